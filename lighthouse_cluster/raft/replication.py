"""Raft replication of the quorum state machine, through pysyncobj.

This module is the only one that touches pysyncobj. It owns:
* ``RaftSettings``: timeouts tuned for sub-second failover (pysyncobj's defaults take ~1 s);
* ``ReplicatedState``: a ``SyncObjConsumer`` with one replicated method whose single argument is
  a msgpack-encoded command (so the log never holds pickled objects of ours, and the method id
  never shifts between versions), and msgpack snapshots;
* ``RaftNode``: starts the SyncObj with the journal and snapshot in the data directory, the
  cluster secret on the Raft port, and exposes role, term, leader and indexes to the rest of
  the node;
* ``DialNode``: a peer that keeps its Raft address as its identity but is dialed at another
  ``host:port`` (``--raft-dial``: NAT, port forwarding, a fault-injection proxy);
* ``FastElectionSyncObj``: keeps the links between followers alive (pysyncobj drops a message
  sent or received on a link idle for ``connectionTimeout``: the first vote request after a leader
  died was lost), and a follower that refuses a vote because the candidate's log is behind its
  own starts its own election at once (no second election timeout after a failover).

Everything pysyncobj calls back happens on its tick thread; callers that live in an event loop
hop back with ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import enum
import logging
import queue
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from pysyncobj import FAIL_REASON, SyncObj, SyncObjConf, SyncObjConsumer, replicated
from pysyncobj.dns_resolver import globalDnsResolver
from pysyncobj.monotonic import monotonic as raft_monotonic
from pysyncobj.node import TCPNode
from pysyncobj.syncobj import _RAFT_STATE
from pysyncobj.tcp_connection import CONNECTION_STATE

from lighthouse_cluster.core import codec
from lighthouse_cluster.core.state_machine import QuorumStateMachine

log = logging.getLogger(__name__)


class Role(enum.Enum):
    FOLLOWER = "follower"
    CANDIDATE = "candidate"
    LEADER = "leader"


_ROLE_OF_STATE = {
    _RAFT_STATE.FOLLOWER: Role.FOLLOWER,
    _RAFT_STATE.CANDIDATE: Role.CANDIDATE,
    _RAFT_STATE.LEADER: Role.LEADER,
}

# Leadership won before SyncObj() returned (a one-node cluster): its term is read on first use.
_TERM_AT_START = -1

# A joining node's election timeout until it hears from a leader (``hold_elections_until_leader``).
_HOLD_ELECTIONS_S = 10 * 365 * 86400.0

_FAIL_NAMES = {v: k for k, v in vars(FAIL_REASON).items() if isinstance(v, int) and k.isupper()}


class CommitError(Exception):
    """A replicated command failed; ``unknown`` means it may still apply later."""

    def __init__(self, reason: str, unknown: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.unknown = unknown


@dataclass(frozen=True)
class RaftSettings:
    """Raft timing. Election timeouts are drawn from [min, 3 * min]: the wide range makes split
    votes (two followers timing out together, costing a second election) rare. pysyncobj
    requires min > 3 * append_entries_period. Measured on 2 cores, 3 local nodes: a leader
    SIGKILL costs ~0.5 s median until every replica group has its next quorum at 150 ms,
    ~0.74 s at 250 ms."""

    election_timeout_min_s: float = 0.15
    election_timeout_max_s: float = 0.45
    append_entries_period_s: float = 0.0375
    tick_period_s: float = 0.01
    leader_fallback_s: float = 1.0
    reconnect_s: float = 0.25
    compaction_min_entries: int = 2000
    compaction_min_time_s: float = 60.0
    dns_cache_s: float = 5.0
    dns_fail_cache_s: float = 1.0

    @classmethod
    def from_election_timeout_ms(cls, election_timeout_ms: int) -> "RaftSettings":
        lo = election_timeout_ms / 1000.0
        return cls(
            election_timeout_min_s=lo,
            election_timeout_max_s=3 * lo,
            append_entries_period_s=min(0.05, lo / 4),
            leader_fallback_s=max(1.0, 4 * lo),
        )


class ReplicatedState(SyncObjConsumer):
    """Feeds the Raft log into a ``QuorumStateMachine`` and snapshots it with msgpack."""

    def __init__(self, machine: QuorumStateMachine, on_apply: Callable[[Any], None] | None = None):
        self.machine = machine
        self.on_apply = on_apply
        super().__init__()

    @replicated
    def apply_command(self, payload: bytes) -> Any:
        try:
            result = self.machine.apply_bytes(payload)
        except codec.SchemaError:
            # Identical bytes fail identically on every node: a deterministic no-op.
            log.exception("skipping unreadable command")
            return None
        if self.on_apply is not None:
            self.on_apply(result)
        return result

    def _serialize(self) -> bytes:  # type: ignore[override]
        return self.machine.to_snapshot()

    def _deserialize(self, data: Any) -> None:  # type: ignore[override]
        self.machine.restore_snapshot(data)


class DialNode(TCPNode):
    """A peer whose identity is its Raft address but which is dialed at ``dial_address``.

    pysyncobj identifies a peer by ``address`` everywhere (equality and hashing go through the
    id, which is the address; the greater address dials; the dialer announces its own address
    as the first message, and the acceptor looks that string up), and dials ``(ip, port)``
    only (``TCPTransport._connectIfNecessarySingle``). Overriding ``ip``/``port`` therefore
    changes where this node connects to and nothing else. The override is local: it pickles as
    a plain ``TCPNode`` (pysyncobj puts the cluster's nodes into every snapshot, and snapshots
    go to other nodes), so journals and snapshots are the same as without it.
    """

    def __init__(self, address: str, dial_address: str) -> None:
        super().__init__(address)
        host, port = dial_address.rsplit(":", 1)
        self.dial_address = dial_address
        self._dial_host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        self._dial_port = int(port)

    @property
    def ip(self) -> str | None:  # type: ignore[override]
        return globalDnsResolver().resolve(self._dial_host)

    @property
    def port(self) -> int:  # type: ignore[override]
        return self._dial_port

    def __reduce__(self) -> tuple[Any, ...]:
        return (TCPNode, (self.address,))

    def __copy__(self) -> "DialNode":  # copies stay local: keep the override
        return DialNode(self.address, self.dial_address)

    def __deepcopy__(self, memo: dict[int, Any]) -> "DialNode":
        return self.__copy__()


def peer_nodes(peer_addresses: list[str],
               dial: Mapping[str, str]) -> tuple[list[TCPNode], Callable[[str], TCPNode]]:
    """pysyncobj node objects for ``peer_addresses`` with the ``dial`` overrides (Raft address
    -> host:port) applied, and a ``nodeClass`` factory that applies them to any node pysyncobj
    builds later. Raises ValueError for an override naming no peer."""
    unknown = sorted(set(dial) - set(peer_addresses))
    if unknown:
        raise ValueError(f"dial overrides for addresses that are not peers: {unknown}")

    def make(address: str) -> TCPNode:
        return DialNode(address, dial[address]) if address in dial else TCPNode(address)

    return [make(a) for a in peer_addresses], make


# Sent between followers so that their link never looks idle to pysyncobj (see FastElectionSyncObj).
_KEEPALIVE = {"type": "lighthouse_cluster_keepalive"}


class FastElectionSyncObj(SyncObj):
    """``SyncObj`` whose failovers take one election, not two (benchmarks F8: 8 of 10 failovers
    at N=64 took two).

    **Follower links kept alive.** pysyncobj's ``TcpConnection`` checks, before every send and on
    every read event, whether it has read anything for ``connectionTimeout``, and if not it
    disconnects *instead of* sending or reading (``__trySendBuffer`` / ``__processConnection`` ->
    ``__processConnectionTimeout``). Followers never talk to each other while a leader lives, so
    their link is always idle when a leader dies: the first candidate's ``request_vote`` to the
    other survivor was dropped (or the survivor dropped it on arrival), the survivor's own timer
    fired, both were candidates in the same term, and a second election followed. Node logs of
    the failover bench showed exactly this in most trials. Here every node that is not the
    leader sends a tiny keep-alive message to every peer other than its leader each
    ``connectionTimeout / 5`` (ignored by the receiver, and by an older node too: pysyncobj
    ignores unknown message types); leader links carry append_entries anyway.

    **Early election after a refusal.** When the first candidate lacks the last entry (a commit
    every few ms), the other follower refuses its vote (pysyncobj ``__onMessageReceived``,
    ``request_vote``: candidate's last log term/index behind) and nobody can win until that
    follower's own timer fires (up to ``raftMaxTimeout``). Here, a follower that has just refused
    a ``request_vote`` starts its own election on its next tick, when all of these hold (checked
    after pysyncobj has handled the message):

    * the follower has had no append_entries for half the minimum election timeout and was not
      the leader itself (the leader is gone: not a live leader deposed by a stale node);
    * the request is for the follower's current term (it was adopted, not stale) and no leader is
      known in that term;
    * the follower did not vote in that term and is a follower (not a candidate: a candidate has
      voted for itself, and split votes keep their random timeouts);
    * the candidate's log is strictly behind the follower's (lower last term, or the same last
      term and a lower last index). So the follower could win the vote the candidate could not,
      and two nodes can never trigger each other: "more up to date" is a strict order.

    Raft's safety does not depend on when a node times out (any node may start an election at any
    time); this only makes the election that would have happened one timeout later happen now
    (within ``raftMinTimeout / 5``, jittered: a stale node rejoining with a higher term is refused
    by both up-to-date nodes, and they should not both stand in the same term).
    It cannot cause an election storm: it fires only on a refusal for log reasons, at most once
    per term per follower, and a candidate with a shorter log receives none of these triggers
    from a node with a shorter log than its own.
    """

    early_elections = 0  # how many elections this node started early (for logs and tests)
    _leader_contact = 0.0  # pysyncobj clock: last append_entries of a current leader
    keepalives_sent = 0
    _last_keepalive = 0.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._SyncObj__raftCurrentTerm > 0 and self._SyncObj__otherNodes:  # type: ignore[attr-defined]
            # A restarted member (its journal has a term): give the live leader time to re-dial
            # it (at most every connectionRetryTime) and send an append_entries before it may
            # stand. Its vote request would depose a healthy leader (pysyncobj has no pre-vote)
            # and cost every trainer a failover; seen after follower restarts in the bench.
            conf = self._SyncObj__conf  # type: ignore[attr-defined]
            self._SyncObj__raftElectionDeadline = (  # type: ignore[attr-defined]
                raft_monotonic() + conf.connectionRetryTime + 2 * conf.appendEntriesPeriod
                + self._SyncObj__generateRaftTimeout())  # type: ignore[attr-defined]

    def _onTick(self, timeToWait: float = 0.0) -> None:  # noqa: N803 -- pysyncobj's signature
        super()._onTick(timeToWait)
        now = time.monotonic()
        if now - self._last_keepalive < self._SyncObj__conf.connectionTimeout / 5:  # type: ignore[attr-defined]
            return
        self._last_keepalive = now
        if self._SyncObj__raftState == _RAFT_STATE.LEADER:  # type: ignore[attr-defined]
            return
        leader = self._SyncObj__raftLeader  # type: ignore[attr-defined]
        transport = self._SyncObj__transport  # type: ignore[attr-defined]
        for node in self._SyncObj__otherNodes:  # type: ignore[attr-defined]
            if node != leader and transport.send(node, _KEEPALIVE):
                self.keepalives_sent += 1

    def _SyncObj__onMessageReceived(self, node: Any, message: Any) -> None:
        if message == _KEEPALIVE:
            return  # reading it was the point
        kind = message.get("type") if isinstance(message, dict) else None
        if kind == "append_entries" and message.get("term", -1) >= self._SyncObj__raftCurrentTerm:  # type: ignore[attr-defined]
            self._leader_contact = raft_monotonic()
        was_leader = self._SyncObj__raftState == _RAFT_STATE.LEADER  # type: ignore[attr-defined]
        super()._SyncObj__onMessageReceived(node, message)  # type: ignore[misc]
        if kind != "request_vote" or self._SyncObj__selfNode is None:  # type: ignore[attr-defined]
            return
        # Only when the leader is gone (the failover case). A live leader deposed by a stale node's
        # higher term (no pre-vote) is refused by both up-to-date nodes; there the normal timers
        # pick one of them, as without this class: two early candidacies would split the vote.
        if was_leader or raft_monotonic() - self._leader_contact < 0.5 * self._SyncObj__conf.raftMinTimeout:  # type: ignore[attr-defined]
            return
        if message.get("term") != self._SyncObj__raftCurrentTerm \
                or self._SyncObj__raftState != _RAFT_STATE.FOLLOWER \
                or self._SyncObj__votedForNodeId is not None \
                or self._SyncObj__raftLeader is not None:  # type: ignore[attr-defined]
            return
        my_term = self._SyncObj__getCurrentLogTerm()  # type: ignore[attr-defined]
        my_index = self._SyncObj__getCurrentLogIndex()  # type: ignore[attr-defined]
        their = (message["last_log_term"], message["last_log_index"])
        if their < (my_term, my_index):
            self.early_elections += 1
            log.info("refused the vote of %s (log %s behind ours %s) in term %d: starting an election now",
                     getattr(node, "address", node), their, (my_term, my_index), message["term"])
            # Within a fifth of the minimum election timeout (jittered: when a stale node disrupts a
            # live cluster, both up-to-date nodes refuse it, and they must not both stand at once).
            self._SyncObj__raftElectionDeadline = raft_monotonic() + random.uniform(  # type: ignore[attr-defined]
                0.0, 0.2 * self._SyncObj__conf.raftMinTimeout)  # type: ignore[attr-defined]


class RaftNode:
    """One member of the Raft group; thin wrapper over ``SyncObj``."""

    def __init__(
        self,
        self_address: str,
        peer_addresses: list[str],
        state: ReplicatedState,
        *,
        bind_address: str | None = None,
        data_dir: Path | None = None,
        secret: str | None = None,
        settings: RaftSettings = RaftSettings(),
        on_state_changed: Callable[[Role, Role], None] | None = None,
        dial: Mapping[str, str] | None = None,
        hold_elections_until_leader: bool = False,
    ) -> None:
        """``dial`` maps a peer's Raft address to the ``host:port`` to connect to instead
        (identity unchanged; see ``DialNode``). ``hold_elections_until_leader``: a node joining
        a running cluster with an empty journal starts no election until it has heard from a
        leader (see ``_release_elections``)."""
        self.self_address = self_address
        self.state = state
        # pysyncobj resolves a "[v6]:port" host with the brackets and never connects: dial
        # bracketed peers at their bare address (identity unchanged) and bind without brackets.
        dial = {**{a: a for a in peer_addresses if a.startswith("[")}, **(dial or {})}
        if bind_address is not None and bind_address.startswith("["):
            host, port = bind_address.rsplit(":", 1)
            bind_address = f"{host[1:-1]}:{port}"
        journal = dump = None
        fresh = data_dir is None or not (data_dir / "raft.journal").exists()
        if data_dir is not None:
            data_dir.mkdir(parents=True, exist_ok=True)
            journal = str(data_dir / "raft.journal")
            dump = str(data_dir / "raft.snapshot")

        self._led_term: int | None = None

        def state_changed(old: int, new: int) -> None:
            # On pysyncobj's tick thread, at the transition itself: the term read here is the
            # one this node won. A poll from another thread can see the old LEADER state next to
            # a newer term (pysyncobj raises the term before stepping down) and must not take
            # that for leadership of the newer term.
            syncobj = self.__dict__.get("_syncobj")  # None only while SyncObj() is still starting
            if new != _RAFT_STATE.LEADER:
                self._led_term = None
            else:
                self._led_term = syncobj.raftCurrentTerm if syncobj is not None else _TERM_AT_START
            if on_state_changed is not None:
                on_state_changed(_ROLE_OF_STATE.get(old, Role.FOLLOWER), _ROLE_OF_STATE.get(new, Role.FOLLOWER))

        conf = SyncObjConf(
            password=secret or None,
            bindAddress=bind_address,
            journalFile=journal,
            fullDumpFile=dump,
            useFork=False,
            appendEntriesUseBatch=False,
            # Above any command we write: pysyncobj 0.3.17 mis-marks the last chunk of an entry
            # it splits (>= this size alone in a batch) and followers fail to unpickle it.
            appendEntriesBatchSizeBytes=16 * 2**20,
            autoTickPeriod=settings.tick_period_s,
            raftMinTimeout=settings.election_timeout_min_s,
            raftMaxTimeout=settings.election_timeout_max_s,
            appendEntriesPeriod=settings.append_entries_period_s,
            connectionTimeout=max(settings.election_timeout_max_s, 0.5),
            connectionRetryTime=settings.reconnect_s,
            leaderFallbackTimeout=settings.leader_fallback_s,
            logCompactionMinEntries=settings.compaction_min_entries,
            logCompactionMinTime=settings.compaction_min_time_s,
            onStateChanged=state_changed,
            # Peers re-created with new addresses (Kubernetes pods, Slurm requeues) are found
            # again within seconds, not pysyncobj's default 10 minutes.
            dnsCacheTime=settings.dns_cache_s,
            dnsFailCacheTime=settings.dns_fail_cache_s,
            # Runtime membership change (`lighthouse-cluster members add/remove`); the changes
            # are log entries, replayed from the journal after a restart.
            dynamicMembershipChange=True,
        )
        if dial:
            nodes, node_class = peer_nodes(peer_addresses, dial)
            self._syncobj = FastElectionSyncObj(self_address, nodes, conf=conf, consumers=[state],
                                                nodeClass=node_class)
        else:
            self._syncobj = FastElectionSyncObj(self_address, peer_addresses, conf=conf, consumers=[state])

        self._connect_timeout_s = conf.connectionTimeout
        self._syncobj.addOnTickCallback(self._expire_stuck_connects)
        self._tick_jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._syncobj.addOnTickCallback(self._run_tick_jobs)
        self._conf = conf
        self._held_timeouts: tuple[float, float] | None = None
        if hold_elections_until_leader and fresh:
            # pysyncobj reads the timeouts from this conf object whenever it draws a deadline.
            self._held_timeouts = (conf.raftMinTimeout, conf.raftMaxTimeout)
            conf.raftMinTimeout = conf.raftMaxTimeout = _HOLD_ELECTIONS_S
            self.call_on_tick_thread(self._push_election_deadline, lambda _r, _e: None)
            self._syncobj.addOnTickCallback(self._release_elections)

    def _push_election_deadline(self) -> None:
        self._syncobj._SyncObj__raftElectionDeadline = raft_monotonic() + self._conf.raftMaxTimeout  # type: ignore[attr-defined]

    def _release_elections(self) -> None:
        """On the tick thread: once a leader is known, take part in elections as any node.

        Until it is added, a joining node is refused by every member; alone, it would time out
        again and again, raising its term each time (pysyncobj has no PreVote), and once added
        its term would depose the leader for one needless election. Its empty log could not win
        an election anyway, so holding its own back costs nothing."""
        if self._held_timeouts is None or self._syncobj._getLeader() is None:
            return
        self._conf.raftMinTimeout, self._conf.raftMaxTimeout = self._held_timeouts
        self._held_timeouts = None
        self._push_election_deadline()
        log.info("heard from the leader: taking part in elections from now on")

    def _run_tick_jobs(self) -> None:
        while True:
            try:
                job = self._tick_jobs.get_nowait()
            except queue.Empty:
                return
            job()

    def call_on_tick_thread(self, fn: Callable[[], Any], callback: Callable[[Any, Exception | None], None]) -> None:
        """Run ``fn()`` once on pysyncobj's tick thread, between two applied entries (so it sees
        the state machine as of ``last_applied``); ``callback(result, error)`` runs there too."""
        def job() -> None:
            try:
                result, error = fn(), None
            except Exception as e:  # handed to the caller
                result, error = None, e
            callback(result, error)

        self._tick_jobs.put(job)

    def change_membership(self, add: bool, address: str, callback: Callable[[str | None], None]) -> None:
        """Add or remove the Raft member ``address`` (one change at a time; call on the leader).
        ``callback(None)`` once the change is committed, ``callback(reason)`` on failure; both
        on the tick thread."""
        def done(_result: Any, err: int) -> None:
            callback(None if err == FAIL_REASON.SUCCESS else _FAIL_NAMES.get(err, str(err)))

        try:
            if add:
                self._syncobj.addNodeToCluster(address, callback=done)
            else:
                self._syncobj.removeNodeFromCluster(address, callback=done)
        except Exception as e:  # pysyncobj raises plain Exception for a disabled feature
            callback(str(e))

    @property
    def raft_members(self) -> list[str]:
        """The Raft addresses of every member as this node's pysyncobj sees them (self included)."""
        status = self._syncobj.getStatus()
        others = [k[len("partner_node_status_server_"):] for k in status
                  if k.startswith("partner_node_status_server_")]
        return sorted([self.self_address, *others])

    def _expire_stuck_connects(self) -> None:
        """Drop outgoing connects that have waited longer than the connection timeout (on the
        tick thread; pysyncobj re-dials them after ``connectionRetryTime``).

        pysyncobj checks a connection's timeout only when its socket has a poll event, and
        re-dials only a DISCONNECTED connection. A connect whose SYNs were dropped by a
        partition gets no event, so it sat in SYN-SENT until the kernel's next SYN
        retransmission (1, 3, 7, 15, 31 s ...) however long ago the partition healed: a node
        stayed cut off from Raft for 10-30 s after a long partition (jepsen_like BUG-1)."""
        try:
            connections = list(self._syncobj._SyncObj__transport._connections.values())  # type: ignore[attr-defined]
        except AttributeError:  # pysyncobj internals moved: keep its own behaviour
            return
        now = time.monotonic()
        for conn in connections:
            started = getattr(conn, "_TcpConnection__lastReadTime", None)
            if conn.state == CONNECTION_STATE.CONNECTING and started is not None \
                    and now - started > self._connect_timeout_s:
                log.debug("abandoning a connect pending for %.1fs", now - started)
                conn.disconnect()

    # -- writes ---------------------------------------------------------------------------

    def submit(self, command: codec.Command, callback: Callable[[Any, CommitError | None], None], *,
               while_leader_of: int | None = None) -> None:
        """Append ``command`` to the log; ``callback(result, error)`` runs on the tick thread
        once it is applied here or has failed.

        ``while_leader_of=T``: succeed only if this node still leads term ``T`` when the entry is
        applied here (read on the tick thread, at that moment). Then the entry was committed by
        this leader in ``T``: a majority stored it in term ``T``, after it was submitted, and
        before any of them moved to a later term (the quorum lease rests on this)."""
        payload = codec.encode_command(command, version=self.state.machine.schema_version)

        def done(result: Any, err: int) -> None:
            if err == FAIL_REASON.SUCCESS:
                if while_leader_of is not None and self.led_term != while_leader_of:
                    callback(None, CommitError(f"applied after this node stopped leading term {while_leader_of}",
                                               unknown=False))
                    return
                callback(result, None)
                return
            name = _FAIL_NAMES.get(err, str(err))
            # Anything but a refusal before appending may still commit later.
            unknown = err not in (FAIL_REASON.QUEUE_FULL, FAIL_REASON.MISSING_LEADER,
                                  FAIL_REASON.NOT_LEADER, FAIL_REASON.REQUEST_DENIED)
            callback(None, CommitError(name, unknown))

        self.state.apply_command(payload, callback=done)

    # -- reads (local view; may be stale on a deposed leader) --------------------------------

    @property
    def role(self) -> Role:
        return _ROLE_OF_STATE.get(self._syncobj._SyncObj__raftState, Role.FOLLOWER)  # type: ignore[attr-defined]

    @property
    def is_leader(self) -> bool:
        return self._syncobj._isLeader()

    @property
    def led_term(self) -> int | None:
        """The term this node became leader in, while it still is leader; else None."""
        if not self._syncobj._isLeader():
            return None
        return self._syncobj.raftCurrentTerm if self._led_term == _TERM_AT_START else self._led_term

    @property
    def leader_address(self) -> str | None:
        leader = self._syncobj._getLeader()
        return leader.address if isinstance(leader, TCPNode) else (str(leader) if leader else None)

    @property
    def term(self) -> int:
        return self._syncobj.raftCurrentTerm

    @property
    def commit_index(self) -> int:
        return self._syncobj.raftCommitIndex

    @property
    def last_applied(self) -> int:
        return self._syncobj.raftLastApplied

    @property
    def is_ready(self) -> bool:
        return self._syncobj.isReady()

    def is_connected(self, address: str) -> bool:
        return self._syncobj.isNodeConnected(TCPNode(address))

    def transfer_leadership(self, address: str | None = None,
                            callback: Callable[[str | None], None] | None = None) -> None:
        """Raft's TimeoutNow to ``address`` (None: the most caught-up connected follower).
        ``callback(None)`` when it was sent, ``callback(reason)`` when refused (not leader, or
        the target is not fully caught up); on the calling thread."""
        def done(_result: Any, err: int) -> None:
            if callback is not None:
                callback(None if err == FAIL_REASON.SUCCESS else _FAIL_NAMES.get(err, str(err)))

        self._syncobj.transferLeadership(TCPNode(address) if address else None, done)

    def destroy(self) -> None:
        self._syncobj.destroy()

