"""Failover with the quorum lease on: a new leader serves without waiting out its predecessor's
lease when the followers' vote refusal covers it (core/lease.py, point 3; benchmarks F13), and waits
the rest when it does not. Real node processes on loopback (LocalCluster).

Both clusters run a 1 s minimum election timeout (the refusal window R) so that the lease (L) can be
long enough to tell "waited" from "did not wait" well above scheduling noise on a loaded machine.
The lease's safety under failover (no stale fast quorum): tests/fault_injection/test_partition.py
and the jepsen_like kill run in tests/fault_injection/test_jepsen_run.py."""

from __future__ import annotations

import re
import time

import pytest

from support.waiting import not_none, wait_for
from lighthouse_cluster.local.cluster import LocalCluster
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb

pytestmark = pytest.mark.integration

SERVING = re.compile(r"term (\d+): serving; waited ([0-9.]+) s for a predecessor's lease "
                     r"\(lease (\d+) ms, vote refusal ([0-9.]+) s\)")


def _kill_leader_and_time_the_successor(cluster: LocalCluster) -> tuple[int, float, int]:
    """SIGKILL the serving leader; (the new leader's index, seconds from when a survivor first
    reported itself leader to when it reported serving, its term)."""
    leader = cluster.wait_for_leader(timeout=30)
    cluster.wait_for_followers(leader, timeout=10)
    old_term = cluster.status(leader).term
    survivors = [i for i in range(cluster.nodes) if i != leader]
    cluster.kill(leader)
    elected: dict[int, float] = {}

    def serving_successor() -> int | None:
        for i in survivors:
            st = cluster.status(i, timeout=0.5)
            if st is None or st.role != cpb.LEADER or st.term <= old_term:
                continue
            elected.setdefault(i, time.monotonic())
            if st.serving:
                return i
        return None

    new = wait_for("a survivor serving as leader", serving_successor, 15.0, ready=not_none, interval=0.005,
                   context=cluster)
    return new, time.monotonic() - elected[new], cluster.status(new).term


def _serving_line(cluster: LocalCluster, i: int, term: int) -> tuple[float, int, float]:
    """(waited s, lease ms, vote refusal s) from node ``i``'s log line for ``term``."""
    text = cluster.members[i].log_path.read_text(errors="replace")
    for m in SERVING.finditer(text):
        if int(m.group(1)) == term:
            return float(m.group(2)), int(m.group(3)), float(m.group(4))
    raise AssertionError(f"no serving line for term {term} in n{i + 1}'s log\n{cluster.tail_logs()}")


@pytest.mark.exclusive  # a timing bound
@pytest.mark.timeout(120)
def test_a_new_leader_serves_without_the_lease_wait_when_votes_were_refused_longer(make_cluster) -> None:
    # L = 0.9 s < R = 1 s: the lease a SIGKILLed leader held has run out before anyone could be elected.
    cluster = make_cluster(min_replicas=1, election_timeout_ms=1000, quorum_lease_ms=900)
    new, warm_up_s, term = _kill_leader_and_time_the_successor(cluster)
    waited, lease_ms, refusal_s = _serving_line(cluster, new, term)
    assert (waited, lease_ms, refusal_s) == (0.0, 900, 1.0), cluster.tail_logs()
    # Before the refusal window this took >= 0.9 s (the whole lease); now one TermStart commit.
    assert warm_up_s < 0.45, f"served {warm_up_s:.3f} s after it was elected\n{cluster.tail_logs()}"


@pytest.mark.timeout(120)
def test_a_new_leader_waits_what_the_vote_refusal_does_not_cover(make_cluster) -> None:
    # L = 1.6 s > R = 1 s: the new leader waits the remaining 0.6 s.
    cluster = make_cluster(min_replicas=1, election_timeout_ms=1000, quorum_lease_ms=1600)
    new, warm_up_s, term = _kill_leader_and_time_the_successor(cluster)
    waited, lease_ms, refusal_s = _serving_line(cluster, new, term)
    assert (lease_ms, refusal_s) == (1600, 1.0), cluster.tail_logs()
    assert 0.5 <= waited <= 0.6, cluster.tail_logs()  # 0.6 s from when it started leading
    assert warm_up_s >= 0.5, f"served {warm_up_s:.3f} s after it was elected\n{cluster.tail_logs()}"
