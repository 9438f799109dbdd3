"""The replicated state machine and its msgpack schema: determinism, compare-and-set, snapshots."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.waiting import wait_for_async
from lighthouse_cluster.core import codec
from lighthouse_cluster.core.codec import CommitQuorum, EnableSchema, SchemaError, TermStart, UnknownCommand
from lighthouse_cluster.core.quorum import Member, Quorum
from lighthouse_cluster.core.state_machine import CommitResult, QuorumStateMachine, TermStartResult


def q(qid: int, *ids: str, step: int = 0) -> Quorum:
    return Quorum(quorum_id=qid, participants=tuple(Member(replica_id=i, step=step, address=f"a/{i}") for i in ids),
                  created_ms=1_700_000_000_000 + qid)


def commit(expected: int, quorum: Quorum, term: int = 1) -> CommitQuorum:
    return CommitQuorum(expected_quorum_id=expected, quorum=quorum, term=term, node_id="n1")


def test_commit_is_compare_and_set_on_the_previous_id() -> None:
    sm = QuorumStateMachine()
    assert sm.apply(commit(0, q(1, "a", "b"))) == CommitResult(applied=True, current_quorum_id=1)
    # A second leader that computed from the same stale view is rejected, whatever it proposes.
    stale = "stale: computed from quorum id 0, the current one is 1"
    assert sm.apply(commit(0, q(1, "a"))) == CommitResult(applied=False, current_quorum_id=1, reason=stale)
    assert sm.apply(commit(0, q(2, "c"))) == CommitResult(applied=False, current_quorum_id=1, reason=stale)
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
    assert sm.apply(TermStart(term=3, node_id="n2", time_ms=10)) == TermStartResult(True, 3, "n2")
    assert not sm.apply(TermStart(term=2, node_id="n1", time_ms=20)).applied  # an older term never wins
    assert (sm.leader_term, sm.leader_id, sm.leader_since_ms) == (3, "n2", 10)
    # A new state machine is at the newest schema (a new cluster); unknown versions are ignored.
    assert sm.apply(EnableSchema(version=codec.SCHEMA_VERSION + 5)) == sm.schema_version == codec.SCHEMA_VERSION
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
    newer = codec.SCHEMA_VERSION + 1
    raw = msgpack.packb({"v": newer, "k": "commit_quorum", "expect": 0, "term": 1, "node": "n9", "new_field": [1, 2],
                         "q": {"id": 1, "p": [{"r": "a", "st": 3, "future": True}], "c": 7}})
    cmd = codec.decode_command(raw)
    assert isinstance(cmd, CommitQuorum)
    assert cmd.quorum.participants[0] == Member(replica_id="a", step=3)
    assert codec.decode_versioned(raw)[1] == newer
    assert codec.decode_command(msgpack.packb({"v": newer, "k": "rebalance"})) == UnknownCommand(kind="rebalance")


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
    assert sm.apply(EnableSchema(version=codec.MEMBERS_SCHEMA_VERSION)) == codec.SCHEMA_VERSION  # never lowers
    raw = codec.encode_command(codec.SetMembers(expected_version=0, members=members), version=sm.schema_version)
    assert sm.apply_bytes(raw).applied and sm.members == members and sm.members_version == 1
    assert not sm.apply(codec.SetMembers(expected_version=0, members=())).applied  # stale: rejected
    restored = QuorumStateMachine()
    restored.restore_snapshot(sm.to_snapshot())
    assert (restored.members, restored.members_version) == (members, 1)
    with pytest.raises(ValueError, match="needs schema 2"):
        codec.encode_command(codec.SetMembers(expected_version=0, members=()), version=1)


# -- fencing of stale leaders (schema 2; jepsen_like/README.md BUG-2) ------------------------------


def log_of(*commands: codec.Command, version: int = codec.SCHEMA_VERSION) -> list[bytes]:
    return [codec.encode_command(c, version=version) for c in commands]


def replay(payloads: list[bytes], machine: QuorumStateMachine | None = None) -> tuple[QuorumStateMachine, list]:
    sm = machine or QuorumStateMachine()
    return sm, [sm.apply_bytes(p) for p in payloads]


def test_a_second_term_start_for_a_term_is_refused_and_names_the_leader_in_force() -> None:
    """README BUG-2's unit test: TermStart(5, a), TermStart(5, b), CommitQuorum(term 5, b): the
    leader of term 5 stays a. b's commit is from term 5, so it is not fenced by term; its
    compare-and-set is what keeps quorum ids safe, as before."""
    sm, (first, second) = replay(log_of(TermStart(5, "a", 1), TermStart(5, "b", 2)))
    assert first == TermStartResult(applied=True, leader_term=5, leader_id="a")
    assert not second.applied and (second.leader_term, second.leader_id) == (5, "a")
    assert second.reason == "term 5 already started by a: refused for b"
    assert (sm.leader_term, sm.leader_id, sm.leader_since_ms) == (5, "a", 1)
    assert sm.rejected_term_starts == 1
    # The same leader's retry (its first attempt timed out but committed) is an idempotent no-op
    # that still names it: the coordinator serves on it.
    again = sm.apply_bytes(codec.encode_command(TermStart(5, "a", 9)))
    assert not again.applied and (again.leader_term, again.leader_id) == (5, "a") and "repeated" in again.reason
    assert sm.leader_since_ms == 1
    # An older term never wins either.
    old = sm.apply_bytes(codec.encode_command(TermStart(4, "c", 3)))
    assert not old.applied and old.reason.startswith("stale:") and sm.leader_id == "a"


def test_a_deposed_leaders_commit_is_fenced_even_when_its_compare_and_set_holds() -> None:
    """n1 led term 3 and computed quorum 2 from quorum 1; n2 won term 4 and committed its
    TermStart first; n1's CommitQuorum, forwarded by pysyncobj, arrives after it."""
    sm, results = replay(log_of(TermStart(3, "n1", 0), commit(0, q(1, "a"), term=3), TermStart(4, "n2", 5),
                                commit(1, q(2, "a", "b"), term=3)))
    fenced = results[-1]
    assert fenced == CommitResult(applied=False, current_quorum_id=1, fenced=True,
                                  reason="fenced: written by n1 in term 3, the leader term is 4 (n2)")
    assert sm.quorum == q(1, "a") and [h.quorum_id for h in sm.history] == [1]
    # The new leader's commit from the same state applies.
    assert sm.apply_bytes(codec.encode_command(CommitQuorum(1, q(2, "a", "c"), 4, "n2"))).applied
    # A commit from a term *ahead* of the leader term (no TermStart of its own yet) is fenced too.
    assert sm.apply_bytes(codec.encode_command(CommitQuorum(2, q(3, "a"), 5, "n3"))).fenced
    assert sm.quorum_id == 2


