"""torchtitan 0.3.0's own fault-tolerant trainer on a real 3-node lighthouse cluster, end to end.

Each replica group is ``torchrun --standalone`` of ``python -m torchtitan.train --module
torchft.llama3 --config llama3_torchft_debugmodel --fault_tolerance.enable
--fault_tolerance.process_group gloo`` on CPU (``examples/torchtitan/cpu_shim.py``), with its
tokenizer and c4_test corpus made at test time (``examples/torchtitan/make_assets.py``). The SDK
is one of the three lines users run torchtitan on (``support.torchtitan_trainer``): torchft-nightly
(the line torchtitan's guide recommends), torchft 0.2.0, or ftclient (``-m ftclient.as_torchft``,
the trainer unedited). torchft trainers name one node that no test kills (torchft takes one URL);
ftclient trainers the list of every node.

Each test reads what torchtitan and the SDK log (torchtitan's step lines, the manager's
``should_commit`` and heal lines, per rank) and what torchtitan saves: every group's final DCP
checkpoint, compared tensor by tensor across the groups.

Scenarios (the issue's letters):

* (a) per-step (``--fault_tolerance.semi_sync_method None``, the asynchronous quorum), the Raft
  leader SIGKILLed while Quorum calls wait at it: no step fails;
* (b) per-step, a whole replica group SIGKILLed (torchrun and its ranks) and started again: the
  survivor trains on alone, the new group heals from it, both finish with identical weights;
* (c) DiLoCo (``semi_sync_method diloco``, torchtitan's default for this config; a synchronous
  quorum at every synchronisation) with a leader SIGKILL during a synchronisation, and a group
  SIGKILLed and restarted (``min_replica_size 2``: the survivor waits for it at its next
  synchronisation, where it heals);
* (d) two ranks per group with FSDP2 over them (``data_parallel_shard_degree 2``, Gloo needs
  ``--parallelism.spmd_backend partial_dtensor``).

torchft runs per-step mode only where no group ever heals: torchft's asynchronous quorum takes the
donor's state dict on its quorum thread while FSDP2's forward runs, and the donor crashes ("got
mixed torch.Tensor and DTensor"; ``test_torchft_donor_crashes_when_a_peer_heals_per_step`` shows
it, ftclient's heals are safe). Its users' workarounds are DiLoCo, or a synchronous quorum.

Which run where (each two-group run is 40-90 s on 2 cores): every CI run has one run per SDK line,
the rest carry the ``torchtitan_full`` marker, which the default run deselects::

    python3 -m pytest -n 2 -m torchtitan_full tests/torchtitan     # the full matrix, ~15 min
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import pytest

pytest.importorskip("torch", reason="torch is not installed: the torchtitan tests need it")
pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e '.[interop]')")

from support.torchtitan_trainer import TorchtitanTrainer, compare_states, final_state, make_assets  # noqa: E402
from support.training import Kill, TrainingRun  # noqa: E402
from support.waiting import wait_for  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

FULL = pytest.mark.torchtitan_full
PER_STEP = ["--fault_tolerance.semi_sync_method", "None"]
SYNC_EVERY = 5
DILOCO = ["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", str(SYNC_EVERY),
          "--fault_tolerance.num_fragments", "1"]
FSDP2 = ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.spmd_backend", "partial_dtensor"]
STARTUP_S = 120.0  # imports, model build, first quorum; two groups (and the nightly venv's first use)
FINISH_S = 300.0


@pytest.fixture
def run(tmp_path: Path) -> Iterator[TrainingRun]:
    make_assets(tmp_path)
    with TrainingRun(tmp_path, finish_timeout=FINISH_S) as r:
        yield r


def start_cluster(run: TrainingRun, min_replicas: int) -> None:
    """The 3-node cluster, with a 2 s liveness timeout instead of 500 ms: on a 2-core CI host
    running 4+ busy trainer processes and another test, a trainer's keep-alive thread can go
    unscheduled for over 500 ms (seen: a new leader declared both groups dead a second after a
    failover, under load average 9-13), which costs a quorum change and a failed step that has
    nothing to do with the leader kill these tests measure."""
    run.start_cluster(min_replicas=min_replicas, liveness_timeout_ms=2000)


def start_groups(run: TrainingRun, line: str, *, steps: int, args: list[str], min_replica_size: int = 1,
                 nproc: int = 1, groups: int = 2) -> list[TorchtitanTrainer]:
    """``groups`` replica groups of the trainer on ``line``: torchft ones name a follower of the
    current leader (the leader is the node the tests kill), ftclient ones every node."""
    cluster = run.cluster
    assert cluster is not None
    leader = cluster.leader_index()
    follower = next(i for i in range(cluster.nodes) if i != leader)
    lighthouse = cluster.endpoints if line == "ftclient" else f"http://{cluster.client_addresses[follower]}"
    return run.start(TorchtitanTrainer(group=g, line=line, groups=groups, steps=steps, nproc=nproc,
                                       min_replica_size=min_replica_size, lighthouse=lighthouse,
                                       workdir=run.root, args=list(args))
                     for g in range(groups))


def kill_leader(run: TrainingRun, *, while_calls_wait: bool = True) -> float:
    """SIGKILL the Raft leader, while Quorum calls wait at it (a round of several groups: the
    calls are in flight when it dies) or, with ``while_calls_wait=False``, at once (one group's
    quorum is issued without a wait); returns the failover's seconds."""
    if while_calls_wait:
        kill = run.kill_while_calls_wait(timeout=60)
    else:
        cluster = run.cluster
        assert cluster is not None
        leader = cluster.leader_index()
        st = cluster.status(leader, timeout=1.0) if leader is not None else None
        run.check(st is not None, "no leader to kill")
        cluster.kill(leader)
        kill = Kill(node=leader, leader=leader, term=st.term, at=time.time(), waiting=0)
        run.note(f"SIGKILLed n{leader + 1} (the leader, term {st.term})")
    _, failover_s = run.wait_new_leader(kill)
    return failover_s


