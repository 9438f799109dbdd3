"""adaptive_tick: pysyncobj's tick thread sleeps until its next deadline (issue 18, idle cost).

``tick_wait`` is pure and tested as such; the rest runs real pysyncobj nodes on loopback whose
longest wait is far beyond any bound awaited here, so that each test fails if what it checks
depended on a periodic tick instead of a deadline or a wake-up: what a wake-up through pysyncobj's
pipe and the node's view callback need. Heartbeats and election deadlines as tick deadlines, and
idle acknowledgements, are cases of tests/raft/test_sim_raft.py. Idle CPU itself is measured by the
benchmark's footprint section, not asserted here."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import pytest

from support.waiting import wait_for
from lighthouse_cluster.core.state_machine import QuorumStateMachine
from lighthouse_cluster.raft.extensions.adaptive_tick import tick_wait
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
        wait_for("the tick thread waiting LONG_S", lambda: syncobj.ext.adaptive_tick.last_wait == LONG_S, 10.0)
        ran = threading.Event()
        submitted = time.monotonic()
        raft.call_on_tick_thread(lambda: threading.current_thread().name, lambda _r, _e: ran.set())
        assert ran.wait(5.0), "a tick job waited for the tick thread's next deadline"
        assert time.monotonic() - submitted < 5.0
    finally:
        raft.destroy()
    wait_for("the tick thread to end after destroy()", lambda: not syncobj.tick_thread_alive(), 5.0)


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
