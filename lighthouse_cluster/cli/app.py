"""The ``lighthouse-cluster`` click group: one-line usage errors, the version option. The
commands attach to it from their own modules (``cli/commands.py`` imports them all)."""

from __future__ import annotations

import sys
from typing import Any

import click

from lighthouse_cluster import __version__


class OneLineErrors(click.Group):
    """Usage errors as one line on stderr, exit 2 (``error: COMMAND: what is wrong (see --help)``),
    instead of click's usage block."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as e:
            command = e.ctx.command_path if e.ctx is not None else "lighthouse-cluster"
            click.echo(f"error: {command}: {e.format_message()} (see {command} --help)", err=True)
            sys.exit(e.exit_code)
        except click.ClickException as e:
            click.echo(f"error: {e.format_message()}", err=True)
            sys.exit(e.exit_code)
        except click.Abort:
            click.echo("aborted", err=True)
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="lighthouse-cluster")
def main() -> None:
    """Highly-available lighthouse for torchft: Raft-replicated quorums on 3 or 5 nodes."""
