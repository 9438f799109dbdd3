"""Jobs in the replicated state (schema 4): the codec's job commands and their version rules, the
state machine's job table (compare-and-set, limits, per-job quorums, fencing, ids that go on across
a removal), snapshots with several jobs, and the upgrade rules: a snapshot and a log written
before jobs (schema 3, ``support/schema3_log.py``) give the very state the old code reached."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from support import schema3_log
from lighthouse_cluster.core import codec, jobs
from lighthouse_cluster.core.codec import (
    CommitQuorum,
    EnableSchema,
    PutJob,
    RemoveJob,
    SchemaError,
    TermStart,
)
from lighthouse_cluster.core.jobs import ALL_NODES, DEFAULT_JOB, JobSettings, JobSpec
from lighthouse_cluster.core.quorum import Member, Quorum, QuorumOptions
from lighthouse_cluster.core.state_machine import CommitResult, JobResult, QuorumStateMachine

V = codec.SCHEMA_VERSION


def q(qid: int, *ids: str, step: int = 0) -> Quorum:
    return Quorum(quorum_id=qid, participants=tuple(Member(replica_id=i, step=step) for i in ids),
                  created_ms=1_700_000_000_000 + qid)


def job(name: str, **settings) -> JobSpec:
    return JobSpec(name, settings=JobSettings(**settings))


def commit(expected: int, quorum: Quorum, job_name: str = DEFAULT_JOB, term: int = 1, node: str = "n1") -> CommitQuorum:
    return CommitQuorum(expected_quorum_id=expected, quorum=quorum, term=term, node_id=node, job=job_name)


def apply(sm: QuorumStateMachine, *commands: codec.Command, version: int = V) -> list:
    """Through the bytes, as Raft delivers them."""
    return [sm.apply_bytes(codec.encode_command(c, version=version)) for c in commands]


def machine_with(*names: str) -> QuorumStateMachine:
    sm = QuorumStateMachine()
    apply(sm, TermStart(1, "n1", 0), *(PutJob(job(n), 0) for n in names))
    return sm


# -- codec -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cmd", [
    PutJob(job("train", min_replicas=2, quorum_lease_ms=0), 0),
    PutJob(JobSpec("train", settings=JobSettings(), ports=((ALL_NODES, 29600), ("n2", 29602)),
                   config=(("lr", "0.1"), ("opt", "adam=1"))), 7),
    PutJob(JobSpec(DEFAULT_JOB, config=(("k", "v"),)), 1),
    RemoveJob("train", 3),
    commit(4, q(5, "a", "b"), job_name="train", term=9, node="n2"),
    commit(4, q(5, "a", "b")),
])
def test_job_commands_round_trip_at_schema_4(cmd: codec.Command) -> None:
    raw = codec.encode_command(cmd, version=codec.JOBS_SCHEMA_VERSION)
    assert codec.decode_versioned(raw) == (cmd, codec.JOBS_SCHEMA_VERSION)


@pytest.mark.parametrize("cmd, what", [
    (PutJob(job("train"), 0), "put_job"),
    (RemoveJob("train", 1), "remove_job"),
    (commit(0, q(1, "a"), job_name="train"), "a commit for job 'train'"),
])
@pytest.mark.parametrize("version", [1, 2, 3])
def test_job_commands_are_never_encoded_below_schema_4(cmd: codec.Command, what: str, version: int) -> None:
    """An older node would apply a job's commit to its only quorum (it ignores ``j``)."""
    with pytest.raises(ValueError, match=f"{what} needs schema 4; the cluster has {version} enabled"):
        codec.encode_command(cmd, version=version)


def test_a_default_job_commit_at_schema_3_has_no_job_key_and_reads_as_the_default_job() -> None:
    raw = codec.encode_command(commit(0, q(1, "a")), version=3)
    assert "j" not in msgpack.unpackb(raw)
    assert codec.decode_versioned(raw) == (commit(0, q(1, "a")), 3)
    # At schema 4 too: the default job is the absence of "j" in every version.
    assert "j" not in msgpack.unpackb(codec.encode_command(commit(0, q(1, "a")), version=4))


