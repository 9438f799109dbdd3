"""The stop watchdog: a node process asked to stop exits within the deadline, however the stop
goes, and says where it hung (CI: a Slurm job's nodes did not exit within 30 s of SIGTERM)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.integration

PROGRAM = textwrap.dedent('''
    import logging, sys, threading, time
    from lighthouse_cluster.server import stop_watchdog
    logging.basicConfig(level=logging.INFO)
    def stuck_in_shutdown():
        threading.Event().wait()   # a non-daemon thread the interpreter joins at exit, forever
    if sys.argv[1] == "hang":
        threading.Thread(target=stuck_in_shutdown, name="stuck").start()
    stop_watchdog.arm(0.5)
    print("armed", flush=True)
''')


def run(mode: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    res = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, timeout=30)
    return res, time.monotonic() - started


def test_a_process_that_hangs_in_its_stop_exits_with_every_thread_stack_logged() -> None:
    res, took = run("hang")
    assert res.returncode == 1, res.stderr
    assert took < 10
    assert "stop did not finish within 0.5 s: the stack of every thread follows; exiting with status 1" in res.stderr
    assert "stuck_in_shutdown" in res.stderr, res.stderr  # where it hung


def test_a_process_that_stops_in_time_exits_with_its_own_status() -> None:
    res, _ = run("clean")
    assert res.returncode == 0, res.stderr
    assert "stop did not finish" not in res.stderr
