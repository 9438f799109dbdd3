"""Checkers: pure functions from a history (a list of event dicts) to PASS/FAIL.

Each checker returns a ``CheckResult`` naming the offending events (at most ``MAX_OFFENDING``
of them, plus a count). They read only the history: client operations, the nemesis's actions,
the monitor's status observations and the ``journal`` process's ``final-state`` events (each
node's committed log, replayed after the run; see ``jepsen_like.journal.summarize``).

* ``no_split_brain``: no quorum id has two member sets, in what clients were told or in any
  node's committed log.
* ``monotonic_quorum_ids``: a client never sees a quorum id go down, and an operation invoked
  after another completed never returns a lower id (real-time order).
* ``acknowledged_committed``: every quorum a client received is in the committed log of every
  node at the end of the run.
* ``one_leader_per_term``: no two nodes lead the same term, neither in the committed log
  (``TermStart`` and ``CommitQuorum`` carry the writer's term and id) nor as observed.
* ``recovery_after_heal``: after each ``recover`` (the cluster healthy again) held for at least
  ``bound_s``, every client that keeps asking gets a quorum within ``bound_s``.
* ``durable_after_restart_all``: after every node is killed and restarted, quorum ids are at
  least the highest acknowledged before.
* ``logs_agree``: nodes' committed logs are identical where they overlap (digests).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .history import JOURNAL, MONITOR, NEMESIS, OK, Event, is_client, pair_operations
from .schedule import RESTORING

MAX_OFFENDING = 20
DEFAULT_RECOVERY_BOUND_S = 10.0


@dataclass
class CheckResult:
    name: str
    valid: bool
    summary: str
    offending: list[Any] = field(default_factory=list)
    count: int = 0          # how many offences in all (offending is truncated)

    @property
    def status(self) -> str:
        return "PASS" if self.valid else "FAIL"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "valid": self.valid, "summary": self.summary,
                "count": self.count, "offending": self.offending}


def _result(name: str, offending: list[Any], ok_summary: str, fail_summary: str) -> CheckResult:
    if offending:
        return CheckResult(name, False, fail_summary.format(n=len(offending)), offending[:MAX_OFFENDING],
                           len(offending))
    return CheckResult(name, True, ok_summary)


def _members(value: Any) -> tuple[str, ...]:
    return tuple(sorted(value.get("participants") or ()))


def _quorum_oks(history: Sequence[Event]) -> list[Event]:
    return [e for e in history if e["f"] == "quorum" and e["type"] == OK and is_client(e["process"])
            and isinstance(e.get("value"), dict) and e["value"].get("quorum_id") is not None]


def final_states(history: Sequence[Event]) -> dict[str, dict[str, Any]]:
    """node -> the last ``final-state`` value recorded for it."""
    out: dict[str, dict[str, Any]] = {}
    for e in history:
        if e["process"] == JOURNAL and e["f"] == "final-state" and isinstance(e.get("value"), dict):
            out[e.get("node") or "?"] = e["value"]
    return out


# -- safety --------------------------------------------------------------------------------------


def no_split_brain(history: Sequence[Event]) -> CheckResult:
    seen: dict[int, dict[tuple[str, ...], Any]] = defaultdict(dict)
    for e in _quorum_oks(history):
        seen[e["value"]["quorum_id"]].setdefault(_members(e["value"]), e)
    for node, st in final_states(history).items():
        for qid, members, first_index, term in st.get("quorums", []):
            seen[qid].setdefault(tuple(sorted(members)),
                                 {"process": JOURNAL, "node": node, "quorum_id": qid, "participants": members,
                                  "log_index": first_index, "term": term})
    offending = [{"quorum_id": qid, "member_sets": [list(m) for m in sets], "witnesses": list(sets.values())}
                 for qid, sets in sorted(seen.items()) if len(sets) > 1]
    return _result("no-split-brain", offending,
                   f"{len(seen)} quorum ids, each with one member set",
                   "{n} quorum ids were given two or more member sets")


def monotonic_quorum_ids(history: Sequence[Event]) -> CheckResult:
    offending: list[Any] = []
    last: dict[str, Event] = {}
    for e in _quorum_oks(history):
        prev = last.get(e["process"])
        if prev is not None and e["value"]["quorum_id"] < prev["value"]["quorum_id"]:
            offending.append({"kind": "client", "process": e["process"], "earlier": prev, "later": e})
        last[e["process"]] = e
    # Real time: an operation invoked after another one completed must not see a lower id.
    ops = [op for op in pair_operations(history, "quorum") if op.type == OK and is_client(op.process)
           and isinstance(op.value, dict) and op.value.get("quorum_id") is not None]
    by_end = sorted(ops, key=lambda op: op.end_ns)
    best: Any = None
    j = 0
    for op in sorted(ops, key=lambda op: op.start_ns):
        while j < len(by_end) and by_end[j].end_ns < op.start_ns:
            if best is None or by_end[j].value["quorum_id"] > best.value["quorum_id"]:
                best = by_end[j]
            j += 1
        if best is not None and op.value["quorum_id"] < best.value["quorum_id"]:
            offending.append({"kind": "real-time", "completed_before": best.complete, "invoked": op.invoke,
                              "returned": op.complete})
    return _result("monotonic-quorum-ids", offending,
                   f"{len(ops)} quorum acknowledgements in per-client and real-time order",
                   "{n} quorum ids went backwards")


def acknowledged_committed(history: Sequence[Event]) -> CheckResult:
    states = final_states(history)
    oks = _quorum_oks(history)
    if not states:
        return CheckResult("acknowledged-committed", False,
                           "no final committed state recorded (the run did not finish): cannot check")
    offending: list[Any] = []
    unverifiable = 0
    acked: dict[tuple[int, tuple[str, ...]], Event] = {}
    for e in oks:
        acked.setdefault((e["value"]["quorum_id"], _members(e["value"])), e)
    for node, st in sorted(states.items()):
        committed = {(q, tuple(sorted(m))) for q, m, _i, _t in st.get("quorums", [])}
        unknown = st.get("unverifiable_quorum_ids", [])
        for (qid, members), e in acked.items():
            if (qid, members) in committed:
                continue
            if any(lo < qid < hi for lo, hi in unknown):
                unverifiable += 1
                continue
            offending.append({"node": node, "quorum_id": qid, "participants": list(members), "acknowledged": e,
                              "node_commit_index": st.get("commit_index")})
    extra = (f" ({unverifiable} fell in a stretch of a node's log known only from a snapshot, older than its "
             f"history window: not verifiable there)" if unverifiable else "")
    return _result("acknowledged-committed", offending,
                   f"{len(acked)} distinct acknowledged quorums committed on all {len(states)} nodes{extra}",
                   "{n} acknowledged quorums missing from a node's committed log" + extra)


def one_leader_per_term(history: Sequence[Event]) -> CheckResult:
    leaders: dict[int, dict[str, Any]] = defaultdict(dict)
    for node, st in final_states(history).items():
        for term, writers in st.get("leaders", {}).items():
            for w in writers:
                leaders[int(term)].setdefault(w, {"source": "committed log", "node": node, "term": int(term)})
    observed = 0
    for e in history:
        if e["process"] == MONITOR and e["f"] == "status" and isinstance(e.get("value"), dict) \
                and e["value"].get("role") == "leader":
            observed += 1
            leaders[int(e["value"]["term"])].setdefault(e["node"], e)
    offending = [{"term": t, "leaders": sorted(ws), "witnesses": list(ws.values())}
                 for t, ws in sorted(leaders.items()) if len(ws) > 1]
    if not leaders:
        return CheckResult("one-leader-per-term", False, "no leader observed or committed: cannot check")
    return _result("one-leader-per-term", offending,
                   f"{len(leaders)} terms with a leader, one each ({observed} leader observations)",
                   "{n} terms had two or more leaders")


def logs_agree(history: Sequence[Event]) -> CheckResult:
    states = final_states(history)
    offending: list[Any] = []
    by_index: dict[str, dict[str, str]] = defaultdict(dict)
    for node, st in states.items():
        for idx in st.get("conflicts", []):
            offending.append({"node": node, "index": idx, "problem": "committed entry changed between reads"})
        for idx, digest in st.get("digests", {}).items():
            by_index[idx][node] = digest
    compared = 0
    for idx, per_node in sorted(by_index.items(), key=lambda kv: int(kv[0])):
        if len(per_node) > 1:
            compared += 1
            if len(set(per_node.values())) > 1:
                offending.append({"index": int(idx), "digests": per_node, "problem": "committed logs differ"})
    if not states:
        return CheckResult("logs-agree", False, "no final committed state recorded: cannot check")
    return _result("logs-agree", offending, f"committed logs identical at {compared} compared indexes",
                   "{n} places where committed logs differ")


def durable_after_restart_all(history: Sequence[Event]) -> CheckResult:
    ops = sorted((op for op in pair_operations(history, "quorum") if op.type == OK and is_client(op.process)
                  and isinstance(op.value, dict)), key=lambda op: op.end_ns)
    restarts = [op for op in pair_operations(history, "restart-all") if op.process == NEMESIS and op.type == OK]
    offending: list[Any] = []
    for r in restarts:
        before = [op for op in ops if op.end_ns <= r.start_ns]
        if not before:
            continue
        high = max(before, key=lambda op: op.value["quorum_id"])
        for op in ops:
            if op.start_ns >= r.end_ns and op.value["quorum_id"] < high.value["quorum_id"]:
                offending.append({"restart": r.complete, "highest_before": high.complete, "after": op.complete})
    return _result("durable-after-restart-all", offending,
                   f"{len(restarts)} full-cluster restarts; ids afterwards never below those acknowledged before",
                   "{n} quorums after a full restart had a lower id than one acknowledged before it")


# -- liveness ---------------------------------------------------------------------------------------


def recovery_after_heal(history: Sequence[Event], bound_s: float = DEFAULT_RECOVERY_BOUND_S) -> CheckResult:
    """A client that asks after a heal must get a quorum within ``bound_s``. A heal followed by
    another fault, or by the end of the run, sooner than that is judged only for the clients that
    did get one: the others are inconclusive, not failures."""
    bound = int(bound_s * 1e9)
    nemesis_ops = [op for op in pair_operations(history) if op.process == NEMESIS]
    faults = sorted(op.start_ns for op in nemesis_ops if op.f not in RESTORING and op.f != "wait")
    heals = [op for op in nemesis_ops if op.f == "recover" and op.type == OK]
    client_end = max((e["time_ns"] for e in history if is_client(e["process"])), default=0)
    quorum_ops = [op for op in pair_operations(history, "quorum") if is_client(op.process)]
    offending: list[Any] = []
    checked = inconclusive = 0
    for h in heals:
        t0 = h.end_ns
        full = t0 + bound
        nxt = next((t for t in faults if t > t0), None)
        window_end = min(full, nxt if nxt is not None else full, client_end)
        for proc in sorted({op.process for op in quorum_ops if t0 <= op.start_ns <= window_end}):
            got = any(op.process == proc and op.type == OK and t0 <= op.end_ns <= window_end for op in quorum_ops)
            if got:
                checked += 1
            elif window_end < full:
                inconclusive += 1
            else:
                offending.append({"process": proc, "recover": h.complete, "bound_s": bound_s,
                                  "ops": [op.complete or op.invoke for op in quorum_ops
                                          if op.process == proc and t0 <= op.start_ns <= window_end][:5]})
    note = f" ({inconclusive} cut short by the next fault or the end)" if inconclusive else ""
    if not heals:
        return CheckResult("recovery-after-heal", False, "no recover action in the history: cannot check")
    return _result("recovery-after-heal", offending,
                   f"{checked} client recoveries after {len(heals)} heals, each within {bound_s:g}s{note}",
                   f"{{n}} times a client got no quorum within {bound_s:g}s of a heal{note}")


CHEAP: dict[str, Callable[[Sequence[Event]], CheckResult]] = {
    "no-split-brain": no_split_brain,
    "monotonic-quorum-ids": monotonic_quorum_ids,
}


def check_all(history: Sequence[Event], recovery_bound_s: float = DEFAULT_RECOVERY_BOUND_S) -> list[CheckResult]:
    """Every checker, in report order."""
    return [
        no_split_brain(history),
        monotonic_quorum_ids(history),
        acknowledged_committed(history),
        one_leader_per_term(history),
        recovery_after_heal(history, recovery_bound_s),
        durable_after_restart_all(history),
        logs_agree(history),
    ]


def check_cheap(history: Sequence[Event]) -> list[CheckResult]:
    """The invariants cheap enough to check after every step of a property test."""
    return [fn(history) for fn in CHEAP.values()]

