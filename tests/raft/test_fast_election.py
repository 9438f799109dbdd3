"""fast_election.FastElectionSyncObj: follower links kept alive, early election after a refusal
(benchmarks F8), the vote-refusal window and handovers (F13), no attributes of ours in pysyncobj's
snapshots. Three in-process pysyncobj nodes on loopback (one for the snapshot)."""

from __future__ import annotations

import gzip
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pysyncobj import SyncObjConf

from support.raft_counter import Counter
from support.raft_nodes import free_port as _free_port, run_on_tick_thread, start_nodes
from support.waiting import wait_for
from lighthouse_cluster.raft.fast_election import DEPOSE_KEY, HANDOVER_KEY, FastElectionSyncObj, leader_lost_deadline
from lighthouse_cluster.raft.pysyncobj_internals import CONNECTION_STATE, RAFT_STATE, pso_pickle
from lighthouse_cluster.raft.pysyncobj_internals import monotonic as raft_monotonic

pytestmark = pytest.mark.integration  # real servers on loopback


def _conf(**kwargs: Any) -> SyncObjConf:
    return SyncObjConf(autoTickPeriod=0.01, raftMinTimeout=0.15, raftMaxTimeout=0.45, appendEntriesPeriod=0.0375,
                       connectionTimeout=0.5, connectionRetryTime=0.25, appendEntriesUseBatch=False, **kwargs)


def _start(count: int = 3, **kwargs: Any) -> list[FastElectionSyncObj]:
    return start_nodes([FastElectionSyncObj] * count, lambda out: any(n._isLeader() for n in out), conf=_conf(),
                       **kwargs)


@pytest.fixture
def nodes() -> Iterator[list[FastElectionSyncObj]]:
    out = _start()
    try:
        yield out
    finally:
        for n in out:
            n.destroy()


def vote_request(term: int, last_term: int, last_index: int) -> dict:
    return {"type": "request_vote", "term": term, "last_log_term": last_term, "last_log_index": last_index}


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

    # A stale request (older term) and an up-to-date candidate: no early election.
    follower.on_raft_message(other.selfNode, vote_request(term - 1, 0, 0))
    assert follower.early_elections == 0
    # Handled on the caller's thread (not the tick thread): call it with the node's state frozen.
    my_term, my_index = follower.pso_last_log()
    # While the leader lives (an append_entries less than raftMinTimeout ago) a request is put off:
    # no vote, and the follower keeps its term (the leader is not disrupted).
    follower._heard_leader_at = raft_monotonic()
    put_off = follower.votes_put_off
    follower.on_raft_message(other.selfNode, vote_request(term + 1, my_term, my_index + 5))
    assert follower.votes_put_off == put_off + 1 and follower.raftCurrentTerm == term
    # A candidate whose log is behind while the leader is alive: put off too, no early election.
    follower._heard_leader_at = raft_monotonic()
    follower.on_raft_message(other.selfNode, vote_request(term + 2, my_term, my_index - 1))
    assert follower.early_elections == 0 and follower.raftCurrentTerm == term
    # The same once the leader is gone (no append_entries for a while), in a new term the
    # follower has not voted in: refused, and the follower stands itself within raftMinTimeout / 5.
    follower._heard_leader_at = raft_monotonic() - 1.0
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


# -- a closed connection to the leader (benchmarks F19) -------------------------------------------------

# Election timeouts of 1-2 s, a refusal window of 0.3 s: an election at the window's end is a
# closed connection's doing, not a timeout's.
SLOW_TIMEOUTS = {"raftMinTimeout": 1.0, "raftMaxTimeout": 2.0, "appendEntriesPeriod": 0.05, "connectionTimeout": 2.5,
                 "connectionRetryTime": 0.25, "autoTickPeriod": 0.01, "appendEntriesUseBatch": False}
WINDOW_S = 0.3


@pytest.fixture
def slow_nodes() -> Iterator[list[FastElectionSyncObj]]:
    out = start_nodes([FastElectionSyncObj] * 3, lambda ns: sum(n._isLeader() for n in ns) == 1
                      and all(n._getLeader() is not None for n in ns), conf=SyncObjConf(**SLOW_TIMEOUTS),
                      vote_refusal_s=WINDOW_S)
    try:
        yield out
    finally:
        for n in out:
            n.destroy()


def test_the_survivors_stand_one_after_the_other_from_the_end_of_the_window() -> None:
    assert leader_lost_deadline(10.0, 9.9, 0.15, 0, 0.03, 0.002) == pytest.approx(10.052)
    assert leader_lost_deadline(10.0, 9.9, 0.15, 1, 0.03, 0.002) == pytest.approx(10.082)
    # Heard from long ago: at once (plus its rank's delay), never in the past.
    assert leader_lost_deadline(10.0, 5.0, 0.15, 0, 0.03, 0.0) == 10.0
    assert leader_lost_deadline(10.0, 5.0, 0.15, 2, 0.03, 0.0) == pytest.approx(10.06)


