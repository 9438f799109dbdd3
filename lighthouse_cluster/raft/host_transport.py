"""The composed node's transport: pysyncobj's TCP transport, with the node's hooks on its edges.

``RaftHost`` (``raft/host.py``) passes ``HostTransport`` to ``SyncObj`` as its ``transportClass``,
so everything that used to be replaced on a live object is a method of a class made for it:

* every message the node sends goes through ``send``, which hands it to the host's message-out
  hooks first (extensions add their keys to append_entries and acknowledgements); before, the
  instance's ``transport.send`` was replaced by a closure, one per marking;
* ``_onNodeDisconnected`` calls pysyncobj's own handling, then the host's hook; before, the
  callback pysyncobj had registered was wrapped and registered again;
* every connection the transport receives (dialed in ``addNode``, accepted in
  ``_onNewIncomingConnection``) becomes a ``CompactTcpConnection``, which compresses a small
  message with a small zlib state (``message_compression``, same wire format); before,
  pysyncobj's connection module had its ``zlib`` replaced for the whole process. pysyncobj builds
  both kinds of connection itself (the accepted ones inside its ``TcpServer``), so the transport
  re-types each one as it receives it: the subclass adds no state, only ``send``.
"""

from __future__ import annotations

from typing import Any

from lighthouse_cluster.raft.message_compression import SmallMessageZlib
from lighthouse_cluster.raft.pysyncobj_internals import (NODE_DISCONNECTED_CALLBACK_ATTR, TCPTransport, TcpConnection,
                                                       send_compressed)

__all__ = ["CompactTcpConnection", "HostTransport", "compress_message"]

# pysyncobj's compression level for every message (``zlib.compress(data, 3)``).
PYSYNCOBJ_LEVEL = 3


def compress_message(data: bytes) -> bytes:
    """A pickled message compressed as this project's nodes do (``SmallMessageZlib``, level 3)."""
    return SmallMessageZlib.compress(data, PYSYNCOBJ_LEVEL)


class CompactTcpConnection(TcpConnection):
    """pysyncobj's ``TcpConnection`` whose messages are compressed with ``compress_message``."""

    def send(self, message: Any) -> None:
        send_compressed(self, message, compress_message)


def adopt_connection(connection: Any) -> None:
    """Make a connection pysyncobj built a ``CompactTcpConnection`` (same object, same state)."""
    if type(connection) is TcpConnection:
        connection.__class__ = CompactTcpConnection


class HostTransport(TCPTransport):
    """pysyncobj's ``TCPTransport`` for a ``RaftHost`` (``syncObj``): see the module docstring."""

    def __init__(self, syncObj: Any, selfNode: Any, otherNodes: Any) -> None:  # noqa: N803 -- pysyncobj's names
        self.host = syncObj
        super().__init__(syncObj, selfNode, otherNodes)

    def send(self, node: Any, message: Any) -> bool:
        return bool(super().send(node, self.host.outgoing_message(node, message)))

    def addNode(self, node: Any) -> None:  # noqa: N802 -- pysyncobj's name
        super().addNode(node)
        connection = self._connections.get(node)
        if connection is not None:
            adopt_connection(connection)

    def _onNewIncomingConnection(self, conn: Any) -> None:  # noqa: N802 -- pysyncobj's name
        adopt_connection(conn)
        super()._onNewIncomingConnection(conn)

    def _onNodeDisconnected(self, node: Any) -> None:  # noqa: N802 -- pysyncobj's name
        registered = getattr(self, NODE_DISCONNECTED_CALLBACK_ATTR.name) is not None  # None once destroyed
        super()._onNodeDisconnected(node)
        if registered:
            self.host.node_disconnected(node)
