"""Raft replication of the quorum state machine: the API the rest of the node uses.

It owns:
* ``RaftNode``: starts the node's ``LighthouseSyncObj`` (a ``RaftHost`` with this project's
  extensions) with the journal and snapshot in the data directory, the cluster secret on the Raft
  port, and exposes role, term, leader and indexes, writes (``submit``), membership changes and
  leadership transfer to the rest of the node;
* ``ReplicatedState``: a ``SyncObjConsumer`` with one replicated method whose single argument is
  a msgpack-encoded command (so the log never holds pickled objects of ours, and the method id
  never shifts between versions), and msgpack snapshots;
* ``Role`` and ``CommitError``: pysyncobj's states and failure codes in this project's terms.

The rest of ``lighthouse_cluster.raft``: ``settings`` (``RaftSettings``, the ``SyncObjConf``),
``dial`` (``DialNode``: ``--raft-dial``), ``host`` (``RaftHost``: the one ``SyncObj`` subclass,
running extensions at named hooks; ``host_transport``: its transport), ``composed_node``
(``LighthouseSyncObj``: the extensions in their order), ``extensions/`` (one mechanism each:
``lease_probes``, a leader confirms its leadership with an acknowledged heartbeat, for the quorum
lease; ``quiescence``, a leader with no clients heartbeats slowly; ``stall_tolerance``, a stalled
tick thread does not depose a live leader; ``fast_election``, failovers take one election and
votes wait out the lease; ``idle_acks``; ``adaptive_tick``, a tick that sleeps until its next
deadline; ``durable_sync``, nothing acknowledged or counted before it is on disk),
``durable_journal`` (the journal, term and vote, synced), ``durable_snapshot`` (the snapshot
file, synced), ``journal`` (the format of a node's Raft
files, read from outside too), ``message_cipher`` and ``message_compression`` (the Raft port's
bytes) and ``pysyncobj_internals`` (every private pysyncobj name used, checked at import).
``RaftSettings``, ``DialNode`` and ``peer_nodes`` are importable from here too.

Everything pysyncobj calls back happens on its tick thread; callers that live in an event loop
hop back with ``loop.call_soon_threadsafe``.
"""
from __future__ import annotations

import enum
import logging
import queue
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pysyncobj import FAIL_REASON, SyncObjConsumer, replicated

from lighthouse_cluster.core import codec
from lighthouse_cluster.core.state_machine import QuorumStateMachine
from lighthouse_cluster.durable_files import make_directory_durably
from lighthouse_cluster.raft.dial import DialNode, peer_nodes
from lighthouse_cluster.raft.composed_node import LighthouseSyncObj
from lighthouse_cluster.raft.journal import JOURNAL_FILE, SNAPSHOT_FILE
from lighthouse_cluster.raft.message_cipher import MessageCipher
from lighthouse_cluster.raft.pysyncobj_internals import RAFT_STATE, StoragePath, TCPNode, connecting_since, monotonic
from lighthouse_cluster.raft.settings import RaftSettings, syncobj_conf

__all__ = ["CommitError", "DialNode", "RaftNode", "RaftSettings", "ReplicatedState", "Role", "peer_nodes"]

log = logging.getLogger(__name__)


class Role(enum.Enum):
    FOLLOWER = "follower"
    CANDIDATE = "candidate"
    LEADER = "leader"