def test_a_version_3_commit_without_a_job_key_applies_to_the_default_job() -> None:
    old = msgpack.packb({"v": 3, "k": "commit_quorum", "expect": 0, "term": 1, "node": "n1",
                         "q": {"id": 1, "p": [{"r": "a"}], "c": 7}})
    cmd = codec.decode_command(old)
    assert isinstance(cmd, CommitQuorum) and cmd.job == DEFAULT_JOB
    sm = machine_with("train")
    assert sm.apply_bytes(old).applied
    assert sm.quorum_id == 1 and sm.job("train").quorum is None


def test_a_job_spec_with_keys_this_version_does_not_know_still_decodes() -> None:
    raw = msgpack.packb({"v": V + 1, "k": "put_job", "expect": 0, "future": True,
                         "spec": {"n": "train", "s": {"min": 3, "new_setting": 1}, "c": [["a", "1"]],
                                  "p": [["*", 29600]], "labels": {"team": "x"}}})
    cmd = codec.decode_command(raw)
    assert cmd == PutJob(JobSpec("train", settings=JobSettings(min_replicas=3), ports=((ALL_NODES, 29600),),
                                 config=(("a", "1"),)), 0)


# -- the job table ----------------------------------------------------------------------------------------


def test_put_job_creates_then_replaces_by_compare_and_set_on_the_version() -> None:
    sm = machine_with()
    created, twice = apply(sm, PutJob(job("train"), 0), PutJob(job("train", min_replicas=2), 0))
    assert created == JobResult(applied=True, version=1)
    assert twice == JobResult(applied=False, version=1, reason="job 'train' is at version 1, not 0")
    assert sm.job("train").spec == job("train") and sm.jobs_version == 1
    stale, updated = apply(sm, PutJob(job("train", min_replicas=2), 5), PutJob(job("train", min_replicas=2), 1))
    assert stale == JobResult(applied=False, version=1, reason="job 'train' is at version 1, not 5")
    assert updated == JobResult(applied=True, version=2)
    assert sm.job("train").spec.settings.min_replicas == 2 and sm.jobs_version == 2
    # Creating with a version other than 0 is refused too.
    assert apply(sm, PutJob(job("other"), 1)) == [JobResult(False, 0, "job 'other' is at version 0, not 1")]
    assert sm.job("other") is None and sm.jobs_version == 2


def test_an_invalid_spec_is_refused_deterministically_not_raised() -> None:
    """A writer checks a spec before it writes it; the state machine checks again, and a bad one
    is a no-op with the reason on every node."""
    sm = machine_with()
    bad = JobSpec("train", settings=JobSettings(min_replicas=0))
    (result,) = apply(sm, PutJob(bad, 0))
    assert result == JobResult(False, 0, "min_replicas must be between 1 and 65536, got 0")
    (result,) = apply(sm, PutJob(JobSpec(DEFAULT_JOB, settings=JobSettings()), 0))
    assert not result.applied and "nodes' flags" in result.reason
    assert list(sm.jobs) == [DEFAULT_JOB] and sm.jobs_version == 0


def test_the_default_jobs_config_can_be_set_but_the_job_never_removed() -> None:
    sm = machine_with()
    assert apply(sm, PutJob(JobSpec(DEFAULT_JOB, config=(("lr", "0.1"),)), 0)) == [JobResult(True, 1)]
    assert sm.default_job.spec.config_map == {"lr": "0.1"}
    (refused,) = apply(sm, RemoveJob(DEFAULT_JOB, 1))
    assert refused == JobResult(False, 1, "the default job cannot be removed")
    assert DEFAULT_JOB in sm.jobs


def test_remove_job_is_a_compare_and_set_and_keeps_the_last_id() -> None:
    sm = machine_with("train")
    apply(sm, commit(0, q(1, "a"), "train"), commit(1, q(2, "a", "b"), "train"))
    missing, stale = apply(sm, RemoveJob("nope", 0), RemoveJob("train", 2))
    assert missing == JobResult(False, 0, "no job 'nope'")
    assert stale == JobResult(False, 1, "job 'train' is at version 1, not 2")
    assert apply(sm, RemoveJob("train", 1)) == [JobResult(True, 0)]
    assert sm.job("train") is None and sm.retired == {"train": 2} and sm.jobs_version == 2


