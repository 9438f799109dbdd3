"""core.liveness: liveness streams to deaths, with time as an argument."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lighthouse_cluster.core.liveness import STREAM_CLOSED, Death, Liveness


def test_a_closed_stream_is_a_death_at_once() -> None:
    live = Liveness(0.5)
    live.opened("a", 1, now=10.0)
    assert live.watching("a")
    assert live.closed("a", 1) == Death("a", STREAM_CLOSED)
    assert not live.watching("a")
    assert live.closed("a", 1) is None  # reported once


def test_keepalives_keep_a_stream_alive_and_their_absence_kills_it() -> None:
    live = Liveness(0.5)
    live.opened("a", 1, now=10.0)
    live.opened("b", 2, now=10.0)
    for t in (10.3, 10.6, 10.9):
        live.keepalive("a", 1, now=t)
        assert [d.replica_id for d in live.expire(now=t)] == (["b"] if t == 10.6 else [])
    assert live.expire(now=11.39) == []
    assert live.expire(now=11.4) == [Death("a", "keep-alives stopped for 500 ms")]
    assert live.watched() == []


def test_a_replaced_stream_neither_kills_nor_keeps_alive() -> None:
    """The manager reconnected (a leader change, a network blip): the old stream's close comes
    after the new stream opened and must not declare the replica dead."""
    live = Liveness(0.5)
    live.opened("a", 1, now=10.0)
    live.opened("a", 2, now=10.2)
    assert live.closed("a", 1) is None
    live.keepalive("a", 1, now=10.6)  # a late keep-alive of the old stream
    assert live.expire(now=10.7) == [Death("a", "keep-alives stopped for 500 ms")]


def test_a_stall_of_the_leader_is_excused_up_to_now_and_a_dead_replica_still_expires() -> None:
    """The leader could not read for 0.6 s: keep-alives sent meanwhile may be unread, so silence
    counts from 0.6 s later (never past now); a replica that is really silent still expires, at
    most the stall later."""
    live = Liveness(0.5)
    live.opened("a", 1, now=10.0)
    live.opened("b", 2, now=10.0)
    live.keepalive("a", 1, now=10.1)
    live.excuse_stall(0.6, now=10.7)  # a: 10.1 -> 10.7; b: 10.0 -> 10.6
    assert live.expire(now=10.7) == []  # without the excuse, both are 0.6 s and more silent
    live.keepalive("a", 1, now=10.75)  # the keep-alive read after the stall
    live.excuse_stall(5.0, now=10.8)  # capped at now: no silence is counted as the future
    assert live.expire(now=11.29) == []
    assert live.expire(now=11.3) == [Death("a", "keep-alives stopped for 500 ms"),
                                     Death("b", "keep-alives stopped for 500 ms")]
    live.excuse_stall(0.0, now=12.0)  # nothing to excuse, nothing watched: no effect, no error


def test_the_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        Liveness(0)


@given(st.lists(st.tuples(st.sampled_from(["open", "keep", "close", "tick"]), st.sampled_from("abc"),
                          st.integers(0, 3), st.floats(0, 0.4)), max_size=60))
def test_a_replica_is_declared_dead_once_per_stream_and_only_for_its_current_one(
        ops: list[tuple[str, str, int, float]]) -> None:
    live = Liveness(0.5)
    now = 0.0
    opened: dict[str, list[int]] = {}  # every stream id each replica opened, oldest first
    current: dict[str, int] = {}
    deaths: list[tuple[str, int]] = []
    next_id = 0
    for op, rid, pick, dt in ops:
        now += dt
        ids = opened.get(rid, [])
        sid = ids[-1 - pick % len(ids)] if ids else -1  # the newest, or an older one
        if op == "open":
            next_id += 1
            live.opened(rid, next_id, now)
            opened.setdefault(rid, []).append(next_id)
            current[rid] = next_id
        elif op == "keep":
            live.keepalive(rid, sid, now)
        elif op == "close":
            if live.closed(rid, sid) is not None:
                assert current.get(rid) == sid  # only the current stream's close counts
                deaths.append((rid, current.pop(rid)))
        else:
            for d in live.expire(now):
                deaths.append((d.replica_id, current.pop(d.replica_id)))
        assert set(live.watched()) == set(current)
    assert len(deaths) == len(set(deaths))
