"""Leader-local quorum rounds of one job: pending requesters, heartbeats, the tick, and issuing
through Raft.

One ``QuorumCoordinator`` per job (``core/jobs.py``); every job's coordinator on a node shares the
node's ``LeaderTerm`` (``leader_term.py``: the TermStart barrier, the predecessor's lease, the
lease renewals), and reads and commits only its own job's quorum.

Only the leader runs rounds. Requesters and heartbeats are leader-local (they are soft state
that clients re-send every 100 ms); the decision itself is ``quorum.compute_quorum`` and a
quorum with new members or a new id reaches requesters only after its ``CommitQuorum`` has been
committed by a majority and applied (a compare-and-set on the quorum id it was computed from), so
a deposed or partitioned leader cannot hand one out; a fast quorum can go out on the lease (below).

Warm-up: a new leader has heard no heartbeats, so without care it would see the requesters that
re-sent first as the whole healthy set and could issue a smaller quorum than its predecessor
would have. Before serving, its ``LeaderTerm`` commits a ``TermStart`` (which also proves its
state machine has applied everything committed before its term); then each job seeds a heartbeat
*at that moment* for every member of its last committed quorum. A member that is really gone expires after
``heartbeat_timeout_ms`` as it would have on the old leader; one that is alive keeps the
round waiting for it (or triggers the fast-quorum path) exactly as before the failover.

Replay after a failover: the old leader may die between the answers of one round (it answered
some members, then was SIGKILLed before the others' answers went out). The members it answered
run the step on that quorum and wait in their collectives for the others; the others re-send the
very same request to the new leader (ftclient's failover, a follower re-forwarding a torchft
call). A new round would wait for the members already in their step, which never ask: nobody
moves until a collective times out. So until the new leader issues a round of its own, a request
equal byte for byte to its member's entry in the last committed quorum gets that quorum back (the
answer its predecessor gave, or would have given): the same id, members and ``created``. A
trainer that finished its step asks with the next step, and one whose step failed reports
``commit_failures`` (torchft's rule), so neither matches: only a lost answer is replayed. Rounds
issued on the lease and not yet recorded in the log cannot be replayed; see ``lease.py``.

Liveness (``core/liveness.py``, ``liveness_streams.py``): ``declare_dead`` makes a replica
unhealthy for the quorum rules at once (its heartbeat forgotten, its registration withdrawn) and
evaluates the pending round there and then; the next heartbeat, Quorum call or liveness stream
makes it alive again. Only the rules' health input changes: ids, fencing and commits do not.

Quorum lease (``lease.py``, on by default in a node): while a majority has confirmed this
leader's term within the lease (``LeaderTerm``), a *fast* quorum (same members, hence same id, as
the job's last committed one) is issued without a commit; every other round is committed as
above. Every commit is submitted ``while_leader_of`` the term, so each one confirms the term and
renews the lease: a fast round that finds the lease run out is committed, and renews it. A new
leader serves only once its predecessor's lease ran out (``lease.py``, point 3). A job's own
lease setting can only shorten it (0: every round of that job is committed).

Everything here runs on one asyncio event loop; ``submit`` hops to Raft and back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from dataclasses import replace

import grpc

from lighthouse_cluster.core.defaults import COMMIT_TIMEOUT_S
from lighthouse_cluster.core.codec import CommitQuorum
from lighthouse_cluster.core.jobs import DEFAULT_JOB
from lighthouse_cluster.core.lease import LeaseSettings, QuorumLease
from lighthouse_cluster.core.quorum import Member, Participant, Quorum, QuorumOptions, compute_quorum, issue_quorum
from lighthouse_cluster.core.state_machine import CommitResult, JobState, QuorumStateMachine
from lighthouse_cluster.core.torchft_wire import quorum_response
from lighthouse_cluster.raft.replication import CommitError
from lighthouse_cluster.server.leader_term import LeaderTerm

log = logging.getLogger(__name__)

# Rounds issued on the lease are written to the log at most this often (in the background), so
# that every node's state (Status, the dashboard, a restart) shows steps at most this old.
RECORD_INTERVAL_S = 1.0
# With no requester waiting, the tick loop runs at least this often (else on the first join).
IDLE_TICK_S = 1.0
# After a replica is declared dead, a heartbeat (or the heartbeat a Quorum call implies) that
# arrives within this long may have been sent before the death (a follower batches heartbeats
# every 50 ms; calls on other connections are read in any order): it does not revive the replica.
# Its next one does; a new liveness stream always does.
DEATH_QUIET_S = 0.25


def _expire(answer: asyncio.Future[bytes]) -> None:
    if not answer.done():
        answer.set_exception(asyncio.TimeoutError())


class NotLeader(Exception):
    """This node does not (or no longer) serve quorum rounds; the caller should re-route."""


class JobLimitError(Exception):
    """A Quorum call over one of its job's limits; ``code`` is the gRPC status to answer."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class IssuedRound:
    """A committed quorum and its response, serialized once for every requester."""

    quorum: Quorum
    member_ids: frozenset[str]
    response: bytes


