"""Node processes forked from a server that has imported the node's code already.

``python -m lighthouse_cluster serve`` spends about 0.3 CPU-seconds starting the interpreter and
importing grpc, protobuf, pysyncobj and the rest before it serves. Where many short-lived clusters
start one after another (torchft's suites through :class:`~lighthouse_cluster.LighthouseServer`,
hundreds of clusters in a test run), that start is most of what a cluster costs. The standard
library's fork server (``multiprocessing``'s ``forkserver`` start method) imports the command's
modules once (``set_forkserver_preload``) and forks every node from that process.

A forked node is a process of its own like an exec'd one: its own pid and session, the same
arguments to the same ``lighthouse-cluster`` command, the environment given, the starting
process's resource limits and umask (as an exec'd child inherits them; the fork server's are
those of when it started), its log file as stdout and stderr, nothing on stdin. What it shares with its siblings is what the fork server
imported, nothing that runs: the fork server starts no thread, no event loop and no gRPC core
before it forks. :class:`ForkedProcess` gives LocalCluster the part of ``subprocess.Popen`` it
uses (``pid``, ``poll``, ``wait``, ``send_signal``, ``kill``, ``returncode``).

What only an exec gives, a forked node does not have, and :func:`can_fork` says so:

* a launch prefix (``ip netns exec NS ...``) or a preloaded library (``LD_PRELOAD``, libfaketime):
  both act at exec;
* a node that must die with the process that started it (``PR_SET_PDEATHSIG`` and its parent
  check): its parent is the fork server;
* ``/proc/PID/cmdline`` and ``ps`` show the fork server's command line, not ``serve --node-id``:
  whoever must find nodes by their command line starts them with exec;
* a process whose main module is a script (``python script.py``) or a module run with ``-m``
  (other than a package's ``__main__``): the fork server runs or imports it again in every child
  (``multiprocessing``'s "safe importing of main module"), which a script without the
  ``if __name__ == "__main__"`` guard would not survive.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import resource
import runpy
import signal
import subprocess
import sys
import threading
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Mapping

# What the fork server imports once: the ``lighthouse-cluster`` command and the node behind ``serve``.
PRELOAD = ["lighthouse_cluster.cli.commands", "lighthouse_cluster.server.node"]
# Environment variables that act only when a process is exec'd.
EXEC_ONLY_ENV = ("LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONPATH", "PYTHONHOME", "FAKETIME")

_lock = threading.Lock()
_context: BaseContext | None = None
# Forked nodes not yet seen to end (held strongly: multiprocessing holds their Process objects
# until exit whatever becomes of ours, and its exit hook joins them).
_live: "set[ForkedProcess]" = set()
_exit_hook = False


def fork_context() -> BaseContext:
    """This process's forkserver context, with the node's modules preloaded (set once, before the
    fork server starts: it starts at the first fork)."""
    global _context
    with _lock:
        if _context is None:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(PRELOAD)
            _context = context
        return _context


def can_fork(command: list[str], env: Mapping[str, str]) -> str | None:
    """None when the node ``command`` with ``env`` can be forked instead of exec'd; else why not."""
    if not sys.platform.startswith("linux"):
        return "fork servers are used on Linux only"
    if command[:3] != [sys.executable, "-m", "lighthouse_cluster"]:
        return f"a launch prefix or another command ({command[0]}) acts only at exec"
    changed = [k for k in EXEC_ONLY_ENV if env.get(k) != os.environ.get(k)]
    if changed:
        return f"{', '.join(changed)} act only at exec"
    return _main_module_rerun()


def _main_module_rerun(main: object = None) -> str | None:
    """Why a forked child would run this process's main module (``main``: by default
    ``sys.modules["__main__"]``) again, or None (``-c``, an interactive session, a package's
    ``__main__``: what ``multiprocessing.spawn`` leaves alone)."""
    main = sys.modules.get("__main__") if main is None else main
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:
        return None if name == "__main__" or name.endswith(".__main__") else \
            f"a forked node would import the main module {name} again"
    path = getattr(main, "__file__", None)
    return None if path is None else f"a forked node would run the main script {path} again"


