"""Helpers shared by the torchft compatibility tests (test_torchft_client, test_side_by_side).

Import only after ``pytest.importorskip("torchft")``: this module needs torchft's Rust extension.

* :class:`Flags` -- the four lighthouse flags, passed identically to both lighthouses.
* :func:`torchft_lighthouse` / :func:`lighthouse_cluster` -- context managers yielding a
  :class:`Target`: torchft's own ``LighthouseServer`` (one address) or a real 3-node
  ``LocalCluster`` (three addresses, ordered follower, follower, leader, so that replica ``k``
  placed on ``addresses[k % 3]`` puts the first two replicas on followers).
* :class:`Replica` -- one replica group as a torchft manager drives the lighthouse: torchft's
  Rust ``LighthouseClient`` for quorum calls, a background heartbeat every 100 ms (as the manager
  server sends them), and a raw gRPC path (our generated stub) for what the 0.2.0 Rust client
  cannot send: ``commit_failures`` and a verbatim ``data`` string.
* :func:`start_call` / :func:`run_concurrently` -- quorum calls on threads, released together,
  every join bounded.

Conditions on server state (a heartbeat has been seen, a requester is pending) are read from the
leader's ``Status`` for our cluster and from the ``/status`` page torchft's lighthouse serves on
its gRPC port, so scripted scenarios wait for the same condition on both, never for a fixed time.
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
from torchft._torchft import LighthouseClient, LighthouseServer

from lighthouse_cluster.local.cluster import LocalCluster
from lighthouse_cluster.proto import torchft_pb2 as pb
from lighthouse_cluster.proto import torchft_pb2_grpc as pb_grpc
from support.waiting import wait_for

HEARTBEAT_INTERVAL_S = 0.1  # torchft's manager heartbeat period
CALL_GRACE_S = 5.0  # how long past its own deadline a call thread may take before a test fails

# The shape of every error torchft's Rust client raises for a failed call: tonic's Status Display.
STATUS_ERROR_SHAPE = re.compile(
    r'^status: (?P<code>[A-Za-z]+), message: "(?P<message>[^"]*)", details: \[\], '
    r"metadata: MetadataMap \{ headers: \{.*\} \}$", re.DOTALL)


@dataclass(frozen=True)
class Flags:
    min_replicas: int
    join_timeout_ms: int
    heartbeat_timeout_ms: int
    quorum_tick_ms: int = 50


# -- normalized quorum views ---------------------------------------------------------------------


@dataclass(frozen=True)
class MemberView:
    replica_id: str
    address: str
    store_address: str
    step: int
    world_size: int
    shrink_only: bool
    data: Any  # dict/None via the Rust client, the verbatim JSON string via the raw stub
    commit_failures: int | None  # None via the Rust client (its QuorumMember lacks the field)


@dataclass(frozen=True)
class QuorumView:
    quorum_id: int
    members: tuple[MemberView, ...]
    created_s: float

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(m.replica_id for m in self.members)

    @property
    def steps(self) -> tuple[tuple[str, int], ...]:
        return tuple((m.replica_id, m.step) for m in self.members)


def _view_from_rust(q: Any) -> QuorumView:
    return QuorumView(
        quorum_id=q.quorum_id,
        members=tuple(MemberView(p.replica_id, p.address, p.store_address, p.step, p.world_size, p.shrink_only,
                                 p.data, None) for p in q.participants),
        created_s=q.created.seconds + q.created.nanos / 1e9,
    )


def _view_from_proto(q: pb.Quorum) -> QuorumView:
    return QuorumView(
        quorum_id=q.quorum_id,
        members=tuple(MemberView(p.replica_id, p.address, p.store_address, p.step, p.world_size, p.shrink_only,
                                 p.data, p.commit_failures) for p in q.participants),
        created_s=q.created.seconds + q.created.nanos / 1e9,
    )


# -- lighthouses -----------------------------------------------------------------------------------


class Target:
    """One lighthouse under test, seen through the addresses a torchft client would use."""

    name: str
    flags: Flags
    addresses: list[str]

    def logs(self) -> str:
        return ""

    def heartbeat_ages(self) -> dict[str, float] | None:
        """Seconds since each replica's last heartbeat as the deciding lighthouse sees it."""
        raise NotImplementedError

    def pending_count(self) -> int | None:
        """How many requesters are registered for the next quorum (healthy or not)."""
        raise NotImplementedError

    def wait_heartbeats_seen(self, replica_ids: list[str], timeout: float = 5.0) -> None:
        """Wait until the deciding lighthouse counts every one of ``replica_ids`` as healthy."""
        limit = self.flags.heartbeat_timeout_ms / 1000.0

        def seen() -> bool:
            ages = self.heartbeat_ages()
            return ages is not None and all(r in ages and ages[r] < limit for r in replica_ids)

        wait_for(f"{self.name}: heartbeats of {replica_ids} seen", seen, timeout, context=self.logs, interval=0.01)

    def wait_pending(self, n: int, timeout: float = 5.0) -> None:
        wait_for(f"{self.name}: {n} pending requester(s)", lambda: self.pending_count() == n, timeout,
                 context=self.logs, interval=0.01)

    def wait_all_expired(self, timeout: float = 10.0) -> None:
        """Wait until no replica is healthy any more (nothing left over from an earlier test)."""
        limit = self.flags.heartbeat_timeout_ms / 1000.0

        def expired() -> bool:
            ages = self.heartbeat_ages()
            return ages is not None and all(a >= limit for a in ages.values())

        wait_for(f"{self.name}: every heartbeat expired", expired, timeout, context=self.logs, interval=0.01)


