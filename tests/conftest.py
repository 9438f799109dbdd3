"""Shared fixtures and the two rules every test run enforces.

* **A test that starts a process or serves a socket is an integration test.** Tests are laid out
  by the package they test (``tests/core``, ``tests/raft``, ``tests/server``, ...); within them,
  ``@pytest.mark.integration`` marks every test that starts node processes, subprocesses or
  servers. An unmarked test that tries (``subprocess``, ``multiprocessing``, ``os.fork``, a
  listening socket, a gRPC server) fails at that call, so ``pytest -m "not integration"`` stays
  the fast run it says it is (no processes, no servers; under a minute).
* **No silent skips in CI** (``support.skips``): with ``LIGHTHOUSE_TESTS_STRICT=1`` or ``CI`` set,
  a skip that is not on the expected list fails.

Under pytest-xdist, integration tests run two at a time (two CPU slots; those marked ``low_cpu``
take none), those marked ``exclusive`` alone and last, those marked ``quiet`` last and beside
other quiet tests only, and those marked ``serial_on(resource)`` one after another on one worker
(``support.run_lock``, ``support.suite_time.run_order``).

Tests marked ``torchtitan_full`` (the full matrix of torchtitan's trainer on the cluster: minutes
each) run only when the ``-m`` expression names the marker (``pytest -m torchtitan_full``); every
other run deselects them.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import socket
import subprocess
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import grpc.aio
import pytest

from lighthouse_cluster.local.cluster import LocalCluster
from support import skips
from support.suite_time import CPU_PROPERTY, CpuPerPhase, TimeTable, markers_of, run_order
# CPU slots under xdist: exclusive tests alone, quiet ones together (a hook: pytest finds it here).
from support.run_lock import pytest_runtest_protocol  # noqa: F401
from support.run_lock import unknown_serial_groups


@pytest.fixture
def make_cluster(tmp_path: Any) -> Iterator[Callable[..., LocalCluster]]:
    """Start ``LocalCluster(root=tmp_path/..., **kwargs)`` (as a context manager; its nodes forked
    from the fork server, ``fork_nodes``, unless ``kwargs`` says otherwise); every node process it
    started is killed when the test ends, whatever happened."""
    started: list[LocalCluster] = []
    with contextlib.ExitStack() as stack:

        def make(**kwargs: Any) -> LocalCluster:
            cluster = LocalCluster(root=tmp_path / f"cluster{len(started)}", **{"fork_nodes": True, **kwargs})
            started.append(cluster)
            # Registered before entering: a start that fails half-way still gets cleaned up.
            stack.callback(cluster.stop_all)
            return stack.enter_context(cluster)

        yield make


# -- the heavy matrix runs when asked for ---------------------------------------------------------

OPT_IN_MARKERS = ("torchtitan_full",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unknown = unknown_serial_groups(items)
    if unknown:
        raise pytest.UsageError("xdist_group names that tests/support/run_lock.py's SERIAL_RESOURCES does not list "
                                "(mark with serial_on(resource)): " + "; ".join(unknown))
    items[:] = run_order(items)
    asked = config.getoption("markexpr", "") or ""
    opt_in = [m for m in OPT_IN_MARKERS if m not in asked]
    if not opt_in:
        return
    kept, deselected = [], []
    for item in items:
        (deselected if any(item.get_closest_marker(m) for m in opt_in) else kept).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


# -- unit tests start nothing ----------------------------------------------------------------------

_REFUSED = (
    (subprocess.Popen, "__init__", "start a subprocess"),
    (multiprocessing.process.BaseProcess, "start", "start a multiprocessing process"),
    (os, "fork", "fork"),
    (socket.socket, "listen", "listen on a socket"),
    (grpc, "server", "start a gRPC server"),
    (grpc.aio, "server", "start a gRPC server"),
)


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process_or_server(request: pytest.FixtureRequest,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("integration") is not None:
        return
    for owner, name, what in _REFUSED:
        def refuse(*args: Any, _what: str = what, **kwargs: Any) -> Any:
            raise AssertionError(f"a test that is not marked integration may not {_what}: "
                                 f"mark it @pytest.mark.integration (tests/conftest.py)")
        monkeypatch.setattr(owner, name, refuse)


# -- no silent skips in CI -------------------------------------------------------------------------

_expected_skips: list[str] = []


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    if not skips.expected(reason) and skips.strict():
        report.outcome = "failed"
        report.longrepr = f"unexpected skip (LIGHTHOUSE_TESTS_STRICT; see tests/support/skips.py): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.skipped and skips.strict() and not skips.expected(_skip_reason(report)):
        report.outcome = "failed"
        report.longrepr = (f"unexpected skip of {collector.nodeid} at collection (LIGHTHOUSE_TESTS_STRICT; "
                           f"see tests/support/skips.py): {_skip_reason(report)}")


_times = TimeTable()
# Set to a file name, every run writes each test's wall and CPU seconds there (suite_time.py).
TIMES_JSON_ENV = "LIGHTHOUSE_TESTS_TIMES_JSON"


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(CpuPerPhase(), "cpu-per-phase")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # Here, not in makereport: with pytest-xdist the controller sees every worker's reports.
    cpu_s = sum(value for name, value in report.user_properties if name == CPU_PROPERTY)
    _times.add(report.nodeid, report.duration, markers_of(report.keywords), cpu_s,
               start=getattr(report, "start", None), worker=getattr(report, "worker_id", None))
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = _skip_reason(report)
        if skips.expected(reason):
            _expected_skips.append(f"{report.nodeid}: {reason}")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _times.by_directory:
        terminalreporter.section("time by directory (tests/support/suite_time.py)")
        for line in _times.lines():
            terminalreporter.write_line(line)
        if os.environ.get(TIMES_JSON_ENV):
            _times.write_json(Path(os.environ[TIMES_JSON_ENV]))
    if _expected_skips:
        terminalreporter.section("expected skips (tests/support/skips.py)")
        for line in _expected_skips:
            terminalreporter.write_line(line)
