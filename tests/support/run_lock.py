"""How many integration tests run at once under pytest-xdist: CPU slots, the run lock and the
serial resources.

The README's test command runs three xdist workers on 2 cores, and what keeps the host's load at
two busy tests is not the worker count but the CPU slots: an integration test holds one of
``CPU_SLOTS`` (2) slot locks while it runs, so at most two run at once; a worker whose next test
finds both slots taken waits. A test marked ``low_cpu`` (it mostly waits: the fault harness's
runs use a third of a core over their fixed-length schedules) takes no slot, so it runs beside
two others. Without that third lane those runs held a slot for about 290 s while most of it sat
idle (``docs/design/test-suite-time.md``).

An integration test marked ``exclusive`` (busy loops that load both cores, CPU measurements, a
machine-wide check) runs alone: it holds a file lock exclusively while every other integration
test holds it shared. A turnstile lock in front keeps a waiting exclusive test from being
overtaken by the other workers' next tests. Unit tests take no lock, and without xdist nothing is
locked.

An integration test marked ``quiet`` (timing bounds of a second or less, using well under a core)
needs a host that no ordinary test loads, but not the host to itself: it runs beside other quiet
tests only, two at a time (each holds a CPU slot), never beside a test that is not quiet. Alone,
the quiet tests had the host at under one core of two for about two minutes of every run. Two
more lock files keep the kinds apart: every running quiet test holds ``QUIET_LOCK`` shared, every
other one ``BUSY_LOCK``; a test passing the turnstile first waits until no test of the other kind
runs (an exclusive hold of that kind's lock, let go at once), then takes its own kind's, and only
then lets the turnstile go, so no test of the other kind can start in between.

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
QUIET_LOCK = "xdist-quiet.lock"  # held shared by every running quiet test
BUSY_LOCK = "xdist-busy.lock"  # held shared by every running test that is neither quiet nor exclusive
ALONE, QUIET, SHARED = "alone", "quiet", "shared"  # how a test runs: run_lock's ``kind``
# Integration tests that use CPU, at most this many at once: the 2 cores CI has.
CPU_SLOTS = 2
SLOT_LOCK = "xdist-cpu-slot-{}.lock"
SLOT_QUEUE = "xdist-cpu-slot-queue.lock"
SLOT_POLL_S = 0.02  # flock cannot wait for "any one of N" locks: a waiter tries each this often


@contextlib.contextmanager
def run_lock(directory: Path, kind: str, cpu_slot: bool = True) -> Iterator[None]:
    """Hold the run lock in ``directory`` as a test of ``kind``: ALONE (no other integration test
    beside it), QUIET (beside other quiet tests only) or SHARED (beside any but those two); and,
    unless ALONE, one of the CPU_SLOTS slots when ``cpu_slot``."""
    if kind not in (ALONE, QUIET, SHARED):
        raise ValueError(f"kind {kind!r}: use ALONE, QUIET or SHARED")
    with contextlib.ExitStack() as held:
        turnstile, run, quiet, busy = (held.enter_context(open(directory / name, "a"))
                                       for name in (TURNSTILE, RUN_LOCK, QUIET_LOCK, BUSY_LOCK))
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        held.callback(fcntl.flock, turnstile, fcntl.LOCK_UN)
        if kind == ALONE:
            fcntl.flock(run, fcntl.LOCK_EX)  # the turnstile stays held: no new test starts meanwhile
            held.callback(fcntl.flock, run, fcntl.LOCK_UN)
            yield
            return
        other, own = (busy, quiet) if kind == QUIET else (quiet, busy)
        fcntl.flock(other, fcntl.LOCK_EX)  # until no test of the other kind runs ...
        fcntl.flock(other, fcntl.LOCK_UN)  # ... and none can start: this test holds the turnstile
        fcntl.flock(own, fcntl.LOCK_SH)
        held.callback(fcntl.flock, own, fcntl.LOCK_UN)
        fcntl.flock(run, fcntl.LOCK_SH)
        held.callback(fcntl.flock, run, fcntl.LOCK_UN)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        if cpu_slot:
            held.enter_context(cpu_slot_held(directory))
        yield


def kind_of(item: pytest.Item) -> str:
    """ALONE for an ``exclusive`` test, QUIET for a ``quiet`` one, else SHARED."""
    if item.get_closest_marker("exclusive") is not None:
        return ALONE
    return QUIET if item.get_closest_marker("quiet") is not None else SHARED


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
    with run_lock(directory, kind_of(item), cpu_slot=item.get_closest_marker("low_cpu") is None):
        yield
