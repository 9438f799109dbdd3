"""torchtitan as its users feel it: step time and what faults cost, side by side.

``python -m benchmarks torchtitan`` runs torchtitan 0.3.0's own fault-tolerant trainer
(``--module torchft.llama3 --config llama3_torchft_debugmodel --fault_tolerance.enable``, two
replica groups of one rank each, ``--fault_tolerance.process_group gloo``), each group a
``torchrun --standalone`` of ``examples/torchtitan/cpu_shim.py`` (on CPU; with an accelerator the
shim leaves the device alone), against each system in turn:

* ``torchft-lighthouse``: torchft 0.2.0 on torchft's Rust ``torchft_lighthouse``;
* ``torchft-cluster``: torchft 0.2.0 on our 3-node cluster (one URL: a follower, the node the
  benchmark does not kill; followers forward to the leader);
* ``ftclient-cluster``: ftclient (``torchrun -m ftclient.as_torchft``, the trainer unedited) on the
  cluster (the list of every node);
* ``ftclient-cluster-per-step`` (extra column): ftclient in per-step mode, torchft's asynchronous
  quorum.

**Training mode.** The three compared columns run DiLoCo with a synchronisation every step
(``--fault_tolerance.semi_sync_method diloco --fault_tolerance.sync_steps 1
--fault_tolerance.num_fragments 1``): a synchronous quorum and an outer allreduce every step, so
every step goes through the lighthouse. Per-step mode (``semi_sync_method None``, the asynchronous
quorum) does not run on every line with two groups: torchft heals a non-primary group at step 0
(``init_sync``) and the donor crashes ("got mixed torch.Tensor and DTensor"), so torchft per-step
is not measured at all, and ftclient per-step is the extra column (it records a crash, if any).
(ftclient in DiLoCo mode once crashed too, in the group that healed at step 0, at its next inner
AdamW step: fixed in ``ftclient/local_sgd.py``; a crash in any column reads "crashed".)

**Lighthouse settings** (every system alike): ``min_replicas 1`` (and ``--fault_tolerance.
min_replica_size 1``: the survivor of a group kill trains on alone), torchft's default heartbeat
timeout (5 s), the 10 s join timeout torchtitan's and torchft's guides use, 100 ms quorum tick.

**One run per system**, its phases in order (every wait bounded, progress printed):

1. both groups start; ``warmup`` steps each (start-up, first quorum, the init-sync heal);
2. steady state: ``steady`` more steps of each group; the **median step** is the median duration
   (time between consecutive step lines of one group) of the steps of both groups that started
   after the warm-up and ended before the first fault;
3. cluster only: **SIGKILL of the Raft leader** while Quorum calls wait at it (when none is seen
   within a while, at once); a new leader is waited for; both groups train ``after`` more steps.
   Cost = the slowest step among the one in flight at the kill and the two after it, minus the
   median step (per group; the table shows the larger), and the steps that failed (should_commit
   False) among them;
4. **SIGKILL of replica group 1** (torchrun and its rank). Cost to the survivor (group 0):
   ``kill -> commit`` = from the kill to the end of the survivor's first committed step on a
   quorum without the dead group (a step that started after the kill: its allreduce cannot have
   included the dead group; or the step in flight at the kill, when it committed on a newer quorum
   than the one the survivor was on), minus the median step. Beside it ``lost`` = from the start
   of the step in flight at the kill to the end of that committed step, minus a median step per
   step committed in that span (time that made no training progress: waits and failed steps);
   with ``--restart`` the group is started again at once and the run waits until it has healed
   and committed ``after`` steps (``rejoin``: seconds from its start to its first committed step);
5. torchft_lighthouse only: its SIGKILL. There is no other lighthouse, so training stops: the
   figure is how long the survivor goes on (the steps it still logs) and when it exits (bounded
   by ``STOP_WAIT_S``).

Timestamps are the trainer's own: torchtitan's log lines carry the wall clock to the millisecond
(``[titan] 2026-11-29 00:37:18,585 - root - INFO - step:  1  loss: ...``), written by the rank
itself; the manager's ``should_commit=`` and ``reconfiguring for quorum_id=`` lines (torchft's and
ftclient's alike) tell which steps committed and on which quorum. Kills are timed with the same
clock (``time.time()``) in this process.

Results: ``<out>/<name>.json`` (every step of every group, every figure) and ``<name>.md`` (the
table). ``--verdict`` (what ``scripts/gpu_torchtitan.sh`` uses) prints one line ``PASS``/``FAIL``
with the reasons: every system ran through every phase, no step failed at a leader kill, the
survivor recovered, and (with ``--restart``) the restarted group healed and trained.
``--report RESULTS.json`` re-analyses a stored results file (the figures are pure functions of its
step records) and re-writes it and its table.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import click

from .procs import CHECKOUT, child_env, descendants, load_snapshot, machine_info

SHIM = CHECKOUT / "examples" / "torchtitan" / "cpu_shim.py"
MAKE_ASSETS = CHECKOUT / "examples" / "torchtitan" / "make_assets.py"

# (id, label, sdk, lighthouse kind, mode): the table's columns, in order.
SYSTEMS = (
    ("torchft-lighthouse", "torchft 0.2.0 on torchft_lighthouse", "torchft", "torchft", "diloco"),
    ("torchft-cluster", "torchft 0.2.0 on the cluster", "torchft", "cluster", "diloco"),
    ("ftclient-cluster", "ftclient on the cluster", "ftclient", "cluster", "diloco"),
    ("ftclient-cluster-per-step", "ftclient on the cluster, per-step (async quorum)", "ftclient", "cluster",
     "per-step"),
)
SYSTEM_IDS = tuple(s[0] for s in SYSTEMS)
SYNC_STEPS = 1
MODE_ARGS = {
    "diloco": ["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", str(SYNC_STEPS),
               "--fault_tolerance.num_fragments", "1"],
    "per-step": ["--fault_tolerance.semi_sync_method", "None"],
}
MODE_LABELS = {"diloco": f"DiLoCo, sync every {SYNC_STEPS} step", "per-step": "per-step, async quorum"}

# The trainer (as tests/support/torchtitan_trainer.py runs it): the Llama3 debug model (6 layers,
# dim 256), FlexAttention, AdamW, the c4_test loader, FSDP2 on the group's mesh. Checkpointing is on
# (torchtitan registers the manager's state-dict functions through it: healing needs it) with an
# interval no run reaches; the run is stopped by killing it, long before TRAINING_STEPS.
TRAINING_STEPS = 100_000
BASE_ARGS = [
    "--module", "torchft.llama3", "--config", "llama3_torchft_debugmodel",
    "--fault_tolerance.enable", "--fault_tolerance.process_group", "gloo",
    "--training.seq_len", "128", "--training.local_batch_size", "2",
    "--profiler.no-enable-profiling", "--validator.no-enable",
    "--metrics.log_freq", "1", "--metrics.disable_color_printing",
    "--checkpoint.enable", "--checkpoint.interval", "1000000",
    "--checkpoint.no-enable-ft-dataloader-checkpoints",
    # The group's own process-group timeout above the SDK's quorum and transfer timeouts
    # (docs/torchtitan.md; WORKER_ENV), as tests/support/torchtitan_trainer.py runs it.
    "--comm.train_timeout_seconds", "90",
]
GROUPS = 2
MIN_REPLICAS = 1
HEARTBEAT_TIMEOUT_MS = 5_000  # torchft's default
JOIN_TIMEOUT_MS = 10_000  # torchtitan's and torchft's guides
QUORUM_TICK_MS = 100
# Collectives, commit and checkpoint transfer; a quorum; the first connection.
WORKER_ENV = {"TORCHFT_TIMEOUT_SEC": "30", "TORCHFT_QUORUM_TIMEOUT_SEC": "60", "TORCHFT_CONNECT_TIMEOUT_SEC": "30"}
# Never inherited (a trainer would take them for torchrun's, or change its behaviour unasked).
DROPPED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "TORCHFT_QUORUM_RETRIES", "TORCHFT_MANAGER_PORT", "TORCHFT_LIGHTHOUSE", "TORCHFT_USE_BUCKETIZATION")
STARTUP_TIMEOUT_S = 240.0  # imports, model, first quorum, warm-up steps (two groups on 2 loaded cores)
STEPS_TIMEOUT_S = 120.0  # a phase's steps
RECOVERY_TIMEOUT_S = 90.0  # the survivor's first committed step after a group kill
REJOIN_TIMEOUT_S = 240.0  # a restarted group: start-up, heal, steps
STOP_WAIT_S = 20.0  # after torchft_lighthouse's death: how long we watch the survivor
CALLS_WAIT_S = 30.0  # looking for Quorum calls waiting at the leader before killing it
AROUND = 3  # steps looked at around a leader kill: the one in flight and the two after it


@dataclass
class Sizes:
    warmup: int = 3
    steady: int = 8
    after: int = 4

    @classmethod
    def quick(cls) -> "Sizes":
        return cls(warmup=2, steady=3, after=2)


# -- the trainers' logs (pure) ---------------------------------------------------------------------

RANK_PREFIX = re.compile(r"^\[default(?P<rank>\d+)\]:")
TITAN_TIME = re.compile(r"\[titan\] (?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) - ")
STEP_LINE = re.compile(r" - INFO - step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>\S+)")
COMMIT_LINE = re.compile(r"/(?P<rank>\d+) - step (?P<step>\d+)\] should_commit=(?P<ok>True|False)")
QUORUM_LINE = re.compile(r"reconfiguring for quorum_id=(?P<q>-?\d+)")
HEAL_LINE = re.compile(r"healing (?:required|from)")
DEVICE_LINE = re.compile(r" - INFO - (?P<kind>\w+) capacity: (?P<name>.+?) with (?P<gib>[\d.]+)GiB memory")
# torchft's donor crash (the state dict taken under FSDP2's forward), and whatever else ends in
# the same error (a healed group's optimizer state of plain tensors, say).
DONOR_CRASH = re.compile(r"got mixed torch\.Tensor and DTensor|data is not allocated yet")
TRACEBACK = re.compile(r"Traceback \(most recent call last\)|\bError: ")


def titan_time(ts: str) -> float:
    """A ``[titan]`` log timestamp (local time, milliseconds) as seconds since the epoch."""
    return dt.datetime.strptime(ts, "%Y-%m-%d %H:%M:%S,%f").timestamp()


@dataclass
class StepLog:
    """What one rank of one trainer process logged, fed line by line (torchrun's ``--tee 3``
    output: every line prefixed ``[default<rank>]:``). A step record is torchtitan's metric line
    with its time (``t``: the step's end) and what the manager logged since the previous step
    line: ``committed`` (the last should_commit decision, None when none was logged: a step
    without synchronisation), ``quorum_id`` (the latest reconfiguration so far), ``healed``."""

    rank: int = 0
    steps: list[dict[str, Any]] = field(default_factory=list)
    device: str | None = None
    donor_crash: bool = False
    heals: int = 0
    first_error: str | None = None
    _commit: bool | None = None
    _quorum: int | None = None
    _healed: bool = False

    def feed(self, line: str) -> None:
        m = RANK_PREFIX.match(line)
        if m is None:
            return
        body = line[m.end():]
        if DONOR_CRASH.search(body):
            self.donor_crash = True
        if int(m["rank"]) != self.rank:
            return
        if self.first_error is None and TRACEBACK.search(body) and "[titan]" not in body:
            self.first_error = body.strip()[:300]
        if HEAL_LINE.search(body):
            self._healed = True
            self.heals += 1
        if (q := QUORUM_LINE.search(body)) is not None:
            self._quorum = int(q["q"])
        if (c := COMMIT_LINE.search(body)) is not None and int(c["rank"]) == self.rank:
            self._commit = c["ok"] == "True"
        if self.device is None and (d := DEVICE_LINE.search(body)) is not None:
            self.device = f"{d['kind']}: {d['name']} ({d['gib']} GiB)"
        s = STEP_LINE.search(body)
        ts = TITAN_TIME.search(body)
        if s is not None and ts is not None:
            self.steps.append({"step": int(s["step"]), "t": titan_time(ts["ts"]), "loss": float(s["loss"]),
                               "committed": self._commit, "quorum_id": self._quorum, "healed": self._healed})
            self._commit, self._healed = None, False


def parse_log(text: str, rank: int = 0) -> StepLog:
    log = StepLog(rank=rank)
    for line in text.splitlines():
        log.feed(line)
    return log


# -- analysis (pure) -------------------------------------------------------------------------------


def durations(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each step of one process after its first, with its start (the previous step line's time)
    and duration."""
    return [{**b, "start": a["t"], "duration_s": b["t"] - a["t"]} for a, b in zip(steps, steps[1:])]


def median_step(per_group: list[list[dict[str, Any]]], t0: float, t1: float) -> dict[str, Any]:
    """The median duration of the steps (of every group) that started at or after ``t0`` and
    ended by ``t1``; per group too."""
    each = [[d["duration_s"] for d in durations(steps) if d["start"] >= t0 and d["t"] <= t1] for steps in per_group]
    pooled = [x for xs in each for x in xs]
    return {"median_s": round(statistics.median(pooled), 4) if pooled else None, "steps": len(pooled),
            "per_group_median_s": [round(statistics.median(xs), 4) if xs else None for xs in each],
            "min_s": round(min(pooled), 4) if pooled else None, "max_s": round(max(pooled), 4) if pooled else None}


def in_flight(steps: list[dict[str, Any]], t: float) -> int | None:
    """Index (in ``durations(steps)``) of the step running at ``t``: the first that ends after it."""
    return next((i for i, d in enumerate(durations(steps)) if d["t"] > t), None)


def leader_kill_cost(steps: list[dict[str, Any]], t_kill: float, median: float, around: int = AROUND,
                     until: float | None = None) -> dict[str, Any]:
    """One group's figures for a leader kill at ``t_kill``: the slowest of the step in flight and
    the ``around - 1`` after it (those that ended by ``until``, the next fault), minus ``median``;
    the steps among them that failed."""
    ds = durations(steps)
    i = in_flight(steps, t_kill)
    window = [] if i is None else [d for d in ds[i:i + around] if until is None or d["t"] <= until]
    if not window:
        return {"complete": False, "steps": [], "slowest_s": None, "cost_s": None, "failed_steps": 0}
    slowest = max(d["duration_s"] for d in window)
    return {"complete": len(window) == around, "steps": [d["step"] for d in window],
            "durations_s": [round(d["duration_s"], 4) for d in window], "slowest_s": round(slowest, 4),
            "cost_s": round(slowest - median, 4),
            "excess_s": round(sum(max(0.0, d["duration_s"] - median) for d in window), 4),
            "failed_steps": sum(1 for d in window if d["committed"] is False)}


def group_kill_cost(survivor: list[dict[str, Any]], t_kill: float, median: float) -> dict[str, Any]:
    """The survivor's figures for a replica-group kill at ``t_kill`` (see the module docstring):
    its first committed step after the kill that ran on a quorum without the dead group (one that
    started after the kill, or the step in flight when it committed on a newer quorum than the one
    at the kill), ``kill_to_commit_s``, ``cost_s`` (that minus ``median``), ``lost_s`` and the
    failed steps in between. ``recovered`` False when no such step was logged."""
    ds = durations(survivor)
    i0 = in_flight(survivor, t_kill)
    q0 = next((s["quorum_id"] for s in reversed(survivor) if s["t"] <= t_kill), None)
    rec = next((j for j, d in enumerate(ds) if d["t"] > t_kill and d["committed"] is True
                and (d["start"] >= t_kill or d["quorum_id"] != q0)), None)
    if i0 is None or rec is None:
        return {"recovered": False, "kill_to_commit_s": None, "cost_s": None, "lost_s": None,
                "failed_steps": sum(1 for d in ds if d["t"] > t_kill and d["committed"] is False)}
    span = ds[i0:rec + 1]
    committed = sum(1 for d in span if d["committed"] is True)
    kill_to_commit = ds[rec]["t"] - t_kill
    lost = ds[rec]["t"] - ds[i0]["start"] - committed * median
    return {"recovered": True, "recovery_step": ds[rec]["step"], "quorum_before": q0,
            "quorum_after": ds[rec]["quorum_id"], "kill_to_commit_s": round(kill_to_commit, 4),
            "cost_s": round(kill_to_commit - median, 4), "lost_s": round(lost, 4),
            "failed_steps": sum(1 for d in span if d["committed"] is False),
            "span_durations_s": [round(d["duration_s"], 4) for d in span]}


def rejoin_figures(restarted: list[dict[str, Any]], started: float, survivor: list[dict[str, Any]],
                   median: float, heals: int) -> dict[str, Any]:
    """A restarted group: seconds from its start to its first committed step, whether it healed;
    the survivor's slowest step while it joined (the heal's cost to the donor), minus ``median``."""
    first = next((s for s in restarted if s["committed"] is True), None)
    out: dict[str, Any] = {"rejoined": first is not None, "heals": heals,
                           "rejoin_s": None if first is None else round(first["t"] - started, 4),
                           "first_step": None if first is None else first["step"],
                           "committed_steps": sum(1 for s in restarted if s["committed"] is True)}
    if first is not None:
        window = [d for d in durations(survivor) if d["t"] > first["t"] - median][:AROUND]
        if window:
            out["survivor_slowest_s"] = round(max(d["duration_s"] for d in window), 4)
            out["survivor_cost_s"] = round(out["survivor_slowest_s"] - median, 4)
    return out


def lighthouse_stop_figures(survivor: list[dict[str, Any]], t_kill: float, exit_at: float | None,
                            exit_code: int | None, watched_s: float) -> dict[str, Any]:
    """After torchft_lighthouse's SIGKILL: the steps the survivor still logged, the last one's
    time after the kill, and when (whether) it exited within ``watched_s``."""
    after = [s for s in survivor if s["t"] > t_kill]
    return {"steps_after_kill": len(after), "committed_after_kill": sum(1 for s in after if s["committed"] is True),
            "last_step_after_s": round(after[-1]["t"] - t_kill, 4) if after else None,
            "exited_after_s": None if exit_at is None else round(exit_at - t_kill, 4), "exit_code": exit_code,
            "watched_s": watched_s}


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """The table's figures of one run from its records (``steps`` per group incarnation,
    ``marks``); pure, so a stored JSON can be re-analysed."""
    marks = run.get("marks", {})
    incs = run.get("incarnations", [])
    first = {i["group"]: i["steps"] for i in incs if i["index"] == 0}
    per_group = [first.get(g, []) for g in range(run.get("groups", GROUPS))]
    out: dict[str, Any] = {}
    if "steady" not in marks:
        return out
    t0, t1 = marks["steady"]
    med = median_step(per_group, t0, t1)
    out["median"] = med
    m = med["median_s"]
    if m is None:
        return out
    if "leader_kill" in marks:
        k = marks["leader_kill"]
        until = marks.get("group_kill", {}).get("t")
        per = [leader_kill_cost(steps, k["t"], m, until=until) for steps in per_group]
        costs = [p["cost_s"] for p in per if p["cost_s"] is not None]
        out["leader_kill"] = {"per_group": per, "cost_s": max(costs) if costs else None,
                              "failed_steps": sum(p["failed_steps"] for p in per),
                              "failover_s": k.get("failover_s"), "calls_waiting": k.get("calls_waiting")}
    if "group_kill" in marks:
        k = marks["group_kill"]
        out["group_kill"] = group_kill_cost(first.get(k["survivor"], []), k["t"], m)
    if "restart" in marks:
        r = marks["restart"]
        restarted = next((i for i in incs if i["group"] == r["group"] and i["index"] == r["index"]), None)
        out["rejoin"] = rejoin_figures(restarted["steps"] if restarted else [], r["t"],
                                       first.get(r["survivor"], []), m, restarted["heals"] if restarted else 0)
    if "lighthouse_kill" in marks:
        k = marks["lighthouse_kill"]
        out["lighthouse_kill"] = lighthouse_stop_figures(first.get(k["survivor"], []), k["t"], k.get("exit_at"),
                                                         k.get("exit_code"), k.get("watched_s", STOP_WAIT_S))
    return out


def verdict(res: dict[str, Any]) -> tuple[bool, list[str]]:
    """PASS when every run went through every phase without an error, no step failed at a leader
    kill, every survivor recovered and (where restarted) every restarted group healed and
    committed steps. Returns (ok, the reasons it is not)."""
    problems = []
    runs = res.get("runs", [])
    if not runs:
        problems.append("no run")
    for r in runs:
        name = r["system"]
        if r.get("error"):
            problems.append(f"{name}: {r['error']}")
            continue
        s = r.get("summary", {})
        if s.get("median", {}).get("median_s") is None:
            problems.append(f"{name}: no steady-state step")
        lk = s.get("leader_kill")
        if r["lighthouse"] == "cluster" and lk is None:
            problems.append(f"{name}: no leader kill")
        if lk is not None and lk["failed_steps"]:
            problems.append(f"{name}: {lk['failed_steps']} step(s) failed at the leader kill")
        gk = s.get("group_kill")
        if gk is None or not gk["recovered"]:
            problems.append(f"{name}: the survivor did not commit a step after the group kill")
        if "restart" in r.get("marks", {}):
            rj = s.get("rejoin")
            if rj is None or not rj["rejoined"]:
                problems.append(f"{name}: the restarted group committed no step")
            elif not rj["heals"]:
                problems.append(f"{name}: the restarted group did not heal")
    return not problems, problems


# -- processes -------------------------------------------------------------------------------------


def trainer_env(lighthouse: str, device: str) -> dict[str, str]:
    env = {k: v for k, v in child_env().items() if k not in DROPPED_ENV}
    env.update(WORKER_ENV)
    env.update({"TORCHFT_LIGHTHOUSE": lighthouse, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "RUST_LOG": "warn"})
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # no accelerator: the shim runs torchtitan on CPU
    return env


@dataclass
class Group:
    """One incarnation of one replica group: ``torchrun --standalone --nproc_per_node=1`` of
    torchtitan's FT trainer (through ``-m ftclient.as_torchft`` for ftclient)."""

    group: int
    index: int
    sdk: str
    mode: str
    lighthouse: str
    run_dir: Path
    cwd: Path
    device: str = "auto"
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    killed_at: float | None = None
    log: StepLog = field(default_factory=StepLog)
    _offset: int = 0
    _partial: bytes = b""

    @property
    def name(self) -> str:
        return f"g{self.group}.{self.index}"

    @property
    def log_path(self) -> Path:
        return self.run_dir / f"{self.name}.log"

    def command(self) -> list[str]:
        program = ["-m", "ftclient.as_torchft", str(SHIM)] if self.sdk == "ftclient" else [str(SHIM)]
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "--tee", "3",
                *program, *BASE_ARGS, f"--fault_tolerance.replica_id={self.group}",
                f"--fault_tolerance.group_size={GROUPS}", "--fault_tolerance.min_replica_size", str(MIN_REPLICAS),
                "--training.steps", str(TRAINING_STEPS), "--dump_folder", str(self.run_dir / f"dump-g{self.group}"),
                *MODE_ARGS[self.mode]]

    def start(self) -> None:
        with open(self.log_path, "ab") as out:
            self.process = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, cwd=str(self.cwd),
                                            env=trainer_env(self.lighthouse, self.device), start_new_session=True)
        self.started = time.time()

    def read(self) -> None:
        """Feed the complete lines written since the last call to the step log."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        self._offset += len(data)
        data = self._partial + data
        end = data.rfind(b"\n") + 1
        self._partial = data[end:]
        for line in data[:end].decode(errors="replace").splitlines():
            self.log.feed(line)

    @property
    def steps(self) -> list[dict[str, Any]]:
        return self.log.steps

    def committed(self) -> int:
        return sum(1 for s in self.steps if s["committed"] is True)

    def exited(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def kill(self) -> float:
        """SIGKILL torchrun and every process under it (torchrun starts each rank in a session of
        its own, so its process group is not enough: torchrun is stopped first, so that it starts
        nothing new, then everything is killed); returns the time of the kill."""
        p = self.process
        if p is None:
            return time.time()
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
            for pid in descendants(p.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.killed_at = time.time()
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
        self.read()
        return self.killed_at

    def error_line(self) -> str:
        """The last exception line the group printed (``...Error: ...``), else its last lines."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        errors = [x for x in lines if re.search(r"^(\[default\d+\]:)?(\[rank\d+\]: )?\w*(Error|Exception)\b", x)]
        return errors[-1][:400] if errors else self.tail()

    def tail(self, n: int = 6) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        lines = [x for x in lines if "torchft::" not in x][-n:]
        return " | ".join(x[:300] for x in lines)

    def as_dict(self) -> dict[str, Any]:
        return {"group": self.group, "index": self.index, "started": self.started, "killed_at": self.killed_at,
                "exit_code": self.exited(), "device": self.log.device, "heals": self.log.heals,
                "donor_crash": self.log.donor_crash, "steps": self.steps, "log": str(self.log_path)}


