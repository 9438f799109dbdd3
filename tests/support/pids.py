"""Whether a process id exists, and what /proc says of it (for assertion messages)."""

from __future__ import annotations

import os


def pid_exists(pid: int) -> bool:
    """True while ``pid`` exists (a zombie not yet reaped counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def proc_state(pid: int) -> str:
    """``pid``'s state letter and parent from /proc/PID/stat, or "gone"."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return f"pid {pid} is gone"
    return f"pid {pid}: state {fields[0]}, parent {fields[1]} (this process is {os.getpid()})"


def wait_until_gone(pid: int, timeout: float = 5.0) -> None:
    """Wait (bounded) until ``pid`` no longer exists; the failure message says what /proc shows."""
    from support.waiting import wait_for

    wait_for(f"pid {pid} to be gone", lambda: not pid_exists(pid), timeout, context=lambda: proc_state(pid))
