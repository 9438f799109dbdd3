"""One scripted scenario, run against torchft's LighthouseServer and against a 3-node cluster.

Both lighthouses get the same flags and the same fixed sequence of heartbeats and quorum requests
(steps, shrink_only, commit_failures, a replica leaving by heartbeat timeout, a replica joining).
Each client records every quorum it receives as (quorum_id, members), members being
(replica_id, step, shrink_only, commit_failures); the two recordings must be identical, and torchft's must be the
one the script is written to produce (so the scenario really exercises each rule).

The order of requests is fixed by threads released together only where the order inside a round
cannot change the outcome, and by waiting for a server-side condition (a heartbeat seen, a
requester pending) where it could. On the cluster, replicas are spread over the nodes: a and e
on a follower, b on the leader, c (which leaves) and d (which joins) on the other follower.
This is a behaviour test, not a benchmark: the only timing recorded is the coarse "prompt" mark of
the last round (issued well before the join timeout, as a fast quorum is), and every wait is
bounded.
"""

from __future__ import annotations

from functools import partial

import pytest

torchft = pytest.importorskip("torchft", reason="torchft (with its Rust LighthouseClient/LighthouseServer) "
                                                "is not installed; this test compares against it")

from support.torchft_support import (  # noqa: E402 -- needs torchft
    Flags,
    QuorumView,
    Target,
    on_both,
    replica_set,
    run_concurrently,
    start_call,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

FLAGS = Flags(min_replicas=2, join_timeout_ms=1_000, heartbeat_timeout_ms=600, quorum_tick_ms=50)
T = 10.0  # per-call deadline; every call is expected back far sooner


def seen(q: QuorumView) -> tuple:
    """(quorum_id, members as (replica_id, step, shrink_only, commit_failures)); commit_failures
    is None where the Rust client made the call (its Quorum does not expose the field)."""
    return q.quorum_id, tuple((m.replica_id, m.step, m.shrink_only, m.commit_failures) for m in q.members)


def scenario(t: Target) -> dict[str, list[tuple]]:
    log: dict[str, list[tuple]] = {r: [] for r in "abcd"}

    def round_(calls: dict[str, object], note_prompt: bool = False) -> None:
        results = run_concurrently(calls, T)
        for name, res in sorted(results.items()):
            assert res.error is None, f"{t.name}: {name} failed after {res.elapsed:.2f}s: {res.error!r}"
            entry = seen(res.quorum)
            if note_prompt:  # coarse on purpose: "well before the join timeout" or not
                entry += ("prompt" if res.elapsed < FLAGS.join_timeout_ms / 2000 else "waited",)
            log[name].append(entry)

    n = len(t.addresses)
    with replica_set() as make:
        a = make("a", t.addresses[0 % n])
        b = make("b", t.addresses[2 % n])
        c = make("c", t.addresses[1 % n])
        d = make("d", t.addresses[1 % n])
        e = make("e", t.addresses[0 % n])
        for r in (a, b, c):
            r.start_heartbeats()
        t.wait_heartbeats_seen(["a", "b", "c"])

        # R1: everyone joins at step 0 -> first quorum.
        round_({r.replica_id: partial(r.quorum, T, step=0) for r in (a, b, c)})
        # R2: same members, no failures -> fast quorum, same id.
        round_({r.replica_id: partial(r.quorum, T, step=1) for r in (a, b, c)})
        # R3: a reports a failed commit -> same members, id + 1.
        round_({"a": partial(a.raw_quorum, T, step=1, commit_failures=1),
                "b": partial(b.raw_quorum, T, step=2),
                "c": partial(c.raw_quorum, T, step=2)})
        # R4: c stops heartbeating; a and b wait until c's heartbeat times out -> {a, b}, id + 1.
        c.stop_heartbeats()
        round_({"a": partial(a.quorum, T, step=2), "b": partial(b.quorum, T, step=2)})
        # R5: d joins (heartbeats, then requests first); a and b ask shrink_only: the fast quorum
        # keeps {a, b} (same id) and leaves d out; d stays registered and keeps waiting.
        d.start_heartbeats()
        t.wait_heartbeats_seen(["d"])
        d_call = start_call("d", partial(d.quorum, T, step=0), T)
        t.wait_pending(1)
        round_({"a": partial(a.quorum, T, step=3, shrink_only=True),
                "b": partial(b.quorum, T, step=3, shrink_only=True)})
        t.wait_pending(1)  # d registered again for the next round
        # R6: a and b ask normally: the fast quorum now takes d in -> {a, b, d}, id + 1.
        round_({"a": partial(a.quorum, T, step=4), "b": partial(b.quorum, T, step=4)})
        log["d"].append(seen(d_call.quorum()))
        # R7: e heartbeats but does not request; a, b and d (still behind) ask again: the fast
        # quorum (every previous member asked) is issued at once, without waiting the join
        # timeout for e, with the same id.
        e.start_heartbeats()
        t.wait_heartbeats_seen(["e"])
        round_({"a": partial(a.quorum, T, step=5), "b": partial(b.quorum, T, step=5),
                "d": partial(d.quorum, T, step=1)}, note_prompt=True)
        for r in (a, b, d, e):
            assert r.heartbeat_errors == [], f"{t.name}: heartbeats of {r.replica_id} failed: {r.heartbeat_errors[:3]}"
    return log


def expected() -> dict[str, list[tuple]]:
    def q(qid: int, *members: tuple) -> tuple:
        return qid, tuple(members)

    ab_c = [q(1, ("a", 0, False, None), ("b", 0, False, None), ("c", 0, False, None)),
            q(1, ("a", 1, False, None), ("b", 1, False, None), ("c", 1, False, None)),
            q(2, ("a", 1, False, 1), ("b", 2, False, 0), ("c", 2, False, 0))]
    ab = [q(3, ("a", 2, False, None), ("b", 2, False, None)),
          q(3, ("a", 3, True, None), ("b", 3, True, None))]
    abd = [q(4, ("a", 4, False, None), ("b", 4, False, None), ("d", 0, False, None)),
           q(4, ("a", 5, False, None), ("b", 5, False, None), ("d", 1, False, None)) + ("prompt",)]
    return {"a": ab_c + ab + abd, "b": ab_c + ab + abd, "c": ab_c, "d": abd}


def test_scripted_scenario_matches_torchft_lighthouse(tmp_path) -> None:
    theirs, ours, logs = on_both(tmp_path, FLAGS, scenario)
    assert theirs == expected(), f"scenario premise (torchft's lighthouse): {theirs}"
    for replica in "abcd":
        assert ours[replica] == theirs[replica], (
            f"replica {replica}:\n  ours:    {ours[replica]}\n  torchft: {theirs[replica]}\n{logs}")
