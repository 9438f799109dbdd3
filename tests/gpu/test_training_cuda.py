"""The DDP example (``examples/train_ddp.py --device cuda``) trains on a GPU through a real cluster.

Two replica groups, one process each, both on GPU 0 (one GPU is enough: the collectives across
groups are ftclient's ProcessGroupGloo on CUDA tensors; NCCL would refuse two ranks of one group
on the same GPU). The model, its gradients and the optimizer state live on the GPU, so this covers
what the CPU tests cannot: the DDP comm hook's CUDA future, the Manager's stream handling in a
real training loop, and a heal whose checkpoint is made of CUDA tensors (sent over HTTP from the
peer's GPU, loaded into the restarted process's GPU model). One group is SIGKILLed mid-run and a
new process started for it: it heals from the survivor and both end at the same step with
bit-identical parameters and optimizer state.

Run on a machine with CUDA (``scripts/gpu_tests.sh``); skipped elsewhere with the reason "CUDA is
not available". The same scenario on CPU is ``tests/sdk/test_ftclient_training.py``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

import sklearn  # noqa: E402,F401 -- the example's dataset

from support.trainer_process import DdpExampleTrainer  # noqa: E402
from support.training import TrainingRun  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[TrainingRun]:
    with TrainingRun(tmp_path, finish_timeout=150.0) as run:
        yield run


def test_ddp_on_cuda_survives_a_killed_group_that_heals_from_its_peer(harness: TrainingRun) -> None:
    cluster = harness.start_cluster(min_replicas=1)
    steps = 25
    trainers = harness.start(DdpExampleTrainer.groups(
        2, harness.root, cluster.endpoints,
        ["--device", "cuda", "--steps", str(steps), "--step-sleep", "0.1", "--min-replica-size", "1",
         "--min-final-participants", "2"]))
    harness.wait_all_steps(5)
    for t in trainers:
        harness.check("device=cuda:0" in t.output(), f"{t.name} does not train on cuda:0:\n{t.tail()}")
    survivor, victim = trainers
    step_at_kill = victim.step()
    seen = len(survivor.step_lines())
    victim.kill()
    killed_at = time.time()
    harness.note(f"SIGKILLed {victim.name} at step {step_at_kill}")
    harness.wait_until("the survivor to commit two steps alone",
                       lambda: sum(s["committed"] and s["participants"] == 1
                                   for s in survivor.step_lines()[seen:]) >= 2, 60)
    harness.note(f"the survivor committed alone {time.time() - killed_at:.2f}s after the kill")
    victim.restart()

    results = harness.wait_finished()
    harness.assert_identical(results, steps)
    by_group = {r["replica_group"]: r for r in results}
    first = by_group[victim.group]["steps"][0]
    harness.check(first["step_before"] == 0 and first["healed"] and first["committed"] and first["step"] > step_at_kill,
                  f"the restarted group did not heal from its peer first: {first}")
    harness.check("peers need recovery from us" in survivor.output(),
                  "the survivor never served its (CUDA) checkpoint to the restarted group")
    harness.assert_one_process(survivor, by_group[survivor.group])
    print(f"\ncuda: kill at step {step_at_kill}, restarted group healed 0 -> {first['step']}, "
          f"final step {results[0]['final_step']}, accuracy {results[0]['test_accuracy']:.3f}, "
          f"digest {results[0]['params_sha256'][:12]}")


def test_ddp_on_cuda_over_nccl_commits_every_step(harness: TrainingRun) -> None:
    """One replica group on ftclient's ProcessGroupNCCL (one GPU holds one NCCL rank: two groups
    need two GPUs): the Manager configures the NCCL group for each quorum and every step commits."""
    cluster = harness.start_cluster(min_replicas=1)
    steps = 15
    (trainer,) = harness.start(DdpExampleTrainer.groups(
        1, harness.root, cluster.endpoints, ["--device", "cuda", "--pg", "nccl", "--steps", str(steps)]))
    (result,) = harness.wait_finished()
    harness.assert_identical([result], steps)
    harness.assert_seamless(trainer, result)
    harness.check("device=cuda:0" in trainer.output(), f"not on cuda:0:\n{trainer.tail()}")
