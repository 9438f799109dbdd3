"""The dashboard's rendezvous panel as JSON (``GET /rendezvous.json``): every run's namespace in
this node's replicated store with what its torchrun state's summary line says (round, complete
or waiting, participants; ``core/rendezvous_state.py``; the state itself is never unpickled),
and the store's counters the page turns into rates.

Pure: reads a ``KVStore`` (copies of its dicts, as the KV service does: Raft's thread may write
meanwhile) and the numbers it is given; no clock, no I/O.
"""

from __future__ import annotations

from typing import Any

from lighthouse_cluster.core.kv_store import KVStore
from lighthouse_cluster.core.rendezvous_state import STATE_KEY, is_state, read_summary

# Runs listed at most (the most recently written first); the store holds up to 1024.
MAX_RUNS = 100


def run_state(value: bytes | None) -> dict[str, Any]:
    """A run's torchrun state as the panel shows it: ``state`` is "complete", "waiting" or
    "closed" with ``round``, ``participants`` and ``waiting`` from its summary; "unknown" for a
    state without a readable summary (an older agent's, or garbage); "none" without a state."""
    if value is None or not is_state(value):
        return {"state": "none", "round": None, "participants": None, "waiting": None}
    summary = read_summary(value)
    if summary is None:
        return {"state": "unknown", "round": None, "participants": None, "waiting": None}
    return {"state": summary.phase, "round": summary.round, "participants": summary.participants,
            "waiting": summary.waiting}


def rendezvous_view(kv: KVStore, now_ms: int, kv_calls: int, limit: int = MAX_RUNS) -> dict[str, Any]:
    """The panel's data: ``runs`` (at most ``limit``, the most recently written first), how many
    namespaces there are and how many hold a torchrun state, the store's revision (bumped by every
    applied write, the same on every node), the rounds this node counted, ``kv_calls`` (the store
    calls this node answered) and ``generated_ms`` (``now_ms``)."""
    namespaces = list(kv.namespaces.items())
    runs = []
    with_state = 0
    for (job, run_id), n in namespaces:
        entry = n.entries.get(STATE_KEY)
        state = run_state(None if entry is None else entry.value)
        with_state += state["state"] != "none"
        runs.append({"job": job, "run_id": run_id, "keys": len(n.entries), "bytes": n.size,
                     "touched_ms": n.touched_ms, "write_age_ms": max(0, now_ms - n.touched_ms), **state})
    runs.sort(key=lambda r: (-r["touched_ms"], r["job"], r["run_id"]))
    return {"runs": runs[:limit], "namespaces": len(namespaces), "rendezvous_runs": with_state,
            "revision": kv.revision, "rounds_completed": kv.rendezvous_rounds, "kv_calls": kv_calls,
            "generated_ms": now_ms}
