"""``AdaptiveTick``: pysyncobj's tick thread sleeps until its next deadline, not 10 ms.

pysyncobj's tick thread runs ``_onTick`` in a loop: the Raft work, then a wait in its poller for
socket events of at most ``autoTickPeriod``. With the 10 ms tick that sub-second failover needs
(a 50 ms tick split votes), an idle node ticked 100 times a second for nothing: most of a node's
idle CPU (docs/design/idle-cost.md). Here the wait lasts until the next thing that is due, at most ``longest_s``:

* a leader's next append_entries (``appendEntriesPeriod`` after the last);
* a follower's or candidate's election deadline;
* the next re-dial of a disconnected peer (``connectionRetryTime``);
* every other extension's ``next_deadlines`` (keep-alives, a put-off vote) and whatever a caller
  registers with the host's ``add_tick_deadline`` (``RaftNode``: stuck connects).

Everything else that needs a tick is an event that ends the wait at once: a socket readable or
writable, and the host's ``wake()``, pysyncobj's own pipe, which ``_applyCommand`` (every write,
from any thread) already writes to. A deadline that was due when the tick started and is still
pending (an election deadline while connected to no one: pysyncobj does not stand then) is
looked at again after ``autoTickPeriod``, as before. Other timers of pysyncobj's that are not
listed (log compaction by age, the journal's once-a-second metadata write, a leader's step-down
after ``leaderFallbackTimeout``) run at most ``longest_s`` late. Without pysyncobj's pipe
(``appendEntriesUseBatch=True``) nothing could interrupt a wait: the tick stays fixed.

The decision is ``tick_wait``, a pure function of the clock and the deadlines; the rest is the
shell that collects them (pysyncobj's own deadlines through ``pysyncobj_internals``). It publishes how late
a tick is (``NodeSignals.tick_lateness``: ``stall_tolerance`` measures stalls by it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from lighthouse_cluster.raft.extensions.signals import NodeSignals
from lighthouse_cluster.raft.host import Extension, RaftHost
from lighthouse_cluster.raft.pysyncobj_internals import RAFT_STATE, monotonic

__all__ = ["AdaptiveTick", "tick_wait"]

log = logging.getLogger(__name__)

# The longest the tick thread waits with nothing due (RaftSettings.idle_tick_max_s).
DEFAULT_LONGEST_S = 0.1


def tick_wait(now: float, tick_started: float, deadlines: Iterable[float], *, overdue_s: float,
              longest_s: float) -> float:
    """How long the tick thread may wait for socket events, at ``now``, after a tick that started
    at ``tick_started``, given the ``monotonic()`` times at which something is due.

    A deadline still in the future: until it. One that came due during the tick (after it
    started): none, tick again at once. One that was due before the tick started and is still
    listed was looked at and not acted on (pysyncobj starts no election while connected to no
    one): ``overdue_s``, the fixed tick this replaces. Never more than ``longest_s``."""
    wait = longest_s
    for deadline in deadlines:
        if deadline > now:
            wait = min(wait, deadline - now)
        elif deadline > tick_started:
            return 0.0
        else:
            wait = min(wait, overdue_s)
    return max(0.0, wait)


class AdaptiveTick(Extension):
    """The tick thread's wait until its next deadline (module docstring). ``longest_s``: the
    longest wait while nothing is due (``RaftSettings.idle_tick_max_s``)."""

    def __init__(self, signals: NodeSignals, *, longest_s: float = DEFAULT_LONGEST_S) -> None:
        self.signals = signals
        self.longest_s = longest_s
        self.tick_started = 0.0
        self.poll_due = float("inf")  # monotonic() time at which the last wait was to end
        self.tick_waits = 0  # how many waits the tick thread computed (for tests and logs)
        self.last_wait = 0.0  # the last of them, in seconds

    def attach(self, host: RaftHost) -> None:
        super().attach(host)
        self.signals.tick_lateness = self.tick_lateness

    def tick_lateness(self, now: float) -> float:
        """How long after its last wait was due to end ``now`` is (0.0 if not late)."""
        return max(0.0, now - self.poll_due)

    def longest_wait_s(self) -> float:
        return max(self.longest_s, self.signals.longest_wait_floor_s())

    def before_tick(self) -> None:
        self.tick_started = monotonic()

    def next_deadlines(self) -> Iterable[float]:
        """pysyncobj's own: the leader's next heartbeat or the election deadline, and re-dials."""
        host = self.host
        out: list[float] = []
        if host.pso_state == RAFT_STATE.LEADER:
            out.append(host.pso_next_append_entries())
        elif host.selfNode is not None:
            out.append(host.pso_election_deadline)
        out.extend(host.pso_redial_deadlines())
        return out

    def tick_wait(self, overdue_s: float) -> float | None:
        host = self.host
        if not host.pso_can_wake:
            return None  # nothing could end a longer wait: pysyncobj's fixed tick
        if host.commands_overran:
            wait = 0.0
        else:
            try:
                deadlines = host.tick_deadlines()
            except Exception:  # noqa: BLE001 -- never leave the tick thread without a bounded wait
                log.exception("computing the tick thread's next deadline failed")
                deadlines = [self.tick_started]  # overdue: the fixed tick
            wait = tick_wait(monotonic(), self.tick_started, deadlines, overdue_s=overdue_s,
                             longest_s=self.longest_wait_s())
        self.tick_waits += 1
        self.last_wait = wait
        self.poll_due = monotonic() + wait
        return wait
