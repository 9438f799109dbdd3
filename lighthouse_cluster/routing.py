"""Routing calls to the leader: channels to peers, Quorum forwarding and heartbeat batching.

A follower does not answer Quorum itself: it forwards the caller's bytes to the node it believes
leads and relays the leader's bytes back unparsed. Forwarded calls carry ``FORWARDED_HEADER`` so
they are never forwarded twice; a node that receives a forwarded call but no longer leads
answers UNAVAILABLE and the origin re-routes.

Heartbeats are fire-and-forget in torchft (every 100 ms, no deadline): a follower acknowledges
them at once and forwards the ids it saw in one batch per ``HEARTBEAT_FLUSH_S`` to the leader.
The first heartbeat of a replica the follower has not forwarded recently goes out at once: a
replica that just started must count as healthy at the leader as early as it would with a
single lighthouse, or a round already in progress could leave it out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import grpc

from .proto import lighthouse_cluster_pb2 as cpb
from .tls import ClientTLS, aio_channel

log = logging.getLogger(__name__)

FORWARDED_HEADER = "x-lighthouse-cluster-forwarded-by"
QUORUM_METHOD = "/torchft.LighthouseService/Quorum"
FORWARD_HEARTBEATS_METHOD = "/lighthouse_cluster.LighthouseCluster/ForwardHeartbeats"
HEARTBEAT_FLUSH_S = 0.05
HEARTBEAT_BATCH_TIMEOUT_S = 1.0
# A replica not forwarded for this long is treated as new: its next heartbeat is sent at once.
NEW_REPLICA_AFTER_S = 1.0

# Channel options shared by every node-to-node channel: fail fast on a dead peer.
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 500),
    ("grpc.keepalive_time_ms", 10_000),
]


def _identity(x: bytes) -> bytes:
    return x


class PeerChannels:
    """One long-lived grpc.aio channel per peer client address."""

    def __init__(self, tls: ClientTLS | None = None) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._tls = tls  # None: plaintext; else how to dial peers' TLS client ports

    def get(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = aio_channel(address, self._tls, CHANNEL_OPTIONS)
            self._channels[address] = ch
        return ch

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close(grace=None)
        self._channels.clear()


class QuorumForwarder:
    """Sends a raw ``LighthouseQuorumRequest`` to the leader and returns its raw response."""

    def __init__(self, channels: PeerChannels, node_id: str) -> None:
        self._channels = channels
        self._metadata = ((FORWARDED_HEADER, node_id),)

    async def forward(self, leader_address: str, request: bytes, timeout: float | None) -> bytes:
        call = self._channels.get(leader_address).unary_unary(
            QUORUM_METHOD, request_serializer=_identity, response_deserializer=_identity)
        return await call(request, timeout=timeout, metadata=self._metadata, wait_for_ready=False)


class HeartbeatBatcher:
    """Collects heartbeat replica ids on a follower and forwards them to the leader in batches."""

    def __init__(self, channels: PeerChannels, node_id: str, leader_address: Callable[[], str | None]) -> None:
        self._channels = channels
        self._node_id = node_id
        self._leader_address = leader_address
        self._pending: set[str] = set()
        self._last_sent: dict[str, float] = {}
        self._urgent = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._in_flight: set[asyncio.Task[None]] = set()
        self.forwarded = 0
        self.failed_batches = 0

    def add(self, replica_id: str) -> None:
        self._pending.add(replica_id)
        last = self._last_sent.get(replica_id)
        if last is None or time.monotonic() - last > NEW_REPLICA_AFTER_S:
            self._urgent.set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        for task in list(self._in_flight):
            task.cancel()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._urgent.wait(), HEARTBEAT_FLUSH_S)
            except asyncio.TimeoutError:
                pass
            self._urgent.clear()
            if not self._pending:
                continue
            leader = self._leader_address()
            if leader is None:
                await asyncio.sleep(HEARTBEAT_FLUSH_S)
                continue  # keep them for when a leader is known
            batch, self._pending = self._pending, set()
            now = time.monotonic()
            for rid in batch:
                self._last_sent[rid] = now
            if len(self._last_sent) > 4 * len(batch) + 1024:
                self._last_sent = {r: t for r, t in self._last_sent.items() if now - t <= NEW_REPLICA_AFTER_S}
            # Each batch is its own task, so a leader that stopped answering never holds up the
            # batches for the next one.
            task = asyncio.get_running_loop().create_task(self._send(leader, batch))
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)

    async def _send(self, leader: str, batch: set[str]) -> None:
        call = self._channels.get(leader).unary_unary(
            FORWARD_HEARTBEATS_METHOD,
            request_serializer=cpb.HeartbeatBatch.SerializeToString,
            response_deserializer=cpb.HeartbeatBatchResponse.FromString)
        try:
            await call(cpb.HeartbeatBatch(from_node=self._node_id, replica_ids=sorted(batch)),
                       timeout=HEARTBEAT_BATCH_TIMEOUT_S)
            self.forwarded += len(batch)
        except grpc.aio.AioRpcError as e:
            self.failed_batches += 1
            log.debug("heartbeat batch to %s failed: %s", leader, e.code())
            # Not re-queued: a late heartbeat would overstate how recently the replica was alive,
            # and its next one arrives within 100 ms.
