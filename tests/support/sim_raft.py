"""A deterministic Raft cluster: real ``RaftNode``s on a simulated network and a fake clock.

Each node is built the way the lighthouse builds it (``RaftNode`` with its ``RaftSettings``, the
replicated ``QuorumStateMachine``), with three things swapped underneath, all from here, none in
the production code:

* **the clock**: every module of pysyncobj and of ``lighthouse_cluster.raft`` that imported
  pysyncobj's ``monotonic`` reads ``SimClock`` instead, and every ``random`` they use is one
  ``random.Random(seed)``: a run is a function of its seed;
* **the wire**: ``SimTransport`` (pysyncobj's ``Transport`` interface, plus the few attributes of
  ``TCPTransport`` that ``pysyncobj_internals`` reads: ``_connections``, ``_lastConnectAttempt``,
  ``_shouldConnect``) carries each message, pickled, through ``SimNetwork``, which delays, drops,
  partitions, filters and (with jitter) reorders it. A connection behaves as pysyncobj's
  ``TcpConnection`` does where the Raft layer notices: it is dialed by the greater address and
  re-dialed every ``connectionRetryTime``, a crashed peer's end closes at once (its kernel
  closes it), and a connection that has read nothing for ``connectionTimeout`` is dropped on its
  next send or read (pysyncobj checks before it sends or reads);
* **the tick thread**: ``autoTick`` is off and ``SimCluster`` calls each node's ``doTick`` as its
  tick thread would: when the wait it computed ends (``adaptive_tick``: the poller's timeout),
  when a message arrives, or when it was woken (pysyncobj's pipe notifier). A node can stall:
  its tick then starts late, with what arrived meanwhile still unread (``SimCluster.stall``).

What stays with real sockets: TCP itself (connects stuck in SYN-SENT, resets, the poller's read
events, cipher and compression on the byte stream, ``--raft-dial``). The journal is in memory,
or, with ``data_dir``, on real files (``DurableJournal``), which ``SimCluster.restart`` starts a
crashed member from.

The single coupling to the node's class: ``replication.LighthouseSyncObj``, the class
``RaftNode`` instantiates, is replaced for the duration of the cluster by a factory that adds the
simulated transport (as ``transportClass``: it plays ``HostTransport``'s part for the host,
handing every message it sends to ``outgoing_message`` and every closed connection to
``node_disconnected``), turns ``autoTick`` off and, for a case that switches a mechanism off,
builds a test-only subclass instead (``node_class``: one that names another class for one of its
extensions, ``extension_classes``) or passes a constructor argument (``syncobj_kwargs``).
"""

from __future__ import annotations

import heapq
import itertools
import pickle
import random
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pysyncobj.monotonic
import pysyncobj.syncobj
from pysyncobj.transport import Transport

from lighthouse_cluster.core import codec
from lighthouse_cluster.core.codec import EnableSchema
from lighthouse_cluster.core.state_machine import QuorumStateMachine
from lighthouse_cluster.raft import replication
from lighthouse_cluster.raft.host import TickPoller
from lighthouse_cluster.raft.pysyncobj_internals import CONNECTION_STATE, LAST_READ_ATTR
from lighthouse_cluster.raft.replication import RaftNode, RaftSettings, ReplicatedState

START_S = 1000.0  # the fake clock's first reading (no deadline of 0.0 falls due by accident)
# How much later than its timeout a poll returns (a real one is never exactly on time; pysyncobj
# acts on a deadline only once the clock is past it).
POLL_OVERSHOOT_S = 1e-5
# Ticks of one node at one instant beyond which the run is a livelock, not progress.
MAX_TICKS_AT_ONE_INSTANT = 1000


class SimClock:
    """The fake monotonic clock every simulated node reads."""

    def __init__(self, start: float = START_S) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


# -- the wire -------------------------------------------------------------------------------------


@dataclass(order=True)
class _InFlight:
    arrival: float
    seq: int
    src: str = field(compare=False)
    dst: str = field(compare=False)
    payload: bytes | None = field(compare=False)  # None: the sender's end of the connection closed
    connection: int = field(compare=False, default=0)  # which connection between the two carried it


@dataclass(frozen=True)
class Sent:
    """One message a node put on the wire (delivered or not): when, from, to, its type, its keys."""

    at: float
    src: str
    dst: str
    kind: str
    keys: frozenset[str]


