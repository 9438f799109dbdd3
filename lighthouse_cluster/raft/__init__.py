"""Raft replication through pysyncobj: the only package that imports pysyncobj.

Importing it checks pysyncobj (``pysyncobj_internals.check``): the pinned version, with every
private name this package uses; otherwise ImportError says what is missing and what to install.
It then makes pysyncobj compress small messages cheaply (``message_compression``), and create
the journal and rename the snapshot of a node with a data directory through this project's
durable storage (``durable_journal``, ``durable_files``: on disk before the node acts on them).
``replication`` is the API the node uses; see its docstring for the other modules.
"""

from lighthouse_cluster.raft import pysyncobj_internals as _pysyncobj_internals  # runs the check
from lighthouse_cluster.durable_files import replace_durably as _replace_durably
from lighthouse_cluster.raft.durable_journal import open_journal as _open_journal
from lighthouse_cluster.raft.message_compression import SmallMessageZlib as _SmallMessageZlib

# Small Raft messages compressed with a small zlib state (message_compression.py; same wire format).
_pysyncobj_internals.use_message_compression(_SmallMessageZlib())

# A StoragePath journal or snapshot (every RaftNode with a data directory) is written durably.
_pysyncobj_internals.use_durable_storage(
    _open_journal, lambda tmp, final: _replace_durably(tmp, final, sync=final.sync))
