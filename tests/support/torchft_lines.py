"""The two torchft lines users install, each with a Python interpreter that imports it.

* ``"0.2.0"``: torchft 0.2.0 (the ``interop`` extra), in the environment running the tests.
* ``"nightly"``: torchft-nightly (the ``interop-nightly`` extra, pinned). It installs the same
  module name, ``torchft``, so it lives in a virtual environment of its own, created on first use
  under ``<repo>/.venvs/torchft-nightly`` with this repo's package installed editable, the test
  extras and what torchft's own test modules import (the ``torchft-tests`` extra). The venv sees
  the test environment's packages (``--system-site-packages``: torch is not copied again); its
  own torchft-nightly shadows the environment's torchft 0.2.0.

API (tests/torchft_interop/test_torchft_suites.py and tests/torchft_interop/test_torchft_hosts_ha.py import it):

* ``LINES`` -- the line names, for ``pytest.mark.parametrize``.
* ``python_for(line)`` -- the path of an interpreter for that line; creates the nightly venv once
  (a file lock makes concurrent pytest processes wait for one creation; a marker file records a
  finished one, so an interrupted creation starts over, and a change to pyproject.toml's
  dependencies or these extras updates the venv). Raises :class:`VenvError` with the tail
  of pip's output when the environment cannot be made: CI must fail, never skip silently.
* ``torchft_version(python)`` -- the torchft distribution and version that interpreter imports,
  e.g. ``"torchft 0.2.0"`` or ``"torchft-nightly 2026.10.26"``.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

LINES = ("0.2.0", "nightly")

ROOT = Path(__file__).resolve().parents[2]
VENVS = ROOT / ".venvs"
NIGHTLY_VENV = VENVS / "torchft-nightly"
EXTRAS = "test,interop-nightly,torchft-tests,examples"  # examples: scikit-learn for the drop-in training tests
MARKER = ".lighthouse-cluster-ready"

PIP_TIMEOUT_S = 1200.0  # a cold install downloads ~50 MB of wheels and copies torch (~1 GB)
TAIL_LINES = 40


class VenvError(RuntimeError):
    """The nightly virtual environment could not be created."""


def _log(message: str) -> None:
    # Straight to the terminal: pytest captures stdout, and this can take minutes.
    print(f"[torchft_lines] {message}", file=sys.__stderr__, flush=True)


def _run(cmd: list[str], what: str, timeout: float) -> None:
    started = time.monotonic()
    _log(f"{what}: {' '.join(cmd)}")
    try:
        res = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        out = e.stdout if isinstance(e.stdout, str) else (e.stdout or b"").decode(errors="replace")
        tail = "\n".join(out.splitlines()[-TAIL_LINES:])
        raise VenvError(f"{what} did not finish within {timeout:.0f}s; output tail:\n{tail}") from None
    if res.returncode != 0:
        tail = "\n".join(res.stdout.splitlines()[-TAIL_LINES:])
        raise VenvError(f"{what} failed (exit {res.returncode}); output tail:\n{tail}")
    _log(f"{what}: done in {time.monotonic() - started:.0f}s")


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _spec() -> str:
    """What the venv was made from: the extras and this repo's dependency lists. A venv made from
    another spec is brought up to date (pip install again), so a new pin or test dependency in
    pyproject.toml reaches it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {"dependencies": project.get("dependencies", []),
              "extras": {k: v for k, v in project.get("optional-dependencies", {}).items()
                         if k in EXTRAS.split(",")}}
    digest = hashlib.sha256(json.dumps(wanted, sort_keys=True).encode()).hexdigest()[:16]
    return f"extras {EXTRAS}; pyproject {digest}"


def _ready(venv: Path) -> bool:
    marker = venv / MARKER
    return (_venv_python(venv).exists() and marker.exists() and marker.read_text() == _spec()
            and _shares_site_packages(venv))