def test_at_most_max_jobs_jobs_the_default_one_included() -> None:
    sm = machine_with(*(f"j{i}" for i in range(jobs.MAX_JOBS - 1)))
    assert len(sm.jobs) == jobs.MAX_JOBS
    (refused,) = apply(sm, PutJob(job("one-more"), 0))
    assert refused == JobResult(False, 0, f"the cluster has {jobs.MAX_JOBS} jobs, its limit")
    # An existing job can still be changed, and a removal makes room.
    assert apply(sm, PutJob(job("j0", min_replicas=2), 1))[0].applied
    assert apply(sm, RemoveJob("j1", 1), PutJob(job("one-more"), 0))[1].applied


# -- quorums per job ---------------------------------------------------------------------------------------


def test_the_quorums_of_two_jobs_are_independent() -> None:
    sm = machine_with("a", "b")
    results = apply(sm, commit(0, q(1, "a1", "a2"), "a"), commit(0, q(1, "b1"), "b"),
                    commit(1, q(2, "a1"), "a"), commit(0, q(1, "b9"), "b"),   # b's compare-and-set: stale
                    commit(1, q(1, "b2"), "b"),                               # b's id 1 has other members
                    commit(0, q(1, "d1"), DEFAULT_JOB))
    assert [r.applied for r in results] == [True, True, True, False, False, True]
    assert results[3].reason == "stale: computed from quorum id 0, the current one is 1"
    assert results[4].reason == "quorum id 1 already has other members"
    assert (sm.job("a").quorum_id, sm.job("b").quorum_id, sm.quorum_id) == (2, 1, 1)
    assert [(h.quorum_id, h.replica_ids) for h in sm.job("a").history] == [(1, ("a1", "a2")), (2, ("a1",))]
    assert [(h.quorum_id, h.replica_ids) for h in sm.job("b").history] == [(1, ("b1",))]
    assert [(h.quorum_id, h.replica_ids) for h in sm.history] == [(1, ("d1",))]
    assert sm.rejected_commits == 2


def test_fencing_applies_to_a_jobs_commit() -> None:
    sm = machine_with("a")
    apply(sm, commit(0, q(1, "x"), "a", term=1), TermStart(2, "n2", 5))
    (fenced,) = apply(sm, commit(1, q(2, "x", "y"), "a", term=1))
    assert fenced == CommitResult(applied=False, current_quorum_id=1, fenced=True,
                                  reason="fenced: written by n1 in term 1, the leader term is 2 (n2)")
    assert sm.job("a").quorum_id == 1
    assert apply(sm, commit(1, q(2, "x", "y"), "a", term=2, node="n2"))[0].applied


def test_a_commit_for_an_unknown_job_is_rejected_alike_on_every_node() -> None:
    a, b = machine_with("x"), machine_with("x")
    ra, rb = apply(a, commit(0, q(1, "r"), "ghost")), apply(b, commit(0, q(1, "r"), "ghost"))
    assert ra == rb == [CommitResult(applied=False, current_quorum_id=0, reason="no job 'ghost'")]
    assert a.to_snapshot() == b.to_snapshot() and a.rejected_commits == 1
    assert a.job("ghost") is None and a.job("x").quorum is None and a.quorum is None
    # So is one for a job removed after it was written.
    apply(a, RemoveJob("x", 1))
    assert not apply(a, commit(0, q(1, "r"), "x"))[0].applied


def test_a_job_created_again_goes_on_above_its_last_id() -> None:
    sm = machine_with("train")
    apply(sm, commit(0, q(1, "a"), "train"), commit(1, q(7, "a", "b"), "train"), RemoveJob("train", 1),
          PutJob(job("train"), 0))
    js = sm.job("train")
    assert (js.quorum, js.id_floor, js.quorum_id, js.version, list(js.history)) == (None, 7, 7, 1, [])
    assert sm.retired == {}
    # From below the floor: refused; the next id above it: applied.
    back, fresh = apply(sm, commit(0, q(1, "z"), "train"), commit(7, q(8, "z"), "train"))
    assert back.reason == "stale: computed from quorum id 0, the current one is 7"
    assert fresh.applied and sm.job("train").quorum_id == 8


