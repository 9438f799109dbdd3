"""tests/support/suite_time.py: the per-directory time table every run prints."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.suite_time import SLOW_DIRECTORIES, TimeTable, cpu_mark, directory_of, markers_of, run_order


def test_durations_add_up_per_directory_with_integration_and_exclusive_shares() -> None:
    table = TimeTable()
    for phase_s in (0.5, 10.0, 0.25):  # setup, call, teardown of one exclusive integration test
        table.add("tests/bench/test_bench.py::test_quick", phase_s, ["integration", "exclusive"])
    table.add("tests/raft/test_sim.py::test_election[split-vote]", 0.125, [])
    table.add("tests/raft/test_reconnect.py::test_reconnect", 3.0, ["integration"])
    bench, raft = table.by_directory["tests/bench"], table.by_directory["tests/raft"]
    assert (bench.tests, bench.seconds, bench.integration_s, bench.exclusive_s) == (1, 10.75, 10.75, 10.75)
    assert (raft.tests, raft.seconds, raft.integration_s, raft.exclusive_s) == (2, 3.125, 3.0, 0.0)
    lines = table.lines()
    assert lines[1].startswith("tests/bench") and lines[2].startswith("tests/raft")  # slowest first
    assert lines[-1].split() == ["total", "3", "13.9", "13.8", "10.8", "0.0"]


def test_directory_of_a_node_id_is_its_first_two_path_parts() -> None:
    assert directory_of("tests/raft/test_x.py::test_y[a/b::c]") == "tests/raft"
    assert directory_of("tests/project/samples/deep/test_z.py::t") == "tests/project"
    assert directory_of("test_top.py::t") == "."


def test_only_the_markers_the_table_tells_apart_are_kept() -> None:
    assert markers_of({"integration": 1, "timeout": 1, "test_x": 1}) == ["integration"]
    assert markers_of({"exclusive": 1, "integration": 1}) == ["integration", "exclusive"]


def test_cpu_seconds_add_up_per_directory_and_per_test(tmp_path) -> None:
    table = TimeTable()
    table.add("tests/sdk/test_a.py::test_x", 2.0, ["integration"], cpu_s=0.5, start=100.0, worker="gw0")
    table.add("tests/sdk/test_a.py::test_x", 1.0, ["integration"], cpu_s=1.25, start=102.0, worker="gw0")
    table.add("tests/sdk/test_b.py::test_y", 4.0, [], cpu_s=3.0, start=101.5, worker="gw1")
    assert table.by_directory["tests/sdk"].cpu_s == 4.75
    out = tmp_path / "times.json"
    table.write_json(out)
    rows = json.loads(out.read_text())
    assert [(r["test"], r["seconds"], r["cpu_s"]) for r in rows] == [
        ("tests/sdk/test_b.py::test_y", 4.0, 3.0), ("tests/sdk/test_a.py::test_x", 3.0, 1.75)]
    # The timeline: each test's worker and its first report's start, after the run's first test.
    assert [(r["worker"], r["start_s"]) for r in rows] == [("gw1", 1.5), ("gw0", 0.0)]
    assert "cpu s" in table.lines()[0]


@pytest.mark.integration
def test_a_cpu_mark_counts_the_cpu_of_reaped_children() -> None:
    before = cpu_mark()
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], check=True)
    assert cpu_mark() - before > 0.1


def test_exclusive_and_quiet_tests_come_last_each_part_slow_directories_first_and_the_rest_keeps_its_order() -> None:
    class Item:
        def __init__(self, nodeid: str, marker: str | None = None) -> None:
            self.nodeid, self.marker = nodeid, marker

        def get_closest_marker(self, name: str) -> object | None:
            return object() if name == self.marker else None

    items = [Item("tests/cli/test_a.py::t1"), Item("tests/sdk/test_s.py::t2"), Item("tests/core/test_c.py::t3"),
             Item("tests/server/test_x.py::q1", "quiet"), Item("tests/torchtitan/test_t.py::t4"),
             Item("tests/sdk/test_s.py::t5"), Item("tests/cli/test_a.py::t6", "low_cpu"),
             Item("tests/server/test_x.py::x1", "exclusive"), Item("tests/sdk/test_s.py::x2", "exclusive")]
    ordered = [i.nodeid.rsplit("::", 1)[1] for i in run_order(items)]
    assert ordered == ["t4", "t2", "t5", "t1", "t3", "t6", "x2", "q1", "x1"]
    assert SLOW_DIRECTORIES[0] == "tests/torchtitan"
