"""Figures of a run, computed from its history (pure): operation counts and unavailability.

* ``operation_counts``: ``{f: {ok, fail, info, open}}`` for client operations (in all, and per
  job under ``jobs``), and how many of each nemesis action succeeded.
* ``fault_windows``: for each fault, from its injection to the next fault (or the end):
  ``unavailable_s``, the longest stretch in the window in which no client got any quorum
  (cluster-wide unavailability, starting at the injection), and ``recovery_s``, from the
  ``recover`` that ended it until every client that kept asking had a quorum again.
* ``unavailability_by_kind``: per fault kind, count, median and max of both.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from typing import Any, Sequence

from .history import NEMESIS, OK, Event, is_client, pair_operations
from .schedule import RESTORING


def operation_counts(history: Sequence[Event]) -> dict[str, Any]:
    ops = pair_operations(history)
    clients: dict[str, Counter[str]] = defaultdict(Counter)
    jobs: dict[str, dict[str, Counter[str]]] = defaultdict(lambda: defaultdict(Counter))
    nemesis: Counter[str] = Counter()
    for op in ops:
        if is_client(op.process):
            kind = op.type if op.complete is not None else "open"
            clients[op.f][kind] += 1
            jobs[op.job][op.f][kind] += 1
        elif op.process == NEMESIS and op.f not in ("wait",):
            nemesis[op.f if op.type == OK else f"{op.f} (failed)"] += 1
    return {"client": {f: dict(c) for f, c in sorted(clients.items())}, "nemesis": dict(sorted(nemesis.items())),
            "jobs": {job: {f: dict(c) for f, c in sorted(fs.items())} for job, fs in sorted(jobs.items())}}


def fault_windows(history: Sequence[Event]) -> list[dict[str, Any]]:
    nemesis_ops = [op for op in pair_operations(history) if op.process == NEMESIS]
    faults = [op for op in nemesis_ops if op.f not in RESTORING and op.f != "wait" and op.type == OK]
    recovers = [op for op in nemesis_ops if op.f == "recover" and op.type == OK]
    quorum_ops = [op for op in pair_operations(history, "quorum") if is_client(op.process)]
    oks = sorted(op.end_ns for op in quorum_ops if op.type == OK)
    end_ns = max((e["time_ns"] for e in history if is_client(e["process"])), default=0)
    out = []
    for k, fop in enumerate(faults):
        t0 = fop.start_ns
        t1 = faults[k + 1].start_ns if k + 1 < len(faults) else end_ns
        times = [t for t in oks if t0 <= t <= t1]
        gaps, prev = [], t0
        for t in times:
            gaps.append(t - prev)
            prev = t
        gaps.append(t1 - prev)
        unavailable = max(gaps) / 1e9 if gaps else (t1 - t0) / 1e9
        rec = next((r for r in recovers if t0 <= r.start_ns <= t1), None)
        recovery = None
        if rec is not None:
            r0 = rec.end_ns
            per_client = []
            for proc in sorted({op.process for op in quorum_ops if r0 <= op.start_ns <= t1}):
                first = min((op.end_ns for op in quorum_ops if op.process == proc and op.type == OK
                             and r0 <= op.end_ns <= t1), default=None)
                per_client.append((first - r0) / 1e9 if first is not None else (t1 - r0) / 1e9)
            recovery = max(per_client) if per_client else None
        out.append({"f": fop.f, "start_s": t0 / 1e9, "end_s": t1 / 1e9, "value": fop.value,
                    "unavailable_s": round(unavailable, 3), "recovery_s": None if recovery is None else round(recovery, 3),
                    "quorums_during": len(times)})
    return out


def unavailability_by_kind(windows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for w in windows:
        by[w["f"]].append(w)
    out = {}
    for f, ws in sorted(by.items()):
        un = [w["unavailable_s"] for w in ws]
        rec = [w["recovery_s"] for w in ws if w["recovery_s"] is not None]
        out[f] = {"count": len(ws), "unavailable_median_s": round(statistics.median(un), 3),
                  "unavailable_max_s": round(max(un), 3),
                  "recovery_median_s": round(statistics.median(rec), 3) if rec else None,
                  "recovery_max_s": round(max(rec), 3) if rec else None}
    return out
