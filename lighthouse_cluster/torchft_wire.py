"""torchft's wire messages <-> the quorum value types, with pass-through of every member field.

A quorum participant goes back to trainers exactly as its requester sent it: ``Member.raw``
holds the requester's serialized ``torchft.QuorumMember``, and a participant is rebuilt from
those bytes, so fields this version does not know (torchft-nightly's ``reconfigure_handle``,
whatever torchft adds next) come back unchanged. The quorum algorithm reads only the fields it
names (``replica_id``, ``step``, ``shrink_only``, ``commit_failures``); a ``Member`` built by
hand (``raw`` empty) is encoded from those fields.

Pure translation, no state and no I/O.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from .proto import torchft_pb2 as pb
from .quorum import Member, Quorum

__all__ = ["DecodeError", "member_from_bytes", "member_from_proto", "member_to_proto", "quorum_response",
           "quorum_to_proto"]


def member_from_proto(p: pb.QuorumMember, raw: bytes | None = None) -> Member:
    """A ``Member`` of ``p``; ``raw`` is ``p`` as its sender serialized it (default: re-serialized,
    which keeps the fields this version does not know)."""
    return Member(
        replica_id=p.replica_id, address=p.address, store_address=p.store_address, step=p.step,
        world_size=p.world_size, shrink_only=p.shrink_only, data=p.data, commit_failures=p.commit_failures,
        raw=p.SerializeToString() if raw is None else raw,
    )


def member_from_bytes(raw: bytes) -> Member:
    """A ``Member`` of a serialized ``torchft.QuorumMember``; raises ``DecodeError``."""
    return member_from_proto(pb.QuorumMember.FromString(raw), raw)


def member_to_proto(m: Member) -> pb.QuorumMember:
    if m.raw:
        return pb.QuorumMember.FromString(m.raw)
    return pb.QuorumMember(
        replica_id=m.replica_id, address=m.address, store_address=m.store_address, step=m.step,
        world_size=m.world_size, shrink_only=m.shrink_only, data=m.data, commit_failures=m.commit_failures,
    )


def quorum_to_proto(q: Quorum) -> pb.Quorum:
    out = pb.Quorum()
    _fill_quorum(out, q)
    return out


def quorum_response(q: Quorum) -> bytes:
    """The serialized ``LighthouseQuorumResponse`` for ``q`` (encoded once per round)."""
    response = pb.LighthouseQuorumResponse()
    _fill_quorum(response.quorum, q)
    return response.SerializeToString()


def _fill_quorum(out: pb.Quorum, q: Quorum) -> None:
    out.quorum_id = q.quorum_id
    out.created.FromMilliseconds(q.created_ms)
    participants = out.participants
    for m in q.participants:
        if m.raw:
            participants.add().MergeFromString(m.raw)
        else:
            participants.append(member_to_proto(m))
