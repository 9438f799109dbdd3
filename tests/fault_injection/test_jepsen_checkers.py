"""The fault-injection harness's pure parts: every checker passes a good history and fails a
hand-made history that violates it (naming the offending operations); schedules, partition
shapes, journal parsing, figures and the timeline."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path
from typing import Any

import pytest

from jepsen_like import checkers, schedule, stats, timeline
from jepsen_like.history import HistoryWriter, make_event, pair_operations, read_history
from jepsen_like.journal import CommittedLog, parse_journal_bytes, summarize
from jepsen_like.schedule import FaultOp, Schedule

S = 1_000_000_000  # one second in ns


class H:
    """Builds a history by hand: ``h.op("c0", 1.0, 1.2, "ok", quorum_id=3, participants=[...])``."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def add(self, t: float, process: str, type: str, f: str, value: Any = None, node: str | None = "n1",
            error: str | None = None, job: str | None = None) -> "H":
        self.events.append(make_event(len(self.events), int(t * S), process, type, f, value, node, error, job))
        return self

    def quorum(self, process: str, t0: float, t1: float, type: str = "ok", qid: int | None = None,
               members: tuple[str, ...] = ("c0", "c1"), node: str = "n1", job: str | None = None) -> "H":
        """A client's quorum call; ``job`` None: an event without a job (a history from before
        jobs, read as the default job's)."""
        self.add(t0, process, "invoke", "quorum", {"step": 0}, node, job=job)
        value = {"quorum_id": qid, "participants": list(members), "step": 0} if type == "ok" else {"step": 0}
        return self.add(t1, process, type, "quorum", value, node, None if type == "ok" else "DEADLINE_EXCEEDED",
                        job=job)

    def nemesis(self, t0: float, t1: float, f: str, value: Any = None, type: str = "ok") -> "H":
        self.add(t0, "nemesis", "invoke", f, value or {}, None)
        return self.add(t1, "nemesis", type, f, value or {}, None)

    def final(self, node: str, quorums: list[tuple[Any, ...]], leaders: dict[int, list[str]] | None = None,
              digests: dict[str, str] | None = None, unknown: list[list[Any]] | None = None,
              **extra: Any) -> "H":
        """``quorums``: (id, members) (a summary from before jobs) or (id, members, job)."""
        value = {"commit_index": 100, "quorums": [[q[0], list(q[1]), i + 1, 1, *q[2:]] for i, q in enumerate(quorums)],
                 "leaders": {str(t): n for t, n in (leaders or {1: ["n1"]}).items()},
                 "digests": digests or {}, "conflicts": [], "unverifiable_quorum_ids": unknown or [], **extra}
        return self.add(1000.0, "journal", "info", "final-state", value, node)

    def status(self, t: float, node: str, role: str, term: int) -> "H":
        return self.add(t, "monitor", "info", "status", {"reachable": True, "role": role, "term": term}, node)


def good() -> H:
    """A healthy run: a fault, a heal, quorums before and after, the same final state everywhere."""
    h = H()
    h.status(0.1, "n1", "leader", 1).status(0.1, "n2", "follower", 1)
    h.quorum("c0", 0.5, 0.6, qid=1).quorum("c1", 0.5, 0.6, qid=1)
    h.nemesis(1.0, 1.01, "isolate-leader", {"node": 0})
    h.status(1.5, "n2", "leader", 2)
    h.quorum("c0", 1.0, 3.0, "info")
    h.quorum("c1", 1.0, 1.8, qid=2, members=("c1",))
    h.nemesis(3.0, 3.01, "recover", {"healthy": True})
    h.quorum("c0", 3.1, 3.5, qid=3).quorum("c1", 3.1, 3.5, qid=3)
    h.quorum("c0", 20.0, 20.1, qid=3).quorum("c1", 20.0, 20.1, qid=3)
    for n in ("n1", "n2", "n3"):
        h.final(n, [(1, ("c0", "c1")), (2, ("c1",)), (3, ("c0", "c1"))], {1: ["n1"], 2: ["n2"]}, {"100": "abc"})
    return h


def by_name(results: list[checkers.CheckResult]) -> dict[str, checkers.CheckResult]:
    return {r.name: r for r in results}


def test_every_checker_passes_a_good_history() -> None:
    results = checkers.check_all(good().events)
    assert [r.name for r in results] == ["no-split-brain", "monotonic-quorum-ids", "acknowledged-committed",
                                         "jobs-isolated", "one-leader-per-term", "recovery-after-heal", "survivor-wait",
                                         "durable-after-restart-all", "logs-agree"]
    assert all(r.valid for r in results), [(r.name, r.summary, r.offending) for r in results if not r.valid]
    assert all(r.status == "PASS" for r in results)


def test_split_brain_in_client_answers_fails() -> None:
    h = good().quorum("c0", 30.0, 30.1, qid=2, members=("c0", "c1"))   # id 2 was {c1}
    r = checkers.no_split_brain(h.events)
    assert not r.valid and r.status == "FAIL" and r.count == 1
    assert r.offending[0]["quorum_id"] == 2
    assert sorted(map(tuple, r.offending[0]["member_sets"])) == [("c0", "c1"), ("c1",)]


def test_split_brain_between_committed_logs_fails() -> None:
    h = H().quorum("c0", 0.1, 0.2, qid=1)
    h.final("n1", [(1, ("c0", "c1")), (2, ("c0",))]).final("n2", [(1, ("c0", "c1")), (2, ("c1",))])
    r = checkers.no_split_brain(h.events)
    assert not r.valid and [o["quorum_id"] for o in r.offending] == [2]


def test_quorum_id_going_back_for_one_client_fails() -> None:
    h = H().quorum("c0", 0.0, 0.1, qid=5).quorum("c0", 0.2, 0.3, qid=4)
    r = checkers.monotonic_quorum_ids(h.events)
    assert not r.valid
    assert any(o["kind"] == "client" and o["later"]["value"]["quorum_id"] == 4 for o in r.offending)


