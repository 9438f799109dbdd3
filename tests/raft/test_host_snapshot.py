"""A composed node's snapshots hold pysyncobj's state and the consumers', nothing of ours.

pysyncobj pickles into a snapshot every attribute of the SyncObj's ``__dict__`` that was not there
when ``SyncObj.__init__`` finished; the host keeps its state in slots and its extensions keep
theirs on themselves. One node on loopback, ticked by hand (``autoTick=False``), writes a real
snapshot file, which is read back here as pysyncobj reads it (a listening socket: integration). Its journal is the durable one,
opened per node (no process-wide ``createJournal``).
"""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
from pysyncobj import SyncObjConf
from support.raft_counter import Counter
from support.raft_nodes import free_port

from lighthouse_cluster.raft import pysyncobj_internals as internals
from lighthouse_cluster.raft.composed_node import LighthouseSyncObj
from lighthouse_cluster.raft.durable_journal import DurableJournal
from lighthouse_cluster.raft.pysyncobj_internals import StoragePath, monotonic

# What pysyncobj itself adds to a SyncObj after its __init__ (and so to every snapshot).
PYSYNCOBJ_OWN = {"_SyncObj__enabledCodeVersion"}


@pytest.mark.integration
def test_a_snapshot_holds_no_attribute_of_the_host_or_its_extensions(tmp_path: Path) -> None:
    snapshot = tmp_path / "raft.snapshot"
    journal = StoragePath(str(tmp_path / "raft.journal"), sync=False)
    conf = SyncObjConf(autoTick=False, journalFile=journal, fullDumpFile=StoragePath(str(snapshot), sync=False),
                       useFork=False, appendEntriesUseBatch=False, raftMinTimeout=0.02, raftMaxTimeout=0.03,
                       appendEntriesPeriod=0.005, connectionTimeout=0.5, logCompactionMinEntries=10**6,
                       logCompactionMinTime=10**6)
    counter = Counter()
    node = LighthouseSyncObj(f"127.0.0.1:{free_port()}", [], conf=conf, consumers=[counter])
    try:
        assert isinstance(node.pso_journal, DurableJournal) and conf.journalFile == journal
        deadline = monotonic() + 5
        while not node._isLeader() and monotonic() < deadline:
            node.doTick(0.01)
        assert node._isLeader()
        for _ in range(3):
            counter.inc()
        while counter.n < 3 and monotonic() < deadline:
            node.doTick(0.01)
        assert counter.n == 3
        node.add_tick_deadline(lambda: None)  # host state set after SyncObj.__init__
        node.ext.quiescence.note_client_activity()
        node.forceLogCompaction()
        while not snapshot.exists() and monotonic() < deadline:
            node.doTick(0.01)
        with gzip.open(snapshot, "rb") as f:
            data, *_ = internals.pso_pickle.load(f)
    finally:
        node.destroy()
    own, counter_state = data[0], data[1]
    assert set(own) <= PYSYNCOBJ_OWN, f"attributes of ours in the snapshot: {sorted(set(own) - PYSYNCOBJ_OWN)}"
    assert counter_state["n"] == 3  # the consumer's state is there