class _Run:
    """The groups of one system's run: start, wait, kill, always clean up."""

    def __init__(self, system: str, sdk: str, mode: str, lighthouse: str, run_dir: Path, cwd: Path,
                 device: str, say: Callable[[str], None]) -> None:
        self.system, self.sdk, self.mode, self.lighthouse = system, sdk, mode, lighthouse
        self.dir, self.cwd, self.device, self.say = run_dir, cwd, device, say
        self.incs: list[Group] = []
        self.current: dict[int, Group] = {}
        self.t0 = time.monotonic()

    def note(self, msg: str) -> None:
        self.say(f"    [{time.monotonic() - self.t0:6.1f}s] {self.system}: {msg}")

    def start(self, group: int) -> Group:
        index = sum(1 for g in self.incs if g.group == group)
        g = Group(group=group, index=index, sdk=self.sdk, mode=self.mode, lighthouse=self.lighthouse,
                  run_dir=self.dir, cwd=self.cwd, device=self.device)
        g.start()
        self.incs.append(g)
        self.current[group] = g
        return g

    def check(self) -> None:
        for g in self.current.values():
            g.read()
            rc = g.exited()
            if rc is not None and g.killed_at is None:
                why = " (crashed: got mixed torch.Tensor and DTensor)" if g.log.donor_crash else ""
                raise RuntimeError(f"{g.name} exited with {rc}{why} after {len(g.steps)} steps: {g.error_line()} "
                                   f"(log {g.log_path})")

    def wait(self, what: str, done: Callable[[], Any], timeout: float, poll_s: float = 0.25) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            self.check()
            value = done()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout:.0f} s; steps logged "
                                   + ", ".join(f"{g.name} {len(g.steps)}" for g in self.current.values()))
            time.sleep(poll_s)

    def stop(self) -> None:
        for g in self.incs:
            g.kill()


