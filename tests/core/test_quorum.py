"""Tests for lighthouse_cluster.core.quorum: torchft's lighthouse quorum algorithm.

The first part re-states the scenarios of torchft's own lighthouse tests
(``src/lighthouse.rs`` ``mod tests`` and ``torchft/lighthouse_test.py``) against the pure
functions; the second part checks properties with hypothesis.
"""

from __future__ import annotations

import re
import time
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lighthouse_cluster.core.quorum import (
    Member,
    Participant,
    Quorum,
    QuorumDecision,
    QuorumOptions,
    compute_quorum,
    issue_quorum,
    next_quorum_id,
)

NOW = 1_000.0  # monotonic seconds; arbitrary but far from 0 so "in the past" stays positive
HOUR_MS = 60 * 60 * 1000


def member(rid: str, **kw: object) -> Member:
    kw.setdefault("step", 1)
    kw.setdefault("world_size", 1)
    return Member(replica_id=rid, **kw)  # type: ignore[arg-type]


def part(rid: str, joined: float = NOW, **kw: object) -> Participant:
    return Participant(member=member(rid, **kw), joined=joined)


def quorum(*rids: str, quorum_id: int = 1) -> Quorum:
    return Quorum(quorum_id=quorum_id, participants=tuple(member(r) for r in rids), created_ms=0)


def ids(decision: QuorumDecision) -> list[str] | None:
    return None if decision.members is None else [m.replica_id for m in decision.members]


class Lighthouse:
    """Minimal in-test model of torchft's lighthouse state around the pure functions.

    ``request`` = the Quorum RPC (implicit heartbeat, register, proactive tick);
    ``tick`` = ``_quorum_tick``.  Requesters left out of an issued quorum re-register
    (joined = now), as the RPC handler's wait loop does.
    """

    def __init__(self, options: QuorumOptions) -> None:
        self.options = options
        self.participants: dict[str, Participant] = {}
        self.heartbeats: dict[str, float] = {}
        self.previous: Quorum | None = None
        self.waiting: dict[str, Member] = {}
        self.delivered: dict[str, Quorum] = {}
        self.issued: list[Quorum] = []
        self.reasons: list[str] = []

    def heartbeat(self, rid: str, now: float) -> None:
        self.heartbeats[rid] = now

    def request(self, m: Member, now: float) -> None:
        self.heartbeats[m.replica_id] = now
        self.participants[m.replica_id] = Participant(m, now)
        self.waiting[m.replica_id] = m
        self.delivered.pop(m.replica_id, None)
        self.tick(now)

    def tick(self, now: float) -> Quorum | None:
        decision = compute_quorum(
            now, self.participants, self.heartbeats, self.previous, self.options
        )
        self.reasons.append(decision.reason)
        if decision.members is None:
            return None
        q = issue_quorum(self.previous, decision.members, created_ms=int(now * 1000))
        self.previous = q
        self.participants.clear()
        self.issued.append(q)
        in_quorum = {m.replica_id for m in q.participants}
        for rid, m in list(self.waiting.items()):
            if rid in in_quorum:
                self.delivered[rid] = q
                del self.waiting[rid]
            else:
                self.participants[rid] = Participant(m, now)
        return q


# --------------------------------------------------------------------------------------
# Ported torchft cases
# --------------------------------------------------------------------------------------


