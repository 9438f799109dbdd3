"""Clients: simulated replica groups doing quorum rounds and heartbeats, every call recorded.

Each client is one torchft replica group (replica id ``c0``, ``c1``, ...) as its manager server
talks to the lighthouse: a heartbeat every 100 ms and one Quorum call per step with a deadline.
Client ``k`` starts on node ``k mod n``; even clients stay on their node unless it refuses
connections (a killed node: they move on, like a client with the endpoint list), odd clients
also move on after any failed call (a client that load-balances). Every call is an ``invoke``
followed by ``ok``, ``fail`` (the call never reached a node: connection refused, invalid
argument) or ``info`` (unknown: a timed-out Quorum call may still have been committed).

All clients run on one asyncio event loop in a background thread (``ClientPool``).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Callable

import grpc

from lighthouse_cluster.proto import torchft_pb2 as pb
from lighthouse_cluster.proto import torchft_pb2_grpc as pb_grpc

from .history import FAIL, INFO, INVOKE, OK, HistoryWriter

_NOT_SENT = ("failed to connect", "connection refused", "connect failed", "dns resolution failed")


@dataclass
class ClientSettings:
    clients: int = 4
    quorum_timeout_s: float = 2.0
    heartbeat_interval_s: float = 0.1
    heartbeat_timeout_s: float = 1.0
    step_time_s: float = 0.05
    retry_sleep_s: float = 0.05


def classify(code: grpc.StatusCode, details: str | None) -> str:
    """``fail`` when the call certainly had no effect, else ``info`` (unknown outcome)."""
    text = (details or "").lower()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return FAIL
    if code == grpc.StatusCode.UNAVAILABLE and any(s in text for s in _NOT_SENT):
        return FAIL
    return INFO


@dataclass
class Client:
    replica_id: str
    endpoints: list[str]
    node_ids: list[str]
    start: int
    roaming: bool
    settings: ClientSettings
    history: HistoryWriter
    step: int = 0
    current: int = field(init=False, default=0)
    _channels: dict[str, grpc.aio.Channel] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.current = self.start % len(self.endpoints)

    def _stub(self) -> pb_grpc.LighthouseServiceStub:
        ep = self.endpoints[self.current]
        ch = self._channels.get(ep)
        if ch is None:
            ch = grpc.aio.insecure_channel(ep, options=[("grpc.initial_reconnect_backoff_ms", 100),
                                                        ("grpc.max_reconnect_backoff_ms", 500)])
            self._channels[ep] = ch
        return pb_grpc.LighthouseServiceStub(ch)

    @property
    def node(self) -> str:
        return self.node_ids[self.current]

    def _move_on(self) -> None:
        self.current = (self.current + 1) % len(self.endpoints)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close(grace=None)
        self._channels.clear()

    async def quorum_once(self) -> bool:
        node = self.node
        self.history.append(self.replica_id, INVOKE, "quorum", {"step": self.step}, node)
        request = pb.LighthouseQuorumRequest(requester=pb.QuorumMember(
            replica_id=self.replica_id, address=f"sim://{self.replica_id}",
            store_address=f"sim-store://{self.replica_id}", step=self.step, world_size=1))
        try:
            resp = await self._stub().Quorum(request, timeout=self.settings.quorum_timeout_s)
        except grpc.aio.AioRpcError as e:
            kind = classify(e.code(), e.details())
            self.history.append(self.replica_id, kind, "quorum", {"step": self.step}, node,
                                f"{e.code().name}: {(e.details() or '')[:120]}")
            if kind == FAIL or self.roaming:
                self._move_on()
            return False
        except asyncio.CancelledError:
            self.history.append(self.replica_id, INFO, "quorum", {"step": self.step}, node, "cancelled at shutdown")
            raise
        q = resp.quorum
        members = [m.replica_id for m in q.participants]
        self.history.append(self.replica_id, OK, "quorum",
                            {"quorum_id": q.quorum_id, "participants": members, "step": self.step}, node)
        self.step = max((m.step for m in q.participants), default=self.step) + 1
        return True

    async def heartbeat_once(self) -> None:
        node = self.node
        self.history.append(self.replica_id, INVOKE, "heartbeat", None, node)
        try:
            await self._stub().Heartbeat(pb.LighthouseHeartbeatRequest(replica_id=self.replica_id),
                                         timeout=self.settings.heartbeat_timeout_s)
        except grpc.aio.AioRpcError as e:
            self.history.append(self.replica_id, classify(e.code(), e.details()), "heartbeat", None, node,
                                f"{e.code().name}: {(e.details() or '')[:120]}")
            return
        except asyncio.CancelledError:
            self.history.append(self.replica_id, INFO, "heartbeat", None, node, "cancelled at shutdown")
            raise
        self.history.append(self.replica_id, OK, "heartbeat", None, node)

    async def run(self, stop: Callable[[], bool]) -> None:
        async def heartbeats() -> None:
            while not stop():
                await self.heartbeat_once()
                await asyncio.sleep(self.settings.heartbeat_interval_s)

        hb = asyncio.get_running_loop().create_task(heartbeats())
        try:
            while not stop():
                ok = await self.quorum_once()
                await asyncio.sleep(self.settings.step_time_s if ok else self.settings.retry_sleep_s)
        finally:
            hb.cancel()
            try:
                await hb
            except asyncio.CancelledError:
                pass
            await self.close()


class ClientPool:
    """Runs every client on one event loop thread until ``stop()``."""

    def __init__(self, endpoints: list[str], node_ids: list[str], history: HistoryWriter,
                 settings: ClientSettings | None = None) -> None:
        self.settings = settings or ClientSettings()
        self.clients = [Client(f"c{k}", endpoints, node_ids, start=k, roaming=bool(k % 2), settings=self.settings,
                               history=history) for k in range(self.settings.clients)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="jepsen-clients", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> "ClientPool":
        self._thread.start()
        return self

    def _main(self) -> None:
        async def main() -> None:
            await asyncio.gather(*(c.run(self._stop.is_set) for c in self.clients))
        try:
            asyncio.run(main())
        except BaseException as e:  # reported by stop()
            self.error = e

    def stop(self) -> None:
        """Stop and wait (bounded by one quorum deadline and a margin)."""
        self._stop.set()
        self._thread.join(self.settings.quorum_timeout_s + 10.0)
        if self._thread.is_alive():
            raise RuntimeError("clients did not stop in time")
        if self.error is not None:
            raise RuntimeError(f"client loop crashed: {self.error!r}") from self.error

    @property
    def replica_ids(self) -> list[str]:
        return [c.replica_id for c in self.clients]
