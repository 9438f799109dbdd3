"""The pure pieces of the Raft-process experiment (``benchmarks/raft_process``): the channel's
framing, the variant launcher's argument split, the harness's variant list and summary. No
processes."""

from __future__ import annotations

import sys

import pytest

from benchmarks.raft_process import channel as ch
from benchmarks.raft_process.measure import parse_variants, summarize
from benchmarks.raft_process.variant import prefix, split_argv


def test_frames_round_trip_in_order_across_any_split() -> None:
    messages = [[ch.SUBMIT, 1, b"\x00\x01payload", None], [ch.APPLIED, b"x" * 70_000],
                [ch.DONE, 1, None, False], [ch.CONFIRMED, 12345.678], [ch.PROBED, 2, True],
                ch.view_message({"role": "leader", "term": 3, "connected": ["127.0.0.1:1"]})]
    stream = b"".join(ch.encode(m) for m in messages)
    for step in (1, 3, 4, 5, 1000, len(stream)):
        reader = ch.FrameReader()
        got = []
        for i in range(0, len(stream), step):
            got += reader.feed(stream[i:i + step])
        assert got == messages
        assert reader.pending == 0


def test_a_partial_frame_is_held_back() -> None:
    frame = ch.encode([ch.ACTIVITY])
    reader = ch.FrameReader()
    assert reader.feed(frame[:-1]) == []
    assert reader.pending == len(frame) - 1
    assert reader.feed(frame[-1:]) == [[ch.ACTIVITY]]


def test_bytes_stay_bytes_and_strings_stay_strings() -> None:
    (m,) = ch.FrameReader().feed(ch.encode([ch.SUBMIT, 7, b"cmd", 4]))
    assert m == ["s", 7, b"cmd", 4] and isinstance(m[2], bytes) and isinstance(m[0], str)


def test_view_message_has_exactly_the_view_keys() -> None:
    kind, view = ch.view_message({"term": 5, "unknown": 1})
    assert kind == ch.VIEW
    assert tuple(view) == ch.VIEW_KEYS and view["term"] == 5 and view["role"] is None


def test_an_oversized_frame_is_refused() -> None:
    import struct

    with pytest.raises(ValueError):
        ch.FrameReader().feed(struct.pack(">I", ch.MAX_FRAME + 1))


def test_variant_prefix_and_argv_split() -> None:
    node = [sys.executable, "-m", "lighthouse_cluster", "serve", "--node-id", "n1"]
    argv = prefix("C2", stall_tolerance=False)[3:] + node
    assert split_argv(argv) == ("C2", False, ["serve", "--node-id", "n1"])
    assert split_argv(["A", *node]) == ("A", True, ["serve", "--node-id", "n1"])
    with pytest.raises(ValueError):
        prefix("D")
    with pytest.raises(SystemExit):
        split_argv(["Z", *node])


def test_parse_variants() -> None:
    assert parse_variants("A,B,C-nost, C2") == [("A", True), ("B", True), ("C", False), ("C2", True)]
    with pytest.raises(ValueError):
        parse_variants("A-off")


def test_summary_medians_and_spread() -> None:
    rows = [{"kind": "rounds", "variant": "A", "stall_tolerance": True, "n": 1024, "leader": "n1",
             "leader_changes": c, "rounds_per_s": 0.5, "latency_ms": {"p50": 1.0, "p99": 2.0},
             "cpu_s_per_round": 1.5, "errors_total": 0, "load": {"start": {"loadavg": [2.0, 1.0, 1.0]}},
             "nodes": [{"node": "n1", "stalls": 1}, {"node": "n2", "stalls": 2}, {"node": "n3", "stalls": 3}]}
            for c in (0, 2, 5)]
    rows.append({"kind": "idle", "variant": "C", "cpu_total_pct": 2.0, "load_start": {"loadavg": [1.0]}})
    rows.append({**rows[0], "leader_changes": 99, "failed": "every node process exited"})
    rows.append({**rows[0], "leader_changes": 98, "excluded": "overlapped a smoke test"})
    s = summarize(rows)
    a = s["rounds A N=1024"]
    assert a["leader_changes"] == {"median": 2, "min": 0, "max": 5, "all": [0, 2, 5]}
    assert a["stalls_leader"]["all"] == [1, 1, 1] and a["stalls_followers"]["all"] == [5, 5, 5]
    assert s["idle C N=-"]["cpu_total_pct"]["median"] == 2.0
