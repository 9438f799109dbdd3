"""raft.durable_journal and raft.extensions.durable_sync: the Raft log, term and vote on disk before the node
acts on them (issue 32).

Unit tests, no processes: the file layer (``os.pwrite``, ``os.fsync``, ``os.fdatasync``,
``os.replace`` as the journal and ``durable_files`` call them) is instrumented to record the order
of writes, syncs and renames, and the node's acknowledgement is recorded in the same list, so each
test fails if a sync comes after what it must precede or is missing. pysyncobj's own
``FileJournal`` reads what ``DurableJournal`` writes and the other way round (the on-disk format
is unchanged: rolling upgrades and downgrades keep their journal). The power-loss behaviour
itself is tested end to end on the lazy filesystem (tests/fault_injection/test_power_loss.py).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pysyncobj.config import SERIALIZER_STATE
from pysyncobj.journal import FileJournal

from lighthouse_cluster import durable_files
from lighthouse_cluster.raft import durable_journal
from lighthouse_cluster.raft.durable_journal import DurableJournal, StorageFailure
from lighthouse_cluster.raft.durable_snapshot import DurableSnapshotFile
from lighthouse_cluster.raft.journal import JOURNAL_FILE, SNAPSHOT_FILE, journal_header, read_records
from lighthouse_cluster.raft.pysyncobj_internals import JOURNAL_FIRST_RECORD_OFFSET, Serializer, StoragePath


class FileLayer:
    """Records every write, sync and rename the journal makes, in order, as (op, file name)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, str]] = []
        self.names: dict[int, str] = {}
        real_open, real_close = os.open, os.close
        real_pwrite, real_write = os.pwrite, os.write
        real_fsync, real_fdatasync, real_replace = os.fsync, os.fdatasync, os.replace

        def open_(path: Any, flags: int, mode: int = 0o777, **kw: Any) -> int:
            fd = real_open(path, flags, mode, **kw)
            self.names[fd] = os.path.basename(os.fspath(path)) or os.fspath(path)
            return fd

        def close(fd: int) -> None:
            self.names.pop(fd, None)
            real_close(fd)

        def pwrite(fd: int, data: Any, offset: int) -> int:
            self.events.append(("write", self.names.get(fd, "?")))
            return real_pwrite(fd, data, offset)

        def write(fd: int, data: Any) -> int:
            self.events.append(("write", self.names.get(fd, "?")))
            return real_write(fd, data)

        def fsync(fd: int) -> None:
            self.events.append(("fsync", self.names.get(fd, "?")))
            real_fsync(fd)

        def fdatasync(fd: int) -> None:
            self.events.append(("fsync", self.names.get(fd, "?")))
            real_fdatasync(fd)

        def replace(src: Any, dst: Any) -> None:
            self.events.append(("rename", os.path.basename(os.fspath(dst))))
            real_replace(src, dst)

        for name, fn in (("open", open_), ("close", close), ("pwrite", pwrite), ("write", write), ("fsync", fsync),
                         ("fdatasync", fdatasync), ("replace", replace)):
            monkeypatch.setattr(os, name, fn)

    def mark(self, what: str) -> None:
        self.events.append((what, ""))

    def take(self) -> list[tuple[str, str]]:
        events, self.events = self.events, []
        return events


def recorded_failures() -> tuple[list[str], Any]:
    seen: list[str] = []
    return seen, lambda what, error: seen.append(what)


@pytest.fixture
def files(monkeypatch: pytest.MonkeyPatch) -> FileLayer:
    return FileLayer(monkeypatch)


def entries(n: int, first: int = 1, term: int = 1) -> list[tuple[bytes, int, int]]:
    return [(b"\x00command %d" % i, i, term) for i in range(first, first + n)]


# -- what is written, and when ---------------------------------------------------------------------


def test_a_new_journal_exists_durably_before_anything_else(tmp_path: Path, files: FileLayer) -> None:
    DurableJournal(str(tmp_path / "d" / JOURNAL_FILE))
    events = files.take()
    # The data directory made durable in its parent, then the journal: temp file synced, renamed,
    # directory synced.
    assert events[-4:] == [("write", "raft.journal.tmp"), ("fsync", "raft.journal.tmp"), ("rename", "raft.journal"),
                           ("fsync", "d")]
    assert ("fsync", tmp_path.name) in events[:-4]
    assert (tmp_path / "d" / JOURNAL_FILE).read_bytes() == journal_header()


