"""Liveness streams (#15 items 1 and 3, server side): ``server/liveness_streams.py``.

Unit tests drive ``LivenessStreams.serve`` through a fake servicer context (read/write/abort),
with a fake coordinator and a controlled clock. The integration tests run real node processes
(``make_cluster``) and raw gRPC clients: a watcher SIGKILLed, keep-alives that stop, the leader
SIGKILLed with streams open, Watch on a follower.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

import grpc
import pytest

from lighthouse_cluster.client.discovery import NOT_LEADER_KEY, NotLeader, not_leader
from lighthouse_cluster.core.liveness import STREAM_CLOSED
from lighthouse_cluster.core.quorum import Member, Quorum
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import lighthouse_cluster_pb2_grpc as cpb_grpc
from lighthouse_cluster.proto import torchft_pb2 as pb
from lighthouse_cluster.proto import torchft_pb2_grpc as pb_grpc
from lighthouse_cluster.local.cluster import free_ports
from lighthouse_cluster.server.config import PeerSpec
from lighthouse_cluster.server.liveness_streams import LivenessStreams
from support.waiting import wait_for_async

# -- unit: the hub through a fake context -----------------------------------------------------------


class Aborted(Exception):
    pass


class FakeContext:
    """The read/write/abort part of ``grpc.aio.ServicerContext``."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[Any] = asyncio.Queue()
        self.written: list[cpb.WatchEvent] = []
        self.status: tuple[grpc.StatusCode, str] | None = None

    async def read(self) -> Any:
        return await self.inbox.get()

    async def write(self, message: cpb.WatchEvent) -> None:
        self.written.append(message)

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: tuple = ()) -> None:
        self.status = (code, details)
        self.trailing = trailing_metadata
        raise Aborted(details)

    def send(self, replica_id: str = "", keepalive_interval_ms: int = 0) -> None:
        self.inbox.put_nowait(cpb.WatchRequest(replica_id=replica_id, keepalive_interval_ms=keepalive_interval_ms))

    def peer_died(self) -> list[cpb.PeerDied]:
        return [e.peer_died for e in self.written if e.WhichOneof("event") == "peer_died"]


class FakeRounds:
    def __init__(self) -> None:
        self.serving = True
        self.term: int | None = 3
        self.quorum: Quorum | None = None
        self.calls: list[tuple[str, ...]] = []

    def alive(self, replica_id: str) -> None:
        self.calls.append(("alive", replica_id))

    def declare_dead(self, replica_id: str, reason: str) -> None:
        self.calls.append(("dead", replica_id, reason))

    def running_quorum(self) -> Quorum | None:
        return self.quorum

    def deaths(self) -> list[tuple[str, ...]]:
        return [c for c in self.calls if c[0] == "dead"]


class FakeRaft:
    is_leader = True
    client_calls = 0

    def note_client_activity(self) -> None:
        self.client_calls += 1


class FakeNode:
    def __init__(self) -> None:
        self.raft = FakeRaft()
        self.coordinator = FakeRounds()
        self.leader: PeerSpec | None = PeerSpec("n1", "127.0.0.1:1", "127.0.0.1:2")

    def leader_peer(self) -> PeerSpec | None:
        return self.leader


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Hub:
    """A ``LivenessStreams`` on a fake node, with helpers to open streams."""

    def __init__(self, timeout_ms: int = 500, *, real_clock: bool = False) -> None:
        self.node = FakeNode()
        self.clock = Clock()
        self.streams = LivenessStreams(self.node, "n1", timeout_ms / 1000,
                                       clock=time.monotonic if real_clock else self.clock)
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.contexts: dict[str, FakeContext] = {}

    @property
    def rounds(self) -> FakeRounds:
        return self.node.coordinator

    async def open(self, replica_id: str, keepalive_interval_ms: int = 100) -> FakeContext:
        ctx = FakeContext()
        ctx.send(replica_id, keepalive_interval_ms)
        self.contexts[replica_id] = ctx
        self.tasks[replica_id] = asyncio.ensure_future(self.streams.serve(ctx))  # type: ignore[arg-type]
        await wait_for_async(f"{replica_id}'s stream to be accepted", lambda: ctx.written or self.tasks[replica_id].done(),
                             1.0, interval=0.001)
        return ctx

    async def ended(self, replica_id: str) -> tuple[grpc.StatusCode, str] | None:
        task = self.tasks[replica_id]
        await wait_for_async(f"{replica_id}'s stream to end", task.done, 1.0, interval=0.001)
        if not task.cancelled() and task.exception() is not None:
            assert isinstance(task.exception(), Aborted)
        return self.contexts[replica_id].status