def _create_nightly(venv: Path) -> None:
    started = time.monotonic()
    py = str(_venv_python(venv))
    (venv / MARKER).unlink(missing_ok=True)
    if _venv_python(venv).exists() and _usable(py) and _shares_site_packages(venv):
        _log(f"updating the torchft-nightly virtual environment in {venv} (pyproject.toml changed)")
    else:
        if venv.exists():
            _log(f"removing {venv} (broken, or made without --system-site-packages)")
            shutil.rmtree(venv)
        _log(f"creating the torchft-nightly virtual environment in {venv} (once; about a minute)")
        # --system-site-packages: torch 2.13.0 and the other shared dependencies come from the
        # environment running the tests instead of a second ~1 GB copy (about 100 s on CI); the
        # venv's own torchft-nightly comes first on its sys.path (torchft_version checks which
        # distribution the imported module belongs to).
        _run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], "python -m venv", 300)
    # torch is pinned (a CPU build); an unpinned torch would pull a multi-GB CUDA build.
    _run([py, "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off",
          "torch==2.13.0", "-e", f".[{EXTRAS}]"], f"pip install torch==2.13.0 -e '.[{EXTRAS}]'", PIP_TIMEOUT_S)
    torchft_version.cache_clear()
    version = torchft_version(py)
    if not version.startswith("torchft-nightly "):
        raise VenvError(f"{venv} imports {version}, not torchft-nightly")
    (venv / MARKER).write_text(_spec())
    _log(f"{venv} ready ({version}) in {time.monotonic() - started:.0f}s")


def _shares_site_packages(venv: Path) -> bool:
    """Whether the venv was made with --system-site-packages (an older one is made again)."""
    try:
        cfg = (venv / "pyvenv.cfg").read_text()
    except OSError:
        return False
    return any(line.replace(" ", "") == "include-system-site-packages=true" for line in cfg.splitlines())


def python_for(line: str) -> str:
    """Path of a Python interpreter that imports torchft ``line`` and this repo's package."""
    if line == "0.2.0":
        return sys.executable
    if line != "nightly":
        raise ValueError(f"unknown torchft line {line!r}; expected one of {LINES}")
    venv = NIGHTLY_VENV
    if not _ready(venv):
        VENVS.mkdir(parents=True, exist_ok=True)
        with open(VENVS / "torchft-nightly.lock", "w") as lock:
            if not _lock_nonblocking(lock):
                _log(f"another process is creating {venv}; waiting for it")
                fcntl.flock(lock, fcntl.LOCK_EX)  # bounded by that process's own pip timeout
            try:
                if not _ready(venv):  # the other process may have finished it meanwhile
                    _create_nightly(venv)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    return str(_venv_python(venv))


def _usable(python: str) -> bool:
    try:
        return subprocess.run([python, "-c", "import pip"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _lock_nonblocking(lock: object) -> bool:
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


_VERSION_SCRIPT = """
import json, importlib.metadata as md, pathlib, torchft
# The distribution whose files hold the torchft module this interpreter imports (the nightly venv
# also sees the base environment's torchft 0.2.0, behind its own torchft-nightly).
imported = pathlib.Path(torchft.__file__).resolve()
found = []
for name in ("torchft", "torchft-nightly"):
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        continue
    if pathlib.Path(dist.locate_file("torchft/__init__.py")).resolve() == imported:
        found.append((name, dist.version))
print(json.dumps(found))
"""


@functools.lru_cache(maxsize=None)
def torchft_version(python: str) -> str:
    """``"<distribution> <version>"`` of the torchft that ``python`` imports (runs it once)."""
    try:
        res = subprocess.run([python, "-c", _VERSION_SCRIPT], capture_output=True, text=True, timeout=120,
                             stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": ""})
    except subprocess.TimeoutExpired:
        raise VenvError(f"{python} did not report its torchft version within 120s") from None
    if res.returncode != 0:
        tail = "\n".join(res.stderr.splitlines()[-TAIL_LINES:])
        raise VenvError(f"{python} cannot import torchft:\n{tail}")
    found = json.loads(res.stdout.strip().splitlines()[-1])
    if len(found) != 1:
        raise VenvError(f"{python} imports torchft from {found or 'no known distribution'}: expected exactly one "
                        "torchft line")
    name, version = found[0]
    return f"{name} {version}"
