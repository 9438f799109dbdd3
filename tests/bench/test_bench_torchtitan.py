"""`python -m benchmarks torchtitan` (issue 31): its analysis on synthetic trainer logs (unit), and
a tiny real run of one configuration (integration).

The unit tests build torchrun's ``--tee 3`` output as torchtitan and the SDK's manager write it
(``[default<rank>]:[titan] <time> - <logger> - INFO - ...``) and check what the benchmark reads
from it: step times, commits, quorum ids, heals, and the figures of each fault.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.torchtitan import (SYSTEMS, group_kill_cost, leader_kill_cost, lighthouse_stop_figures, markdown,
                                   median_step, parse_log, rejoin_figures, summarize, table, verdict)

ROOT = Path(__file__).resolve().parents[2]
T0 = dt.datetime(2026, 11, 29, 0, 37, 0).timestamp()


def _ts(t: float) -> str:
    d = dt.datetime.fromtimestamp(T0 + t)
    return d.strftime("%Y-%m-%d %H:%M:%S,") + f"{d.microsecond // 1000:03d}"


def _line(t: float, logger: str, msg: str, rank: int = 0) -> str:
    return f"[default{rank}]:[titan] {_ts(t)} - {logger} - INFO - {msg}"


def _log(steps: list[tuple[float, bool | None, int | None]], rank: int = 0, heal_at: int | None = None) -> str:
    """torchrun output of one rank: for each (end time, committed, new quorum id) a reconfigure
    line (when the quorum changes), a should_commit line (unless None) and torchtitan's step line;
    Rust lines and another rank's lines in between, which the parser must ignore."""
    out = [_line(0.0, "root", "CPU capacity: cpu with 23.54GiB memory", rank)]
    for i, (t, ok, quorum) in enumerate(steps):
        prefix = f"[torchtitan_ft_0:abc/{rank} - step {i}]"
        if quorum is not None:
            out.append(_line(t - 0.3, "torchft.manager", f"{prefix} reconfiguring for quorum_id={quorum} store=x",
                             rank))
        if heal_at == i:
            out.append(_line(t - 0.25, "torchft.manager", f"{prefix} healing required", rank))
        out.append(f"[default{rank}]:2026-11-29T00:37:17.456 [INFO] [torchft::manager] - should_commit=true")
        if ok is not None:
            out.append(_line(t - 0.1, "torchft.manager", f"{prefix} should_commit={ok} enough_replicas=True", rank))
        out.append(_line(t - 0.05, "root", "step: 99  loss:  1.0", rank + 1))  # another rank's
        out.append(_line(t, "root", f"step: {i + 1:2}  loss:  {8.0 - i / 10:.5f}  grad_norm:  1.0  memory: 0", rank))
    return "\n".join(out) + "\n"


def _steps(ends: list[float], committed: list[bool | None] | None = None,
           quorums: list[int | None] | None = None) -> list[dict]:
    committed = committed or [True] * len(ends)
    quorums = quorums or [1] * len(ends)
    return [{"step": i + 1, "t": T0 + t, "loss": 1.0, "committed": c, "quorum_id": q, "healed": False}
            for i, (t, c, q) in enumerate(zip(ends, committed, quorums))]


# -- parsing ---------------------------------------------------------------------------------------


def test_step_lines_carry_their_time_commit_and_quorum():
    text = _log([(1.0, True, 1), (2.5, True, None), (4.0, False, None), (5.0, True, 2)], heal_at=3)
    log = parse_log(text)
    assert [s["step"] for s in log.steps] == [1, 2, 3, 4]
    assert [round(s["t"] - T0, 3) for s in log.steps] == [1.0, 2.5, 4.0, 5.0]
    assert [s["committed"] for s in log.steps] == [True, True, False, True]
    assert [s["quorum_id"] for s in log.steps] == [1, 1, 1, 2]
    assert [s["healed"] for s in log.steps] == [False, False, False, True]
    assert log.heals == 1 and log.device == "CPU: cpu (23.54 GiB)" and not log.donor_crash


def test_a_step_without_a_commit_decision_is_none_and_rank_one_is_read_apart():
    text = _log([(1.0, None, 1), (2.0, True, None)], rank=1)
    assert [s["committed"] for s in parse_log(text, rank=1).steps] == [None, True]
    assert parse_log(text, rank=2).steps[0]["step"] == 99  # the other rank's own lines
    assert parse_log(text, rank=0).steps == [] and parse_log(text, rank=0).device is None


def test_the_donor_crash_is_seen_on_any_rank():
    text = _log([(1.0, True, 1)]) + "[default1]:RuntimeError: aten.add.Tensor: got mixed torch.Tensor and DTensor\n"
    assert parse_log(text).donor_crash


# -- figures ---------------------------------------------------------------------------------------


