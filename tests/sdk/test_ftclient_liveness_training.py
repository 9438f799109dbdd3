"""Liveness streams with real trainer processes on a real 3-node cluster: what a replica group's
SIGKILL costs the survivors.

Each replica group is one process of ``tests/support/liveness_trainer.py`` (ftclient's Manager,
ProcessGroupGloo, HTTP checkpoints; every phase of every step timestamped). The cluster runs with
torchft's default 5 s heartbeat timeout and the 10 s join timeout torchft's guides use, and the
trainers with a 15 s collective timeout: without liveness a survivor would wait seconds for the
dead group (a heartbeat going stale, a join timeout, a collective timeout). With it:

* **killed during an allreduce**: the group holds before its allreduce of a step, the survivors
  are in that allreduce; it is SIGKILLed. The survivors' allreduce fails at once (well under a
  second: the leader sees the stream close and pushes ``peer_died``; the Manager aborts the
  process group), the step is not committed, and they commit the next one under a second after
  the kill;
* **stopped during an allreduce** (SIGSTOP: it closes nothing, like a hung or cut-off host): Gloo
  would wait for it until the collective timeout; the leader declares it dead when its keep-alives
  have stopped for the liveness timeout and pushes the notice, which aborts the survivors'
  allreduce; they commit again within that timeout plus a second;
* **killed between steps**: the group holds before asking for a quorum, the survivors wait for it
  at the lighthouse; it is SIGKILLed. The survivors get a quorum without it at once and lose no
  step;
* **killed while healing**: a new group joins and fetches a peer's checkpoint (256 MiB of state,
  so the transfer takes a while); it is SIGKILLed during the transfer. The survivors' allreduce,
  which waited for the healing group, fails at once and they commit again under a second later.

In every test the survivors end with identical parameters. Each test prints a summary (``-s``).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from support.trainer_process import LivenessTrainer
from support.training import TrainingRun

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240), pytest.mark.exclusive]  # exclusive: runs alone (conftest)

HEARTBEAT_TIMEOUT_MS = 5_000  # torchft's default
JOIN_TIMEOUT_MS = 10_000  # torchft's and torchtitan's guides
# "At once" and "well under a second": the bound on a survivor's wait after the kill. Measured
# values are printed; on 2 loaded cores they are a few hundred ms at most.
FAST_S = 1.0
LIVENESS_TIMEOUT_S = 0.5  # the nodes' default --liveness-timeout-ms
STEPS = 14
HOLD_AT = 5
START_S = 90.0  # trainers up (imports, first quorum) and at the step the test waits for


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[TrainingRun]:
    with TrainingRun(tmp_path, finish_timeout=120) as run:
        yield run


def start_cluster(harness: TrainingRun) -> str:
    cluster = harness.start_cluster(min_replicas=2, join_timeout_ms=JOIN_TIMEOUT_MS,
                                    heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    return cluster.endpoints


def trainers(harness: TrainingRun, lighthouse: str, groups: range, **kwargs: Any) -> list[LivenessTrainer]:
    options: dict[str, Any] = {"steps": STEPS, "min_replica_size": 2, "step_sleep": 0.05, **kwargs}
    return [LivenessTrainer(group=g, lighthouse=lighthouse, workdir=harness.root, **options) for g in groups]


def first_attempt_ending_after(t: LivenessTrainer, at: float) -> dict[str, Any] | None:
    return next((r for r in t.records() if r["t_end"] >= at), None)


def first_commit_after(t: LivenessTrainer, at: float) -> dict[str, Any] | None:
    return next((r for r in t.records() if r["t_end"] >= at and r["committed"]), None)


def check_survivors_recover(harness: TrainingRun, survivors: list[LivenessTrainer], killed_at: float,
                            expect_failed_step: bool, bound: float = FAST_S) -> list[str]:
    """The survivors' first step attempt ending after the kill ended within ``bound`` (failed or
    not, as expected), and they committed within ``bound`` of the kill; a line per survivor."""
    lines = []
    for s in survivors:
        rec = harness.wait_until(f"{s.name} to finish a step after the kill",
                                 lambda s=s: first_attempt_ending_after(s, killed_at), 30)
        commit = harness.wait_until(f"{s.name} to commit after the kill",
                                    lambda s=s: first_commit_after(s, killed_at), 30)
        allreduce_s = rec["t_allreduce_end"] - killed_at
        commit_s = commit["t_end"] - killed_at
        if expect_failed_step:
            harness.check(not rec["committed"], f"{s.name}: the step in flight at the kill committed: {rec}")
            harness.check(allreduce_s < bound, f"{s.name}: its allreduce ended {allreduce_s:.2f}s after the kill")
        else:
            harness.check(rec["committed"], f"{s.name}: a step failed: {rec}")
        harness.check(commit_s < bound, f"{s.name}: committed again {commit_s:.2f}s after the kill")
        lines.append(f"{s.name}: step {rec['step']} {'committed' if rec['committed'] else 'failed'} "
                     f"(allreduce ended {allreduce_s:+.3f}s after the kill, error {str(rec['errored'])[:90]!r}), "
                     f"next commit {commit_s:.3f}s after the kill (step {commit['step_after']}, quorum "
                     f"{commit['quorum_id']}, {commit['participants']} participants)")
    return lines


def in_the_allreduce(s: LivenessTrainer) -> bool:
    return any(e["step"] == HOLD_AT for e in s.events("allreduce"))


def finish(harness: TrainingRun, survivors: list[LivenessTrainer]) -> list[dict[str, Any]]:
    results = harness.wait_finished(survivors)
    harness.assert_identical(results, STEPS)
    for s in survivors:
        harness.assert_one_process(s)
        notices = [line for line in s.output().splitlines() if "liveness notice" in line]
        harness.check(bool(notices), f"{s.name} logged no liveness notice")
    return results


def test_sigkill_during_an_allreduce_fails_the_survivors_step_at_once(harness: TrainingRun) -> None:
    lighthouse = start_cluster(harness)
    groups = trainers(harness, lighthouse, range(3), min_final_participants=2)
    victim, survivors = groups[1], [groups[0], groups[2]]
    victim.hold, victim.hold_at_step = "allreduce", HOLD_AT
    harness.start(groups)

    harness.wait_until(f"{victim.name} holding at step {HOLD_AT} with the survivors in its allreduce",
                       lambda: victim.events("holding") and all(in_the_allreduce(s) for s in survivors), START_S)
    time.sleep(0.2)  # the survivors are well inside the allreduce
    killed_at = time.time()  # before: kill() also waits for the process to be reaped
    victim.kill()
    harness.note(f"SIGKILLed {victim.name} holding before its allreduce of step {HOLD_AT}")
    # Gloo sees the dead peer's sockets close too: whichever is first fails the allreduce.
    lines = check_survivors_recover(harness, survivors, killed_at, expect_failed_step=True)
    finish(harness, survivors)
    print("\nkill during an allreduce:\n  " + "\n  ".join(lines))


def test_a_group_that_stops_during_an_allreduce_is_cut_off_after_the_liveness_timeout(harness: TrainingRun) -> None:
    """A stopped process (SIGSTOP; a hung host looks the same) closes nothing: Gloo would wait for
    it until the collective timeout. Its keep-alives stop, the leader declares it dead after the
    liveness timeout and pushes the notice, and the survivors' allreduce is aborted."""
    lighthouse = start_cluster(harness)
    groups = trainers(harness, lighthouse, range(3), min_final_participants=2)
    victim, survivors = groups[1], [groups[0], groups[2]]
    victim.hold, victim.hold_at_step = "allreduce", HOLD_AT
    harness.start(groups)
    harness.wait_until(f"{victim.name} holding at step {HOLD_AT} with the survivors in its allreduce",
                       lambda: victim.events("holding") and all(in_the_allreduce(s) for s in survivors), START_S)
    time.sleep(0.2)
    assert victim.process is not None
    stopped_at = time.time()
    os.killpg(victim.process.pid, signal.SIGSTOP)
    harness.note(f"SIGSTOPped {victim.name} holding before its allreduce of step {HOLD_AT}")
    try:
        lines = check_survivors_recover(harness, survivors, stopped_at, expect_failed_step=True,
                                        bound=LIVENESS_TIMEOUT_S + FAST_S)
        errors = [first_attempt_ending_after(s, stopped_at)["errored"] or "" for s in survivors]  # type: ignore[index]
        harness.check(all("died" in e and "keep-alives stopped" in e for e in errors),
                      f"the survivors' allreduce did not fail on the notice: {errors}")
    finally:
        victim.kill()
    finish(harness, survivors)
    print("\nstop during an allreduce:\n  " + "\n  ".join(lines))


