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
* the same example on torchft 0.2.0 itself (``--sdk torchft``): two groups, each given one node of
  the cluster as torchft takes one URL, train to identical parameters; a comma-separated
  ``TORCHFT_LIGHTHOUSE`` is refused at once with a one-line error.

Settings: ``join_timeout_ms=1000`` (survivors wait 1 s, not 60 s, for a dead group that is
still heartbeat-healthy); ``TORCHFT_TIMEOUT_SEC=15`` bounds collectives, commit and checkpoint
transfer; ``TORCHFT_QUORUM_TIMEOUT_SEC=30`` a quorum. Where every group must be in every quorum
from step 0 the lighthouse's ``min_replicas`` is the number of groups (the first quorum waits
for the slowest starter instead of a late group healing in).

Every wait has a deadline; the harness kills every trainer (its whole process group: the ranks
the example started too), every node and the Rust lighthouse whatever happens; a failure
message carries the events, the trainers' output tails and the lighthouse logs. Each test prints
a one-line summary with its measurements (``-s``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any, Callable, Iterator

import pytest

# The example's trainers need the examples extra (torch, scikit-learn): without it these imports
# fail here, naming the missing module, rather than in every trainer subprocess.
import sklearn  # noqa: F401
import torch  # noqa: F401

from lighthouse_cluster.local.cluster import LocalCluster, free_ports
from support.trainer_process import ROOT, TrainerProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

EXAMPLE = ROOT / "examples" / "train_ddp.py"

JOIN_TIMEOUT_MS = 1_000
BASE_ENV = {
    "TORCHFT_TIMEOUT_SEC": "15",
    "TORCHFT_QUORUM_TIMEOUT_SEC": "30",
    "TORCHFT_CONNECT_TIMEOUT_SEC": "10",
    "PYTHONUNBUFFERED": "1",
}
# Never inherited: the example would take them for torchrun's (or retry lighthouse calls).
DROPPED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "TORCHFT_QUORUM_RETRIES", "TORCHFT_MANAGER_PORT", "TORCHFT_LIGHTHOUSE")
START_S = 60.0  # every trainer process up (imports, manager, first quorum)
TRAINING_DEADLINE_S = 90.0

STEP_LINE = re.compile(r"^group=(?P<group>\d+)(?: rank=(?P<rank>\d+))? step=(?P<step>\d+) loss=(?P<loss>\S+) "
                       r"quorum_id=(?P<quorum_id>-?\d+) participants=(?P<participants>\d+) "
                       r"committed=(?P<committed>True|False)", re.MULTILINE)


# -- helpers ------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class Trainer(TrainerProcess):
    """One replica group: one process of the example (which may start more ranks itself)."""

    num_groups: int
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    nproc: int = 1
    sdk: str = "ftclient"

    @property
    def output_path(self) -> Path:
        return self.workdir / f"{self.name}.json"

    def output_paths(self) -> list[Path]:
        if self.nproc == 1:
            return [self.output_path]
        return [self.workdir / f"{self.name}.rank{r}.json" for r in range(self.nproc)]

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
        env.update(BASE_ENV)
        env.update(self.env)
        env.update(TORCHFT_LIGHTHOUSE=self.lighthouse, REPLICA_GROUP_ID=str(self.group),
                   NUM_REPLICA_GROUPS=str(self.num_groups))
        return env

    def command(self) -> list[str]:
        return [sys.executable, str(EXAMPLE), "--sdk", self.sdk, "--output", str(self.output_path),
                "--log-level", "info", "--nproc-per-group", str(self.nproc), *self.args]

    def steps(self, rank: int = 0) -> list[dict[str, Any]]:
        """The per-step lines printed so far by ``rank`` of this incarnation."""
        out = []
        for m in STEP_LINE.finditer(self.output()):
            if int(m["rank"] or 0) == rank:
                out.append({"step": int(m["step"]), "quorum_id": int(m["quorum_id"]),
                            "participants": int(m["participants"]), "committed": m["committed"] == "True"})
        return out

    def step(self) -> int:
        recs = self.steps()
        return recs[-1]["step"] if recs else -1

    def results(self) -> list[dict[str, Any] | None]:
        out = []
        for path in self.output_paths():
            try:
                out.append(json.loads(path.read_text()))
            except (FileNotFoundError, json.JSONDecodeError):
                out.append(None)
        return out

    def tail(self, lines: int = 30) -> str:
        text = self.output().splitlines() or ["(no output)"]
        rc = self.process.poll() if self.process else "-"
        return "\n".join([f"--- trainer {self.name} (pid {self.process.pid if self.process else '-'}, rc {rc}) "
                          f"{self.log_path} ---", *[line[:400] for line in text[-lines:]]])


