"""ftclient.lighthouse_client: leader discovery, failover re-sends, heartbeats following the
leader, torchft's single Rust lighthouse, and bounded quorum timeouts -- against real 3-node
LocalClusters on loopback (and torchft's own LighthouseServer)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from support.waiting import wait_for
from ftclient.lighthouse_client import LighthouseClient, Probe, Target, choose_target, parse_endpoints
from lighthouse_cluster.local.cluster import LocalCluster, free_ports
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import torchft_pb2 as pb

# -- pure parts ----------------------------------------------------------------------------------


def test_parse_endpoints() -> None:
    assert parse_endpoints("http://a:1, b:2,,http://a:1/") == ["a:1", "b:2"]
    assert parse_endpoints(["http://a:1,http://b:2", "c:3"]) == ["a:1", "b:2", "c:3"]
    assert parse_endpoints("http://[::1]:29510") == ["[::1]:29510"]
    for bad in ["", " , ", "ftp://a:1", "http://a", "a:port"]:
        with pytest.raises(ValueError):
            parse_endpoints(bad)


def test_choose_target() -> None:
    assert choose_target([Probe("a:1", error="UNAVAILABLE"), Probe("b:2")]) is None
    # The leader named in the highest term wins; the first such answer on a tie.
    assert choose_target([Probe("a:1", leader_address="x:1", term=3), Probe("b:2", leader_address="y:1", term=4),
                          Probe("c:3", leader_address="z:1", term=4)]) == Target("y:1", cluster=True, term=4)
    # A cluster leader beats an endpoint without the cluster service; without one, that endpoint.
    assert choose_target([Probe("a:1", unimplemented=True), Probe("b:2", leader_address="x:1", term=1)]) \
        == Target("x:1", cluster=True, term=1)
    assert choose_target([Probe("a:1", error="UNAVAILABLE"), Probe("b:2", unimplemented=True)]) \
        == Target("b:2", cluster=False)


def test_no_lighthouse_raises_connection_error_naming_endpoints() -> None:
    ports = free_ports(2)
    addr = ",".join(f"http://127.0.0.1:{p}" for p in ports)
    started = time.monotonic()
    with pytest.raises(ConnectionError) as info:
        LighthouseClient(addr, connect_timeout=0.5)
    assert time.monotonic() - started < 3.0
    for p in ports:
        assert f"http://127.0.0.1:{p}" in str(info.value)


# -- helpers -------------------------------------------------------------------------------------


def url(cluster: LocalCluster, i: int) -> str:
    return f"http://{cluster.client_addresses[i]}"


def pending_ids(cluster: LocalCluster, i: int) -> set[str]:
    st = cluster.status(i)
    return {p.member.replica_id for p in st.pending} if st is not None else set()


def heartbeat_age_ms(cluster: LocalCluster, i: int, replica_id: str) -> int | None:
    st = cluster.status(i)
    if st is None or st.role != cpb.LEADER:
        return None
    ages = {h.replica_id: h.age_ms for h in st.heartbeats}
    return ages.get(replica_id)


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as ex:
        yield ex


def result_within(fut: Future, timeout: float) -> Any:
    return fut.result(timeout=timeout)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A 3-node cluster for the tests that kill nothing. min_replicas=2 makes a lone requester
    wait; short join/heartbeat timeouts keep leftovers of one test from holding up the next."""
    cluster = LocalCluster(root=tmp_path_factory.mktemp("shared"), min_replicas=2, join_timeout_ms=300,
                           heartbeat_timeout_ms=1000)
    try:
        cluster.start()
        cluster.wait_for_leader()
        yield cluster
    finally:
        cluster.stop_all()


# -- discovery -----------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_discovery_from_follower_or_dead_first_entry(shared: LocalCluster) -> None:
    leader = shared.wait_for_leader()
    follower = next(i for i in range(3) if i != leader)
    dead = f"http://127.0.0.1:{free_ports(1)[0]}"

    with LighthouseClient(url(shared, follower), connect_timeout=10) as client:
        assert client.target == Target(shared.client_addresses[leader], cluster=True, term=client.target.term)
        # The configured nodes were learned from the follower's answer.
        assert sorted(client.endpoints) == sorted(shared.client_addresses)

    with LighthouseClient(f"{dead},{url(shared, follower)}", connect_timeout=10) as client:
        assert client.target is not None and client.target.address == shared.client_addresses[leader]
        assert client.endpoints[0] == dead.removeprefix("http://")


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_quorum_through_the_leader_and_invalid_request(shared: LocalCluster, pool: ThreadPoolExecutor) -> None:
    with LighthouseClient(shared.endpoints, connect_timeout=10) as a, \
            LighthouseClient(shared.endpoints, connect_timeout=10) as b:
        fa = pool.submit(a.quorum, "disc-a", 15, address="ma", store_address="sa", step=4, data={"k": 1})
        fb = pool.submit(b.quorum, "disc-b", 15, step=2, commit_failures=1)
        qa, qb = result_within(fa, 20), result_within(fb, 20)
        assert qa.quorum_id == qb.quorum_id
        assert [m.replica_id for m in qa.participants] == ["disc-a", "disc-b"]
        ma = qa.participants[0]
        assert (ma.address, ma.store_address, ma.step, ma.data) == ("ma", "sa", 4, '{"k": 1}')
        assert qa.participants[1].commit_failures == 1
        with pytest.raises(ValueError, match="replica_id"):
            a.quorum("", 5)


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_quorum_timeout_is_bounded_and_names_endpoints(shared: LocalCluster) -> None:
    with LighthouseClient(shared.endpoints, connect_timeout=10) as client:
        started = time.monotonic()
        with pytest.raises(TimeoutError) as info:
            client.quorum("lonely", timeout=1.5)
        elapsed = time.monotonic() - started
    assert 1.4 <= elapsed <= 2.5, elapsed
    assert "lonely" in str(info.value)
    for address in shared.client_addresses:
        assert f"http://{address}" in str(info.value)


