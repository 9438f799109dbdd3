"""`lighthouse-cluster bench`: hands over to a source checkout's benchmarks."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from lighthouse_cluster.cli.app import main


# -- bench -----------------------------------------------------------------------------------------
# The benchmarks are not part of the runtime: they are the top-level ``benchmarks`` package of a
# source checkout (``python -m benchmarks``) and need the ``bench`` extra (torch, torchft, numpy,
# matplotlib, py-spy). This command only hands over to them when both are there.

BENCH_HINT = "the benchmarks run from a source checkout: pip install -e '.[bench]', then python -m benchmarks run"


def _benchmarks_cli() -> tuple[click.Command | None, str]:
    """The ``bench`` click group of the checkout this package runs from, or None and why not.
    ``benchmarks`` is imported here, when the command runs, never when the CLI loads."""
    import importlib

    checkout = Path(__file__).resolve().parents[2]
    if not (checkout / "benchmarks" / "__init__.py").is_file() or not (checkout / "pyproject.toml").is_file():
        return None, "not a source checkout"
    if str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    try:
        benchmarks = importlib.import_module("benchmarks")
    except ModuleNotFoundError as e:
        if e.name != "benchmarks":
            raise
        return None, "cannot import benchmarks"
    if Path(benchmarks.__file__).resolve().parent != checkout / "benchmarks":
        return None, f"'benchmarks' is {benchmarks.__file__}, not this checkout's"
    missing = benchmarks.missing_modules()
    if missing:
        return None, f"{', '.join(missing)} not installed"
    # A failure from here on is a bug in the benchmarks, not a missing extra: it is not caught.
    return importlib.import_module("benchmarks.cli").bench, ""


@main.command(context_settings={"ignore_unknown_options": True}, add_help_option=False,
              short_help="The benchmarks (python -m benchmarks in a source checkout).")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(args: tuple[str, ...]) -> None:
    """Hand over to a source checkout's benchmarks (python -m benchmarks), or say what to install."""
    group, problem = _benchmarks_cli()
    if group is None:
        click.echo(f"error: lighthouse-cluster bench: {problem}; {BENCH_HINT}", err=True)
        sys.exit(2)
    group.main(list(args), prog_name="lighthouse-cluster bench")
