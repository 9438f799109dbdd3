"""raft/stall_tolerance.py: a node whose tick thread stalls (no CPU, the GIL held by the gRPC
front end) does not depose a live leader. Three real Raft nodes on loopback; a stall is injected
where the host puts it, between the tick thread's wait returning and its next tick (the poller
sleeps after it returned, as a thread waiting for the GIL or a CPU would)."""

from __future__ import annotations

import collections
import socket
import threading
import time
from typing import Any

import pytest

from support.waiting import wait_for
from lighthouse_cluster.core.codec import CommitQuorum
from lighthouse_cluster.core.quorum import Member, Quorum
from lighthouse_cluster.core.state_machine import QuorumStateMachine
from lighthouse_cluster.local.cluster import free_ports
from lighthouse_cluster.raft import stall_tolerance
from lighthouse_cluster.raft.pysyncobj_internals import (CONNECTION_STATE, LAST_READ_ATTR, TcpConnection,
                                                         count_arrivals_as_reads, monotonic)
from lighthouse_cluster.raft.replication import RaftNode, RaftSettings, ReplicatedState
from lighthouse_cluster.raft.stall_tolerance import patience_s


def test_patience_is_twice_the_longest_recent_stall_above_the_floor_and_capped() -> None:
    stalls: collections.deque[tuple[float, float]] = collections.deque([(1.0, 0.3), (15.0, 0.05), (16.0, 0.2)])
    assert patience_s(stalls, 16.0, floor_s=0.1) == pytest.approx(0.6)
    assert patience_s(stalls, 22.0, floor_s=0.1) == pytest.approx(0.4)  # the first is over 20 s old: dropped
    assert list(stalls) == [(15.0, 0.05), (16.0, 0.2)]
    assert patience_s(stalls, 22.0, floor_s=0.25) == 0.0  # none long enough to cost an election
    assert patience_s(collections.deque([(0.0, 5.0)]), 1.0, floor_s=0.1) == stall_tolerance.PATIENCE_CAP_S
    assert patience_s(collections.deque(), 1.0, floor_s=0.1) == 0.0


@pytest.mark.parametrize("counted", [False, True])
def test_a_connection_with_bytes_waiting_is_not_dropped_for_a_silence_its_own_stall_made(counted: bool) -> None:
    """pysyncobj checks a connection's silence before it reads: a node whose thread did not run
    past ``connectionTimeout`` dropped the link whose bytes were waiting (``counted=False``: what
    pysyncobj does, so that this test notices if that changes). Counted as a read on arrival, the
    message is read and the link kept."""
    from pysyncobj.poller import PollPoller

    poller = PollPoller()
    if counted:
        assert count_arrivals_as_reads(poller)
    a_sock, b_sock = socket.socketpair()
    a_sock.setblocking(False)  # as pysyncobj's own sockets are
    b_sock.setblocking(False)
    got: list[Any] = []
    a = TcpConnection(poller, socket=a_sock, timeout=0.3)
    b = TcpConnection(poller, onMessageReceived=got.append, socket=b_sock, timeout=0.3)
    try:
        a.send({"type": "append_entries", "term": 1})
        setattr(b, LAST_READ_ATTR.name, monotonic() - 1.0)  # b's thread has not run for a second
        for _ in range(5):
            poller.poll(0.02)
        if counted:
            assert got == [{"type": "append_entries", "term": 1}] and b.state == CONNECTION_STATE.CONNECTED
        else:
            assert got == [] and b.state == CONNECTION_STATE.DISCONNECTED
    finally:
        a.disconnect()
        b.disconnect()


