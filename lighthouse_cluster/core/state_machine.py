"""The replicated state machine: what every node agrees on, and the only rules that change it.

Deterministic by construction: ``apply`` depends only on the state and the command (time, term
and node ids arrive inside the command, chosen by the leader that wrote it). No clock, no
randomness, no I/O. ``replication.ReplicatedState`` feeds it the Raft log; tests feed it
directly.

State:
* ``quorum``: the last committed quorum (``None`` before the first one). Quorum ids only grow:
  a ``CommitQuorum`` is a compare-and-set on the id it was computed from, so a command computed
  from a stale view (a deposed leader, a retried write whose first attempt did apply) is
  rejected on every node alike, and no id is ever committed twice with different members.
* ``history``: the ids and member ids of the last ``HISTORY_LENGTH`` committed quorums, for
  audits (the fault-injection checkers compare it across nodes).
* ``leader_term`` / ``leader_id`` / ``leader_since_ms``: the last ``TermStart`` applied.
* ``schema_version``: the codec version writers may use.

Fencing (commands written at ``codec.FENCING_SCHEMA_VERSION`` or later; defence in depth behind
``RaftNode.led_term``, see jepsen_like/README.md BUG-2): pysyncobj forwards a replicated call made
on a follower to the leader, so a node deposed while it still believed it led can get a command
committed in its successor's term. Such a command is a deterministic no-op with a reason:
* a ``TermStart`` must raise the leader term: the first one of a term wins, a second one (a
  stale writer, or the same leader's retry) changes nothing and reports the leader in force;
* a ``CommitQuorum`` must carry the current leader term (once a ``TermStart`` was applied):
  one written by a deposed leader is rejected as ``fenced`` even when its compare-and-set
  would still hold.
Commands written at version 1 keep version 1's rules (a later ``TermStart`` of the same term
replaces the leader; no term check on commits), so an old journal replays to the same state.
A new state machine starts at ``SCHEMA_VERSION`` (a new cluster writes fenced commands from its
first entry); when the first command it applies was written at an older version (an existing
log replayed from its beginning), it adopts that version, as every other node of that log did.
Snapshots carry the version.
* ``lease_ms``: the quorum-lease length the latest ``ConfirmLeadership`` announced: a new leader
  waits at least this long, less the vote-refusal window, before serving, so that its
  predecessor's lease has run out (``lease.py``). A ``ConfirmLeadership`` changes nothing else; its result says whether its
  writer is the leader in force.
* ``members`` / ``members_version``: the replicated member table (node id, Raft address,
  client address), written by ``SetMembers`` (compare-and-set on the version) when an admin
  changes the membership; empty until the first change (then the configured peers apply).
* ``jobs`` (schema 4, ``jobs.py``): one ``JobState`` per job (its spec, version, last quorum and
  history). The default job always exists; ``quorum``, ``history`` and ``quorum_id`` are its.
  ``PutJob`` creates a job or replaces its spec, ``RemoveJob`` removes one (both compare-and-set
  on the job's version); a ``CommitQuorum`` names its job and is the same compare-and-set within
  that job. A removed job's last quorum id is kept (``retired``): created again, its ids go on
  above it (a commit of that id or a lower one is refused), so a job's quorum ids never go back
  and none is issued twice. At most ``MAX_RETIRED_JOBS`` names are kept, the longest removed
  leaving first: its id raises ``retired_floor``, above which every job created afterwards under
  a name not kept starts (ids are per job, so starting higher is harmless). The limit is part of
  the schema: every node must evict alike.
* ``kv`` (schema 7, ``kv_store.py``): the rendezvous key-value store, one namespace per (job,
  run id); ``KVWrite`` / ``KVDrop`` / ``KVExpire`` change it and return a ``kv_store.KVResult``,
  the number of keys dropped, or the namespaces expired. It is independent of the job table (a
  run's namespace needs no job of that name). Snapshots carry it under ``kv``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from lighthouse_cluster.core import codec
from lighthouse_cluster.core.codec import (
    CommitQuorum,
    ConfirmLeadership,
    EnableSchema,
    KVDrop,
    KVExpire,
    KVWrite,
    PutJob,
    RemoveJob,
    SetMembers,
    TermStart,
    UnknownCommand,
)
from lighthouse_cluster.core.jobs import (
    DEFAULT_JOB,
    MAX_JOBS,
    MAX_RETIRED_JOBS,
    JobError,
    JobSpec,
    port_conflict,
    spec_from_wire,
    spec_to_wire,
)
from lighthouse_cluster.core.kv_store import DEFAULT_LIMITS, KVLimits, KVStore
from lighthouse_cluster.core.quorum import Quorum

HISTORY_LENGTH = 256


@dataclass(frozen=True, slots=True)
class CommitResult:
    """Outcome of a ``CommitQuorum``: applied, or rejected with the quorum id actually in place.
    ``fenced``: rejected because it was written in another term than the current leader's (its
    writer is not the leader any more; it should stop serving)."""

    applied: bool
    current_quorum_id: int
    reason: str = ""
    fenced: bool = False


@dataclass(frozen=True, slots=True)
class TermStartResult:
    """Outcome of a ``TermStart``, with the leader in force afterwards: a writer serves only when
    that is itself in its own term (``applied`` is False for a repeated, idempotent one)."""

    applied: bool
    leader_term: int
    leader_id: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class JobResult:
    """Outcome of a ``PutJob`` or ``RemoveJob``: applied, or why not; ``version``: the job's
    version afterwards (0: the job does not exist)."""

    applied: bool
    version: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class HistoryEntry:
    quorum_id: int
    replica_ids: tuple[str, ...]
    created_ms: int
    term: int


@dataclass(slots=True)
class JobState:
    """One job's replicated state. ``id_floor``: quorum ids start above it (a job created again
    after it was removed); ``quorum_id`` is the last one issued, else the floor."""

    spec: JobSpec
    version: int = 0
    quorum: Quorum | None = None
    history: deque[HistoryEntry] = field(default_factory=lambda: deque(maxlen=HISTORY_LENGTH))
    id_floor: int = 0

    @property
    def quorum_id(self) -> int:
        return self.quorum.quorum_id if self.quorum is not None else self.id_floor


def _history_wire(history: deque[HistoryEntry]) -> list[list[Any]]:
    return [[h.quorum_id, list(h.replica_ids), h.created_ms, h.term] for h in history]


def _history_from_wire(items: Any) -> deque[HistoryEntry]:
    return deque((HistoryEntry(quorum_id=h[0], replica_ids=tuple(h[1]), created_ms=h[2], term=h[3])
                  for h in items or []), maxlen=HISTORY_LENGTH)


class QuorumStateMachine:
    """The lighthouse cluster's replicated state; see the module docstring."""

    def __init__(self, max_schema_version: int = codec.SCHEMA_VERSION, max_retired: int = MAX_RETIRED_JOBS,
                 kv_limits: KVLimits = DEFAULT_LIMITS) -> None:
        """``max_schema_version``: the newest schema this node's version writes (lower only to act
        as an older version, for rolling-upgrade tests); ``max_retired``: removed jobs kept by
        name, ``kv_limits``: the rendezvous store's limits (lower either only in tests: every node
        must use the same)."""
        self.max_schema_version = max_schema_version
        self.max_retired = max_retired
        self.kv = KVStore(kv_limits)
        self.jobs: dict[str, JobState] = {DEFAULT_JOB: JobState(JobSpec(DEFAULT_JOB))}
        self.retired: dict[str, int] = {}  # removed jobs' last quorum ids, oldest removal first
        self.retired_floor = 0  # the highest last id of the names dropped from ``retired``
        self.jobs_version = 0  # bumped by every applied PutJob/RemoveJob (readers notice changes)
        self.leader_term = 0
        self.leader_id = ""
        self.leader_since_ms = 0
        self.schema_version = max_schema_version
        self.commands_applied = 0
        self.rejected_commits = 0
        self.rejected_term_starts = 0
        self._fresh = True  # nothing applied or restored yet
        self.members: tuple[tuple[str, str, str], ...] = ()
        self.members_version = 0
        self.lease_ms = 0

    @property
    def fresh(self) -> bool:
        """Nothing applied or restored yet: ``schema_version`` is this node's own default, not its
        cluster's (a node that has not caught up does not know which cluster it is in)."""
        return self._fresh

    @property
    def default_job(self) -> JobState:
        return self.jobs[DEFAULT_JOB]

    @property
    def quorum(self) -> Quorum | None:
        """The default job's last committed quorum."""
        return self.jobs[DEFAULT_JOB].quorum

    @quorum.setter
    def quorum(self, value: Quorum | None) -> None:
        self.jobs[DEFAULT_JOB].quorum = value

    @property
    def history(self) -> deque[HistoryEntry]:
        return self.jobs[DEFAULT_JOB].history

    @property
    def quorum_id(self) -> int:
        return self.jobs[DEFAULT_JOB].quorum_id

    def job(self, name: str) -> JobState | None:
        return self.jobs.get(name)

    def apply(self, command: codec.Command, version: int | None = None) -> Any:
        """Apply one command, written at schema ``version`` (default: the enabled version), and
        return its result (the same on every node)."""
        if version is None:
            version = self.schema_version
        if self._fresh:
            self._fresh = False
            if codec.MIN_READABLE_VERSION <= version < self.schema_version:
                self.schema_version = version  # an existing log, replayed from its first entry
        self.commands_applied += 1
        fencing = version >= codec.FENCING_SCHEMA_VERSION
        if isinstance(command, CommitQuorum):
            return self._commit_quorum(command, fencing)
        if isinstance(command, TermStart):
            return self._term_start(command, fencing)
        if isinstance(command, ConfirmLeadership):
            self.lease_ms = command.lease_ms
            return command.term == self.leader_term and command.node_id == self.leader_id
        if isinstance(command, EnableSchema):
            if codec.MIN_READABLE_VERSION <= command.version <= self.max_schema_version:
                self.schema_version = max(self.schema_version, command.version)
            return self.schema_version
        if isinstance(command, SetMembers):
            if command.expected_version != self.members_version:
                return CommitResult(applied=False, current_quorum_id=self.members_version)
            self.members = command.members
            self.members_version += 1
            return CommitResult(applied=True, current_quorum_id=self.members_version)
        if isinstance(command, PutJob):
            return self._put_job(command)
        if isinstance(command, RemoveJob):
            return self._remove_job(command)
        if isinstance(command, KVWrite):
            return self.kv.write((command.job, command.run_id), command.op, command.request_id, command.time_ms)
        if isinstance(command, KVDrop):
            return self.kv.drop((command.job, command.run_id))
        if isinstance(command, KVExpire):
            return self.kv.expire(command.time_ms, command.idle_ms)
        if isinstance(command, UnknownCommand):
            return None
        raise TypeError(f"not a command: {command!r}")

    def apply_bytes(self, payload: bytes) -> Any:
        command, version = codec.decode_versioned(payload)
        return self.apply(command, version)

    def _term_start(self, cmd: TermStart, fencing: bool) -> TermStartResult:
        if cmd.term > self.leader_term or (not fencing and cmd.term == self.leader_term):
            self.leader_term = cmd.term
            self.leader_id = cmd.node_id
            self.leader_since_ms = cmd.time_ms
            return TermStartResult(applied=True, leader_term=cmd.term, leader_id=cmd.node_id)
        self.rejected_term_starts += 1
        if cmd.term == self.leader_term and cmd.node_id == self.leader_id:
            reason = f"term {cmd.term} already started by {cmd.node_id} (a repeated TermStart)"
        elif cmd.term == self.leader_term:
            reason = f"term {cmd.term} already started by {self.leader_id}: refused for {cmd.node_id}"
        else:
            reason = f"stale: TermStart({cmd.term}, {cmd.node_id}) after term {self.leader_term} started"
        return TermStartResult(applied=False, leader_term=self.leader_term, leader_id=self.leader_id, reason=reason)

    def _put_job(self, cmd: PutJob) -> JobResult:
        spec = cmd.spec
        current = self.jobs.get(spec.name)
        version = current.version if current is not None else 0
        if cmd.expected_version != version or (current is None and cmd.expected_version != 0):
            return JobResult(applied=False, version=version,
                             reason=f"job {spec.name!r} is at version {version}, not {cmd.expected_version}")
        try:
            spec.check()
        except JobError as e:
            return JobResult(applied=False, version=version, reason=str(e))
        clash = port_conflict(spec, (j.spec for j in self.jobs.values()))
        if clash is not None:
            return JobResult(applied=False, version=version, reason=clash)
        if current is None:
            if len(self.jobs) >= MAX_JOBS:
                return JobResult(applied=False, version=0, reason=f"the cluster has {MAX_JOBS} jobs, its limit")
            current = self.jobs[spec.name] = JobState(spec, id_floor=self.retired.pop(spec.name, self.retired_floor))
        current.spec = spec
        current.version += 1
        self.jobs_version += 1
        return JobResult(applied=True, version=current.version)

    def _remove_job(self, cmd: RemoveJob) -> JobResult:
        current = self.jobs.get(cmd.name)
        if current is None:
            return JobResult(applied=False, version=0, reason=f"no job {cmd.name!r}")
        if cmd.name == DEFAULT_JOB:
            return JobResult(applied=False, version=current.version, reason="the default job cannot be removed")
        if cmd.expected_version != current.version:
            return JobResult(applied=False, version=current.version,
                             reason=f"job {cmd.name!r} is at version {current.version}, not {cmd.expected_version}")
        del self.jobs[cmd.name]
        self.retired[cmd.name] = current.quorum_id
        if len(self.retired) > self.max_retired:
            oldest = next(iter(self.retired))
            self.retired_floor = max(self.retired_floor, self.retired.pop(oldest))
        self.jobs_version += 1
        return JobResult(applied=True, version=0)

    def _commit_quorum(self, cmd: CommitQuorum, fencing: bool = True) -> CommitResult:
        job = self.jobs.get(cmd.job)
        current = job.quorum_id if job is not None else 0
        # Fencing first: a deposed leader's commit is reported fenced (it then steps down) even
        # when its job is gone meanwhile.
        if fencing and self.leader_term and cmd.term != self.leader_term:
            self.rejected_commits += 1
            return CommitResult(applied=False, current_quorum_id=current, fenced=True,
                                reason=f"fenced: written by {cmd.node_id} in term {cmd.term}, "
                                       f"the leader term is {self.leader_term} ({self.leader_id})")
        if job is None:
            self.rejected_commits += 1
            return CommitResult(applied=False, current_quorum_id=0, reason=f"no job {cmd.job!r}")
        q = cmd.quorum
        same_id_other_members = (
            job.quorum is not None and q.quorum_id == current
            and [m.replica_id for m in q.participants] != [m.replica_id for m in job.quorum.participants]
        )
        # A job created again: its old self issued ids up to the floor, so the floor itself is
        # taken too (a commit computed from the old job's state may carry it).
        reissued_floor = job.quorum is None and job.id_floor > 0 and q.quorum_id <= job.id_floor
        # Ids start at 1 (torchft's first quorum is 1; no writer computes 0): a quorum id 0 would
        # be indistinguishable from "none yet", so a job removed after committing it and created
        # again could commit 0 once more with other members.
        below_first = q.quorum_id < 1
        if cmd.expected_quorum_id != current or q.quorum_id < current or same_id_other_members or reissued_floor \
                or below_first:
            self.rejected_commits += 1
            if below_first:
                reason = f"quorum id {q.quorum_id}: quorum ids start at 1"
            elif cmd.expected_quorum_id != current:
                reason = f"stale: computed from quorum id {cmd.expected_quorum_id}, the current one is {current}"
            elif q.quorum_id < current:
                reason = f"quorum id {q.quorum_id} would go back from {current}"
            elif reissued_floor:
                reason = f"quorum id {q.quorum_id} was the job's before it was removed and created again"
            else:
                reason = f"quorum id {current} already has other members"
            return CommitResult(applied=False, current_quorum_id=current, reason=reason)
        job.quorum = q
        job.history.append(HistoryEntry(
            quorum_id=q.quorum_id,
            replica_ids=tuple(m.replica_id for m in q.participants),
            created_ms=q.created_ms,
            term=cmd.term,
        ))
        return CommitResult(applied=True, current_quorum_id=q.quorum_id)

    # -- snapshots ------------------------------------------------------------------------

    def to_snapshot(self) -> bytes:
        v = self.schema_version
        # The default job keeps the keys it always had; other jobs (and the default job's spec
        # once set) go under "jobs", which an older reader ignores.
        jobs = {name: {"spec": spec_to_wire(j.spec), "ver": j.version,
                       **({"q": codec.quorum_to_wire(j.quorum, v), "h": _history_wire(j.history)}
                          if name != DEFAULT_JOB and j.quorum is not None else {}),
                       **({"floor": j.id_floor} if j.id_floor else {})}
                for name, j in self.jobs.items() if name != DEFAULT_JOB or j.version or j.id_floor}
        return codec.encode_snapshot({
            "quorum": codec.quorum_to_wire(self.quorum, v) if self.quorum is not None else None,
            "history": _history_wire(self.history),
            **({"jobs": jobs} if jobs else {}),
            **({"retired": dict(self.retired)} if self.retired else {}),
            **({"retired_floor": self.retired_floor} if self.retired_floor else {}),
            **({"jobs_v": self.jobs_version} if self.jobs_version else {}),
            "leader": [self.leader_term, self.leader_id, self.leader_since_ms],
            "schema": self.schema_version,
            "applied": self.commands_applied,
            "rejected": self.rejected_commits,
            **({"rejected_ts": self.rejected_term_starts} if self.rejected_term_starts else {}),
            **({"members": [list(m) for m in self.members], "members_v": self.members_version}
               if self.members_version else {}),
            **({"lease_ms": self.lease_ms} if self.lease_ms else {}),
            **({"kv": self.kv.to_wire()} if self.kv.namespaces or self.kv.revision else {}),
        }, version=self.schema_version)

    def restore_snapshot(self, data: bytes) -> None:
        obj = codec.decode_snapshot(data)
        q = obj.get("quorum")
        default = JobState(JobSpec(DEFAULT_JOB), quorum=codec.quorum_from_wire(q) if q is not None else None,
                           history=_history_from_wire(obj.get("history")))
        self.jobs = {DEFAULT_JOB: default}
        for name, j in (obj.get("jobs") or {}).items():
            state = self.jobs.get(name) or JobState(spec_from_wire(j["spec"]))
            state.spec, state.version, state.id_floor = spec_from_wire(j["spec"]), j.get("ver", 0), j.get("floor", 0)
            if j.get("q") is not None:
                state.quorum, state.history = codec.quorum_from_wire(j["q"]), _history_from_wire(j.get("h"))
            self.jobs[name] = state
        self.retired = {str(k): int(v) for k, v in (obj.get("retired") or {}).items()}
        self.retired_floor = int(obj.get("retired_floor", 0))
        self.jobs_version = obj.get("jobs_v", 0)
        self.leader_term, self.leader_id, self.leader_since_ms = obj.get("leader", [0, "", 0])
        self.schema_version = obj.get("schema", codec.MIN_READABLE_VERSION)
        self.commands_applied = obj.get("applied", 0)
        self.rejected_commits = obj.get("rejected", 0)
        self.rejected_term_starts = obj.get("rejected_ts", 0)
        self._fresh = self.commands_applied == 0  # a snapshot of a state that applied nothing
        self.members = tuple((str(m[0]), str(m[1]), str(m[2])) for m in obj.get("members", []))
        self.members_version = obj.get("members_v", 0)
        self.lease_ms = obj.get("lease_ms", 0)
        self.kv.restore(obj.get("kv"))
