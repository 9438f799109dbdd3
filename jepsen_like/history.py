"""The history of a run: one event per line of ``history.jsonl``, and the pairing of operations.

An event is a plain dict with the fields

* ``index``: position in the history (0, 1, 2, ...);
* ``time_ns``: monotonic nanoseconds since the run started (one clock for every process);
* ``process``: who did it: a client (``c0``, ``c1``, ...), ``nemesis``, ``monitor`` (status
  polls: one event per observed change of a node's role/term/leader) or ``journal`` (each
  node's committed Raft log, summarised after the run);
* ``type``: ``invoke``, ``ok``, ``fail`` (definitely did not happen) or ``info`` (outcome
  unknown, or an observation);
* ``f``: ``quorum``, ``heartbeat``, ``kv-read``/``kv-cas``/``kv-final`` (key-value clients,
  ``kv_clients.py``), a nemesis action (``isolate``, ``kill``, ``heal``, ...),
  ``status`` (monitor) or ``final-state`` (journal);
* ``value``: for a quorum ``ok`` at least ``quorum_id`` and ``participants`` (replica ids);
* ``node``: the lighthouse node the operation went through (``n1`` ...), if any;
* ``error``: the error of a ``fail``/``info``, else ``None``;
* ``job``: the job (``lighthouse_cluster/core/jobs.py``) a client's operation belongs to
  (``default``, or a job the run created), else ``None``. Histories from before jobs have no
  ``job``: their client operations are the default job's (``job_of``).

A client's quorum loop and heartbeat loop each have at most one operation outstanding, so an
invocation is completed by the next ``ok``/``fail``/``info`` with the same ``process`` and
``f`` (``pair_operations``). ``HistoryWriter`` is the only I/O here: it appends events from any
thread and flushes every line, so a run that dies still leaves its history behind.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from lighthouse_cluster.core.jobs import DEFAULT_JOB

Event = dict[str, Any]

INVOKE, OK, FAIL, INFO = "invoke", "ok", "fail", "info"
COMPLETIONS = (OK, FAIL, INFO)
NEMESIS, MONITOR, JOURNAL = "nemesis", "monitor", "journal"
# The key-value clients' operations (``kv_clients.py``): a read, a compare-and-set, the final read.
KV_READ, KV_CAS, KV_FINAL = "kv-read", "kv-cas", "kv-final"
KV_FS = (KV_READ, KV_CAS, KV_FINAL)
EVENT_FIELDS = ("index", "time_ns", "process", "type", "f", "value", "node", "error", "job")


def make_event(index: int, time_ns: int, process: str, type: str, f: str, value: Any = None,
               node: str | None = None, error: str | None = None, job: str | None = None) -> Event:
    """An event dict with exactly the history's fields (for writers and hand-made tests)."""
    if type not in (INVOKE, *COMPLETIONS):
        raise ValueError(f"event type must be invoke/ok/fail/info, not {type!r}")
    return {"index": index, "time_ns": time_ns, "process": process, "type": type, "f": f,
            "value": value, "node": node, "error": error, "job": job}


def job_of(event: Event) -> str:
    """The job of a client's event (the default job where the history names none)."""
    return event.get("job") or DEFAULT_JOB


class HistoryWriter:
    """Thread-safe append-only history; ``path=None`` keeps it in memory only."""

    def __init__(self, path: Path | None = None, t0_ns: int | None = None) -> None:
        self.path = path
        self.t0_ns = time.monotonic_ns() if t0_ns is None else t0_ns
        self._events: list[Event] = []
        self._lock = threading.Lock()
        self._file = open(path, "w", encoding="utf-8") if path is not None else None

    def now_ns(self) -> int:
        return time.monotonic_ns() - self.t0_ns

    def to_ns(self, monotonic_s: float) -> int:
        """A ``time.monotonic()`` reading as this history's ``time_ns``."""
        return int(monotonic_s * 1e9) - self.t0_ns

    def append(self, process: str, type: str, f: str, value: Any = None, node: str | None = None,
               error: str | None = None, time_ns: int | None = None, job: str | None = None) -> Event:
        with self._lock:
            event = make_event(len(self._events), self.now_ns() if time_ns is None else time_ns, process, type, f,
                               value, node, error, job)
            self._events.append(event)
            if self._file is not None:
                self._file.write(json.dumps(event, separators=(",", ":")) + "\n")
                self._file.flush()
            return event

    def snapshot(self) -> list[Event]:
        with self._lock:
            return list(self._events)

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_history(path: Path) -> list[Event]:
    """Load a ``history.jsonl``; a torn last line (a run killed mid-write) is ignored."""
    events: list[Event] = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            if n == len(lines) - 1:
                break
            raise ValueError(f"{path}:{n + 1}: not a JSON event") from None
    return events


def write_history(path: Path, events: Iterable[Event]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for e in events:
            f.write(json.dumps(e, separators=(",", ":")) + "\n")


@dataclass(frozen=True, slots=True)
class Operation:
    """An invocation and its completion (``None`` while still open at the end of the history)."""

    invoke: Event
    complete: Event | None

    @property
    def process(self) -> str:
        return self.invoke["process"]

    @property
    def f(self) -> str:
        return self.invoke["f"]

    @property
    def type(self) -> str:
        """``ok``/``fail``/``info``; an operation never completed counts as ``info``."""
        return self.complete["type"] if self.complete is not None else INFO

    @property
    def start_ns(self) -> int:
        return self.invoke["time_ns"]

    @property
    def end_ns(self) -> int | None:
        return self.complete["time_ns"] if self.complete is not None else None

    @property
    def value(self) -> Any:
        return self.complete["value"] if self.complete is not None else None

    @property
    def node(self) -> str | None:
        return self.invoke.get("node") or (self.complete or {}).get("node")

    @property
    def job(self) -> str:
        return job_of(self.invoke)


def pair_operations(history: Sequence[Event], f: str | Iterable[str] | None = None) -> list[Operation]:
    """Pair every invocation with its completion, in invocation order. ``f`` filters by function."""
    wanted = {f} if isinstance(f, str) else (set(f) if f is not None else None)
    open_ops: dict[tuple[str, str], Event] = {}
    ops: dict[int, Operation] = {}
    for e in history:
        if wanted is not None and e["f"] not in wanted:
            continue
        key = (e["process"], e["f"])
        if e["type"] == INVOKE:
            prev = open_ops.pop(key, None)
            if prev is not None:
                ops[prev["index"]] = Operation(prev, None)
            open_ops[key] = e
        elif e["type"] in COMPLETIONS:
            inv = open_ops.pop(key, None)
            if inv is not None:
                ops[inv["index"]] = Operation(inv, e)
    for inv in open_ops.values():
        ops[inv["index"]] = Operation(inv, None)
    return [ops[i] for i in sorted(ops)]


def events_of(history: Sequence[Event], process: str | None = None, f: str | None = None,
              type: str | None = None) -> Iterator[Event]:
    for e in history:
        if (process is None or e["process"] == process) and (f is None or e["f"] == f) and \
                (type is None or e["type"] == type):
            yield e


def is_client(process: str) -> bool:
    return process not in (NEMESIS, MONITOR, JOURNAL)
