"""Section 6, goodput: what a replica group's SIGKILL costs the others.

G replica groups (``benchmarks.goodput_worker``, the SDK section's training step with
``COMPUTE_S`` of simulated compute) train against a lighthouse with torchft's default heartbeat
timeout (5 s) and the 10 s join timeout torchft's docs recommend. Once every group has committed
``WARMUP_STEPS`` steps, a no-failure window of ``kills x kill_every_s`` seconds is measured; then,
in a window of the same length, one group is SIGKILLed every ``kill_every_s`` seconds (round
robin over the groups) and started again at once (a new process: a new manager uuid, step 0, it
heals from a peer). After the last kill the run waits until every survivor has recovered and the
restarted group has rejoined (bounded by ``TAIL_TIMEOUT_S``); then every group is killed.

Systems: ftclient on our 3-node cluster (the endpoint list), torchft's Manager on the cluster (the
leader's URL) and torchft's Manager on ``torchft_lighthouse``.

Figures, from the steps every group records (``analyze``):

* **recovery** (per kill): seconds from the kill until every survivor (every other group that had
  committed a step by then) has committed a step on a quorum newer than the one it was on at the
  kill; a step of the old quorum that commits just after the kill does not count. Median and max
  over the kills.
* **goodput**: committed steps per second (distinct committed step numbers, i.e. training
  progress) in the window with kills divided by the same in the no-failure window; beside it
  the same ratio for batches (participants summed over committed steps).
* **rejoin** (per restart): seconds from starting the new process until its first committed step;
  ``ready`` (manager set up: imports, model, store) is recorded apart.

A group that exits unasked, a survivor that never recovers, or a restarted group that never
rejoins is an error; a worker that cannot import torch or torchft is a skip.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from lighthouse_cluster.local.cluster import LocalCluster
from .procs import RustLighthouse, child_env, kill_process, worker_command

# (system id, SDK, lighthouse, extra node flags): the order of the table. torchft on the cluster
# runs twice: as deployed (the leader watches each member's manager-server connection, so a
# SIGKILLed torchft trainer is declared dead at once) and with that off, i.e. torchft's own
# semantics (a dead trainer is noticed when its heartbeats are older than the heartbeat timeout).
SYSTEMS = (("ftclient-cluster", "ftclient", "cluster", ()), ("torchft-cluster", "torchft", "cluster", ()),
           ("torchft-cluster-hb", "torchft", "cluster", ("--no-watch-manager-connections",)),
           ("torchft-lighthouse", "torchft", "torchft", ()))
# --quick (CI's smoke run): one system per SDK and lighthouse kind; the full run has all four.
QUICK_SYSTEMS = ("ftclient-cluster", "torchft-lighthouse")
SYSTEM_LABELS = {"ftclient-cluster": "ftclient on the cluster", "torchft-cluster": "torchft on the cluster",
                 "torchft-cluster-hb": "torchft on the cluster, heartbeats only",
                 "torchft-lighthouse": "torchft on torchft_lighthouse"}
HEARTBEAT_TIMEOUT_MS = 5_000  # torchft's default
JOIN_TIMEOUT_MS = 10_000  # what torchft's and torchtitan's guides use
QUORUM_TICK_MS = 100  # torchft's default
MIN_REPLICAS = 1  # the lighthouse's and the managers' min replicas: survivors go on without the dead
COMPUTE_S = 0.05  # simulated compute per step (overlaps the async quorum)
# Same for every system: collectives, commit and checkpoint transfer; quorum; first connection.
WORKER_ENV = {"TORCHFT_TIMEOUT_SEC": "10", "TORCHFT_QUORUM_TIMEOUT_SEC": "60", "TORCHFT_CONNECT_TIMEOUT_SEC": "30"}
WARMUP_STEPS = 5
START_TIMEOUT_S = 120.0  # every group set up, then WARMUP_STEPS committed
TAIL_TIMEOUT_S = 60.0  # after the last kill: recoveries and the last rejoin


@dataclass
class Incarnation:
    """One process of one replica group, and the records read from its progress file so far."""

    group: int
    index: int
    progress: Path
    log: Path
    started: float  # wall clock, just before the process was started
    process: subprocess.Popen[bytes] | None = None
    killed_at: float | None = None  # wall clock, just before our SIGKILL
    records: list[dict] = field(default_factory=list)
    _offset: int = 0
    _committed: int = 0
    _ready: bool = False

    @property
    def name(self) -> str:
        return f"g{self.group}.{self.index}"

    def read(self) -> list[dict]:
        """Parse the complete lines appended since the last call; returns them."""
        try:
            with open(self.progress, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self._offset += end
        new = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
        self.records += new
        self._committed += sum(1 for r in new if r.get("event") == "step" and r["committed"])
        self._ready = self._ready or any(r.get("event") == "ready" for r in new)
        return new

    def steps(self) -> list[dict]:
        return [r for r in self.records if r.get("event") == "step"]

    def committed(self) -> int:
        """Steps committed so far (as far as read)."""
        return self._committed

    @property
    def ready(self) -> bool:
        return self._ready

    def log_tail(self, n: int = 8) -> str:
        try:
            return " | ".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


# -- analysis (pure) -------------------------------------------------------------------------------


def _quorum_at(steps: list[dict], t: float) -> Any:
    """The quorum id of the last step that ended by ``t`` (None when none had)."""
    before = [r for r in steps if r["t_end"] <= t]
    return before[-1].get("quorum_id") if before else None


def recovery(kill: dict, incarnations: list[dict]) -> dict:
    """One kill's figures. ``kill``: ``{"t", "group", "incarnation"}`` (the killed one's index);
    ``incarnations``: ``[{"group", "index", "started", "killed_at", "steps"}]``, every process of
    the run. Survivors are the processes alive at the kill (started before it, not killed by then)
    that had committed a step by then; each recovers at the end of its first committed step after
    the kill on a quorum other than the one it was on at the kill."""
    t = kill["t"]
    per: dict[str, float | None] = {}
    skipped: list[str] = []
    killed: list[str] = []  # killed by a later kill before they committed again
    for inc in incarnations:
        if inc["group"] == kill["group"] and inc["index"] == kill["incarnation"]:
            continue
        if inc["started"] > t or (inc.get("killed_at") is not None and inc["killed_at"] <= t):
            continue
        name = f"g{inc['group']}.{inc['index']}"
        steps = inc["steps"]
        if not any(r["committed"] and r["t_end"] <= t for r in steps):
            skipped.append(name)  # still starting or healing: not a survivor yet
            continue
        q0 = _quorum_at(steps, t)
        first = next((r for r in steps if r["committed"] and r["t_end"] > t and r.get("quorum_id") != q0), None)
        per[name] = None if first is None else round(first["t_end"] - t, 4)
        if first is None and inc.get("killed_at") is not None:
            killed.append(name)
    done = [v for v in per.values() if v is not None]
    missing = [k for k, v in per.items() if v is None]
    return {"recovery_s": round(max(done), 4) if per and not missing else None, "survivors": per,
            "not_recovered": missing, "killed_before_recovering": killed, "not_yet_training": skipped}


def rejoin(inc: dict) -> dict:
    """A restarted process's figures: ready (manager set up) and first committed step, seconds
    from its start."""
    ready = next((r["t"] for r in inc.get("events", []) if r.get("event") == "ready"), None)
    first = next((r for r in inc["steps"] if r["committed"]), None)
    return {"group": inc["group"], "incarnation": inc["index"],
            "ready_s": None if ready is None else round(ready - inc["started"], 4),
            "rejoin_s": None if first is None else round(first["t_end"] - inc["started"], 4),
            "first_step": None if first is None else first["step_after"]}


def rate(incarnations: list[dict], t0: float, t1: float) -> dict:
    """Committed steps per second (distinct step numbers committed by any group whose step ended
    in [t0, t1)) and batches per second (participants summed over those steps)."""
    steps: dict[int, int] = {}
    for inc in incarnations:
        for r in inc["steps"]:
            if r["committed"] and t0 <= r["t_end"] < t1:
                steps[r["step_after"]] = max(steps.get(r["step_after"], 0), r.get("participants") or 0)
    span = max(1e-9, t1 - t0)
    return {"steps": len(steps), "steps_per_s": round(len(steps) / span, 3),
            "batches_per_s": round(sum(steps.values()) / span, 3)}


def _median(vals: list[float]) -> float | None:
    return round(statistics.median(vals), 4) if vals else None


def analyze(incarnations: list[dict], kills: list[dict], baseline: tuple[float, float],
            failures: tuple[float, float]) -> dict:
    """Every figure of one run (see the module docstring) from its records."""
    trials = [{"group": k["group"], "at_s": round(k["t"] - failures[0], 3), **recovery(k, incarnations)}
              for k in kills]
    restarts = [rejoin(inc) for inc in incarnations if inc["index"] > 0]
    base, fail = rate(incarnations, *baseline), rate(incarnations, *failures)
    rec = [t["recovery_s"] for t in trials if t["recovery_s"] is not None]
    rej = [r["rejoin_s"] for r in restarts if r["rejoin_s"] is not None]
    ready = [r["ready_s"] for r in restarts if r["ready_s"] is not None]
    summary = {
        "kills": len(trials), "recovered": len(rec),
        "recovery_median_s": _median(rec), "recovery_max_s": round(max(rec), 4) if rec else None,
        "restarts": len(restarts), "rejoined": len(rej),
        "rejoin_median_s": _median(rej), "rejoin_max_s": round(max(rej), 4) if rej else None,
        "ready_median_s": _median(ready),
        "steps_per_s_baseline": base["steps_per_s"], "steps_per_s_failures": fail["steps_per_s"],
        "goodput_ratio": round(fail["steps_per_s"] / base["steps_per_s"], 3) if base["steps_per_s"] else None,
        "batches_ratio": (round(fail["batches_per_s"] / base["batches_per_s"], 3)
                          if base["batches_per_s"] else None),
    }
    errors = [f"kill {i} (g{t['group']}): survivors {', '.join(t['not_recovered'])} never committed again"
              + (f" ({', '.join(t['killed_before_recovering'])} killed by a later kill first: the kill interval "
                 "is shorter than the recovery)" if t["killed_before_recovering"] else "")
              for i, t in enumerate(trials) if t["not_recovered"]]
    errors += [f"kill {i} (g{t['group']}): no survivor was training" for i, t in enumerate(trials) if not t["survivors"]]
    errors += [f"restarted g{r['group']}.{r['incarnation']} never committed a step" for r in restarts
               if r["rejoin_s"] is None]
    if not base["steps"]:
        errors.append("no step committed in the no-failure window")
    return {"kills": trials, "restarts": restarts, "baseline": base, "failures": fail, "summary": summary,
            "errors": errors}


# -- one run ---------------------------------------------------------------------------------------


class _Skipped(Exception):
    pass


class _Run:
    """The groups of one (system, G) run: start, kill, restart, read, always clean up."""

    def __init__(self, sdk: str, lighthouse: str, groups: int, run_dir: Path) -> None:
        self.sdk, self.lighthouse, self.groups, self.dir = sdk, lighthouse, groups, run_dir
        self.incs: list[Incarnation] = []
        self.current: dict[int, Incarnation] = {}
        self.go = run_dir / "go"
        self.env = child_env(TORCHFT_LIGHTHOUSE=lighthouse, RUST_LOG="warn", OMP_NUM_THREADS="1", **WORKER_ENV)
        for k in ("TORCHFT_QUORUM_RETRIES", "TORCHFT_MANAGER_PORT", "TORCHFT_USE_BUCKETIZATION"):
            self.env.pop(k, None)

    def start(self, group: int, barrier: bool) -> Incarnation:
        index = sum(1 for i in self.incs if i.group == group)
        inc = Incarnation(group, index, self.dir / f"g{group}.{index}.jsonl", self.dir / f"g{group}.{index}.log",
                          started=time.time())
        args = ["--sdk", self.sdk, "--group", str(group), "--progress", str(inc.progress),
                "--compute-s", str(COMPUTE_S), "--min-replica-size", str(MIN_REPLICAS)]
        if barrier:
            args += ["--go-file", str(self.go)]
        with open(inc.log, "wb") as log:
            inc.process = subprocess.Popen(worker_command("goodput_worker", *args), stdout=log,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
                                           start_new_session=True)
        self.incs.append(inc)
        self.current[group] = inc
        return inc

    def kill(self, group: int) -> float:
        inc = self.current[group]
        assert inc.process is not None
        inc.killed_at = time.time()
        try:
            os.killpg(inc.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        inc.process.wait(timeout=10)
        inc.read()  # what it wrote before it died
        return inc.killed_at

    def check(self) -> None:
        """Read every live process's progress; raise when one was skipped or exited unasked."""
        for inc in self.current.values():
            for r in inc.read():
                if r.get("event") == "skipped":
                    raise _Skipped(r["reason"])
                if r.get("event") == "error":
                    raise RuntimeError(f"{inc.name}: {r['error']}")
            if inc.process is not None and inc.process.poll() is not None:
                raise RuntimeError(f"{inc.name} exited unasked (status {inc.process.returncode}); log tail: "
                                   f"{inc.log_tail()}")

    def wait(self, what: str, done: Callable[[], bool], timeout: float, poll_s: float = 0.05) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.check()
            if done():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout:.0f} s; steps committed "
                                   + ", ".join(f"{i.name} {i.committed()}" for i in self.current.values()))
            time.sleep(poll_s)

    def stop(self) -> None:
        for inc in self.incs:
            kill_process(inc.process)
        for inc in self.incs:
            inc.read()

    def as_dicts(self) -> list[dict]:
        return [{"group": i.group, "index": i.index, "started": i.started, "killed_at": i.killed_at,
                 "steps": i.steps(), "events": [r for r in i.records if r.get("event") != "step"]}
                for i in self.incs]


