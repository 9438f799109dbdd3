"""The Raft mechanisms, case by case, on a simulated network and a fake clock (``support.sim_raft``).

Each case builds real ``RaftNode``s, drives them by ``doTick`` in a deterministic order (a seeded
run gives the same result every time) and asserts what the mechanism is for, through what a
node shows (role, term, leader, commits) and what goes over the wire. Each case runs twice: with
the mechanism (``test_case``) and with the mechanism switched off (``test_case_fails_without_its_mechanism``),
where it must fail: a case that passes either way tests nothing. The switches are listed in
``MECHANISM_OFF``: a setting where one exists, else a test-only subclass whose one hook does what
pysyncobj does without the mechanism.

No process, no socket, no sleep: the whole table runs in a few seconds.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from support.sim_raft import SimCluster
from lighthouse_cluster.core.codec import ConfirmLeadership, KVWrite
from lighthouse_cluster.core.kv_store import KVSet
from lighthouse_cluster.raft.composed_node import EXTENSION_CLASSES, LighthouseSyncObj
from lighthouse_cluster.raft.extensions.fast_election import HANDOVER_KEY, KEEPALIVE, FastElection
from lighthouse_cluster.raft.extensions.idle_acks import IdleAcks
from lighthouse_cluster.raft.extensions.lease_probes import LEASE_PROBE_KEY, PROBE_EXPIRY_S, LeaseProbes
from lighthouse_cluster.raft.extensions.quiescence import QUIET_KEY
from lighthouse_cluster.raft.extensions.stall_tolerance import StallTolerance
from lighthouse_cluster.raft.host import Extension
from lighthouse_cluster.raft.journal import SNAPSHOT_FILE
from lighthouse_cluster.raft.replication import RaftSettings

# -- the mechanisms switched off --------------------------------------------------------------------


def node_with(**extension: type[Extension]) -> type[LighthouseSyncObj]:
    """The production node with the named extensions of another class (``extension_classes``)."""
    return type("SwitchedSyncObj", (LighthouseSyncObj,),
                {"__slots__": (), "extension_classes": {**EXTENSION_CLASSES, **extension}})


class NoKeepaliveElection(FastElection):
    """Followers send each other nothing while a leader lives (pysyncobj: their link idles)."""

    def keepalive_period_s(self) -> float:
        return float("inf")


class NoClosedLeaderElection(FastElection):
    """A follower whose leader's connection closed waits out its election timeout (pysyncobj)."""

    def node_disconnected(self, node: Any) -> None:
        pass


class NoStaleLeaderElection(FastElection):
    """An append_entries of an older term is ignored without a word (pysyncobj)."""

    def _tell_stale_leader(self, node: Any, term: int) -> None:
        pass


class NoHandoverElection(FastElection):
    """A candidate standing on TimeoutNow asks for votes as any candidate does (unmarked)."""

    def _send_handover_votes(self) -> None:
        pass


class NoRestartHoldBackElection(FastElection):
    """A restarted member may stand at its first election deadline, as a new one may (pysyncobj)."""

    def on_started(self) -> None:
        pass


class NoStallMeasured(StallTolerance):
    """A tick that starts late is not noticed, and timers are checked before reading (pysyncobj)."""

    def before_tick(self) -> None:
        pass


class AckEveryHeartbeatAcks(IdleAcks):
    """A follower acknowledges every append_entries (pysyncobj)."""

    @property
    def ack_every_s(self) -> float:
        return 0.0


class NoEchoProbes(LeaseProbes):
    """A follower echoes no lease probe (an older version)."""

    def message_in(self, node: Any, message: Any) -> bool:
        return False


NoKeepalives = node_with(fast_election=NoKeepaliveElection)
NoClosedLeaderReaction = node_with(fast_election=NoClosedLeaderElection)
NoStaleLeaderTold = node_with(fast_election=NoStaleLeaderElection)
NoHandoverMark = node_with(fast_election=NoHandoverElection)
NoRestartHoldBack = node_with(fast_election=NoRestartHoldBackElection)
NoStallTolerance = node_with(stall_tolerance=NoStallMeasured)
AckEveryHeartbeat = node_with(idle_acks=AckEveryHeartbeatAcks)
NoEcho = node_with(lease_probes=NoEchoProbes)