def _kind(message: Any) -> str:
    return str(message.get("type")) if isinstance(message, dict) else type(message).__name__


class SimConnection:
    """One end of a simulated connection, with what the Raft layer reads of a ``TcpConnection``:
    ``state`` and the time of its last read (under pysyncobj's attribute name)."""

    def __init__(self, now: float) -> None:
        self.state = CONNECTION_STATE.DISCONNECTED
        self.last_read = now
        self.generation = 0  # which connection between the two nodes this end belongs to
        self._transport: SimTransport | None = None
        self._peer: str = ""

    @property
    def last_read(self) -> float:
        return getattr(self, LAST_READ_ATTR.name)

    @last_read.setter
    def last_read(self, value: float) -> None:
        setattr(self, LAST_READ_ATTR.name, value)

    def disconnect(self) -> None:
        if self._transport is not None:
            self._transport.close(self._peer)


class SimNetwork:
    """Messages between simulated transports: latency (plus jitter, which reorders), loss,
    partitions, one-way filters, and a record of everything sent (``sent``)."""

    def __init__(self, clock: SimClock, rng: random.Random, *, latency_s: float, jitter_s: float) -> None:
        self.clock = clock
        self.rng = rng
        self.latency_s = latency_s
        self.jitter_s = jitter_s
        self.drop_rate = 0.0
        self.transports: dict[str, SimTransport] = {}
        self.down: set[str] = set()  # crashed nodes
        self._groups: list[set[str]] | None = None
        self._filters: list[Callable[[str, str, Any], bool]] = []
        self._inbox: dict[str, list[_InFlight]] = {}
        self._seq = itertools.count()
        self.sent: list[Sent] = []

    # what the tests set
    def partition(self, *groups: Iterable[str]) -> None:
        """Only nodes of the same group reach each other (a node in no group reaches no one)."""
        self._groups = [set(g) for g in groups]

    def heal(self) -> None:
        """No partition, no filter, no loss."""
        self._groups = None
        self._filters.clear()
        self.drop_rate = 0.0

    def drop_if(self, predicate: Callable[[str, str, Any], bool]) -> Callable[[str, str, Any], bool]:
        """Drop every message ``(src, dst, message)`` for which ``predicate`` holds (until
        ``heal`` or ``allow``)."""
        self._filters.append(predicate)
        return predicate

    def allow(self, predicate: Callable[[str, str, Any], bool]) -> None:
        self._filters.remove(predicate)

    def reachable(self, src: str, dst: str) -> bool:
        if src in self.down or dst in self.down:
            return False
        return self._groups is None or any(src in g and dst in g for g in self._groups)

    # what the transports call
    def new_connection(self) -> int:
        return next(self._seq)

    def carry(self, src: str, dst: str, message: Any, connection: int = 0) -> None:
        self.sent.append(Sent(self.clock.now, src, dst, _kind(message),
                              frozenset(message) if isinstance(message, dict) else frozenset()))
        if not self.reachable(src, dst) or any(f(src, dst, message) for f in self._filters):
            return
        if self.drop_rate and self.rng.random() < self.drop_rate:
            return
        self._post(src, dst, pickle.dumps(message), connection)

    def close(self, src: str, dst: str, connection: int) -> None:
        """``src``'s end of ``connection`` to ``dst`` closed: ``dst`` reads the end if reachable."""
        if self.reachable(src, dst):
            self._post(src, dst, None, connection)

    def _post(self, src: str, dst: str, payload: bytes | None, connection: int) -> None:
        delay = self.latency_s + (self.rng.uniform(0.0, self.jitter_s) if self.jitter_s else 0.0)
        heapq.heappush(self._inbox.setdefault(dst, []), _InFlight(self.clock.now + delay, next(self._seq), src, dst,
                                                                  payload, connection))

    def next_arrival(self, dst: str) -> float | None:
        inbox = self._inbox.get(dst)
        return inbox[0].arrival if inbox else None

    def arrived(self, dst: str) -> list[_InFlight]:
        """Everything that has reached ``dst`` by now, in arrival order (removed from the wire)."""
        inbox = self._inbox.get(dst, [])
        out = []
        while inbox and inbox[0].arrival <= self.clock.now:
            out.append(heapq.heappop(inbox))
        return out

    def discard_inbox(self, dst: str) -> None:
        self._inbox.pop(dst, None)

    def count(self, kind: str, *, src: str | None = None, dst: str | None = None, since: float = float("-inf"),
              key: str | None = None) -> int:
        """How many messages of ``kind`` were sent (from ``src``, to ``dst``, at ``since`` or later,
        carrying ``key``)."""
        return sum(1 for s in self.sent if s.kind == kind and s.at >= since and (src is None or s.src == src)
                   and (dst is None or s.dst == dst) and (key is None or key in s.keys))


