"""Run N lighthouse nodes as separate local processes: `lighthouse-cluster up`, tests, harnesses.

``LocalCluster`` starts every node with ``python -m lighthouse_cluster serve`` on loopback (or, with
``fork_nodes``, forks that command from a fork server that has imported it: ``node_forks``), each
with its own data directory and log file, passes the cluster secret through the environment
(never on the command line, where ``ps`` would show it), and can kill (SIGKILL), stop
(SIGTERM), restart, pause (SIGSTOP) and resume (SIGCONT) nodes. It always cleans up its
processes, even when the caller fails.
"""

from __future__ import annotations

import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from lighthouse_cluster.client.admin_client import query_status
from lighthouse_cluster.client.discovery import agreed_leader, serving_leader
from lighthouse_cluster.core.defaults import DEFAULT_HEARTBEAT_TIMEOUT_MS, DEFAULT_JOIN_TIMEOUT_MS, DEFAULT_QUORUM_TICK_MS
from lighthouse_cluster.local.node_forks import ForkedProcess, can_fork
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.server.config import PeerSpec
from lighthouse_cluster.tls import ClientTLS, PKIFiles

SECRET_ENV = "LIGHTHOUSE_CLUSTER_SECRET"
PARENT_PID_ENV = "LIGHTHOUSE_CLUSTER_PARENT_PID"  # see supervise.die_with_parent_from_env
ADMIN_TOKEN_ENV = "LIGHTHOUSE_CLUSTER_ADMIN_TOKEN"


# Ports are drawn from below the kernel's ephemeral range (the ports it gives outgoing connections
# and bind(0)), from this port up, when that leaves room; else the kernel is asked.
_DRAWN_PORTS_START = 10_000
_DRAWN_PORTS_MIN = 2_000
# The ports free_ports handed out lately in this process, never drawn again while remembered: a
# port is free until its taker binds it, and a test that drew a job's ports and then started a
# cluster once got one of them twice (a node's client port given to the job as well).
_HANDED_OUT: dict[int, None] = {}
_HANDED_OUT_MAX = 4_096


def _hand_out(ports: list[int]) -> list[int]:
    for port in ports:
        _HANDED_OUT.pop(port, None)
        _HANDED_OUT[port] = None
    while len(_HANDED_OUT) > _HANDED_OUT_MAX:
        del _HANDED_OUT[next(iter(_HANDED_OUT))]
    return ports


