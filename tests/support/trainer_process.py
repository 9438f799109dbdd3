"""One replica group's trainer process, and the three trainers the training tests run.

A trainer starts in its own session (so a SIGKILL takes the ranks it started too), logs to
``<workdir>/g<group>.<incarnation>.log``, and a restart is a new incarnation with its own files.
Its environment is this process's without what would change a trainer's behaviour unasked
(torchrun's rank variables, ``TORCHFT_*`` settings; ``DROPPED_ENV``), plus ``BASE_ENV``, the
kind's own settings, the test's ``env``, ``TORCHFT_LIGHTHOUSE`` (``lighthouse``: the whole value, a
URL or a comma-separated list) and ``REPLICA_GROUP_ID``.

The kinds (each says what to run, how far it got and where its results are):

* ``DdpExampleTrainer``: ``examples/train_ddp.py`` (ftclient, or ``--sdk torchft``), one process
  per replica group that may start more ranks itself; one JSON result per rank; per-step lines on
  stdout (``step_lines``);
* ``DilocoExampleTrainer``: ``examples/train_diloco.py`` (ftclient's DiLoCo / LocalSGD); one JSON
  result; per-synchronisation lines (``rounds``);
* ``TorchftTrainer``: ``tests/support/torchft_trainer.py`` (torchft's own Manager, DDP and
  Optimizer, unchanged); per-step JSON records (``records``), one JSON result, and a start
  barrier (``ready_path``, ``go_path``);
* ``LivenessTrainer``: ``tests/support/liveness_trainer.py`` (ftclient's Manager, every phase of
  every step timestamped; a group can hold before its quorum or its allreduce at a given step, and
  carry ballast state so a checkpoint transfer lasts); per-step and per-event JSON records
  (``records``, ``events``), one JSON result, and the start barrier.

``support.training.TrainingRun`` starts them, waits on them and compares their results.
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
from typing import Any, ClassVar

ROOT = Path(__file__).resolve().parents[2]
DDP_EXAMPLE = ROOT / "examples" / "train_ddp.py"
DILOCO_EXAMPLE = ROOT / "examples" / "train_diloco.py"
TORCHFT_TRAINER = Path(__file__).resolve().parent / "torchft_trainer.py"

# Never inherited: a trainer would take them for torchrun's, retry lighthouse calls, bind a fixed
# manager port, talk to another lighthouse or bucketize DiLoCo's averages unasked.
DROPPED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "TORCHFT_QUORUM_RETRIES", "TORCHFT_MANAGER_PORT", "TORCHFT_LIGHTHOUSE", "TORCHFT_USE_BUCKETIZATION")
# TORCHFT_TIMEOUT_SEC bounds collectives, commit and checkpoint transfer; TORCHFT_QUORUM_TIMEOUT_SEC
# a quorum; TORCHFT_CONNECT_TIMEOUT_SEC the first connection to the lighthouse.
BASE_ENV = {
    "TORCHFT_TIMEOUT_SEC": "15",
    "TORCHFT_QUORUM_TIMEOUT_SEC": "30",
    "TORCHFT_CONNECT_TIMEOUT_SEC": "10",
    "PYTHONUNBUFFERED": "1",
}


def inherited_env() -> dict[str, str]:
    """This process's environment without ``DROPPED_ENV``."""
    return {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


@dataclass(kw_only=True)
class TrainerProcess:
    group: int
    lighthouse: str  # TORCHFT_LIGHTHOUSE
    workdir: Path
    env: dict[str, str] = field(default_factory=dict)  # the test's settings, over BASE_ENV
    incarnation: int = 0
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    killed: bool = False  # SIGKILLed on purpose (and not restarted yet)
    history: list[int] = field(default_factory=list)  # pids of earlier incarnations
    # Run the command under this (e.g. ``ip netns exec NS``: it execs, so the pid is the trainer's).
    launch_prefix: list[str] = field(default_factory=list)

    # The result keys holding digests that every replica group must end with identical.
    DIGESTS: ClassVar[tuple[str, ...]] = ()

    @property
    def name(self) -> str:
        return f"g{self.group}.{self.incarnation}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    @property
    def ready_path(self) -> Path | None:
        """A file the trainer creates once set up, when it waits at a start barrier."""
        return None

    @property
    def go_path(self) -> Path | None:
        """The file the trainer waits for before its first step (the start barrier), if any."""
        return None

    def command(self) -> list[str]:
        raise NotImplementedError

    def kind_env(self) -> dict[str, str]:
        """The kind's own settings, over BASE_ENV and under the test's ``env``."""
        return {}

    def environment(self) -> dict[str, str]:
        return {**inherited_env(), **BASE_ENV, **self.kind_env(), **self.env,
                "TORCHFT_LIGHTHOUSE": self.lighthouse, "REPLICA_GROUP_ID": str(self.group)}

    def step(self) -> int:
        """How far this incarnation got (-1 before its first step)."""
        raise NotImplementedError

    def results(self) -> list[dict[str, Any] | None]:
        """This incarnation's result files, one per rank (None where not written yet)."""
        raise NotImplementedError

    def process_problems(self, result: dict[str, Any] | None = None) -> list[str]:
        """Why this trainer (and ``result``, one of its results) did not run as one process from
        its start to its end: empty when it did."""
        return [] if self.incarnation == 0 else [f"{self.name} was restarted"]

    def seamless_problems(self, result: dict[str, Any] | None = None) -> list[str]:
        """Why its training was not seamless (beyond ``process_problems``): a step not committed
        or errored, a heal after the first step, a gap in its steps; empty when it was."""
        raise NotImplementedError

    def start(self) -> None:
        env = self.environment()
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen([*self.launch_prefix, *self.command()], stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=env, cwd=str(self.workdir),
                                            start_new_session=True)
        self.started_at = time.time()
        self.killed = False

    def kill(self) -> None:
        """SIGKILL the trainer's whole process group (the ranks it started too) and reap it."""
        p = self.process
        if p is None:
            return
        self.killed = True
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def restart(self) -> None:
        self.kill()
        if self.process is not None:
            self.history.append(self.process.pid)
        self.incarnation += 1
        self.start()

    def output(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def returncode(self) -> int | None:
        return self.process.poll() if self.process is not None else None

    def tail(self, lines: int = 30) -> str:
        """The last lines of this incarnation's output, for a failure message."""
        text = self.output().splitlines() or ["(no output)"]
        pid = self.process.pid if self.process is not None else "-"
        return "\n".join([f"--- trainer {self.name} (pid {pid}, rc {self.returncode()}) {self.log_path} ---",
                          *[line[:400] for line in text[-lines:]]])


# -- examples/train_ddp.py --------------------------------------------------------------------------

STEP_LINE = re.compile(r"^group=(?P<group>\d+)(?: rank=(?P<rank>\d+))? step=(?P<step>\d+) loss=(?P<loss>\S+) "
                       r"quorum_id=(?P<quorum_id>-?\d+) participants=(?P<participants>\d+) "
                       r"committed=(?P<committed>True|False)", re.MULTILINE)


@dataclass(kw_only=True)
class DdpExampleTrainer(TrainerProcess):
    """One replica group: one process of ``examples/train_ddp.py`` (which may start more ranks)."""

    num_groups: int
    args: list[str]
    nproc: int = 1
    sdk: str = "ftclient"

    DIGESTS: ClassVar[tuple[str, ...]] = ("params_sha256", "optim_sha256")

    @classmethod
    def groups(cls, n: int, workdir: Path, lighthouse: str | list[str], args: list[str],
               per_group: dict[int, list[str]] | None = None, **kwargs: Any) -> list[DdpExampleTrainer]:
        """``n`` replica groups; ``lighthouse`` is every group's TORCHFT_LIGHTHOUSE, or one per
        group; ``per_group`` adds arguments to some groups'."""
        return [cls(group=g, num_groups=n, workdir=workdir,
                    lighthouse=lighthouse if isinstance(lighthouse, str) else lighthouse[g],
                    args=[*args, *(per_group or {}).get(g, [])], **kwargs) for g in range(n)]

    @property
    def output_path(self) -> Path:
        return self.workdir / f"{self.name}.json"

    def output_paths(self) -> list[Path]:
        if self.nproc == 1:
            return [self.output_path]
        return [self.workdir / f"{self.name}.rank{r}.json" for r in range(self.nproc)]

    def kind_env(self) -> dict[str, str]:
        return {"NUM_REPLICA_GROUPS": str(self.num_groups)}

    def command(self) -> list[str]:
        return [sys.executable, str(DDP_EXAMPLE), "--sdk", self.sdk, "--output", str(self.output_path),
                "--log-level", "info", "--nproc-per-group", str(self.nproc), *self.args]

    def step_lines(self, rank: int = 0) -> list[dict[str, Any]]:
        """The per-step lines printed so far by ``rank`` of this incarnation."""
        out = []
        for m in STEP_LINE.finditer(self.output()):
            if int(m["rank"] or 0) == rank:
                out.append({"step": int(m["step"]), "quorum_id": int(m["quorum_id"]),
                            "participants": int(m["participants"]), "committed": m["committed"] == "True"})
        return out

    def step(self) -> int:
        recs = self.step_lines()
        return recs[-1]["step"] if recs else -1

    def results(self) -> list[dict[str, Any] | None]:
        return [_read_json(path) for path in self.output_paths()]

    def process_problems(self, result: dict[str, Any] | None = None) -> list[str]:
        problems = super().process_problems(result)
        assert self.process is not None
        if result is not None and self.nproc == 1 and result["pid"] != self.process.pid:
            problems.append(f"{self.name}: result from pid {result['pid']}, not {self.process.pid}")
        return problems

    def seamless_problems(self, result: dict[str, Any] | None = None) -> list[str]:
        """Every step from the first committed exactly once, without error; no heal but the init
        sync of step 0."""
        assert result is not None, "the example's steps are in its result"
        recs = result["steps"]
        problems = []
        bad = [r for r in recs if not r["committed"] or r["errored"] or (r["healed"] and r["step_before"] > 0)]
        if bad:
            problems.append(f"{self.name}: steps not seamless: {bad[:5]}")
        steps = [r["step"] for r in recs]
        if steps != list(range(1, len(steps) + 1)):
            problems.append(f"{self.name}: steps not contiguous: {steps}")
        return problems


# -- examples/train_diloco.py -----------------------------------------------------------------------

ROUND_LINE = re.compile(
    r"^group=(?P<group>\d+) round=(?P<round>\d+) step=(?P<step>\d+) fragment=(?P<fragment>\S+) loss=(?P<loss>\S+) "
    r"quorum_id=(?P<quorum_id>-?\d+) participants=(?P<participants>\d+) committed=(?P<committed>True|False) "
    r"healed=(?P<healed>True|False)", re.MULTILINE)


@dataclass(kw_only=True)
class DilocoExampleTrainer(TrainerProcess):
    """One replica group: one process of ``examples/train_diloco.py``."""

    args: list[str]

    DIGESTS: ClassVar[tuple[str, ...]] = ("params_sha256", "outer_sha256")

    @property
    def output_path(self) -> Path:
        return self.workdir / f"{self.name}.json"

    def kind_env(self) -> dict[str, str]:
        return {"TORCHFT_TIMEOUT_SEC": "10"}

    def command(self) -> list[str]:
        return [sys.executable, str(DILOCO_EXAMPLE), "--output", str(self.output_path), "--log-level", "info",
                *self.args]

    def rounds(self) -> list[dict[str, Any]]:
        """The synchronisation lines printed so far by this incarnation."""
        return [{"round": int(m["round"]), "step": int(m["step"]), "fragment": m["fragment"],
                 "quorum_id": int(m["quorum_id"]), "participants": int(m["participants"]),
                 "committed": m["committed"] == "True", "healed": m["healed"] == "True"}
                for m in ROUND_LINE.finditer(self.output())]

    def step(self) -> int:
        rounds = self.rounds()
        return rounds[-1]["step"] if rounds else -1

    def results(self) -> list[dict[str, Any] | None]:
        return [_read_json(self.output_path)]


# -- tests/support/torchft_trainer.py ---------------------------------------------------------------

# A slow group (``slow=True``) spends this long before each quorum, so the others' Quorum calls
# wait at the leader for it every step (a fault then hits calls in flight).
SLOW_GROUP_S = 0.2
# To ride out a restart or loss of the node a torchft trainer talks to: the lighthouse call of the
# step in flight fails (UNAVAILABLE / connection refused) and torchft's manager retries it after
# quorum_timeout / (retries + 1) seconds, each attempt with the full quorum timeout; the
# Python-side deadline of the whole quorum is the same quorum timeout, so every retry must be done
# within it.
TORCHFT_RESTART_ENV = {
    "TORCHFT_QUORUM_TIMEOUT_SEC": "10",
    "TORCHFT_QUORUM_RETRIES": "9",  # -> ~1 s between attempts, 9 s of node downtime tolerated
}
GO_FILE = "go"


@dataclass(kw_only=True)
class _FileProtocolTrainer(TrainerProcess):
    """A trainer that reports through files in ``workdir``: progress lines, a result, a ready
    file, and waits for the shared go file (torchft_trainer.py, liveness_trainer.py)."""

    @property
    def progress_path(self) -> Path:
        return self.workdir / f"{self.name}.progress.jsonl"

    @property
    def result_path(self) -> Path:
        return self.workdir / f"{self.name}.result.json"

    @property
    def ready_path(self) -> Path:
        return self.workdir / f"{self.name}.ready"

    @property
    def go_path(self) -> Path:
        return self.workdir / GO_FILE


@dataclass(kw_only=True)
class TorchftTrainer(_FileProtocolTrainer):
    """One replica group of ``tests/support/torchft_trainer.py``: its progress records, its result
    and its output log. Every trainer of a run sets up, then waits for ``go_path`` (the start
    barrier), so that every group joins the first quorum and none heals at a later step."""

    steps: int
    step_sleep: float
    min_final_participants: int
    min_replica_size: int
    slow: bool = False
    args: list[str] = field(default_factory=list)
    python: str = sys.executable

    DIGESTS: ClassVar[tuple[str, ...]] = ("digest",)

    def command(self) -> list[str]:
        slow = ["--pre-quorum-sleep", str(SLOW_GROUP_S)] if self.slow else []
        return [self.python, str(TORCHFT_TRAINER), "--replica-group", str(self.group), "--steps", str(self.steps),
                "--min-final-participants", str(self.min_final_participants),
                "--min-replica-size", str(self.min_replica_size), "--step-sleep", str(self.step_sleep),
                "--progress", str(self.progress_path), "--result", str(self.result_path),
                "--ready-file", str(self.ready_path), "--go-file", str(self.go_path), *slow, *self.args]

    def records(self) -> list[dict[str, Any]]:
        """One record per step attempt so far (see torchft_trainer.py)."""
        try:
            lines = self.progress_path.read_text().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line being written
        return out

    def step(self) -> int:
        recs = self.records()
        return recs[-1]["step_after"] if recs else -1

    def results(self) -> list[dict[str, Any] | None]:
        return [_read_json(self.result_path)]

    def process_problems(self, result: dict[str, Any] | None = None) -> list[str]:
        problems = super().process_problems(result)
        recs = self.records()
        assert self.process is not None
        pids = {r["pid"] for r in recs}
        if not recs:
            problems.append(f"{self.name} recorded no steps")
        elif pids != {self.process.pid}:
            problems.append(f"{self.name}: records from several processes {pids}")
        return problems

    def disruptions(self) -> list[tuple[float, str]]:
        """(time, what) for every step that was not seamless: not committed or errored, healed
        after step 0 (the group was left out of a quorum and caught up), or run under a different
        quorum id than the step before (a process-group reconfiguration)."""
        found = []
        prev_quorum = None
        for r in self.records():
            where = f"{self.name} step {r['step']} (quorum {r['quorum_id']}, t={r['t_start']:.3f})"
            if not r["committed"] or r["errored"]:
                found.append((r["t_start"], f"{where}: not committed, errored={(r['errored'] or '')[:120]!r}"))
            if r["healed"] and r["step"] > 0:
                found.append((r["t_start"], f"{where}: healed to step {r['step_after'] - 1}"))
            if prev_quorum is not None and r["quorum_id"] != prev_quorum:
                found.append((r["t_start"], f"{where}: quorum id changed from {prev_quorum}"))
            prev_quorum = r["quorum_id"]
        return found

    def seamless_problems(self, result: dict[str, Any] | None = None) -> list[str]:
        """Every step from 0 attempted once and committed, no heal after step 0, one quorum id
        throughout."""
        problems = [what for _, what in self.disruptions()][:20]
        steps = [r["step"] for r in self.records()]
        if steps != list(range(len(steps))):
            problems.append(f"{self.name}: steps not contiguous from 0: {steps}")
        return problems

    def tail(self, lines: int = 25) -> str:
        return super().tail(lines) + "\n  last progress: " + json.dumps(self.records()[-3:])[:1500]


# -- tests/support/liveness_trainer.py --------------------------------------------------------------

LIVENESS_TRAINER = Path(__file__).resolve().parent / "liveness_trainer.py"


@dataclass(kw_only=True)
class LivenessTrainer(_FileProtocolTrainer):
    """One replica group of ``tests/support/liveness_trainer.py`` (ftclient's Manager with phase
    timestamps per step, and the hold/ballast knobs of the liveness tests)."""

    steps: int
    min_replica_size: int = 2
    min_final_participants: int = 1
    step_sleep: float = 0.0
    hold: str = "none"
    hold_at_step: int = -1
    state_mb: int = 0
    host: str = "127.0.0.1"  # where the other groups reach it (its namespace's address in one)

    DIGESTS: ClassVar[tuple[str, ...]] = ("digest",)

    def command(self) -> list[str]:
        return [sys.executable, str(LIVENESS_TRAINER), "--ready-file", str(self.ready_path),
                "--go-file", str(self.go_path), "--replica-group", str(self.group), "--steps", str(self.steps),
                "--min-replica-size", str(self.min_replica_size),
                "--min-final-participants", str(self.min_final_participants), "--step-sleep", str(self.step_sleep),
                "--hold", self.hold, "--hold-at-step", str(self.hold_at_step), "--state-mb", str(self.state_mb),
                "--host", self.host, "--progress", str(self.progress_path), "--result", str(self.result_path)]

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        """The progress records so far (of ``kind``)."""
        try:
            lines = self.progress_path.read_text().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written
            if kind is None or rec["kind"] == kind:
                out.append(rec)
        return out

    def records(self) -> list[dict[str, Any]]:
        """One record per step attempt so far."""
        return self.events("step")

    def step(self) -> int:
        recs = self.records()
        return recs[-1]["step_after"] if recs else -1

    def results(self) -> list[dict[str, Any] | None]:
        return [_read_json(self.result_path)]

    def tail(self, lines: int = 30) -> str:
        return super().tail(lines) + "\n  last events: " + json.dumps(self.events()[-4:])[:1500]