class SimTransport(Transport):
    """pysyncobj's ``Transport`` on a ``SimNetwork`` (see the module docstring)."""

    def __init__(self, network: SimNetwork, syncObj: Any, selfNode: Any, otherNodes: Any) -> None:  # noqa: N803
        super().__init__(syncObj, selfNode, otherNodes)
        self.network = network
        self._syncObj = syncObj
        self._selfNode = selfNode
        self.address: str = selfNode.address
        self._nodes: dict[str, Any] = {}
        self._connections: dict[Any, SimConnection] = {}
        self._lastConnectAttempt: dict[Any, float] = {}
        network.transports[self.address] = self
        syncObj.addOnTickCallback(self._onTick)
        for node in otherNodes:
            self.addNode(node)

    # pysyncobj's interface
    def addNode(self, node: Any) -> None:  # noqa: N802
        self._nodes[node.address] = node
        conn = SimConnection(self.network.clock.now)
        conn._transport, conn._peer = self, node.address
        self._connections[node] = conn

    def dropNode(self, node: Any) -> None:  # noqa: N802
        if node in self._connections:
            self.close(node.address, notify=False)
            del self._connections[node]
        self._nodes.pop(node.address, None)
        self._lastConnectAttempt.pop(node, None)

    def send(self, node: Any, message: Any) -> bool:
        message = self._syncObj.outgoing_message(node, message)  # the host's message-out hooks, as HostTransport
        conn = self._connections.get(node)
        if conn is None or conn.state != CONNECTION_STATE.CONNECTED:
            return False
        if self._silent_too_long(conn):
            self.close(node.address)
            return False
        self.network.carry(self.address, node.address, message, conn.generation)
        return True

    def destroy(self) -> None:
        for node in list(self._connections):
            self.close(node.address, notify=False)

    # what TCPTransport has and pysyncobj_internals reads
    def _shouldConnect(self, node: Any) -> bool:  # noqa: N802
        return self.address > node.address and node.address in self._nodes

    def _onTick(self) -> None:  # noqa: N802 -- dial who this node dials, at most every connectionRetryTime
        for node in list(self._connections):
            self._dial(node)

    def _dial(self, node: Any) -> None:
        conn = self._connections.get(node)
        if conn is None or conn.state != CONNECTION_STATE.DISCONNECTED or not self._shouldConnect(node):
            return
        now = self.network.clock.now
        last = self._lastConnectAttempt.get(node)
        if last is not None and now - last < self._syncObj.conf.connectionRetryTime:
            return
        self._lastConnectAttempt[node] = now
        peer = self.network.transports.get(node.address)
        if peer is None or not self.network.reachable(self.address, node.address):
            return  # no answer: tried again after connectionRetryTime
        generation = self.network.new_connection()
        peer._accept(self.address, generation)
        self._connected(node, generation)

    def _accept(self, address: str, generation: int) -> None:
        node = self._nodes.get(address)
        if node is not None:
            conn = self._connections[node]
            if conn.state == CONNECTION_STATE.CONNECTED:  # the old connection's end, unread yet: gone
                self.close(address)
            self._connected(node, generation)

    def _connected(self, node: Any, generation: int) -> None:
        conn = self._connections[node]
        conn.state, conn.generation = CONNECTION_STATE.CONNECTED, generation
        conn.last_read = self.network.clock.now
        self._onNodeConnected(node)

    def _silent_too_long(self, conn: SimConnection) -> bool:
        return self.network.clock.now - conn.last_read > self._syncObj.conf.connectionTimeout

    def close(self, address: str, *, notify: bool = True) -> None:
        """This end of the connection to ``address`` closes (the other end reads its end)."""
        node = self._nodes.get(address)
        conn = self._connections.get(node) if node is not None else None
        if conn is None or conn.state == CONNECTION_STATE.DISCONNECTED:
            return
        conn.state = CONNECTION_STATE.DISCONNECTED
        self.network.close(self.address, address, conn.generation)
        if notify:
            self._onNodeDisconnected(node)
            self._syncObj.node_disconnected(node)
            self._dial(node)

    def deliver(self, item: _InFlight) -> None:
        """A message (or the end of the connection) from ``item.src`` is read, in this node's poll."""
        node = self._nodes.get(item.src)
        conn = self._connections.get(node) if node is not None else None
        if conn is None or conn.state != CONNECTION_STATE.CONNECTED or conn.generation != item.connection:
            return  # bytes of a connection closed since
        if item.payload is None or self._silent_too_long(conn):
            self.close(item.src)
            return
        conn.last_read = self.network.clock.now
        self._onMessageReceived(node, pickle.loads(item.payload))