def test_quorum_join_timeout() -> None:
    opts = QuorumOptions(min_replicas=1, join_timeout_ms=HOUR_MS, heartbeat_timeout_ms=5000)
    participants: dict[str, Participant] = {}
    heartbeats: dict[str, float] = {}

    d = compute_quorum(NOW, participants, heartbeats, None, opts)
    assert d.members is None, d.reason
    assert (
        "New quorum not ready, only have 0 participants, need min_replicas 1 "
        "[0/0 participants healthy]" in d.reason
    )

    for rid in ("a", "b"):
        participants[rid] = part(rid)
        heartbeats[rid] = NOW

    # every healthy worker participates
    d = compute_quorum(NOW, participants, heartbeats, None, opts)
    assert ids(d) == ["a", "b"], d.reason

    # a healthy worker that does not participate holds the quorum back
    heartbeats["c"] = NOW
    d = compute_quorum(NOW, participants, heartbeats, None, opts)
    assert d.members is None, d.reason
    assert "join timeout" in d.reason
    assert d.reason == (
        "Valid quorum with 2 participants, waiting for 1 healthy but not participating "
        "stragglers due to join timeout [2/2 participants healthy][3 heartbeating]"
        "[shrink_only=false]"
    )

    # ... until the earliest participant has waited longer than the join timeout
    participants["a"] = replace(participants["a"], joined=NOW - 10 * 60 * 60)
    d = compute_quorum(NOW, participants, heartbeats, None, opts)
    assert ids(d) == ["a", "b"], d.reason
    assert d.reason.startswith("Valid quorum found ")


def test_quorum_heartbeats() -> None:
    opts = QuorumOptions(min_replicas=1, join_timeout_ms=0, heartbeat_timeout_ms=5000)
    participants = {"a": part("a")}
    heartbeats = {"a": NOW}

    d = compute_quorum(NOW, participants, heartbeats, None, opts)
    assert ids(d) == ["a"], d.reason
    assert "[1/1 participants healthy][1 heartbeating]" in d.reason

    # expired heartbeat
    heartbeats["a"] = NOW - 10
    d = compute_quorum(NOW, participants, heartbeats, None, opts)
    assert d.members is None, d.reason
    assert "[0/1 participants healthy][0 heartbeating]" in d.reason

    # one healthy, one expired
    participants["b"] = part("b")
    heartbeats["b"] = NOW
    d = compute_quorum(NOW, participants, heartbeats, None, opts)
    assert ids(d) == ["b"], d.reason
    assert "[1/2 participants healthy][1 heartbeating]" in d.reason


def test_quorum_fast_prev_quorum() -> None:
    opts = QuorumOptions(min_replicas=1, join_timeout_ms=HOUR_MS, heartbeat_timeout_ms=5000)
    participants: dict[str, Participant] = {}
    heartbeats: dict[str, float] = {}

    assert compute_quorum(NOW, participants, heartbeats, None, opts).members is None

    participants["a"] = part("a")
    heartbeats["a"] = NOW
    # b is alive but not participating: split brain guard blocks without a previous quorum
    heartbeats["b"] = NOW
    d = compute_quorum(NOW, participants, heartbeats, None, opts)
    assert d.members is None, d.reason
    assert "need at least half" in d.reason

    # with a previous quorum of just {a}, a alone is a fast quorum
    prev = quorum("a")
    d = compute_quorum(NOW, participants, heartbeats, prev, opts)
    assert ids(d) == ["a"], d.reason
    assert d.reason.startswith("Fast quorum found! ")

    # the fast quorum may also grow
    participants["b"] = part("b")
    d = compute_quorum(NOW, participants, heartbeats, prev, opts)
    assert ids(d) == ["a", "b"], d.reason
    assert d.reason == (
        "Fast quorum found! [2/2 participants healthy][2 heartbeating][shrink_only=false]"
    )


def test_quorum_shrink_only() -> None:
    opts = QuorumOptions(min_replicas=1, join_timeout_ms=HOUR_MS, heartbeat_timeout_ms=5000)
    prev = quorum("a", "b")
    # a (in the previous quorum) and c (not in it) both ask for shrink_only; b is gone
    participants = {"a": part("a", shrink_only=True), "c": part("c", shrink_only=True)}
    heartbeats = {"a": NOW, "c": NOW}

    d = compute_quorum(NOW, participants, heartbeats, prev, opts)
    assert ids(d) == ["a"], d.reason
    assert "[shrink_only=true]" in d.reason
    # not a fast quorum (b is missing): the regular path issues the shrink-filtered set
    assert d.reason == (
        "Valid quorum found [2/2 participants healthy][2 heartbeating][shrink_only=true]"
    )


