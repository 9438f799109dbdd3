"""``python -m benchmarks`` (from the repository root): the ``bench`` command group."""

if __name__ == "__main__":  # guarded: multiprocessing's spawn re-imports the main module
    from benchmarks.cli import main

    main()