class FixedTick(LighthouseSyncObj):
    """The tick thread knows no deadline and waits its longest every time."""

    __slots__ = ()

    def tick_deadlines(self) -> list[float]:
        return []


# -- the cases ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    run: Callable[[bool], None]  # run(on): with the mechanism (True) or without it (False)
    off: str  # how the mechanism is switched off
    fails_with: str  # a regex of what the failure without the mechanism says (not some other failure)


CASES: list[Case] = []


def case(off: str, fails_with: str) -> Callable[[Callable[[bool], None]], Callable[[bool], None]]:
    def register(fn: Callable[[bool], None]) -> Callable[[bool], None]:
        CASES.append(Case(fn.__name__, fn, off, fails_with))
        return fn
    return register


@case(off="no link between any two nodes", fails_with="one leader known to every live node")
def elects_one_leader_that_commits_on_every_node(on: bool) -> None:
    with SimCluster(seed=1) as cluster:
        if not on:
            cluster.network.partition()
        leader = cluster.elect(timeout_s=2.0)
        assert len(set(cluster.terms())) == 1
        follower = cluster.followers(leader)[0]
        # A write on a follower: forwarded to the leader, committed and applied on every node.
        cluster.submit(follower, ConfirmLeadership(term=leader.term, node_id="n1", lease_ms=100))
        index = leader.raft.commit_index
        cluster.run_until("the write applied on every node",
                          lambda: all(n.raft.last_applied >= index for n in cluster.nodes), 1.0)


@case(off="NoKeepalives", fails_with="2 elections")
def idle_follower_links_carry_the_first_vote_request_of_a_failover(on: bool) -> None:
    """fast_election, follower links kept alive (docs/design/fast-election.md): after an idle spell
    longer than the connection timeout, the survivors of a leader cut off by a partition elect one
    of them in one election. Without keep-alives the first candidate's vote request goes out on a
    link idle for longer than pysyncobj's connection timeout, which drops it: a split vote, a second
    election."""
    for seed in range(4):
        with SimCluster(seed=seed, node_class=None if on else NoKeepalives) as cluster:
            leader = cluster.elect()
            term = leader.term
            cluster.run_for(3 * 0.5)  # three connection timeouts without Raft traffic between followers
            survivors = cluster.followers(leader)
            cluster.network.partition([n.address for n in survivors])
            new = cluster.run_until("a new leader among the survivors", lambda: cluster.leader(survivors), 3.0)
            assert new in survivors
            assert new.term == term + 1, f"seed {seed}: {new.term - term} elections"


SLOW = RaftSettings(election_timeout_min_s=1.0, election_timeout_max_s=2.0, append_entries_period_s=0.05,
                    quiet_after_s=0.0)


@case(off="NoClosedLeaderReaction", fails_with="a new leader after")
def a_crashed_leader_is_replaced_at_the_end_of_the_refusal_window(on: bool) -> None:
    """fast_election, a closed connection to the leader (docs/design/fast-election.md): with
    election timeouts of 1-2 s and a 0.3 s refusal window, the survivors of a leader whose process
    died (its connections closed) stand from the end of the window, first by node id, and one
    election does it."""
    with SimCluster(seed=2, settings=SLOW, syncobj_kwargs={"vote_refusal_s": 0.3},
                    node_class=None if on else NoClosedLeaderReaction) as cluster:
        leader = cluster.elect()
        cluster.submit(leader, ConfirmLeadership(term=leader.term, node_id="n1", lease_ms=100))
        cluster.run_for(0.2)
        term, survivors = leader.term, sorted(cluster.followers(leader), key=lambda n: n.address)
        cluster.crash(leader)
        crashed = cluster.now
        new = cluster.run_until("a new leader", cluster.leader, 5.0)
        assert cluster.now - crashed < 0.8, f"a new leader after {cluster.now - crashed:.3f} s"
        assert new is survivors[0] and new.term == term + 1


