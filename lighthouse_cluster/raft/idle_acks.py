"""``IdleAckSyncObj``: a follower acknowledges an idle leader's heartbeats a few times a second,
not each one.

An idle leader sends every follower an append_entries every ``appendEntriesPeriod`` (37.5 ms: the
election timeout needs several per timeout), and pysyncobj's follower answers each with a
``next_node_idx`` acknowledgement: with the Fernet encryption of the Raft port, pickling and
compression, these messages are most of an idle node's CPU (docs/design/idle-cost.md). The
acknowledgement of a heartbeat that carried no entries repeats the previous one word for word, and
the leader does nothing with a repeat (pysyncobj: ``matchIndex`` only grows, ``nextIndex`` moves
only on a reset) but note when it last heard from the follower, which it uses twice: to step down
after ``leaderFallbackTimeout`` (1 s) without a majority, and, in the TCP connection, to drop a link
it has read nothing on for ``connectionTimeout`` (0.5 s).

So a repeat is sent only once ``ack_every_s`` (``connectionTimeout / 5``, as the keep-alives
between followers) has passed since the last acknowledgement sent to that leader: a few times a
second, five per connection timeout. Everything else is sent at once: an acknowledgement of new
entries (a commit waits for it), a refusal or a reset, the first one in a term or to another
leader, and the first one after the link to the leader dropped (the last one may be lost).
Failover is unaffected: followers detect a dead leader by its missing append_entries, which do
not change. An older leader (a rolling upgrade) sees the same, within the same bounds.
"""

from __future__ import annotations

from typing import Any

from lighthouse_cluster.raft.adaptive_tick import AdaptiveTickSyncObj
from lighthouse_cluster.raft.pysyncobj_internals import monotonic


class IdleAckSyncObj(AdaptiveTickSyncObj):
    """``SyncObj`` whose follower sends repeated acknowledgements at most every ``ack_every_s``
    (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Before SyncObj.__init__: pysyncobj puts attributes added after it into its snapshots.
        self._last_ack: tuple[Any, ...] | None = None  # (leader, term, next index) of the last ack sent
        self._last_ack_at = float("-inf")
        self.acks_sent = 0
        self.acks_skipped = 0
        super().__init__(*args, **kwargs)

    def _onTick(self, timeToWait: float = 0.0) -> None:  # noqa: N803 -- pysyncobj's name
        # The link to the leader dropped since the last ack (a tick follows every disconnect):
        # that ack may be lost, so the next one is sent whatever it says.
        last = self._last_ack
        if last is not None and not self.isNodeConnected(last[0]):
            self._last_ack = None
        super()._onTick(timeToWait)

    @property
    def ack_every_s(self) -> float:
        return self.conf.connectionTimeout / 5

    def ack_now(self) -> None:
        """The next acknowledgement is sent whatever it repeats (a lease probe's echo)."""
        self._last_ack = None

    def on_ack(self, node: Any, reset: bool, next_index: int | None, success: bool) -> None:
        if next_index is None:
            next_index = self.pso_last_log()[1] + 1
        key = (node, self.raftCurrentTerm, next_index)
        now = monotonic()
        if success and not reset and key == self._last_ack and now - self._last_ack_at < self.ack_every_s:
            self.acks_skipped += 1
            return
        self.pso_send_ack(node, reset, next_index, success)
        self.acks_sent += 1
        connected = self.isNodeConnected(node)
        # Only a success that reached a live link is repeated later rather than now.
        self._last_ack = key if success and not reset and connected else None
        self._last_ack_at = now
