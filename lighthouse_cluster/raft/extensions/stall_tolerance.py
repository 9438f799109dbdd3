"""``StallTolerance``: a tick thread that did not run for a while does not depose a live leader.

The reasons are those of ``raft.stall_tolerance`` (docs/design/stall-tolerance.md: at N >= 2048
replica groups the tick thread of every node stalled 150 ms to over a second many times a minute,
and each stall ended the term). In short:

**A node's own stall: read before acting on a timer, and do not count it against peers.**
pysyncobj checks the election deadline (and a leader its ``leaderFallbackTimeout``) before it
polls its sockets, and each connection its silence before it reads. Here every connection counts
a read event as a read before pysyncobj checks its silence (``socket_callback``, as each socket is
subscribed); and at the start of a tick that comes ``STALL_S`` or more after its wait was due
(``NodeSignals.tick_lateness``), every connection's last read, a leader's last response from each
follower and a follower's election deadline move on by the stall; and a node that stalled, or a
follower whose election deadline has passed, first reads what has arrived.

**The leader's stall: it asks its followers for patience.** A leader that measured stalls of at
least half the minimum election timeout within the last ``PATIENCE_WINDOW_S`` puts
``PATIENCE_FACTOR`` times the longest (at most ``PATIENCE_CAP_S``, ``patience_s``) into every
append_entries (``PATIENCE_KEY``); its followers add it to the election timeouts they draw
(``NodeSignals.leader_patience_s``, which this extension owns).

**Safety.** Raft's safety never depends on when a node times out; both only put off an election.
The quorum lease rests on the vote refusal window, which neither changes. An older follower
ignores ``PATIENCE_KEY`` and keeps its short timeouts.

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
from lighthouse_cluster.raft.stall_tolerance import PATIENCE_CAP_S, PATIENCE_KEY, PATIENCE_WINDOW_S, STALL_S, patience_s

__all__ = ["PATIENCE_KEY", "STALL_S", "StallTolerance", "asked_patience_s", "patience_s"]

log = logging.getLogger(__name__)


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
