"""Run a torchft program on ftclient without editing it: ``import torchft`` answers with ftclient.

This module owns the launcher and the import hook behind it::

    python -m ftclient.as_torchft train.py --args ...            # a script
    python -m ftclient.as_torchft -m torchtitan.train --args ...  # a module
    python -m ftclient.as_torchft -c "import torchft; print(torchft.Manager)"
    ftclient-as-torchft -m torchtitan.train --args ...           # the console script
    torchrun --nproc_per_node=8 -m ftclient.as_torchft -m torchtitan.train --args ...

Before the target runs, :func:`install` puts ftclient's compatibility package
(:mod:`ftclient.torchft_compat`) into ``sys.modules`` as ``torchft`` and each torchft submodule
it covers under its torchft name (``torchft.process_group``, ``torchft.manager``,
``torchft.local_sgd``, ``torchft.checkpointing`` ...), and puts a finder first on
``sys.meta_path`` that answers every other ``torchft.*`` import with a ``ModuleNotFoundError``
saying what ftclient lacks, so that nothing can ever reach an installed torchft.
``importlib.util.find_spec("torchft")`` (torchtitan's check) finds the compatibility package.

For this process only: an installed torchft is never touched, imported, or shadowed for other
processes. A child process that is a new interpreter (multiprocessing's spawn, a subprocess)
does not inherit it: start it through the launcher too, or call :func:`install` at its start.
(ftclient's own children, such as the baby process groups', import no torchft.) If torchft was
already imported when :func:`install` runs, it refuses: objects of the real torchft would then
meet ftclient's.

The target runs as ``__main__`` with ``sys.argv`` set as if Python had run it directly (the
script's directory first on ``sys.path`` for a script, the working directory for ``-m`` and
``-c``); its exit status is the launcher's.
"""

from __future__ import annotations

import builtins
import importlib.abc
import importlib.machinery
import os
import runpy
import sys
from types import ModuleType
from typing import Sequence

__all__ = ["install", "installed", "main"]

_NAME = "torchft"
_USAGE = """\
usage: python -m ftclient.as_torchft SCRIPT [ARGS...]
       python -m ftclient.as_torchft -m MODULE [ARGS...]
       python -m ftclient.as_torchft -c CODE [ARGS...]

Runs a torchft program (torchtitan's fault tolerance, a torchft training script) on ftclient:
in this process `import torchft` gives ftclient's compatibility layer (ftclient.torchft_compat);
an installed torchft is never imported.
"""


class _RefuseOtherTorchft(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``: a torchft module the compatibility layer does not cover is
    an error naming what is missing, never a fall-through to an installed torchft."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _NAME and not fullname.startswith(_NAME + "."):
            return None
        from ftclient import torchft_compat

        sub = fullname[len(_NAME) + 1:]
        why = torchft_compat.MISSING.get(sub.split(".")[0], "it has no counterpart in ftclient")
        covered = ", ".join(f"{_NAME}.{m}" for m in torchft_compat.MODULES)
        raise ModuleNotFoundError(
            f"No module named {fullname!r} under ftclient's torchft compatibility layer "
            f"(python -m ftclient.as_torchft): {why}. It covers torchft, {covered}.", name=fullname)


def installed() -> bool:
    """Whether ``torchft`` in this process is ftclient's compatibility layer."""
    from ftclient import torchft_compat

    return sys.modules.get(_NAME) is torchft_compat


def install() -> ModuleType:
    """Make ``import torchft`` (and its covered submodules) give ftclient in this process;
    returns the compatibility package. Idempotent. Raises ``RuntimeError`` if a real torchft
    module is already imported."""
    from ftclient import torchft_compat

    if installed():
        return torchft_compat
    already = sorted(m for m in sys.modules if m == _NAME or m.startswith(_NAME + "."))
    if already:
        raise RuntimeError(f"torchft is already imported in this process ({', '.join(already[:5])}): "
                           "install ftclient's compatibility layer before anything imports torchft "
                           "(start the program with python -m ftclient.as_torchft)")
    sys.modules[_NAME] = torchft_compat
    for sub, module in torchft_compat.MODULES.items():
        sys.modules[f"{_NAME}.{sub}"] = module
    if not any(isinstance(f, _RefuseOtherTorchft) for f in sys.meta_path):
        sys.meta_path.insert(0, _RefuseOtherTorchft())
    return torchft_compat


def _run(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE, end="", file=sys.stdout if argv else sys.stderr)
        raise SystemExit(0 if argv else 2)
    if argv[0] in ("-m", "-c"):
        if len(argv) < 2:
            print(f"ftclient.as_torchft: argument {argv[0]} needs a value\n{_USAGE}", end="", file=sys.stderr)
            raise SystemExit(2)
        install()
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]  # runpy replaces argv[0] with the module's path
            sys.path.insert(0, os.getcwd())
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *argv[2:]]
            sys.path.insert(0, "")
            code = compile(argv[1], "<string>", "exec")
            program = ModuleType("__main__")  # a fresh __main__, as runpy gives a script
            program.__dict__["__builtins__"] = builtins
            saved = sys.modules["__main__"]
            sys.modules["__main__"] = program
            try:
                exec(code, program.__dict__)
            finally:
                sys.modules["__main__"] = saved
        return
    script = argv[0]
    if argv[0] == "--":
        if len(argv) < 2:
            print(f"ftclient.as_torchft: -- needs a script\n{_USAGE}", end="", file=sys.stderr)
            raise SystemExit(2)
        script, argv = argv[1], argv[1:]
    if not os.path.exists(script):
        print(f"ftclient.as_torchft: can't open file {script!r}: no such file", file=sys.stderr)
        raise SystemExit(2)
    install()
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def main(argv: Sequence[str] | None = None) -> None:
    """The launcher (``python -m ftclient.as_torchft`` / ``ftclient-as-torchft``)."""
    _run(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