def test_quorum_split_brain() -> None:
    opts = QuorumOptions(min_replicas=1, join_timeout_ms=HOUR_MS, heartbeat_timeout_ms=5000)
    participants: dict[str, Participant] = {}
    heartbeats: dict[str, float] = {}

    assert compute_quorum(NOW, participants, heartbeats, None, opts).members is None

    participants["a"] = part("a")
    heartbeats["a"] = NOW
    d = compute_quorum(NOW, participants, heartbeats, None, opts)
    assert ids(d) == ["a"], d.reason

    # b is alive but not participating
    heartbeats["b"] = NOW
    d = compute_quorum(NOW, participants, heartbeats, None, opts)
    assert d.members is None, d.reason
    assert (
        "New quorum not ready, only have 1 participants, need at least half of 2 healthy "
        "workers [1/1 participants healthy][2 heartbeating]" in d.reason
    )


def test_quorum_changed() -> None:
    """Only the ordered replica_id list matters for the quorum id, not other fields."""
    prev = Quorum(quorum_id=7, participants=(member("1"),), created_ms=0)
    same_ids = [member("1", address="changed", store_address="changed", step=1000)]
    assert next_quorum_id(prev, same_ids) == 7
    assert next_quorum_id(prev, [member("2")]) == 8


def test_lighthouse_e2e() -> None:
    """A heartbeat then a quorum request from a single replica yields a 1-member quorum."""
    lh = Lighthouse(QuorumOptions(min_replicas=1, join_timeout_ms=1, heartbeat_timeout_ms=5000))
    lh.heartbeat("foo", NOW)
    lh.request(member("foo", step=10), NOW)
    q = lh.delivered["foo"]
    assert q.quorum_id == 1
    assert [m.replica_id for m in q.participants] == ["foo"]
    assert q.participants[0].step == 10


def test_lighthouse_join_during_shrink() -> None:
    lh = Lighthouse(QuorumOptions(min_replicas=2, join_timeout_ms=1000, heartbeat_timeout_ms=5000))

    def mk(rid: str, n: int, step: int, shrink_only: bool) -> Member:
        return Member(rid, f"addr{n}", f"store{n}", step, 1, shrink_only)

    t = NOW
    # 1. first quorum of replica0 + replica1
    lh.request(mk("replica0", 1, 1, False), t)
    assert not lh.delivered
    assert "need min_replicas 2" in lh.reasons[-1]
    lh.request(mk("replica1", 2, 1, False), t + 0.01)
    q1 = lh.delivered["replica0"]
    assert q1 is lh.delivered["replica1"]
    assert [m.replica_id for m in q1.participants] == ["replica0", "replica1"]
    assert q1.participants[1].step == 1

    # 2. a joiner arrives while the group asks for shrink_only: it is left out
    t += 1
    lh.request(mk("joiner", 3, 1, False), t)
    assert "joiner" not in lh.delivered
    lh.request(mk("replica0", 1, 2, True), t + 0.01)
    assert "replica0" not in lh.delivered  # waits for replica1 (fast quorum not yet met)
    lh.request(mk("replica1", 2, 2, False), t + 0.02)
    q2 = lh.delivered["replica1"]
    assert lh.reasons[-1].startswith("Fast quorum found! ")
    assert "[shrink_only=true]" in lh.reasons[-1]
    assert [m.replica_id for m in q2.participants] == ["replica0", "replica1"]
    assert q2.participants[1].step == 2
    assert q2.quorum_id == q1.quorum_id  # same membership, no commit failures
    assert "joiner" in lh.participants  # re-registered by its waiting request

    # 3. without shrink_only the joiner gets in
    t += 1
    lh.request(mk("replica0", 1, 3, False), t)
    assert "replica0" not in lh.delivered
    assert "join timeout" in lh.reasons[-1]
    lh.request(mk("replica1", 2, 3, False), t + 0.01)
    q3 = lh.delivered["replica1"]
    assert [m.replica_id for m in q3.participants] == ["joiner", "replica0", "replica1"]
    assert q3.participants[2].step == 3
    assert lh.delivered["joiner"] is q3
    assert q3.quorum_id == q2.quorum_id + 1