def test_median_step_takes_both_groups_steps_inside_the_window():
    g0 = _steps([1, 2, 3, 4, 5, 10])  # durations 1,1,1,1,5
    g1 = _steps([1.5, 3.5, 5.5, 7.5])  # durations 2,2,2
    med = median_step([g0, g1], T0 + 1, T0 + 6)
    # g0: steps ending 2..5 (start >= 1, end <= 6): 1,1,1,1; g1: ending 3.5 and 5.5: 2,2
    assert med["steps"] == 6 and med["median_s"] == 1.0 and med["per_group_median_s"] == [1.0, 2.0]
    assert median_step([[], []], T0, T0 + 1)["median_s"] is None


def test_leader_kill_cost_is_the_slowest_step_around_it_minus_the_median():
    steps = _steps([0, 1, 2, 3, 6, 7, 8], committed=[True, True, True, True, False, True, True])
    out = leader_kill_cost(steps, T0 + 2.5, 1.0)
    assert out["steps"] == [4, 5, 6] and out["durations_s"] == [1.0, 3.0, 1.0]
    assert out["slowest_s"] == 3.0 and out["cost_s"] == 2.0 and out["excess_s"] == 2.0
    assert out["failed_steps"] == 1 and out["complete"]
    assert not leader_kill_cost(steps, T0 + 7.5, 1.0)["complete"]
    assert leader_kill_cost(steps, T0 + 9, 1.0)["cost_s"] is None
    # a later fault (a group kill at 6.5) bounds the window: step 6 is not the leader kill's
    assert leader_kill_cost(steps, T0 + 2.5, 1.0, until=T0 + 6.5)["steps"] == [4, 5]


def test_group_kill_recovery_on_the_step_in_flight_when_its_quorum_is_new():
    # Kill at 3.5 during step 5 (3 -> 8.5), which commits on quorum 2: recovered at 8.5.
    steps = _steps([0, 1, 2, 3, 8.5, 9.5], quorums=[1, 1, 1, 1, 2, 2])
    out = group_kill_cost(steps, T0 + 3.5, 1.0)
    assert out["recovered"] and out["recovery_step"] == 5
    assert out["kill_to_commit_s"] == 5.0 and out["cost_s"] == 4.0
    assert out["lost_s"] == 4.5  # 8.5 - 3 (start of the step in flight) - 1 committed x 1.0
    assert out["quorum_before"] == 1 and out["quorum_after"] == 2 and out["failed_steps"] == 0


def test_group_kill_a_step_that_commits_on_the_old_quorum_is_not_recovery():
    # Kill at 3.9: step 5 (3 -> 4) committed on quorum 1 (its allreduce was done); step 6 fails;
    # step 7 starts after the kill and commits: recovered at 9.
    steps = _steps([0, 1, 2, 3, 4, 7, 9, 10], committed=[True, True, True, True, True, False, True, True],
                   quorums=[1, 1, 1, 1, 1, 1, 2, 2])
    out = group_kill_cost(steps, T0 + 3.9, 1.0)
    assert out["recovery_step"] == 7 and out["kill_to_commit_s"] == pytest.approx(5.1)
    assert out["failed_steps"] == 1
    assert out["lost_s"] == pytest.approx(9 - 3 - 2 * 1.0)  # steps 5 and 7 committed in the span


def test_group_kill_without_a_later_commit_is_not_recovered():
    steps = _steps([0, 1, 2, 3, 5], committed=[True, True, True, True, False])
    out = group_kill_cost(steps, T0 + 2.5, 1.0)
    assert not out["recovered"] and out["kill_to_commit_s"] is None and out["failed_steps"] == 1


def test_rejoin_and_lighthouse_stop_figures():
    restarted = _steps([20, 21, 22], committed=[False, True, True])
    survivor = _steps([18, 19, 20, 23, 24])
    out = rejoin_figures(restarted, T0 + 10, survivor, 1.0, heals=1)
    assert out["rejoined"] and out["rejoin_s"] == 11.0 and out["first_step"] == 2 and out["committed_steps"] == 2
    assert out["survivor_slowest_s"] == 3.0 and out["survivor_cost_s"] == 2.0
    assert not rejoin_figures([], T0, survivor, 1.0, heals=0)["rejoined"]
    stop = lighthouse_stop_figures(survivor, T0 + 19.5, None, None, 20.0)
    assert stop["steps_after_kill"] == 3 and stop["last_step_after_s"] == 4.5 and stop["exited_after_s"] is None
    assert lighthouse_stop_figures(survivor, T0 + 30, T0 + 31, 1, 20.0)["exited_after_s"] == 1.0


# -- a whole run: summary, table, verdict ----------------------------------------------------------