def kill_and_restart(run: TrainingRun, victim: TorchtitanTrainer, survivor: TorchtitanTrainer, *,
                     alone_steps: int) -> None:
    """SIGKILL ``victim``'s whole group, wait until ``survivor`` logged ``alone_steps`` more steps
    (0: none; it then waits for the victim), and start the victim again."""
    before = survivor.step()
    victim.kill()
    run.note(f"SIGKILLed {victim.name} (torchrun and its ranks) at step {victim.step()}")
    if alone_steps:
        run.wait_until(f"{survivor.name} to train {alone_steps} steps alone",
                       lambda: survivor.step() >= before + alone_steps, 90)
    victim.restart()
    run.note(f"restarted as {victim.name}")


def assert_finished_identical(run: TrainingRun, trainers: list[TorchtitanTrainer], steps: int, *,
                              optimizer: bool) -> None:
    """Every group exits 0 with its final checkpoint at ``steps``; the model (and with
    ``optimizer`` the optimizer state: DiLoCo's inner optimizers are each group's own) is equal
    tensor by tensor across groups."""
    results = run.wait_finished(trainers)
    run.check(all(r["final_step"] == steps for r in results), f"final steps {[r['final_step'] for r in results]}")
    states = [final_state(t.checkpoint_dir()) for t in trainers]
    for t, state in zip(trainers[1:], states[1:]):
        problems = [p for p in compare_states(states[0], state)
                    if optimizer or not p.startswith(("optimizer.", "lr_scheduler.", "train_state."))]
        run.check(not problems, f"{trainers[0].name} and {t.name} end with different state "
                                f"({len(problems)} differences): " + "; ".join(problems[:8]))
    run.note(f"final checkpoints at step {steps} equal across {len(trainers)} groups "
             f"({results[0]['tensors']} entries, model sha256 {results[0]['model_sha256'][:12]})")


def assert_no_failed_step(run: TrainingRun, trainers: list[TorchtitanTrainer]) -> None:
    for t in trainers:
        problems = t.seamless_problems()
        run.check(not problems, "; ".join(problems))


