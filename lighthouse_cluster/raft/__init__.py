"""Raft replication through pysyncobj: the only package that imports pysyncobj.

Importing it checks pysyncobj (``pysyncobj_internals.check``): the pinned version, with every
private name this package uses; otherwise ImportError says what is missing and what to install.
It then makes pysyncobj rename the snapshot of a node with a data directory through this
project's durable storage (``durable_files``: on disk before the node acts on it), the one
process-wide hook left (``pysyncobj_internals.use_durable_snapshots``). Everything else a node
changes of pysyncobj's is its own: the journal, the transport, compression and encryption
(``host``). ``replication`` is the API the node uses; see its docstring for the other modules.
"""

from lighthouse_cluster.raft import pysyncobj_internals as _pysyncobj_internals  # runs the check
from lighthouse_cluster.durable_files import replace_durably as _replace_durably

# A StoragePath snapshot (every RaftNode with a data directory) is renamed into place durably.
_pysyncobj_internals.use_durable_snapshots(lambda tmp, final: _replace_durably(tmp, final, sync=final.sync))