def _kill_leader_while_calls_wait(cluster: Any, timeout: float) -> dict[str, Any]:
    """SIGKILL the serving leader as soon as it reports Quorum calls waiting for a round (within
    ``timeout``; then at once); wait for a leader in a later term."""
    deadline = time.monotonic() + timeout
    leader, term, waiting = None, None, 0
    while time.monotonic() < deadline:
        i = cluster.leader_index()
        st = cluster.status(i, timeout=0.5) if i is not None else None
        if st is not None and st.serving:
            leader, term = i, st.term
            pending = list(st.pending) + [p for j in st.jobs if j.name != "default" for p in j.pending]
            if pending:
                waiting = len(pending)
                break
        time.sleep(0.01)
    if leader is None:
        raise RuntimeError("no serving leader to kill")
    cluster.kill(leader)
    t = time.time()
    others = [i for i in range(cluster.nodes) if i != leader]
    new = cluster.wait_for_leader(timeout=30, among=others, exclude_term=term)
    return {"t": t, "node": leader, "term": term, "calls_waiting": waiting, "new_leader": new,
            "failover_s": round(time.time() - t, 4)}


def _run_phases(run: _Run, sizes: Sizes, restart: bool, lighthouse: Any, cluster: Any,
                marks: dict[str, Any]) -> None:
    """The phases (module docstring), each one's times into ``marks`` as it happens (a run that
    fails half-way keeps the figures of the phases it went through)."""
    for g in range(GROUPS):
        run.start(g)
    run.note(f"started {GROUPS} groups ({MODE_LABELS[run.mode]}); waiting for {sizes.warmup} warm-up steps each")
    run.wait("the warm-up steps", lambda: all(len(g.steps) >= sizes.warmup for g in run.current.values()),
             STARTUP_TIMEOUT_S)
    t0 = max(g.steps[sizes.warmup - 1]["t"] for g in run.current.values())
    run.wait(f"{sizes.steady} steady steps",
             lambda: all(sum(1 for s in g.steps if s["t"] > t0) >= sizes.steady + 1 for g in run.current.values()),
             STEPS_TIMEOUT_S + sizes.steady * 10)
    t1 = time.time()
    marks["steady"] = (t0, t1)
    med = median_step([g.steps for g in run.current.values()], t0, t1)["median_s"]
    run.note(f"median step {med} s")

    def steps_after(t: float, n: int) -> Callable[[], bool]:
        return lambda: all(sum(1 for s in g.steps if s["t"] > t) >= n for g in run.current.values())

    if cluster is not None:
        k = _kill_leader_while_calls_wait(cluster, CALLS_WAIT_S)
        marks["leader_kill"] = k
        run.note(f"SIGKILLed the leader n{k['node'] + 1} ({k['calls_waiting']} Quorum calls waiting); "
                 f"new leader n{k['new_leader'] + 1} after {k['failover_s']:.2f} s")
        n = max(sizes.after, AROUND)  # the steps the cost is read from, before the next fault
        run.wait(f"{n} steps after the leader kill", steps_after(k["t"], n), STEPS_TIMEOUT_S + n * 10)

    victim, survivor = run.current[1], run.current[0]
    t = victim.kill()
    marks["group_kill"] = {"t": t, "group": victim.group, "survivor": survivor.group,
                           "at_step": victim.steps[-1]["step"] if victim.steps else None}
    run.note(f"SIGKILLed replica group {victim.group} (torchrun and its rank)")
    del run.current[victim.group]
    assert med is not None

    def recovered() -> bool:
        return group_kill_cost(survivor.steps, t, med)["recovered"]

    run.wait("the survivor's first committed step after the group kill", recovered, RECOVERY_TIMEOUT_S)
    run.note(f"survivor committed again {group_kill_cost(survivor.steps, t, med)['kill_to_commit_s']} s after the kill")

    if restart:
        g = run.start(victim.group)
        marks["restart"] = {"t": g.started, "group": g.group, "index": g.index, "survivor": survivor.group}
        run.note(f"restarted replica group {g.group} as {g.name}; waiting for it to heal and commit "
                 f"{sizes.after} steps")
        run.wait(f"{g.name} to commit {sizes.after} steps", lambda: g.committed() >= sizes.after, REJOIN_TIMEOUT_S)
        run.note(f"{g.name} rejoined ({g.log.heals} heal(s))")

    if lighthouse is not None:
        lighthouse.kill()
        t = time.time()
        run.note(f"SIGKILLed torchft_lighthouse; watching the survivor for up to {STOP_WAIT_S:.0f} s")
        deadline = time.monotonic() + STOP_WAIT_S
        exit_at = None
        while time.monotonic() < deadline:
            survivor.read()
            if survivor.exited() is not None:
                exit_at = time.time()
                break
            time.sleep(0.1)
        survivor.read()
        marks["lighthouse_kill"] = {"t": t, "survivor": survivor.group, "exit_at": exit_at,
                                    "exit_code": survivor.exited(), "watched_s": STOP_WAIT_S}
        survivor.killed_at = survivor.killed_at or time.time()  # its exit was asked for
        run.note("survivor " + (f"exited ({survivor.exited()}) after {exit_at - t:.1f} s" if exit_at
                                 else f"still running after {STOP_WAIT_S:.0f} s"))


