"""The `lighthouse-cluster` command: serve a node, run a local cluster, show cluster status.

A thin shell: options are parsed here (flags > environment variables > ``--config`` TOML file >
defaults) and handed to ``config``, ``node``, ``local_cluster`` and ``cluster_view``. Every
failure a user can cause ends with exit status 2 (bad input) or 1 (cluster problem) and a
one-line reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

import click

from lighthouse_cluster import __version__
from lighthouse_cluster.core.codec import SCHEMA_VERSION
from lighthouse_cluster.core.lease import DEFAULT_LEASE_MS
from lighthouse_cluster.durable_files import make_directory_durably, write_durably
from lighthouse_cluster.server.config import (
    DEFAULT_JOB_PORT_PROCESS_NICE,
    DEFAULT_LIVENESS_TIMEOUT_MS,
    DEFAULT_QUIESCE_AFTER_MS,
    MAX_JOB_PORT_PROCESS_NICE,
    MAX_LEASE_MS,
    MAX_LIVENESS_TIMEOUT_MS,
    MIN_LIVENESS_TIMEOUT_MS,
    ConfigError,
    build_node_config,
    split_endpoints,
)
from lighthouse_cluster.server.event_loop import DEFAULT_LOOP, LOOPS
from lighthouse_cluster.server.event_loop import run as run_event_loop
from lighthouse_cluster.server.gc_thresholds import use_serving_thresholds

ENV = "LIGHTHOUSE_CLUSTER_"
# Where `serve --config` leaves the file's [[jobs]] tables (click's context meta).
DECLARED_JOBS = "lighthouse_cluster.declared_jobs"
# gRPC core logs a failed TLS handshake at INFO on stderr; the commands say what failed in one line.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


def _load_config_file(ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    if not value:
        return value
    try:
        with open(value, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise click.BadParameter(f"cannot read {value}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise click.BadParameter(f"{value} is not valid TOML: {e}") from None
    # [[jobs]] tables are no option: serve reads them from here (``DECLARED_JOBS``).
    ctx.meta[DECLARED_JOBS] = data.pop("jobs", None)
    defaults: dict[str, Any] = {}
    for key, v in data.items():
        name = key.replace("-", "_")
        if name == "peer":
            name = "peers"
        defaults[name] = v
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


def torchft_flags(f: Any) -> Any:
    """torchft_lighthouse's own flags, same names, meaning and defaults."""
    f = click.option("--heartbeat_timeout_ms", "--heartbeat-timeout-ms", "heartbeat_timeout_ms", type=click.IntRange(min=1),
                     default=5000, show_default=True, envvar=ENV + "HEARTBEAT_TIMEOUT_MS",
                     help="A replica whose last heartbeat is older is unhealthy.")(f)
    f = click.option("--quorum_tick_ms", "--quorum-tick-ms", "quorum_tick_ms", type=click.IntRange(min=1), default=100,
                     show_default=True, envvar=ENV + "QUORUM_TICK_MS",
                     help="How often the leader re-evaluates the pending quorum.")(f)
    f = click.option("--join_timeout_ms", "--join-timeout-ms", "join_timeout_ms", type=click.IntRange(min=1), default=60000,
                     show_default=True, envvar=ENV + "JOIN_TIMEOUT_MS",
                     help="How long to wait for heartbeating replicas that have not asked for the quorum.")(f)
    f = click.option("--min_replicas", "--min-replicas", "min_replicas", type=click.IntRange(min=1), required=True,
                     envvar=ENV + "MIN_REPLICAS", help="Fewest replica groups a new quorum may have.")(f)
    return f


def lease_flag(f: Any) -> Any:
    return click.option(
        "--quorum-lease-ms", "quorum_lease_ms", type=click.IntRange(0, MAX_LEASE_MS), default=None,
        show_default=f"{DEFAULT_LEASE_MS}, at most the election timeout",
        envvar=ENV + "QUORUM_LEASE_MS",
        help="Leader lease for fast quorums: issued without a Raft commit while a majority confirmed "
             "the leader within it; a new leader waits out what of it exceeds the election timeout "
             "before serving. Assumes node clock rates differ by less than 2x. 0 commits every round.")(f)


def liveness_flag(f: Any) -> Any:
    return click.option(
        "--liveness-timeout-ms", "liveness_timeout_ms",
        type=click.IntRange(MIN_LIVENESS_TIMEOUT_MS, MAX_LIVENESS_TIMEOUT_MS), default=DEFAULT_LIVENESS_TIMEOUT_MS,
        show_default=True, envvar=ENV + "LIVENESS_TIMEOUT_MS",
        help="A replica group whose liveness stream (ftclient's Watch) sent no keep-alive for this long is "
             "declared dead and left out of the next quorum at once (a closed stream is a death at once). "
             "A false death costs one quorum change. torchft trainers are unaffected (heartbeat timeout).")(f)


def manager_watch_flag(f: Any) -> Any:
    return click.option(
        "--watch-manager-connections/--no-watch-manager-connections", "watch_manager_connections", default=True,
        show_default=True, envvar=ENV + "WATCH_MANAGER_CONNECTIONS",
        help="The leader keeps an idle connection to each running quorum member's manager server; when it "
             "closes and a new one is refused (the trainer process died), the member is declared dead at "
             "once instead of after its heartbeat timeout. Nothing changes for the trainers.")(f)


def _exit_config_error(e: ConfigError) -> None:
    click.echo(f"error: {e}", err=True)
    sys.exit(2)


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


# -- serve -----------------------------------------------------------------------------------------


@main.command()
@click.option("--config", type=click.Path(dir_okay=False), is_eager=True, expose_value=False,
              callback=_load_config_file, envvar=ENV + "CONFIG",
              help="TOML file whose keys are these options' names (peers = [...] for --peer), and "
                   "[[jobs]] tables declaring jobs (name, port or ports, settings, [jobs.config]) that the "
                   "leader creates when the cluster does not have them yet.")
@click.option("--node-id", required=True, envvar=ENV + "NODE_ID", help="This node's id; must be one of the peers.")
@click.option("--peer", "peers", multiple=True, envvar=ENV + "PEERS", metavar="ID=RAFT_HOST:PORT,CLIENT_HOST:PORT",
              help="Every node of the cluster, this one included (repeat; env: space-separated).")
@click.option("--client-bind", envvar=ENV + "CLIENT_BIND", metavar="HOST:PORT",
              help="Where to serve gRPC (torchft.LighthouseService + cluster service). "
                   "Default: [::] and this node's client port.")