def test_sigkill_between_steps_costs_the_survivors_no_step(harness: TrainingRun) -> None:
    lighthouse = start_cluster(harness)
    groups = trainers(harness, lighthouse, range(3), min_final_participants=2)
    victim, survivors = groups[1], [groups[0], groups[2]]
    victim.hold, victim.hold_at_step = "quorum", HOLD_AT
    harness.start(groups)
    harness.wait_until(f"{victim.name} holding before its quorum of step {HOLD_AT} with the survivors done with "
                       f"step {HOLD_AT - 1}",
                       lambda: victim.events("holding") and all(s.step() >= HOLD_AT for s in survivors), START_S)
    time.sleep(0.3)  # the survivors' Quorum calls wait at the leader for the victim
    killed_at = time.time()  # before: kill() also waits for the process to be reaped
    victim.kill()
    harness.note(f"SIGKILLed {victim.name} holding before its quorum of step {HOLD_AT}")
    lines = check_survivors_recover(harness, survivors, killed_at, expect_failed_step=False)
    results = finish(harness, survivors)
    for s in survivors:
        failed = [r for r in s.records() if not r["committed"]]
        harness.check(not failed, f"{s.name} failed steps: {failed[:3]}")
    print("\nkill between steps:\n  " + "\n  ".join(lines) + f"\n  final step {results[0]['final_step']}")


