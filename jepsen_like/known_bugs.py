"""Signatures of cluster bugs the harness found and that are not fixed yet (pure functions).

A checker failure still fails ``run`` and ``check``; a signature only says which offences a
known open bug explains (printed next to the FAIL line), and lets the CI tests tolerate exactly
those offences while the bug is open, so that every *other* violation still fails CI.

BUG-1 (a node cut off from Raft after a partition heals), BUG-2 (a deposed leader committing
a ``TermStart`` in its successor's term) and BUG-3 (``Status`` reporting a leader being deposed
as the leader of the new term) are fixed and their signatures removed; their regression
schedules expect ``pass`` (jepsen_like/README.md, "Bugs found"). No bug is open: ``SIGNATURES``
is empty, so CI tolerates no checker failure.

When the harness finds a new bug that cannot be fixed at once: describe it in the README, add
a function ``matches(offence, history) -> bool`` that recognises exactly its offences, register
it here as ``SIGNATURES[checker_name] = ("BUG-n", matches)``, and save its schedule under
``regressions/`` with ``"expect": "fail"`` or ``"flaky-fail"``. Remove both once it is fixed.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from .checkers import CheckResult
from .history import Event

Signature = Callable[[dict[str, Any], Sequence[Event]], bool]

# checker name -> (bug name, offence matcher)
SIGNATURES: dict[str, tuple[str, Signature]] = {}   # no open bug


def explain(result: CheckResult, history: Sequence[Event]) -> str | None:
    """The known bug that explains *every* offence of a failed check, if any."""
    if result.valid or result.name not in SIGNATURES or result.count != len(result.offending):
        return None
    name, matches = SIGNATURES[result.name]
    return name if result.offending and all(matches(o, history) for o in result.offending) else None


def unexplained(checks: Sequence[CheckResult], history: Sequence[Event]) -> list[CheckResult]:
    """The failed checks that no known bug explains."""
    return [c for c in checks if not c.valid and explain(c, history) is None]