@pytest.mark.timeout(60)
def test_a_leader_whose_connections_close_is_replaced_at_the_end_of_the_refusal_window(
        slow_nodes: list[FastElectionSyncObj]) -> None:
    leader = _caught_up(slow_nodes)
    survivors = sorted((n for n in slow_nodes if n is not leader), key=lambda n: n.selfNode.id)
    term = leader.raftCurrentTerm
    assert [n.survivor_rank(leader.selfNode) for n in survivors] == [0, 1]
    started = raft_monotonic()
    leader.destroy()  # its sockets close, as a killed process's do
    wait_for("a new leader", lambda: any(n._isLeader() for n in survivors), 5.0, interval=0.001)
    took = raft_monotonic() - started
    # Before: no election before raftMinTimeout (1 s) after the last append_entries (<= 50 ms ago).
    assert took < 0.8, f"a new leader after {took:.3f} s"
    assert survivors[0]._isLeader(), "the first survivor by node id stands first and wins"
    assert survivors[0].raftCurrentTerm == term + 1, "one election"
    assert [n.leader_connection_losses for n in survivors] == [1, 1]
    wait_for("the other survivor to follow it", lambda: survivors[1]._getLeader() == survivors[0].selfNode, 5.0,
             interval=0.005)


@pytest.mark.timeout(60)
def test_a_connection_reset_while_the_leader_lives_deposes_nobody(slow_nodes: list[FastElectionSyncObj]) -> None:
    leader = _caught_up(slow_nodes)
    follower = next(n for n in slow_nodes if n is not leader)
    term = leader.raftCurrentTerm
    run_on_tick_thread(follower, lambda: follower.pso_connections[leader.selfNode].disconnect())
    assert follower.leader_connection_losses == 1
    # pysyncobj re-dials at once and the leader's next append_entries (<= 50 ms) comes before the
    # window's end (0.3 s): the follower's deadline moves on, nobody stands.
    wait_for("the link back", lambda: follower.isNodeConnected(leader.selfNode), 5.0, interval=0.005)
    time.sleep(3 * WINDOW_S)  # the deadline it had would have fallen due in this time
    assert leader._isLeader() and leader.raftCurrentTerm == term
    assert all(n.raftCurrentTerm == term and n._getLeader() == leader.selfNode for n in slow_nodes)


@pytest.mark.timeout(60)
def test_a_link_dropped_for_its_silence_brings_no_election_forward(slow_nodes: list[FastElectionSyncObj]) -> None:
    leader = _caught_up(slow_nodes)
    follower = next(n for n in slow_nodes if n is not leader)
    deadlines: list[float] = []

    def drop_after_silence() -> None:
        # As pysyncobj drops a link that read nothing for connectionTimeout (a stalled leader).
        follower._heard_leader_at = raft_monotonic() - SLOW_TIMEOUTS["connectionTimeout"]
        deadlines.append(follower.pso_election_deadline)
        follower.pso_connections[leader.selfNode].disconnect()
        deadlines.append(follower.pso_election_deadline)

    run_on_tick_thread(follower, drop_after_silence)
    assert follower.leader_connection_losses == 0 and deadlines[0] == deadlines[1]


# -- the vote-refusal window (core/lease.py point 3, benchmarks F13) ---------------------------------


def _caught_up(nodes: list[FastElectionSyncObj]) -> FastElectionSyncObj:
    leader = next(n for n in nodes if n._isLeader())
    leader.counter.inc(sync=True, timeout=5)  # type: ignore[attr-defined]
    wait_for("every node to apply the leader's entries",
             lambda: all(n.raftLastApplied >= leader.raftLastApplied for n in nodes), 5.0, interval=0.01)
    # ... and the leader knows it: pysyncobj refuses a transfer (REQUEST_DENIED) while the target's
    # acknowledged index is behind the leader's log (a follower can apply an entry before its
    # acknowledgement reaches the leader: seen in CI, where the handover was then never sent).
    wait_for("the leader to know every follower has its whole log",
             lambda: all(leader.pso_match_index(n) == leader.pso_last_log()[1] for n in leader.otherNodes), 5.0,
             interval=0.01)
    return leader


