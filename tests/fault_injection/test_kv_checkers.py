"""``checkers.kv_cas_linearizable`` on hand-made histories (pure, fast): compare-and-set increments
of one register by contending clients pass when every acknowledged one is counted once, and
fail, with a summary saying why, when one is lost, applied twice, or a read goes back; and the
journal replay's key-value summary it reads from each node."""

from __future__ import annotations

from typing import Any

from jepsen_like import checkers
from jepsen_like.history import make_event
from jepsen_like.journal import CommittedLog, summarize
from jepsen_like.kv_clients import KV_KEY, KV_RUN_ID
from lighthouse_cluster.core import codec
from lighthouse_cluster.core.kv_store import DEFAULT_LIMITS, KVCompareAndSet, KVSet
from lighthouse_cluster.raft.journal import journal_entry

S = 1_000_000_000
REG = {"run_id": KV_RUN_ID, "key": KV_KEY}


class KVH:
    """A key-value history by hand; times in seconds."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self._rid = 0

    def add(self, t: float, process: str, type: str, f: str, value: Any, error: str | None = None,
            node: str | None = "n1") -> "KVH":
        self.events.append(make_event(len(self.events), int(t * S), process, type, f, value, node, error,
                                      "default"))
        return self

    def read(self, p: str, t0: float, t1: float, value: int, version: int, type: str = "ok") -> "KVH":
        self.add(t0, p, "invoke", "kv-read", dict(REG))
        return self.add(t1, p, type, "kv-read", {**REG, "value": value, "version": version} if type == "ok"
                        else dict(REG), None if type == "ok" else "KVUnavailable")

    def cas(self, p: str, t0: float, t1: float, frm: int, expected: int, type: str = "ok",
            version: int | None = None, current: tuple[int, int] | None = None) -> "KVH":
        """``ok``: applied at ``version``; ``fail``: lost, the key at ``current`` (version, value);
        ``info``: unknown; ``open``: never completed."""
        self._rid += 1
        inv = {**REG, "expected_version": expected, "from": frm, "to": frm + 1, "request_id": f"r{self._rid}"}
        self.add(t0, p, "invoke", "kv-cas", inv)
        if type == "ok":
            return self.add(t1, p, "ok", "kv-cas", {**inv, "applied": True, "version": version, "duplicate": False})
        if type == "fail":
            assert current is not None
            return self.add(t1, p, "fail", "kv-cas", {**inv, "applied": False, "current_version": current[0],
                                                      "current_value": current[1], "duplicate": False},
                            "compare-and-set lost")
        if type == "info":
            return self.add(t1, p, "info", "kv-cas", inv, "KVUnavailable: no answer")
        return self

    def final(self, t0: float, t1: float, value: int, version: int) -> "KVH":
        self.add(t0, "kv-final", "invoke", "kv-final", dict(REG), node=None)
        return self.add(t1, "kv-final", "ok", "kv-final", {**REG, "value": value, "version": version}, node=None)

    def node_state(self, node: str, value: int, version: int, applied: int | None = None,
                   reapplied: list[list[str]] | None = None) -> "KVH":
        st = {"commit_index": 50, "quorums": [], "jobs": {}, "leaders": {}, "digests": {}, "conflicts": [],
              "kv": [["default", KV_RUN_ID, KV_KEY, str(value), version]] if version else [],
              "kv_applied": [["default", KV_RUN_ID, KV_KEY, value if applied is None else applied]],
              "kv_complete": True, "kv_reapplied": reapplied or []}
        return self.add(100.0, "journal", "info", "final-state", st, node=node)


def contended() -> KVH:
    """Two clients racing: kv0 wins 0->1 (v1), kv1 loses from 0, reads (1, v1), wins 1->2 (v2); kv0
    loses from v1, then an unknown CAS 2->3 that took effect (v3, seen by the final read)."""
    return (KVH()
            .read("kv0", 0.0, 0.1, 0, 0).read("kv1", 0.0, 0.1, 0, 0)
            .cas("kv0", 0.2, 0.3, 0, 0, "ok", version=1)
            .cas("kv1", 0.2, 0.35, 0, 0, "fail", current=(1, 1))
            .cas("kv1", 0.4, 0.5, 1, 1, "ok", version=2)
            .cas("kv0", 0.4, 0.55, 1, 1, "fail", current=(2, 2))
            .read("kv0", 0.6, 0.7, 2, 2)
            .cas("kv0", 0.8, 3.0, 2, 2, "info")
            .read("kv1", 1.0, 1.1, 0, 0, type="info")
            .final(4.0, 4.1, 3, 3)
            .node_state("n1", 3, 3).node_state("n2", 3, 3).node_state("n3", 3, 3))


def check(h: KVH) -> checkers.CheckResult:
    return checkers.kv_cas_linearizable(h.events)


def problems(r: checkers.CheckResult) -> list[str]:
    return [o["problem"] for o in r.offending]


def test_contended_increments_with_an_unknown_one_pass() -> None:
    r = check(contended())
    assert r.valid, r.offending
    assert r.name == "kv-cas-linearizable"
    figs = r.figures[f"default/{KV_RUN_ID}/{KV_KEY}"]
    assert figs["acknowledged"] == 2 and figs["lost_races"] == 2 and figs["unknown"] == 1
    assert figs["final_value"] == 3 and figs["bounds"] == [2, 3] and figs["nodes_checked"] == 3
    assert "2 acknowledged compare-and-sets" in r.summary


def test_an_unknown_increment_that_did_not_take_effect_passes_too() -> None:
    h = (KVH().cas("kv0", 0.0, 0.1, 0, 0, "ok", version=1).cas("kv0", 0.2, 2.0, 1, 1, "info")
         .cas("kv1", 0.3, 0.4, 1, 1, "open").final(3.0, 3.1, 1, 1))
    r = check(h)
    assert r.valid, r.offending
    assert r.figures[f"default/{KV_RUN_ID}/{KV_KEY}"]["bounds"] == [1, 3]


def test_no_kv_operations_pass_and_are_not_registered() -> None:
    assert checkers.kv_cas_linearizable([]).valid
    assert not checkers.has_kv([])
    assert checkers.has_kv(contended().events)
    assert "kv-cas-linearizable" in {c.name for c in checkers.check_cheap(contended().events)}
    assert "kv-cas-linearizable" not in {c.name for c in checkers.check_cheap([])}


def test_a_lost_acknowledged_increment_fails() -> None:
    """Three acknowledged increments, the register ends at 2: one acknowledged CAS is lost."""
    h = (KVH().cas("kv0", 0.0, 0.1, 0, 0, "ok", version=1).cas("kv1", 0.2, 0.3, 1, 1, "ok", version=2)
         .cas("kv0", 0.4, 0.5, 2, 2, "ok", version=3).final(1.0, 1.1, 2, 4))
    r = check(h)
    assert not r.valid
    assert any(p.startswith("lost: 3 acknowledged increments (the highest wrote 3) but the register ends at 2")
               for p in problems(r)), problems(r)
    assert "lost" in r.summary and "key-value offences" in r.summary


def test_a_node_whose_log_lost_an_increment_fails() -> None:
    h = contended()
    h.events = [e for e in h.events if not (e["f"] == "final-state" and e["node"] == "n3")]
    h.node_state("n3", 1, 1)
    r = check(h)
    assert not r.valid
    assert any("n3's committed log ends with the register at 1, outside [2, 3]" in p for p in problems(r))


def test_two_acknowledged_cas_from_the_same_version_fail() -> None:
    """Both claim to have moved the register from version 1: one update was applied over the
    other's (lost), or one was applied twice."""
    h = (KVH().cas("kv0", 0.0, 0.1, 0, 0, "ok", version=1)
         .cas("kv0", 0.2, 0.3, 1, 1, "ok", version=2).cas("kv1", 0.2, 0.35, 1, 1, "ok", version=3)
         .final(1.0, 1.1, 3, 3))
    r = check(h)
    assert not r.valid
    ps = problems(r)
    assert any(p.startswith("two acknowledged compare-and-sets from the same version") for p in ps), ps
    assert any(p.startswith("two acknowledged compare-and-sets wrote the same value") for p in ps), ps
    assert "applied twice" in r.summary