def inherited() -> tuple[dict[int, tuple[int, int]], int | None]:
    """What an exec'd child would inherit from this process and a forked one must be given: every
    resource limit, and the umask (None where /proc does not say it)."""
    limits = {getattr(resource, name): resource.getrlimit(getattr(resource, name))
              for name in dir(resource) if name.startswith("RLIMIT_")}
    try:
        status = Path("/proc/self/status").read_text()
        umask = next((int(line.split()[1], 8) for line in status.splitlines() if line.startswith("Umask:")), None)
    except OSError:
        umask = None
    return limits, umask


def _run(argv: list[str], env: dict[str, str], cwd: str, log_path: str,
         limits: dict[int, tuple[int, int]], umask: int | None) -> None:
    """The forked node: its own session, the log as stdout and stderr, the starting process's
    resource limits and umask, ``env`` as its environment, then the ``lighthouse-cluster``
    command with ``argv``."""
    os.setsid()
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    # Line-buffered, as PYTHONUNBUFFERED makes an exec'd node's (the fork server's were set up for it).
    sys.stdout = open(1, "w", buffering=1, closefd=False, encoding="utf-8", errors="backslashreplace")
    sys.stderr = open(2, "w", buffering=1, closefd=False, encoding="utf-8", errors="backslashreplace")
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    for which, limit in limits.items():
        if resource.getrlimit(which) != limit:
            try:
                resource.setrlimit(which, limit)
            except (ValueError, OSError) as e:  # a hard limit above the fork server's: not for us to raise
                print(f"warning: the starting process's resource limit {which} {limit} could not be set: {e}",
                      file=sys.stderr)
    if umask is not None:
        os.umask(umask)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    # As ``python -m lighthouse_cluster ARGV`` runs it (the fork server imported it already); it
    # exits with SystemExit, whose code is the process's exit code.
    sys.argv = [str(Path(__file__).resolve().parents[1] / "__main__.py"), *argv]
    runpy.run_module("lighthouse_cluster", run_name="__main__", alter_sys=True)


def _kill_at_exit() -> None:
    """At interpreter exit, SIGKILL every forked node still running (a paused one too), before
    ``multiprocessing``'s own exit hook joins its children: that join would wait forever on a
    node that nobody stopped, and on a SIGSTOPped one even after its SIGTERM. (atexit runs the
    hooks last registered first; this one is registered after the first fork, so after
    multiprocessing's.)"""
    global _exit_hook
    with _lock:
        if _exit_hook:
            return
        _exit_hook = True

    def kill_live() -> None:
        for process in list(_live):
            process.send_signal(signal.SIGCONT)
            process.kill()

    atexit.register(kill_live)


class ForkedProcess:
    """A node forked by the fork server, with the part of ``subprocess.Popen``'s interface that
    LocalCluster uses. ``returncode`` is the exit code, or minus the signal that ended it."""

    def __init__(self, command: list[str], env: Mapping[str, str], log_path: Path) -> None:
        self.args = list(command)
        self.returncode: int | None = None
        self._process = fork_context().Process(
            target=_run, args=(command[3:], dict(env), os.getcwd(), str(log_path), *inherited()),
            name=f"lighthouse-cluster {' '.join(command[3:6])}", daemon=True)
        self._process.start()
        self.pid: int = self._process.pid  # type: ignore[assignment]
        _live.add(self)
        _kill_at_exit()

    def poll(self) -> int | None:
        if self.returncode is None and self._process.exitcode is not None:
            self.returncode = self._process.exitcode
            _live.discard(self)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __repr__(self) -> str:
        return f"<ForkedProcess pid={self.pid} returncode={self.returncode} args={self.args[3:6]}>"


__all__ = ["ForkedProcess", "can_fork", "fork_context", "PRELOAD"]
