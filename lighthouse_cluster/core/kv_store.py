"""The replicated key-value store: versioned keys in one namespace per (job, run id).

What torchrun's rendezvous needs from the cluster (issue #34): a small store per training run,
replicated through Raft like everything else, with compare-and-set. Pure: every write arrives
with the leader's time (``time_ms``) and the client's request id; nothing here reads a clock.

* **Namespaces.** A namespace is ``(job, run_id)``: two runs, or two jobs, never see each other's
  keys. One is created by its first write that stores something, and dropped by ``drop`` (an
  operator, ``lighthouse-cluster rendezvous remove``) or by ``expire`` once no write touched it
  for the idle time the leader passes in (reads do not touch).
* **Versions.** Every change takes the next value of one store-wide counter (``revision``), so a
  key's version only grows, and never repeats, not even after its namespace was dropped and
  created again: a compare-and-set token (a version) from an older incarnation never matches.
  Version 0 means "absent".
* **Writes.** ``KVSet``, ``KVCompareAndSet`` (on the expected version, 0 meaning absent, or on
  the expected value, ``b""`` meaning absent, as torch's ``Store.compare_set``), ``KVAdd``
  (an integer counter stored as decimal ASCII, as torch's ``Store.add``) and ``KVDelete``
  (optionally compare-and-delete on the version).
* **Retries apply once.** A write carries the client's request id (chosen once per operation and
  kept across its retries). Each namespace remembers the outcome of its last ``dedup_window``
  request ids; a write whose id is known is not applied again and answers the first attempt's
  outcome (``duplicate``). So a compare-and-set whose answer was lost in a leader change and that
  the client sends again is never applied twice. The window is part of the schema: every node
  forgets alike.
* **Limits** (``KVLimits``, part of the schema like ``jobs.MAX_JOBS``: every node refuses alike):
  key and value size, keys and bytes per namespace, namespaces in all. A refused write is a
  deterministic no-op whose result carries the error (``KVError.kind``: ``invalid`` or
  ``exhausted`` or ``precondition``); the servers check the same rules before they submit.

This module owns the rules and their wire form (``op_to_wire``, ``to_wire``); ``codec`` wraps
them in commands and ``state_machine`` applies them.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Union

from lighthouse_cluster.core.jobs import JobError, check_job_name
from lighthouse_cluster.core.rendezvous_state import STATE_KEY, completes_a_round

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_DECIMAL = re.compile(rb"^-?[0-9]+$")
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@=+-]*$")

# Error kinds (the gRPC status a server answers with: INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
# FAILED_PRECONDITION).
INVALID = "invalid"
EXHAUSTED = "exhausted"
PRECONDITION = "precondition"


@dataclass(frozen=True, slots=True)
class KVLimits:
    """The store's limits. Part of the replicated schema: every node must use the same (lower
    them only in tests, on every node alike)."""

    max_key_bytes: int = 512
    max_value_bytes: int = 256 * 1024
    max_run_id_bytes: int = 128
    max_request_id_bytes: int = 64
    max_keys: int = 10_000                       # per namespace
    max_namespace_bytes: int = 16 * 1024 * 1024  # keys and values of one namespace
    max_namespaces: int = 1024
    dedup_window: int = 1024                     # request ids remembered per namespace
    max_list: int = 10_000                       # entries one List answers at most


DEFAULT_LIMITS = KVLimits()
# A namespace no write touched for this long is dropped by the leader (``expire``).
DEFAULT_IDLE_EXPIRY_S = 24 * 3600.0


class KVError(ValueError):
    """A request the store refuses; ``kind`` is ``INVALID``, ``EXHAUSTED`` or ``PRECONDITION``."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


NamespaceId = tuple[str, str]  # (job, run id)


# -- operations ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KVSet:
    key: str
    value: bytes


@dataclass(frozen=True, slots=True)
class KVCompareAndSet:
    """Set ``key`` to ``value`` if it is at ``expected_version`` (0: absent), or holds
    ``expected_value`` (``b""``: absent or empty, as torch's ``compare_set``); exactly one of
    the two is given."""

    key: str
    value: bytes
    expected_version: int | None = None
    expected_value: bytes | None = None


@dataclass(frozen=True, slots=True)
class KVAdd:
    """Add ``delta`` to the integer at ``key`` (absent: 0), stored as decimal ASCII."""

    key: str
    delta: int


@dataclass(frozen=True, slots=True)
class KVDelete:
    """Delete ``key``; with ``expected_version``, only if it is at that version."""

    key: str
    expected_version: int | None = None


KVOp = Union[KVSet, KVCompareAndSet, KVAdd, KVDelete]