def test_the_first_message_is_answered_and_counts_as_alive() -> None:
    async def main() -> None:
        hub = Hub()
        ctx = await hub.open("a")
        accepted = ctx.written[0].accepted
        assert (accepted.leader_id, accepted.term, accepted.liveness_timeout_ms) == ("n1", 3, 500)
        assert hub.streams.open_streams == 1 and hub.rounds.calls == [("alive", "a")]
        assert hub.node.raft.client_calls == 1  # a client's call: the Raft leader stays awake
        ctx.send()  # a keep-alive
        await wait_for_async("the keep-alive", lambda: len(hub.rounds.calls) == 2, 1.0, interval=0.001)
        assert hub.node.raft.client_calls == 2
        hub.streams.stop()
        assert (await hub.ended("a"))[0] == grpc.StatusCode.UNAVAILABLE
        assert hub.rounds.deaths() == []  # a node shutting down declares nobody dead
    asyncio.run(main())


@pytest.mark.parametrize("replica_id, interval, message", [
    ("", 100, "the first WatchRequest must name replica_id"),
    ("x" * 1025, 100, "replica_id is longer than 1024 characters"),
    ("a", 500, "keepalive_interval_ms 500 must be below the liveness timeout (500 ms), or 0 for unspecified"),
    ("a", -1, "keepalive_interval_ms -1 must be below the liveness timeout (500 ms), or 0 for unspecified"),
])
def test_an_invalid_first_message_is_refused(replica_id: str, interval: int, message: str) -> None:
    async def main() -> None:
        hub = Hub()
        await hub.open(replica_id, interval)
        assert await hub.ended(replica_id) == (grpc.StatusCode.INVALID_ARGUMENT, message)
        assert hub.streams.open_streams == 0 and hub.rounds.calls == []
    asyncio.run(main())


def test_a_follower_refuses_naming_the_leader() -> None:
    async def main() -> None:
        hub = Hub()
        hub.node.raft.is_leader = False
        hub.node.leader = PeerSpec("n2", "127.0.0.1:3", "127.0.0.1:4")
        await hub.open("a")
        assert await hub.ended("a") == (grpc.StatusCode.FAILED_PRECONDITION,
                                        "node n1 is not the leader; the leader is n2 at 127.0.0.1:4")
        # The same, typed (client.discovery.not_leader), beside the sentence older clients read.
        context = hub.contexts["a"]
        assert not_leader(*context.status, context.trailing) == NotLeader("n2", "127.0.0.1:4", 0)
        assert context.trailing[0][0] == NOT_LEADER_KEY
        hub.node.leader = None
        await hub.open("b")
        code, message = await hub.ended("b")
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "the leader is unknown" in message
        hub.node.raft.is_leader = True
        hub.rounds.serving = False  # warming up
        hub.node.leader = PeerSpec("n1", "127.0.0.1:1", "127.0.0.1:2")
        await hub.open("c")
        code, message = await hub.ended("c")
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "does not serve quorum rounds yet" in message
    asyncio.run(main())