def committed(t: TorchtitanTrainer, rank: int = 0) -> int:
    return sum(ok for _, ok in t.commits(rank))


# -- in every CI run: one run per SDK line ------------------------------------------------------------


@pytest.mark.parametrize("line", ["ftclient"])
def test_per_step_survives_a_leader_kill_and_a_group_kill(run: TrainingRun, line: str) -> None:
    """(a) then (b), per-step on ftclient with the asynchronous quorum."""
    steps = 40
    start_cluster(run, 1)
    g0, g1 = start_groups(run, line, steps=steps, args=PER_STEP)
    run.wait_all_steps(3, timeout=STARTUP_S)
    failover_s = kill_leader(run)
    run.wait_all_steps(8, timeout=60)
    # (a): the leader's death failed no step of either group (before the group kill below).
    assert_no_failed_step(run, [g0, g1])
    kill_and_restart(run, g1, g0, alone_steps=2)
    run.wait_until(f"{g1.name} to heal from {g0.name}", lambda: g1.heals() >= 1, STARTUP_S)
    assert_finished_identical(run, [g0, g1], steps, optimizer=True)
    # (b): the survivor trained alone and then with the healed group; never restarted itself.
    run.check(g0.incarnation == 0 and g1.incarnation == 1, "only the killed group restarted")
    logged = [s for s, _ in g1.steps_logged()]
    run.check(bool(logged) and logged[0] > 8 and logged[-1] == steps,
              f"the restarted group's steps should start past the kill (healed) and end at {steps}: {logged}")
    print(f"\n{line} per-step: failover {failover_s:.2f}s; survivor committed {committed(g0)} of {steps} steps; "
          f"restarted group healed and trained steps {logged[0]}-{logged[-1]}")


@pytest.mark.parametrize("line", ["0.2.0", "nightly"])
def test_diloco_survives_a_leader_kill_and_a_group_kill(run: TrainingRun, line: str) -> None:
    """(c) on the torchft lines: DiLoCo (a synchronous quorum per synchronisation)."""
    steps = 4 * SYNC_EVERY
    start_cluster(run, 2)
    g0, g1 = start_groups(run, line, steps=steps, args=DILOCO, min_replica_size=2)
    run.wait_all_steps(1, timeout=STARTUP_S)
    failover_s = kill_leader(run)  # at the first synchronisation: Quorum calls wait then
    run.wait_until("a synchronisation committed by both groups after the leader kill",
                   lambda: committed(g0) >= 1 and committed(g1) >= 1, 90)
    assert_no_failed_step(run, [g0, g1])
    run.wait_all_steps(SYNC_EVERY + 2, timeout=60)
    kill_and_restart(run, g1, g0, alone_steps=0)
    run.wait_until(f"{g1.name} to heal from {g0.name}", lambda: g1.heals() >= 1, STARTUP_S)
    assert_finished_identical(run, [g0, g1], steps, optimizer=False)
    print(f"\n{line} DiLoCo: failover {failover_s:.2f}s; restarted group healed; "
          f"synchronisations committed {committed(g0)} / {committed(g1)}")


# -- the full matrix (-m torchtitan_full) ---------------------------------------------------------------


