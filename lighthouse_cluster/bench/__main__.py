"""``python -m lighthouse_cluster.bench``: the ``bench`` command group without the main CLI."""

if __name__ == "__main__":  # guarded: multiprocessing's spawn re-imports the main module
    from .cli import main

    main()