def test_a_closed_stream_is_a_death_and_the_other_members_are_told() -> None:
    async def main() -> None:
        hub = Hub()
        hub.rounds.quorum = Quorum(7, (Member("a"), Member("b"), Member("c")), 1)
        ctxs = {r: await hub.open(r) for r in ("a", "b", "c", "outsider")}
        hub.tasks["c"].cancel()  # the client went away: gRPC cancels the handler
        await hub.ended("c")
        assert hub.rounds.deaths() == [("dead", "c", STREAM_CLOSED)]
        for r in ("a", "b"):
            await wait_for_async(f"{r}'s notice", lambda r=r: ctxs[r].peer_died(), 1.0, interval=0.001)
            assert ctxs[r].peer_died() == [cpb.PeerDied(quorum_id=7, replica_ids=["c"], reason=STREAM_CLOSED)]
        assert ctxs["outsider"].peer_died() == []
        assert hub.streams.deaths == {"stream_closed": 1, "keepalive_timeout": 0, "manager_connection_lost": 0}
        assert hub.streams.open_streams == 3 and hub.streams.notices_sent == 2
        ctxs["outsider"].inbox.put_nowait(grpc.aio.EOF)  # a half-close ends the stream: a death, no notice
        assert await hub.ended("outsider") is None  # ended with OK
        assert hub.rounds.deaths()[-1] == ("dead", "outsider", STREAM_CLOSED)
        assert hub.streams.notices_sent == 2
        hub.streams.stop()
    asyncio.run(main())


def test_a_leader_whose_event_loop_stalled_reads_the_keepalives_before_it_declares_deaths() -> None:
    """CI: a replica sending keep-alives every 100 ms was declared dead ("keep-alives stopped for
    500 ms") on a loaded machine. When the leader's event loop is held, the check's timer and the
    keep-alive that arrived meanwhile become due together, and the timer runs first (gRPC's
    reads reach the loop one iteration later). The real check loop and clock, the loop blocked
    for 0.8 s: the replica sending keep-alives stays alive; one that stopped still dies."""
    async def main() -> None:
        hub = Hub(timeout_ms=500, real_clock=True)
        hub.streams.start()
        hub.rounds.quorum = Quorum(4, (Member("a"), Member("b")), 1)
        ctxs = {r: await hub.open(r) for r in ("a", "b")}
        for _ in range(3):  # both alive, the check loop running
            await asyncio.sleep(0.1)
            for ctx in ctxs.values():
                ctx.send()
        # Both accepted and 3 keep-alives each read: both were last seen now.
        await wait_for_async("the last keep-alives read", lambda: hub.rounds.calls.count(("alive", "a")) == 4
                             and hub.rounds.calls.count(("alive", "b")) == 4, 1.0, interval=0.001)
        loop = asyncio.get_running_loop()
        loop.call_later(0.75, ctxs["a"].send)  # arrives during the stall, after the check's timer
        time.sleep(0.8)  # the leader's event loop is held
        for _ in range(3):
            await asyncio.sleep(0.1)
            ctxs["a"].send()
        assert ("dead", "a", "keep-alives stopped for 500 ms") not in hub.rounds.deaths()
        assert hub.streams.stalls_excused >= 1
        await wait_for_async("b's death", lambda: hub.rounds.deaths(), 2.0, interval=0.01)
        assert hub.rounds.deaths() == [("dead", "b", "keep-alives stopped for 500 ms")]
        hub.streams.stop()
    asyncio.run(main())


def test_keepalives_that_stop_are_a_death_after_the_timeout() -> None:
    async def main() -> None:
        hub = Hub(timeout_ms=500)
        hub.rounds.quorum = Quorum(4, (Member("a"), Member("b")), 1)
        ctxs = {r: await hub.open(r) for r in ("a", "b")}
        for _ in range(3):
            hub.clock.now += 0.3
            ctxs["a"].send()
            await wait_for_async("a's keep-alive", lambda: hub.rounds.calls[-1] == ("alive", "a"), 1.0, interval=0.001)
            hub.rounds.calls.append(("tick",))
            hub.streams.check()
            if hub.rounds.deaths():
                break
        assert hub.rounds.deaths() == [("dead", "b", "keep-alives stopped for 500 ms")]
        assert await hub.ended("b") == (grpc.StatusCode.UNAVAILABLE,
                                        "replica b declared dead: keep-alives stopped for 500 ms")
        await wait_for_async("a's notice", lambda: ctxs["a"].peer_died(), 1.0, interval=0.001)
        assert ctxs["a"].peer_died()[0] == cpb.PeerDied(quorum_id=4, replica_ids=["b"],
                                                        reason="keep-alives stopped for 500 ms")
        assert hub.streams.deaths == {"stream_closed": 0, "keepalive_timeout": 1, "manager_connection_lost": 0}
        hub.streams.stop()
    asyncio.run(main())