@dataclass(frozen=True, slots=True)
class Entry:
    value: bytes
    version: int


@dataclass(frozen=True, slots=True)
class KVResult:
    """A write's outcome, the same on every node.

    ``applied``: the write changed the store (a set, a matching compare-and-set, an add, a delete
    of a present key). ``version`` / ``value``: the key afterwards (0 / None: absent); on a failed
    compare-and-set, what is there instead. ``counter``: an add's new value. ``duplicate``: the
    request id was seen before; the first attempt's outcome is answered (``value`` then is the
    key's value now if the key is still at that version, else None). ``error``/``error_kind``: the
    write was refused (``KVError``); nothing changed."""

    applied: bool = False
    version: int = 0
    value: bytes | None = None
    counter: int = 0
    duplicate: bool = False
    error: str = ""
    error_kind: str = ""


@dataclass(slots=True)
class Namespace:
    entries: dict[str, Entry] = field(default_factory=dict)
    created_ms: int = 0
    touched_ms: int = 0
    size: int = 0  # bytes of keys and values
    requests: OrderedDict[str, tuple[bool, int, int]] = field(default_factory=OrderedDict)


# -- validation (the servers check the same before submitting) ----------------------------------


def check_namespace(job: str, run_id: str, limits: KVLimits = DEFAULT_LIMITS) -> None:
    try:
        check_job_name(job)
    except JobError as e:
        raise KVError(INVALID, str(e)) from None
    if not run_id:
        raise KVError(INVALID, "the run id is empty")
    if len(run_id.encode()) > limits.max_run_id_bytes or not _RUN_ID.match(run_id):
        raise KVError(INVALID, f"run id {run_id[:80]!r}: at most {limits.max_run_id_bytes} characters from "
                               "A-Z a-z 0-9 _ . : @ = + -, starting with a letter or digit")


def check_key(key: str, limits: KVLimits = DEFAULT_LIMITS) -> None:
    if not isinstance(key, str) or not key:
        raise KVError(INVALID, "the key is empty")
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        raise KVError(INVALID, f"key {key[:40]!r} is not valid Unicode text") from None
    if size > limits.max_key_bytes:
        raise KVError(INVALID, f"key {key[:40]!r}... is {size} bytes; the limit is {limits.max_key_bytes}")


def check_value(key: str, value: bytes, limits: KVLimits = DEFAULT_LIMITS) -> None:
    if len(value) > limits.max_value_bytes:
        raise KVError(INVALID, f"the value of {key[:80]!r} is {len(value)} bytes; the limit is "
                               f"{limits.max_value_bytes}")


def check_request_id(request_id: str, limits: KVLimits = DEFAULT_LIMITS) -> None:
    if len(request_id.encode()) > limits.max_request_id_bytes:
        raise KVError(INVALID, f"the request id is longer than {limits.max_request_id_bytes} bytes")


def check_op(op: KVOp, limits: KVLimits = DEFAULT_LIMITS) -> None:
    """``KVError`` for an operation no state could accept (its shape, not the namespace's room)."""
    check_key(op.key, limits)
    if isinstance(op, (KVSet, KVCompareAndSet)):
        check_value(op.key, op.value, limits)
    if isinstance(op, KVCompareAndSet):
        if (op.expected_version is None) == (op.expected_value is None):
            raise KVError(INVALID, "compare-and-set needs exactly one of an expected version and an expected value")
        if op.expected_version is not None and op.expected_version < 0:
            raise KVError(INVALID, f"expected version {op.expected_version} is negative")
        if op.expected_value is not None:
            check_value(op.key, op.expected_value, limits)
    if isinstance(op, KVAdd) and not INT64_MIN <= op.delta <= INT64_MAX:
        raise KVError(INVALID, f"add {op.delta}: not a 64-bit integer")
    if isinstance(op, KVDelete) and op.expected_version is not None and op.expected_version < 0:
        raise KVError(INVALID, f"expected version {op.expected_version} is negative")


def counter_value(key: str, value: bytes | None) -> int:
    """The integer an ``add`` starts from: 0 when absent; ``KVError`` when it is not decimal."""
    if value is None:
        return 0
    if not _DECIMAL.match(value):
        raise KVError(PRECONDITION, f"key {key[:80]!r} does not hold an integer (add needs decimal ASCII, "
                                    f"it holds {value[:20]!r})")
    return int(value)


# -- wire form ----------------------------------------------------------------------------------


