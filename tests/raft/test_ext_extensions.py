"""``raft/extensions/``: each extension's pure policy, and its hooks against a fake host.

No sockets, no threads: ``FakeHost`` has only what the extensions read and records what they do.
"""

from __future__ import annotations

import collections
from types import SimpleNamespace
from typing import Any

import pytest

from lighthouse_cluster.raft.extensions.adaptive_tick import AdaptiveTick
from lighthouse_cluster.raft.extensions.durable_sync import DurableSync
from lighthouse_cluster.raft.extensions.fast_election import (DEPOSE_KEY, KEEPALIVE, FastElection,
                                                              refusal_starts_election)
from lighthouse_cluster.raft.extensions.idle_acks import IdleAcks, ack_held_back
from lighthouse_cluster.raft.extensions.lease_probes import LEASE_PROBE_KEY, LeaseProbes, parse_probe
from lighthouse_cluster.raft.extensions.quiescence import QUIET_KEY, WAKE, Quiescence, quiet_keepalive_floor_s
from lighthouse_cluster.raft.extensions.signals import NodeSignals, draw_election_timeout
from lighthouse_cluster.raft.extensions.stall_tolerance import PATIENCE_KEY, StallTolerance, asked_patience_s
from lighthouse_cluster.raft.host import Ack
from lighthouse_cluster.raft.pysyncobj_internals import RAFT_STATE, monotonic


class FakeHost:
    """The host surface the extensions use, with a settable role and a record of what they did."""

    def __init__(self, *, leader: bool = False) -> None:
        self.conf = SimpleNamespace(connectionTimeout=0.5, raftMinTimeout=0.15, raftMaxTimeout=0.45,
                                    appendEntriesPeriod=0.0375, connectionRetryTime=0.25)
        self.leader = leader
        self.raftCurrentTerm = 3
        self.otherNodes = {"b", "c"}
        self.selfNode = SimpleNamespace(id="a")
        self.connected = {"b", "c"}
        self.sent: list[tuple[Any, Any]] = []
        self.pso_election_deadline = 0.0
        self.pso_journal = SimpleNamespace(syncs=0)
        self.pso_journal.sync = lambda: setattr(self.pso_journal, "syncs", self.pso_journal.syncs + 1)
        self.woken = 0
        self.appended_now = 0
        self.pso_voted_for = None

    @property
    def pso_state(self) -> int:
        return RAFT_STATE.LEADER if self.leader else RAFT_STATE.FOLLOWER

    def _isLeader(self) -> bool:  # noqa: N802
        return self.leader

    def _getLeader(self) -> Any:
        return "a" if self.leader else "b"

    def isNodeConnected(self, node: Any) -> bool:  # noqa: N802
        return node in self.connected

    def pso_send(self, node: Any, message: Any) -> bool:
        self.sent.append((node, message))
        return node in self.connected

    def pso_last_log(self) -> tuple[int, int]:
        return 3, 10

    def pso_election_timeout(self) -> float:
        return 0.2

    def pso_send_append_entries_now(self) -> None:
        self.appended_now += 1

    def wake(self) -> None:
        self.woken += 1

    def is_current_leaders_append(self, node: Any, message: Any) -> bool:
        return (isinstance(message, dict) and message.get("type") == "append_entries" and not self.leader
                and message.get("term") == self.raftCurrentTerm and node == self._getLeader())


# -- pure policies -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, held", [
    (dict(success=True, reset=False, must_send=False), True),
    (dict(success=True, reset=False, must_send=True), False),   # a lease probe's echo
    (dict(success=False, reset=False, must_send=False), False),  # a refusal
    (dict(success=True, reset=True, must_send=False), False),   # a reset
])
def test_only_a_plain_repeat_within_the_period_is_held_back(kwargs: dict[str, bool], held: bool) -> None:
    key = ("b", 3, 11)
    assert ack_held_back(key, key, 1.05, 1.0, 0.1, **kwargs) is held
    assert ack_held_back(key, key, 1.2, 1.0, 0.1, **kwargs) is False   # the period has passed
    assert ack_held_back(key, ("b", 3, 10), 1.05, 1.0, 0.1, **kwargs) is False  # new entries


def test_a_refusal_starts_an_election_only_against_a_strictly_shorter_log_with_the_leader_gone() -> None:
    go = dict(since_leader_s=0.1, min_timeout_s=0.15, term_matches=True, follower_without_vote_or_leader=True)
    assert refusal_starts_election((2, 50), (3, 10), **go)
    assert refusal_starts_election((3, 9), (3, 10), **go)
    assert not refusal_starts_election((3, 10), (3, 10), **go)  # as up to date: no trigger either way
    assert not refusal_starts_election((2, 50), (3, 10), **{**go, "since_leader_s": 0.05})  # the leader lives
    assert not refusal_starts_election((2, 50), (3, 10), **{**go, "term_matches": False})
    assert not refusal_starts_election((2, 50), (3, 10), **{**go, "follower_without_vote_or_leader": False})