def _run_groups(sdk: str, lighthouse: str, groups: int, kills: int, kill_every_s: float, run_dir: Path,
                say: Callable[[str], None]) -> dict:
    run = _Run(sdk, lighthouse, groups, run_dir)
    kill_log: list[dict] = []
    window = kills * kill_every_s
    try:
        for g in range(groups):
            run.start(g, barrier=True)
        run.wait("every group set up", lambda: all(i.ready for i in run.current.values()), START_TIMEOUT_S)
        run.go.write_text("go")
        run.wait(f"every group to commit {WARMUP_STEPS} steps",
                 lambda: all(i.committed() >= WARMUP_STEPS for i in run.current.values()), START_TIMEOUT_S)
        t_base = time.time()
        run.wait("the no-failure window", lambda: time.time() >= t_base + window, window + 30)
        t_fail = time.time()
        for k in range(kills):
            due = t_fail + k * kill_every_s
            run.wait(f"kill {k}", lambda due=due: time.time() >= due, kill_every_s + 30)
            group = k % groups
            index = run.current[group].index
            t = run.kill(group)
            run.start(group, barrier=False)
            kill_log.append({"t": t, "group": group, "incarnation": index})
        run.wait("the end of the window with kills", lambda: time.time() >= t_fail + window, kill_every_s + 30)

        def settled() -> bool:
            got = analyze(run.as_dicts(), kill_log, (t_base, t_fail), (t_fail, t_fail + window))
            return not got["errors"]

        try:
            # Polled slowly: the analysis reads every record, and the trainers need the CPU.
            run.wait("every survivor to recover and every restarted group to rejoin", settled, TAIL_TIMEOUT_S,
                     poll_s=0.5)
        except TimeoutError:
            pass  # analyze() below names what is missing
    finally:
        run.stop()
    out = analyze(run.as_dicts(), kill_log, (t_base, t_fail), (t_fail, t_fail + window))
    out["log_dir"] = str(run_dir)
    return out


