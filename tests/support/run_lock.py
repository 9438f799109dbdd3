"""Two integration tests at a time under pytest-xdist, some alone, some one after another: the
run lock and the serial resources.

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

Alone is costly: while an exclusive test runs, the other worker's integration tests wait, so its
whole time adds to the run's wall time (``docs/design/test-suite-time.md``). A test that only
needs a fixed-named resource to itself (torchft's suites bind fixed manager ports) is instead
marked ``serial_on(resource)``: pytest-xdist's ``loadgroup`` distribution (pyproject's addopts)
sends every test on one resource to the same worker, one after another, while the other worker
goes on with anything else. ``SERIAL_RESOURCES`` names each resource and why; a group name not
listed there fails the run at collection.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Iterator

import pytest

LOCK_DIR_ENV = "LIGHTHOUSE_TESTS_LOCK_DIR"

# Resource -> why the tests that use it must not overlap one another (but may overlap any other).
SERIAL_RESOURCES = {
    "torchft-manager-ports": "torchft's own suites bind fixed manager ports (19530 + replica id): two side by "
                             "side fail with 'Address already in use'",
    "fault-harness": "the fault-injection harness's runs (3 nodes, a fault schedule, a client pool, network "
                     "namespaces or FUSE mounts): namespaces take free subnets and nftables tables as they "
                     "start, and the recovery and survivor-wait checkers' bounds assume one run at a time",
}
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


def serial_on(resource: str) -> pytest.MarkDecorator:
    """Mark a test to run after, never beside, the other tests on ``resource`` (see the module
    docstring); beside any other test."""
    if resource not in SERIAL_RESOURCES:
        raise ValueError(f"unknown serial resource {resource!r}; add it to SERIAL_RESOURCES with its reason")
    return pytest.mark.xdist_group(name=resource)


def unknown_serial_groups(items: list[pytest.Item]) -> list[str]:
    """``nodeid: group`` for every collected test in an ``xdist_group`` not in SERIAL_RESOURCES."""
    out = []
    for item in items:
        for mark in item.iter_markers("xdist_group"):
            name = mark.kwargs.get("name", mark.args[0] if mark.args else None)
            if name not in SERIAL_RESOURCES:
                out.append(f"{item.nodeid}: {name}")
    return out


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