@click.option("--raft-bind", envvar=ENV + "RAFT_BIND", metavar="HOST:PORT",
              help="Where to listen for Raft peers. Default: every interface (0.0.0.0, or :: for an IPv6 "
                   "Raft address) on this node's Raft port.")
@click.option("--raft-dial", "raft_dial", multiple=True, envvar=ENV + "RAFT_DIAL", metavar="ID=HOST:PORT",
              help="Reach peer ID's Raft port at HOST:PORT instead of its Raft address (NAT, port forwarding, "
                   "a proxy); its identity stays its Raft address (repeat; env: space-separated).")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), envvar=ENV + "DATA_DIR",
              help="Raft journal and snapshots; without it the node keeps no state across restarts.")
@click.option("--secret", envvar=ENV + "SECRET", help="Cluster secret encrypting the Raft port (prefer the env var).")
@click.option("--secret-file", type=click.Path(dir_okay=False, path_type=Path), envvar=ENV + "SECRET_FILE",
              help="Read the cluster secret from this file.")
@click.option("--insecure", is_flag=True, envvar=ENV + "INSECURE",
              help="Run the Raft port without a secret (trusted networks only).")
@click.option("--http-bind", envvar=ENV + "HTTP_BIND", metavar="HOST:PORT",
              help="Serve /metrics, /livez, /readyz and the dashboard (/) over HTTP here. Default: off.")
@click.option("--admin-token", envvar=ENV + "ADMIN_TOKEN",
              help="Bearer token required by the admin commands (jobs add/set/remove, members add/remove, "
                   "transfer-leader, snapshot) "
                   "and the dashboard's kill button (prefer the env var). Default: all of those refused.")
@click.option("--tls-cert", envvar=ENV + "TLS_CERT", type=click.Path(dir_okay=False), metavar="PEM",
              help="Serve the client (gRPC) port with TLS: this node's certificate chain. Needs --tls-key.")
@click.option("--tls-key", envvar=ENV + "TLS_KEY", type=click.Path(dir_okay=False), metavar="PEM",
              help="The private key of --tls-cert.")
@click.option("--tls-client-ca", envvar=ENV + "TLS_CLIENT_CA", type=click.Path(dir_okay=False), metavar="PEM",
              help="Require client certificates signed by this CA (mutual TLS); peers are dialed with --tls-cert.")
@click.option("--tls-ca", envvar=ENV + "TLS_CA", type=click.Path(dir_okay=False), metavar="PEM",
              help="CA that signs the peers' certificates, for node-to-node calls "
                   "(default: --tls-client-ca, else the system's roots).")
@click.option("--join", is_flag=True, envvar=ENV + "JOIN",
              help="This node joins a running cluster: --peer lists the current members and this node, which an "
                   "admin then adds with `lighthouse-cluster members add` (allows an even number of peers).")
@torchft_flags
@click.option("--election-timeout-ms", type=int, envvar=ENV + "ELECTION_TIMEOUT_MS",
              help="Raft election timeout lower bound (default 150; upper bound is three times it).")
@click.option("--quiesce-after-ms", type=int, default=DEFAULT_QUIESCE_AFTER_MS, show_default=True,
              envvar=ENV + "QUIESCE_AFTER_MS",
              help="With no client call for this long, the Raft leader heartbeats every 200 ms instead of 37.5 ms "
                   "(an idle node's CPU; the first client call wakes it). 0: never.")
@lease_flag
@liveness_flag
@manager_watch_flag
@click.option("--auto-create-jobs/--no-auto-create-jobs", "auto_create_jobs", default=False, show_default=True,
              envvar=ENV + "AUTO_CREATE_JOBS",
              help="The leader creates a job nobody added on its first use (a Quorum call, heartbeat or Watch "
                   "naming it) with the settings `jobs add` would give it. Off: such calls fail NOT_FOUND.")
@click.option("--job-port-processes/--no-job-port-processes", "job_port_processes", default=False,
              show_default=True, envvar=ENV + "JOB_PORT_PROCESSES",
              help="Serve each job's own client port from a process of its own, which forwards the job's calls to "
                   "the leader as a follower does: a job's load then stays off this node's event loop, which "
                   "other jobs' rounds share (one Python process more per job port).")
@click.option("--job-port-process-nice", "job_port_process_nice", type=int, default=DEFAULT_JOB_PORT_PROCESS_NICE,
              show_default=True, envvar=ENV + "JOB_PORT_PROCESS_NICE",
              help=f"With --job-port-processes: the port processes run this many steps of CPU priority (nice) "
                   f"below the node, so where they share cores the node's Raft and rounds go first. "
                   f"0-{MAX_JOB_PORT_PROCESS_NICE}; 0: the node's priority.")
@click.option("--event-loop", type=click.Choice(LOOPS), default=DEFAULT_LOOP, show_default=True,
              envvar=ENV + "EVENT_LOOP", help="asyncio event loop of the node (uvloop: faster; asyncio: the standard one).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              envvar=ENV + "LOG_LEVEL", show_default=True)
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text", envvar=ENV + "LOG_FORMAT",
              show_default=True)
@click.option("--unsafe-no-fsync", "unsafe_no_fsync", is_flag=True, envvar=ENV + "UNSAFE_NO_FSYNC",
              help="UNSAFE, for tests and benchmarks only: never fsync the Raft journal, term, vote and snapshots. "
                   "A process crash still loses nothing; a power loss or machine crash can lose quorums this node "
                   "acknowledged (with two of three nodes: committed ones). The node logs a warning and "
                   "`lighthouse-cluster status` shows it.")
@click.option("--schema-version", type=int, default=SCHEMA_VERSION, hidden=True,
              help="Write and report at most this replicated schema version: act as an older version "
                   "(rolling-upgrade tests).")
