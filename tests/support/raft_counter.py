"""A replicated counter: the smallest pysyncobj consumer, for tests of the Raft layer alone."""

from __future__ import annotations

from pysyncobj import SyncObjConsumer, replicated


class Counter(SyncObjConsumer):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    @replicated
    def inc(self) -> int:
        self.n += 1
        return self.n
