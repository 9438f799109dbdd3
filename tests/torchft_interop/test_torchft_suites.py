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
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.torchft_lines import LINES, python_for, torchft_version

ROOT = Path(__file__).resolve().parents[2]
SUBRUN_ENV = "LIGHTHOUSE_CLUSTER_TORCHFT_SUBRUN"

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
# kills the nodes), so the test here fails with the stacks instead of waiting for SUITE_TIMEOUT_S.
PER_TEST_TIMEOUT_S = 120  # the slowest case here takes ~15 s
SUITE_TIMEOUT_S = 1200
DROPIN_FILES = ("tests/torchft_interop/test_torchft_client.py", "tests/torchft_interop/test_side_by_side.py", "tests/torchft_interop/test_torchft_training.py")
DROPIN_TIMEOUT_S = 1500


@dataclass
class SubRun:
    passed: set[str]
    failed: set[str]
    skipped: set[str]
    rerun: int
    seconds: float
    output: str

    def summary(self) -> str:
        return (f"{len(self.passed)} passed, {len(self.failed)} failed, {len(self.skipped)} skipped, "
                f"{self.rerun} rerun in {self.seconds:.0f}s")

    def diagnostics(self, lines: int = 120) -> str:
        out = self.output.splitlines()
        short = [ln for ln in out if ln.startswith(("FAILED ", "ERROR "))]
        return "\n".join(["failures:", *short, f"--- last {lines} lines of the sub-run ---", *out[-lines:]])


def _run_pytest(python: str, args: list[str], cwd: Path, junit: Path, timeout: float,
                per_test_timeout: float = PER_TEST_TIMEOUT_S) -> SubRun:
    cmd = [python, "-m", "pytest", *args, f"--junitxml={junit}", "-p", "no:cacheprovider", "-rfE",
           "--timeout", str(per_test_timeout), "--timeout-method", "thread"]
    env = {**os.environ, SUBRUN_ENV: "1", "PYTHONUNBUFFERED": "1"}
    env.pop("PYTEST_ADDOPTS", None)
    for name in [k for k in env if k.startswith("PYTEST_XDIST_")]:
        env.pop(name)  # a sub-run started from an xdist worker is not a worker
    started = time.monotonic()
    try:
        res = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             timeout=timeout, stdin=subprocess.DEVNULL, errors="replace")
        output = res.stdout
    except subprocess.TimeoutExpired as e:
        out = e.stdout if isinstance(e.stdout, str) else (e.stdout or b"").decode(errors="replace")
        pytest.fail(f"{' '.join(cmd)} did not finish within {timeout:.0f}s; output tail:\n"
                    + "\n".join(out.splitlines()[-120:]), pytrace=False)
    seconds = time.monotonic() - started
    if not junit.exists():
        pytest.fail(f"{' '.join(cmd)} exited {res.returncode} and wrote no junit report:\n"
                    + "\n".join(output.splitlines()[-120:]), pytrace=False)
    passed, failed, skipped = set(), set(), set()
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed.add(name)
        elif case.find("skipped") is not None:
            skipped.add(name)
        else:
            passed.add(name)
    m = re.search(r"(\d+) rerun", "\n".join(output.splitlines()[-5:]))
    return SubRun(passed, failed, skipped, int(m.group(1)) if m else 0, seconds, output)


# exclusive: torchft's suites bind fixed manager ports (19530 + replica id), so two of them side by
# side fail with "Address already in use" (seen with pytest -n 2), and their own timeouts are tight.
@pytest.mark.exclusive
@pytest.mark.timeout(SUITE_TIMEOUT_S + 120)
@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("line", LINES)
def test_torchft_suite(line: str, suite: str, tmp_path: Path) -> None:
    python = python_for(line)
    version = torchft_version(python)
    run = _run_pytest(python, ["-p", "lighthouse_cluster.local.torchft_plugin", "--pyargs", f"torchft.{suite}",
                               "--reruns", "1", "-q"], tmp_path, tmp_path / "junit.xml", SUITE_TIMEOUT_S)
    want_passed, want_skipped = BASELINE[(line, suite)]
    plugin = next((ln for ln in run.output.splitlines() if ln.startswith("lighthouse-cluster: ")), "")
    print(f"\n{version} {suite} against lighthouse-cluster: {run.summary()} "
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
    run = _run_pytest(python, [*DROPIN_FILES, "-q", "-n", "2"], ROOT, tmp_path / "junit.xml", DROPIN_TIMEOUT_S, 300)
    print(f"\n{version}: the drop-in tests ({', '.join(Path(f).name for f in DROPIN_FILES)}): {run.summary()} "
          f"(torchft 0.2.0 collects {len(expected)})")
    assert not run.failed, f"{version}: {len(run.failed)} drop-in test(s) failed\n{run.diagnostics()}"
    passed = {_node_id(name) for name in run.passed}
    assert passed == expected, (
        f"{version}: passed {len(passed)}, 0.2.0 runs {len(expected)}; not passed on the nightly: "
        f"{sorted(expected - passed)}; only on the nightly: {sorted(passed - expected)}\n{run.diagnostics()}")


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
