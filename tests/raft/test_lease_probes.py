"""extensions/lease_probes.py: a leader confirms its leadership with one acknowledged heartbeat and no log entry
(the quorum lease's renewals, docs/design/lease-renewal.md). The majority rule alone, then three
in-process pysyncobj nodes on loopback: refused off the term or off the leader, echoed even while a
follower holds back its acknowledgements, an echo of another term or from the future counting for
nothing (confirmed with no entry written, by one live follower of two, not by none, not by followers
that do not echo: a case of tests/raft/test_sim_raft.py). Then a leader whose every heartbeat is a
probe (``stream_confirmations``): each one confirmed, with no message of its own, until the stream
stops or the term ends."""

from __future__ import annotations

import queue
from typing import Any
from collections.abc import Iterator

import pytest
from pysyncobj import SyncObjConf

from support.raft_nodes import run_on_tick_thread, start_nodes
from support.waiting import wait_for
from lighthouse_cluster.raft.pysyncobj_internals import monotonic
from lighthouse_cluster.raft.composed_node import EXTENSION_CLASSES, LighthouseSyncObj
from lighthouse_cluster.raft.extensions.lease_probes import (LEASE_PROBE_KEY, PROBE_EXPIRY_S, LeaseProbes,
                                                              confirmed_since)


# -- the majority rule (no processes) ------------------------------------------------------------

def test_a_majority_of_echoes_confirms_the_probes_up_to_its_oldest_member() -> None:
    # 3 members: this leader and one follower are a majority.
    assert confirmed_since([], 3) is None
    assert confirmed_since([5.0], 3) == 5.0
    assert confirmed_since([5.0, 7.0], 3) == 7.0
    # 5 members: two followers needed; the second most recent echo bounds what is confirmed.
    assert confirmed_since([9.0], 5) is None
    assert confirmed_since([9.0, 4.0, 6.0], 5) == 6.0
    assert confirmed_since([1.0, 2.0, 3.0, 4.0], 5) == 3.0
    # One member is its own majority; two need the other.
    assert confirmed_since([], 1) == float("inf")
    assert confirmed_since([], 2) is None and confirmed_since([3.0], 2) == 3.0


# -- three real nodes -----------------------------------------------------------------------------


def _conf() -> SyncObjConf:
    return SyncObjConf(autoTickPeriod=0.01, raftMinTimeout=0.15, raftMaxTimeout=0.45, appendEntriesPeriod=0.0375,
                       connectionTimeout=0.5, connectionRetryTime=0.25, appendEntriesUseBatch=False)


class _CountingProbes(LeaseProbes):
    """Lease probes that count the append_entries going out (every one passes through them)."""

    def __init__(self) -> None:
        super().__init__()
        self.append_entries_out = 0

    def message_out(self, node: Any, message: Any) -> Any:
        if isinstance(message, dict) and message.get("type") == "append_entries":
            self.append_entries_out += 1
        return super().message_out(node, message)


class _UnmarkedProbes(LeaseProbes):
    """A leader whose append_entries never carry its probes: only a forged echo could confirm one."""

    def message_out(self, node: Any, message: Any) -> Any:
        if isinstance(message, dict) and message.get("type") == "append_entries":
            return message
        return super().message_out(node, message)


class _Counted(LighthouseSyncObj):
    __slots__ = ()
    extension_classes = {**EXTENSION_CLASSES, "lease_probes": _CountingProbes}


class _Unmarked(LighthouseSyncObj):
    __slots__ = ()
    extension_classes = {**EXTENSION_CLASSES, "lease_probes": _UnmarkedProbes}


def _start(classes: list[type[LighthouseSyncObj]]) -> list[LighthouseSyncObj]:
    return start_nodes(classes, lambda out: any(n._isLeader() for n in out)
                       and all(n._getLeader() is not None for n in out), conf=_conf())


@pytest.fixture
def nodes(request: pytest.FixtureRequest) -> Iterator[list[LighthouseSyncObj]]:
    out = _start(getattr(request, "param", [_Counted] * 3))
    try:
        yield out
    finally:
        for n in out:
            n.destroy()


def _probe(node: LighthouseSyncObj, term: int | None = None, timeout: float = PROBE_EXPIRY_S + 5.0) -> bool:
    answers: queue.Queue[bool] = queue.Queue()
    run_on_tick_thread(node, lambda: node.probe_leadership(node.raftCurrentTerm if term is None else term, answers.put))
    return answers.get(timeout=timeout)


def _leader(nodes: list[LighthouseSyncObj]) -> LighthouseSyncObj:
    return next(n for n in nodes if n._isLeader())


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_probe_off_the_term_or_off_the_leader_is_refused_at_once(nodes: list[LighthouseSyncObj]) -> None:
    leader = _leader(nodes)
    follower = next(n for n in nodes if n is not leader)
    assert _probe(leader, term=leader.raftCurrentTerm + 1, timeout=PROBE_EXPIRY_S / 2) is False
    assert _probe(leader, term=leader.raftCurrentTerm - 1, timeout=PROBE_EXPIRY_S / 2) is False
    assert _probe(follower, timeout=PROBE_EXPIRY_S / 2) is False


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_follower_holding_back_its_acknowledgements_still_echoes_a_probe(nodes: list[LighthouseSyncObj]) -> None:
    # An idle leader's heartbeats are acknowledged a few times a second (idle_acks): an echo that
    # waited for the next one would come ~100 ms late, and an ack held back would carry none.
    leader = _leader(nodes)
    followers = [n for n in nodes if n is not leader]
    skipped = sum(n.ext.idle_acks.acks_skipped for n in followers)
    wait_for("the followers holding back repeated acknowledgements",
             lambda: sum(n.ext.idle_acks.acks_skipped for n in followers) > skipped + 10, 10)
    echoed = sum(n.ext.lease_probes.lease_probes_echoed for n in followers)
    for _ in range(10):
        assert _probe(leader) is True
    assert sum(n.ext.lease_probes.lease_probes_echoed for n in followers) >= echoed + 10


