"""``Quiescence``: a cluster with no clients sends a few Raft messages a second, not fifty.

An idle node's cost is its Raft messages: a leader heartbeats every follower
every ``appendEntriesPeriod`` (37.5 ms) so that a follower notices its death within the election
timeout (150-450 ms), and each message costs a Python tick to read or send. That speed is what
the trainers' failover needs; a cluster nobody uses needs none of it. So, as CockroachDB quiesces
an idle range, the leader **quiesces**: once no client has called any node for ``quiet_after_s``
(no Quorum call, heartbeat, liveness keep-alive or forwarded call), no entry was written, and
every connected follower has the whole log, it heartbeats every ``quiet_period_s`` (200 ms)
instead, and says so in each append_entries (``QUIET_KEY``: its period). A follower that reads
that, and has had no client of its own for ``quiet_after_s`` either, sets its election deadline
to ``QUIET_TIMEOUTS`` times the period (0.8-1.6 s) instead of 0.15-0.45 s, and sends its
keep-alives to the other followers with each of those heartbeats, in the tick that reads it (no
wake-up of their own: a third of an idle follower's Raft wake-ups before), falling back to a
timer of ``QUIET_KEEPALIVE_FALLBACK`` periods (at most 0.7 ``connectionTimeout``) when the
heartbeats stop. Acknowledgements follow the heartbeats (``idle_acks``). Every link still reads a
message well within pysyncobj's ``connectionTimeout`` (0.5 s), and the leader still hears a
majority within ``leaderFallbackTimeout`` (1 s). Measured: docs/design/quiescence.md.

**Waking.** Any client call wakes the node it reaches at once (``note_client_activity``, from
any thread: it ends the tick thread's wait):

* the leader goes back to ``appendEntriesPeriod`` and sends an append_entries now, without the
  key, so its followers are back on their normal election timeouts within one message;
* a follower sends its leader ``WAKE`` (the leader wakes as for a client of its own) and draws a
  normal election timeout again, counted from the leader's last append_entries but not ending
  before ``raftMinTimeout`` from now (the leader's first awake heartbeat is on its way; an
  election before it arrives would depose a live leader). A quiet append_entries that still
  arrives sets the quiet timeout again (the leader's period demands it) and is answered with
  another ``WAKE``. So a leader that died while the cluster was quiet is replaced at most
  ``raftMinTimeout`` plus one election timeout after a client turns up at a follower, and
  failover while clients are active is what it always was.

**Safety.** Raft does not depend on when a node times out; a longer election timeout only
delays an election. The lease (``core/lease.py``) rests on the vote refusal window
(``extensions.fast_election.vote_refused``), which this does not change; a quiet leader has no rounds, and
its lease has long expired. A node that does not know the key would keep its short election
timeout under 200 ms heartbeats and stand again and again, so the leader quiesces only while
``quiet_allowed()`` holds: the cluster enabled ``QUIESCENCE_SCHEMA_VERSION`` (``core/codec.py``),
which a leader does only once every member runs a version that reads it.

**As an extension.** A quiet follower sends its keep-alives through
``NodeSignals.send_keepalives`` (fast election's) and publishes the longer keep-alive timer it
needs (``NodeSignals.keepalive_period_floor_s``, ``quiet_keepalive_floor_s``) and the longer
wait the tick thread may then take (``NodeSignals.longest_wait_floor_s``: up to the quiet
period); a follower's wake counts from ``NodeSignals.heard_leader_at``.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import Any

from lighthouse_cluster.raft.extensions.signals import NodeSignals, draw_election_timeout
from lighthouse_cluster.raft.host import Extension, RaftHost
from lighthouse_cluster.raft.pysyncobj_internals import monotonic

__all__ = ["QUIET_KEY", "Quiescence", "WAKE", "quiet_keepalive_floor_s"]

log = logging.getLogger(__name__)

# A key of an append_entries: the leader is quiet; its value is the leader's heartbeat period in
# seconds. pysyncobj (and an older node) ignores it.
QUIET_KEY = "lighthouse_cluster_quiet"
# A follower of a quiet leader draws its election timeout from these multiples of its period.
QUIET_TIMEOUTS = (4.0, 8.0)
# Sent by a follower to a quiet leader: a client called the follower (ignored by older nodes:
# pysyncobj ignores unknown message types).
WAKE = {"type": "lighthouse_cluster_wake"}
# While a client is recent, a leader looks at whether its log or followers moved this often.
BUSY_CHECK_S = 0.25
# A follower sends WAKE at most this often while its leader stays quiet.
WAKE_EVERY_S = 0.05
# A follower of a quiet leader sends its keep-alives with the leader's heartbeats; when none came
# for this many periods (a leader that vanished without closing its connections), on a timer.
QUIET_KEEPALIVE_FALLBACK = 1.75


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
