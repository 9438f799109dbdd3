"""Clock-rate skew (``jepsen_like.clock``, libfaketime): safety holds, the skew is real.

Three nodes run under libfaketime; ``n1`` starts with its clocks at twice real speed. Checked:
* the cluster forms and serves quorums with a 2x node in it;
* the skew is observable: ``n1``'s Status ``uptime_ms`` (its monotonic clock) grows ~2x as fast
  as real time and the others' ~1x; after ``set_rate(0, 1)`` live it grows ~1x and never went
  backwards;
* while the leader's clock is then made fast and another node's slow, and then the leader's
  slow and the others' fast (which forces an election), every group keeps getting quorums;
  from the client history and every node's Raft journal: every quorum a client got was
  committed, no quorum id has two member sets, no client saw its quorum id go back, and the
  committed logs of all nodes are equal.

The cluster test is skipped with the reason when libfaketime is not installed (Debian
packages ``faketime libfaketime``); the bookkeeping test runs everywhere.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

import test_partition as partition_test  # Traffic, journal replay
from support.waiting import wait_for
from jepsen_like import clock
from lighthouse_cluster.local.cluster import LocalCluster
from lighthouse_cluster.local.simulated_group import SimulatedReplicaGroup

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120), pytest.mark.quiet]  # quiet: beside quiet tests only (conftest)

GROUPS = ("g-a", "g-b", "g-c")
STEP_TIME_S = 0.25


def test_rate_files_env_and_teardown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bookkeeping, without libfaketime (a stand-in library path)."""
    lib = tmp_path / "libfaketimeMT.so.1"
    lib.write_bytes(b"")
    monkeypatch.setenv("LD_PRELOAD", "/other/lib.so")
    assert [clock.spec(r) for r in (2, 0.5, 1.0, 1.25)] == ["+0 x2", "+0 x0.5", "+0 x1", "+0 x1.25"]
    with pytest.raises(ValueError):
        clock.spec(0)
    n = clock.ClockNemesis(2, tmp_path / "clocks", library=str(lib))
    with pytest.raises(clock.ClockError, match="setup"):
        n.set_rate(0, 2)
    n.setup()
    try:
        assert [n.rate_file(i).read_text() for i in range(2)] == ["+0 x1\n"] * 2
        n.set_rate(1, 3)
        assert n.rate_file(1).read_text() == "+0 x3\n" and n.rates == [1.0, 3.0]
        assert n.env(1) == {"LD_PRELOAD": f"{lib}:/other/lib.so", "FAKETIME_TIMESTAMP_FILE": str(n.rate_file(1)),
                            "FAKETIME_NO_CACHE": "1", "FAKETIME_XRESET": "1"}
        assert n.launch_prefix(1) == ["env", *(f"{k}={v}" for k, v in n.env(1).items())]
        n.reset()
        assert n.rate_file(1).read_text() == "+0 x1\n"
        with pytest.raises(ValueError):
            n.set_rate(2, 1)
    finally:
        n.teardown()
    assert not list((tmp_path / "clocks").iterdir())
    n.teardown()                                                         # idempotent
    monkeypatch.setattr(clock, "find_library", lambda *a: None)
    monkeypatch.setattr(clock, "_available_cache", None)
    ok, why = clock.available()
    assert not ok and "apt-get install -y faketime libfaketime" in why


@pytest.fixture
def nemesis(tmp_path: Path) -> Iterator[clock.ClockNemesis]:
    ok, why = clock.available()
    if not ok:
        pytest.skip(f"clock skew unavailable: {why}")
    n = clock.ClockNemesis(3, directory=tmp_path / "clocks").setup()
    try:
        yield n
    finally:
        n.teardown()