@case(off="vote_refusal_s=0", fails_with="a live leader was disrupted")
def a_vote_request_is_put_off_while_the_leader_lives(on: bool) -> None:
    """fast_election.vote_refused (thesis 4.2.3; the quorum lease, point 3): a node that heard
    from its leader less than the window ago grants no vote and keeps its term, so a candidate
    disrupts no live leader; the request is answered once the window is over."""
    with SimCluster(seed=3, syncobj_kwargs={} if on else {"vote_refusal_s": 0.0}) as cluster:
        leader = cluster.elect()
        voter, candidate = sorted(cluster.followers(leader), key=lambda n: n.address)
        term = leader.term
        last_term, last_index = voter.syncobj.pso_last_log()
        request = {"type": "request_vote", "term": term + 1, "last_log_term": last_term, "last_log_index": last_index}
        cluster.inject(candidate, voter, request)
        cluster.run_for(1.0)
        assert cluster.terms() == [term] * 3 and cluster.leader() is leader, "a live leader was disrupted"
        assert cluster.network.count("response_vote", src=voter.address, since=cluster.now - 1.0) == 0
        # The leader dies (its connections close): the same request, put off, is answered at the
        # end of the window (not before it, nor one election timeout later).
        cluster.crash(leader)
        heard = cluster.now
        cluster.inject(candidate, voter, request)
        granted_at = cluster.run_until(
            "the voter grants the vote",
            lambda: next((s.at for s in cluster.network.sent if s.kind == "response_vote" and s.src == voter.address
                          and s.at >= heard), None), 1.0)
        assert heard + 0.15 - 0.04 <= granted_at < heard + 0.15 + 0.05, granted_at - heard


@case(off="NoStaleLeaderTold", fails_with="the leader at the follower's term")
def a_node_at_a_higher_term_deposes_the_leader_at_its_next_append_entries(on: bool) -> None:
    """fast_election, DEPOSE_KEY (Raft's "reply with the higher term"): a node that reached a
    higher term without its vote requests reaching the leader answers the leader's next
    append_entries with its term, and the leader steps down to it without voting for it, within
    a heartbeat, not at the node's next election timeout."""
    with SimCluster(seed=4, node_class=None if on else NoStaleLeaderTold) as cluster:
        leader = cluster.elect()
        follower, other = sorted(cluster.followers(leader), key=lambda n: n.address)
        term = leader.term
        last_term, last_index = follower.syncobj.pso_last_log()
        # A handover's vote request (answered at once) takes the follower to term + 5.
        cluster.inject(other, follower, {"type": "request_vote", "term": term + 5, "last_log_term": last_term,
                                         "last_log_index": last_index, HANDOVER_KEY: True})
        cluster.run_until("the follower at term + 5", lambda: follower.term == term + 5, 0.1)
        told = cluster.now
        cluster.run_until("the leader at the follower's term", lambda: leader.term >= term + 5, 0.1)
        assert cluster.now - told < 0.1
        assert cluster.network.count("response_vote", src=leader.address, since=told) == 0, "told, not asked"
        new = cluster.elect(timeout_s=3.0)
        assert new.term >= term + 5


@case(off="NoHandoverMark", fails_with="the target leads")
def a_handover_target_wins_at_once_despite_the_refusal_window(on: bool) -> None:
    """fast_election.HANDOVER_KEY and RaftNode.transfer_leadership (thesis 3.10): with a 3 s
    refusal window the target of a TimeoutNow still leads within a few messages, the old leader
    appends nothing meanwhile, and nobody stands again afterwards."""
    with SimCluster(seed=5, syncobj_kwargs={"vote_refusal_s": 3.0},
                    node_class=None if on else NoHandoverMark) as cluster:
        leader = cluster.elect(timeout_s=10.0)
        cluster.submit(leader, ConfirmLeadership(term=leader.term, node_id="n1", lease_ms=100))
        cluster.run_for(0.2)  # the leader knows every follower has its whole log
        target = cluster.followers(leader)[0]
        term = leader.term
        sent: list[str | None] = []
        leader.raft.transfer_leadership(target.address, sent.append)
        assert sent == [None], sent
        refused: list[Any] = []
        leader.raft.submit(ConfirmLeadership(term=term, node_id="n1", lease_ms=100), lambda r, e: refused.append(e))
        assert refused and "leadership transfer" in str(refused[0])
        cluster.run_until("the target leads", lambda: cluster.leader() is target, 0.5)
        assert target.term == term + 1 and target.raft.vote_refusal_s(term + 1) == 0.0
        cluster.run_for(3 * 0.45)
        assert cluster.terms() == [term + 1] * 3 and cluster.leader() is target


