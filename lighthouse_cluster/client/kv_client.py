"""A blocking client of the rendezvous key-value store (``LighthouseKV``, issue 34).

``KVClient(endpoints, job, run_id)`` is one run's namespace: ``get``, ``set``,
``compare_and_set``, ``add``, ``delete``, ``list``, ``num_keys``, ``wait`` and ``drop``;
``KVCluster(endpoints)`` the connection it uses, which also lists every namespace
(``list_namespaces``). Endpoints are the list every client of the cluster takes
(``discovery.parse_endpoints``: ``http://a:29510,http://b:29510``).

* **Routing.** Calls go to the leader (``discovery.find_leader``); a refusal carrying the "not
  the leader" detail names the next one to try, and a node that cannot be reached, or knows no
  leader, sends the client back to asking every node. Any node would do (a follower forwards),
  the leader saves a hop. Retries are tenacity's, with jittered backoff, bounded by the client's
  ``timeout`` per operation; then ``KVUnavailable``.
* **Writes apply once.** Each write carries a request id, chosen once per call and sent again
  with every retry of it: a retry whose first attempt was applied (its answer lost in a leader
  change) is answered with that attempt's outcome and not applied again (``duplicate``).
* **Waits** are answered by any node from its replicated state, in slices of at most
  ``WAIT_SLICE_S``; a node that dies or cannot answer under a wait is replaced by the next
  endpoint and the wait goes on there, from the same known versions, until its timeout.
* **Refusals** (bad input, limits, the schema not enabled yet, a wrong token) raise ``KVError``
  with the gRPC code and the node's one-line message.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import grpc
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential_jitter

from lighthouse_cluster.client.discovery import find_leader, not_leader_of_error, parse_endpoints
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import lighthouse_cluster_pb2_grpc as cpb_grpc
from lighthouse_cluster.tls import ClientTLS, channel, client_tls_for

DEFAULT_TIMEOUT_S = 10.0
# One attempt's deadline at most (a hung node is given up after this long).
CALL_TIMEOUT_S = 5.0
# A wait asks one node for at most this long before asking again (the next node in turn).
WAIT_SLICE_S = 10.0
LEADER_PROBE_S = 1.0
# Codes after which the call is tried again (elsewhere): the node or the cluster could not answer.
_MOVING = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                     grpc.StatusCode.ABORTED})


class KVError(Exception):
    """The cluster refused the call (``code``: INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
    FAILED_PRECONDITION, PERMISSION_DENIED, UNAUTHENTICATED, ...), or could not be reached
    (``KVUnavailable``); the message is one line."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class KVUnavailable(KVError):
    """No node answered the call (or no leader was found) within the client's timeout."""


@dataclass(frozen=True)
class Entry:
    key: str
    value: bytes
    version: int


@dataclass(frozen=True)
class WriteResult:
    """A write's outcome: ``applied`` (the write changed the store); ``entry`` the key afterwards
    (None: absent), on a failed compare-and-set what is there instead; ``counter`` an add's new
    value; ``duplicate``: a retry of a write that had applied, answered with its outcome."""

    applied: bool
    entry: Entry | None
    counter: int = 0
    duplicate: bool = False


@dataclass(frozen=True)
class WaitResult:
    """``ready``: every key's version differs from the known one (with 0: every key exists);
    ``entries``: one per key, in order (None: absent), as the answering node had them."""

    ready: bool
    entries: tuple[Entry | None, ...]
    answered_by: str = ""


@dataclass(frozen=True)
class NamespaceInfo:
    job: str
    run_id: str
    keys: int
    bytes: int
    created_ms: int
    touched_ms: int


class _Again(Exception):
    """One attempt failed in a way another attempt (perhaps elsewhere) may mend."""

    def __init__(self, message: str, code: grpc.StatusCode | None) -> None:
        super().__init__(message)
        self.code = code


def _entry(e: cpb.KVEntry) -> Entry | None:
    return Entry(e.key, e.value, e.version) if e.version else None


def _write_result(r: cpb.KVWriteResponse) -> WriteResult:
    return WriteResult(r.applied, _entry(r.entry) if r.found else None, r.counter, r.duplicate)


