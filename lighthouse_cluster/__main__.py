"""``python -m lighthouse_cluster`` is the ``lighthouse-cluster`` command."""

from lighthouse_cluster.cli.commands import main

if __name__ == "__main__":
    main()