STALLS = RaftSettings(quiet_after_s=0.0)


@case(off="NoStallTolerance", fails_with="a stalled follower raised the term")
def a_follower_that_stalls_past_its_election_deadline_reads_the_heartbeat_first(on: bool) -> None:
    """stall_tolerance (docs/design/stall-tolerance.md): a follower whose tick thread stops for
    longer than its election timeout, with the leader's heartbeats arriving meanwhile, reads them
    before it checks its deadline and does not stand."""
    with SimCluster(seed=6, settings=STALLS, node_class=None if on else NoStallTolerance) as cluster:
        leader = cluster.elect()
        term = leader.term
        for follower in cluster.followers(leader) * 2:
            cluster.stall(follower, 0.47)  # past any deadline (<= 0.45 s), within the connection timeout
            cluster.run_for(1.0)
        assert cluster.terms() == [term] * 3 and cluster.leader() is leader, "a stalled follower raised the term"


@case(off="NoStallTolerance", fails_with="the followers did not wait")
def a_leader_that_stalled_is_waited_for_when_it_stalls_again(on: bool) -> None:
    """stall_tolerance, patience (docs/design/stall-tolerance.md): a leader that stalled 0.1 s
    (under the 0.15 s minimum election timeout) asks for twice that in its append_entries; its later
    stalls of 0.25 s (past what a follower may draw) cost no election. Killed, it is replaced all
    the same."""
    with SimCluster(seed=7, settings=STALLS, node_class=None if on else NoStallTolerance) as cluster:
        leader = cluster.elect()
        term = leader.term
        cluster.stall(leader, 0.1)
        cluster.run_for(0.5)
        for _ in range(3):
            cluster.stall(leader, 0.25)
            cluster.run_for(0.6)
        assert cluster.terms() == [term] * 3 and cluster.leader() is leader, "the followers did not wait"
        cluster.crash(leader)
        crashed = cluster.now
        cluster.run_until("a new leader", cluster.leader, 2.0)
        assert cluster.now - crashed < 0.2 + 0.45 + 0.2


QUIET = RaftSettings(quiet_after_s=0.5)


@case(off="quiet_after_s=0", fails_with="quiet heartbeats")
def an_idle_cluster_quiesces_and_a_client_wakes_it(on: bool) -> None:
    """quiescence (docs/design/quiescence.md): with no client for quiet_after_s, the leader
    heartbeats every quiet_period_s (0.2 s) and says so, nobody stands meanwhile; a client at a
    follower wakes the leader back to its normal period."""
    with SimCluster(seed=8, settings=QUIET if on else RaftSettings(quiet_after_s=0.0)) as cluster:
        leader = cluster.elect()
        cluster.enable_schema(leader)
        term = leader.term
        cluster.run_for(1.0)
        since = cluster.now
        cluster.run_for(2.0)
        for follower in cluster.followers(leader):
            beats = cluster.network.count("append_entries", src=leader.address, dst=follower.address, since=since)
            quiet = cluster.network.count("append_entries", src=leader.address, dst=follower.address, since=since,
                                          key=QUIET_KEY)
            assert beats <= 2.0 / 0.2 + 2 and quiet == beats, f"{beats} heartbeats in 2 s, {quiet} quiet heartbeats"
            # The followers' links stay up on keep-alives sent with those heartbeats (one per 0.2 s,
            # not one per 0.1 s).
            keepalives = cluster.network.count("lighthouse_cluster_keepalive", src=follower.address, since=since)
            assert 2.0 / 0.2 - 2 <= keepalives <= 2.0 / 0.2 + 2, keepalives
            assert follower.raft.quiet
        assert cluster.terms() == [term] * 3 and cluster.leader() is leader
        # A client at a follower: it wakes its leader, which is back to its normal period at once.
        follower = cluster.followers(leader)[0]
        follower.raft.note_client_activity()
        cluster.run_until("every node awake", lambda: not any(n.raft.quiet for n in cluster.nodes), 0.1)
        assert cluster.network.count("lighthouse_cluster_wake", src=follower.address, dst=leader.address) >= 1
        since = cluster.now
        cluster.run_for(0.5)
        beats = cluster.network.count("append_entries", src=leader.address, dst=follower.address, since=since)
        assert beats >= 0.5 / 0.0375 - 2, beats
        # Quiet again once the client is gone; a client at the leader wakes it too.
        cluster.run_until("quiet again", lambda: all(n.raft.quiet for n in cluster.nodes), 2.0)
        leader.raft.note_client_activity()
        cluster.run_until("awake on a call to the leader", lambda: not any(n.raft.quiet for n in cluster.nodes), 0.1)
        assert cluster.terms() == [term] * 3 and cluster.leader() is leader