class KVCluster:
    """The connection to a cluster's rendezvous store (see the module docstring)."""

    def __init__(self, endpoints: str | Sequence[str], *, tls: ClientTLS | None = None, token: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S, call_timeout: float = CALL_TIMEOUT_S) -> None:
        parsed = parse_endpoints(endpoints)
        self.endpoints = list(parsed.addresses)
        self.tls = tls if tls is not None else client_tls_for(endpoints)
        self.timeout = timeout
        self.call_timeout = call_timeout
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._channels: dict[str, grpc.Channel] = {}
        self._target: str | None = None  # where calls go: the leader as last heard
        self._waiting_at = 0              # the endpoint a wait asks next (index)

    # -- plumbing -----------------------------------------------------------------------------------

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()

    def __enter__(self) -> "KVCluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _stub(self, address: str) -> cpb_grpc.LighthouseKVStub:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = channel(address, self.tls)
        return cpb_grpc.LighthouseKVStub(ch)

    def _leader(self) -> str:
        if self._target is None:
            best, _ = find_leader(self.endpoints, self.tls, min(LEADER_PROBE_S, self.timeout))
            # No leader named: any node will do (a follower forwards, or says who leads).
            self._target = best.leader_address if best is not None else self.endpoints[0]
        return self._target

    def _retrying(self, timeout: float) -> Retrying:
        return Retrying(stop=stop_after_delay(timeout), wait=wait_exponential_jitter(multiplier=0.02, max=0.5, jitter=0.05),
                        retry=retry_if_exception_type(_Again), reraise=True)

    def _attempt(self, address: str, method: str, request: Any, timeout: float) -> Any:
        try:
            return getattr(self._stub(address), method)(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
            moved = not_leader_of_error(e)
            if moved is not None:
                self._target = moved.leader_address or None
                raise _Again(f"{address}: {details}", code) from None
            if code in _MOVING:
                self._target = None
                raise _Again(f"{address}: {code.name}: {details}", code) from None
            raise KVError(f"{code.name}: {details}", code) from None

    def call(self, method: str, request: Any) -> Any:
        """``LighthouseKV/<method>`` on the leader, retried across leader changes and unreachable
        nodes until ``timeout``."""
        deadline = time.monotonic() + self.timeout
        try:
            for attempt in self._retrying(self.timeout):
                with attempt:
                    left = max(0.05, deadline - time.monotonic())
                    return self._attempt(self._leader(), method, request, min(self.call_timeout, left))
        except _Again as e:
            raise KVUnavailable(f"the rendezvous store did not answer {method} within {self.timeout:g} s "
                                f"(last: {e})", e.code) from None
        raise AssertionError("unreachable")

    def wait(self, ns: cpb.KVNamespace, keys: Sequence[str], known_versions: Sequence[int],
             timeout: float) -> WaitResult:
        """See ``KVClient.wait``."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return WaitResult(False, tuple(None for _ in keys))
            slice_s = min(WAIT_SLICE_S, left)
            request = cpb.KVWaitRequest(ns=ns, keys=list(keys), known_versions=list(known_versions),
                                        timeout_ms=max(1, int(slice_s * 1000)))
            address = self.endpoints[self._waiting_at % len(self.endpoints)]
            try:
                r = self._stub(address).Wait(request, timeout=slice_s + 1.0, metadata=self._metadata)
            except grpc.RpcError as e:
                if e.code() not in _MOVING:
                    raise KVError(f"{e.code().name}: {e.details()}", e.code()) from None
                self._waiting_at += 1  # that node is gone: go on waiting at the next one
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
                continue
            result = WaitResult(r.ready, tuple(_entry(e) for e in r.entries), r.answered_by)
            if r.ready or deadline - time.monotonic() <= 0:
                return result
            self._waiting_at += 1  # a slice went by: the next one asks another node

    # -- the whole store ------------------------------------------------------------------------------

    def list_namespaces(self, job: str = "") -> list[NamespaceInfo]:
        r = self.call("ListNamespaces", cpb.KVListNamespacesRequest(job=job))
        return [NamespaceInfo(n.ns.job, n.ns.run_id, n.keys, n.bytes, n.created_ms, n.touched_ms) for n in r.namespaces]

    def namespace(self, job: str, run_id: str) -> "KVClient":
        return KVClient(self, job, run_id)


class KVClient:
    """One (job, run id) namespace of the rendezvous store. ``endpoints`` is an endpoint list (a
    ``KVCluster`` is made with ``tls``, ``token`` and ``timeout``) or a ``KVCluster`` to share."""

    def __init__(self, endpoints: str | Sequence[str] | KVCluster, job: str, run_id: str, *,
                 tls: ClientTLS | None = None, token: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.cluster = endpoints if isinstance(endpoints, KVCluster) else \
            KVCluster(endpoints, tls=tls, token=token, timeout=timeout)
        self.job = job
        self.run_id = run_id
        self._ns = cpb.KVNamespace(job=job, run_id=run_id)
        self._new_request_id: Callable[[], str] = lambda: uuid.uuid4().hex

    def close(self) -> None:
        self.cluster.close()

    def __enter__(self) -> "KVClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reads (linearizable: answered by the leader) -----------------------------------------------

    def get(self, key: str) -> Entry | None:
        """The key's value and version; None when absent."""
        r = self.cluster.call("Get", cpb.KVGetRequest(ns=self._ns, key=key))
        return _entry(r.entry) if r.found else None

    def list(self, prefix: str = "", *, limit: int = 0, values: bool = False) -> tuple[list[Entry], int]:
        """(the keys starting with ``prefix`` in key order, at most ``limit`` (0: the cluster's
        limit), with their values when ``values``; how many match in all)."""
        r = self.cluster.call("List", cpb.KVListRequest(ns=self._ns, prefix=prefix, limit=limit, values=values))
        return [Entry(e.key, e.value, e.version) for e in r.entries], r.total

    def num_keys(self) -> int:
        return self.list(limit=1)[1]

    # -- writes (through Raft, applied once) --------------------------------------------------------

    def set(self, key: str, value: bytes) -> Entry:
        r = self.cluster.call("Set", cpb.KVSetRequest(ns=self._ns, key=key, value=value,
                                                      request_id=self._new_request_id()))
        return Entry(key, value, r.entry.version)

    def compare_and_set(self, key: str, value: bytes, *, expected_version: int | None = None,
                        expected_value: bytes | None = None, request_id: str | None = None) -> WriteResult:
        """Set ``key`` to ``value`` if it is at ``expected_version`` (0: absent) or holds
        ``expected_value`` (``b""``: absent or empty; torch's ``compare_set``); give exactly one.
        ``applied`` says whether it did; ``entry`` is the key afterwards. ``request_id``: the id
        this write is sent (and every retry resent) with, for a caller that records it; default a
        fresh one."""
        if (expected_version is None) == (expected_value is None):
            raise ValueError("compare_and_set needs exactly one of expected_version and expected_value")
        request = cpb.KVCompareAndSetRequest(ns=self._ns, key=key, value=value,
                                             request_id=request_id or self._new_request_id())
        if expected_version is not None:
            request.expected_version = expected_version
        else:
            request.expected_value = expected_value  # type: ignore[assignment]
        return _write_result(self.cluster.call("CompareAndSet", request))

    def add(self, key: str, delta: int) -> int:
        """Add ``delta`` to the integer at ``key`` (absent: 0); its new value."""
        r = self.cluster.call("Add", cpb.KVAddRequest(ns=self._ns, key=key, delta=delta,
                                                      request_id=self._new_request_id()))
        return r.counter

    def delete(self, key: str, *, expected_version: int | None = None) -> bool:
        """Delete ``key`` (with ``expected_version``: only at that version); whether it did."""
        request = cpb.KVDeleteRequest(ns=self._ns, key=key, request_id=self._new_request_id())
        if expected_version is not None:
            request.expected_version = expected_version
        return self.cluster.call("Delete", request).applied

    def drop(self) -> int | None:
        """Remove this namespace and its keys (needs the admin token); how many keys it held, None
        when there was none."""
        r = self.cluster.call("DropNamespace", cpb.KVDropRequest(ns=self._ns))
        return r.keys if r.dropped else None

    # -- waits (any node) -----------------------------------------------------------------------------

    def wait(self, keys: str | Iterable[str], *, known_versions: Sequence[int] | None = None,
             timeout: float = DEFAULT_TIMEOUT_S) -> WaitResult:
        """Wait until every key's version differs from its known version (default 0: until every
        key exists, torch's ``Store.wait``; a key's current version: until it changes). Returns
        ``ready=False`` once ``timeout`` passed first."""
        keys = [keys] if isinstance(keys, str) else list(keys)
        known = list(known_versions) if known_versions is not None else [0] * len(keys)
        if len(known) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(known)} known versions")
        return self.cluster.wait(self._ns, keys, known, timeout)
