"""The leader's liveness streams: ``LighthouseCluster.Watch`` served, deaths declared, peers told.

A replica group's manager keeps one Watch stream open to the Raft leader. Only the serving
leader accepts one: any other node ends it FAILED_PRECONDITION, naming the leader's client
address when it knows it. The first message names the replica (answered ``WatchAccepted``);
every later one is a keep-alive, which counts as the replica's heartbeat. The replica is dead
(``core/liveness.py`` decides) when its stream ends (the client gone, cancelled, an error) or
when its keep-alives stop for the node's ``--liveness-timeout-ms`` (checked every
``CHECK_PERIOD_S``; that stream is then ended UNAVAILABLE, so a live client reconnects). A death
goes to the coordinator (``declare_dead``: the rules' health input, nothing else), and when the
replica is a member of the quorum the trainers run, every other member with an open stream gets
``PeerDied`` on its own stream, so it aborts that quorum's collectives instead of waiting.

A replica declared dead while it was alive (cut off from the leader, or too slow to keep up its
keep-alives) learns it when its stream reconnects: right after ``accepted`` the leader sends it a
``PeerDied`` naming the replica itself and the quorum it was a member of. The other members left
that quorum when they were told; its own collectives of that quorum are stuck (or would complete
with the remains of theirs), so it aborts them and asks for the next quorum at once.

Leadership: when this node stops serving (or serves a new term) every stream is ended
UNAVAILABLE and forgotten without a death; the clients reconnect to the new leader. A new leader
has no streams, so it declares nobody dead before they reconnect: the coordinator's warm-up seeds
a heartbeat for every member of the last quorum, as before streams existed (the grace period).

What is used of the node is ``StreamLeadership`` and of the coordinator ``LivenessRounds``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

import grpc

from lighthouse_cluster.client.discovery import not_leader_metadata
from lighthouse_cluster.core.defaults import WATCH_FIRST_MESSAGE_TIMEOUT_S
from lighthouse_cluster.core.liveness import STREAM_CLOSED, Death, Liveness
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb

if TYPE_CHECKING:
    from lighthouse_cluster.core.quorum import Quorum
    from lighthouse_cluster.server.config import PeerSpec

log = logging.getLogger(__name__)

# How often the serving leader looks for streams whose keep-alives stopped.
CHECK_PERIOD_S = 0.05
# A check that ran this much later than its period excuses the stall (Liveness.excuse_stall): the
# event loop was held, and keep-alives that arrived meanwhile may not be read yet.
STALL_S = 0.05
# With no stream open the check waits for one to open, and runs at least this often.
IDLE_CHECK_PERIOD_S = 1.0
MAX_REPLICA_ID_CHARS = 1024  # as a Quorum call's requester.replica_id
# Declared-dead notices kept for replicas that may come back (a restarted process has a new id,
# so most never do): the oldest are dropped past this many.
MAX_KEPT_DEATH_NOTICES = 4096
# Metric labels of the two kinds of death (Death.reason carries the detail).
STREAM_CLOSED_LABEL = "stream_closed"
KEEPALIVE_TIMEOUT_LABEL = "keepalive_timeout"
# A death learnt from a member's manager server (manager_connections.py), not from a stream.
CONNECTION_LOST_LABEL = "manager_connection_lost"


class LivenessRounds(Protocol):
    """What the streams use of the leader's coordinator (``coordinator.QuorumCoordinator``)."""

    @property
    def serving(self) -> bool: ...

    @property
    def term(self) -> int | None: ...

    def alive(self, replica_id: str) -> None: ...

    def declare_dead(self, replica_id: str, reason: str) -> None: ...

    def running_quorum(self) -> Quorum | None: ...


class RaftLeading(Protocol):
    @property
    def is_leader(self) -> bool: ...

    def note_client_activity(self) -> None: ...


class StreamLeadership(Protocol):
    """What the streams read from their node (``LighthouseNode``)."""

    @property
    def raft(self) -> RaftLeading | None: ...

    @property
    def coordinator(self) -> LivenessRounds | None: ...

    def leader_peer(self) -> PeerSpec | None: ...


