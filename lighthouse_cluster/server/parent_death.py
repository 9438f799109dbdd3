"""A process that must not outlive the one that started it (a node of `up`, a job port process).

Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``), asked for by the child itself
first thing (no ``preexec_fn``, unsafe in a parent with gRPC threads). The kernel ties it to the
*thread* that started the child, not the process: start such children from one long-lived thread.
"""

from __future__ import annotations

import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, what: str = "process") -> None:
    """Be SIGKILLed when ``parent_pid`` (this process's parent) exits; exit now, with one line on
    stderr naming ``what`` this is, if it already has (the race between its ``fork`` and here)."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            sys.stderr.write(f"warning: prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}\n")
    if os.getppid() != parent_pid:
        sys.stderr.write(f"error: the process that started this {what} ({parent_pid}) is gone; exiting\n")
        sys.stderr.flush()
        os._exit(1)