def test_before_any_term_start_there_is_nothing_to_fence_against() -> None:
    sm, (result,) = replay(log_of(commit(0, q(1, "a"), term=7)))
    assert result.applied and not result.fenced


def test_a_version_1_journal_replays_by_version_1_rules() -> None:
    """An existing journal (every command written at schema 1) must replay to the very state the
    nodes that wrote it reached: a second TermStart of a term still replaces the leader, and a
    deposed leader's commit whose compare-and-set holds still applies (fencing it would leave
    this node's quorum behind the others' and every later commit rejected)."""
    commands = (TermStart(3, "n1", 0), commit(0, q(1, "a"), term=3), TermStart(4, "n2", 5),
                commit(1, q(2, "a", "b"), term=3), TermStart(4, "n1", 6), commit(2, q(3, "a"), term=4))
    sm, results = replay(log_of(*commands, version=1))
    assert sm.schema_version == 1            # adopted from the log's first entry
    assert [r.applied for r in results] == [True, True, True, True, True, True]
    assert (sm.leader_term, sm.leader_id) == (4, "n1") and sm.quorum == q(3, "a")
    # Writers keep writing version 1 until the cluster enables 2; then fencing applies.
    assert sm.apply_bytes(codec.encode_command(EnableSchema(2), version=sm.schema_version)) == 2
    assert sm.apply_bytes(codec.encode_command(commit(3, q(4, "a"), term=3), version=sm.schema_version)).fenced
    # A node restarting from a snapshot taken before the enable keeps version 1 too.
    restored = QuorumStateMachine()
    restored.restore_snapshot(replay(log_of(*commands, version=1))[0].to_snapshot())
    assert restored.schema_version == 1


