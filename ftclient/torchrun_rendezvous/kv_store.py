"""``LighthouseKVStore``: a ``torch.distributed.Store`` on one namespace of the cluster's
replicated key-value store (``lighthouse_cluster.client.kv_client.KVClient``).

torch's dynamic rendezvous handler hands this store (under a ``PrefixStore`` per round) to the
elastic agent, which uses it for the agents' rank assignment (``multi_get``/``multi_set``/``get``),
to publish ``MASTER_ADDR``/``MASTER_PORT`` of the workers' TCPStore (hosted by the agent of rank
0) and for its exit barrier (``add``/``wait``/``get``). The semantics are TCPStore's:

* ``get`` waits (up to the store's timeout, ``set_timeout``) until the key exists, then reads it
  on the leader; ``wait(keys[, timeout])`` waits until every key exists. A timeout raises
  ``torch.distributed.DistStoreError`` naming the keys and the namespace.
* ``compare_set(key, expected, desired)`` sets when the key holds ``expected`` (``b""``: absent)
  and returns the value afterwards; on an absent key and a non-empty ``expected`` it returns
  ``expected``, as TCPStore.
* ``add`` is an integer counter stored as decimal text.
* A refusal of the cluster (a value over its size limit, a bad key) or a cluster that does not
  answer within the client's timeout is a ``DistStoreError`` too, with the cluster's one-line
  message; the store is unchanged.

The C++ side calls a Python subclass by these names: ``set``, ``get``, ``add``, ``compare_set``,
``wait`` (both forms), ``check``, ``multi_get``, ``multi_set``, ``append``, and ``deleteKey`` and
``getNumKeys`` (aliases of ``delete_key`` and ``num_keys`` here).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Sequence

import torch.distributed as dist

from lighthouse_cluster.client.kv_client import KVClient, KVError

# Store.wait with a zero timeout (torch's kNoTimeout) waits this long per round, and again.
_NO_TIMEOUT_ROUND_S = 300.0


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (list, tuple)):  # a std::vector<uint8_t> from some bindings
        return bytes(value)
    raise TypeError(f"a store value must be bytes or str, not {type(value).__name__}")


def _seconds(timeout: timedelta | float | None) -> float | None:
    if timeout is None:
        return None
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


class LighthouseKVStore(dist.Store):
    """A ``torch.distributed.Store`` on ``kv``'s namespace; see the module docstring."""

    def __init__(self, kv: KVClient, timeout: timedelta = timedelta(seconds=60)) -> None:
        super().__init__()
        self._kv = kv
        self.set_timeout(timeout)

    @property
    def kv(self) -> KVClient:
        return self._kv

    def _where(self) -> str:
        return f"rendezvous store {self._kv.job}/{self._kv.run_id}"

    def _failed(self, what: str, e: KVError) -> dist.DistStoreError:
        return dist.DistStoreError(f"{self._where()}: {what}: {e}")

    def _timeout_s(self, timeout: timedelta | float | None = None) -> float | None:
        """Seconds to wait: ``timeout`` or the store's; None: no limit (torch's zero timeout)."""
        seconds = _seconds(timeout)
        if seconds is None:
            seconds = self.timeout.total_seconds()
        return seconds if seconds > 0 else None

    def _await(self, keys: list[str], timeout: timedelta | float | None) -> None:
        limit = self._timeout_s(timeout)
        deadline = None if limit is None else time.monotonic() + limit
        while True:
            left = _NO_TIMEOUT_ROUND_S if deadline is None else deadline - time.monotonic()
            try:
                if left > 0 and self._kv.wait(keys, timeout=left).ready:
                    return
            except KVError as e:
                raise self._failed(f"wait for {keys}", e) from None
            if deadline is not None and time.monotonic() >= deadline:
                raise dist.DistStoreError(f"{self._where()}: wait timeout after {limit:g} s for keys {keys}")

    # -- the Store interface ----------------------------------------------------------------------

    def set(self, key: str, value: Any) -> None:
        try:
            self._kv.set(key, _as_bytes(value))
        except KVError as e:
            raise self._failed(f"set {key!r}", e) from None

    def get(self, key: str) -> bytes:
        limit = self._timeout_s()
        deadline = None if limit is None else time.monotonic() + limit
        while True:
            try:
                entry = self._kv.get(key)
            except KVError as e:
                raise self._failed(f"get {key!r}", e) from None
            if entry is not None:
                return entry.value
            # Absent: wait until it exists (any node answers), then read it on the leader.
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._await([key], left if left is None or left > 0 else 1e-3)

    def add(self, key: str, value: int) -> int:
        try:
            return self._kv.add(key, int(value))
        except KVError as e:
            raise self._failed(f"add to {key!r}", e) from None

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        expected, desired = _as_bytes(expected_value), _as_bytes(desired_value)
        try:
            result = self._kv.compare_and_set(key, desired, expected_value=expected)
        except KVError as e:
            raise self._failed(f"compare_set {key!r}", e) from None
        if result.applied:
            return desired
        return result.entry.value if result.entry is not None else expected

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        self._await(list(keys), timeout)

    def check(self, keys: Sequence[str]) -> bool:
        try:
            return all(self._kv.get(k) is not None for k in keys)
        except KVError as e:
            raise self._failed(f"check {list(keys)}", e) from None

    def delete_key(self, key: str) -> bool:
        try:
            return self._kv.delete(key)
        except KVError as e:
            raise self._failed(f"delete {key!r}", e) from None

    def num_keys(self) -> int:
        try:
            return self._kv.num_keys()
        except KVError as e:
            raise self._failed("count keys", e) from None

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: Sequence[str], values: Sequence[Any]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        for key, value in zip(keys, values):
            self.set(key, value)

    def append(self, key: str, value: Any) -> None:
        # Read, then compare-and-set on that version: concurrent appends all land.
        extra = _as_bytes(value)
        try:
            while True:
                entry = self._kv.get(key)
                current, version = (entry.value, entry.version) if entry is not None else (b"", 0)
                if self._kv.compare_and_set(key, current + extra, expected_version=version).applied:
                    return
        except KVError as e:
            raise self._failed(f"append to {key!r}", e) from None

    # The C++ names the trampoline calls for these two.
    deleteKey = delete_key
    getNumKeys = num_keys