@pytest.mark.timeout(60)
def test_a_vote_request_put_off_while_the_leader_lived_is_answered_when_the_window_ends(
        nodes: list[FastElectionSyncObj]) -> None:
    leader = _caught_up(nodes)
    follower, other = (n for n in nodes if n is not leader)
    leader.destroy()
    wait_for("the leader's tick thread to end", lambda: not leader.tick_thread_alive(), 5.0, interval=0.001)
    # Both followers read the end of their leader's connection (and moved their deadlines up) first.
    wait_for("the followers to see the leader's connection close",
             lambda: follower.leader_connection_losses == other.leader_connection_losses == 1, 5.0, interval=0.001)
    # Within raftMinTimeout of its last append_entries (each of which moved the deadlines up).
    far = raft_monotonic() + 3600.0
    follower.pso_election_deadline = other.pso_election_deadline = far  # neither stands by itself
    heard = follower._heard_leader_at
    term = follower.raftCurrentTerm
    put_off, voted = follower.votes_put_off, follower.pso_voted_for  # its vote of this term (for the leader)
    my_term, my_index = follower.pso_last_log()
    # Within raftMinTimeout of the leader's last append_entries: put off, neither voted nor refused.
    follower.on_raft_message(other.selfNode, vote_request(term + 1, my_term, my_index))
    assert follower.votes_put_off == put_off + 1
    assert follower.pso_voted_for == voted and follower.raftCurrentTerm == term
    # Answered once the window is over (on the tick thread, at that deadline), not dropped: the
    # candidate need not wait for its next election timeout.
    wait_for("the follower to vote for the candidate", lambda: follower.pso_voted_for == other.selfNode.id, 2.0,
             interval=0.005)
    assert raft_monotonic() >= heard + follower.vote_refusal_s
    assert follower.raftCurrentTerm == term + 1


@pytest.mark.timeout(60)
def test_a_leader_takes_a_higher_term_from_a_vote_request_but_gives_no_vote(nodes: list[FastElectionSyncObj]) -> None:
    leader = _caught_up(nodes)
    follower = next(n for n in nodes if n is not leader)
    term = leader.raftCurrentTerm
    my_term, my_index = leader.pso_last_log()
    # A node back from a partition with a higher term: the leader steps down (else that node could
    # never rejoin: pysyncobj ignores append_entries of an older term) but does not vote.
    leader.on_raft_message(follower.selfNode, vote_request(term + 1, my_term, my_index))
    assert leader.raftCurrentTerm >= term + 1 and leader.pso_voted_for in (None, leader.selfNode.id)
    assert leader.pso_voted_for != follower.selfNode.id
    wait_for("one leader again, known to every node",
             lambda: sum(n._isLeader() for n in nodes) == 1 and all(n._getLeader() is not None for n in nodes), 5.0,
             interval=0.01)


@pytest.mark.timeout(60)
def test_a_node_at_a_higher_term_tells_the_leader_whose_append_entries_it_gets(
        nodes: list[FastElectionSyncObj]) -> None:
    """Raft's "reply with the higher term": a node that reached a higher term without its vote
    requests reaching the leader (here: it granted a vote in that term, then never stands itself)
    answers the leader's next append_entries, and the leader steps down to that term without
    voting. pysyncobj alone ignores the append_entries and nothing changes (the CI failure of the
    clock nemesis's slow-former-leader phase: 20 s with one node a candidate at term 7)."""
    leader = _caught_up(nodes)
    follower, other = (n for n in nodes if n is not leader)
    term = leader.raftCurrentTerm
    my_term, my_index = follower.pso_last_log()
    follower.on_raft_message(other.selfNode, {**vote_request(term + 5, my_term, my_index), HANDOVER_KEY: True})
    follower.pso_election_deadline = raft_monotonic() + 3600.0  # it never stands by itself
    assert follower.raftCurrentTerm == term + 5 and leader.raftCurrentTerm == term
    wait_for("the leader to take the follower's term", lambda: leader.raftCurrentTerm, 5.0,
             ready=lambda t: t >= term + 5, interval=0.005)
    assert follower.stale_leaders_told >= 1
    assert leader.pso_voted_for != follower.selfNode.id  # told, not asked: no vote
    follower.pso_election_deadline = raft_monotonic()  # it may stand again
    wait_for("one leader again, known to every node",
             lambda: sum(n._isLeader() for n in nodes) == 1 and all(n._getLeader() is not None for n in nodes), 5.0,
             interval=0.01)
    assert min(n.raftCurrentTerm for n in nodes) >= term + 5


@pytest.mark.timeout(60)
def test_only_a_leader_acts_on_a_depose_mark() -> None:
    """``DEPOSE_KEY`` is for a leader of an older term. A follower that gets one (its sender's
    leader stepped down meanwhile) takes neither the term nor a vote request from it; the same
    request unmarked raises its term at once (no refusal window here)."""
    nodes = _start(vote_refusal_s=0.0)
    try:
        leader = _caught_up(nodes)
        follower, other = (n for n in nodes if n is not leader)
        term = follower.raftCurrentTerm
        last_term, last_index = other.pso_last_log()
        follower.on_raft_message(other.selfNode, {**vote_request(term + 3, last_term, last_index), DEPOSE_KEY: True})
        assert follower.raftCurrentTerm == term and follower.pso_voted_for != other.selfNode.id
        follower.on_raft_message(other.selfNode, vote_request(term + 3, last_term, last_index))
        assert follower.raftCurrentTerm == term + 3  # the control: unmarked, it is a vote request
    finally:
        for n in nodes:
            n.destroy()


