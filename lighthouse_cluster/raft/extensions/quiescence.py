"""``Quiescence``: a cluster with no clients sends a few Raft messages a second, not fifty.

The reasons are those of ``raft.quiescence`` (docs/design/quiescence.md). In short: once no client has
called any node for ``quiet_after_s``, no entry was written and every connected follower has the
whole log, the leader heartbeats every ``quiet_period_s`` and says so in each append_entries
(``QUIET_KEY``: its period). A follower that reads that, with no client of its own either, sets
its election deadline to ``QUIET_TIMEOUTS`` times the period and sends its keep-alives with each
of those heartbeats (``NodeSignals.send_keepalives``, fast election's), falling back to a timer of
``QUIET_KEEPALIVE_FALLBACK`` periods (``NodeSignals.keepalive_period_floor_s``, published here).
The tick thread may then wait up to the quiet period (``NodeSignals.longest_wait_floor_s``).

**Waking.** Any client call wakes the node it reaches at once (``note_client_activity``, any
thread): the leader goes back to ``appendEntriesPeriod`` and sends an append_entries now, without
the key; a follower sends its leader ``WAKE`` and draws a normal election timeout again, counted
from the leader's last append_entries (``NodeSignals.heard_leader_at``) but not ending before
``raftMinTimeout`` from now.

**Safety.** A longer election timeout only delays an election; the lease rests on the vote
refusal window, which this does not change. A node that does not know the key would keep its
short election timeout under slow heartbeats, so the leader quiesces only while
``quiet_allowed()`` holds (every member reads ``QUIET_KEY``: ``QUIESCENCE_SCHEMA_VERSION``).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import Any

from lighthouse_cluster.raft.extensions.signals import NodeSignals, draw_election_timeout
from lighthouse_cluster.raft.host import Extension, RaftHost
from lighthouse_cluster.raft.pysyncobj_internals import monotonic
from lighthouse_cluster.raft.quiescence import (BUSY_CHECK_S, QUIET_KEEPALIVE_FALLBACK, QUIET_KEY, QUIET_TIMEOUTS,
                                                WAKE, WAKE_EVERY_S)

__all__ = ["QUIET_KEY", "Quiescence", "WAKE", "quiet_keepalive_floor_s"]

log = logging.getLogger(__name__)


def quiet_keepalive_floor_s(leader_period_s: float, connection_timeout_s: float) -> float:
    """The keep-alive timer of a quiet leader's follower, behind its heartbeats:
    ``QUIET_KEEPALIVE_FALLBACK`` periods, at most 0.7 ``connectionTimeout``."""
    return min(QUIET_KEEPALIVE_FALLBACK * leader_period_s, 0.7 * connection_timeout_s)


class Quiescence(Extension):
    """A leader that heartbeats slowly while no client calls (module docstring).

    ``quiet_after_s``: how long without a client, an entry or a follower catching up before the
    leader quiesces (0: never); ``quiet_period_s``: its heartbeat period then; ``quiet_allowed()``:
    on the tick thread, whether every member reads ``QUIET_KEY``."""

    def __init__(self, signals: NodeSignals, *, quiet_after_s: float = 0.0, quiet_period_s: float = 0.2,
                 quiet_allowed: Callable[[], bool] = lambda: False) -> None:
        self.signals = signals
        self.quiet_after_s = quiet_after_s
        self.quiet_period_s = quiet_period_s
        self._quiet_allowed = quiet_allowed
        self._client_at = monotonic()  # a client's last call to this node (written from any thread)
        self._busy_at = monotonic()  # the log or the followers last moved
        self._seen: tuple[Any, ...] | None = None
        self._busy_checked_at = float("-inf")
        self._awake_period_s: float | None = None  # appendEntriesPeriod while awake (a leader)
        self.quiet = False  # a leader: its heartbeats say it is quiet
        self.leader_quiet = False  # a follower: its leader's last append_entries said so
        self.quiet_spells = 0
        self.wakes_sent = 0
        self.keepalives_with_heartbeats = 0
        self._leader_period_s = quiet_period_s  # a follower: its quiet leader's heartbeat period
        self._wake_sent_at = float("-inf")

    def attach(self, host: RaftHost) -> None:
        super().attach(host)
        self.signals.keepalive_period_floor_s = self.keepalive_period_floor_s
        self.signals.longest_wait_floor_s = self.longest_wait_floor_s

    def on_started(self) -> None:
        self._awake_period_s = self.host.conf.appendEntriesPeriod

    # -- waking -----------------------------------------------------------------------------------

    def note_client_activity(self) -> None:
        """A client called this node (any thread): stay awake, and wake now if quiet."""
        self._client_at = monotonic()
        if self.quiet or self.leader_quiet:
            self.host.wake()

    def _client_recent(self, now: float) -> bool:
        return now - self._client_at < self.quiet_after_s

    # -- published for the others -------------------------------------------------------------------

    def keepalive_period_floor_s(self) -> float:
        if not self.leader_quiet:
            return 0.0
        return quiet_keepalive_floor_s(self._leader_period_s, self.host.conf.connectionTimeout)

    def longest_wait_floor_s(self) -> float:
        """Quiet, the tick thread waits up to the quiet period (its deadlines are that far apart)."""
        return self.quiet_period_s if self.quiet or self.leader_quiet else 0.0

    # -- the leader -------------------------------------------------------------------------------

    def _leader_may_quiesce(self, now: float) -> bool:
        """As leader: nothing happened for ``quiet_after_s``. While a client is recent the log and
        the followers are looked at only every ``BUSY_CHECK_S`` (docs/design/lease-renewal.md)."""
        if self.quiet_after_s <= 0:
            return False
        if self._client_recent(now) and now < self._busy_checked_at + BUSY_CHECK_S:
            return False
        self._busy_checked_at = now
        if not self._quiet_allowed():
            return False
        host = self.host
        connected = frozenset(n for n in host.otherNodes if host.isNodeConnected(n))
        last_index = host.pso_last_log()[1]
        behind = any(host.pso_match_index(n) < last_index for n in connected)
        seen = (host.raftCurrentTerm, last_index, host.raftCommitIndex, connected)
        if seen != self._seen or behind:
            self._seen = seen
            self._busy_at = now
        return not self._client_recent(now) and now - self._busy_at >= self.quiet_after_s

    def _set_quiet(self, quiet: bool) -> None:
        awake = self._awake_period_s
        if awake is None or quiet == self.quiet:
            return
        self.quiet = quiet
        host = self.host
        # pysyncobj reads the period from the conf whenever it schedules the next heartbeat.
        host.conf.appendEntriesPeriod = self.quiet_period_s if quiet else awake
        if quiet:
            self.quiet_spells += 1
            log.debug("quiet: no client for %.1f s, heartbeats every %.0f ms", self.quiet_after_s,
                      self.quiet_period_s * 1000)
        elif host._isLeader():
            host.pso_send_append_entries_now()  # without QUIET_KEY: the followers wake with it
            log.debug("awake: heartbeats every %.1f ms", awake * 1000)

    def message_out(self, node: Any, message: Any) -> Any:
        if self.quiet and isinstance(message, dict) and message.get("type") == "append_entries":
            return {**message, QUIET_KEY: self.quiet_period_s}
        return message

    # -- the followers ----------------------------------------------------------------------------

    def message_in(self, node: Any, message: Any) -> bool:
        if message != WAKE:
            return False
        if self.host._isLeader():
            self._client_at = monotonic()
            self._set_quiet(False)
        return True

    def message_handled(self, node: Any, message: Any, was_leader: bool) -> None:
        host = self.host
        if not host.is_current_leaders_append(node, message):
            return
        period = message.get(QUIET_KEY)
        if not (isinstance(period, (int, float)) and period > 0):
            self.leader_quiet = False
            return
        now = monotonic()
        self.leader_quiet = True
        self._leader_period_s = float(period)
        # pysyncobj has just drawn a normal election timeout for this append_entries: never shorter.
        quiet_deadline = now + random.uniform(*(m * period for m in QUIET_TIMEOUTS))
        host.pso_election_deadline = max(host.pso_election_deadline, quiet_deadline)
        if self._client_recent(now):
            self._send_wake(node, now)
        else:
            # Awake already (this tick read the heartbeat): the keep-alives go now.
            self.signals.send_keepalives(now)
            self.keepalives_with_heartbeats += 1

    def _send_wake(self, leader: Any, now: float) -> None:
        if now - self._wake_sent_at >= WAKE_EVERY_S and self.host.pso_send(leader, WAKE):
            self._wake_sent_at = now
            self.wakes_sent += 1

    def _wake_as_follower(self, now: float) -> None:
        """A client called this follower while its leader was quiet: wake the leader, and back
        to normal timeouts."""
        host = self.host
        self.leader_quiet = False
        leader = host._getLeader()
        if leader is not None:
            self._send_wake(leader, now)
        drawn = draw_election_timeout(host.pso_election_timeout(), self.signals)
        normal = max(self.signals.heard_leader_at + drawn, now + host.conf.raftMinTimeout)
        host.pso_election_deadline = min(host.pso_election_deadline, normal)

    # -- the tick ---------------------------------------------------------------------------------

    def before_tick(self) -> None:
        host = self.host
        now = monotonic()
        if host._isLeader():
            self.leader_quiet = False
            self._set_quiet(self._leader_may_quiesce(now))
        else:
            self._set_quiet(False)
            if self.leader_quiet and self._client_recent(now):
                self._wake_as_follower(now)