def run_system(system: str, sizes: Sizes, workdir: Path, assets: Path, say: Callable[[str], None],
               restart: bool = False, device: str = "auto") -> dict[str, Any]:
    """One system's run (see the module docstring); never raises: a failure is the run's ``error``."""
    from lighthouse_cluster.local.cluster import LocalCluster

    from .procs import RustLighthouse

    _, label, sdk, lh_kind, mode = next(s for s in SYSTEMS if s[0] == system)
    run_dir = workdir / f"torchtitan-{system}"
    run_dir.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"system": system, "label": label, "sdk": sdk, "lighthouse": lh_kind, "mode": mode,
                           "groups": GROUPS, "log_dir": str(run_dir), "marks": {}}
    say(f"  torchtitan {system}: {label}, {MODE_LABELS[mode]}")
    started = time.monotonic()
    lh = cluster = run = None
    try:
        if lh_kind == "torchft":
            lh = RustLighthouse(min_replicas=MIN_REPLICAS, log_path=run_dir / "torchft_lighthouse.log",
                                join_timeout_ms=JOIN_TIMEOUT_MS, quorum_tick_ms=QUORUM_TICK_MS,
                                heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
            lh.start()
            url = f"http://{lh.address}"
        else:
            cluster = LocalCluster(root=run_dir / "cluster", min_replicas=MIN_REPLICAS, join_timeout_ms=JOIN_TIMEOUT_MS,
                                   quorum_tick_ms=QUORUM_TICK_MS, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
            cluster.start()
            leader = cluster.wait_for_agreed_leader(timeout=30)
            follower = next(i for i in range(cluster.nodes) if i != leader)
            url = cluster.endpoints if sdk == "ftclient" else f"http://{cluster.client_addresses[follower]}"
        res["lighthouse_url"] = url
        run = _Run(system, sdk, mode, url, run_dir, assets, device, say)
        _run_phases(run, sizes, restart, lh, cluster, res["marks"])
    except Exception as e:  # noqa: BLE001 -- recorded as this run's error; the others still run
        res["error"] = f"{type(e).__name__}: {e}"
        say(f"  torchtitan {system}: ERROR: {res['error']}")
    finally:
        if run is not None:
            run.stop()
        if lh is not None:
            lh.kill()
        if cluster is not None:
            cluster.stop_all()
    res["duration_s"] = round(time.monotonic() - started, 1)
    if run is not None:
        res["incarnations"] = [g.as_dict() for g in run.incs]
        devices = {g.log.device for g in run.incs if g.log.device}
        res["device"] = ", ".join(sorted(devices)) or None
        res["donor_crash"] = any(g.log.donor_crash for g in run.incs)
    res["summary"] = summarize(res)
    say(f"  torchtitan {system}: {one_line(res)} ({res['duration_s']} s)")
    return res


def one_line(run: dict[str, Any]) -> str:
    s = run.get("summary", {})
    parts = [f"median step {s.get('median', {}).get('median_s')} s"]
    if "leader_kill" in s:
        parts.append(f"leader kill +{s['leader_kill']['cost_s']} s ({s['leader_kill']['failed_steps']} failed)")
    if "group_kill" in s:
        gk = s["group_kill"]
        parts.append(f"group kill: commit after {gk['kill_to_commit_s']} s (lost {gk['lost_s']} s)")
    if "rejoin" in s:
        parts.append(f"rejoin {s['rejoin']['rejoin_s']} s")
    if "lighthouse_kill" in s:
        lk = s["lighthouse_kill"]
        parts.append("lighthouse kill: " + (f"trainer exits after {lk['exited_after_s']} s"
                                            if lk["exited_after_s"] is not None else "trainer hangs"))
    if run.get("error"):
        parts.append(f"ERROR {run['error'][:200]}")
    return "; ".join(parts)


def checkout_info() -> dict[str, Any]:
    """The commit this checkout is at and its uncommitted changes under ftclient/ and
    lighthouse_cluster/ (what the columns ran), when git can tell."""
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=CHECKOUT, capture_output=True, text=True, timeout=10,
                                  check=True).stdout
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain", "--", "ftclient", "lighthouse_cluster")
    commit = git("rev-parse", "HEAD")
    return {"commit": None if commit is None else commit.strip(),
            "uncommitted": None if status is None else [line[3:] for line in status.splitlines() if line]}


def run_torchtitan(systems: list[str], sizes: Sizes, workdir: Path, say: Callable[[str], None],
                   restart: bool = False, device: str = "auto", command: str = "") -> dict[str, Any]:
    sys.path.insert(0, str(MAKE_ASSETS.parent))
    try:
        import make_assets  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(MAKE_ASSETS.parent))
    started = time.time()
    res: dict[str, Any] = {
        "schema": 1, "command": command, "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(), "checkout": checkout_info(), "load_start": load_snapshot(),
        "config": {"groups": GROUPS, "ranks_per_group": 1, "modes": {k: MODE_LABELS[k] for k in MODE_ARGS},
                   "mode_args": MODE_ARGS, "base_args": BASE_ARGS, "min_replicas": MIN_REPLICAS,
                   "heartbeat_timeout_ms": HEARTBEAT_TIMEOUT_MS, "join_timeout_ms": JOIN_TIMEOUT_MS,
                   "quorum_tick_ms": QUORUM_TICK_MS, "worker_env": WORKER_ENV, "warmup_steps": sizes.warmup,
                   "steady_steps": sizes.steady, "after_steps": sizes.after, "restart": restart, "device": device,
                   "stop_wait_s": STOP_WAIT_S},
        "runs": [],
    }
    say(f"torchtitan: making the tokenizer and corpus in {workdir}")
    make_assets.make_assets(workdir)
    for system in systems:
        res["runs"].append(run_system(system, sizes, workdir, workdir, say, restart=restart, device=device))
    res["load_end"] = load_snapshot()
    res["duration_s"] = round(time.time() - started, 1)
    res["errors"] = [f"{r['system']}: {r['error']}" for r in res["runs"] if r.get("error")]
    return res


