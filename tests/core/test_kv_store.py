"""The rendezvous key-value store (``core/kv_store.py``, schema 7): operations and their versions,
compare-and-set by version and by value, counters, limits, request-id deduplication, namespace
isolation and expiry, the codec's commands and version rule, snapshots; and a hypothesis state
machine checking the store against a plain dict under random operation sequences."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lighthouse_cluster.core import codec
from lighthouse_cluster.core.codec import KVDrop, KVExpire, KVWrite
from lighthouse_cluster.core.kv_store import (
    EXHAUSTED,
    INVALID,
    PRECONDITION,
    KVAdd,
    KVCompareAndSet,
    KVDelete,
    KVLimits,
    KVResult,
    KVSet,
    KVStore,
)
from lighthouse_cluster.core.state_machine import QuorumStateMachine

NS = ("train", "run-1")
OTHER = ("train", "run-2")


def write(store: KVStore, op, rid: str = "", t: int = 1000, ns=NS) -> KVResult:  # type: ignore[no-untyped-def]
    return store.write(ns, op, rid, t)


def test_set_get_and_versions_only_grow() -> None:
    s = KVStore()
    r1 = write(s, KVSet("a", b"1"))
    r2 = write(s, KVSet("b", b"2"))
    r3 = write(s, KVSet("a", b"3"))
    assert r1.applied and r2.applied and r3.applied
    assert 0 < r1.version < r2.version < r3.version
    assert s.get(NS, "a").value == b"3" and s.get(NS, "a").version == r3.version
    assert s.get(NS, "missing") is None and s.get(OTHER, "a") is None


def test_compare_and_set_by_version() -> None:
    s = KVStore()
    created = write(s, KVCompareAndSet("state", b"v1", expected_version=0))
    assert created.applied
    again = write(s, KVCompareAndSet("state", b"x", expected_version=0))
    assert not again.applied and again.version == created.version and again.value == b"v1"
    updated = write(s, KVCompareAndSet("state", b"v2", expected_version=created.version))
    assert updated.applied and updated.version > created.version
    stale = write(s, KVCompareAndSet("state", b"v3", expected_version=created.version))
    assert not stale.applied and stale.value == b"v2"


def test_compare_and_set_by_value_as_torch() -> None:
    s = KVStore()
    # Absent matches b"" (torch: compare_set(key, "", desired) creates it).
    assert write(s, KVCompareAndSet("k", b"one", expected_value=b"")).applied
    wrong = write(s, KVCompareAndSet("k", b"two", expected_value=b"zero"))
    assert not wrong.applied and wrong.value == b"one"
    assert write(s, KVCompareAndSet("k", b"two", expected_value=b"one")).value == b"two"
    # A non-empty expectation of an absent key fails and creates nothing.
    absent = write(s, KVCompareAndSet("nope", b"x", expected_value=b"y"))
    assert not absent.applied and absent.value is None and s.get(NS, "nope") is None


def test_compare_and_set_needs_exactly_one_expectation() -> None:
    s = KVStore()
    for op in (KVCompareAndSet("k", b"v"), KVCompareAndSet("k", b"v", expected_version=0, expected_value=b"")):
        r = write(s, op)
        assert not r.applied and r.error_kind == INVALID and "exactly one" in r.error


def test_add_counts_in_decimal_ascii() -> None:
    s = KVStore()
    assert write(s, KVAdd("n", 5)).counter == 5
    r = write(s, KVAdd("n", -7))
    assert r.counter == -2 and s.get(NS, "n").value == b"-2"
    write(s, KVSet("text", b"abc"))
    bad = write(s, KVAdd("text", 1))
    assert bad.error_kind == PRECONDITION and "integer" in bad.error and s.get(NS, "text").value == b"abc"
    write(s, KVSet("big", str(2**63 - 1).encode()))
    assert write(s, KVAdd("big", 1)).error_kind == PRECONDITION


def test_delete_and_compare_and_delete() -> None:
    s = KVStore()
    v = write(s, KVSet("k", b"v")).version
    assert not write(s, KVDelete("k", expected_version=v + 100)).applied
    assert write(s, KVDelete("k", expected_version=v)).applied
    assert s.get(NS, "k") is None
    assert not write(s, KVDelete("k")).applied


def test_list_by_prefix_is_sorted_and_bounded() -> None:
    s = KVStore(KVLimits(max_list=3))
    for k in ("b/2", "a/1", "b/1", "b/3", "b/4", "c"):
        write(s, KVSet(k, b"x"))
    entries, total = s.list(NS, "b/")
    assert [k for k, _ in entries] == ["b/1", "b/2", "b/3"] and total == 4
    assert [k for k, _ in s.list(NS, "", limit=2)[0]] == ["a/1", "b/1"]
    assert s.list(OTHER) == ([], 0)


def test_request_id_applies_a_retried_write_once() -> None:
    s = KVStore()
    first = write(s, KVAdd("n", 1), rid="req-1")
    retry = write(s, KVAdd("n", 1), rid="req-1")
    assert first.counter == retry.counter == 1 and retry.duplicate and not first.duplicate
    assert s.get(NS, "n").value == b"1"
    # A retried compare-and-set that won answers "won" again, though the version moved on only by it.
    cas = write(s, KVCompareAndSet("state", b"mine", expected_version=0), rid="cas-1")
    cas_retry = write(s, KVCompareAndSet("state", b"mine", expected_version=0), rid="cas-1")
    assert cas.applied and cas_retry.applied and cas_retry.version == cas.version and cas_retry.duplicate
    # The same id in another namespace is another request.
    assert write(s, KVAdd("n", 1), rid="req-1", ns=OTHER).counter == 1


def test_dedup_window_forgets_the_oldest_alike() -> None:
    s = KVStore(KVLimits(dedup_window=2))
    write(s, KVAdd("n", 1), rid="r1")
    write(s, KVAdd("n", 1), rid="r2")
    write(s, KVAdd("n", 1), rid="r3")
    assert write(s, KVAdd("n", 1), rid="r1").counter == 4  # forgotten: applied again
    assert write(s, KVAdd("n", 1), rid="r3").duplicate


@pytest.mark.parametrize("op, kind, words", [
    (KVSet("", b"v"), INVALID, "empty"),
    (KVSet("k" * 9, b"v"), INVALID, "limit is 8"),
    (KVSet("k", b"v" * 17), INVALID, "limit is 16"),
    (KVAdd("k", 2**63), INVALID, "64-bit"),
    (KVCompareAndSet("k", b"v", expected_version=-1), INVALID, "negative"),
])
def test_bad_operations_are_refused_and_change_nothing(op, kind, words) -> None:  # type: ignore[no-untyped-def]
    s = KVStore(KVLimits(max_key_bytes=8, max_value_bytes=16))
    r = write(s, op)
    assert r.error_kind == kind and words in r.error and not r.applied
    assert s.namespaces == {} and s.revision == 0


def test_bad_namespaces_are_refused() -> None:
    s = KVStore()
    for ns in (("train", ""), ("train", "has space"), ("Bad Job!", "run"), ("train", "r" * 200)):
        assert s.write(ns, KVSet("k", b"v"), "", 0).error_kind == INVALID
    assert s.namespaces == {}


def test_limits_on_keys_bytes_and_namespaces() -> None:
    s = KVStore(KVLimits(max_keys=2, max_namespace_bytes=20, max_namespaces=2))
    write(s, KVSet("a", b"1"))
    write(s, KVSet("b", b"2"))
    full = write(s, KVSet("c", b"3"))
    assert full.error_kind == EXHAUSTED and "2 keys" in full.error
    assert write(s, KVSet("a", b"x")).applied  # replacing a key needs no new room
    big = write(s, KVSet("a", b"y" * 30))
    assert big.error_kind == EXHAUSTED and "bytes" in big.error
    write(s, KVSet("k", b"v"), ns=OTHER)
    third = write(s, KVSet("k", b"v"), ns=("train", "run-3"))
    assert third.error_kind == EXHAUSTED and "namespaces" in third.error
    assert len(s.namespaces) == 2


def test_failed_writes_create_no_namespace() -> None:
    s = KVStore()
    assert not write(s, KVDelete("k")).applied
    assert not write(s, KVCompareAndSet("k", b"v", expected_version=7)).applied
    assert s.namespaces == {}


def test_expiry_drops_idle_namespaces_only() -> None:
    s = KVStore()
    write(s, KVSet("k", b"v"), t=1_000)
    write(s, KVSet("k", b"v"), t=5_000, ns=OTHER)
    assert s.idle(now_ms=6_000, idle_ms=4_000) == [NS]
    assert s.expire(now_ms=6_000, idle_ms=4_000) == [NS]
    assert s.get(NS, "k") is None and s.get(OTHER, "k") is not None
    # A write touches: the namespace stays while written to.
    write(s, KVSet("k2", b"v"), t=9_500, ns=OTHER)
    assert s.expire(now_ms=10_000, idle_ms=4_000) == []


def test_a_recreated_namespace_never_reuses_versions() -> None:
    s = KVStore()
    old = write(s, KVSet("state", b"old")).version
    assert s.drop(NS) == 1 and s.drop(NS) == -1
    new = write(s, KVCompareAndSet("state", b"new", expected_version=0))
    assert new.applied and new.version > old
    assert not write(s, KVCompareAndSet("state", b"stale", expected_version=old)).applied


# -- through the codec and the state machine -------------------------------------------------


def test_commands_round_trip_through_the_codec() -> None:
    for cmd in (KVWrite("train", "r1", KVSet("k", b"\x00\xff"), "rid", 5),
                KVWrite("train", "r1", KVCompareAndSet("k", b"v", expected_version=3), "", 5),
                KVWrite("train", "r1", KVCompareAndSet("k", b"v", expected_value=b""), "x", 5),
                KVWrite("train", "r1", KVAdd("k", -3), "", 5),
                KVWrite("train", "r1", KVDelete("k", expected_version=9), "", 5),
                KVDrop("train", "r1"), KVExpire(10, 20)):
        data = codec.encode_command(cmd, version=codec.KV_SCHEMA_VERSION)
        assert codec.decode_versioned(data) == (cmd, codec.KV_SCHEMA_VERSION)


def test_no_kv_command_before_its_schema_is_enabled() -> None:
    for cmd in (KVWrite("train", "r1", KVSet("k", b"v"), "", 5), KVDrop("train", "r1"), KVExpire(1, 2)):
        with pytest.raises(ValueError, match="needs schema 7"):
            codec.encode_command(cmd, version=codec.KV_SCHEMA_VERSION - 1)


def test_a_malformed_kv_command_is_a_schema_error() -> None:
    import msgpack

    data = msgpack.packb({"k": "kv_write", "v": 7, "j": "a", "r": "b", "t": 1, "op": {"o": "nope", "key": "k"}})
    with pytest.raises(codec.SchemaError):
        codec.decode_command(data)


def test_state_machine_applies_kv_and_snapshots_it() -> None:
    sm = QuorumStateMachine()
    for cmd in (KVWrite("train", "r1", KVSet("a", b"1"), "id-1", 100),
                KVWrite("train", "r2", KVAdd("n", 4), "", 200),
                KVWrite("train", "r1", KVSet("gone", b"x"), "", 300)):
        sm.apply_bytes(codec.encode_command(cmd, codec.SCHEMA_VERSION))
    assert sm.apply(KVWrite("train", "r1", KVDelete("gone"), "", 400)).applied
    restored = QuorumStateMachine()
    restored.restore_snapshot(sm.to_snapshot())
    assert restored.kv.to_wire() == sm.kv.to_wire()
    # The dedup table travels too: a retry after a snapshot install is still a duplicate.
    assert restored.apply(KVWrite("train", "r1", KVSet("a", b"1"), "id-1", 500)).duplicate
    assert restored.apply(KVDrop("train", "r2")) == 1
    assert restored.apply(KVExpire(10_000, 1_000)) == [("train", "r1")]
    assert restored.kv.namespaces == {}


def test_a_snapshot_without_kv_restores_an_empty_store() -> None:
    sm = QuorumStateMachine()
    sm.apply(KVWrite("train", "r1", KVSet("a", b"1"), "", 100))
    old = QuorumStateMachine(max_schema_version=6)
    sm.restore_snapshot(old.to_snapshot())
    assert sm.kv.namespaces == {} and sm.kv.revision == 0


# -- the store against a plain dict ----------------------------------------------------------

KEYS = st.sampled_from(["a", "b", "c/1", "c/2"])
VALUES = st.binary(max_size=4)
NAMESPACES = st.sampled_from([NS, OTHER])


class KVAgainstDict(RuleBasedStateMachine):
    """Random writes (retried at random with their request id), drops and expiries; the model is
    a dict per namespace, a version counter and the outcomes per request id."""

    def __init__(self) -> None:
        super().__init__()
        self.store = KVStore(KVLimits(max_keys=3, dedup_window=1_000_000))
        self.model: dict[tuple[str, str], dict[str, tuple[bytes, int]]] = {}
        self.touched: dict[tuple[str, str], int] = {}
        self.outcomes: dict[tuple[tuple[str, str], str], tuple[bool, int]] = {}
        self.sent: list[tuple[tuple[str, str], object, str]] = []
        self.now = 0
        self.ids = 0

    def _send(self, ns, op, rid: str) -> None:  # type: ignore[no-untyped-def]
        self.now += 1
        result = self.store.write(ns, op, rid, self.now)
        known = self.outcomes.get((ns, rid))
        if known is not None and ns in self.model:
            assert result.duplicate and (result.applied, result.version) == known
            self.touched[ns] = self.now
            return
        expected = self._model_apply(ns, op)
        if expected is None:
            assert result.error_kind == EXHAUSTED
            return
        assert not result.duplicate and not result.error
        applied, version, value = expected
        assert (result.applied, result.version, result.value) == (applied, version, value)
        if ns in self.model:
            self.touched[ns] = self.now
            self.outcomes[(ns, rid)] = (applied, version)

    def _model_apply(self, ns, op):  # type: ignore[no-untyped-def]
        keys = dict(self.model.get(ns, {}))
        current = keys.get(op.key)
        cur_version = current[1] if current else 0
        cur_value = current[0] if current else None
        if isinstance(op, KVDelete):
            if current is None or (op.expected_version is not None and op.expected_version != cur_version):
                return False, cur_version, cur_value
            del keys[op.key]
            self.model[ns] = keys
            return True, 0, None
        if isinstance(op, KVCompareAndSet):
            if op.expected_version is not None:
                ok = cur_version == op.expected_version
            else:
                ok = (cur_value if current else b"") == op.expected_value
            if not ok:
                return False, cur_version, cur_value
        if current is None and len(keys) >= 3:
            return None
        value = op.value if not isinstance(op, KVAdd) else b"0"  # counters are not generated here
        version = self.store.revision  # the store has applied it: its revision is the new version
        keys[op.key] = (value, version)
        if ns not in self.model:
            self.touched[ns] = self.now
        self.model[ns] = keys
        return True, version, value

    def _rid(self) -> str:
        self.ids += 1
        return f"r{self.ids}"

    @rule(ns=NAMESPACES, key=KEYS, value=VALUES)
    def set(self, ns, key, value) -> None:  # type: ignore[no-untyped-def]
        rid = self._rid()
        self.sent.append((ns, KVSet(key, value), rid))
        self._send(ns, KVSet(key, value), rid)

    @rule(ns=NAMESPACES, key=KEYS, value=VALUES, stale=st.booleans())
    def cas_version(self, ns, key, value, stale) -> None:  # type: ignore[no-untyped-def]
        current = self.model.get(ns, {}).get(key)
        expected = (current[1] if current else 0) + (1 if stale else 0)
        op = KVCompareAndSet(key, value, expected_version=expected)
        rid = self._rid()
        self.sent.append((ns, op, rid))
        self._send(ns, op, rid)

    @rule(ns=NAMESPACES, key=KEYS, value=VALUES, expected=VALUES)
    def cas_value(self, ns, key, value, expected) -> None:  # type: ignore[no-untyped-def]
        op = KVCompareAndSet(key, value, expected_value=expected)
        rid = self._rid()
        self.sent.append((ns, op, rid))
        self._send(ns, op, rid)

    @rule(ns=NAMESPACES, key=KEYS)
    def delete(self, ns, key) -> None:  # type: ignore[no-untyped-def]
        rid = self._rid()
        self.sent.append((ns, KVDelete(key), rid))
        self._send(ns, KVDelete(key), rid)

    @precondition(lambda self: self.sent)
    @rule(pick=st.integers(min_value=0))
    def retry(self, pick: int) -> None:
        ns, op, rid = self.sent[pick % len(self.sent)]
        if (ns, rid) in self.outcomes and ns in self.model:
            self._send(ns, op, rid)

    @rule(ns=NAMESPACES)
    def drop(self, ns) -> None:  # type: ignore[no-untyped-def]
        assert self.store.drop(ns) == (len(self.model[ns]) if ns in self.model else -1)
        self.model.pop(ns, None)
        self.outcomes = {k: v for k, v in self.outcomes.items() if k[0] != ns}

    @rule(idle=st.integers(min_value=0, max_value=5))
    def expire(self, idle: int) -> None:
        self.now += 1
        gone = self.store.expire(self.now, idle)
        assert sorted(gone) == sorted(ns for ns in self.model if self.touched[ns] + idle <= self.now)
        for ns in gone:
            self.model.pop(ns)
            self.outcomes = {k: v for k, v in self.outcomes.items() if k[0] != ns}

    @invariant()
    def same_contents(self) -> None:
        for ns in (NS, OTHER):
            listed, total = self.store.list(ns)
            keys = self.model.get(ns, {})
            assert {k: (e.value, e.version) for k, e in listed} == keys and total == len(keys)

    @invariant()
    def snapshot_round_trips(self) -> None:
        copy = KVStore(self.store.limits)
        copy.restore(self.store.to_wire())
        assert copy.to_wire() == self.store.to_wire()


TestKVAgainstDict = KVAgainstDict.TestCase
TestKVAgainstDict.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
