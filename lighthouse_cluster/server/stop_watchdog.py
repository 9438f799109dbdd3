"""A bound on how long a node process takes to stop once asked to.

A stop that never ends (a gRPC shutdown waiting on a call, a thread the interpreter joins at exit
and that never returns) leaves a Slurm job, a pod or a systemd unit stopping until something
SIGKILLs it, and says nothing about why. ``arm`` starts a daemon thread when a stop begins: if
the process still lives ``deadline_s`` later, it logs one ERROR line, writes every thread's stack
to stderr (the node's log) and exits with ``STOP_TIMEOUT_EXIT``. A daemon thread runs on while
the interpreter joins the others at exit, so that hang is covered too; a process that exits in
time takes the thread with it.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time

__all__ = ["STOP_DEADLINE_S", "STOP_TIMEOUT_EXIT", "arm"]

log = logging.getLogger(__name__)

# A stop hands leadership over (at most 1 s), then closes its servers (each step bounded: node.py):
# 10 s is several times what a healthy stop takes, and under the 30 s orchestrators wait by default.
STOP_DEADLINE_S = 10.0
STOP_TIMEOUT_EXIT = 1


def arm(deadline_s: float = STOP_DEADLINE_S) -> None:
    """Start the watchdog: the process exits ``deadline_s`` from now unless it has exited by then."""

    def watch() -> None:
        time.sleep(deadline_s)
        log.error("stop did not finish within %g s: the stack of every thread follows; exiting with status %d",
                  deadline_s, STOP_TIMEOUT_EXIT)
        for handler in logging.getLogger().handlers:
            try:
                handler.flush()
            except Exception:  # noqa: BLE001 -- a broken handler must not keep the process alive
                pass
        try:
            sys.stderr.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except (OSError, ValueError):  # stderr closed: exit anyway
            pass
        os._exit(STOP_TIMEOUT_EXIT)

    threading.Thread(target=watch, name="stop-watchdog", daemon=True).start()