def test_a_replica_declared_dead_is_told_so_when_its_stream_comes_back() -> None:
    """A cut-off replica: its keep-alives stop, it is declared dead as a member of quorum 4; when
    it reconnects (the same replica id), the leader's first notice names the replica itself. A
    replica that was not declared dead, or was told once already, gets no notice."""
    async def main() -> None:
        hub = Hub(timeout_ms=500)
        hub.rounds.quorum = Quorum(4, (Member("a"), Member("b")), 1)
        await hub.open("a")
        await hub.open("b")
        hub.clock.now += 0.6
        hub.streams.check()  # neither sent a keep-alive: both declared dead
        assert {d[1] for d in hub.rounds.deaths()} == {"a", "b"}
        await hub.ended("a")
        hub.rounds.quorum = Quorum(5, (Member("c"),), 1)  # the others went on without them

        back = await hub.open("a")
        await wait_for_async("a's own notice", back.peer_died, 1.0, interval=0.001)
        assert back.written[0].WhichOneof("event") == "accepted"
        assert back.peer_died() == [cpb.PeerDied(
            quorum_id=4, replica_ids=["a"],
            reason="this replica was declared dead by leader n1 (keep-alives stopped for 500 ms)")]
        again = await hub.open("a")  # told once: a later stream gets nothing
        fresh = await hub.open("c")
        for ctx in (again, fresh):
            # A notice is written right after `accepted`, with no await between that yields
            # (FakeContext.write does not): it would be there by now.
            assert [e.WhichOneof("event") for e in ctx.written] == ["accepted"]
        hub.streams.stop()
    asyncio.run(main())


def test_losing_leadership_ends_every_stream_without_a_death() -> None:
    async def main() -> None:
        hub = Hub()
        for r in ("a", "b"):
            await hub.open(r)
        hub.rounds.serving, hub.rounds.term = False, None
        hub.streams.leadership_changed()
        for r in ("a", "b"):
            code, message = await hub.ended(r)
            assert code == grpc.StatusCode.UNAVAILABLE and "no longer serves term 3" in message
        assert hub.rounds.deaths() == [] and hub.streams.open_streams == 0
    asyncio.run(main())


def test_a_new_term_ends_the_old_terms_streams_without_a_death() -> None:
    async def main() -> None:
        hub = Hub()
        await hub.open("a")
        hub.rounds.term = 4  # deposed and elected again: the streams of term 3 end
        hub.streams.check()
        assert (await hub.ended("a"))[0] == grpc.StatusCode.UNAVAILABLE
        await hub.open("a")
        assert hub.contexts["a"].written[0].accepted.term == 4
        assert hub.rounds.deaths() == []
        hub.streams.stop()
    asyncio.run(main())


def test_a_replaced_stream_ends_without_a_death() -> None:
    async def main() -> None:
        hub = Hub()
        await hub.open("a")
        first = hub.tasks["a"]
        first_ctx = hub.contexts["a"]
        await hub.open("a")
        await wait_for_async("the first stream to end", first.done, 1.0, interval=0.001)
        assert first_ctx.status == (grpc.StatusCode.ABORTED, "replaced by a newer liveness stream for replica a")
        assert hub.rounds.deaths() == [] and hub.streams.open_streams == 1
        hub.tasks["a"].cancel()
        await hub.ended("a")
        assert hub.rounds.deaths() == [("dead", "a", STREAM_CLOSED)]
    asyncio.run(main())


