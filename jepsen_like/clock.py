"""Clock-rate skew for local node processes, with libfaketime (no root needed).

``ClockNemesis`` gives every node its own libfaketime rate file. A node started with
``env(i)`` / ``launch_prefix(i)`` (or ``wire(cluster)`` for a ``LocalCluster``, before
``start()``) runs under ``LD_PRELOAD=libfaketimeMT.so.1`` with::

    FAKETIME_TIMESTAMP_FILE=<dir>/n<i>.faketime   # "+0 x<rate>", re-read on every clock call
    FAKETIME_NO_CACHE=1                           # ... so ``set_rate`` acts at once
    FAKETIME_XRESET=1                             # a rate change continues from the current fake time

and ``set_rate(i, r)`` makes node ``i``'s wall *and* monotonic clocks (and its sleeps and timed
waits, which libfaketime scales too) run ``r`` times as fast as real time from that moment on,
while the process runs. ``reset()`` sets every rate back to 1: the clocks run at real speed
again but keep the time they gained or lost (they never jump back; a backwards step of the
monotonic clock would be a different fault). Both clocks are always faked: with
``FAKETIME_DONT_FAKE_MONOTONIC`` Python's ``time.sleep`` misbehaves.

Measured here (libfaketime 0.9.10, Python 3.11, 4 threads reading the clock in a loop):

* without ``FAKETIME_XRESET`` a rate change rescales the whole time since the process started
  (``x2 -> x1`` after 1 s of ``x2`` steps the clocks back by ~1 s), hence ``XRESET``;
* with ``XRESET``, the single-threaded ``libfaketime.so.1`` stepped the monotonic clock
  *backwards* (up to 0.22 s, 176 times in 3 s) even at a constant rate, in a multi-threaded
  process; ``libfaketimeMT.so.1`` did not (0 backward steps at a constant rate; one of 2 ms in
  27 rate changes). The nodes are multi-threaded (gRPC, pysyncobj's tick thread), so the MT
  library is the default; ``library=`` overrides it;
* ``FAKETIME_NO_CACHE=1`` costs an open/read of the rate file per clock call (~10 us): fine for
  a node (thousands of calls per second), not for a clock-bound benchmark.

A rate applies to what libfaketime 0.9.10 intercepts in the node process: ``clock_gettime``,
``time``, ``gettimeofday``, ``nanosleep``/``clock_nanosleep``, ``poll``/``select``/``epoll_wait``
timeouts, ``pthread_cond_timedwait``, ``sem_timedwait`` (not ``sem_clockwait``, which Python
3.11 uses for lock timeouts on recent glibc: those run in real time). A restarted node starts
again at real time (libfaketime re-initialises in a new process) and at the rate in its file.
``teardown()`` sets every rate back to 1 and removes the files; a node still running then keeps
rate 1 (libfaketime keeps the last spec it read when the file disappears).

Debian packages: ``libfaketime`` (the preload libraries, in
``/usr/lib/<multiarch>/faketime/``) and ``faketime`` (the wrapper command; not used here but
handy by hand): ``apt-get install -y faketime libfaketime``.
"""

from __future__ import annotations

import glob
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ClockError", "ClockNemesis", "available", "find_library"]

_LIBRARY_NAMES = ("libfaketimeMT.so.1", "libfaketime.so.1")
_LIBRARY_DIRS = ("/usr/lib/*/faketime", "/usr/lib/faketime", "/usr/local/lib/faketime", "/usr/lib64/faketime")


class ClockError(RuntimeError):
    """A clock fault could not be set up or applied; the message says why."""


def find_library(name: str = _LIBRARY_NAMES[0]) -> str | None:
    """The path of a libfaketime preload library (the multi-threaded one by default)."""
    for pattern in _LIBRARY_DIRS:
        for d in sorted(glob.glob(pattern)):
            path = os.path.join(d, name)
            if os.path.isfile(path):
                return path
    return None


def spec(rate: float) -> str:
    """libfaketime's spec for "real time, running ``rate`` times as fast"."""
    if not rate > 0:
        raise ValueError(f"clock rate must be positive, got {rate}")
    text = f"{rate:.6f}".rstrip("0").rstrip(".")
    return f"+0 x{text}"


_PROBE = """
import sys, time
m0, w0 = time.monotonic(), time.time()
sys.stdout.write("ready\\n"); sys.stdout.flush()
sys.stdin.readline()
print(time.monotonic() - m0, time.time() - w0)
"""

_available_cache: tuple[bool, str] | None = None


def available() -> tuple[bool, str]:
    """Whether node processes can be run with a skewed clock here, and if not, why.

    Checks that a libfaketime preload library is installed and that a Python child under it,
    at ``+0 x2``, sees its monotonic and wall clocks advance about twice as fast as ours.
    """
    global _available_cache
    if _available_cache is None:
        _available_cache = _probe()
    return _available_cache