# -- the table -------------------------------------------------------------------------------------


def _s(x: float | None, plus: bool = False) -> str:
    if x is None:
        return "-"
    return f"{'+' if plus and x >= 0 else ''}{x:.2f}"


def table(res: dict[str, Any]) -> list[str]:
    """The side-by-side table: one column per system, one row per figure."""
    runs = res["runs"]
    head = "| | " + " | ".join(f"{r['label']}" for r in runs) + " |"
    rows = [head, "|---|" + "---|" * len(runs)]

    def row(name: str, cell: Callable[[dict[str, Any]], str]) -> None:
        cells = []
        for r in runs:
            if r.get("error") and not r.get("summary", {}).get("median") and name != "training mode":
                cells.append("crashed" if r.get("donor_crash") else "failed")
            else:
                try:
                    cells.append(cell(r))
                except (KeyError, TypeError):
                    cells.append("-")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")

    row("training mode", lambda r: MODE_LABELS[r["mode"]])
    row("median step (s)", lambda r: _s(r["summary"]["median"]["median_s"]))
    row("steady steps measured (min-max s)", lambda r: f"{r['summary']['median']['steps']} "
        f"({_s(r['summary']['median']['min_s'])}-{_s(r['summary']['median']['max_s'])})")

    def leader(r: dict[str, Any]) -> str:
        if r["lighthouse"] == "torchft":
            lk = r["summary"].get("lighthouse_kill")
            if lk is None:
                return "training stops"
            if lk["exited_after_s"] is not None:
                return f"training stops (trainer exits after {lk['exited_after_s']:.1f} s)"
            return f"training stops (no exit within {lk['watched_s']:.0f} s)"
        return _s(r["summary"]["leader_kill"]["cost_s"], plus=True)

    row("Raft leader SIGKILL: slowest step around it - median (s)", leader)
    row("... steps failed at the leader kill", lambda r: "n/a" if r["lighthouse"] == "torchft"
        else str(r["summary"]["leader_kill"]["failed_steps"]))
    row("... failover (new leader, s)", lambda r: "n/a" if r["lighthouse"] == "torchft"
        else _s(r["summary"]["leader_kill"]["failover_s"]))
    row("replica-group SIGKILL: kill -> survivor's next committed step (s)",
        lambda r: _s(r["summary"]["group_kill"]["kill_to_commit_s"]))
    row("... minus a median step (s)", lambda r: _s(r["summary"]["group_kill"]["cost_s"], plus=True))
    row("... survivor's lost time (s)", lambda r: _s(r["summary"]["group_kill"]["lost_s"]))
    row("... survivor's failed steps", lambda r: str(r["summary"]["group_kill"]["failed_steps"]))
    if any("rejoin" in r.get("summary", {}) for r in runs):
        row("restarted group: start -> first committed step (s)", lambda r: _s(r["summary"]["rejoin"]["rejoin_s"]))
    return rows