# -- integration: real nodes ------------------------------------------------------------------------

WATCHER = textwrap.dedent("""
    # A replica group's process as far as liveness goes: one Watch stream to the leader with a
    # keep-alive every 100 ms, and torchft's heartbeats every 100 ms, until it is killed.
    import sys, time, queue, grpc
    from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb, lighthouse_cluster_pb2_grpc as cpb_grpc
    from lighthouse_cluster.proto import torchft_pb2 as pb, torchft_pb2_grpc as pb_grpc
    address, replica_id = sys.argv[1], sys.argv[2]
    channel = grpc.insecure_channel(address)
    deadline = time.monotonic() + 10
    while True:  # a leader just elected refuses until it serves
        requests = queue.Queue()
        requests.put(cpb.WatchRequest(replica_id=replica_id, keepalive_interval_ms=100))
        def messages(requests=requests):
            while True:
                yield requests.get()
        stream = cpb_grpc.LighthouseClusterStub(channel).Watch(messages())
        try:
            first = next(stream)
            break
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.FAILED_PRECONDITION or time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    print("accepted", first.accepted.leader_id, flush=True)
    lighthouse = pb_grpc.LighthouseServiceStub(channel)
    while True:
        requests.put(cpb.WatchRequest())
        lighthouse.Heartbeat(pb.LighthouseHeartbeatRequest(replica_id=replica_id), timeout=1.0)
        time.sleep(0.1)
""")


def spawn_watcher(address: str, replica_id: str) -> subprocess.Popen[str]:
    """A process holding a Watch stream for ``replica_id`` (and heartbeating), until killed."""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen([sys.executable, "-c", WATCHER, address, replica_id], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # bounded: the process exits (EOF) if it cannot connect
    if not line.startswith("accepted"):
        proc.kill()
        raise AssertionError(f"watcher {replica_id} not accepted: {line}{proc.stdout.read()}")
    return proc


class Watcher:
    """An in-process Watch stream that records its events with their arrival time; with
    ``follow`` it reconnects to whichever node serves as leader when its stream ends."""

    def __init__(self, cluster: Any, replica_id: str, *, keepalives: bool = True, follow: bool = False) -> None:
        self.cluster = cluster
        self.replica_id = replica_id
        self.keepalives = keepalives
        self.follow = follow
        self.events: list[tuple[float, cpb.WatchEvent]] = []
        self.status: tuple[grpc.StatusCode, str] | None = None
        self.accepted_by: list[str] = []
        self._task: asyncio.Task[None] | None = None

    async def start(self, address: str) -> "Watcher":
        """Open the stream (again while a leader just elected refuses it: it does not serve yet)."""
        deadline = time.monotonic() + 10.0
        while True:
            self.status = None
            self._task = asyncio.ensure_future(self._run(address))
            await wait_for_async(f"{self.replica_id}'s stream to be accepted",
                                 lambda: self.accepted_by or self.status, 10.0, interval=0.01)
            if self.accepted_by or self.status[0] != grpc.StatusCode.FAILED_PRECONDITION or \
                    time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert self.accepted_by, self.status
        return self

    async def _requests(self):  # type: ignore[no-untyped-def]
        yield cpb.WatchRequest(replica_id=self.replica_id, keepalive_interval_ms=100)
        while True:
            await asyncio.sleep(0.1)
            if self.keepalives:
                yield cpb.WatchRequest()

    async def _stream(self, address: str) -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            call = cpb_grpc.LighthouseClusterStub(channel).Watch(self._requests())
            try:
                async for event in call:
                    self.events.append((time.monotonic(), event))
                    if event.HasField("accepted"):
                        self.accepted_by.append(event.accepted.leader_id)
            except grpc.aio.AioRpcError as e:
                self.status = (e.code(), e.details() or "")
            else:
                self.status = (grpc.StatusCode.OK, "")

    async def _run(self, address: str) -> None:
        while True:
            await self._stream(address)
            if not self.follow:
                return
            while True:  # the next serving leader (the cluster's sync calls in a thread)
                index = await asyncio.to_thread(self.cluster.leader_index)
                if index is not None:
                    address = self.cluster.client_addresses[index]
                    break
                await asyncio.sleep(0.05)

    def peer_died(self) -> list[tuple[float, cpb.PeerDied]]:
        return [(t, e.peer_died) for t, e in self.events if e.WhichOneof("event") == "peer_died"]

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task


async def quorum(address: str, replica_id: str, step: int, timeout: float = 30.0) -> pb.Quorum:
    async with grpc.aio.insecure_channel(address) as channel:
        response = await pb_grpc.LighthouseServiceStub(channel).Quorum(pb.LighthouseQuorumRequest(
            requester=pb.QuorumMember(replica_id=replica_id, address=f"{replica_id}:1",
                                      store_address=f"{replica_id}:2", step=step, world_size=1)), timeout=timeout)
        return response.quorum


async def heartbeats(addresses: Callable[[], list[str]], replica_ids: list[str]) -> None:
    """torchft's heartbeats, every 100 ms, for ``replica_ids``, to every address given (a
    follower forwards them to the leader)."""
    channels: dict[str, grpc.aio.Channel] = {}
    try:
        while True:
            for address in addresses():
                channel = channels.setdefault(address, grpc.aio.insecure_channel(address))
                stub = pb_grpc.LighthouseServiceStub(channel)
                for rid in replica_ids:
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        await stub.Heartbeat(pb.LighthouseHeartbeatRequest(replica_id=rid), timeout=0.5)
            await asyncio.sleep(0.1)
    finally:
        for channel in channels.values():
            await channel.close()


def members(q: pb.Quorum) -> list[str]:
    return [m.replica_id for m in q.participants]


def scrape(cluster: Any, i: int, job: str = "default") -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Node ``i``'s samples, node-wide and of ``job`` (another job's left out), keyed by name and
    their labels other than ``node`` and ``job``."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{cluster.http_address(i)}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("node", "job")))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if s.labels.get("job", job) == job}


