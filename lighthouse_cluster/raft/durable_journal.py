"""A node's Raft log, term and vote on disk before it acts on them: ``DurableJournal``.

Raft's safety rests on every node keeping, across a crash of its machine, what it said it keeps:
an entry it acknowledged to a leader, an entry a leader counted as its own copy toward a commit,
and the term and vote it announced. pysyncobj 0.3.17's ``FileJournal`` syncs none of them: the
log is an mmap that is never flushed, the term and vote a temp file renamed with no fsync. That
survives a SIGKILL (the page cache does) but not a power loss: a node that forgot its vote can
vote twice in a term (two leaders), and two of three nodes that forgot acknowledged entries can
elect a leader without a committed quorum (``docs/operations.md``, "What survives what").

``DurableJournal`` is pysyncobj's journal interface (what ``FileJournal`` implements, listed in
``pysyncobj_internals.JOURNAL_INTERFACE``), plugged in where pysyncobj creates its own
(``RaftHost.adopt_journal``). It keeps pysyncobj's file format byte for byte
(``raft.journal``), so existing data directories read as they are and a downgrade still reads
what it wrote. What changes is when bytes reach the disk:

* ``add`` / ``deleteEntriesFrom`` only change the entries in memory and mark them unwritten;
  ``sync()`` writes the new records and the header (``pwrite``) and makes them durable with one
  ``fdatasync``, however many entries arrived since the last one: the batch. The node calls
  ``sync()`` before it acknowledges an append_entries, and on every tick before a leader counts
  its own copy (``raft.extensions.durable_sync``);
* ``clear`` / ``deleteEntriesTo`` (a snapshot installed, the log compacted) rewrite the whole file:
  a new file, synced, renamed over the old, the directory synced, so a crash in the middle leaves
  the old journal or the new one, never records of both;
* the term and vote (``setCurrentTerm``) are written and synced before it returns, so before
  pysyncobj sends the vote or the vote request that announces them: the meta file, pysyncobj's
  ``raft.journal.meta`` (same name and pickle), replaced with ``durable_files.write_durably``;
  the commit index, which Raft does not need on disk, rides along about once a second.

With ``sync=False`` (``--unsafe-no-fsync``) every write happens at the same moments and no
fsync does: a process crash loses nothing, a power loss loses what the kernel had not written back.
A write or sync that fails stops the process (``durable_files.halt_on_storage_failure``): the
node cannot know what reached the disk (after a failed fsync Linux may drop the dirty pages and
report the next fsync clean), and must not go on to acknowledge what it may not have.
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

from lighthouse_cluster.durable_files import halt_on_storage_failure, make_directory_durably, write_durably
from lighthouse_cluster.raft.journal import (encode_record, journal_header, last_record_offset_bytes,
                                             read_records)
from lighthouse_cluster.raft.pysyncobj_internals import (JOURNAL_APP_NAME, JOURNAL_FIRST_RECORD_OFFSET,
                                                       JOURNAL_LAST_RECORD_OFFSET_OFFSET, StoragePath, pso_pickle)

__all__ = ["DurableJournal", "MetaStore", "StorageFailure", "open_journal"]

log = logging.getLogger(__name__)

META_SUFFIX = ".meta"   # pysyncobj's: the meta file is the journal's name + ".meta"


class StorageFailure(OSError):
    """A write or sync of the Raft files failed: what is on disk is unknown; the node must stop."""


class MetaStore:
    """The term, the vote and the commit index (pysyncobj's meta file and format: a pickled dict
    with ``currentTerm``, ``votedForNodeId``, ``raftCommitIndex``), each save atomic and, unless
    ``sync`` is False, durable before ``save`` returns."""

    def __init__(self, path: str, *, sync: bool) -> None:
        self.path = path
        self.sync = sync
        self.saves = 0

    def load(self) -> dict[str, Any]:
        try:
            with open(self.path, "rb") as f:
                meta = pso_pickle.loads(f.read())
        except FileNotFoundError:
            return {}
        except Exception as e:  # noqa: BLE001 -- as pysyncobj: an unreadable meta file is none
            log.warning("unreadable Raft meta file %s (%r): starting from term 0 with no vote", self.path, e)
            return {}
        return meta if isinstance(meta, dict) else {}

    def save(self, meta: dict[str, Any]) -> None:
        try:
            write_durably(self.path, pso_pickle.dumps(meta), sync=self.sync)
        except OSError as e:
            raise StorageFailure(e.errno, f"cannot save the Raft term and vote to {self.path}: {e}") from e
        self.saves += 1


class DurableJournal:
    """pysyncobj's journal (entries ``(command, index, term)``, term and vote, commit index) in
    ``path``, written when ``sync()`` is called; see the module docstring."""

    def __init__(self, path: str, *, sync: bool = True,
                 on_failure: Callable[[str, BaseException], None] = halt_on_storage_failure) -> None:
        """``on_failure(what, error)``: called when a write or sync fails, before
        ``StorageFailure`` is raised; by default it ends the process (tests record instead)."""
        self.path = path
        self.sync_enabled = sync
        self._on_failure = on_failure
        self.meta_store = MetaStore(path + META_SUFFIX, sync=sync)
        self._meta = self.meta_store.load()
        self._meta_saved = True
        # Counters for status, benchmarks and tests.
        self.syncs = 0              # sync() calls that wrote something
        self.entries_synced = 0     # entries made durable by them (entries / syncs: the batch size)
        self.sync_seconds = 0.0     # time spent writing and syncing the journal (not the meta file)
        make_directory_durably(os.path.dirname(os.path.abspath(path)), sync=sync)
        try:
            data = Path(path).read_bytes()
        except FileNotFoundError:
            data = None
        records, end = read_records(data or b"")
        self._entries: list[tuple[bytes, int, int]] = [(entry, idx, term) for idx, term, entry in records]
        self._offsets: list[int] = []     # the file offset of each entry's record
        off = JOURNAL_FIRST_RECORD_OFFSET
        for idx, term, entry in records:
            self._offsets.append(off)
            off += len(entry) + 24
        self._end = end                   # where the next record goes
        self._written_end = end           # the file holds every record before this offset
        self._header_written = True       # the file's header says the records end at _written_end
        is_journal = data is not None and len(data) >= JOURNAL_FIRST_RECORD_OFFSET and data.startswith(JOURNAL_APP_NAME)
        if data and not is_journal:
            log.warning("Raft journal %s has no readable header (%d bytes; a creation torn by a crash?): "
                        "starting an empty journal", path, len(data))
        self._rewrite = not is_journal
        if is_journal:
            assert data is not None
            stated = int.from_bytes(data[JOURNAL_LAST_RECORD_OFFSET_OFFSET:JOURNAL_LAST_RECORD_OFFSET_OFFSET + 4],
                                    "little")
            if stated != end:
                # A power loss tore the last writes (or a crash came between the records and the
                # header): keep the consistent prefix, and say so.
                log.warning("Raft journal %s: its header says the records end at %d, the readable ones end at "
                            "%d (entries up to index %s): keeping those", path, stated, end,
                            records[-1][0] if records else "none")
                self._header_written = False
        self._fd = -1
        if self._rewrite:
            self.sync()  # a new journal exists, durably, before anything is said
        else:
            self._fd = os.open(path, os.O_RDWR)

    # -- pysyncobj's journal interface --------------------------------------------------------

    def add(self, command: bytes, idx: int, term: int) -> None:
        if not isinstance(command, bytes):
            command = bytes(command)
        self._entries.append((command, idx, term))
        self._offsets.append(self._end)
        self._end += len(command) + 24

    def clear(self) -> None:
        self._entries = []
        self._offsets = []
        self._end = JOURNAL_FIRST_RECORD_OFFSET
        self._rewrite = True

    def deleteEntriesFrom(self, entryFrom: int) -> None:  # noqa: N802, N803 -- pysyncobj's names
        if entryFrom >= len(self._entries):
            return
        self._end = self._offsets[entryFrom]
        del self._entries[entryFrom:]
        del self._offsets[entryFrom:]
        if self._end < self._written_end:
            self._written_end = self._end
            self._header_written = False

    def deleteEntriesTo(self, entryTo: int) -> None:  # noqa: N802, N803 -- pysyncobj's names
        kept = self._entries[entryTo:]
        self.clear()
        for entry in kept:
            self.add(*entry)

    def __getitem__(self, item: Any) -> Any:
        return self._entries[item]

    def __len__(self) -> int:
        return len(self._entries)

    def _destroy(self) -> None:
        try:
            self.sync()
            if not self._meta_saved:
                self._save_meta()
        finally:
            self.close()

    def close(self) -> None:
        """Release the journal file without writing anything more (``_destroy``, pysyncobj's
        shutdown, syncs first)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def flush(self) -> None:
        self.sync()

    def setRaftCommitIndex(self, raftCommitIndex: int) -> None:  # noqa: N802, N803 -- pysyncobj's names
        # A follower sets it on every append_entries, changed or not: marking the meta file
        # unsaved each time rewrote it every second for nothing (what is saved is the same).
        if raftCommitIndex == self.getRaftCommitIndex():
            return
        self._meta["raftCommitIndex"] = raftCommitIndex
        self._meta_saved = False

    def getRaftCommitIndex(self) -> int:  # noqa: N802
        return int(self._meta.get("raftCommitIndex", 1))

    def setCurrentTerm(self, term: int, votedForNodeId: Any) -> None:  # noqa: N802, N803
        # Raft: the term and the vote are on disk before any message that announces them.
        self._meta["currentTerm"] = term
        self._meta["votedForNodeId"] = votedForNodeId
        self._save_meta()

    def getCurrentTerm(self) -> int:  # noqa: N802
        return int(self._meta.get("currentTerm", 0))

    def getVotedForNodeId(self) -> Any:  # noqa: N802
        return self._meta.get("votedForNodeId", None)

    def onOneSecondTimer(self) -> None:  # noqa: N802
        if not self._meta_saved:
            self._save_meta()

    def _save_meta(self) -> None:
        try:
            self.meta_store.save(self._meta)
        except StorageFailure as e:
            self._on_failure("the Raft term and vote", e)
            raise
        self._meta_saved = True

    # -- durability ------------------------------------------------------------------------------

    @property
    def unsynced(self) -> bool:
        """Whether entries or truncations are not on disk yet (``sync()`` has work)."""
        return self._rewrite or self._written_end < self._end or not self._header_written

    def sync(self) -> None:
        """Make every entry added and every truncation durable: the new records and the header
        written, then one fdatasync (the batch); after a ``clear``, the whole file rewritten and
        renamed into place. A no-op when nothing changed since the last call."""
        if not self.unsynced:
            return
        started = time.perf_counter()
        pending = len(self._entries) - bisect.bisect_left(self._offsets, self._written_end)
        try:
            if self._rewrite:
                self._rewrite_file()
            else:
                first = bisect.bisect_left(self._offsets, self._written_end)
                records = b"".join(encode_record(idx, term, command) for command, idx, term in self._entries[first:])
                _pwrite_all(self._fd, records, self._written_end)
                _pwrite_all(self._fd, last_record_offset_bytes(self._end), JOURNAL_LAST_RECORD_OFFSET_OFFSET)
                if self.sync_enabled:
                    os.fdatasync(self._fd)
        except OSError as e:
            failure = StorageFailure(e.errno, f"cannot write the Raft journal {self.path}: {e}")
            self._on_failure("the Raft journal", failure)
            raise failure from e
        self._written_end = self._end
        self._header_written = True
        self.syncs += 1
        self.entries_synced += pending
        self.sync_seconds += time.perf_counter() - started

    def _rewrite_file(self) -> None:
        body = b"".join(encode_record(idx, term, command) for command, idx, term in self._entries)
        write_durably(self.path, journal_header(self._end) + body, sync=self.sync_enabled)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_RDWR)
        self._rewrite = False


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def open_journal(path: StoragePath) -> DurableJournal:
    """The journal pysyncobj gets for a ``StoragePath`` (``RaftHost.adopt_journal``)."""
    return DurableJournal(str(path), sync=path.sync)