def test_lighthouse_commit_failures() -> None:
    lh = Lighthouse(QuorumOptions(min_replicas=2, join_timeout_ms=1000, heartbeat_timeout_ms=5000))

    def mk(rid: str, commit_failures: int) -> Member:
        return Member(rid, f"addr{rid}", f"store{rid}", 10, 1, commit_failures=commit_failures)

    t = NOW
    # the first two quorums are stable
    for _ in range(2):
        lh.request(mk("replica0", 0), t)
        lh.request(mk("replica1", 0), t + 0.01)
        q = lh.delivered["replica1"]
        assert q.quorum_id == 1
        assert [m.commit_failures for m in q.participants] == [0, 0]
        t += 1

    # reported commit failures force a new quorum id
    lh.request(mk("replica0", 0), t)
    lh.request(mk("replica1", 2), t + 0.01)
    q = lh.delivered["replica1"]
    assert q.quorum_id == 2
    assert [m.commit_failures for m in q.participants] == [0, 2]


def test_heartbeat_round_trip() -> None:
    """torchft/lighthouse_test.py: an expired replica is dropped from the next quorum."""
    lh = Lighthouse(QuorumOptions(min_replicas=1, join_timeout_ms=60_000, heartbeat_timeout_ms=200))
    lh.heartbeat("rep0", NOW)
    lh.request(member("rep0"), NOW + 0.15)  # still alive
    assert [m.replica_id for m in lh.delivered["rep0"].participants] == ["rep0"]
    # rep0's heartbeat (refreshed by its request) expires; a probe gets a quorum without it
    lh.request(member("probe"), NOW + 0.15 + 0.25)
    probe_q = lh.delivered["probe"]
    assert [m.replica_id for m in probe_q.participants] == ["probe"]
    assert probe_q.quorum_id == 2


# --------------------------------------------------------------------------------------
# Further torchft semantics, table-driven
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n_participants", "n_idle", "ready"),
    [
        (1, 0, True),
        (1, 1, False),  # 1 <= 2 // 2
        (2, 1, True),  # 2 > 3 // 2
        (2, 2, False),  # 2 <= 4 // 2
        (3, 2, True),  # 3 > 5 // 2
        (2, 3, False),  # 2 <= 5 // 2
        (4, 3, True),  # 4 > 7 // 2
    ],
)
def test_split_brain_integer_division(n_participants: int, n_idle: int, ready: bool) -> None:
    opts = QuorumOptions(min_replicas=1, join_timeout_ms=0)
    participants = {f"p{i}": part(f"p{i}") for i in range(n_participants)}
    heartbeats = {rid: NOW for rid in participants} | {f"idle{i}": NOW for i in range(n_idle)}
    d = compute_quorum(NOW, participants, heartbeats, None, opts)
    if ready:
        assert ids(d) == sorted(participants), d.reason
    else:
        assert d.members is None
        total = n_participants + n_idle
        assert d.reason == (
            f"New quorum not ready, only have {n_participants} participants, need at least "
            f"half of {total} healthy workers [{n_participants}/{n_participants} participants "
            f"healthy][{total} heartbeating][shrink_only=false]"
        )