class StallingPoller:
    """Wraps a node's poller: after the wait that follows ``stall(seconds)``, the tick thread does
    not run for that long."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._stall_s = 0.0
        self.stalled = threading.Event()

    def stall(self, seconds: float) -> None:
        self.stalled.clear()
        self._stall_s = seconds

    def subscribe(self, descr: Any, callback: Any, event_mask: int) -> None:
        self._inner.subscribe(descr, callback, event_mask)

    def unsubscribe(self, descr: Any) -> None:
        self._inner.unsubscribe(descr)

    def poll(self, timeout: float) -> None:
        self._inner.poll(timeout)
        seconds, self._stall_s = self._stall_s, 0.0
        if seconds:
            time.sleep(seconds)
            self.stalled.set()


def stalling(raft: RaftNode) -> StallingPoller:
    deadline_poller = raft._syncobj.pso_poller  # adaptive_tick's, around pysyncobj's own
    wrapper = StallingPoller(deadline_poller._inner)
    deadline_poller._inner = wrapper
    return wrapper


def start(settings: RaftSettings) -> list[RaftNode]:
    addrs = [f"127.0.0.1:{p}" for p in free_ports(3)]
    rafts: list[RaftNode] = []
    try:
        for a in addrs:
            rafts.append(RaftNode(a, [x for x in addrs if x != a], ReplicatedState(QuorumStateMachine()),
                                  settings=settings))
        wait_for("a leader every node follows", lambda: len({r.leader_address for r in rafts} - {None}) == 1
                 and any(r.is_leader for r in rafts), 10.0)
    except BaseException:
        for r in rafts:
            r.destroy()
        raise
    return rafts


class Writer:
    """Commits a round every 20 ms through the leader (a busy cluster: followers acknowledge
    every append_entries, so the leader's links never look idle)."""

    def __init__(self, leader: RaftNode) -> None:
        self._leader = leader
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        qid = 0
        while not self._stop.wait(0.02):
            qid += 1
            self._leader.submit(CommitQuorum(expected_quorum_id=qid - 1, term=self._leader.term, node_id="n",
                                             quorum=Quorum(qid, (Member("a"),), 1)), lambda _r, _e: None)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)


def run_with(settings: RaftSettings) -> tuple[list[RaftNode], RaftNode]:
    rafts = start(settings)
    leader = next(r for r in rafts if r.is_leader)
    return rafts, leader


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_follower_that_stalls_past_its_election_deadline_reads_the_leaders_heartbeat_first() -> None:
    """F15: pysyncobj checks the election deadline before it reads its sockets. A follower that
    stalled 0.4 s (its deadline is at most 0.25 s after the leader's last append_entries) stood
    for election with the leader's heartbeats unread, and deposed it."""
    settings = RaftSettings(election_timeout_min_s=0.1, election_timeout_max_s=0.25, append_entries_period_s=0.025,
                            quiet_after_s=0.0)
    rafts, leader = run_with(settings)
    writer = Writer(leader)
    try:
        follower = next(r for r in rafts if r is not leader)
        term = leader.term
        poller = stalling(follower)
        for _ in range(3):
            poller.stall(0.4)
            assert poller.stalled.wait(5.0)
            time.sleep(0.5)  # a second election timeout on every node
        assert [r.term for r in rafts] == [term] * 3, "a stalled follower raised the term"
        assert leader.is_leader and follower.leader_address == leader.self_address
        assert follower._syncobj.stalls >= 3 and follower._syncobj.reads_before_timers >= 3
    finally:
        writer.stop()
        for r in rafts:
            r.destroy()


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_leader_that_stalled_is_waited_for_when_it_stalls_again_and_replaced_when_it_dies() -> None:
    """A leader's stall of 0.25 s (under the 0.4 s minimum election timeout) makes it ask its
    followers for 0.5 s more; its next stall, 0.5 s (past the 0.5 s maximum: without patience an
    election every time), costs no election. Killed, it is replaced within patience plus the
    longest election timeout."""
    settings = RaftSettings(election_timeout_min_s=0.4, election_timeout_max_s=0.5, append_entries_period_s=0.05,
                            quiet_after_s=0.0)
    rafts, leader = run_with(settings)
    writer = Writer(leader)
    try:
        followers = [r for r in rafts if r is not leader]
        term = leader.term
        poller = stalling(leader)
        poller.stall(0.25)
        assert poller.stalled.wait(5.0)
        wait_for("the followers to have the leader's request for patience",
                 lambda: all(f._syncobj.leader_patience_s >= 0.35 for f in followers), 5.0)
        for _ in range(2):
            poller.stall(0.5)
            assert poller.stalled.wait(5.0)
            time.sleep(0.6)
        assert [r.term for r in rafts] == [term] * 3, "the followers did not wait for a leader that stalls"
        assert leader.is_leader and all(f.leader_address == leader.self_address for f in followers)
        assert leader.election_patience_s >= 0.7 and leader.tick_stalls >= 3  # about twice the 0.5 s stall
        assert all(f.election_patience_s >= 0.7 for f in followers)
    finally:
        writer.stop()
    rafts.remove(leader)
    leader.destroy()
    died = time.monotonic()
    try:
        new = wait_for("a new leader", lambda: next((r for r in rafts if r.is_leader), None), 10.0)
        took = time.monotonic() - died
        # Patience (at most 2 x 0.5 s) + the longest election timeout + an election, with slack.
        assert took < 1.0 + 0.5 + 1.5, took
        assert new.term > term
    finally:
        for r in rafts:
            r.destroy()
