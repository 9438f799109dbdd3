"""``FastElection``: failovers take one election, not two; votes wait out the lease.

It owns the two changes to pysyncobj's election behaviour (docs/design/fast-election.md: 8 of 10
failovers at N=64 took two elections before), the hold-back of a restarted member and the vote
refusal the quorum lease rests on (``vote_refused``, docs/design/leader-lease.md); the private
pysyncobj state they need comes from ``pysyncobj_internals``.

**Follower links kept alive.** pysyncobj's ``TcpConnection`` checks, before every send and on
every read event, whether it has read anything for ``connectionTimeout``, and if not it
disconnects *instead of* sending or reading (``__trySendBuffer`` / ``__processConnection`` ->
``__processConnectionTimeout``). Followers never talk to each other while a leader lives, so
their link is always idle when a leader dies: the first candidate's ``request_vote`` to the
other survivor was dropped (or the survivor dropped it on arrival), the survivor's own timer
fired, both were candidates in the same term, and a second election followed. Node logs of
the failover bench showed exactly this in most trials. Here every node that is not the
leader sends a tiny keep-alive message (``KEEPALIVE``) to every peer other than its leader each
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

**No vote within the refusal window** (``vote_refused``; thesis 4.2.3). A node that heard
from a current leader less than ``vote_refusal_s`` ago (default ``raftMinTimeout``; a leader
hears from itself) puts a ``request_vote`` off: a follower or candidate leaves it unhandled
(no vote, and its term stays: a live leader is not disrupted) and handles it once the window
has passed, if it is not older than ``raftMaxTimeout`` by then (the candidate would have
asked again); a leader takes the higher term and steps down, as pysyncobj does, but does not
vote (otherwise a node with a higher term, back from a partition, could never rejoin: pysyncobj
followers ignore the append_entries of an older term). A node that starts counts as having
heard from a leader at its start (it may have, before a restart, and its journal holds what
it stored). A candidate standing on its leader's TimeoutNow (``transfer-leader``, a stopping
leader) marks its requests (``HANDOVER_KEY``) and is answered at once; it then records the term
(``handover_term``), and a leader of that term waits out the lease in full (``core/lease.py``).
In a failover the first candidate (at least ``raftMinTimeout`` after the leader's last
append_entries) asks followers that heard that same append_entries at about the same time, so
a put-off request is handled a few milliseconds later, not one election timeout later.

**A closed connection to the leader** (docs/design/fast-election.md). A leader process that
dies (SIGKILL, OOM, a crash, a pod deleted) leaves its host's kernel to close its sockets:
every follower reads the end of its connection within a millisecond. pysyncobj only notes the
link down and waits out its election timeout, drawn in [raftMinTimeout, raftMaxTimeout] from
the leader's last append_entries (a failover's median was ~0.25 s, nearly all of it this
wait). Here a follower
whose leader's connection closes moves its election deadline to ``leader_lost_deadline``: the
end of its vote-refusal window (never earlier than its shortest timeout: the lease's proof and
Raft's safety hold as for any timeout), the survivors ``raftMinTimeout / 5`` apart by rank. A
connection that closes while the leader lives (a reset on the way) is re-dialed at once by
pysyncobj, and the leader's next append_entries, due within ``appendEntriesPeriod``, moves the
deadline on again before it falls due; a partition or a dead host closes nothing, and the
normal timeouts apply, as they do to a link pysyncobj drops for its silence (half a
``connectionTimeout`` or more since the leader was heard: a stalled leader keeps the patience
it asked for, ``stall_tolerance``).

**A stale leader hears of the higher term** (Raft: a node answers an append_entries of an older
term with its own term, and the sender steps down). pysyncobj ignores such an append_entries
without a word, so a node that stood for election while the others kept their leader (cut off
for a moment, or its clock slow: the clock nemesis) stayed at its higher term, a candidate
knowing no leader, until one of its own vote requests happened to reach the leader; its
clients' calls waited meanwhile (seen in CI: 20 s). Here it answers the leader's append_entries
with a request_vote of its term marked ``DEPOSE_KEY`` (at most once per ``raftMinTimeout`` per
sender); the leader steps down to that term without voting, as for any higher-term vote
request above, and the next election includes the node. It disturbs nothing more than that
node's own next vote request would have.

**A restarted member holds back** (its journal has a term): its first election deadline leaves the
live leader time to re-dial it (at most every ``connectionRetryTime``) and send an append_entries
before it may stand. Its vote request would depose a healthy leader (pysyncobj has no pre-vote)
and cost every trainer a failover; seen after follower restarts in the bench.

**Keep-alives with a quiet leader.** A follower of a quiet leader sends them with the leader's
heartbeats, and its timer is the longer ``NodeSignals.keepalive_period_floor_s`` (``quiescence``).

It owns ``NodeSignals.heard_leader_at`` and ``send_keepalives``. The message shapes it builds
and reads are declared in ``pysyncobj_internals.MESSAGE_SHAPES``. The policies are pure functions
(``leader_lost_deadline``, ``vote_refused``, ``refusal_starts_election``).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable
from typing import Any

from lighthouse_cluster.raft.extensions.signals import NodeSignals, draw_election_timeout
from lighthouse_cluster.raft.host import Extension, RaftHost
from lighthouse_cluster.raft.pysyncobj_internals import RAFT_STATE, monotonic

__all__ = ["DEPOSE_KEY", "FastElection", "HANDOVER_KEY", "KEEPALIVE", "leader_lost_deadline",
           "refusal_starts_election", "vote_refused"]

log = logging.getLogger(__name__)

# Sent between followers so that their link never looks idle to pysyncobj (module docstring).
KEEPALIVE = {"type": "lighthouse_cluster_keepalive"}
# A key of a request_vote: the candidate stands because its leader handed leadership over to it
# (Raft's TimeoutNow), so voters answer it at once (see ``vote_refused``). pysyncobj ignores it.
HANDOVER_KEY = "lighthouse_cluster_handover"
# A key of a request_vote sent to a leader of an older term in answer to its append_entries: Raft's
# "reply with the higher term", which pysyncobj leaves out (module docstring). Only a
# leader acts on it (it steps down, without a vote); an older node takes it as a vote request.
DEPOSE_KEY = "lighthouse_cluster_depose"


def leader_lost_deadline(now: float, heard_leader_at: float, window_s: float, rank: int, stagger_s: float,
                         jitter_s: float) -> float:
    """When a follower whose connection to its leader closed stands for election: at the end of its
    vote-refusal window (``window_s`` after it last heard the leader, the earliest any election
    timeout of its would fire), ``rank`` staggers later, plus ``jitter_s``. ``rank`` orders the
    members other than the lost leader (by node id, the same order on every member), so the
    survivors stand one after the other, not together (a split vote costs a whole timeout more).
    All times are one node's monotonic seconds."""
    return max(now, heard_leader_at + window_s) + rank * stagger_s + jitter_s


