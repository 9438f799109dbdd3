"""A pytest run in a subprocess (another interpreter, another torchft line), read back through its
junit report, and what it says when one of its tests hung.

``tests/torchft_interop/test_torchft_suites.py`` runs torchft's own suites and this repo's drop-in
tests this way. Each sub-run gets ``--timeout-method thread``: a test that hangs (torchft's
EventInjector barriers and executor joins wait without a bound) makes pytest-timeout dump every
thread's stack and end the process, with no junit report. :func:`run_pytest` reports that as
:attr:`SubRun.hung`, naming the test that was running (the sub-run is verbose, so each test's
node id is printed when it starts), so a caller can fail with that name or start the sub-run again.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

SUBRUN_ENV = "LIGHTHOUSE_CLUSTER_TORCHFT_SUBRUN"

# pytest-timeout's banner before and after the stacks (thread method): "+++...+++ Timeout +++...+++",
# the first on the line the verbose run started with the hung test's node id.
_TIMEOUT_BANNER = re.compile(r"\+{3,} Timeout \+{3,}")
# A verbose test line: "<node id> PASSED [ 12%]", or the node id of the test still running (what
# the test printed uncaptured, if anything, after it).
_NODE_LINE = re.compile(r"^(\S+::\S+)(?:\s+(PASSED|FAILED|SKIPPED|ERROR|RERUN|XFAIL|XPASS)\b)?")


_STACK_HEADER = re.compile(r"^~+ Stack of (.+?) \(\d+\) ~+\s*$")
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')


class SubRunError(AssertionError):
    """The sub-run ended without a report for another reason than a test's timeout."""


@dataclass
class SubRun:
    passed: set[str]
    failed: set[str]
    skipped: set[str]
    rerun: int
    seconds: float
    output: str
    hung: str | None = None  # node id of the test that timed out and ended the sub-run

    def summary(self) -> str:
        if self.hung is not None:
            return f"hung in {self.hung} after {self.seconds:.0f}s"
        return (f"{len(self.passed)} passed, {len(self.failed)} failed, {len(self.skipped)} skipped, "
                f"{self.rerun} rerun in {self.seconds:.0f}s")

    def diagnostics(self, lines: int = 120) -> str:
        out = self.output.splitlines()
        short = [ln for ln in out if ln.startswith(("FAILED ", "ERROR "))]
        head = [f"hung: {self.hung}"] if self.hung is not None else []
        return "\n".join([*head, "failures:", *short, f"--- last {lines} lines of the sub-run ---", *out[-lines:]])


def hung_test(output: str) -> str | None:
    """The node id of the test pytest-timeout ended the run in, from a verbose run's output, or
    None when the output has no timeout banner. ``"?"`` when the banner is there but no test had
    started (a hang at collection or in a session fixture)."""
    banner = _TIMEOUT_BANNER.search(output)
    if banner is None:
        return None
    running = "?"
    for line in output[:banner.start()].splitlines():
        m = _NODE_LINE.match(line)
        if m:
            running = m.group(1) if m.group(2) is None else "?"
    return running


def stack_tails(output: str, frames: int = 2) -> list[str]:
    """One line per thread in pytest-timeout's dump: the thread's name and its innermost ``frames``
    frames (``file:line in function``, file names without their directories), innermost last."""
    banner = _TIMEOUT_BANNER.search(output)
    if banner is None:
        return []
    threads: list[tuple[str, list[str]]] = []
    for line in output[banner.end():].splitlines():
        header = _STACK_HEADER.match(line)
        if header:
            threads.append((header.group(1), []))
            continue
        if _TIMEOUT_BANNER.search(line):
            break
        frame = _FRAME.match(line)
        if frame and threads:
            threads[-1][1].append(f"{Path(frame.group(1)).name}:{frame.group(2)} in {frame.group(3)}")
    return [f"{name}: {' > '.join(stack[-frames:])}" for name, stack in threads]


def run_pytest(python: str, args: list[str], cwd: Path, junit: Path, timeout: float,
               per_test_timeout: float) -> SubRun:
    """``python -m pytest <args>`` in ``cwd``, verbose, with a per-test thread timeout; raises
    :class:`SubRunError` when the run outlives ``timeout`` or ends without a report and without a
    hung test to name."""
    cmd = [python, "-m", "pytest", *args, "-v", f"--junitxml={junit}", "-p", "no:cacheprovider", "-rfE",
           "--timeout", str(per_test_timeout), "--timeout-method", "thread"]
    env = {**os.environ, SUBRUN_ENV: "1", "PYTHONUNBUFFERED": "1"}
    env.pop("PYTEST_ADDOPTS", None)
    for name in [k for k in env if k.startswith("PYTEST_XDIST_")]:
        env.pop(name)  # a sub-run started from an xdist worker is not a worker
    started = time.monotonic()
    try:
        res = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             timeout=timeout, stdin=subprocess.DEVNULL, errors="replace")
    except subprocess.TimeoutExpired as e:
        out = e.stdout if isinstance(e.stdout, str) else (e.stdout or b"").decode(errors="replace")
        raise SubRunError(f"{' '.join(cmd)} did not finish within {timeout:.0f}s; output tail:\n"
                          + "\n".join(out.splitlines()[-120:])) from None
    seconds = time.monotonic() - started
    output = res.stdout
    if not junit.exists():
        hung = hung_test(output)
        if hung is None:
            raise SubRunError(f"{' '.join(cmd)} exited {res.returncode} and wrote no junit report:\n"
                              + "\n".join(output.splitlines()[-120:]))
        return SubRun(set(), set(), set(), 0, seconds, output, hung=hung)
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
