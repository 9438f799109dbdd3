"""Node processes that never outlive `lighthouse-cluster up`, and come back when they die.

Three layers, so that whatever ends ``up`` its nodes go with it:

1. ``up`` itself stops its nodes on SIGINT, SIGTERM, SIGHUP and a closed stdout (``cli.up``).
2. Parent-death signal (Linux): a node started with ``LIGHTHOUSE_CLUSTER_PARENT_PID`` in its
   environment asks the kernel (``prctl(PR_SET_PDEATHSIG, SIGKILL)``) to SIGKILL it when its
   parent goes, and exits at once if the parent is already gone (the race between ``fork`` and
   the ``prctl``). It is set in the node itself, first thing in ``serve`` (no ``preexec_fn``,
   which is unsafe in a parent with gRPC threads). The kernel ties the signal to the *thread*
   that started the node, not the process: ``up`` starts every node from its main thread.
3. :class:`Guardian`: a tiny process in a session of its own that holds the read end of a pipe
   whose only write end is in ``up``. When ``up`` ends in any way (SIGKILL and crashes
   included) the kernel closes that end; the guardian then SIGKILLs every node process group
   it was told about, waits for them to go, and removes the temporary data directory.

:class:`NodeSupervisor` starts the nodes (telling the guardian), notices when one exits and
restarts it after a :class:`~lighthouse_cluster.local.up_plan.RestartBackoff` delay, reporting both.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable

from lighthouse_cluster.local.cluster import PARENT_PID_ENV, LocalCluster
from lighthouse_cluster.core.restarts import RestartBackoff, describe_exit
from lighthouse_cluster.server.parent_death import die_with_parent

def die_with_parent_from_env() -> None:
    """In a process started with ``LIGHTHOUSE_CLUSTER_PARENT_PID``: be SIGKILLed when that parent
    (the thread that started this process) exits; exit now if it already has."""
    value = os.environ.pop(PARENT_PID_ENV, None)
    if value:
        die_with_parent(int(value), "node")


# The guardian: reads "+PID" / "-PID" / "rm PATH" lines; at EOF (its owner closed the pipe or
# died) it SIGKILLs every process group still listed (each node leads its own: pgid == pid),
# waits up to 10 s for them to go, and removes the listed directories. Run with -S -I: starts in
# ~20 ms and imports nothing of this package.
_GUARDIAN = r"""
import os, shutil, signal, sys, time
for s in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGPIPE):
    signal.signal(s, signal.SIG_IGN)
groups, dirs = set(), []
for line in sys.stdin:
    line = line.rstrip("\n")
    if line.startswith("+"):
        groups.add(int(line[1:]))
    elif line.startswith("-"):
        groups.discard(int(line[1:]))
    elif line.startswith("rm "):
        dirs.append(line[3:])
for g in groups:
    try:
        os.killpg(g, signal.SIGKILL)
    except OSError:
        pass
def gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True
deadline = time.monotonic() + 10
while groups and time.monotonic() < deadline:
    groups = {g for g in groups if not gone(g)}
    time.sleep(0.02)
for d in dirs:
    shutil.rmtree(d, ignore_errors=True)