def test_sigkill_of_a_healing_group_during_its_checkpoint_transfer(harness: TrainingRun) -> None:
    lighthouse = start_cluster(harness)
    state_mb = 256
    # The first two groups finish only with the third: after the interrupted transfer, a new
    # process of it heals and trains with them.
    first = trainers(harness, lighthouse, range(2), state_mb=state_mb, min_final_participants=3)
    harness.start(first)
    harness.wait_all_steps(HOLD_AT)
    (healer,) = trainers(harness, lighthouse, range(2, 3), state_mb=state_mb, min_final_participants=3)
    harness.start([healer])
    harness.wait_until(f"{healer.name} to start fetching a checkpoint", lambda: healer.events("recv_start"),
                       START_S, interval=0.005)
    killed_at = time.time()
    healer.kill()
    recv = healer.events("recv_start")[0]
    harness.check(not healer.events("recv_end"), f"{healer.name} had fetched the whole checkpoint before the kill")
    harness.note(f"SIGKILLed {healer.name} {killed_at - recv['t']:.3f}s into its checkpoint transfer")
    lines = check_survivors_recover(harness, first, killed_at, expect_failed_step=True)
    senders = [s.name for s in first if "peers need recovery from us" in s.output()]
    harness.check(bool(senders), "no survivor was sending a checkpoint")

    healer.restart()
    harness.note(f"restarted as {healer.name}")
    results = harness.wait_finished(first + [healer])
    harness.assert_identical(results, STEPS)
    harness.check(bool(healer.events("recv_end")), f"{healer.name} did not heal from a peer")
    for s in first:
        harness.assert_one_process(s)
        harness.check(any("liveness notice" in line for line in s.output().splitlines()),
                      f"{s.name} logged no liveness notice")
    print(f"\nkill of a healing group {killed_at - recv['t']:.3f}s into its transfer of {state_mb} MiB from "
          f"{senders}:\n  " + "\n  ".join(lines) + f"\n  then {healer.name} healed; final step "
          f"{results[0]['final_step']}, identical digests")
