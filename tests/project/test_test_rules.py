"""The rules tests/conftest.py enforces on every run: an unmarked test starts no process and
serves nothing, and in CI (``LIGHTHOUSE_TESTS_STRICT=1``) only an expected skip may skip."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from support import skips
from support.run_lock import LOCK_DIR_ENV, RUN_LOCK
from support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]


def test_an_unmarked_test_may_not_start_a_subprocess() -> None:
    with pytest.raises(AssertionError, match="not marked integration may not start a subprocess"):
        subprocess.run(["true"], check=False)


def test_an_unmarked_test_may_not_listen() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        with pytest.raises(AssertionError, match="may not listen on a socket"):
            s.listen()


def test_an_unmarked_test_may_not_start_a_grpc_server() -> None:
    with pytest.raises(AssertionError, match="may not start a gRPC server"):
        grpc.aio.server()
    with pytest.raises(AssertionError, match="may not start a gRPC server"):
        grpc.server(None)  # type: ignore[arg-type]


def test_expected_skips_are_the_gpu_ones() -> None:
    assert skips.expected("needs a CUDA GPU")
    assert skips.expected("NCCL is not available")
    assert not skips.expected("sometool is not installed")
    assert not skips.expected("torchft is not installed")


def _run_samples(strict: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "LIGHTHOUSE_TESTS_STRICT")}
    if strict:
        env["LIGHTHOUSE_TESTS_STRICT"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA",
                           "tests/project/skip_samples.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.integration
def test_strict_mode_fails_an_unexpected_skip_and_lists_the_expected_ones() -> None:
    res = _run_samples(strict=True)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert "1 failed, 1 passed, 1 skipped" in out, out
    assert "unexpected skip (LIGHTHOUSE_TESTS_STRICT" in out and "sometool is not installed" in out, out
    assert "expected skips (tests/support/skips.py)" in out, out
    assert "test_needs_a_gpu: needs a CUDA GPU" in out, out


@pytest.mark.integration
def test_without_strict_mode_a_missing_tool_is_a_listed_skip() -> None:
    res = _run_samples(strict=False)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "1 passed, 2 skipped" in out, out
    assert "sometool is not installed" in out, out


@pytest.mark.integration
def test_strict_mode_under_xdist_lists_the_expected_skips_too() -> None:
    """The README's command runs xdist workers: the skip policy holds there too (the expected
    skips are gathered from the reports the controller receives)."""
    env = {k: v for k, v in os.environ.items() if k not in ("CI",)}
    env["LIGHTHOUSE_TESTS_STRICT"] = "1"
    res = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", "-n", "2",
                          "tests/project/skip_samples.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode == 1 and "1 failed, 1 passed, 1 skipped" in out, out
    assert "unexpected skip (LIGHTHOUSE_TESTS_STRICT" in out, out
    assert "expected skips (tests/support/skips.py)" in out and "test_needs_a_gpu: needs a CUDA GPU" in out, out


@pytest.mark.integration
def test_exclusive_tests_run_alone_quiet_ones_beside_quiet_ones_and_the_others_two_cpu_slots_at_a_time(tmp_path) -> None:
    log = tmp_path / "log.jsonl"
    env = {**os.environ, "XDIST_SAMPLES_LOG": str(log)}
    res = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", "3",
                          "tests/project/xdist_samples.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(runs) == 21

    def overlap(a: dict, b: dict) -> bool:
        return a["start"] < b["end"] and b["start"] < a["end"]

    for a in (r for r in runs if r["kind"] == "exclusive"):
        beside = [b["name"] for b in runs if b is not a and b["kind"] != "unit" and overlap(a, b)]
        assert not beside, f"{a['name']} ran beside {beside}"
    shared = [r for r in runs if r["kind"] == "shared"]
    assert any(overlap(a, b) for i, a in enumerate(shared) for b in shared[i + 1:]), "no two tests ran at once"
    # Three workers, two CPU slots: never three slot holders at once (at any holder's start, at most
    # one other runs), and a low_cpu test, which takes no slot, ran beside two of them at some point.
    slot_holders = [r for r in runs if r["kind"] in ("shared", "serial", "quiet")]
    for a in slot_holders:
        running = [b["name"] for b in slot_holders if b is not a and b["start"] <= a["start"] < b["end"]]
        assert len(running) <= 1, f"{a['name']} started beside {running}"
    low_cpu = [r for r in runs if r["kind"] == "low_cpu"]
    assert any(len([b for b in slot_holders if b["start"] <= t < b["end"]]) == 2
               for a in low_cpu for t in (b["start"] + 0.01 for b in slot_holders if overlap(a, b))
               if a["start"] <= t < a["end"]), "no low_cpu test ran beside two slot holders"
    # Quiet tests: beside quiet ones only (and unit tests), and two of them at once at some point.
    quiet = [r for r in runs if r["kind"] == "quiet"]
    for a in quiet:
        beside = [b["name"] for b in runs if b["kind"] not in ("quiet", "unit") and overlap(a, b)]
        assert not beside, f"{a['name']} ran beside {beside}"
    assert any(overlap(a, b) for i, a in enumerate(quiet) for b in quiet[i + 1:]), "no two quiet tests ran at once"
    serial = [r for r in runs if r["kind"] == "serial"]
    assert len({r["worker"] for r in serial}) == 1, serial  # one worker, so one after another
    assert not any(overlap(a, b) for i, a in enumerate(serial) for b in serial[i + 1:]), serial
    # ... and beside the other workers' tests: 1.2 s of serial tests while they have 3.2 s of shared ones
    assert any(overlap(a, b) for a in serial for b in shared), "the serial tests ran alone"


@pytest.mark.integration
def test_a_serial_group_not_on_the_resource_list_fails_the_run_at_collection() -> None:
    res = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                          "tests/project/serial_group_samples.py"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "SERIAL_RESOURCES does not list" in out and "made-up" in out, out


def _blocked_on(path: Path) -> bool:
    """Whether a process waits for a flock on ``path`` (a "->" line of /proc/locks)."""
    inode = f":{os.stat(path).st_ino} "
    return any("->" in line and inode in line for line in Path("/proc/locks").read_text().splitlines())


@pytest.mark.integration
def test_a_test_waiting_for_its_turn_is_not_timed_out_before_it_starts(tmp_path) -> None:
    """A test that waits behind an exclusive one (a minute, for some) got pytest-timeout's
    "Timeout" at setup while the lock was a fixture: its timer ran while it waited."""
    locks, started = tmp_path / "locks", tmp_path / "started"
    locks.mkdir()
    env = {**os.environ, LOCK_DIR_ENV: str(locks), "RUN_LOCK_SAMPLES_LOG": str(started)}
    hold_s = 2.5  # the sample's timeout is 1 s: it must wait well past it
    with open(locks / RUN_LOCK, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # an exclusive test running on another worker
        sub = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", "1",
                                "tests/project/run_lock_samples.py"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
        try:
            wait_for("the sub-run's test waiting for the run lock", lambda: _blocked_on(locks / RUN_LOCK), 60,
                     context=lambda: f"sub-run exit code: {sub.poll()}")
            time.sleep(hold_s)  # the subject of the test: a wait longer than the waiting test's timeout
            released = time.time()
            fcntl.flock(held, fcntl.LOCK_UN)
            out, _ = sub.communicate(timeout=120)
        finally:
            if sub.poll() is None:  # a failed wait above: no sub-run outlives the test
                sub.kill()
                sub.wait()
    assert sub.returncode == 0, out
    assert float(started.read_text()) >= released, "the test ran while the lock was held"


def _collected(*args: str) -> list[str]:
    res = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q",
                          "tests/project/opt_in_samples.py", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode in (0, 5), res.stdout + res.stderr  # 5: every test deselected
    return [line.split("::")[-1] for line in res.stdout.splitlines() if "::" in line]


@pytest.mark.integration
def test_the_torchtitan_matrix_runs_only_when_its_marker_is_asked_for() -> None:
    assert _collected() == ["test_in_every_run"]
    assert _collected("-m", "torchtitan_full") == ["test_in_the_full_matrix"]
    assert sorted(_collected("-m", "torchtitan_full or not torchtitan_full")) == ["test_in_every_run",
                                                                                  "test_in_the_full_matrix"]
    assert _collected("-m", "not torchtitan_full") == ["test_in_every_run"]