def op_to_wire(op: KVOp) -> dict[str, Any]:
    if isinstance(op, KVSet):
        return {"o": "set", "key": op.key, "val": op.value}
    if isinstance(op, KVCompareAndSet):
        body: dict[str, Any] = {"o": "cas", "key": op.key, "val": op.value}
        if op.expected_version is not None:
            body["ev"] = op.expected_version
        if op.expected_value is not None:
            body["eval"] = op.expected_value
        return body
    if isinstance(op, KVAdd):
        return {"o": "add", "key": op.key, "d": op.delta}
    if isinstance(op, KVDelete):
        body = {"o": "del", "key": op.key}
        if op.expected_version is not None:
            body["ev"] = op.expected_version
        return body
    raise TypeError(f"not a KV operation: {op!r}")


def op_from_wire(d: dict[str, Any]) -> KVOp:
    """``KeyError``/``TypeError``/``ValueError`` on a malformed operation (``codec`` turns them
    into ``SchemaError``)."""
    kind = d["o"]
    key = str(d["key"])
    if kind == "set":
        return KVSet(key, bytes(d["val"]))
    if kind == "cas":
        ev, eval_ = d.get("ev"), d.get("eval")
        return KVCompareAndSet(key, bytes(d["val"]), None if ev is None else int(ev),
                               None if eval_ is None else bytes(eval_))
    if kind == "add":
        return KVAdd(key, int(d["d"]))
    if kind == "del":
        ev = d.get("ev")
        return KVDelete(key, None if ev is None else int(ev))
    raise ValueError(f"unknown KV operation {kind!r}")


# -- the store ----------------------------------------------------------------------------------


def _size(key: str, value: bytes) -> int:
    return len(key.encode("utf-8")) + len(value)