def _run(system: str, leader: bool, restart: bool = False, error: str | None = None) -> dict:
    _, label, sdk, lh, mode = next(s for s in SYSTEMS if s[0] == system)
    g0 = _steps([0, 1, 2, 3, 4, 5, 6, 9, 10, 11, 17, 18], quorums=[1] * 10 + [2, 2])
    g1 = _steps([0.1, 1.1, 2.1, 3.1, 4.1, 5.1, 6.1, 9.1, 10.1, 11.1])
    marks: dict = {"steady": (T0 + 1, T0 + 6.5), "group_kill": {"t": T0 + 11.5, "group": 1, "survivor": 0}}
    if leader:
        marks["leader_kill"] = {"t": T0 + 6.5, "failover_s": 0.6, "calls_waiting": 2}
    else:
        marks["lighthouse_kill"] = {"t": T0 + 18.5, "survivor": 0, "exit_at": None, "exit_code": None,
                                    "watched_s": 20.0}
    incs = [{"group": 0, "index": 0, "steps": g0, "heals": 0}, {"group": 1, "index": 0, "steps": g1, "heals": 0}]
    if restart:
        marks["restart"] = {"t": T0 + 12, "group": 1, "index": 1, "survivor": 0}
        incs.append({"group": 1, "index": 1, "steps": _steps([16, 17, 18]), "heals": 1})
    run = {"system": system, "label": label, "sdk": sdk, "lighthouse": lh, "mode": mode, "groups": 2,
           "marks": marks, "incarnations": incs, "device": "CPU: cpu (23.5 GiB)"}
    if error:
        run["error"] = error
    run["summary"] = summarize(run)
    return run


def test_summary_table_and_verdict_of_a_run():
    cluster = _run("ftclient-cluster", leader=True, restart=True)
    s = cluster["summary"]
    assert s["median"]["median_s"] == 1.0
    assert s["leader_kill"]["cost_s"] == 2.0 and s["leader_kill"]["failed_steps"] == 0  # step 6 -> 9: 3 s
    assert s["group_kill"]["recovered"] and s["group_kill"]["kill_to_commit_s"] == 5.5  # 11.5 -> 17 (quorum 2)
    assert s["rejoin"]["rejoin_s"] == 4.0 and s["rejoin"]["heals"] == 1  # started at 12, committed at 16
    lighthouse = _run("torchft-lighthouse", leader=False)
    assert lighthouse["summary"]["lighthouse_kill"]["steps_after_kill"] == 0
    crashed = _run("ftclient-cluster-per-step", leader=True, error="RuntimeError: g1.0 exited with 1 (donor crash)")
    crashed["summary"] = {}
    crashed["donor_crash"] = True
    res = {"runs": [lighthouse, cluster, crashed], "machine": {"versions": {}}, "config": {
        "groups": 2, "min_replicas": 1, "heartbeat_timeout_ms": 5000, "join_timeout_ms": 10000, "warmup_steps": 3,
        "steady_steps": 8, "after_steps": 4}, "errors": ["ftclient-cluster-per-step: crashed"]}
    rows = table(res)
    assert rows[0].count("|") == 5 and len({r.count("|") for r in rows}) == 1  # one column per run
    text = "\n".join(rows)
    assert "training stops (no exit within 20 s)" in text and "crashed" in text and "+2.00" in text
    assert "| 5.50 |" in text
    md = markdown(res)
    assert "DiLoCo" in md and "Errors (" in md
    ok, problems = verdict(res)
    assert not ok and problems == ["ftclient-cluster-per-step: RuntimeError: g1.0 exited with 1 (donor crash)"]
    assert verdict({"runs": [lighthouse, cluster]}) == (True, [])
    assert not verdict({"runs": []})[0]


def test_verdict_fails_a_step_failed_at_the_leader_kill_and_a_restart_that_did_not_heal():
    run = _run("torchft-cluster", leader=True, restart=True)
    run["summary"]["leader_kill"]["failed_steps"] = 1
    run["summary"]["rejoin"]["heals"] = 0
    ok, problems = verdict({"runs": [run]})
    assert not ok and len(problems) == 2


# -- a real run ------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_one_configuration_runs_end_to_end(tmp_path: Path):
    """torchft 0.2.0 on a 3-node cluster in DiLoCo mode (the configuration that runs on every SDK
    line), two groups, the fewest steps: every phase runs (leader kill, group kill) and the results
    files hold the figures."""
    pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e '.[interop]')")
    pytest.importorskip("torchft", reason="torchft is not installed (pip install -e '.[interop]')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "torchtitan", "--systems", "torchft-cluster",
                           "--warmup-steps", "2", "--steady-steps", "2", "--after-steps", "1", "--out", str(tmp_path),
                           "--name", "tt", "--verdict", "torchtitan"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "torchtitan: PASS" in proc.stdout
    res = json.loads((tmp_path / "tt.json").read_text())
    (run,) = res["runs"]
    s = run["summary"]
    assert s["median"]["median_s"] > 0
    assert s["leader_kill"]["failed_steps"] == 0 and s["group_kill"]["recovered"]
    assert "median step (s)" in (tmp_path / "tt.md").read_text()
