"""Two integration tests at a time under pytest-xdist, some alone: the run lock.

The README's test command runs two xdist workers. An integration test marked ``exclusive`` (tight
timing bounds, CPU measurements, a machine-wide check) runs alone: it holds a file lock exclusively
while every other integration test holds it shared. A turnstile lock in front keeps a waiting
exclusive test from being overtaken by the other worker's next tests. Unit tests take no lock, and
without xdist nothing is locked.

The lock is held around a test's whole run protocol (setup, call, teardown), outside
pytest-timeout's timer, which starts once the test has its turn: a test that waited a minute
behind an exclusive one is not timed out before it began. (Taken in a fixture, the wait counted
against the waiting test's timeout.) Every holder is bounded by its own timeout, so every wait is.

The lock files live in the run's base temporary directory (xdist gives each worker
``<base>/popen-gwN``), or in ``$LIGHTHOUSE_TESTS_LOCK_DIR``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Iterator

import pytest

LOCK_DIR_ENV = "LIGHTHOUSE_TESTS_LOCK_DIR"
RUN_LOCK = "xdist-run.lock"
TURNSTILE = "xdist-turnstile.lock"


@contextlib.contextmanager
def run_lock(directory: Path, exclusive: bool) -> Iterator[None]:
    """Hold the run lock in ``directory``: alone when ``exclusive``, else beside other holders."""
    with open(directory / TURNSTILE, "a") as turnstile, open(directory / RUN_LOCK, "a") as run:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if exclusive:
            fcntl.flock(run, fcntl.LOCK_EX)  # the turnstile stays held: no new test starts meanwhile
        else:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
            fcntl.flock(run, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(run, fcntl.LOCK_UN)
            fcntl.flock(turnstile, fcntl.LOCK_UN)


def lock_directory(config: pytest.Config) -> Path | None:
    """Where this xdist worker's run locks are; None outside a worker (nothing is locked)."""
    if not hasattr(config, "workerinput"):
        return None
    override = os.environ.get(LOCK_DIR_ENV)
    if override:
        return Path(override)
    basetemp = config.option.basetemp
    return Path(basetemp).parent if basetemp else None


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Run an integration test holding the run lock (the outermost wrapper: before
    pytest-timeout's timer starts)."""
    directory = lock_directory(item.config)
    if directory is None or item.get_closest_marker("integration") is None:
        yield
        return
    with run_lock(directory, item.get_closest_marker("exclusive") is not None):
        yield
