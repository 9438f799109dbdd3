"""The simulated replica group (``lighthouse_cluster.local.simulated_group``): its pure rules
(requester, classification, move-on, step), and its loop and the fault-injection client's
history against an in-process fake LighthouseService (no node processes)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import grpc
import pytest

from jepsen_like.clients import Client, ClientSettings
from jepsen_like.history import FAIL, INFO, INVOKE, OK, HistoryWriter, pair_operations
from lighthouse_cluster.local import simulated_group as sg
from lighthouse_cluster.proto import torchft_pb2 as pb
from lighthouse_cluster.proto import torchft_pb2_grpc as pb_grpc

REFUSED = "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Connection refused"


# -- pure parts -----------------------------------------------------------------------------------


@pytest.mark.parametrize("code, details, outcome", [
    (grpc.StatusCode.INVALID_ARGUMENT, "missing requester", sg.FAILED),
    (grpc.StatusCode.UNAVAILABLE, REFUSED, sg.FAILED),
    (grpc.StatusCode.UNAVAILABLE, "DNS resolution failed for nowhere:1", sg.FAILED),
    (grpc.StatusCode.UNAVAILABLE, "no leader known", sg.UNKNOWN),
    (grpc.StatusCode.UNAVAILABLE, None, sg.UNKNOWN),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", sg.UNKNOWN),
    (grpc.StatusCode.CANCELLED, "connection refused", sg.UNKNOWN),
])
def test_classify(code: grpc.StatusCode, details: str | None, outcome: str) -> None:
    assert sg.classify(code, details) == outcome


def test_should_move() -> None:
    unavailable, deadline = "UNAVAILABLE", "DEADLINE_EXCEEDED"
    assert not sg.should_move(sg.STAY, unavailable, sg.FAILED)
    assert sg.should_move(sg.ON_UNAVAILABLE, unavailable, sg.UNKNOWN)
    assert not sg.should_move(sg.ON_UNAVAILABLE, deadline, sg.UNKNOWN)
    assert sg.should_move(sg.ON_NOT_SENT, unavailable, sg.FAILED)
    assert sg.should_move(sg.ON_NOT_SENT, "INVALID_ARGUMENT", sg.FAILED)
    assert not sg.should_move(sg.ON_NOT_SENT, unavailable, sg.UNKNOWN)
    assert sg.should_move(sg.ON_ANY_ERROR, deadline, sg.UNKNOWN)
    assert not any(sg.should_move(p, "", sg.OK) for p in sg.MOVE_ON)   # an answer never moves
    with pytest.raises(ValueError, match="move_on"):
        sg.should_move("sometimes", unavailable, sg.FAILED)
    with pytest.raises(ValueError, match="move_on"):
        sg.SimulatedReplicaGroup("r", "a", move_on="sometimes")


def test_next_endpoint_cycles_through_the_list() -> None:
    ring = ("a", "b", "c")
    assert [sg.next_endpoint(e, ring) for e in ring] == ["b", "c", "a"]
    assert sg.next_endpoint("x", ring) == "a"          # not in the list: its first node
    assert sg.next_endpoint("a", ("a",)) is None       # nowhere else to go
    assert sg.next_endpoint("a", ()) is None


def test_requester_and_next_step() -> None:
    m = sg.requester("g1", 4)
    assert (m.replica_id, m.address, m.store_address, m.step, m.world_size, m.commit_failures) == \
        ("g1", "sim://g1", "sim-store://g1", 4, 1, 0)
    m = sg.requester("g1", 4, address="http://127.0.0.1:5", world_size=2, data="d", commit_failures=1)
    assert (m.address, m.world_size, m.data, m.commit_failures) == ("http://127.0.0.1:5", 2, "d", 1)
    members = [pb.QuorumMember(replica_id="a", step=3), pb.QuorumMember(replica_id="b", step=7)]
    assert sg.next_step(3, members) == 8               # a group behind catches up
    assert sg.next_step(3, []) == 4
    group = sg.SimulatedReplicaGroup("g2", "x", step=5, commit_failures=2)
    assert group.request().requester == sg.requester("g2", 5, commit_failures=2)


# -- the loop against a fake lighthouse ---------------------------------------------------------------


class FakeLighthouse(pb_grpc.LighthouseServiceServicer):
    """Answers every Quorum with a quorum of the requester alone (quorum id 1), or fails the
    next ``fail_next`` calls with INVALID_ARGUMENT; counts heartbeats."""

    def __init__(self) -> None:
        self.requests: list[pb.QuorumMember] = []
        self.heartbeats: list[str] = []
        self.fail_next = 0

    async def Quorum(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC method name
        self.requests.append(request.requester)
        if self.fail_next:
            self.fail_next -= 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad request")
        return pb.LighthouseQuorumResponse(quorum=pb.Quorum(quorum_id=1, participants=[request.requester]))

    async def Heartbeat(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.heartbeats.append(request.replica_id)
        return pb.LighthouseHeartbeatResponse()


def closed_port() -> str:
    """An address where nothing listens (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


async def with_fake(body: Any) -> Any:
    fake = FakeLighthouse()
    server = grpc.aio.server()
    pb_grpc.add_LighthouseServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        return await body(fake, f"127.0.0.1:{port}")
    finally:
        await server.stop(None)


@pytest.mark.integration
def test_group_rounds_steps_heartbeats_and_moving_on() -> None:
    async def body(fake: FakeLighthouse, live: str) -> None:
        dead = closed_port()
        sent: list[tuple[str, str]] = []
        seen: list[sg.RoundResult] = []
        group = sg.SimulatedReplicaGroup("g", dead, fallback_endpoints=(dead, live), move_on=sg.ON_NOT_SENT,
                                         retry_sleep_s=0.0, step_time_s=0.05, step=3, on_round=seen.append,
                                         on_send=lambda f, e: sent.append((f, e)))
        try:
            await group.run(rounds=3)
            beat = await group.heartbeat_once()
        finally:
            await group.close()
        first, *answered = group.rounds
        assert seen == group.rounds
        assert (first.endpoint, first.error, first.outcome, first.quorum_id, first.step) == \
            (dead, "UNAVAILABLE", sg.FAILED, None, 3)
        assert [(r.endpoint, r.outcome, r.quorum_id, r.participants, r.step) for r in answered] == \
            [(live, sg.OK, 1, ("g",), 3), (live, sg.OK, 1, ("g",), 4)]
        assert group.endpoint == live and group.step == 5
        assert [m.step for m in fake.requests] == [3, 4]
        assert ("quorum", dead) in sent and sent.count(("quorum", live)) == 2
        assert ("heartbeat", dead) in sent             # heartbeats go out beside the rounds
        assert (beat.endpoint, beat.outcome, fake.heartbeats[-1]) == (live, sg.OK, "g")

    asyncio.run(with_fake(body))


@pytest.mark.integration
def test_group_stays_by_default_and_raises_from_call_quorum() -> None:
    async def body(fake: FakeLighthouse, live: str) -> None:
        fake.fail_next = 1
        group = sg.SimulatedReplicaGroup("g", live, fallback_endpoints=(live, closed_port()))
        try:
            with pytest.raises(grpc.RpcError) as info:
                await group.call_quorum()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and group.step == 0
            q = await group.call_quorum()
            assert q.quorum_id == 1 and group.step == 1 and group.rounds == []   # call_quorum reports nothing
            fake.fail_next = 1
            r = await group.quorum_once()   # INVALID_ARGUMENT is not UNAVAILABLE: the default policy stays
            assert (r.error, r.outcome, r.details) == ("INVALID_ARGUMENT", sg.FAILED, "bad request")
            assert group.endpoint == live
        finally:
            await group.close()

    asyncio.run(with_fake(body))


@pytest.mark.integration
def test_jepsen_client_records_every_call() -> None:
    """The fault-injection client on top of the group: invoke/complete pairs with the node each
    call went through, ``fail`` for a refused connection (then it moves on), ``info`` for what
    was cut short at shutdown."""
    async def body(fake: FakeLighthouse, live: str) -> list[dict]:
        history = HistoryWriter()
        settings = ClientSettings(clients=1, heartbeat_interval_s=0.02, step_time_s=0.02, retry_sleep_s=0.0)
        client = Client("c0", [closed_port(), live], ["n1", "n2"], start=0, roaming=False, settings=settings,
                        history=history)
        assert client.node == "n1"
        def three_quorums() -> bool:
            return sum(1 for e in history.snapshot() if e["f"] == "quorum" and e["type"] == OK) >= 3

        await asyncio.wait_for(client.run(three_quorums), 10)
        assert client.node == "n2" and client.step >= 3
        return history.snapshot()

    events = asyncio.run(with_fake(body))
    quorum = [e for e in events if e["f"] == "quorum"]
    assert [(e["type"], e["node"]) for e in quorum[:4]] == [(INVOKE, "n1"), (FAIL, "n1"), (INVOKE, "n2"), (OK, "n2")]
    assert quorum[1]["value"] == {"step": 0} and quorum[1]["error"].startswith("UNAVAILABLE: ")
    assert quorum[3]["value"] == {"quorum_id": 1, "participants": ["c0"], "step": 0}
    ops = pair_operations(events)
    assert all(op.complete is not None for op in ops)                 # every invocation completed
    beats = [op for op in ops if op.f == "heartbeat"]
    assert {op.type for op in beats if op.node == "n1"} <= {FAIL, INFO}
    assert OK in {op.type for op in beats if op.node == "n2"} <= {OK, INFO}
