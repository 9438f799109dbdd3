"""``DurableSyncObj``: a node says nothing that its disk does not back.

Raft lets a node act on a log entry only once the entry is durable: a follower acknowledges an
append_entries only after the entries are on its disk, and a leader counts its own copy toward
a commit only after it is on its own (Raft thesis 10.2.1: the leader may send the entries before
that, in parallel with its own write). pysyncobj's journal is now ``DurableJournal``
(``raft.durable_journal``), which writes and syncs only when asked (``sync()``); this class asks
at the three moments that need it, so one fdatasync covers every entry that arrived since:

* before every acknowledgement (``pso_send_ack``: the only way pysyncobj answers an
  append_entries);
* at the end of every tick, just before the tick thread waits for messages: the entries a leader
  appended in this tick (the command queue's batch, a membership change), already sent to its
  followers, become durable while the followers write theirs; their acknowledgements can only
  be read in that wait, so they are counted, in the next tick, next to a durable own copy;
* at the start of every tick, before pysyncobj's own (which counts the leader's copy): what was
  appended while handling messages (a new leader's no-op) and not yet synced.

Each is a no-op when nothing changed (no entries: no fsync; heartbeats cost nothing). The term
and the vote need no hook: ``DurableJournal.setCurrentTerm`` syncs before it returns, which is
before pysyncobj sends the vote or the vote request. A node with no data directory (pysyncobj's
``MemoryJournal``) has nothing to sync. A write or sync that fails stops the process
(``durable_files.halt_on_storage_failure``, exit status 74).
"""

from __future__ import annotations

from typing import Any

from lighthouse_cluster.raft.pysyncobj_internals import SyncObjInternals


class DurableSyncObj(SyncObjInternals):
    """``SyncObj`` that syncs its journal before it acknowledges entries or counts its own copy
    (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The tick thread runs already; it picks the callback up at its next tick (an on-tick
        # callback runs after the command queue and the compaction, right before the wait).
        self.addOnTickCallback(self.sync_journal)

    def sync_journal(self) -> None:
        """Make what the journal holds durable now (on the tick thread; a disk that fails stops
        the process: ``DurableJournal``)."""
        sync = getattr(self.pso_journal, "sync", None)
        if sync is not None:  # None: pysyncobj's MemoryJournal (no data directory)
            sync()

    def _onTick(self, timeToWait: float = 0.0) -> None:  # noqa: N803 -- pysyncobj's name
        self.sync_journal()
        super()._onTick(timeToWait)

    def pso_send_ack(self, node: Any, reset: bool, next_index: int | None, success: bool) -> None:
        self.sync_journal()
        super().pso_send_ack(node, reset, next_index, success)
