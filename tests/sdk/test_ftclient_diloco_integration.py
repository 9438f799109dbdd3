"""Semi-synchronous training with real processes: ``examples/train_diloco.py`` (ftclient's DiLoCo /
LocalSGD, Manager, ProcessGroupGloo, HTTP checkpoints) against a real 3-node ``LocalCluster``.

Every replica group is one process of the example with ``TORCHFT_LIGHTHOUSE`` set to the list of all
three nodes. Every test ends with every replica group at the same step holding bitwise-identical
global parameters and outer optimizer state (the example's sha256 digests):

* healthy: three groups (Streaming DiLoCo: 2 fragments, sync delay 1, alpha 0.5, bucketized), and
  two groups with LocalSGD; every round committed by everyone;
* a group is SIGKILLed between synchronisations and restarted: the survivors go on, the new process
  heals the whole DiLoCo state from a peer at the next synchronisation and takes part in it;
* upscale: a third group started mid-run joins at the next synchronisation (healed, 3 participants);
* commit failure: one group reports an error (``manager.report_error``) before one commit: its commit
  fails, the next quorum has a new id, the group catches up from its peer and the job loses no step;
* the Raft leader is SIGKILLed between synchronisations: no round fails, the quorum id stays.

Settings: ``join_timeout_ms=1000``; ``TORCHFT_TIMEOUT_SEC=10`` bounds collectives, commit and
checkpoint transfer, ``TORCHFT_QUORUM_TIMEOUT_SEC=30`` a quorum. The harness is
``support.training.TrainingRun`` with ``support.trainer_process.DilocoExampleTrainer``: every wait
has a deadline; it kills every trainer and node whatever happens, and a failure message carries
the events, the trainers' output tails and the lighthouse logs. Each test prints a one-line
summary (``-s``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch  # noqa: F401 -- the example's trainers need it: without it this fails here, not in each subprocess

from support.trainer_process import DilocoExampleTrainer
from support.training import TrainingRun

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

RUN_S = 90.0  # bound on any one run of trainers, start to exit
# Streaming DiLoCo: 2 fragments, a round is 2 inner steps, averages in flight for 1 of them.
DILOCO = ["--fragments", "2", "--sync-every", "4", "--fragment-sync-delay", "1"]


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[TrainingRun]:
    with TrainingRun(tmp_path, finish_timeout=RUN_S) as run:
        yield run


def trainer(h: TrainingRun, group: int, args: list[str]) -> DilocoExampleTrainer:
    """Start replica group ``group``: one process of the example on every node of the cluster."""
    assert h.cluster is not None
    (t,) = h.start([DilocoExampleTrainer(group=group, lighthouse=h.cluster.endpoints, workdir=h.root, args=args)])
    return t


def summary(name: str, h: TrainingRun, results: list[dict[str, Any]], **extra: Any) -> None:
    durations = [r["duration_s"] for res in results for r in res["rounds"]]
    print(f"\n[{name}] {h.elapsed():.1f}s final_step={results[0]['final_step']} "
          f"eval_loss={results[0]['eval_loss']:.3f} rounds/group={[len(r['rounds']) for r in results]} "
          f"slowest_round={max(durations):.2f}s " + " ".join(f"{k}={v}" for k, v in extra.items()))
    print("  timeline: " + " | ".join(e.strip() for e in h.events))


# -- tests ----------------------------------------------------------------------------------------


def test_healthy_diloco_groups_end_identical(harness: TrainingRun) -> None:
    h = harness
    h.start_cluster(min_replicas=3)
    args = [*DILOCO, "--fragment-update-alpha", "0.5", "--bucket-cap-mb", "0.003", "--rounds", "8"]
    trainers = [trainer(h, g, args) for g in range(3)]
    results = h.wait_finished(trainers)
    h.assert_identical(results)
    for t, r in zip(trainers, results):
        rounds = r["rounds"]
        assert [x["step"] for x in rounds] == list(range(1, 9)), t.name
        assert all(x["committed"] and x["participants"] == 3 for x in rounds), rounds
        assert [x["fragment"] for x in rounds] == [0, 1] * 4
        assert len({x["quorum_id"] for x in rounds}) == 1  # the same members all along: one quorum
    # init_sync: the groups that are not the primary load the primary's state at step 0.
    assert sum(r["rounds"][0]["healed"] for r in results) == 2
    summary("healthy diloco", h, results, quorum_id=results[0]["rounds"][0]["quorum_id"])


def test_healthy_local_sgd_groups_end_identical(harness: TrainingRun) -> None:
    h = harness
    h.start_cluster(min_replicas=2)
    trainers = [trainer(h, g, ["--algorithm", "localsgd", "--sync-every", "3", "--rounds", "6"]) for g in range(2)]
    results = h.wait_finished(trainers)
    h.assert_identical(results)
    for r in results:
        assert all(x["committed"] and x["participants"] == 2 for x in r["rounds"]) and r["final_step"] == 6
    summary("healthy localsgd", h, results)


def test_crashed_group_restarts_and_heals_the_whole_state(harness: TrainingRun) -> None:
    h = harness
    h.start_cluster(min_replicas=2)
    args = [*DILOCO, "--step-sleep", "0.05", "--rounds", "12", "--min-final-participants", "3", "--final-rounds", "4"]
    a, b, c = (trainer(h, g, args) for g in range(3))
    h.wait_until("every group committed 3 rounds with 3 participants",
                 lambda: all(sum(x["committed"] and x["participants"] == 3 for x in t.rounds()) >= 3
                             for t in (a, b, c)), RUN_S)
    c.kill()  # right after its round line: between synchronisations
    killed_at = max(x["step"] for x in c.rounds())
    h.note(f"SIGKILLed {c.name} at step {killed_at}")
    h.wait_until("the survivors committed 2 rounds without it",
                 lambda: all(sum(x["committed"] and x["participants"] == 2 for x in t.rounds()) >= 2 for t in (a, b)),
                 RUN_S)
    c.restart()
    h.note(f"restarted as {c.name}")
    results = h.wait_finished([a, b, c])
    h.assert_identical(results)

    back = results[2]["rounds"]
    first = back[0]
    assert first["healed"] and first["committed"] and first["participants"] == 3, back
    assert first["step"] > killed_at + 2
    # ... and trains on with the others: every round of the new process committed by all three.
    assert len(back) >= 4 and all(x["committed"] and x["participants"] == 3 and not x["healed"] for x in back[1:])
    for r in results[:2]:
        rounds = r["rounds"]
        alone = [x for x in rounds if x["participants"] == 2]
        assert alone and all(x["committed"] for x in alone), rounds
        assert all(x["participants"] == 3 and x["committed"] for x in rounds[-len(back):])
        # From the kill on, every step was committed by both survivors (a failed round is retried).
        # (Before it, a group that started late joined by healing, skipping steps.)
        committed = {x["step"] for x in rounds if x["committed"]}
        assert set(range(killed_at + 1, r["final_step"] + 1)) <= committed, rounds
    lost = sum(not x["committed"] for r in results[:2] for x in r["rounds"])
    summary("crash+restart", h, results, killed_at_step=killed_at, healed_at_step=first["step"],
            failed_rounds_of_survivors=lost)


def test_group_joining_mid_run_is_brought_in_at_the_next_synchronisation(harness: TrainingRun) -> None:
    h = harness
    h.start_cluster(min_replicas=2)
    args = [*DILOCO, "--fragment-update-alpha", "0.25", "--step-sleep", "0.05", "--rounds", "6",
            "--min-final-participants", "3", "--final-rounds", "3"]
    a, b = trainer(h, 0, args), trainer(h, 1, args)
    h.wait_until("two groups committed 3 rounds", lambda: all(len(t.rounds()) >= 3 for t in (a, b)), RUN_S)
    c = trainer(h, 2, args)
    results = h.wait_finished([a, b, c])
    h.assert_identical(results)
    joiner = results[2]["rounds"]
    first = joiner[0]
    assert first["healed"] and first["committed"] and first["participants"] == 3, joiner
    assert len(joiner) >= 3 and all(x["committed"] and x["participants"] == 3 for x in joiner)
    for r in results[:2]:
        rounds = r["rounds"]
        joined = next(i for i, x in enumerate(rounds) if x["participants"] == 3)
        assert rounds[joined]["step"] == first["step"] and rounds[joined]["quorum_id"] == first["quorum_id"]
        assert rounds[joined]["quorum_id"] > rounds[joined - 1]["quorum_id"]  # new members: new quorum
        assert all(x["committed"] for x in rounds), rounds  # nobody lost a round to the join
        assert [x["step"] for x in rounds[joined:]] == [x["step"] for x in joiner]
    summary("upscale", h, results, joined_at_step=first["step"],
            rounds_before_join=sum(x["participants"] == 2 for x in results[0]["rounds"]))


def test_commit_failure_bumps_quorum_id_and_is_retried(harness: TrainingRun) -> None:
    h = harness
    h.start_cluster(min_replicas=2)
    base = [*DILOCO, "--rounds", "8"]
    a = trainer(h, 0, [*base, "--fail-commit-at-step", "3"])
    b = trainer(h, 1, base)
    ra, rb = h.wait_finished([a, b])
    h.assert_identical([ra, rb])
    assert "injecting a commit failure at step=3" in a.output()
    failed = [i for i, x in enumerate(ra["rounds"]) if not x["committed"]]
    assert len(failed) == 1, ra["rounds"]
    bad, nxt = ra["rounds"][failed[0]], ra["rounds"][failed[0] + 1]
    assert bad["step"] == 3 and bad["fragment"] == 1  # step 3 was not committed by this group
    # The failure is reported with the next quorum: a new quorum id, and the group, now one step
    # behind its peer, catches up from it and commits the following step with it.
    assert nxt["quorum_id"] == bad["quorum_id"] + 1 and nxt["healed"] and nxt["committed"], ra["rounds"]
    assert nxt["step"] == 5
    # The peer committed every step; the job lost none.
    assert all(x["committed"] for x in rb["rounds"]) and [x["step"] for x in rb["rounds"]] == list(range(1, 9))
    peer_next = next(x for x in rb["rounds"] if x["step"] == nxt["step"])
    assert peer_next["quorum_id"] == nxt["quorum_id"]
    summary("commit failure", h, [ra, rb], quorum_ids=[bad["quorum_id"], nxt["quorum_id"]])


def test_leader_sigkill_between_synchronisations_costs_no_round(harness: TrainingRun) -> None:
    h = harness
    cluster = h.start_cluster(min_replicas=2)
    # One fragment, 4 inner steps of >= 0.2 s between synchronisations.
    args = ["--fragments", "1", "--sync-every", "4", "--fragment-sync-delay", "0", "--step-sleep", "0.2",
            "--rounds", "7"]
    a, b = trainer(h, 0, args), trainer(h, 1, args)
    h.wait_until("both groups committed 3 rounds", lambda: all(len(t.rounds()) >= 3 for t in (a, b)), RUN_S)
    at_step = max(x["step"] for t in (a, b) for x in t.rounds())
    leader = cluster.wait_for_leader(timeout=10)
    status = cluster.status(leader)
    term = status.term if status is not None else 0
    t_kill = time.monotonic()
    cluster.kill(leader)
    h.note(f"SIGKILLed the leader n{leader + 1} after step {at_step}")
    new_leader = cluster.wait_for_leader(timeout=15, exclude_term=term)
    h.note(f"new leader n{new_leader + 1} after {time.monotonic() - t_kill:.2f}s")
    ra, rb = h.wait_finished([a, b])
    h.assert_identical([ra, rb])
    for r in (ra, rb):
        rounds = r["rounds"]
        assert [x["step"] for x in rounds] == list(range(1, 8)), rounds
        assert all(x["committed"] and x["participants"] == 2 for x in rounds), rounds
        assert len({x["quorum_id"] for x in rounds}) == 1, rounds  # the same quorum across the failover
    around = [x["duration_s"] for x in ra["rounds"] if x["step"] in (at_step + 1, at_step + 2)]
    summary("leader SIGKILL", h, [ra, rb], killed_after_step=at_step,
            rounds_after_kill_s=[round(d, 2) for d in around])
