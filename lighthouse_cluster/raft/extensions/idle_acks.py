"""``IdleAcks``: a follower acknowledges an idle leader's heartbeats a few times a second, not
each one.

An idle leader sends every follower an append_entries every ``appendEntriesPeriod`` (37.5 ms:
the election timeout needs several per timeout), and pysyncobj's follower answers each with a
``next_node_idx`` acknowledgement: with the encryption of the Raft port, pickling and
compression, these messages are most of an idle node's CPU (docs/design/idle-cost.md). The acknowledgement of a
heartbeat that carried no entries repeats the previous one word for word, and the leader does
nothing with a repeat (pysyncobj: ``matchIndex`` only grows, ``nextIndex`` moves only on a reset)
but note when it last heard from the follower, which it uses twice: to step down after
``leaderFallbackTimeout`` (1 s) without a majority, and, in the TCP connection, to drop a link it
has read nothing on for ``connectionTimeout`` (0.5 s).

So a repeat is sent only once ``ack_every_s`` (``connectionTimeout / 5``, as the keep-alives
between followers) has passed since the last acknowledgement sent to that leader
(``ack_held_back``): a few times a second. Everything else is sent at once: an acknowledgement of
new entries (a commit waits for it), a refusal or a reset, the first one in a term or to another
leader, the first one after the link to the leader dropped (the last one may be lost), and one
another extension marks ``must_send`` (a lease probe's echo). Failover is unaffected: followers
detect a dead leader by its missing append_entries, which do not change. An older leader (a
rolling upgrade) sees the same, within the same bounds.
"""

from __future__ import annotations

from typing import Any

from lighthouse_cluster.raft.host import Ack, Extension
from lighthouse_cluster.raft.pysyncobj_internals import monotonic

__all__ = ["IdleAcks", "ack_held_back"]


def ack_held_back(key: tuple[Any, ...], last_key: tuple[Any, ...] | None, now: float, last_at: float,
                  every_s: float, *, success: bool, reset: bool, must_send: bool) -> bool:
    """Whether an acknowledgement ``key`` (leader, term, next index) repeats the last one sent
    (``last_key`` at ``last_at``; None: none that may be repeated) within ``every_s``, and so is
    held back. Only a plain success is ever held back."""
    if must_send or not success or reset:
        return False
    return key == last_key and now - last_at < every_s


class IdleAcks(Extension):
    """Holds back a follower's repeated acknowledgements (module docstring)."""

    def __init__(self) -> None:
        self.last_ack: tuple[Any, ...] | None = None  # (leader, term, next index) of the last ack sent
        self.last_ack_at = float("-inf")
        self.acks_sent = 0
        self.acks_skipped = 0
        self._sending_at = 0.0

    @property
    def ack_every_s(self) -> float:
        return self.host.conf.connectionTimeout / 5

    def before_tick(self) -> None:
        # The link to the leader dropped since the last ack (a tick follows every disconnect):
        # that ack may be lost, so the next one is sent whatever it says.
        last = self.last_ack
        if last is not None and not self.host.isNodeConnected(last[0]):
            self.last_ack = None

    def ack_out(self, ack: Ack) -> bool:
        key = (ack.node, self.host.raftCurrentTerm, ack.next_index)
        now = monotonic()
        if ack_held_back(key, self.last_ack, now, self.last_ack_at, self.ack_every_s, success=ack.success,
                         reset=ack.reset, must_send=ack.must_send):
            self.acks_skipped += 1
            return False
        self._sending_at = now
        return True

    def ack_sent(self, ack: Ack) -> None:
        self.acks_sent += 1
        host = self.host
        connected = host.isNodeConnected(ack.node)
        # Only a success that reached a live link is repeated later rather than now.
        repeatable = ack.success and not ack.reset and connected
        self.last_ack = (ack.node, host.raftCurrentTerm, ack.next_index) if repeatable else None
        self.last_ack_at = self._sending_at
