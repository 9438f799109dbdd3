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


def pid_running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (a killed process whose parent died too may
    wait a moment to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _parents() -> dict[int, int]:
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    out[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    return out


def job_port_processes(ancestor: int) -> list[int]:
    """The job port processes (``--job-port-processes``) among ``ancestor``'s descendants."""
    parents = _parents()

    def under(pid: int) -> bool:
        while pid in parents and pid > 1:
            pid = parents[pid]
            if pid == ancestor:
                return True
        return False

    out = []
    for pid in parents:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"lighthouse_cluster.server.job_port_process" in cmdline and under(pid):
            out.append(pid)
    return out
