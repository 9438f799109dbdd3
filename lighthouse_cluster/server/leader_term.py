"""The leader's term, shared by every job's quorum rounds: the TermStart barrier, the wait for the
predecessor's lease, and the lease renewals.

A node that Raft makes leader of term ``T`` serves no job's rounds until ``LeaderTerm`` has:

1. committed a ``TermStart`` for ``T`` (applying it proves this node's state machine holds
   everything committed before its term; the state machine fences off a second one), and
2. waited out every quorum lease a predecessor may still hold (``lease.py``, point 3): nothing
   with the defaults, where the followers' vote refusal outlasts any lease (``vote_refusal_s``).

Then ``serving(T)`` resolves True for every job's coordinator (``coordinator.QuorumCoordinator``),
which seeds its heartbeats and starts its rounds. When a job first asks for a quorum in the term
(``requested``), ``LeaderTerm`` commits a ``ConfirmLeadership``: it announces the lease length to
successors and grants the first lease. After that:

* every quorum a coordinator commits while leading ``T`` confirms the term as well
  (``confirmed_by_commit``), and a fast round that finds the lease run out is committed rather
  than issued on it, which renews it;
* while rounds come faster than one per ``BUSY_GAP_S`` (``round_issued``), ``LeaderTerm`` also
  confirms the term in the background, so that no round waits for a commit: every heartbeat the
  leader sends is then a lease probe (``stream``: ``raft/extensions/lease_probes.py``, "Heartbeats as
  probes"; no log entry, no message of its own), and each one a majority acknowledged renews the
  lease from when it was sent. Where less than a quarter of a confirmation's worth is left all
  the same (heartbeats late, or unanswered), it asks a probe of its own (an append_entries sent
  at once), and where that goes unanswered too (a member of an older version does not echo
  probes), it renews with a ``ConfirmLeadership`` commit, for ``PROBE_BACKOFF_S``. Without
  ``stream`` each renewal is such a probe, asked when less than half a confirmation's worth is
  left.

So training that asks once a second writes one commit per round and nothing else (before, a
confirmation went out every 25 ms for a second after each request), and a benchmark hammering
rounds keeps every fast round on the lease. One lease serves every job: it says that this node
still leads, which is not a property of a job. When the state machine shows that another leader is in force (a
refused ``TermStart``, an unconfirmed lease, a fenced commit: ``deposed``) every job stops serving.

Everything here runs on one asyncio event loop; ``submit`` hops to Raft and back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from lighthouse_cluster.core.defaults import COMMIT_TIMEOUT_S
from lighthouse_cluster.core.codec import ConfirmLeadership, TermStart
from lighthouse_cluster.core.lease import LeaseSettings, QuorumLease
from lighthouse_cluster.core.state_machine import QuorumStateMachine, TermStartResult
from lighthouse_cluster.raft.replication import CommitError

log = logging.getLogger(__name__)

# Rounds (of any job) at least this close together keep the lease renewed in the background.
BUSY_GAP_S = 0.5
# A TermStart that was not committed is retried after this long.
RETRY_S = 0.1
# After a lease probe went unanswered, the lease is renewed by commits for this long.
PROBE_BACKOFF_S = 5.0
# A renewal is asked when less than this share of a confirmation's worth (held_s) is left: half,
# or a quarter while every heartbeat renews the lease (a heartbeat every appendEntriesPeriod,
# half of held_s with the defaults, leaves that share plus a round trip at its lowest).
RENEWAL_SHARE = 0.5
STREAMED_RENEWAL_SHARE = 0.25


class LeaderTerm:
    """One leader term's barrier and lease, for every job (see the module docstring)."""

    def __init__(self, node_id: str, state: QuorumStateMachine, submit: Callable[..., Awaitable[Any]], *,
                 clock: Callable[[], float] = time.monotonic,
                 wall_ms: Callable[[], int] = lambda: int(time.time() * 1000),
                 lease: LeaseSettings = LeaseSettings(), retry_s: float = RETRY_S,
                 vote_refusal_s: Callable[[int], float] = lambda _term: 0.0,
                 probe: Callable[[int], Awaitable[bool]] | None = None,
                 stream: Callable[[int, Callable[[float], None] | None], None] | None = None) -> None:
        """``vote_refusal_s(T)``: how long every member refused votes after hearing from a leader
        when this node was elected leader of ``T`` (``RaftNode.vote_refusal_s``; 0: wait out the
        whole lease, as a leader elected on a handover does). ``probe(T)``: True when a majority
        acknowledged, after the call, that this node leads ``T`` (``RaftNode.probe_leadership``);
        None: every renewal is a ``ConfirmLeadership`` commit. ``stream(T, on_confirmed)``: every
        heartbeat of ``T`` a probe, ``on_confirmed(t)`` (on this loop, ``t`` on ``clock``) for
        each later time a majority confirmed; ``stream(T, None)`` stops it
        (``RaftNode.stream_lease_confirmations``; None: renewals are asked one at a time)."""
        self._probe = probe
        self._stream = stream
        self._streaming: int | None = None  # the term whose heartbeats are probes
        self._probe_after = float("-inf")  # renewals are commits until then (a probe went unanswered)
        # lease renewals in the background, by how: a heartbeat, a probe of its own, a commit
        self.renewals = {"heartbeat": 0, "probe": 0, "commit": 0}
        self.node_id = node_id
        self._vote_refusal_s = vote_refusal_s
        self.state = state
        self._submit = submit
        self._clock = clock
        self._wall_ms = wall_ms
        self._retry_s = retry_s
        self.lease = QuorumLease(lease)
        self._term: int | None = None
        self._serving = False
        self._ready: asyncio.Future[bool] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._leading_since = 0.0
        self._requested = asyncio.Event()
        self._announced: int | None = None  # the term whose lease was announced (ConfirmLeadership)
        self._last_round = self._previous_round = float("-inf")
        self._busy_now = asyncio.Event()
        self._on_deposed: list[Callable[[], None]] = []

    @property
    def term(self) -> int | None:
        return self._term

    @property
    def serving_term(self) -> int | None:
        """The term whose rounds may be served now (None while warming up or not leading)."""
        return self._term if self._serving else None

    def on_deposed(self, callback: Callable[[], None]) -> None:
        """``callback()`` runs when the state machine shows another leader in force."""
        self._on_deposed.append(callback)

    def forget(self, callback: Callable[[], None]) -> None:
        if callback in self._on_deposed:
            self._on_deposed.remove(callback)

    def start(self, term: int) -> None:
        """Raft made this node leader of ``term``: commit the barrier, wait out the old lease."""
        if self._term == term:
            return
        self.stop()
        loop = asyncio.get_running_loop()
        self._term = term
        self._probe_after = float("-inf")
        self._leading_since = self._clock()
        self._requested.clear()  # a term that is never asked writes no ConfirmLeadership
        self._ready = loop.create_future()
        self._tasks.append(loop.create_task(self._warm_up(term)))

    def stop(self) -> None:
        if self._term is None:
            return
        self._term = None
        self._serving = False
        self._stop_stream()
        for task in self._tasks:
            task.cancel()
        self._tasks = []
        self.lease.reset()
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(False)
        self._ready = None

    def deposed(self, why: str) -> None:
        """Another leader is in force (the state machine said so): stop every job's rounds."""
        if self._term is None:
            return
        log.warning("term %d: %s; stepping down", self._term, why)
        self.stop()
        for callback in list(self._on_deposed):
            callback()

    async def serving(self, term: int) -> bool:
        """Wait until ``term``'s rounds may be served: True, or False when it never will be."""
        if self._term != term or self._ready is None:
            return False
        return await asyncio.shield(self._ready)

    async def _warm_up(self, term: int) -> None:
        while self._term == term:
            try:
                started = await asyncio.wait_for(
                    self._submit(TermStart(term=term, node_id=self.node_id, time_ms=self._wall_ms())),
                    COMMIT_TIMEOUT_S)
            except (CommitError, asyncio.TimeoutError) as e:
                log.warning("term %d: leadership barrier not committed (%s); retrying", term,
                            str(e) or type(e).__name__)
                await asyncio.sleep(self._retry_s)
                continue
            if self._term != term:
                return
            if isinstance(started, TermStartResult) and (started.leader_term, started.leader_id) != (term, self.node_id):
                # The state machine fenced it off (another TermStart is in force): never serve
                # this term; waiting calls fail with NotLeader and are re-routed.
                log.error("term %d: TermStart refused (%s); not serving", term, started.reason)
                self.deposed("another leader's TermStart is in force")
                return
            # Every lease a predecessor can hold runs out before this leader answers (lease.py).
            refusal_s = self._vote_refusal_s(term)
            wait = self.lease.serve_after(self._leading_since, self.state.lease_ms, refusal_s) - self._clock()
            if wait > 0:
                await asyncio.sleep(wait)
                if self._term != term:
                    return
            log.info("term %d: serving; waited %.3f s for a predecessor's lease (lease %d ms, vote refusal %.3f s)",
                     term, max(0.0, wait), max(self.lease.settings.lease_ms, self.state.lease_ms), refusal_s)
            self._serving = True
            if self.lease.settings.enabled:
                self._tasks.append(asyncio.get_running_loop().create_task(self._keep_lease(term)))
            assert self._ready is not None
            self._ready.set_result(True)
            return

    # -- the lease ----------------------------------------------------------------------------

    def requested(self) -> None:
        """A job was asked for a quorum: the term announces its lease (once)."""
        self._requested.set()

    def lease_valid(self, term: int | None, now: float, lease_ms: int | None = None) -> bool:
        """Whether a fast quorum of ``term`` may go out on the lease now; ``lease_ms``: the job's
        own lease (0: never), effective at most the node's."""
        if lease_ms is not None and lease_ms <= 0:
            return False
        settings = self.lease.settings
        if lease_ms is None or lease_ms >= settings.lease_ms:
            return self.lease.valid(term, now)
        # A shorter lease: a confirmation counts for the job's share of the time only.
        shorter_by = (settings.lease_ms - lease_ms) * settings.trust / 1000.0
        return self.lease.valid(term, now + shorter_by)

    def confirmed_by_commit(self, term: int, submitted_at: float) -> None:
        """A command submitted at ``submitted_at`` was applied while this node led ``term``
        (``submit(while_leader_of=term)``): it confirms the term as a ``ConfirmLeadership`` would
        (``lease.py``, point 1), once this term announced its lease."""
        if self._announced == term:
            self.lease.confirmed(term, submitted_at)

    def round_issued(self) -> None:
        """A job issued a quorum (on the lease or committed): how busy the node is decides
        whether the lease is renewed in the background (module docstring)."""
        self._previous_round, self._last_round = self._last_round, self._clock()
        if self._busy(self._last_round):
            self._busy_now.set()

    def _busy(self, now: float) -> bool:
        """Rounds come faster than one per ``BUSY_GAP_S``, and the last one was recent."""
        return now - self._last_round < BUSY_GAP_S and self._last_round - self._previous_round < BUSY_GAP_S

    async def _keep_lease(self, term: int) -> None:
        """At the term's first request: confirm the term through Raft, announcing the lease length
        (successors wait it out), which grants the first lease. Then, while rounds are frequent,
        confirm again (a probe, else a commit) whenever less than half a confirmation's worth is
        left (a quarter while its heartbeats renew it); otherwise the rounds' own commits renew it
        (module docstring)."""
        settings = self.lease.settings
        cmd = ConfirmLeadership(term=term, node_id=self.node_id, lease_ms=settings.lease_ms)
        await self._requested.wait()
        while self._term == term:
            now = self._clock()
            if self._announced == term:
                if not self._busy(now):
                    self._stop_stream()
                    self._busy_now.clear()
                    await self._busy_now.wait()
                    continue
                self._start_stream(term)
                # A quarter while heartbeats renew it; half while renewals are commits (a commit
                # takes longer than a heartbeat's echo, and probes just went unanswered).
                streamed = self._streaming == term and now >= self._probe_after
                share = STREAMED_RENEWAL_SHARE if streamed else RENEWAL_SHARE
                if not self.lease.renewal_due(term, now, share):
                    await asyncio.sleep(max(0.001, self.lease.remaining(term, now) - share * settings.held_s))
                    continue
            if self._announced == term and self._probe is not None and now >= self._probe_after:
                if await self._renew_by_probe(term, now):
                    continue
                if self._term != term:
                    return
            try:
                confirmed = await asyncio.wait_for(self._submit(cmd, while_leader_of=term), COMMIT_TIMEOUT_S)
            except (CommitError, asyncio.TimeoutError) as e:
                log.debug("term %d: lease not confirmed (%s)", term, str(e) or type(e).__name__)
                await asyncio.sleep(self._retry_s)
                continue
            if self._term != term:
                return
            if confirmed is not True:
                self.deposed("leadership not confirmed (another TermStart is in force)")
                return
            if self._announced == term:
                self.renewals["commit"] += 1
            self._announced = term
            self.lease.confirmed(term, now)

    def _start_stream(self, term: int) -> None:
        if self._stream is None or self._streaming == term:
            return
        self._stop_stream()
        self._streaming = term
        self._stream(term, lambda since: self._confirmed_by_heartbeat(term, since))

    def _stop_stream(self) -> None:
        if self._streaming is not None and self._stream is not None:
            self._stream(self._streaming, None)
        self._streaming = None

    def _confirmed_by_heartbeat(self, term: int, since: float) -> None:
        """A heartbeat this leader sent at ``since`` (its clock) was acknowledged, in ``term``, by a
        majority: as a probe asked then (``lease.py``, point 1)."""
        if self._term != term or self._announced != term or self._streaming != term:
            return
        self.lease.confirmed(term, since)
        self.renewals["heartbeat"] += 1

    async def _renew_by_probe(self, term: int, now: float) -> bool:
        """Renew the lease with a probe asked after ``now`` (``lease_probes``): True when it was
        confirmed. A probe unanswered within the lease length (a member that does not echo
        probes, or a slow majority) makes the renewals commits for ``PROBE_BACKOFF_S``."""
        assert self._probe is not None
        try:
            confirmed = await asyncio.wait_for(self._probe(term), self.lease.settings.lease_ms / 1000.0)
        except asyncio.TimeoutError:
            confirmed = False
        if self._term != term:
            return False
        if confirmed is True:
            self.lease.confirmed(term, now)
            self.renewals["probe"] += 1
            return True
        self._probe_after = self._clock() + PROBE_BACKOFF_S
        log.debug("term %d: lease probe not confirmed; renewing by commits for %.0f s", term, PROBE_BACKOFF_S)
        return False