def test_removed_jobs_kept_by_name_are_bounded_and_ids_still_never_go_back() -> None:
    """A platform creating a job per run removes thousands: the state keeps the last
    ``max_retired`` names; an evicted one's id raises the floor every new job starts above."""
    sm = QuorumStateMachine(max_retired=2)
    apply(sm, TermStart(1, "n1", 0))
    for i, name in enumerate(["r1", "r2", "r3", "r4"]):
        apply(sm, PutJob(job(name), 0))
        apply(sm, commit(sm.job(name).quorum_id, q(10 * (i + 1), "a"), name), RemoveJob(name, 1))
    assert sm.retired == {"r3": 30, "r4": 40} and sm.retired_floor == 20
    apply(sm, PutJob(job("r1"), 0), PutJob(job("fresh"), 0), PutJob(job("r3"), 0))
    # r1 was evicted: it starts above the floor (20 >= its 10); so does a name never seen.
    assert (sm.job("r1").quorum_id, sm.job("fresh").quorum_id, sm.job("r3").quorum_id) == (20, 20, 30)
    (back,) = apply(sm, commit(20, q(20, "z"), "r1"))
    assert not back.applied
    restored = QuorumStateMachine(max_retired=2)
    restored.restore_snapshot(sm.to_snapshot())
    assert (restored.retired, restored.retired_floor) == ({"r4": 40}, 20)
    assert restored.to_snapshot() == sm.to_snapshot()


@pytest.mark.parametrize("members", [("a", "b"), ("z",)])
def test_a_job_created_again_never_commits_its_last_id_again(members: tuple[str, ...]) -> None:
    """Quorum id 7 belonged to the job before its removal. A commit computed from the old job's
    state (a lease round's record, or a commit in flight across the removal) carries id 7 and
    the compare-and-set 7: it must not give the new job id 7 a second time, with the old
    members or others."""
    sm = machine_with("train")
    apply(sm, commit(0, q(7, "a", "b"), "train"), RemoveJob("train", 1), PutJob(job("train"), 0))
    (again,) = apply(sm, commit(7, q(7, *members), "train"))
    assert not again.applied and again.reason == "quorum id 7 was the job's before it was removed and created again"
    assert sm.job("train").quorum is None and sm.job("train").quorum_id == 7


@pytest.mark.parametrize("name", [DEFAULT_JOB, "train"])
def test_quorum_id_0_is_never_committed(name: str) -> None:
    """Ids start at 1 (torchft's first quorum; no writer computes 0). Accepted, a quorum id 0 was
    "no quorum yet" to a job removed and created again, which then took 0 with other members."""
    sm = machine_with("train")
    (zero,) = apply(sm, commit(0, q(0, "a"), name))
    assert not zero.applied and zero.reason == "quorum id 0: quorum ids start at 1"
    assert sm.job(name).quorum is None
    (first,) = apply(sm, commit(0, q(1, "a"), name))
    assert first.applied and sm.job(name).quorum_id == 1


def test_the_coordinator_of_a_job_created_again_issues_floor_plus_one() -> None:
    from lighthouse_cluster.server.coordinator import QuorumCoordinator

    async def main() -> None:
        sm = machine_with("train")
        apply(sm, commit(0, q(4, "a"), "train"), RemoveJob("train", 1), PutJob(job("train"), 0))

        async def submit(command: codec.Command, **_):
            await asyncio.sleep(0)
            return sm.apply_bytes(codec.encode_command(command, version=sm.schema_version))

        coord = QuorumCoordinator("n1", QuorumOptions(min_replicas=1, join_timeout_ms=60_000,
                                                      heartbeat_timeout_ms=5_000),
                                  quorum_tick_ms=10, state=sm, submit=submit, wall_ms=lambda: 1, job="train")
        coord.start_leading(2)
        await asyncio.wait_for(coord.quorum(Member("x")), 2.0)
        assert sm.job("train").quorum == Quorum(5, (Member("x"),), 1)
        assert sm.quorum is None   # the default job untouched
        coord.stop_leading()
    asyncio.run(main())


