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
checkpoint transfer, ``TORCHFT_QUORUM_TIMEOUT_SEC=30`` a quorum. Every wait has a deadline; the
harness kills every trainer and node whatever happens, and a failure message carries the events,
the trainers' output tails and the lighthouse logs. Each test prints a one-line summary (``-s``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch  # noqa: F401 -- the example's trainers need it: without it this fails here, not in each subprocess

from lighthouse_cluster.local.cluster import LocalCluster
from support.trainer_process import ROOT, TrainerProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

EXAMPLE = ROOT / "examples" / "train_diloco.py"
JOIN_TIMEOUT_MS = 1_000
BASE_ENV = {
    "TORCHFT_TIMEOUT_SEC": "10",
    "TORCHFT_QUORUM_TIMEOUT_SEC": "30",
    "TORCHFT_CONNECT_TIMEOUT_SEC": "10",
    "PYTHONUNBUFFERED": "1",
}
DROPPED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "TORCHFT_QUORUM_RETRIES", "TORCHFT_MANAGER_PORT", "TORCHFT_LIGHTHOUSE", "TORCHFT_USE_BUCKETIZATION")
RUN_S = 90.0  # bound on any one run of trainers, start to exit
# Streaming DiLoCo: 2 fragments, a round is 2 inner steps, averages in flight for 1 of them.
DILOCO = ["--fragments", "2", "--sync-every", "4", "--fragment-sync-delay", "1"]

ROUND_LINE = re.compile(
    r"^group=(?P<group>\d+) round=(?P<round>\d+) step=(?P<step>\d+) fragment=(?P<fragment>\S+) loss=(?P<loss>\S+) "
    r"quorum_id=(?P<quorum_id>-?\d+) participants=(?P<participants>\d+) committed=(?P<committed>True|False) "
    r"healed=(?P<healed>True|False)", re.MULTILINE)


