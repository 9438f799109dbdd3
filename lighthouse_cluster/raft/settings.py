"""Raft timing (``RaftSettings``) and the pysyncobj configuration every node runs with
(``syncobj_conf``): sub-second failover, journal and snapshot files, no fork, the cluster secret."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pysyncobj import SyncObjConf


@dataclass(frozen=True)
class RaftSettings:
    """Raft timing. Election timeouts are drawn from [min, 3 * min]: the wide range makes split
    votes (two followers timing out together, costing a second election) rare. pysyncobj
    requires min > 3 * append_entries_period. A leader process that dies closes its connections,
    and its followers stand at min after its last append_entries, staggered by node id
    (``fast_election.leader_lost_deadline``): measured on 2 cores, 3 local nodes, a leader
    SIGKILL costs ~0.17-0.26 s median until every replica group has its next quorum
    (docs/design/fast-election.md); a leader that vanishes without closing them costs the random
    timeout (~0.22-0.32 s)."""

    election_timeout_min_s: float = 0.15
    election_timeout_max_s: float = 0.45
    append_entries_period_s: float = 0.0375
    # pysyncobj's tick thread waits for socket events until its next deadline (a heartbeat, an
    # election, a re-dial; ``adaptive_tick``), at most idle_tick_max_s; tick_period_s is its
    # wait when a deadline is overdue (and pysyncobj's fixed tick before that).
    tick_period_s: float = 0.01
    idle_tick_max_s: float = 0.1
    leader_fallback_s: float = 1.0
    # A leader with no client for quiet_after_s heartbeats every quiet_period_s (quiescence.py;
    # 0: never). Its followers' election timeouts are 4-8 such periods meanwhile.
    quiet_after_s: float = 3.0
    quiet_period_s: float = 0.2
    reconnect_s: float = 0.25
    compaction_min_entries: int = 2000
    compaction_min_time_s: float = 60.0
    dns_cache_s: float = 5.0
    dns_fail_cache_s: float = 1.0

    @classmethod
    def from_election_timeout_ms(cls, election_timeout_ms: int) -> RaftSettings:
        lo = election_timeout_ms / 1000.0
        return cls(
            election_timeout_min_s=lo,
            election_timeout_max_s=3 * lo,
            append_entries_period_s=min(0.05, lo / 4),
            leader_fallback_s=max(1.0, 4 * lo),
        )


def syncobj_conf(settings: RaftSettings, *, secret: str | None, bind_address: str | None,
                 journal_file: str | None, snapshot_file: str | None,
                 on_state_changed: Callable[[int, int], None]) -> SyncObjConf:
    """The ``SyncObjConf`` of a node: ``settings``' timing, the journal and snapshot files (None:
    in memory), ``secret`` encrypting the Raft port (None: plain), ``on_state_changed(old, new)``
    with pysyncobj's raft states, on its tick thread."""
    return SyncObjConf(
        password=secret or None,
        bindAddress=bind_address,
        journalFile=journal_file,
        fullDumpFile=snapshot_file,
        useFork=False,
        appendEntriesUseBatch=False,
        # Above any command we write: pysyncobj 0.3.17 mis-marks the last chunk of an entry
        # it splits (>= this size alone in a batch) and followers fail to unpickle it.
        appendEntriesBatchSizeBytes=16 * 2**20,
        autoTickPeriod=settings.tick_period_s,
        raftMinTimeout=settings.election_timeout_min_s,
        raftMaxTimeout=settings.election_timeout_max_s,
        appendEntriesPeriod=settings.append_entries_period_s,
        connectionTimeout=max(settings.election_timeout_max_s, 0.5),
        connectionRetryTime=settings.reconnect_s,
        leaderFallbackTimeout=settings.leader_fallback_s,
        logCompactionMinEntries=settings.compaction_min_entries,
        logCompactionMinTime=settings.compaction_min_time_s,
        onStateChanged=on_state_changed,
        # Peers re-created with new addresses (Kubernetes pods, Slurm requeues) are found
        # again within seconds, not pysyncobj's default 10 minutes.
        dnsCacheTime=settings.dns_cache_s,
        dnsFailCacheTime=settings.dns_fail_cache_s,
        # Runtime membership change (`lighthouse-cluster members add/remove`); the changes
        # are log entries, replayed from the journal after a restart.
        dynamicMembershipChange=True,
    )
