"""raft/extensions/quiescence.py on three real Raft nodes (in-process, loopback): followers keep their links
alive when a quiet leader's heartbeats stop, a follower woken by a client replaces a leader that
died while quiet on its normal timeouts, no quiescence before the schema, few busy checks. (An
idle cluster quiescing without an election and a client waking it: a case of
tests/raft/test_sim_raft.py.)"""

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
def test_followers_keep_their_link_alive_when_a_quiet_leaders_heartbeats_stop(rafts: list[RaftNode]) -> None:
    """A quiet leader that stops heartbeating without closing its connections (its host hangs):
    the followers' keep-alives, which went with its heartbeats, go on a timer, and their link stays
    up for the election to come (pysyncobj drops a link that read nothing for connectionTimeout,
    and with it the first vote request: docs/design/fast-election.md)."""
    leader = leader_of(rafts)
    a, b = (r for r in rafts if r is not leader)
    wait_for("the leader and its followers quiet", lambda: leader.quiet and a.quiet and b.quiet, 10.0)
    sent = a._syncobj.ext.fast_election.keepalives_sent
    hang_s = 1.2  # > 2 connectionTimeouts (0.5 s) without a heartbeat
    leader.call_on_tick_thread(lambda: time.sleep(hang_s), lambda _r, _e: None)
    started, states = time.monotonic(), []
    while time.monotonic() - started < hang_s:
        states.append(on_tick_thread(a, lambda s: s.isNodeConnected(b._syncobj.selfNode)))
        time.sleep(0.05)
    assert all(states), states
    assert a._syncobj.ext.fast_election.keepalives_sent - sent >= 2  # at most 0.35 s apart while no heartbeat came


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
        assert leader._syncobj.ext.quiescence.quiet_spells == 0
    finally:
        for r in rafts:
            r.destroy()


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_leader_with_a_recent_client_looks_at_its_log_and_followers_only_a_few_times_a_second(
        rafts: list[RaftNode]) -> None:
    """Whether to quiesce is no while a client is recent: the leader does not work it out on every
    tick (it was ~10 % of a busy leader's tick thread), only every ``BUSY_CHECK_S``."""
    from lighthouse_cluster.raft.extensions.quiescence import BUSY_CHECK_S

    leader = leader_of(rafts)
    looked: list[float] = []
    ticks: list[float] = []

    def instrument(s: Any) -> None:
        quiescence = s.ext.quiescence
        allowed = quiescence._quiet_allowed

        def counting() -> bool:
            looked.append(monotonic())
            return allowed()

        quiescence._quiet_allowed = counting

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
