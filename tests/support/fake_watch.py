"""An in-process fake lighthouse-cluster node for ftclient's liveness tests.

``FakeWatchNode`` serves, on a loopback port, what ftclient's lighthouse client and liveness
stream call: ``LighthouseCluster.Leader`` (the leader it is told to name), ``LighthouseCluster.
Watch`` (accept, refuse with FAILED_PRECONDITION as a follower does, or answer UNIMPLEMENTED as an
older cluster does), torchft's ``Heartbeat`` (recorded) and ``Quorum`` (a minimal round: once
``quorum_size`` distinct replicas wait, all of them get one quorum, with an id the test sets).

Each accepted stream is a ``FakeStream``: its first message, the times its keep-alives arrived,
when it closed, and ``push``/``end`` to send a ``peer_died`` notice or end it with a status.
The real generated stubs are used on both sides.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc

from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import lighthouse_cluster_pb2_grpc as cpb_grpc
from lighthouse_cluster.proto import torchft_pb2 as pb
from lighthouse_cluster.proto import torchft_pb2_grpc as pb_grpc

_END = object()


@dataclass
class FakeStream:
    replica_id: str
    keepalive_interval_ms: int
    opened_at: float = field(default_factory=time.monotonic)
    keepalives: list[float] = field(default_factory=list)
    closed_at: float | None = None
    events: queue.Queue = field(default_factory=queue.Queue)
    closed: threading.Event = field(default_factory=threading.Event)

    def push_peer_died(self, quorum_id: int, replica_ids: list[str], reason: str = "stream closed") -> None:
        self.events.put(cpb.WatchEvent(peer_died=cpb.PeerDied(quorum_id=quorum_id, replica_ids=replica_ids,
                                                              reason=reason)))

    def end(self, code: grpc.StatusCode | None = grpc.StatusCode.UNAVAILABLE, details: str = "leader gone") -> None:
        """End the stream from the server: with ``code`` (None: a plain end, status OK)."""
        self.events.put((_END, code, details))


class FakeWatchNode:
    def __init__(self, name: str = "n1", *, mode: str = "accept", term: int = 1, liveness_timeout_ms: int = 500,
                 quorum_size: int = 1) -> None:
        self.name = name
        self.mode = mode  # accept | refuse | unimplemented | invalid (INVALID_ARGUMENT) | silent (never accepts)
        self.term = term
        self.liveness_timeout_ms = liveness_timeout_ms
        self.leader_address: str | None = None  # None: this node
        self.cluster_service = True  # False: Leader answers UNIMPLEMENTED (a single lighthouse)
        self.streams: list[FakeStream] = []
        self.heartbeats: list[tuple[str, float]] = []
        self.watch_calls = 0
        self.quorum_size = quorum_size
        self.next_quorum_id = 1
        self._lock = threading.Condition()
        self._waiting: dict[str, pb.QuorumMember] = {}
        self._issued: dict[str, tuple[int, pb.Quorum]] = {}
        self._round = 0
        self._server = grpc.server(ThreadPoolExecutor(max_workers=32, thread_name_prefix=f"fake-{name}"))
        cpb_grpc.add_LighthouseClusterServicer_to_server(_Cluster(self), self._server)
        pb_grpc.add_LighthouseServiceServicer_to_server(_Lighthouse(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"
        self._server.start()

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def stop(self) -> None:
        self._server.stop(grace=None)

    def __enter__(self) -> FakeWatchNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what the tests read ----------------------------------------------------------------------

    def open_streams(self) -> list[FakeStream]:
        with self._lock:
            return [s for s in self.streams if s.closed_at is None]

    def last_stream(self) -> FakeStream | None:
        with self._lock:
            return self.streams[-1] if self.streams else None

    def heartbeat_times(self, replica_id: str | None = None) -> list[float]:
        with self._lock:
            return [t for r, t in self.heartbeats if replica_id is None or r == replica_id]

    def push_peer_died(self, quorum_id: int, replica_ids: list[str], reason: str = "stream closed") -> int:
        """Push the notice on every open stream; how many got it."""
        streams = self.open_streams()
        for s in streams:
            s.push_peer_died(quorum_id, replica_ids, reason)
        return len(streams)

    # -- Quorum ------------------------------------------------------------------------------------

    def quorum(self, member: pb.QuorumMember, context: grpc.ServicerContext) -> pb.Quorum:
        deadline = time.monotonic() + (context.time_remaining() or 60)
        with self._lock:
            self._waiting[member.replica_id] = member
            my_round = self._round
            if len(self._waiting) >= self.quorum_size:
                members = sorted(self._waiting.values(), key=lambda m: m.replica_id)
                q = pb.Quorum(quorum_id=self.next_quorum_id, participants=members)
                for m in members:
                    self._issued[m.replica_id] = (my_round, q)
                self._waiting.clear()
                self._round += 1
                self._lock.notify_all()
            while True:
                got = self._issued.get(member.replica_id)
                if got is not None and got[0] == my_round:
                    del self._issued[member.replica_id]
                    return got[1]
                left = deadline - time.monotonic()
                if left <= 0 or not context.is_active():
                    self._waiting.pop(member.replica_id, None)
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "fake quorum timed out")
                self._lock.wait(min(left, 0.1))


class _Cluster(cpb_grpc.LighthouseClusterServicer):
    def __init__(self, node: FakeWatchNode) -> None:
        self.node = node

    def Leader(self, request: Any, context: grpc.ServicerContext) -> cpb.LeaderResponse:  # noqa: N802
        n = self.node
        if not n.cluster_service:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        return cpb.LeaderResponse(leader_id="leader", leader_client_address=n.leader_address or n.address,
                                  term=n.term)

    def Watch(self, request_iterator: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        n = self.node
        with n._lock:
            n.watch_calls += 1
        if n.mode == "unimplemented" or not n.cluster_service:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        if n.mode == "refuse":
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"not the leader; the leader is {n.leader_address or 'unknown'}")
        first = next(request_iterator)
        if n.mode == "invalid":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"keepalive_interval_ms {first.keepalive_interval_ms} must be below the liveness timeout")
        stream = FakeStream(first.replica_id, first.keepalive_interval_ms)
        with n._lock:
            n.streams.append(stream)

        def closed() -> None:
            with n._lock:
                if stream.closed_at is None:
                    stream.closed_at = time.monotonic()
            stream.closed.set()

        def read() -> None:
            try:
                for _ in request_iterator:
                    stream.keepalives.append(time.monotonic())
            except Exception:  # noqa: BLE001 -- the call ended
                pass
            closed()  # the client half-closed or went away

        context.add_callback(closed)
        threading.Thread(target=read, daemon=True, name="fake-watch-reader").start()
        if n.mode != "silent":
            yield cpb.WatchEvent(accepted=cpb.WatchAccepted(leader_id=n.name, term=n.term,
                                                            liveness_timeout_ms=n.liveness_timeout_ms))
        while context.is_active() and not stream.closed.is_set():
            try:
                item = stream.events.get(timeout=0.02)
            except queue.Empty:
                continue
            if isinstance(item, tuple) and item[0] is _END:
                _, code, details = item
                closed()
                if code is None:
                    return
                context.abort(code, details)
            yield item


class _Lighthouse(pb_grpc.LighthouseServiceServicer):
    def __init__(self, node: FakeWatchNode) -> None:
        self.node = node

    def Heartbeat(self, request: Any, context: grpc.ServicerContext) -> pb.LighthouseHeartbeatResponse:  # noqa: N802
        with self.node._lock:
            self.node.heartbeats.append((request.replica_id, time.monotonic()))
        return pb.LighthouseHeartbeatResponse()

    def Quorum(self, request: Any, context: grpc.ServicerContext) -> pb.LighthouseQuorumResponse:  # noqa: N802
        return pb.LighthouseQuorumResponse(quorum=self.node.quorum(request.requester, context))
