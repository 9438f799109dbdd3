"""Which replica groups are alive, from their liveness streams (``LighthouseCluster.Watch``).

A replica group's manager keeps one stream open to the leader and sends a keep-alive every
``keepalive_interval``; the stream is its heartbeat. It is declared dead the moment its stream
closes (a process that dies closes its sockets at once) or when no keep-alive arrived for
``timeout_s`` (a host cut off from the network closes nothing). Death only ever feeds the quorum
rules' health input (``QuorumCoordinator.declare_dead``): quorum ids, fencing and commits are
untouched, so a false death (a blip) costs at most one quorum change.

A new stream replaces the replica's previous one; a close or expiry of a replaced stream is
ignored (the manager reconnected: it is alive). A leader that itself stalled (its event loop held
for longer than a check period) cannot tell silence from keep-alives it has not read yet: the
stall is excused (:meth:`Liveness.excuse_stall`), as the Raft thread excuses its own stalls
(``raft/extensions/stall_tolerance.py``), so a loaded leader does not declare live replicas dead. A leader
knows only the streams opened to it, so a new leader declares nobody dead before each replica had
the chance to reconnect: the replicas of the last quorum are seeded with a heartbeat at warm-up
exactly as before streams existed.

Pure: time comes in as arguments; no I/O, no threads.
"""

from __future__ import annotations

from dataclasses import dataclass

STREAM_CLOSED = "stream closed"


@dataclass(frozen=True, slots=True)
class Death:
    replica_id: str
    reason: str


@dataclass(slots=True)
class _Stream:
    stream_id: int
    last_seen: float


class Liveness:
    """The open liveness streams of one leader, and the deaths they imply."""

    def __init__(self, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"liveness timeout must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self._streams: dict[str, _Stream] = {}

    def opened(self, replica_id: str, stream_id: int, now: float) -> None:
        """A stream for ``replica_id`` was accepted; it replaces any earlier one."""
        self._streams[replica_id] = _Stream(stream_id, now)

    def keepalive(self, replica_id: str, stream_id: int, now: float) -> None:
        stream = self._streams.get(replica_id)
        if stream is not None and stream.stream_id == stream_id:
            stream.last_seen = now

    def closed(self, replica_id: str, stream_id: int) -> Death | None:
        """The stream ended; the replica's death, unless a newer stream replaced this one."""
        stream = self._streams.get(replica_id)
        if stream is None or stream.stream_id != stream_id:
            return None
        del self._streams[replica_id]
        return Death(replica_id, STREAM_CLOSED)

    def excuse_stall(self, stall_s: float, now: float) -> None:
        """The leader could not read for ``stall_s`` up to ``now``: every stream's silence is
        counted from ``stall_s`` later (never later than ``now``), so keep-alives that arrived
        during the stall and are still unread do not count as missing. A replica that did die is
        declared dead at most ``stall_s`` later."""
        if stall_s <= 0:
            return
        for s in self._streams.values():
            s.last_seen = min(now, s.last_seen + stall_s)

    def expire(self, now: float) -> list[Death]:
        """Deaths of every replica whose keep-alives stopped for the timeout (their streams are
        forgotten: the replica comes back by opening a new one)."""
        late = [rid for rid, s in self._streams.items() if now - s.last_seen >= self.timeout_s]
        for rid in late:
            del self._streams[rid]
        ms = round(self.timeout_s * 1000)
        return [Death(rid, f"keep-alives stopped for {ms} ms") for rid in sorted(late)]

    def watching_any(self) -> bool:
        """Whether any replica's stream is watched (else ``expire`` has nothing to expire)."""
        return bool(self._streams)

    def watching(self, replica_id: str) -> bool:
        return replica_id in self._streams

    def watched(self) -> list[str]:
        return sorted(self._streams)

    def clear(self) -> None:
        self._streams.clear()
