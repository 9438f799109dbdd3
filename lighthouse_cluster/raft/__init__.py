"""Raft replication through pysyncobj: the only package that imports pysyncobj.

Importing it checks pysyncobj (``pysyncobj_internals.check``): the pinned version, with every
private name this package uses; otherwise ImportError says what is missing and what to install.
It then makes pysyncobj compress small messages cheaply (``message_compression``).
``replication`` is the API the node uses; see its docstring for the other modules.
"""

from lighthouse_cluster.raft import pysyncobj_internals as _pysyncobj_internals  # runs the check
from lighthouse_cluster.raft.message_compression import SmallMessageZlib as _SmallMessageZlib

# Small Raft messages compressed with a small zlib state (message_compression.py; same wire format).
_pysyncobj_internals.use_message_compression(_SmallMessageZlib())