def test_a_final_value_above_every_possible_increment_fails() -> None:
    h = (KVH().cas("kv0", 0.0, 0.1, 0, 0, "ok", version=1).cas("kv1", 0.2, 0.3, 1, 1, "fail", current=(5, 9))
         .final(1.0, 1.1, 2, 6))
    r = check(h)
    assert not r.valid
    assert any(p.startswith("applied twice: the register ends at 2, but only 1 increments were acknowledged "
                            "and 0 had an unknown outcome") for p in problems(r)), problems(r)


def test_a_request_applied_twice_in_a_log_fails() -> None:
    h = contended()
    h.events = [e for e in h.events if e["f"] != "final-state"]
    h.node_state("n1", 3, 3, reapplied=[["default", KV_RUN_ID, "r3", "17"]])
    r = check(h)
    assert not r.valid
    assert any("n1's log applied request r3 twice (again at index 17)" in p for p in problems(r))


def test_a_write_that_did_not_increment_fails() -> None:
    h = contended()
    h.events = [e for e in h.events if e["f"] != "final-state"]
    h.node_state("n1", 3, 3, applied=4)
    r = check(h)
    assert not r.valid
    assert any("n1's log applied 4 writes to the register, which holds 3" in p for p in problems(r))


def test_a_read_going_back_fails() -> None:
    """kv1 reads version 2 (value 2), then version 1 (value 1), after the first read completed."""
    h = (KVH().cas("kv0", 0.0, 0.1, 0, 0, "ok", version=1).cas("kv0", 0.2, 0.3, 1, 1, "ok", version=2)
         .read("kv1", 0.4, 0.5, 2, 2).read("kv1", 0.6, 0.7, 1, 1).final(1.0, 1.1, 2, 2))
    r = check(h)
    assert not r.valid
    ps = problems(r)
    assert any(p.startswith("kv1 saw the register go back: version 2 value 2, then version 1 value 1") for p in ps)
    assert any(p.startswith("stale: kv1 saw version 1 after an operation that had completed saw version 2")
               for p in ps), ps