@case(off="AckEveryHeartbeat", fails_with="acknowledgements for")
def idle_followers_acknowledge_heartbeats_a_few_times_a_second(on: bool) -> None:
    """idle_acks: a follower repeats an acknowledgement every connectionTimeout / 5, not per
    heartbeat, and the leader keeps leading (it hears from each within its fallback timeout)."""
    with SimCluster(seed=9, settings=STALLS, node_class=None if on else AckEveryHeartbeat) as cluster:
        leader = cluster.elect()
        term = leader.term
        since = cluster.now
        cluster.run_for(2.5)
        for follower in cluster.followers(leader):
            beats = cluster.network.count("append_entries", src=leader.address, dst=follower.address, since=since)
            acks = cluster.network.count("next_node_idx", src=follower.address, since=since)
            assert acks <= beats / 2, f"{acks} acknowledgements for {beats} heartbeats"
            assert acks >= 2.5 / 0.25, f"{acks} acknowledgements for {beats} heartbeats"
        assert cluster.terms() == [term] * 3 and cluster.leader() is leader
        # New entries are acknowledged at once: a write commits within a round trip or two.
        submitted = cluster.now
        cluster.submit(leader, ConfirmLeadership(term=term, node_id="n1", lease_ms=100))
        assert cluster.now - submitted < 0.01


@case(off="NoEcho", fails_with="not confirmed")
def a_lease_probe_is_confirmed_by_a_majority_with_no_log_entry(on: bool) -> None:
    """lease_probes (docs/design/lease-renewal.md): a leader confirms it leads its term with one
    acknowledged heartbeat: no entry written; one live follower of two suffices; with none, the
    probe fails after PROBE_EXPIRY_S."""
    with SimCluster(seed=10, node_class=None if on else NoEcho) as cluster:
        leader = cluster.elect()
        cluster.run_for(0.3)
        term, index = leader.term, leader.raft.commit_index
        near, far = sorted(cluster.followers(leader), key=lambda n: n.address)

        def probe() -> bool:
            out: list[bool] = []
            leader.raft.probe_leadership(term, out.append)
            cluster.run_until("the probe answered", lambda: out, PROBE_EXPIRY_S + 0.5)
            return out[0]

        asked = cluster.now
        assert probe() is True, "a probe echoed by both followers not confirmed"
        assert cluster.now - asked < 0.01  # one round trip, not a heartbeat period
        assert leader.raft.commit_index == index
        assert cluster.network.count("next_node_idx", since=asked, key=LEASE_PROBE_KEY) >= 1
        cluster.network.partition([leader.address, near.address], [far.address])
        assert probe() is True, "a probe echoed by one follower of two not confirmed"
        cluster.network.partition([leader.address], [near.address, far.address])
        assert probe() is False, "a probe nobody echoed confirmed"