def test_quorum_id_going_back_in_real_time_fails() -> None:
    # c1 invoked after c0's call returned id 7, yet got 6: stale.
    h = H().quorum("c0", 0.0, 1.0, qid=7).quorum("c1", 1.5, 2.0, qid=6)
    r = checkers.monotonic_quorum_ids(h.events)
    assert not r.valid and r.offending[0]["kind"] == "real-time"
    assert r.offending[0]["returned"]["value"]["quorum_id"] == 6
    # Concurrent calls may complete in either order.
    ok = H().quorum("c0", 0.0, 1.0, qid=7).quorum("c1", 0.5, 2.0, qid=6)
    assert checkers.monotonic_quorum_ids(ok.events).valid


def test_acknowledged_quorum_missing_from_a_node_fails() -> None:
    h = H().quorum("c0", 0.0, 0.1, qid=1).quorum("c0", 0.2, 0.3, qid=2, members=("c0",))
    h.final("n1", [(1, ("c0", "c1")), (2, ("c0",))]).final("n2", [(1, ("c0", "c1"))])
    r = checkers.acknowledged_committed(h.events)
    assert not r.valid and r.count == 1
    assert r.offending[0]["node"] == "n2" and r.offending[0]["quorum_id"] == 2
    assert r.offending[0]["acknowledged"]["index"] == 3
    # Same members, other id: still missing.
    h2 = H().quorum("c0", 0.0, 0.1, qid=3).final("n1", [(3, ("c0",))])
    assert not checkers.acknowledged_committed(h2.events).valid


def test_acknowledged_committed_needs_final_states_and_skips_what_a_snapshot_hides() -> None:
    h = H().quorum("c0", 0.0, 0.1, qid=3)
    r = checkers.acknowledged_committed(h.events)
    assert not r.valid and "cannot check" in r.summary
    h.final("n1", [(2, ("c0", "c1")), (5, ("c0", "c1"))], unknown=[[2, 5]])   # ids 3, 4 only in a snapshot
    r = checkers.acknowledged_committed(h.events)
    assert r.valid and "not verifiable" in r.summary
    h2 = H().quorum("c0", 0.0, 0.1, qid=5, members=("c0",)).final("n1", [(2, ("c0", "c1"))], unknown=[[2, 5]])
    assert not checkers.acknowledged_committed(h2.events).valid               # 5 is not strictly inside


def test_two_leaders_in_one_term_fail() -> None:
    observed = good().status(5.0, "n3", "leader", 2)          # n2 led term 2 already
    r = checkers.one_leader_per_term(observed.events)
    assert not r.valid and r.offending[0]["term"] == 2 and r.offending[0]["leaders"] == ["n2", "n3"]
    committed = H().final("n1", [], {4: ["n1", "n2"]})
    r = checkers.one_leader_per_term(committed.events)
    assert not r.valid and r.offending[0]["term"] == 4


def test_no_quorum_within_bound_after_heal_fails() -> None:
    h = H().quorum("c0", 0.0, 0.1, qid=1).quorum("c1", 0.0, 0.1, qid=1)
    h.nemesis(1.0, 1.1, "kill", {"node": 0}).nemesis(2.0, 2.1, "recover", {"healthy": True})
    h.quorum("c0", 2.2, 3.0, qid=1)
    t = 2.2
    while t < 20.0:                       # c1 keeps timing out for 18 s after the heal
        h.quorum("c1", t, t + 2.0, "info")
        t += 2.05
    r = checkers.recovery_after_heal(h.events, bound_s=10.0)
    assert not r.valid and [o["process"] for o in r.offending] == ["c1"]
    # With a bound longer than the rest of the run, it is inconclusive, not a failure.
    assert checkers.recovery_after_heal(h.events, bound_s=30.0).valid


def test_heal_cut_short_by_next_fault_is_not_judged() -> None:
    h = H().nemesis(1.0, 1.1, "recover").quorum("c0", 1.2, 3.2, "info").nemesis(3.3, 3.4, "kill", {"node": 1})
    h.quorum("c0", 3.5, 30.0, "info").nemesis(30.0, 30.1, "recover").quorum("c0", 30.2, 30.3, qid=1)
    r = checkers.recovery_after_heal(h.events, bound_s=5.0)
    assert r.valid, r.offending


def test_lower_quorum_id_after_full_restart_fails() -> None:
    h = H().quorum("c0", 0.0, 0.1, qid=9)
    h.nemesis(1.0, 1.5, "restart-all").quorum("c0", 2.0, 2.5, qid=1, members=("c0",))
    r = checkers.durable_after_restart_all(h.events)
    assert not r.valid and r.offending[0]["after"]["value"]["quorum_id"] == 1
    assert r.offending[0]["highest_before"]["value"]["quorum_id"] == 9
    ok = H().quorum("c0", 0.0, 0.1, qid=9).nemesis(1.0, 1.5, "restart-all").quorum("c0", 2.0, 2.5, qid=9)
    assert checkers.durable_after_restart_all(ok.events).valid


def test_diverging_logs_fail() -> None:
    h = H().final("n1", [], digests={"100": "aa", "200": "bb"}).final("n2", [], digests={"100": "aa", "200": "cc"})
    r = checkers.logs_agree(h.events)
    assert not r.valid and r.offending[0]["index"] == 200


def test_check_cheap_is_a_subset() -> None:
    assert [r.name for r in checkers.check_cheap(good().events)] == ["no-split-brain", "monotonic-quorum-ids",
                                                                     "jobs-isolated"]


# -- history ------------------------------------------------------------------------------------


def test_history_writer_round_trip_and_pairing(tmp_path: Path) -> None:
    w = HistoryWriter(tmp_path / "h.jsonl")
    w.append("c0", "invoke", "quorum", {"step": 0}, "n1")
    w.append("c0", "invoke", "heartbeat", None, "n1")
    w.append("c0", "ok", "heartbeat", None, "n1")
    w.append("c0", "ok", "quorum", {"quorum_id": 1, "participants": ["c0"]}, "n1")
    w.append("c1", "invoke", "quorum", {"step": 0}, "n2")
    w.close()
    with open(tmp_path / "h.jsonl", "a") as f:
        f.write('{"index": 5, "time')               # a torn last line is ignored
    events = read_history(tmp_path / "h.jsonl")
    assert [e["index"] for e in events] == [0, 1, 2, 3, 4]
    assert set(events[0]) == {"index", "time_ns", "process", "type", "f", "value", "node", "error", "job"}
    ops = pair_operations(events)
    assert [(o.process, o.f, o.type) for o in ops] == [("c0", "quorum", "ok"), ("c0", "heartbeat", "ok"),
                                                        ("c1", "quorum", "info")]
    assert ops[2].complete is None