@click.pass_context
def serve(ctx: click.Context, node_id: str, peers: tuple[str, ...], client_bind: str | None, raft_bind: str | None,
          raft_dial: tuple[str, ...], data_dir: Path | None, secret: str | None, secret_file: Path | None,
          insecure: bool, http_bind: str | None, admin_token: str | None, tls_cert: str | None, tls_key: str | None,
          tls_client_ca: str | None, tls_ca: str | None, join: bool, min_replicas: int, join_timeout_ms: int,
          quorum_tick_ms: int, heartbeat_timeout_ms: int, election_timeout_ms: int | None, quiesce_after_ms: int,
          quorum_lease_ms: int | None, liveness_timeout_ms: int, watch_manager_connections: bool, auto_create_jobs: bool,
          job_port_processes: bool, job_port_process_nice: int, event_loop: str, log_level: str, log_format: str,
          unsafe_no_fsync: bool, schema_version: int) -> None:
    """Run one lighthouse node in the foreground (SIGTERM hands leadership over, then exits)."""
    from lighthouse_cluster.local.supervise import die_with_parent_from_env
    from lighthouse_cluster.server.logs import configure_logging
    from lighthouse_cluster.server.open_files import raise_open_file_limit

    die_with_parent_from_env()  # a node of `up`: dies with it (no-op unless `up` asked for it)

    if secret_file is not None:
        try:
            secret = secret_file.read_text().strip()
        except OSError as e:
            _exit_config_error(ConfigError(f"cannot read --secret-file {secret_file}: {e.strerror}"))
    if isinstance(peers, str):  # from a config file or env as one string
        peers = tuple(peers.split())
    if isinstance(raft_dial, str):
        raft_dial = tuple(raft_dial.split())
    try:
        config = build_node_config(
            node_id=node_id, peers=list(peers), client_bind=client_bind, raft_bind=raft_bind, data_dir=data_dir,
            secret=secret, insecure=insecure, min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
            quorum_tick_ms=quorum_tick_ms, heartbeat_timeout_ms=heartbeat_timeout_ms,
            election_timeout_ms=election_timeout_ms, raft_dial=list(raft_dial), http_bind=http_bind,
            admin_token=admin_token, tls_cert=tls_cert, tls_key=tls_key, tls_client_ca=tls_client_ca, tls_ca=tls_ca,
            join=join, quorum_lease_ms=quorum_lease_ms, schema_version=schema_version,
            liveness_timeout_ms=liveness_timeout_ms, watch_manager_connections=watch_manager_connections,
            jobs=ctx.meta.get(DECLARED_JOBS), auto_create_jobs=auto_create_jobs, quiesce_after_ms=quiesce_after_ms,
            job_port_processes=job_port_processes, job_port_process_nice=job_port_process_nice,
            unsafe_no_fsync=unsafe_no_fsync)
    except ConfigError as e:
        _exit_config_error(e)
    configure_logging(log_level, log_format, node_id)
    raise_open_file_limit()  # before any socket: trainers' connections, Raft, the journal
    use_serving_thresholds()
    try:
        run_event_loop(_serve(config), event_loop)
    except OSError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)


async def _serve(config: Any) -> None:
    from lighthouse_cluster.server.node import LighthouseNode

    node = LighthouseNode(config)
    await node.start()
    node.install_signal_handlers()
    await node.wait_closed()


# -- up --------------------------------------------------------------------------------------------


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

    def print(self, *args: Any, **kwargs: Any) -> None:
        self._guard(lambda: self.console.print(*args, **kwargs))

    def print_with(self, write: Any) -> None:
        """``write(console)`` under the same guard (several lines, e.g. ``output.print_table``)."""
        self._guard(lambda: write(self.console))

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


