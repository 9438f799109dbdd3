"""The composed node (``raft/composed_node.py``) as a real cluster: three in-process nodes on
loopback elect a leader, commit, and elect another once the leader is destroyed; their
connections compress per node and their messages carry no keys but pysyncobj's while nothing
asks for more."""

from __future__ import annotations

from typing import Any

import pytest
from pysyncobj import SyncObjConf
from support.raft_nodes import start_nodes
from support.waiting import wait_for

from lighthouse_cluster.raft.composed_node import LighthouseSyncObj
from lighthouse_cluster.raft.host_transport import CompactTcpConnection

pytestmark = pytest.mark.integration


def _conf() -> SyncObjConf:
    return SyncObjConf(autoTickPeriod=0.01, raftMinTimeout=0.15, raftMaxTimeout=0.45, appendEntriesPeriod=0.0375,
                       connectionTimeout=0.5, connectionRetryTime=0.25, leaderFallbackTimeout=1.0,
                       appendEntriesUseBatch=False, dynamicMembershipChange=True)


def _leaders(nodes: list[Any]) -> list[Any]:
    return [n for n in nodes if n._isLeader()]


def test_three_composed_nodes_elect_commit_and_elect_again_after_the_leader_goes() -> None:
    nodes: list[LighthouseSyncObj] = start_nodes([LighthouseSyncObj] * 3, lambda ns: len(_leaders(ns)) == 1
                                                 and all(n._getLeader() is not None for n in ns), conf=_conf())
    try:
        leader = _leaders(nodes)[0]
        assert leader.counter.inc(sync=True, timeout=5) == 1  # type: ignore[attr-defined]
        assert leader.counter.inc(sync=True, timeout=5) == 2  # type: ignore[attr-defined]
        wait_for("every node to apply both entries", lambda: all(n.counter.n == 2 for n in nodes),  # type: ignore[attr-defined]
                 5.0, interval=0.005)
        connections = [c for n in nodes for c in n.pso_connections.values()]
        assert connections and all(type(c) is CompactTcpConnection for c in connections)
        wait_for("followers to send keep-alives and hold back repeated acks",
                 lambda: all(n.ext.fast_election.keepalives_sent > 0 and n.ext.idle_acks.acks_skipped > 0
                             for n in nodes if n is not leader), 5.0, interval=0.01)
        assert all(n.ext.adaptive_tick.tick_waits > 0 for n in nodes)

        leader.destroy()
        survivors = [n for n in nodes if n is not leader]
        wait_for("a new leader among the survivors", lambda: len(_leaders(survivors)) == 1, 5.0, interval=0.005)
        new_leader = _leaders(survivors)[0]
        assert new_leader.raftCurrentTerm > leader.raftCurrentTerm
        assert new_leader.counter.inc(sync=True, timeout=5) == 3  # type: ignore[attr-defined]
        assert any(n.ext.fast_election.leader_connection_losses for n in survivors)  # the closed connection seen
    finally:
        for n in nodes:
            n.destroy()