def run_one(system: str, groups: int, kills: int, kill_every_s: float, workdir: Path,
            say: Callable[[str], None]) -> dict:
    sdk, lh_kind, node_flags = next((s, lh, flags) for name, s, lh, flags in SYSTEMS if name == system)
    run_dir = workdir / f"goodput-{system}-{groups}"
    run_dir.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"system": system, "sdk": sdk, "lighthouse": lh_kind, "node_flags": list(node_flags),
                           "groups": groups}
    try:
        if lh_kind == "torchft":
            lh = RustLighthouse(min_replicas=MIN_REPLICAS, log_path=run_dir / "torchft_lighthouse.log",
                                join_timeout_ms=JOIN_TIMEOUT_MS, quorum_tick_ms=QUORUM_TICK_MS,
                                heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
            try:
                lh.start()
                res.update(_run_groups(sdk, f"http://{lh.address}", groups, kills, kill_every_s, run_dir, say))
            finally:
                lh.kill()
        else:
            cluster = LocalCluster(root=run_dir / "cluster", min_replicas=MIN_REPLICAS, join_timeout_ms=JOIN_TIMEOUT_MS,
                                   quorum_tick_ms=QUORUM_TICK_MS, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
                                   extra_args=list(node_flags))
            try:
                cluster.start()
                leader = cluster.wait_for_leader(timeout=30)
                url = f"http://{cluster.client_addresses[leader]}" if sdk == "torchft" else cluster.endpoints
                res.update(_run_groups(sdk, url, groups, kills, kill_every_s, run_dir, say))
            finally:
                cluster.stop_all()
    except _Skipped as e:
        res["skipped"] = str(e)
        say(f"  goodput {system} G={groups}: SKIPPED: {e}")
        return res
    except Exception as e:  # noqa: BLE001 -- recorded as this run's error; the others still run
        res["error"] = f"{type(e).__name__}: {e}"
        res["log_dir"] = str(run_dir)
        say(f"  goodput {system} G={groups}: ERROR: {res['error']}")
        return res
    if res["errors"]:
        res["error"] = "; ".join(res["errors"])
    s = res["summary"]
    say(f"  goodput {system:18s} G={groups}: recovery median {s['recovery_median_s']} s, max "
        f"{s['recovery_max_s']} s ({s['recovered']}/{s['kills']} kills); goodput {s['goodput_ratio']} "
        f"({s['steps_per_s_failures']} / {s['steps_per_s_baseline']} steps/s); rejoin median "
        f"{s['rejoin_median_s']} s" + (f"; ERROR: {res['error']}" if "error" in res else ""))
    return res


def run_goodput(groups: list[int], kills: int, kill_every_s: float, workdir: Path,
                say: Callable[[str], None], systems: list[str] | None = None) -> dict:
    out: dict[str, Any] = {
        "config": {"groups": groups, "kills": kills, "kill_every_s": kill_every_s,
                   "window_s": kills * kill_every_s, "heartbeat_timeout_ms": HEARTBEAT_TIMEOUT_MS,
                   "join_timeout_ms": JOIN_TIMEOUT_MS, "quorum_tick_ms": QUORUM_TICK_MS,
                   "min_replicas": MIN_REPLICAS, "compute_s": COMPUTE_S, "warmup_steps": WARMUP_STEPS,
                   "worker_env": WORKER_ENV, "model": "MLP 64-256-256-10, SGD (momentum 0.9), batch 32"},
        "runs": [],
    }
    for g in groups:
        for system in systems or [s[0] for s in SYSTEMS]:
            out["runs"].append(run_one(system, g, kills, kill_every_s, workdir, say))
    out["errors"] = [f"{r['system']} G={r['groups']}: {r['error']}" for r in out["runs"] if "error" in r]
    return out