def _kept_log_dir() -> Path:
    """Where a temporary cluster's node logs go: kept after `up` exits, one directory per run."""
    base = Path(tempfile.gettempdir()) / "lighthouse-cluster-logs"
    base.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=base))


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
def up(nodes: int, bind: str, http_bind: str | None, raft_port: int | None, data_dir: Path | None,
       log_dir: Path | None, no_restart: bool, min_replicas: int, join_timeout_ms: int, quorum_tick_ms: int,
       heartbeat_timeout_ms: int, tls: bool, mtls: bool, admin_token: str | None, quorum_lease_ms: int | None,
       liveness_timeout_ms: int, jobs: tuple[str, ...], job_port_processes: bool, demo: bool, demo_replicas: int,
       demo_kill_every: float, log_level: str) -> None:
    """Run a local N-node cluster on this host in the foreground.

    Ctrl-C, SIGTERM, SIGHUP (a closed terminal) or a closed stdout stops every node; if `up`
    itself is killed, its nodes die with it. A node that exits is restarted (see --no-restart).
    """
    import threading

    from lighthouse_cluster.cli.output import console as output_console
    from lighthouse_cluster.local.cluster import LocalCluster, can_bind, free_ports
    from lighthouse_cluster.local.supervise import Guardian, NodeSupervisor
    from lighthouse_cluster.core.restarts import describe_exit
    from lighthouse_cluster.local.up_plan import plan_addresses, plan_jobs

    console = output_console(raise_broken_pipe=True)  # a closed stdout stops up through its own cleanup
    if nodes % 2 == 0:
        _exit_config_error(ConfigError(f"--nodes {nodes}: use an odd number so a majority survives a split"))
    if demo and (tls or mtls):
        _exit_config_error(ConfigError("--demo's simulated replica groups speak plaintext: drop --tls/--mtls"))
    try:
        plan = plan_addresses(nodes, bind, http_bind, raft_port, lambda n, host: free_ports(n, host.strip("[]")))
        up_jobs = plan_jobs(jobs, nodes, [p for _kind, _host, p in plan.every_port()])
    except ConfigError as e:
        _exit_config_error(e)
    job_ports = [("job", plan.client.bind_host, p) for j in up_jobs for _node, p in j.ports(
        [f"n{i + 1}" for i in range(nodes)])]
    busy = [f"{p} ({kind} on {host})" for kind, host, p in plan.every_port() + job_ports if not can_bind(host, p)]
    if busy:
        _exit_config_error(ConfigError(f"ports already in use: {', '.join(busy)} "
                                       "(pick another --bind, or HOST:0 for free ports)"))
    temporary = data_dir is None
    out = _UpOutput(console)
    root = data_dir or Path(tempfile.mkdtemp(prefix="lighthouse-cluster-"))
    logs = log_dir or (data_dir if data_dir is not None else _kept_log_dir())
    out.echo(f"logs: {logs}")
    guardian = Guardian(remove=root if temporary else None)
    token_file: Path | None = None
    if up_jobs and not admin_token:  # creating jobs needs one: this run's own, in a file only its user reads
        import secrets

        admin_token = secrets.token_urlsafe(24)
        token_file = root / "admin-token"
        make_directory_durably(root)  # a --data-dir that does not exist yet
        write_durably(token_file, (admin_token + "\n").encode(), mode=0o600)
    reach = plan.client.reach_host
    pki = None
    if tls or mtls:
        from lighthouse_cluster.tls import generate_pki

        pki = generate_pki(root / "tls", hosts=sorted({reach.strip("[]"), "127.0.0.1", "localhost", "::1"}))
    cluster = LocalCluster(root=root, nodes=nodes, host=reach, client_ports=list(plan.client.ports),
                           raft_ports=list(plan.raft.ports), min_replicas=min_replicas,
                           join_timeout_ms=join_timeout_ms, quorum_tick_ms=quorum_tick_ms,
                           heartbeat_timeout_ms=heartbeat_timeout_ms, log_level=log_level,
                           client_bind_host=plan.client.bind_host, http_ports=list(plan.http.ports),
                           pki=pki, mutual_tls=mtls, admin_token=admin_token, quorum_lease_ms=quorum_lease_ms,
                           liveness_timeout_ms=liveness_timeout_ms, log_dir=logs, raft_bind_host=plan.raft.bind_host,
                           http_bind_host=plan.http.bind_host,
                           http_host=plan.http.reach_host, die_with_parent=True,
                           extra_args=["--job-port-processes"] if job_port_processes else [])
    # Nodes are started only from this (the main) thread: their parent-death signal is tied to it.
    supervisor = NodeSupervisor(cluster, say=out.say, restart=not no_restart, guardian=guardian)
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)

    def startup_check() -> None:
        exited = supervisor.exited()
        if exited:
            i, code = exited[0]
            raise RuntimeError(f"{cluster.members[i].peer.node_id} exited with {describe_exit(code)} while the "
                               f"cluster started\n{cluster.tail_logs()}")

    demo_thread: threading.Thread | None = None
    code = 0
    try:
        supervisor.start_all()
        with console.status(f"starting {nodes} nodes, waiting for a leader every node follows ..."):
            leader, term = cluster.wait_for_stable_leader(timeout=30, stable_for=0.5, should_stop=stop.is_set,
                                                         on_poll=startup_check)
        for up_job in up_jobs:
            _create_up_job(cluster, up_job, admin_token)
        if plan.picked:
            flag = f"--bind {bind}" if bind.strip().endswith(":0") else f"--http-bind {http_bind}"
            out.echo(f"{flag}: chose client ports {','.join(map(str, plan.client.ports))}, "
                     f"raft ports {','.join(map(str, plan.raft.ports))}, "
                     f"http ports {','.join(map(str, plan.http.ports))}")
        _print_endpoints(out, cluster, plan, leader, term, root, temporary, logs, up_jobs, token_file)
        if demo:
            from lighthouse_cluster.local.demo import run_demo

            def demo_main() -> None:
                try:
                    run_demo(cluster, replicas=demo_replicas, kill_every_s=demo_kill_every, should_stop=stop.is_set,
                             say=out.say)
                except Exception as e:  # the cluster keeps running; say why the demo ended
                    out.say(f"demo stopped: {type(e).__name__}: {e}")

            demo_thread = threading.Thread(target=demo_main, name="demo", daemon=True)
            demo_thread.start()
        while not stop.wait(0.1):
            supervisor.tick()
            if out.reader_gone():
                break
    except InterruptedError:
        pass
    except (TimeoutError, RuntimeError) as e:
        with contextlib.suppress(OSError):
            click.echo(f"error: {e}", err=True)
        code = 1
    finally:
        stop.set()
        if demo_thread is not None:
            demo_thread.join(timeout=15)
        out.say("stopping nodes ...")
        supervisor.stop_all(graceful=code == 0)
        if temporary:
            shutil.rmtree(root, ignore_errors=True)
        guardian.close()
        out.say(f"node logs kept in {logs}")
        if out.broken:
            out.silence_stdout()
    sys.exit(code)


def _create_up_job(cluster: Any, job: Any, admin_token: str | None) -> None:
    """Create ``up --job``'s job (an ``up_plan.UpJob``) through the leader; a job of that name kept
    in --data-dir from an earlier run gets the ports asked for now. RuntimeError when refused."""
    import grpc

    from lighthouse_cluster.client.admin_client import AdminCallError, AdminClient
    from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb

    ports = [cpb.JobPort(node_id=node, port=port) for node, port in job.ports([m.peer.node_id for m in cluster.members])]
    client = AdminClient(cluster.client_addresses, tls=cluster.client_tls, token=admin_token, timeout=10.0)
    try:
        try:
            client.call("AddJob", cpb.AddJobRequest(name=job.name, ports=ports))
        except AdminCallError as e:
            if e.code != grpc.StatusCode.ALREADY_EXISTS:
                raise
            client.call("SetJob", cpb.SetJobRequest(name=job.name, set_ports=True, ports=ports))
    except AdminCallError as e:
        raise RuntimeError(f"--job {job.name}: cannot create the job: {e}") from None


def _print_endpoints(out: _UpOutput, cluster: Any, plan: Any, leader: int, term: int, root: Path, temporary: bool,
                     logs: Path, up_jobs: Any = (), token_file: Path | None = None) -> None:
    from lighthouse_cluster.cli.output import print_table
    from lighthouse_cluster.local.up_plan import job_banner

    rows = []
    for i, m in enumerate(cluster.members):
        http = cluster.http_address(i)
        rows.append((m.peer.node_id, "leader" if i == leader else "follower", m.peer.client_address,
                     m.peer.raft_address, f"http://{http}" if http else "-"))
    # A terminal gets a table; a log file or pipe one "node: id=n1 role=... client=..." line each.
    out.print_with(lambda console: print_table("lighthouse-cluster is up", ("id", "role", "client", "raft", "http"),
                                               rows, out=console, record="node"))
    # Plain echo: these lines are meant to be copied, so they must not be wrapped.
    out.echo(f"leader: {cluster.members[leader].peer.node_id} (term {term}), followed by every node")
    out.echo("listening: " + ", ".join(_listening(kind, ls) for kind, ls in
                                       (("client", plan.client), ("raft", plan.raft), ("http", plan.http))))
    out.echo(f"data: {root}{' (removed on exit)' if temporary else ''}")
    out.echo(f"logs: {logs}/{{{','.join(m.peer.node_id for m in cluster.members)}}}.log (kept after exit)")
    if cluster.pki is not None:
        out.echo("TLS clients (status, admin commands, ftclient):")
        out.echo(f"  export LIGHTHOUSE_CLUSTER_TLS_CA={cluster.pki.ca_cert}")
        if cluster.mutual_tls:
            out.echo(f"  export LIGHTHOUSE_CLUSTER_TLS_CLIENT_CERT={cluster.pki.client_cert}")
            out.echo(f"  export LIGHTHOUSE_CLUSTER_TLS_CLIENT_KEY={cluster.pki.client_key}")
    if cluster.pki is None:
        out.echo("torchft trainers: exactly ONE URL, any node (torchft hangs on a list; for HA see")
        out.echo("deploy/README.md, 'One name for every node'):")
        out.echo(f"  export TORCHFT_LIGHTHOUSE=http://{cluster.client_addresses[0]}")
    out.echo("ftclient trainers and the lighthouse-cluster commands take the list of every node:")
    out.echo(f"  export TORCHFT_LIGHTHOUSE={cluster.endpoints}")
    out.echo(f"  lighthouse-cluster status --endpoints {cluster.endpoints}")
    for up_job in up_jobs:
        for line in job_banner(up_job, [m.peer.node_id for m in cluster.members], plan.client.reach_host,
                               cluster.endpoints, cluster.pki is not None):
            out.echo(line)
    if token_file is not None:
        out.echo("the admin token of this run (jobs add/set/remove, members, snapshot):")
        out.echo(f"  export LIGHTHOUSE_CLUSTER_ADMIN_TOKEN=$(cat {token_file})")
    out.echo("Ctrl-C stops every node.")


