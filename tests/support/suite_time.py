"""Where the suite's time goes, by test directory: the table every run prints at its end.

The README's test command runs on 2 cores with a budget (``.ci/run`` under 20 minutes); pytest's
``--durations`` lists the slowest tests but not which part of the suite the rest of the time is
spent in. ``TimeTable`` adds up every report's duration (setup, call and teardown) per test
directory (``tests/raft``, ``tests/sdk``, ...) and how much of it ran as ``integration`` and as
``exclusive`` (alone under xdist: the other workers' integration tests wait meanwhile). It is fed
from ``pytest_runtest_logreport``, which under xdist runs on the controller with every worker's
reports.

It also adds up the CPU each test used (``cpu_s``): the worker's own CPU, that of every child
process it reaped (cluster nodes, trainers, sub-runs) and that of the nodes its fork server forked
and reaped (``forked_cpu``), taken around each phase on the worker
(``CpuPerPhase``, a plugin conftest registers) and carried to the controller in the report's
user properties. Wall seconds say how long a test held its worker; CPU seconds say how much of
the 2 cores it used, so the two together say which tests could overlap at little cost (those
that mostly wait).
"""

from __future__ import annotations

import json
import os
import resource
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest

CPU_PROPERTY = "cpu_s"

# The directories whose tests take longest (a minute or more each for some: torchtitan runs,
# torchft's suites, fault-harness schedules, the quick bench), slowest first. ``run_order`` starts
# the run with them, so that the workers end together on short tests instead of one worker
# finishing a long test alone (longest-first scheduling); from the table every run prints.
SLOW_DIRECTORIES = ("tests/torchtitan", "tests/torchft_interop", "tests/fault_injection", "tests/bench",
                    "tests/torchrun", "tests/sdk")


@dataclass
class DirectoryTime:
    tests: int = 0
    seconds: float = 0.0
    integration_s: float = 0.0
    exclusive_s: float = 0.0
    cpu_s: float = 0.0


@dataclass
class TimedTest:
    """One test's reports added up; its start and worker place it on the run's timeline."""

    markers: list[str]
    seconds: float = 0.0
    cpu_s: float = 0.0
    start: float | None = None  # epoch seconds: the earliest of its reports' starts
    worker: str | None = None


@dataclass
class TimeTable:
    by_directory: dict[str, DirectoryTime] = field(default_factory=dict)
    # Every test, for ``write_json``.
    by_test: dict[str, TimedTest] = field(default_factory=dict)

    def add(self, nodeid: str, duration_s: float, markers: Iterable[str], cpu_s: float = 0.0,
            start: float | None = None, worker: str | None = None) -> None:
        """One report (setup, call or teardown) of the test ``nodeid`` that began at ``start``
        on ``worker``, took ``duration_s`` and used ``cpu_s`` of CPU."""
        directory = directory_of(nodeid)
        row = self.by_directory.setdefault(directory, DirectoryTime())
        marks = set(markers)
        if nodeid not in self.by_test:
            self.by_test[nodeid] = TimedTest(sorted(marks), worker=worker)
            row.tests += 1
        test = self.by_test[nodeid]
        test.seconds += duration_s
        test.cpu_s += cpu_s
        if start is not None and (test.start is None or start < test.start):
            test.start = start
        row.seconds += duration_s
        row.cpu_s += cpu_s
        if "integration" in marks:
            row.integration_s += duration_s
        if "exclusive" in marks:
            row.exclusive_s += duration_s

    def lines(self) -> list[str]:
        """The table, slowest directory first, with a total line."""
        rows = sorted(self.by_directory.items(), key=lambda kv: -kv[1].seconds)
        total = DirectoryTime(sum(r.tests for _, r in rows), sum(r.seconds for _, r in rows),
                              sum(r.integration_s for _, r in rows), sum(r.exclusive_s for _, r in rows),
                              sum(r.cpu_s for _, r in rows))
        out = [f"{'directory':<24} {'tests':>6} {'seconds':>9} {'integration':>12} {'exclusive':>10} {'cpu s':>8}"]
        for name, r in [*rows, ("total", total)]:
            out.append(f"{name:<24} {r.tests:>6} {r.seconds:>9.1f} {r.integration_s:>12.1f} {r.exclusive_s:>10.1f}"
                       f" {r.cpu_s:>8.1f}")
        return out

    def write_json(self, path: Path) -> None:
        """Every test's wall and CPU seconds, markers, worker and start (seconds after the first
        test's), slowest first (for a closer look)."""
        tests = sorted(self.by_test.items(), key=lambda kv: -kv[1].seconds)
        t0 = min((t.start for t in self.by_test.values() if t.start is not None), default=0.0)
        path.write_text(json.dumps([{"test": nodeid, "seconds": round(t.seconds, 2), "cpu_s": round(t.cpu_s, 2),
                                     "markers": t.markers, "worker": t.worker,
                                     "start_s": None if t.start is None else round(t.start - t0, 2)}
                                    for nodeid, t in tests], indent=1))