def distinct_ports(nodes: int) -> dict[str, list[int]]:
    """Client, Raft and HTTP ports from one request: picked apart, an HTTP port can be a client
    port LocalCluster picked (each list is released before the nodes bind)."""
    ports = free_ports(3 * nodes)
    return {"client_ports": ports[:nodes], "raft_ports": ports[nodes:2 * nodes], "http_ports": ports[2 * nodes:]}


DEATHS = "lighthouse_cluster_replica_deaths_total"
STREAMS = "lighthouse_cluster_liveness_streams"


@pytest.mark.integration
def test_a_killed_replica_costs_the_survivors_well_under_a_second(make_cluster: Callable[..., Any]) -> None:
    """(a) 3 replica groups in a quorum (heartbeat timeout 5 s, join timeout 60 s); a and b wait
    for their next quorum, c's process is SIGKILLed: a and b get PeerDied, and their next quorum
    ([a, b], the next id), in well under a second. Without liveness streams they would wait
    5 s for c's heartbeat to expire."""
    cluster = make_cluster(min_replicas=1, heartbeat_timeout_ms=5_000, join_timeout_ms=60_000,
                           **distinct_ports(3))
    leader, _ = cluster.wait_for_stable_leader()
    address = cluster.client_addresses[leader]

    async def main() -> None:
        beats = asyncio.ensure_future(heartbeats(lambda: [address], ["a", "b"]))
        c = await asyncio.to_thread(spawn_watcher, address, "c")
        watchers = [await Watcher(cluster, r).start(address) for r in ("a", "b")]
        try:
            await asyncio.sleep(0.3)  # every one heartbeating: the first round waits for all three
            first = await asyncio.wait_for(asyncio.gather(*(quorum(address, r, 1) for r in ("a", "b", "c"))), 30)
            assert members(first[0]) == ["a", "b", "c"]
            survivors = [asyncio.ensure_future(quorum(address, r, 2)) for r in ("a", "b")]
            await asyncio.sleep(0.5)
            assert not any(s.done() for s in survivors)  # c is healthy: they wait for it
            killed = time.monotonic()
            c.kill()
            second = await asyncio.wait_for(asyncio.gather(*survivors), 10)
            issued = time.monotonic() - killed
            assert members(second[0]) == ["a", "b"] and second[0].quorum_id == first[0].quorum_id + 1
            for w in watchers:
                await wait_for_async(f"{w.replica_id}'s PeerDied", w.peer_died, 2.0, interval=0.01)
            notices = [w.peer_died() for w in watchers]
            for notice in notices:
                assert [n for _, n in notice] == [cpb.PeerDied(quorum_id=first[0].quorum_id, replica_ids=["c"],
                                                               reason=STREAM_CLOSED)]
            told = max(t for notice in notices for t, _ in notice) - killed
            print(f"SIGKILL -> PeerDied at every survivor {told * 1000:.0f} ms, -> next quorum issued "
                  f"{issued * 1000:.0f} ms")
            assert told < 1.0 and issued < 1.0
            m = await asyncio.to_thread(scrape, cluster, leader)
            assert m[(DEATHS, (("reason", "stream_closed"),))] == 1
            assert m[(DEATHS, (("reason", "keepalive_timeout"),))] == 0
            assert m[(STREAMS, ())] == 2
        finally:
            c.kill()
            c.wait(10)
            beats.cancel()
            for w in watchers:
                await w.close()

    asyncio.run(main())


