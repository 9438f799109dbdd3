"""`lighthouse-cluster up`: a local N-node cluster in the foreground. The shell only: the options
(one ``local.up_plan.UpRequest`` field each, by name), the check before anything starts
(``up_plan.plan_up``: bad input exits 2 with one line), and how the lines reach the terminal
(``_UpOutput``, the session's ``UpView``). The run itself (data and log directories, PKI,
signals, supervision, the startup check, ``--job``'s jobs, the banner, the demo) is
``local.up_session.UpSession``'s."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any, ContextManager, Sequence

import click

from lighthouse_cluster.cli.app import main
from lighthouse_cluster.cli.options import ENV, exit_config_error, lease_flag, liveness_flag, torchft_flags
from lighthouse_cluster.server.config import ConfigError


class _UpOutput:
    """What `up` prints. A closed stdout (`up | head -3`, a dropped SSH session) is not an error
    here: it marks the output broken, which stops `up` like Ctrl-C; later lines go to stderr
    while it still works, else nowhere."""

    def __init__(self, console: Any) -> None:
        import threading

        self.console = console
        self.broken = False
        self._lock = threading.Lock()

    def _guard(self, write: Any) -> None:
        with self._lock:
            if self.broken:
                return
            try:
                write()
            except OSError:  # BrokenPipeError, or EIO from a terminal that went away
                self.broken = True

    def echo(self, text: str) -> None:
        self._guard(lambda: click.echo(text))

    def table(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], record: str) -> None:
        """A table on a terminal, one ``RECORD: key=value ...`` line a row elsewhere (``output.print_table``)."""
        from lighthouse_cluster.cli.output import print_table

        self._guard(lambda: print_table(title, columns, rows, out=self.console, record=record))

    def waiting(self, text: str) -> ContextManager[Any]:
        return self.console.status(text)

    def error(self, text: str) -> None:
        with contextlib.suppress(OSError):
            click.echo(text, err=True)

    def say(self, text: str) -> None:
        """One line, to stdout, or to stderr once stdout is gone."""
        if not self.broken:
            self.echo(text)
        if self.broken:
            try:
                click.echo(text, err=True)
            except OSError:
                pass

    def reader_gone(self) -> bool:
        """Has the reading end of a stdout pipe been closed (`| head` finished)? Seen without
        writing: poll reports POLLERR on the write end of a pipe with no reader."""
        import select
        import stat

        if self.broken:
            return True
        try:
            fd = sys.stdout.fileno()
            mode = os.fstat(fd).st_mode
        except (OSError, ValueError, AttributeError):
            return False
        if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
            return False
        poller = select.poll()
        poller.register(fd, 0)
        if any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0)):
            self.broken = True
        return self.broken

    def silence_stdout(self) -> None:
        """After a broken stdout: point it at /dev/null so the interpreter's final flush does not
        print a BrokenPipeError traceback."""
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass


@main.command()
@click.option("--nodes", type=click.IntRange(1, 9), default=3, show_default=True, help="How many nodes (odd).")
@click.option("--bind", default="[::]:29510", show_default=True, metavar="HOST:PORT",
              help="The first node's client address; the others take the following ports (as torchft_lighthouse: "
                   "[::] is every interface). Port 0 picks free ports for every node (printed).")
@click.option("--http-bind", metavar="HOST[:PORT]",
              help="Where the HTTP ports (/metrics, /readyz, the dashboard) listen: HOST, or HOST:PORT of the first "
                   "node (the others take the following ports; port 0 picks free ones). "
                   "Default: --bind's host, client port + 200.")
@click.option("--raft-port", type=click.IntRange(1, 65535),
              help="The first node's Raft port (default: client port + 100). Raft listens on this host only "
                   "(127.0.0.1 when --bind is a wildcard).")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Keep node data here (default: a temporary directory removed on exit).")
@click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Write the node logs here (default: --data-dir, else a new directory under "
                   "$TMPDIR/lighthouse-cluster-logs/, kept after exit).")
@click.option("--no-restart", is_flag=True,
              help="Leave a node that exits dead (default: restart it, after 0.5 s, doubling up to 10 s while it "
                   "keeps exiting).")
@torchft_flags
@click.option("--tls", "tls", is_flag=True,
              help="Serve every node's client port with TLS (a throw-away CA and certificates in the data dir).")
@click.option("--mtls", is_flag=True, help="Like --tls, and the nodes require client certificates (mutual TLS).")
@click.option("--admin-token", envvar=ENV + "ADMIN_TOKEN",
              help="Admin token of every node (enables the admin commands and the dashboard's kill button).")
@lease_flag
@liveness_flag
@click.option("--job", "jobs", multiple=True, metavar="NAME[=PORT]",
              help="Once the cluster is up, create job NAME (repeat); with =PORT, node i serves it on its own "
                   "client port PORT + i (torchft trainers select the job by it). Without --admin-token, a "
                   "token is generated for the run (its file is printed).")
@click.option("--job-port-processes", is_flag=True,
              help="Serve each job's port from a process of its own (the nodes' --job-port-processes).")
@click.option("--demo", is_flag=True, help="Also run simulated replica groups and SIGKILL the leader every 8 s.")
@click.option("--demo-replicas", type=click.IntRange(1, 1024), default=3, show_default=True)
@click.option("--demo-kill-every", type=click.FloatRange(min=0.5), default=8.0, hidden=True,
              help="Seconds between the demo's leader kills.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
def up(**options: Any) -> None:
    """Run a local N-node cluster on this host in the foreground.

    Ctrl-C, SIGTERM, SIGHUP (a closed terminal) or a closed stdout stops every node; if `up`
    itself is killed, its nodes die with it. A node that exits is restarted (see --no-restart).
    """
    from lighthouse_cluster.cli.output import console
    from lighthouse_cluster.local.cluster import can_bind, free_ports
    from lighthouse_cluster.local.up_plan import UpRequest, plan_up
    from lighthouse_cluster.local.up_session import UpSession

    try:
        plan = plan_up(UpRequest(**options), lambda n, host: free_ports(n, host.strip("[]")), can_bind)
    except ConfigError as e:
        exit_config_error(e)
    # A closed stdout stops up through its own cleanup (the console raises BrokenPipeError).
    sys.exit(UpSession(plan, _UpOutput(console(raise_broken_pipe=True))).run())