def cpu_mark() -> float:
    """CPU seconds used so far by this process, the children it has reaped, and the nodes its
    fork servers forked and reaped (``forked_cpu``)."""
    total = forked_cpu()
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def forked_cpu() -> float:
    """CPU seconds of the ended children of this process's fork servers: the nodes LocalCluster
    forked (``lighthouse_cluster.local.node_forks``) are the fork server's children, not this
    process's, so RUSAGE_CHILDREN never counts them. Read from each fork server's
    ``/proc/PID/stat`` (cutime, cstime); a child of this process is a fork server when its
    command line runs ``multiprocessing.forkserver``."""
    total = 0.0
    for children in Path("/proc/self/task").glob("*/children"):
        try:
            pids = children.read_text().split()
        except OSError:
            continue
        for pid in pids:
            try:
                if b"multiprocessing.forkserver" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                    continue
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += (int(fields[13]) + int(fields[14])) / _CLOCK_TICKS  # cutime, cstime
    return total


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def directory_of(nodeid: str) -> str:
    """``tests/raft`` for ``tests/raft/test_x.py::test_y[a/b]`` (the path before ``::``, up to two parts)."""
    path = nodeid.split("::", 1)[0]
    parts = path.split("/")[:-1] or ["."]
    return "/".join(parts[:2])


def run_order(items: list[Any]) -> list[Any]:
    """``items`` (anything with a ``nodeid`` and ``get_closest_marker``) in the order the run
    takes them: the ``exclusive`` and ``quiet`` tests last, after the others (neither runs beside
    an ordinary test, so one that came up mid-run would wait for the running ones to end); in each
    part the tests of SLOW_DIRECTORIES come first, in that order, then the rest. Collection order
    is kept otherwise (a stable sort), and every xdist worker computes the same order from the
    same collection.

    pytest-xdist's ``loadgroup`` hands out its work units largest first: the ``serial_on`` groups
    (the fault harness's runs, torchft's suites: minutes each) start the run whatever this order
    says. An exclusive test that comes up while such a test runs waits for it to end, with the
    other workers stopped at the turnstile meanwhile: up to a minute each, 454 worker-seconds in
    one measured run, and with the exclusive tests first the whole first eleven minutes ran one
    test at a time. At the end only short tests are left to wait for."""
    rank = {d: i for i, d in enumerate(SLOW_DIRECTORIES)}

    def key(item: Any) -> tuple[int, int]:
        last = any(item.get_closest_marker(name) is not None for name in ("exclusive", "quiet"))
        return (1 if last else 0, rank.get(directory_of(item.nodeid), len(rank)))

    return sorted(items, key=key)


def markers_of(keywords: Mapping[str, object]) -> list[str]:
    """The marker names among a report's keywords that this table tells apart."""
    return [name for name in ("integration", "exclusive") if name in keywords]


class CpuPerPhase:
    """A pytest plugin: on the worker that runs a test, each phase's report (setup, call,
    teardown) carries the CPU used since the previous one, or since the test's start, as the user
    property ``cpu_s``, which xdist sends to the controller with the report."""

    def __init__(self) -> None:
        self._marks: dict[str, float] = {}

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        # Before the fixtures' setup; only where tests run (an xdist controller runs none).
        self._marks[item.nodeid] = cpu_mark()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
        start, now = self._marks.get(item.nodeid), cpu_mark()
        outcome = yield
        if start is not None:
            outcome.get_result().user_properties.append((CPU_PROPERTY, now - start))
        if call.when == "teardown":
            self._marks.pop(item.nodeid, None)
        else:
            self._marks[item.nodeid] = now
