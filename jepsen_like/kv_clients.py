"""Key-value clients: compare-and-set increments of one register in the rendezvous store (issue 34).

A run with ``ClientSettings.kv_clients = N`` (CLI ``--kv-clients N``; default 0) has, besides the
simulated replica groups, N KV clients ``kv0 ..`` that share one namespace of the replicated
key-value store (``lighthouse_cluster/client/kv_client.py``: job ``kv_job``, run id ``KV_RUN_ID``)
and contend on one key, ``KV_KEY``, holding a decimal integer (absent: 0 at version 0). Each
client loops: it knows a (value, version) of the register (from a read, or from its last
compare-and-set's answer) and asks to set it to value + 1 if it is still at that version. Every
call is recorded:

* ``kv-read``: invoke ``{run_id, key}``; ``ok`` ``{.., value, version}`` (0, 0: absent);
  ``info`` when no node answered within the client's timeout (``KVUnavailable``); ``fail`` when
  the cluster refused it.
* ``kv-cas``: invoke ``{run_id, key, expected_version, from, to, request_id}`` (``to = from + 1``;
  the request id is the one the client sends with every retry of this call, so the store applies
  it once); ``ok`` when it applied: the invoke's fields and ``applied: true``, ``version`` (the
  key's new version), ``duplicate``; ``fail`` when it certainly did not apply: the CAS lost the
  race (``applied: false`` with ``current_version``/``current_value``, what the key held instead);
  ``info`` when its outcome is unknown (no answer within the timeout, or any other error: an
  earlier attempt of the same call may have been applied).
* ``kv-final`` (process ``kv-final``): after the run, once the KV clients stopped and the cluster
  healed, one linearizable read of the register: what the checker counts the increments against.

The clients are threads of the harness (the KV client is a blocking gRPC client); about one call
in ``KV_READ_ONE_IN`` is a plain read. ``checkers.kv_cas_linearizable`` checks the history.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from typing import Any, Callable

from lighthouse_cluster.client.kv_client import KVClient, KVError, KVUnavailable

from .history import FAIL, INFO, INVOKE, KV_CAS as F_CAS, KV_FINAL as F_FINAL, KV_FS, KV_READ as F_READ, OK, \
    HistoryWriter

__all__ = ["FINAL_PROCESS", "KV_FS", "KV_KEY", "KV_RUN_ID", "KVClientPool", "KVWorker", "final_read"]

KV_RUN_ID = "jepsen-register"
KV_KEY = "register"
FINAL_PROCESS = "kv-final"
KV_READ_ONE_IN = 4
# One attempt's deadline: a node that does not answer within it (isolated, paused) is left for the
# next one, well before the call's own timeout.
KV_ATTEMPT_S = 1.0
FINAL_READ_TIMEOUT_S = 10.0


def parse_counter(raw: bytes | None) -> int | str:
    """The register's value: an integer (absent or empty: 0); anything else as text (the checker
    flags it)."""
    if not raw:
        return 0
    try:
        return int(raw)
    except ValueError:
        return raw[:40].decode("utf-8", "replace")


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:160]}"


class KVWorker:
    """One KV client (``kv<k>``): CAS increments of the register and some reads, every call
    recorded (see the module docstring)."""

    def __init__(self, name: str, endpoints: list[str], node_ids: list[str], history: HistoryWriter, *,
                 job: str, timeout_s: float, seed: int) -> None:
        self.name = name
        self.history = history
        self.job = job
        self.client = KVClient(list(endpoints), job, KV_RUN_ID, timeout=timeout_s)
        self.client.cluster.call_timeout = min(KV_ATTEMPT_S, timeout_s)
        self._node_of = dict(zip(endpoints, node_ids))
        self._rng = random.Random(seed)
        self.known: tuple[int, int] | None = None  # (value, version) last seen, None: read first
        self.unexpected: list[str] = []

    def _node(self) -> str | None:
        target = self.client.cluster._target
        return self._node_of.get(target) if target else None

    def _record(self, type: str, f: str, value: Any, error: str | None = None) -> None:
        self.history.append(self.name, type, f, value, self._node(), error, job=self.job)

    def read(self) -> None:
        base = {"run_id": KV_RUN_ID, "key": KV_KEY}
        self._record(INVOKE, F_READ, base)
        try:
            entry = self.client.get(KV_KEY)
        except KVUnavailable as e:
            self.known = None
            self._record(INFO, F_READ, base, _error(e))
            return
        except KVError as e:
            self.known = None
            self._record(FAIL, F_READ, base, _error(e))
            return
        value, version = (parse_counter(entry.value), entry.version) if entry is not None else (0, 0)
        self._record(OK, F_READ, {**base, "value": value, "version": version})
        self.known = (value, version) if isinstance(value, int) else None

    def cas(self) -> None:
        assert self.known is not None
        value, version = self.known
        request_id = uuid.uuid4().hex
        inv = {"run_id": KV_RUN_ID, "key": KV_KEY, "expected_version": version, "from": value, "to": value + 1,
               "request_id": request_id}
        self._record(INVOKE, F_CAS, inv)
        try:
            r = self.client.compare_and_set(KV_KEY, str(value + 1).encode(), expected_version=version,
                                             request_id=request_id)
        except KVUnavailable as e:
            self.known = None
            self._record(INFO, F_CAS, inv, _error(e))
            return
        except KVError as e:
            # Refused now, but an earlier attempt of this call may have been applied: unknown.
            self.known = None
            self._record(INFO, F_CAS, inv, _error(e))
            return
        new_version = r.entry.version if r.entry is not None else 0
        if r.applied:
            self._record(OK, F_CAS, {**inv, "applied": True, "version": new_version, "duplicate": r.duplicate})
            self.known = (value + 1, new_version)
            return
        # The entry of a duplicate answer has the version the key had then; its value only if the
        # key is still at that version (otherwise empty: unknown).
        if r.entry is None:
            current: int | str | None = 0
        elif r.duplicate and not r.entry.value:
            current = None
        else:
            current = parse_counter(r.entry.value)
        self._record(FAIL, F_CAS, {**inv, "applied": False, "current_version": new_version,
                                   "current_value": current, "duplicate": r.duplicate},
                     f"compare-and-set lost: the key is at version {new_version}")
        self.known = (current, new_version) if isinstance(current, int) else None

    def step(self) -> None:
        if self.known is None or self._rng.randrange(KV_READ_ONE_IN) == 0:
            self.read()
        else:
            self.cas()

    def run(self, stop: Callable[[], bool], pause_s: float) -> None:
        try:
            while not stop():
                try:
                    self.step()
                except Exception as e:  # a bug of the harness or the client: recorded, and go on
                    self.unexpected.append(_error(e))
                    self.known = None
                    time.sleep(0.1)
                if pause_s:
                    time.sleep(pause_s)
        finally:
            self.client.close()


class KVClientPool:
    """Every KV client on a thread of its own until ``stop()``."""

    def __init__(self, endpoints: list[str], node_ids: list[str], history: HistoryWriter, count: int, *,
                 job: str, timeout_s: float, pause_s: float = 0.01, seed: int = 0) -> None:
        self.timeout_s = timeout_s
        self.pause_s = pause_s
        self.workers = [KVWorker(f"kv{k}", endpoints, node_ids, history, job=job, timeout_s=timeout_s,
                                 seed=seed * 1000 + k) for k in range(count)]
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=w.run, args=(self._stop.is_set, pause_s), name=f"jepsen-{w.name}",
                                          daemon=True) for w in self.workers]
        self._stopped = False

    @property
    def names(self) -> list[str]:
        return [w.name for w in self.workers]

    def start(self) -> "KVClientPool":
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        """Stop and wait (each finishes its call in flight: bounded by its timeout and a margin);
        raises if a client is stuck or hit an unexpected error. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        deadline = time.monotonic() + self.timeout_s + 10.0
        for t in self._threads:
            t.join(max(0.1, deadline - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            raise RuntimeError(f"KV clients did not stop in time: {', '.join(stuck)}")
        errors = [f"{w.name}: {e}" for w in self.workers for e in w.unexpected]
        if errors:
            raise RuntimeError(f"KV clients hit unexpected errors: {'; '.join(errors[:5])}")


def final_read(endpoints: list[str], history: HistoryWriter, job: str,
               timeout_s: float = FINAL_READ_TIMEOUT_S) -> dict[str, Any] | None:
    """Read the register once through the cluster (after the KV clients stopped and the cluster
    healed), recorded as ``kv-final``; returns the ``ok`` value, or None when it could not."""
    base = {"run_id": KV_RUN_ID, "key": KV_KEY}
    history.append(FINAL_PROCESS, INVOKE, F_FINAL, base, job=job)
    with KVClient(list(endpoints), job, KV_RUN_ID, timeout=timeout_s) as client:
        client.cluster.call_timeout = min(KV_ATTEMPT_S, timeout_s)
        try:
            entry = client.get(KV_KEY)
        except KVError as e:
            history.append(FINAL_PROCESS, INFO if isinstance(e, KVUnavailable) else FAIL, F_FINAL, base,
                           error=_error(e), job=job)
            return None
    value = {**base, "value": parse_counter(entry.value) if entry is not None else 0,
             "version": entry.version if entry is not None else 0}
    history.append(FINAL_PROCESS, OK, F_FINAL, value, job=job)
    return value
