"""`lighthouse-cluster up`: a local N-node cluster in the foreground (port planning in
``local/up_plan.py``, supervision in ``local/supervise.py``, the nodes in ``local/cluster.py``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from lighthouse_cluster.cli.app import main
from lighthouse_cluster.cli.options import ENV, exit_config_error, lease_flag, liveness_flag, torchft_flags
from lighthouse_cluster.core.defaults import UP_ADMIN_TIMEOUT_S, UP_LEADER_STABLE_S, UP_LEADER_TIMEOUT_S
from lighthouse_cluster.durable_files import make_directory_durably, write_durably
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
        exit_config_error(ConfigError(f"--nodes {nodes}: use an odd number so a majority survives a split"))
    if demo and (tls or mtls):
        exit_config_error(ConfigError("--demo's simulated replica groups speak plaintext: drop --tls/--mtls"))
    try:
        plan = plan_addresses(nodes, bind, http_bind, raft_port, lambda n, host: free_ports(n, host.strip("[]")))
        up_jobs = plan_jobs(jobs, nodes, [p for _kind, _host, p in plan.every_port()])
    except ConfigError as e:
        exit_config_error(e)
    job_ports = [("job", plan.client.bind_host, p) for j in up_jobs for _node, p in j.ports(
        [f"n{i + 1}" for i in range(nodes)])]
    busy = [f"{p} ({kind} on {host})" for kind, host, p in plan.every_port() + job_ports if not can_bind(host, p)]
    if busy:
        exit_config_error(ConfigError(f"ports already in use: {', '.join(busy)} "
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
            leader, term = cluster.wait_for_stable_leader(timeout=UP_LEADER_TIMEOUT_S, stable_for=UP_LEADER_STABLE_S,
                                                         should_stop=stop.is_set, on_poll=startup_check)
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
    client = AdminClient(cluster.client_addresses, tls=cluster.client_tls, token=admin_token,
                         timeout=UP_ADMIN_TIMEOUT_S)
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
                     m.peer.raft_address, f"{'http' if cluster.pki is None else 'https'}://{http}" if http else "-"))
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
