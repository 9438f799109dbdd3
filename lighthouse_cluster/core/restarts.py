"""Restarting a process that exited: how long to wait, and how to name its exit. Pure.

Used by ``lighthouse-cluster up`` (its nodes) and by a node (its job port processes).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field


@dataclass
class RestartBackoff:
    """Bounded exponential backoff per process (a node, a job port): ``initial_s``, then doubling
    up to ``max_s`` while it keeps exiting within ``healthy_after_s`` of its start; one that ran
    longer starts over at ``initial_s``."""

    initial_s: float = 0.5
    factor: float = 2.0
    max_s: float = 10.0
    healthy_after_s: float = 5.0
    failures: dict[str, int] = field(default_factory=dict)

    def next_delay(self, node: str, ran_for_s: float) -> float:
        if ran_for_s >= self.healthy_after_s:
            self.failures[node] = 0
        n = self.failures.get(node, 0)
        self.failures[node] = n + 1
        return min(self.max_s, self.initial_s * self.factor ** n)


def describe_exit(code: int) -> str:
    """A process's exit status as ``up`` prints it: ``-9 (SIGKILL)``, ``1``."""
    if code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return str(code)
