"""The `lighthouse-cluster` command line (click) and its table/record output."""

from lighthouse_cluster.cli.commands import main

__all__ = ["main"]