# -- schedules ----------------------------------------------------------------------------------


@pytest.mark.parametrize("nodes", [3, 5])
def test_majorities_ring_gives_each_node_a_distinct_majority(nodes: int) -> None:
    for seed in range(20):
        cuts = {tuple(c) for c in schedule.majorities_ring(random.Random(seed), nodes)}
        hears = [frozenset(s for s in range(nodes) if (s, d) not in cuts) for d in range(nodes)]
        assert all(d in h and len(h) == nodes // 2 + 1 for d, h in enumerate(hears)), hears
        assert len(set(hears)) == nodes


@pytest.mark.parametrize("nodes", [3, 5])
def test_halves_and_bridge_shapes(nodes: int) -> None:
    rng = random.Random(1)
    small, big = schedule.random_halves(rng, nodes)
    assert len(small) == nodes // 2 and sorted(small + big) == list(range(nodes))
    sides, middle = schedule.bridge(rng, nodes)
    assert middle not in sides[0] + sides[1] and sorted(sides[0] + sides[1] + [middle]) == list(range(nodes))
    blocked = schedule.blocked_pairs(FaultOp(0, "bridge", {"sides": sides, "bridge": middle}), nodes)
    assert all(middle not in pair for pair in blocked) and blocked


def test_generate_is_deterministic_and_round_trips() -> None:
    a = schedule.generate(42, nodes=5, time_limit_s=60, nemeses=["halves", "kill-leader", "ring"])
    b = schedule.generate(42, nodes=5, time_limit_s=60, nemeses=["halves", "kill-leader", "ring"])
    assert a.to_json() == b.to_json()
    assert a.ops and all(op.at < 60 for op in a.ops)
    assert [op.f == "recover" for op in a.ops] == [i % 2 == 1 for i in range(len(a.ops))]
    assert Schedule.loads(a.dumps()).to_json() == a.to_json()
    with pytest.raises(ValueError):
        schedule.generate(1, nemeses=["meteor"])


# -- journal ------------------------------------------------------------------------------------


def _journal_bytes(entries: list[tuple[int, int, bytes]]) -> bytes:
    header = b"PYSYNCOBJ".ljust(24, b"\0") + b"0.3.17".ljust(8, b"\0") + struct.pack("<I", 1)
    body = b""
    for idx, term, cmd in entries:
        rec = struct.pack("<QQ", idx, term) + cmd
        body += struct.pack("<I", len(rec)) + rec + struct.pack("<I", len(rec))
    return header + struct.pack("<I", 40 + len(body)) + body + b"\0" * 64


def _command(cmd: Any) -> bytes:
    from lighthouse_cluster.core import codec
    from lighthouse_cluster.raft.journal import journal_entry
    return journal_entry(codec.encode_command(cmd))


def test_journal_parse_and_replay() -> None:
    from lighthouse_cluster.core.codec import CommitQuorum, TermStart
    from lighthouse_cluster.core.quorum import Member, Quorum

    q1 = Quorum(1, (Member("a"), Member("b")), 0)
    q2 = Quorum(2, (Member("a"),), 0)
    entries = [(1, 1, _command(TermStart(1, "n1", 0))), (2, 1, _command(CommitQuorum(0, q1, 1, "n1"))),
               (3, 2, _command(TermStart(2, "n2", 0))), (4, 2, _command(CommitQuorum(0, q2, 2, "n2"))),  # rejected
               (5, 2, _command(CommitQuorum(1, q2, 2, "n2")))]
    data = _journal_bytes(entries)
    assert parse_journal_bytes(data) == entries
    torn = bytearray(data)
    torn[-64 - 2] ^= 0xFF                     # the last record's trailing length no longer matches
    assert parse_journal_bytes(bytes(torn)) == entries[:-1]
    log = CommittedLog("n1")
    log.absorb(entries, commit_index=4)
    s = summarize(log)
    assert s["complete"] and s["replayed_to"] == 4 and s["quorum_id"] == 1 and s["rejected_commits"] == 1
    assert s["quorums"] == [[1, ["a", "b"], 2, 1, "default"]]
    assert s["jobs"] == {"default": {"quorum_id": 1, "version": 0}} and s["retired"] == {}
    assert s["leaders"] == {"1": ["n1"], "2": ["n2"]}
    log.absorb(entries, commit_index=5)
    s = summarize(log)
    assert [q[0] for q in s["quorums"]] == [1, 2] and s["term_starts"] == [[1, "n1", 1], [2, "n2", 3]]
    changed = [(5, 3, entries[4][2])]
    log.absorb(changed, commit_index=5)
    assert log.conflicts == [5]


# -- figures and timeline -------------------------------------------------------------------------


def test_unavailability_per_fault() -> None:
    h = H().quorum("c0", 0.0, 0.5, qid=1)
    h.nemesis(1.0, 1.0, "kill-leader", {"node": 0}).quorum("c0", 0.9, 3.0, qid=2).quorum("c0", 3.0, 3.2, qid=2)
    h.nemesis(4.0, 4.1, "recover").quorum("c0", 4.2, 4.6, qid=2).quorum("c0", 4.6, 6.0, qid=2)
    windows = stats.fault_windows(h.events)
    assert len(windows) == 1 and windows[0]["f"] == "kill-leader"
    assert windows[0]["unavailable_s"] == pytest.approx(2.0) and windows[0]["recovery_s"] == pytest.approx(0.5)
    by_kind = stats.unavailability_by_kind(windows)
    assert by_kind["kill-leader"]["count"] == 1 and by_kind["kill-leader"]["unavailable_max_s"] == pytest.approx(2.0)
    counts = stats.operation_counts(h.events)
    assert counts["client"]["quorum"]["ok"] == 5 and counts["nemesis"] == {"kill-leader": 1, "recover": 1}


def test_timeline_is_self_contained() -> None:
    h = good()
    page = timeline.render(h.events, [c.to_json() for c in checkers.check_all(h.events)], title="t</script>")
    assert page.startswith("<!doctype html>") and "<script>" in page
    assert "http://" not in page and "https://" not in page and "src=" not in page
    assert "isolate-leader" in page and "t&lt;/script&gt;" in page
    data = page[page.index("const D=") + 8: page.index(";\nconst C=")]
    parsed = json.loads(data.replace("<\\/", "</"))
    assert set(parsed["lanes"]) == {"c0", "c1"} and parsed["bands"][0][2] == "isolate-leader"


def test_journal_gap_left_by_compaction_is_bridged_by_a_snapshot() -> None:
    from lighthouse_cluster.core.codec import CommitQuorum, TermStart, decode_command
    from lighthouse_cluster.core.quorum import Member, Quorum
    from lighthouse_cluster.core.state_machine import QuorumStateMachine
    from lighthouse_cluster.raft.journal import command_payload

    cmds = [TermStart(1, "n1", 0)] + [CommitQuorum(i, Quorum(i + 1, (Member("a"),), 0), 1, "n1") for i in range(6)]
    entries = [(i + 1, 1, _command(c)) for i, c in enumerate(cmds)]      # quorum ids 1..6 at indexes 2..7
    machine = QuorumStateMachine()
    for _idx, _term, cmd in entries[:5]:
        machine.apply(decode_command(command_payload(cmd)))
    snapshot_at_5 = machine.to_snapshot()
    log = CommittedLog("n1")
    log.absorb(entries[:2], commit_index=2)          # read before compaction: 1..2
    log.absorb(entries[3:], commit_index=7)          # compacted at 5: pysyncobj keeps 4 (= 5 - 1) on
    gap = summarize(log)
    assert not gap["complete"] and gap["missing"] == [3, 3] and gap["replayed_to"] == 2
    bridged = summarize(log, {5: snapshot_at_5})
    assert bridged["replayed_to"] == 7 and bridged["gaps_bridged_by_snapshot"] == [[3, 5]]
    assert [q[0] for q in bridged["quorums"]] == [1, 2, 3, 4, 5, 6] and bridged["quorum_id"] == 6


def _final_state(term_starts: list[list[Any]]) -> H:
    h = H()
    leaders: dict[str, list[str]] = {}
    for term, node, _idx in term_starts:
        leaders.setdefault(str(term), []).append(node)
    h.add(1000.0, "journal", "info", "final-state", {"quorums": [], "term_starts": term_starts,
                                                       "leaders": leaders, "digests": {}, "conflicts": []}, "n1")
    return h


def test_a_stale_leaders_term_start_is_no_longer_tolerated() -> None:
    """BUG-2 is fixed: a deposed leader's TermStart committed in its successor's term (what the
    removed signature used to excuse) is an unexplained violation again."""
    from jepsen_like import known_bugs

    stale = _final_state([[57, "n1", 10], [58, "n2", 20], [58, "n1", 21]])
    r = checkers.one_leader_per_term(stale.events)
    assert not r.valid and known_bugs.explain(r, stale.events) is None
    assert known_bugs.unexplained([r], stale.events) == [r]


def test_known_bug_mechanism_tolerates_only_offences_its_signature_matches(monkeypatch: Any) -> None:
    """The mechanism: a failed check is explained only when its signature matches every offence."""
    from jepsen_like import known_bugs

    monkeypatch.setitem(known_bugs.SIGNATURES, "one-leader-per-term",
                        ("BUG-X", lambda offence, _history: offence.get("term") == 58))
    one = _final_state([[57, "n1", 10], [58, "n2", 20], [58, "n1", 21]])
    r = checkers.one_leader_per_term(one.events)
    assert not r.valid and known_bugs.explain(r, one.events) == "BUG-X"
    assert known_bugs.unexplained([r], one.events) == []
    # A second offence the signature does not match: the whole check stays unexplained.
    two = _final_state([[57, "n1", 10], [58, "n2", 20], [58, "n1", 21], [60, "n2", 30], [60, "n3", 31]])
    r = checkers.one_leader_per_term(two.events)
    assert not r.valid and r.count == 2 and known_bugs.explain(r, two.events) is None
    assert known_bugs.unexplained([r], two.events) == [r]


def test_snapshot_bridge_marks_quorums_older_than_its_history_as_unverifiable() -> None:
    from lighthouse_cluster.core.codec import CommitQuorum, TermStart, decode_command
    from lighthouse_cluster.core.quorum import Member, Quorum
    from lighthouse_cluster.core.state_machine import HISTORY_LENGTH, QuorumStateMachine
    from lighthouse_cluster.raft.journal import command_payload

    n = HISTORY_LENGTH + 40            # more commits in the gap than the snapshot's history keeps
    cmds = [TermStart(1, "n1", 0)] + [CommitQuorum(i, Quorum(i + 1, (Member("a"),), 0), 1, "n1") for i in range(n)]
    entries = [(i + 1, 1, _command(c)) for i, c in enumerate(cmds)]
    machine = QuorumStateMachine()
    for _idx, _term, cmd in entries[:n]:
        machine.apply(decode_command(command_payload(cmd)))
    log = CommittedLog("n1")
    log.absorb(entries[:2], commit_index=2)                     # quorum 1 seen; then compaction at n
    log.absorb(entries[n - 2:], commit_index=len(entries))
    s = summarize(log, {n: machine.to_snapshot()})
    oldest = n - 1 - HISTORY_LENGTH + 1                         # first quorum id still in the snapshot's history
    assert s["unverifiable_quorum_ids"] == [[1, oldest, "default"]]
    ids = {q[0] for q in s["quorums"]}
    assert 1 in ids and oldest in ids and (oldest - 1) not in ids and n + 0 in ids


def test_a_node_cut_off_after_the_heal_is_no_longer_tolerated() -> None:
    """BUG-1 is fixed: a client starving on a node that stays cut off from Raft after the heal
    (what the removed signature used to excuse) fails ``recovery-after-heal`` unexplained."""
    from jepsen_like import known_bugs

    h = H().quorum("c0", 0.0, 0.1, qid=1, node="n1")
    h.nemesis(1.0, 1.0, "isolate", {"node": 0, "cuts": [["n1", "n2"], ["n2", "n1"], ["n1", "n3"], ["n3", "n1"]]})
    h.status(1.5, "n1", "follower", 1).status(1.6, "n2", "leader", 2)
    h.events[-1]["value"]["serving"] = True
    h.events[-2]["value"]["leader"] = ""
    h.nemesis(5.0, 5.0, "recover", {"cuts": []})
    t = 5.1
    while t < 20.0:
        h.quorum("c0", t, t + 2.0, "info", node="n1")
        t += 2.05
    r = checkers.recovery_after_heal(h.events, bound_s=10.0)
    assert not r.valid and known_bugs.explain(r, h.events) is None
    assert known_bugs.unexplained([r], h.events) == [r]


def _deposed_leaders_status_claim(observed: str = "n1") -> H:
    """BUG-3's shape: n1 led term 2, n2 won term 3 (the committed log has only n2's commands in
    term 3), and the monitor saw ``observed`` report itself leader of term 3."""
    h = _final_state([[1, "n2", 3], [2, "n1", 7], [3, "n2", 47]])
    return h.status(6.04, observed, "leader", 3)


def test_a_deposed_leaders_status_claim_is_no_longer_tolerated() -> None:
    """BUG-3 is fixed: a ``Status`` report of a leader being deposed as leader of the new term
    (what the removed signature used to excuse) fails ``one-leader-per-term`` unexplained."""
    from jepsen_like import known_bugs

    torn = _deposed_leaders_status_claim()
    r = checkers.one_leader_per_term(torn.events)
    assert not r.valid and r.offending[0]["term"] == 3 and r.offending[0]["leaders"] == ["n1", "n2"]
    assert known_bugs.explain(r, torn.events) is None
    assert known_bugs.unexplained([r], torn.events) == [r]


def test_a_registered_signature_explains_only_the_offences_it_matches(monkeypatch: Any) -> None:
    """The mechanism with a signature registered the way an open bug's would be: it names its bug
    for the offences it matches, under its own checker only, and None for anything else."""
    from jepsen_like import known_bugs

    def deposed_claim(offence: dict[str, Any], _history: Any) -> bool:
        return offence.get("term") == 3 and offence.get("leaders") == ["n1", "n2"]

    monkeypatch.setitem(known_bugs.SIGNATURES, "one-leader-per-term", ("BUG-T", deposed_claim))
    torn = _deposed_leaders_status_claim()
    r = checkers.one_leader_per_term(torn.events)
    assert not r.valid and known_bugs.explain(r, torn.events) == "BUG-T"
    assert known_bugs.unexplained([r], torn.events) == []
    # An offence the signature does not match (another node claims term 3): unexplained, fails.
    stranger = _deposed_leaders_status_claim(observed="n3")
    r = checkers.one_leader_per_term(stranger.events)
    assert not r.valid and known_bugs.explain(r, stranger.events) is None
    assert known_bugs.unexplained([r], stranger.events) == [r]
    # A signature applies to its own checker only: another checker's failure stays unexplained,
    # even with an offence the signature would match.
    other = checkers.CheckResult("logs-agree", False, "1 places where committed logs differ",
                                 [{"term": 3, "leaders": ["n1", "n2"]}], 1)
    assert known_bugs.explain(other, torn.events) is None
    assert known_bugs.unexplained([other], torn.events) == [other]
    # A passing check is never "explained".
    ok = checkers.one_leader_per_term(_final_state([[1, "n2", 3], [2, "n1", 7]]).events)
    assert ok.valid and known_bugs.explain(ok, torn.events) is None and known_bugs.unexplained([ok], torn.events) == []


# -- survivor-wait (client kills) -------------------------------------------------------------------

ALL3 = ("c0", "c1", "c2")


def killed_c1(wait_c0: float = 0.7, wait_c2: float = 0.75, restart_at: float = 6.0) -> H:
    """Three clients; c1 is SIGKILLed at 2.0 s (its open call completed as info by the harness),
    the survivors' call in flight at the kill is answered with a quorum still naming c1 (formed
    just before), then they ask again and get one without c1 ``wait_*`` after the kill; c1 comes
    back with the ``recover`` at ``restart_at``."""
    h = H()
    for c in ALL3:
        h.quorum(c, 1.0, 1.1, qid=1, members=ALL3)
    h.add(1.9, "c1", "invoke", "quorum", {"step": 1})
    h.nemesis(2.0, 2.01, "kill-client", {"client": "c1", "clients_down": ["c1"]})
    h.add(2.01, "c1", "info", "quorum", {"step": 1}, error="killed (SIGKILL) by the nemesis")
    for c, wait in (("c0", wait_c0), ("c2", wait_c2)):
        h.quorum(c, 1.9, 2.05, qid=1, members=ALL3)                         # formed before the kill
        h.quorum(c, 2.1, 2.0 + wait, qid=2, members=("c0", "c2"))
        h.quorum(c, 2.0 + wait + 0.05, 2.0 + wait + 0.1, qid=2, members=("c0", "c2"))
    h.nemesis(restart_at, restart_at + 0.01, "recover", {"clients_restarted": ["c1"], "clients_down": []})
    for c in ALL3:
        h.quorum(c, restart_at + 0.5, restart_at + 0.6, qid=3, members=ALL3)
    return h


def test_survivor_wait_measures_each_survivor_until_a_quorum_without_the_killed_client() -> None:
    r = checkers.survivor_wait(killed_c1().events, bound_s=3.5)
    assert r.valid and r.status == "PASS", r.offending
    f = r.figures
    assert f["kills"] == 1 and f["survivor_waits"] == 2 and f["inconclusive"] == 0
    kill = f["per_kill"][0]
    assert kill["client"] == "c1" and kill["at_s"] == pytest.approx(2.0) and kill["survivors"] == ["c0", "c2"]
    # The quorum answered at 2.05 s still names c1: it does not end the wait.
    assert kill["waits_s"] == {"c0": pytest.approx(0.7), "c2": pytest.approx(0.75)} and kill["rejoined"] == []
    assert kill["all_survivors_s"] == pytest.approx(0.75)
    assert f["median_s"] == pytest.approx(0.75) and f["max_s"] == pytest.approx(0.75)
    assert "median 0.75s, max 0.75s" in r.summary
    assert r.to_json()["figures"] == f
    assert "survivor-wait" in {c.name for c in checkers.check_all(killed_c1().events)}


def test_survivor_wait_over_the_bound_fails_and_the_bound_is_a_parameter() -> None:
    slow = killed_c1(wait_c0=0.4, wait_c2=5.0, restart_at=9.0).events     # c2 waits 5 s (a heartbeat timeout)
    r = checkers.survivor_wait(slow, bound_s=3.5)
    assert not r.valid and r.count == 1
    o = r.offending[0]
    assert (o["client"], o["survivor"], o["wait_s"]) == ("c1", "c2", pytest.approx(5.0))
    assert o["quorum"]["value"]["participants"] == ["c0", "c2"]
    assert r.figures["max_s"] == pytest.approx(5.0)
    assert checkers.survivor_wait(slow, bound_s=6.0).valid                  # a looser bound passes it
    assert not checkers.survivor_wait(killed_c1().events, bound_s=0.5).valid   # a tight one (liveness) fails 0.7 s


def test_survivor_with_no_quorum_without_the_killed_client_fails() -> None:
    h = H()
    h.quorum("c0", 1.0, 1.1, qid=1, members=("c0", "c1"))
    h.nemesis(2.0, 2.01, "kill-client", {"client": "c1", "clients_down": ["c1"]})
    t = 2.05
    while t < 9.0:                          # c0 keeps timing out: no quorum without c1 for 7 s
        h.quorum("c0", t, t + 2.0, "info")
        t += 2.05
    r = checkers.survivor_wait(h.events, bound_s=3.5)
    assert not r.valid and r.offending[0]["survivor"] == "c0" and "no quorum without c1" in r.offending[0]["problem"]
    assert r.figures["per_kill"][0]["all_survivors_s"] is None and r.figures["max_s"] is None


def test_survivor_wait_cut_short_by_the_next_fault_is_inconclusive() -> None:
    h = H()
    h.quorum("c0", 1.0, 1.1, qid=1, members=("c0", "c1"))
    h.nemesis(2.0, 2.01, "kill-client", {"client": "c1", "clients_down": ["c1"]})
    h.quorum("c0", 2.05, 4.05, "info")
    h.nemesis(3.0, 3.1, "kill-leader", {"node": 0})                       # 1 s after the kill: window ends
    h.quorum("c0", 4.1, 9.0, qid=2, members=("c0",))
    r = checkers.survivor_wait(h.events, bound_s=3.5)
    assert r.valid and r.figures["inconclusive"] == 1 and r.figures["per_kill"][0]["inconclusive"] == ["c0"]
    assert "cut short" in r.summary


def test_survivor_wait_ends_with_the_killed_client_back_and_ignores_clients_already_down() -> None:
    h = H()
    for c in ALL3:
        h.quorum(c, 0.5, 0.6, qid=1, members=ALL3)
    h.nemesis(1.0, 1.01, "kill-client", {"client": "c2", "clients_down": ["c2"]})
    h.quorum("c0", 1.05, 1.5, qid=2, members=("c0", "c1")).quorum("c1", 1.05, 1.5, qid=2, members=("c0", "c1"))
    h.nemesis(2.0, 2.01, "kill-client", {"client": "c1", "clients_down": ["c1", "c2"]})
    h.quorum("c0", 2.05, 2.3, qid=2, members=("c0", "c1"))                 # c1 is dead: not the end
    h.nemesis(2.5, 2.6, "restart-client", {"client": "c1", "clients_restarted": ["c1"], "clients_down": ["c2"]})
    h.quorum("c1", 2.9, 3.2, qid=3, members=("c0", "c1"))                  # the new c1 asks from 2.9 s
    h.quorum("c0", 2.35, 3.2, qid=3, members=("c0", "c1"))
    r = checkers.survivor_wait(h.events, bound_s=3.5)
    assert r.valid, r.offending
    first, second = r.figures["per_kill"]
    assert first["survivors"] == ["c0", "c1"] and first["waits_s"] == {"c0": pytest.approx(0.5),
                                                                      "c1": pytest.approx(0.5)}
    # c2, dead since 1.0 s, is no survivor of the second kill; c0's wait ends with the restarted c1.
    assert second["survivors"] == ["c0"] and second["waits_s"] == {"c0": pytest.approx(1.2)}
    assert second["rejoined"] == ["c0"]


def test_survivor_wait_without_client_kills_passes() -> None:
    r = checkers.survivor_wait(good().events)
    assert r.valid and r.summary == "no client kills in the history" and r.figures["kills"] == 0
    # A kill that failed (the nemesis could not do it) is no kill.
    h = H().quorum("c0", 0.0, 0.1, qid=1).nemesis(1.0, 1.1, "kill-client", {"client": "c9"}, type="info")
    assert checkers.survivor_wait(h.events).figures["kills"] == 0


def test_survivor_wait_default_bound() -> None:
    assert checkers.survivor_wait_bound(500, 1000) == checkers.DEFAULT_SURVIVOR_WAIT_BOUND_S == 3.5
    assert checkers.survivor_wait_bound(5000, 10000) == 17.0
    from jepsen_like.cluster import ClusterSettings
    from jepsen_like.runner import RunOptions
    assert RunOptions().survivor_bound_s == 3.5
    assert RunOptions(cluster=ClusterSettings(heartbeat_timeout_ms=5000)).survivor_bound_s == 8.0
    tight = RunOptions(survivor_wait_bound_s=1.0)
    assert tight.survivor_bound_s == 1.0 and RunOptions.from_json(tight.to_json()).survivor_bound_s == 1.0


def test_client_kill_in_schedules_and_the_cli() -> None:
    from jepsen_like.cli import _parse_nemeses

    s = schedule.generate(3, time_limit_s=60, nemeses=["kill-client"], clients=3)
    kills = [op for op in s.ops if op.f == "kill-client"]
    assert kills and all(op.args["client"] in ("c0", "c1", "c2") for op in kills)
    assert schedule.uses_client_faults(s) and not schedule.uses_client_faults(schedule.generate(3, time_limit_s=60))
    assert "kill-client" not in schedule.DEFAULT_FAULTS and "restart-client" in schedule.RESTORING
    # Opt-in: the default set draws the same schedules as before.
    assert schedule.generate(7, time_limit_s=60).to_json() == \
        schedule.generate(7, time_limit_s=60, nemeses=schedule.DEFAULT_FAULTS).to_json()
    assert _parse_nemeses(("all,kill-client",)) == [*schedule.DEFAULT_FAULTS, "kill-client"]
    assert _parse_nemeses(("kill-client", "kill")) == ["kill-client", "kill"]
    assert _parse_nemeses(()) == list(schedule.DEFAULT_FAULTS)


def test_client_kill_is_a_fault_in_the_figures_and_the_timeline() -> None:
    h = killed_c1()
    windows = stats.fault_windows(h.events)
    assert [w["f"] for w in windows] == ["kill-client"] and windows[0]["recovery_s"] == pytest.approx(0.59)
    page = timeline.render(h.events, [c.to_json() for c in checkers.check_all(h.events)], title="t")
    data = json.loads(page[page.index("const D=") + 8: page.index(";\nconst C=")].replace("<\\/", "</"))
    assert data["bands"][0][2] == "kill-client"


def test_event_lines_round_trip(tmp_path: Path) -> None:
    """A client process's events (JSON lines on its stdout) carry the parent's clock."""
    import os

    from jepsen_like.clients import EventLines

    path = tmp_path / "out"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        EventLines(t0_ns=0, fd=fd).append("c1", "invoke", "quorum", {"step": 3}, "n2", time_ns=42)
    finally:
        os.close(fd)
    assert json.loads(path.read_text()) == {"time_ns": 42, "process": "c1", "type": "invoke", "f": "quorum",
                                            "value": {"step": 3}, "node": "n2", "error": None, "job": None}


# -- jobs: every quorum property per job ----------------------------------------------------------------

JA, JB = "job-1", "job-2"


def three_jobs() -> H:
    """A healthy run of three jobs whose ids overlap: the default job (c0, c3) reaches id 3, job-1
    (c1, c4) id 2, job-2 (c2) id 1; the same id means a different member set in each job, and
    job-2's id 1 comes after job-1's id 2 in real time. Every node's log holds every job."""
    h = H()
    h.status(0.1, "n1", "leader", 1)
    h.quorum("c0", 0.5, 0.6, qid=1, members=("c0", "c3"), job="default")
    h.quorum("c3", 0.5, 0.6, qid=1, members=("c0", "c3"), job="default")
    h.quorum("c1", 0.5, 0.6, qid=1, members=("c1",), job=JA)
    h.quorum("c4", 0.7, 0.8, qid=2, members=("c1", "c4"), job=JA)
    h.quorum("c1", 0.7, 0.8, qid=2, members=("c1", "c4"), job=JA)
    h.quorum("c2", 0.9, 1.0, qid=1, members=("c2",), job=JB)
    h.nemesis(1.1, 1.11, "kill-leader", {"node": 0})
    h.status(1.5, "n2", "leader", 2)
    h.nemesis(2.0, 2.01, "recover", {"healthy": True})
    h.quorum("c0", 2.1, 2.2, qid=3, members=("c0",), job="default")
    h.quorum("c2", 2.3, 2.4, qid=1, members=("c2",), job=JB)
    h.quorum("c1", 2.3, 2.4, qid=2, members=("c1", "c4"), job=JA)
    committed = [(1, ("c0", "c3"), "default"), (3, ("c0",), "default"), (1, ("c1",), JA), (2, ("c1", "c4"), JA),
                 (1, ("c2",), JB)]
    jobs = {"default": {"quorum_id": 3, "version": 0}, JA: {"quorum_id": 2, "version": 1},
            JB: {"quorum_id": 1, "version": 1}}
    for n in ("n1", "n2", "n3"):
        h.final(n, committed, {1: ["n1"], 2: ["n2"]}, {"100": "abc"}, jobs=jobs, retired={}, replayed_to=120)
    return h


def test_every_checker_passes_three_jobs_whose_ids_overlap() -> None:
    results = by_name(checkers.check_all(three_jobs().events))
    assert all(r.valid for r in results.values()), {n: r.offending for n, r in results.items() if not r.valid}
    assert results["no-split-brain"].summary == "5 quorum ids of 3 jobs, each with one member set"
    assert results["jobs-isolated"].summary.startswith("24 quorums of 3 jobs (default, job-1, job-2)")
    assert "of 3 jobs committed on all 3 nodes" in results["acknowledged-committed"].summary
    assert "every job's state identical on nodes at the same index (1 compared)" in results["logs-agree"].summary


def test_split_brain_is_per_job() -> None:
    h = three_jobs().quorum("c4", 3.0, 3.1, qid=2, members=("c4",), job=JA)    # job-1's id 2: another member set
    r = checkers.no_split_brain(h.events)
    assert not r.valid and r.count == 1
    assert r.offending[0]["job"] == JA and r.offending[0]["quorum_id"] == 2
    assert sorted(r.offending[0]["member_sets"]) == [["c1", "c4"], ["c4"]]
    # In a node's committed log too.
    h = three_jobs()
    h.final("n3", [(1, ("c0", "c3"), "default"), (1, ("c9",), JB)])
    r = checkers.no_split_brain(h.events)
    assert not r.valid and [(o["job"], o["quorum_id"]) for o in r.offending] == [(JB, 1)]


def test_real_time_order_is_per_job() -> None:
    h = three_jobs()
    r = checkers.monotonic_quorum_ids(h.events)
    assert r.valid, r.offending     # job-2's id 1 after job-1's id 2 is no regression
    h.quorum("c4", 3.0, 3.1, qid=1, members=("c1",), job=JA)      # job-1 back to 1 after its 2 completed
    r = checkers.monotonic_quorum_ids(h.events)
    assert not r.valid and {o["kind"] for o in r.offending} == {"client", "real-time"}
    assert [o["job"] for o in r.offending if o["kind"] == "real-time"] == [JA]


def test_an_acknowledged_quorum_must_be_committed_under_its_own_job() -> None:
    h = H()
    h.quorum("c2", 0.5, 0.6, qid=1, members=("c2",), job=JB)
    h.final("n1", [(1, ("c2",), JA)])          # same id and members, but job-1's
    r = checkers.acknowledged_committed(h.events)
    assert not r.valid and r.offending[0]["job"] == JB
    # A stretch known only from a snapshot excuses only that job's ids.
    h = H().quorum("c2", 0.5, 0.6, qid=5, members=("c2",), job=JB)
    h.final("n1", [], unknown=[[1, 9, JA]])
    assert not checkers.acknowledged_committed(h.events).valid
    h = H().quorum("c2", 0.5, 0.6, qid=5, members=("c2",), job=JB)
    h.final("n1", [], unknown=[[1, 9, JB]])
    assert checkers.acknowledged_committed(h.events).valid


def test_jobs_isolated_fails_on_another_jobs_replica_in_a_quorum() -> None:
    h = three_jobs().quorum("c2", 3.0, 3.1, qid=2, members=("c2", "c1"), job=JB)   # c1 is job-1's
    r = checkers.jobs_isolated(h.events)
    assert not r.valid and r.offending[0]["other_jobs_replicas"] == {"c1": JA} and r.offending[0]["job"] == JB
    # Committed in a node's log.
    h = three_jobs()
    h.final("n2", [(4, ("c0", "c2"), "default")])
    r = checkers.jobs_isolated(h.events)
    assert not r.valid and r.offending[0]["node"] == "n2" and r.offending[0]["other_jobs_replicas"] == {"c2": JB}
    # A replica group that named two jobs: the harness itself is wrong.
    h = three_jobs().quorum("c0", 3.0, 3.1, qid=1, members=("c0",), job=JB)
    r = checkers.jobs_isolated(h.events)
    assert not r.valid and r.offending[0] == {"replica": "c0", "jobs": ["default", JB],
                                              "problem": "one replica group named two jobs"}


def test_durable_after_restart_all_is_per_job() -> None:
    h = H()
    h.quorum("c0", 0.5, 0.6, qid=9, members=("c0",), job="default")
    h.quorum("c1", 0.5, 0.6, qid=2, members=("c1",), job=JA)
    h.nemesis(1.0, 2.0, "restart-all")
    h.quorum("c1", 2.5, 2.6, qid=3, members=("c1",), job=JA)       # below the default job's 9: fine
    assert checkers.durable_after_restart_all(h.events).valid
    h.quorum("c1", 2.7, 2.8, qid=1, members=("c1",), job=JA)       # below job-1's 2: not
    r = checkers.durable_after_restart_all(h.events)
    assert not r.valid and r.count == 1 and r.offending[0]["job"] == JA


def test_survivors_of_a_client_kill_are_its_own_jobs_clients() -> None:
    """c1 (job-1) is killed; c0 (default) never had c1 in its quorums and is no survivor: its
    quorums say nothing about how long c1's death held up its own job's rounds."""
    h = H()
    h.quorum("c1", 1.0, 1.1, qid=1, members=("c1", "c4"), job=JA)
    h.quorum("c4", 1.0, 1.1, qid=1, members=("c1", "c4"), job=JA)
    h.quorum("c0", 1.0, 1.1, qid=1, members=("c0",), job="default")
    h.nemesis(2.0, 2.01, "kill-client", {"client": "c1", "clients_down": ["c1"]})
    h.quorum("c0", 2.1, 2.2, qid=1, members=("c0",), job="default")
    h.quorum("c4", 2.1, 2.9, qid=2, members=("c4",), job=JA)
    r = checkers.survivor_wait(h.events, bound_s=3.5)
    assert r.valid, r.offending
    kill = r.figures["per_kill"][0]
    assert kill["survivors"] == ["c4"] and kill["waits_s"] == {"c4": pytest.approx(0.9)}


def test_logs_agree_compares_every_jobs_state_at_the_same_index() -> None:
    h = three_jobs()
    h.final("n3", [], digests={"100": "abc"}, replayed_to=120,
            jobs={"default": {"quorum_id": 3, "version": 0}, JA: {"quorum_id": 1, "version": 1}}, retired={})
    r = checkers.logs_agree(h.events)
    assert not r.valid and r.offending[0]["problem"] == "nodes at the same index hold different job states"
    # Nodes replayed to different indexes are not compared.
    h = three_jobs()
    h.final("n3", [], digests={"100": "abc"}, replayed_to=119, jobs={}, retired={})
    assert checkers.logs_agree(h.events).valid


def test_a_history_from_before_jobs_is_the_default_jobs() -> None:
    """Events without ``job`` and four-field committed quorums (runs recorded before jobs)."""
    results = by_name(checkers.check_all(good().events))
    assert all(r.valid for r in results.values())
    assert results["jobs-isolated"].summary.startswith("16 quorums of 1 job (default)")
    h = good().quorum("c0", 21.0, 21.1, qid=3, members=("c0",))
    assert not checkers.no_split_brain(h.events).valid


def test_operation_counts_per_job() -> None:
    counts = stats.operation_counts(three_jobs().events)
    assert counts["client"]["quorum"]["ok"] == 9
    assert {job: c["quorum"]["ok"] for job, c in counts["jobs"].items()} == {"default": 3, JA: 4, JB: 2}


def test_journal_summary_keeps_each_jobs_quorums() -> None:
    from lighthouse_cluster.core.codec import CommitQuorum, PutJob, RemoveJob, TermStart
    from lighthouse_cluster.core.jobs import JobSettings, JobSpec
    from lighthouse_cluster.core.quorum import Member, Quorum

    def q(qid: int, *ids: str) -> Quorum:
        return Quorum(qid, tuple(Member(i) for i in ids), 0)

    commands = [TermStart(1, "n1", 0), PutJob(JobSpec(JA, settings=JobSettings()), 0),
                CommitQuorum(0, q(1, "c0"), 1, "n1"), CommitQuorum(0, q(1, "c1"), 1, "n1", job=JA),
                CommitQuorum(1, q(2, "c1", "c4"), 1, "n1", job=JA), CommitQuorum(0, q(1, "x"), 1, "n1", job=JB),
                PutJob(JobSpec(JB, settings=JobSettings()), 0), RemoveJob(JB, 1)]
    log = CommittedLog("n1")
    log.absorb([(i + 1, 1, _command(c)) for i, c in enumerate(commands)], commit_index=len(commands))
    s = summarize(log)
    assert s["quorums"] == [[1, ["c0"], 3, 1, "default"], [1, ["c1"], 4, 1, JA], [2, ["c1", "c4"], 5, 1, JA]]
    assert s["jobs"] == {"default": {"quorum_id": 1, "version": 0}, JA: {"quorum_id": 2, "version": 1}}
    assert s["retired"] == {JB: 0} and s["rejected_commits"] == 1
