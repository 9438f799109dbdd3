"""fast_election.FastElectionSyncObj: follower links kept alive, early election after a refusal
(benchmarks F8). Three in-process pysyncobj nodes on loopback."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
from pysyncobj import SyncObjConf

from support.raft_counter import Counter
from support.waiting import wait_for
from lighthouse_cluster.raft.fast_election import FastElectionSyncObj
from lighthouse_cluster.raft.pysyncobj_internals import CONNECTION_STATE, RAFT_STATE
from lighthouse_cluster.raft.pysyncobj_internals import monotonic as raft_monotonic

pytestmark = pytest.mark.integration  # real servers on loopback


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def nodes() -> Iterator[list[FastElectionSyncObj]]:
    addrs = [f"127.0.0.1:{_free_port()}" for _ in range(3)]
    out = []
    for a in addrs:
        conf = SyncObjConf(autoTickPeriod=0.01, raftMinTimeout=0.15, raftMaxTimeout=0.45, appendEntriesPeriod=0.0375,
                           connectionTimeout=0.5, connectionRetryTime=0.25, appendEntriesUseBatch=False)
        counter = Counter()
        out.append(FastElectionSyncObj(a, [x for x in addrs if x != a], conf=conf, consumers=[counter]))
        out[-1].counter = counter  # type: ignore[attr-defined]
    try:
        wait_for("a leader", lambda: any(n._isLeader() for n in out), 10)
        yield out
    finally:
        for n in out:
            n.destroy()


@pytest.mark.timeout(60)
def test_follower_links_stay_connected_while_idle(nodes: list[FastElectionSyncObj]) -> None:
    leader = next(n for n in nodes if n._isLeader())
    a, b = (n for n in nodes if n is not leader)
    wait_for("the followers connected to each other",
             lambda: a.isNodeConnected(b.selfNode) and b.isNodeConnected(a.selfNode),
             5.0, interval=0.01)
    # Three connection timeouts without Raft traffic between the followers: pysyncobj alone would
    # time the link out (and drop the first message sent on it).
    states, sent_by_leader = [], leader.keepalives_sent
    for _ in range(30):
        time.sleep(0.05)
        conn = a.pso_connections.get(b.selfNode)
        states.append(conn is not None and conn.state == CONNECTION_STATE.CONNECTED)
    assert all(states)
    assert a.keepalives_sent > 0 and b.keepalives_sent > 0
    assert leader.keepalives_sent == sent_by_leader  # a leader's links carry append_entries


@pytest.mark.timeout(60)
def test_refusing_a_candidate_that_is_behind_starts_an_election_soon(nodes: list[FastElectionSyncObj]) -> None:
    leader = next(n for n in nodes if n._isLeader())
    for _ in range(3):
        leader.counter.inc(sync=True, timeout=5)  # type: ignore[attr-defined]
    follower = next(n for n in nodes if n is not leader)
    wait_for("the follower to apply the leader's entries", lambda: follower.raftLastApplied >= leader.raftLastApplied,
             5.0, interval=0.01)
    other = next(n for n in nodes if n not in (leader, follower))
    term = follower.raftCurrentTerm

    def vote_request(term: int, last_term: int, last_index: int) -> dict:
        return {"type": "request_vote", "term": term, "last_log_term": last_term, "last_log_index": last_index}

    # A stale request (older term) and an up-to-date candidate: no early election.
    follower.on_raft_message(other.selfNode, vote_request(term - 1, 0, 0))
    assert follower.early_elections == 0
    # Handled on the caller's thread (not the tick thread): call it with the node's state frozen.
    my_term, my_index = follower.pso_last_log()
    follower.on_raft_message(other.selfNode, vote_request(term + 1, my_term, my_index + 5))
    assert follower.early_elections == 0  # it voted for that candidate
    # A candidate whose log is behind while the leader is alive (it deposes it: no pre-vote):
    # refused, and the normal timers decide, as without FastElectionSyncObj.
    follower._leader_contact = raft_monotonic()
    follower.on_raft_message(other.selfNode, vote_request(term + 2, my_term, my_index - 1))
    assert follower.early_elections == 0
    # The same once the leader is gone (no append_entries for a while), in a new term the
    # follower has not voted in: refused, and the follower stands itself within raftMinTimeout / 5.
    follower._leader_contact = raft_monotonic() - 1.0
    term = follower.raftCurrentTerm
    before = raft_monotonic()
    follower.on_raft_message(other.selfNode, vote_request(term + 2, my_term, my_index - 1))
    assert follower.early_elections == 1
    assert follower.pso_election_deadline <= before + 0.2 * 0.15 + 0.01
    assert follower.pso_state in (RAFT_STATE.FOLLOWER, RAFT_STATE.CANDIDATE, RAFT_STATE.LEADER)
    # Never for a term it voted in.
    follower.pso_voted_for = follower.selfNode.id
    follower.on_raft_message(other.selfNode, vote_request(term + 2, my_term, my_index - 1))
    assert follower.early_elections == 1
    # The cluster settles on one leader.
    wait_for("one leader, known to every node",
             lambda: sum(n._isLeader() for n in nodes) == 1 and all(n._getLeader() is not None for n in nodes), 5.0,
             interval=0.01)