_ROLE_OF_STATE = {
    RAFT_STATE.FOLLOWER: Role.FOLLOWER,
    RAFT_STATE.CANDIDATE: Role.CANDIDATE,
    RAFT_STATE.LEADER: Role.LEADER,
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
        on_view_changed: Callable[[], None] | None = None,
        fsync: bool = True,
    ) -> None:
        """``fsync=False`` (``--unsafe-no-fsync``; tests and benchmarks only): the journal, term,
        vote and snapshots in ``data_dir`` are written at the same moments but never synced, so a
        power loss can lose what this node acknowledged (``raft.durable_journal``). ``dial`` maps
        a peer's Raft address to the ``host:port`` to connect to instead (identity unchanged; see
        ``DialNode``). ``hold_elections_until_leader``: a node joining
        a running cluster with an empty journal starts no election until it has heard from a
        leader (see ``_release_elections``). ``on_view_changed()``: on the tick thread, after a
        tick that changed what the rest of the node reads here (role, term, leader, which peers
        are connected, the state machine's member, job and schema versions), so that it need not
        poll them."""
        self.self_address = self_address
        self.state = state
        # pysyncobj resolves a "[v6]:port" host with the brackets and never connects: dial
        # bracketed peers at their bare address (identity unchanged) and bind without brackets.
        dial = {**{a: a for a in peer_addresses if a.startswith("[")}, **(dial or {})}
        if bind_address is not None and bind_address.startswith("["):
            host, port = bind_address.rsplit(":", 1)
            bind_address = f"{host[1:-1]}:{port}"
        journal = dump = None
        fresh = data_dir is None or not (data_dir / JOURNAL_FILE).exists()
        self.fsync = fsync
        if data_dir is not None:
            make_directory_durably(data_dir, sync=fsync)
            # pysyncobj hands these names to this project's durable journal and snapshot rename.
            journal = StoragePath(str(data_dir / JOURNAL_FILE), sync=fsync)
            dump = StoragePath(str(data_dir / SNAPSHOT_FILE), sync=fsync)
        if not fsync and data_dir is not None:
            log.warning("--unsafe-no-fsync: the Raft journal, term, vote and snapshots in %s are never fsynced; "
                        "a power loss (not a process crash) can lose quorums this node acknowledged. "
                        "For tests and benchmarks only.", data_dir)

        self._led_term: int | None = None

        def state_changed(old: int, new: int) -> None:
            # On pysyncobj's tick thread, at the transition itself: the term read here is the
            # one this node won. A poll from another thread can see the old LEADER state next to
            # a newer term (pysyncobj raises the term before stepping down) and must not take
            # that for leadership of the newer term.
            syncobj = self.__dict__.get("_syncobj")  # None only while SyncObj() is still starting
            if new != RAFT_STATE.LEADER:
                self._led_term = None
            else:
                self._led_term = syncobj.raftCurrentTerm if syncobj is not None else _TERM_AT_START
            if on_state_changed is not None:
                on_state_changed(_ROLE_OF_STATE.get(old, Role.FOLLOWER), _ROLE_OF_STATE.get(new, Role.FOLLOWER))

        conf = syncobj_conf(settings, secret=secret, bind_address=bind_address, journal_file=journal,
                            snapshot_file=dump, on_state_changed=state_changed)
        # The Raft port's encryption: AES-256-GCM once the cluster reads it (message_cipher.py).
        self.cipher = MessageCipher(secret, send_gcm=self._send_gcm) if secret else None
        # A quiet leader (extensions/quiescence.py) only where its period is longer than the normal one.
        quiet_after_s = settings.quiet_after_s if settings.quiet_period_s > settings.append_entries_period_s else 0.0
        common: dict[str, Any] = dict(conf=conf, consumers=[state], longest_s=settings.idle_tick_max_s,
                                      cipher=self.cipher, quiet_after_s=quiet_after_s,
                                      quiet_period_s=settings.quiet_period_s, quiet_allowed=self._quiet_allowed)
        if dial:
            nodes, node_class = peer_nodes(peer_addresses, dial)
            self._syncobj = LighthouseSyncObj(self_address, nodes, nodeClass=node_class, **common)
        else:
            self._syncobj = LighthouseSyncObj(self_address, peer_addresses, **common)

        self._nodes_by_address: dict[str, TCPNode] = {}
        self._connect_timeout_s = conf.connectionTimeout
        self._syncobj.addOnTickCallback(self._expire_stuck_connects)
        self._syncobj.add_tick_deadline(self._next_stuck_connect_expiry)
        self._tick_jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._syncobj.addOnTickCallback(self._run_tick_jobs)
        self._on_view_changed = on_view_changed
        self._last_view: tuple[Any, ...] | None = None
        if on_view_changed is not None:
            self._syncobj.addOnTickCallback(self._notice_view)
        self._conf = conf
        self._election_max_s = settings.election_timeout_max_s
        # While a TimeoutNow's election runs (monotonic() deadline): this leader appends nothing.
        self._handing_over_until = 0.0
        self._held_timeouts: tuple[float, float] | None = None
        if hold_elections_until_leader and fresh:
            # pysyncobj reads the timeouts from this conf object whenever it draws a deadline.
            self._held_timeouts = (conf.raftMinTimeout, conf.raftMaxTimeout)
            conf.raftMinTimeout = conf.raftMaxTimeout = _HOLD_ELECTIONS_S
            self.call_on_tick_thread(self._push_election_deadline, lambda _r, _e: None)
            self._syncobj.addOnTickCallback(self._release_elections)

    def _send_gcm(self) -> bool:
        """On the tick thread, per message sent: AES-GCM once this node knows its cluster (it
        applied or restored something) and the cluster enabled ``CIPHER_SCHEMA_VERSION``, which
        it does only once every member reads it."""
        machine = self.state.machine
        return not machine.fresh and machine.schema_version >= codec.CIPHER_SCHEMA_VERSION

    def _quiet_allowed(self) -> bool:
        """On the tick thread: whether the leader may quiesce (``raft/extensions/quiescence.py``): the cluster
        enabled ``QUIESCENCE_SCHEMA_VERSION``, which it does only once every member reads it."""
        machine = self.state.machine
        return not machine.fresh and machine.schema_version >= codec.QUIESCENCE_SCHEMA_VERSION

    def note_client_activity(self) -> None:
        """A client called this node (any thread): its leader stays, or wakes, out of quiescence."""
        self._syncobj.note_client_activity()

    @property
    def quiet(self) -> bool:
        """Whether this node's Raft heartbeats are quiet: as leader, its own; as follower, its
        leader's last append_entries said so."""
        syncobj = self._syncobj
        return syncobj.quiet or syncobj.leader_quiet

    @property
    def journal_syncs(self) -> tuple[int, int, float]:
        """(syncs that wrote something, entries they made durable, seconds spent) of this node's
        journal since it started; zeros without a data directory."""
        journal = self._syncobj.pso_journal
        return (getattr(journal, "syncs", 0), getattr(journal, "entries_synced", 0),
                getattr(journal, "sync_seconds", 0.0))

    @property
    def tick_stalls(self) -> int:
        """How many times this node's Raft tick thread stalled (``raft/extensions/stall_tolerance.py``)."""
        return self._syncobj.stalls

    @property
    def election_patience_s(self) -> float:
        """What the leader's append_entries add to its followers' election timeouts after its
        recent stalls (as leader: what it asks; as follower: what its leader asked)."""
        syncobj = self._syncobj
        return syncobj.patience_asked_s if syncobj._isLeader() else syncobj.leader_patience_s

    @property
    def messages_encrypted(self) -> dict[str, int]:
        """Raft messages sent encrypted, by cipher (empty without a secret)."""
        cipher = self.cipher
        return {} if cipher is None else {"aes-gcm": cipher.sent_gcm, "fernet": cipher.sent_fernet}

    def _push_election_deadline(self) -> None:
        self._syncobj.pso_election_deadline = monotonic() + self._conf.raftMaxTimeout

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

    def _view(self) -> tuple[Any, ...]:
        syncobj, machine = self._syncobj, self.state.machine
        connected = frozenset(n for n in syncobj.otherNodes if syncobj.isNodeConnected(n))
        return (syncobj.pso_state, syncobj.raftCurrentTerm, self._led_term, syncobj._getLeader(), connected,
                machine.members_version, machine.jobs_version, machine.schema_version)

    def _notice_view(self) -> None:
        """On the tick thread, after every tick: ``on_view_changed()`` when the view changed."""
        view = self._view()
        if view != self._last_view:
            self._last_view = view
            assert self._on_view_changed is not None
            self._on_view_changed()

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
        self._syncobj.wake()  # the tick thread may be waiting for its next deadline

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
        now = monotonic()
        for conn in list(self._syncobj.pso_connections.values()):
            started = connecting_since(conn)
            if started is not None and now - started > self._connect_timeout_s:
                log.debug("abandoning a connect pending for %.1fs", now - started)
                conn.disconnect()

    def _next_stuck_connect_expiry(self) -> float | None:
        """When ``_expire_stuck_connects`` next has a connect to drop (a tick deadline)."""
        starts = [s for s in map(connecting_since, list(self._syncobj.pso_connections.values())) if s is not None]
        return min(starts) + self._connect_timeout_s if starts else None

    # -- writes ---------------------------------------------------------------------------

    def submit(self, command: codec.Command, callback: Callable[[Any, CommitError | None], None], *,
               while_leader_of: int | None = None) -> None:
        """Append ``command`` to the log; ``callback(result, error)`` runs on the tick thread
        once it is applied here or has failed.

        ``while_leader_of=T``: succeed only if this node still leads term ``T`` when the entry is
        applied here (read on the tick thread, at that moment). Then the entry was committed by
        this leader in ``T``: a majority stored it in term ``T``, after it was submitted, and
        before any of them moved to a later term (the quorum lease rests on this)."""
        if self._handing_over_until > monotonic() and self.is_leader:
            # Raft thesis 3.10: a leader that sent TimeoutNow appends nothing until the election it
            # asked for is over. An entry its target lacks and the third node stores would have
            # that node refuse the target's vote, and this (stopping) leader win the next term.
            callback(None, CommitError("leadership transfer in progress", unknown=False))
            return
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

    def probe_leadership(self, term: int, callback: Callable[[bool], None]) -> None:
        """Confirm that this node leads ``term`` with a majority as of now, with one acknowledged
        heartbeat and no log entry (``lease_probes``): ``callback(True)`` once a majority echoed
        it while this node still leads ``term``, ``callback(False)`` otherwise (not leading it, a
        leadership transfer in progress, or no majority within ``PROBE_EXPIRY_S``); on the tick
        thread. What it proves is what ``submit(while_leader_of=term)`` proves of an entry
        applied: a majority followed this leader in ``term`` after the call."""
        if self._handing_over_until > monotonic() and self.is_leader:
            callback(False)  # as submit: a leader handing over renews nothing
            return

        def probe() -> None:
            self._syncobj.probe_leadership(term, lambda ok: callback(ok and self.led_term == term))

        self._tick_jobs.put(probe)
        self._syncobj.wake()

    def stream_lease_confirmations(self, term: int, on_confirmed: Callable[[float], None] | None) -> None:
        """While this node leads ``term``, every heartbeat is a lease probe (``lease_probes``,
        "Heartbeats as probes"): ``on_confirmed(t)`` reports each later ``time.monotonic()`` time
        ``t`` at which a majority followed this leader in ``term`` (what ``probe_leadership``
        called at ``t`` proves), on the tick thread; None stops it. Nothing is reported while a
        leadership transfer runs, as ``probe_leadership`` confirms nothing then."""
        def confirmed(since: float) -> None:
            if self.led_term != term or (self._handing_over_until > monotonic() and self.is_leader):
                return
            # pysyncobj's clock (CLOCK_MONOTONIC_RAW) to time.monotonic's, read back to back: the
            # age of the confirmation, not its absolute time, crosses over.
            on_confirmed(time.monotonic() - (monotonic() - since))

        report = None if on_confirmed is None else confirmed
        self._tick_jobs.put(lambda: self._syncobj.stream_confirmations(term, report))
        self._syncobj.wake()

    # -- reads (local view; may be stale on a deposed leader) --------------------------------

    @property
    def role(self) -> Role:
        return _ROLE_OF_STATE.get(self._syncobj.pso_state, Role.FOLLOWER)

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
        node = self._nodes_by_address.get(address)
        if node is None:  # one per member address: a follower asks on every forwarded call
            node = self._nodes_by_address[address] = TCPNode(address)
        return self._syncobj.isNodeConnected(node)

    def vote_refusal_s(self, term: int) -> float:
        """How long every member refuses votes after hearing from a leader (``fast_election``'s
        ``vote_refused``, this node's minimum election timeout), as it bounds the lease of this
        node's predecessor when it leads ``term`` (``core/lease.py``): 0 when it won ``term`` on a
        handover (TimeoutNow), whose votes were not refused."""
        syncobj = self._syncobj
        return 0.0 if syncobj.handover_term == term else syncobj.vote_refusal_s

    def transfer_leadership(self, address: str | None = None,
                            callback: Callable[[str | None], None] | None = None) -> None:
        """Raft's TimeoutNow to ``address`` (None: the most caught-up connected follower).
        ``callback(None)`` when it was sent, ``callback(reason)`` when refused (not leader, or
        the target is not fully caught up); on the calling thread. Once sent, ``submit`` refuses
        every command for the longest election timeout (the target, caught up when it was sent,
        must stay so to win)."""
        def done(_result: Any, err: int) -> None:
            if err == FAIL_REASON.SUCCESS:  # sent: no new entry until its election is over (submit)
                self._handing_over_until = monotonic() + self._election_max_s
            if callback is not None:
                callback(None if err == FAIL_REASON.SUCCESS else _FAIL_NAMES.get(err, str(err)))

        self._syncobj.transferLeadership(TCPNode(address) if address else None, done)

    def destroy(self) -> None:
        self._syncobj.destroy()

