"""torchft messages as a newer torchft would send them: fields this version does not know."""

from __future__ import annotations

from lighthouse_cluster.proto import torchft_pb2 as pb


def unknown_field(number: int, payload: bytes) -> bytes:
    """A length-delimited field ``number`` (wire type 2) that torchft.proto does not define."""
    assert number < 16 and len(payload) < 128  # one-byte tag and length keep this readable
    return bytes([(number << 3) | 2, len(payload)]) + payload


def member_bytes(rid: str, *, step: int = 3, extra: bytes = b"", **fields: object) -> bytes:
    """A serialized QuorumMember as a newer torchft would send it: known fields, then ``extra``."""
    known = pb.QuorumMember(replica_id=rid, address=f"http://{rid}:1", store_address=f"{rid}:2", step=step,
                            world_size=2, data='{"k": 1}', **fields)
    return known.SerializeToString() + extra