def _drawable_ports() -> tuple[int, int] | None:
    """The port range ``free_ports`` draws from, or None where the ephemeral range leaves too little."""
    try:
        low, _high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return None
    if low - _DRAWN_PORTS_START < _DRAWN_PORTS_MIN:
        return None
    return _DRAWN_PORTS_START, low - 1


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports free now on ``host`` and on every interface, released again, and
    none of them handed out by an earlier call of this process (of the last few thousand ports).

    They are drawn at random from below the kernel's ephemeral range where it leaves room: a port
    the kernel hands out (bind(0), an outgoing connection's) is the kind another process gets
    next, and two tests starting nodes side by side (``pytest -n 2``) then raced for one (a node
    failed with "Address already in use"). Elsewhere the kernel picks them."""
    drawable = _drawable_ports()
    if drawable is None:
        return _hand_out(_kernel_ports(n, host))
    draw = random.SystemRandom()
    ipv6 = can_bind("[::]", 0)
    chosen: list[int] = []
    for _ in range(100 * n):
        if len(chosen) == n:
            break
        port = draw.randint(*drawable)
        if port in chosen or port in _HANDED_OUT or not can_bind(host, port) or not can_bind("0.0.0.0", port) \
                or (ipv6 and not can_bind("[::]", port)):
            continue
        chosen.append(port)
    return _hand_out(chosen if len(chosen) == n else _kernel_ports(n, host))


def _kernel_ports(n: int, host: str) -> list[int]:
    """Ask the kernel for ``n`` distinct free TCP ports (released again before returning)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def can_bind(host: str, port: int) -> bool:
    """Could a TCP listener bind ``host:port`` now? ``host`` may be ``[::]`` (every interface,
    IPv4 too, as the nodes bind it), ``0.0.0.0``, an address or a name."""
    bare = host.strip("[]")
    try:
        infos = socket.getaddrinfo(bare, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return False
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and bare == "::":
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        try:
            s.bind(address)
        except OSError:
            return False
    return True


@dataclass
class NodeProcess:
    """One node: its spec, data directory, log file and (while running) its process."""

    peer: PeerSpec
    data_dir: Path
    log_path: Path
    process: subprocess.Popen[bytes] | ForkedProcess | None = None
    paused: bool = False

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass
class LocalCluster:
    """N node processes on one host; see the module docstring."""

    root: Path
    min_replicas: int = 1
    nodes: int = 3
    host: str = "127.0.0.1"
    client_ports: list[int] | None = None
    raft_ports: list[int] | None = None
    secret: str | None = field(default=None, repr=False)
    join_timeout_ms: int = DEFAULT_JOIN_TIMEOUT_MS
    quorum_tick_ms: int = DEFAULT_QUORUM_TICK_MS
    heartbeat_timeout_ms: int = DEFAULT_HEARTBEAT_TIMEOUT_MS
    election_timeout_ms: int | None = None
    # --quorum-lease-ms; None = the node's default (lease.default_lease_ms).
    quorum_lease_ms: int | None = None
    # --liveness-timeout-ms; None = the node's default (config.DEFAULT_LIVENESS_TIMEOUT_MS).
    liveness_timeout_ms: int | None = None
    log_level: str = "info"
    extra_args: list[str] = field(default_factory=list)
    client_bind_host: str | None = None
    # Per-node host (advertised and bound: e.g. each node's address in its own network
    # namespace); None = every node on ``host``.
    hosts: list[str] | None = None
    # Per-node command prefix (e.g. ``["ip", "netns", "exec", NS]``); it must exec the command
    # so that signals reach the node itself. None = launch the node directly.
    launch_prefix: Callable[[int], list[str]] | None = None
    # Per-node HTTP port (--http-bind on the node's bind host); None = no HTTP port.
    http_ports: list[int] | None = None
    # Admin token for the HTTP kill endpoint, passed through the environment; None = kill disabled.
    admin_token: str | None = field(default=None, repr=False)
    # TLS on every node's client port with these files (``tls.generate_pki``); with
    # ``mutual_tls`` the nodes also require client certificates signed by the CA.
    pki: PKIFiles | None = None
    mutual_tls: bool = False
    # Per-node Raft secret overrides (index -> secret; None = --insecure): tests of nodes that
    # must not be able to join.
    node_secrets: dict[int, str | None] = field(default_factory=dict, repr=False)
    # Node log files go here (kept when ``root`` is a throw-away directory); None = in ``root``.
    log_dir: Path | None = None
    # --raft-bind host of every node (on its Raft port); None = the node's default (every interface).
    raft_bind_host: str | None = None
    # --http-bind host, and the host the HTTP ports are reached at; None = as the client port.
    http_bind_host: str | None = None
    http_host: str | None = None
    # Each node is SIGKILLed by the kernel when the thread that started it exits (Linux
    # PR_SET_PDEATHSIG, set by the node itself: ``supervise.die_with_parent_from_env``), and
    # exits at once if that process is gone before it got there. Start such nodes from a thread
    # that lives as long as the cluster should (a worker thread that ends takes them with it).
    die_with_parent: bool = False
    # Fork each node from a fork server that has imported the node's code (``node_forks``: a
    # node starts without the interpreter start and the imports, ~0.3 CPU-seconds) where that is
    # the same as exec'ing it: the plain command, no exec-only environment, not ``die_with_parent``.
    fork_nodes: bool = False
    members: list[NodeProcess] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self._initial_nodes = self.nodes
        if self.secret is None:
            self.secret = secrets.token_urlsafe(32)
        ports = free_ports(2 * self.nodes, self.host) if self.client_ports is None or self.raft_ports is None else []
        client = self.client_ports or ports[: self.nodes]
        raft = self.raft_ports or ports[self.nodes:]
        if len(client) != self.nodes or len(raft) != self.nodes:
            raise ValueError("need one client port and one Raft port per node")
        if self.hosts is not None and len(self.hosts) != self.nodes:
            raise ValueError("need one host per node")
        if self.http_ports is not None and len(self.http_ports) != self.nodes:
            raise ValueError("need one HTTP port per node")
        for i in range(self.nodes):
            node_id = f"n{i + 1}"
            host = self.node_host(i)
            peer = PeerSpec(node_id, f"{host}:{raft[i]}", f"{host}:{client[i]}")
            self.members.append(NodeProcess(peer=peer, data_dir=self.root / node_id,
                                            log_path=self._log_path(node_id)))

    def _log_path(self, node_id: str) -> Path:
        return Path(self.log_dir or self.root) / f"{node_id}.log"

    # -- addresses ----------------------------------------------------------------------------

    def node_host(self, i: int) -> str:
        """The host node ``i`` listens on and is reached at."""
        return self.hosts[i] if self.hosts is not None else self.host

    @property
    def peers(self) -> list[PeerSpec]:
        return [m.peer for m in self.members]

    @property
    def client_addresses(self) -> list[str]:
        return [m.peer.client_address for m in self.members]

    def http_address(self, i: int) -> str | None:
        """Where node ``i`` serves HTTP (/metrics, /readyz, the dashboard), if it does."""
        return None if self.http_ports is None else f"{self.http_host or self.node_host(i)}:{self.http_ports[i]}"

    @property
    def endpoints(self) -> str:
        """The comma-separated URL list ftclient and `lighthouse-cluster status` take."""
        scheme = "https" if self.pki is not None else "http"
        return ",".join(f"{scheme}://{a}" for a in self.client_addresses)

    # -- processes ------------------------------------------------------------------------------

    def command(self, i: int) -> list[str]:
        m = self.members[i]
        bind_host = self.client_bind_host or self.node_host(i)
        cmd = [
            sys.executable, "-m", "lighthouse_cluster", "serve",
            "--node-id", m.peer.node_id,
            "--client-bind", f"{bind_host}:{m.peer.client_address.rsplit(':', 1)[1]}",
            "--data-dir", str(m.data_dir),
            "--min_replicas", str(self.min_replicas),
            "--join_timeout_ms", str(self.join_timeout_ms),
            "--quorum_tick_ms", str(self.quorum_tick_ms),
            "--heartbeat_timeout_ms", str(self.heartbeat_timeout_ms),
            "--log-level", self.log_level,
        ]
        if self.election_timeout_ms:
            cmd += ["--election-timeout-ms", str(self.election_timeout_ms)]
        if self.quorum_lease_ms is not None:
            cmd += ["--quorum-lease-ms", str(self.quorum_lease_ms)]
        if self.liveness_timeout_ms is not None:
            cmd += ["--liveness-timeout-ms", str(self.liveness_timeout_ms)]
        if self.raft_bind_host is not None:
            cmd += ["--raft-bind", f"{self.raft_bind_host}:{m.peer.raft_address.rsplit(':', 1)[1]}"]
        if self.http_ports is not None:
            cmd += ["--http-bind", f"{self.http_bind_host or bind_host}:{self.http_ports[i]}"]
        if self.pki is not None:
            cmd += ["--tls-cert", str(self.pki.server_cert), "--tls-key", str(self.pki.server_key),
                    "--tls-ca", str(self.pki.ca_cert)]
            if self.mutual_tls:
                cmd += ["--tls-client-ca", str(self.pki.ca_cert)]
        if i in self.node_secrets and self.node_secrets[i] is None:
            cmd += ["--insecure"]
        if i >= self._initial_nodes or len(self.members) % 2 == 0:
            cmd += ["--join"]  # added later (`add_node`), or restarted while the member count is even
        for p in self.peers:
            cmd += ["--peer", str(p)]
        return cmd + self.extra_args

    def launch_command(self, i: int) -> list[str]:
        """``command(i)`` behind ``launch_prefix(i)``, if any: what ``start_node`` runs."""
        prefix = self.launch_prefix(i) if self.launch_prefix is not None else []
        return [*prefix, *self.command(i)]

    def start(self) -> "LocalCluster":
        self.root.mkdir(parents=True, exist_ok=True)
        if self.log_dir is not None:
            Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        for i in range(self.nodes):
            self.start_node(i)
        return self

    def start_node(self, i: int) -> None:
        m = self.members[i]
        if m.running:
            raise RuntimeError(f"{m.peer.node_id} is already running")
        m.data_dir.mkdir(parents=True, exist_ok=True)
        m.log_path.parent.mkdir(parents=True, exist_ok=True)
        secret = self.node_secrets.get(i, self.secret) if i in self.node_secrets else self.secret
        env = {**os.environ, SECRET_ENV: secret or "", "PYTHONUNBUFFERED": "1"}
        env.pop(ADMIN_TOKEN_ENV, None)
        if self.admin_token:
            env[ADMIN_TOKEN_ENV] = self.admin_token
        env.pop(PARENT_PID_ENV, None)
        if self.die_with_parent:
            env[PARENT_PID_ENV] = str(os.getpid())
        command = self.launch_command(i)
        if self.fork_nodes and not self.die_with_parent and can_fork(command, env) is None:
            m.process = ForkedProcess(command, env, m.log_path)
        else:
            log = open(m.log_path, "ab")
            try:
                m.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                             stdin=subprocess.DEVNULL, start_new_session=True)
            finally:
                log.close()
        m.paused = False

    def signal(self, i: int, sig: int) -> None:
        m = self.members[i]
        if m.process is not None and m.process.poll() is None:
            m.process.send_signal(sig)

    def kill(self, i: int) -> None:
        """SIGKILL node i and reap it."""
        m = self.members[i]
        if m.process is None:
            return
        if m.paused:
            self.signal(i, signal.SIGCONT)
        self.signal(i, signal.SIGKILL)
        m.process.wait(timeout=10)
        m.process = None
        m.paused = False

    def stop(self, i: int, timeout: float = 10.0) -> int | None:
        """SIGTERM node i (graceful: hands leadership over) and wait; SIGKILL after ``timeout``."""
        m = self.members[i]
        if m.process is None:
            return None
        if m.paused:
            self.signal(i, signal.SIGCONT)
        self.signal(i, signal.SIGTERM)
        try:
            code = m.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            m.process.kill()
            code = m.process.wait(timeout=10)
        m.process = None
        m.paused = False
        return code

    def restart(self, i: int) -> None:
        self.kill(i)
        self.start_node(i)

    def pause(self, i: int) -> None:
        self.signal(i, signal.SIGSTOP)
        self.members[i].paused = True

    def resume(self, i: int) -> None:
        self.signal(i, signal.SIGCONT)
        self.members[i].paused = False

    def stop_all(self, graceful: bool = False) -> None:
        for i in range(self.nodes):
            try:
                if graceful:
                    self.stop(i)
                else:
                    self.kill(i)
            except (OSError, subprocess.SubprocessError):
                pass

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def add_node(self, node_id: str | None = None) -> int:
        """Describe one more node (fresh ports, ``--join``: it starts knowing every member);
        start it with ``start_node`` and add it with ``members add``. Returns its index."""
        i = len(self.members)
        node_id = node_id or f"n{i + 1}"
        client, raft = free_ports(2, self.host)
        if self.http_ports is not None:
            self.http_ports.append(free_ports(1, self.host)[0])
        host = self.host
        self.members.append(NodeProcess(peer=PeerSpec(node_id, f"{host}:{raft}", f"{host}:{client}"),
                                        data_dir=self.root / node_id, log_path=self._log_path(node_id)))
        self.nodes = len(self.members)
        return i

    # -- observation ------------------------------------------------------------------------------

    @property
    def client_tls(self) -> ClientTLS | None:
        """How clients dial these nodes (with the client certificate when mTLS is on)."""
        return None if self.pki is None else self.pki.client_tls(with_cert=self.mutual_tls)

    def status(self, i: int, timeout: float = 1.0) -> cpb.NodeStatus | None:
        return query_status(self.members[i].peer.client_address, timeout, self.client_tls)

    def leader_index(self, among: list[int] | None = None) -> int | None:
        """The index of the running node that reports itself serving leader in the highest term
        (``discovery.serving_leader``: a deposed leader not yet told is passed over), if any."""
        asked = [i for i in (among if among is not None else range(self.nodes))
                 if self.members[i].running and not self.members[i].paused]
        return serving_leader([(i, self.status(i, timeout=0.5)) for i in asked])

    def wait_for_leader(self, timeout: float = 15.0, among: list[int] | None = None,
                        exclude_term: int | None = None) -> int:
        """Wait until some running node serves as leader (optionally in a term after
        ``exclude_term``); raise TimeoutError with the nodes' last log lines otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            i = self.leader_index(among)
            if i is not None:
                st = self.status(i, timeout=0.5)
                if st is not None and (exclude_term is None or st.term > exclude_term):
                    return i
            self._raise_if_all_exited()
            time.sleep(0.02)
        raise TimeoutError(f"no serving leader within {timeout:.1f}s\n{self.tail_logs()}")

    def wait_for_followers(self, leader: int, timeout: float = 10.0) -> bool:
        """Wait until every running node reports ``leader`` as its leader in the leader's term
        (a freshly elected leader is known to a majority at once, to the rest a heartbeat later).
        Returns False, rather than raising, when some node has not caught up in time."""
        deadline = time.monotonic() + timeout
        leader_id = self.members[leader].peer.node_id
        while time.monotonic() < deadline:
            lst = self.status(leader, timeout=0.5)
            running = [i for i, m in enumerate(self.members) if m.running and not m.paused]
            views = [self.status(i, timeout=0.5) for i in running]
            if lst is not None and all(v is not None and v.leader_id == leader_id and v.term == lst.term
                                       for v in views):
                return True
            self._raise_if_all_exited()
            time.sleep(0.02)
        return False

    def wait_for_agreed_leader(self, timeout: float = 30.0) -> int:
        """A serving leader that every running node follows in its term. A start-up election can
        be followed by another one: then the next leader is waited for. TimeoutError with the
        nodes' last log lines when none is agreed on within ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            leader = self.wait_for_leader(timeout=max(0.1, deadline - time.monotonic()))
            if self.wait_for_followers(leader, timeout=min(5.0, max(0.5, deadline - time.monotonic()))):
                return leader
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no leader followed by every node within {timeout:.1f}s\n{self.tail_logs()}")

    def wait_for_stable_leader(self, timeout: float = 30.0, stable_for: float = 0.5,
                               should_stop: Callable[[], bool] | None = None,
                               on_poll: Callable[[], None] | None = None) -> tuple[int, int]:
        """``(index, term)`` of the leader that every running node names in the same term, while
        it serves, unchanged for ``stable_for`` seconds (``discovery.agreed_leader``): a start-up
        election followed by another one is waited out, not reported. ``on_poll`` runs between
        polls (e.g. a supervisor restarting nodes); ``should_stop()`` true raises InterruptedError.
        TimeoutError with the nodes' last log lines when no leader is agreed on in time."""
        from lighthouse_cluster.local.up_plan import Stable

        deadline = time.monotonic() + timeout
        stable = Stable(stable_for)
        while time.monotonic() < deadline:
            if should_stop is not None and should_stop():
                raise InterruptedError("stopped while waiting for a leader")
            if on_poll is not None:
                on_poll()
            running = [i for i, m in enumerate(self.members) if m.running and not m.paused]
            views = [self.status(i, timeout=0.5) for i in running]
            agreed = agreed_leader(views) if len(running) > self.nodes // 2 else None
            if stable.observe(agreed, time.monotonic()):
                assert agreed is not None
                leader_id, term = agreed
                return next(i for i, m in enumerate(self.members) if m.peer.node_id == leader_id), term
            self._raise_if_all_exited()
            time.sleep(0.02)
        raise TimeoutError(f"no leader followed by every node for {stable_for:g}s within {timeout:.1f}s\n"
                           f"{self.tail_logs()}")

    def _raise_if_all_exited(self) -> None:
        started = [m for m in self.members if m.process is not None]
        if started and all(m.process.poll() is not None for m in started):
            raise RuntimeError(f"every node process exited\n{self.tail_logs()}")

    def tail_logs(self, lines: int = 15) -> str:
        out = []
        for m in self.members:
            try:
                text = m.log_path.read_text(errors="replace").splitlines()[-lines:]
            except FileNotFoundError:
                text = ["(no log)"]
            out.append(f"--- {m.peer.node_id} ({m.log_path}) ---")
            out.extend(text)
        return "\n".join(out)
