"""``StallTolerance``: a tick thread that did not run for a while does not depose a live leader.

Every Raft timer here is short (election timeout 150-450 ms, for a fast failover), and the tick
thread shares a GIL with the node's gRPC front end and two cores with everything else on the
host. At N >= 2048 replica groups the tick thread of every node stalls for 150 ms to over a
second many times a minute, and each stall used to end the term (an election every 1-3 s, and
each election cost 2048 re-routed calls, so the next stall came before the cluster recovered;
docs/design/stall-tolerance.md). Two kinds of stall, two answers:

**A node's own stall: read before acting on a timer, and do not count it against peers.**
pysyncobj's tick checks the election deadline (and a leader its ``leaderFallbackTimeout``) *before*
it polls its sockets, and each connection checks that it read something within
``connectionTimeout`` before it reads. A follower whose thread stalled past its deadline, with the
leader's append_entries waiting unread in its socket, stood for election anyway, or dropped the
link on the very read that would have ended the silence. Here a connection counts a read
event as a read before pysyncobj checks its silence (``socket_callback``, as each socket is
subscribed); and at the start of a tick that comes
``STALL_S`` or more after its wait was due (``NodeSignals.tick_lateness``, adaptive tick's: the wait may have
ended early, so a stall can measure up to one wait short), every connection's last read, a
leader's last response from each follower and a follower's election deadline move on by the
stall (the host that stopped this node most likely stopped its leader too); and a node that
stalled, or a follower whose election deadline has passed, first reads what has arrived (a poll
that does not wait). An append_entries then moves the deadline on as it would have on time. A
follower whose leader is really gone notices it as much later as it was itself stopped.

**The leader's stall: it asks its followers for patience.** A leader that stalled sent no
append_entries meanwhile, and its followers, having read everything, rightly see silence. So a
leader that measured stalls of at least half the minimum election timeout (below that no follower
can time out) within the last ``PATIENCE_WINDOW_S``, as leader or before (the host that stalled
it as a follower stalls its leadership too), puts ``PATIENCE_FACTOR`` times the longest
(at most ``PATIENCE_CAP_S``) into every append_entries (``PATIENCE_KEY``). Its followers add it to
the election timeout they draw for that append_entries. A leader that stalls up to
twice as long as it did recently is waited for; a leader that dies is replaced that much later
than otherwise, only while its recent stalls say that so much silence does not mean it is dead.

**Safety.** Raft's safety never depends on when a node times out; both changes only put off an
election. The quorum lease (``core/lease.py``) rests on the vote refusal window
(``extensions.fast_election.vote_refused``), which neither changes, and a new leader still waits out the
lease in full. An older follower ignores ``PATIENCE_KEY`` (pysyncobj reads only the keys it
knows) and keeps its short timeouts, as before; no schema gate is needed.

It owns ``NodeSignals.leader_patience_s`` (what this follower's leader asked for), which every
extension that draws an election timeout adds (``draw_election_timeout``).

Candidate for the GIL measurement of issue #33: the stalls it tolerates come from the tick thread
sharing the GIL with the node's gRPC front end.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

from lighthouse_cluster.raft.extensions.signals import NodeSignals, draw_election_timeout
from lighthouse_cluster.raft.host import Extension
from lighthouse_cluster.raft.pysyncobj_internals import RAFT_STATE, counting_arrivals, monotonic

__all__ = ["PATIENCE_KEY", "STALL_S", "StallTolerance", "asked_patience_s", "patience_s"]

log = logging.getLogger(__name__)

# A poll that returned this much after it was due (or a tick that started this late) was a stall.
STALL_S = 0.05
# A key of an append_entries: the leader's recent longest stall, in seconds (see the docstring).
PATIENCE_KEY = "lighthouse_cluster_patience"
# A leader asks for PATIENCE_FACTOR times its longest stall of the last PATIENCE_WINDOW_S, at
# most PATIENCE_CAP_S (stalls vary: 150-880 ms on one node within a minute at N=2048,
# docs/design/stall-tolerance.md).
PATIENCE_FACTOR = 2.0
PATIENCE_WINDOW_S = 20.0
PATIENCE_CAP_S = 2.0


def patience_s(stalls: collections.deque[tuple[float, float]], now: float, *, floor_s: float,
               window_s: float = PATIENCE_WINDOW_S, factor: float = PATIENCE_FACTOR,
               cap_s: float = PATIENCE_CAP_S) -> float:
    """What a leader asks its followers to add to their election timeouts: ``factor`` times the
    longest of its stalls ``(at, seconds)`` of at least ``floor_s`` within ``window_s`` before
    ``now``, at most ``cap_s``; 0.0 when there is none. Drops the stalls older than the window
    from ``stalls``."""
    while stalls and stalls[0][0] < now - window_s:
        stalls.popleft()
    longest = max((s for _, s in stalls if s >= floor_s), default=0.0)
    return min(factor * longest, cap_s)


def asked_patience_s(value: Any) -> float:
    """The patience an append_entries asks for (its ``PATIENCE_KEY`` value): a positive number of
    seconds, at most ``PATIENCE_CAP_S``; 0.0 for anything else."""
    if not isinstance(value, (int, float)) or not value > 0:
        return 0.0
    return min(float(value), PATIENCE_CAP_S)


class StallTolerance(Extension):
    """A node whose stalls do not cost an election (module docstring)."""

    def __init__(self, signals: NodeSignals) -> None:
        self.signals = signals
        self.stalls = 0  # how many stalls this node measured (for metrics, logs and tests)
        self.longest_stall_s = 0.0
        self.reads_before_timers = 0  # non-blocking polls at a tick's start (for tests)
        self.patience_asked_s = 0.0  # a leader: what its append_entries ask for now
        self.recent_stalls: collections.deque[tuple[float, float]] = collections.deque()

    @property
    def leader_patience_s(self) -> float:
        """A follower: what its leader's last append_entries asked for."""
        return self.signals.leader_patience_s

    def socket_callback(self, callback: Any) -> Any:
        return counting_arrivals(callback)

    def message_out(self, node: Any, message: Any) -> Any:
        asked = self.patience_asked_s
        if asked > 0.0 and isinstance(message, dict) and message.get("type") == "append_entries":
            return {**message, PATIENCE_KEY: asked}
        return message

    def message_handled(self, node: Any, message: Any, was_leader: bool) -> None:
        host = self.host
        if not host.is_current_leaders_append(node, message):
            return
        asked = asked_patience_s(message.get(PATIENCE_KEY))
        self.signals.leader_patience_s = asked
        if asked > 0.0:
            # pysyncobj has just drawn a normal election timeout for this append_entries.
            drawn = draw_election_timeout(host.pso_election_timeout(), self.signals)
            host.pso_election_deadline = max(host.pso_election_deadline, monotonic() + drawn)

    def before_tick(self) -> None:
        host = self.host
        now = monotonic()
        stall = self.signals.tick_lateness(now)
        leader = host.pso_state == RAFT_STATE.LEADER
        if stall >= STALL_S:
            self.stalls += 1
            self.longest_stall_s = max(self.longest_stall_s, stall)
            # Whatever the role: the host that stalled this node as follower stalls its leadership.
            self.recent_stalls.append((now, stall))
            host.pso_excuse_stall(stall, now)
            if not leader and host.selfNode is not None:
                # The host that stopped this node most likely stopped its leader too.
                host.pso_election_deadline += stall
            log.debug("the Raft tick thread stalled %.0f ms", stall * 1000)
        asked = patience_s(self.recent_stalls, now, floor_s=0.5 * host.conf.raftMinTimeout)  # prunes too
        if leader:
            self.signals.leader_patience_s = 0.0
            if asked > self.patience_asked_s:
                log.info("the Raft tick thread stalled up to %.0f ms lately: asking followers to wait %.0f ms "
                         "more before an election", max(x for _, x in self.recent_stalls) * 1000, asked * 1000)
            elif asked == 0.0 < self.patience_asked_s:
                log.info("no Raft tick thread stall for %.0f s: followers' election timeouts back to normal",
                         PATIENCE_WINDOW_S)
            self.patience_asked_s = asked
        else:
            self.patience_asked_s = 0.0
        if stall >= STALL_S or (not leader and host.selfNode is not None and host.pso_election_deadline < now):
            self.reads_before_timers += 1
            host.read_now()