@pytest.mark.parametrize(
    ("participants", "heartbeats", "previous", "opts", "expect_ids", "reason"),
    [
        pytest.param(
            {}, {}, None, QuorumOptions(min_replicas=0), None,
            "New quorum not ready, only have 0 participants, need at least half of 0 healthy "
            "workers [0/0 participants healthy][0 heartbeating][shrink_only=false]",
            id="min_replicas_0_still_needs_a_participant",
        ),
        pytest.param(
            {"a": part("a")}, {}, None, QuorumOptions(min_replicas=1), None,
            "New quorum not ready, only have 0 participants, need min_replicas 1 "
            "[0/1 participants healthy][0 heartbeating][shrink_only=false]",
            id="participant_without_heartbeat_is_unhealthy",
        ),
        pytest.param(
            {"a": part("a"), "b": part("b")}, {"a": NOW, "b": NOW - 5.0}, None,
            QuorumOptions(min_replicas=1), ["a"],
            "Valid quorum found [1/2 participants healthy][1 heartbeating][shrink_only=false]",
            id="heartbeat_exactly_at_timeout_is_expired",
        ),
        pytest.param(
            {"a": part("a")}, {"a": NOW}, None, QuorumOptions(min_replicas=1,
                                                                heartbeat_timeout_ms=0),
            None,
            "New quorum not ready, only have 0 participants, need min_replicas 1 "
            "[0/1 participants healthy][0 heartbeating][shrink_only=false]",
            id="zero_heartbeat_timeout_nobody_healthy",
        ),
        pytest.param(
            {"a": part("a"), "b": part("b")}, {"a": NOW, "b": NOW, "c": NOW}, None,
            QuorumOptions(min_replicas=3), None,
            "New quorum not ready, only have 2 participants, need min_replicas 3 "
            "[2/2 participants healthy][3 heartbeating][shrink_only=false]",
            id="min_replicas_before_split_brain",
        ),
        pytest.param(
            {"a": part("a", joined=NOW + 1), "b": part("b", joined=NOW + 1)},
            {"a": NOW, "b": NOW, "c": NOW}, None,
            QuorumOptions(min_replicas=1, join_timeout_ms=0), ["a", "b"],
            "Valid quorum found [2/2 participants healthy][3 heartbeating][shrink_only=false]",
            id="join_in_future_saturates_to_zero_elapsed",
        ),
        pytest.param(
            {"a": part("a", joined=NOW - 59.999), "b": part("b", joined=NOW)},
            {"a": NOW, "b": NOW, "c": NOW}, None, QuorumOptions(min_replicas=1), None,
            "Valid quorum with 2 participants, waiting for 1 healthy but not participating "
            "stragglers due to join timeout [2/2 participants healthy][3 heartbeating]"
            "[shrink_only=false]",
            id="join_timeout_uses_earliest_join",
        ),
        pytest.param(
            {"a": part("a", joined=NOW - 60.0), "b": part("b", joined=NOW)},
            {"a": NOW, "b": NOW, "c": NOW}, None, QuorumOptions(min_replicas=1), ["a", "b"],
            "Valid quorum found [2/2 participants healthy][3 heartbeating][shrink_only=false]",
            id="join_timeout_elapsed_exactly",
        ),
        pytest.param(
            {"a": part("a"), "b": part("b", shrink_only=True)}, {"a": NOW}, quorum("a", "b"),
            QuorumOptions(min_replicas=1), ["a"],
            "Valid quorum found [1/2 participants healthy][1 heartbeating][shrink_only=false]",
            id="shrink_only_of_unhealthy_participant_ignored",
        ),
        pytest.param(
            {"a": part("a"), "b": part("b"), "c": part("c", shrink_only=True)},
            {"a": NOW, "b": NOW, "c": NOW}, quorum("a", "b"),
            QuorumOptions(min_replicas=1), ["a", "b"],
            "Fast quorum found! [3/3 participants healthy][3 heartbeating][shrink_only=true]",
            id="shrink_only_filters_fast_quorum",
        ),
        pytest.param(
            {"c": part("c", shrink_only=True), "d": part("d")}, {"c": NOW, "d": NOW},
            quorum("a", "b"), QuorumOptions(min_replicas=2), [],
            "Valid quorum found [2/2 participants healthy][2 heartbeating][shrink_only=true]",
            id="shrink_only_can_issue_empty_quorum_below_min_replicas",
        ),
        pytest.param(
            {}, {}, quorum(), QuorumOptions(min_replicas=5), [],
            "Fast quorum found! [0/0 participants healthy][0 heartbeating][shrink_only=false]",
            id="empty_previous_quorum_is_vacuously_fast",
        ),
        pytest.param(
            {"a": part("a"), "b": part("b")}, {"a": NOW, "b": NOW}, quorum("a", "b"),
            QuorumOptions(min_replicas=5), ["a", "b"],
            "Fast quorum found! [2/2 participants healthy][2 heartbeating][shrink_only=false]",
            id="fast_quorum_skips_min_replicas",
        ),
        pytest.param(
            {"a": part("a"), "b": part("b")}, {"a": NOW, "b": NOW - 6}, quorum("a", "b"),
            QuorumOptions(min_replicas=1), ["a"],
            "Valid quorum found [1/2 participants healthy][1 heartbeating][shrink_only=false]",
            id="fast_quorum_needs_previous_members_healthy",
        ),
    ],
)
def test_decision_table(
    participants: dict[str, Participant],
    heartbeats: dict[str, float],
    previous: Quorum | None,
    opts: QuorumOptions,
    expect_ids: list[str] | None,
    reason: str,
) -> None:
    d = compute_quorum(NOW, participants, heartbeats, previous, opts)
    assert ids(d) == expect_ids
    assert d.reason == reason


