"""The userspace TCP proxy network backend (``jepsen_like.proxy``), no root needed.

* On raw sockets: exactly the documented fault semantics (a severed pair is reset and refused,
  a one-way cut holds bytes in order and delivers them at the heal, delay is per direction,
  teardown leaves no listener and no thread).
* A 3-node ``LocalCluster`` wired through the proxy (``serve --raft-dial``): the same scenario
  and the same checks as ``test_partition.py`` (which uses network namespaces and root),
  imported from there: the isolated leader hands out nothing, the majority elects a new leader
  and serves, the heal restores the old leader as a follower, the committed logs agree.
* Delay on the leader's links slows Raft commits (only when no follower acknowledges in time:
  one slow follower does not), and a one-way cut disconnects a pair that exchanges traffic.
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Iterator

import pytest

import test_partition as partition_test  # the netns partition test's scenario and checks
from support.waiting import wait_for
from jepsen_like.proxy import ProxyError, ProxyNetwork
from lighthouse_cluster.local.cluster import LocalCluster
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.local.simulated_group import SimulatedReplicaGroup

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120), pytest.mark.quiet]  # quiet: beside quiet tests only (conftest)

# 300 ms keeps a follower from timing out while a 0.2 s delay starts (its heartbeats arrive
# 0.2 s + one append-entries period apart once, which is more than 150 ms).
ELECTION_TIMEOUT_MS = 300


def proxy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("jepsen_like-proxy-")]


def assert_torn_down(net: ProxyNetwork) -> None:
    assert not net.running and not proxy_threads(), proxy_threads()
    for port in net.listen_ports:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((net.host, port), timeout=1).close()


# -- raw sockets ---------------------------------------------------------------------------------------


class Endpoints:
    """Two fake nodes (listening sockets) behind a 2-node proxy."""

    def __init__(self, net: ProxyNetwork) -> None:
        self.net = net
        self.listeners = []
        for _ in range(2):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen()
            s.settimeout(2)
            self.listeners.append(s)
        net.set_targets([f"127.0.0.1:{s.getsockname()[1]}" for s in self.listeners])
        self.open: list[socket.socket] = []

    def connect(self, i: int, j: int) -> tuple[socket.socket, socket.socket]:
        """Node i dials node j through the proxy: (i's socket, j's accepted socket)."""
        host, port = self.net.listen_address(i, j).rsplit(":", 1)
        a = socket.create_connection((host, int(port)), timeout=2)
        b, _ = self.listeners[j].accept()
        for s in (a, b):
            s.settimeout(2)
            self.open.append(s)
        return a, b

    def close(self) -> None:
        for s in self.open + self.listeners:
            s.close()


def recv_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {data!r}")
        data += chunk
    return data


def nothing_arrives(s: socket.socket, within: float) -> bool:
    s.settimeout(within)
    try:
        s.recv(100)
        return False
    except socket.timeout:
        return True
    finally:
        s.settimeout(2)


def test_fault_semantics_on_raw_connections() -> None:
    net = ProxyNetwork(2).setup()
    ends = Endpoints(net)
    try:
        assert net.dial_args(0) == ["--raft-dial", f"n2={net.listen_address(0, 1)}"]
        assert net.launch_prefix(1) == ["env", f"LIGHTHOUSE_CLUSTER_RAFT_DIAL=n1={net.listen_address(1, 0)}"]
        a, b = ends.connect(1, 0)                       # node 1 dials node 0 (its listener (1, 0))
        a.sendall(b"ping")
        assert recv_exactly(b, 4) == b"ping"

        # One-way cut 1 -> 0: 1's bytes are held (in order), 0's bytes still reach 1.
        net.cut(1, 0)
        assert net.blocked == {(1, 0)}
        a.sendall(b"held-1")
        b.sendall(b"flows")
        assert recv_exactly(a, 5) == b"flows"
        assert nothing_arrives(b, 0.3)
        a.sendall(b"held-2")
        a2, b2 = ends.connect(1, 0)                     # new connections are accepted, and held too
        a2.sendall(b"x")
        assert nothing_arrives(b2, 0.2)
        net.heal()
        assert recv_exactly(b, 12) == b"held-1held-2"   # delivered at the heal, in order
        assert recv_exactly(b2, 1) == b"x"

        # Per-direction delay: 1 -> 0 late by 0.2 s, 0 -> 1 not.
        net.delay(1, 0, 0.2)
        t = time.monotonic()
        a.sendall(b"d")
        recv_exactly(b, 1)
        slow = time.monotonic() - t
        t = time.monotonic()
        b.sendall(b"f")
        recv_exactly(a, 1)
        fast = time.monotonic() - t
        assert 0.19 <= slow < 0.5 and fast < 0.1, (slow, fast)
        net.clear_delays()

        # Both directions cut: the pair is severed, open connections are reset, new ones refused.
        net.isolate(0)
        assert net.blocked == {(0, 1), (1, 0)}
        for s in (a, b, a2, b2):
            with pytest.raises((ConnectionResetError, ConnectionError)):
                recv_exactly(s, 1)
        host, port = net.listen_address(1, 0).rsplit(":", 1)
        with pytest.raises((ConnectionResetError, ConnectionError)):   # at the connect, or right after
            c = socket.create_connection((host, int(port)), timeout=2)
            ends.open.append(c)
            recv_exactly(c, 1)
        stats = net.stats()
        assert stats["reset 0-1"] == 2 and stats["refused 1->0"] == 1, stats
        assert net.open_connections() == 0

        net.heal()
        a, b = ends.connect(0, 1)
        b.sendall(b"back")
        assert recv_exactly(a, 4) == b"back"
    finally:
        net.teardown()
        ends.close()
    assert_torn_down(net)
    net.teardown()                                       # idempotent
    with pytest.raises(ProxyError, match="not running"):
        net.isolate(0)


# -- a cluster through the proxy -------------------------------------------------------------------------


@pytest.fixture
def net() -> Iterator[ProxyNetwork]:
    network = ProxyNetwork(3).setup()
    try:
        yield network
    finally:
        network.teardown()
        assert_torn_down(network)


@pytest.fixture
def cluster(net: ProxyNetwork, tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster(root=tmp_path / "cluster", nodes=3, min_replicas=1, join_timeout_ms=1000,
                     heartbeat_timeout_ms=500, quorum_tick_ms=50, election_timeout_ms=ELECTION_TIMEOUT_MS)
    net.wire(c)
    try:
        c.start()
        yield c
    finally:
        c.stop_all()


def test_partitioned_leader_issues_nothing_through_the_proxy(net: ProxyNetwork, cluster: LocalCluster,
                                                             tmp_path: Path) -> None:
    history_file = tmp_path / "history.jsonl"

    def explain(msg: str) -> str:
        return f"{msg}\n(history: {history_file}; proxy: {net.stats()})\n{cluster.tail_logs(25)}"

    # The leader every node follows (a start-up election can be followed by a second one), as
    # in test_partition: the groups below are placed on the leader and the followers.
    leader, _ = cluster.wait_for_stable_leader(timeout=20)
    followers = [i for i in range(cluster.nodes) if i != leader]
    # Every Raft connection goes through the proxy: one per pair, each on the dialer's listener.
    wait_for("three proxied Raft connections",
             lambda: sum(v for k, v in net.stats().items() if k.startswith("accepted")) >= 3, 10,
             context=lambda: cluster.tail_logs(25), interval=0.05)
    addr = cluster.client_addresses
    p = partition_test
    groups = [SimulatedReplicaGroup(rid, addr[leader], quorum_timeout_s=p.ISO_QUORUM_TIMEOUT_S,
                                    step_time_s=p.STEP_TIME_S) for rid in p.ISO_GROUPS]
    groups += [SimulatedReplicaGroup(rid, addr[f], quorum_timeout_s=p.MAJ_QUORUM_TIMEOUT_S, step_time_s=p.STEP_TIME_S)
               for rid, f in zip(p.MAJ_GROUPS, followers)]
    traffic = p.Traffic(groups).start()
    try:
        marks = p._run_scenario(net, cluster, traffic, leader, followers, explain)  # type: ignore[arg-type]
    finally:
        try:
            traffic.stop()
        finally:
            with history_file.open("w") as f:
                for r in traffic.snapshot():
                    f.write(json.dumps(asdict(r)) + "\n")
    stats = net.stats()
    # The cut really went through the proxy: the isolated node's connections were reset and its
    # peers' reconnection attempts refused while it lasted.
    assert any(k.startswith("reset") for k in stats) and any(k.startswith("refused") for k in stats), stats
    p._check_logs_and_history(cluster, traffic.snapshot(), leader, marks, explain)


def quorum_latencies(endpoint: str, rounds: int) -> list[float]:
    async def run() -> list[float]:
        g = SimulatedReplicaGroup("lat", endpoint, quorum_timeout_s=3.0)
        try:
            results = [await g.quorum_once() for _ in range(rounds)]
        finally:
            await g.close()
        errors = [r.error for r in results if r.error]
        assert not errors, errors
        return [r.latency_s for r in results]
    return asyncio.run(run())


def test_delay_on_leader_links_slows_commits_and_one_way_cut_disconnects(net: ProxyNetwork,
                                                                         cluster: LocalCluster) -> None:
    leader = cluster.wait_for_leader(timeout=20)
    ids = {i: cluster.members[i].peer.node_id for i in range(3)}

    def connected(i: int, j: int) -> bool | None:
        s = cluster.status(i, timeout=0.5)
        return None if s is None else next(p.connected for p in s.peers if p.node.id == ids[j])

    def all_connected() -> bool:
        return all(connected(i, j) for i in range(3) for j in range(3) if i != j)

    wait_for("every node up and connected to the others", all_connected, 20, context=lambda: cluster.tail_logs(25),
             interval=0.05)
    leader = cluster.wait_for_leader(timeout=10)
    term = cluster.status(leader).term
    f1, f2 = [i for i in range(3) if i != leader]
    endpoint = cluster.client_addresses[leader]

    def settle() -> None:  # chunks read before a delay change keep their old due time
        time.sleep(0.3)
        quorum_latencies(endpoint, 1)

    # A quorum round on the leader waits for one Raft commit (plus at most one quorum tick).
    base = statistics.median(quorum_latencies(endpoint, 8))

    net.delay(leader, f1, 0.2)                           # one slow follower: the other one acks
    settle()
    one_slow = statistics.median(quorum_latencies(endpoint, 8))

    net.delay(leader, f2, 0.2)                           # both: no ack before 0.2 s
    settle()
    both_slow = statistics.median(quorum_latencies(endpoint, 8))

    net.clear_delays()
    net.delay(f1, leader, 0.2)                           # the acknowledgements, the other way
    net.delay(f2, leader, 0.2)
    settle()
    acks_slow = statistics.median(quorum_latencies(endpoint, 8))

    net.clear_delays()
    settle()
    after = statistics.median(quorum_latencies(endpoint, 8))
    summary = dict(base=base, one_slow=one_slow, both_slow=both_slow, acks_slow=acks_slow, after=after)

    st = cluster.status(leader)
    assert st.role == cpb.LEADER and st.term == term, \
        f"leadership changed while measuring {summary}\n{cluster.tail_logs(20)}"
    assert both_slow >= base + 0.15 and acks_slow >= base + 0.15, summary
    assert one_slow < base + 0.1 and after < base + 0.1, summary

    # A one-way cut on a pair that exchanges traffic (leader -> follower) ends, after the
    # follower's connection timeout, with the pair disconnected both ways, until the heal.
    net.cut(leader, f1)
    assert net.blocked == {(leader, f1)}
    wait_for("the one-way cut leader -> follower disconnects the pair both ways",
             lambda: connected(leader, f1) is False and connected(f1, leader) is False,
             5, context=lambda: cluster.tail_logs(25), interval=0.05)
    time.sleep(0.5)
    assert connected(leader, f1) is False and connected(f1, leader) is False, "reconnected under a one-way cut"
    net.heal()
    wait_for("every pair connected again after the heal", all_connected, 10, context=lambda: cluster.tail_logs(25),
             interval=0.05)
    cluster.wait_for_leader(timeout=10)