@dataclass(frozen=True, slots=True)
class ReplayableRound:
    """The last committed quorum as a new leader found it, answerable to a re-sent request."""

    issued: IssuedRound
    members: dict[str, Member]

    @classmethod
    def of(cls, quorum: Quorum) -> ReplayableRound:
        members = {m.replica_id: m for m in quorum.participants}
        return cls(IssuedRound(quorum=quorum, member_ids=frozenset(members), response=quorum_response(quorum)),
                   members)

    def answer(self, member: Member) -> bytes | None:
        """The quorum's response when ``member`` is its entry in the quorum exactly, else None."""
        return self.issued.response if self.members.get(member.replica_id) == member else None


class QuorumCoordinator:
    """Runs one job's quorum rounds while this node leads; see the module docstring."""

    def __init__(
        self,
        node_id: str,
        options: QuorumOptions,
        quorum_tick_ms: int,
        state: QuorumStateMachine,
        submit: Callable[..., Awaitable[Any]],
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_ms: Callable[[], int] = lambda: int(time.time() * 1000),
        on_issue: Callable[[IssuedRound, float | None], None] | None = None,
        lease: LeaseSettings = LeaseSettings(),
        job: str = DEFAULT_JOB,
        leader: LeaderTerm | None = None,
        job_lease_ms: int | None = None,
    ) -> None:
        """``submit(command)`` commits through Raft; ``submit(command, while_leader_of=term)``
        fails unless this node still leads ``term`` when the entry applies (the lease needs it).
        ``on_issue(round, commit_s)``: ``commit_s`` is None for a round issued on the lease.
        ``leader``: the node's ``LeaderTerm``, shared by every job (None: one of its own, with
        ``lease``); ``job_lease_ms``: this job's lease (None: the node's)."""
        self.node_id = node_id
        self.job = job
        self.options = options
        self.tick_s = quorum_tick_ms / 1000.0
        self.state = state
        self._submit = submit
        self._clock = clock
        self._wall_ms = wall_ms
        self._on_issue = on_issue
        self.on_serving: Callable[[], None] | None = None  # called when it starts serving a term
        self._owns_leader = leader is None
        if leader is None:
            leader = LeaderTerm(node_id, state, submit, clock=clock, wall_ms=wall_ms, lease=lease,
                                retry_s=self.tick_s)
        self.leader = leader
        leader.on_deposed(self.stop_leading)
        self.job_lease_ms = job_lease_ms
        # The job's limits (core/jobs.py JobSettings; 0: none): set by the job registry.
        self.max_replicas = 0
        self.max_member_bytes = 0
        self._participants: dict[str, Participant] = {}
        self._heartbeats: dict[str, float] = {}
        self._waiting: dict[str, int] = {}
        # The waiting calls' answers by replica (``request``), and those that came before this
        # term served (joined when it starts serving).
        self._answers: dict[str, list[asyncio.Future[bytes]]] = {}
        self._before_serving: list[tuple[Member, asyncio.Future[bytes]]] = []
        self._term: int | None = None
        self._serving = False
        self._in_flight = False
        self._eval_scheduled = False
        self._tick_task: asyncio.Task[None] | None = None
        self._joined = asyncio.Event()  # a requester registered (ends the tick loop's idle wait)
        # Cheap pre-checks so that a burst of N requests does not run N full evaluations.
        self._prev_ids: frozenset[str] = frozenset()
        self._prev_present = 0
        self._healthy_at_tick = 0
        self._round_started: float | None = None
        self.last_reason = ""
        self.last_issued: IssuedRound | None = None
        self._warm_up_task: asyncio.Task[None] | None = None
        self.rounds_on_lease = 0
        self.rounds_committed = 0
        self.quorums_withheld = 0
        self._recorded_at = float("-inf")
        self._recording = False
        # Liveness: replicas declared dead and not alive since (when), and the registrations
        # withdrawn from calls that still wait (re-registered if the replica comes back).
        self._dead: dict[str, float] = {}
        self._withdrawn: dict[str, Member] = {}
        self._issued_this_term: Quorum | None = None
        self.deaths_declared = 0
        # Replay after a failover (module docstring): set when this term starts serving, cleared
        # once it issues or withholds a round of its own.
        self._replayable: ReplayableRound | None = None
        self.rounds_replayed = 0
        self._replay_logged: ReplayableRound | None = None  # the last one whose replay was logged at INFO

    # -- leadership -------------------------------------------------------------------------

    @property
    def serving(self) -> bool:
        return self._serving

    @property
    def term(self) -> int | None:
        return self._term

    @property
    def lease(self) -> QuorumLease:
        """The node's quorum lease (shared by every job)."""
        return self.leader.lease

    def job_state(self) -> JobState | None:
        """This job's replicated state (None once the job was removed)."""
        return self.state.job(self.job)

    def _previous(self) -> Quorum | None:
        js = self.state.job(self.job)
        return js.quorum if js is not None else None

    def start_leading(self, term: int) -> None:
        """Called when Raft makes this node leader of ``term``: once the node's ``LeaderTerm``
        serves ``term`` (its TermStart committed, the old lease run out), serve."""
        if self._term == term:
            return
        self.stop_leading()
        self._term = term
        self._issued_this_term = None
        self.leader.start(term)
        self._warm_up_task = asyncio.get_running_loop().create_task(self._warm_up(term))

    async def _warm_up(self, term: int) -> None:
        if not await self.leader.serving(term) or self._term != term or self._serving:
            return
        now = self._clock()
        prev = self._previous()
        if prev is not None:
            for m in prev.participants:
                # Seed, never age: a heartbeat that already arrived is at least as fresh.
                # (Nobody is declared dead before serving: streams open only once it serves.)
                self._heartbeats.setdefault(m.replica_id, now)
        self._replayable = ReplayableRound.of(prev) if prev is not None else None
        self._reset_round_tracking()
        self._serving = True
        early, self._before_serving = self._before_serving, []
        for member, answer in early:
            self._join(member, answer)
        js = self.job_state()
        log.info("term %d: serving quorum rounds%s (previous quorum id %d, %d members seeded)", term,
                 "" if self.job == DEFAULT_JOB else f" of job {self.job}", js.quorum_id if js else 0,
                 len(prev.participants) if prev else 0)
        self._tick_task = asyncio.get_running_loop().create_task(self._tick_loop(term))
        self._evaluate()
        if self.on_serving is not None:
            self.on_serving()

    def stop_leading(self) -> None:
        """Stop serving and fail every waiting call promptly with ``NotLeader``."""
        if self._term is None:
            return
        log.info("term %d: no longer leader; failing %d waiting calls", self._term, sum(self._waiting.values()))
        self._term = None
        self._serving = False
        if self._tick_task is not None:
            self._tick_task.cancel()
            self._tick_task = None
        if self._warm_up_task is not None:
            self._warm_up_task.cancel()
            self._warm_up_task = None
        if self._owns_leader:
            self.leader.stop()
        waiting = [answer for answers in self._answers.values() for answer in answers]
        waiting += [answer for _member, answer in self._before_serving]
        self._answers = {}
        self._before_serving = []
        for answer in waiting:
            if not answer.done():
                answer.set_exception(NotLeader("leader stepped down"))
        self._replayable = None
        self._participants.clear()
        self._heartbeats.clear()
        self._dead.clear()
        self._withdrawn.clear()
        self._in_flight = False

    # -- requests ---------------------------------------------------------------------------

    def heartbeat(self, replica_id: str) -> None:
        """A unary heartbeat (direct or in a follower's batch); see ``DEATH_QUIET_S``."""
        now = self._clock()
        if self._quiet_after_death(replica_id, now):
            return
        self._heartbeats[replica_id] = now
        self._back_alive(replica_id, now)

    def alive(self, replica_id: str) -> None:
        """Fresh evidence from the replica itself (its liveness stream opened, a keep-alive):
        a heartbeat that also ends a declared death at once."""
        now = self._clock()
        self._dead.pop(replica_id, None)
        self._heartbeats[replica_id] = now
        self._back_alive(replica_id, now)

    def declare_dead(self, replica_id: str, reason: str) -> None:
        """The replica is dead (``core/liveness.py``): unhealthy for the quorum rules from now,
        its heartbeat forgotten and its registration withdrawn, the healthy count recomputed and
        the pending round evaluated now, not at the next tick. A quorum under commit that has it
        as a member is not issued (``_commit``). Its next heartbeat, Quorum call or liveness
        stream makes it alive again (see ``DEATH_QUIET_S``). Ids, fencing and commits are
        untouched: a false death costs at most one quorum change."""
        if self._term is None:
            return
        now = self._clock()
        self.deaths_declared += 1
        self._dead = {r: t for r, t in self._dead.items() if now - t < DEATH_QUIET_S or self._waiting.get(r)}
        self._dead[replica_id] = now
        self._heartbeats.pop(replica_id, None)
        participant = self._participants.get(replica_id)
        if participant is not None and self._waiting.get(replica_id):
            # A call still waits (a cut-off host's call ends only at its deadline): if the replica
            # comes back while it waits, its registration is restored.
            self._withdrawn[replica_id] = participant.member
        self._unregister(replica_id)
        log.info("replica %s declared dead (%s)", replica_id, reason)
        timeout = self.options.heartbeat_timeout_ms / 1000.0
        self._healthy_at_tick = sum(1 for t in self._heartbeats.values() if now - t < timeout)
        self._evaluate()

    def is_dead(self, replica_id: str) -> bool:
        """Declared dead and not alive since."""
        return replica_id in self._dead

    def _quiet_after_death(self, replica_id: str, now: float) -> bool:
        died = self._dead.get(replica_id)
        return died is not None and now - died < DEATH_QUIET_S

    def _back_alive(self, replica_id: str, now: float) -> None:
        """After a heartbeat was accepted: the replica is no longer dead; a call of it that still
        waits is registered again."""
        self._dead.pop(replica_id, None)
        member = self._withdrawn.pop(replica_id, None)
        if member is not None and self._waiting.get(replica_id) and replica_id not in self._participants \
                and self._serving:
            self._register(member, now)
            self._schedule_evaluation()

    def running_quorum(self) -> Quorum | None:
        """The quorum trainers run as far as this leader knows: the last one it issued in its
        term, else the last committed one (its predecessor issued it)."""
        return self._issued_this_term if self._issued_this_term is not None else self._previous()

    async def quorum(self, member: Member, timeout: float | None = None) -> bytes:
        """``request``'s answer, awaited (cancelling the await withdraws the call)."""
        return await self.request(member, timeout)

    def request(self, member: Member, timeout: float | None = None) -> asyncio.Future[bytes]:
        """Register ``member``: a future of the serialized ``LighthouseQuorumResponse`` of the
        first committed quorum that includes it.

        Raises ``NotLeader`` when this node does not lead (no term), ``JobLimitError`` over the
        job's limits. The future fails with ``NotLeader`` when this node stops leading, with
        ``asyncio.TimeoutError`` after ``timeout`` seconds; cancelling it ends the call. A call made
        before this term serves waits for it (a replay is decided on the state it serves from).

        Only live requesters are issued: a call that ends without a quorum (its deadline, a
        cancellation, the caller or the forwarding node gone) withdraws the registration when it
        was the last call for that replica. Nobody is left to receive the quorum, and a member
        that never configures its process group fails the step for every other member (a
        "ghost"); counting it as joined could also close a round without the requester's real,
        re-sent call. A quorum whose commit was already under way when a member's call ended is
        not issued either (``_commit``).

        A future rather than a coroutine: per waiting call one future and one timer, settled by
        ``_issue`` (a forwarded call needs no task of its own; docs/design/follower-forwarding.md).
        """
        if self._term is None:
            raise NotLeader("not leader")
        self._admit(member)
        loop = asyncio.get_running_loop()
        rid = member.replica_id
        now = self._clock()
        self.leader.requested()
        if not self._quiet_after_death(rid, now):  # else it may predate the death (DEATH_QUIET_S)
            self._heartbeats[rid] = now
            self._dead.pop(rid, None)
        self._withdrawn.pop(rid, None)
        self._waiting[rid] = self._waiting.get(rid, 0) + 1
        answer: asyncio.Future[bytes] = loop.create_future()
        timer = None if timeout is None else loop.call_later(max(0.0, timeout), _expire, answer)
        answer.add_done_callback(lambda done: self._call_ended(rid, done, timer))
        if self._serving:
            self._join(member, answer)
        else:
            # A replay (module docstring) is decided on the state this term serves from.
            self._before_serving.append((member, answer))
        return answer

    def _join(self, member: Member, answer: asyncio.Future[bytes]) -> None:
        """A call of ``member`` while this term serves: its replay, or its registration."""
        if answer.done():
            return  # ended while the term was not serving yet
        rid = member.replica_id
        replayed = self._replayable.answer(member) if self._replayable is not None else None
        if replayed is not None:
            self.rounds_replayed += 1
            # One line per quorum at INFO: after a failover at N=2048 nearly every member asks
            # again, and a line each was 2048 lines on a new leader's busiest second
            # (docs/design/new-leader-large-quorum.md).
            first = self._replay_logged is not self._replayable
            self._replay_logged = self._replayable
            log.log(logging.INFO if first else logging.DEBUG,
                    "quorum %d replayed to %s: its request equals its entry in that quorum (an answer "
                    "lost with the previous leader)%s", self._replayable.issued.quorum.quorum_id, rid,
                    "; replays to other members of it are logged at DEBUG" if first else "")
            answer.set_result(replayed)
            return
        self._register(member, self._clock())
        answers = self._answers.get(rid)
        if answers is None:
            self._answers[rid] = [answer]
        else:
            answers.append(answer)
        self._schedule_evaluation()

    def _call_ended(self, rid: str, answer: asyncio.Future[bytes], timer: asyncio.TimerHandle | None) -> None:
        """A call's answer settled (answered, failed, timed out or cancelled)."""
        if timer is not None:
            timer.cancel()
        answers = self._answers.get(rid)
        if answers is not None and answer in answers:
            answers.remove(answer)
            if not answers:
                del self._answers[rid]
        remaining = self._waiting.get(rid, 0) - 1
        if remaining > 0:
            self._waiting[rid] = remaining
            return
        self._waiting.pop(rid, None)
        self._withdrawn.pop(rid, None)
        if answer.cancelled() or answer.exception() is not None:
            self._unregister(rid)

    def _admit(self, member: Member) -> None:
        """Refuse a call over the job's limits (``JobLimitError``): a member larger than
        ``max_member_bytes``, or a new replica when ``max_replicas`` are already known (healthy
        heartbeats and pending requesters)."""
        if self.max_member_bytes and len(member.raw) > self.max_member_bytes:
            raise JobLimitError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"requester is {len(member.raw)} bytes serialized; job {self.job}'s limit on a "
                                f"member is {self.max_member_bytes} (max_member_bytes)")
        limit, rid = self.max_replicas, member.replica_id
        if not limit or rid in self._participants or rid in self._heartbeats:
            return
        if len(self._heartbeats) + len(self._participants) < limit:
            return  # cheap: the exact count below only near the limit
        now, timeout = self._clock(), self.options.heartbeat_timeout_ms / 1000.0
        known = {r for r, t in self._heartbeats.items() if now - t < timeout} | set(self._participants)
        if len(known) >= limit:
            raise JobLimitError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"job {self.job} has {len(known)} replica groups, its limit (max_replicas) is {limit}")

    def _unregister(self, rid: str) -> None:
        if self._participants.pop(rid, None) is not None and rid in self._prev_ids:
            self._prev_present -= 1

    def _register(self, member: Member, now: float) -> None:
        rid = member.replica_id
        if rid not in self._participants:
            if rid in self._prev_ids:
                self._prev_present += 1
            if self._round_started is None:
                self._round_started = now
        self._participants[rid] = Participant(member=member, joined=now)
        self._joined.set()

    # -- evaluation -------------------------------------------------------------------------

    def _schedule_evaluation(self) -> None:
        if self._eval_scheduled or not self._serving:
            return
        if not self._maybe_ready():
            return
        self._eval_scheduled = True
        asyncio.get_running_loop().call_soon(self._run_scheduled)

    def _run_scheduled(self) -> None:
        self._eval_scheduled = False
        self._evaluate()

    def _maybe_ready(self) -> bool:
        """A necessary condition for compute_quorum to issue; full evaluations also run every tick."""
        if self._prev_ids and self._prev_present >= len(self._prev_ids):
            return True  # fast quorum possible
        if len(self._participants) >= self._healthy_at_tick:
            return True  # every healthy replica may have joined
        started = self._round_started
        return started is not None and self._clock() - started >= self.options.join_timeout_ms / 1000.0

    async def _tick_loop(self, term: int) -> None:
        while self._term == term:
            if self._participants:
                await asyncio.sleep(self.tick_s)
            else:
                # Nothing to evaluate until a requester joins (heartbeats alone issue nothing; the
                # join schedules its own evaluation): an idle job's leader ticks every IDLE_TICK_S,
                # and once a requester joins, every tick again from then on.
                self._joined.clear()
                try:
                    await asyncio.wait_for(self._joined.wait(), max(IDLE_TICK_S, self.tick_s))
                    continue
                except asyncio.TimeoutError:
                    pass
            now = self._clock()
            timeout = self.options.heartbeat_timeout_ms / 1000.0
            self._healthy_at_tick = sum(1 for t in self._heartbeats.values() if now - t < timeout)
            if len(self._heartbeats) > 2 * self._healthy_at_tick + 64:
                self._prune_heartbeats(now, 10 * timeout)
            self._evaluate()

    def _prune_heartbeats(self, now: float, older_than: float) -> None:
        self._heartbeats = {r: t for r, t in self._heartbeats.items()
                            if now - t < older_than or r in self._participants}

    def _evaluate(self) -> None:
        if not self._serving or self._in_flight or not self._participants:
            return
        js = self.job_state()
        if js is None:
            return  # the job was removed; the node stops this coordinator
        prev = js.quorum
        decision = compute_quorum(self._clock(), self._participants, self._heartbeats, prev, self.options)
        if decision.reason != self.last_reason:
            log.debug("term %s: %s", self._term, decision.reason)
            self.last_reason = decision.reason
        if decision.members is None:
            return
        quorum = issue_quorum(prev, decision.members, self._wall_ms())
        if prev is None and js.id_floor:
            # A job created again after its removal: its ids go on above the last one it issued.
            quorum = replace(quorum, quorum_id=js.id_floor + 1)
        if self._on_lease(prev, quorum):
            self._issue(quorum, None)
            return
        self._in_flight = True
        asyncio.get_running_loop().create_task(self._commit(js.quorum_id, quorum, self._term))

    async def _commit(self, expected_id: int, quorum: Quorum, term: int | None) -> None:
        started = self._clock()
        try:
            result = await asyncio.wait_for(
                self._submit(CommitQuorum(expected_quorum_id=expected_id, quorum=quorum, term=term or 0,
                                          node_id=self.node_id, job=self.job), while_leader_of=term),
                COMMIT_TIMEOUT_S)
        except (CommitError, asyncio.TimeoutError) as e:
            # Outcome may be unknown: the compare-and-set makes a retry from fresh state safe.
            log.warning("quorum %d not committed (%s); retrying next tick", quorum.quorum_id,
                        str(e) or type(e).__name__)
            if self._term == term:
                self._in_flight = False
            return
        if self._term != term:
            return  # stepped down meanwhile; waiters were already sent elsewhere
        self._in_flight = False
        if isinstance(result, CommitResult) and result.fenced:
            # Committed in a later leader's term: this node is deposed. Fail the round now (the
            # callers re-route) rather than retry a commit that can never apply.
            self.leader.deposed(f"quorum {quorum.quorum_id} refused ({result.reason})")
            self.stop_leading()
            return
        if term is not None:
            self.leader.confirmed_by_commit(term, started)  # applied while leading term: the lease
        if not isinstance(result, CommitResult) or not result.applied:
            log.warning("quorum %d rejected: state moved to quorum id %s", quorum.quorum_id,
                        getattr(result, "current_quorum_id", "?"))
            return
        gone = sorted(m.replica_id for m in quorum.participants
                      if not self._waiting.get(m.replica_id) or m.replica_id in self._dead)
        if gone:
            # A member's call ended (or it was declared dead) while the commit was under way:
            # issued, the quorum would hold a member that never configures its process group and
            # every other member's step would fail. Committed but never issued, its id is skipped: the next round,
            # without the gone members, gets a new id (a different member set), so no trainer
            # ever sees two quorums under one id.
            log.info("quorum %d committed but not issued: %s no longer waiting", quorum.quorum_id,
                     ", ".join(gone))
            self.quorums_withheld += 1
            self._replayable = None  # its members' requests now match a quorum nobody received
            self._track_previous_quorum()
            self._schedule_evaluation()
            return
        self._issue(quorum, self._clock() - started)

    def _on_lease(self, prev: Quorum | None, quorum: Quorum) -> bool:
        """A fast quorum (the committed id and member set again) while the lease holds."""
        return (prev is not None and quorum.quorum_id == prev.quorum_id
                and len(quorum.participants) == len(prev.participants)
                and all(a.replica_id == b.replica_id for a, b in zip(quorum.participants, prev.participants))
                and self.leader.lease_valid(self._term, self._clock(), self.job_lease_ms))

    async def _record(self, quorum: Quorum, term: int | None) -> None:
        """Write a round issued on the lease to the log (same id and members as the committed
        quorum, fresher steps); nobody waits for it. A round committed meanwhile wins the
        compare-and-set, which is as good."""
        self._recorded_at = started = self._clock()
        try:
            result = await asyncio.wait_for(
                self._submit(CommitQuorum(expected_quorum_id=quorum.quorum_id, quorum=quorum, term=term or 0,
                                          node_id=self.node_id, job=self.job), while_leader_of=term),
                COMMIT_TIMEOUT_S)
        except (CommitError, asyncio.TimeoutError):
            return
        finally:
            self._recording = False
        if self._term == term and isinstance(result, CommitResult) and result.fenced:
            self.leader.deposed(f"quorum {quorum.quorum_id} record refused ({result.reason})")
            self.stop_leading()
        elif term is not None:
            self.leader.confirmed_by_commit(term, started)

    def _issue(self, quorum: Quorum, commit_s: float | None) -> None:
        response = quorum_response(quorum)
        issued = IssuedRound(quorum=quorum, member_ids=frozenset(m.replica_id for m in quorum.participants),
                             response=response)
        previous, self.last_issued = self.last_issued, issued
        self._issued_this_term = quorum
        self._replayable = None
        self.leader.round_issued()
        if commit_s is None:
            self.rounds_on_lease += 1
            if not self._recording and self._clock() - self._recorded_at >= RECORD_INTERVAL_S:
                self._recording = True
                asyncio.get_running_loop().create_task(self._record(quorum, self._term))
        else:
            self.rounds_committed += 1
            self._recorded_at = self._clock()
        if previous is None or previous.quorum.quorum_id != quorum.quorum_id:
            log.info("quorum %d issued: %d members (%s)", quorum.quorum_id, len(quorum.participants),
                     self.last_reason)
        # torchft: pending participants are cleared; a waiting requester the quorum left out
        # registers again (here at once, so the next evaluation sees it).
        now = self._clock()
        leftover = {rid: Participant(member=p.member, joined=now) for rid, p in self._participants.items()
                    if rid not in issued.member_ids and self._waiting.get(rid)}
        self._participants = {}
        self._reset_round_tracking()
        for p in leftover.values():
            self._register(p.member, now)
        for rid in issued.member_ids:
            for answer in self._answers.pop(rid, ()):
                if not answer.done():
                    answer.set_result(response)
        if self._on_issue is not None:
            self._on_issue(issued, commit_s)
        if self._participants:
            self._schedule_evaluation()

    def _reset_round_tracking(self) -> None:
        self._track_previous_quorum()
        self._round_started = None

    def _track_previous_quorum(self) -> None:
        prev = self._previous()
        self._prev_ids = frozenset(m.replica_id for m in prev.participants) if prev else frozenset()
        self._prev_present = sum(1 for r in self._participants if r in self._prev_ids)

    # -- introspection ----------------------------------------------------------------------

    def heartbeat_ages_ms(self) -> dict[str, int]:
        now = self._clock()
        return {r: int((now - t) * 1000) for r, t in self._heartbeats.items()}

    def pending(self) -> list[tuple[Member, int]]:
        now = self._clock()
        return [(p.member, int((now - p.joined) * 1000)) for p in self._participants.values()]
