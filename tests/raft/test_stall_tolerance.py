"""raft/extensions/stall_tolerance.py: a node whose tick thread stalls (no CPU, the GIL held by the gRPC
front end) does not depose a live leader. Here the parts that need pysyncobj's own connections and
poller: the patience rule, and a connection that counts bytes waiting as read. A stalled follower
and a stalled leader in a cluster are cases of tests/raft/test_sim_raft.py."""

from __future__ import annotations

import collections
import socket
from typing import Any

import pytest

from lighthouse_cluster.raft.extensions.stall_tolerance import PATIENCE_CAP_S, patience_s
from lighthouse_cluster.raft.host import TickPoller
from lighthouse_cluster.raft.pysyncobj_internals import (CONNECTION_STATE, LAST_READ_ATTR, TcpConnection,
                                                         counting_arrivals, monotonic)


def test_patience_is_twice_the_longest_recent_stall_above_the_floor_and_capped() -> None:
    stalls: collections.deque[tuple[float, float]] = collections.deque([(1.0, 0.3), (15.0, 0.05), (16.0, 0.2)])
    assert patience_s(stalls, 16.0, floor_s=0.1) == pytest.approx(0.6)
    assert patience_s(stalls, 22.0, floor_s=0.1) == pytest.approx(0.4)  # the first is over 20 s old: dropped
    assert list(stalls) == [(15.0, 0.05), (16.0, 0.2)]
    assert patience_s(stalls, 22.0, floor_s=0.25) == 0.0  # none long enough to cost an election
    assert patience_s(collections.deque([(0.0, 5.0)]), 1.0, floor_s=0.1) == PATIENCE_CAP_S
    assert patience_s(collections.deque(), 1.0, floor_s=0.1) == 0.0


@pytest.mark.parametrize("counted", [False, True])
def test_a_connection_with_bytes_waiting_is_not_dropped_for_a_silence_its_own_stall_made(counted: bool) -> None:
    """pysyncobj checks a connection's silence before it reads: a node whose thread did not run
    past ``connectionTimeout`` dropped the link whose bytes were waiting (``counted=False``: what
    pysyncobj does, so that this test notices if that changes). Counted as a read on arrival, the
    message is read and the link kept."""
    from pysyncobj.poller import PollPoller

    # The host's poller wraps each socket's callback as it is subscribed (StallTolerance.socket_callback).
    poller: Any = TickPoller(PollPoller(), lambda timeout: timeout, counting_arrivals) if counted else PollPoller()
    a_sock, b_sock = socket.socketpair()
    a_sock.setblocking(False)  # as pysyncobj's own sockets are
    b_sock.setblocking(False)
    got: list[Any] = []
    a = TcpConnection(poller, socket=a_sock, timeout=0.3)
    b = TcpConnection(poller, onMessageReceived=got.append, socket=b_sock, timeout=0.3)
    try:
        a.send({"type": "append_entries", "term": 1})
        setattr(b, LAST_READ_ATTR.name, monotonic() - 1.0)  # b's thread has not run for a second
        for _ in range(5):
            poller.poll(0.02)
        if counted:
            assert got == [{"type": "append_entries", "term": 1}] and b.state == CONNECTION_STATE.CONNECTED
        else:
            assert got == [] and b.state == CONNECTION_STATE.DISCONNECTED
    finally:
        a.disconnect()
        b.disconnect()