@case(off="FixedTick", fails_with="an election while the leader was idle|one leader known to every live node")
def an_idle_leaders_heartbeats_are_its_tick_deadlines(on: bool) -> None:
    """adaptive_tick: with a longest wait of 5 s, a node wakes for its next deadline (a
    heartbeat, an election, a keep-alive): the idle leader keeps its followers, and nodes tick a
    few dozen times a second, not a hundred."""
    settings = RaftSettings(idle_tick_max_s=5.0, quiet_after_s=0.0)
    with SimCluster(seed=11, settings=settings, node_class=None if on else FixedTick) as cluster:
        leader = cluster.elect(timeout_s=10.0)
        term = leader.term
        ticks = [n.ticks for n in cluster.nodes]
        cluster.run_for(3.0)
        assert cluster.terms() == [term] * 3 and cluster.leader() is leader, "an election while the leader was idle"
        assert all((n.ticks - t) / 3.0 < 60 for n, t in zip(cluster.nodes, ticks))
        # A follower's election deadline is a tick deadline too: the leader dies (unannounced: a
        # partition), and a survivor stands within the longest election timeout, not after 5 s.
        cluster.network.partition([n.address for n in cluster.followers(leader)])
        cut = cluster.now
        survivors = cluster.followers(leader)
        cluster.run_until("a new leader", lambda: cluster.leader(survivors), 2.0)
        assert cluster.now - cut < 0.45 + 0.2


COMPACTING = RaftSettings(compaction_min_entries=20)


@case(off="compaction_min_entries=10**6", fails_with="no snapshot")
def a_follower_behind_the_compacted_log_catches_up_from_a_snapshot(on: bool) -> None:
    """Log compaction (pysyncobj's, on this project's msgpack snapshots: ``ReplicatedState``): a
    leader whose log passed ``compaction_min_entries`` replaces it with a snapshot, and a follower
    cut off meanwhile is brought up to date by that snapshot, not by the entries it missed; every
    node then holds the same state machine, byte for byte."""
    settings = COMPACTING if on else RaftSettings(compaction_min_entries=10**6)
    # On files (DurableSnapshotFile: the leader's snapshot written, the follower's received, synced).
    with tempfile.TemporaryDirectory() as tmp, SimCluster(seed=12, settings=settings, data_dir=Path(tmp)) as cluster:
        leader = cluster.elect()
        cluster.enable_schema(leader)
        lagging = cluster.followers(leader)[0]
        cluster.network.partition([n.address for n in cluster.nodes if n is not lagging], [lagging.address])
        for i in range(60):
            cluster.submit(leader, KVWrite("default", "compaction", KVSet(f"k{i}", b"v"), f"r{i}", 1_000 + i))
        cut_off_at = cluster.now
        cluster.network.heal()

        def same_state() -> bool:
            return lagging.raft.state.machine.to_snapshot() == leader.raft.state.machine.to_snapshot()

        cluster.run_until("the lagging follower holds the leader's state", same_state, 10.0)
        # pysyncobj sends a snapshot as append_entries carrying "serialized" (in chunks).
        snapshots = cluster.network.count("append_entries", dst=lagging.address, since=cut_off_at, key="serialized")
        assert snapshots > 0, "no snapshot sent: the follower caught up entry by entry"
        assert len(lagging.raft.state.machine.kv.namespaces[("default", "compaction")].entries) == 60
        assert all(Path(tmp, f"n{n.index + 1}", SNAPSHOT_FILE).exists() for n in (leader, lagging))


@case(off="hold_elections_until_leader=False", fails_with="stood for election")
def a_joining_node_stands_for_no_election_until_it_has_heard_a_leader(on: bool) -> None:
    """``RaftNode(hold_elections_until_leader=True)`` (``serve --join``): a member joining with an
    empty journal, cut off from the cluster, starts no election (it would only be refused, and
    its higher term would depose the live leader when it is let in); once it hears the leader it
    follows it and takes part in elections as any node."""
    with SimCluster(seed=13, joining=[2] if on else []) as cluster:
        joiner = cluster.nodes[2]
        # Linked to the members (keep-alives get through) but hearing no Raft message: as a joining
        # node before it is added, whose messages the members do not act on.
        unheard = cluster.network.drop_if(lambda src, dst, message: joiner.address in (src, dst)
                                          and message != KEEPALIVE)
        leader = cluster.run_until("a leader of the two", lambda: cluster.leader(cluster.nodes[:2]), 5.0)
        term = leader.term
        cluster.run_for(5.0)
        assert joiner.term == 0, f"the joining node stood for election (term {joiner.term})"
        cluster.network.allow(unheard)
        cluster.run_until("the joining node follows the leader",
                          lambda: joiner.raft.leader_address == leader.address, 5.0)
        assert leader.term == term and cluster.leader() is leader
        # Released: it stands like any member once the leader is gone.
        cluster.crash(leader)
        new = cluster.run_until("a new leader", cluster.leader, 5.0)
        assert new.term > term


