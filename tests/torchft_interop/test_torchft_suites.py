"""torchft's own test suites, and this repo's drop-in tests, against lighthouse-cluster, for both
torchft lines (``tests/support/torchft_lines.py``: torchft 0.2.0 here, torchft-nightly in its venv).

* ``test_torchft_suite``: torchft's ``lighthouse_test``, ``manager_integ_test`` and
  ``local_sgd_integ_test`` (shipped inside both wheels) run in a subprocess with
  ``-p lighthouse_cluster.local.torchft_plugin``, so every ``LighthouseServer`` they create is a real
  local 3-node cluster. No test may fail, and as many must pass (and skip) as against torchft's
  own lighthouse (``BASELINE``).
* ``test_dropin_tests_on_nightly``: ``test_torchft_client.py``, ``test_side_by_side.py`` and
  ``test_torchft_training.py`` import torchft in-process, so for the nightly they run in a
  subprocess with the nightly venv's Python. No failure, and the tests that pass must be exactly
  the tests the same files collect under torchft 0.2.0 (none of them skips on 0.2.0).

Each prints a one-line summary (passed/failed/skipped/rerun, seconds). A failure message carries
the failures' short summary and the tail of the sub-run's output.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from support.run_lock import serial_on
from support.pytest_subrun import SUBRUN_ENV, SubRun, SubRunError, run_pytest, stack_tails
from support.torchft_lines import LINES, python_for, torchft_version

ROOT = Path(__file__).resolve().parents[2]

if os.environ.get(SUBRUN_ENV):  # never recurse from a sub-run
    pytest.skip("inside a torchft sub-run", allow_module_level=True)

pytestmark = [pytest.mark.integration]

SUITES = ("lighthouse_test", "manager_integ_test", "local_sgd_integ_test")

# (passed, skipped) of each suite against torchft's OWN lighthouse (no plugin), measured on this
# 2-core machine (CPU only, torch 2.13.0) with
#   <python_for(line)> -m pytest --pyargs torchft.<suite> -p no:cacheprovider --junitxml=...
# The skips are the suites' own: GPU-only cases ("Not enough GPUs for CUDA test"), torchcomms
# ("torchcomms not installed") and, on the nightly, 2 manager_integ cases "requires native process
# group reconfiguration". Against torchft's own lighthouse the suites took 5/6/39 s (0.2.0) and
# 9/14/32 s (nightly); against the cluster 11/14/57 s and 10/-/57 s (about 1.1 s per
# LighthouseServer start-up, ~40 of them per line).
# Flaky with either lighthouse: local_sgd_integ_test's test_streaming_diloco_upscale_* (a race in
# the test: the late replica's first quorum request must reach the lighthouse before the last
# round of the other two is issued, or it waits alone for min_replicas=2 until its 10 s quorum
# timeout). The 12 upscale cases x 3 runs per line failed 5 times in 72 against torchft's own
# lighthouse, 1 in 72 against the cluster (busy machine); --reruns 1 absorbs it.
BASELINE = {
    ("0.2.0", "lighthouse_test"): (4, 0),
    ("0.2.0", "manager_integ_test"): (7, 3),
    ("0.2.0", "local_sgd_integ_test"): (28, 0),
    ("nightly", "lighthouse_test"): (4, 0),
    ("nightly", "manager_integ_test"): (7, 5),
    ("nightly", "local_sgd_integ_test"): (28, 0),
}

# A test that hangs (torchft's EventInjector barriers and executor joins wait without a bound)
# ends the sub-run: pytest-timeout's thread method dumps every stack and exits the process (its
# signal method never fires while the main thread joins a worker; LighthouseServer's reaper then
# kills the nodes), so the sub-run reports the hung test instead of waiting for SUITE_TIMEOUT_S.
# --reruns cannot rerun a test that ended its process, so test_torchft_suite starts a suite whose
# test hung once more, whole, and that second run must pass as the baseline says: a hang the
# suite's own races explain (upscale, above) costs one more sub-run, a second hang fails.
PER_TEST_TIMEOUT_S = 120  # the slowest case here takes ~15 s
SUITE_RUNS_AFTER_A_HANG = 1
SUITE_TIMEOUT_S = 1200
DROPIN_FILES = ("tests/torchft_interop/test_torchft_client.py", "tests/torchft_interop/test_side_by_side.py", "tests/torchft_interop/test_torchft_training.py")
DROPIN_TIMEOUT_S = 1500


# serial_on: torchft's suites bind fixed manager ports (19530 + replica id), so two of them side by
# side fail with "Address already in use" (seen with pytest -n 2); one after another on one worker,
# beside the other worker's tests (their own timeouts held there; a hang is run again, below).
@serial_on("torchft-manager-ports")
@pytest.mark.timeout(SUITE_TIMEOUT_S + 120)
@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("line", LINES)
def test_torchft_suite(line: str, suite: str, tmp_path: Path) -> None:
    python = python_for(line)
    version = torchft_version(python)
    hangs: list[SubRun] = []
    while True:
        attempt = tmp_path / f"run{len(hangs)}"
        attempt.mkdir()
        run = _run_pytest(python, ["-p", "lighthouse_cluster.local.torchft_plugin", "--pyargs", f"torchft.{suite}",
                                   "--reruns", "1"], attempt, attempt / "junit.xml", SUITE_TIMEOUT_S)
        if run.hung is None:
            break
        # A warning, so the hang and where each thread waited show in the run's summary even
        # when the second run passes.
        warnings.warn(f"{version} {suite}: {run.summary()}; started again. Threads: "
                      + "; ".join(stack_tails(run.output, 3)), stacklevel=1)
        hangs.append(run)
        assert len(hangs) <= SUITE_RUNS_AFTER_A_HANG, (
            f"{version} {suite}: hung in {len(hangs)} runs in a row ({', '.join(h.hung or '?' for h in hangs)})\n"
            f"{run.diagnostics()}")
    want_passed, want_skipped = BASELINE[(line, suite)]
    plugin = next((ln for ln in run.output.splitlines() if ln.startswith("lighthouse-cluster: ")), "")
    restarted = f" (started again after a hang in {hangs[0].hung})" if hangs else ""
    print(f"\n{version} {suite} against lighthouse-cluster: {run.summary()}{restarted} "
          f"(torchft's lighthouse: {want_passed} passed, {want_skipped} skipped); {plugin}")
    swapped = next((ln for ln in run.output.splitlines() if "lighthouse-cluster LighthouseServer" in ln
                    and "swapped into:" in ln), "")
    assert f"torchft.{suite}" in swapped, "the plugin did not swap LighthouseServer in:\n" + run.output[-3000:]
    assert not run.failed, f"{version} {suite}: {len(run.failed)} failed\n{run.diagnostics()}"
    assert (len(run.passed), len(run.skipped)) == (want_passed, want_skipped), (
        f"{version} {suite}: {len(run.passed)} passed, {len(run.skipped)} skipped; against torchft's own "
        f"lighthouse {want_passed} passed, {want_skipped} skipped\n{run.diagnostics()}")


@pytest.mark.exclusive  # the drop-in client tests have sub-second timing bounds: runs alone
@pytest.mark.timeout(DROPIN_TIMEOUT_S + 120)
def test_dropin_tests_on_nightly(tmp_path: Path) -> None:
    python = python_for("nightly")
    version = torchft_version(python)
    # What 0.2.0 runs: the ids these files collect in this environment (none of them skips here).
    collect = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                              *DROPIN_FILES], cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env={**os.environ, SUBRUN_ENV: "1"})
    assert collect.returncode == 0, collect.stdout[-3000:] + collect.stderr[-3000:]
    expected = {ln.strip() for ln in collect.stdout.splitlines() if "::" in ln}
    assert expected, collect.stdout[-3000:]

    # pyproject.toml's per-test timeout (300 s) as in the main run; the files' own marks override it.
    # Two workers, as the main run: this test holds the machine, and inside the sub-run the files'
    # own exclusive tests (the sub-second bounds) still run alone (conftest's run lock).
    run = _run_pytest(python, [*DROPIN_FILES, "-n", "2"], ROOT, tmp_path / "junit.xml", DROPIN_TIMEOUT_S, 300)
    assert run.hung is None, f"{version}: the drop-in tests hung\n{run.diagnostics()}"
    print(f"\n{version}: the drop-in tests ({', '.join(Path(f).name for f in DROPIN_FILES)}): {run.summary()} "
          f"(torchft 0.2.0 collects {len(expected)})")
    assert not run.failed, f"{version}: {len(run.failed)} drop-in test(s) failed\n{run.diagnostics()}"
    passed = {_node_id(name) for name in run.passed}
    assert passed == expected, (
        f"{version}: passed {len(passed)}, 0.2.0 runs {len(expected)}; not passed on the nightly: "
        f"{sorted(expected - passed)}; only on the nightly: {sorted(passed - expected)}\n{run.diagnostics()}")


def _run_pytest(python: str, args: list[str], cwd: Path, junit: Path, timeout: float,
                per_test_timeout: float = PER_TEST_TIMEOUT_S) -> SubRun:
    try:
        return run_pytest(python, args, cwd, junit, timeout, per_test_timeout)
    except SubRunError as e:
        pytest.fail(str(e), pytrace=False)


def _node_id(junit_name: str) -> str:
    """``tests.test_x::test_y[param]`` (junit classname::name) -> ``tests/test_x.py::test_y[param]``."""
    classname, name = junit_name.split("::", 1)
    parts = classname.split(".")
    # classname is the module path, plus the class for tests in a class
    for cut in range(len(parts), 0, -1):
        path = ROOT.joinpath(*parts[:cut]).with_suffix(".py")
        if path.exists():
            return "::".join([str(path.relative_to(ROOT)), *parts[cut:], name])
    return junit_name