def _listening(kind: str, ls: Any) -> str:
    """``client on [::] (every interface; reached here at 127.0.0.1)``: what the ports bind."""
    where = ls.describe()
    if ls.reach_host != ls.bind_host:
        where = where[:-1] + f"; reached here at {ls.reach_host})" if where.endswith(")") else \
            f"{where} (reached here at {ls.reach_host})"
    return f"{kind} on {where}"


# -- client options (status and the admin commands) -------------------------------------------------


def client_options(f: Any, timeout: float = 5.0) -> Any:
    """Where the nodes are and how to dial them; shared by status and every admin command."""
    f = click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=timeout, show_default=True,
                     help="Seconds to wait for each call.")(f)
    f = click.option("--output", "-o", type=click.Choice(["table", "json"]), default="table", show_default=True)(f)
    f = click.option("--tls-client-key", envvar=ENV + "TLS_CLIENT_KEY", type=click.Path(dir_okay=False),
                     metavar="PEM", help="Key of --tls-client-cert.")(f)
    f = click.option("--tls-client-cert", envvar=ENV + "TLS_CLIENT_CERT", type=click.Path(dir_okay=False),
                     metavar="PEM", help="Client certificate, for nodes that require one (mutual TLS).")(f)
    f = click.option("--tls-ca", envvar=ENV + "TLS_CA", type=click.Path(dir_okay=False), metavar="PEM",
                     help="Dial the nodes with TLS, trusting this CA (https:// or grpcs:// endpoints alone "
                          "use the system's roots).")(f)
    f = click.option("--endpoints", envvar=[ENV + "ENDPOINTS", "TORCHFT_LIGHTHOUSE"], metavar="URL[,URL...]",
                     help="Client addresses of the nodes; any one is enough "
                          "(env: LIGHTHOUSE_CLUSTER_ENDPOINTS or TORCHFT_LIGHTHOUSE).")(f)
    return f


def admin_token_option(f: Any) -> Any:
    return click.option("--admin-token", envvar=ENV + "ADMIN_TOKEN", metavar="TOKEN",
                        help="The cluster's admin token (prefer the env var LIGHTHOUSE_CLUSTER_ADMIN_TOKEN).")(f)


def _client_settings(endpoints: str | None, tls_ca: str | None, tls_client_cert: str | None,
                     tls_client_key: str | None) -> tuple[list[str], Any]:
    from lighthouse_cluster.tls import TLSConfigError, client_tls_for

    if not endpoints:
        _exit_config_error(ConfigError("no endpoints: pass --endpoints URL[,URL...], or set LIGHTHOUSE_CLUSTER_ENDPOINTS "
                                       "(or TORCHFT_LIGHTHOUSE)"))
    try:
        addresses = split_endpoints(endpoints)
        tls = client_tls_for(endpoints, tls_ca, tls_client_cert, tls_client_key, env={})
    except (ConfigError, TLSConfigError) as e:
        _exit_config_error(ConfigError(str(e)))
    return addresses, tls


def _admin_client(endpoints: str | None, tls_ca: str | None, tls_client_cert: str | None,
                  tls_client_key: str | None, timeout: float, admin_token: str | None = None) -> Any:
    from lighthouse_cluster.client.admin_client import AdminClient

    addresses, tls = _client_settings(endpoints, tls_ca, tls_client_cert, tls_client_key)
    return AdminClient(addresses, tls=tls, token=admin_token, timeout=timeout)


def _admin_call(fn: Any) -> Any:
    """Run ``fn()``; an AdminCallError becomes one line on stderr and exit status 1."""
    from lighthouse_cluster.client.admin_client import AdminCallError

    try:
        return fn()
    except AdminCallError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)


def _need_token(admin_token: str | None) -> None:
    if not admin_token:
        _exit_config_error(ConfigError("no admin token: set LIGHTHOUSE_CLUSTER_ADMIN_TOKEN or pass --admin-token"))


# -- status ----------------------------------------------------------------------------------------


@main.command()
@lambda f: client_options(f, timeout=2.0)
def status(endpoints: str | None, tls_ca: str | None, tls_client_cert: str | None, tls_client_key: str | None,
           output: str, timeout: float) -> None:
    """Show nodes, leader, current quorum, heartbeats and jobs; exit 1 when no leader is known."""
    from lighthouse_cluster.cli.status_tables import render
    from lighthouse_cluster.client.cluster_view import build_view, collect, collect_jobs, to_json

    addresses, tls = _client_settings(endpoints, tls_ca, tls_client_cert, tls_client_key)
    reasons: dict[str, str] = {}
    answers = collect(addresses, timeout, tls, reasons)
    if all(st is None for _, st in answers):
        message = "no node answered: " + "; ".join(reasons.get(a, a) for a in addresses)
        if output == "json":
            click.echo(json.dumps({"leader": None, "nodes": [], "quorum": None, "error": message}))
        click.echo(f"error: {message}", err=True)
        sys.exit(1)
    view = build_view(answers)
    if not view.jobs:  # the leader's Status does not list them (an older node): ask for them
        asked = [endpoint for endpoint, st in answers
                 if st is not None and (view.leader is None or st.node.id == view.leader)]
        view.jobs = next((jobs for jobs in (collect_jobs(a, timeout, tls) for a in asked) if jobs is not None), [])
    if output == "json":
        click.echo(json.dumps(to_json(view), indent=2))
    else:
        from lighthouse_cluster.cli.output import console

        render(view, console())
    if view.leader is None:
        click.echo("error: no leader is known (election in progress or no majority reachable)", err=True)
        sys.exit(1)