def _probe() -> tuple[bool, str]:
    lib = find_library()
    if lib is None:
        return False, "libfaketime is not installed (apt-get install -y faketime libfaketime)"
    with tempfile.TemporaryDirectory(prefix="jepsen_like-clock-") as d:
        nemesis = ClockNemesis(1, directory=Path(d), library=lib).setup()
        nemesis.set_rate(0, 2.0)
        env = {**os.environ, **nemesis.env(0)}
        proc = None
        try:
            proc = subprocess.Popen([sys.executable, "-c", _PROBE], env=env, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            assert proc.stdout is not None and proc.stdin is not None
            ready, _, _ = select.select([proc.stdout], [], [], 20.0)
            if not ready or proc.stdout.readline().strip() != "ready":
                proc.kill()
                return False, f"a Python child under {lib} failed: {proc.communicate(timeout=10)[1].strip()[:200]}"
            t0 = time.monotonic()
            time.sleep(0.3)
            real = time.monotonic() - t0
            out, err = proc.communicate("go\n", timeout=10)
        except (OSError, subprocess.SubprocessError) as e:
            return False, f"cannot run a Python child under {lib}: {e}"
        finally:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        try:
            mono, wall = (float(x) for x in out.split())
        except ValueError:
            return False, f"unexpected probe output under {lib}: {out!r} {err.strip()[:200]!r}"
        if not (1.5 * real < mono < 3.0 * real and 1.5 * real < wall < 3.0 * real):
            return False, (f"libfaketime at x2 did not speed up a Python child's clocks ({lib}: "
                           f"monotonic {mono:.3f}s, wall {wall:.3f}s over {real:.3f}s real)")
    return True, f"libfaketime ({lib})"


@dataclass
class ClockNemesis:
    """Per-node clock rates for ``nodes`` node processes; see the module docstring.

    Nodes are numbered ``0 .. nodes-1`` (the ``LocalCluster`` member index). Use as a context
    manager, or call ``setup()`` and always ``teardown()`` (after the nodes stopped).
    """

    nodes: int
    directory: Path | None = None       # where the rate files go; default: a temporary directory
    library: str | None = None          # default: libfaketimeMT.so.1 from the Debian package
    _rates: list[float] = field(init=False, default_factory=list)
    _own_directory: bool = field(init=False, default=False)
    _ready: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError("nodes must be at least 1")
        self._rates = [1.0] * self.nodes

    # -- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> "ClockNemesis":
        return self.setup()

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def setup(self) -> "ClockNemesis":
        """Find the library and write every node's rate file at rate 1."""
        if self._ready:
            raise ClockError("setup() already ran")
        self.library = self.library or find_library()
        if self.library is None or not os.path.isfile(self.library):
            raise ClockError(f"libfaketime not found ({self.library or 'searched ' + ', '.join(_LIBRARY_DIRS)}): "
                             "apt-get install -y faketime libfaketime")
        if self.directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix="jepsen_like-clock-"))
            self._own_directory = True
        else:
            self.directory = Path(self.directory)
            self.directory.mkdir(parents=True, exist_ok=True)
        self._ready = True
        for i in range(self.nodes):
            self._write(i, 1.0)
        return self

    def teardown(self) -> None:
        """Set every rate back to 1, then remove the rate files (and the directory if this
        nemesis made it); idempotent."""
        if not self._ready:
            return
        try:
            self.reset()
        except OSError:
            pass
        self._ready = False
        assert self.directory is not None
        if self._own_directory:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None
        else:
            for i in range(self.nodes):
                try:
                    self.rate_file(i).unlink()
                except FileNotFoundError:
                    pass
        self._rates = [1.0] * self.nodes

    # -- wiring -------------------------------------------------------------------------------

    def rate_file(self, i: int) -> Path:
        if self.directory is None:
            raise ClockError("setup() has not run")
        return self.directory / f"n{self._check(i)}.faketime"

    def env(self, i: int) -> dict[str, str]:
        """Environment variables that run node ``i`` under its rate file."""
        if not self._ready or self.library is None:
            raise ClockError("setup() has not run")
        preload = os.environ.get("LD_PRELOAD")
        return {
            "LD_PRELOAD": f"{self.library}:{preload}" if preload else self.library,
            "FAKETIME_TIMESTAMP_FILE": str(self.rate_file(i)),
            "FAKETIME_NO_CACHE": "1",
            "FAKETIME_XRESET": "1",
        }

    def launch_prefix(self, i: int) -> list[str]:
        """A ``LocalCluster.launch_prefix`` for node ``i`` (``env`` execs the node, so signals
        still reach it)."""
        return ["env", *(f"{k}={v}" for k, v in self.env(i).items())]

    def wire(self, cluster: Any) -> Any:
        """Start a ``LocalCluster``'s nodes under their rate files; call before
        ``cluster.start()``. Any existing ``launch_prefix`` is kept (after ours)."""
        if cluster.nodes != self.nodes:
            raise ValueError(f"cluster has {cluster.nodes} nodes, clock nemesis {self.nodes}")
        previous = cluster.launch_prefix
        cluster.launch_prefix = lambda i: [*self.launch_prefix(i), *(previous(i) if previous else [])]
        return cluster

    # -- faults -------------------------------------------------------------------------------

    def set_rate(self, i: int, rate: float) -> None:
        """Node ``i``'s clocks run ``rate`` times as fast as real time from now on (live)."""
        self._write(self._check(i), rate)

    def reset(self) -> None:
        """Every node back to rate 1 (the time gained or lost is kept)."""
        for i in range(self.nodes):
            self._write(i, 1.0)

    @property
    def rates(self) -> list[float]:
        return list(self._rates)

    # -- internals ------------------------------------------------------------------------------

    def _check(self, i: int) -> int:
        if not 0 <= i < self.nodes:
            raise ValueError(f"no node {i} (have 0..{self.nodes - 1})")
        return i

    def _write(self, i: int, rate: float) -> None:
        if not self._ready:
            raise ClockError("setup() has not run")
        text = spec(rate) + "\n"
        path = self.rate_file(i)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)   # atomic: libfaketime reads the old spec or the new one
        self._rates[i] = float(rate)