@pytest.mark.integration
def test_keepalives_that_stop_are_a_death_after_the_liveness_timeout(make_cluster: Callable[..., Any]) -> None:
    """(b) c's stream stays open but sends no keep-alive (a host cut off closes nothing): after
    about the liveness timeout (500 ms) it is dead, its stream ended UNAVAILABLE, a and b told,
    and their next quorum has no c."""
    cluster = make_cluster(min_replicas=1, heartbeat_timeout_ms=5_000, join_timeout_ms=60_000)
    leader, _ = cluster.wait_for_stable_leader()
    address = cluster.client_addresses[leader]

    async def main() -> None:
        beating = ["a", "b", "c"]  # c heartbeats until its stream opens: the first round waits for it
        beats = asyncio.ensure_future(heartbeats(lambda: [address], beating))
        watchers = [await Watcher(cluster, r).start(address) for r in ("a", "b")]
        silent = Watcher(cluster, "c", keepalives=False)
        try:
            await asyncio.sleep(0.3)
            first = await asyncio.wait_for(asyncio.gather(*(quorum(address, r, 1) for r in ("a", "b", "c"))), 30)
            assert members(first[0]) == ["a", "b", "c"]
            beating.remove("c")
            await asyncio.sleep(0.3)  # no heartbeat of c in flight any more
            await silent.start(address)
            opened = silent.events[0][0]
            for w in watchers:
                await wait_for_async(f"{w.replica_id}'s PeerDied", w.peer_died, 3.0, interval=0.01)
            notices = [w.peer_died() for w in watchers]
            for notice in notices:
                assert [n for _, n in notice] == [cpb.PeerDied(quorum_id=first[0].quorum_id, replica_ids=["c"],
                                                               reason="keep-alives stopped for 500 ms")]
            after = max(t for notice in notices for t, _ in notice) - opened
            print(f"last keep-alive -> PeerDied {after * 1000:.0f} ms (liveness timeout 500 ms)")
            assert 0.45 <= after < 1.5
            await wait_for_async("c's stream to be ended", lambda: silent.status, 2.0, interval=0.01)
            assert silent.status == (grpc.StatusCode.UNAVAILABLE,
                                     "replica c declared dead: keep-alives stopped for 500 ms")
            second = await asyncio.wait_for(asyncio.gather(*(quorum(address, r, 2) for r in ("a", "b"))), 5)
            assert members(second[0]) == ["a", "b"] and second[0].quorum_id == first[0].quorum_id + 1
        finally:
            beats.cancel()
            for w in (*watchers, silent):
                await w.close()

    asyncio.run(main())


