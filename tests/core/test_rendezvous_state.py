"""The torchrun state's summary line (``core/rendezvous_state.py``) as the nodes read it, without
unpickling anything: written and read back, old-format values and garbage read as "unknown" and
never raise, an older agent's read (header stripped, ``pickle.loads`` of the rest) still works on
a newer value; rounds counted by the store as it applies writes."""

from __future__ import annotations

import pickle
import random

import pytest

from lighthouse_cluster.core.kv_store import KVCompareAndSet, KVDelete, KVSet, KVStore
from lighthouse_cluster.core.rendezvous_state import (MAX_SUMMARY_BYTES, STATE_HEADER, STATE_KEY, SUMMARY_MAGIC,
                                                      RoundSummary, completes_a_round, decode_state, encode_state,
                                                      read_summary, summary_line)

# Stands for torch's pickled state: the nodes treat it as opaque bytes, so any pickle will do.
TORCH_STATE = pickle.dumps({"round": 3, "participants": {"host-a": 0, "host-b": 1}, "note": "\n.lighthouse"})


def summary(round_: int = 3, complete: bool = True, closed: bool = False, participants: int = 2,
            waiting: int = 0) -> RoundSummary:
    return RoundSummary(round=round_, complete=complete, closed=closed, participants=participants, waiting=waiting)


def test_a_summary_is_written_after_the_state_and_read_back() -> None:
    s = summary(round_=7, complete=False, participants=3, waiting=1)
    value = encode_state(TORCH_STATE, s)
    assert value.startswith(STATE_HEADER + TORCH_STATE)
    assert value.endswith(b"lighthouse-rendezvous-summary/1 round=7 complete=0 closed=0 participants=3 waiting=1\n")
    assert read_summary(value) == s and s.phase == "waiting"
    assert decode_state(value) == (TORCH_STATE, s)
    line = summary_line(RoundSummary(round=10**12 - 1, complete=True, closed=True, participants=10**12 - 1,
                                     waiting=10**12 - 1))
    assert len(line) <= MAX_SUMMARY_BYTES
    with pytest.raises(ValueError):
        summary_line(summary(round_=-1))


def test_an_older_agent_reads_a_newer_value_as_its_state() -> None:
    # The first backend stripped the header and handed the rest to pickle.loads, which ignores
    # the summary after the pickle's end.
    value = encode_state(TORCH_STATE, summary())
    assert pickle.loads(value[len(STATE_HEADER):]) == pickle.loads(TORCH_STATE)


def test_an_old_format_value_is_a_state_without_a_summary() -> None:
    old = STATE_HEADER + TORCH_STATE
    assert decode_state(old) == (TORCH_STATE, None)
    assert read_summary(old) is None


@pytest.mark.parametrize("value", [
    None, b"", b"\n", b"garbage", STATE_HEADER, STATE_HEADER + b"\n",
    b"\x80\x04garbage" + summary_line(summary()),                        # a summary but no header
    STATE_HEADER + TORCH_STATE + summary_line(summary())[:-1],           # no final newline
    STATE_HEADER + TORCH_STATE + b"lighthouse-rendezvous-summary/2 round=1 complete=1 closed=0 participants=1 "
                                 b"waiting=0\n",                         # another version
    STATE_HEADER + TORCH_STATE + SUMMARY_MAGIC + b"1 round=1 complete=1\n",  # fields missing
    STATE_HEADER + TORCH_STATE + SUMMARY_MAGIC + b"1 round=-1 complete=1 closed=0 participants=1 waiting=0\n",
    STATE_HEADER + TORCH_STATE + SUMMARY_MAGIC + b"1 round=1 complete=1 closed=0 participants=1 waiting=0 x\n",
    STATE_HEADER + TORCH_STATE + SUMMARY_MAGIC + b"1 round=1 complete=1 closed=0\nparticipants=1 waiting=0\n",
    STATE_HEADER + TORCH_STATE + SUMMARY_MAGIC + b"1 round=" + b"9" * 13 + b" complete=1 closed=0 participants=1 "
                                                               b"waiting=0\n",
    STATE_HEADER + b"x" * 1000 + SUMMARY_MAGIC + b"1 round=1 complete=1 closed=0 participants=1 waiting=0"
                                                 + b" " * MAX_SUMMARY_BYTES + b"\n",  # too far from the end
], ids=["none", "empty", "newline", "garbage", "header-only", "header-newline", "no-header", "no-final-newline",
        "version-2", "fields-missing", "negative", "stray-word", "two-lines", "too-many-digits", "too-far"])
