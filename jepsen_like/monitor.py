"""The monitor: polls every node's Status during a run and tails their Raft journals.

* Status: every ``status_period_s`` each running node is asked for its Status; whenever a node's
  (reachable, role, term, leader, serving) changes, an ``info`` event with process ``monitor``,
  f ``status`` is recorded (the one-leader-per-term checker reads them).
* Journals: every ``journal_period_s`` each node's ``raft.journal`` is read read-only and the
  entries at or below the commit index that node reported just before are kept
  (``journal.CommittedLog``): log compaction may drop them from the file later, so this keeps
  the whole committed log of every node for the end-of-run checks.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from .cluster import ROLE_NAMES, HarnessCluster
from .history import INFO, MONITOR, HistoryWriter
from .journal import CommittedLog, parse_journal, read_snapshot


class Monitor:
    def __init__(self, cluster: HarnessCluster, history: HistoryWriter, status_period_s: float = 0.25,
                 journal_period_s: float = 0.5) -> None:
        self.cluster = cluster
        self.history = history
        self.status_period_s = status_period_s
        self.journal_period_s = journal_period_s
        self.logs = [CommittedLog(cluster.node_id(i)) for i in range(cluster.nodes)]
        self.snapshots: list[dict[int, bytes]] = [{} for _ in range(cluster.nodes)]
        self._snapshot_stat: list[Any] = [None] * cluster.nodes
        self.last_status: list[Any] = [None] * cluster.nodes
        self._seen: list[Any] = [None] * cluster.nodes
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._main, name="jepsen-monitor", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> "Monitor":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10.0)

    def _main(self) -> None:
        next_journal = 0.0
        try:
            while not self._stop.is_set():
                self.poll_status()
                if time.monotonic() >= next_journal:
                    self.poll_journals()
                    next_journal = time.monotonic() + self.journal_period_s
                self._stop.wait(self.status_period_s)
        except BaseException as e:  # pragma: no cover - surfaced in results
            self.error = e

    def poll_status(self) -> list[Any]:
        sts = self.cluster.statuses(timeout=0.5)
        with self._lock:
            for i, st in enumerate(sts):
                self.last_status[i] = st
                if st is None:
                    key: Any = ("unreachable",)
                    value: dict[str, Any] = {"reachable": False}
                else:
                    role = ROLE_NAMES.get(st.role, "unknown")
                    key = (role, st.term, st.leader_id, st.serving)
                    value = {"reachable": True, "role": role, "term": st.term, "leader": st.leader_id,
                             "serving": st.serving, "commit_index": st.commit_index,
                             "quorum_id": st.quorum.quorum_id if st.has_quorum else None}
                if key != self._seen[i]:
                    self._seen[i] = key
                    self.history.append(MONITOR, INFO, "status", value, self.cluster.node_id(i))
        return sts

    def poll_journals(self, statuses: list[Any] | None = None) -> None:
        """Absorb committed entries from each node whose commit index is known (asked just before
        the file is read), and keep every new snapshot file of each node."""
        sts = self.cluster.statuses(timeout=0.5) if statuses is None else statuses
        for i, st in enumerate(sts):
            self.keep_snapshot(i)
            if st is None:
                continue
            entries = parse_journal(self.cluster.data_dir(i) / "raft.journal")
            with self._lock:
                self.logs[i].absorb(entries, st.commit_index)

    def keep_snapshot(self, i: int) -> None:
        path = self.cluster.data_dir(i) / "raft.snapshot"
        try:
            stat = path.stat()
        except FileNotFoundError:
            return
        key = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
        if key == self._snapshot_stat[i]:
            return
        snap = read_snapshot(path.parent)
        if snap is not None:
            self._snapshot_stat[i] = key
            self.snapshots[i][snap[0]] = snap[1]