# -- the tick thread --------------------------------------------------------------------------------


class SimPoller:
    """pysyncobj's poller for a simulated node: ``poll(timeout)`` reads what has arrived and notes
    when the wait would end; it never blocks."""

    def __init__(self) -> None:
        self.node: SimNode | None = None
        self.wake_at = START_S
        self.woken = False

    def subscribe(self, descr: Any, callback: Any, eventMask: int) -> None:  # noqa: N803
        pass

    def unsubscribe(self, descr: Any) -> None:
        pass

    def poll(self, timeout: float) -> None:
        node = self.node
        if node is None:
            return
        node.read_arrived()
        self.wake_at = node.network.clock.now + max(0.0, timeout) + POLL_OVERSHOOT_S


class SimNotifier:
    """pysyncobj's pipe notifier for a simulated node: ``notify()`` ends its wait. pysyncobj
    builds it on the poller as the host adopted it (``TickPoller``, around the ``SimPoller``)."""

    def __init__(self, poller: Any, callback: Any = None) -> None:
        self.poller: SimPoller = poller.inner if isinstance(poller, TickPoller) else poller

    def notify(self) -> None:
        self.poller.woken = True


@dataclass
class SimNode:
    """One simulated member: its ``RaftNode`` (``raft``), the SyncObj beneath (``syncobj``)."""

    address: str
    raft: RaftNode
    syncobj: Any
    poller: SimPoller
    network: SimNetwork
    index: int
    alive: bool = True
    stall_s: float = 0.0  # the next tick starts this much late
    paused_until: float | None = None
    ticks: int = 0

    def read_arrived(self) -> None:
        transport = self.network.transports[self.address]
        for item in self.network.arrived(self.address):
            transport.deliver(item)

    def next_event(self) -> float | None:
        if not self.alive:
            return None
        if self.paused_until is not None:
            return self.paused_until
        if self.poller.woken:
            return self.network.clock.now
        arrival = self.network.next_arrival(self.address)
        return self.poller.wake_at if arrival is None else min(self.poller.wake_at, arrival)

    @property
    def role(self) -> replication.Role:
        return self.raft.role

    @property
    def term(self) -> int:
        return self.raft.term


