"""Signatures of cluster bugs the harness found and that are not fixed yet (pure functions).

A checker failure still fails ``run`` and ``check``; these signatures only say which offences
are a known bug (printed next to the FAIL line), and let the CI tests tolerate exactly those
offences while the bug is open, so that every *other* violation still fails CI. Remove a
signature when its bug is fixed. Each bug is described in jepsen_like/README.md ("Bugs found").

* ``BUG-2`` (stale leader commits a TermStart in the next leader's term): a node deposed by a
  higher term is read as (leader, new term) by ``node._check_raft``, starts leading that term,
  and its ``TermStart`` (or ``CommitQuorum``) is forwarded by pysyncobj to the real leader and
  committed. Signature: in a committed log, term T has the first ``TermStart`` by node A and
  another writer X that led an earlier term (X is the deposed leader); or the monitor saw X
  report leader of T while A was the leader that committed T's first ``TermStart``.

* ``BUG-1`` (a node stays cut off from Raft after a partition heals: pysyncobj never times out a
  connect whose SYNs were dropped). Signature of a ``recovery-after-heal`` offence: every call
  of the starving client went through one node X; X was cut off by the last network fault
  before the heal; and 2 s after the heal X still knew no leader while another node was a
  serving leader (as the monitor last saw them).
"""

from __future__ import annotations

from typing import Any, Sequence

from .checkers import CheckResult, final_states
from .history import Event


def _first_term_starts(history: Sequence[Event]) -> tuple[dict[int, str], dict[str, int]]:
    """(term -> node of the first committed TermStart, node -> first term it started)."""
    first: dict[int, tuple[int, str]] = {}
    led: dict[str, int] = {}
    for st in final_states(history).values():
        for term, node, idx in st.get("term_starts", []):
            if term not in first or idx < first[term][0]:
                first[term] = (idx, node)
            led[node] = min(led.get(node, term), term)
    return {t: n for t, (_i, n) in first.items()}, led


def bug2(offence: dict[str, Any], history: Sequence[Event]) -> bool:
    """A one-leader-per-term offence explained by BUG-2."""
    term = offence.get("term")
    leaders = offence.get("leaders") or []
    first, led = _first_term_starts(history)
    real = first.get(term)
    if term is None or real is None or real not in leaders or len(leaders) < 2:
        return False
    return all(x == real or led.get(x, term) < term for x in leaders)


def bug1(offence: dict[str, Any], history: Sequence[Event]) -> bool:
    """A recovery-after-heal offence explained by BUG-1."""
    recover = offence.get("recover") or {}
    t_heal = recover.get("time_ns")
    nodes = {op.get("node") for op in offence.get("ops") or []}
    if t_heal is None or len(nodes) != 1:
        return False
    (x,) = nodes
    cut = None
    for e in history:
        if e["time_ns"] >= t_heal:
            break
        if e["process"] == "nemesis" and e["type"] == "ok" and isinstance(e.get("value"), dict) \
                and e["f"] not in ("recover", "heal") and "cuts" in e["value"]:
            cut = e["value"]["cuts"]
    if not cut or not any(x in pair for pair in cut):
        return False
    # The monitor records changes only: a node's state at time t is its last event at or before t.
    t_check = t_heal + int(min(2.0, float(offence.get("bound_s", 10.0))) * 1e9)
    state: dict[str, dict[str, Any]] = {}
    for e in history:
        if e["time_ns"] > t_check:
            break
        if e["process"] == "monitor" and e["f"] == "status":
            state[e.get("node") or "?"] = e.get("value") or {}
    x_state = state.get(x, {})
    x_lost = bool(x_state.get("reachable")) and not x_state.get("leader")
    other_serving = any(v.get("role") == "leader" and v.get("serving") for n, v in state.items() if n != x)
    return x_lost and other_serving


SIGNATURES = {"one-leader-per-term": ("BUG-2", bug2), "recovery-after-heal": ("BUG-1", bug1)}


def explain(result: CheckResult, history: Sequence[Event]) -> str | None:
    """The known bug that explains *every* offence of a failed check, if any."""
    if result.valid or result.name not in SIGNATURES or result.count != len(result.offending):
        return None
    name, matches = SIGNATURES[result.name]
    return name if result.offending and all(matches(o, history) for o in result.offending) else None


def unexplained(checks: Sequence[CheckResult], history: Sequence[Event]) -> list[CheckResult]:
    """The failed checks that no known bug explains."""
    return [c for c in checks if not c.valid and explain(c, history) is None]
