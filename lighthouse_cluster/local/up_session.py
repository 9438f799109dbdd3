"""One run of `lighthouse-cluster up`, from start to stop: the work behind the command.

``cli.up`` parses the options into an ``up_plan.UpRequest``, checks it (``up_plan.plan_up``) and
hands the plan to :class:`UpSession` with an :class:`UpView` (where the lines go). The session:

1. makes the data directory (a temporary one unless ``--data-dir``, removed on exit, also by the
   guardian if ``up`` is killed) and the log directory (kept), starts the guardian
   (``supervise.Guardian``), writes an admin token for ``--job`` when none was given, and a
   throw-away PKI for ``--tls``/``--mtls``;
2. turns SIGINT, SIGTERM and SIGHUP (a closed terminal) into a stop;
3. starts every node (``supervise.NodeSupervisor``, from this thread: the nodes' parent-death
   signal is tied to it), waits for a leader every node follows (a node that exits meanwhile
   ends the start, with its log), creates ``--job``'s jobs, shows the endpoints, and starts
   ``--demo`` (``demo.run_demo``) on a thread of its own;
4. supervises until a stop or until stdout's reader is gone (``up | head``), restarting nodes
   that exit (unless ``--no-restart``);
5. stops the demo and the nodes (gracefully, unless the start failed), removes a temporary data
   directory and closes the guardian.

:meth:`UpSession.run` returns the exit status: 0, or 1 when the start failed (after one
``error:`` line).
"""

from __future__ import annotations

import secrets
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, ContextManager, Protocol, Sequence

from lighthouse_cluster.core.defaults import UP_ADMIN_TIMEOUT_S, UP_LEADER_STABLE_S, UP_LEADER_TIMEOUT_S
from lighthouse_cluster.core.restarts import describe_exit
from lighthouse_cluster.durable_files import make_directory_durably, write_durably
from lighthouse_cluster.local.cluster import LocalCluster
from lighthouse_cluster.local.supervise import Guardian, NodeSupervisor
from lighthouse_cluster.local.up_plan import UpJob, UpPlan, job_banner, listening, picked_ports_line


class UpView(Protocol):
    """Where ``up``'s lines go (``cli.up`` writes them to the terminal)."""

    broken: bool  # stdout is gone: the session stops

    def echo(self, text: str) -> None:
        """A line of the banner (stdout)."""

    def say(self, text: str) -> None:
        """A line about what happens (stdout, stderr once stdout is gone)."""

    def error(self, text: str) -> None:
        """The one line saying why ``up`` failed (stderr)."""

    def waiting(self, text: str) -> ContextManager[Any]:
        """While the nodes start (a spinner on a terminal)."""

    def table(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], record: str) -> None:
        """The nodes, one row each."""

    def reader_gone(self) -> bool:
        """Has stdout's reader gone away?"""

    def silence_stdout(self) -> None:
        """After a broken stdout: nothing more goes there."""


def kept_log_dir() -> Path:
    """Where a temporary cluster's node logs go: kept after `up` exits, one directory per run."""
    base = Path(tempfile.gettempdir()) / "lighthouse-cluster-logs"
    base.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=base))