SLOW_REDIAL = RaftSettings(reconnect_s=1.0, quiet_after_s=0.0)


@case(off="NoRestartHoldBack", fails_with="deposed the live leader")
def a_restarted_member_waits_for_the_live_leader_before_it_stands(on: bool) -> None:
    """fast_election, a restarted member holds back (docs/design/fast-election.md): a follower
    restarted from its journal (a term in it) gives the live leader time to re-dial it (at most
    every ``connectionRetryTime``, 1 s here) before its first election deadline, and follows it.
    Without the hold-back it stands at its first election timeout, before the leader's re-dial,
    and its higher term deposes a healthy leader (pysyncobj has no pre-vote): a failover for
    every trainer, for nothing."""
    for restart_after_s in (0.05, 0.4, 0.75):
        with tempfile.TemporaryDirectory() as tmp, SimCluster(
                seed=14, settings=SLOW_REDIAL, data_dir=Path(tmp),
                node_class=None if on else NoRestartHoldBack) as cluster:
            leader = cluster.elect()
            cluster.submit(leader, ConfirmLeadership(term=leader.term, node_id="n1", lease_ms=100))
            cluster.run_for(0.2)  # every follower has the whole log: a handover may go to any
            top, member = cluster.nodes[-1], cluster.nodes[0]  # member: the least address, dialed by the others
            if leader is not top:
                sent: list[str | None] = []
                leader.raft.transfer_leadership(top.address, sent.append)
                assert sent == [None], sent
                leader = cluster.run_until("the greatest address leads", lambda: cluster.leader() is top and top, 2.0)
            term = leader.term
            cluster.run_until("the member holds the leader's term", lambda: member.term == term, 1.0)
            cluster.crash(member)
            cluster.run_for(restart_after_s)  # where the leader's re-dial falls after the restart varies
            restarted = cluster.restart(member)
            assert restarted.term == term  # from its journal
            cluster.run_for(3.0)
            assert cluster.terms() == [term] * 3 and cluster.leader() is leader, (
                f"the restarted member deposed the live leader ({restart_after_s} s down): {cluster.describe()}")
            assert restarted.raft.leader_address == leader.address


# -- the table ------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_case(case: Case) -> None:
    case.run(True)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_case_fails_without_its_mechanism(case: Case) -> None:
    with pytest.raises(AssertionError, match=case.fails_with):
        case.run(False)


def test_a_lossy_reordering_network_still_elects_and_commits() -> None:
    """5 % of messages lost and up to 5 ms of jitter (messages overtake each other): a leader is
    elected and ten writes commit on every node all the same."""
    with SimCluster(seed=14, jitter_s=0.005) as cluster:
        cluster.network.drop_rate = 0.05
        leader = cluster.elect(timeout_s=5.0)
        for i in range(10):
            cluster.submit(leader, ConfirmLeadership(term=leader.term, node_id=f"n{i}", lease_ms=100))
        index = leader.raft.commit_index
        cluster.run_until("every node applied the writes",
                          lambda: all(n.raft.last_applied >= index for n in cluster.nodes), 5.0)
    assert cluster.network.count("append_entries") > 0


def test_a_seeded_run_is_repeatable() -> None:
    def trace(seed: int) -> list[tuple[float, str, str, str]]:
        with SimCluster(seed=seed) as cluster:
            leader = cluster.elect()
            cluster.crash(leader)
            cluster.elect()
            return [(s.at, s.src, s.dst, s.kind) for s in cluster.network.sent]

    assert trace(12) == trace(12)
    assert trace(12) != trace(13)