@pytest.mark.parametrize(
    ("previous", "members", "expected"),
    [
        pytest.param(None, [member("a")], 1, id="first_quorum_is_1"),
        pytest.param(None, [member("a", commit_failures=3)], 1, id="first_quorum_ignores_cf"),
        pytest.param(quorum("a", "b", quorum_id=4), [member("b"), member("a")], 4,
                     id="same_ids_any_order"),
        pytest.param(quorum("a", "b", quorum_id=4), [member("a")], 5, id="shrink"),
        pytest.param(quorum("a", quorum_id=4), [member("a"), member("b")], 5, id="grow"),
        pytest.param(quorum("a", "b", quorum_id=4), [member("a"), member("c")], 5, id="swap"),
        pytest.param(quorum("a", "b", quorum_id=4),
                     [member("a"), member("b", commit_failures=1)], 5, id="commit_failures"),
        pytest.param(quorum("a", quorum_id=4), [member("a", commit_failures=2), member("b")],
                     5, id="change_and_commit_failures_bump_once"),
        pytest.param(quorum("a", quorum_id=4), [member("a", commit_failures=-1)], 4,
                     id="negative_commit_failures_do_not_bump"),
        pytest.param(quorum(quorum_id=4), [], 4, id="empty_to_empty"),
    ],
)
def test_next_quorum_id(previous: Quorum | None, members: list[Member], expected: int) -> None:
    assert next_quorum_id(previous, members) == expected
    q = issue_quorum(previous, members, created_ms=123)
    assert q.quorum_id == expected
    assert q.created_ms == 123
    assert [m.replica_id for m in q.participants] == sorted(m.replica_id for m in members)