class _End(Exception):
    """Ends one stream with a status (raised inside its handler)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(eq=False)
class _Watcher:
    replica_id: str
    stream_id: int
    events: asyncio.Queue[cpb.WatchEvent | _End] = field(default_factory=asyncio.Queue)

    def end(self, code: grpc.StatusCode, message: str) -> None:
        self.events.put_nowait(_End(code, message))


def death_label(death: Death) -> str:
    return STREAM_CLOSED_LABEL if death.reason == STREAM_CLOSED else KEEPALIVE_TIMEOUT_LABEL


class LivenessStreams:
    """The Watch streams of one node (served only while it is the serving leader)."""

    def __init__(self, node: StreamLeadership, node_id: str, timeout_s: float, *,
                 clock: Callable[[], float] = time.monotonic, check_period_s: float = CHECK_PERIOD_S) -> None:
        self._node = node
        self._node_id = node_id
        self._clock = clock
        self._check_period_s = check_period_s
        self.liveness = Liveness(timeout_s)
        self._watchers: dict[str, _Watcher] = {}
        self._ids = itertools.count(1)
        self._term: int | None = None  # the term the open streams were accepted in
        self._task: asyncio.Task[None] | None = None
        self._opened = asyncio.Event()  # a stream opened: the check loop runs every CHECK_PERIOD_S again
        self.stalls_excused = 0
        self.deaths: dict[str, int] = {STREAM_CLOSED_LABEL: 0, KEEPALIVE_TIMEOUT_LABEL: 0, CONNECTION_LOST_LABEL: 0}
        self.notices_sent = 0
        # replica id -> the notice it gets if it opens a stream again (declared dead as a member
        # of a quorum; see the module docstring)
        self._declared_dead: OrderedDict[str, cpb.PeerDied] = OrderedDict()
        self._members_of: tuple[Quorum | None, dict[str, str]] = (None, {})  # see running_members

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._check_loop())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._close_all(grpc.StatusCode.UNAVAILABLE, f"node {self._node_id} is shutting down")

    @property
    def open_streams(self) -> int:
        return len(self._watchers)

    # -- leadership -------------------------------------------------------------------------------

    def _serving_rounds(self) -> LivenessRounds | None:
        raft, rounds = self._node.raft, self._node.coordinator
        if raft is not None and raft.is_leader and rounds is not None and rounds.serving and rounds.term is not None:
            return rounds
        return None

    def _not_leader_message(self) -> str:
        peer = self._node.leader_peer()
        if peer is None:
            return f"node {self._node_id} is not the leader; the leader is unknown (ask LighthouseCluster/Leader)"
        if peer.node_id == self._node_id:
            return f"node {self._node_id} leads but does not serve quorum rounds yet; the leader is {peer.client_address}"
        return f"node {self._node_id} is not the leader; the leader is {peer.node_id} at {peer.client_address}"

    def _not_leader_detail(self) -> tuple[tuple[str, str | bytes], ...]:
        """The typed "not the leader" detail (``discovery.not_leader``) beside the sentence."""
        peer = self._node.leader_peer()
        named = peer is not None and peer.node_id != self._node_id
        term = getattr(self._node.raft, "term", 0)
        return not_leader_metadata(peer.node_id if named and peer else "", peer.client_address if named and peer else "",
                                   term if isinstance(term, int) else 0)

    def leadership_changed(self) -> None:
        """The node saw its role or term change: streams of a term it no longer serves end now."""
        self.check()

    def _close_all(self, code: grpc.StatusCode, message: str) -> None:
        # Forgotten first: their handlers' ends are then no deaths.
        self.liveness.clear()
        self._declared_dead.clear()
        watchers, self._watchers = list(self._watchers.values()), {}
        for w in watchers:
            w.end(code, message)
        if watchers:
            log.info("ended %d liveness streams: %s", len(watchers), message)

    async def _check_loop(self) -> None:
        while True:
            if self.liveness.watching_any():
                slept_from = self._clock()
                await asyncio.sleep(self._check_period_s)
                now = self._clock()
                stall = now - slept_from - self._check_period_s
                if stall >= STALL_S:
                    self.stalls_excused += 1
                    self.liveness.excuse_stall(stall, now)
            else:  # nothing can expire (leadership changes call check() themselves)
                try:
                    await asyncio.wait_for(self._opened.wait(), IDLE_CHECK_PERIOD_S)
                except asyncio.TimeoutError:
                    pass
            self._opened.clear()
            try:
                self.check()
            except Exception:  # noqa: BLE001 -- the check must keep running
                log.exception("liveness check failed")

    def check(self) -> None:
        """Every CHECK_PERIOD_S and on leadership changes: end the streams of a term this node no
        longer serves (no deaths), and declare dead the replicas whose keep-alives stopped."""
        rounds = self._serving_rounds()
        term = rounds.term if rounds is not None else None
        if self._term is not None and term != self._term:
            self._close_all(grpc.StatusCode.UNAVAILABLE,
                            f"node {self._node_id} no longer serves term {self._term}; reconnect to the leader")
        self._term = term
        if rounds is None:
            return
        deaths = self.liveness.expire(self._clock())
        for d in deaths:
            w = self._watchers.pop(d.replica_id, None)
            if w is not None:
                w.end(grpc.StatusCode.UNAVAILABLE, f"replica {d.replica_id} declared dead: {d.reason}")
        if deaths:
            self._declare(deaths, rounds)

    # -- deaths -----------------------------------------------------------------------------------

    def has_stream(self, replica_id: str) -> bool:
        """Whether the replica has a liveness stream open here."""
        return replica_id in self._watchers

    def running_members(self) -> dict[str, str] | None:
        """The running quorum's members (replica id -> manager address) while this node serves
        as leader, else None (what ``manager_connections`` watches)."""
        rounds = self._serving_rounds()
        if rounds is None:
            return None
        running = rounds.running_quorum()
        if running is not self._members_of[0]:  # built once per quorum: it is read every 50 ms
            members = {} if running is None else {m.replica_id: m.address for m in running.participants}
            self._members_of = (running, members)
        return self._members_of[1]

    def declare_dead(self, replica_id: str, reason: str) -> None:
        """A death learnt elsewhere (a member's manager server closed its connection): declared
        as the streams' are (the coordinator, the metric, the other members' notices)."""
        rounds = self._serving_rounds()
        if rounds is not None:
            self._declare([Death(replica_id, reason)], rounds, label=CONNECTION_LOST_LABEL)

    def _declare(self, deaths: list[Death], rounds: LivenessRounds, label: str | None = None) -> None:
        """Tell the coordinator, count, and push PeerDied to the other members of the running
        quorum (read before the deaths: declaring one may issue the next quorum)."""
        running = rounds.running_quorum()
        for d in deaths:
            self.deaths[label or death_label(d)] += 1
            rounds.declare_dead(d.replica_id, d.reason)
        if running is None:
            return
        members = [m.replica_id for m in running.participants]
        by_reason: dict[str, list[str]] = {}
        for d in deaths:
            if d.replica_id in members:
                by_reason.setdefault(d.reason, []).append(d.replica_id)
                self._keep_death_notice(d, running.quorum_id)
        for reason, dead in by_reason.items():
            event = cpb.WatchEvent(peer_died=cpb.PeerDied(quorum_id=running.quorum_id, replica_ids=sorted(dead),
                                                          reason=reason))
            told = []
            for rid in members:
                w = self._watchers.get(rid)
                if rid not in dead and w is not None:
                    w.events.put_nowait(event)
                    told.append(rid)
            self.notices_sent += len(told)
            log.info("quorum %d: %s died (%s); told %s", running.quorum_id, ", ".join(sorted(dead)), reason,
                     ", ".join(told) or "nobody (no other member has a stream open)")

    def _keep_death_notice(self, death: Death, quorum_id: int) -> None:
        self._declared_dead[death.replica_id] = cpb.PeerDied(
            quorum_id=quorum_id, replica_ids=[death.replica_id],
            reason=f"this replica was declared dead by leader {self._node_id} ({death.reason})")
        self._declared_dead.move_to_end(death.replica_id)
        while len(self._declared_dead) > MAX_KEPT_DEATH_NOTICES:
            self._declared_dead.popitem(last=False)

    # -- the RPC ----------------------------------------------------------------------------------

    async def serve(self, context: grpc.aio.ServicerContext) -> None:
        """One ``Watch`` stream, read and written through ``context`` until it ends.

        The first message is read before any answer, a refusal included: a status sent while the
        client's first write is still under way can reach it as INTERNAL ("Internal error from
        Core", grpc/grpc#36066) instead of the status sent."""
        try:
            first = await asyncio.wait_for(context.read(), WATCH_FIRST_MESSAGE_TIMEOUT_S)
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"no WatchRequest naming the replica within {WATCH_FIRST_MESSAGE_TIMEOUT_S:g} s")
        if first is grpc.aio.EOF:
            return
        rid = first.replica_id
        timeout_ms = round(self.liveness.timeout_s * 1000)
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first WatchRequest must name replica_id")
        if len(rid) > MAX_REPLICA_ID_CHARS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"replica_id is longer than {MAX_REPLICA_ID_CHARS} characters")
        if first.keepalive_interval_ms < 0 or first.keepalive_interval_ms >= timeout_ms:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"keepalive_interval_ms {first.keepalive_interval_ms} must be below the liveness "
                                f"timeout ({timeout_ms} ms), or 0 for unspecified")
        rounds = self._serving_rounds()
        if rounds is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, self._not_leader_message(), self._not_leader_detail())
        if self._term != rounds.term:
            self.check()
        watcher = _Watcher(rid, next(self._ids))
        replaced = self._watchers.get(rid)
        self._watchers[rid] = watcher
        if replaced is not None:
            replaced.end(grpc.StatusCode.ABORTED, f"replaced by a newer liveness stream for replica {rid}")
        self.liveness.opened(rid, watcher.stream_id, self._clock())
        self._client_called()
        self._opened.set()
        rounds.alive(rid)
        log.debug("liveness stream %d opened for %s", watcher.stream_id, rid)
        reader = asyncio.get_running_loop().create_task(self._read_keepalives(context, watcher, rounds))
        ended: _End | None = None
        try:
            await context.write(cpb.WatchEvent(accepted=cpb.WatchAccepted(
                leader_id=self._node_id, term=rounds.term or 0, liveness_timeout_ms=timeout_ms)))
            own = self._declared_dead.pop(rid, None)
            if own is not None:
                log.info("told %s, back after it was declared dead as a member of quorum %d", rid, own.quorum_id)
                self.notices_sent += 1
                await context.write(cpb.WatchEvent(peer_died=own))
            while True:
                event = await watcher.events.get()
                if isinstance(event, _End):
                    ended = event
                    break
                await context.write(event)
        finally:
            reader.cancel()
            self._stream_ended(watcher)
        if ended.code is not grpc.StatusCode.OK:
            await context.abort(ended.code, ended.message)

    async def _read_keepalives(self, context: grpc.aio.ServicerContext, watcher: _Watcher,
                               rounds: LivenessRounds) -> None:
        try:
            while True:
                message = await context.read()
                if message is grpc.aio.EOF:
                    break
                if self._watchers.get(watcher.replica_id) is not watcher:
                    return  # replaced or expired: its handler ends it
                self.liveness.keepalive(watcher.replica_id, watcher.stream_id, self._clock())
                rounds.alive(watcher.replica_id)
                self._client_called()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 -- a broken stream is a closed one
            log.debug("liveness stream %d of %s: read failed (%s)", watcher.stream_id, watcher.replica_id, e)
            watcher.end(grpc.StatusCode.CANCELLED, f"liveness stream read failed: {e}")
            return
        watcher.end(grpc.StatusCode.OK, "the client closed its liveness stream")

    def _client_called(self) -> None:
        raft = self._node.raft
        if raft is not None:
            raft.note_client_activity()

    def _stream_ended(self, watcher: _Watcher) -> None:
        """The handler ends, however (client gone, cancelled, error, ended by this node): a
        death when it was the replica's current stream and the node still serves its term."""
        if self._watchers.get(watcher.replica_id) is watcher:
            del self._watchers[watcher.replica_id]
        death = self.liveness.closed(watcher.replica_id, watcher.stream_id)
        if death is None:
            return
        rounds = self._serving_rounds()
        if rounds is None or rounds.term != self._term:
            return
        self._declare([death], rounds)
