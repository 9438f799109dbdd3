"""``python -m lighthouse_cluster`` is the ``lighthouse-cluster`` command."""

from .cli import main

if __name__ == "__main__":
    main()
