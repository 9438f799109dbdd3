"""``lighthouse_cluster.LighthouseKV`` on a node: the rendezvous key-value store's gRPC service.

Thin: validate (``core/kv_store.py``'s own checks, so a refusal never reaches the log), route,
commit, map outcomes to gRPC status codes. The rules live in ``kv_store``; the store itself is the
replicated state machine's ``kv``.

* **Writes** (Set, CompareAndSet, Add, Delete, DropNamespace) run on the serving leader: a
  ``KVWrite`` committed through Raft, stamped with the leader's wall clock and the client's
  request id (a retry with the same id applies once). A write not committed in time is
  UNAVAILABLE "outcome unknown": the client sends it again with the same request id.
* **Reads** (Get, List, ListNamespaces) run on the serving leader too, after a majority
  confirmed that it still leads (``probe_leadership``: one heartbeat round trip, no log entry);
  every write acknowledged before the read began was applied on this leader before it was
  acknowledged (or before this leader's ``TermStart``), so reads are linearizable.
* **A follower forwards** every call but Wait to the leader it knows, once, as a plain unary
  call marked with ``forwarding.FORWARDED_HEADER`` (and the caller's metadata: its token), and
  relays the answer, or the failure with its trailing metadata. A node that receives a
  forwarded call but does not lead, or knows no leader, answers UNAVAILABLE with the typed "not
  the leader" detail (``discovery.not_leader_metadata``) that every client already reads.
* **Wait** is answered by any node from its own applied state: it wakes whenever an applied
  entry changed the store (``on_apply``, called on Raft's thread, hops to the loop) and at least
  every ``WAIT_RECHECK_S`` (a snapshot installed on a lagging follower changes the store without
  an entry). It ends ``ready`` once every key's version differs from the one the caller knows,
  or not ready when its timeout (or just before the call's deadline) comes; a node dying under
  it costs the caller nothing but a reconnect elsewhere (``client/kv_client.py``).
* **Expiry**: the serving leader checks every ``check_period`` whether a namespace has been idle
  (no write) for ``idle_expiry_s`` and, if one has, commits a ``KVExpire`` with its wall clock;
  every node drops the same namespaces. ``serve --rendezvous-idle-expiry-s`` sets the idle
  time (default 24 h).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, Protocol

import grpc

from lighthouse_cluster.client.discovery import NOT_LEADER_KEY, not_leader_metadata
from lighthouse_cluster.core import codec
from lighthouse_cluster.core.codec import KVDrop, KVExpire, KVWrite
from lighthouse_cluster.core.defaults import COMMIT_TIMEOUT_S
from lighthouse_cluster.core.kv_store import (
    DEFAULT_IDLE_EXPIRY_S,
    EXHAUSTED,
    INVALID,
    Entry,
    KVAdd,
    KVCompareAndSet,
    KVDelete,
    KVError,
    KVOp,
    KVResult,
    KVSet,
    check_key,
    check_namespace,
    check_op,
    check_request_id,
)
from lighthouse_cluster.core.rendezvous_state import STATE_KEY
from lighthouse_cluster.core.state_machine import QuorumStateMachine
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import lighthouse_cluster_pb2_grpc as cpb_grpc
from lighthouse_cluster.raft.replication import CommitError
from lighthouse_cluster.server.admin import check_token
from lighthouse_cluster.server.forwarding import FORWARDED_HEADER, PeerChannels
from lighthouse_cluster.server.rendezvous_view import run_state

log = logging.getLogger(__name__)

SERVICE = "lighthouse_cluster.LighthouseKV"
# A waiting Wait re-reads the store at least this often (see the module docstring).
WAIT_RECHECK_S = 0.5
# A Wait without a timeout or deadline ends (not ready) after this long; the client asks again.
MAX_WAIT_S = 300.0
# A Wait answers this long before the call's deadline, so the answer arrives in time.
WAIT_DEADLINE_MARGIN_S = 0.05
MAX_WAIT_KEYS = 1024
# How long a forwarded call may take at most when its caller set no deadline.
FORWARD_TIMEOUT_S = 10.0

_CODES = {INVALID: grpc.StatusCode.INVALID_ARGUMENT, EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED}


class _Answer(Exception):
    """End the call with this status (a refusal, or a forwarded call's failure relayed)."""

    def __init__(self, code: grpc.StatusCode, message: str, trailing: tuple[tuple[str, Any], ...] = ()) -> None:
        super().__init__(message)
        self.code, self.message, self.trailing = code, message, trailing


class KVRaft(Protocol):
    @property
    def term(self) -> int: ...


class KVNode(Protocol):
    """What the service uses of the node (``LighthouseNode``)."""

    @property
    def raft(self) -> KVRaft | None: ...

    @property
    def machine(self) -> QuorumStateMachine: ...

    def serving_term(self) -> int | None:
        """The term this node serves in as leader (None: it does not)."""

    def leader_peer(self) -> Any:
        """The leader's ``PeerSpec`` as far as this node knows (None: unknown)."""

    def submit(self, command: codec.Command) -> Awaitable[Any]: ...

    def probe_leadership(self, term: int) -> Awaitable[bool]: ...


def _entry(key: str, e: Entry | None, values: bool = True) -> cpb.KVEntry:
    if e is None:
        return cpb.KVEntry(key=key)
    return cpb.KVEntry(key=key, value=e.value if values else b"", version=e.version)


def _write_response(key: str, r: KVResult) -> cpb.KVWriteResponse:
    found = r.version > 0
    return cpb.KVWriteResponse(applied=r.applied, found=found, counter=r.counter, duplicate=r.duplicate,
                               entry=cpb.KVEntry(key=key, value=r.value or b"", version=r.version))


class KVService(cpb_grpc.LighthouseKVServicer):
    """The service (see the module docstring); ``start()`` / ``await stop()`` with the node."""

    def __init__(self, node: KVNode, channels: PeerChannels, node_id: str, admin_token: str | None, *,
                 idle_expiry_s: float = DEFAULT_IDLE_EXPIRY_S, check_period_s: float | None = None,
                 count: Callable[[str, str], None] = lambda _op, _result: None,
                 wall_ms: Callable[[], int] = lambda: int(time.time() * 1000)) -> None:
        self.node = node
        self.channels = channels
        self.node_id = node_id
        self.admin_token = admin_token
        self.idle_expiry_s = idle_expiry_s
        self.check_period_s = check_period_s if check_period_s is not None else max(0.05, min(60.0, idle_expiry_s / 4))
        self._count = count
        self._wall_ms = wall_ms
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed = asyncio.Event()
        self._seen_changes = 0
        self._expiry_task: asyncio.Task[None] | None = None

    # -- lifecycle and wake-ups ------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._expiry_task = self._loop.create_task(self._expire_idle())

    async def stop(self) -> None:
        if self._expiry_task is not None:
            self._expiry_task.cancel()
            try:
                await self._expiry_task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 -- stopping
                pass
        self._wake()

    def on_apply(self, _result: Any) -> None:
        """On Raft's thread, after every applied entry: wake the waits if the store changed."""
        changes = self.node.machine.kv.changes
        if changes == self._seen_changes:
            return
        self._seen_changes = changes
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the loop closed meanwhile: the node is stopping
            pass

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # -- routing ------------------------------------------------------------------------------------

    def _not_leader(self, why: str) -> _Answer:
        leader = self.node.leader_peer()
        term = self.node.raft.term if self.node.raft is not None else 0
        named = leader is not None and leader.node_id != self.node_id
        where = f"the leader is {leader.node_id} at {leader.client_address}" if named else "no leader is known yet"
        return _Answer(grpc.StatusCode.UNAVAILABLE, f"node {self.node_id} is not the leader ({why}; {where}); retry",
                       not_leader_metadata(leader.node_id if named else "", leader.client_address if named else "",
                                           term))

    async def _on_leader(self, method: str, request: Any, context: grpc.aio.ServicerContext,
                         local: Callable[[int], Awaitable[Any]], read: bool = False) -> Any:
        """``local(term)`` on the serving leader; else the call forwarded to the leader, once."""
        term = self.node.serving_term()
        if term is not None:
            if read and not await self.node.probe_leadership(term):
                raise self._not_leader("a majority did not confirm its leadership")
            return await local(term)
        metadata = tuple(context.invocation_metadata() or ())
        if any(k == FORWARDED_HEADER for k, _ in metadata):
            raise self._not_leader("a forwarded call is not forwarded again")
        leader = self.node.leader_peer()
        if leader is None or leader.node_id == self.node_id:
            raise self._not_leader("no leader to forward to")
        left = context.time_remaining()
        timeout = FORWARD_TIMEOUT_S if left is None else max(0.0, left)
        passed = tuple((k, v) for k, v in metadata if k.lower() == "authorization")
        stub = cpb_grpc.LighthouseKVStub(self.channels.get(leader.client_address))
        try:
            return await getattr(stub, method)(request, timeout=timeout,
                                               metadata=passed + ((FORWARDED_HEADER, self.node_id),))
        except grpc.aio.AioRpcError as e:
            trailing = tuple((k, v) for k, v in (e.trailing_metadata() or ()) if k == NOT_LEADER_KEY)
            raise _Answer(e.code(), e.details() or e.code().name, trailing) from None

    async def _run(self, method: str, context: grpc.aio.ServicerContext, call: Callable[[], Awaitable[Any]]) -> Any:
        try:
            answer = await call()
        except KVError as e:
            self._count(method, e.kind)
            await context.abort(_CODES.get(e.kind, grpc.StatusCode.FAILED_PRECONDITION), e.message)
        except _Answer as e:
            self._count(method, e.code.name.lower())
            await context.abort(e.code, e.message, e.trailing)
        self._count(method, "ok")
        return answer

    # -- writes -------------------------------------------------------------------------------------

    def _require_schema(self) -> None:
        enabled = self.node.machine.schema_version
        if enabled < codec.KV_SCHEMA_VERSION:
            raise _Answer(grpc.StatusCode.FAILED_PRECONDITION,
                          f"the rendezvous store needs replicated schema {codec.KV_SCHEMA_VERSION}, the cluster has "
                          f"{enabled} enabled: every node must run a version with it first (a rolling upgrade is in "
                          "progress; `lighthouse-cluster status` shows it)")

    async def _commit(self, command: codec.Command, context: grpc.aio.ServicerContext) -> Any:
        left = context.time_remaining()
        timeout = COMMIT_TIMEOUT_S if left is None else max(0.0, min(COMMIT_TIMEOUT_S, left - 0.02))
        try:
            return await asyncio.wait_for(self.node.submit(command), timeout)
        except asyncio.TimeoutError:
            raise _Answer(grpc.StatusCode.UNAVAILABLE, "the write was not committed in time (outcome unknown); "
                          "send it again with the same request id") from None
        except CommitError as e:
            raise _Answer(grpc.StatusCode.UNAVAILABLE, f"the write was not committed ({e.reason}); "
                          "send it again with the same request id") from None

    async def _write(self, method: str, request: Any, context: grpc.aio.ServicerContext, op: KVOp) -> Any:
        ns = (request.ns.job, request.ns.run_id)

        async def local(_term: int) -> cpb.KVWriteResponse:
            self._require_schema()
            result = await self._commit(KVWrite(*ns, op, request.request_id, self._wall_ms()), context)
            if not isinstance(result, KVResult):
                raise _Answer(grpc.StatusCode.INTERNAL, f"unexpected result {result!r}")
            if result.error:
                raise KVError(result.error_kind, result.error)
            return _write_response(op.key, result)

        def checked() -> Awaitable[Any]:
            check_namespace(*ns)
            check_op(op)
            check_request_id(request.request_id)
            return self._on_leader(method, request, context, local)

        return await self._run(method, context, checked)

    async def Set(self, request: cpb.KVSetRequest, context: grpc.aio.ServicerContext) -> cpb.KVWriteResponse:
        return await self._write("Set", request, context, KVSet(request.key, request.value))

    async def CompareAndSet(self, request: cpb.KVCompareAndSetRequest,
                            context: grpc.aio.ServicerContext) -> cpb.KVWriteResponse:
        which = request.WhichOneof("expected")
        op = KVCompareAndSet(request.key, request.value,
                             expected_version=request.expected_version if which == "expected_version" else None,
                             expected_value=request.expected_value if which == "expected_value" else None)
        return await self._write("CompareAndSet", request, context, op)

    async def Add(self, request: cpb.KVAddRequest, context: grpc.aio.ServicerContext) -> cpb.KVWriteResponse:
        return await self._write("Add", request, context, KVAdd(request.key, request.delta))

    async def Delete(self, request: cpb.KVDeleteRequest, context: grpc.aio.ServicerContext) -> cpb.KVWriteResponse:
        expected = request.expected_version if request.HasField("expected_version") else None
        return await self._write("Delete", request, context, KVDelete(request.key, expected))

    async def DropNamespace(self, request: cpb.KVDropRequest, context: grpc.aio.ServicerContext) -> cpb.KVDropResponse:
        ns = (request.ns.job, request.ns.run_id)

        async def local(_term: int) -> cpb.KVDropResponse:
            refused = check_token(context.invocation_metadata(), self.admin_token)
            if refused is not None:
                raise _Answer(refused.code, refused.message)
            self._require_schema()
            if ns not in self.node.machine.kv.namespaces:
                return cpb.KVDropResponse(dropped=False)
            keys = await self._commit(KVDrop(*ns), context)
            if keys >= 0:
                log.warning("rendezvous %s/%s removed (%d keys)", ns[0], ns[1], keys)
            return cpb.KVDropResponse(dropped=keys >= 0, keys=max(0, keys))

        def checked() -> Awaitable[Any]:
            check_namespace(*ns)
            return self._on_leader("DropNamespace", request, context, local)

        return await self._run("DropNamespace", context, checked)

    # -- reads --------------------------------------------------------------------------------------

    async def Get(self, request: cpb.KVGetRequest, context: grpc.aio.ServicerContext) -> cpb.KVGetResponse:
        ns = (request.ns.job, request.ns.run_id)

        async def local(_term: int) -> cpb.KVGetResponse:
            e = self.node.machine.kv.get(ns, request.key)
            return cpb.KVGetResponse(found=e is not None, entry=_entry(request.key, e))

        def checked() -> Awaitable[Any]:
            check_namespace(*ns)
            check_key(request.key)
            return self._on_leader("Get", request, context, local, read=True)

        return await self._run("Get", context, checked)

    async def List(self, request: cpb.KVListRequest, context: grpc.aio.ServicerContext) -> cpb.KVListResponse:
        ns = (request.ns.job, request.ns.run_id)

        async def local(_term: int) -> cpb.KVListResponse:
            entries, total = self.node.machine.kv.list(ns, request.prefix, request.limit or None)
            return cpb.KVListResponse(entries=[_entry(k, e, request.values) for k, e in entries], total=total)

        def checked() -> Awaitable[Any]:
            check_namespace(*ns)
            return self._on_leader("List", request, context, local, read=True)

        return await self._run("List", context, checked)

    async def ListNamespaces(self, request: cpb.KVListNamespacesRequest,
                             context: grpc.aio.ServicerContext) -> cpb.KVListNamespacesResponse:
        async def local(_term: int) -> cpb.KVListNamespacesResponse:
            out = cpb.KVListNamespacesResponse(idle_expiry_ms=int(self.idle_expiry_s * 1000))
            for (job, run), n in sorted(list(self.node.machine.kv.namespaces.items())):
                if request.job and job != request.job:
                    continue
                state_entry = n.entries.get(STATE_KEY)
                rdzv = run_state(None if state_entry is None else state_entry.value)
                out.namespaces.append(cpb.KVNamespaceInfo(
                    ns=cpb.KVNamespace(job=job, run_id=run), keys=len(n.entries), bytes=n.size,
                    created_ms=n.created_ms, touched_ms=n.touched_ms, rendezvous=rdzv["state"],
                    round=rdzv["round"] or 0, participants=rdzv["participants"] or 0, waiting=rdzv["waiting"] or 0))
            return out

        return await self._run("ListNamespaces", context,
                               lambda: self._on_leader("ListNamespaces", request, context, local, read=True))

    async def Wait(self, request: cpb.KVWaitRequest, context: grpc.aio.ServicerContext) -> cpb.KVWaitResponse:
        ns = (request.ns.job, request.ns.run_id)
        keys = list(request.keys)
        known = list(request.known_versions) + [0] * (len(keys) - len(request.known_versions))

        async def wait() -> cpb.KVWaitResponse:
            check_namespace(*ns)
            if not keys or len(keys) > MAX_WAIT_KEYS:
                raise KVError(INVALID, f"wait for 1 to {MAX_WAIT_KEYS} keys, not {len(keys)}")
            if len(request.known_versions) > len(keys):
                raise KVError(INVALID, "more known versions than keys")
            for k in keys:
                check_key(k)
            return await self._wait(ns, keys, known, request.timeout_ms, context)

        return await self._run("Wait", context, wait)

    async def _wait(self, ns: tuple[str, str], keys: list[str], known: list[int], timeout_ms: int,
                    context: grpc.aio.ServicerContext) -> cpb.KVWaitResponse:
        loop = asyncio.get_running_loop()
        limit = timeout_ms / 1000 if timeout_ms else MAX_WAIT_S
        left = context.time_remaining()
        if left is not None:
            limit = min(limit, left - WAIT_DEADLINE_MARGIN_S)
        deadline = loop.time() + limit
        kv = self.node.machine.kv
        while True:
            changed = self._changed
            entries = [kv.get(ns, k) for k in keys]
            ready = all((e.version if e is not None else 0) != v for e, v in zip(entries, known))
            left_s = deadline - loop.time()
            if ready or left_s <= 0:
                return cpb.KVWaitResponse(ready=ready, answered_by=self.node_id,
                                          entries=[_entry(k, e) for k, e in zip(keys, entries)])
            try:
                await asyncio.wait_for(changed.wait(), min(left_s, WAIT_RECHECK_S))
            except asyncio.TimeoutError:
                pass

    # -- expiry -------------------------------------------------------------------------------------

    async def _expire_idle(self) -> None:
        idle_ms = int(self.idle_expiry_s * 1000)
        while True:
            await asyncio.sleep(self.check_period_s)
            machine = self.node.machine
            if self.node.serving_term() is None or machine.schema_version < codec.KV_SCHEMA_VERSION:
                continue
            now_ms = self._wall_ms()
            if not machine.kv.idle(now_ms, idle_ms):
                continue
            try:
                dropped = await asyncio.wait_for(self.node.submit(KVExpire(now_ms, idle_ms)), COMMIT_TIMEOUT_S)
            except (asyncio.TimeoutError, CommitError) as e:
                log.info("idle rendezvous namespaces not expired yet (%s); retried", e or "timeout")
                continue
            for job, run in dropped or ():
                log.info("rendezvous %s/%s expired: no write for %.0f s", job, run, self.idle_expiry_s)
