"""compute_quorum_results: torchft's cases (src/manager.rs tests) as a table, plus properties.

Each quorum is written as ``"id@step"`` (``"id@step/cf"`` with commit_failures) per participant;
each case names the asking replica, its group rank, init_sync, and the fields it expects.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftclient.quorum_results import PeerInfo, QuorumView, ReplicaNotInQuorum, compute_quorum_results


def quorum(*members: str, quorum_id: int = 1) -> QuorumView:
    """``quorum("replica_0@0", "replica_1@3/2")``: address ``addr_<n>``, store ``store_addr_<n>``
    where ``<n>`` is the id's suffix after the last underscore."""
    out = []
    for spec in members:
        rid, _, rest = spec.partition("@")
        step, _, cf = rest.partition("/")
        n = rid.rsplit("_", 1)[-1]
        out.append(PeerInfo(replica_id=rid, address=f"addr_{n}", store_address=f"store_addr_{n}",
                            step=int(step), commit_failures=int(cf or 0)))
    return QuorumView(quorum_id=quorum_id, participants=tuple(out))


FIRST_STEP = quorum("replica_0@0", "replica_1@0")
RECOVERY = quorum("replica_0@0", "replica_1@1", "replica_2@0", "replica_3@1", "replica_4@0")
BEHIND_ONE = quorum("replica_0@1", "replica_1@0")

# (case, quorum, replica_id, group_rank, init_sync, expected fields)
CASES: list[tuple[str, QuorumView, str, int, bool, dict[str, Any]]] = [
    # torchft test_get_quorum: one replica group, commit_failures passed through.
    ("single replica group", quorum("rep_id@123/3"), "rep_id", 0, True,
     dict(quorum_id=1, recover_src_manager_address="", store_address="store_addr_id", max_step=123,
          max_replica_rank=0, max_world_size=1, replica_rank=0, replica_world_size=1, heal=False,
          commit_failures=3, recover_src_replica_rank=None, recover_dst_replica_ranks=[])),
    # torchft test_compute_quorum_results_first_step / test_get_quorum_heal_first_step.
    ("first step: the primary serves the other", FIRST_STEP, "replica_0", 0, True,
     dict(heal=False, replica_rank=0, recover_src_replica_rank=None, recover_dst_replica_ranks=[1],
          max_step=0, replica_world_size=2, max_world_size=2, store_address="store_addr_0")),
    ("first step: the non-primary heals", FIRST_STEP, "replica_1", 0, True,
     dict(heal=True, replica_rank=1, recover_src_replica_rank=0, recover_dst_replica_ranks=[],
          recover_src_manager_address="addr_0", max_replica_rank=1)),
    ("first step, group rank 1: primary and recovery flip", FIRST_STEP, "replica_1", 1, True,
     dict(heal=False, replica_rank=1, recover_src_replica_rank=None, recover_dst_replica_ranks=[0],
          store_address="store_addr_1")),
    ("first step, group rank 1: replica_0 heals from replica_1", FIRST_STEP, "replica_0", 1, True,
     dict(heal=True, recover_src_replica_rank=1, recover_src_manager_address="addr_1")),
    # torchft test_compute_quorum_results_recovery: 2 up to date (1, 3), 3 behind (0, 2, 4).
    ("recovery: behind heals from the first up-to-date", RECOVERY, "replica_0", 0, True,
     dict(heal=True, recover_src_manager_address="addr_1", replica_rank=0, recover_src_replica_rank=1,
          recover_dst_replica_ranks=[], max_step=1, max_replica_rank=None, max_world_size=2,
          replica_world_size=5, store_address="store_addr_1")),
    ("recovery: replica_1 serves 0 and 4", RECOVERY, "replica_1", 0, True,
     dict(heal=False, recover_src_manager_address="", replica_rank=1, recover_src_replica_rank=None,
          recover_dst_replica_ranks=[0, 4], max_replica_rank=0)),
    ("recovery: replica_3 serves 2", RECOVERY, "replica_3", 0, True,
     dict(heal=False, replica_rank=3, recover_src_replica_rank=None, recover_dst_replica_ranks=[2],
          max_replica_rank=1)),
    ("recovery, group rank 1: assignments rotate", RECOVERY, "replica_1", 1, True,
     dict(heal=False, replica_rank=1, recover_src_replica_rank=None, recover_dst_replica_ranks=[2],
          store_address="store_addr_3")),
    ("recovery, group rank 1: replica_0 heals from replica_3", RECOVERY, "replica_0", 1, True,
     dict(heal=True, recover_src_replica_rank=3, recover_src_manager_address="addr_3")),
    # torchft test_compute_quorum_results_skip_init_sync.
    ("init_sync on step 0: primary does not heal", FIRST_STEP, "replica_0", 0, True, dict(heal=False)),
    ("init_sync on step 0: non-primary heals", FIRST_STEP, "replica_1", 0, True, dict(heal=True)),
    ("no init_sync on step 0: nobody heals", FIRST_STEP, "replica_1", 0, False,
     dict(heal=False, recover_src_replica_rank=None, recover_dst_replica_ranks=[])),
    ("no init_sync, primary side: nobody to serve", FIRST_STEP, "replica_0", 0, False,
     dict(heal=False, recover_dst_replica_ranks=[])),
    ("no init_sync but behind: heals", BEHIND_ONE, "replica_1", 0, False,
     dict(heal=True, recover_src_replica_rank=0, max_step=1, max_replica_rank=None, max_world_size=1)),
    ("no init_sync but behind: the other serves", BEHIND_ONE, "replica_0", 0, False,
     dict(heal=False, recover_dst_replica_ranks=[1], max_replica_rank=0)),
    ("after step 0 init_sync changes nothing", BEHIND_ONE, "replica_0", 1, True,
     dict(heal=False, recover_dst_replica_ranks=[1], store_address="store_addr_0")),
    # torchft test_compute_quorum_results_commit_failures.
    ("commit_failures: the maximum over participants", quorum("replica_0@0", "replica_1@0/2"), "replica_0", 0,
     True, dict(commit_failures=2)),
    # The 0.2.0 wheel's replica_ids; participants arrive in any order.
    ("replica_ids sorted, ranks by sorted order", quorum("replica_b@4", "replica_a@4", quorum_id=9), "replica_b",
     0, True, dict(quorum_id=9, replica_ids=["replica_a", "replica_b"], replica_rank=1, max_replica_rank=1,
                   store_address="store_addr_a")),
]