# -- health ----------------------------------------------------------------------------------------


@main.command()
@lambda f: client_options(f, timeout=2.0)
@click.option("--max-lag", type=int, default=100, show_default=True,
              help="Most log entries a node may be behind the leader's commit index and count as healthy.")
def health(endpoints: str | None, tls_ca: str | None, tls_client_cert: str | None, tls_client_key: str | None,
           output: str, timeout: float, max_lag: int) -> None:
    """Per-node liveness, readiness, leader and lag; exit 0 only when the whole cluster is healthy."""
    from lighthouse_cluster.cli.status_tables import render_health
    from lighthouse_cluster.client.cluster_view import build_health, collect, health_to_json

    addresses, tls = _client_settings(endpoints, tls_ca, tls_client_cert, tls_client_key)
    reasons: dict[str, str] = {}
    answers = collect(addresses, timeout, tls, reasons)
    if all(st is None for _, st in answers) and output != "json":
        click.echo("error: no node answered: " + "; ".join(reasons.get(a, a) for a in addresses), err=True)
        sys.exit(1)
    h = build_health(answers, max_lag)
    if output == "json":
        click.echo(json.dumps(health_to_json(h), indent=2))
    else:
        from lighthouse_cluster.cli.output import console

        render_health(h, console())
    if not h.healthy:
        click.echo(f"error: cluster unhealthy: {h.problems[0]}", err=True)
        sys.exit(1)


# -- members ---------------------------------------------------------------------------------------


def _print_members(r: Any, output: str, title: str = "members") -> None:
    data = {"leader": r.leader_id or None, "term": r.term, "version": r.version,
            "members": [{"id": m.id, "raft_address": m.raft_address, "client_address": m.client_address,
                         "leader": m.id == r.leader_id, "connected": m.id == r.leader_id or m.id in r.connected}
                        for m in r.members]}
    if output == "json":
        click.echo(json.dumps(data, indent=2))
        return
    from lighthouse_cluster.cli.output import Cell, print_table

    print_table(f"{title} (table version {r.version}{', from --peer' if not r.version else ''})",
                ("id", "raft address", "client address", "role", "connected"),
                [(m["id"], m["raft_address"], m["client_address"],
                  Cell("leader", "bold green") if m["leader"] else "follower",
                  "yes" if m["connected"] else Cell("no", "red")) for m in data["members"]], record="member")


@main.group()
def members() -> None:
    """List, add and remove cluster members (runtime membership change)."""


@members.command("list")
@client_options
def members_list(endpoints: str | None, tls_ca: str | None, tls_client_cert: str | None,
                 tls_client_key: str | None, output: str, timeout: float) -> None:
    """The members as the leader sees them (any node answers when no leader is known)."""
    from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb

    client = _admin_client(endpoints, tls_ca, tls_client_cert, tls_client_key, timeout)

    def ask() -> Any:
        from lighthouse_cluster.client.admin_client import AdminCallError

        try:
            return client.call("ListMembers", cpb.MembersRequest(), at=client.leader()[0])
        except AdminCallError:  # no leader known (or it just went away): any node's view
            return client.any_node("ListMembers", cpb.MembersRequest())

    _print_members(_admin_call(ask), output)


@members.command("add")
@click.argument("node_id")
@click.argument("raft_addr")
@click.argument("client_addr")
@client_options
@admin_token_option
def members_add(node_id: str, raft_addr: str, client_addr: str, endpoints: str | None, tls_ca: str | None,
                tls_client_cert: str | None, tls_client_key: str | None, output: str, timeout: float,
                admin_token: str | None) -> None:
    """Add NODE_ID (already started with `serve --join`) at RAFT_ADDR / CLIENT_ADDR."""
    from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
    from lighthouse_cluster.server.config import check_node_id, normalize_address

    try:
        check_node_id(node_id)
        raft = normalize_address(raft_addr, "RAFT_ADDR")
        client_address = normalize_address(client_addr, "CLIENT_ADDR")
    except ConfigError as e:
        _exit_config_error(e)
    _need_token(admin_token)
    client = _admin_client(endpoints, tls_ca, tls_client_cert, tls_client_key, timeout, admin_token)
    r = _admin_call(lambda: client.call("AddMember", cpb.AddMemberRequest(
        node=cpb.NodeInfo(id=node_id, raft_address=raft, client_address=client_address))))
    _print_members(r, output, f"{node_id} added; members")


@members.command("remove")
@click.argument("node_id")
@client_options
@admin_token_option
def members_remove(node_id: str, endpoints: str | None, tls_ca: str | None, tls_client_cert: str | None,
                   tls_client_key: str | None, output: str, timeout: float, admin_token: str | None) -> None:
    """Remove NODE_ID from the cluster (then stop its process)."""
    from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb

    _need_token(admin_token)
    client = _admin_client(endpoints, tls_ca, tls_client_cert, tls_client_key, timeout, admin_token)
    r = _admin_call(lambda: client.call("RemoveMember", cpb.RemoveMemberRequest(node_id=node_id)))
    _print_members(r, output, f"{node_id} removed; members")


# -- jobs ------------------------------------------------------------------------------------------


def job_settings_options(f: Any) -> Any:
    """The job settings as flags (``job_requests.SETTING_FLAGS``: serve's spellings). No
    environment variables: a node's LIGHTHOUSE_CLUSTER_MIN_REPLICAS must not change a job."""
    from lighthouse_cluster.cli.job_requests import SETTING_FLAGS

    for name, flags, help_text in reversed(SETTING_FLAGS):
        f = click.option(*flags, name, type=int, default=None, metavar="N", help=help_text)(f)
    return f


def _job_input(build: Any) -> Any:
    """``build()``'s request; a ``JobError`` (bad local input) is one line and exit 2, before any call."""
    from lighthouse_cluster.core.jobs import JobError

    try:
        return build()
    except JobError as e:
        _exit_config_error(ConfigError(str(e)))


