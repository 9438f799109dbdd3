"""pytest plugin: run torchft's own test suites against lighthouse-cluster.

    python -m pytest -p lighthouse_cluster.local.torchft_plugin --pyargs torchft.lighthouse_test

torchft's test modules (``lighthouse_test``, ``manager_integ_test``, ``local_sgd_integ_test``, ...)
create a lighthouse per test with ``LighthouseServer(bind="[::]:0", min_replicas=...)``, imported
from ``torchft._torchft`` or ``torchft.coordination``. After collection, this plugin replaces the
module attribute ``LighthouseServer`` of every collected module that has one, and of every
imported ``torchft.*`` module (helpers such as ``manager_integ_test``, which other suites import),
with :class:`lighthouse_cluster.LighthouseServer`: each test then talks to a real local 3-node
Raft cluster instead of torchft's in-process lighthouse. Nothing else changes.

The header names the lighthouse in use; the summary says how many clusters were started and how
long they took to serve. Servers a test never shut down are shut down at the end of the session
(and counted). ``--lighthouse-cluster-nodes N`` picks the node count (default 3).
"""

from __future__ import annotations

import sys
import weakref
from types import ModuleType
from typing import Any

import pytest

from lighthouse_cluster import __version__

_STATS: dict[str, Any] = {"started": [], "patched": [], "servers": weakref.WeakSet(), "leaked": 0,
                          "nodes": 3}


def _server_class() -> type:
    from lighthouse_cluster.local.lighthouse_server import LighthouseServer

    class PluginLighthouseServer(LighthouseServer):
        """lighthouse_cluster.LighthouseServer, counted by the torchft plugin."""

        def __init__(self, bind: str, min_replicas: int, join_timeout_ms: int | None = None,
                     quorum_tick_ms: int | None = None, heartbeat_timeout_ms: int | None = None) -> None:
            super().__init__(bind, min_replicas, join_timeout_ms, quorum_tick_ms, heartbeat_timeout_ms,
                             nodes=_STATS["nodes"])
            _STATS["started"].append(self.start_seconds)
            _STATS["servers"].add(self)

    PluginLighthouseServer.__name__ = PluginLighthouseServer.__qualname__ = "LighthouseServer"
    PluginLighthouseServer.__doc__ = LighthouseServer.__doc__
    return PluginLighthouseServer


_OURS: type | None = None


def _ours() -> type:
    global _OURS
    if _OURS is None:
        _OURS = _server_class()
    return _OURS


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("lighthouse-cluster")
    group.addoption("--lighthouse-cluster-nodes", type=int, default=3, metavar="N",
                    help="node processes per LighthouseServer the torchft plugin starts (odd; default 3)")


def pytest_configure(config: pytest.Config) -> None:
    nodes = config.getoption("--lighthouse-cluster-nodes")
    if nodes < 1 or nodes % 2 == 0:
        raise pytest.UsageError(f"--lighthouse-cluster-nodes {nodes}: use an odd number")
    _STATS["nodes"] = nodes


def pytest_report_header(config: pytest.Config) -> str:
    import lighthouse_cluster

    return (f"lighthouse: lighthouse-cluster {__version__} LighthouseServer ({_STATS['nodes']}-node Raft cluster "
            f"per server, {lighthouse_cluster.__file__.rsplit('/', 1)[0]}) in place of torchft's LighthouseServer")


def _swap(module: ModuleType) -> bool:
    current = getattr(module, "LighthouseServer", None)
    if current is None or not isinstance(current, type):
        return False
    ours = _ours()
    if current is ours:
        return False
    module.LighthouseServer = ours  # type: ignore[attr-defined]
    _STATS["patched"].append(module.__name__)
    return True


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    seen: set[int] = set()
    for item in items:
        parent = item.getparent(pytest.Module)
        module = getattr(parent, "obj", None) if parent is not None else None
        if module is not None and id(module) not in seen:
            seen.add(id(module))
            _swap(module)
    for name, module in list(sys.modules.items()):
        if (name == "torchft" or name.startswith("torchft.")) and isinstance(module, ModuleType) \
                and id(module) not in seen and name not in ("torchft._torchft", "torchft.coordination"):
            seen.add(id(module))
            _swap(module)


def pytest_report_collectionfinish(config: pytest.Config, start_path: Any, items: list[pytest.Item]) -> str:
    patched = ", ".join(sorted(set(_STATS["patched"]))) or "none (no collected module has a LighthouseServer)"
    return f"lighthouse: lighthouse-cluster LighthouseServer ({_STATS['nodes']} nodes) swapped into: {patched}"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for server in list(_STATS["servers"]):
        if server.alive:
            _STATS["leaked"] += 1
            server.shutdown()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    started = _STATS["started"]
    if not started:
        terminalreporter.write_line("lighthouse-cluster: no LighthouseServer was started")
        return
    terminalreporter.write_line(
        f"lighthouse-cluster: {len(started)} LighthouseServer(s) started ({_STATS['nodes']} nodes each), serving "
        f"after {sum(started) / len(started):.2f}s mean / {max(started):.2f}s max; "
        f"{_STATS['leaked']} left running by their tests, shut down at session end")