@pytest.mark.timeout(60)
def test_a_handover_candidate_is_answered_at_once_despite_the_refusal_window() -> None:
    # A 3 s refusal window: without the handover mark on its requests the target could not win
    # before the window after the old leader's last append_entries ends (its leader gives no vote
    # while it leads, the other follower puts the request off).
    nodes = _start(vote_refusal_s=3.0)
    try:
        leader = _caught_up(nodes)
        target = next(n for n in nodes if n is not leader)
        term = leader.raftCurrentTerm
        sent: list[Any] = []
        leader.transferLeadership(target.selfNode, callback=lambda _r, err: sent.append(err))
        assert sent == [0], sent  # FAIL_REASON.SUCCESS: TimeoutNow sent
        started = time.monotonic()
        wait_for("the target to lead", target._isLeader, 2.0, interval=0.005)
        assert time.monotonic() - started < 1.5
        assert target.raftCurrentTerm == term + 1 and target.handover_term == term + 1
        assert all(n.handover_term is None for n in nodes if n is not target)
    finally:
        for n in nodes:
            n.destroy()


def test_after_a_handover_the_old_leader_does_not_stand_again() -> None:
    """The handover candidate's first request (pysyncobj's own, unmarked) deposes the old leader,
    which gives no vote within its window. Without a vote its election timer was not restarted:
    its deadline from before it led had long passed, so it could stand at its next tick, a term
    above the handover's, and leadership moved again (CI, on a loaded machine: the old leader stood
    13 ms after the handover began, and test_transfer_leader_to_a_named_node found a leader other
    than the one it had just read). Here, on a quiet machine, the marked request reaches it in time
    even without the fix: this guards the outcome; it did not reproduce the race."""
    nodes = _start()
    try:
        leader = _caught_up(nodes)
        target = next(n for n in nodes if n is not leader)
        term = leader.raftCurrentTerm
        # The marked requests go out 50 ms after pysyncobj's own (a loaded machine splits them
        # over the old leader's ticks; on an idle one they arrive together).
        send_marked, first_seen = target._send_handover_votes, []

        def late_marked_requests() -> None:
            if target._handover_pending is not None and not first_seen:
                first_seen.append(time.monotonic())
            if first_seen and time.monotonic() - first_seen[0] < 0.05:
                return
            send_marked()

        target._send_handover_votes = late_marked_requests  # type: ignore[method-assign]
        sent: list[Any] = []
        leader.transferLeadership(target.selfNode, callback=lambda _r, err: sent.append(err))
        assert sent == [0], sent  # FAIL_REASON.SUCCESS: TimeoutNow sent
        wait_for("the target to lead", target._isLeader, 2.0, interval=0.005)
        # Three election timeouts: a node standing again would have done so by now.
        time.sleep(3 * 0.45)
        assert [n.raftCurrentTerm for n in nodes] == [term + 1] * 3
        assert target._isLeader() and not leader._isLeader()
    finally:
        for n in nodes:
            n.destroy()


@pytest.mark.timeout(60)
def test_no_attribute_of_ours_goes_into_pysyncobjs_snapshots(tmp_path: Path) -> None:
    # pysyncobj snapshots the SyncObj's own attributes (all but those it had at the end of its
    # __init__) and restores them on every node that loads the snapshot: a time of one node's clock
    # (the last keep-alive, the last leader contact) would land on another's.
    dump = tmp_path / "raft.snapshot"
    counter = Counter()
    node = FastElectionSyncObj(f"127.0.0.1:{_free_port()}", [], conf=_conf(fullDumpFile=str(dump)),
                               consumers=[counter])
    try:
        wait_for("a leader", node._isLeader, 10.0)
        for _ in range(3):
            counter.inc(sync=True, timeout=5)
        # Let a few ticks run (keep-alives, acks and the adaptive tick set their attributes then).
        wait_for("a few ticks", lambda: node.tick_waits > 20, 5.0, interval=0.01)
        node.forceLogCompaction()
        wait_for("a snapshot", lambda: dump.exists() and dump.stat().st_size > 0, 10.0, interval=0.01)
        with gzip.open(dump, "rb") as g:
            data = pso_pickle.load(g)
        ours = sorted(k for k in data[0][0] if not k.startswith("_SyncObj__"))  # pysyncobj's own: its business
        assert ours == []
    finally:
        node.destroy()