def _job_call(fn: Any) -> Any:
    """Run ``fn()``; a failed call is one line on stderr: exit 2 when the node refused the
    request (a bad token, unknown job, duplicate, bad value, live replicas), 1 when the cluster
    could not be reached or did not answer."""
    import grpc

    from lighthouse_cluster.client.admin_client import AdminCallError

    try:
        return fn()
    except AdminCallError as e:
        hint = " (check LIGHTHOUSE_CLUSTER_ADMIN_TOKEN or --admin-token)" \
            if e.code == grpc.StatusCode.UNAUTHENTICATED else ""
        click.echo(f"error: {e}{hint}", err=True)
        sys.exit(2 if e.refused else 1)


def _print_job(job: Any, output: str, title: str = "", answered_by: str = "") -> None:
    from lighthouse_cluster.client.job_view import job_json

    data = job_json(job)
    if output == "json":
        click.echo(json.dumps({**data, "answered_by": answered_by} if answered_by else data, indent=2))
        return
    from lighthouse_cluster.cli.job_tables import render_job
    from lighthouse_cluster.cli.output import console

    render_job(data, console(), answered_by=answered_by, title=title)


@main.group()
def jobs() -> None:
    """Add, list, show, change and remove jobs: named quorum namespaces sharing the cluster.

    A torchft trainer selects a job by calling the job's own port (--port); an ftclient trainer
    on any port by name (LIGHTHOUSE_JOB=NAME). Calls that name no job belong to the `default` job,
    whose settings are the nodes' serve flags."""


@jobs.command("add")
@click.argument("name")
@job_settings_options
@click.option("--port", "ports", multiple=True, metavar="PORT|NODE=PORT",
              help="A client port every node serves for this job only (torchft trainers select the job by it); "
                   "NODE=PORT for one node's port (repeat). Default: none (reached by name).")
@click.option("--config", "config", multiple=True, metavar="KEY=VALUE",
              help="A configuration entry the job's trainers read (ftclient: manager.job_config()) (repeat).")
@client_options
@admin_token_option
def jobs_add(name: str, ports: tuple[str, ...], config: tuple[str, ...], endpoints: str | None,
             tls_ca: str | None, tls_client_cert: str | None, tls_client_key: str | None, output: str,
             timeout: float, admin_token: str | None, **settings: int | None) -> None:
    """Create job NAME; settings not given are the leader's own (its serve flags)."""
    from lighthouse_cluster.cli.job_requests import add_request, settings_given

    request = _job_input(lambda: add_request(name, settings_given(settings), ports, config))
    _need_token(admin_token)
    client = _admin_client(endpoints, tls_ca, tls_client_cert, tls_client_key, timeout, admin_token)
    _print_job(_job_call(lambda: client.call("AddJob", request)), output, f"job {name} added")


@jobs.command("list")
@client_options
def jobs_list(endpoints: str | None, tls_ca: str | None, tls_client_cert: str | None,
              tls_client_key: str | None, output: str, timeout: float) -> None:
    """Every job, the default one first: ports, min_replicas, last quorum, members, heartbeating
    replicas and config keys (as the leader sees them; another node's view when no leader answers)."""
    from lighthouse_cluster.client.job_view import jobs_view
    from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb

    client = _admin_client(endpoints, tls_ca, tls_client_cert, tls_client_key, timeout)
    r, address = _job_call(lambda: client.read("ListJobs", cpb.ListJobsRequest()))
    data = jobs_view(r)
    data["answered_by"] = f"{r.answered_by} ({address})" if r.answered_by else address
    if output == "json":
        click.echo(json.dumps(data, indent=2))
        return
    from lighthouse_cluster.cli.job_tables import render_jobs
    from lighthouse_cluster.cli.output import console

    render_jobs(data, console())


@jobs.command("show")
@click.argument("name")
@client_options
def jobs_show(name: str, endpoints: str | None, tls_ca: str | None, tls_client_cert: str | None,
              tls_client_key: str | None, output: str, timeout: float) -> None:
    """Every field of job NAME: settings, ports (and whether the answering node listens on its
    own), config, the members of its last quorum, heartbeats and pending requesters (leader's view)."""
    from lighthouse_cluster.core.jobs import check_job_name
    from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb

    _job_input(lambda: check_job_name(name))
    client = _admin_client(endpoints, tls_ca, tls_client_cert, tls_client_key, timeout)
    job, address = _job_call(lambda: client.read("GetJob", cpb.JobRequest(name=name)))
    _print_job(job, output, answered_by=address)


@jobs.command("set")
@click.argument("name")
@job_settings_options
@click.option("--port", "ports", multiple=True, metavar="PORT|NODE=PORT",
              help="Replace the job's ports with these (repeat; as in `jobs add`).")
@click.option("--no-ports", is_flag=True, help="Remove the job's own ports (it stays reachable by name).")
@click.option("--config", "config", multiple=True, metavar="KEY=VALUE", help="Set a config entry (repeat).")
@click.option("--unset-config", "unset_config", multiple=True, metavar="KEY", help="Remove a config entry (repeat).")
@client_options
@admin_token_option
def jobs_set(name: str, ports: tuple[str, ...], no_ports: bool, config: tuple[str, ...],
             unset_config: tuple[str, ...], endpoints: str | None, tls_ca: str | None,
             tls_client_cert: str | None, tls_client_key: str | None, output: str, timeout: float,
             admin_token: str | None, **settings: int | None) -> None:
    """Change job NAME: only what is given changes (the default job: only its config)."""
    from lighthouse_cluster.cli.job_requests import set_request, settings_given

    request = _job_input(lambda: set_request(name, settings_given(settings), ports, no_ports, config,
                                             unset_config))
    _need_token(admin_token)
    client = _admin_client(endpoints, tls_ca, tls_client_cert, tls_client_key, timeout, admin_token)
    _print_job(_job_call(lambda: client.call("SetJob", request)), output, f"job {name} changed")


@jobs.command("remove")
@click.argument("name")
@click.option("--force", is_flag=True, help="Remove it even while its replicas heartbeat (their next calls fail "
                                            "with NOT_FOUND).")