@dataclass
class Harness:
    root: Path
    cluster: LocalCluster | None = None
    rust: subprocess.Popen[bytes] | None = None
    rust_log: Path | None = None
    trainers: list[Trainer] = field(default_factory=list)
    events: list[str] = field(default_factory=list)

    # lighthouses

    def start_cluster(self, min_replicas: int) -> LocalCluster:
        self.cluster = LocalCluster(root=self.root / "cluster", nodes=3, min_replicas=min_replicas,
                                    join_timeout_ms=JOIN_TIMEOUT_MS)
        self.cluster.start()
        try:
            leader = self.cluster.wait_for_leader(timeout=30)
        except (TimeoutError, RuntimeError) as e:
            self.fail(f"the cluster elected no leader: {e}")
        self.note(f"cluster up, leader n{leader + 1}, endpoints {self.cluster.endpoints}")
        return self.cluster

    def start_rust_lighthouse(self, min_replicas: int) -> str:
        binary = shutil.which("torchft_lighthouse")
        if binary is None:
            pytest.skip("torchft_lighthouse is not installed (pip install -e '.[interop]')")
        port = free_ports(1)[0]
        self.rust_log = self.root / "torchft_lighthouse.log"
        with open(self.rust_log, "ab") as log:
            self.rust = subprocess.Popen([binary, "--bind", f"127.0.0.1:{port}", "--min_replicas", str(min_replicas),
                                          "--join_timeout_ms", str(JOIN_TIMEOUT_MS)],
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)

        def listening() -> bool:
            with socket.socket() as s:
                s.settimeout(0.2)
                return s.connect_ex(("127.0.0.1", port)) == 0

        self.wait_until(lambda: listening() or self.rust.poll() is not None, 15, "torchft_lighthouse to listen")
        self.check(self.rust.poll() is None, f"torchft_lighthouse exited with {self.rust.poll()}")
        self.note(f"torchft_lighthouse on 127.0.0.1:{port}")
        return f"http://127.0.0.1:{port}"

    def lighthouse_logs(self) -> str:
        parts = []
        if self.cluster is not None:
            parts.append(self.cluster.tail_logs(lines=20))
        if self.rust_log is not None:
            try:
                text = self.rust_log.read_text(errors="replace").splitlines()[-20:]
            except FileNotFoundError:
                text = ["(no log)"]
            parts.append("\n".join([f"--- torchft_lighthouse ({self.rust_log}) ---", *text]))
        return "\n".join(parts)

    # trainers

    def start_trainers(self, n: int, lighthouse: str | list[str], args: list[str],
                       per_group: dict[int, list[str]] | None = None, nproc: int = 1,
                       env: dict[str, str] | None = None, sdk: str = "ftclient") -> list[Trainer]:
        """``n`` replica groups; ``lighthouse`` is every group's TORCHFT_LIGHTHOUSE, or one per group."""
        for g in range(n):
            url = lighthouse if isinstance(lighthouse, str) else lighthouse[g]
            t = Trainer(group=g, num_groups=n, lighthouse=url, workdir=self.root,
                        args=[*args, *(per_group or {}).get(g, [])], env=env or {}, nproc=nproc, sdk=sdk)
            t.start()
            self.trainers.append(t)
        self.note(f"{n} {sdk} trainers started against {lighthouse}")
        return self.trainers

    def note(self, event: str) -> None:
        self.events.append(f"{time.time():.3f} {event}")

    def diagnostics(self) -> str:
        return "\n".join(["events:", *self.events, *[t.tail() for t in self.trainers], self.lighthouse_logs()])

    def fail(self, message: str) -> None:
        pytest.fail(f"{message}\n{self.diagnostics()}", pytrace=False)

    def check(self, condition: bool, message: str) -> None:
        if not condition:
            self.fail(message)

    def wait_until(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            for t in self.trainers:
                rc = t.process.poll() if t.process is not None and not t.killed else None
                if rc is not None and rc != 0:
                    self.fail(f"trainer {t.name} exited with {rc} while waiting for {what}")
            time.sleep(0.05)
        self.fail(f"timed out after {timeout:.0f}s waiting for {what}")

    def wait_all_steps(self, step: int, timeout: float = START_S) -> None:
        self.wait_until(lambda: all(t.step() >= step for t in self.trainers), timeout,
                        f"every trainer at step >= {step}")

    def wait_finished(self, timeout: float = TRAINING_DEADLINE_S) -> list[dict[str, Any]]:
        """Every trainer exits 0 and wrote its output (one per rank); returns them all."""
        deadline = time.monotonic() + timeout
        for t in self.trainers:
            assert t.process is not None
            try:
                rc = t.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.fail(f"trainer {t.name} did not finish within {timeout:.0f}s")
            self.check(rc == 0, f"trainer {t.name} exited with {rc}")
        results = []
        for t in self.trainers:
            for path, r in zip(t.output_paths(), t.results()):
                self.check(r is not None, f"trainer {t.name} wrote no {path.name}")
                results.append(r)
        self.note("every trainer finished")
        return results

    def assert_identical(self, results: list[dict[str, Any]], min_step: int) -> None:
        steps = {r["final_step"] for r in results}
        self.check(len(steps) == 1 and min(steps) >= min_step, f"final steps differ or short: {sorted(steps)}")
        for key in ("params_sha256", "optim_sha256"):
            values = {(r["replica_group"], r["rank"]): r[key][:16] for r in results}
            self.check(len(set(values.values())) == 1, f"{key} differs between replica groups/ranks: {values}")

    def assert_one_process(self, trainer: Trainer, result: dict[str, Any]) -> None:
        self.check(trainer.incarnation == 0, f"{trainer.name} was restarted")
        assert trainer.process is not None
        if trainer.nproc == 1:
            self.check(result["pid"] == trainer.process.pid,
                       f"{trainer.name}: result from pid {result['pid']}, not {trainer.process.pid}")

    def assert_seamless(self, trainer: Trainer, result: dict[str, Any]) -> None:
        """One process; every step from the first committed exactly once, without error; no
        heal but the init sync of step 0."""
        self.assert_one_process(trainer, result)
        recs = result["steps"]
        bad = [r for r in recs if not r["committed"] or r["errored"] or (r["healed"] and r["step_before"] > 0)]
        self.check(not bad, f"{trainer.name}: steps not seamless: {bad[:5]}")
        steps = [r["step"] for r in recs]
        self.check(steps == list(range(1, len(steps) + 1)), f"{trainer.name}: steps not contiguous: {steps}")

    def kill_leader_while_calls_wait(self, timeout: float = 20.0,
                                     max_waiting_ms: int = 100) -> tuple[int, int, float, int]:
        """SIGKILL the serving leader as soon as it reports Quorum calls that have waited for a
        round for less than ``max_waiting_ms`` (so the round is not about to close: the calls are
        still in flight when it dies). Returns (node index, its term, kill time, calls waiting)."""
        cluster = self.cluster
        assert cluster is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            leader = cluster.leader_index()
            st = cluster.status(leader, timeout=0.5) if leader is not None else None
            if st is not None and st.serving and st.pending and max(p.waiting_ms for p in st.pending) < max_waiting_ms:
                cluster.kill(leader)
                return leader, st.term, time.time(), len(st.pending)
            time.sleep(0.01)
        self.fail(f"no Quorum call seen waiting at the leader within {timeout:.0f}s")
        raise AssertionError  # unreachable

    def close(self) -> None:
        for t in self.trainers:
            t.kill()
        if self.cluster is not None:
            self.cluster.stop_all()
        if self.rust is not None and self.rust.poll() is None:
            self.rust.kill()
            try:
                self.rust.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(root=tmp_path)
    try:
        yield h
    finally:
        h.close()


# -- tests ----------------------------------------------------------------------------------------


def test_three_groups_train_to_identical_parameters(harness: Harness) -> None:
    cluster = harness.start_cluster(min_replicas=3)
    steps = 20
    trainers = harness.start_trainers(3, cluster.endpoints, ["--steps", str(steps), "--step-sleep", "0.05",
                                                             "--min-replica-size", "2"])
    results = harness.wait_finished()
    harness.assert_identical(results, steps)
    for t, r in zip(trainers, results):
        harness.assert_seamless(t, r)
        harness.check(all(s["participants"] == 3 for s in r["steps"]), f"{t.name}: a step without all 3 groups")
        printed = t.steps()
        harness.check([p["step"] for p in printed] == list(range(1, steps + 1)),
                      f"{t.name}: printed steps {[p['step'] for p in printed]}")
        harness.check(f"params_sha256={r['params_sha256']}" in t.output(), f"{t.name}: no final digest line")
    first, last = results[0]["steps"][0]["loss"], results[0]["steps"][-1]["loss"]
    harness.check(results[0]["test_accuracy"] > 0.5 and last < first,
                  f"the model did not learn: loss {first} -> {last}, accuracy {results[0]['test_accuracy']}")
    print(f"\nhealthy: 3 groups x {steps} steps, median step "
          f"{median([s['duration_s'] for r in results for s in r['steps']]):.3f}s, loss {first:.3f} -> {last:.3f}, "
          f"test accuracy {results[0]['test_accuracy']:.3f}, digest {results[0]['params_sha256'][:12]}")


def test_killed_group_heals_from_a_peer(harness: Harness) -> None:
    cluster = harness.start_cluster(min_replicas=2)
    steps = 25
    trainers = harness.start_trainers(3, cluster.endpoints, ["--steps", str(steps), "--step-sleep", "0.1",
                                                             "--min-replica-size", "2",
                                                             "--min-final-participants", "3"])
    victim, survivors = trainers[1], [trainers[0], trainers[2]]
    harness.wait_all_steps(6)
    step_at_kill = victim.step()
    seen = {s.group: len(s.steps()) for s in survivors}
    victim.kill()
    killed_at = time.time()
    harness.note(f"SIGKILLed {victim.name} at step {step_at_kill}")

    def alone(t: Trainer) -> int:
        # Steps committed by only the two survivors since the kill.
        return sum(s["committed"] and s["participants"] == 2 for s in t.steps()[seen[t.group]:])

    harness.wait_until(lambda: all(alone(s) >= 2 for s in survivors), 30,
                       "the survivors to commit two steps without the killed group")
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


def test_leader_sigkill_fails_no_step(harness: Harness) -> None:
    cluster = harness.start_cluster(min_replicas=3)
    steps = 30
    # Group 2 is slow (data loading), so the others' Quorum calls wait at the leader every step.
    # No TORCHFT_QUORUM_RETRIES: the endpoint list alone must carry the calls over.
    trainers = harness.start_trainers(3, cluster.endpoints, ["--steps", str(steps), "--step-sleep", "0.05",
                                                             "--min-replica-size", "2"],
                                      per_group={2: ["--step-sleep", "0.3"]})
    harness.wait_all_steps(6)
    leader, old_term, killed_at, waiting = harness.kill_leader_while_calls_wait()
    steps_at_kill = [t.step() for t in trainers]
    harness.note(f"SIGKILLed leader n{leader + 1} (term {old_term}) with {waiting} Quorum calls waiting, "
                 f"at steps {steps_at_kill}")
    others = [i for i in range(cluster.nodes) if i != leader]
    try:
        new_leader = cluster.wait_for_leader(timeout=15, among=others, exclude_term=old_term)
    except (TimeoutError, RuntimeError) as e:
        harness.fail(f"no new leader: {e}")
    failover_s = time.time() - killed_at
    harness.note(f"new leader n{new_leader + 1} after {failover_s:.2f}s")

    results = harness.wait_finished()
    harness.assert_identical(results, steps)
    slowest, quorum_ids = [], set()
    for t, r in zip(trainers, results):
        harness.assert_seamless(t, r)
        after = [s for s in r["steps"] if s["t_start"] > killed_at + failover_s]
        harness.check(len(after) >= 5, f"{t.name}: only {len(after)} steps after the failover")
        around = [s for s in r["steps"] if s["t_end"] >= killed_at][:3]
        slowest.append(max((s["duration_s"] for s in around), default=0.0))
        quorum_ids |= {s["quorum_id"] for s in r["steps"]}
    rerouted = sum(len(re.findall(r"re-routing|re-sending", t.output())) for t in trainers)
    harness.check(rerouted > 0, "no trainer re-sent a lighthouse call: the kill did not hit a call in flight")
    normal = median([s["duration_s"] for r in results[:2] for s in r["steps"]])
    print(f"\nleader kill: {waiting} calls waiting at the kill, steps {steps_at_kill}; new leader after "
          f"{failover_s:.2f}s; slowest step around the kill {max(slowest):.2f}s (median fast-group step "
          f"{normal:.3f}s); {rerouted} lighthouse calls re-sent; quorum ids {sorted(quorum_ids)}; every step "
          f"committed, no restart, TORCHFT_QUORUM_RETRIES unset")


def test_two_ranks_per_replica_group(harness: Harness) -> None:
    cluster = harness.start_cluster(min_replicas=2)
    steps = 10
    harness.start_trainers(2, cluster.endpoints, ["--steps", str(steps), "--step-sleep", "0.05",
                                                  "--min-replica-size", "2"], nproc=2)
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


def test_quorum_timeout_raises_within_the_configured_time(harness: Harness) -> None:
    cluster = harness.start_cluster(min_replicas=2)
    timeout_s = 3.0
    # One group where the lighthouse needs two: the quorum can never form.
    (trainer,) = harness.start_trainers(1, cluster.endpoints, ["--steps", "5", "--min-replica-size", "2"],
                                        env={"TORCHFT_QUORUM_TIMEOUT_SEC": f"{timeout_s:g}"})
    assert trainer.process is not None
    harness.wait_until(lambda: "pid=" in trainer.output() or trainer.process.poll() is not None, START_S,
                       "the trainer to start training")
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
    harness.check(not trainer.steps(), f"a step was printed: {trainer.steps()}")
    print(f"\nquorum timeout: TORCHFT_QUORUM_TIMEOUT_SEC={timeout_s:g}, exit 1 after {elapsed:.2f}s: {error[-1][:200]}")


def test_trains_against_torchft_rust_lighthouse(harness: Harness) -> None:
    lighthouse = harness.start_rust_lighthouse(min_replicas=2)
    steps = 10
    trainers = harness.start_trainers(2, lighthouse, ["--steps", str(steps), "--step-sleep", "0.05",
                                                      "--min-replica-size", "2"])
    results = harness.wait_finished()
    harness.assert_identical(results, steps)
    for t, r in zip(trainers, results):
        harness.assert_seamless(t, r)
    print(f"\ntorchft_lighthouse: 2 groups x {steps} steps, identical digests {results[0]['params_sha256'][:12]}, "
          f"median step {median([s['duration_s'] for r in results for s in r['steps']]):.3f}s")


def test_torchft_sdk_trains_against_the_cluster(harness: Harness) -> None:
    """``--sdk torchft``: torchft 0.2.0's own Manager, DDP, Optimizer and sampler, unchanged, each
    replica group given one node's URL (torchft takes one), so one of them talks to a follower."""
    import torchft  # noqa: F401 -- the interop extra: a missing torchft fails this test
    cluster = harness.start_cluster(min_replicas=2)
    steps = 15
    urls = [f"http://{a}" for a in cluster.client_addresses[:2]]
    trainers = harness.start_trainers(2, urls, ["--steps", str(steps), "--step-sleep", "0.05",
                                                "--min-replica-size", "2"], sdk="torchft")
    results = harness.wait_finished()
    harness.assert_identical(results, steps)
    for t, r in zip(trainers, results):
        harness.check(r["sdk"] == "torchft" and f"sdk=torchft replica_group {t.group}/2" in t.output()
                      and f"lighthouse={t.lighthouse} " in t.output(), f"{t.name}: not torchft on {t.lighthouse}")
        harness.assert_seamless(t, r)
        harness.check(all(s["participants"] == 2 and s["quorum_id"] >= 1 for s in r["steps"]),
                      f"{t.name}: a step without both groups or without a quorum id: {r['steps'][:3]}")
        harness.check(r["batches_committed"] == 2 * steps, f"{t.name}: batches_committed {r['batches_committed']}")
        harness.check("torchft.manager" in t.output(), f"{t.name}: no log line from torchft's Manager")
    losses = [s["loss"] for s in results[0]["steps"]]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    harness.check(results[0]["test_accuracy"] > 0.5 and last < first,
                  f"the model did not learn: mean loss {first:.3f} -> {last:.3f}, "
                  f"accuracy {results[0]['test_accuracy']}")
    # The cluster issued the quorum: both torchft managers are its members.
    st = cluster.status(cluster.wait_for_leader())
    members = sorted(p.replica_id.split(":")[0] for p in st.quorum.participants)
    harness.check(members == ["train_ddp_0", "train_ddp_1"], f"the cluster's last quorum: {members}")
    print(f"\ntorchft 0.2.0 on the cluster: 2 groups x {steps} steps via {urls}, mean loss {first:.3f} -> "
          f"{last:.3f}, test accuracy {results[0]['test_accuracy']:.3f}, identical digests "
          f"{results[0]['params_sha256'][:12]}")


def test_torchft_sdk_refuses_a_url_list(tmp_path: Path) -> None:
    """torchft's client takes one URL (with a list it waits out its connect timeout, then fails with
    "invalid URI"): the example says so in one line and exits 2 before it imports torch."""
    ports = free_ports(3)  # nothing listens there: were the list let through, nothing would answer
    urls = ",".join(f"http://127.0.0.1:{p}" for p in ports)
    env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
    env.update(TORCHFT_LIGHTHOUSE=urls, TORCHFT_CONNECT_TIMEOUT_SEC="60", PYTHONPATH=str(ROOT))
    started = time.monotonic()
    res = subprocess.run([sys.executable, str(EXAMPLE), "--sdk", "torchft", "--steps", "5"], env=env, cwd=tmp_path,
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