"""

GUARDIAN_TAG = "lighthouse-cluster-guardian"


class Guardian:
    """The guardian process and the write end of its pipe (see the module docstring)."""

    def __init__(self, remove: Path | None = None) -> None:
        self._lock = threading.Lock()
        # The tag and the directory in argv name the guardian in `ps` (and to tests).
        self.process = subprocess.Popen(
            [sys.executable, "-S", "-I", "-c", _GUARDIAN, GUARDIAN_TAG, str(remove or "")],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, close_fds=True, text=True)
        self._pipe: IO[str] | None = self.process.stdin
        if remove is not None:
            self.send(f"rm {remove}")

    def send(self, line: str) -> None:
        with self._lock:
            if self._pipe is not None:
                try:
                    self._pipe.write(line + "\n")
                    self._pipe.flush()
                except OSError:  # the guardian is gone; the other layers still hold
                    self._pipe = None

    def watch(self, pid: int) -> None:
        self.send(f"+{pid}")

    def forget(self, pid: int) -> None:
        self.send(f"-{pid}")

    def close(self, timeout: float = 15.0) -> None:
        """Close the pipe (the guardian kills what is still listed and removes the directory)
        and reap it."""
        with self._lock:
            pipe, self._pipe = self._pipe, None
        if pipe is not None:
            try:
                pipe.close()
            except OSError:
                pass
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=timeout)


@dataclass
class NodeSupervisor:
    """Starts ``cluster``'s nodes, and restarts a node that exits (unless ``restart`` is off).

    Call :meth:`start_all`, :meth:`tick` and :meth:`stop_all` from the thread that should own
    the nodes (the parent-death signal is tied to it); ``say`` reports exits and restarts."""

    cluster: LocalCluster
    say: Callable[[str], None]
    restart: bool = True
    guardian: Guardian | None = None
    backoff: RestartBackoff = field(default_factory=RestartBackoff)
    clock: Callable[[], float] = time.monotonic
    # index -> (the process we started, when); index -> when to restart it
    _running: dict[int, tuple[subprocess.Popen[bytes], float]] = field(default_factory=dict)
    _due: dict[int, float] = field(default_factory=dict)
    restarts: int = 0

    def start(self, i: int) -> None:
        self.cluster.start_node(i)
        proc = self.cluster.members[i].process
        assert proc is not None
        if self.guardian is not None:
            self.guardian.watch(proc.pid)
        self._running[i] = (proc, self.clock())

    def start_all(self) -> None:
        self.cluster.root.mkdir(parents=True, exist_ok=True)
        for i in range(self.cluster.nodes):
            self.start(i)

    def exited(self) -> list[tuple[int, int]]:
        """(index, exit status) of every started node that has exited (not yet handled by tick)."""
        return [(i, code) for i, (proc, _) in self._running.items() if (code := proc.poll()) is not None]

    def tick(self) -> None:
        """Report nodes that exited since the last tick; restart those whose delay is over."""
        now = self.clock()
        for i, (proc, started) in list(self._running.items()):
            code = proc.poll()
            if code is None:
                continue
            del self._running[i]
            if self.guardian is not None:
                self.guardian.forget(proc.pid)
            m = self.cluster.members[i]
            if m.process is proc:
                m.process = None
            name = m.peer.node_id
            if not self.restart:
                self.say(f"{name} exited with {describe_exit(code)}; not restarting it (--no-restart); "
                         f"log: {m.log_path}")
                continue
            delay = self.backoff.next_delay(name, now - started)
            self._due[i] = now + delay
            self.say(f"{name} exited with {describe_exit(code)}; restarting in {delay:g} s")
        for i, due in list(self._due.items()):
            if now >= due:
                del self._due[i]
                try:
                    self.start(i)
                except OSError as e:
                    delay = self.backoff.next_delay(self.cluster.members[i].peer.node_id, 0.0)
                    self._due[i] = now + delay
                    self.say(f"{self.cluster.members[i].peer.node_id} did not start ({e}); retrying in {delay:g} s")
                    continue
                self.restarts += 1
                self.say(f"{self.cluster.members[i].peer.node_id} restarted (pid {self._running[i][0].pid})")

    def stop_all(self, graceful: bool = True) -> None:
        """Stop every node (SIGTERM first when ``graceful``, all at once) and cancel restarts."""
        self._due.clear()
        procs = [proc for proc, _ in self._running.values()]
        self._running.clear()
        for proc in procs:
            if proc.poll() is None:
                try:
                    proc.send_signal(signal.SIGTERM if graceful else signal.SIGKILL)
                except OSError:
                    pass
        deadline = self.clock() + 10.0
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - self.clock()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
            if self.guardian is not None:
                self.guardian.forget(proc.pid)
        for m in self.cluster.members:
            m.process = None
            m.paused = False
