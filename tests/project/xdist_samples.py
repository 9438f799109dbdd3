"""Run only by tests/project/test_test_rules.py with three xdist workers, as the README's command
(not collected: the name does not start with test_). Every test appends its name, kind and
start/end times to the log file named by XDIST_SAMPLES_LOG, and the worker it ran on; the caller
checks that the exclusive ones ran alone, the quiet ones beside quiet ones only (two at once), that
no more than two tests holding a CPU slot ran at once while a low_cpu one ran beside them, and the
serial ones one after another on one worker."""

import json
import os
import time

import pytest

from support.run_lock import serial_on

HOLD_S = 0.4


def _record(name: str, kind: str, hold_s: float = HOLD_S) -> None:
    start = time.time()
    time.sleep(hold_s)
    with open(os.environ["XDIST_SAMPLES_LOG"], "a") as f:
        f.write(json.dumps({"name": name, "kind": kind, "start": start, "end": time.time(),
                            "worker": os.environ.get("PYTEST_XDIST_WORKER")}) + "\n")


@pytest.mark.integration
@pytest.mark.low_cpu
def test_low_cpu() -> None:
    _record("low_cpu", "low_cpu", hold_s=6 * HOLD_S)


@pytest.mark.integration
@pytest.mark.parametrize("n", range(8))
def test_shared(n: int) -> None:
    _record(f"shared{n}", "shared")


@pytest.mark.integration
@pytest.mark.quiet
@pytest.mark.parametrize("n", range(4))
def test_quiet(n: int) -> None:
    _record(f"quiet{n}", "quiet")


@pytest.mark.integration
@pytest.mark.exclusive
@pytest.mark.parametrize("n", range(2))
def test_alone(n: int) -> None:
    _record(f"alone{n}", "exclusive")


@pytest.mark.integration
def test_shared_long() -> None:
    """Still running when the quiet tests come up (they are ordered last): they wait for it."""
    _record("shared_long", "shared", hold_s=10 * HOLD_S)


@pytest.mark.parametrize("n", range(2))
def test_unit_takes_no_lock(n: int) -> None:
    _record(f"unit{n}", "unit")


@pytest.mark.integration
@serial_on("torchft-manager-ports")
@pytest.mark.parametrize("n", range(3))
def test_serial(n: int) -> None:
    _record(f"serial{n}", "serial")
