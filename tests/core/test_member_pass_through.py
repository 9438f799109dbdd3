"""Quorum members pass through whole: every field a requester sent, known to this version or
not, comes back in every participant, and survives the Raft log (schema 3) and snapshots; an
old (schema 1/2) journal still replays, and a schema-2 cluster keeps writing what old nodes read.

Pure tests: no processes (the same through real nodes: tests/server/test_forward_compat.py).
"""

from __future__ import annotations

import msgpack
import pytest

from lighthouse_cluster.core import codec
from lighthouse_cluster.core.codec import CommitQuorum, EnableSchema, SchemaError, TermStart
from lighthouse_cluster.proto import torchft_pb2 as pb
from lighthouse_cluster.core.quorum import Member, Quorum, issue_quorum
from lighthouse_cluster.server.grpc_services import InvalidRequest, validate_requester
from lighthouse_cluster.core.state_machine import QuorumStateMachine
from lighthouse_cluster.core.torchft_wire import member_from_bytes, member_to_proto, quorum_response, quorum_to_proto
from support.member_bytes import member_bytes, unknown_field

LIMIT = 64 * 1024


def request_bytes(raw_member: bytes) -> bytes:
    """A LighthouseQuorumRequest's bytes, written by hand: field 1 holds ``raw_member`` verbatim."""
    assert len(raw_member) < 128
    return bytes([0x0A, len(raw_member)]) + raw_member


def request_of(raw_member: bytes) -> pb.LighthouseQuorumRequest:
    request = pb.LighthouseQuorumRequest()
    request.requester.MergeFromString(raw_member)
    # What a node receives is the request's bytes: parse them as the servicer does.
    return pb.LighthouseQuorumRequest.FromString(request.SerializeToString())


def participants_bytes(response: bytes) -> dict[str, bytes]:
    quorum = pb.LighthouseQuorumResponse.FromString(response).quorum
    return {p.replica_id: p.SerializeToString() for p in quorum.participants}


def test_unknown_and_new_fields_come_back_unchanged_in_every_participant() -> None:
    sent = {
        "a": member_bytes("a", extra=unknown_field(15, b"\x00\xffopaque")),
        "b": member_bytes("b", reconfigure_handles=['{"rank": 0}', '{"rank": 1}'], extra=unknown_field(14, b"x")),
        "c": member_bytes("c"),
    }
    members = [validate_requester(request_of(raw), LIMIT, request_bytes(raw)) for raw in sent.values()]
    assert all(m.raw == sent[m.replica_id] for m in members)
    quorum = issue_quorum(None, members, created_ms=1_700_000_000_123)
    assert participants_bytes(quorum_response(quorum)) == sent
    # The quorum algorithm still reads the known fields.
    assert [(m.replica_id, m.step, m.world_size) for m in quorum.participants] == [("a", 3, 2), ("b", 3, 2),
                                                                                  ("c", 3, 2)]
    assert list(quorum_to_proto(quorum).participants[1].reconfigure_handles) == ['{"rank": 0}', '{"rank": 1}']


def test_a_member_built_by_hand_is_encoded_from_its_fields() -> None:
    m = Member(replica_id="x", address="a", store_address="s", step=4, world_size=1, shrink_only=True,
               data="{}", commit_failures=2)
    assert member_to_proto(m) == pb.QuorumMember(replica_id="x", address="a", store_address="s", step=4,
                                                 world_size=1, shrink_only=True, data="{}", commit_failures=2)
    q = Quorum(quorum_id=7, participants=(m,), created_ms=5)
    assert participants_bytes(quorum_response(q)) == {"x": member_to_proto(m).SerializeToString()}


def test_the_size_limit_counts_every_field_of_the_member() -> None:
    small = member_bytes("a", extra=unknown_field(15, b"y" * 100))
    assert validate_requester(request_of(small), LIMIT).raw == small
    with pytest.raises(InvalidRequest, match=r"requester is \d+ bytes serialized .* limit on a member is 100"):
        validate_requester(request_of(small), 100)  # data alone (8 bytes) is far below the limit
    huge_data = pb.QuorumMember(replica_id="a", data="x" * (LIMIT + 1)).SerializeToString()
    with pytest.raises(InvalidRequest, match="data"):
        validate_requester(request_of(huge_data), LIMIT)


def commit_of(raw_members: list[bytes], quorum_id: int = 1, term: int = 1) -> CommitQuorum:
    members = tuple(member_from_bytes(r) for r in raw_members)
    return CommitQuorum(expected_quorum_id=quorum_id - 1, quorum=Quorum(quorum_id, members, 10), term=term,
                        node_id="n1")


