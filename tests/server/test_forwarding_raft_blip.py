"""A follower's Raft link to the leader drops and comes back within one term: the Quorum calls it
forwarded stay registered at the leader.

Under load a node's Raft connection to its leader can drop and be dialed again without any election
(a tick thread stalled past the connection timeout; docs/design/follower-forwarding.md: at N=4096
with the clients on followers, rounds stopped while the followers' links came and went within a
term). While the link is down the follower knows no leader (``node.leader_peer``). It used to take
that for a leader change and withdraw every call it had forwarded, then send them all again once the
link was back: each blip took the follower's members out of the round being collected. A call
forwarded on the batched stream now waits for its answer until Raft names *another* leader (or this
node leads): a leader that steps down fails the calls itself, and a dead one ends the stream.

Real node processes on loopback; the link is cut with ``ss -K`` (the kernel resets the sockets,
as a dropped connection does), which needs root.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess

import pytest

from support.waiting import wait_for
from lighthouse_cluster.local.cluster import LocalCluster, free_ports
from lighthouse_cluster.local.simulated_group import SimulatedReplicaGroup
from test_cluster import leader_status, metric_samples

pytestmark = pytest.mark.integration

_SOCKET = re.compile(r"^\S+\s+\S+\s+\S+:(\d+)\s+\S+:(\d+)\s+.*pid=(\d+),")


def established(pid: int) -> list[tuple[int, int]]:
    """(local port, peer port) of every established TCP socket of process ``pid``."""
    out = subprocess.run(["ss", "-Htnp", "state", "established"], capture_output=True, text=True, check=True,
                         timeout=10).stdout
    return [(int(m[1]), int(m[2])) for line in out.splitlines() if (m := _SOCKET.match(line)) and int(m[3]) == pid]


def cut_raft_link(a_pid: int, a_raft: int, b_pid: int, b_raft: int) -> int:
    """Reset the Raft connection(s) between processes a and b from a's side; how many were cut.
    One side dials the other's Raft port from an ephemeral port, so a's end is (any, b_raft) or
    (a_raft, a port of b's)."""
    b_ports = {local for local, _ in established(b_pid)}
    ends = [(local, peer) for local, peer in established(a_pid)
            if peer == b_raft or (local == a_raft and peer in b_ports)]
    for local, peer in ends:
        subprocess.run(["ss", "-K", "src", f"127.0.0.1:{local}", "dst", f"127.0.0.1:{peer}"], capture_output=True,
                       check=True, timeout=10)
    return len(ends)


def raft_port(cluster: LocalCluster, i: int) -> int:
    return int(cluster.members[i].peer.raft_address.rsplit(":", 1)[1])


def counter(cluster: LocalCluster, i: int, name: str) -> float:
    return sum(value for _, value in metric_samples(cluster, i, name))


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ss") is None,
                    reason="cutting a node's Raft connection with `ss -K` needs root and iproute2")
def test_calls_forwarded_by_a_follower_stay_at_the_leader_while_its_raft_link_blips(make_cluster) -> None:
    # Elections after 1-3 s without the leader: the link comes back (0.25 s redial) well before.
    cluster = make_cluster(min_replicas=3, join_timeout_ms=60_000, election_timeout_ms=1000,
                           http_ports=free_ports(3))
    leader, before = leader_status(cluster, timeout=30)
    follower = (leader + 1) % 3
    addrs = cluster.client_addresses
    pid = lambda i: cluster.members[i].process.pid  # noqa: E731

    def pending_at_leader() -> set[str]:
        st = cluster.status(leader)
        return set() if st is None else {p.member.replica_id for p in st.pending}

    async def scenario() -> list:
        groups = [SimulatedReplicaGroup(f"g{i}", addrs[follower] if i < 2 else addrs[leader], step=3,
                                        quorum_timeout_s=30.0) for i in range(3)]
        try:
            async with groups[0].heartbeating(), groups[1].heartbeating(), groups[2].heartbeating():
                waiting = [asyncio.ensure_future(g.call_quorum()) for g in groups[:2]]
                await asyncio.to_thread(wait_for, "g0 and g1 pending at the leader", pending_at_leader, 15,
                                        ready=lambda p: p == {"g0", "g1"}, context=cluster)
                forwarded = await asyncio.to_thread(counter, cluster, follower,
                                                    "lighthouse_cluster_forwarded_quorum_calls_total")
                assert forwarded == 2, cluster.tail_logs()
                lost = lambda: cluster.members[follower].log_path.read_text().count("leader unknown")  # noqa: E731
                lost_before = lost()

                def found() -> bool:
                    st = cluster.status(follower)
                    return st is not None and st.leader_id == before.node.id and all(p.connected for p in st.peers)

                # The follower must see the link gone (its log says "leader unknown"); one whose
                # link came back before its event loop looked saw nothing, so it is cut again.
                for _ in range(5):
                    await asyncio.to_thread(wait_for, "the follower connected to the leader", found, 10,
                                            context=cluster)
                    cut = await asyncio.to_thread(cut_raft_link, pid(follower), raft_port(cluster, follower),
                                                  pid(leader), raft_port(cluster, leader))
                    assert cut >= 1, "no Raft connection between the follower and the leader to cut"
                    try:
                        await asyncio.to_thread(wait_for, "the follower to lose the leader", lost, 2,
                                                ready=lambda n: n > lost_before)
                        break
                    except AssertionError:
                        continue
                else:
                    raise AssertionError(f"the follower never saw its Raft link go\n{cluster.tail_logs()}")
                # It has the link back, in the same term.
                await asyncio.to_thread(wait_for, "the follower to find the leader again", found, 10, context=cluster)
                assert [cluster.status(i).term for i in range(3)] == [before.term] * 3, "an election took place"
                # The calls stayed where they were: nothing withdrawn, nothing sent twice.
                assert pending_at_leader() == {"g0", "g1"}
                assert await asyncio.to_thread(counter, cluster, follower,
                                               "lighthouse_cluster_forwarded_quorum_calls_total") == 2, \
                    cluster.tail_logs()
                assert await asyncio.to_thread(counter, cluster, follower,
                                               "lighthouse_cluster_rerouted_quorum_calls_total") == 0
                third = await groups[2].call_quorum()
                return [third, *await asyncio.gather(*waiting)]
        finally:
            for g in groups:
                await g.close()

    quorums = asyncio.run(scenario())
    assert all([m.replica_id for m in q.participants] == ["g0", "g1", "g2"] for q in quorums), quorums
    assert len({q.quorum_id for q in quorums}) == 1