# -- snapshots ---------------------------------------------------------------------------------------------


def busy_machine() -> QuorumStateMachine:
    sm = machine_with("a", "b", "gone", "again")
    apply(sm, PutJob(JobSpec("a", settings=JobSettings(min_replicas=2), ports=((ALL_NODES, 29600),),
                             config=(("lr", "0.1"),)), 1),
          PutJob(JobSpec(DEFAULT_JOB, config=(("team", "infra"),)), 0),
          commit(0, q(1, "a1", "a2"), "a"), commit(1, q(2, "a1"), "a"), commit(0, q(3, "b1"), "b"),
          commit(0, q(1, "d1"), DEFAULT_JOB), commit(0, q(9, "g1"), "gone"), RemoveJob("gone", 1),
          commit(0, q(4, "x"), "again"), RemoveJob("again", 1), PutJob(job("again"), 0),
          commit(0, q(1, "late"), "ghost"))
    return sm


def test_a_snapshot_carries_every_job_and_the_retired_ids() -> None:
    sm = busy_machine()
    restored = QuorumStateMachine()
    restored.restore_snapshot(sm.to_snapshot())
    assert restored.to_snapshot() == sm.to_snapshot()
    assert list(restored.jobs) == list(sm.jobs) == [DEFAULT_JOB, "a", "b", "again"]
    for name, js in sm.jobs.items():
        other = restored.job(name)
        assert (other.spec, other.version, other.quorum, list(other.history), other.id_floor) == \
            (js.spec, js.version, js.quorum, list(js.history), js.id_floor), name
    assert restored.retired == {"gone": 9} and restored.jobs_version == sm.jobs_version
    assert restored.job("again").quorum_id == 4 and restored.rejected_commits == sm.rejected_commits
    # The restored machine goes on exactly as the original does.
    more = (commit(4, q(5, "y"), "again"), PutJob(job("gone"), 0), commit(9, q(10, "g"), "gone"))
    assert apply(restored, *more) == apply(sm, *more)
    assert restored.to_snapshot() == sm.to_snapshot() and sm.job("gone").quorum_id == 10


def test_an_older_reader_finds_the_default_job_under_the_keys_it_always_had() -> None:
    obj = msgpack.unpackb(busy_machine().to_snapshot())
    assert obj["quorum"]["id"] == 1 and [h[0] for h in obj["history"]] == [1]
    assert obj["v"] == obj["schema"] == V


def test_a_snapshot_from_before_jobs_restores_to_the_same_state() -> None:
    """Schema 3's snapshot keys only (written by the code before jobs): the default job's quorum
    and history, nothing else; written again it is byte for byte the old snapshot."""
    for golden in (schema3_log.GOLDEN_MID, schema3_log.GOLDEN_FINAL):
        old = bytes.fromhex(golden)
        sm = QuorumStateMachine()
        sm.restore_snapshot(old)
        assert list(sm.jobs) == [DEFAULT_JOB] and sm.retired == {} and sm.jobs_version == 0
        assert sm.schema_version == 3 and sm.to_snapshot() == old
    assert sm.quorum_id == 3 and [h.quorum_id for h in sm.history] == [1, 1, 2, 3]


def test_a_schema_3_log_replays_to_the_state_the_code_before_jobs_reached() -> None:
    log = schema3_log.encode_at_3(schema3_log.commands())
    # This version, writing at 3 (the cluster has 3 enabled), writes exactly what the old one did.
    assert [p.hex() for p in log] == schema3_log.GOLDEN_LOG
    sm = QuorumStateMachine()
    for p in log:
        sm.apply_bytes(p)
    assert sm.to_snapshot() == bytes.fromhex(schema3_log.GOLDEN_FINAL)
    # Restarting from the old snapshot taken half-way and replaying the rest: the same again.
    half = QuorumStateMachine()
    half.restore_snapshot(bytes.fromhex(schema3_log.GOLDEN_MID))
    for p in log[schema3_log.MID_INDEX + 1:]:
        half.apply_bytes(p)
    assert half.to_snapshot() == bytes.fromhex(schema3_log.GOLDEN_FINAL)


