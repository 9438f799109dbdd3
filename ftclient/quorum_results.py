"""What one rank of a replica group learns from a lighthouse quorum: torchft's
``compute_quorum_results`` (``src/manager.rs``), as a pure function.

It owns the manager-side rules, and nothing else (no I/O, no clock, no logging):

* participants are ordered by ``replica_id``; ``replica_rank`` is this replica group's index
  in that order (absent -> :class:`ReplicaNotInQuorum`, which the manager server turns into
  gRPC NOT_FOUND);
* the *max participants* are those at the highest step; the rank's *primary* (whose TCPStore
  it uses for the process group) is ``max_participants[group_rank % len(max_participants)]``;
* a replica group must recover when it is behind the highest step, or -- ``init_sync`` on step
  0 -- when it is not the primary (so every group starts from identical weights);
* the i-th recovering group recovers from ``up_to_date[(i + group_rank) % len(up_to_date)]``:
  recovery sources rotate, and different group ranks of one replica group spread their
  checkpoint traffic over different sources;
* ``commit_failures`` is the maximum any participant reported; ``replica_ids`` the sorted ids
  (the field the torchft 0.2.0 wheel added).

The quorum may be the lighthouse's answer as received (the generated protobuf ``Quorum``, whose
participants are ``QuorumMember`` messages) or this module's :class:`QuorumView` of
:class:`PeerInfo` values: any objects with those attributes. These two dataclasses are the
trainer's view of an issued quorum; the lighthouse's own records
(``lighthouse_cluster.core.quorum.Member``, ``Quorum``, ``Participant``) are different types.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["PeerInfo", "QuorumResult", "QuorumView", "ReplicaNotInQuorum", "compute_quorum_results"]


class PeerInfoLike(Protocol):
    """A quorum participant: ``torchft.QuorumMember``, its protobuf message, :class:`PeerInfo`."""

    replica_id: str
    address: str
    store_address: str
    step: int
    commit_failures: int


class QuorumViewLike(Protocol):
    """A quorum as the trainer received it: the protobuf ``Quorum``, :class:`QuorumView`."""

    quorum_id: int

    @property
    def participants(self) -> Sequence[PeerInfoLike]: ...


@dataclass(frozen=True)
class PeerInfo:
    """What the trainer learns about one replica group of a quorum it received, itself included
    (the fields of ``torchft.QuorumMember``; ``world_size`` is the group's number of ranks, at
    least 1)."""

    replica_id: str
    address: str = ""
    store_address: str = ""
    step: int = 0
    world_size: int = 1
    shrink_only: bool = False
    data: str = ""
    commit_failures: int = 0


@dataclass(frozen=True)
class QuorumView:
    """A quorum as the trainer received it from the lighthouse: its id and its participants (in
    any order)."""

    quorum_id: int
    participants: tuple[PeerInfo, ...]


@dataclass(frozen=True)
class QuorumResult:
    """One group rank's view of a quorum; the fields of torchft's ``QuorumResult``.

    ``max_*`` describe the replica groups at the highest step, ``replica_*`` all of them.
    ``recover_src_*`` name the group this one heals from (``heal``); ``recover_dst_replica_ranks``
    the groups that heal from this one (for this group rank).
    """

    quorum_id: int
    replica_rank: int
    replica_world_size: int
    recover_src_manager_address: str
    recover_src_replica_rank: int | None
    recover_dst_replica_ranks: list[int]
    store_address: str
    max_step: int
    max_replica_rank: int | None
    max_world_size: int
    heal: bool
    commit_failures: int
    replica_ids: list[str] = field(default_factory=list)


class ReplicaNotInQuorum(LookupError):
    """The replica group asking is not a participant of the quorum it was handed."""


def compute_quorum_results(replica_id: str, group_rank: int, quorum: QuorumViewLike,
                           init_sync: bool = True) -> QuorumResult:
    """``replica_id``'s group rank ``group_rank`` view of ``quorum``; see the module docstring."""
    if group_rank < 0:
        raise ValueError(f"group_rank must be >= 0, got {group_rank}")
    participants = sorted(quorum.participants, key=lambda p: p.replica_id)
    ids = [p.replica_id for p in participants]
    if replica_id not in ids:
        raise ReplicaNotInQuorum(f"replica {replica_id} not participating in returned quorum "
                                 f"{quorum.quorum_id} (participants: {', '.join(ids) or 'none'})")
    replica_rank = ids.index(replica_id)

    max_step = max(p.step for p in participants)
    max_participants = [p for p in participants if p.step == max_step]
    max_ids = [p.replica_id for p in max_participants]
    max_replica_rank = max_ids.index(replica_id) if replica_id in max_ids else None
    primary = max_participants[group_rank % len(max_participants)]

    force_recover = init_sync and max_step == 0
    recovering = [i for i, p in enumerate(participants)
                  if p.step != max_step or (force_recover and p.replica_id != primary.replica_id)]
    recovering_set = set(recovering)
    up_to_date = [i for i in range(len(participants)) if i not in recovering_set]

    recover_src: int | None = None
    recover_dst: list[int] = []
    for i, dst in enumerate(recovering):
        src = up_to_date[(i + group_rank) % len(up_to_date)]
        if src == replica_rank:
            recover_dst.append(dst)
        if dst == replica_rank:
            recover_src = src

    return QuorumResult(
        quorum_id=quorum.quorum_id,
        replica_rank=replica_rank,
        replica_world_size=len(participants),
        recover_src_manager_address=participants[recover_src].address if recover_src is not None else "",
        recover_src_replica_rank=recover_src,
        recover_dst_replica_ranks=recover_dst,
        store_address=primary.store_address,
        max_step=max_step,
        max_replica_rank=max_replica_rank,
        max_world_size=len(max_participants),
        heal=recover_src is not None,
        commit_failures=max((p.commit_failures for p in participants), default=0),
        replica_ids=ids,
    )