@client_options
@admin_token_option
def jobs_remove(name: str, force: bool, endpoints: str | None, tls_ca: str | None, tls_client_cert: str | None,
                tls_client_key: str | None, output: str, timeout: float, admin_token: str | None) -> None:
    """Remove job NAME (refused while its replicas heartbeat, unless --force)."""
    from lighthouse_cluster.cli.job_requests import remove_request

    request = _job_input(lambda: remove_request(name, force))
    _need_token(admin_token)
    client = _admin_client(endpoints, tls_ca, tls_client_cert, tls_client_key, timeout, admin_token)
    r = _job_call(lambda: client.call("RemoveJob", request))
    data = {"name": r.name, "last_quorum_id": r.last_quorum_id}
    if output == "json":
        click.echo(json.dumps(data, indent=2))
        return
    from lighthouse_cluster.cli.output import print_record

    print_record(f"job {r.name} removed", {"last quorum id": str(r.last_quorum_id)})


# -- transfer-leader -------------------------------------------------------------------------------


@main.command("transfer-leader")
@click.option("--to", "to", metavar="NODE_ID", help="The new leader (default: the most caught-up follower).")
@lambda f: client_options(f, timeout=10.0)
@admin_token_option
def transfer_leader(to: str | None, endpoints: str | None, tls_ca: str | None, tls_client_cert: str | None,
                    tls_client_key: str | None, output: str, timeout: float, admin_token: str | None) -> None:
    """Hand leadership over to another node (e.g. before maintenance on the leader's host)."""
    from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb

    _need_token(admin_token)
    client = _admin_client(endpoints, tls_ca, tls_client_cert, tls_client_key, timeout, admin_token)
    r = _admin_call(lambda: client.call("TransferLeader", cpb.TransferLeaderRequest(to_node_id=to or "")))
    for _ in range(2):  # a split vote can elect a third node: ask the new leader to hand over again
        if not to or r.leader_id == to:
            break
        r = _admin_call(lambda: client.call("TransferLeader", cpb.TransferLeaderRequest(to_node_id=to)))
    data = {"previous_leader": r.previous_leader_id, "leader": r.leader_id, "term": r.term}
    if output == "json":
        click.echo(json.dumps(data, indent=2))
    else:
        from lighthouse_cluster.cli.output import Cell, print_table

        print_table("leadership transferred", ("previous leader", "leader", "term"),
                    [(r.previous_leader_id, Cell(r.leader_id, "bold green"), str(r.term))])
    if to and r.leader_id != to:
        click.echo(f"error: {r.leader_id} was elected, not {to}", err=True)
        sys.exit(1)


# -- snapshot --------------------------------------------------------------------------------------

SNAPSHOT_FORMAT = "lighthouse-cluster-snapshot"


@main.group()
def snapshot() -> None:
    """Save the replicated state to a file, or restore a saved quorum into a running cluster."""


def _snapshot_table(title: str, rows: dict[str, Any], output: str) -> None:
    if output == "json":
        click.echo(json.dumps(rows, indent=2))
        return
    from lighthouse_cluster.cli.output import print_record

    flat = {k: str(v) for k, v in rows.items() if k != "jobs"}
    for name, j in rows.get("jobs", {}).items():
        flat[f"job {name}"] = (("created, " if j["created"] else "") + f"quorum id {j['previous_quorum_id']} -> "
                               f"{j['quorum_id']}" + (f" ({j['not_restored']})" if j.get("not_restored") else ""))
    print_record(title, flat)


@snapshot.command("save")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@client_options
@admin_token_option
def snapshot_save(file: Path, endpoints: str | None, tls_ca: str | None, tls_client_cert: str | None,
                  tls_client_key: str | None, output: str, timeout: float, admin_token: str | None) -> None:
    """Write a consistent snapshot of the replicated state, taken on the leader, to FILE."""
    import base64

    from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb

    _need_token(admin_token)
    client = _admin_client(endpoints, tls_ca, tls_client_cert, tls_client_key, timeout, admin_token)
    snap = _admin_call(lambda: client.call("SaveSnapshot", cpb.SnapshotRequest()))
    meta = {"format": SNAPSHOT_FORMAT, "format_version": 1, "leader_id": snap.leader_id, "term": snap.term,
            "last_applied": snap.last_applied, "quorum_id": snap.quorum_id, "taken_ms": snap.taken_ms,
            "schema_version": snap.schema_version}
    try:  # a backup: on disk (temp file, fsync, rename, directory fsync) before "saved" is printed
        write_durably(file, json.dumps({**meta, "state": base64.b64encode(snap.state).decode()}, indent=1).encode(),
                      mode=0o600)
    except OSError as e:
        click.echo(f"error: cannot write {file}: {e.strerror}", err=True)
        sys.exit(1)
    _snapshot_table(f"snapshot saved to {file}", {**meta, "file": str(file), "bytes": len(snap.state)}, output)


@snapshot.command("restore")
@click.argument("file", type=click.Path(dir_okay=False, exists=True, path_type=Path))
@client_options
@admin_token_option
def snapshot_restore(file: Path, endpoints: str | None, tls_ca: str | None, tls_client_cert: str | None,
                     tls_client_key: str | None, output: str, timeout: float, admin_token: str | None) -> None:
    """Commit FILE's quorum in a running cluster whose quorum id is below it (e.g. a cluster
    rebuilt from empty data directories), so quorum ids continue after it."""
    import base64
    import binascii

    from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb

    try:
        data = json.loads(file.read_text())
        if data.get("format") != SNAPSHOT_FORMAT:
            raise ValueError("not a lighthouse-cluster snapshot file")
        state = base64.b64decode(data["state"], validate=True)
    except (OSError, ValueError, KeyError, TypeError, binascii.Error) as e:
        _exit_config_error(ConfigError(f"cannot read snapshot {file}: {e}"))
    _need_token(admin_token)
    client = _admin_client(endpoints, tls_ca, tls_client_cert, tls_client_key, timeout, admin_token)
    r = _admin_call(lambda: client.call("RestoreSnapshot", cpb.Snapshot(
        state=state, term=data.get("term", 0), last_applied=data.get("last_applied", 0),
        quorum_id=data.get("quorum_id", 0), leader_id=data.get("leader_id", ""))))
    shown: dict[str, Any] = {"applied": r.applied, "quorum_id": r.quorum_id, "previous_quorum_id": r.previous_quorum_id}
    if r.jobs:  # the snapshot's other jobs: name -> what happened to it
        shown["jobs"] = {j.name: {"created": j.created, "quorum_id": j.quorum_id,
                                  "previous_quorum_id": j.previous_quorum_id,
                                  **({"not_restored": j.not_restored} if j.not_restored else {})} for j in r.jobs}
    _snapshot_table(f"snapshot {file} restored", shown, output)


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


if __name__ == "__main__":
    main()