@dataclass(kw_only=True)
class Trainer(TrainerProcess):
    """One replica group: one process of the example."""

    args: list[str]

    @property
    def output_path(self) -> Path:
        return self.workdir / f"{self.name}.json"

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
        env.update(BASE_ENV)
        env.update(TORCHFT_LIGHTHOUSE=self.lighthouse, REPLICA_GROUP_ID=str(self.group))
        return env

    def command(self) -> list[str]:
        return [sys.executable, str(EXAMPLE), "--output", str(self.output_path), "--log-level", "info", *self.args]

    def rounds(self) -> list[dict[str, Any]]:
        return [{"round": int(m["round"]), "step": int(m["step"]), "fragment": m["fragment"],
                 "quorum_id": int(m["quorum_id"]), "participants": int(m["participants"]),
                 "committed": m["committed"] == "True", "healed": m["healed"] == "True"}
                for m in ROUND_LINE.finditer(self.output())]

    def result(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.output_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def tail(self, lines: int = 25) -> str:
        text = self.output().splitlines() or ["(no output)"]
        rc = self.process.poll() if self.process else "-"
        return "\n".join([f"--- trainer {self.name} (rc {rc}) {self.log_path} ---",
                          *[line[:400] for line in text[-lines:]]])


@dataclass
class Harness:
    root: Path
    cluster: LocalCluster | None = None
    trainers: list[Trainer] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)

    def note(self, what: str) -> None:
        self.events.append(f"{time.monotonic() - self.t0:7.2f}s {what}")

    def start_cluster(self, min_replicas: int) -> LocalCluster:
        self.cluster = LocalCluster(root=self.root / "cluster", nodes=3, min_replicas=min_replicas,
                                    join_timeout_ms=JOIN_TIMEOUT_MS)
        self.cluster.start()
        try:
            leader = self.cluster.wait_for_leader(timeout=30)
        except (TimeoutError, RuntimeError) as e:
            self.fail(f"the cluster elected no leader: {e}")
        self.note(f"cluster up, leader n{leader + 1}")
        return self.cluster

    def trainer(self, group: int, args: list[str], start: bool = True) -> Trainer:
        assert self.cluster is not None
        t = Trainer(group=group, lighthouse=self.cluster.endpoints, workdir=self.root, args=args)
        self.trainers.append(t)
        if start:
            t.start()
            self.note(f"started {t.name}")
        return t

    def wait_until(self, what: str, predicate: Callable[[], bool], timeout: float = RUN_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                self.note(what)
                return
            for t in self.trainers:
                rc = t.process.poll() if t.process is not None else None
                if rc not in (None, 0, -signal.SIGKILL):  # SIGKILL: ours
                    self.fail(f"trainer {t.name} exited with {rc} while waiting for: {what}")
            time.sleep(0.02)
        self.fail(f"timed out after {timeout:.0f}s waiting for: {what}")

    def wait_finished(self, trainers: list[Trainer], timeout: float = RUN_S) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        for t in trainers:
            assert t.process is not None
            try:
                rc = t.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.fail(f"trainer {t.name} still running after {timeout:.0f}s")
            if rc != 0:
                self.fail(f"trainer {t.name} exited with {rc}")
        self.note("every trainer finished")
        results = []
        for t in trainers:
            r = t.result()
            if r is None:
                self.fail(f"trainer {t.name} wrote no summary")
            results.append(r)
        return results

    def fail(self, msg: str) -> None:
        parts = [msg, "events:", *self.events, *[t.tail() for t in self.trainers]]
        if self.cluster is not None:
            parts.append(self.cluster.tail_logs(10))
        pytest.fail("\n".join(parts), pytrace=False)

    def close(self) -> None:
        for t in self.trainers:
            t.kill()
        if self.cluster is not None:
            self.cluster.stop_all()


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(tmp_path)
    try:
        yield h
    finally:
        h.close()


def assert_identical(h: Harness, results: list[dict[str, Any]]) -> None:
    digests = {(r["params_sha256"], r["outer_sha256"], r["final_step"]) for r in results}
    if len(digests) != 1:
        h.fail(f"replica groups ended differently: {sorted(digests)}")


def summary(name: str, h: Harness, results: list[dict[str, Any]], **extra: Any) -> None:
    durations = [r["duration_s"] for res in results for r in res["rounds"]]
    print(f"\n[{name}] {time.monotonic() - h.t0:.1f}s final_step={results[0]['final_step']} "
          f"eval_loss={results[0]['eval_loss']:.3f} rounds/group={[len(r['rounds']) for r in results]} "
          f"slowest_round={max(durations):.2f}s " + " ".join(f"{k}={v}" for k, v in extra.items()))
    print("  timeline: " + " | ".join(e.strip() for e in h.events))


# -- tests ----------------------------------------------------------------------------------------


def test_healthy_diloco_groups_end_identical(harness: Harness) -> None:
    h = harness
    h.start_cluster(min_replicas=3)
    args = [*DILOCO, "--fragment-update-alpha", "0.5", "--bucket-cap-mb", "0.003", "--rounds", "8"]
    trainers = [h.trainer(g, args) for g in range(3)]
    results = h.wait_finished(trainers)
    assert_identical(h, results)
    for t, r in zip(trainers, results):
        rounds = r["rounds"]
        assert [x["step"] for x in rounds] == list(range(1, 9)), t.name
        assert all(x["committed"] and x["participants"] == 3 for x in rounds), rounds
        assert [x["fragment"] for x in rounds] == [0, 1] * 4
        assert len({x["quorum_id"] for x in rounds}) == 1  # the same members all along: one quorum
    # init_sync: the groups that are not the primary load the primary's state at step 0.
    assert sum(r["rounds"][0]["healed"] for r in results) == 2
    summary("healthy diloco", h, results, quorum_id=results[0]["rounds"][0]["quorum_id"])


def test_healthy_local_sgd_groups_end_identical(harness: Harness) -> None:
    h = harness
    h.start_cluster(min_replicas=2)
    trainers = [h.trainer(g, ["--algorithm", "localsgd", "--sync-every", "3", "--rounds", "6"]) for g in range(2)]
    results = h.wait_finished(trainers)
    assert_identical(h, results)
    for r in results:
        assert all(x["committed"] and x["participants"] == 2 for x in r["rounds"]) and r["final_step"] == 6
    summary("healthy localsgd", h, results)


def test_crashed_group_restarts_and_heals_the_whole_state(harness: Harness) -> None:
    h = harness
    h.start_cluster(min_replicas=2)
    args = [*DILOCO, "--step-sleep", "0.05", "--rounds", "12", "--min-final-participants", "3", "--final-rounds", "4"]
    a, b, c = (h.trainer(g, args) for g in range(3))
    h.wait_until("every group committed 3 rounds with 3 participants",
                 lambda: all(sum(x["committed"] and x["participants"] == 3 for x in t.rounds()) >= 3
                             for t in (a, b, c)))
    c.kill()  # right after its round line: between synchronisations
    killed_at = max(x["step"] for x in c.rounds())
    h.note(f"SIGKILLed {c.name} at step {killed_at}")
    h.wait_until("the survivors committed 2 rounds without it",
                 lambda: all(sum(x["committed"] and x["participants"] == 2 for x in t.rounds()) >= 2 for t in (a, b)))
    c.restart()
    h.note(f"restarted as {c.name}")
    results = h.wait_finished([a, b, c])
    assert_identical(h, results)

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


def test_group_joining_mid_run_is_brought_in_at_the_next_synchronisation(harness: Harness) -> None:
    h = harness
    h.start_cluster(min_replicas=2)
    args = [*DILOCO, "--fragment-update-alpha", "0.25", "--step-sleep", "0.05", "--rounds", "6",
            "--min-final-participants", "3", "--final-rounds", "3"]
    a, b = h.trainer(0, args), h.trainer(1, args)
    h.wait_until("two groups committed 3 rounds", lambda: all(len(t.rounds()) >= 3 for t in (a, b)))
    c = h.trainer(2, args)
    results = h.wait_finished([a, b, c])
    assert_identical(h, results)
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


def test_commit_failure_bumps_quorum_id_and_is_retried(harness: Harness) -> None:
    h = harness
    h.start_cluster(min_replicas=2)
    base = [*DILOCO, "--rounds", "8"]
    a = h.trainer(0, [*base, "--fail-commit-at-step", "3"])
    b = h.trainer(1, base)
    ra, rb = h.wait_finished([a, b])
    assert_identical(h, [ra, rb])
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


def test_leader_sigkill_between_synchronisations_costs_no_round(harness: Harness) -> None:
    h = harness
    cluster = h.start_cluster(min_replicas=2)
    # One fragment, 4 inner steps of >= 0.2 s between synchronisations.
    args = ["--fragments", "1", "--sync-every", "4", "--fragment-sync-delay", "0", "--step-sleep", "0.2",
            "--rounds", "7"]
    a, b = h.trainer(0, args), h.trainer(1, args)
    h.wait_until("both groups committed 3 rounds", lambda: all(len(t.rounds()) >= 3 for t in (a, b)))
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
    assert_identical(h, [ra, rb])
    for r in (ra, rb):
        rounds = r["rounds"]
        assert [x["step"] for x in rounds] == list(range(1, 8)), rounds
        assert all(x["committed"] and x["participants"] == 2 for x in rounds), rounds
        assert len({x["quorum_id"] for x in rounds}) == 1, rounds  # the same quorum across the failover
    around = [x["duration_s"] for x in ra["rounds"] if x["step"] in (at_step + 1, at_step + 2)]
    summary("leader SIGKILL", h, [ra, rb], killed_after_step=at_step,
            rounds_after_kill_s=[round(d, 2) for d in around])
