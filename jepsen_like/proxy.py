"""Network faults between local node processes through a userspace TCP proxy (no root needed).

``ProxyNetwork`` has the fault interface of ``netns.NetnsNetwork`` (``setup()``,
``teardown()``, context manager, ``isolate(i)``, ``partition(*sides)``, ``cut(src, dst)``,
``heal()``, ``blocked``) plus per-direction latency (``delay(src, dst, seconds)``), for nodes
that all run on loopback.

Wiring
------
For every ordered pair of nodes ``(i, j)`` the proxy listens on ``host:<port>`` (``listen_address
(i, j)``) and forwards each connection it accepts there to node ``j``'s real Raft address. Node
``i`` is started with ``--raft-dial <id of j>=<listen_address(i, j)>`` for every other node ``j``
(the ``serve`` option: peer ``j`` keeps its Raft address as its identity, only the address node
``i`` connects to changes). So a byte on a connection accepted on listener ``(i, j)`` that comes
from the client side was sent by ``i`` to ``j``, and a byte from the upstream side by ``j`` to
``i``. The proxy forwards bytes unchanged, so pysyncobj's handshake (a dialer announces its own
Raft address as its first message, encrypted with the cluster secret) identifies the dialer
exactly as without the proxy. ``wire(cluster)`` does all of it for a ``LocalCluster`` (before
``start()``): it sets the upstream targets from ``cluster.peers`` and prefixes each node's
command with ``env LIGHTHOUSE_CLUSTER_RAFT_DIAL=...`` (``LocalCluster.extra_args`` is shared by
every node; the launch prefix is per node). ``cluster_kwargs()`` + ``attach(cluster)`` are the
same in two steps, for ``jepsen_like.network``. ``dial_args(i)`` gives the same as flags.

pysyncobj keeps one TCP connection per pair of nodes, dialed by the node with the greater
address string, so of the two listeners of a pair only ``(greater, lesser)`` carries traffic;
the other one is there so that the wiring does not depend on that rule.

Fault semantics (exactly what you get)
--------------------------------------
Faults act on whole connections or hold bytes back; the proxy never drops bytes from the middle
of a stream and then carries on (pysyncobj frames messages with a length prefix, and a stream
with a hole in it would be misparsed, not lost).

* A pair ``{a, b}`` is *severed* when both ``(a, b)`` and ``(b, a)`` are blocked (``isolate``,
  ``partition``, or ``cut`` both ways). At that moment every open ``a <-> b`` connection is
  reset (``SO_LINGER 0`` + close: an RST to both nodes; bytes still queued in the proxy are
  discarded along with the connection, as a dead TCP connection's would be). While severed,
  every new connection on either listener of the pair is accepted and reset at once, without
  connecting upstream: a dialer sees its connection reset before the handshake completes, and
  pysyncobj retries every ``connectionRetryTime``. ``heal()`` lets the next attempt through.
* A *one-way* cut ``cut(src, dst)`` (with ``(dst, src)`` not blocked) is **not** a packet drop:
  one TCP connection carries both directions, and a connection cannot lose bytes in one
  direction and stay usable. The closest honest approximation the proxy gives is a **hold**:
  on every ``src <-> dst`` connection (open ones and new ones, which are accepted normally),
  bytes from ``src`` are no longer delivered to ``dst``; they are kept, in order, in the proxy
  (up to ``_QUEUE_CHUNKS`` reads, then in the kernel and in ``src``'s send buffer), and bytes
  from ``dst`` still reach ``src``. When the cut is healed while the connection is still open,
  the held bytes are delivered in order (as TCP retransmission would deliver them after a real
  one-way outage); if the connection closes first, they are discarded with it.
  What that means for pysyncobj: ``dst`` stops hearing from ``src`` and closes the connection
  after ``connectionTimeout`` (``max(election max, 0.5 s)`` here) of silence; reconnections
  are held the same way, and with a cluster secret their key exchange needs both directions,
  so they never complete (without a secret the dialer's one-message handshake may let a
  reconnection count as connected for up to one ``connectionTimeout`` each time). Net effect:
  ``dst -> src`` messages keep arriving for up to one ``connectionTimeout`` after the cut, then
  the pair is disconnected both ways until ``heal()`` (measured, leader -> follower cut, 0.9 s
  connection timeout: disconnected both ways 0.5-1 s after the cut; the follower then runs for
  leader, and leadership churns while the cut lasts, as Raft without PreVote/CheckQuorum does
  under a one-way partition). pysyncobj checks that timeout only when the socket has an event
  or it sends, so a pair that exchanges nothing (two followers under a stable leader) stays
  connected and the hold is invisible until one of them sends. That matches what a one-way
  DROP rule does to a TCP-based protocol (``netns.cut`` documents the same stall); a protocol
  that sends datagrams one way while the other way is dead cannot be modelled over
  pysyncobj's single connection per pair.
* ``delay(src, dst, s)``: every chunk read from ``src`` on a ``src <-> dst`` connection is
  delivered to ``dst`` ``s`` seconds after the proxy read it (latency, not a bandwidth limit:
  chunks are timestamped on arrival and a separate writer delivers them in order when due). A
  new delay applies to chunks read after the call; order is always preserved, so after a
  decrease later chunks may wait for earlier ones. The other direction is not affected.
  ``heal()`` removes cuts only; ``clear_delays()`` (or ``delay(..., 0)``) removes delays.
* A connection closed by either end (EOF or error) is closed at once on the other side too; a
  close is not delayed and not held, and bytes the proxy still holds or delays on it are
  discarded (pysyncobj never half-closes: it closes only connections it has given up on). If node ``j`` is down, a connection on a listener
  ``(i, j)`` is accepted and then reset (the proxy cannot refuse before accepting); with a
  cluster secret pysyncobj never counts such a connection as connected.
* Clients (gRPC ports, Status) are not proxied: an isolated node stays reachable by clients,
  as with ``netns``.

The proxy runs an asyncio event loop in one background thread owned by the ``ProxyNetwork``;
every fault method returns after the change is in force (connections already reset).
``teardown()`` is idempotent, closes every listener and connection, stops the loop and joins
the thread; it also runs after a failed ``setup()``.

Needs no Debian package (standard library only).
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import struct
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Sequence

__all__ = ["ProxyError", "ProxyNetwork", "available"]

RAFT_DIAL_ENV = "LIGHTHOUSE_CLUSTER_RAFT_DIAL"
_CALL_TIMEOUT_S = 10.0
_CONNECT_TIMEOUT_S = 2.0
_CHUNK = 64 * 1024
_QUEUE_CHUNKS = 64          # chunks read ahead per direction before the proxy stops reading


class ProxyError(RuntimeError):
    """The proxy could not do what was asked; the message says why."""


def available() -> tuple[bool, str]:
    """Whether this backend can run here (it always can: loopback TCP, no privileges)."""
    return True, "userspace TCP proxy on loopback"


def _reset(writer: asyncio.StreamWriter | None) -> None:
    """Close with an RST (SO_LINGER 0), dropping anything unsent."""
    if writer is None:
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


class _Link:
    """One proxied connection: node ``client`` dialed node ``upstream`` through the listener
    ``(client, upstream)``."""

    def __init__(self, net: "ProxyNetwork", client: int, upstream: int, c_reader: asyncio.StreamReader,
                 c_writer: asyncio.StreamWriter, u_reader: asyncio.StreamReader,
                 u_writer: asyncio.StreamWriter) -> None:
        self.net = net
        self.client, self.upstream = client, upstream
        self.writers = (c_writer, u_writer)
        # Direction (src, dst) -> an event set while bytes may flow that way.
        self.open = {(client, upstream): asyncio.Event(), (upstream, client): asyncio.Event()}
        self.tasks: list[asyncio.Task[None]] = []
        self.closed = False
        loop = asyncio.get_running_loop()
        for (src, dst), reader, writer in (((client, upstream), c_reader, u_writer),
                                           ((upstream, client), u_reader, c_writer)):
            queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(_QUEUE_CHUNKS)
            self.tasks.append(loop.create_task(self._read(src, dst, reader, queue)))
            self.tasks.append(loop.create_task(self._write(src, dst, writer, queue)))

    @property
    def pair(self) -> frozenset[int]:
        return frozenset((self.client, self.upstream))

    async def _read(self, src: int, dst: int, reader: asyncio.StreamReader,
                    queue: asyncio.Queue[tuple[float, bytes]]) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                data = await reader.read(_CHUNK)
                if not data:
                    break
                await queue.put((loop.time() + self.net._delays.get((src, dst), 0.0), data))
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self.close()

    async def _write(self, src: int, dst: int, writer: asyncio.StreamWriter,
                     queue: asyncio.Queue[tuple[float, bytes]]) -> None:
        loop = asyncio.get_running_loop()
        gate = self.open[(src, dst)]
        try:
            while True:
                due, data = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                await gate.wait()
                writer.write(data)
                await writer.drain()
                self.net._count(f"bytes {src}->{dst}", len(data))
        except (OSError, ConnectionError):
            pass
        finally:
            self.close()

    def apply(self, blocked: set[tuple[int, int]]) -> None:
        for direction, gate in self.open.items():
            if direction in blocked:
                gate.clear()
            else:
                gate.set()

    def close(self, reset: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        self.net._links.discard(self)
        current = asyncio.current_task()
        for t in self.tasks:
            if t is not current:
                t.cancel()
        for w in self.writers:
            if reset:
                _reset(w)
            else:
                w.transport.abort()


@dataclass
class ProxyNetwork:
    """Loopback TCP proxies between ``nodes`` nodes; see the module docstring.

    Nodes are numbered ``0 .. nodes-1`` (the ``LocalCluster`` member index). Use as a context
    manager, or call ``setup()`` and always ``teardown()``.
    """

    name: ClassVar[str] = "proxy"
    nodes: int
    host: str = "127.0.0.1"             # where the listeners bind (the nodes dial it)
    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    _blocked: set[tuple[int, int]] = field(init=False, default_factory=set)
    _delays: dict[tuple[int, int], float] = field(init=False, default_factory=dict)
    _targets: list[tuple[str, int] | None] = field(init=False, default_factory=list)
    _peer_ids: list[str] | None = field(init=False, default=None)
    _ports: dict[tuple[int, int], int] = field(init=False, default_factory=dict)
    _servers: list[asyncio.base_events.Server] = field(init=False, default_factory=list)
    _links: set[_Link] = field(init=False, default_factory=set)
    _stats: Counter[str] = field(init=False, default_factory=Counter)
    _loop: asyncio.AbstractEventLoop | None = field(init=False, default=None)
    _thread: threading.Thread | None = field(init=False, default=None)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.nodes > 200:
            raise ValueError("nodes must be 1..200")
        self._targets = [None] * self.nodes

    # -- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> "ProxyNetwork":
        return self.setup()

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def setup(self) -> "ProxyNetwork":
        """Start the proxy thread and bind one listener per ordered pair of nodes. On failure
        everything started so far is stopped and ``ProxyError`` is raised."""
        if self._loop is not None:
            raise ProxyError("setup() already ran")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"jepsen_like-proxy-{self.tag}",
                                        daemon=True)
        self._thread.start()
        try:
            self._call(self._listen_all())
        except BaseException:
            self.teardown()
            raise
        return self

    async def _listen_all(self) -> None:
        for i in range(self.nodes):
            for j in range(self.nodes):
                if i == j:
                    continue
                server = await asyncio.start_server(
                    lambda r, w, i=i, j=j: self._accept(i, j, r, w), self.host, 0, reuse_address=True)
                self._servers.append(server)
                self._ports[(i, j)] = server.sockets[0].getsockname()[1]

    def teardown(self) -> None:
        """Close every listener and connection, stop the loop and join its thread
        (idempotent). Raises ``ProxyError`` if the thread does not stop."""
        loop, thread = self._loop, self._thread
        if loop is None:
            return
        if thread is not None and thread.is_alive() and not loop.is_closed():
            try:
                self._call(self._close_all())
            except ProxyError:
                pass
            loop.call_soon_threadsafe(loop.stop)
            thread.join(_CALL_TIMEOUT_S)
            if thread.is_alive():
                raise ProxyError(f"proxy thread {thread.name} did not stop")
        if not loop.is_closed():
            loop.close()
        self._loop = self._thread = None
        self._servers.clear()
        self._links.clear()
        with self._lock:
            self._blocked.clear()
            self._delays.clear()

    async def _close_all(self) -> None:
        for server in self._servers:
            server.close()
        for link in list(self._links):
            link.close(reset=True)
        for server in self._servers:
            await server.wait_closed()
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def thread(self) -> threading.Thread | None:
        """The proxy's thread while it runs (for leak checks)."""
        return self._thread

    # -- wiring -------------------------------------------------------------------------------

    def listen_address(self, i: int, j: int) -> str:
        """Where node ``i`` connects to reach node ``j`` (valid after ``setup()``)."""
        if (self._check(i), self._check(j)) not in self._ports:
            raise ProxyError("setup() has not run" if i != j else "a node has no listener to itself")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self._ports[(i, j)]}"

    @property
    def listen_ports(self) -> list[int]:
        return sorted(self._ports.values())

    def set_targets(self, raft_addresses: Sequence[str], node_ids: Sequence[str] | None = None) -> None:
        """Node ``j`` listens for Raft at ``raft_addresses[j]`` (``host:port``); ``node_ids``
        (default ``n1, n2, ...`` as in ``LocalCluster``) name the nodes in ``--raft-dial``."""
        if len(raft_addresses) != self.nodes:
            raise ValueError(f"need {self.nodes} Raft addresses, got {len(raft_addresses)}")
        targets: list[tuple[str, int] | None] = []
        for a in raft_addresses:
            host, port = a.rsplit(":", 1)
            targets.append((host.strip("[]"), int(port)))
        self._targets = targets
        ids = list(node_ids) if node_ids is not None else [f"n{k + 1}" for k in range(self.nodes)]
        if len(ids) != self.nodes:
            raise ValueError(f"need {self.nodes} node ids, got {len(ids)}")
        self._peer_ids = ids

    def dial_map(self, i: int) -> dict[str, str]:
        """Node ``i``'s ``--raft-dial`` overrides: peer id -> proxy listener (i -> peer)."""
        if self._peer_ids is None:
            raise ProxyError("no targets: call set_targets() or wire() first")
        return {self._peer_ids[j]: self.listen_address(i, j) for j in range(self.nodes) if j != i}

    def dial_args(self, i: int) -> list[str]:
        """``serve`` flags that make node ``i`` reach every peer through the proxy."""
        args: list[str] = []
        for peer_id, address in self.dial_map(i).items():
            args += ["--raft-dial", f"{peer_id}={address}"]
        return args

    def dial_env(self, i: int) -> dict[str, str]:
        """The same as an environment variable for ``serve``."""
        return {RAFT_DIAL_ENV: " ".join(f"{k}={v}" for k, v in self.dial_map(i).items())}

    def launch_prefix(self, i: int) -> list[str]:
        """A ``LocalCluster.launch_prefix`` that wires node ``i`` through the proxy (``env``
        execs the node, so signals still reach it)."""
        return ["env", *(f"{k}={v}" for k, v in self.dial_env(i).items())]

    def wire(self, cluster: Any) -> Any:
        """Route a ``LocalCluster``'s Raft traffic through this proxy; call before
        ``cluster.start()``. Any existing ``launch_prefix`` is kept (after ours). Returns the
        cluster."""
        self.attach(cluster)
        previous = cluster.launch_prefix
        cluster.launch_prefix = lambda i: [*self.launch_prefix(i), *(previous(i) if previous else [])]
        return cluster

    # The two hooks of ``jepsen_like.network.NetworkBackend``: ``LocalCluster(**net.cluster_kwargs())``,
    # then ``net.attach(cluster)`` before any node starts (together: what ``wire`` does).

    def cluster_kwargs(self) -> dict[str, Any]:
        """``LocalCluster`` keyword arguments: the per-node launch prefix (``--raft-dial`` through
        the environment; it needs ``attach()`` before the nodes start)."""
        return {"launch_prefix": self.launch_prefix}

    def attach(self, cluster: Any) -> None:
        """Take the upstream Raft addresses and node ids from ``cluster.peers``."""
        if cluster.nodes != self.nodes:
            raise ValueError(f"cluster has {cluster.nodes} nodes, proxy {self.nodes}")
        if cluster.hosts is not None and any(h != cluster.hosts[0] for h in cluster.hosts):
            raise ValueError("the proxy expects every node on one host")
        self.set_targets([p.raft_address for p in cluster.peers], [p.node_id for p in cluster.peers])

    # -- faults -------------------------------------------------------------------------------

    def isolate(self, node: int) -> None:
        """Sever ``node`` from every other node, both ways (clients still reach it)."""
        self.partition([node], [j for j in range(self.nodes) if j != node])

    def partition(self, *sides: Iterable[int]) -> None:
        """Sever nodes on different sides from each other, both ways (adds to existing cuts).
        Nodes listed on no side keep talking to everyone."""
        groups = [[self._check(n) for n in s] for s in sides]
        with self._lock:
            for gi, a_side in enumerate(groups):
                for gj, b_side in enumerate(groups):
                    if gi != gj:
                        self._blocked.update((a, b) for a in a_side for b in b_side)
        self._apply()

    def cut(self, src: int, dst: int) -> None:
        """Hold every byte ``src`` sends to ``dst`` (one-way; see the module docstring for
        what that does to a TCP connection). With ``(dst, src)`` also cut, the pair is severed."""
        if self._check(src) == self._check(dst):
            raise ValueError("cannot cut a node from itself")
        with self._lock:
            self._blocked.add((src, dst))
        self._apply()

    def heal(self) -> None:
        """Remove every cut (delays stay)."""
        with self._lock:
            self._blocked.clear()
        self._apply()

    @property
    def blocked(self) -> frozenset[tuple[int, int]]:
        """The directed (src, dst) node pairs currently cut."""
        with self._lock:
            return frozenset(self._blocked)

    def delay(self, src: int, dst: int, seconds: float) -> None:
        """Deliver bytes from ``src`` to ``dst`` ``seconds`` late (0 removes the delay)."""
        if self._check(src) == self._check(dst):
            raise ValueError("a node has no link to itself")
        if seconds < 0:
            raise ValueError("delay must be >= 0")
        with self._lock:
            if seconds:
                self._delays[(src, dst)] = float(seconds)
            else:
                self._delays.pop((src, dst), None)

    def clear_delays(self) -> None:
        with self._lock:
            self._delays.clear()

    @property
    def delays(self) -> dict[tuple[int, int], float]:
        with self._lock:
            return dict(self._delays)

    def stats(self) -> dict[str, int]:
        """Counters: ``accepted i->j``, ``refused i->j`` (severed pair), ``failed i->j``
        (upstream unreachable), ``reset i-j`` (connections reset by a fault), ``bytes s->d``."""
        with self._lock:
            return dict(self._stats)

    def open_connections(self) -> int:
        return self._call(self._count_links())

    async def _count_links(self) -> int:
        return len(self._links)

    # -- internals ------------------------------------------------------------------------------

    def _check(self, i: int) -> int:
        if not 0 <= i < self.nodes:
            raise ValueError(f"no node {i} (have 0..{self.nodes - 1})")
        return i

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._stats[key] += n

    def _call(self, coro: Any) -> Any:
        if self._loop is None or self._thread is None or not self._thread.is_alive():
            coro.close()
            raise ProxyError("the proxy is not running (setup() not called or teardown() done)")
        try:
            return asyncio.run_coroutine_threadsafe(coro, self._loop).result(_CALL_TIMEOUT_S)
        except TimeoutError as e:
            raise ProxyError(f"proxy thread did not answer within {_CALL_TIMEOUT_S}s") from e

    def _apply(self) -> None:
        self._call(self._apply_async())

    async def _apply_async(self) -> None:
        blocked = self.blocked
        for link in list(self._links):
            if (link.client, link.upstream) in blocked and (link.upstream, link.client) in blocked:
                self._count(f"reset {min(link.pair)}-{max(link.pair)}")
                link.close(reset=True)
            else:
                link.apply(set(blocked))

    def _severed(self, a: int, b: int) -> bool:
        blocked = self.blocked
        return (a, b) in blocked and (b, a) in blocked

    async def _accept(self, i: int, j: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._severed(i, j):
            self._count(f"refused {i}->{j}")
            _reset(writer)
            return
        target = self._targets[j]
        u_writer = None
        try:
            if target is None:
                raise OSError(f"no target for node {j}")
            u_reader, u_writer = await asyncio.wait_for(asyncio.open_connection(*target), _CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError):
            self._count(f"failed {i}->{j}")
            _reset(writer)
            return
        if self._severed(i, j):  # a fault arrived while connecting
            self._count(f"refused {i}->{j}")
            _reset(writer)
            _reset(u_writer)
            return
        self._count(f"accepted {i}->{j}")
        link = _Link(self, i, j, reader, writer, u_reader, u_writer)
        link.apply(set(self.blocked))
        self._links.add(link)
