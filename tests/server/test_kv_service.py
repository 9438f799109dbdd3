"""``server/kv_service.py`` without sockets: the servicer over a real state machine and a fake node
whose ``submit`` applies at once (as Raft would, on every node alike). A Wait woken by an applied
entry (not by its periodic re-check), refusals mapped to status codes, the "not the leader" detail
of a forwarded call, and the leader's expiry of idle namespaces."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest

from support.waiting import wait_for_async
from lighthouse_cluster.client.discovery import not_leader
from lighthouse_cluster.core import codec
from lighthouse_cluster.core.state_machine import QuorumStateMachine
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.server.forwarding import FORWARDED_HEADER, PeerChannels
from lighthouse_cluster.server.kv_service import WAIT_RECHECK_S, KVService

NS = cpb.KVNamespace(job="train", run_id="r1")


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, trailing: Any) -> None:
        super().__init__(details)
        self.code, self.details, self.trailing = code, details, trailing


class Context:
    def __init__(self, metadata: tuple[tuple[str, str], ...] = (), remaining: float | None = 5.0) -> None:
        self.metadata, self.remaining = metadata, remaining

    def time_remaining(self) -> float | None:
        return self.remaining

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    async def abort(self, code: grpc.StatusCode, details: str, trailing: Any = ()) -> None:
        raise Aborted(code, details, trailing)


class Raft:
    term = 3


class Node:
    def __init__(self, leading: bool = True) -> None:
        self.machine = QuorumStateMachine()
        self.raft = Raft()
        self.leading = leading
        self.service: KVService | None = None

    def serving_term(self) -> int | None:
        return 3 if self.leading else None

    def leader_peer(self) -> None:
        return None

    async def probe_leadership(self, term: int) -> bool:
        return True

    def submit(self, command: codec.Command) -> "asyncio.Future[Any]":
        future = asyncio.get_running_loop().create_future()
        result = self.machine.apply_bytes(codec.encode_command(command, codec.SCHEMA_VERSION))
        assert self.service is not None
        self.service.on_apply(result)
        future.set_result(result)
        return future


def service(node: Node, **kwargs: Any) -> KVService:
    svc = KVService(node, PeerChannels(), "n1", "token", **kwargs)
    node.service = svc
    return svc


def test_a_wait_wakes_on_the_applied_write() -> None:
    async def run() -> float:
        node = Node()
        svc = service(node)
        svc.start()
        try:
            waiting = asyncio.ensure_future(svc.Wait(cpb.KVWaitRequest(ns=NS, keys=["go"], timeout_ms=5000),
                                                     Context()))
            await asyncio.sleep(0.05)
            assert not waiting.done()
            started = time.monotonic()
            await svc.Set(cpb.KVSetRequest(ns=NS, key="go", value=b"now"), Context())
            answer = await asyncio.wait_for(waiting, 2.0)
            assert answer.ready and answer.entries[0].value == b"now" and answer.answered_by == "n1"
            return time.monotonic() - started
        finally:
            await svc.stop()

    assert asyncio.run(run()) < WAIT_RECHECK_S / 2


def test_a_wait_ends_not_ready_at_its_timeout() -> None:
    async def run() -> cpb.KVWaitResponse:
        svc = service(Node())
        return await svc.Wait(cpb.KVWaitRequest(ns=NS, keys=["never"], timeout_ms=30), Context())

    answer = asyncio.run(run())
    assert not answer.ready and answer.entries[0].version == 0


@pytest.mark.parametrize("request_, code, words", [
    (cpb.KVSetRequest(ns=NS, key="", value=b"v"), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    (cpb.KVSetRequest(ns=cpb.KVNamespace(job="train", run_id=""), key="k"), grpc.StatusCode.INVALID_ARGUMENT,
     "run id"),
    (cpb.KVSetRequest(ns=NS, key="k", value=b"v" * (256 * 1024 + 1)), grpc.StatusCode.INVALID_ARGUMENT, "limit"),
])
def test_refusals(request_: Any, code: grpc.StatusCode, words: str) -> None:
    async def run() -> Aborted:
        with pytest.raises(Aborted) as e:
            await service(Node()).Set(request_, Context())
        return e.value

    refused = asyncio.run(run())
    assert refused.code == code and words in refused.details


def test_a_full_namespace_is_resource_exhausted() -> None:
    async def run() -> Aborted:
        node = Node()
        node.machine = QuorumStateMachine(kv_limits=node.machine.kv.limits.__class__(max_keys=1))
        svc = service(node)
        await svc.Set(cpb.KVSetRequest(ns=NS, key="a", value=b"v"), Context())
        with pytest.raises(Aborted) as e:
            await svc.Set(cpb.KVSetRequest(ns=NS, key="b", value=b"v"), Context())
        return e.value

    assert asyncio.run(run()).code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_forwarded_call_on_a_follower_says_not_the_leader() -> None:
    async def run() -> Aborted:
        with pytest.raises(Aborted) as e:
            await service(Node(leading=False)).Get(cpb.KVGetRequest(ns=NS, key="k"),
                                                   Context(metadata=((FORWARDED_HEADER, "n2"),)))
        return e.value

    refused = asyncio.run(run())
    assert refused.code == grpc.StatusCode.UNAVAILABLE
    assert not_leader(refused.code, refused.details, refused.trailing) is not None


def test_drop_needs_the_admin_token() -> None:
    async def run() -> tuple[Aborted, cpb.KVDropResponse]:
        svc = service(Node())
        await svc.Set(cpb.KVSetRequest(ns=NS, key="k", value=b"v"), Context())
        with pytest.raises(Aborted) as e:
            await svc.DropNamespace(cpb.KVDropRequest(ns=NS), Context())
        dropped = await svc.DropNamespace(cpb.KVDropRequest(ns=NS), Context(metadata=(("authorization",
                                                                                        "Bearer token"),)))
        return e.value, dropped

    refused, dropped = asyncio.run(run())
    assert refused.code == grpc.StatusCode.UNAUTHENTICATED and dropped.dropped and dropped.keys == 1


def test_the_leader_expires_idle_namespaces() -> None:
    clock = [1_000_000]

    async def run() -> list[Any]:
        node = Node()
        svc = service(node, idle_expiry_s=60, check_period_s=0.01, wall_ms=lambda: clock[0])
        svc.start()
        try:
            await svc.Set(cpb.KVSetRequest(ns=NS, key="k", value=b"v"), Context())
            await asyncio.sleep(0.05)
            kept = list(node.machine.kv.namespaces)
            clock[0] += 60_000
            await wait_for_async("the idle namespace expired", lambda: not node.machine.kv.namespaces, 2.0)
            return [kept, list(node.machine.kv.namespaces)]
        finally:
            await svc.stop()

    kept, after = asyncio.run(run())
    assert kept == [("train", "r1")] and after == []


def test_a_cluster_still_on_the_previous_schema_refuses_writes_before_the_log() -> None:
    """A rolling upgrade: until every node reads schema 7 (``KV_SCHEMA_VERSION``) the leader writes
    the previous one, and a KV write would be an entry an older node cannot apply. It is refused
    with FAILED_PRECONDITION naming both versions, and nothing is submitted."""
    submitted: list[codec.Command] = []

    async def run() -> Aborted:
        node = Node()
        node.machine = QuorumStateMachine(max_schema_version=codec.KV_SCHEMA_VERSION - 1)
        node.submit = lambda command: submitted.append(command)  # type: ignore[method-assign]
        with pytest.raises(Aborted) as e:
            await service(node).CompareAndSet(
                cpb.KVCompareAndSetRequest(ns=NS, key="k", value=b"v", expected_version=0, request_id="r"), Context())
        return e.value

    refused = asyncio.run(run())
    assert refused.code == grpc.StatusCode.FAILED_PRECONDITION
    assert str(codec.KV_SCHEMA_VERSION) in refused.details and str(codec.KV_SCHEMA_VERSION - 1) in refused.details
    assert submitted == []
