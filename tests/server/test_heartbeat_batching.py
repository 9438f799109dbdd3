"""A follower's heartbeat batches (``forwarding.HeartbeatBatcher``), on one event loop with a
stand-in for the leader's channel (no processes): a new replica's first heartbeat goes out
without waiting for the next regular batch, and heartbeats that are all "new" (every replica heard
from less than once a second: a follower short of CPU, as at N=4096) still travel in batches, not
one call each (docs/design/heartbeat-batching.md: 1.0 heartbeats per call before, the leader at 2x
the CPU)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from support.waiting import wait_for_async
from lighthouse_cluster.server import forwarding
from lighthouse_cluster.server.forwarding import HEARTBEAT_MIN_GAP_S, NEW_REPLICA_AFTER_S, HeartbeatBatcher


class Leader:
    """What ``PeerChannels.get(address).unary_unary(...)`` gives: records each batch it is sent."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    def get(self, address: str) -> "Leader":
        assert address == "leader:1"
        return self

    def unary_unary(self, method: str, **_kwargs: Any) -> Any:
        assert method == forwarding.FORWARD_HEARTBEATS_METHOD

        async def call(request: Any, timeout: float) -> Any:
            self.batches.append(list(request.replica_ids))
            return None

        return call


def _batcher(leader: Leader) -> HeartbeatBatcher:
    batcher = HeartbeatBatcher(leader, "n2", lambda: "leader:1")  # type: ignore[arg-type]
    batcher.start()
    return batcher


def test_heartbeats_of_replicas_all_new_still_travel_in_batches() -> None:
    async def main() -> None:
        leader = Leader()
        batcher = _batcher(leader)
        count, spacing_s = 300, 0.001
        started = asyncio.get_running_loop().time()
        for i in range(count):  # each in its own loop turn, none seen in the last second
            batcher.add(f"r{i}")
            await asyncio.sleep(spacing_s)
        elapsed = asyncio.get_running_loop().time() - started
        await wait_for_async("every heartbeat forwarded", lambda: batcher.forwarded == count, 5.0, interval=0.005)
        await batcher.stop()
        assert sorted(r for b in leader.batches for r in b) == sorted(f"r{i}" for i in range(count))
        # At most one batch per HEARTBEAT_MIN_GAP_S (and the last one); one call per heartbeat before.
        assert batcher.batches == len(leader.batches) <= elapsed / HEARTBEAT_MIN_GAP_S + 2, leader.batches
    asyncio.run(main())


def test_a_new_replicas_first_heartbeat_does_not_wait_for_the_regular_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forwarding, "HEARTBEAT_FLUSH_S", 60.0)  # no regular batch within the test

    async def main() -> None:
        leader = Leader()
        batcher = _batcher(leader)
        batcher.add("fresh")
        await wait_for_async("the new replica's heartbeat forwarded", lambda: leader.batches == [["fresh"]],
                             5.0, interval=0.005)
        batcher.add("fresh")  # forwarded a moment ago: it waits for the regular batch
        await asyncio.sleep(2 * HEARTBEAT_MIN_GAP_S + 0.05)
        assert leader.batches == [["fresh"]] and NEW_REPLICA_AFTER_S > 0.1
        batcher.add("other")  # another new one: goes out at once, with the waiting repeat
        await wait_for_async("the second batch", lambda: len(leader.batches) == 2, 5.0, interval=0.005)
        assert sorted(leader.batches[1]) == ["fresh", "other"]
        await batcher.stop()
    asyncio.run(main())
