"""ftclient.liveness and the manager server's heartbeats around it, against in-process fake nodes
(``support.fake_watch``; real generated stubs, real gRPC on loopback).

Covered: the first message and the keep-alive pace; ``peer_died`` notices delivered; a closed
stream seen by the leader at once; a stream the leader ends is reopened (and unary heartbeats
fill the gap); a follower's FAILED_PRECONDITION and a newer leader found by other calls move the
stream to the leader; UNIMPLEMENTED and a single lighthouse fall back to unary heartbeats only;
a stream never accepted is given up; the manager server pauses unary heartbeats exactly while a
stream is accepted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import grpc
import pytest
import torch
from torch.distributed import TCPStore

from ftclient.lighthouse_client import LighthouseClient
from ftclient.liveness import LivenessStream, PeerDied, PeerDiedError
from ftclient.manager import Manager
from ftclient.manager_server import ManagerServer
from ftclient.process_group import ProcessGroupGloo
from support.fake_watch import FakeWatchNode
from support.waiting import wait_for
from support.null_transport import NullTransport

pytestmark = [pytest.mark.timeout(60), pytest.mark.exclusive]  # exclusive: runs alone (conftest)

REPLICA = "train_0:abc"


@pytest.fixture
def node() -> Iterator[FakeWatchNode]:
    with FakeWatchNode("n1") as n:
        yield n


def client(*nodes: FakeWatchNode) -> LighthouseClient:
    return LighthouseClient(",".join(n.url for n in nodes), connect_timeout=5)


def test_peer_died_error_names_the_notice() -> None:
    notice = PeerDied(quorum_id=7, replica_ids=("b:1", "c:2"), reason="stream closed")
    err = PeerDiedError(notice)
    assert err.notice is notice
    assert "b:1, c:2 of quorum 7 died (stream closed)" in str(err)
    with pytest.raises(ValueError, match="keepalive_interval"):
        LivenessStream(None, "r", keepalive_interval=0)  # type: ignore[arg-type]


@pytest.mark.integration
def test_stream_is_accepted_keeps_alive_and_delivers_notices(node: FakeWatchNode) -> None:
    notices: list[PeerDied] = []
    with client(node) as lh, LivenessStream(lh, REPLICA, keepalive_interval=0.05,
                                            on_peer_died=notices.append) as live:
        assert live.wait_accepted(5)
        assert live.accepted and live.state == "accepted"
        assert live.accepted_by is not None and live.accepted_by.liveness_timeout_ms == 500
        (stream,) = node.open_streams()
        assert (stream.replica_id, stream.keepalive_interval_ms) == (REPLICA, 50)
        time.sleep(0.5)
        gaps = [b - a for a, b in zip(stream.keepalives, stream.keepalives[1:])]
        assert len(stream.keepalives) >= 5 and max(gaps) < 0.3, gaps

        node.push_peer_died(4, ["train_1:def"], "keep-alives stopped for 500 ms")
        wait_for("the notice", lambda: notices, 5)
        assert notices == [PeerDied(4, ("train_1:def",), "keep-alives stopped for 500 ms")]
        assert live.notices == 1
    # Closing the stream is seen by the leader at once.
    closed_at = time.monotonic()
    wait_for("the leader to see the stream closed", lambda: stream.closed_at is not None, 5)
    assert stream.closed_at - closed_at < 1.0
    assert not live.accepted and live.state == "closed"


@pytest.mark.integration
def test_a_stream_the_leader_ends_is_reopened(node: FakeWatchNode) -> None:
    with client(node) as lh, LivenessStream(lh, REPLICA, keepalive_interval=0.05) as live:
        assert live.wait_accepted(5)
        first = node.last_stream()
        assert first is not None
        first.end(grpc.StatusCode.UNAVAILABLE, "stepping down")
        assert live.wait_down(5)
        wait_for("a second stream accepted", lambda: live.streams_accepted >= 2 and live.accepted, 5)
        assert len(node.streams) == 2 and node.open_streams() == [node.streams[1]]
        node.streams[1].end(None)  # a plain end (status OK) too
        wait_for("a third stream accepted", lambda: live.streams_accepted >= 3 and live.accepted, 5)


@pytest.mark.integration
def test_a_follower_refuses_and_the_stream_goes_to_the_leader() -> None:
    with FakeWatchNode("n1", term=2) as follower, FakeWatchNode("n2", term=3) as leader:
        with client(follower) as lh:
            lh.discover(5)  # n1 leads in term 2
            assert lh.target is not None and lh.target.address == follower.address
            # n1 lost the lead to n2 (term 3): it refuses streams and names n2.
            follower.mode, follower.leader_address, follower.term = "refuse", leader.address, 3
            with LivenessStream(lh, REPLICA, keepalive_interval=0.05) as live:
                wait_for("the stream accepted by the leader", lambda: live.accepted, 10)
                assert follower.watch_calls >= 1 and not follower.streams
                assert [s.replica_id for s in leader.open_streams()] == [REPLICA]


@pytest.mark.integration
def test_a_newer_leader_found_by_other_calls_moves_the_stream() -> None:
    with FakeWatchNode("n1", term=1) as old, FakeWatchNode("n2", term=2) as new:
        with client(old, new) as lh:
            new.leader_address = old.address  # n2 still names n1 (term 1 answers)
            new.term = 1
            lh.discover(5)
            with LivenessStream(lh, REPLICA, keepalive_interval=0.05) as live:
                assert live.wait_accepted(5)
                (stream,) = old.open_streams()
                # n1 hangs as leader (closes nothing); a Quorum call's watch finds n2 in term 2.
                new.leader_address, new.term = None, 2
                old.leader_address, old.term = new.address, 2
                lh.discover(5)
                wait_for("the stream moved to n2", lambda: new.open_streams() and live.accepted, 5)
                wait_for("the stream to n1 closed", lambda: stream.closed_at is not None, 5)


@pytest.mark.integration
def test_unimplemented_falls_back_to_unary_heartbeats_only() -> None:
    with FakeWatchNode("n1", mode="unimplemented") as node, client(node) as lh:
        with LivenessStream(lh, REPLICA, keepalive_interval=0.05, unsupported_retry=30) as live:
            wait_for("unsupported", lambda: live.state == "unsupported", 5)
            time.sleep(0.3)
            assert not live.accepted and node.watch_calls == 1  # not asked again before unsupported_retry


@pytest.mark.integration
def test_a_single_lighthouse_without_the_cluster_service_is_never_watched() -> None:
    with FakeWatchNode("n1") as node:
        node.cluster_service = False
        with client(node) as lh, LivenessStream(lh, REPLICA, keepalive_interval=0.05) as live:
            wait_for("unsupported", lambda: live.state == "unsupported", 5)
            assert node.watch_calls == 0 and not live.accepted


@pytest.mark.integration
def test_a_stream_never_accepted_is_given_up_and_reopened() -> None:
    with FakeWatchNode("n1", mode="silent") as node, client(node) as lh:
        with LivenessStream(lh, REPLICA, keepalive_interval=0.05, accept_timeout=0.3) as live:
            wait_for("a second stream", lambda: node.watch_calls >= 2, 5)
            assert not live.accepted
            wait_for("the first one closed", lambda: node.streams[0].closed_at is not None, 5)


# -- the manager server's unary heartbeats ---------------------------------------------------------


def _manager_server(node: FakeWatchNode, **kwargs: object) -> ManagerServer:
    return ManagerServer(replica_id=REPLICA, lighthouse_addr=node.url, hostname="127.0.0.1", bind="127.0.0.1:0",
                         store_addr="127.0.0.1:1", world_size=1, heartbeat_interval=0.05, connect_timeout=5,
                         **kwargs)  # type: ignore[arg-type]


@pytest.mark.integration
def test_unary_heartbeats_pause_while_the_stream_is_accepted(node: FakeWatchNode) -> None:
    server = _manager_server(node, liveness_interval=0.05)
    try:
        live = server.liveness
        assert live is not None and live.wait_accepted(5)
        time.sleep(0.2)  # a heartbeat sent just before the acceptance may still land
        paused_from = time.monotonic()
        time.sleep(0.5)
        assert node.heartbeat_times(REPLICA) and not [t for t in node.heartbeat_times(REPLICA) if t > paused_from]
        # The stream goes down and stays down: unary heartbeats resume at once.
        node.mode = "refuse"
        down = time.monotonic()
        node.last_stream().end(grpc.StatusCode.UNAVAILABLE, "gone")  # type: ignore[union-attr]
        wait_for("a unary heartbeat after the stream went down",
                 lambda: [t for t in node.heartbeat_times(REPLICA) if t > down], 2)
        time.sleep(0.5)
        assert len([t for t in node.heartbeat_times(REPLICA) if t > down]) >= 5
        # It comes back: they pause again.
        node.mode = "accept"
        wait_for("the stream accepted again", lambda: live.accepted, 5)
        time.sleep(0.2)
        paused_from = time.monotonic()
        time.sleep(0.4)
        assert not [t for t in node.heartbeat_times(REPLICA) if t > paused_from]
    finally:
        server.shutdown()
    assert not live.accepted


@pytest.mark.integration
def test_without_liveness_streams_unary_heartbeats_go_on(node: FakeWatchNode) -> None:
    server = _manager_server(node, liveness_interval=None)
    try:
        assert server.liveness is None
        time.sleep(0.5)
        assert len(node.heartbeat_times(REPLICA)) >= 5 and node.watch_calls == 0
    finally:
        server.shutdown()
    with FakeWatchNode("n2", mode="unimplemented") as old:
        server = _manager_server(old, liveness_interval=0.05)
        try:
            wait_for("unsupported", lambda: server.liveness is not None and server.liveness.state == "unsupported", 5)
            start = time.monotonic()
            time.sleep(0.5)
            assert len([t for t in old.heartbeat_times(REPLICA) if t > start]) >= 5
        finally:
            server.shutdown()


@pytest.mark.integration
def test_notices_reach_the_manager_servers_callback(node: FakeWatchNode) -> None:
    got: list[PeerDied] = []
    seen = threading.Event()

    def on_peer_died(notice: PeerDied) -> None:
        got.append(notice)
        seen.set()

    server = _manager_server(node, liveness_interval=timedelta(milliseconds=50), on_peer_died=on_peer_died)
    try:
        assert server.liveness is not None and server.liveness.wait_accepted(5)
        node.push_peer_died(3, ["train_1:x"])
        assert seen.wait(5)
        assert got == [PeerDied(3, ("train_1:x",), "stream closed")]
    finally:
        server.shutdown()


# -- the Manager: notices fail the step's collectives ----------------------------------------------

TIMEOUT = timedelta(seconds=10)  # collectives' timeout: "at once" must be far below it


class Groups:
    """Replica groups of Manager ranks (threads of this process) on a fake lighthouse."""

    def __init__(self, node: FakeWatchNode) -> None:
        self.node = node
        self.managers: list[Manager] = []
        self.stores: list[TCPStore] = []
        self.pool = ThreadPoolExecutor(8)

    def group(self, name: str, world_size: int = 1, pg: Callable[[], Any] = lambda: ProcessGroupGloo(timeout=TIMEOUT),
              ) -> list[Manager]:
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
        self.stores.append(store)

        def build(rank: int) -> Manager:
            return Manager(pg=pg(), load_state_dict=None, state_dict=None,
                           min_replica_size=1, use_async_quorum=False, timeout=TIMEOUT, quorum_timeout=TIMEOUT,
                           connect_timeout=TIMEOUT, rank=rank, world_size=world_size, store_addr="127.0.0.1",
                           store_port=store.port, lighthouse_addr=self.node.url, replica_id=name,
                           hostname="127.0.0.1", checkpoint_transport=NullTransport(), init_sync=False,
                           liveness_interval=timedelta(milliseconds=50))

        ranks = self.all(*[lambda r=r: build(r) for r in range(world_size)])
        live = ranks[0]._manager.liveness  # type: ignore[union-attr]
        assert live is not None and live.wait_accepted(5)
        self.managers.extend(ranks)
        return ranks

    def all(self, *calls: Callable[[], Any], timeout: float = 30) -> list[Any]:
        futs = [self.pool.submit(c) for c in calls]
        return [f.result(timeout=timeout) for f in futs]

    def stream_of(self, m: Manager) -> Any:
        streams = [s for s in self.node.open_streams() if s.replica_id == m.replica_id]
        assert len(streams) == 1, streams
        return streams[0]

    def close(self) -> None:
        for m in self.managers:
            m.shutdown(wait=False)
        self.pool.shutdown(wait=False)


@pytest.fixture
def groups() -> Iterator[Groups]:
    with FakeWatchNode("n1", quorum_size=2) as node:
        g = Groups(node)
        try:
            yield g
        finally:
            g.close()


def full_step(m: Manager, value: float) -> tuple[list[float], bool]:
    m.start_quorum()
    out = m.allreduce(torch.tensor([value])).get_future().wait().tolist()
    return out, m.should_commit()


@pytest.mark.integration
def test_a_notice_for_the_steps_quorum_fails_its_allreduce_at_once(groups: Groups) -> None:
    (a,), (b,) = groups.group("a"), groups.group("b")
    assert groups.all(lambda: full_step(a, 1.0), lambda: full_step(b, 3.0)) == [([2.0], True), ([2.0], True)]
    assert a.last_quorum_result is not None and a.last_quorum_result.quorum_id == 1

    # Both get quorum 1 again; a is in its allreduce, b never joins it (it "died").
    groups.all(a.start_quorum, b.start_quorum)
    work = a.allreduce(torch.tensor([5.0]))
    time.sleep(0.2)
    assert not work.is_completed()
    pushed = time.monotonic()
    groups.stream_of(a).push_peer_died(1, [b.replica_id])
    assert work.wait() is False  # failed: never raises
    assert work.get_future().wait().tolist() == [5.0]  # the input back
    assert time.monotonic() - pushed < 1.0, "the allreduce did not fail at once"
    err = a.errored()
    assert err is not None and isinstance(err.original_exception, PeerDiedError)
    assert err.original_exception.notice == PeerDied(1, (b.replica_id,), "stream closed")
    assert a.should_commit() is False and a.current_step() == 1
    # b was only slow (a false death): its allreduce completes the Gloo operation a aborted; a's
    # tensors are not touched by it, and b's step fails too (a's contribution is the input).
    t = torch.tensor([5.0])
    assert b.allreduce(torch.tensor([9.0])).get_future().wait().tolist() == [7.0]
    assert t.tolist() == [5.0] and b.errored() is None  # b saw a complete allreduce
    b.report_error(RuntimeError("b is out of this test"))
    assert b.should_commit() is False

    # The next quorum (id 2, a alone) commits; a notice for quorum 1 during it is ignored.
    groups.node.quorum_size, groups.node.next_quorum_id = 1, 2
    a.start_quorum()
    groups.stream_of(a).push_peer_died(1, [b.replica_id])
    wait_for("the second notice", lambda: a.peer_died_notices == 2, 5)
    assert a.allreduce(torch.tensor([7.0])).get_future().wait().tolist() == [7.0]
    assert a.errored() is None and a.should_commit() is True and a.current_step() == 2


@pytest.mark.integration
def test_a_notice_before_its_quorum_arrives_fails_that_quorums_step(groups: Groups) -> None:
    groups.node.quorum_size, groups.node.next_quorum_id = 1, 5
    (a,) = groups.group("a")
    assert full_step(a, 1.0) == ([1.0], True)
    # Between steps: a member of quorum 5 died; the lighthouse still hands out quorum 5 (it was
    # issued before the death was known). That step fails without waiting for any collective.
    groups.stream_of(a).push_peer_died(5, ["ghost:1"])
    wait_for("the notice", lambda: a.peer_died_notices == 1, 5)
    started = time.monotonic()
    assert full_step(a, 2.0) == ([2.0], False)
    assert time.monotonic() - started < 1.0
    assert isinstance(a.errored().original_exception, PeerDiedError)  # type: ignore[union-attr]
    # Quorum 6 goes on; a late notice for 5 is ignored.
    groups.node.next_quorum_id = 6
    assert full_step(a, 3.0) == ([3.0], True)
    groups.stream_of(a).push_peer_died(5, ["ghost:1"])
    wait_for("the late notice", lambda: a.peer_died_notices == 2, 5)
    assert full_step(a, 4.0) == ([4.0], True)


@pytest.mark.integration
def test_the_groups_other_ranks_get_the_notice_through_the_store(groups: Groups) -> None:
    a = groups.group("a", world_size=2)
    b = groups.group("b", world_size=2)
    assert groups.all(*[lambda m=m: full_step(m, 1.0) for m in a + b]) == [([1.0], True)] * 4
    groups.all(*[m.start_quorum for m in a + b])
    works = [m.allreduce(torch.tensor([2.0])) for m in a]  # group b's ranks never join
    time.sleep(0.2)
    pushed = time.monotonic()
    groups.stream_of(a[0]).push_peer_died(1, [b[0].replica_id])
    for work in works:
        assert work.wait() is False and work.get_future().wait().tolist() == [2.0]
    assert time.monotonic() - pushed < 1.0, "a rank's allreduce did not fail at once"
    assert all(isinstance(m.errored().original_exception, PeerDiedError) for m in a)  # type: ignore[union-attr]
    assert groups.all(*[m.should_commit for m in a]) == [False, False]
    # Group b was only slow: its ranks complete the Gloo operations the others aborted.
    assert [m.allreduce(torch.tensor([4.0])).get_future().wait().tolist() for m in b] == [[3.0], [3.0]]


@pytest.mark.integration
def test_a_refused_first_message_falls_back_to_unary_heartbeats(node: FakeWatchNode) -> None:
    node.mode = "invalid"
    with client(node) as lh, LivenessStream(lh, REPLICA, keepalive_interval=0.05, unsupported_retry=30) as live:
        wait_for("unsupported", lambda: live.state == "unsupported", 5)
        time.sleep(0.3)
        assert node.watch_calls == 1 and not live.accepted


class SlowConfigurePG(ProcessGroupGloo):
    """Joins each rendezvous only once ``go`` is set (a member that will never get there)."""

    def __init__(self) -> None:
        super().__init__(timeout=TIMEOUT)
        self.go = threading.Event()
        self.go.set()

    def configure(self, *args: Any, **kwargs: Any) -> None:
        self.go.wait(30)
        super().configure(*args, **kwargs)


@pytest.mark.integration
def test_a_notice_aborts_a_rendezvous_waiting_for_the_dead_member(groups: Groups) -> None:
    (a,) = groups.group("a")
    slow = SlowConfigurePG()
    (b,) = groups.group("b", pg=lambda: slow)
    assert groups.all(lambda: full_step(a, 1.0), lambda: full_step(b, 3.0)) == [([2.0], True), ([2.0], True)]
    # Quorum 2: b gets it but never builds its group; a waits in the rendezvous for b.
    groups.node.next_quorum_id = 2
    slow.go.clear()
    b_quorum = groups.pool.submit(b.start_quorum)
    a_step = groups.pool.submit(lambda: full_step(a, 5.0))
    wait_for("a in quorum 2's rendezvous", lambda: a._configuring_quorum_id == 2, 10)
    time.sleep(0.2)
    pushed = time.monotonic()
    groups.stream_of(a).push_peer_died(2, [b.replica_id])
    assert a_step.result(timeout=5) == ([5.0], False)
    assert time.monotonic() - pushed < 1.0, "the rendezvous was not aborted at once"
    assert isinstance(a.errored().original_exception, PeerDiedError)  # type: ignore[union-attr]
    slow.go.set()
    b_quorum.result(timeout=30)  # b's own rendezvous then times out: its step fails
    b.report_error(RuntimeError("b is out of this test"))
    assert b.should_commit() is False
    # a goes on alone with quorum 3.
    groups.node.quorum_size, groups.node.next_quorum_id = 1, 3
    assert full_step(a, 7.0) == ([7.0], True)


@pytest.mark.integration
def test_a_notice_after_the_steps_collectives_completed_fails_only_later_ones(groups: Groups) -> None:
    (a,), (b,) = groups.group("a"), groups.group("b")
    assert groups.all(lambda: full_step(a, 1.0), lambda: full_step(b, 3.0)) == [([2.0], True), ([2.0], True)]
    groups.all(a.start_quorum, b.start_quorum)
    outs = groups.all(lambda: a.allreduce(torch.tensor([1.0])).get_future().wait().tolist(),
                      lambda: b.allreduce(torch.tensor([5.0])).get_future().wait().tolist())
    assert outs == [[3.0], [3.0]]
    # b dies after the step's allreduce completed (e.g. it committed and exited): the average a
    # holds includes b's part, so a's step may commit.
    groups.stream_of(a).push_peer_died(1, [b.replica_id])
    wait_for("the notice", lambda: a.peer_died_notices == 1, 5)
    assert a.errored() is None and a.should_commit() is True
    b.report_error(RuntimeError("b is out of this test"))
    assert b.should_commit() is False
    # A collective of that quorum later fails at once: b will never take part in it.
    groups.node.quorum_size = 1
    a.start_quorum()  # the fake hands out quorum 1 again (issued before the death was known)
    started = time.monotonic()
    assert a.allreduce(torch.tensor([2.0])).get_future().wait().tolist() == [2.0]
    assert time.monotonic() - started < 1.0
    assert isinstance(a.errored().original_exception, PeerDiedError)  # type: ignore[union-attr]
    assert a.should_commit() is False