class KVStore:
    """Every namespace's keys; see the module docstring. Mutated only by ``write``, ``drop``,
    ``expire`` and ``restore`` (the state machine, on Raft's thread)."""

    def __init__(self, limits: KVLimits = DEFAULT_LIMITS) -> None:
        self.limits = limits
        self.namespaces: dict[NamespaceId, Namespace] = {}
        self.revision = 0  # the last version handed out; bumped by every change
        self.changes = 0   # bumped by every change, drops and expiries too (waiters re-check)
        # torchrun rendezvous rounds completed by the writes this process applied (a write of a
        # run's ``rendezvous_state.STATE_KEY`` whose summary says a new round is complete). Not
        # replicated, not in snapshots: every node counts the same entries as it applies them,
        # from zero at its start (a Prometheus counter's reset).
        self.rendezvous_rounds = 0

    # -- reads --

    def get(self, ns: NamespaceId, key: str) -> Entry | None:
        n = self.namespaces.get(ns)
        return None if n is None else n.entries.get(key)

    def list(self, ns: NamespaceId, prefix: str = "", limit: int | None = None) -> tuple[list[tuple[str, Entry]], int]:
        """(the first ``limit`` keys starting with ``prefix``, in key order, with their entries;
        how many keys match in all)."""
        n = self.namespaces.get(ns)
        if n is None:
            return [], 0
        limit = self.limits.max_list if limit is None or limit <= 0 else min(limit, self.limits.max_list)
        items = list(n.entries.items())  # one copy: Raft's thread may write meanwhile
        matched = sorted((kv for kv in items if kv[0].startswith(prefix)), key=lambda kv: kv[0])
        return matched[:limit], len(matched)

    def idle(self, now_ms: int, idle_ms: int) -> list[NamespaceId]:
        """The namespaces no write touched for ``idle_ms`` as of ``now_ms``."""
        return [ns for ns, n in list(self.namespaces.items()) if n.touched_ms + idle_ms <= now_ms]

    # -- changes --

    def write(self, ns: NamespaceId, op: KVOp, request_id: str, time_ms: int) -> KVResult:
        """Apply one write (see the module docstring); refusals are results, never exceptions."""
        limits = self.limits
        try:
            check_namespace(*ns, limits)
            check_op(op, limits)
            check_request_id(request_id, limits)
        except KVError as e:
            return KVResult(error=e.message, error_kind=e.kind)
        n = self.namespaces.get(ns)
        if n is not None and request_id and request_id in n.requests:
            applied, version, counter = n.requests[request_id]
            n.touched_ms = max(n.touched_ms, time_ms)
            current = n.entries.get(op.key)
            value = current.value if current is not None and current.version == version else None
            return KVResult(applied=applied, version=version, value=value, counter=counter, duplicate=True)
        new = n is None
        if new:
            if len(self.namespaces) >= limits.max_namespaces:
                return KVResult(error=f"the cluster holds {limits.max_namespaces} rendezvous namespaces, its limit "
                                      "(remove finished runs: lighthouse-cluster rendezvous remove)",
                                error_kind=EXHAUSTED)
            n = Namespace(created_ms=time_ms, touched_ms=time_ms)
        before = n.entries.get(op.key)
        try:
            result = self._apply(n, ns, op)
        except KVError as e:
            return KVResult(error=e.message, error_kind=e.kind)
        if (result.applied and op.key == STATE_KEY and isinstance(op, (KVSet, KVCompareAndSet))
                and completes_a_round(None if before is None else before.value, op.value)):
            self.rendezvous_rounds += 1
        if new and not n.entries:
            return result  # nothing stored: no namespace is created (nor its request id kept)
        if new:
            self.namespaces[ns] = n
        n.touched_ms = max(n.touched_ms, time_ms)
        if request_id:
            n.requests[request_id] = (result.applied, result.version, result.counter)
            while len(n.requests) > limits.dedup_window:
                n.requests.popitem(last=False)
        if result.applied:
            self.changes += 1
        return result

    def _store(self, n: Namespace, ns: NamespaceId, key: str, value: bytes) -> int:
        limits = self.limits
        old = n.entries.get(key)
        if old is None and len(n.entries) >= limits.max_keys:
            raise KVError(EXHAUSTED, f"rendezvous {ns[0]}/{ns[1]} holds {limits.max_keys} keys, its limit")
        grown = n.size + _size(key, value) - (0 if old is None else _size(key, old.value))
        if grown > limits.max_namespace_bytes:
            raise KVError(EXHAUSTED, f"rendezvous {ns[0]}/{ns[1]} would hold {grown} bytes; its limit is "
                                     f"{limits.max_namespace_bytes}")
        self.revision += 1
        n.entries[key] = Entry(value, self.revision)
        n.size = grown
        return self.revision

    def _apply(self, n: Namespace, ns: NamespaceId, op: KVOp) -> KVResult:
        current = n.entries.get(op.key)
        if isinstance(op, KVSet):
            return KVResult(applied=True, version=self._store(n, ns, op.key, op.value), value=op.value)
        if isinstance(op, KVCompareAndSet):
            if op.expected_version is not None:
                match = (current.version if current is not None else 0) == op.expected_version
            else:
                match = (current.value if current is not None else b"") == op.expected_value
            if not match:
                return KVResult(applied=False, version=current.version if current else 0,
                                value=current.value if current else None)
            return KVResult(applied=True, version=self._store(n, ns, op.key, op.value), value=op.value)
        if isinstance(op, KVAdd):
            total = counter_value(op.key, current.value if current else None) + op.delta
            if not INT64_MIN <= total <= INT64_MAX:
                raise KVError(PRECONDITION, f"add {op.delta} to {op.key[:80]!r}: the sum leaves the 64-bit range")
            value = str(total).encode()
            return KVResult(applied=True, version=self._store(n, ns, op.key, value), value=value, counter=total)
        if isinstance(op, KVDelete):
            if current is None or (op.expected_version is not None and op.expected_version != current.version):
                return KVResult(applied=False, version=current.version if current else 0,
                                value=current.value if current else None)
            del n.entries[op.key]
            n.size -= _size(op.key, current.value)
            self.revision += 1
            return KVResult(applied=True, version=0)
        raise TypeError(f"not a KV operation: {op!r}")

    def drop(self, ns: NamespaceId) -> int:
        """Drop a namespace; how many keys it held (-1: there was none)."""
        n = self.namespaces.pop(ns, None)
        if n is None:
            return -1
        self.revision += 1
        self.changes += 1
        return len(n.entries)

    def expire(self, now_ms: int, idle_ms: int) -> list[NamespaceId]:
        """Drop every namespace no write touched for ``idle_ms`` as of ``now_ms``; those dropped."""
        dropped = self.idle(now_ms, idle_ms)
        for ns in dropped:
            self.drop(ns)
        return dropped

    # -- snapshots --

    def to_wire(self) -> dict[str, Any]:
        return {"rev": self.revision,
                "ns": [[job, run, n.created_ms, n.touched_ms,
                        [[k, e.value, e.version] for k, e in n.entries.items()],
                        [[rid, a, v, c] for rid, (a, v, c) in n.requests.items()]]
                       for (job, run), n in self.namespaces.items()]}

    def restore(self, obj: dict[str, Any] | None) -> None:
        self.namespaces = {}
        self.revision = int((obj or {}).get("rev", 0))
        for job, run, created, touched, entries, requests in (obj or {}).get("ns", []):
            n = Namespace(created_ms=int(created), touched_ms=int(touched))
            for k, value, version in entries:
                n.entries[str(k)] = Entry(bytes(value), int(version))
                n.size += _size(str(k), bytes(value))
            for rid, a, v, c in requests:
                n.requests[str(rid)] = (bool(a), int(v), int(c))
            self.namespaces[(str(job), str(run))] = n
        self.changes += 1