@pytest.mark.integration
def test_a_leader_change_with_streams_open_evicts_nobody(make_cluster: Callable[..., Any]) -> None:
    """(c) The leader is SIGKILLed with three streams open: each reconnects to the new leader,
    which declares nobody dead and notifies nobody; the next round has the same members and the
    same id (a fast quorum: no quorum change)."""
    cluster = make_cluster(min_replicas=1, heartbeat_timeout_ms=5_000, join_timeout_ms=60_000,
                           **distinct_ports(3))
    leader, _ = cluster.wait_for_stable_leader()
    ids = ["a", "b", "c"]

    def live_addresses() -> list[str]:
        return [cluster.client_addresses[i] for i, m in enumerate(cluster.members) if m.running]

    async def main() -> None:
        beats = asyncio.ensure_future(heartbeats(live_addresses, ids))
        watchers = [await Watcher(cluster, r, follow=True).start(cluster.client_addresses[leader]) for r in ids]
        try:
            await asyncio.sleep(0.3)  # every one heartbeating: the first round waits for all three
            address = cluster.client_addresses[leader]
            first = await asyncio.wait_for(asyncio.gather(*(quorum(address, r, 1) for r in ids)), 30)
            assert members(first[0]) == ids
            await asyncio.to_thread(cluster.kill, leader)
            new = await asyncio.to_thread(cluster.wait_for_leader, 20.0, None, None)
            new_id = cluster.members[new].peer.node_id
            for w in watchers:
                await wait_for_async(f"{w.replica_id}'s stream on the new leader {new_id}",
                                     lambda w=w: w.accepted_by[-1] == new_id, 10.0, interval=0.02)
            address = cluster.client_addresses[new]
            second = await asyncio.wait_for(asyncio.gather(*(quorum(address, r, 2) for r in ids)), 30)
            assert members(second[0]) == ids and second[0].quorum_id == first[0].quorum_id
            await asyncio.sleep(1.0)  # several liveness timeouts: still nobody dead
            assert [w.peer_died() for w in watchers] == [[], [], []]
            m = await asyncio.to_thread(scrape, cluster, new)
            assert m[(DEATHS, (("reason", "stream_closed"),))] == 0
            assert m[(DEATHS, (("reason", "keepalive_timeout"),))] == 0
            assert m[(STREAMS, ())] == 3
        finally:
            beats.cancel()
            for w in watchers:
                await w.close()

    asyncio.run(main())


@pytest.mark.integration
def test_watch_on_a_follower_fails_naming_the_leader(make_cluster: Callable[..., Any]) -> None:
    """(d) A follower refuses a Watch stream FAILED_PRECONDITION, naming the leader's client
    address; Status shows the liveness timeout."""
    cluster = make_cluster(min_replicas=1, liveness_timeout_ms=700)
    leader, _ = cluster.wait_for_stable_leader()
    follower = (leader + 1) % 3

    async def main() -> None:
        w = Watcher(cluster, "a")
        w._task = asyncio.ensure_future(w._run(cluster.client_addresses[follower]))
        await wait_for_async("the follower's answer", lambda: w.status, 10.0, interval=0.01)
        code, message = w.status
        assert code == grpc.StatusCode.FAILED_PRECONDITION, w.status
        assert cluster.client_addresses[leader] in message and "is not the leader" in message
        await w.close()
        accepted = await Watcher(cluster, "a").start(cluster.client_addresses[leader])
        assert accepted.events[0][1].accepted.liveness_timeout_ms == 700
        await accepted.close()

    asyncio.run(main())
    st = cluster.status(follower)
    assert st is not None and st.settings.liveness_timeout_ms == 700
