"""A trainer cut off from the cluster and from its peers by a real network partition (#15).

Six network namespaces on one bridge (``jepsen_like.netns``): the three lighthouse nodes in the
first three, one ftclient replica group (``tests/support/liveness_trainer.py``) in each of the
others, every group advertising its namespace's address (store, manager server, checkpoints,
Gloo on ``eth0``). The cluster runs torchft's default 5 s heartbeat timeout and the 10 s join
timeout of torchft's guides; the groups keep liveness streams open to the leader.

Group 2 is then isolated from every other namespace, both ways (packets dropped: nothing is
closed, so neither side sees a reset). Checked:

* the leader declares it dead once its keep-alives have stopped for the liveness timeout and
  tells the others; their allreduce waiting for it is aborted, the step is not committed, and
  they commit steps without it about a second after the cut, not after the 5 s heartbeat timeout
  or the 15 s collective timeout;
* after the heal it rejoins without a restart: its stream reconnects, the leader tells it that it
  was declared dead (so its own allreduce, stuck on the quorum the others left, fails at once),
  it heals from a peer and trains with them again;
* every group ends with identical parameters; no process was restarted.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from jepsen_like import netns
from support.trainer_process import LivenessTrainer
from support.training import TrainingRun

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240), pytest.mark.quiet]  # quiet: beside quiet tests only (conftest)

NODES = 3
GROUPS = 3
VICTIM = 2
HEARTBEAT_TIMEOUT_MS = 5_000  # torchft's default
JOIN_TIMEOUT_MS = 10_000  # torchft's and torchtitan's guides
LIVENESS_TIMEOUT_S = 0.5  # the nodes' default --liveness-timeout-ms
# The survivors' first commit without the victim: the liveness timeout, the notice, the abort
# grace and a new quorum, on 2 loaded cores. Without liveness it is the 5 s heartbeat timeout at
# best (and the 15 s collective timeout for the allreduce in flight).
SURVIVOR_BOUND_S = 2.5
PARTITION_S = 4.0  # how long the victim stays cut off, at least
STEPS = 12
# The survivors compute for this long per step, the victim not at all: the victim spends most of
# each step in its allreduce, waiting for them, where the cut catches it.
SURVIVOR_STEP_S = 0.2
START_S = 90.0


@pytest.fixture
def net() -> Iterator[netns.NetnsNetwork]:
    ok, why = netns.available()
    if not ok:
        pytest.skip(f"network namespaces unavailable: {why}")
    network = netns.NetnsNetwork(NODES + GROUPS).setup()
    try:
        yield network
    finally:
        network.teardown()


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[TrainingRun]:
    with TrainingRun(tmp_path, finish_timeout=120) as run:
        yield run


def first(records: list[dict[str, Any]], ending_after: float, **where: Any) -> dict[str, Any] | None:
    """The first step record that ended after ``ending_after`` with the fields ``where``."""
    return next((r for r in records if r["t_end"] > ending_after and all(r[k] == v for k, v in where.items())), None)


def test_a_cut_off_trainer_is_declared_dead_its_peers_go_on_and_it_rejoins_after_the_heal(
        net: netns.NetnsNetwork, harness: TrainingRun) -> None:
    cluster = harness.start_cluster(min_replicas=2, hosts=net.addresses[:NODES], launch_prefix=net.exec_prefix,
                                    join_timeout_ms=JOIN_TIMEOUT_MS, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    groups = [LivenessTrainer(group=g, lighthouse=cluster.endpoints, workdir=harness.root, steps=STEPS,
                              min_replica_size=2, min_final_participants=GROUPS,
                              step_sleep=0.0 if g == VICTIM else SURVIVOR_STEP_S,
                              host=net.address(NODES + g), launch_prefix=net.exec_prefix(NODES + g),
                              env={"GLOO_SOCKET_IFNAME": "eth0"})
              for g in range(GROUPS)]
    victim, survivors = groups[VICTIM], [g for i, g in enumerate(groups) if i != VICTIM]
    harness.start(groups)
    harness.wait_all_steps(4, timeout=START_S)

    def in_allreduce() -> bool:
        events = victim.events()
        return bool(events) and events[-1]["kind"] == "allreduce"

    harness.wait_until(f"{victim.name} in an allreduce", in_allreduce, 30, interval=0.005)
    cut_at = time.time()
    net.isolate(NODES + VICTIM)
    harness.note(f"cut {victim.name} ({net.address(NODES + VICTIM)}) off from the cluster and its peers "
                 f"in its allreduce of step {victim.step()}")

    lines = []
    for s in survivors:
        commit = harness.wait_until(f"{s.name} to commit a step without {victim.name}",
                                    lambda s=s: first(s.records(), cut_at, committed=True, participants=2),
                                    30)
        waited = commit["t_end"] - cut_at
        failed = [r for r in s.records()
                  if r["t_end"] > cut_at and r["t_start"] < commit["t_start"] and not r["committed"]]
        harness.check(waited < SURVIVOR_BOUND_S,
                      f"{s.name} committed without {victim.name} only {waited:.2f}s after the cut")
        lines.append(f"{s.name}: committed step {commit['step']} with 2 participants {waited:.2f}s after the cut "
                     f"(quorum {commit['quorum_id']}; {len(failed)} step(s) failed in between"
                     f"{': ' + str(failed[0]['errored'])[:100] if failed else ''})")
        notices = [line for line in s.output().splitlines() if "liveness notice" in line]
        harness.check(bool(notices), f"{s.name} logged no liveness notice")
    leader_logs = "\n".join(m.log_path.read_text(errors="replace") for m in cluster.members)
    harness.check(f"liveness_{VICTIM}" in leader_logs and "keep-alives stopped" in leader_logs,
                  f"no node declared {victim.name} dead for its stopped keep-alives")

    # The partition lasts: the survivors go on training without it meanwhile.
    harness.wait_until("the survivors to commit 3 steps each without the victim",
                       lambda: all(sum(r["committed"] and r["participants"] == 2 and r["t_start"] > cut_at
                                       for r in s.records()) >= 3 for s in survivors), 30)
    time.sleep(max(0.0, cut_at + PARTITION_S - time.time()))  # the fault's duration
    heal_at = time.time()
    net.heal()
    harness.note(f"healed the partition after {heal_at - cut_at:.1f}s")

    # A quorum issued after the heal (the victim's answer for the old one may only arrive now).
    alone = max(r["quorum_id"] for s in survivors for r in s.records() if r["t_end"] < heal_at)
    rejoined = harness.wait_until(
        f"{victim.name} to train with both peers again",
        lambda: next((r for r in victim.records() if r["t_end"] > heal_at and r["committed"]
                      and r["participants"] == GROUPS and r["quorum_id"] > alone), None), 60)
    told = [line for line in victim.output().splitlines() if "this replica was declared dead" in line]
    harness.check(bool(told), f"{victim.name} was not told that it had been declared dead")
    healed = [r for r in victim.records() if r["t_end"] > heal_at and r["healed"]]
    harness.check(bool(healed), f"{victim.name} did not heal from a peer after the partition")
    # The victim's step that was waiting when the partition healed (for its quorum or its allreduce).
    waiting = first(victim.records(), heal_at)
    assert waiting is not None

    results = harness.wait_finished(groups)
    harness.assert_identical(results, STEPS)
    for g in groups:
        harness.assert_one_process(g)
    print(f"\ntrainer partition ({heal_at - cut_at:.1f}s):\n  " + "\n  ".join(lines)
          + f"\n  {victim.name}: its step waiting at the heal (started {waiting['t_start'] - cut_at:+.2f}s after the "
          f"cut) ended {waiting['t_end'] - heal_at:.2f}s after the heal, "
          f"{'committed' if waiting['committed'] else 'failed: ' + str(waiting['errored'])[:100]}; trained with both "
          f"peers {rejoined['t_end'] - heal_at:.2f}s after the heal (step {rejoined['step']}, quorum "
          f"{rejoined['quorum_id']}), healed at step {healed[0]['step_after']}; identical digests at step "
          f"{results[0]['final_step']}")
