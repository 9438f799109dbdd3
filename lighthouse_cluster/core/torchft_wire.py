"""torchft's wire messages <-> the quorum value types, with pass-through of every member field.

A quorum participant goes back to trainers exactly as its requester sent it: ``Member.raw``
holds the requester's serialized ``torchft.QuorumMember``, and a participant is rebuilt from
those bytes, so fields this version does not know (torchft-nightly's ``reconfigure_handles``,
whatever torchft adds next) come back unchanged. The quorum algorithm reads only the fields it
names (``replica_id``, ``step``, ``shrink_only``, ``commit_failures``); a ``Member`` built by
hand (``raw`` empty) is encoded from those fields.

Pure translation, no state and no I/O.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError
from google.protobuf.timestamp_pb2 import Timestamp

from lighthouse_cluster.core.quorum import Member, Quorum
from lighthouse_cluster.proto import torchft_pb2 as pb

__all__ = ["DecodeError", "member_from_bytes", "member_from_proto", "member_to_proto", "quorum_bytes",
           "quorum_response", "quorum_to_proto", "requester_bytes"]


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
    return pb.Quorum.FromString(quorum_bytes(q))


def quorum_response(q: Quorum) -> bytes:
    """The serialized ``LighthouseQuorumResponse`` for ``q`` (encoded once per round)."""
    return _field(1, quorum_bytes(q))


def quorum_bytes(q: Quorum) -> bytes:
    """The serialized ``torchft.Quorum``, written field by field so that every participant is
    its requester's bytes verbatim (a parse and re-serialization could merge or drop fields)."""
    created = Timestamp()
    created.FromMilliseconds(q.created_ms)
    parts = [_key(1, 0) + _encode_varint(q.quorum_id)] if q.quorum_id else []
    parts += [_field(2, m.raw if m.raw else member_to_proto(m).SerializeToString()) for m in q.participants]
    parts.append(_field(3, created.SerializeToString()))
    return b"".join(parts)


def requester_bytes(request: bytes) -> bytes | None:
    """The ``requester`` (field 1) of a serialized ``LighthouseQuorumRequest`` exactly as sent, or
    None when it is not there exactly once (then re-serialize the parsed one). Verbatim bytes keep
    every field as the sender wrote it, also where this version's schema would read it otherwise
    (a field it declares singular that a newer torchft repeats)."""
    found: bytes | None = None
    pos, end = 0, len(request)
    try:
        while pos < end:
            key, pos = _varint(request, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, pos = _varint(request, pos)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 2:
                length, pos = _varint(request, pos)
                if number == 1:
                    if found is not None:
                        return None  # two occurrences merge: let protobuf do it
                    found = request[pos:pos + length]
                pos += length
            elif wire_type == 5:
                pos += 4
            else:
                return None  # groups: not in this schema
    except IndexError:
        return None
    return found if pos == end else None


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _key(number: int, wire_type: int) -> bytes:
    return _encode_varint((number << 3) | wire_type)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    return _key(number, 2) + _encode_varint(len(payload)) + payload


def _encode_varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # int64 on the wire: two's complement in ten bytes
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