def test_a_new_cluster_fences_from_its_first_entry() -> None:
    sm = QuorumStateMachine()
    assert sm.schema_version == codec.SCHEMA_VERSION >= codec.FENCING_SCHEMA_VERSION
    _, results = replay(log_of(TermStart(1, "n1", 0), TermStart(1, "n2", 0), version=sm.schema_version), sm)
    assert sm.schema_version == codec.SCHEMA_VERSION and not results[1].applied


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["ts", "cq"]), st.integers(1, 4), st.sampled_from(["n1", "n2", "n3"]),
                          st.integers(0, 3)), max_size=20),
       st.sampled_from([1, 2]))
def test_fencing_is_deterministic_and_snapshots_keep_it(ops: list[tuple[str, int, str, int]], version: int) -> None:
    """Any log (stale terms, repeated TermStarts, stale commits) applied on two replicas, or on a
    third one restored from a snapshot half-way, ends in byte-identical states."""
    commands: list[codec.Command] = []
    for kind, term, node, expect in ops:
        commands.append(TermStart(term, node, term) if kind == "ts" else
                        CommitQuorum(expect, q(expect + 1, node), term, node))
    payloads = log_of(*commands, version=version)
    a, ra = replay(payloads)
    b, rb = replay(payloads)
    assert ra == rb and a.to_snapshot() == b.to_snapshot()
    half = len(payloads) // 2
    c, _ = replay(payloads[:half])
    d = QuorumStateMachine()
    d.restore_snapshot(c.to_snapshot())
    replay(payloads[half:], d)
    assert d.to_snapshot() == a.to_snapshot()
    assert [x.quorum_id for x in a.history] == sorted(x.quorum_id for x in a.history)


# -- how the leader's coordinator reacts to a refused command: fail the round, never hang -----------


def _coordinator(machine: QuorumStateMachine, node_id: str = "n1"):
    from lighthouse_cluster.server.coordinator import QuorumCoordinator
    from lighthouse_cluster.core.quorum import QuorumOptions

    async def submit(command: codec.Command, while_leader_of: int | None = None):  # once the entry is committed
        await asyncio.sleep(0)
        return machine.apply_bytes(codec.encode_command(command, version=machine.schema_version))

    return QuorumCoordinator(node_id, QuorumOptions(min_replicas=1, join_timeout_ms=60_000, heartbeat_timeout_ms=5_000),
                             quorum_tick_ms=10, state=machine, submit=submit, wall_ms=lambda: 1)


def test_a_leader_whose_term_start_is_refused_never_serves() -> None:
    from lighthouse_cluster.server.coordinator import NotLeader

    async def main() -> None:
        machine = QuorumStateMachine()
        machine.apply_bytes(codec.encode_command(TermStart(5, "n2", 0)))   # n2 started term 5 first
        coord = _coordinator(machine)
        coord.start_leading(5)
        waiting = asyncio.ensure_future(coord.quorum(Member("a")))
        with pytest.raises(NotLeader):
            await asyncio.wait_for(waiting, 2.0)  # failed at once, not at its deadline
        assert not coord.serving and coord.term is None and machine.leader_id == "n2"
    asyncio.run(main())


def test_a_leader_whose_term_start_was_already_committed_serves_on_its_retry() -> None:
    async def main() -> None:
        machine = QuorumStateMachine()
        machine.apply_bytes(codec.encode_command(TermStart(5, "n1", 0)))   # a timed-out attempt that committed
        coord = _coordinator(machine)
        coord.start_leading(5)
        raw = await asyncio.wait_for(coord.quorum(Member("a")), 2.0)
        assert raw and coord.serving
        coord.stop_leading()
    asyncio.run(main())


def test_a_fenced_commit_makes_the_leader_step_down_and_fail_the_round() -> None:
    from lighthouse_cluster.server.coordinator import NotLeader

    async def main() -> None:
        machine = QuorumStateMachine()
        coord = _coordinator(machine)
        coord.start_leading(3)
        await wait_for_async("the coordinator to serve", lambda: coord.serving, 1.0, interval=0.005)
        # n2 wins term 4 and its TermStart is applied before n1's next commit.
        machine.apply_bytes(codec.encode_command(TermStart(4, "n2", 0)))
        with pytest.raises(NotLeader):
            await asyncio.wait_for(coord.quorum(Member("a")), 2.0)
        assert coord.term is None and not coord.serving and machine.quorum is None
        assert machine.rejected_commits == 1   # one refused commit, no retry loop
    asyncio.run(main())