def test_added_entries_are_written_and_synced_together_once_per_batch(tmp_path: Path, files: FileLayer) -> None:
    j = DurableJournal(str(tmp_path / JOURNAL_FILE))
    files.take()
    for e in entries(5):
        j.add(*e)
    assert files.take() == []            # nothing written before sync(): the batch is the node's to close
    assert j.unsynced
    j.sync()
    # The records, the header's end offset, one fdatasync: five entries, one sync.
    assert files.take() == [("write", "raft.journal"), ("write", "raft.journal"), ("fsync", "raft.journal")]
    assert (j.syncs, j.entries_synced) == (2, 5)   # the first: the new journal itself
    j.sync()
    assert files.take() == []            # nothing new: no write, no sync (heartbeats cost nothing)
    assert [(idx, term, cmd) for idx, term, cmd in read_records((tmp_path / JOURNAL_FILE).read_bytes())[0]] == \
        [(i, t, c) for c, i, t in entries(5)]


def test_the_term_and_vote_are_durable_before_set_current_term_returns(tmp_path: Path, files: FileLayer) -> None:
    j = DurableJournal(str(tmp_path / JOURNAL_FILE))
    files.take()
    j.setCurrentTerm(7, "n2")
    files.mark("returned")
    assert files.take() == [("write", "raft.journal.meta.tmp"), ("fsync", "raft.journal.meta.tmp"),
                            ("rename", "raft.journal.meta"), ("fsync", tmp_path.name), ("returned", "")]
    again = DurableJournal(str(tmp_path / JOURNAL_FILE))
    assert (again.getCurrentTerm(), again.getVotedForNodeId()) == (7, "n2")


def test_the_commit_index_is_saved_about_once_a_second(tmp_path: Path, files: FileLayer) -> None:
    j = DurableJournal(str(tmp_path / JOURNAL_FILE))
    files.take()
    j.setRaftCommitIndex(5)
    assert files.take() == []
    j.onOneSecondTimer()
    assert ("rename", "raft.journal.meta") in files.take()
    j.onOneSecondTimer()
    assert files.take() == []
    assert DurableJournal(str(tmp_path / JOURNAL_FILE)).getRaftCommitIndex() == 5


def test_a_truncation_then_new_entries_is_one_batch(tmp_path: Path) -> None:
    path = tmp_path / JOURNAL_FILE
    j = DurableJournal(str(path))
    for e in entries(6):
        j.add(*e)
    j.sync()
    j.deleteEntriesFrom(3)               # entries 4..6 conflicted with a new leader's
    for e in entries(2, first=4, term=2):
        j.add(*e)
    assert j.unsynced
    j.sync()
    on_disk = read_records(path.read_bytes())[0]
    assert [(i, t) for i, t, _ in on_disk] == [(1, 1), (2, 1), (3, 1), (4, 2), (5, 2)]
    # A truncation alone moves the header back and is synced too.
    j.deleteEntriesFrom(4)
    j.sync()
    assert [i for i, _, _ in read_records(path.read_bytes())[0]] == [1, 2, 3, 4]


def test_a_compaction_or_snapshot_install_rewrites_the_file_atomically(tmp_path: Path, files: FileLayer) -> None:
    path = tmp_path / JOURNAL_FILE
    j = DurableJournal(str(path))
    for e in entries(10):
        j.add(*e)
    j.sync()
    files.take()
    j.deleteEntriesTo(7)                 # pysyncobj: clear() and add() the entries kept
    assert files.take() == []
    j.sync()
    assert files.take() == [("write", "raft.journal.tmp"), ("fsync", "raft.journal.tmp"), ("rename", "raft.journal"),
                            ("fsync", tmp_path.name)]
    assert [i for i, _, _ in read_records(path.read_bytes())[0]] == [8, 9, 10]
    j.add(*entries(1, first=11)[0])      # appends go on in the new file
    j.sync()
    assert [i for i, _, _ in read_records(path.read_bytes())[0]] == [8, 9, 10, 11]


def test_unsafe_no_fsync_writes_the_same_bytes_at_the_same_moments_and_syncs_nothing(
        tmp_path: Path, files: FileLayer) -> None:
    synced, unsynced = tmp_path / "synced", tmp_path / "unsynced"
    for where, sync in ((synced, True), (unsynced, False)):
        j = DurableJournal(str(where / JOURNAL_FILE), sync=sync)
        for e in entries(4):
            j.add(*e)
        j.sync()
        j.setCurrentTerm(3, "n1")
        j.deleteEntriesTo(2)
        j.sync()
        events = files.take()
        if not sync:
            assert [e for e in events if e[0] == "fsync"] == []
            renames = [e for e in events if e[0] == "rename"]
            assert renames == [("rename", "raft.journal"), ("rename", "raft.journal.meta"), ("rename", "raft.journal")]
    for name in (JOURNAL_FILE, JOURNAL_FILE + ".meta"):
        assert (synced / name).read_bytes() == (unsynced / name).read_bytes()