def test_issue_quorum_keeps_member_objects() -> None:
    b = member("b", address="x", data='{"k": 1}')
    a = member("a", step=5)
    q = issue_quorum(None, [b, a], created_ms=1)
    assert q.participants == (a, b)
    assert q.participants[0] is a and q.participants[1] is b


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_replicas": -1},
        {"min_replicas": 1, "join_timeout_ms": -1},
        {"min_replicas": 1, "heartbeat_timeout_ms": -5},
        {"min_replicas": 1.5},
    ],
)
def test_options_reject_invalid(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        QuorumOptions(**kwargs)  # type: ignore[arg-type]


def test_large_cluster_is_fast() -> None:
    n = 1024
    opts = QuorumOptions(min_replicas=1)
    participants = {f"replica_{i:04d}": part(f"replica_{i:04d}") for i in reversed(range(n))}
    heartbeats = {rid: NOW for rid in participants}
    prev = issue_quorum(None, [p.member for p in participants.values()], 0)
    # the waiting path (one member missing) and the issuing paths
    waiting = dict(participants)
    waiting.pop("replica_0000")
    waiting_hb = heartbeats | {"straggler": NOW}
    for args in (
        (participants, heartbeats, None),
        (participants, heartbeats, prev),
        (waiting, waiting_hb, prev),
    ):
        start = time.perf_counter()
        for _ in range(20):
            d = compute_quorum(NOW, *args, opts)
        per_call = (time.perf_counter() - start) / 20
        assert per_call < 0.02, per_call  # ~1 ms expected; generous bound for slow CI
    assert d.members is None


# --------------------------------------------------------------------------------------
# Properties
# --------------------------------------------------------------------------------------

IDS = [f"r{i}" for i in range(8)]
SUFFIX = re.compile(
    r"\[(\d+)/(\d+) participants healthy\]\[(\d+) heartbeating\]\[shrink_only=(true|false)\]$"
)
REASON = re.compile(
    r"^(Fast quorum found! |Valid quorum found "
    r"|New quorum not ready, only have \d+ participants, need min_replicas \d+ "
    r"|New quorum not ready, only have \d+ participants, need at least half of \d+ healthy "
    r"workers "
    r"|Valid quorum with \d+ participants, waiting for \d+ healthy but not participating "
    r"stragglers due to join timeout )"
)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple:
    """Random lighthouse states biased towards the interesting branches.

    Each replica id is absent, heartbeating only, a heartbeating participant, or a
    participant without a heartbeat entry; most heartbeats are fresh.
    """
    now = NOW
    participants: dict[str, Participant] = {}
    heartbeats: dict[str, float] = {}
    n_ids = draw(st.integers(0, len(IDS)))
    for rid in IDS[:n_ids]:
        role = draw(st.sampled_from(["part+hb", "part+hb", "part+hb", "hb", "part", "none"]))
        if role.startswith("part"):
            participants[rid] = Participant(
                Member(
                    rid,
                    address=f"addr-{rid}",
                    step=draw(st.integers(0, 3)),
                    shrink_only=draw(st.sampled_from([False, False, False, True])),
                    commit_failures=draw(st.sampled_from([0, 0, 0, 1])),
                ),
                joined=now - draw(st.sampled_from([0.0, 0.5, 1.0, 30.0, 61.0, -1.0])),
            )
        if role.endswith("hb"):
            heartbeats[rid] = now - draw(
                st.sampled_from([0.0, 0.0, 0.05, 1.0, 4.9, 5.0, 7.0, -0.5])
            )
    previous = draw(
        st.none()
        | st.builds(
            lambda rids, qid: Quorum(qid, tuple(Member(r) for r in sorted(rids)), created_ms=0),
            st.lists(st.sampled_from(IDS), unique=True, max_size=len(IDS)),
            st.integers(1, 100),
        )
    )
    options = QuorumOptions(
        min_replicas=draw(st.integers(0, 5)),
        join_timeout_ms=draw(st.sampled_from([0, 1000, 60_000])),
        heartbeat_timeout_ms=draw(st.sampled_from([0, 1000, 5000, 5000])),
    )
    return now, participants, heartbeats, previous, options


def _healthy(now: float, heartbeats: dict[str, float], opts: QuorumOptions) -> set[str]:
    return {
        r for r, t in heartbeats.items() if max(0.0, now - t) * 1000 < opts.heartbeat_timeout_ms
    }


@settings(deadline=None, max_examples=300)
@given(scenarios())
def test_prop_decision_invariants(scenario: tuple) -> None:
    now, participants, heartbeats, previous, opts = scenario
    d = compute_quorum(now, participants, heartbeats, previous, opts)

    healthy = _healthy(now, heartbeats, opts)
    healthy_parts = {r for r in participants if r in healthy}
    shrink_only = any(participants[r].member.shrink_only for r in healthy_parts)

    # reason format and metadata suffix
    assert REASON.match(d.reason), d.reason
    m = SUFFIX.search(d.reason)
    assert m, d.reason
    assert int(m.group(1)) == len(healthy_parts)
    assert int(m.group(2)) == len(participants)
    assert int(m.group(3)) == len(healthy)
    assert m.group(4) == ("true" if shrink_only else "false")

    fast = d.reason.startswith("Fast quorum found! ")
    issued = d.members is not None
    assert issued == (fast or d.reason.startswith("Valid quorum found "))

    if fast:
        assert previous is not None
        assert all(p.replica_id in healthy_parts for p in previous.participants)
    elif previous is not None:
        # the fast path is always taken when it applies
        assert not all(p.replica_id in healthy_parts for p in previous.participants)

    if not issued:
        return
    got = [x.replica_id for x in d.members]
    # subset of healthy participants, the participants' own Member objects, sorted, unique
    assert set(got) <= healthy_parts
    assert all(x is participants[x.replica_id].member for x in d.members)
    assert got == sorted(got) and len(set(got)) == len(got)
    # shrink_only never adds members outside the previous quorum ...
    if shrink_only and previous is not None:
        prev_ids = {p.replica_id for p in previous.participants}
        assert set(got) == healthy_parts & prev_ids
    else:
        # ... and otherwise every healthy participant is in
        assert set(got) == healthy_parts
    if not fast:
        # min_replicas and split brain guard hold for the healthy participants
        assert len(healthy_parts) >= opts.min_replicas
        assert len(healthy_parts) > len(healthy) // 2
        if not shrink_only or previous is None:
            assert len(got) >= opts.min_replicas
        if len(healthy_parts) != len(healthy):
            first = min(participants[r].joined for r in healthy_parts)
            assert max(0.0, now - first) * 1000 >= opts.join_timeout_ms


@settings(deadline=None, max_examples=150)
@given(scenarios(), st.randoms(use_true_random=False))
def test_prop_deterministic_and_order_independent(scenario: tuple, rnd) -> None:
    now, participants, heartbeats, previous, opts = scenario
    d1 = compute_quorum(now, participants, heartbeats, previous, opts)
    d2 = compute_quorum(now, participants, heartbeats, previous, opts)
    assert d1 == d2
    # torchft iterates HashMaps in arbitrary order; the result must not depend on it
    p_items = list(participants.items())
    h_items = list(heartbeats.items())
    rnd.shuffle(p_items)
    rnd.shuffle(h_items)
    d3 = compute_quorum(now, dict(p_items), dict(h_items), previous, opts)
    assert d3 == d1


@settings(deadline=None, max_examples=150)
@given(
    st.none()
    | st.builds(
        lambda rids, qid: Quorum(qid, tuple(Member(r) for r in sorted(rids)), 0),
        st.lists(st.sampled_from(IDS), unique=True),
        st.integers(1, 1000),
    ),
    st.lists(
        st.builds(Member, st.sampled_from(IDS), commit_failures=st.sampled_from([0, 0, 1])),
        unique_by=lambda x: x.replica_id,
    ),
)
def test_prop_quorum_id(previous: Quorum | None, members: list[Member]) -> None:
    q = issue_quorum(previous, members, created_ms=5)
    got = [m.replica_id for m in q.participants]
    assert got == sorted(m.replica_id for m in members)
    assert q.quorum_id == next_quorum_id(previous, members)
    if previous is None:
        assert q.quorum_id == 1
        return
    prev = [m.replica_id for m in previous.participants]
    if got != prev:
        assert q.quorum_id == previous.quorum_id + 1
    elif any(m.commit_failures > 0 for m in members):
        assert q.quorum_id == previous.quorum_id + 1
    else:
        assert q.quorum_id == previous.quorum_id


@settings(deadline=None, max_examples=60)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["request", "heartbeat", "tick"]),
            st.sampled_from(IDS[:5]),
            st.sampled_from([0.0, 0.01, 0.5, 2.0, 6.0]),
            st.booleans(),
            st.sampled_from([0, 0, 0, 1]),
        ),
        max_size=40,
    ),
    st.integers(1, 3),
)
def test_prop_simulated_lighthouse(ops: list[tuple], min_replicas: int) -> None:
    """Drive the model lighthouse with random events; issued quorums stay consistent."""
    opts = QuorumOptions(min_replicas=min_replicas, join_timeout_ms=1000, heartbeat_timeout_ms=5000)
    lh = Lighthouse(opts)
    t = NOW
    for op, rid, dt, shrink, cf in ops:
        t += dt
        if op == "request":
            lh.request(Member(rid, shrink_only=shrink, commit_failures=cf), t)
        elif op == "heartbeat":
            lh.heartbeat(rid, t)
        else:
            lh.tick(t)
    prev: Quorum | None = None
    for q in lh.issued:
        got = [m.replica_id for m in q.participants]
        assert got == sorted(set(got))
        if prev is None:
            assert q.quorum_id == 1
        else:
            assert q.quorum_id >= prev.quorum_id
            if got != [m.replica_id for m in prev.participants]:
                assert q.quorum_id == prev.quorum_id + 1
        prev = q
