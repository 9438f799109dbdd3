"""When a follower (or a job port process) gives up a call it forwarded: ``routing.Router.
_forward_while_leader``, with a stand-in forwarder and no processes.

The behaviour on real nodes (a Raft link reset with ``ss -K``) is in
``test_forwarding_raft_blip.py``.
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import grpc
import pytest

from lighthouse_cluster.server.forwarding import PeerChannels, forward_error
from lighthouse_cluster.server.job_port_process import LeaderAddress, NodeView
from lighthouse_cluster.server.routing import Router

OLD, NEW = LeaderAddress("n1", "10.0.0.1:29510"), LeaderAddress("n3", "10.0.0.3:29510")


class RacingForwarder:
    """A forward that waits for its answer and, cancelled, fails instead (its answer raced the
    cancel, as asyncio.wait_for lets happen)."""

    def __init__(self) -> None:
        self.started = asyncio.Event()

    def forward(self, leader: str, raw: bytes, timeout: float | None, job: str = "default") -> "asyncio.Future[bytes]":
        return asyncio.ensure_future(self._forward())  # a future, as QuorumForwarder.forward gives

    async def _forward(self) -> bytes:
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise forward_error(grpc.StatusCode.UNAVAILABLE, "forwarding stream closed") from None
        return b""

    def close(self) -> None:
        pass


async def loop_turns(n: int = 10) -> None:
    """Let the event loop run ``n`` turns: enough for the call to see a change (it takes three)."""
    for _ in range(n):
        await asyncio.sleep(0)


def router_on(view: NodeView) -> tuple[Router, RacingForwarder]:
    router = Router(view, PeerChannels(), "n2/job", 65536)
    forwarder = RacingForwarder()
    router.forwarder = forwarder  # type: ignore[assignment]
    return router, forwarder


async def call_forwarded_to_old() -> tuple[NodeView, Router, "asyncio.Future[bytes | None]"]:
    """A router that knows OLD as leader, and a call it forwarded there (the forward started)."""
    view = NodeView()
    view.leader = OLD
    router, forwarder = router_on(view)
    call = asyncio.ensure_future(router._forward_while_leader(OLD.client_address, b"req", 5.0))
    await forwarder.started.wait()
    return view, router, call


def test_a_forwarded_call_waits_through_an_unknown_leader_and_gives_up_for_another() -> None:
    async def main() -> None:
        view, router, call = await call_forwarded_to_old()
        view.leader = None  # the Raft link to the leader dropped: no leader known for a moment
        router.leadership_changed()
        await loop_turns()
        assert not call.done(), "the call was given up while the leader was only unknown"
        view.leader = OLD  # the link is back: same leader
        router.leadership_changed()
        await loop_turns()
        assert not call.done()
        view.leader = NEW  # Raft names another leader: the call goes there
        router.leadership_changed()
        assert await asyncio.wait_for(call, 5) is None
    asyncio.run(main())


def test_a_forward_that_fails_as_it_is_given_up_logs_no_unretrieved_error() -> None:
    errors: list[dict[str, Any]] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        view, router, call = await call_forwarded_to_old()
        view.leader = NEW
        router.leadership_changed()
        assert await asyncio.wait_for(call, 5) is None
        for _ in range(3):
            await asyncio.sleep(0)  # the forward task ends with its error
        gc.collect()  # an unretrieved task error is reported when the task is collected
        await asyncio.sleep(0)
    asyncio.run(main())
    assert [c.get("message") for c in errors] == []


def test_a_forwarded_call_whose_client_went_away_is_cancelled_not_given_up() -> None:
    async def main() -> None:
        view, router, call = await call_forwarded_to_old()
        call.cancel()  # gRPC cancels the handler: the caller is gone
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(call, 5)
        assert call.cancelled() and router._forwards == {}
    asyncio.run(main())


def test_waiting_forwarded_calls_hold_no_task_each_besides_their_forward() -> None:
    """A follower holds one forwarded call per replica group it serves while a round is collected
    (thousands at N=4096): each is its handler and its forward, and a leader change is one pass
    over them, not a task and an ``asyncio.wait`` per call (docs/design/follower-forwarding.md)."""
    async def main() -> None:
        view = NodeView()
        view.leader = OLD
        router, forwarder = router_on(view)
        base = len(asyncio.all_tasks())
        calls = [asyncio.ensure_future(router._forward_while_leader(OLD.client_address, b"req", 5.0))
                 for _ in range(200)]
        await loop_turns()
        assert len(asyncio.all_tasks()) - base == 2 * len(calls)  # 3 per call before
        view.leader = None  # unknown for a moment: every call keeps waiting
        router.leadership_changed()
        await loop_turns()
        assert not any(c.done() for c in calls) and len(router._forwards) == len(calls)
        view.leader = NEW
        router.leadership_changed()
        assert await asyncio.wait_for(asyncio.gather(*calls), 5) == [None] * len(calls)
        assert router._forwards == {}
    asyncio.run(main())