class TorchftTarget(Target):
    _PENDING = re.compile(r"\[(\d+)/(\d+) participants healthy\]")
    _HEARTBEAT = re.compile(r"^\s*(\S+): seen ([0-9.]+)s ago\s*$", re.MULTILINE)

    def __init__(self, port: int, flags: Flags) -> None:
        self.name = "torchft LighthouseServer"
        self.flags = flags
        self.port = port
        self.addresses = [f"http://127.0.0.1:{port}"]

    def _status_page(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/status", timeout=2) as r:
            return r.read().decode()

    def heartbeat_ages(self) -> dict[str, float]:
        return {rid: float(age) for rid, age in self._HEARTBEAT.findall(self._status_page())}

    def pending_count(self) -> int:
        m = self._PENDING.search(self._status_page())
        assert m is not None, "torchft's /status page has no '[h/p participants healthy]' part"
        return int(m.group(2))


class ClusterTarget(Target):
    def __init__(self, cluster: LocalCluster, flags: Flags, leader: int) -> None:
        self.name = "lighthouse-cluster"
        self.flags = flags
        self.cluster = cluster
        self.leader = leader
        followers = [i for i in range(cluster.nodes) if i != leader]
        self.order = followers + [leader]
        self.addresses = [f"http://{cluster.client_addresses[i]}" for i in self.order]

    def logs(self) -> str:
        return self.cluster.tail_logs(25)

    def _leader_status(self):
        i = self.cluster.leader_index()
        return None if i is None else self.cluster.status(i)

    def heartbeat_ages(self) -> dict[str, float] | None:
        st = self._leader_status()
        if st is None or not st.serving:
            return None
        return {h.replica_id: h.age_ms / 1000.0 for h in st.heartbeats}

    def pending_count(self) -> int | None:
        st = self._leader_status()
        if st is None or not st.serving:
            return None
        return len(st.pending)


@contextmanager
def torchft_lighthouse(flags: Flags) -> Iterator[TorchftTarget]:
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=flags.min_replicas,
                              join_timeout_ms=flags.join_timeout_ms, quorum_tick_ms=flags.quorum_tick_ms,
                              heartbeat_timeout_ms=flags.heartbeat_timeout_ms)
    try:
        yield TorchftTarget(int(server.address().rsplit(":", 1)[1]), flags)
    finally:
        server.shutdown()


@contextmanager
def lighthouse_cluster(root: Path, flags: Flags, nodes: int = 3) -> Iterator[ClusterTarget]:
    with LocalCluster(root, nodes=nodes, min_replicas=flags.min_replicas, join_timeout_ms=flags.join_timeout_ms,
                      quorum_tick_ms=flags.quorum_tick_ms, heartbeat_timeout_ms=flags.heartbeat_timeout_ms,
                      fork_nodes=True) as cluster:
        # The leader every node follows: three nodes started at once sometimes elect one that a
        # start-up candidate (which missed it) deposes a moment later, and the tests place groups
        # by the leader (the same race as test_partition's).
        leader, _ = cluster.wait_for_stable_leader(timeout=30.0)
        yield ClusterTarget(cluster, flags, leader)


def on_both(root: Path, flags: Flags, scenario: Callable[[Target], Any]) -> tuple[Any, Any, str]:
    """Run ``scenario`` against torchft's lighthouse, then against a fresh 3-node cluster with the
    same flags. Returns (torchft outcome, cluster outcome, cluster log tail)."""
    with torchft_lighthouse(flags) as ref:
        theirs = scenario(ref)
    with lighthouse_cluster(root, flags) as ours:
        try:
            mine = scenario(ours)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{ours.logs()}") from e
        logs = ours.logs()
    return theirs, mine, logs


# -- replicas ---------------------------------------------------------------------------------------


