"""HSDP as torchtitan runs it, on CPU (#16 item 3): ``examples/train_hsdp.py`` as real processes.

Two replica groups of two ranks each (4 trainer processes plus each group's launcher) on a real
3-node ``LocalCluster``: FSDP2 (``fully_shard``) shards the model over each group's Gloo default
process group; a ``ManagedProcessGroup(manager)`` registered as ``"dp_replicate"`` averages the
reduce-scattered gradient shards across the groups from every FSDP module's
``set_all_reduce_hook`` (``dist.all_reduce(out, group=replicate_pg, op=ReduceOp.AVG)``); the loss
and the sample count are synced with functional collectives over the group and then over the
managed group. Every test ends with every rank of every group at the same step with
bitwise-identical full (unsharded) parameters and optimizer state.

* healthy training, then a whole replica group SIGKILLed (launcher and both ranks) and started
  again: the survivor trains on alone, and each rank of the new group heals its shards (the
  DTensors of ``model.state_dict()`` and ``optimizer.state_dict()``: only the local shards travel,
  over HTTP) from the same rank of the survivor, then trains with it;
* one rank of a group SIGKILLed: its launcher ends the other rank and starts the group again
  (``--max-restarts``, as torchrun does: FSDP's process group cannot lose a rank), and the new
  ranks heal from the other group.

Settings as in the other training tests (``support.training``): ``join_timeout_ms=1000``,
``TORCHFT_TIMEOUT_SEC=15``; ``min_replicas=1`` so that a group trains on alone, and a start
barrier so that the first quorum has both groups. Each test prints a one-line summary (``-s``).
"""

from __future__ import annotations

import os
import signal
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

import pytest

from support.hsdp_trainer import HsdpExampleTrainer
from support.training import TrainingRun, median_duration_s

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

FINISH_TIMEOUT_S = 100.0
STEPS = 10
ARGS = ["--steps", str(STEPS), "--step-sleep", "0.2", "--min-replica-size", "1", "--min-final-participants", "2"]


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[TrainingRun]:
    with TrainingRun(tmp_path, finish_timeout=FINISH_TIMEOUT_S) as run:
        yield run


def by_rank(results: list[dict[str, Any]]) -> dict[tuple[int, int], dict[str, Any]]:
    return {(r["replica_group"], r["rank"]): r for r in results}


def check_healed(harness: TrainingRun, result: dict[str, Any], after_step: int) -> dict[str, Any]:
    """The result's first step healed from a peer (to a step past ``after_step``) and committed,
    and every later step committed without error."""
    recs = result["steps"]
    first = recs[0]
    where = f"group {result['replica_group']} rank {result['rank']} (attempt {result['attempt']})"
    harness.check(first["step_before"] == 0 and first["healed"] and first["committed"] and first["step"] > after_step,
                  f"{where} did not heal to the peers' step first: {first}")
    harness.check(all(r["committed"] and not r["errored"] for r in recs), f"{where} failed steps: "
                  f"{[r for r in recs if not r['committed'] or r['errored']][:3]}")
    harness.check(any(r["participants"] == 2 for r in recs[1:]), f"{where} never trained with the other group")
    return first


