"""The dashboard's rendezvous panel (``GET /rendezvous.json``, ``server/rendezvous_view.py``) from a
store's contents: each run's round, phase and participants from its state's summary line, runs
without one as "unknown" or "none", the most recently written first."""

from __future__ import annotations

import pickle

from lighthouse_cluster.core.kv_store import KVSet, KVStore
from lighthouse_cluster.core.rendezvous_state import STATE_HEADER, STATE_KEY, RoundSummary, encode_state
from lighthouse_cluster.server.rendezvous_view import rendezvous_view, run_state

TORCH_STATE = pickle.dumps({"round": 4})


def summary(round_: int, complete: bool = True, waiting: int = 0) -> RoundSummary:
    return RoundSummary(round=round_, complete=complete, closed=False, participants=2, waiting=waiting)


def test_run_state_of_each_kind_of_value() -> None:
    unknown = {"state": "unknown", "round": None, "participants": None, "waiting": None}
    assert run_state(STATE_HEADER + TORCH_STATE) == unknown
    assert run_state(STATE_HEADER + b"garbage\n") == unknown
    assert run_state(None) == run_state(b"not a state") == {**unknown, "state": "none"}
    assert run_state(encode_state(TORCH_STATE, summary(3))) == {"state": "complete", "round": 3, "participants": 2,
                                                               "waiting": 0}


def test_the_panel_lists_runs_last_written_first() -> None:
    kv = KVStore()
    kv.write(("default", "a"), KVSet(STATE_KEY, encode_state(TORCH_STATE, summary(round_=4, complete=False,
                                                                                   waiting=1))), "1", 1000)
    kv.write(("train", "b"), KVSet(STATE_KEY, STATE_HEADER + TORCH_STATE), "2", 2000)
    kv.write(("train", "c"), KVSet("torch.rendezvous.c.0/k", b"1"), "3", 3000)
    kv.write(("train", "d"), KVSet(STATE_KEY, encode_state(TORCH_STATE, summary(round_=1))), "4", 500)
    view = rendezvous_view(kv, now_ms=4000, kv_calls=17, limit=3)
    assert [(r["job"], r["run_id"], r["state"], r["round"], r["participants"], r["waiting"], r["write_age_ms"])
            for r in view["runs"]] == [("train", "c", "none", None, None, None, 1000),
                                       ("train", "b", "unknown", None, None, None, 2000),
                                       ("default", "a", "waiting", 4, 2, 1, 3000)]
    assert (view["namespaces"], view["rendezvous_runs"], view["kv_calls"], view["revision"],
            view["rounds_completed"]) == (4, 3, 17, 4, 1)