def test_a_failed_sync_is_reported_and_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen, on_failure = recorded_failures()
    j = DurableJournal(str(tmp_path / JOURNAL_FILE), on_failure=on_failure)
    j.add(*entries(1)[0])

    def eio(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", eio)
    monkeypatch.setattr(os, "fsync", eio)
    with pytest.raises(StorageFailure, match="Raft journal"):
        j.sync()
    with pytest.raises(StorageFailure, match="term and vote"):
        j.setCurrentTerm(2, None)
    assert seen == ["the Raft journal", "the Raft term and vote"]


def test_by_default_a_failed_sync_stops_the_process() -> None:
    assert DurableJournal.__init__.__kwdefaults__["on_failure"] is durable_files.halt_on_storage_failure


# -- the format: pysyncobj's, both ways ---------------------------------------------------------------


def test_pysyncobjs_file_journal_reads_what_the_durable_journal_wrote(tmp_path: Path) -> None:
    path = str(tmp_path / JOURNAL_FILE)
    j = DurableJournal(path)
    for e in entries(20):
        j.add(*e)
    j.deleteEntriesFrom(15)
    j.setCurrentTerm(4, "n3")
    j.setRaftCommitIndex(12)
    j._destroy()
    old = FileJournal(path)              # a node downgraded to the release before this one
    assert [old[i] for i in range(len(old))] == entries(15)
    assert (old.getCurrentTerm(), old.getVotedForNodeId(), old.getRaftCommitIndex()) == (4, "n3", 12)
    old._destroy()


def test_the_durable_journal_reads_a_data_directory_pysyncobj_wrote(tmp_path: Path) -> None:
    path = str(tmp_path / JOURNAL_FILE)
    old = FileJournal(path)              # an existing node's data directory (mmap'd, preallocated)
    for e in entries(30):
        old.add(*e)
    old.deleteEntriesFrom(25)
    old.setCurrentTerm(6, "n1")
    old.setRaftCommitIndex(20)
    old.onOneSecondTimer()
    old._destroy()
    j = DurableJournal(path)
    assert [j[i] for i in range(len(j))] == entries(25)
    assert (j.getCurrentTerm(), j.getVotedForNodeId(), j.getRaftCommitIndex()) == (6, "n1", 20)
    assert not j.unsynced
    j.add(*entries(1, first=26)[0])      # and goes on appending where pysyncobj stopped
    j._destroy()
    again = FileJournal(path)
    assert [again[i] for i in range(len(again))] == entries(26)
    again._destroy()


def test_a_write_torn_by_a_power_loss_ends_the_journal_at_the_last_whole_record(tmp_path: Path) -> None:
    path = tmp_path / JOURNAL_FILE
    j = DurableJournal(str(path))
    for e in entries(5):
        j.add(*e)
    j._destroy()
    data = bytearray(path.read_bytes())
    # The header reached the disk, the last record only in part (zeros where the page was not written).
    data[-10:] = b"\0" * 10
    path.write_bytes(bytes(data))
    j = DurableJournal(str(path))
    assert [j[i] for i in range(len(j))] == entries(4)
    assert j.unsynced                    # the header is rewritten at the next sync
    j.add(*entries(1, first=5, term=2)[0])
    j.sync()
    assert [(i, t) for i, t, _ in read_records(path.read_bytes())[0]] == [(1, 1), (2, 1), (3, 1), (4, 1), (5, 2)]


def test_a_journal_with_an_older_record_after_a_newer_term_stops_before_it(tmp_path: Path) -> None:
    """A stale record left after a truncation, exposed by a torn header: terms never decrease."""
    path = tmp_path / JOURNAL_FILE
    j = DurableJournal(str(path))
    for e in entries(3, term=3):
        j.add(*e)
    j._destroy()
    data = bytearray(path.read_bytes())
    # Record 3's term rewritten to 2 (its index still follows): not a log Raft can have.
    third = JOURNAL_FIRST_RECORD_OFFSET + 2 * (len(entries(1)[0][0]) + 24)
    struct.pack_into("<Q", data, third + 12, 2)
    path.write_bytes(bytes(data))
    assert len(DurableJournal(str(path))) == 2


def test_a_journal_file_without_a_header_starts_empty(tmp_path: Path) -> None:
    path = tmp_path / JOURNAL_FILE
    path.write_bytes(b"")                # created by an older version, lost its content to a crash
    j = DurableJournal(str(path))
    assert len(j) == 0
    assert path.read_bytes() == journal_header()


# -- the node: sync before the acknowledgement, before the leader's own count --------------------------


def test_storage_paths_go_to_the_durable_journal_and_snapshot_file_and_other_names_to_pysyncobjs(
        tmp_path: Path) -> None:
    # The journal: opened per node by the host for a StoragePath (RaftHost.adopt_journal).
    journal = durable_journal.open_journal(StoragePath(str(tmp_path / "a" / JOURNAL_FILE), sync=False))
    assert isinstance(journal, DurableJournal) and not journal.sync_enabled
    # The snapshot file: a node with a data directory adopts one that syncs, any other keeps
    # pysyncobj's (RaftHost.adopt_serializer); nothing of pysyncobj's is changed process-wide.
    from pysyncobj import SyncObjConf, serializer
    from lighthouse_cluster.raft.host import RaftHost
    original = Serializer(None, 1024, False, None, None, None)
    synced = RaftHost.adopt_serializer(SimpleNamespace(conf=SyncObjConf(
        fullDumpFile=StoragePath(str(tmp_path / SNAPSHOT_FILE)), logCompactionBatchSize=512)), original)
    assert type(synced) is DurableSnapshotFile and synced.path == str(tmp_path / SNAPSHOT_FILE)
    plain = SimpleNamespace(conf=SyncObjConf(fullDumpFile=str(tmp_path / "other.snapshot")))
    assert RaftHost.adopt_serializer(plain, original) is original
    assert serializer.atomicReplace is os.rename


SNAPSHOT_DATA = ({"raftCurrentTerm": 3}, ("entry", 7, 2), ("entry", 6, 2), {"n1", "n2"})


@pytest.mark.parametrize("sync", [True, False])
def test_a_written_snapshot_is_synced_before_its_rename_and_its_directory_after(
        tmp_path: Path, files: FileLayer, sync: bool) -> None:
    path = StoragePath(str(tmp_path / SNAPSHOT_FILE), sync=sync)
    snapshots = DurableSnapshotFile(path, 1024)
    files.take()
    snapshots.serialize(SNAPSHOT_DATA, 7)
    synced = [("fsync", SNAPSHOT_FILE + ".tmp"), ("rename", SNAPSHOT_FILE), ("fsync", tmp_path.name)]
    assert [e for e in files.take() if e[0] != "write"] == (synced if sync else [("rename", SNAPSHOT_FILE)])
    assert snapshots.checkSerializing() == (SERIALIZER_STATE.SUCCESS, 7)
    # The format is pysyncobj's own: its Serializer reads the file, and sends it as it is.
    assert Serializer(path, 1024, False, None, None, None).deserialize() == SNAPSHOT_DATA


def test_a_received_snapshot_is_synced_before_its_rename_and_its_directory_before_it_is_loaded(
        tmp_path: Path, files: FileLayer, monkeypatch: pytest.MonkeyPatch) -> None:
    from pysyncobj import serializer
    rename = serializer.atomicReplace  # pysyncobj's own (os.rename), recorded here: it renames a received file

    def recorded(src: str, dst: str) -> Any:
        files.events.append(("rename", os.path.basename(dst)))
        return rename(src, dst)

    monkeypatch.setattr(serializer, "atomicReplace", recorded)
    sender = Serializer(str(tmp_path / "leader.snapshot"), 16, False, None, None, None)
    sender.serialize(SNAPSHOT_DATA, 7)
    assert sender.checkSerializing() == (SERIALIZER_STATE.SUCCESS, 7)
    receiver = DurableSnapshotFile(StoragePath(str(tmp_path / SNAPSHOT_FILE)), 16)
    files.take()
    chunks = 0
    while True:
        chunk = sender.getTransmissionData("t")
        chunks += 1
        done = receiver.setTransmissionData(chunk)
        if chunk[2]:
            break
        assert not done and not [e for e in files.take() if e[0] != "write"], "synced or renamed before the end"
    assert done and chunks > 2
    assert files.take() == [("fsync", SNAPSHOT_FILE + ".1.tmp"), ("rename", SNAPSHOT_FILE), ("fsync", tmp_path.name)]
    assert receiver.deserialize() == SNAPSHOT_DATA


def test_a_snapshot_that_cannot_be_written_is_reported_and_tried_again(tmp_path: Path) -> None:
    snapshots = DurableSnapshotFile(StoragePath(str(tmp_path / "missing" / SNAPSHOT_FILE)), 1024)
    snapshots.serialize(SNAPSHOT_DATA, 7)
    assert snapshots.checkSerializing() == (SERIALIZER_STATE.FAILED, 7)
    (tmp_path / "missing").mkdir()
    snapshots.serialize(SNAPSHOT_DATA, 8)
    assert snapshots.checkSerializing() == (SERIALIZER_STATE.SUCCESS, 8)


def test_the_meta_file_is_named_as_pysyncobj_names_it(tmp_path: Path) -> None:
    j = DurableJournal(str(tmp_path / JOURNAL_FILE))
    j.setCurrentTerm(1, None)
    assert j.meta_store.path == str(tmp_path / JOURNAL_FILE) + durable_journal.META_SUFFIX
    assert FileJournal(str(tmp_path / JOURNAL_FILE)).getCurrentTerm() == 1