def test_hsdp_healthy_then_a_killed_group_restarts_and_heals_its_shards(harness: TrainingRun) -> None:
    # The healthy phase asserts every step committed: under CI load a trainer's keep-alive
    # thread stalled past the default 500 ms once, a false death that cost a step (as
    # documented). The kill below closes the victim's stream, a death at once whatever this is.
    cluster = harness.start_cluster(min_replicas=1, liveness_timeout_ms=3000)
    trainers = harness.start(HsdpExampleTrainer.groups(2, harness.root, cluster.endpoints, ARGS))
    survivor, victim = trainers

    # Healthy: both groups in every quorum, every step committed by every rank, the same loss
    # (averaged over all 4 ranks through funcol) and sample count printed by every rank.
    harness.wait_all_steps(4)
    lines = [r for t in trainers for r in t.lines() if r["step"] <= 4]
    harness.check(len(lines) == 16 and all(r["committed"] for r in lines), f"healthy steps: {lines}")
    per_step: dict[int, set[tuple[float, int, int]]] = defaultdict(set)
    for r in lines:
        if r["step"] >= 2:  # step 1: the groups' init sync (a rank heals from the primary)
            per_step[r["step"]].add((r["loss"], r["samples"], r["participants"]))
    harness.check(len(per_step) == 3 and all(len(v) == 1 and next(iter(v))[1:] == (64, 2) for v in per_step.values()),
                  f"a healthy step's loss, samples or participants differ between ranks: {dict(per_step)}")

    step_at_kill = victim.step()
    seen = len(survivor.lines())
    victim.kill()
    killed_at = time.time()
    harness.note(f"SIGKILLed {victim.name} (launcher and both ranks) at step {step_at_kill}")
    harness.wait_until("the survivor's ranks to commit two steps alone",
                       lambda: sum(r["committed"] and r["participants"] == 1 for r in survivor.lines()[seen:]) >= 4,
                       30)
    alone_s = time.time() - killed_at
    victim.restart()
    harness.note(f"restarted as {victim.name}")

    results = harness.wait_finished()
    harness.assert_identical(results, STEPS)
    ranks = by_rank(results)
    firsts = [check_healed(harness, ranks[(victim.group, r)], step_at_kill) for r in range(2)]
    for r in range(2):
        harness.assert_one_process(survivor, ranks[(survivor.group, r)])
    survivor_failed = sum(not s["committed"] for r in range(2) for s in ranks[(survivor.group, r)]["steps"])
    healthy = median_duration_s(s for r in range(2) for s in ranks[(survivor.group, r)]["steps"][1:5])
    print(f"\nhsdp: median healthy step {healthy:.3f}s; group kill at step {step_at_kill}: survivor alone after {alone_s:.2f}s "
          f"(uncommitted survivor steps over both ranks: {survivor_failed}); restarted ranks healed to steps "
          f"{[f['step'] - 1 for f in firsts]} in {[round(f['duration_s'], 2) for f in firsts]}s steps; final step "
          f"{results[0]['final_step']}, digest {results[0]['params_sha256'][:12]}")


def test_hsdp_one_killed_rank_restarts_its_group_which_heals(harness: TrainingRun) -> None:
    cluster = harness.start_cluster(min_replicas=1)
    trainers = harness.start(HsdpExampleTrainer.groups(2, harness.root, cluster.endpoints,
                                                       [*ARGS, "--max-restarts", "1"]))
    survivor, victim = trainers
    harness.wait_all_steps(3)
    step_at_kill = victim.step()
    found = victim.rank_pid(1)
    harness.check(found is not None and found[1] == 0, f"no start line of {victim.name} rank 1: {found}")
    assert found is not None
    os.kill(found[0], signal.SIGKILL)
    killed_at = time.time()
    harness.note(f"SIGKILLed rank 1 of {victim.name} (pid {found[0]}) at step {step_at_kill}")
    harness.wait_until(f"{victim.name}'s launcher to restart the group",
                       lambda: "restarting the replica group" in victim.output(), 20)

    results = harness.wait_finished()
    harness.assert_identical(results, STEPS)
    ranks = by_rank(results)
    firsts = []
    for r in range(2):
        res = ranks[(victim.group, r)]
        harness.check(res["attempt"] == 1, f"{victim.name} rank {r} finished in attempt {res['attempt']}, not 1")
        firsts.append(check_healed(harness, res, step_at_kill))
        harness.check(ranks[(survivor.group, r)]["attempt"] == 0, f"{survivor.name} rank {r} was restarted")
    harness.assert_one_process(survivor)
    rejoined = min(s["t_end"] for r in range(2) for s in ranks[(victim.group, r)]["steps"])
    survivor_failed = sum(not s["committed"] for r in range(2) for s in ranks[(survivor.group, r)]["steps"])
    print(f"\nhsdp rank kill at step {step_at_kill}: group restarted by its launcher, its ranks healed to steps "
          f"{[f['step'] - 1 for f in firsts]}, first commit {rejoined - killed_at:.2f}s after the kill "
          f"(uncommitted survivor steps over both ranks: {survivor_failed}); final step {results[0]['final_step']}")
