"""Failover with the quorum lease on: a new leader serves without waiting out its predecessor's
lease when the followers' vote refusal covers it (core/lease.py, point 3;
docs/design/leader-lease.md), and waits the rest when it does not. Real node processes on loopback
(LocalCluster).

Both clusters run a 1 s minimum election timeout (the refusal window R) so that the lease (L) can be
long enough to tell "waited" from "did not wait" well above scheduling noise on a loaded machine.
The lease's safety under failover (no stale fast quorum): tests/fault_injection/test_partition.py
and the jepsen_like kill run in tests/fault_injection/test_jepsen_run.py."""

from __future__ import annotations

import re
from datetime import datetime

import pytest

from lighthouse_cluster.local.cluster import LocalCluster

pytestmark = pytest.mark.integration

SERVING = re.compile(r"^(\S+ \S+) .*term (\d+): serving; waited ([0-9.]+) s for a predecessor's lease "
                     r"\(lease (\d+) ms, vote refusal ([0-9.]+) s\)", re.M)
LEADER = re.compile(r"^(\S+ \S+) .*raft: leader in term (\d+),", re.M)


def _kill_leader(cluster: LocalCluster) -> tuple[int, int]:
    """SIGKILL the serving leader: (the serving successor's index, its term)."""
    leader = cluster.wait_for_leader(timeout=30)
    cluster.wait_for_followers(leader, timeout=10)
    old_term = cluster.status(leader).term
    survivors = [i for i in range(cluster.nodes) if i != leader]
    cluster.kill(leader)
    new = cluster.wait_for_leader(timeout=15, among=survivors, exclude_term=old_term)
    return new, cluster.status(new).term


def _stamp(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _warm_up(cluster: LocalCluster, i: int, term: int) -> tuple[float, float, int, float]:
    """From node ``i``'s log, for ``term``: (seconds from "leader in term" to "serving" on the
    node's own clock, the lease wait it logged, the lease ms, the vote refusal s)."""
    text = cluster.members[i].log_path.read_text(errors="replace")
    led = [_stamp(m.group(1)) for m in LEADER.finditer(text) if int(m.group(2)) == term]
    for m in SERVING.finditer(text):
        if int(m.group(2)) == term and led:
            return _stamp(m.group(1)) - led[-1], float(m.group(3)), int(m.group(4)), float(m.group(5))
    raise AssertionError(f"no leader/serving lines for term {term} in n{i + 1}'s log\n{cluster.tail_logs()}")


@pytest.mark.quiet  # a timing bound: beside quiet tests only
@pytest.mark.timeout(120)
def test_a_new_leader_serves_without_the_lease_wait_when_votes_were_refused_longer(make_cluster) -> None:
    # L = 0.9 s < R = 1 s: the lease a SIGKILLed leader held has run out before anyone could be elected.
    cluster = make_cluster(min_replicas=1, election_timeout_ms=1000, quorum_lease_ms=900)
    new, term = _kill_leader(cluster)
    warm_up_s, waited, lease_ms, refusal_s = _warm_up(cluster, new, term)
    assert (waited, lease_ms, refusal_s) == (0.0, 900, 1.0), cluster.tail_logs()
    # Before the refusal window this took >= 0.9 s (the whole lease); now one TermStart commit.
    assert warm_up_s < 0.45, f"served {warm_up_s:.3f} s after it was elected\n{cluster.tail_logs()}"


@pytest.mark.timeout(120)
def test_a_new_leader_waits_what_the_vote_refusal_does_not_cover(make_cluster) -> None:
    # L = 1.6 s > R = 1 s: the new leader waits the remaining 0.6 s.
    cluster = make_cluster(min_replicas=1, election_timeout_ms=1000, quorum_lease_ms=1600)
    new, term = _kill_leader(cluster)
    warm_up_s, waited, lease_ms, refusal_s = _warm_up(cluster, new, term)
    assert (lease_ms, refusal_s) == (1600, 1.0), cluster.tail_logs()
    assert 0.0 < waited <= 0.6, cluster.tail_logs()  # what was left of 0.6 s after the TermStart commit
    # 0.6 s from when it started leading (log lines are stamped to the millisecond).
    assert warm_up_s >= 0.59, f"served {warm_up_s:.3f} s after it was elected\n{cluster.tail_logs()}"


LOST = re.compile(r"the connection to the leader (\S+) closed: (standing in|its election timeout, in) (\d+) ms.*"
                  r"\(rank (\d+)\)")


@pytest.mark.timeout(120)
def test_a_sigkilled_leaders_survivors_stand_by_rank_as_its_connections_close(make_cluster) -> None:
    """docs/design/fast-election.md: the kernel closes a killed process's sockets, its followers
    read that and stand at the end of their refusal window, the first by node id first: one
    election."""
    cluster = make_cluster(min_replicas=1, election_timeout_ms=1000)
    leader = cluster.wait_for_leader(timeout=30)
    cluster.wait_for_followers(leader, timeout=10)
    old_term = cluster.status(leader).term
    new, term = _kill_leader(cluster)
    seen = {}
    for i in range(cluster.nodes):
        if i == leader:
            continue
        lost = LOST.findall(cluster.members[i].log_path.read_text(errors="replace"))
        assert len(lost) == 1, f"n{i + 1}: {lost}\n{cluster.tail_logs()}"
        _, how, in_ms, rank = lost[0]
        seen[i] = (int(rank), how == "standing in")
        if how == "standing in":  # the window's end (R = 1 s) at most, plus its rank's delay and jitter
            assert int(in_ms) <= 1000 + int(rank) * 200 + 50, lost
    assert sorted(rank for rank, _ in seen.values()) == [0, 1], (seen, cluster.tail_logs())
    # The first by node id won, unless its own election timeout (1-3 s) was the sooner one.
    assert seen[new] == (0, True) or not seen[new][1], (seen, new, cluster.tail_logs())
    assert term == old_term + 1, cluster.tail_logs()