@FULL
def test_ftclient_diloco_survives_a_leader_kill(run: TrainingRun) -> None:
    """(c) on ftclient."""
    steps = 3 * SYNC_EVERY
    start_cluster(run, 2)
    g0, g1 = start_groups(run, "ftclient", steps=steps, args=DILOCO, min_replica_size=2)
    run.wait_all_steps(1, timeout=STARTUP_S)
    kill_leader(run)
    assert_finished_identical(run, [g0, g1], steps, optimizer=False)
    assert_no_failed_step(run, [g0, g1])
    run.check(committed(g0) == steps // SYNC_EVERY, f"{g0.name} committed {committed(g0)} synchronisations")


@FULL
@pytest.mark.parametrize("line", ["0.2.0", "nightly"])
def test_torchft_per_step_survives_a_leader_kill_with_one_group(run: TrainingRun, line: str) -> None:
    """(a) on the torchft lines, with one replica group: no heal, so no donor crash."""
    steps = 20
    start_cluster(run, 1)
    (g0,) = start_groups(run, line, steps=steps, args=PER_STEP, groups=1)
    run.wait_all_steps(3, timeout=STARTUP_S)
    kill_leader(run, while_calls_wait=False)
    run.wait_finished([g0])
    assert_no_failed_step(run, [g0])
    run.check(committed(g0) == steps, f"{g0.name} committed {committed(g0)} of {steps} steps")


@FULL
@pytest.mark.parametrize("line", ["0.2.0", "nightly"])
def test_torchft_donor_crashes_when_a_peer_heals_per_step(run: TrainingRun, line: str) -> None:
    """The upstream bug, on torchtitan's own trainer: per-step mode, two groups, one heals from
    the other (torchft's ``init_sync`` at step 0, or a late group) and the donor dies of the state
    dict taken under its forward. ftclient passes the same run
    (``test_per_step_survives_a_leader_kill_and_a_group_kill``)."""
    start_cluster(run, 1)
    groups = start_groups(run, line, steps=10, args=PER_STEP)
    # Not run.wait_until: a trainer exiting non-zero is what this test waits for.
    wait_for("a donor to crash, or every group to exit",
             lambda: any(t.donor_crashed() for t in groups) or all(t.returncode() is not None for t in groups),
             FINISH_S, interval=0.2)
    run.wait_until("the crashed donor to exit", lambda: any(t.returncode() not in (None, 0) for t in groups), 60)
    crashed = [t.name for t in groups if t.returncode() not in (None, 0) and t.donor_crashed()]
    run.check(bool(crashed), "no torchft donor crashed of a state dict taken under forward "
                             f"(exit codes {[t.returncode() for t in groups]}); heals: {[t.heals() for t in groups]}")
    print(f"\n{line}: donor {crashed} crashed (state dict under FSDP2's forward)")


@FULL
@pytest.mark.parametrize("mode", ["per-step", "diloco"])
def test_two_ranks_per_group_with_fsdp_on_ftclient(run: TrainingRun, mode: str) -> None:
    """(d) two ranks per group, FSDP2 over them, on ftclient: per-step with a leader kill and a
    group kill (both ranks of the new group heal their shards), and DiLoCo with a leader kill.
    Both ranks of a group always decide alike. (torchft-nightly in DiLoCo with two ranks per group
    did not get past its step-0 heal here: docs/torchtitan.md.)"""
    start_cluster(run, 1 if mode == "per-step" else 2)
    if mode == "per-step":
        steps = 30
        g0, g1 = start_groups(run, "ftclient", steps=steps, args=[*PER_STEP, *FSDP2], nproc=2)
        run.wait_all_steps(3, timeout=STARTUP_S * 1.5)
        kill_leader(run)
        run.wait_all_steps(6, timeout=90)
        assert_no_failed_step(run, [g0, g1])
        kill_and_restart(run, g1, g0, alone_steps=2)
        run.wait_until(f"{g1.name} to heal", lambda: g1.heals(0) >= 1 and g1.heals(1) >= 1, STARTUP_S * 1.5)
        assert_finished_identical(run, [g0, g1], steps, optimizer=True)
    else:
        steps = 3 * SYNC_EVERY
        g0, g1 = start_groups(run, "ftclient", steps=steps, args=[*DILOCO, *FSDP2], nproc=2, min_replica_size=2)
        run.wait_all_steps(1, timeout=STARTUP_S * 1.5)
        kill_leader(run)
        assert_finished_identical(run, [g0, g1], steps, optimizer=False)
        assert_no_failed_step(run, [g0, g1])
    for t in (g0, g1):
        run.check(t.commits(0) == t.commits(1), f"{t.name}: its two ranks decided differently: "
                                                f"{t.commits(0)} vs {t.commits(1)}")
