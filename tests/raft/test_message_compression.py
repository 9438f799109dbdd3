"""Raft messages compressed with a small zlib state (raft/message_compression.py): still the
zlib format every node reads, used by each node's connections, and cheaper per message."""

from __future__ import annotations

import os
import zlib

import pytest

from lighthouse_cluster.raft.message_compression import SMALL_MESSAGE_BYTES, SmallMessageZlib
from lighthouse_cluster.raft import pysyncobj_internals

HEARTBEAT = {"type": "append_entries", "term": 5, "commit_index": 1234, "entries": [], "prevLogIdx": 1234,
             "prevLogTerm": 5}


@pytest.mark.parametrize("data", [b"", b"x", pysyncobj_internals.pso_pickle.dumps(HEARTBEAT),
                                  os.urandom(SMALL_MESSAGE_BYTES), b"members " * 50_000],
                         ids=["empty", "one-byte", "heartbeat", "small-random", "large"])
def test_any_zlib_reader_reads_what_it_writes(data: bytes) -> None:
    codec = SmallMessageZlib()
    packed = codec.compress(data, 3)
    assert zlib.decompress(packed) == data  # what a node of any version runs on it
    assert codec.decompress(zlib.compress(data, 3)) == data  # and it reads what pysyncobj writes


def test_a_small_message_gets_the_small_window_and_a_large_one_pysyncobjs_settings() -> None:
    codec = SmallMessageZlib()
    small = codec.compress(pysyncobj_internals.pso_pickle.dumps(HEARTBEAT), 3)
    # The zlib header's first byte: compression method 8, window size 2**(CINFO + 8) bytes.
    assert small[0] >> 4 == 9 - 8
    large = b"members " * 50_000
    assert codec.compress(large, 3) == zlib.compress(large, 3)


def test_importing_the_raft_package_leaves_pysyncobjs_own_compression_alone() -> None:
    """Each node's connections compress with it (``host_transport.CompactTcpConnection``);
    pysyncobj's module, which other code in the process may use, keeps ``zlib``."""
    import lighthouse_cluster.raft  # noqa: F401
    from pysyncobj import tcp_connection

    assert tcp_connection.zlib is zlib