@pytest.mark.integration
@pytest.mark.timeout(60)
@pytest.mark.parametrize("nodes", [[_Unmarked, _Unmarked, _Unmarked]], indirect=True)
def test_an_echo_of_another_term_or_from_the_future_counts_for_nothing(nodes: list[LighthouseSyncObj]) -> None:
    leader = _leader(nodes)
    follower = next(n for n in nodes if n is not leader)
    answers: queue.Queue[bool] = queue.Queue()

    def forged() -> None:
        # A probe is pending (no heartbeat carries it); echoes that do not prove it arrive.
        term = leader.raftCurrentTerm
        leader.probe_leadership(term, answers.put)
        node = next(n for n in leader.otherNodes if n.address == follower.selfNode.address)
        for value in [(term - 1, 1e18), (term + 1, 0.0), (term, 1e18), "nonsense", (True, 0.0)]:
            leader.on_raft_message(node, {"type": "next_node_idx", "next_node_idx": 1, "reset": False,
                                          "success": False, LEASE_PROBE_KEY: value})

    run_on_tick_thread(leader, forged)
    assert answers.get(timeout=PROBE_EXPIRY_S + 5.0) is False


# -- heartbeats as probes (stream_confirmations) ---------------------------------------------------


class _Confirmations:
    """What a stream reports, from the tick thread."""

    def __init__(self) -> None:
        self.times: queue.Queue[float] = queue.Queue()

    def __call__(self, since: float) -> None:
        self.times.put(since)

    def drain(self) -> list[float]:
        out = []
        while not self.times.empty():
            out.append(self.times.get_nowait())
        return out


class _AppendEntriesSent:
    """Counts the append_entries a ``_Counted`` node sends from now (one per follower per heartbeat
    or entry)."""

    def __init__(self, node: LighthouseSyncObj) -> None:
        self._probes = node.ext.lease_probes
        self._start = self._probes.append_entries_out

    @property
    def count(self) -> int:
        return self._probes.append_entries_out - self._start


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_every_heartbeat_of_a_streaming_leader_is_a_confirmed_probe_and_nothing_more(
        nodes: list[LighthouseSyncObj]) -> None:
    leader = _leader(nodes)
    wait_for("every entry committed everywhere",
             lambda: len({(n.raftCommitIndex, n.pso_last_log()) for n in nodes}) == 1
             and all(n.raftCommitIndex == n.pso_last_log()[1] for n in nodes), 10)
    before = [(n.pso_last_log(), n.raftCommitIndex) for n in nodes]
    sent = _AppendEntriesSent(leader)
    term = leader.raftCurrentTerm
    seen = _Confirmations()
    run_on_tick_thread(leader, lambda: leader.stream_confirmations(term, seen))
    wait_for("20 confirmations", lambda: seen.times.qsize() >= 20, 10)
    run_on_tick_thread(leader, lambda: leader.stream_confirmations(term, None))
    times = seen.drain()
    marked, heartbeats = leader.ext.lease_probes.lease_probes_sent, sent.count
    # Each a later send time of the leader's clock, and no entry written anywhere.
    assert times == sorted(times) and len(set(times)) == len(times) and times[-1] <= monotonic()
    assert [(n.pso_last_log(), n.raftCommitIndex) for n in nodes] == before
    # They came with the leader's heartbeats: every append_entries carried a probe, and none went
    # out for a probe alone (20 confirmations: about 20 heartbeats to each of two followers).
    assert marked == heartbeats, (marked, heartbeats)
    assert heartbeats <= 2 * (len(times) + 3), (heartbeats, len(times))
    # Stopped: the heartbeats that follow carry no probe and confirm nothing.
    wait_for("ten more heartbeats", lambda: sent.count >= heartbeats + 10, 10)
    assert leader.ext.lease_probes.lease_probes_sent == marked and seen.drain() == []


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_stream_confirms_with_one_live_follower_of_two_and_not_with_none(
        nodes: list[LighthouseSyncObj]) -> None:
    leader = _leader(nodes)
    a, b = (n for n in nodes if n is not leader)
    a.destroy()
    seen = _Confirmations()
    term = leader.raftCurrentTerm
    run_on_tick_thread(leader, lambda: leader.stream_confirmations(term, seen))
    wait_for("confirmations from the leader and b", lambda: seen.times.qsize() >= 5, 10)
    b.destroy()
    wait_for("the leader sees both followers gone",
             lambda: not any(leader.isNodeConnected(n) for n in leader.otherNodes), 10)
    run_on_tick_thread(leader, lambda: None)  # whatever b echoed before it went is read by now
    seen.drain()
    # No majority: three heartbeat periods (a confirmation each, before) report nothing.
    deadline = monotonic() + 3 * leader.conf.appendEntriesPeriod
    wait_for("three heartbeat periods", lambda: monotonic() > deadline, 5)
    assert seen.drain() == []


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_stream_of_another_term_marks_and_reports_nothing(nodes: list[LighthouseSyncObj]) -> None:
    leader = _leader(nodes)
    sent = _AppendEntriesSent(leader)
    seen = _Confirmations()
    marked = leader.ext.lease_probes.lease_probes_sent
    run_on_tick_thread(leader, lambda: leader.stream_confirmations(leader.raftCurrentTerm - 1, seen))
    wait_for("ten heartbeats", lambda: sent.count >= 10, 10)
    assert leader.ext.lease_probes.lease_probes_sent == marked and seen.drain() == []