def test_a_stale_read_by_another_client_fails() -> None:
    """kv0's CAS to version 2 completed before kv1's read began, which still saw version 1."""
    h = (KVH().cas("kv0", 0.0, 0.1, 0, 0, "ok", version=1).cas("kv0", 0.2, 0.3, 1, 1, "ok", version=2)
         .read("kv1", 0.4, 0.5, 1, 1).final(1.0, 1.1, 2, 2))
    r = check(h)
    assert not r.valid
    assert problems(r) == ["stale: kv1 saw version 1 after an operation that had completed saw version 2"]


def test_concurrent_reads_may_see_either_version() -> None:
    h = (KVH().cas("kv0", 0.0, 0.1, 0, 0, "ok", version=1).cas("kv0", 0.2, 0.5, 1, 1, "ok", version=2)
         .read("kv1", 0.3, 0.4, 1, 1).read("kv2", 0.3, 0.6, 2, 2).final(1.0, 1.1, 2, 2))
    assert check(h).valid


def test_values_not_increasing_with_versions_fail() -> None:
    """Version 3 read as 1 while version 2 is 2: the register went back in version order."""
    h = (KVH().cas("kv0", 0.0, 0.1, 0, 0, "ok", version=1).cas("kv0", 0.2, 0.3, 1, 1, "ok", version=2)
         .read("kv1", 0.2, 0.9, 1, 3).final(1.0, 1.1, 2, 3))
    r = check(h)
    assert not r.valid
    assert any(p.startswith("the value did not increase with the version: 2 at version 2, 1 at version 3")
               for p in problems(r)), problems(r)


def test_a_broken_chain_fails() -> None:
    """2 was written from version 7, but 1 was written at version 1."""
    h = (KVH().cas("kv0", 0.0, 0.1, 0, 0, "ok", version=1).cas("kv1", 0.2, 0.3, 1, 7, "ok", version=8)
         .final(1.0, 1.1, 2, 8))
    r = check(h)
    assert not r.valid
    assert problems(r) == ["2 was written from version 7, but 1 was written at version 1"]


def test_journal_summary_counts_kv_writes_and_reapplied_requests() -> None:
    """The replay of a committed log lists the store's keys and the writes applied per key; a
    retried request (the same request id again) is answered as a duplicate, not counted."""
    cmds = [codec.KVWrite("default", KV_RUN_ID, KVCompareAndSet(KV_KEY, b"1", expected_version=0), "a", 1000),
            codec.KVWrite("default", KV_RUN_ID, KVCompareAndSet(KV_KEY, b"2", expected_version=1), "b", 1001),
            codec.KVWrite("default", KV_RUN_ID, KVCompareAndSet(KV_KEY, b"2", expected_version=1), "b", 1002),
            codec.KVWrite("default", KV_RUN_ID, KVCompareAndSet(KV_KEY, b"9", expected_version=1), "c", 1003)]
    st = summarize(committed(cmds))
    assert st["kv"] == [["default", KV_RUN_ID, KV_KEY, "2", 2]]
    assert st["kv_applied"] == [["default", KV_RUN_ID, KV_KEY, 2]]
    assert st["kv_reapplied"] == [] and st["kv_complete"] is True


def test_journal_summary_names_a_request_applied_twice() -> None:
    """A request id retried after the store forgot it (past its dedup window) is applied again:
    the replay names it, and the checker fails on it."""
    window = DEFAULT_LIMITS.dedup_window
    cmds = [codec.KVWrite("default", KV_RUN_ID, KVSet("other", b"x"), "again", 1000)]
    cmds += [codec.KVWrite("default", KV_RUN_ID, KVSet("other", b"y"), f"r{i}", 1001) for i in range(window)]
    cmds += [codec.KVWrite("default", KV_RUN_ID, KVSet("other", b"x"), "again", 1002)]
    st = summarize(committed(cmds))
    assert st["kv_reapplied"] == [["default", KV_RUN_ID, "again", str(len(cmds))]]
    h = contended()
    h.events = [e for e in h.events if e["f"] != "final-state"]
    h.add(100.0, "journal", "info", "final-state",
          {**st, "kv": [["default", KV_RUN_ID, KV_KEY, "3", 3]], "kv_applied": [["default", KV_RUN_ID, KV_KEY, 3]]},
          node="n1")
    r = check(h)
    assert not r.valid and r.offending[0]["kind"] == "applied twice"
    assert f"n1's log applied request again twice (again at index {len(cmds)})" in r.offending[0]["problem"]


def committed(cmds: list[Any]) -> CommittedLog:
    log = CommittedLog("n1")
    log.absorb([(i, 1, journal_entry(codec.encode_command(cmd))) for i, cmd in enumerate(cmds, start=1)],
               commit_index=len(cmds))
    return log