def test_patience_asked_is_a_positive_number_capped() -> None:
    assert asked_patience_s(0.3) == 0.3
    assert asked_patience_s(60) == 2.0
    assert asked_patience_s(-1) == asked_patience_s("1") == asked_patience_s(None) == 0.0


def test_a_quiet_followers_keepalive_timer_is_bounded_by_the_connection_timeout() -> None:
    assert quiet_keepalive_floor_s(0.2, 0.5) == pytest.approx(0.35)
    assert quiet_keepalive_floor_s(1.0, 0.5) == pytest.approx(0.35)
    assert quiet_keepalive_floor_s(0.1, 0.5) == pytest.approx(0.175)


def test_probes_parse_only_as_term_and_time() -> None:
    assert parse_probe((4, 1.5)) == (4, 1.5) and parse_probe([4, 2]) == (4, 2.0)
    assert parse_probe((True, 1.0)) is parse_probe((4,)) is parse_probe("x") is parse_probe((4, "t")) is None


def test_an_election_timeout_adds_the_leaders_patience() -> None:
    signals = NodeSignals(leader_patience_s=0.5)
    assert draw_election_timeout(0.2, signals) == pytest.approx(0.7)


# -- extensions on a fake host ---------------------------------------------------------------------------


def test_durable_sync_syncs_before_each_tick_at_its_end_and_before_an_ack() -> None:
    host, ext = FakeHost(), DurableSync()
    ext.attach(host)  # type: ignore[arg-type]
    ext.before_tick()
    ext.on_tick_callback()
    assert ext.ack_out(Ack("b", False, 11, True)) is True
    assert host.pso_journal.syncs == 3


def test_idle_acks_hold_back_a_repeat_and_send_it_after_the_link_dropped() -> None:
    host, ext = FakeHost(), IdleAcks()
    ext.attach(host)  # type: ignore[arg-type]
    ack = Ack("b", False, 11, True)
    assert ext.ack_out(ack)
    ext.ack_sent(ack)
    assert not ext.ack_out(Ack("b", False, 11, True)) and ext.acks_skipped == 1
    assert ext.ack_out(Ack("b", False, 11, True, must_send=True))
    host.connected.discard("b")
    ext.before_tick()  # the link to the leader dropped: the last ack may be lost
    assert ext.ack_out(Ack("b", False, 11, True))


def test_adaptive_tick_waits_until_the_next_deadline_and_publishes_its_lateness() -> None:
    signals = NodeSignals()
    host, ext = FakeHost(), AdaptiveTick(signals, longest_s=0.1)
    host.pso_can_wake, host.commands_overran = True, False
    host.tick_deadlines = lambda: [monotonic() + 0.05]
    ext.attach(host)  # type: ignore[arg-type]
    ext.before_tick()
    wait = ext.tick_wait(0.01)
    assert wait is not None and 0.04 < wait <= 0.05
    assert signals.tick_lateness(ext.poll_due + 0.2) == pytest.approx(0.2)
    host.pso_can_wake = False
    assert ext.tick_wait(0.01) is None  # without pysyncobj's pipe: the fixed tick


def test_fast_election_takes_keepalives_and_deposes_only_as_leader() -> None:
    signals = NodeSignals()
    host = FakeHost()
    ext = FastElection(signals, host.conf)
    ext.attach(host)  # type: ignore[arg-type]
    assert ext.message_in("b", KEEPALIVE) is True
    assert ext.message_in("b", {"type": "request_vote", "term": 9, DEPOSE_KEY: True}) is True
    ext.send_keepalives(monotonic())
    assert [n for n, m in host.sent if m == KEEPALIVE] == ["c"]  # not to its leader "b"
    host.leader = True
    ext.send_keepalives(monotonic())
    assert len(host.sent) == 1  # a leader sends none


def test_fast_election_puts_off_a_vote_within_the_refusal_window() -> None:
    signals = NodeSignals()
    host = FakeHost()
    ext = FastElection(signals, host.conf)
    ext.attach(host)  # type: ignore[arg-type]
    assert ext.message_in("c", {"type": "append_entries", "term": 3}) is False
    request = {"type": "request_vote", "term": 4, "last_log_term": 3, "last_log_index": 10}
    assert ext.message_in("c", request) is True and ext.votes_put_off == 1
    assert list(ext.next_deadlines())[-1] == pytest.approx(signals.heard_leader_at + 0.15)