def vote_refused(now: float, heard_leader_at: float, window_s: float, *, handover: bool) -> bool:
    """Whether a node puts off a ``request_vote`` (Raft thesis, section 4.2.3): it heard from a
    current leader (an append_entries of a term >= its own; for a leader, itself) less than
    ``window_s`` ago on its own clock, and the candidate does not stand on a handover.

    All times are one node's monotonic seconds. ``heard_leader_at`` later than ``now`` cannot come
    from this process (a value from another node's clock, e.g. an older version's snapshot): it is
    ignored rather than trusted to refuse for an unbounded time.

    The quorum lease rests on this (``core/lease.py``, point 3): every node that stored a leader's
    lease confirmation grants no vote until ``window_s`` after it last heard from that leader, so no
    successor is elected before then, unless on a handover (whose winner waits out the lease)."""
    if handover:
        return False
    return 0.0 <= now - heard_leader_at < window_s


def refusal_starts_election(candidate_log: tuple[int, int], own_log: tuple[int, int], *, since_leader_s: float,
                            min_timeout_s: float, term_matches: bool, follower_without_vote_or_leader: bool) -> bool:
    """Whether a follower that has just handled a ``request_vote`` stands now: the leader is gone
    (not heard for half ``min_timeout_s``), the request is of the follower's term, it is a follower
    that voted for no one and knows no leader, and the candidate's (last term, last index) is
    strictly behind its own (a strict order: two nodes never trigger each other)."""
    if since_leader_s < 0.5 * min_timeout_s or not term_matches or not follower_without_vote_or_leader:
        return False
    return candidate_log < own_log


