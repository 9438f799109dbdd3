"""Benchmarks of lighthouse-cluster side by side with torchft's Rust lighthouse.

Not part of the runtime: a package of the source checkout, run from its root as
``python -m benchmarks run [--quick]`` and ``python -m benchmarks report RESULTS.json``, with the
``bench`` extra installed (``pip install -e '.[bench]'``: torch, torchft, numpy, matplotlib,
py-spy). The results live beside it (``bench.json``, ``bench.md``, ``bench.png``, ``bench-*``), with
``README.md``: how to run each benchmark, the latest results and the targets.

Sections (each launches the systems it measures and always cleans them up):
``rounds`` (quorum rounds with N simulated replica groups), ``failover`` (leader SIGKILL vs
torchft_lighthouse kill + restart), ``sdk`` (ftclient vs torchft Manager step time), ``recovery``
(live recovery over HTTP, ftclient vs torchft transport), ``footprint`` (idle CPU and memory),
``goodput`` (replica groups SIGKILLed and restarted while the others train: what it costs them).
Entry point: the ``bench`` click group in :mod:`benchmarks.cli`.
"""

from __future__ import annotations

import importlib.util
import traceback
from typing import Callable, TypeVar

T = TypeVar("T")

# The Python modules the benchmarks import, beyond the runtime (all in the `bench` extra; py-spy
# is a program, looked up when --profile-ns asks for it).
REQUIRED_MODULES = ("torch", "torchft", "numpy", "matplotlib")
INSTALL_HINT = "pip install -e '.[bench]' (from the repository root)"
# What a measurement may genuinely lack: a worker process whose SDK or transport cannot be
# imported because one of these is not installed records a skip. Every other failure is an error,
# ftclient's own import included (it is this repository's).
OPTIONAL_PACKAGES = ("torch", "torchft")


def skip_reason(e: BaseException) -> str | None:
    """A skip reason when ``e`` says one of OPTIONAL_PACKAGES is not installed, else None."""
    if isinstance(e, ModuleNotFoundError) and e.name in OPTIONAL_PACKAGES:
        return f"{e.name} is not installed ({INSTALL_HINT})"
    return None


def load_for_worker(load: Callable[[], T], what: str, skipped: Callable[[str], None],
                    errored: Callable[[str], None]) -> tuple[T | None, int]:
    """``(load(), 0)``; when it raises, record a skip (exit code 3) if an optional package is
    missing, else an error naming ``what`` (exit code 1, traceback into the worker's log)."""
    try:
        return load(), 0
    except Exception as e:  # noqa: BLE001 -- recorded: a skip only when an optional package is missing
        reason = skip_reason(e)
        if reason:
            skipped(reason)
            return None, 3
        traceback.print_exc()
        errored(f"cannot import {what}: {type(e).__name__}: {e}")
        return None, 1


def missing_modules() -> list[str]:
    """Which of REQUIRED_MODULES cannot be imported here."""
    missing = []
    for name in REQUIRED_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing
