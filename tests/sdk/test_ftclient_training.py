"""The ftclient example (``examples/train_ddp.py``) as a user runs it: real processes on CPU.

Each replica group is one process of the example (scikit-learn's bundled digits, an MLP, ftclient's
Manager / ProcessGroupGloo / DistributedDataParallel / Optimizer / DistributedSampler) whose
``TORCHFT_LIGHTHOUSE`` is the comma-separated list of all three nodes of a real ``LocalCluster``
(the SDK finds the leader itself). Every test ends with all replica groups (all ranks) at the same
step holding bitwise-identical parameters and optimizer state (the example's sha256 digests).

* three groups train to identical parameters, every step committed by all three;
* a group is SIGKILLed and a new process started for it: the survivors go on alone, the new
  process heals from a peer (checkpoint over HTTP) and trains on with them;
* the Raft LEADER is SIGKILLed while Quorum calls wait at it: no step fails, no process restarts,
  and no ``TORCHFT_QUORUM_RETRIES`` is set: the SDK re-sends the call to the new leader itself;
* two ranks per replica group (the example starts them; they share the group's TCPStore);
* a quorum that cannot be met ends the process with a TimeoutError within the configured
  ``TORCHFT_QUORUM_TIMEOUT_SEC``;
* the same example against torchft's Rust ``torchft_lighthouse`` (one URL, no cluster service);
* with ``--sdk torchft``, a comma-separated ``TORCHFT_LIGHTHOUSE`` is refused at once with a
  one-line error (the example on torchft's own SDK trains in
  ``tests/torchft_interop/test_torchft_training.py``).

Settings: ``join_timeout_ms=1000`` (survivors wait 1 s, not 60 s, for a dead group that is
still heartbeat-healthy); ``TORCHFT_TIMEOUT_SEC=15`` bounds collectives, commit and checkpoint
transfer; ``TORCHFT_QUORUM_TIMEOUT_SEC=30`` a quorum. Where every group must be in every quorum
from step 0 the lighthouse's ``min_replicas`` is the number of groups (the first quorum waits
for the slowest starter instead of a late group healing in).

The harness is ``support.training.TrainingRun`` with ``support.trainer_process.DdpExampleTrainer``:
every wait has a deadline; it kills every trainer (its whole process group: the ranks the example
started too), every node and the Rust lighthouse whatever happens; a failure message carries the
events, the trainers' output tails and the lighthouse logs. Each test prints a one-line summary
with its measurements (``-s``).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

# The example's trainers need the examples extra (torch, scikit-learn): without it these imports
# fail here, naming the missing module, rather than in every trainer subprocess.
import sklearn  # noqa: F401
import torch  # noqa: F401

from lighthouse_cluster.local.cluster import free_ports
from support.trainer_process import DDP_EXAMPLE, ROOT, DdpExampleTrainer, inherited_env
from support.training import TrainingRun, median_duration_s, slowest_step_around

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

FINISH_TIMEOUT_S = 90.0
START_S = 60.0  # a trainer process up (imports, manager, first quorum)


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[TrainingRun]:
    with TrainingRun(tmp_path, finish_timeout=FINISH_TIMEOUT_S) as run:
        yield run


# -- tests ----------------------------------------------------------------------------------------


def test_three_groups_train_to_identical_parameters(harness: TrainingRun) -> None:
    cluster = harness.start_cluster(min_replicas=3)
    steps = 20
    trainers = harness.start(DdpExampleTrainer.groups(3, harness.root, cluster.endpoints,
                                                      ["--steps", str(steps), "--step-sleep", "0.05",
                                                       "--min-replica-size", "2"]))
    results = harness.wait_finished()
    harness.assert_identical(results, steps)
    for t, r in zip(trainers, results):
        harness.assert_seamless(t, r)
        harness.check(all(s["participants"] == 3 for s in r["steps"]), f"{t.name}: a step without all 3 groups")
        printed = t.step_lines()
        harness.check([p["step"] for p in printed] == list(range(1, steps + 1)),
                      f"{t.name}: printed steps {[p['step'] for p in printed]}")
        harness.check(f"params_sha256={r['params_sha256']}" in t.output(), f"{t.name}: no final digest line")
    first, last = results[0]["steps"][0]["loss"], results[0]["steps"][-1]["loss"]
    harness.check(results[0]["test_accuracy"] > 0.5 and last < first,
                  f"the model did not learn: loss {first} -> {last}, accuracy {results[0]['test_accuracy']}")
    print(f"\nhealthy: 3 groups x {steps} steps, median step "
          f"{median_duration_s(s for r in results for s in r['steps']):.3f}s, loss {first:.3f} -> {last:.3f}, "
          f"test accuracy {results[0]['test_accuracy']:.3f}, digest {results[0]['params_sha256'][:12]}")


def test_killed_group_heals_from_a_peer(harness: TrainingRun) -> None:
    cluster = harness.start_cluster(min_replicas=2)
    steps = 25
    trainers = harness.start(DdpExampleTrainer.groups(3, harness.root, cluster.endpoints,
                                                      ["--steps", str(steps), "--step-sleep", "0.1",
                                                       "--min-replica-size", "2", "--min-final-participants", "3"]))
    victim, survivors = trainers[1], [trainers[0], trainers[2]]
    harness.wait_all_steps(6)
    step_at_kill = victim.step()
    seen = {s.group: len(s.step_lines()) for s in survivors}
    victim.kill()
    killed_at = time.time()
    harness.note(f"SIGKILLed {victim.name} at step {step_at_kill}")

    def alone(t: DdpExampleTrainer) -> int:
        # Steps committed by only the two survivors since the kill.
        return sum(s["committed"] and s["participants"] == 2 for s in t.step_lines()[seen[t.group]:])

    harness.wait_until("the survivors to commit two steps without the killed group",
                       lambda: all(alone(s) >= 2 for s in survivors), 30)
    alone_at = time.time()
    harness.note(f"survivors committed alone {alone_at - killed_at:.2f}s after the kill")
    victim.restart()
    restarted_at = victim.started_at
    harness.note(f"restarted as {victim.name}")

    results = harness.wait_finished()
    harness.assert_identical(results, steps)
    by_group = {r["replica_group"]: r for r in results}
    recs = by_group[victim.group]["steps"]
    first = recs[0]
    harness.check(first["step_before"] == 0 and first["healed"] and first["committed"] and first["step"] > step_at_kill,
                  f"the restarted group did not heal to the peers' step first: {first}")
    harness.check(all(r["committed"] and not r["errored"] for r in recs),
                  f"the restarted group failed steps: {[r for r in recs if not r['committed']]}")
    together = [r for r in recs[1:] if r["participants"] == 3]
    harness.check(bool(together), "the restarted group never trained together with the others after healing")
    senders = [s.name for s in survivors if "peers need recovery from us" in s.output()]
    harness.check(bool(senders), "no survivor served a checkpoint to the restarted group")
    for s in survivors:
        harness.assert_one_process(s, by_group[s.group])
    lost = {s.name: sum(not r["committed"] for r in by_group[s.group]["steps"]) for s in survivors}
    gap = max((r["duration_s"] for s in survivors for r in by_group[s.group]["steps"] if r["t_end"] >= killed_at),
              default=0.0)
    print(f"\nreplica kill at step {step_at_kill}: survivors' failed steps {lost}, slowest survivor step after the "
          f"kill {gap:.2f}s, alone after {alone_at - killed_at:.2f}s; restarted process healed 0 -> "
          f"{first['step'] - 1} in a {first['duration_s']:.2f}s step, first commit "
          f"{first['t_end'] - restarted_at:.2f}s after its start (with imports); then {len(together)} steps with all 3")


def test_leader_sigkill_fails_no_step(harness: TrainingRun) -> None:
    cluster = harness.start_cluster(min_replicas=3)
    steps = 30
    # Group 2 is slow (data loading), so the others' Quorum calls wait at the leader every step.
    # No TORCHFT_QUORUM_RETRIES: the endpoint list alone must carry the calls over.
    trainers = harness.start(DdpExampleTrainer.groups(3, harness.root, cluster.endpoints,
                                                      ["--steps", str(steps), "--step-sleep", "0.05",
                                                       "--min-replica-size", "2"],
                                                      per_group={2: ["--step-sleep", "0.3"]}))
    harness.wait_all_steps(6)
    kill = harness.kill_while_calls_wait(max_waiting_ms=100)  # the leader
    killed_at, waiting = kill.at, kill.waiting
    steps_at_kill = [t.step() for t in trainers]
    harness.note(f"steps at the kill: {steps_at_kill}")
    _, failover_s = harness.wait_new_leader(kill)

    results = harness.wait_finished()
    harness.assert_identical(results, steps)
    slowest, quorum_ids = [], set()
    for t, r in zip(trainers, results):
        harness.assert_seamless(t, r)
        after = [s for s in r["steps"] if s["t_start"] > killed_at + failover_s]
        harness.check(len(after) >= 5, f"{t.name}: only {len(after)} steps after the failover")
        around = slowest_step_around(r["steps"], killed_at)
        slowest.append(around["duration_s"] if around else 0.0)
        quorum_ids |= {s["quorum_id"] for s in r["steps"]}
    rerouted = sum(len(re.findall(r"re-routing|re-sending", t.output())) for t in trainers)
    harness.check(rerouted > 0, "no trainer re-sent a lighthouse call: the kill did not hit a call in flight")
    normal = median_duration_s(s for r in results[:2] for s in r["steps"])
    print(f"\nleader kill: {waiting} calls waiting at the kill, steps {steps_at_kill}; new leader after "
          f"{failover_s:.2f}s; slowest step around the kill {max(slowest):.2f}s (median fast-group step "
          f"{normal:.3f}s); {rerouted} lighthouse calls re-sent; quorum ids {sorted(quorum_ids)}; every step "
          f"committed, no restart, TORCHFT_QUORUM_RETRIES unset")


def test_two_ranks_per_replica_group(harness: TrainingRun) -> None:
    cluster = harness.start_cluster(min_replicas=2)
    steps = 10
    harness.start(DdpExampleTrainer.groups(2, harness.root, cluster.endpoints,
                                           ["--steps", str(steps), "--step-sleep", "0.05", "--min-replica-size", "2"],
                                           nproc=2))
    results = harness.wait_finished()
    harness.check(len(results) == 4, f"expected 4 outputs (2 groups x 2 ranks), got {len(results)}")
    harness.assert_identical(results, steps)
    for r in results:
        who = f"group {r['replica_group']} rank {r['rank']}"
        harness.check(r["world_size"] == 2, f"{who}: world_size {r['world_size']}")
        bad = [s for s in r["steps"] if not s["committed"] or s["errored"]]
        harness.check(not bad, f"{who}: failed steps {bad[:3]}")
    pids = {(r["replica_group"], r["rank"]): r["pid"] for r in results}
    harness.check(len(set(pids.values())) == 4, f"ranks did not run as separate processes: {pids}")
    # The lighthouse saw one member per replica group, of world size 2 (the group's ranks joined
    # through its manager server, on rank 0).
    leader = cluster.wait_for_leader()
    st = cluster.status(leader)
    members = [(p.replica_id, p.world_size) for p in st.quorum.participants]
    harness.check(len(members) == 2 and all(ws == 2 for _, ws in members), f"last quorum's members: {members}")
    print(f"\ntwo ranks per group: 2 groups x 2 ranks x {steps} steps, identical digests "
          f"{results[0]['params_sha256'][:12]}; lighthouse members {members}")


def test_quorum_timeout_raises_within_the_configured_time(harness: TrainingRun) -> None:
    cluster = harness.start_cluster(min_replicas=2)
    timeout_s = 3.0
    # One group where the lighthouse needs two: the quorum can never form.
    (trainer,) = harness.start(DdpExampleTrainer.groups(1, harness.root, cluster.endpoints,
                                                        ["--steps", "5", "--min-replica-size", "2"],
                                                        env={"TORCHFT_QUORUM_TIMEOUT_SEC": f"{timeout_s:g}"}))
    assert trainer.process is not None
    harness.wait_until("the trainer to start training",
                       lambda: "pid=" in trainer.output() or trainer.returncode() is not None, START_S)
    ready_at = time.monotonic()
    try:
        rc = trainer.process.wait(timeout=timeout_s + 15)
    except subprocess.TimeoutExpired:
        harness.fail(f"the trainer did not exit within {timeout_s + 15:.0f}s of a {timeout_s:g}s quorum timeout")
    elapsed = time.monotonic() - ready_at
    out = trainer.output()
    error = [line for line in out.splitlines() if line.startswith("train_ddp: error:")]
    harness.check(rc == 1, f"exit status {rc}, expected 1")
    harness.check(bool(error) and "TimeoutError" in error[-1] and "timed out" in error[-1]
                  and "lighthouse quorum" in error[-1], f"no error line naming the quorum timeout: {error}")
    harness.check(timeout_s * 0.5 <= elapsed <= timeout_s + 5, f"exited {elapsed:.2f}s after starting to train, "
                  f"expected about TORCHFT_QUORUM_TIMEOUT_SEC={timeout_s:g}s")
    harness.check(not trainer.step_lines(), f"a step was printed: {trainer.step_lines()}")
    print(f"\nquorum timeout: TORCHFT_QUORUM_TIMEOUT_SEC={timeout_s:g}, exit 1 after {elapsed:.2f}s: {error[-1][:200]}")


def test_trains_against_torchft_rust_lighthouse(harness: TrainingRun) -> None:
    lighthouse = harness.start_torchft_lighthouse(min_replicas=2)
    steps = 10
    trainers = harness.start(DdpExampleTrainer.groups(2, harness.root, lighthouse,
                                                      ["--steps", str(steps), "--step-sleep", "0.05",
                                                       "--min-replica-size", "2"]))
    results = harness.wait_finished()
    harness.assert_identical(results, steps)
    for t, r in zip(trainers, results):
        harness.assert_seamless(t, r)
    print(f"\ntorchft_lighthouse: 2 groups x {steps} steps, identical digests {results[0]['params_sha256'][:12]}, "
          f"median step {median_duration_s(s for r in results for s in r['steps']):.3f}s")


def test_torchft_sdk_refuses_a_url_list(tmp_path: Path) -> None:
    """torchft's client takes one URL (with a list it waits out its connect timeout, then fails with
    "invalid URI"): the example says so in one line and exits 2 before it imports torch."""
    ports = free_ports(3)  # nothing listens there: were the list let through, nothing would answer
    urls = ",".join(f"http://127.0.0.1:{p}" for p in ports)
    env = inherited_env()
    env.update(TORCHFT_LIGHTHOUSE=urls, TORCHFT_CONNECT_TIMEOUT_SEC="60", PYTHONPATH=str(ROOT))
    started = time.monotonic()
    res = subprocess.run([sys.executable, str(DDP_EXAMPLE), "--sdk", "torchft", "--steps", "5"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60)
    elapsed = time.monotonic() - started
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and not res.stdout, (res.returncode, res.stdout, res.stderr)
    (line,) = lines
    assert line.startswith("train_ddp: error: torchft takes exactly one lighthouse URL"), line
    for part in (f"lists 3 ({urls})", f"TORCHFT_LIGHTHOUSE=http://127.0.0.1:{ports[0]};", "One name for every node",
                 "--sdk ftclient"):
        assert part in line, f"{part!r} not in {line!r}"
    assert elapsed < 30, f"took {elapsed:.1f}s: the error must not wait for torchft's 60 s connect timeout"


def test_nccl_without_a_gpu_device_is_refused_in_one_line(tmp_path: Path) -> None:
    """``--pg nccl`` needs ``--device cuda``: one line, exit 2, before torch is imported. (The
    example on CUDA, gloo across groups, trains in tests/gpu/test_training_cuda.py.)"""
    env = inherited_env()
    env.update(TORCHFT_LIGHTHOUSE="http://127.0.0.1:1", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, str(DDP_EXAMPLE), "--pg", "nccl", "--steps", "5"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60)
    assert res.returncode == 2 and not res.stdout, (res.returncode, res.stdout, res.stderr)
    assert res.stderr.strip() == "train_ddp: error: --pg nccl needs --device cuda (NCCL runs on GPUs only)"
