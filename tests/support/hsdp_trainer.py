"""One replica group of ``examples/train_hsdp.py`` (FSDP2 in the group, ftclient across groups) for
``support.training.TrainingRun``.

The example's launcher is the process the harness starts (its own session, so a SIGKILL of the
trainer takes its ranks too); it starts ``nproc`` ranks and, with ``--max-restarts``, starts them
all again when one dies. The trainers of a run start together (``TrainingRun``'s start barrier:
the example's ``--ready-file`` / ``--go-file``), so the first quorum has every group; a restarted
group finds the go file and starts at once. Every rank prints a start line (``group= rank= pid= attempt=``) and one line
per step; at the end each rank writes ``<name>.rank<r>.json``. ``lines()`` parses the step lines
with the attempt (the launcher's restart) each belongs to, ``heals()`` the ones that healed and
committed, ``rank_pid()`` finds a rank's process so that a test can kill one rank alone, and
``state_dict_reads_during_compute()`` the lines in which a rank reported a state-dict read while a
forward or backward pass ran in its process.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from support.trainer_process import GO_FILE, ROOT, TrainerProcess

HSDP_EXAMPLE = ROOT / "examples" / "train_hsdp.py"

START_LINE = re.compile(r"^group=(?P<group>\d+) rank=(?P<rank>\d+) pid=(?P<pid>\d+) attempt=(?P<attempt>\d+) ")
STEP_LINE = re.compile(r"^group=(?P<group>\d+) rank=(?P<rank>\d+) step=(?P<step>\d+) loss=(?P<loss>\S+) "
                       r"quorum_id=(?P<quorum_id>-?\d+) participants=(?P<participants>\d+) "
                       r"committed=(?P<committed>True|False) samples=(?P<samples>\d+)"
                       r"(?: healed_to=(?P<healed_to>\d+))?")
READ_DURING_COMPUTE = re.compile(r"^group=\d+ rank=\d+ state_dict read during (?:forward|backward) ")


@dataclass(kw_only=True)
class HsdpExampleTrainer(TrainerProcess):
    """One replica group: the launcher of ``examples/train_hsdp.py`` and the ranks it starts."""

    args: list[str]
    nproc: int = 2

    DIGESTS: ClassVar[tuple[str, ...]] = ("params_sha256", "optim_sha256")

    @classmethod
    def groups(cls, n: int, workdir: Path, lighthouse: str, args: list[str]) -> list[HsdpExampleTrainer]:
        return [cls(group=g, workdir=workdir, lighthouse=lighthouse, args=list(args)) for g in range(n)]

    @property
    def output_path(self) -> Path:
        return self.workdir / f"{self.name}.json"

    def output_paths(self) -> list[Path]:
        return [self.workdir / f"{self.name}.rank{r}.json" for r in range(self.nproc)]

    @property
    def ready_path(self) -> Path:
        return self.workdir / f"{self.name}.ready"

    @property
    def go_path(self) -> Path:
        return self.workdir / GO_FILE

    def command(self) -> list[str]:
        return [sys.executable, str(HSDP_EXAMPLE), "--output", str(self.output_path), "--log-level", "info",
                "--nproc-per-group", str(self.nproc), "--ready-file", str(self.ready_path),
                "--go-file", str(self.go_path), *self.args]

    def lines(self) -> list[dict[str, Any]]:
        """Every step line of this incarnation so far, in order, with its rank's attempt."""
        attempt: dict[int, int] = {}
        out = []
        for line in self.output().splitlines():
            if m := START_LINE.match(line):
                attempt[int(m["rank"])] = int(m["attempt"])
            elif m := STEP_LINE.match(line):
                rank = int(m["rank"])
                out.append({"rank": rank, "attempt": attempt.get(rank, 0), "step": int(m["step"]),
                            "loss": float(m["loss"]), "quorum_id": int(m["quorum_id"]),
                            "participants": int(m["participants"]), "committed": m["committed"] == "True",
                            "samples": int(m["samples"]), "healed": m["healed_to"] is not None})
        return out

    def rank_pid(self, rank: int) -> tuple[int, int] | None:
        """(pid, attempt) of ``rank``'s latest process, once it printed its start line."""
        found = None
        for line in self.output().splitlines():
            m = START_LINE.match(line)
            if m and int(m["rank"]) == rank:
                found = (int(m["pid"]), int(m["attempt"]))
        return found

    def state_dict_reads_during_compute(self) -> list[str]:
        """The lines in which a rank reported a state-dict read while a forward or backward pass
        ran in its process (every attempt of this incarnation)."""
        return [line for line in self.output().splitlines() if READ_DURING_COMPUTE.match(line)]

    def heals(self, rank: int = 0) -> list[dict[str, Any]]:
        """``rank``'s step lines that healed from a peer and committed (every attempt)."""
        return [r for r in self.lines() if r["rank"] == rank and r["healed"] and r["committed"]]

    def step(self) -> int:
        """The step every rank of this incarnation has printed (-1 until each printed one): the
        ranks print their lines independently, so rank 0's alone can run one step ahead."""
        last: dict[int, int] = {}
        for r in self.lines():
            last[r["rank"]] = r["step"]
        return min(last.values()) if len(last) == self.nproc else -1

    def results(self) -> list[dict[str, Any] | None]:
        out: list[dict[str, Any] | None] = []
        for path in self.output_paths():
            try:
                out.append(json.loads(path.read_text()))
            except (FileNotFoundError, json.JSONDecodeError):
                out.append(None)
        return out

    def seamless_problems(self, result: dict[str, Any] | None = None) -> list[str]:
        """Every step of the rank's result committed without error, no heal but step 0's, the
        steps contiguous."""
        assert result is not None, "the example's steps are in its result"
        recs = result["steps"]
        problems = []
        bad = [r for r in recs if not r["committed"] or r["errored"] or (r["healed"] and r["step_before"] > 0)]
        if bad:
            problems.append(f"{self.name} rank {result['rank']}: steps not seamless: {bad[:3]}")
        steps = [r["step"] for r in recs]
        if steps != list(range(1, len(steps) + 1)):
            problems.append(f"{self.name} rank {result['rank']}: steps not contiguous: {steps}")
        return problems
