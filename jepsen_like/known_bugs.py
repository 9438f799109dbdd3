"""Signatures of cluster bugs the harness found and that are not fixed yet (pure functions).

A checker failure still fails ``run`` and ``check``; a signature only says which offences a
known open bug explains (printed next to the FAIL line), and lets the CI tests tolerate exactly
those offences while the bug is open, so that every *other* violation still fails CI.

BUG-1 (a node cut off from Raft after a partition heals) and BUG-2 (a deposed leader committing
a ``TermStart`` in its successor's term) are fixed and their signatures removed; their
regression schedules expect ``pass`` (jepsen_like/README.md, "Bugs found"). One bug is open:

* ``BUG-3`` (``Status`` reports a leader being deposed as the leader of the new term): pysyncobj
  raises the term (a synchronous meta-file write, which releases the GIL) before it steps a
  deposed leader down, and ``node.status()`` reads ``raft.role`` and ``raft.term`` separately,
  so a poll in between sees (leader, new term). Only the report is wrong: the node neither
  serves nor writes in that term (``RaftNode.led_term``). Signature of a
  ``one-leader-per-term`` offence: exactly one node wrote the term's committed commands, and
  every other claimed leader of it appears only in monitor observations and wrote commands
  (led) in an earlier term.

When the harness finds a new bug that cannot be fixed at once: describe it in the README, add
a function ``matches(offence, history) -> bool`` that recognises exactly its offences, register
it here as ``SIGNATURES[checker_name] = ("BUG-n", matches)``, and save its schedule under
``regressions/`` with ``"expect": "fail"`` or ``"flaky-fail"``. Remove both once it is fixed.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from .checkers import CheckResult, final_states
from .history import Event

Signature = Callable[[dict[str, Any], Sequence[Event]], bool]



def bug3(offence: dict[str, Any], history: Sequence[Event]) -> bool:
    """A one-leader-per-term offence explained by BUG-3 (a torn ``Status`` read)."""
    term = offence.get("term")
    leaders = offence.get("leaders") or []
    if not isinstance(term, int) or len(leaders) < 2:
        return False
    writers: set[str] = set()        # nodes that wrote committed commands in ``term``
    led_before: set[str] = set()     # nodes that wrote committed commands in an earlier term
    for st in final_states(history).values():
        for t, ws in (st.get("leaders") or {}).items():
            if int(t) == term:
                writers.update(ws)
            elif int(t) < term:
                led_before.update(ws)
    observed_only = [x for x in leaders if x not in writers]
    return len(writers) == 1 and bool(observed_only) and all(x in led_before for x in observed_only)


# checker name -> (bug name, offence matcher)
SIGNATURES: dict[str, tuple[str, Signature]] = {"one-leader-per-term": ("BUG-3", bug3)}


def explain(result: CheckResult, history: Sequence[Event]) -> str | None:
    """The known bug that explains *every* offence of a failed check, if any."""
    if result.valid or result.name not in SIGNATURES or result.count != len(result.offending):
        return None
    name, matches = SIGNATURES[result.name]
    return name if result.offending and all(matches(o, history) for o in result.offending) else None


def unexplained(checks: Sequence[CheckResult], history: Sequence[Event]) -> list[CheckResult]:
    """The failed checks that no known bug explains."""
    return [c for c in checks if not c.valid and explain(c, history) is None]
