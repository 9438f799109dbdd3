"""The format of a node's Raft files in its data directory: the journal's entries, the commit
index pysyncobj last saved, the snapshot, and our command inside a journal entry; read from
outside the node (``parse_journal``: tools, the fault-injection monitor) and by the node's own
journal (``raft.durable_journal``: ``read_records``, ``encode_record``, ``journal_header``).

pysyncobj's ``FileJournal`` (``raft.journal``) is an mmap'd file: a header (``PYSYNCOBJ``,
version, format, the offset after the last record) then records ``[len][index, term, entry][len]``.
``DurableJournal`` writes the very same bytes (with write + fdatasync instead of an mmap), so a
data directory written by either reads with the other: no migration, and a rolling upgrade or a
downgrade keeps its journal. ``read_records`` keeps the longest self-consistent prefix (sizes and
trailers match, indexes consecutive, terms never decreasing): a write torn by a power loss ends
the journal there instead of being read as garbage. ``parse_journal`` reads *read-only*: the node
may be running, so the file is read twice and only the longest self-consistent prefix both reads
agree on is kept. An entry is pysyncobj's: a command type byte, then, for
``ReplicatedState.apply_command(payload)``, the pickled call (``command_payload`` returns the
payload, ``journal_entry`` builds an entry). ``raft.journal.meta`` holds the term, the vote and
the commit index (saved about once a second); ``raft.snapshot`` is a gzipped pickle of
(consumers' states, last included entry, ...). These formats are pysyncobj 0.3.17's, the pinned
version (``pysyncobj_internals``).
"""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

from lighthouse_cluster.raft.pysyncobj_internals import (COMMAND_TYPE, JOURNAL_APP_NAME, JOURNAL_APP_VERSION,
                                                       JOURNAL_FIRST_RECORD_OFFSET, JOURNAL_FORMAT_VERSION,
                                                       JOURNAL_LAST_RECORD_OFFSET_OFFSET, JOURNAL_NAME_SIZE,
                                                       JOURNAL_VERSION_SIZE, pso_pickle)

JOURNAL_FILE = "raft.journal"
META_FILE = JOURNAL_FILE + ".meta"     # pysyncobj's name for the journal's metadata
SNAPSHOT_FILE = "raft.snapshot"

Entry = tuple[int, int, bytes]   # (index, term, entry bytes as pysyncobj stores them)

_RECORD_HEADER = 16              # index, term: two little-endian uint64


def journal_header(last_record_offset: int = JOURNAL_FIRST_RECORD_OFFSET) -> bytes:
    """The journal file's header, as pysyncobj writes it, saying the records end at
    ``last_record_offset``."""
    return (JOURNAL_APP_NAME.ljust(JOURNAL_NAME_SIZE, b"\0") + JOURNAL_APP_VERSION.ljust(JOURNAL_VERSION_SIZE, b"\0")
            + struct.pack("<II", JOURNAL_FORMAT_VERSION, last_record_offset))


def last_record_offset_bytes(offset: int) -> bytes:
    """The header's last field (written at ``JOURNAL_LAST_RECORD_OFFSET_OFFSET``)."""
    return struct.pack("<I", offset)


def encode_record(idx: int, term: int, entry: bytes) -> bytes:
    """One journal record: ``[len][index, term, entry][len]``."""
    body = struct.pack("<QQ", idx, term) + entry
    size = struct.pack("<I", len(body))
    return size + body + size


def read_records(data: bytes) -> tuple[list[Entry], int]:
    """The records of a journal file's bytes, up to the last self-consistent one, and the offset
    after it (where the next record goes). A file that is not a journal (empty, or a header torn
    by a crash) reads as no records, ending at ``JOURNAL_FIRST_RECORD_OFFSET``."""
    if len(data) < JOURNAL_FIRST_RECORD_OFFSET or not data.startswith(JOURNAL_APP_NAME):
        return [], JOURNAL_FIRST_RECORD_OFFSET
    last = struct.unpack_from("<I", data, JOURNAL_LAST_RECORD_OFFSET_OFFSET)[0]
    last = min(last, len(data))
    out: list[Entry] = []
    off = JOURNAL_FIRST_RECORD_OFFSET
    while off + 4 <= last:
        size = struct.unpack_from("<I", data, off)[0]
        if size < _RECORD_HEADER or off + 8 + size > len(data):
            break
        (trailer,) = struct.unpack_from("<I", data, off + 4 + size)
        if trailer != size:
            break
        idx, term = struct.unpack_from("<QQ", data, off + 4)
        if out and (idx != out[-1][0] + 1 or term < out[-1][1]):
            break
        out.append((idx, term, bytes(data[off + 4 + _RECORD_HEADER: off + 4 + size])))
        off += size + 8
    return out, off


def parse_journal_bytes(data: bytes) -> list[Entry]:
    """The records of a journal file's bytes, up to the last self-consistent one."""
    return read_records(data)[0]


def parse_journal(path: Path) -> list[Entry]:
    """The entries of the journal file ``path`` (possibly live: read twice, the longest prefix both
    reads agree on is kept); [] when there is no such file."""
    try:
        first = path.read_bytes()
        second = path.read_bytes()
    except FileNotFoundError:
        return []
    a, b = parse_journal_bytes(first), parse_journal_bytes(second)
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def read_meta_commit_index(data_dir: Path) -> int | None:
    """The commit index pysyncobj last saved in ``data_dir``'s journal metadata (about once a
    second), or None when there is none yet."""
    try:
        meta = pso_pickle.loads((data_dir / META_FILE).read_bytes())
    except Exception:  # absent, or torn while being replaced
        return None
    value = meta.get("raftCommitIndex") if isinstance(meta, dict) else None
    return int(value) if isinstance(value, int) else None


def read_snapshot(data_dir: Path) -> tuple[int, bytes] | None:
    """(last included index, the state machine's msgpack snapshot), if the node ever compacted."""
    try:
        with gzip.open(data_dir / SNAPSHOT_FILE, "rb") as g:
            data = pso_pickle.load(g)
    except Exception:
        return None
    try:
        consumers = data[0][1:]
        return int(data[1][1]), bytes(consumers[0])
    except (TypeError, IndexError, ValueError):
        return None


def command_payload(entry: bytes) -> bytes | None:
    """The payload of ``ReplicatedState.apply_command`` in a journal entry (an encoded command),
    or None for pysyncobj's own entries (a new leader's no-op, membership changes). Raises
    ValueError for a replicated call that does not read as one."""
    if not entry or entry[0] != COMMAND_TYPE.REGULAR:
        return None
    try:
        call = pso_pickle.loads(entry[1:])
        payload = call[1][0]
    except Exception as e:
        raise ValueError(f"unreadable replicated call in a journal entry: {e!r}") from e
    if not isinstance(payload, bytes):
        raise ValueError(f"a replicated call whose argument is {type(payload).__name__}, not bytes")
    return payload


def journal_entry(payload: bytes) -> bytes:
    """The journal entry pysyncobj writes for ``ReplicatedState.apply_command(payload)`` (its only
    replicated method, id 0): for tests and tools that build journals."""
    return bytes([COMMAND_TYPE.REGULAR]) + pso_pickle.dumps((0, (payload,)))