class UpSession:
    """One run of ``up`` (see the module docstring)."""

    def __init__(self, plan: UpPlan, view: UpView) -> None:
        self.plan = plan
        self.request = plan.request
        self.view = view
        self.stop = threading.Event()
        self.temporary = self.request.data_dir is None
        self.root = self.request.data_dir or Path(tempfile.mkdtemp(prefix="lighthouse-cluster-"))
        self.logs = self.request.log_dir or (self.request.data_dir if not self.temporary else kept_log_dir())
        self.token_file: Path | None = None

    def run(self) -> int:
        """Run the cluster until stopped; the exit status."""
        view, r = self.view, self.request
        view.echo(f"logs: {self.logs}")
        guardian = Guardian(remove=self.root if self.temporary else None)
        admin_token = self._admin_token()
        cluster = self._cluster(admin_token)
        supervisor = NodeSupervisor(cluster, say=view.say, restart=not r.no_restart, guardian=guardian)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, lambda _signum, _frame: self.stop.set())
        demo_thread: threading.Thread | None = None
        code = 0
        try:
            supervisor.start_all()
            with view.waiting(f"starting {r.nodes} nodes, waiting for a leader every node follows ..."):
                leader, term = cluster.wait_for_stable_leader(
                    timeout=UP_LEADER_TIMEOUT_S, stable_for=UP_LEADER_STABLE_S, should_stop=self.stop.is_set,
                    on_poll=lambda: _fail_if_a_node_exited(cluster, supervisor))
            for job in self.plan.jobs:
                create_job(cluster, job, admin_token)
            picked = picked_ports_line(self.plan)
            if picked is not None:
                view.echo(picked)
            self._show_endpoints(cluster, leader, term)
            if r.demo:
                demo_thread = threading.Thread(target=self._demo, args=(cluster,), name="demo", daemon=True)
                demo_thread.start()
            while not self.stop.wait(0.1):
                supervisor.tick()
                if view.reader_gone():
                    break
        except InterruptedError:
            pass
        except (TimeoutError, RuntimeError) as e:
            view.error(f"error: {e}")
            code = 1
        finally:
            self.stop.set()
            if demo_thread is not None:
                demo_thread.join(timeout=15)
            view.say("stopping nodes ...")
            supervisor.stop_all(graceful=code == 0)
            if self.temporary:
                shutil.rmtree(self.root, ignore_errors=True)
            guardian.close()
            view.say(f"node logs kept in {self.logs}")
            if view.broken:
                view.silence_stdout()
        return code

    def _admin_token(self) -> str | None:
        """``--admin-token``; else, when ``--job`` needs one, this run's own, in a file only its
        user reads (``token_file``)."""
        if not self.plan.jobs or self.request.admin_token:
            return self.request.admin_token
        token = secrets.token_urlsafe(24)
        self.token_file = self.root / "admin-token"
        make_directory_durably(self.root)  # a --data-dir that does not exist yet
        write_durably(self.token_file, (token + "\n").encode(), mode=0o600)
        return token

    def _cluster(self, admin_token: str | None) -> LocalCluster:
        r, a = self.request, self.plan.addresses
        pki = None
        if r.tls or r.mtls:
            from lighthouse_cluster.tls import generate_pki

            reach = a.client.reach_host
            pki = generate_pki(self.root / "tls", hosts=sorted({reach.strip("[]"), "127.0.0.1", "localhost", "::1"}))
        return LocalCluster(root=self.root, nodes=r.nodes, host=a.client.reach_host, client_ports=list(a.client.ports),
                            raft_ports=list(a.raft.ports), min_replicas=r.min_replicas,
                            join_timeout_ms=r.join_timeout_ms, quorum_tick_ms=r.quorum_tick_ms,
                            heartbeat_timeout_ms=r.heartbeat_timeout_ms, log_level=r.log_level,
                            client_bind_host=a.client.bind_host, http_ports=list(a.http.ports),
                            pki=pki, mutual_tls=r.mtls, admin_token=admin_token, quorum_lease_ms=r.quorum_lease_ms,
                            liveness_timeout_ms=r.liveness_timeout_ms, log_dir=self.logs,
                            raft_bind_host=a.raft.bind_host, http_bind_host=a.http.bind_host,
                            http_host=a.http.reach_host, die_with_parent=True,
                            extra_args=["--job-port-processes"] if r.job_port_processes else [])

    def _demo(self, cluster: LocalCluster) -> None:
        from lighthouse_cluster.local.demo import run_demo

        r = self.request
        try:
            run_demo(cluster, replicas=r.demo_replicas, kill_every_s=r.demo_kill_every, should_stop=self.stop.is_set,
                     say=self.view.say)
        except Exception as e:  # the cluster keeps running; say why the demo ended
            self.view.say(f"demo stopped: {type(e).__name__}: {e}")

    def _show_endpoints(self, cluster: LocalCluster, leader: int, term: int) -> None:
        rows = []
        for i, m in enumerate(cluster.members):
            http = cluster.http_address(i)
            scheme = "http" if cluster.pki is None else "https"
            rows.append((m.peer.node_id, "leader" if i == leader else "follower", m.peer.client_address,
                         m.peer.raft_address, f"{scheme}://{http}" if http else "-"))
        # A terminal gets a table; a log file or pipe one "node: id=n1 role=... client=..." line each.
        self.view.table("lighthouse-cluster is up", ("id", "role", "client", "raft", "http"), rows, record="node")
        for line in self.endpoint_lines(cluster, leader, term):
            self.view.echo(line)

    def endpoint_lines(self, cluster: LocalCluster, leader: int, term: int) -> list[str]:
        """What ``up`` prints under the node table: the leader, where the ports listen, the data
        and logs, and what trainers and the commands set. Meant to be copied: never wrapped."""
        a = self.plan.addresses
        node_ids = [m.peer.node_id for m in cluster.members]
        lines = [f"leader: {cluster.members[leader].peer.node_id} (term {term}), followed by every node",
                 "listening: " + ", ".join(listening(kind, ls) for kind, ls in
                                           (("client", a.client), ("raft", a.raft), ("http", a.http))),
                 f"data: {self.root}{' (removed on exit)' if self.temporary else ''}",
                 f"logs: {self.logs}/{{{','.join(node_ids)}}}.log (kept after exit)"]
        if cluster.pki is not None:
            lines += ["TLS clients (status, admin commands, ftclient):",
                      f"  export LIGHTHOUSE_CLUSTER_TLS_CA={cluster.pki.ca_cert}"]
            if cluster.mutual_tls:
                lines += [f"  export LIGHTHOUSE_CLUSTER_TLS_CLIENT_CERT={cluster.pki.client_cert}",
                          f"  export LIGHTHOUSE_CLUSTER_TLS_CLIENT_KEY={cluster.pki.client_key}"]
        else:
            lines += ["torchft trainers: exactly ONE URL, any node (torchft hangs on a list; for HA see",
                      "deploy/README.md, 'One name for every node'):",
                      f"  export TORCHFT_LIGHTHOUSE=http://{cluster.client_addresses[0]}"]
        lines += ["ftclient trainers and the lighthouse-cluster commands take the list of every node:",
                  f"  export TORCHFT_LIGHTHOUSE={cluster.endpoints}",
                  f"  lighthouse-cluster status --endpoints {cluster.endpoints}"]
        for job in self.plan.jobs:
            lines += job_banner(job, node_ids, a.client.reach_host, cluster.endpoints, cluster.pki is not None)
        if self.token_file is not None:
            lines += ["the admin token of this run (jobs add/set/remove, members, snapshot):",
                      f"  export LIGHTHOUSE_CLUSTER_ADMIN_TOKEN=$(cat {self.token_file})"]
        lines.append("Ctrl-C stops every node.")
        return lines


def _fail_if_a_node_exited(cluster: LocalCluster, supervisor: NodeSupervisor) -> None:
    """While the cluster starts: a node that exited ends the start (RuntimeError, with the logs)."""
    exited = supervisor.exited()
    if exited:
        i, code = exited[0]
        raise RuntimeError(f"{cluster.members[i].peer.node_id} exited with {describe_exit(code)} while the "
                           f"cluster started\n{cluster.tail_logs()}")


def create_job(cluster: LocalCluster, job: UpJob, admin_token: str | None) -> None:
    """Create ``up --job``'s job through the leader; a job of that name kept in --data-dir from
    an earlier run gets the ports asked for now. RuntimeError when refused."""
    import grpc

    from lighthouse_cluster.client.admin_client import AdminCallError, AdminClient
    from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb

    node_ids = [m.peer.node_id for m in cluster.members]
    ports = [cpb.JobPort(node_id=node, port=port) for node, port in job.ports(node_ids)]
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