def test_stall_tolerance_marks_append_entries_with_its_patience_and_reads_the_leaders() -> None:
    signals = NodeSignals()
    host, ext = FakeHost(), StallTolerance(signals)
    ext.attach(host)  # type: ignore[arg-type]
    assert ext.message_out("b", {"type": "append_entries"}) == {"type": "append_entries"}
    ext.patience_asked_s = 0.4
    assert ext.message_out("b", {"type": "append_entries"})[PATIENCE_KEY] == 0.4
    assert PATIENCE_KEY not in ext.message_out("b", {"type": "next_node_idx"})
    ext.message_handled("b", {"type": "append_entries", "term": 3, PATIENCE_KEY: 0.3}, False)
    assert signals.leader_patience_s == 0.3 and host.pso_election_deadline > monotonic() + 0.4


def test_quiescence_takes_wake_and_marks_quiet_heartbeats() -> None:
    signals = NodeSignals()
    host, ext = FakeHost(leader=True), Quiescence(signals, quiet_after_s=1.0, quiet_period_s=0.2)
    ext.attach(host)  # type: ignore[arg-type]
    ext.on_started()
    ext._set_quiet(True)
    assert host.conf.appendEntriesPeriod == 0.2 and signals.longest_wait_floor_s() == 0.2
    assert ext.message_out("b", {"type": "append_entries"})[QUIET_KEY] == 0.2
    assert ext.message_in("b", WAKE) is True
    assert not ext.quiet and host.conf.appendEntriesPeriod == 0.0375 and host.appended_now == 1


def test_a_quiet_leaders_follower_sends_keepalives_with_its_heartbeats() -> None:
    signals = NodeSignals()
    sent: list[float] = []
    signals.send_keepalives = sent.append
    host, ext = FakeHost(), Quiescence(signals, quiet_after_s=0.0, quiet_period_s=0.2)
    ext.attach(host)  # type: ignore[arg-type]
    ext.message_handled("b", {"type": "append_entries", "term": 3, QUIET_KEY: 0.2}, False)
    assert ext.leader_quiet and len(sent) == 1
    assert signals.keepalive_period_floor_s() == pytest.approx(0.35)
    assert host.pso_election_deadline >= monotonic() + 0.7


def test_lease_probes_mark_append_entries_echo_them_and_confirm_with_a_majority() -> None:
    leader, probes = FakeHost(leader=True), LeaseProbes()
    probes.attach(leader)  # type: ignore[arg-type]
    results: list[bool] = []
    probes.probe_leadership(3, results.append)
    assert leader.appended_now == 1 and leader.woken == 1
    marked = probes.message_out("b", {"type": "append_entries", "term": 3})
    term, sent = marked[LEASE_PROBE_KEY]
    assert term == 3

    follower, echoes = FakeHost(), LeaseProbes()
    echoes.attach(follower)  # type: ignore[arg-type]
    assert echoes.message_in("a", marked) is False
    ack = Ack("a", False, 11, True)
    echoes.ack_out(ack)
    assert ack.must_send
    assert echoes.message_out("a", {"type": "next_node_idx"})[LEASE_PROBE_KEY] == (3, sent)
    echoes.message_handled("a", marked, False)
    assert echoes.message_out("a", {"type": "next_node_idx"}) == {"type": "next_node_idx"}

    probes.message_handled("b", {"type": "next_node_idx", LEASE_PROBE_KEY: (3, sent)}, True)
    assert results == [True]  # itself and "b": two of three


def test_lease_probes_fail_when_the_term_moves_on() -> None:
    leader, probes = FakeHost(leader=True), LeaseProbes()
    probes.attach(leader)  # type: ignore[arg-type]
    results: list[bool] = []
    probes.probe_leadership(2, results.append)  # not its term
    probes.probe_leadership(3, results.append)
    leader.raftCurrentTerm = 4
    probes.after_tick()
    assert results == [False, False]


def test_stalls_are_measured_by_the_published_lateness() -> None:
    signals = NodeSignals()
    signals.tick_lateness = lambda now: 0.3
    host, ext = FakeHost(leader=True), StallTolerance(signals)
    excused: list[float] = []
    host.pso_excuse_stall = lambda stall, now: excused.append(stall)
    host.read_now = lambda: None
    ext.attach(host)  # type: ignore[arg-type]
    ext.before_tick()
    assert ext.stalls == 1 and excused == [0.3] and ext.patience_asked_s == pytest.approx(0.6)
    assert isinstance(ext.recent_stalls, collections.deque)
