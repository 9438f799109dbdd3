"""Simulated replica groups: torchft's lighthouse traffic without a trainer.

A ``SimulatedReplicaGroup`` does what a torchft manager server does against the lighthouse:
heartbeats every 100 ms and one Quorum call per step, with a deadline, through one node's
client address (any node works: followers forward). Used by the `up --demo`, the integration
tests, the fault-injection harness and the benchmarks. Every round is reported to ``on_round``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc

from lighthouse_cluster.proto import torchft_pb2 as pb
from lighthouse_cluster.proto import torchft_pb2_grpc as pb_grpc


@dataclass(frozen=True, slots=True)
class RoundResult:
    replica_id: str
    step: int
    quorum_id: int | None            # None when the call failed
    participants: tuple[str, ...]
    latency_s: float
    started: float                   # time.monotonic() when the call was sent
    error: str = ""                  # gRPC status name when the call failed
    endpoint: str = ""


@dataclass
class SimulatedReplicaGroup:
    """One replica group's lighthouse client loop; see the module docstring."""

    replica_id: str
    endpoint: str
    quorum_timeout_s: float = 5.0
    heartbeat_interval_s: float = 0.1
    step_time_s: float = 0.0
    world_size: int = 1
    data: str = ""
    # The member address in Quorum requests (torchft: the manager server, which the lighthouse's
    # kill reaches); empty = the placeholder ``sim://ID``.
    address: str = ""
    on_round: Callable[[RoundResult], None] | None = None
    # Other nodes to move to when the current one is unreachable (what a client with the
    # endpoint list does); empty = stay on ``endpoint``.
    fallback_endpoints: tuple[str, ...] = ()
    step: int = 0
    rounds: list[RoundResult] = field(default_factory=list)
    _channel: grpc.aio.Channel | None = None

    def _stub(self) -> pb_grpc.LighthouseServiceStub:
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.endpoint)
        return pb_grpc.LighthouseServiceStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    def switch_endpoint(self, endpoint: str) -> None:
        """Point later calls at another node (the open channel is closed lazily)."""
        if endpoint != self.endpoint:
            old, self._channel = self._channel, None
            self.endpoint = endpoint
            if old is not None:
                asyncio.get_running_loop().create_task(old.close())

    async def quorum_once(self) -> RoundResult:
        request = pb.LighthouseQuorumRequest(requester=pb.QuorumMember(
            replica_id=self.replica_id, address=self.address or f"sim://{self.replica_id}", store_address=f"sim-store://{self.replica_id}",
            step=self.step, world_size=self.world_size, data=self.data))
        started = time.monotonic()
        try:
            resp = await self._stub().Quorum(request, timeout=self.quorum_timeout_s)
        except grpc.aio.AioRpcError as e:
            result = RoundResult(self.replica_id, self.step, None, (), time.monotonic() - started, started,
                                 error=e.code().name, endpoint=self.endpoint)
        else:
            q = resp.quorum
            result = RoundResult(self.replica_id, self.step, q.quorum_id,
                                 tuple(m.replica_id for m in q.participants), time.monotonic() - started, started,
                                 endpoint=self.endpoint)
            self.step = max(m.step for m in q.participants) + 1 if q.participants else self.step + 1
        self.rounds.append(result)
        if result.error == "UNAVAILABLE" and self.fallback_endpoints:
            ring = [self.endpoint, *[e for e in self.fallback_endpoints if e != self.endpoint]]
            self.switch_endpoint(ring[1 % len(ring)])
            self.fallback_endpoints = tuple(ring[1:] + ring[:1])
        if self.on_round is not None:
            self.on_round(result)
        return result

    async def heartbeat_loop(self) -> None:
        while True:
            try:
                await self._stub().Heartbeat(pb.LighthouseHeartbeatRequest(replica_id=self.replica_id), timeout=1.0)
            except grpc.aio.AioRpcError:
                pass  # torchft ignores heartbeat failures too
            await asyncio.sleep(self.heartbeat_interval_s)

    async def run(self, rounds: int | None = None, until: Callable[[], bool] | None = None) -> list[RoundResult]:
        """Heartbeat in the background and do quorum rounds until ``rounds`` are done or
        ``until()`` is true."""
        hb = asyncio.get_running_loop().create_task(self.heartbeat_loop())
        try:
            done = 0
            while (rounds is None or done < rounds) and not (until is not None and until()):
                result = await self.quorum_once()
                done += 1
                if result.error:
                    await asyncio.sleep(0.05)  # torchft's manager would retry its step the same way
                elif self.step_time_s:
                    await asyncio.sleep(self.step_time_s)
            return self.rounds
        finally:
            hb.cancel()
            try:
                await hb
            except asyncio.CancelledError:
                pass
