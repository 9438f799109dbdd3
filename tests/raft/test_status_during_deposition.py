"""BUG-3 (fixed): ``Status`` must never report a leader that is being deposed as leader of the new term.

When a leader learns of a higher term (a vote request or an append from the new leader),
pysyncobj first stores the new term synchronously (``FileJournal.setCurrentTerm`` ->
``MetaStorer.storeMeta``: open, write, flush, rename) and only then steps down. ``node.status()``
read ``raft.role`` and ``raft.term`` separately, so a poll in that window answered (leader, new
term). jepsen_like found it (``one-leader-per-term`` on the monitor's observations); see
jepsen_like/README.md, "Bugs found", BUG-3, which has the fix for ``node.py``.

To make the window wide enough to hit every time, the nodes start with a ``sitecustomize`` that
makes that one store slow (100 ms; only the store that records a higher term learned from a
message, so elections still finish): a slow disk. The old leader is paused until the others
elect a new one, resumed, and polled until it reports the new term.

Fixed in ``node.py`` (``LighthouseNode._role_and_term`` and ``leader_peer``): a node is reported
leader only of the term it won (``RaftNode.led_term``). Without the fix this fails every time
(3 torn reports in 3 depositions); with it, none.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from support.waiting import wait_for
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
TRIALS = 3
SLOW_STORE_S = 0.1

SITECUSTOMIZE = f'''
import time as _t
import pysyncobj.journal as _j
_orig = _j.MetaStorer.storeMeta
def _slow(self, meta):
    if meta.get("votedForNodeId") is None:   # a higher term learned from a message
        _t.sleep({SLOW_STORE_S})
    return _orig(self, meta)
_j.MetaStorer.storeMeta = _slow
'''


def test_a_leader_being_deposed_never_reports_itself_leader_of_the_new_term(make_cluster, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    slow = tmp_path / "slow_disk"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), str(slow), os.environ.get("PYTHONPATH", "")]))
    cluster = make_cluster(nodes=3, min_replicas=1, join_timeout_ms=100, heartbeat_timeout_ms=1000,
                           quorum_tick_ms=50)
    torn = []
    for _ in range(TRIALS):
        leader = cluster.wait_for_agreed_leader(timeout=40)
        led = cluster.status(leader)
        assert led is not None
        cluster.pause(leader)
        try:
            others = [i for i in range(3) if i != leader]
            successor = cluster.wait_for_leader(timeout=30, among=others, exclude_term=led.term)
            won = cluster.status(successor)
            assert won is not None and won.term > led.term
        finally:
            cluster.resume(leader)
        st = wait_for("the old leader to report its successor's term (or a later one)",
                      lambda: (s := cluster.status(leader, timeout=0.5)) is not None and s.term >= won.term and s,
                      10, context=cluster, interval=0.005)
        if st.term == won.term and st.role == cpb.LEADER:
            torn.append((led.node.id, led.term, st.term))  # the successor leads that term
    assert not torn, f"Status reported a deposed leader as leader of the new term (node, led, reported): {torn}"