def test_after_a_schema_3_log_jobs_wait_for_schema_4() -> None:
    sm = QuorumStateMachine()
    for p in schema3_log.encode_at_3(schema3_log.commands()):
        sm.apply_bytes(p)
    with pytest.raises(ValueError, match="needs schema 4"):
        codec.encode_command(PutJob(job("train"), 0), version=sm.schema_version)
    # A node acting as schema 3 ignores the enable; this version adopts it.
    old_node = QuorumStateMachine(max_schema_version=3)
    old_node.restore_snapshot(sm.to_snapshot())
    assert old_node.apply_bytes(codec.encode_command(EnableSchema(4), version=3)) == 3
    assert sm.apply_bytes(codec.encode_command(EnableSchema(4), version=3)) == 4
    assert apply(sm, TermStart(3, "n1", 0), PutJob(job("train"), 0),
                 commit(0, q(1, "t"), "train", term=3), commit(3, q(4, "a", "c"), term=3)) == [
        apply(QuorumStateMachine(), TermStart(3, "n1", 0))[0], JobResult(True, 1),
        CommitResult(True, 1), CommitResult(True, 4)]


# -- bad bytes ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [
    {"n": "a", "p": [["*", "not-a-port"]]},
    {"n": "a", "c": [["k", "v", "extra"]]},
    {"n": "a", "p": [7]},
    {"s": {}},
])
def test_a_malformed_job_command_is_a_schema_error_not_a_crash(spec) -> None:
    """``ReplicatedState`` skips a SchemaError as a deterministic no-op; any other exception
    would fail pysyncobj's apply on every node at that entry, again at every tick (the whole
    cluster stops applying)."""
    raw = msgpack.packb({"v": V, "k": "put_job", "expect": 0, "spec": spec})
    with pytest.raises(SchemaError, match="malformed put_job command"):
        codec.decode_command(raw)


# -- property: any interleaving over three jobs ------------------------------------------------------------

JOBS = (DEFAULT_JOB, "a", "b")
REPLICAS = {DEFAULT_JOB: ("d1", "d2", "d3"), "a": ("a1", "a2", "a3"), "b": ("b1", "b2", "b3")}

ops = st.one_of(
    st.tuples(st.just("commit"), st.sampled_from(JOBS), st.integers(-1, 2), st.integers(0, 2),
              st.sets(st.integers(0, 2), min_size=1), st.integers(1, 3)),
    st.tuples(st.just("put"), st.sampled_from(JOBS[1:]), st.integers(-1, 1), st.integers(1, 3)),
    st.tuples(st.just("remove"), st.sampled_from(JOBS), st.integers(-1, 1)),
    st.tuples(st.just("term"), st.integers(1, 3), st.sampled_from(["n1", "n2"])),
)


def to_command(sm: QuorumStateMachine, op: tuple) -> codec.Command:
    """An operation drawn against the current state: offsets near the truth (0 = what a correct
    writer would send), so that most commands apply and some are stale."""
    kind = op[0]
    if kind == "commit":
        _, name, expect_off, id_off, picks, term = op
        js = sm.job(name)
        current = js.quorum_id if js is not None else 0
        members = tuple(sorted(REPLICAS[name][i] for i in picks))
        return commit(max(0, current + expect_off), q(current + id_off, *members), name, term=term,
                      node=f"n{term}")
    if kind == "put":
        _, name, version_off, min_replicas = op
        js = sm.job(name)
        version = js.version if js is not None else 0
        return PutJob(job(name, min_replicas=min_replicas), max(0, version + version_off))
    if kind == "remove":
        _, name, version_off = op
        js = sm.job(name)
        return RemoveJob(name, max(0, (js.version if js is not None else 0) + version_off))
    _, term, node = op
    return TermStart(term, node, term)


def last_ids(sm: QuorumStateMachine) -> dict[str, int]:
    """Each job's last quorum id, whether it exists now or was removed (and maybe evicted)."""
    return {name: (sm.job(name).quorum_id if sm.job(name) is not None else sm.retired.get(name, sm.retired_floor))
            for name in JOBS}