class Replica:
    """One replica group's lighthouse traffic, as torchft's manager sends it."""

    def __init__(self, replica_id: str, address: str, *, world_size: int = 1) -> None:
        self.replica_id = replica_id
        self.address = address
        self.world_size = world_size
        connect = timedelta(seconds=5)
        self._client = LighthouseClient(addr=address, connect_timeout=connect)
        self._hb_client = LighthouseClient(addr=address, connect_timeout=connect)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_heartbeat_started: float | None = None
        self.heartbeat_errors: list[BaseException] = []

    # heartbeats

    def heartbeat(self, via: str | None = None, timeout: float = 2.0) -> None:
        client = self._hb_client if via is None else LighthouseClient(addr=via, connect_timeout=timedelta(seconds=5))
        client.heartbeat(self.replica_id, timeout=timedelta(seconds=timeout))

    def start_heartbeats(self) -> "Replica":
        assert self._thread is None, "heartbeats already running"
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name=f"hb-{self.replica_id}", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self._hb_client.heartbeat(self.replica_id, timeout=timedelta(seconds=1))
                self.last_heartbeat_started = started
            except Exception as e:  # recorded; a test asserting on health will notice
                self.heartbeat_errors.append(e)
            self._stop.wait(HEARTBEAT_INTERVAL_S)

    def stop_heartbeats(self) -> float | None:
        """Stop heartbeating; returns when the last heartbeat that reached the lighthouse started."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            assert not self._thread.is_alive(), f"heartbeat thread of {self.replica_id} did not stop"
            self._thread = None
        return self.last_heartbeat_started

    # quorum

    def member(self, **kw: Any) -> dict[str, Any]:
        return dict(address=f"mgr-{self.replica_id}:1", store_address=f"store-{self.replica_id}:2",
                    world_size=self.world_size) | kw

    def quorum(self, timeout: float, *, step: int = 0, shrink_only: bool = False, data: dict | None = None,
               **member: Any) -> QuorumView:
        """torchft's Rust LighthouseClient.quorum (what torchft's manager calls)."""
        m = self.member(**member)
        q = self._client.quorum(replica_id=self.replica_id, timeout=timedelta(seconds=timeout),
                                address=m["address"], store_address=m["store_address"], step=step,
                                world_size=m["world_size"], shrink_only=shrink_only, data=data)
        return _view_from_rust(q)

    def raw_quorum(self, timeout: float, *, step: int = 0, shrink_only: bool = False, data: str = "",
                   commit_failures: int = 0, **member: Any) -> QuorumView:
        """The same RPC through our generated stub: sends commit_failures and a verbatim data string."""
        m = self.member(**member)
        request = pb.LighthouseQuorumRequest(requester=pb.QuorumMember(
            replica_id=self.replica_id, address=m["address"], store_address=m["store_address"], step=step,
            world_size=m["world_size"], shrink_only=shrink_only, data=data, commit_failures=commit_failures))
        with grpc.insecure_channel(self.address.removeprefix("http://")) as channel:
            response = pb_grpc.LighthouseServiceStub(channel).Quorum(request, timeout=timeout)
        return _view_from_proto(response.quorum)


@contextmanager
def replica_set() -> Iterator[Callable[..., Replica]]:
    """A factory for replicas whose heartbeat threads are stopped on exit, whatever happens."""
    made: list[Replica] = []

    def make(replica_id: str, address: str, **kw: Any) -> Replica:
        r = Replica(replica_id, address, **kw)
        made.append(r)
        return r

    try:
        yield make
    finally:
        for r in made:
            r.stop_heartbeats()


# -- calls on threads -----------------------------------------------------------------------------------


@dataclass
class CallResult:
    name: str
    started: float
    finished: float
    quorum: QuorumView | None
    error: BaseException | None

    @property
    def elapsed(self) -> float:
        return self.finished - self.started


class Call:
    """A blocking call on its own (daemon) thread, optionally released by ``gate``."""

    def __init__(self, name: str, fn: Callable[[], QuorumView], bound: float,
                 gate: threading.Event | None = None) -> None:
        self.name = name
        self.bound = bound
        self._fn = fn
        self._gate = gate
        self._result: CallResult | None = None
        self._thread = threading.Thread(target=self._run, name=f"call-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._gate is not None:
            self._gate.wait(30)
        started = time.monotonic()
        try:
            q, err = self._fn(), None
        except BaseException as e:  # noqa: BLE001 -- the outcome under test
            q, err = None, e
        self._result = CallResult(self.name, started, time.monotonic(), q, err)

    def wait(self) -> CallResult:
        self._thread.join(self.bound)
        assert not self._thread.is_alive(), f"call {self.name} still running after {self.bound:.1f}s"
        assert self._result is not None
        return self._result

    def quorum(self) -> QuorumView:
        """The call's quorum; fails the test with the call's error otherwise."""
        r = self.wait()
        assert r.error is None, f"call {self.name} failed: {type(r.error).__name__}: {r.error}"
        return r.quorum


def start_call(name: str, fn: Callable[[], QuorumView], timeout: float) -> Call:
    return Call(name, fn, timeout + CALL_GRACE_S)


def run_concurrently(calls: dict[str, Callable[[], QuorumView]], timeout: float) -> dict[str, CallResult]:
    """Start every call on its own thread, release them together, wait (bounded) for all."""
    gate = threading.Event()
    running = {name: Call(name, fn, timeout + CALL_GRACE_S, gate) for name, fn in calls.items()}
    gate.set()
    return {name: c.wait() for name, c in running.items()}
