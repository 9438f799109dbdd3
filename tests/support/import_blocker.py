"""Run Python subprocesses in which some top-level packages cannot be imported.

``blocking_env(tmp_path, names)`` writes a ``sitecustomize.py`` into ``tmp_path`` and returns an
environment that puts it first on ``PYTHONPATH``: every Python process started with it (and every
process those start, e.g. the nodes of ``up``) installs a meta-path finder that raises
``ModuleNotFoundError`` for ``names`` and their submodules, as if they were not installed, and
appends each blocked attempt (``name pid``) to the file ``blocked_attempts(env)`` names -- so a
test also sees an ``import`` that the code under test caught and ignored.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# What the runtime must run without (issue 14): the trainer SDK, the benchmarks and what they need.
HEAVY = ("torch", "torchft", "matplotlib", "numpy", "py_spy", "ftclient", "benchmarks")

SITECUSTOMIZE = '''\
import importlib.abc
import os
import sys

_BLOCKED = frozenset(n for n in os.environ.get("LHC_TEST_BLOCK_IMPORTS", "").split(",") if n)
_LOG = os.environ.get("LHC_TEST_BLOCK_LOG")


class _Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] not in _BLOCKED:
            return None
        if _LOG:
            with open(_LOG, "a") as f:
                f.write(f"{fullname} {os.getpid()}\\n")
        raise ModuleNotFoundError(f"No module named {fullname!r} (blocked by the test)", name=fullname)


sys.meta_path.insert(0, _Blocker())
'''


def blocking_env(tmp_path: Path, names: tuple[str, ...] = HEAVY, **extra: str) -> dict[str, str]:
    """os.environ plus ``extra``, with ``names`` unimportable in every Python process started with it."""
    site = tmp_path / "blocker-site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = tmp_path / "blocked-imports.log"
    log.write_text("")
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["LHC_TEST_BLOCK_IMPORTS"] = ",".join(names)
    env["LHC_TEST_BLOCK_LOG"] = str(log)
    return env


def blocked_attempts(env: dict[str, str]) -> list[str]:
    """The module names whose import was refused so far (each once, in order)."""
    seen: dict[str, None] = {}
    for line in Path(env["LHC_TEST_BLOCK_LOG"]).read_text().splitlines():
        seen.setdefault(line.split()[0], None)
    return list(seen)