def _uncommitted(res: dict[str, Any]) -> str:
    paths = (res.get("checkout") or {}).get("uncommitted") or []
    if not paths:
        return ""
    per = {top: sum(1 for p in paths if p.startswith(top + "/")) for top in ("ftclient", "lighthouse_cluster")}
    return (", with uncommitted changes (" + ", ".join(f"{n} files under {top}/" for top, n in per.items() if n)
            + "; the JSON lists them)")


def markdown(res: dict[str, Any]) -> str:
    m = res["machine"]
    v = m.get("versions", {})
    ls, le = res.get("load_start", {}), res.get("load_end", {})
    cfg = res["config"]
    lines = [
        "# torchtitan on each lighthouse: step time and what faults cost",
        "",
        f"Command: `{res.get('command', '')}`  ",
        f"Run: {res.get('started')}, {res.get('duration_s')} s.  ",
        f"Machine: {m.get('cpu_model')}, {m.get('cpus')} CPUs, {m.get('mem_bytes', 0) / 2**30:.1f} GiB RAM, Linux "
        f"{m.get('kernel')}, Python {m.get('python')}; torch {v.get('torch')}, torchft {v.get('torchft')}.  ",
        f"Device: {', '.join(sorted({r.get('device') or '?' for r in res['runs']}))}.  ",
        f"Load average (1/5/15 min) at start {ls.get('loadavg')}, at end {le.get('loadavg')}; CPU pressure (PSI "
        f"some avg60) at start {(ls.get('cpu_pressure_some') or {}).get('avg60')} %, at end "
        f"{(le.get('cpu_pressure_some') or {}).get('avg60')} % (other work on the machine shows up here).  ",
        f"Checkout: {(res.get('checkout') or {}).get('commit')}{_uncommitted(res)}.",
        "",
        f"torchtitan 0.3.0's FT trainer (Llama3 debug model, seq_len 128, local batch 2), {cfg['groups']} replica "
        f"groups of 1 rank, Gloo across groups; lighthouse min_replicas {cfg['min_replicas']}, heartbeat timeout "
        f"{cfg['heartbeat_timeout_ms']} ms, join timeout {cfg['join_timeout_ms']} ms. Steps: {cfg['warmup_steps']} "
        f"warm-up, {cfg['steady_steps']} steady per group, {cfg['after_steps']} after a leader kill.",
        "",
        "Mode: DiLoCo with a synchronisation every step (a synchronous quorum and an outer allreduce each step) "
        "for the compared columns: per-step mode (torchft's asynchronous quorum) does not run with two groups "
        "on torchft 0.2.0 (its init-sync heal at step 0 crashes the donor: \"got mixed torch.Tensor and "
        "DTensor\"). ftclient per-step is an extra column.",
        "",
        *table(res),
        "",
        "* median step: steps of both groups after the warm-up, before the first fault.",
        "* leader SIGKILL (cluster only; killed while Quorum calls waited at it): the slowest of the step in "
        "flight and the two after it, minus the median step (the larger of the two groups). torchft_lighthouse "
        "is a single process: its death stops training (the row says when the trainer gave up).",
        "* replica-group SIGKILL: group 1's torchrun and rank killed; from the kill to the end of the survivor's "
        "first committed step on a quorum without the dead group, minus a median step (the rest of the step in "
        "flight at the kill, up to one step, is included); lost time: from the start of the step in flight at "
        "the kill to that commit, minus a median step per step committed in that span.",
    ]
    if res.get("errors"):
        lines += ["", "Errors (the JSON has them whole, and the log paths):",
                  *[f"* {e[:400]}{' ...' if len(e) > 400 else ''}" for e in res["errors"]]]
    return "\n".join(lines) + "\n"


def write_outputs(res: dict[str, Any], out_dir: Path, name: str) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{name}.json", "md": out_dir / f"{name}.md"}
    paths["json"].write_text(json.dumps(res, indent=1, default=str) + "\n")
    paths["md"].write_text(markdown(res))
    return paths


# -- the command -----------------------------------------------------------------------------------


@click.command("torchtitan")
@click.option("--systems", default=",".join(SYSTEM_IDS), show_default=True,
              help="Comma-separated systems (columns) to run.")
@click.option("--quick", is_flag=True, help="Fewer steps per phase (2 warm-up, 3 steady, 2 after).")
@click.option("--warmup-steps", type=int, help="Steps each group trains before the steady window (default 3).")
@click.option("--steady-steps", type=int, help="Steady-state steps per group for the median (default 8).")
@click.option("--after-steps", type=int, help="Steps after a leader kill, and of a restarted group (default 4).")
@click.option("--restart", is_flag=True, help="Start the killed replica group again and wait until it healed.")
@click.option("--device", type=click.Choice(["auto", "cpu"]), default="auto", show_default=True,
              help="auto: torchtitan's own choice (an accelerator if there is one); cpu: hide CUDA.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("benchmarks"),
              show_default=True)
@click.option("--name", default="bench-torchtitan", show_default=True, help="Output file stem.")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path),
              help="Keep logs and dumps here (default: a temporary directory, removed afterwards).")
