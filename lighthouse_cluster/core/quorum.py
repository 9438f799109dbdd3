"""torchft's lighthouse quorum algorithm, as a pure function of the lighthouse state.

This module owns the *decision* part of the lighthouse:

* :func:`compute_quorum` -- torchft's ``quorum_compute``: given the pending quorum
  requesters, the heartbeat table and the previous quorum, decide whether a new quorum can
  be issued now, which members it has, and the human-readable reason string (byte-for-byte
  the string torchft's Rust lighthouse produces).
* :func:`next_quorum_id` / :func:`issue_quorum` -- the quorum-id rule of torchft's
  ``_quorum_tick`` and the construction of the issued :class:`Quorum`.
* The value types shared with the rest of the package (:class:`Member`, :class:`Quorum`,
  :class:`QuorumOptions`, :class:`Participant`, :class:`QuorumDecision`).

It does no I/O, reads no clock, starts no threads and logs nothing: every time value is
passed in by the caller (monotonic seconds for ``now``/``joined``/heartbeats, wall-clock
milliseconds for ``created_ms``).  Everything the caller must do around a decision -- record
the issued quorum as the new previous one, clear the pending participants, wake the waiting
requesters, re-register requesters that were left out -- is the caller's business.

Semantics follow torchft's ``src/lighthouse.rs`` exactly, including its quirks:

* a replica is healthy iff ``now - last_heartbeat < heartbeat_timeout`` (strict; a heartbeat
  timestamp in the future counts as zero elapsed time, like Rust's saturating
  ``Instant::duration_since``);
* a pending participant that has no heartbeat entry (or a stale one) is not healthy;
* with a previous quorum, the ``shrink_only`` filter is applied to the candidates *before*
  the fast-quorum check, and it is applied on every path that issues a quorum; the
  fast-quorum check itself looks at the *healthy participants* (not the filtered
  candidates), and it is vacuously true when the previous quorum is empty;
* the ``min_replicas``, split-brain and join-timeout checks count healthy participants,
  not the shrink-filtered candidates, so a ``shrink_only`` round can issue a quorum smaller
  than ``min_replicas`` (even an empty one);
* candidates are ordered by ``replica_id``; Python's ``str`` ordering (by code point) equals
  Rust's ``String`` ordering (by UTF-8 bytes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter

from lighthouse_cluster.core.defaults import DEFAULT_HEARTBEAT_TIMEOUT_MS, DEFAULT_JOIN_TIMEOUT_MS

__all__ = [
    "Member",
    "Participant",
    "Quorum",
    "QuorumDecision",
    "QuorumOptions",
    "compute_quorum",
    "issue_quorum",
    "next_quorum_id",
]


@dataclass(frozen=True, slots=True)
class Member:
    """One replica group's quorum request (mirrors ``torchft.QuorumMember``).

    ``data`` is an opaque JSON string; ``commit_failures`` is the number of consecutive
    failed commits the replica reports (a positive value forces a new quorum id). ``raw`` is
    the requester's serialized ``torchft.QuorumMember`` exactly as it sent it, fields this
    version does not know included: participants go back to trainers from it
    (``torchft_wire``); empty for a member built from the fields above alone.
    """

    replica_id: str
    address: str = ""
    store_address: str = ""
    step: int = 0
    world_size: int = 0
    shrink_only: bool = False
    data: str = ""
    commit_failures: int = 0
    raw: bytes = field(default=b"", repr=False)


@dataclass(frozen=True, slots=True)
class Quorum:
    """An issued quorum (mirrors ``torchft.Quorum``).

    ``participants`` are sorted by ``replica_id``; ``created_ms`` is wall-clock milliseconds
    since the Unix epoch (it becomes the proto ``created`` Timestamp).
    """

    quorum_id: int
    participants: tuple[Member, ...]
    created_ms: int


@dataclass(frozen=True, slots=True)
class QuorumOptions:
    """The lighthouse flags that influence the decision (torchft's ``LighthouseOpt``).

    ``quorum_tick_ms`` is a scheduling concern of the caller and is deliberately absent.
    All values are non-negative integers (they are ``u64`` in torchft).
    """

    min_replicas: int
    join_timeout_ms: int = DEFAULT_JOIN_TIMEOUT_MS
    heartbeat_timeout_ms: int = DEFAULT_HEARTBEAT_TIMEOUT_MS

    def __post_init__(self) -> None:
        for name in ("min_replicas", "join_timeout_ms", "heartbeat_timeout_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")


@dataclass(frozen=True, slots=True)
class Participant:
    """A pending quorum requester: its request and when it registered.

    ``joined`` is in monotonic seconds (same clock as ``now`` and the heartbeats).  The key
    under which a participant is stored must equal ``member.replica_id``.
    """

    member: Member
    joined: float


@dataclass(frozen=True, slots=True)
class QuorumDecision:
    """Result of :func:`compute_quorum`.

    ``members`` is ``None`` when no quorum can be issued yet, otherwise the members of the
    quorum to issue, sorted by ``replica_id``.  ``reason`` is torchft's status string.
    """

    members: tuple[Member, ...] | None
    reason: str


_BY_REPLICA_ID = attrgetter("replica_id")


def _candidates(
    healthy_participants: dict[str, Participant], prev_ids: set[str] | None
) -> tuple[Member, ...]:
    """Members of the healthy participants, restricted to ``prev_ids`` if given, sorted."""
    members = [p.member for p in healthy_participants.values()]
    if prev_ids is not None:
        members = [m for m in members if m.replica_id in prev_ids]
    members.sort(key=_BY_REPLICA_ID)
    return tuple(members)


def compute_quorum(
    now: float,
    participants: Mapping[str, Participant],
    heartbeats: Mapping[str, float],
    previous: Quorum | None,
    options: QuorumOptions,
) -> QuorumDecision:
    """Decide whether a quorum can be issued now (torchft's ``quorum_compute``).

    ``now``, ``heartbeats`` values and ``Participant.joined`` are monotonic seconds;
    the timeouts in ``options`` are milliseconds.  Checks, in torchft's order:

    1. healthy replicas (fresh heartbeat) and healthy participants;
    2. with a previous quorum: drop candidates outside it if any healthy participant asked
       for ``shrink_only``; issue at once ("fast quorum") if every previous member is a
       healthy participant;
    3. not ready if fewer than ``min_replicas`` healthy participants;
    4. not ready if healthy participants <= healthy replicas // 2 (split brain guard);
    5. not ready if some healthy replica has not joined and the earliest healthy
       participant joined less than ``join_timeout_ms`` ago;
    6. otherwise issue the candidates.
    """
    # 1. Healthy replicas.  With a positive timeout, max(0, now - t) < T  <=>  now - t < T;
    #    with a zero timeout Rust's saturating duration makes nobody healthy.
    hb_timeout = options.heartbeat_timeout_ms / 1000.0
    if hb_timeout > 0.0:
        healthy = {rid for rid, last in heartbeats.items() if now - last < hb_timeout}
    else:
        healthy = set()

    healthy_participants = {rid: p for rid, p in participants.items() if rid in healthy}
    n_hp = len(healthy_participants)
    n_healthy = len(healthy)

    shrink_only = any(p.member.shrink_only for p in healthy_participants.values())

    metadata = (
        f"[{n_hp}/{len(participants)} participants healthy]"
        f"[{n_healthy} heartbeating]"
        f"[shrink_only={'true' if shrink_only else 'false'}]"
    )

    # Candidates are only materialised (filtered + sorted) on the paths that issue.
    prev_ids: set[str] | None = None

    # 2. Previous quorum: shrink_only filter, then the fast-quorum check.
    if previous is not None:
        if shrink_only:
            prev_ids = {m.replica_id for m in previous.participants}
        if all(m.replica_id in healthy_participants for m in previous.participants):
            return QuorumDecision(
                _candidates(healthy_participants, prev_ids), f"Fast quorum found! {metadata}"
            )

    # 3. Minimum quorum size.
    if n_hp < options.min_replicas:
        return QuorumDecision(
            None,
            f"New quorum not ready, only have {n_hp} participants, "
            f"need min_replicas {options.min_replicas} {metadata}",
        )

    # 4. Split brain guard: at least half (integer division) of the alive workers.
    if n_hp <= n_healthy // 2:
        return QuorumDecision(
            None,
            f"New quorum not ready, only have {n_hp} participants, "
            f"need at least half of {n_healthy} healthy workers {metadata}",
        )

    # 5. Valid, but wait for healthy stragglers until the join timeout has passed.
    if n_hp != n_healthy:
        # healthy_participants is non-empty here (step 4 rejects n_hp == 0).
        first_joined = min(p.joined for p in healthy_participants.values())
        elapsed = now - first_joined
        if elapsed < 0.0:
            elapsed = 0.0
        if elapsed < options.join_timeout_ms / 1000.0:
            return QuorumDecision(
                None,
                f"Valid quorum with {n_hp} participants, waiting for "
                f"{n_healthy - n_hp} healthy but not participating stragglers "
                f"due to join timeout {metadata}",
            )

    # 6. Issue.
    return QuorumDecision(
        _candidates(healthy_participants, prev_ids), f"Valid quorum found {metadata}"
    )


def next_quorum_id(previous: Quorum | None, members: Sequence[Member]) -> int:
    """The id of the quorum issued with ``members`` after ``previous`` (torchft's rule).

    * no previous quorum -> 1 (torchft starts at 0 and bumps on the first quorum);
    * the ordered replica_id list differs from the previous quorum's -> previous id + 1;
    * else any member reports ``commit_failures > 0`` -> previous id + 1;
    * else the previous id.

    ``members`` is compared in ``replica_id`` order (the order :func:`issue_quorum` stores).
    """
    if previous is None:
        return 1
    prev = previous.participants
    if len(prev) != len(members):
        return previous.quorum_id + 1
    ids = sorted(m.replica_id for m in members)
    if any(a != b.replica_id for a, b in zip(ids, prev)):
        return previous.quorum_id + 1
    if any(m.commit_failures > 0 for m in members):
        return previous.quorum_id + 1
    return previous.quorum_id


def issue_quorum(previous: Quorum | None, members: Sequence[Member], created_ms: int) -> Quorum:
    """Build the quorum that follows ``previous`` with ``members`` (sorted by replica_id)."""
    ordered = tuple(sorted(members, key=_BY_REPLICA_ID))
    return Quorum(
        quorum_id=next_quorum_id(previous, ordered),
        participants=ordered,
        created_ms=created_ms,
    )
