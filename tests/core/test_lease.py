"""The quorum lease (lease.py) as pure rules, and the coordinator's use of it with an in-process log.

Real Raft and a real partition: tests/fault_injection/test_partition.py (the isolated leader's last answer
comes before the new leader's first, quorum ids never go back in real time) and
tests/server/test_cluster.py (failover with the default lease).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from support.waiting import wait_for_async
from lighthouse_cluster.core.codec import CommitQuorum, ConfirmLeadership, TermStart, decode_command, encode_command
from lighthouse_cluster.server.coordinator import QuorumCoordinator
from lighthouse_cluster.server.leader_term import LeaderTerm
from lighthouse_cluster.core.lease import LeaseSettings, QuorumLease, lease_wait_s
from lighthouse_cluster.core.quorum import Member, QuorumOptions
from lighthouse_cluster.raft.replication import CommitError
from lighthouse_cluster.core.state_machine import QuorumStateMachine

# -- the rules ------------------------------------------------------------------------------------


def test_settings_reject_nonsense() -> None:
    with pytest.raises(ValueError, match="lease_ms"):
        LeaseSettings(lease_ms=-1)
    with pytest.raises(ValueError, match="trust"):
        LeaseSettings(lease_ms=100, trust=0.0)
    assert not LeaseSettings(lease_ms=0).enabled and LeaseSettings(lease_ms=100).enabled


def test_a_confirmation_grants_trust_times_the_lease_from_its_submission() -> None:
    lease = QuorumLease(LeaseSettings(lease_ms=100, trust=0.5))
    assert not lease.valid(3, 10.0)
    lease.confirmed(3, submitted_at=10.0)
    assert lease.valid(3, 10.049) and not lease.valid(3, 10.05)
    assert not lease.valid(4, 10.01) and not lease.valid(None, 10.01)  # another term: no lease
    lease.confirmed(3, submitted_at=9.0)  # an older confirmation applied late never shortens it
    assert lease.valid(3, 10.049)
    lease.confirmed(4, submitted_at=10.02)  # a new term starts from scratch
    assert not lease.valid(3, 10.03) and lease.valid(4, 10.03)
    lease.reset()
    assert not lease.valid(4, 10.03)


def test_renewal_is_due_when_half_of_a_confirmation_is_left() -> None:
    lease = QuorumLease(LeaseSettings(lease_ms=100))
    assert lease.renewal_due(1, 0.0)
    lease.confirmed(1, 0.0)  # held 0.05 s
    assert not lease.renewal_due(1, 0.02) and lease.renewal_due(1, 0.026)


def test_disabled_lease_never_holds() -> None:
    lease = QuorumLease(LeaseSettings(lease_ms=0))
    lease.confirmed(1, 0.0)
    assert not lease.valid(1, 0.0)


def test_a_new_leader_waits_out_the_longer_of_its_own_and_its_predecessors_lease() -> None:
    assert QuorumLease(LeaseSettings(lease_ms=100)).serve_after(5.0, 0) == pytest.approx(5.1)
    assert QuorumLease(LeaseSettings(lease_ms=100)).serve_after(5.0, 400) == pytest.approx(5.4)
    assert QuorumLease(LeaseSettings(lease_ms=0)).serve_after(5.0, 250) == pytest.approx(5.25)


def test_the_vote_refusal_window_shortens_the_wait() -> None:
    # lease.py point 3: a new leader waits max(L, L') - R; with the defaults (L 100 ms, R the 150 ms
    # minimum election timeout) not at all.
    lease = QuorumLease(LeaseSettings(lease_ms=100))
    assert lease.serve_after(5.0, 0, vote_refusal_s=0.15) == pytest.approx(5.0)
    assert lease.serve_after(5.0, 100, vote_refusal_s=0.1) == pytest.approx(5.0)
    assert lease.serve_after(5.0, 400, vote_refusal_s=0.15) == pytest.approx(5.25)  # a longer predecessor lease
    assert lease.serve_after(5.0, 0, vote_refusal_s=0.0) == pytest.approx(5.1)  # a handover: the whole lease
    assert lease_wait_s(250, 0.15) == pytest.approx(0.1)
    assert lease_wait_s(0, 0.15) == 0.0
    with pytest.raises(ValueError):
        lease_wait_s(100, -0.1)


def test_confirm_leadership_round_trips_and_records_the_lease_length() -> None:
    cmd = ConfirmLeadership(term=7, node_id="n2", lease_ms=150)
    assert decode_command(encode_command(cmd)) == cmd
    machine = QuorumStateMachine()
    assert machine.apply(TermStart(term=7, node_id="n2", time_ms=1)).applied
    assert machine.apply(cmd) is True
    assert machine.apply(ConfirmLeadership(term=6, node_id="n1", lease_ms=300)) is False  # not the leader in force
    assert machine.lease_ms == 300  # the longest recent announcement is what a successor must wait out
    restored = QuorumStateMachine()
    restored.restore_snapshot(machine.to_snapshot())
    assert restored.lease_ms == 300


# -- the coordinator ------------------------------------------------------------------------------


class Log:
    """Applies commands in order (what Raft does once a majority stored them); can refuse
    leadership confirmations."""

    def __init__(self, machine: QuorumStateMachine) -> None:
        self.machine = machine
        self.commands: list[Any] = []
        self.confirm_error: CommitError | None = None

    async def submit(self, command: Any, while_leader_of: int | None = None) -> Any:
        await asyncio.sleep(0)
        if isinstance(command, ConfirmLeadership) and self.confirm_error is not None:
            raise self.confirm_error
        self.commands.append(command)
        return self.machine.apply(command)

    def count(self, kind: type) -> int:
        return sum(1 for c in self.commands if isinstance(c, kind))


def make(lease_ms: int, machine: QuorumStateMachine | None = None) -> tuple[QuorumCoordinator, Log]:
    machine = machine or QuorumStateMachine()
    log = Log(machine)
    coord = QuorumCoordinator("n1", QuorumOptions(min_replicas=2), quorum_tick_ms=10, state=machine,
                              submit=log.submit, lease=LeaseSettings(lease_ms=lease_ms))
    return coord, log


async def rounds(coord: QuorumCoordinator, n: int) -> None:
    for step in range(n):
        await asyncio.gather(*(coord.quorum(Member(r, step=step)) for r in ("a", "b")))


def test_fast_rounds_go_out_on_the_lease_and_membership_changes_are_committed() -> None:
    async def main() -> None:
        coord, log = make(lease_ms=1000)
        coord.start_leading(1)
        await wait_for_async("the coordinator to serve", lambda: coord.serving, 5.0, interval=0.001)
        await rounds(coord, 1)  # the first quorum: a new member set, committed
        assert log.count(CommitQuorum) == 1
        await wait_for_async("a valid lease for term 1", lambda: coord.lease.valid(1, time.monotonic()),
                             5.0, interval=0.001)
        await rounds(coord, 20)
        assert log.count(CommitQuorum) == 1, "fast rounds on a valid lease must not be committed"
        assert coord.rounds_on_lease == 20 and coord.rounds_committed == 1
        assert 1 <= log.count(ConfirmLeadership) <= 3
        # A third member: new member set, new id, committed although the lease holds.
        await asyncio.gather(*(coord.quorum(Member(r)) for r in ("a", "b", "c")))
        assert log.count(CommitQuorum) == 2 and log.machine.quorum_id == 2
        coord.stop_leading()
    asyncio.run(main())


def test_without_confirmations_every_round_is_committed() -> None:
    async def main() -> None:
        coord, log = make(lease_ms=1000)
        log.confirm_error = CommitError("NOT_LEADER", unknown=False)
        coord.start_leading(1)
        await wait_for_async("the coordinator to serve", lambda: coord.serving, 5.0, interval=0.001)
        await rounds(coord, 10)
        assert log.count(CommitQuorum) == 10 and coord.rounds_on_lease == 0
        coord.stop_leading()
    asyncio.run(main())


def test_a_confirmation_refused_by_the_state_machine_deposes_the_leader() -> None:
    async def main() -> None:
        machine = QuorumStateMachine()
        coord, log = make(lease_ms=1000, machine=machine)
        coord.start_leading(1)
        await wait_for_async("the coordinator to serve", lambda: coord.serving, 5.0, interval=0.001)
        machine.apply(TermStart(term=2, node_id="n2", time_ms=2))  # another leader's term is in force
        waiter = asyncio.ensure_future(coord.quorum(Member("a")))
        await wait_for_async("the coordinator to step down", lambda: coord.term is None, 5.0, interval=0.001)
        assert not coord.serving
        with pytest.raises(Exception, match="stepped down"):
            await waiter
    asyncio.run(main())


def test_the_lease_ends_with_the_leadership() -> None:
    async def main() -> None:
        coord, _ = make(lease_ms=1000)
        coord.start_leading(1)
        await wait_for_async("the coordinator to serve", lambda: coord.serving, 5.0, interval=0.001)
        await rounds(coord, 1)
        await wait_for_async("a valid lease for term 1", lambda: coord.lease.valid(1, time.monotonic()),
                             5.0, interval=0.001)
        coord.stop_leading()
        assert not coord.lease.valid(1, time.monotonic())
    asyncio.run(main())


def test_a_new_leader_serves_only_after_its_predecessors_lease_ran_out() -> None:
    async def main() -> None:
        machine = QuorumStateMachine()
        machine.apply(TermStart(term=1, node_id="n0", time_ms=1))
        machine.apply(ConfirmLeadership(term=1, node_id="n0", lease_ms=400))
        coord, _ = make(lease_ms=0, machine=machine)  # its own lease is off; the predecessor's counts
        started = time.monotonic()
        coord.start_leading(2)
        await wait_for_async("the coordinator to serve", lambda: coord.serving, 5.0, interval=0.001)
        assert time.monotonic() - started >= 0.4
        coord.stop_leading()
    asyncio.run(main())


def test_a_new_leader_waits_only_for_what_the_vote_refusal_does_not_cover() -> None:
    async def main() -> None:
        machine = QuorumStateMachine()
        machine.apply(TermStart(term=1, node_id="n0", time_ms=1))
        machine.apply(ConfirmLeadership(term=1, node_id="n0", lease_ms=2000))
        log = Log(machine)
        asked: list[int] = []

        def refusal(term: int) -> float:
            asked.append(term)
            return 1.9  # every member refused votes for 1.9 s after hearing from the old leader

        leader = LeaderTerm("n1", machine, log.submit, lease=LeaseSettings(lease_ms=0), vote_refusal_s=refusal)
        started = time.monotonic()
        leader.start(2)
        assert await asyncio.wait_for(leader.serving(2), 5.0)
        elapsed = time.monotonic() - started
        assert asked == [2]
        assert 0.1 <= elapsed < 1.5  # 2.0 - 1.9 s, not the whole 2 s lease
        leader.stop()
    asyncio.run(main())


def test_an_idle_leader_writes_no_confirmations() -> None:
    async def main() -> None:
        coord, log = make(lease_ms=100)
        coord.start_leading(1)
        await wait_for_async("the coordinator to serve", lambda: coord.serving, 5.0, interval=0.001)
        await asyncio.sleep(0.3)  # three leases long: nobody asked for a quorum
        assert log.count(ConfirmLeadership) == 0
        await rounds(coord, 1)
        await wait_for_async("a ConfirmLeadership entry", lambda: log.count(ConfirmLeadership) >= 1,
                             5.0, interval=0.001)
        coord.stop_leading()
    asyncio.run(main())


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_slow_rounds_are_committed_and_their_commits_renew_the_lease() -> None:
    """Rounds 0.6 s apart (training that asks about once a second): the term announces its lease
    once (a ConfirmLeadership) and writes nothing else in the background; each round finds the
    lease run out and is committed, and that commit renews it, so a round right after one goes
    out on the lease."""
    async def main() -> None:
        clock = Clock()
        machine = QuorumStateMachine()
        log = Log(machine)
        coord = QuorumCoordinator("n1", QuorumOptions(min_replicas=2), quorum_tick_ms=600_000, state=machine,
                                  submit=log.submit, lease=LeaseSettings(lease_ms=100), clock=clock)
        coord.start_leading(1)
        await wait_for_async("the coordinator to serve", lambda: coord.serving, 5.0, interval=0.001)
        await rounds(coord, 1)  # the first quorum (new members): committed; the lease announced
        await wait_for_async("the announced lease", lambda: coord.lease.valid(1, clock.now), 5.0, interval=0.001)
        for step in range(1, 4):
            clock.now += 0.6
            await asyncio.gather(*(coord.quorum(Member(r, step=step)) for r in ("a", "b")))
        assert (coord.rounds_committed, coord.rounds_on_lease) == (4, 0)
        assert log.count(ConfirmLeadership) == 1 and log.count(CommitQuorum) == 4
        clock.now += 0.02  # within the lease the last commit renewed (held 50 ms)
        await asyncio.gather(*(coord.quorum(Member(r, step=4)) for r in ("a", "b")))
        assert (coord.rounds_committed, coord.rounds_on_lease) == (4, 1)
        assert log.count(ConfirmLeadership) == 1
        coord.stop_leading()
    asyncio.run(main())


def test_a_commit_applied_after_the_term_ended_renews_nothing() -> None:
    """``submit(while_leader_of=T)`` fails when the entry applies after this node stopped leading
    T: such a commit proves nothing about T, so the lease is not renewed by it."""
    async def main() -> None:
        clock = Clock()
        machine = QuorumStateMachine()
        log = Log(machine)
        plain = log.submit

        async def late(command: Any, while_leader_of: int | None = None) -> Any:
            if isinstance(command, CommitQuorum) and command.quorum.participants[0].step >= 1:
                await plain(command, while_leader_of)
                raise CommitError("applied after this node stopped leading term 1", unknown=False)
            return await plain(command, while_leader_of)

        coord = QuorumCoordinator("n1", QuorumOptions(min_replicas=2), quorum_tick_ms=600_000, state=machine,
                                  submit=late, lease=LeaseSettings(lease_ms=100), clock=clock)
        coord.start_leading(1)
        await wait_for_async("the coordinator to serve", lambda: coord.serving, 5.0, interval=0.001)
        await rounds(coord, 1)
        await wait_for_async("the announced lease", lambda: coord.lease.valid(1, clock.now), 5.0, interval=0.001)
        clock.now += 0.06  # the lease ran out: the next fast round is committed
        calls = [asyncio.ensure_future(coord.quorum(Member(r, step=1))) for r in ("a", "b")]
        await wait_for_async("the round's commit", lambda: log.count(CommitQuorum) == 2, 5.0, interval=0.001)
        await asyncio.sleep(0.01)
        assert not coord.lease.valid(1, clock.now)
        for c in calls:
            c.cancel()
        coord.stop_leading()
    asyncio.run(main())


# -- renewals by lease probe (raft/extensions/lease_probes.py) ------------------------------------------------


async def _busy_term(probe: Any, *, until: Any, timeout: float = 5.0, stream: Any = None,
                     lease_ms: int = 100) -> tuple[LeaderTerm, Log]:
    """A LeaderTerm of term 1 with a ``lease_ms`` lease, asked for rounds every 5 ms until
    ``until(leader, log)`` holds (the renewals go out in the background meanwhile)."""
    log = Log(QuorumStateMachine())
    leader = LeaderTerm("n1", log.machine, log.submit, lease=LeaseSettings(lease_ms=lease_ms), probe=probe,
                        stream=stream)
    leader.start(1)
    assert await asyncio.wait_for(leader.serving(1), 5.0)
    leader.requested()

    async def busy() -> None:
        while True:
            leader.round_issued()
            await asyncio.sleep(0.005)

    task = asyncio.ensure_future(busy())
    try:
        await wait_for_async("the renewals expected", lambda: until(leader, log), timeout, interval=0.002)
    finally:
        task.cancel()
        leader.stop()
    return leader, log


class Probes:
    """A ``probe`` that a majority always confirms; ``terms``: the term of each probe asked."""

    def __init__(self) -> None:
        self.terms: list[int] = []

    async def __call__(self, term: int) -> bool:
        self.terms.append(term)
        await asyncio.sleep(0)
        return True


def test_a_busy_leader_renews_its_lease_by_probes_and_writes_one_confirmation() -> None:
    probe = Probes()

    async def main() -> None:
        leader, log = await _busy_term(probe, until=lambda leader, _log: leader.renewals["probe"] >= 5)
        assert log.count(ConfirmLeadership) == 1  # the term's announcement of its lease length only
        assert leader.renewals["commit"] == 0 and set(probe.terms) == {1}
    asyncio.run(main())


@pytest.mark.parametrize("heartbeats", [False, True], ids=["asked", "streamed"])
@pytest.mark.parametrize("answer", ["refused", "unanswered"])
def test_a_probe_not_confirmed_falls_back_to_commits_for_a_while(answer: str, heartbeats: bool) -> None:
    """Members that echo no probe (an older version): the probe asked when the lease runs low goes
    unconfirmed, and renewals are commits for PROBE_BACKOFF_S, also where every heartbeat is a
    probe (none of them is confirmed either)."""
    probed: list[int] = []

    async def probe(term: int) -> bool:
        probed.append(term)
        if answer == "unanswered":  # a member that does not echo: never confirmed, the wait times out
            await asyncio.sleep(10)
        return False

    async def main() -> None:
        beats = Heartbeats(mute=True) if heartbeats else None
        try:
            leader, log = await _busy_term(probe, stream=beats, lease_ms=150 if heartbeats else 100,
                                           until=lambda leader, _log: leader.renewals["commit"] >= 3)
        finally:
            if beats is not None:
                beats.stop()
        assert len(probed) == 1, "after an unconfirmed probe, renewals are commits for PROBE_BACKOFF_S"
        assert leader.renewals["probe"] == 0 and leader.renewals["heartbeat"] == 0
        assert log.count(ConfirmLeadership) >= 4
    asyncio.run(main())


# -- renewals by heartbeat (lease_probes.py, "Heartbeats as probes") -------------------------------


class Heartbeats:
    """A leader's heartbeats as ``LeaderTerm``'s ``stream`` sees them: while a stream is on, one
    confirmation every ``period_s`` (unless ``mute``), stamped with when it was "sent"."""

    def __init__(self, period_s: float = 0.02, mute: bool = False) -> None:
        self.period_s = period_s
        self.mute = mute  # members that do not echo, or heartbeats that never get through
        self.calls: list[tuple[int, bool]] = []  # (term, on) per stream() call
        self.on_confirmed: Any = None
        self.given: list[Any] = []  # every on_confirmed a stream was started with
        self._task: asyncio.Task[None] | None = None

    def __call__(self, term: int, on_confirmed: Any) -> None:
        self.calls.append((term, on_confirmed is not None))
        self.on_confirmed = on_confirmed
        if on_confirmed is None:
            return
        self.given.append(on_confirmed)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._beat())

    async def _beat(self) -> None:
        while True:
            sent = time.monotonic()
            await asyncio.sleep(self.period_s)
            if self.on_confirmed is not None and not self.mute:
                self.on_confirmed(sent)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


def test_a_busy_leader_renews_its_lease_by_its_heartbeats_with_no_probe_of_their_own() -> None:
    probe = Probes()

    async def main() -> None:
        beats = Heartbeats()
        try:
            leader, log = await _busy_term(probe, stream=beats, lease_ms=150,
                                           until=lambda leader, _log: leader.renewals["heartbeat"] >= 20)
        finally:
            beats.stop()
        assert log.count(ConfirmLeadership) == 1 and leader.renewals["commit"] == 0
        # A probe of its own only where a heartbeat came a quarter lease late (a stalled loop).
        assert leader.renewals["heartbeat"] > 4 * max(1, len(probe.terms)), (leader.renewals, probe.terms)
        assert beats.calls[0] == (1, True) and beats.calls[-1] == (1, False)  # stopped with the term
    asyncio.run(main())


def test_heartbeats_that_stop_confirming_give_way_to_probes() -> None:
    async def main() -> None:
        beats = Heartbeats(mute=True)
        try:
            leader, log = await _busy_term(Probes(), stream=beats, lease_ms=150,
                                           until=lambda leader, _log: leader.renewals["probe"] >= 5)
        finally:
            beats.stop()
        assert leader.renewals["heartbeat"] == 0 and leader.renewals["commit"] == 0
        assert log.count(ConfirmLeadership) == 1
    asyncio.run(main())


def test_heartbeats_renew_only_while_rounds_come_fast_and_only_the_term_they_belong_to() -> None:
    async def main() -> None:
        beats = Heartbeats()
        log = Log(QuorumStateMachine())
        leader = LeaderTerm("n1", log.machine, log.submit, lease=LeaseSettings(lease_ms=150), probe=Probes(),
                            stream=beats)
        try:
            leader.start(1)
            assert await asyncio.wait_for(leader.serving(1), 5.0)
            leader.requested()
            await wait_for_async("the announced lease", lambda: log.count(ConfirmLeadership) == 1, 5.0,
                                 interval=0.001)
            for _ in range(3):  # busy: the heartbeats become probes
                leader.round_issued()
                await asyncio.sleep(0.01)
            await wait_for_async("a renewal by heartbeat", lambda: leader.renewals["heartbeat"] >= 1, 5.0,
                                 interval=0.001)
            # No round for BUSY_GAP_S: the stream stops (heartbeats plain again).
            await wait_for_async("the stream stopped", lambda: beats.calls[-1] == (1, False), 5.0, interval=0.005)
            renewed = dict(leader.renewals)
            beats.given[-1](time.monotonic())  # a confirmation read after the stream stopped
            assert leader.renewals == renewed
            leader.round_issued()  # busy again: the stream starts again
            leader.round_issued()
            await wait_for_async("the stream restarted", lambda: beats.calls[-1] == (1, True), 5.0, interval=0.001)
            leader.stop()
            assert beats.calls[-1] == (1, False)
            renewed = dict(leader.renewals)
            # A confirmation of the term that arrives after it ended renews nothing.
            beats.given[-1](time.monotonic())
            assert leader.renewals == renewed and not leader.lease.valid(1, time.monotonic())
        finally:
            beats.stop()
            leader.stop()
    asyncio.run(main())
