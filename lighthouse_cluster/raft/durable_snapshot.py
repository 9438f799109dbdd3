"""A node's snapshot file, written and received durably: pysyncobj's ``Serializer`` for a node
with a data directory, adopted per node as pysyncobj stores it (``RaftHost.adopt_serializer``).

pysyncobj writes a snapshot to a temporary file, either its own (log compaction: ``<file>.tmp``)
or one its leader sends (``<file>.1.tmp``), and renames it over ``<file>`` with no sync; right
after, it deletes the journal entries the snapshot replaces, or clears the journal and
acknowledges a received one. A power loss could then leave neither the entries nor the snapshot.
Here, for a ``StoragePath`` (every ``RaftNode`` with a data directory):

* its own snapshot is written as pysyncobj writes it (gzip of pysyncobj's pickle of the same
  data: the file's format is unchanged) and put in place with ``durable_files.replace_durably``
  (the file synced, renamed, its directory synced) before ``serialize`` returns, hence before
  pysyncobj compacts the journal;
* a received snapshot's last chunk is handed to pysyncobj's ``setTransmissionData`` as two
  calls: the data (written), then, once the temporary file is synced, an empty last chunk
  (closed and renamed by pysyncobj); the directory is synced before it returns True, hence
  before pysyncobj loads the snapshot, clears the journal and acknowledges it.

With ``StoragePath.sync`` off (``--unsafe-no-fsync``) the same happens without the syncs. Every
other method is pysyncobj's. A snapshot that cannot be written is reported (log) and retried at
the next compaction, as pysyncobj does.
"""

from __future__ import annotations

import gzip
import logging
import os
from typing import Any

from lighthouse_cluster.durable_files import fsync_directory, fsync_file, replace_durably
from lighthouse_cluster.raft.pysyncobj_internals import Serializer, SerializerPrivates, StoragePath, pso_pickle

__all__ = ["DurableSnapshotFile", "RECEIVED_SUFFIX", "WRITTEN_SUFFIX"]

log = logging.getLogger(__name__)

# pysyncobj's temporary names, beside the snapshot file: its own snapshot, and a received one.
WRITTEN_SUFFIX = ".tmp"
RECEIVED_SUFFIX = ".1.tmp"
# pysyncobj's Serializer states without useFork (what checkSerializing reports).
_WRITTEN, _FAILED = -1, -2


class DurableSnapshotFile(SerializerPrivates, Serializer):
    """pysyncobj's ``Serializer`` for the snapshot file ``path``, synced (module docstring)."""

    def __init__(self, path: StoragePath, transmission_batch_size: int) -> None:
        # As SyncObj builds its own for this file: no fork, pysyncobj's own (de)serialization.
        super().__init__(path, transmission_batch_size, False, None, None, None)
        self.path = path

    def serialize(self, data: Any, id: Any) -> None:  # noqa: A002 -- pysyncobj's name
        if self.pso_pid != 0:
            return  # the last one not yet reported (checkSerializing)
        self.pso_current_id = id
        tmp = self.path + WRITTEN_SUFFIX
        try:
            with open(tmp, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb") as g:
                pso_pickle.dump(data, g)
            replace_durably(tmp, self.path, sync=self.path.sync)
        except Exception:
            log.exception("writing the Raft snapshot %s failed; it is tried again at the next compaction", self.path)
            self.pso_pid = _FAILED
        else:
            self.pso_pid = _WRITTEN

    def setTransmissionData(self, data: Any) -> bool:  # noqa: N802 -- pysyncobj's name
        if data is None or not data[2]:
            return super().setTransmissionData(data)
        chunk, first, _last = data
        super().setTransmissionData((chunk, first, False))  # written, not yet closed
        incoming = self.pso_incoming_file
        if incoming is None:
            return False  # pysyncobj could not open or write it (logged): the leader sends it again
        if self.path.sync:
            incoming.flush()
            fsync_file(self.path + RECEIVED_SUFFIX)
        if not super().setTransmissionData((b"", False, True)):
            return False
        if self.path.sync:
            fsync_directory(os.path.dirname(os.path.abspath(self.path)))
        return True