@pytest.fixture
def cluster(nemesis: clock.ClockNemesis, tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster(root=tmp_path / "cluster", nodes=3, min_replicas=1, join_timeout_ms=1000,
                     heartbeat_timeout_ms=1000, quorum_tick_ms=50)
    nemesis.wire(c)
    try:
        yield c
    finally:
        c.stop_all()


def uptime_rates(cluster: LocalCluster, seconds: float, change: Callable[[], None] | None = None) -> list[float]:
    """How fast each node's uptime (monotonic clock) advanced per real second (``change`` runs
    right after the first sample)."""
    def sample(i: int) -> tuple[float, int]:
        for _ in range(5):
            t = time.monotonic()
            st = cluster.status(i, timeout=1.0)
            if st is not None and time.monotonic() - t < 0.2:  # a slow answer blurs the rate
                return (t + time.monotonic()) / 2, st.uptime_ms
        pytest.fail(f"n{i + 1} did not answer Status promptly\n{cluster.tail_logs(10)}")
    before = [sample(i) for i in range(cluster.nodes)]
    if change is not None:
        change()
    time.sleep(seconds)
    after = [sample(i) for i in range(cluster.nodes)]
    assert all(b[1] >= a[1] for a, b in zip(before, after)), f"an uptime went backwards: {before} -> {after}"
    return [(b[1] - a[1]) / 1000.0 / (b[0] - a[0]) for a, b in zip(before, after)]


def test_fast_clock_node_keeps_quorums_safe(nemesis: clock.ClockNemesis, cluster: LocalCluster) -> None:
    env = nemesis.env(0)
    assert env["LD_PRELOAD"].split(":")[0] == nemesis.library and env["FAKETIME_NO_CACHE"] == "1"
    assert env["FAKETIME_TIMESTAMP_FILE"] == str(nemesis.rate_file(0)) and "FAKETIME_XRESET" in env
    assert nemesis.launch_prefix(0) == ["env", *(f"{k}={v}" for k, v in env.items())]
    nemesis.set_rate(0, 2.0)
    assert nemesis.rate_file(0).read_text().strip() == "+0 x2" and nemesis.rates == [2.0, 1.0, 1.0]
    cluster.start()
    cluster.wait_for_leader(timeout=20)
    wait_for("every node answers Status", lambda: all(s is not None for s in partition_test.statuses(cluster)),
             20, context=lambda: cluster.tail_logs(25), interval=0.05)

    # The skew is real, per node, and can be changed live without the clock going back.
    rates = uptime_rates(cluster, 1.5)
    assert 1.7 < rates[0] < 2.3 and all(0.85 < r < 1.15 for r in rates[1:]), rates
    # Across the change (2x -> 1x) n1's clock neither jumps nor goes back: it just slows down.
    rates = uptime_rates(cluster, 1.0, change=lambda: nemesis.set_rate(0, 1.0))
    assert 0.85 < rates[0] < 1.3 and all(0.85 < r < 1.15 for r in rates), rates
    rates = uptime_rates(cluster, 1.0)
    assert all(0.85 < r < 1.15 for r in rates), rates
    nemesis.set_rate(0, 2.0)

    addr = cluster.client_addresses
    # A round every ~0.25 s: a busy leader sends appendEntries for every new entry whatever its
    # clock says (its tick loop wakes on I/O), and would hide the slow-leader phase below.
    groups = [SimulatedReplicaGroup(rid, addr[i], quorum_timeout_s=3.0, step_time_s=STEP_TIME_S,
                                    fallback_endpoints=tuple(addr))
              for i, rid in enumerate(GROUPS)]
    traffic = partition_test.Traffic(groups).start()

    def ok_since(t: float, count: int = 3) -> bool:
        rounds = [r for r in traffic.snapshot() if r.quorum_id is not None and r.started >= t]
        return all(sum(1 for r in rounds if r.replica_id == g) >= count for g in GROUPS)

    def context() -> str:
        """The nodes' logs, every node's view of the last round's reason, each group's last calls."""
        views = [f"n{i + 1}: term {s.term}, leader {s.leader_id or '?'}, quorum {s.quorum.quorum_id}, "
                 f"reason {s.quorum_reason!r}" if s is not None else f"n{i + 1}: no status"
                 for i, s in enumerate(partition_test.statuses(cluster))]
        calls = [f"{g}: " + "; ".join(f"{r.endpoint} {r.outcome} q{r.quorum_id} {r.error} {r.details[:80]}"
                                     for r in [x for x in traffic.snapshot() if x.replica_id == g][-3:])
                 for g in GROUPS]
        return "\n".join([cluster.tail_logs(25), *views, *calls])

    try:
        t = time.monotonic()
        wait_for("every group gets quorums with n1 at 2x", lambda: ok_since(t), 15,
                 context=lambda: cluster.tail_logs(25), interval=0.05)
        time.sleep(1.0)

        # Now the leader runs fast and another node slow: leadership may move; safety must hold.
        leader = cluster.wait_for_leader(timeout=10)
        slow = next(i for i in range(3) if i != leader)
        nemesis.set_rate(leader, 2.0)
        nemesis.set_rate(slow, 0.5)
        t = time.monotonic()
        wait_for(f"quorums with n{leader + 1} at 2x, n{slow + 1} at 0.5x", lambda: ok_since(t), 20,
                 context=context, interval=0.05)
        time.sleep(1.0)

        # A slow leader and fast followers: its heartbeats (every 37.5 ms of its time, 375 ms
        # real) come later than the followers' election timeouts (150-450 ms of theirs, 75-225 ms
        # real) whenever no new entry is sent in between: elections are disturbed, quorums must
        # stay safe and resume.
        leader = cluster.wait_for_leader(timeout=10)
        term = cluster.status(leader).term
        for i in range(3):
            nemesis.set_rate(i, 0.1 if i == leader else 2.0)
        def new_term() -> bool:
            return any(s is not None and s.term > term for s in partition_test.statuses(cluster))
        wait_for(f"an election after slowing the leader n{leader + 1} down", new_term, 10,
                 context=lambda: cluster.tail_logs(25), interval=0.05)
        t = time.monotonic()
        wait_for("quorums with a slow former leader", lambda: ok_since(t), 20, context=context, interval=0.05)

        nemesis.reset()
        assert nemesis.rates == [1.0, 1.0, 1.0]
        t = time.monotonic()
        wait_for("quorums after the reset", lambda: ok_since(t), 15, context=context, interval=0.05)
    finally:
        traffic.stop()
    results = traffic.snapshot()
    _check_history_against_logs(cluster, results)


def _check_history_against_logs(cluster: LocalCluster, results: list) -> None:
    successes = [r for r in results if r.quorum_id is not None]
    assert successes, "no quorum at all"

    def converged():
        sts = partition_test.statuses(cluster)
        if any(s is None for s in sts):
            return None
        key = {(s.commit_index, s.last_applied, s.quorum.quorum_id) for s in sts}
        return sts if len(key) == 1 and sts[0].commit_index == sts[0].last_applied else None
    sts = wait_for("all nodes converge on one commit index", converged, 10, context=lambda: cluster.tail_logs(25),
                   interval=0.05)
    commit_index = sts[0].commit_index
    cluster.stop_all()
    logs = [partition_test.committed_quorums(m.data_dir / "raft.journal", commit_index) for m in cluster.members]
    for i in range(1, cluster.nodes):
        assert logs[i][0] == logs[0][0], f"committed Raft logs of n1 and n{i + 1} differ up to {commit_index}"
    committed = logs[0][1]
    members_of: dict[int, set[tuple[str, ...]]] = {}
    for qid, members, _term in committed:
        members_of.setdefault(qid, set()).add(tuple(sorted(members)))
    assert not {q: m for q, m in members_of.items() if len(m) > 1}, "a quorum id committed with two member sets"
    committed_set = {(q, tuple(sorted(m))) for q, m, _term in committed}
    told: dict[int, set[tuple[str, ...]]] = {}
    for r in successes:
        told.setdefault(r.quorum_id, set()).add(tuple(sorted(r.participants)))
    assert not {q: m for q, m in told.items() if len(m) > 1}, "clients got one quorum id with two member sets"
    unknown = [r for r in successes if (r.quorum_id, tuple(sorted(r.participants))) not in committed_set]
    assert not unknown, f"clients got quorums that were never committed: {unknown[:5]}"
    # No group ever saw its quorum id go back.
    for g in GROUPS:
        ids = [r.quorum_id for r in sorted(successes, key=lambda r: r.started) if r.replica_id == g]
        assert all(b >= a for a, b in zip(ids, ids[1:])), f"{g} saw quorum ids go back: {ids}"
