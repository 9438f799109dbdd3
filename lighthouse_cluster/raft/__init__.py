"""Raft replication through pysyncobj: the only package that imports pysyncobj.

Importing it checks pysyncobj (``pysyncobj_internals.check``): the pinned version, with every
private name this package uses; otherwise ImportError says what is missing and what to install.
Nothing of pysyncobj's is changed process-wide: everything a node changes of it is its own, per
node: the journal and snapshot file (synced before the node acts on them), the transport,
compression and encryption (``host``). ``replication`` is the API the node uses; see its
docstring for the other modules.
"""

from lighthouse_cluster.raft import pysyncobj_internals as _pysyncobj_internals  # noqa: F401 -- runs the check
