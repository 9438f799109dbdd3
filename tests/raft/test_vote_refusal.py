"""fast_election.vote_refused: the vote-refusal window (Raft thesis 4.2.3) as a pure rule; the
quorum lease's wait rests on it (core/lease.py, point 3). The rule at work on real nodes:
tests/raft/test_fast_election.py; a failover that skips the lease wait: tests/server/test_failover_lease.py."""

from __future__ import annotations

from lighthouse_cluster.raft.extensions.fast_election import vote_refused


def test_a_vote_is_refused_within_the_window_after_hearing_from_a_leader() -> None:
    assert vote_refused(10.0, 10.0, 0.15, handover=False)
    assert vote_refused(10.149, 10.0, 0.15, handover=False)
    assert not vote_refused(10.15, 10.0, 0.15, handover=False)
    assert not vote_refused(11.0, 10.0, 0.15, handover=False)


def test_a_handover_candidate_is_answered_at_once() -> None:
    assert not vote_refused(10.0, 10.0, 0.15, handover=True)


def test_no_window_refuses_nothing() -> None:
    assert not vote_refused(10.0, 10.0, 0.0, handover=False)


def test_a_time_from_another_clock_does_not_refuse_for_ever() -> None:
    # heard_leader_at after now cannot come from this process's monotonic clock (e.g. a value an
    # older version put into a snapshot, taken on another node): ignored.
    assert not vote_refused(10.0, 5000.0, 0.15, handover=False)
