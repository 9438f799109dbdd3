"""How a node compresses its Raft messages: a small message gets a small deflate state.

pysyncobj compresses every message it sends with ``zlib.compress(data, 3)`` and decompresses what
it reads with ``zlib.decompress``. Most messages are small: an idle or steady cluster sends
heartbeats, their acknowledgements and the followers' keep-alives, about 130 bytes pickled.
For those, nearly all of ``zlib.compress`` is setting up zlib's default state (a 32 KB window and
128 KB of hash tables at ``memLevel`` 8): 60-120 us a message here, against about 10 us with a
512-byte window and ``memLevel`` 1, which compress a message that small as well. Larger messages
(log entries with a quorum's members) keep pysyncobj's settings, where the set-up is a small part.

Both are standard zlib streams, so ``zlib.decompress`` reads either on any node, of any version:
the wire format does not change and a rolling upgrade needs nothing. Each node's connections
use it (``host_transport.CompactTcpConnection``); pysyncobj's own ``zlib`` is left alone.
"""

from __future__ import annotations

import zlib

__all__ = ["SMALL_MESSAGE_BYTES", "SmallMessageZlib"]

# Messages up to this size (pickled) are compressed with the small state.
SMALL_MESSAGE_BYTES = 4096
_SMALL_WBITS = 9     # a 512-byte window: zlib's smallest for its own (zlib-wrapped) format
_SMALL_MEM_LEVEL = 1


class SmallMessageZlib:
    """What pysyncobj's connection module calls ``zlib``: ``compress`` and ``decompress``."""

    @staticmethod
    def compress(data: bytes, level: int = -1) -> bytes:
        if len(data) > SMALL_MESSAGE_BYTES:
            return zlib.compress(data, level)
        compressor = zlib.compressobj(level, zlib.DEFLATED, _SMALL_WBITS, _SMALL_MEM_LEVEL)
        return compressor.compress(data) + compressor.flush()

    @staticmethod
    def decompress(data: bytes) -> bytes:
        return zlib.decompress(data)
