"""A drop-in for torchft's ``LighthouseServer`` that runs a local 3-node lighthouse-cluster.

``torchft._torchft.LighthouseServer(bind, min_replicas, ...)`` runs torchft's lighthouse on a
thread of the calling process. :class:`LighthouseServer` takes the same arguments with the same
defaults, starts the nodes of a :class:`~lighthouse_cluster.local.cluster.LocalCluster` as
separate processes on loopback (a temporary data directory, removed on shutdown) and returns once
the cluster serves: one leader, followed by every node, that answers quorum calls. The nodes are
forked from a fork server that has imported their code (``node_forks``; a cluster serves in about
0.8 s instead of 1.2 s, for a quarter of the CPU), or exec'd where that is not the same. ``address()``
is an ``http://host:port`` URL torchft's Rust client accepts; ``shutdown()`` stops every node.

No node outlives its owner: ``shutdown()`` kills them, so does garbage collection of the object
and interpreter exit (``weakref.finalize``), and a guardian process (``supervise.Guardian``, one
per server, in a session of its own) kills them and removes the data directory when the owning
process dies without running either (SIGKILL, ``os._exit``): it holds the read end of a pipe
whose only write end is in the owner. (No parent-death signal: the kernel ties it to the thread
that started a node, and torchft's tests may create a server on any thread.)

``bind`` is ``HOST:PORT`` as torchft's: port 0 picks free ports; ``[::]`` or ``0.0.0.0`` serves
the client ports on every interface (Raft stays on loopback) and ``address()`` then names this
host by its hostname, as torchft's does. With port 0, ``address()`` is the first leader's client
port (no forwarding hop); with an explicit port it is that port (node ``n1``); ``addresses()``
lists every node.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
import time
import weakref
from pathlib import Path

from lighthouse_cluster.local.cluster import LocalCluster, free_ports, port_is_free
from lighthouse_cluster.local.supervise import Guardian
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.server.config import ConfigError, parse_host_port

# The defaults of torchft's Python LighthouseServer (its pyo3 constructor): join_timeout_ms is 100
# there, not the torchft_lighthouse command line's 60000 (torchft's own tests rely on it: e.g.
# local_sgd_integ_test's upscale cases expect two replicas to go on without a third that
# heartbeats but waits at a barrier).
DEFAULT_JOIN_TIMEOUT_MS = 100
DEFAULT_QUORUM_TICK_MS = 100
DEFAULT_HEARTBEAT_TIMEOUT_MS = 5_000

START_TIMEOUT_S = 60.0
WILDCARDS = ("[::]", "::", "0.0.0.0")

class _GuardedCluster(LocalCluster):
    """A LocalCluster whose node process groups the guardian knows about."""

    guardian: Guardian | None = None

    def start_node(self, i: int) -> None:
        super().start_node(i)
        proc = self.members[i].process
        if self.guardian is not None and proc is not None:
            self.guardian.watch(proc.pid)  # each node leads its own session: pgid == pid

    def kill(self, i: int) -> None:
        proc = self.members[i].process
        super().kill(i)
        if self.guardian is not None and proc is not None:
            self.guardian.forget(proc.pid)

    def stop(self, i: int, timeout: float = 10.0) -> int | None:
        proc = self.members[i].process
        code = super().stop(i, timeout)
        if self.guardian is not None and proc is not None:
            self.guardian.forget(proc.pid)
        return code


def _cleanup(cluster: _GuardedCluster, guardian: Guardian, root: Path) -> None:
    """Kill every node, reap them, then let the guardian go and remove the data directory."""
    try:
        cluster.stop_all()
    finally:
        guardian.close()
        shutil.rmtree(root, ignore_errors=True)


def _wait_ready(cluster: LocalCluster, timeout: float) -> int:
    """The index of a serving leader that every node names as leader in its term. Polls every
    node's Status; a start-up re-election just moves the target (no fixed wait). RuntimeError
    when a node exits, TimeoutError (with the nodes' log tails) at ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        exited = [m.peer.node_id for m in cluster.members if not m.running]
        if exited:
            raise RuntimeError(f"node(s) {', '.join(exited)} exited during start-up")
        views = [cluster.status(i, timeout=0.5) for i in range(cluster.nodes)]
        leaders = [i for i, v in enumerate(views) if v is not None and v.role == cpb.LEADER and v.serving]
        if len(leaders) == 1:
            lead = views[leaders[0]]
            name = cluster.members[leaders[0]].peer.node_id
            if all(v is not None and v.leader_id == name and v.term == lead.term for v in views):
                return leaders[0]
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no leader followed by every node within {timeout:.1f}s\n{cluster.tail_logs()}")
        time.sleep(0.01)


def _advertised_host(host: str) -> str:
    """The host name to give clients for a bind host."""
    if host in WILDCARDS:
        name = socket.gethostname()
        try:
            socket.getaddrinfo(name, None)
            return name
        except OSError:
            return "127.0.0.1"
    return host.strip("[]")


class LighthouseServer:
    """torchft's ``LighthouseServer`` API backed by a local N-node cluster (see module docstring).

    Args:
        bind: ``HOST:PORT`` for the (first) node's client port; port 0 picks free ports.
        min_replicas: fewest replica groups a new quorum may have.
        join_timeout_ms: how long to wait for heartbeating replicas that have not asked (100, as
            torchft's LighthouseServer; torchft_lighthouse's command line defaults to 60000).
        quorum_tick_ms: how often the leader re-evaluates the pending quorum (100).
        heartbeat_timeout_ms: a replica whose last heartbeat is older is unhealthy (5000).
        nodes: how many node processes (odd; 3 by default).
        start_timeout: seconds to wait for the cluster to serve before raising TimeoutError.
    """

    def __init__(self, bind: str, min_replicas: int, join_timeout_ms: int | None = None,
                 quorum_tick_ms: int | None = None, heartbeat_timeout_ms: int | None = None, *,
                 nodes: int = 3, start_timeout: float = START_TIMEOUT_S) -> None:
        try:
            host, port = parse_host_port(bind, "bind", allow_zero=True)
        except ConfigError as e:
            raise ValueError(str(e)) from None
        if nodes < 1 or nodes % 2 == 0:
            raise ValueError(f"nodes={nodes}: use an odd number so a majority survives a split")
        if min_replicas < 1:
            raise ValueError(f"min_replicas={min_replicas}: must be at least 1")
        wildcard = host in WILDCARDS
        node_host = "127.0.0.1" if wildcard or host == "localhost" else host.strip("[]")
        self._advertised = _advertised_host(host)
        if port != 0 and not port_is_free(port, node_host):
            raise OSError(f"bind {bind}: port {port} is already in use on {node_host}")
        client = free_ports(nodes, node_host) if port == 0 else [port] + free_ports(nodes - 1, node_host)
        raft = free_ports(nodes, node_host)
        while set(raft) & set(client):  # an explicit port may collide with a fresh one
            raft = free_ports(nodes, node_host)
        self._explicit_port = port != 0
        root = Path(tempfile.mkdtemp(prefix="lighthouse-server-"))
        guardian = Guardian(remove=root)
        cluster = _GuardedCluster(
            root=root, nodes=nodes, host=node_host, client_ports=client, raft_ports=raft,
            min_replicas=min_replicas,
            join_timeout_ms=DEFAULT_JOIN_TIMEOUT_MS if join_timeout_ms is None else join_timeout_ms,
            quorum_tick_ms=DEFAULT_QUORUM_TICK_MS if quorum_tick_ms is None else quorum_tick_ms,
            heartbeat_timeout_ms=DEFAULT_HEARTBEAT_TIMEOUT_MS if heartbeat_timeout_ms is None else heartbeat_timeout_ms,
            client_bind_host=host if wildcard and host else None, fork_nodes=True)
        cluster.guardian = guardian
        self.cluster = cluster
        self.root = root
        self._finalizer = weakref.finalize(self, _cleanup, cluster, guardian, root)
        started = time.monotonic()
        try:
            cluster.start()
            self._leader = _wait_ready(cluster, start_timeout)
        except (TimeoutError, RuntimeError) as e:
            logs = cluster.tail_logs(20)
            self._finalizer()
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise RuntimeError(f"lighthouse-cluster did not start (bind {bind}, {nodes} nodes): {reason}\n{logs}") \
                from None
        except BaseException:
            self._finalizer()
            raise
        self.start_seconds = time.monotonic() - started

    def address(self) -> str:
        """``http://host:port`` of one node (any node serves; see the module docstring)."""
        i = 0 if self._explicit_port else self._leader
        port = self.cluster.client_addresses[i].rsplit(":", 1)[1]
        host = self._advertised
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{port}"

    def addresses(self) -> list[str]:
        """``http://host:port`` of every node, in node order."""
        return [f"http://{a}" for a in self.cluster.client_addresses]

    def shutdown(self) -> None:
        """Stop every node and remove the data directory. Idempotent."""
        self._finalizer()

    @property
    def alive(self) -> bool:
        return self._finalizer.alive

    def __enter__(self) -> "LighthouseServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "running" if self.alive else "shut down"
        return f"<lighthouse_cluster.LighthouseServer {self.address()} {self.cluster.nodes} nodes, {state}>"


__all__ = ["LighthouseServer", "DEFAULT_JOIN_TIMEOUT_MS", "DEFAULT_QUORUM_TICK_MS",
           "DEFAULT_HEARTBEAT_TIMEOUT_MS"]
