"""raft/quiescence.py on three real Raft nodes (in-process, loopback): a leader with no client
heartbeats slowly without costing an election, wakes on a client's call, and a follower woken by
a client replaces a leader that died while quiet on its normal timeouts."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from support.waiting import wait_for
from lighthouse_cluster.core import codec
from lighthouse_cluster.core.codec import EnableSchema
from lighthouse_cluster.core.state_machine import QuorumStateMachine
from lighthouse_cluster.local.cluster import free_ports
from lighthouse_cluster.raft.pysyncobj_internals import monotonic
from lighthouse_cluster.raft.replication import RaftNode, RaftSettings, ReplicatedState

QUIET_AFTER_S = 0.5
SETTINGS = RaftSettings(quiet_after_s=QUIET_AFTER_S)


def start(schema: int = codec.SCHEMA_VERSION) -> list[RaftNode]:
    """Three nodes; the leader enables ``schema`` (what a node's leader does once every member
    runs it), so the nodes know their cluster's version."""
    addrs = [f"127.0.0.1:{p}" for p in free_ports(3)]
    rafts: list[RaftNode] = []
    try:
        for a in addrs:
            rafts.append(RaftNode(a, [x for x in addrs if x != a], ReplicatedState(QuorumStateMachine(schema)),
                                  settings=SETTINGS))
        leader = wait_for("a leader", lambda: next((r for r in rafts if r.is_leader), None), 10.0)
        done = threading.Event()
        errors: list[Any] = []
        leader.submit(EnableSchema(version=schema), lambda _r, e: (errors.append(e), done.set()))
        assert done.wait(10.0) and errors == [None], errors
        wait_for("every node applied the schema", lambda: all(r.last_applied >= leader.commit_index for r in rafts),
                 10.0)
    except BaseException:
        for r in rafts:
            r.destroy()
        raise
    return rafts


@pytest.fixture
def rafts() -> Iterator[list[RaftNode]]:
    nodes = start()
    try:
        yield nodes
    finally:
        for r in nodes:
            r.destroy()


def on_tick_thread(raft: RaftNode, fn: Any) -> Any:
    """``fn(syncobj)`` run on ``raft``'s tick thread (its Raft state as of that moment)."""
    out: list[Any] = []
    done = threading.Event()
    raft.call_on_tick_thread(lambda: fn(raft._syncobj), lambda r, e: (out.append((r, e)), done.set()))
    assert done.wait(5.0), "the tick thread ran nothing for 5 s"
    result, error = out[0]
    if error is not None:
        raise error
    return result


