"""A real network partition: a partitioned former leader issues nothing.

Three nodes run in their own network namespaces (``jepsen_like.netns``). Simulated replica
groups talk to them: two ("iso-*") only ever to the leader's client port, two ("maj-*") to the
followers. Then the leader is cut from its peers, both ways; the test process (root namespace)
still reaches every client port, so the iso groups keep asking the isolated leader.

Checked, from the client history and from every node's Raft journal after the run:
(a) the majority elects a new leader and issues quorums to the groups on its side;
(b) while isolated, the old leader returns no quorum: no Quorum call that reached it after the
    cut succeeds, and anything it returned around the cut was committed in the Raft log;
(c) after the heal the old leader follows the new one and catches up (its committed log equals
    the others'), every group gets quorums again, and no quorum id ever has two member sets.

The client history is written to ``history.jsonl`` in the test's temporary directory.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import pytest

from support.run_lock import serial_on
from support.waiting import wait_for
from jepsen_like import netns
from lighthouse_cluster.core import codec
from lighthouse_cluster.core.codec import CommitQuorum
from lighthouse_cluster.local.cluster import LocalCluster
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.local.simulated_group import RoundResult, SimulatedReplicaGroup
from lighthouse_cluster.core.state_machine import CommitResult, QuorumStateMachine
from lighthouse_cluster.raft.journal import command_payload, parse_journal

# serial_on: one fault-harness run at a time (tests/support/run_lock.py), beside any other test
pytestmark = [pytest.mark.integration, pytest.mark.timeout(150), serial_on("fault-harness"), pytest.mark.low_cpu]

ISO_GROUPS = ("iso-a", "iso-b")      # talk only to the leader that gets isolated
MAJ_GROUPS = ("maj-a", "maj-b")      # one per follower (the majority side)
ALL_GROUPS = ISO_GROUPS + MAJ_GROUPS
ISO_QUORUM_TIMEOUT_S = 2.0
MAJ_QUORUM_TIMEOUT_S = 3.0
# A call that reached the old leader just before the cut may still get a quorum committed
# before the cut (its acknowledgements were already in); later ones must not succeed.
CUT_GRACE_S = 0.5
MIN_PARTITION_S = 4.0
STEP_TIME_S = 0.02                   # between successful rounds (torchft: one training step)
WARM_UP_ROUNDS = 5                   # full-membership quorums per group before the cut


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture
def net():
    ok, why = netns.available()
    if not ok:
        pytest.skip(f"network namespaces unavailable: {why}")
    network = netns.NetnsNetwork(3).setup()
    try:
        yield network
    finally:
        network.teardown()


@pytest.fixture
def cluster(net: netns.NetnsNetwork, tmp_path: Path):
    c = LocalCluster(
        root=tmp_path / "cluster", nodes=3, hosts=net.addresses, launch_prefix=net.exec_prefix,
        min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=500, quorum_tick_ms=50,
    )
    try:
        c.start()
        yield c
    finally:
        c.stop_all()


# -- traffic -------------------------------------------------------------------------------------


class Traffic:
    """Simulated replica groups on their own event loop thread; every round is recorded."""

    def __init__(self, groups: list[SimulatedReplicaGroup]) -> None:
        self.groups = groups
        self.results: list[RoundResult] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="traffic", daemon=True)
        self.error: BaseException | None = None
        for g in groups:
            g.on_round = self._record

    def _record(self, r: RoundResult) -> None:
        with self._lock:
            self.results.append(r)

    def snapshot(self) -> list[RoundResult]:
        with self._lock:
            return list(self.results)

    def start(self) -> "Traffic":
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"traffic did not stop within {timeout}s"
        if self.error is not None:
            raise self.error

    def _main(self) -> None:
        async def main() -> None:
            try:
                await asyncio.gather(*(g.run(until=self._stop.is_set) for g in self.groups))
            finally:
                for g in self.groups:
                    await g.close()
        try:
            asyncio.run(main())
        except BaseException as e:  # surfaced by stop()
            self.error = e


def finished(r: RoundResult) -> float:
    return r.started + r.latency_s


# -- helpers -------------------------------------------------------------------------------------


def statuses(cluster: LocalCluster) -> list[cpb.NodeStatus | None]:
    return [cluster.status(i, timeout=0.5) for i in range(cluster.nodes)]


Entry = tuple[int, int, bytes]                     # Raft log index, term, command bytes
Committed = tuple[int, tuple[str, ...], int]       # quorum id, member ids, term of its log entry


def committed_quorums(journal: Path, upto: int) -> tuple[list[Entry], list[Committed]]:
    """The node's Raft log entries with index <= ``upto`` and the quorums they commit, replayed
    through the real state machine (compare-and-set rejections included)."""
    entries = [(idx, term, cmd) for idx, term, cmd in parse_journal(journal) if idx <= upto]
    assert entries and entries[0][0] == 1, f"{journal}: log does not start at index 1 (compacted?)"
    machine = QuorumStateMachine()
    applied: list[Committed] = []
    for _idx, term, cmd in entries:
        payload = command_payload(cmd)
        if payload is None:  # pysyncobj's own entries (a new leader's no-op, membership changes)
            continue
        command = codec.decode_command(payload)
        result = machine.apply(command)
        if isinstance(command, CommitQuorum) and isinstance(result, CommitResult) and result.applied:
            applied.append((command.quorum.quorum_id, tuple(m.replica_id for m in command.quorum.participants), term))
    return entries, applied


# -- the test ------------------------------------------------------------------------------------


def test_partitioned_leader_issues_nothing(net: netns.NetnsNetwork, cluster: LocalCluster, tmp_path: Path) -> None:
    history_file = tmp_path / "history.jsonl"

    def explain(msg: str) -> str:
        return f"{msg}\n(history: {history_file})\n{cluster.tail_logs(25)}"

    # The leader every node follows, for a while: a start-up election can be followed by a second
    # one (a candidate that missed the first leader deposes it with a higher term; CI), and the
    # groups below are placed on the leader and the followers.
    leader, _ = cluster.wait_for_stable_leader(timeout=20)
    followers = [i for i in range(cluster.nodes) if i != leader]
    addr = cluster.client_addresses
    groups = [SimulatedReplicaGroup(rid, addr[leader], quorum_timeout_s=ISO_QUORUM_TIMEOUT_S, step_time_s=STEP_TIME_S)
              for rid in ISO_GROUPS]
    groups += [SimulatedReplicaGroup(rid, addr[f], quorum_timeout_s=MAJ_QUORUM_TIMEOUT_S, step_time_s=STEP_TIME_S)
               for rid, f in zip(MAJ_GROUPS, followers)]
    traffic = Traffic(groups).start()
    try:
        marks = _run_scenario(net, cluster, traffic, leader, followers, explain)
    finally:
        try:
            traffic.stop()
        finally:
            with history_file.open("w") as f:
                for r in traffic.snapshot():
                    f.write(json.dumps(asdict(r)) + "\n")
    _check_logs_and_history(cluster, traffic.snapshot(), leader, marks, explain)


def _run_scenario(net: netns.NetnsNetwork, cluster: LocalCluster, traffic: Traffic, leader: int,
                  followers: list[int], explain: Callable[[str], str]) -> dict[str, float]:
    """Warm up, isolate the leader, check (a) and the step-down, heal, check (c)'s liveness.
    Returns the monotonic times of the cut and the heal."""
    def ok_since(rid: str, t: float, members: int = 0, count: int = 1) -> bool:
        return sum(1 for r in traffic.snapshot() if r.replica_id == rid and r.quorum_id is not None
                   and r.started >= t and len(r.participants) >= members) >= count

    # Warm-up: steady state, every group in several quorums with all four.
    wait_for("all four groups in quorums together before the partition",
             lambda: all(ok_since(g, 0.0, members=len(ALL_GROUPS), count=WARM_UP_ROUNDS) for g in ALL_GROUPS), 20,
             context=lambda: cluster.tail_logs(25), interval=0.05)

    old = cluster.status(leader)
    assert old is not None and old.role == cpb.LEADER, explain(f"n{leader + 1} stopped leading before the cut")
    t_cut0 = time.monotonic()
    net.isolate(leader)
    t_cut1 = time.monotonic()

    # The isolated node stays reachable for clients and stops leading (leaderFallbackTimeout).
    def stepped_down() -> bool:
        st = cluster.status(leader, timeout=0.5)  # through the client port: must stay reachable
        return st is not None and st.role != cpb.LEADER
    wait_for(f"isolated n{leader + 1} answers Status and reports it no longer leads", stepped_down, 5,
             context=lambda: cluster.tail_logs(25), interval=0.05)

    # (a) The majority elects a new leader and serves the groups on its side.
    new_leader = cluster.wait_for_leader(timeout=10, among=followers, exclude_term=old.term)
    wait_for(f"majority (new leader n{new_leader + 1}) issues quorums to {MAJ_GROUPS}",
             lambda: all(ok_since(g, t_cut1 + CUT_GRACE_S) for g in MAJ_GROUPS),
             10, context=lambda: cluster.tail_logs(25), interval=0.05)

    # Hold the partition while the iso groups' calls time out and retry on the old leader.
    def iso_failed_and_retried() -> bool:
        rounds = [r for r in traffic.snapshot() if r.replica_id in ISO_GROUPS and r.started >= t_cut1 + CUT_GRACE_S]
        return (time.monotonic() - t_cut1 >= MIN_PARTITION_S
                and all(sum(1 for r in rounds if r.replica_id == g and r.error) >= 1 for g in ISO_GROUPS))
    wait_for("iso groups time out and retry against the isolated node", iso_failed_and_retried,
             MIN_PARTITION_S + 3 * ISO_QUORUM_TIMEOUT_S, context=lambda: cluster.tail_logs(25), interval=0.05)

    t_heal0 = time.monotonic()
    net.heal()
    t_heal1 = time.monotonic()

    # (c) The old leader follows a majority leader and catches up; every group gets quorums.
    def old_leader_follows() -> bool:
        sts = statuses(cluster)
        lead = next((s for s in sts if s is not None and s.role == cpb.LEADER and s.serving), None)
        mine = sts[leader]
        return (lead is not None and mine is not None and lead.node.id != mine.node.id
                and mine.role == cpb.FOLLOWER and mine.leader_id == lead.node.id and mine.term == lead.term
                and mine.last_applied >= lead.commit_index - 1)
    wait_for(f"old leader n{leader + 1} follows the new leader and catches up", old_leader_follows, 15,
             context=lambda: cluster.tail_logs(25), interval=0.05)
    wait_for("every group gets a quorum after the heal", lambda: all(ok_since(g, t_heal1) for g in ALL_GROUPS),
             15, context=lambda: cluster.tail_logs(25), interval=0.05)
    return {"t_cut0": t_cut0, "t_cut1": t_cut1, "t_heal0": t_heal0, "t_heal1": t_heal1, "old_term": old.term}


def _check_logs_and_history(cluster: LocalCluster, results: list[RoundResult], leader: int,
                            marks: dict[str, float], explain: Callable[[str], str]) -> None:
    t_cut0, t_cut1, t_heal0 = marks["t_cut0"], marks["t_cut1"], marks["t_heal0"]

    successes = [r for r in results if r.quorum_id is not None]

    # (b) The isolated leader handed out nothing while the partition lasted: no call that
    # reached it after the cut was answered before the heal. (Calls in flight at the cut may
    # get a quorum committed before the cut; checked against the Raft log below.)
    iso = [r for r in results if r.replica_id in ISO_GROUPS]
    during = [r for r in iso if t_cut0 < finished(r) < t_heal0]
    late = [r for r in during if r.quorum_id is not None and r.started >= t_cut1 + CUT_GRACE_S]
    assert not late, explain(f"the isolated former leader returned quorums during the partition: {late[:5]}")
    assert any(r.error for r in during), explain("no call to the isolated leader failed during the partition")

    # All nodes converge on one commit index, then stop; their committed logs must be equal.
    def converged() -> list[cpb.NodeStatus] | None:
        sts = statuses(cluster)
        if any(s is None for s in sts):
            return None
        ci = {(s.commit_index, s.last_applied, s.quorum.quorum_id) for s in sts}
        return sts if len(ci) == 1 and sts[0].commit_index == sts[0].last_applied else None
    sts = wait_for("all nodes converge on one commit index", converged, 10, context=lambda: cluster.tail_logs(25),
                   interval=0.05)
    commit_index = sts[0].commit_index
    cluster.stop_all()
    logs = {}
    for i, m in enumerate(cluster.members):
        logs[i] = committed_quorums(m.data_dir / "raft.journal", commit_index)
    for i in range(1, cluster.nodes):
        assert logs[i][0] == logs[0][0], explain(f"committed Raft logs of n1 and n{i + 1} differ up to {commit_index}")
    committed = logs[0][1]
    assert committed, explain("no quorum was ever committed")

    # No quorum id ever has two member sets: in the log, and in what the clients were told.
    members_of: dict[int, set[tuple[str, ...]]] = {}
    for qid, members, _term in committed:
        members_of.setdefault(qid, set()).add(tuple(sorted(members)))
    split = {q: m for q, m in members_of.items() if len(m) > 1}
    assert not split, explain(f"quorum ids committed with different members: {split}")
    told: dict[int, set[tuple[str, ...]]] = {}
    for r in successes:
        told.setdefault(r.quorum_id, set()).add(tuple(sorted(r.participants)))
    split = {q: m for q, m in told.items() if len(m) > 1}
    assert not split, explain(f"clients were given one quorum id with different members: {split}")

    # Every quorum (id and members) that any client got, around the cut included, was committed.
    committed_set = {(q, tuple(sorted(m))) for q, m, _term in committed}
    unknown = [r for r in successes if (r.quorum_id, tuple(sorted(r.participants))) not in committed_set]
    assert not unknown, explain(f"clients got quorums that were never committed: {unknown[:5]}")

    # (b) Whatever the isolated node returned during the partition was committed in its own
    # term or before (the old leader can learn nothing newer while cut off).
    before_cut = {(q, tuple(sorted(m))) for q, m, term in committed if term <= marks["old_term"]}
    stale = [r for r in during if r.quorum_id is not None
             and (r.quorum_id, tuple(sorted(r.participants))) not in before_cut]
    assert not stale, explain(f"the isolated node returned quorums not committed before the cut: {stale[:5]}")

    # Quorum ids never go back in real time: no call that started after another one returned
    # id X got an id below X (the isolated leader's quorum lease ran out before the new leader
    # served; without the lease, the same holds because every round is committed).
    by_finish = sorted(successes, key=finished)
    went_back, best, j = [], None, 0
    for r in sorted(successes, key=lambda r: r.started):
        while j < len(by_finish) and finished(by_finish[j]) < r.started:
            if best is None or by_finish[j].quorum_id > best.quorum_id:
                best = by_finish[j]
            j += 1
        if best is not None and r.quorum_id < best.quorum_id:
            went_back.append((best, r))
    assert not went_back, explain(f"quorum ids went back in real time (returned earlier, started later): {went_back[:3]}")

    # (a) The majority's quorums during the partition were issued without the iso groups.
    maj_during = [r for r in successes if r.replica_id in MAJ_GROUPS
                  and r.started >= t_cut1 + CUT_GRACE_S and finished(r) < t_heal0]
    assert maj_during, explain("the majority issued no quorum during the partition")
    with_iso = [r for r in maj_during if set(r.participants) & set(ISO_GROUPS)]
    assert not with_iso, explain(f"quorums issued during the partition include unreachable groups: {with_iso[:3]}")
    assert all(r.endpoint != cluster.client_addresses[leader] for r in maj_during), explain("a majority group was served by the isolated node")
