"""The two knobs the variants turn on an otherwise unchanged node: stall tolerance off (it only
counts stalls, for the metric) and the Raft tick thread at a higher CPU priority."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from lighthouse_cluster.raft.extensions.stall_tolerance import STALL_S, StallTolerance

log = logging.getLogger(__name__)

RAFT_NICE = -10


class StallCountOnly(StallTolerance):
    """Stall tolerance switched off: it measures stalls (``tick_stalls``) and does nothing else."""

    def socket_callback(self, callback: Any) -> Any:
        return callback

    def message_out(self, node: Any, message: Any) -> Any:
        return message

    def message_handled(self, node: Any, message: Any, was_leader: bool) -> None:
        return None

    def before_tick(self) -> None:
        from lighthouse_cluster.raft.pysyncobj_internals import monotonic

        stall = self.signals.tick_lateness(monotonic())
        if stall >= STALL_S:
            self.stalls += 1
            self.longest_stall_s = max(self.longest_stall_s, stall)


def stall_tolerance_off() -> None:
    """Every ``LighthouseSyncObj`` built after this runs ``StallCountOnly`` (this process only)."""
    from lighthouse_cluster.raft import composed_node

    composed_node.LighthouseSyncObj.extension_classes = {**composed_node.EXTENSION_CLASSES,
                                                         "stall_tolerance": StallCountOnly}


def nice_this_thread(nice: int = RAFT_NICE) -> None:
    """Linux: ``nice`` for the calling thread only (a thread's priority is its own)."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
        log.info("thread %d at nice %d", tid, os.getpriority(os.PRIO_PROCESS, tid))
    except OSError as e:  # no CAP_SYS_NICE
        log.warning("cannot set nice %d on thread %d: %s", nice, tid, e)


TICK_THREAD_LINE = "raft tick thread tid"


def on_tick_thread_once(syncobj: Any, nice: int | None = None) -> None:
    """On the tick thread's first tick callback: log its native id (``TICK_THREAD_LINE``, which
    the harness reads to follow the thread's scheduler statistics) and set its nice if asked."""
    done = threading.Event()

    def once() -> None:
        if not done.is_set():
            done.set()
            if nice is not None:
                nice_this_thread(nice)
            tid = threading.get_native_id()
            log.info("%s %d nice %d", TICK_THREAD_LINE, tid, os.getpriority(os.PRIO_PROCESS, tid))

    syncobj.addOnTickCallback(once)


def raft_node_class(nice: int | None = None) -> type:
    """``RaftNode`` whose tick thread logs its id and, with ``nice``, sets its own priority on its
    first tick callback (variant B: ``RAFT_NICE``; variant A: None)."""
    from lighthouse_cluster.raft.replication import RaftNode

    class TickThreadRaftNode(RaftNode):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            on_tick_thread_once(self._syncobj, nice)

    return TickThreadRaftNode
