"""``AdaptiveTickSyncObj``: pysyncobj's tick thread sleeps until its next deadline, not 10 ms.

pysyncobj's tick thread runs ``_onTick`` in a loop: the Raft work (elections, heartbeats, applying
entries, the command queue, the on-tick callbacks), then a wait in its poller for socket events of
at most ``autoTickPeriod``. With the 10 ms tick that sub-second failover needs (a 50 ms tick split
votes), an idle node ticked 100 times a second for nothing: most of a node's idle CPU
(docs/design/idle-cost.md). Here the wait lasts until the next thing that is due, at most
``longest_s``:

* a leader's next append_entries (``appendEntriesPeriod`` after the last);
* a follower's or candidate's election deadline;
* the next re-dial of a disconnected peer (``connectionRetryTime``);
* whatever a caller registers with ``add_tick_deadline`` (``RaftNode``: stuck connects) and a
  subclass adds in ``tick_deadlines`` (``FastElectionSyncObj``: keep-alives).

Everything else that needs a tick is an event that ends the wait at once: a socket readable or
writable (Raft messages, connects), and ``wake()``, pysyncobj's own pipe, which ``_applyCommand``
(every write, from any thread) already writes to, and which ``RaftNode.call_on_tick_thread`` and
``destroy`` write to here. A deadline that was due when the tick started and is still pending
(an election deadline while connected to no one: pysyncobj does not stand then) is looked at
again after ``autoTickPeriod``, as before. Other timers of pysyncobj's that are not listed (log
compaction by age, the journal's once-a-second metadata write, a leader's step-down after
``leaderFallbackTimeout``) run at most ``longest_s`` late.

The decision is ``tick_wait``, a pure function of the clock and the deadlines; the rest is the
shell that collects them (private pysyncobj state through ``pysyncobj_internals``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from lighthouse_cluster.raft.durability import DurableSyncObj
from lighthouse_cluster.raft.pysyncobj_internals import RAFT_STATE, monotonic

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


class _DeadlinePoller:
    """pysyncobj's poller, whose ``poll(timeout)`` (the tick thread's wait) lasts ``wait(timeout)``."""

    def __init__(self, poller: Any, wait: Callable[[float], float]) -> None:
        self._inner = poller
        self._wait = wait

    def subscribe(self, descr: Any, callback: Any, eventMask: int) -> None:  # noqa: N803 -- pysyncobj's name
        self._inner.subscribe(descr, callback, eventMask)

    def unsubscribe(self, descr: Any) -> None:
        self._inner.unsubscribe(descr)

    def poll(self, timeout: float) -> None:
        self._inner.poll(self._wait(timeout))

    def poll_now(self) -> None:
        """Handle what has arrived, without waiting."""
        self._inner.poll(0.0)


class AdaptiveTickSyncObj(DurableSyncObj):
    """``SyncObj`` whose tick thread sleeps until its next deadline (see the module docstring).

    ``longest_s``: the longest wait (keyword argument; ``RaftSettings.idle_tick_max_s``). The
    conf's ``autoTickPeriod`` stays the wait for a deadline that is overdue. Without pysyncobj's
    pipe (``appendEntriesUseBatch=True``) nothing could interrupt a wait: the tick stays fixed."""

    def __init__(self, *args: Any, longest_s: float = DEFAULT_LONGEST_S, cipher: Any = None, **kwargs: Any) -> None:
        # Set before SyncObj.__init__: pysyncobj puts the attributes a SyncObj gains after it into
        # its snapshots (and the tick thread starts inside it).
        self._longest_s = longest_s
        self._message_cipher = cipher  # pysyncobj_internals.SyncObjInternals.encryptor
        self._tick_deadline_fns: list[Callable[[], float | None]] = []
        self._tick_started = 0.0
        self._poll_due = float("inf")  # monotonic() time at which the last wait was to end
        self._commands_left = False
        self.tick_waits = 0  # how many waits the tick thread computed (for tests and logs)
        self.last_wait = 0.0  # the last of them, in seconds
        super().__init__(*args, **kwargs)
        if self.pso_can_wake:
            # The tick thread is already running: it picks the new poller up at its next wait.
            self.pso_poller = _DeadlinePoller(self.pso_poller, self._wait_for)

    def longest_wait_s(self) -> float:
        """The longest the tick thread waits now (override to lengthen it while nothing is due)."""
        return self._longest_s

    def tick_lateness(self, now: float) -> float:
        """How long after its last wait was due to end ``now`` is (0.0 if not late): at a tick's
        start, how long the tick thread could not run (no CPU, the GIL held elsewhere) or handled
        what it read."""
        return max(0.0, now - self._poll_due)

    def socket_poller(self) -> Any:
        """pysyncobj's own poller (beneath the deadline wrapper), where every socket is registered."""
        poller = self.pso_poller
        return poller._inner if isinstance(poller, _DeadlinePoller) else poller

    def read_now(self) -> None:
        """On the tick thread: handle the messages that have arrived now, without waiting."""
        poller = self.pso_poller
        if isinstance(poller, _DeadlinePoller):
            poller.poll_now()
        else:
            poller.poll(0.0)

    def add_tick_deadline(self, fn: Callable[[], float | None]) -> None:
        """``fn()``, called on the tick thread before each wait: the ``monotonic()`` time of the
        next tick that ``fn``'s owner needs, or None. Register before anything is due."""
        self._tick_deadline_fns.append(fn)

    def wake(self) -> None:
        """End the tick thread's wait now (from any thread)."""
        self.pso_wake()

    def destroy(self) -> None:
        super().destroy()
        self.wake()  # the tick thread sees the request at its next tick, not after a long wait

    def tick_deadlines(self) -> list[float]:
        """The ``monotonic()`` times at which the next tick is due (override to add more)."""
        out: list[float] = []
        state = self.pso_state
        if state == RAFT_STATE.LEADER:
            out.append(self.pso_next_append_entries())
        elif self.selfNode is not None:
            out.append(self.pso_election_deadline)
        out.extend(self.pso_redial_deadlines())
        for fn in self._tick_deadline_fns:
            deadline = fn()
            if deadline is not None:
                out.append(deadline)
        return out

    def _onTick(self, timeToWait: float = 0.0) -> None:  # noqa: N803 -- pysyncobj's name
        self._tick_started = monotonic()
        super()._onTick(timeToWait)

    def _checkCommandsToApply(self) -> None:
        # pysyncobj drains the command queue for at most appendEntriesPeriod per tick: if it ran
        # that long, commands may be left (their pipe wake-ups were already read): tick again now.
        started = monotonic()
        super()._checkCommandsToApply()
        self._commands_left = monotonic() - started >= self.conf.appendEntriesPeriod

    def _wait_for(self, overdue_s: float) -> float:
        if self._commands_left:
            wait = 0.0
        else:
            try:
                deadlines = self.tick_deadlines()
            except Exception:  # noqa: BLE001 -- never leave the tick thread without a bounded wait
                log.exception("computing the tick thread's next deadline failed")
                deadlines = [self._tick_started]  # overdue: the fixed tick
            wait = tick_wait(monotonic(), self._tick_started, deadlines, overdue_s=overdue_s,
                             longest_s=self.longest_wait_s())
        self.tick_waits += 1
        self.last_wait = wait
        self._poll_due = monotonic() + wait
        return wait
