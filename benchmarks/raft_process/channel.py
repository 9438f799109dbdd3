"""The local channel between a node's gRPC front end and its Raft process: length-prefixed
msgpack frames over a Unix stream socket (a ``socketpair`` made by the front end).

A frame is a 4-byte big-endian length and a msgpack array whose first item names the message.

Front end -> Raft process:

* ``[SUBMIT, id, payload, while_leader_of]``: append ``payload`` (an encoded command);
* ``[PROBE, id, term]``: confirm leadership of ``term`` with one acknowledged heartbeat;
* ``[STREAM, term, on]``: every heartbeat of ``term`` a lease probe (on) or none (off);
* ``[ACTIVITY]``: a client called (quiescence), sent at most every ``ACTIVITY_EVERY_S``;
* ``[STOP]``.

Raft process -> front end, in the order they happened on its tick thread:

* ``[VIEW, {...}]``: role, term, led term, leader, connected peers, indexes, counters (``VIEW_KEYS``);
* ``[APPLIED, payload]``: a committed command, applied there; the front end applies it to its
  mirror ``QuorumStateMachine`` (deterministic: the same bytes give the same state);
* ``[RESTORED, snapshot]``: the state machine was replaced by a snapshot;
* ``[DONE, id, error, unknown]``: a submit settled (``error`` None: applied, as the last
  ``APPLIED`` before it);
* ``[PROBED, id, ok]``; ``[CONFIRMED, t]``: a majority followed at ``time.monotonic()`` ``t``
  (CLOCK_MONOTONIC: the same clock in both processes).
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

SUBMIT, PROBE, STREAM, ACTIVITY, STOP = "s", "p", "l", "c", "x"
VIEW, APPLIED, RESTORED, DONE, PROBED, CONFIRMED = "v", "a", "r", "d", "q", "k"

ACTIVITY_EVERY_S = 0.5

VIEW_KEYS = ("role", "term", "led_term", "leader", "connected", "commit_index", "last_applied", "ready",
             "quiet", "stalls", "patience_s", "vote_refusal_s", "handover_term", "journal_syncs", "encrypted")

_LEN = struct.Struct(">I")
MAX_FRAME = 256 * 2**20


def encode(message: list[Any]) -> bytes:
    """One frame for ``message`` (a list whose first item is its kind)."""
    body = msgpack.packb(message, use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise ValueError(f"frame of {len(body)} bytes")
    return _LEN.pack(len(body)) + body


class FrameReader:
    """Bytes in (``feed``), whole messages out, in order; keeps a partial frame for the next feed."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[list[Any]]:
        buf = self._buf
        buf += data
        out: list[list[Any]] = []
        pos = 0
        while len(buf) - pos >= 4:
            (size,) = _LEN.unpack_from(buf, pos)
            if size > MAX_FRAME:
                raise ValueError(f"frame of {size} bytes")
            if len(buf) - pos - 4 < size:
                break
            message = msgpack.unpackb(bytes(buf[pos + 4:pos + 4 + size]), raw=False)
            pos += 4 + size
            out.append(message)
        del buf[:pos]
        return out

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held back."""
        return len(self._buf)


def view_message(view: dict[str, Any]) -> list[Any]:
    """A ``VIEW`` message with exactly ``VIEW_KEYS`` (missing ones None)."""
    return [VIEW, {k: view.get(k) for k in VIEW_KEYS}]