@pytest.mark.parametrize("case,q,replica_id,group_rank,init_sync,expected", CASES, ids=[c[0] for c in CASES])
def test_torchft_cases(case: str, q: QuorumView, replica_id: str, group_rank: int, init_sync: bool,
                       expected: dict[str, Any]) -> None:
    result = compute_quorum_results(replica_id, group_rank, q, init_sync)
    got = {field: getattr(result, field) for field in expected}
    assert got == expected, case


def test_absent_replica_is_not_found() -> None:
    with pytest.raises(ReplicaNotInQuorum, match="replica_9 not participating"):
        compute_quorum_results("replica_9", 0, FIRST_STEP)
    with pytest.raises(ReplicaNotInQuorum):
        compute_quorum_results("replica_0", 0, QuorumView(quorum_id=1, participants=()))


def test_accepts_protobuf_quorums() -> None:
    from lighthouse_cluster.proto import torchft_pb2 as pb

    q = pb.Quorum(quorum_id=4, participants=[
        pb.QuorumMember(replica_id="b", address="ab", store_address="sb", step=2),
        pb.QuorumMember(replica_id="a", address="aa", store_address="sa", step=1, commit_failures=1)])
    result = compute_quorum_results("a", 0, q)
    assert (result.heal, result.recover_src_manager_address, result.commit_failures, result.replica_ids) == \
        (True, "ab", 1, ["a", "b"])


def test_negative_group_rank_is_rejected() -> None:
    with pytest.raises(ValueError, match="group_rank"):
        compute_quorum_results("replica_0", -1, FIRST_STEP)


# -- properties --------------------------------------------------------------------------------

@st.composite
def quorums(draw: st.DrawFn) -> tuple[QuorumView, int, bool]:
    ids = draw(st.lists(st.text("abcdefgh", min_size=1, max_size=3), min_size=1, max_size=8, unique=True))
    members = tuple(PeerInfo(replica_id=rid, address=f"addr-{rid}", store_address=f"store-{rid}",
                             step=draw(st.integers(0, 3)), commit_failures=draw(st.integers(0, 3)))
                    for rid in ids)
    q = QuorumView(quorum_id=draw(st.integers(0, 100)), participants=members)
    return q, draw(st.integers(0, 9)), draw(st.booleans())


@settings(max_examples=300, deadline=None)
@given(quorums())
def test_properties(case: tuple[QuorumView, int, bool]) -> None:
    q, group_rank, init_sync = case
    by_id = {m.replica_id: m for m in q.participants}
    ids = sorted(by_id)
    max_step = max(m.step for m in q.participants)
    results = {rid: compute_quorum_results(rid, group_rank, q, init_sync) for rid in ids}

    for rid, r in results.items():
        # replica_rank is the index in the sorted ids; the sorted ids are reported.
        assert r.replica_rank == ids.index(rid)
        assert r.replica_ids == ids and r.replica_world_size == len(ids)
        assert r.max_step == max_step
        assert r.commit_failures == max(m.commit_failures for m in q.participants)
        at_max = [i for i in ids if by_id[i].step == max_step]
        assert r.max_world_size == len(at_max)
        assert r.max_replica_rank == (at_max.index(rid) if rid in at_max else None)
        # Every rank that is behind heals, from a rank at the max step (never from itself).
        if by_id[rid].step != max_step:
            assert r.heal
        if r.heal:
            assert r.recover_src_replica_rank is not None and r.recover_src_replica_rank != r.replica_rank
            src = ids[r.recover_src_replica_rank]
            assert by_id[src].step == max_step and not results[src].heal
            assert r.recover_src_manager_address == by_id[src].address
            assert r.replica_rank in results[src].recover_dst_replica_ranks
        else:
            assert r.recover_src_replica_rank is None and r.recover_src_manager_address == ""
        # init_sync on step 0: exactly the primary is up to date.
        if init_sync and max_step == 0:
            assert r.heal == (by_id[rid].store_address != r.store_address)

    # Every group rank agrees on the primary store (the process group rendezvous there), and
    # the primary is at the max step.
    stores = {r.store_address for r in results.values()}
    assert len(stores) == 1 and by_id[stores.pop().removeprefix("store-")].step == max_step

    # Sources and destinations agree, and recovery load is balanced over the up-to-date ranks.
    healing = {r.replica_rank for r in results.values() if r.heal}
    served = [d for r in results.values() for d in r.recover_dst_replica_ranks]
    assert sorted(served) == sorted(healing)
    loads = [len(r.recover_dst_replica_ranks) for r in results.values() if not r.heal]
    assert max(loads) - min(loads) <= 1
