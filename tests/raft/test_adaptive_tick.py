"""adaptive_tick: pysyncobj's tick thread sleeps until its next deadline (issue 18, idle cost).

``tick_wait`` is pure and tested as such; the rest runs real pysyncobj nodes on loopback whose
longest wait is far beyond any bound awaited here, so that each test fails if what it checks
depended on a periodic tick instead of a deadline or a wake-up. Idle CPU itself is measured by the
benchmark's footprint section, not asserted here."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from pysyncobj import SyncObjConf

from support.raft_counter import Counter
from support.waiting import wait_for
from lighthouse_cluster.core.codec import ConfirmLeadership
from lighthouse_cluster.core.state_machine import QuorumStateMachine
from lighthouse_cluster.raft.adaptive_tick import tick_wait
from lighthouse_cluster.raft.fast_election import FastElectionSyncObj
from lighthouse_cluster.raft.replication import RaftNode, RaftSettings, ReplicatedState

# Far longer than any wait_for below: a tick that happens anyway came from a deadline or a wake-up.
LONG_S = 60.0


# -- tick_wait (pure) --------------------------------------------------------------------------------


def test_waits_until_the_nearest_future_deadline() -> None:
    assert tick_wait(10.0, 9.99, [10.5, 10.2, 11.0], overdue_s=0.01, longest_s=1.0) == pytest.approx(0.2)


def test_never_longer_than_the_longest_wait() -> None:
    assert tick_wait(10.0, 9.99, [], overdue_s=0.01, longest_s=0.1) == 0.1
    assert tick_wait(10.0, 9.99, [50.0], overdue_s=0.01, longest_s=0.1) == 0.1


def test_a_deadline_that_came_due_during_the_tick_means_no_wait() -> None:
    assert tick_wait(10.0, 9.99, [9.995, 12.0], overdue_s=0.01, longest_s=1.0) == 0.0
    assert tick_wait(10.0, 9.99, [10.0], overdue_s=0.01, longest_s=1.0) == 0.0


def test_a_deadline_due_before_the_tick_and_still_pending_is_retried_after_the_fixed_tick() -> None:
    # pysyncobj looked at it in that tick and did not act (no election while connected to no one).
    assert tick_wait(10.0, 9.99, [9.5, 12.0], overdue_s=0.01, longest_s=1.0) == 0.01
    assert tick_wait(10.0, 9.99, [9.5, 10.004], overdue_s=0.01, longest_s=1.0) == pytest.approx(0.004)
    assert tick_wait(10.0, 9.99, [9.5, 9.995], overdue_s=0.01, longest_s=1.0) == 0.0


# -- real pysyncobj nodes ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_tick_job_submitted_during_a_long_wait_runs_at_once() -> None:
    """A node with nothing due (elections held back, its only peer one it does not dial and that
    never comes) waits LONG_S; ``call_on_tick_thread`` and ``destroy`` must end that wait."""
    me = f"127.0.0.1:{_free_port()}"
    peer = "127.0.0.2:1"  # greater than ``me``: it would dial us, we never dial it
    raft = RaftNode(me, [peer], ReplicatedState(QuorumStateMachine()),
                    settings=RaftSettings(idle_tick_max_s=LONG_S), hold_elections_until_leader=True)
    syncobj = raft._syncobj
    try:
        wait_for("the tick thread waiting LONG_S", lambda: syncobj.last_wait == LONG_S, 10.0)
        ran = threading.Event()
        submitted = time.monotonic()
        raft.call_on_tick_thread(lambda: threading.current_thread().name, lambda _r, _e: ran.set())
        assert ran.wait(5.0), "a tick job waited for the tick thread's next deadline"
        assert time.monotonic() - submitted < 5.0
    finally:
        raft.destroy()
    wait_for("the tick thread to end after destroy()", lambda: not syncobj.tick_thread_alive(), 5.0)


@pytest.fixture
def nodes() -> Iterator[list[FastElectionSyncObj]]:
    """Three nodes with the project's Raft timing and a longest wait of LONG_S."""
    addrs = [f"127.0.0.1:{_free_port()}" for _ in range(3)]
    out = []
    try:
        for a in addrs:
            conf = SyncObjConf(autoTickPeriod=0.01, raftMinTimeout=0.15, raftMaxTimeout=0.45,
                               appendEntriesPeriod=0.0375, connectionTimeout=0.5, connectionRetryTime=0.25,
                               appendEntriesUseBatch=False)
            counter = Counter()
            out.append(FastElectionSyncObj(a, [x for x in addrs if x != a], conf=conf, consumers=[counter],
                                           longest_s=LONG_S))
            out[-1].counter = counter  # type: ignore[attr-defined]
        wait_for("a leader", lambda: any(n._isLeader() for n in out), 10)
        yield out
    finally:
        for n in out:
            n.destroy()


@pytest.mark.integration
@pytest.mark.exclusive  # no election in ~1.5 s of heartbeats: runs alone
@pytest.mark.timeout(60)
def test_an_idle_leader_keeps_its_followers_and_writes_go_through(nodes: list[FastElectionSyncObj]) -> None:
    """The leader's heartbeats are deadlines: without them its followers would time out (at most
    0.45 s) and raise the term while the leader waits LONG_S."""
    leader = next(n for n in nodes if n._isLeader())
    followers = [n for n in nodes if n is not leader]
    term = leader.raftCurrentTerm
    start = [f.tick_waits for f in followers]
    # ~1.5 s of heartbeats (every 37.5 ms) and keep-alives: several election timeouts.
    wait_for("40 ticks on each follower",
             lambda: all(f.tick_waits - s >= 40 for f, s in zip(followers, start)), 20.0)
    assert [n.raftCurrentTerm for n in nodes] == [term] * 3
    assert leader._isLeader()
    # A write on a follower: forwarded, appended, acknowledged, committed and applied everywhere,
    # every step an event (pysyncobj's pipe, a socket), none waiting for a deadline.
    started = time.monotonic()
    assert followers[0].counter.inc(sync=True, timeout=5) == 1  # type: ignore[attr-defined]
    assert time.monotonic() - started < 5.0
    wait_for("the write applied on every node", lambda: all(n.counter.n == 1 for n in nodes), 5.0)  # type: ignore[attr-defined]