class FastElection(Extension):
    """The election rules of the module docstring. ``vote_refusal_s``: the refusal window
    (default: the conf's ``raftMinTimeout`` as given, read before a hold-back raises it)."""

    def __init__(self, signals: NodeSignals, conf: Any, *, vote_refusal_s: float | None = None) -> None:
        self.signals = signals
        self.early_elections = 0  # how many elections this node started early (for logs and tests)
        self.leader_connection_losses = 0  # how often the leader's connection closed on this follower
        self.keepalives_sent = 0
        self.votes_put_off = 0  # request_vote messages put off by the refusal window
        self.handover_term: int | None = None  # the last term this node stood in on a handover
        self.stale_leaders_told = 0  # DEPOSE_KEY requests sent
        self.vote_refusal_s = vote_refusal_s if vote_refusal_s is not None else conf.raftMinTimeout
        self._vote_kept_s = conf.raftMaxTimeout  # how long a put-off request is kept
        self._keepalive_at = 0.0
        self._deferred_votes: dict[Any, tuple[float, dict[str, Any]]] = {}  # node -> (received at, request)
        self._handover_pending: int | None = None  # the term of the leader that sent us TimeoutNow
        self._handover_sent: int | None = None
        self._told_at: dict[Any, float] = {}  # stale leader -> when this node last told it
        self._lost_leader: tuple[Any, float] | None = None  # (leader, last heard) whose connection closed
        self._was_leader = False  # at the start of the current tick

    def attach(self, host: RaftHost) -> None:
        super().attach(host)
        self.signals.heard_leader_at = monotonic()  # a node that starts counts as having heard one
        self.signals.send_keepalives = self.send_keepalives

    @property
    def heard_leader_at(self) -> float:
        return self.signals.heard_leader_at

    def _heard_leader(self, at: float) -> None:
        self.signals.heard_leader_at = at

    def election_timeout(self) -> float:
        return draw_election_timeout(self.host.pso_election_timeout(), self.signals)

    def keepalive_period_s(self) -> float:
        """How often a follower sends its keep-alives (``connectionTimeout / 5``, or a quiet
        leader's longer period)."""
        return max(self.host.conf.connectionTimeout / 5, self.signals.keepalive_period_floor_s())

    # -- start ----------------------------------------------------------------------------------

    def on_started(self) -> None:
        host = self.host
        if host.raftCurrentTerm > 0 and host.otherNodes:
            # A restarted member: give the live leader time to re-dial it (at most every
            # connectionRetryTime) and send an append_entries before it may stand; its vote
            # request would depose a healthy leader (no pre-vote).
            conf = host.conf
            host.pso_election_deadline = (monotonic() + conf.connectionRetryTime + 2 * conf.appendEntriesPeriod
                                          + self.election_timeout())

    # -- ticks ----------------------------------------------------------------------------------

    def next_deadlines(self) -> Iterable[float]:
        """The next keep-alive while there is a follower link to keep, and the end of the refusal
        window while a vote request is put off."""
        host = self.host
        out: list[float] = []
        if not host._isLeader():
            leader = host._getLeader()
            if any(node != leader and host.isNodeConnected(node) for node in host.otherNodes):
                out.append(self._keepalive_at + self.keepalive_period_s())
        if self._deferred_votes:
            out.append(self.signals.heard_leader_at + self.vote_refusal_s)
        return out

    def before_tick(self) -> None:
        self._was_leader = self.host._isLeader()
        if self._deferred_votes:
            # Before pysyncobj's own election check: a follower whose window ends together with its
            # election timeout votes for the candidate that asked first rather than stand against it.
            self._handle_deferred_votes(monotonic())

    def after_tick(self) -> None:
        host = self.host
        now = monotonic()
        if self._was_leader or host._isLeader():
            self._heard_leader(now)  # a leader hears from itself (and one that fell back did until now)
        self._send_handover_votes()
        if self._deferred_votes:
            self._handle_deferred_votes(now)
        if now - self._keepalive_at < self.keepalive_period_s() and now >= self._keepalive_at:
            return
        self.send_keepalives(now)

    def send_keepalives(self, now: float) -> None:
        """On the tick thread: a keep-alive to every connected peer other than the leader (none
        from a leader); the next is due ``keepalive_period_s`` after ``now``."""
        self._keepalive_at = now
        host = self.host
        if host._isLeader():
            return
        leader = host._getLeader()
        for node in host.otherNodes:
            if node != leader and host.pso_send(node, KEEPALIVE):
                self.keepalives_sent += 1

    # -- messages -------------------------------------------------------------------------------

    def message_in(self, node: Any, message: Any) -> bool:
        if message == KEEPALIVE:
            return True  # reading it was the point
        host = self.host
        kind = message.get("type") if isinstance(message, dict) else None
        if kind == "request_vote" and message.get(DEPOSE_KEY):
            if host._isLeader() and message.get("term", -1) > host.raftCurrentTerm:
                self._step_down_without_vote(node, message["term"])
            return True  # no vote request: a node that is no leader has nothing to do with it
        if kind == "append_entries" and message.get("term", -1) < host.raftCurrentTerm and host.selfNode is not None:
            self._tell_stale_leader(node, message.get("term", -1))
        if kind == "append_entries" and message.get("term", -1) >= host.raftCurrentTerm:
            self._heard_leader(monotonic())
        elif kind == "timeout_now" and message.get("term", -1) >= host.raftCurrentTerm \
                and node == host._getLeader():
            self._handover_pending = host.raftCurrentTerm  # pysyncobj stands at its next tick
        elif kind == "request_vote" and self._put_off_vote(node, message):
            return True
        return False

    def message_handled(self, node: Any, message: Any, was_leader: bool) -> None:
        host = self.host
        if was_leader and not host._isLeader():
            self._heard_leader(monotonic())
        if not (isinstance(message, dict) and message.get("type") == "request_vote") or host.selfNode is None:
            return
        # Only when the leader is gone (the failover case); a live leader deposed by a stale node's
        # higher term is refused by both up-to-date nodes, and the normal timers pick one of them.
        if was_leader:
            return
        own = host.pso_last_log()
        their = (message.get("last_log_term"), message.get("last_log_index"))
        if not refusal_starts_election(
                their, own, since_leader_s=monotonic() - self.signals.heard_leader_at,
                min_timeout_s=host.conf.raftMinTimeout, term_matches=message.get("term") == host.raftCurrentTerm,
                follower_without_vote_or_leader=(host.pso_state == RAFT_STATE.FOLLOWER and host.pso_voted_for is None
                                                 and host._getLeader() is None)):
            return
        self.early_elections += 1
        log.info("refused the vote of %s (log %s behind ours %s) in term %d: starting an election now",
                 getattr(node, "address", node), their, own, message["term"])
        # Within a fifth of the minimum election timeout (jittered: both up-to-date nodes refuse a
        # stale node, and they must not both stand at once).
        host.pso_election_deadline = monotonic() + random.uniform(0.0, 0.2 * host.conf.raftMinTimeout)

    def node_disconnected(self, node: Any) -> None:
        """If ``node`` is this follower's leader, stand at ``leader_lost_deadline`` unless an
        election is due sooner."""
        host = self.host
        heard = self.signals.heard_leader_at
        if host.selfNode is None or host.pso_state != RAFT_STATE.FOLLOWER or node != host._getLeader():
            return
        if self._lost_leader == (node, heard):
            return  # the same silence: a failed re-dial closes the connection again
        if monotonic() - heard >= 0.5 * host.conf.connectionTimeout:
            return  # dropped for its silence, not closed by a dead process: a stalled leader's patience holds
        self._lost_leader = (node, heard)
        stagger = 0.2 * host.conf.raftMinTimeout
        rank = sum(1 for other in host.otherNodes if other != node and other.id < host.selfNode.id)
        deadline = leader_lost_deadline(monotonic(), heard, self.vote_refusal_s, rank, stagger,
                                        random.uniform(0.0, 0.25 * stagger))
        self.leader_connection_losses += 1
        address = getattr(node, "address", node)
        if deadline >= host.pso_election_deadline:
            log.info("the connection to the leader %s closed: its election timeout, in %.0f ms, comes sooner "
                     "(rank %d)", address, max(0.0, host.pso_election_deadline - monotonic()) * 1000, rank)
            return
        host.pso_election_deadline = deadline
        log.info("the connection to the leader %s closed: standing in %.0f ms unless it is back (rank %d)",
                 address, max(0.0, deadline - monotonic()) * 1000, rank)

    # -- votes ----------------------------------------------------------------------------------

    def _put_off_vote(self, node: Any, message: dict[str, Any]) -> bool:
        """Whether ``message`` (a request_vote) is put off or handled without a vote here."""
        host = self.host
        now = monotonic()
        if host._isLeader():
            self._heard_leader(now)
        if host.selfNode is None or not vote_refused(now, self.signals.heard_leader_at, self.vote_refusal_s,
                                                     handover=bool(message.get(HANDOVER_KEY))):
            self._deferred_votes.pop(node, None)
            return False
        self.votes_put_off += 1
        if host._isLeader():
            if message.get("term", -1) > host.raftCurrentTerm:
                self._step_down_without_vote(node, message["term"])
            return True
        held = self._deferred_votes.get(node)
        if held is None or held[1].get("term", -1) <= message.get("term", -1):
            self._deferred_votes[node] = (now, message)
        return True

    def _handle_deferred_votes(self, now: float) -> None:
        """Handle the vote requests put off, once the refusal window is over (requests older than
        raftMaxTimeout are dropped: their candidate has asked again)."""
        host = self.host
        for node, (received_at, request) in list(self._deferred_votes.items()):
            if now - received_at > self._vote_kept_s or request["term"] < host.raftCurrentTerm:
                del self._deferred_votes[node]
            elif not vote_refused(now, self.signals.heard_leader_at, self.vote_refusal_s, handover=False):
                del self._deferred_votes[node]
                host.on_raft_message(node, request)

    def _step_down_without_vote(self, node: Any, term: int) -> None:
        """This leader takes ``node``'s higher ``term`` and steps down, without granting the vote:
        a log "behind" everything keeps pysyncobj from granting it."""
        host = self.host
        host.pso_handle_message(node, {"type": "request_vote", "term": term, "last_log_term": -1,
                                       "last_log_index": -1})
        self._heard_leader(monotonic())
        # As a vote would: its election deadline dates from before it led.
        host.pso_election_deadline = monotonic() + self.election_timeout()

    def _tell_stale_leader(self, node: Any, term: int) -> None:
        """``node`` sent an append_entries of ``term``, older than ours: tell it our term."""
        host = self.host
        now = monotonic()
        if now - self._told_at.get(node, float("-inf")) < host.conf.raftMinTimeout:
            return
        self._told_at[node] = now
        last_term, last_index = host.pso_last_log()
        if host.pso_send(node, {"type": "request_vote", "term": host.raftCurrentTerm, "last_log_term": last_term,
                                "last_log_index": last_index, DEPOSE_KEY: True}):
            self.stale_leaders_told += 1
            log.info("%s leads term %d, older than ours (%d): told it our term",
                     getattr(node, "address", node), term, host.raftCurrentTerm)

    def _send_handover_votes(self) -> None:
        """When this node just stood on its leader's TimeoutNow, ask every peer again with the
        request marked as a handover (a peer that put pysyncobj's unmarked one off answers this)."""
        host = self.host
        pending = self._handover_pending
        if pending is None or host.pso_state != RAFT_STATE.CANDIDATE:
            return
        term = host.raftCurrentTerm
        if term != pending + 1 or self._handover_sent == term or host.pso_voted_for != host.selfNode.id:
            if term > pending + 1:
                self._handover_pending = None  # a later election: no longer the handover's
            return
        self._handover_sent = self.handover_term = term
        self._handover_pending = None
        last_term, last_index = host.pso_last_log()
        request = {"type": "request_vote", "term": term, "last_log_index": last_index, "last_log_term": last_term,
                   HANDOVER_KEY: True}
        for node in host.otherNodes:
            host.pso_send(node, request)
        log.info("standing on a handover in term %d", term)
