"""The replicated state machine and its msgpack schema: determinism, compare-and-set, snapshots."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lighthouse_cluster import codec
from lighthouse_cluster.codec import CommitQuorum, EnableSchema, SchemaError, TermStart, UnknownCommand
from lighthouse_cluster.quorum import Member, Quorum
from lighthouse_cluster.state_machine import CommitResult, QuorumStateMachine


def q(qid: int, *ids: str, step: int = 0) -> Quorum:
    return Quorum(quorum_id=qid, participants=tuple(Member(replica_id=i, step=step, address=f"a/{i}") for i in ids),
                  created_ms=1_700_000_000_000 + qid)


def commit(expected: int, quorum: Quorum, term: int = 1) -> CommitQuorum:
    return CommitQuorum(expected_quorum_id=expected, quorum=quorum, term=term, node_id="n1")


def test_commit_is_compare_and_set_on_the_previous_id() -> None:
    sm = QuorumStateMachine()
    assert sm.apply(commit(0, q(1, "a", "b"))) == CommitResult(applied=True, current_quorum_id=1)
    # A second leader that computed from the same stale view is rejected, whatever it proposes.
    assert sm.apply(commit(0, q(1, "a"))) == CommitResult(applied=False, current_quorum_id=1)
    assert sm.apply(commit(0, q(2, "c"))) == CommitResult(applied=False, current_quorum_id=1)
    assert sm.quorum == q(1, "a", "b")
    assert sm.apply(commit(1, q(2, "a", "b", "c"))).applied
    assert [h.quorum_id for h in sm.history] == [1, 2]
    assert sm.rejected_commits == 2


def test_same_id_with_other_members_is_rejected() -> None:
    sm = QuorumStateMachine()
    sm.apply(commit(0, q(1, "a", "b")))
    # Same id, same members, newer steps: allowed (torchft re-issues an id when nothing changed).
    assert sm.apply(commit(1, q(1, "a", "b", step=5))).applied
    # Same id with different members would be two member sets under one id.
    assert not sm.apply(commit(1, q(1, "a"))).applied
    assert sm.quorum == q(1, "a", "b", step=5)


def test_ids_never_go_backwards() -> None:
    sm = QuorumStateMachine()
    sm.apply(commit(0, q(5, "a")))
    assert not sm.apply(commit(5, q(4, "a"))).applied
    assert sm.quorum_id == 5


def test_term_start_and_schema_enable() -> None:
    sm = QuorumStateMachine()
    assert sm.apply(TermStart(term=3, node_id="n2", time_ms=10)) == 3
    sm.apply(TermStart(term=2, node_id="n1", time_ms=20))  # an older term never wins
    assert (sm.leader_term, sm.leader_id, sm.leader_since_ms) == (3, "n2", 10)
    assert sm.apply(EnableSchema(version=codec.SCHEMA_VERSION + 5)) == sm.schema_version == 1
    assert sm.apply(UnknownCommand(kind="from-the-future")) is None


def test_snapshot_round_trip_preserves_state() -> None:
    sm = QuorumStateMachine()
    sm.apply(TermStart(term=1, node_id="n1", time_ms=5))
    sm.apply(commit(0, q(1, "a", "b")))
    sm.apply(commit(1, q(2, "b", "c")))
    sm.apply(commit(0, q(9, "x")))  # rejected, counted
    restored = QuorumStateMachine()
    restored.restore_snapshot(sm.to_snapshot())
    assert restored.quorum == sm.quorum
    assert list(restored.history) == list(sm.history)
    assert (restored.leader_term, restored.leader_id) == (1, "n1")
    assert restored.rejected_commits == 1
    assert restored.to_snapshot() == sm.to_snapshot()


def test_snapshot_is_msgpack_not_pickle() -> None:
    sm = QuorumStateMachine()
    sm.apply(commit(0, q(1, "a")))
    obj = msgpack.unpackb(sm.to_snapshot())
    assert obj["v"] == sm.schema_version  # the version the cluster has enabled
    assert obj["quorum"]["id"] == 1


def test_reader_ignores_unknown_keys_and_unknown_kinds() -> None:
    """Rolling upgrades: a newer writer may add keys and kinds; this version still applies."""
    raw = msgpack.packb({"v": 2, "k": "commit_quorum", "expect": 0, "term": 1, "node": "n9", "new_field": [1, 2],
                         "q": {"id": 1, "p": [{"r": "a", "st": 3, "future": True}], "c": 7}})
    cmd = codec.decode_command(raw)
    assert isinstance(cmd, CommitQuorum)
    assert cmd.quorum.participants[0] == Member(replica_id="a", step=3)
    assert codec.decode_command(msgpack.packb({"v": 2, "k": "rebalance"})) == UnknownCommand(kind="rebalance")


@pytest.mark.parametrize("raw, message", [
    (b"\xc1", "not valid msgpack"),
    (msgpack.packb([1, 2]), "no schema version"),
    (msgpack.packb({"v": 0, "k": "term_start"}), "unreadable schema version"),
    (msgpack.packb({"v": 1, "k": "term_start"}), "malformed term_start"),
])
def test_bad_bytes_are_schema_errors(raw: bytes, message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        codec.decode_command(raw)


members = st.builds(Member, replica_id=st.text(min_size=1, max_size=8), address=st.text(max_size=8),
                    store_address=st.text(max_size=8), step=st.integers(0, 2**62), world_size=st.integers(0, 2**62),
                    shrink_only=st.booleans(), data=st.text(max_size=20), commit_failures=st.integers(0, 100))
quorums = st.builds(Quorum, quorum_id=st.integers(1, 2**62), participants=st.lists(members, max_size=6).map(tuple),
                    created_ms=st.integers(0, 2**50))


@settings(max_examples=200, deadline=None)
@given(quorums, st.integers(0, 2**62), st.integers(0, 2**31))
def test_commands_round_trip(quorum: Quorum, expected: int, term: int) -> None:
    cmd = CommitQuorum(expected_quorum_id=expected, quorum=quorum, term=term, node_id="n1")
    assert codec.decode_command(codec.encode_command(cmd)) == cmd


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), quorums), max_size=12))
def test_apply_is_deterministic_and_ids_monotonic(ops: list[tuple[int, Quorum]]) -> None:
    """Two replicas fed the same log end in byte-identical states; the id never decreases."""
    a, b = QuorumStateMachine(), QuorumStateMachine()
    last = 0
    for expected, quorum in ops:
        payload = codec.encode_command(commit(expected, quorum))
        ra, rb = a.apply_bytes(payload), b.apply_bytes(payload)
        assert ra == rb
        assert a.quorum_id >= last
        last = a.quorum_id
    assert a.to_snapshot() == b.to_snapshot()
    ids = [h.quorum_id for h in a.history]
    assert ids == sorted(ids)


def test_member_table_is_a_compare_and_set_and_survives_snapshots() -> None:
    sm = QuorumStateMachine()
    members = (("n1", "h:1", "h:2"), ("n4", "h:7", "h:8"))
    assert sm.apply(EnableSchema(version=codec.MEMBERS_SCHEMA_VERSION)) == 2
    raw = codec.encode_command(codec.SetMembers(expected_version=0, members=members), version=sm.schema_version)
    assert sm.apply_bytes(raw).applied and sm.members == members and sm.members_version == 1
    assert not sm.apply(codec.SetMembers(expected_version=0, members=())).applied  # stale: rejected
    restored = QuorumStateMachine()
    restored.restore_snapshot(sm.to_snapshot())
    assert (restored.members, restored.members_version) == (members, 1)
    with pytest.raises(ValueError, match="needs schema 2"):
        codec.encode_command(codec.SetMembers(expected_version=0, members=()), version=1)