@click.option("--verdict", "verdict_prefix", default=None,
              help="Print one line '<PREFIX>: PASS ...' or '<PREFIX>: FAIL <reasons>' at the end.")
@click.option("--report", "report_json", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Run nothing: re-analyse RESULTS.json (its step records) and re-write it and its .md.")
def command(systems: str, quick: bool, warmup_steps: int | None, steady_steps: int | None,
            after_steps: int | None, restart: bool, device: str, out_dir: Path, name: str, workdir: Path | None,
            verdict_prefix: str | None, report_json: Path | None) -> None:
    """torchtitan's FT trainer on torchft_lighthouse and on the cluster, torchft and ftclient:
    median step, leader SIGKILL, replica-group SIGKILL."""
    import shutil
    import tempfile

    if report_json is not None:
        res = json.loads(report_json.read_text())
        for r in res["runs"]:
            r["summary"] = summarize(r)
        paths = write_outputs(res, report_json.parent, report_json.stem)
        click.echo("\n".join(table(res)))
        click.echo(f"\nwrote {paths['json']} and {paths['md']}")
        return

    chosen = [s.strip() for s in systems.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SYSTEM_IDS]
    if unknown:
        raise click.BadParameter(f"unknown systems {unknown}; known: {', '.join(SYSTEM_IDS)}", param_hint="--systems")
    sizes = Sizes.quick() if quick else Sizes()
    sizes = Sizes(warmup=warmup_steps or sizes.warmup, steady=steady_steps or sizes.steady,
                  after=after_steps or sizes.after)
    if sizes.warmup < 2:
        raise click.BadParameter("at least 2 (the first step has no duration)", param_hint="--warmup-steps")
    keep = workdir is not None
    wd = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="bench-torchtitan-"))
    wd.mkdir(parents=True, exist_ok=True)
    argv = " ".join(sys.argv[1:])
    try:
        res = run_torchtitan(chosen, sizes, wd.resolve(), lambda s: click.echo(s, err=False), restart=restart,
                             device=device, command=f"python -m benchmarks {argv}")
    finally:
        if not keep:
            shutil.rmtree(wd, ignore_errors=True)
    paths = write_outputs(res, out_dir, name)
    click.echo("")
    click.echo("\n".join(table(res)))
    click.echo(f"\nwrote {paths['json']} and {paths['md']} ({res['duration_s']} s)")
    ok, problems = verdict(res)
    if verdict_prefix:
        devices = ", ".join(sorted({r.get("device") or "?" for r in res["runs"]}))
        if ok:
            click.echo(f"{verdict_prefix}: PASS ({', '.join(r['system'] for r in res['runs'])}; {devices}; "
                       f"{res['duration_s']} s)")
        else:
            click.echo(f"{verdict_prefix}: FAIL " + "; ".join(problems)[:1500])
        sys.exit(0 if ok else 1)
    if res["errors"]:
        click.echo("error: " + "; ".join(res["errors"])[:2000], err=True)
        sys.exit(1)
