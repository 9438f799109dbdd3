"""``FastElectionSyncObj``: pysyncobj's ``SyncObj`` whose failovers take one election, not two.

It owns the two changes to pysyncobj's election behaviour (benchmarks F8) and the hold-back of a
restarted member; the private pysyncobj state they need comes from ``pysyncobj_internals``. Its
tick thread sleeps until the next deadline (``adaptive_tick``), the keep-alives' included, and
it acknowledges an idle leader's heartbeats a few times a second (``idle_acks``).
"""

from __future__ import annotations

import logging
import random
from typing import Any

from lighthouse_cluster.raft.idle_acks import IdleAckSyncObj
from lighthouse_cluster.raft.pysyncobj_internals import RAFT_STATE, monotonic

log = logging.getLogger(__name__)

# Sent between followers so that their link never looks idle to pysyncobj (see FastElectionSyncObj).
KEEPALIVE = {"type": "lighthouse_cluster_keepalive"}


class FastElectionSyncObj(IdleAckSyncObj):
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
        if self.raftCurrentTerm > 0 and self.otherNodes:
            # A restarted member (its journal has a term): give the live leader time to re-dial
            # it (at most every connectionRetryTime) and send an append_entries before it may
            # stand. Its vote request would depose a healthy leader (pysyncobj has no pre-vote)
            # and cost every trainer a failover; seen after follower restarts in the bench.
            conf = self.conf
            self.pso_election_deadline = (monotonic() + conf.connectionRetryTime + 2 * conf.appendEntriesPeriod
                                          + self.pso_election_timeout())

    def tick_deadlines(self) -> list[float]:
        """pysyncobj's deadlines, and the next keep-alive while there is a follower link to keep."""
        out = super().tick_deadlines()
        if not self._isLeader():
            leader = self._getLeader()
            if any(node != leader and self.isNodeConnected(node) for node in self.otherNodes):
                out.append(self._last_keepalive + self.conf.connectionTimeout / 5)
        return out

    def _onTick(self, timeToWait: float = 0.0) -> None:
        super()._onTick(timeToWait)
        now = monotonic()
        if now - self._last_keepalive < self.conf.connectionTimeout / 5:
            return
        self._last_keepalive = now
        if self._isLeader():
            return
        leader = self._getLeader()
        for node in self.otherNodes:
            if node != leader and self.pso_send(node, KEEPALIVE):
                self.keepalives_sent += 1

    def on_raft_message(self, node: Any, message: Any) -> None:
        if message == KEEPALIVE:
            return  # reading it was the point
        kind = message.get("type") if isinstance(message, dict) else None
        if kind == "append_entries" and message.get("term", -1) >= self.raftCurrentTerm:
            self._leader_contact = monotonic()
        was_leader = self._isLeader()
        self.pso_handle_message(node, message)
        if kind != "request_vote" or self.selfNode is None:
            return
        # Only when the leader is gone (the failover case). A live leader deposed by a stale node's
        # higher term (no pre-vote) is refused by both up-to-date nodes; there the normal timers
        # pick one of them, as without this class: two early candidacies would split the vote.
        if was_leader or monotonic() - self._leader_contact < 0.5 * self.conf.raftMinTimeout:
            return
        if message.get("term") != self.raftCurrentTerm \
                or self.pso_state != RAFT_STATE.FOLLOWER \
                or self.pso_voted_for is not None \
                or self._getLeader() is not None:
            return
        my_term, my_index = self.pso_last_log()
        their = (message["last_log_term"], message["last_log_index"])
        if their < (my_term, my_index):
            self.early_elections += 1
            log.info("refused the vote of %s (log %s behind ours %s) in term %d: starting an election now",
                     getattr(node, "address", node), their, (my_term, my_index), message["term"])
            # Within a fifth of the minimum election timeout (jittered: when a stale node disrupts a
            # live cluster, both up-to-date nodes refuse it, and they must not both stand at once).
            self.pso_election_deadline = monotonic() + random.uniform(0.0, 0.2 * self.conf.raftMinTimeout)