def test_anything_else_reads_as_unknown(value: bytes | None) -> None:
    assert read_summary(value) is None
    assert value is None or not completes_a_round(None, value)


def test_random_bytes_never_raise() -> None:
    rng = random.Random(34)
    line = summary_line(summary())
    for _ in range(3000):
        tail = bytearray(line)
        for _ in range(rng.randint(1, 4)):  # flip, drop or insert bytes of a valid summary
            i = rng.randrange(len(tail))
            op = rng.randrange(3)
            if op == 0:
                tail[i] = rng.randrange(256)
            elif op == 1:
                del tail[i]
            else:
                tail.insert(i, rng.randrange(256))
        for value in (STATE_HEADER + TORCH_STATE + bytes(tail), bytes(tail), rng.randbytes(rng.randrange(300))):
            found = read_summary(value)
            assert found is None or isinstance(found, RoundSummary)
            decode_state(value)


def test_only_a_new_complete_round_counts() -> None:
    def v(round_: int, complete: bool, closed: bool = False) -> bytes:
        return encode_state(TORCH_STATE, summary(round_=round_, complete=complete, closed=closed))

    old_format = STATE_HEADER + TORCH_STATE
    assert completes_a_round(None, v(0, True))
    assert completes_a_round(v(0, False), v(0, True))
    assert completes_a_round(v(0, True), v(1, True))            # a round begun and completed between writes
    assert completes_a_round(old_format, v(2, True))
    assert not completes_a_round(v(0, True), v(0, True))        # a keep-alive of the same round
    assert not completes_a_round(v(0, True), v(0, True, closed=True))
    assert not completes_a_round(v(0, True), v(1, False))
    assert not completes_a_round(None, old_format)


def test_the_store_counts_the_rounds_its_applied_writes_complete() -> None:
    kv = KVStore()
    ns = ("default", "run-1")

    def state(round_: int, complete: bool) -> bytes:
        return encode_state(TORCH_STATE, summary(round_=round_, complete=complete))

    r = kv.write(ns, KVCompareAndSet(STATE_KEY, state(0, False), expected_version=0), "w1", 1)
    r = kv.write(ns, KVCompareAndSet(STATE_KEY, state(0, True), expected_version=r.version), "w2", 2)
    assert r.applied and kv.rendezvous_rounds == 1
    # The same request again (a retry after a lost answer) is not applied, so not counted again.
    assert kv.write(ns, KVCompareAndSet(STATE_KEY, state(0, True), expected_version=1), "w2", 3).duplicate
    # A compare-and-set that loses is not applied.
    assert not kv.write(ns, KVCompareAndSet(STATE_KEY, state(1, True), expected_version=1), "w3", 4).applied
    # Another key holding a state, or another operation, is not the rendezvous state.
    kv.write(ns, KVSet("other", state(5, True)), "w4", 5)
    assert kv.rendezvous_rounds == 1
    kv.write(ns, KVSet(STATE_KEY, state(1, True)), "w5", 6)
    kv.write(ns, KVSet(STATE_KEY, state(1, True)), "w6", 7)     # keep-alive
    assert kv.rendezvous_rounds == 2
    kv.write(ns, KVDelete(STATE_KEY), "w7", 8)
    kv.write(ns, KVSet(STATE_KEY, state(1, True)), "w8", 9)     # a new incarnation of the run
    assert kv.rendezvous_rounds == 3
    assert "rendezvous_rounds" not in str(kv.to_wire())         # per process, never replicated
