"""Run only by tests/project/test_test_rules.py, under one xdist worker, while that test holds
the run lock exclusively (as an exclusive test on another worker would); not collected (the name
does not start with test_). The test below waits its turn for longer than its own timeout, and
must still pass: its timeout counts from when it got the lock. It writes when it started to the
file named by RUN_LOCK_SAMPLES_LOG."""

import os
import time

import pytest


@pytest.mark.integration
@pytest.mark.timeout(1)
def test_waits_its_turn_longer_than_its_timeout() -> None:
    with open(os.environ["RUN_LOCK_SAMPLES_LOG"], "w") as f:
        f.write(repr(time.time()))
