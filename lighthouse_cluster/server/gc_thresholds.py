"""The garbage collector's thresholds in a serving process (a node, a job port process).

CPython runs its youngest collection every 700 net allocations of container objects, and an
older one every 10 of those. Serving one Quorum call allocates dozens (the parsed request, a
``Member``, futures, tasks and frames of the handler, gRPC's call state), and a node's heap is
large and long-lived (protobuf descriptors, the job table, Raft's log), so a busy node spent 6-11 %
of its event loop's time collecting. With the youngest threshold at 20 000 and the next at
20 it collects about 30 times less often; reference counting still frees everything that is not
in a cycle at once, and cyclic garbage waits for at most 20 000 allocations.

Measured (``benchmarks/side_by_side.py``: two one-node clusters at once under the same fixed
load, four pairs; docs/design/gc-thresholds.md): the event loop's CPU per round at N=64 and
16 rounds/s 28.0 -> 26.3 ms (every pair lower), at N=256 and 3 rounds/s 117 -> 110 ms; the gRPC
floor, which allocates little and holds a small heap, 21.2 -> 20.9 ms. A higher youngest
threshold (50 000) or ``gc.freeze()`` after start-up gained nothing more.
"""

from __future__ import annotations

import gc

__all__ = ["SERVING_THRESHOLDS", "use_serving_thresholds"]

SERVING_THRESHOLDS = (20_000, 20, 10)


def use_serving_thresholds() -> None:
    """Set ``SERVING_THRESHOLDS`` for this process."""
    gc.set_threshold(*SERVING_THRESHOLDS)
