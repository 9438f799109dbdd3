"""Where the suite's time goes, by test directory: the table every run prints at its end.

The README's test command runs on 2 cores with a budget (``.ci/run`` under 20 minutes); pytest's
``--durations`` lists the slowest tests but not which part of the suite the rest of the time is
spent in. ``TimeTable`` adds up every report's duration (setup, call and teardown) per test
directory (``tests/raft``, ``tests/sdk``, ...) and how much of it ran as ``integration`` and as
``exclusive`` (alone under xdist: the other worker's integration tests wait meanwhile). It is fed
from ``pytest_runtest_logreport``, which under xdist runs on the controller with every worker's
reports.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass
class DirectoryTime:
    tests: int = 0
    seconds: float = 0.0
    integration_s: float = 0.0
    exclusive_s: float = 0.0


@dataclass
class TimeTable:
    by_directory: dict[str, DirectoryTime] = field(default_factory=dict)
    _counted: set[str] = field(default_factory=set)

    def add(self, nodeid: str, duration_s: float, markers: Iterable[str]) -> None:
        """One report (setup, call or teardown) of the test ``nodeid`` that took ``duration_s``."""
        directory = directory_of(nodeid)
        row = self.by_directory.setdefault(directory, DirectoryTime())
        if nodeid not in self._counted:
            self._counted.add(nodeid)
            row.tests += 1
        marks = set(markers)
        row.seconds += duration_s
        if "integration" in marks:
            row.integration_s += duration_s
        if "exclusive" in marks:
            row.exclusive_s += duration_s

    def lines(self) -> list[str]:
        """The table, slowest directory first, with a total line."""
        rows = sorted(self.by_directory.items(), key=lambda kv: -kv[1].seconds)
        total = DirectoryTime(sum(r.tests for _, r in rows), sum(r.seconds for _, r in rows),
                              sum(r.integration_s for _, r in rows), sum(r.exclusive_s for _, r in rows))
        out = [f"{'directory':<24} {'tests':>6} {'seconds':>9} {'integration':>12} {'exclusive':>10}"]
        for name, r in [*rows, ("total", total)]:
            out.append(f"{name:<24} {r.tests:>6} {r.seconds:>9.1f} {r.integration_s:>12.1f} {r.exclusive_s:>10.1f}")
        return out


def directory_of(nodeid: str) -> str:
    """``tests/raft`` for ``tests/raft/test_x.py::test_y[a/b]`` (the path before ``::``, up to two parts)."""
    path = nodeid.split("::", 1)[0]
    parts = path.split("/")[:-1] or ["."]
    return "/".join(parts[:2])


def markers_of(keywords: Mapping[str, object]) -> list[str]:
    """The marker names among a report's keywords that this table tells apart."""
    return [name for name in ("integration", "exclusive") if name in keywords]