def test_schema_3_log_and_snapshot_keep_whole_members() -> None:
    raws = [member_bytes("a", extra=unknown_field(15, b"v3")), member_bytes("b", reconfigure_handles=["h0", "h1"])]
    payload = codec.encode_command(commit_of(raws), version=3)
    wire = msgpack.unpackb(payload)
    assert [p["pb"] for p in wire["q"]["p"]] == raws  # the requester's bytes, not re-derived fields
    sm = QuorumStateMachine()
    sm.apply_bytes(codec.encode_command(TermStart(1, "n1", 0), version=3))
    assert sm.apply_bytes(payload).applied
    assert [m.raw for m in sm.quorum.participants] == raws
    restored = QuorumStateMachine()
    restored.restore_snapshot(sm.to_snapshot())
    assert restored.quorum == sm.quorum
    assert participants_bytes(quorum_response(restored.quorum)) == {"a": raws[0], "b": raws[1]}


def test_a_schema_2_cluster_writes_fields_that_old_nodes_read() -> None:
    raws = [member_bytes("a", step=9, extra=unknown_field(15, b"lost on v2"))]
    payload = codec.encode_command(commit_of(raws), version=2)
    wire = msgpack.unpackb(payload)
    assert wire["v"] == 2 and "pb" not in wire["q"]["p"][0]
    assert wire["q"]["p"][0]["st"] == 9 and wire["q"]["p"][0]["r"] == "a"
    decoded = codec.decode_command(payload)
    assert decoded.quorum.participants[0].step == 9 and decoded.quorum.participants[0].raw == b""


def test_an_old_journal_replays_then_schema_3_is_enabled() -> None:
    """A schema-2 journal replays to the same state; enabling 3 (what the leader does once every
    node reads it) switches writers to whole members; the snapshot keeps both kinds readable."""
    old = [codec.encode_command(TermStart(1, "n1", 0), version=2),
           codec.encode_command(commit_of([member_bytes("a")]), version=2)]
    sm = QuorumStateMachine()
    for entry in old:
        sm.apply_bytes(entry)
    assert sm.schema_version == 2 and sm.quorum.participants[0].raw == b""
    assert msgpack.unpackb(sm.to_snapshot())["quorum"]["p"][0].get("pb") is None
    assert sm.apply_bytes(codec.encode_command(EnableSchema(3), version=sm.schema_version)) == 3
    raw = member_bytes("a", extra=unknown_field(15, b"after upgrade"))
    assert sm.apply_bytes(codec.encode_command(commit_of([raw], quorum_id=2), version=sm.schema_version)).applied
    again = QuorumStateMachine()
    again.restore_snapshot(sm.to_snapshot())
    assert again.schema_version == 3 and again.quorum.participants[0].raw == raw


def test_a_corrupt_whole_member_is_a_schema_error_not_a_crash() -> None:
    payload = msgpack.packb({"v": 3, "k": "commit_quorum", "expect": 0, "term": 1, "node": "n1",
                             "q": {"id": 1, "c": 0, "p": [{"r": "a", "pb": b"\xff\xff\xff"}]}})
    with pytest.raises(SchemaError, match="not a serialized QuorumMember"):
        codec.decode_command(payload)


def test_members_come_back_verbatim_even_where_this_schema_would_read_them_otherwise() -> None:
    """A newer torchft may repeat a field this version declares singular (as torchft-nightly's
    reconfigure handles: one per rank, field 9): parsing keeps only the last value, so the cluster
    passes the requester's bytes through instead of re-serializing them."""
    raw = member_bytes("a") + bytes([0x3A, 2]) + b"d2"  # field 7 (data, singular here) a second time
    assert pb.QuorumMember.FromString(raw).SerializeToString() != raw  # what a re-serialization loses
    member = validate_requester(request_of(raw), LIMIT, request_bytes(raw))
    assert member.raw == raw and member.data == "d2"
    response = quorum_response(issue_quorum(None, [member], 5))
    assert bytes([0x12, len(raw)]) + raw in response  # participant (field 2) = the bytes as sent
    # The request's bytes with field 1 twice (protobuf merges them): the parsed member, re-serialized.
    twice = request_bytes(member_bytes("a", step=1)) + request_bytes(member_bytes("a", step=2))
    merged = validate_requester(pb.LighthouseQuorumRequest.FromString(twice), LIMIT, twice)
    assert merged.step == 2 and merged.raw == pb.LighthouseQuorumRequest.FromString(twice).requester.SerializeToString()
