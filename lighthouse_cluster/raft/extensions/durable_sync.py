"""``DurableSync``: a node says nothing that its disk does not back.

Raft lets a node act on a log entry only once the entry is durable: a follower acknowledges an
append_entries only after the entries are on its disk, and a leader counts its own copy toward
a commit only after it is on its own (Raft thesis 10.2.1: the leader may send the entries before
that, in parallel with its own write). The journal is ``DurableJournal`` (``raft.durable_journal``),
which writes and syncs only when asked (``sync()``); this extension asks at the three moments
that need it, so one fdatasync covers every entry that arrived since:

* before every acknowledgement (``ack_out``: the only way pysyncobj answers an append_entries);
  it is the last ``ack_out`` hook, so an acknowledgement held back costs no sync;
* at the end of every tick, just before the tick thread waits (``on_tick_callback``): the entries
  a leader appended in this tick, already sent to its followers, become durable while the
  followers write theirs; their acknowledgements can only be read in that wait, so they are
  counted, in the next tick, next to a durable own copy;
* at the start of every tick (``before_tick``, the last one, right before pysyncobj's own, which
  counts the leader's copy): what was appended while handling messages (a new leader's no-op).

Each is a no-op when nothing changed. The term and the vote need no hook:
``DurableJournal.setCurrentTerm`` syncs before it returns, which is before pysyncobj sends the
vote or the vote request. A node with no data directory (pysyncobj's ``MemoryJournal``) has
nothing to sync. A write or sync that fails stops the process
(``durable_files.halt_on_storage_failure``, exit status 74).
"""

from __future__ import annotations

from lighthouse_cluster.raft.host import Ack, Extension

__all__ = ["DurableSync"]


class DurableSync(Extension):
    """Syncs the journal before the node acknowledges entries or counts its own copy."""

    def sync_journal(self) -> None:
        """Make what the journal holds durable now (on the tick thread)."""
        sync = getattr(self.host.pso_journal, "sync", None)
        if sync is not None:  # None: pysyncobj's MemoryJournal (no data directory)
            sync()

    def before_tick(self) -> None:
        self.sync_journal()

    def on_tick_callback(self) -> None:
        self.sync_journal()

    def ack_out(self, ack: Ack) -> bool:
        self.sync_journal()
        return True
