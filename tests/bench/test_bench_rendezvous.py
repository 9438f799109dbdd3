"""`python -m benchmarks rendezvous` (issue 34): its figures from synthetic agent reports (unit),
its refusals of bad input, and a real run of two agents on every backend installed (integration).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from benchmarks.etcd_server import etcd_missing
from benchmarks.rendezvous import (cell_text, command, creation_text, lighthouse_missing, summarize_cell,
                                   summarize_trial, table)

ROOT = Path(__file__).resolve().parents[2]
T0 = 1000.0


def _report(i: int, done: float, rank: int | None = None, world: int = 3, cpu: float = 0.1) -> dict:
    return {"index": i, "started": T0 + 0.01 * i, "created": T0 + 0.05, "done": T0 + done, "cpu_s": cpu,
            "rank": i if rank is None else rank, "world_size": world, "handler": "torch.X"}


# -- one trial -------------------------------------------------------------------------------------


def test_a_trial_is_the_last_agent_and_the_median_agent_from_the_common_start():
    out = summarize_trial(T0, [_report(0, 1.2), _report(1, 0.4), _report(2, 1.0)], 3)
    assert out["last_s"] == 1.2 and out["median_s"] == 1.0 and out["returned"] == 3
    assert out["created_median_s"] == 0.05 and out["start_skew_s"] == 0.02
    assert out["agents_cpu_s"] == pytest.approx(0.3) and out["handlers"] == ["torch.X"]
    assert "error" not in out


def test_a_trial_with_a_failed_missing_or_misranked_agent_is_an_error():
    timed_out = {"index": 2, "error": "RendezvousTimeoutError: "}
    failed = summarize_trial(T0, [_report(0, 1.0), _report(1, 1.0), timed_out], 3)
    assert failed["error"] == "RendezvousTimeoutError: " and failed["last_s"] == 1.0
    missing = summarize_trial(T0, [_report(0, 1.0), _report(1, 1.0)], 3)
    assert missing["error"] == "1 of 3 agents did not report"
    twice = summarize_trial(T0, [_report(0, 1.0), _report(1, 1.0, rank=0), _report(2, 1.0)], 3)
    assert "ranks [0, 0, 2]" in twice["error"]
    small = summarize_trial(T0, [_report(0, 1.0, world=2), _report(1, 1.0), _report(2, 1.0)], 3)
    assert "worlds of [2, 3]" in small["error"]
    first_failure_first = summarize_trial(T0, [{"index": 0, "error": "ConnectionError", "after_s": 61.0},
                                               {"index": 1, "error": "TimeoutError", "after_s": 60.0},
                                               {"index": 2, "error": "ConnectionError", "after_s": 61.5}], 3)
    assert first_failure_first["error"] == "TimeoutError; ConnectionError"
    assert summarize_trial(T0, [], 2) == {"agents": 2, "returned": 0, "error": "2 of 2 agents did not report"}


# -- a cell, the table -----------------------------------------------------------------------------


def _trial(last: float, median: float, cpu: float, server: float = 0.0, error: str | None = None) -> dict:
    t = {"agents": 2, "last_s": last, "median_s": median, "created_median_s": 0.05, "agents_cpu_s": cpu,
         "server_cpu_s": server}
    if error:
        t["error"] = error
    return t


def test_a_cell_is_the_median_and_max_over_its_valid_trials():
    cell = summarize_cell([_trial(1.2, 1.1, 0.1, 0.05), _trial(1.4, 1.2, 0.2), _trial(1.1, 1.0, 0.3),
                           _trial(9.0, 9.0, 9.0, error="RendezvousTimeoutError: ")])
    assert cell == {"trials": 4, "valid": 3, "last_median_s": 1.2, "last_max_s": 1.4, "agent_median_s": 1.1,
                    "created_median_s": 0.05, "cpu_median_s": 0.2, "errors": ["RendezvousTimeoutError: "]}
    assert cell_text(cell, None) == "1.20 / 1.40 s (agent 1.10 s), CPU 0.20 s; 1 of 4 trials failed"
    assert cell_text(summarize_cell([_trial(1, 1, 1, error="boom")]), None) == "failed: boom"
    assert cell_text(None, "etcd not installed") == "etcd not installed"


def test_the_table_has_a_row_per_n_and_a_column_per_backend_installed_or_not():
    res = {"config": {"agents": [2, 8]},
           "backends": [{"name": "c10d"}, {"name": "etcd", "missing": "etcd not installed (apt-get ...)"}],
           "cells": {"2/c10d": summarize_cell([_trial(1.2, 1.1, 0.1)]), "8/c10d": summarize_cell([_trial(2, 2, 1)])}}
    rows = table(res)
    assert rows[0] == "| agents | c10d | etcd (etcd-v2) |" and len(rows) == 4
    assert rows[2].startswith("| 2 | 1.20 / 1.20 s") and rows[3].endswith("| etcd not installed (apt-get ...) |")
    assert table(res, creation_text)[2] == "| 2 | 0.05 s | - |"


@pytest.mark.parametrize("args, message", [
    (["--agents", "2,x"], "expected comma-separated integers"),
    (["--agents", "0"], "at least 1"),
    (["--backends", "c10d,zookeeper"], "unknown backends ['zookeeper']"),
    (["--trials", "0"], "0 is not in the range x>=1"),
])
def test_bad_input_is_refused_in_one_line_before_anything_starts(args: list[str], message: str):
    result = CliRunner().invoke(command, args)
    assert result.exit_code == 2 and message in result.output


# -- a real run ------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_two_agents_rendezvous_on_every_installed_backend(tmp_path: Path):
    """N=2, one trial, every backend: c10d always rendezvouses; etcd and the lighthouse do where
    they are installed, and their columns say what is missing where they are not."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "rendezvous", "--agents", "2", "--trials", "1",
                           "--out", str(tmp_path), "--name", "rdzv"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads((tmp_path / "rdzv.json").read_text())
    expected_missing = {"c10d": None, "etcd": etcd_missing(), "lighthouse": lighthouse_missing()}
    assert {b["name"]: b.get("missing") for b in res["backends"]} == expected_missing
    for name, missing in expected_missing.items():
        if missing is None:
            cell = res["cells"][f"2/{name}"]
            assert cell["valid"] == 1 and 0 < cell["last_median_s"] < 60, (name, cell)
    assert res["errors"] == []
    md = (tmp_path / "rdzv.md").read_text()
    assert "| agents | c10d | etcd (etcd-v2) | lighthouse |" in md and "`_delay(seconds=1)`" in md