@settings(max_examples=200, deadline=None)
@given(st.lists(ops, max_size=40))
# Created, committed, removed, created again, then a commit of the old last id with other members
# (random search rarely draws it; the fix of 'reissued_floor' in the state machine).
@example([("put", "a", 0, 1), ("commit", "a", 0, 1, {0}, 1), ("remove", "a", 0), ("put", "a", 0, 1),
          ("commit", "a", 0, 0, {1}, 1)])
# The same through quorum id 0 (found by CI's random search): id 0 committed, the job removed and
# created again, then id 0 again with other members. Quorum ids now start at 1.
@example([("put", "a", 0, 1), ("commit", DEFAULT_JOB, 0, 0, {0}, 1), ("commit", "a", 0, 0, {0}, 1),
          ("remove", "a", 0), ("put", "a", 0, 1), ("commit", "a", 0, 0, {0, 1}, 1)])
def test_any_interleaving_over_three_jobs_is_deterministic_and_ids_never_go_back(steps: list[tuple]) -> None:
    # One removed job kept by name: evictions happen all the time.
    a, b = QuorumStateMachine(max_retired=1), QuorumStateMachine(max_retired=1)
    payloads: list[bytes] = []
    committed: dict[tuple[str, int], tuple[str, ...]] = {}
    previous = last_ids(a)
    for op in steps:
        payload = codec.encode_command(to_command(a, op))
        payloads.append(payload)
        ra, rb = a.apply_bytes(payload), b.apply_bytes(payload)
        assert ra == rb
        now = last_ids(a)
        for name in JOBS:
            assert now[name] >= previous[name], (name, previous, now)
            js = a.job(name)
            if js is not None and js.quorum is not None:
                members = tuple(m.replica_id for m in js.quorum.participants)
                # never two member sets under one id of a job (removals and re-creations included)
                assert committed.setdefault((name, js.quorum_id), members) == members
                assert set(members) <= set(REPLICAS[name])
        previous = now
    assert a.to_snapshot() == b.to_snapshot()
    for name, js in a.jobs.items():
        ids = [h.quorum_id for h in js.history]
        assert ids == sorted(ids)
    # A third node restored from a snapshot half-way ends in the same state.
    half = len(payloads) // 2
    c = QuorumStateMachine(max_retired=1)
    for p in payloads[:half]:
        c.apply_bytes(p)
    d = QuorumStateMachine(max_retired=1)
    d.restore_snapshot(c.to_snapshot())
    for p in payloads[half:]:
        d.apply_bytes(p)
    assert d.to_snapshot() == a.to_snapshot()


def test_a_deposed_leaders_commit_for_a_removed_job_is_reported_fenced() -> None:
    from lighthouse_cluster.core.codec import CommitQuorum, PutJob, RemoveJob, TermStart
    from lighthouse_cluster.core.jobs import JobSettings, JobSpec
    from lighthouse_cluster.core.quorum import Member, Quorum
    from lighthouse_cluster.core.state_machine import QuorumStateMachine

    m = QuorumStateMachine()
    m.apply(TermStart(term=1, node_id="n1", time_ms=0))
    assert m.apply(PutJob(spec=JobSpec("gone", JobSettings()), expected_version=0)).applied
    m.apply(TermStart(term=2, node_id="n2", time_ms=0))
    assert m.apply(RemoveJob(name="gone", expected_version=1)).applied
    stale = m.apply(CommitQuorum(expected_quorum_id=0, quorum=Quorum(1, (Member("a"),), 0), term=1,
                                 node_id="n1", job="gone"))
    assert not stale.applied and stale.fenced and stale.reason.startswith("fenced: written by n1 in term 1")
    current = m.apply(CommitQuorum(expected_quorum_id=0, quorum=Quorum(1, (Member("a"),), 0), term=2,
                                   node_id="n2", job="gone"))
    assert not current.applied and not current.fenced and current.reason == "no job 'gone'"


def test_settings_that_are_not_a_map_are_a_schema_error() -> None:
    import msgpack
    import pytest

    from lighthouse_cluster.core import codec

    bad = msgpack.packb({"k": "put_job", "expect": 0, "spec": {"n": "x", "s": [1, 2]}, "v": 4})
    with pytest.raises(codec.SchemaError, match="settings are a list, not a map"):
        codec.decode_command(bad)