@pytest.mark.integration
@pytest.mark.exclusive  # a new leader within 3 s: runs alone
@pytest.mark.timeout(60)
def test_followers_elect_a_new_leader_on_time_when_the_leader_dies(nodes: list[FastElectionSyncObj]) -> None:
    """A follower's election deadline is a deadline: it stands within raftMaxTimeout of the last
    heartbeat, not after LONG_S (nor at its next keep-alive, which also ends its wait)."""
    leader = next(n for n in nodes if n._isLeader())
    survivors = [n for n in nodes if n is not leader]
    term = leader.raftCurrentTerm
    # Read twice, and the tick thread may move it in between: awaited until both reads agree.
    for f in survivors:
        wait_for("the election deadline among a follower's tick deadlines",
                 lambda f=f: f.pso_election_deadline in f.tick_deadlines(), 5.0)
    wait_for("the next heartbeat among the leader's tick deadlines",
             lambda: leader.pso_next_append_entries() in leader.tick_deadlines(), 5.0)
    leader.destroy()
    died = time.monotonic()
    # raftMaxTimeout 0.45 s, plus slack for a busy 2-core machine.
    new = wait_for("a new leader among the survivors",
                   lambda: next((n for n in survivors if n._isLeader() and n.raftCurrentTerm > term), None), 3.0)
    assert new is not None and time.monotonic() - died < 3.0


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_raft_node_reports_a_new_leader_through_on_view_changed() -> None:
    """The node's watch loop no longer polls Raft: ``on_view_changed`` must report the leader it
    follows after a failover (and the connections that changed)."""
    addrs = [f"127.0.0.1:{_free_port()}" for _ in range(3)]
    rafts: dict[str, RaftNode] = {}
    views: dict[str, list[str | None]] = {a: [] for a in addrs}

    def reporter(address: str) -> Callable[[], None]:
        def report() -> None:  # on the tick thread
            raft = rafts.get(address)
            views[address].append(raft.leader_address if raft is not None else None)
        return report

    try:
        for a in addrs:
            rafts[a] = RaftNode(a, [x for x in addrs if x != a], ReplicatedState(QuorumStateMachine()),
                                on_view_changed=reporter(a))
        leader = wait_for("a leader", lambda: next((a for a, r in rafts.items() if r.is_leader), None), 10.0)
        wait_for("every node reported the leader", lambda: all(leader in views[a] for a in addrs), 10.0)
        rafts.pop(leader).destroy()
        new = wait_for("a new leader", lambda: next((a for a, r in rafts.items() if r.is_leader), None), 10.0)
        wait_for("both survivors reported the new leader", lambda: all(new in views[a] for a in rafts), 5.0)
    finally:
        for r in rafts.values():
            r.destroy()


@pytest.mark.integration
@pytest.mark.exclusive  # ack rate and no election: runs alone
@pytest.mark.timeout(60)
def test_followers_acknowledge_idle_heartbeats_seldom_and_the_leader_keeps_leading() -> None:
    """idle_acks: repeated acknowledgements go out every connectionTimeout / 5, not per heartbeat;
    the leader still hears from its followers within leaderFallbackTimeout (1 s here, as
    deployed) and within the connection timeout, so it neither steps down nor drops a link."""
    addrs = [f"127.0.0.1:{_free_port()}" for _ in range(3)]
    rafts = [RaftNode(a, [x for x in addrs if x != a], ReplicatedState(QuorumStateMachine())) for a in addrs]
    try:
        leader = wait_for("a leader", lambda: next((r for r in rafts if r.is_leader), None), 10.0)
        followers = [r for r in rafts if r is not leader]
        term = leader.term
        start = [(f._syncobj.acks_sent, f._syncobj.acks_skipped) for f in followers]
        started = time.monotonic()
        # ~2.5 s at ~18 skipped acks/s: more than twice the leader's fallback timeout.
        wait_for("45 skipped acks on each follower",
                 lambda: all(f._syncobj.acks_skipped - s[1] >= 45 for f, s in zip(followers, start)), 20.0)
        elapsed = time.monotonic() - started
        for f, (sent0, skipped0) in zip(followers, start):
            sent, skipped = f._syncobj.acks_sent - sent0, f._syncobj.acks_skipped - skipped0
            assert sent < skipped, (sent, skipped)  # one ack in three heartbeats or fewer
            # ... but one at least every ~0.1 s (at the first heartbeat past ack_every_s), not only
            # when the leader dropped a link it had read nothing on for the connection timeout.
            assert sent >= elapsed / 0.25, (sent, elapsed)
        assert leader.is_leader and [r.term for r in rafts] == [term] * 3
        assert all(leader.is_connected(f.self_address) for f in followers)
        # New entries are acknowledged at once: a write commits promptly on the idle cluster.
        done: list[Exception | None] = []
        leader.submit(ConfirmLeadership(term=term, node_id="n1", lease_ms=100), lambda _r, e: done.append(e))
        assert wait_for("the write committed", lambda: done, 5.0) == [None]
    finally:
        for r in rafts:
            r.destroy()
