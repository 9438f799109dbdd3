"""How many integration tests run at once under pytest-xdist: CPU slots, the run lock and the
serial resources.

The README's test command runs three xdist workers on 2 cores, and what keeps the host's load at
two busy tests is not the worker count but the CPU slots: an integration test holds one of
``CPU_SLOTS`` (2) slot locks while it runs, so at most two run at once; a worker whose next test
finds both slots taken waits. A test marked ``low_cpu`` (it mostly waits: the fault harness's
runs use a third of a core over their fixed-length schedules) takes no slot, so it runs beside
two others. Without that third lane those runs held a slot for about 290 s while most of it sat
idle (``docs/design/test-suite-time.md``).

An integration test marked ``exclusive`` (tight timing bounds, CPU measurements, a machine-wide
check) runs alone: it holds a file lock exclusively while every other integration test holds it
shared. A turnstile lock in front keeps a waiting exclusive test from being overtaken by the
other workers' next tests. Unit tests take no lock, and without xdist nothing is locked.

The locks are held around a test's whole run protocol (setup, call, teardown), outside
pytest-timeout's timer, which starts once the test has its turn: a test that waited a minute
behind an exclusive one is not timed out before it began. (Taken in a fixture, the wait counted
against the waiting test's timeout.) Every holder is bounded by its own timeout, so every wait is.

The lock files live in the run's base temporary directory (xdist gives each worker
``<base>/popen-gwN``), or in ``$LIGHTHOUSE_TESTS_LOCK_DIR``.

Alone is costly: while an exclusive test runs, the other workers' integration tests wait, so its
whole time adds to the run's wall time. A test that only needs a fixed-named resource to itself
(torchft's suites bind fixed manager ports) is instead marked ``serial_on(resource)``:
pytest-xdist's ``loadgroup`` distribution (pyproject's addopts) sends every test on one resource
to the same worker, one after another, while the other workers go on with anything else.
``SERIAL_RESOURCES`` names each resource and why; a group name not listed there fails the run at
collection.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
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
# Integration tests that use CPU, at most this many at once: the 2 cores CI has.
CPU_SLOTS = 2
SLOT_LOCK = "xdist-cpu-slot-{}.lock"
SLOT_QUEUE = "xdist-cpu-slot-queue.lock"
SLOT_POLL_S = 0.02  # flock cannot wait for "any one of N" locks: a waiter tries each this often


@contextlib.contextmanager
def run_lock(directory: Path, exclusive: bool, cpu_slot: bool = True) -> Iterator[None]:
    """Hold the run lock in ``directory``: alone when ``exclusive``, else beside other holders and
    (``cpu_slot``) in one of the CPU_SLOTS slots."""
    with open(directory / TURNSTILE, "a") as turnstile, open(directory / RUN_LOCK, "a") as run:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if exclusive:
            fcntl.flock(run, fcntl.LOCK_EX)  # the turnstile stays held: no new test starts meanwhile
        else:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
            fcntl.flock(run, fcntl.LOCK_SH)
        try:
            with cpu_slot_held(directory) if cpu_slot and not exclusive else contextlib.nullcontext():
                yield
        finally:
            fcntl.flock(run, fcntl.LOCK_UN)
            fcntl.flock(turnstile, fcntl.LOCK_UN)


@contextlib.contextmanager
def cpu_slot_held(directory: Path, slots: int = CPU_SLOTS) -> Iterator[int]:
    """Hold one of ``slots`` slot locks in ``directory``; yields its index. Waiters queue on a lock
    of their own, and the first in the queue takes the next slot that comes free (a worker that
    has just released one cannot take it back past a waiter). A slot's holder is a test bounded by
    its timeout, or a dead worker whose lock the kernel dropped, so every wait is bounded."""
    files = [open(directory / SLOT_LOCK.format(i), "a") for i in range(slots)]
    try:
        with open(directory / SLOT_QUEUE, "a") as queue:
            fcntl.flock(queue, fcntl.LOCK_EX)
            try:
                held = _take_a_free_slot(files)
            finally:
                fcntl.flock(queue, fcntl.LOCK_UN)
        try:
            yield held
        finally:
            fcntl.flock(files[held], fcntl.LOCK_UN)
    finally:
        for f in files:
            f.close()


def _take_a_free_slot(files: list) -> int:
    while True:
        for index, f in enumerate(files):
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return index
            except BlockingIOError:
                continue
        time.sleep(SLOT_POLL_S)


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
    with run_lock(directory, item.get_closest_marker("exclusive") is not None,
                  cpu_slot=item.get_closest_marker("low_cpu") is None):
        yield