def leader_of(rafts: list[RaftNode]) -> RaftNode:
    return wait_for("a leader", lambda: next((r for r in rafts if r.is_leader), None), 10.0)


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_an_idle_cluster_quiesces_without_an_election_and_a_client_wakes_it(rafts: list[RaftNode]) -> None:
    leader = leader_of(rafts)
    followers = [r for r in rafts if r is not leader]
    term = leader.term
    wait_for("the leader and its followers quiet", lambda: leader.quiet and all(f.quiet for f in followers), 10.0)
    assert leader._syncobj.conf.appendEntriesPeriod == SETTINGS.quiet_period_s
    # Followers wait a quiet leader's multiple of its period (a normal timeout, 0.15-0.45 s,
    # under heartbeats 200 ms apart would have them stand again and again).
    left = [on_tick_thread(f, lambda s: s.pso_election_deadline - monotonic()) for f in followers]
    assert all(x > SETTINGS.election_timeout_max_s for x in left), left
    # Quiet for a while: keep-alives at the quiet period, no election, the same leader.
    sent = [f._syncobj.keepalives_sent for f in followers]
    with_heartbeats = [f._syncobj.keepalives_with_heartbeats for f in followers]
    started = time.monotonic()
    time.sleep(2.0)  # the measured window itself
    rates = [(f._syncobj.keepalives_sent - s) / (time.monotonic() - started) for f, s in zip(followers, sent)]
    assert all(r < 7.5 for r in rates), rates  # quiet: one per 0.2 s; awake: one per 0.1 s
    # ... sent in the ticks that read the leader's heartbeats, not on wake-ups of their own (one
    # peer each here: a keep-alive round is one message). A late heartbeat may leave one or two to
    # the timer behind them.
    sent = [f._syncobj.keepalives_sent - s for f, s in zip(followers, sent)]
    along = [f._syncobj.keepalives_with_heartbeats - w for f, w in zip(followers, with_heartbeats)]
    assert all(n >= 5 for n in sent) and all(a >= n - 2 for a, n in zip(along, sent)), (sent, along)
    assert [r.term for r in rafts] == [term] * 3 and leader.is_leader
    assert all(f.leader_address == leader.self_address for f in followers)

    # A client's call on a follower: it wakes its leader (WAKE), and every node is awake.
    followers[0].note_client_activity()
    wait_for("every node awake", lambda: not any(r.quiet for r in rafts), 5.0)
    assert leader._syncobj.conf.appendEntriesPeriod == SETTINGS.append_entries_period_s
    assert followers[0]._syncobj.wakes_sent >= 1
    # ... and quiet again once the client is gone, still in the same term.
    wait_for("quiet again", lambda: leader.quiet and all(f.quiet for f in followers), 10.0)
    leader.note_client_activity()
    wait_for("awake on a call to the leader", lambda: not any(r.quiet for r in rafts), 5.0)
    assert [r.term for r in rafts] == [term] * 3 and leader._syncobj.quiet_spells >= 2


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_followers_keep_their_link_alive_when_a_quiet_leaders_heartbeats_stop(rafts: list[RaftNode]) -> None:
    """A quiet leader that stops heartbeating without closing its connections (its host hangs):
    the followers' keep-alives, which went with its heartbeats, go on a timer, and their link stays
    up for the election to come (pysyncobj drops a link that read nothing for connectionTimeout,
    and with it the first vote request: benchmarks F8)."""
    leader = leader_of(rafts)
    a, b = (r for r in rafts if r is not leader)
    wait_for("the leader and its followers quiet", lambda: leader.quiet and a.quiet and b.quiet, 10.0)
    sent = a._syncobj.keepalives_sent
    hang_s = 1.2  # > 2 connectionTimeouts (0.5 s) without a heartbeat
    leader.call_on_tick_thread(lambda: time.sleep(hang_s), lambda _r, _e: None)
    started, states = time.monotonic(), []
    while time.monotonic() - started < hang_s:
        states.append(on_tick_thread(a, lambda s: s.isNodeConnected(b._syncobj.selfNode)))
        time.sleep(0.05)
    assert all(states), states
    assert a._syncobj.keepalives_sent - sent >= 2  # at most 0.35 s apart while no heartbeat came


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_leader_that_dies_while_quiet_is_replaced_on_normal_timeouts_once_a_client_calls(
        rafts: list[RaftNode]) -> None:
    leader = leader_of(rafts)
    followers = [r for r in rafts if r is not leader]
    wait_for("quiet", lambda: leader.quiet and all(f.quiet for f in followers), 10.0)
    rafts.remove(leader)
    leader.destroy()
    died = time.monotonic()
    woken, other = followers
    woken.note_client_activity()
    wait_for("the woken follower out of quiet", lambda: not woken.quiet, 5.0)
    # Its election is due within a normal timeout (counted from the leader's last heartbeat, at
    # least raftMinTimeout from the wake); the other follower still waits a quiet one.
    due = on_tick_thread(woken, lambda s: s.pso_election_deadline - monotonic())
    assert due <= SETTINGS.election_timeout_min_s + SETTINGS.election_timeout_max_s, due
    other_due = on_tick_thread(other, lambda s: s.pso_election_deadline - monotonic())
    new = leader_of(rafts)
    assert new.term > leader.term
    print(f"a new leader {time.monotonic() - died:.2f} s after the quiet leader died and a client woke "
          f"{woken.self_address}; the other follower's election was due in {other_due:.2f} s")


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_cluster_that_has_not_enabled_the_schema_never_quiesces() -> None:
    """An older member would keep its short election timeout under slow heartbeats."""
    rafts = start(schema=codec.QUIESCENCE_SCHEMA_VERSION - 1)
    try:
        leader = leader_of(rafts)
        time.sleep(QUIET_AFTER_S + 1.0)  # past the quiet delay: nothing may change
        assert not any(r.quiet for r in rafts)
        assert leader._syncobj.conf.appendEntriesPeriod == SETTINGS.append_entries_period_s
        assert leader._syncobj.quiet_spells == 0
    finally:
        for r in rafts:
            r.destroy()


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_leader_with_a_recent_client_looks_at_its_log_and_followers_only_a_few_times_a_second(
        rafts: list[RaftNode]) -> None:
    """Whether to quiesce is no while a client is recent: the leader does not work it out on every
    tick (it was ~10 % of a busy leader's tick thread), only every ``BUSY_CHECK_S``."""
    from lighthouse_cluster.raft.quiescence import BUSY_CHECK_S

    leader = leader_of(rafts)
    looked: list[float] = []
    ticks: list[float] = []

    def instrument(s: Any) -> None:
        allowed = s._quiet_allowed

        def counting() -> bool:
            looked.append(monotonic())
            return allowed()

        s._quiet_allowed = counting

    leader.note_client_activity()
    on_tick_thread(leader, instrument)
    leader._syncobj.addOnTickCallback(lambda: ticks.append(monotonic()))  # not from a tick: its lock
    started = time.monotonic()
    while time.monotonic() - started < 1.0:  # a client calling every 20 ms for a second
        leader.note_client_activity()
        time.sleep(0.02)
    seen_ticks, seen_looks = len(ticks), len(looked)
    assert seen_ticks >= 20, seen_ticks  # a heartbeat each 37.5 ms, and its acknowledgements
    assert seen_looks <= 1.0 / BUSY_CHECK_S + 2, (seen_looks, seen_ticks)
    assert not leader.quiet