# -- failover ------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_waiting_quorum_survives_leader_sigkill(make_cluster: Callable[..., LocalCluster],
                                                pool: ThreadPoolExecutor) -> None:
    cluster = make_cluster(min_replicas=2)
    leader = cluster.wait_for_leader()
    term = cluster.status(leader).term
    client_a = LighthouseClient(cluster.endpoints, connect_timeout=10)
    assert client_a.target.address == cluster.client_addresses[leader]

    timeout = 20.0
    started = time.monotonic()
    fa = pool.submit(client_a.quorum, "fo-a", timeout, step=1)
    wait_for("fo-a pending at the leader", lambda: "fo-a" in pending_ids(cluster, leader), 10.0)
    cluster.kill(leader)
    new_leader = cluster.wait_for_leader(exclude_term=term, timeout=15)

    others = ",".join(url(cluster, i) for i in range(3) if i != leader)
    with LighthouseClient(others, connect_timeout=10) as client_b:
        qb = client_b.quorum("fo-b", timeout=15, step=1)
    qa = result_within(fa, timeout + 5)
    assert time.monotonic() - started < timeout
    assert [m.replica_id for m in qa.participants] == ["fo-a", "fo-b"]
    assert qa.quorum_id == qb.quorum_id
    assert client_a.reroutes >= 1
    assert client_a.target.address == cluster.client_addresses[new_leader]
    client_a.close()


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_waiting_quorum_moves_off_a_hung_leader(make_cluster: Callable[..., LocalCluster],
                                                pool: ThreadPoolExecutor) -> None:
    """SIGSTOP: the leader's connection stays open and nothing fails; the client notices the
    newer leader through the other nodes and re-sends there."""
    cluster = make_cluster(min_replicas=2)
    leader = cluster.wait_for_leader()
    term = cluster.status(leader).term
    client_a = LighthouseClient(cluster.endpoints, connect_timeout=10, leader_watch_interval=0.5)
    fa = pool.submit(client_a.quorum, "hung-a", 20, step=1)
    wait_for("hung-a pending at the leader", lambda: "hung-a" in pending_ids(cluster, leader), 10.0)
    cluster.pause(leader)
    new_leader = cluster.wait_for_leader(exclude_term=term, timeout=15,
                                         among=[i for i in range(3) if i != leader])
    wait_for("hung-a re-sent to the new leader", lambda: "hung-a" in pending_ids(cluster, new_leader), 10.0)
    others = ",".join(url(cluster, i) for i in range(3) if i != leader)
    with LighthouseClient(others, connect_timeout=10) as client_b:
        client_b.quorum("hung-b", timeout=15, step=1)
    qa = result_within(fa, 25)
    assert [m.replica_id for m in qa.participants] == ["hung-a", "hung-b"]
    assert client_a.target.address == cluster.client_addresses[new_leader]
    client_a.close()


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_heartbeats_follow_the_new_leader(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(min_replicas=1)
    leader = cluster.wait_for_leader()
    term = cluster.status(leader).term
    client = LighthouseClient(cluster.endpoints, connect_timeout=10)
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            try:
                client.heartbeat("hb-replica", timeout=1.0)
            except (TimeoutError, ConnectionError):
                pass
            stop.wait(0.1)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        wait_for("a heartbeat at the leader", lambda: heartbeat_age_ms(cluster, leader, "hb-replica") is not None, 10.0)
        cluster.kill(leader)
        new_leader = cluster.wait_for_leader(exclude_term=term, timeout=15)
        new_address = cluster.client_addresses[new_leader]
        wait_for("heartbeats sent to the new leader",
                 lambda: client.target is not None and client.target.address == new_address, 10.0)
        wait_for("a fresh heartbeat at the new leader",
                 lambda: (heartbeat_age_ms(cluster, new_leader, "hb-replica") or 10_000) < 500, 10.0)
    finally:
        stop.set()
        thread.join(timeout=5)
        client.close()


# -- torchft's Rust lighthouse -----------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_single_torchft_rust_lighthouse() -> None:
    import torchft._torchft as torchft  # the interop extra: a missing torchft fails this test

    server = torchft.LighthouseServer(bind="[::]:0", min_replicas=1)
    try:
        dead = f"http://127.0.0.1:{free_ports(1)[0]}"
        with LighthouseClient(f"{dead},{server.address()}", connect_timeout=10) as client:
            # No cluster service there (UNIMPLEMENTED): the URL itself is the lighthouse.
            assert client.target == Target(server.address().removeprefix("http://"), cluster=False)
            q = client.quorum("solo", timeout=10, address="m", step=7, data={"k": 2})
            assert isinstance(q, pb.Quorum)
            assert [(m.replica_id, m.step, m.data) for m in q.participants] == [("solo", 7, '{"k": 2}')]
            client.heartbeat("solo", timeout=5)
    finally:
        server.shutdown()


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_rust_lighthouse_quorum_timeout_is_bounded() -> None:
    import torchft._torchft as torchft  # the interop extra: a missing torchft fails this test

    server = torchft.LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        with LighthouseClient(server.address(), connect_timeout=10) as client:
            started = time.monotonic()
            with pytest.raises(TimeoutError, match=server.address()):
                client.quorum("alone", timeout=1.0)
            assert 0.9 <= time.monotonic() - started <= 2.0
    finally:
        server.shutdown()
