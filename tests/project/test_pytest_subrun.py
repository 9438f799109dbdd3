"""tests/support/pytest_subrun.py: a sub-run whose test hangs names that test (the torchft suites
start such a suite once more instead of failing on a race of torchft's own tests)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from support.pytest_subrun import SubRunError, hung_test, run_pytest, stack_tails

BANNER = "+" * 35 + " Timeout " + "+" * 35


def test_no_banner_means_no_hang() -> None:
    assert hung_test("a.py::test_x PASSED [ 50%]\na.py::test_y FAILED [100%]\n") is None


def test_the_test_left_without_a_result_is_the_hung_one() -> None:
    output = "\n".join([
        "a.py::C::test_up_00 PASSED [  8%]",
        "a.py::C::test_up_01 RERUN [ 16%]",
        "a.py::C::test_up_01 PASSED [ 16%]",
        "a.py::C::test_up_02 [INFO] [torchft::manager] - printed past the capture",
        BANNER,
        "~~~ Stack of MainThread (1) ~~~",
        '  File "x.py", line 1, in f',
    ])
    assert hung_test(output) == "a.py::C::test_up_02"


def test_a_banner_before_any_test_started_names_no_test() -> None:
    assert hung_test("collecting ...\na.py::test_x PASSED [ 50%]\n\n" + BANNER + "\n") == "?"


def test_the_banner_on_the_hung_tests_own_line() -> None:
    # What pytest -v prints: the node id when the test starts, the banner after it when it times out.
    assert hung_test("a.py::test_x PASSED [ 50%]\na.py::test_y " + BANNER + "\n~~ Stack of T (1) ~~\n" + BANNER) \
        == "a.py::test_y"


def test_stack_tails_name_each_thread_and_where_it_waits() -> None:
    output = "\n".join([
        "a.py::test_x " + BANNER,
        "~~~~~~~~ Stack of replica0_0 (1401) ~~~~~~~~",
        '  File "/usr/lib/python3.11/threading.py", line 1002, in _bootstrap',
        "    self._bootstrap_inner()",
        '  File "/venv/torchft/manager.py", line 658, in _async_quorum',
        "    quorum = self._client._quorum(",
        '  File "/usr/lib/python3.11/threading.py", line 327, in wait',
        "    waiter.acquire()",
        "~~~~~~~~ Stack of MainThread (1402) ~~~~~~~~",
        '  File "/venv/torchft/local_sgd_integ_test.py", line 505, in test_streaming_diloco_upscale',
        "    for fut in as_completed(futures):",
        BANNER,
        '  File "/not/a/stack.py", line 1, in after_the_dump',
    ])
    assert stack_tails(output) == [
        "replica0_0: manager.py:658 in _async_quorum > threading.py:327 in wait",
        "MainThread: local_sgd_integ_test.py:505 in test_streaming_diloco_upscale",
    ]
    assert stack_tails("no dump here") == []


@pytest.mark.integration
def test_a_real_sub_run_that_hangs_reports_the_test(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(textwrap.dedent("""
        import threading

        def test_quick():
            pass

        def test_waits_forever():
            threading.Event().wait()

        def test_never_reached():
            pass
    """))
    run = run_pytest(sys.executable, ["test_sample.py", "-p", "no:xdist"], tmp_path,
                     tmp_path / "junit.xml", timeout=120, per_test_timeout=2)
    assert run.hung == "test_sample.py::test_waits_forever", run.output[-3000:]
    assert any(t.startswith("MainThread: ") and "in test_waits_forever" in t for t in stack_tails(run.output, 3))
    assert not (tmp_path / "junit.xml").exists()


@pytest.mark.integration
def test_a_real_sub_run_that_ends_cleanly_reports_its_cases(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text("def test_a():\n    pass\n\ndef test_b():\n    assert False\n")
    run = run_pytest(sys.executable, ["test_sample.py", "-p", "no:xdist"], tmp_path, tmp_path / "junit.xml",
                     timeout=120, per_test_timeout=30)
    assert run.hung is None
    assert run.passed == {"test_sample::test_a"} and run.failed == {"test_sample::test_b"}


@pytest.mark.integration
def test_a_sub_run_that_dies_without_a_timeout_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text("import os\n\ndef test_exits():\n    os._exit(3)\n")
    with pytest.raises(SubRunError, match="exited 3 and wrote no junit report"):
        run_pytest(sys.executable, ["test_sample.py", "-p", "no:xdist"], tmp_path, tmp_path / "junit.xml",
                   timeout=120, per_test_timeout=30)