class SimCluster:
    """``size`` ``RaftNode``s on a ``SimNetwork``, stepped deterministically (module docstring).

    A context manager: the clock, the randomness and the node class are swapped in on entry and
    restored on exit. ``node_class``: the SyncObj class each node builds instead of the
    production one (a test-only subclass that switches a mechanism off); ``syncobj_kwargs``:
    constructor arguments added to the production ones."""

    def __init__(self, size: int = 3, *, seed: int = 0, settings: RaftSettings = RaftSettings(),
                 node_class: type | None = None, syncobj_kwargs: dict[str, Any] | None = None,
                 schema: int = codec.SCHEMA_VERSION, latency_s: float = 0.0005, jitter_s: float = 0.0,
                 joining: Iterable[int] = (), data_dir: Path | None = None) -> None:
        self.size = size
        self.settings = settings
        self.schema = schema
        self.clock = SimClock()
        self.rng = random.Random(seed)
        self.network = SimNetwork(self.clock, random.Random(seed + 1), latency_s=latency_s, jitter_s=jitter_s)
        self._node_class = node_class or replication.LighthouseSyncObj
        self._syncobj_kwargs = dict(syncobj_kwargs or {})
        # Nodes (by index) built as a member joining a running cluster with an empty journal
        # (``RaftNode(hold_elections_until_leader=True)``).
        self._joining = frozenset(joining)
        # Each node's Raft files in data_dir / "n<index>" (none: an in-memory journal, no restarts).
        self._data_dir = data_dir
        self._undo: list[tuple[Any, str, Any]] = []
        self._pollers: list[SimPoller] = []
        self._built: list[Any] = []
        self.nodes: list[SimNode] = []
        self.addresses = [f"10.0.0.{i + 1}:4000" for i in range(size)]

    # -- setting up ---------------------------------------------------------------------------------

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def __enter__(self) -> SimCluster:
        real_clock = pysyncobj.monotonic.monotonic
        for name, module in list(sys.modules.items()):
            if module is None or not (name.startswith("pysyncobj") or name.startswith("lighthouse_cluster.raft")):
                continue
            for attr, value in list(vars(module).items()):
                if value is real_clock:
                    self._patch(module, attr, self.clock)
                elif value is random:
                    self._patch(module, attr, self.rng)

        def make_poller(*_args: Any) -> SimPoller:
            poller = SimPoller()
            self._pollers.append(poller)
            return poller

        self._patch(pysyncobj.syncobj, "createPoller", make_poller)
        self._patch(pysyncobj.syncobj, "PipeNotifier", SimNotifier)
        self._patch(pysyncobj.syncobj, "PIPE_NOTIFIER_ENABLED", True)
        network, node_class, extra, built = self.network, self._node_class, self._syncobj_kwargs, self._built

        def make_syncobj(*args: Any, conf: Any, **kwargs: Any) -> Any:
            conf.autoTick = False
            syncobj = node_class(*args, conf=conf, transportClass=lambda so, me, others: SimTransport(
                network, so, me, others), **{**kwargs, **extra})
            built.append(syncobj)
            return syncobj

        self._patch(replication, "LighthouseSyncObj", make_syncobj)
        try:
            for i, address in enumerate(self.addresses):
                self._build(i, address)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _build(self, index: int, address: str) -> SimNode:
        peers = [a for a in self.addresses if a != address]
        data_dir = self._data_dir / f"n{index + 1}" if self._data_dir is not None else None
        raft = RaftNode(address, peers, ReplicatedState(QuorumStateMachine(self.schema)), settings=self.settings,
                        hold_elections_until_leader=index in self._joining, data_dir=data_dir)
        poller = self._pollers.pop()
        node = SimNode(address, raft, self._built.pop(), poller, self.network, index)
        poller.node = node
        poller.wake_at = self.clock.now
        if index < len(self.nodes):
            self.nodes[index] = node
        else:
            self.nodes.append(node)
        return node

    def __exit__(self, *exc: Any) -> None:
        while self._undo:
            owner, name, value = self._undo.pop()
            setattr(owner, name, value)

    # -- running --------------------------------------------------------------------------------------

    @property
    def now(self) -> float:
        return self.clock.now

    def step(self, until: float) -> bool:
        """Run the earliest event due at or before ``until``; False when there is none (the clock
        is then at ``until``)."""
        best: tuple[float, int] | None = None
        for node in self.nodes:
            at = node.next_event()
            if at is not None and at <= until and (best is None or (at, node.index) < best):
                best = (at, node.index)
        if best is None:
            self.clock.now = max(self.clock.now, until)
            return False
        node = self.nodes[best[1]]
        self.clock.now = max(self.clock.now, best[0])
        if node.paused_until is not None:
            node.paused_until = None  # the stall is over: the tick starts, nothing read since
        else:
            timed_out = not node.poller.woken and best[0] >= node.poller.wake_at
            node.poller.woken = False
            node.read_arrived()  # the wait ends with what arrived read
            if node.stall_s > 0.0 and timed_out:
                node.paused_until, node.stall_s = self.clock.now + node.stall_s, 0.0
                return True
        node.ticks += 1
        node.syncobj.doTick(node.syncobj.conf.autoTickPeriod)
        return True

    def run_for(self, seconds: float) -> None:
        self._run(self.clock.now + seconds, lambda: False)

    def run_until(self, what: str, cond: Callable[[], Any], timeout_s: float) -> Any:
        """Run until ``cond()`` is truthy (checked after every tick) and return its value; fail
        with ``what`` after ``timeout_s`` simulated seconds."""
        value = cond()
        if value:
            return value
        end = self.clock.now + timeout_s
        value = self._run(end, cond)
        if not value:
            raise AssertionError(f"not within {timeout_s} simulated s: {what} ({self.describe()})")
        return value

    def _run(self, end: float, cond: Callable[[], Any]) -> Any:
        instant, ticks_at_instant = self.clock.now, 0
        while self.step(end):
            if self.clock.now == instant:
                ticks_at_instant += 1
                if ticks_at_instant > MAX_TICKS_AT_ONE_INSTANT * self.size:
                    raise AssertionError(f"livelock: {ticks_at_instant} ticks at t={instant} ({self.describe()})")
            else:
                instant, ticks_at_instant = self.clock.now, 0
            value = cond()
            if value:
                return value
        return cond()

    def describe(self) -> str:
        return "; ".join(f"{n.address} {n.role.value if n.alive else 'down'} term {n.term}"
                         for n in self.nodes)

    # -- reading ---------------------------------------------------------------------------------------

    @property
    def live(self) -> list[SimNode]:
        return [n for n in self.nodes if n.alive]

    def leader(self, among: list[SimNode] | None = None) -> SimNode | None:
        """The live node (of ``among``, default all) that leads the highest term among them,
        known as leader to every one of them in that term; None otherwise."""
        live = [n for n in (self.live if among is None else among) if n.alive]
        top = max(n.term for n in live)
        leaders = [n for n in live if n.raft.is_leader and n.term == top]
        if len(leaders) != 1:
            return None
        leader = leaders[0]
        if all(n.raft.leader_address == leader.address for n in live if n.term == top):
            return leader
        return None

    def elect(self, timeout_s: float = 5.0) -> SimNode:
        return self.run_until("one leader known to every live node", self.leader, timeout_s)

    def followers(self, leader: SimNode) -> list[SimNode]:
        return [n for n in self.live if n is not leader]

    def node(self, address: str) -> SimNode:
        return next(n for n in self.nodes if n.address == address)

    def terms(self) -> list[int]:
        return [n.term for n in self.nodes]

    # -- acting -----------------------------------------------------------------------------------------

    def submit(self, node: SimNode, command: codec.Command, timeout_s: float = 5.0) -> Any:
        """``command`` submitted on ``node``; its result once applied there (fails on an error)."""
        out: list[tuple[Any, Any]] = []
        node.raft.submit(command, lambda result, error: out.append((result, error)))
        self.run_until(f"{type(command).__name__} applied on {node.address}", lambda: out, timeout_s)
        result, error = out[0]
        assert error is None, error
        return result

    def enable_schema(self, leader: SimNode) -> None:
        """What a leader does once every member runs this version: the cluster enables its schema
        (then a leader may quiesce, and the members know their cluster)."""
        self.submit(leader, EnableSchema(version=self.schema))
        self.run_until("every node applied the schema",
                       lambda: all(n.raft.last_applied >= leader.raft.commit_index for n in self.live), 5.0)

    def crash(self, node: SimNode) -> None:
        """``node``'s process dies: it ticks no more and its kernel closes its connections."""
        transport = self.network.transports[node.address]
        for peer in list(transport._nodes.values()):
            transport.close(peer.address, notify=False)
        node.alive = False
        self.network.down.add(node.address)
        self.network.discard_inbox(node.address)

    def restart(self, node: SimNode) -> SimNode:
        """``node``'s process starts again (crashed first if it is up) from its Raft files: a new
        ``RaftNode`` on the same address and data directory, reached again once its peers re-dial
        it (the greater address dials). Needs ``data_dir``."""
        if self._data_dir is None:
            raise ValueError("SimCluster(data_dir=...) is needed to restart a node from its files")
        if node.alive:
            self.crash(node)
        node.raft.destroy()  # closes its journal file, as the process's exit did
        self.network.down.discard(node.address)
        return self._build(node.index, node.address)

    def stall(self, node: SimNode, seconds: float) -> None:
        """``node``'s tick thread stops for ``seconds`` when its next wait runs to its end (no CPU,
        the GIL held elsewhere): messages that arrive meanwhile wait unread, and its tick starts
        ``seconds`` after it was due."""
        node.stall_s = seconds

    def inject(self, src: SimNode, dst: SimNode, message: dict[str, Any]) -> None:
        """``message`` from ``src`` arrives at ``dst`` (if connected) after the usual latency."""
        transport = self.network.transports[src.address]
        conn = transport._connections.get(transport._nodes.get(dst.address))
        self.network.carry(src.address, dst.address, message, conn.generation if conn is not None else 0)

