"""``NodeSignals``: what one extension of a node publishes for the others, each with one writer.

Extensions never read each other's attributes; where one mechanism depends on another's state,
the owner publishes it here (a value it keeps current, or a function it provides) and the
readers read it. The owner of each is named next to it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from lighthouse_cluster.raft.pysyncobj_internals import monotonic


def _never_late(_now: float) -> float:
    return 0.0


def _nothing(*_args: object) -> None:
    return None


def _no_floor() -> float:
    return 0.0


@dataclass
class NodeSignals:
    """One node's shared signals (see the module docstring)."""

    # fast_election: pysyncobj's clock when this node last heard from a current leader (an
    # append_entries of a term >= its own; a leader from itself), or its start.
    heard_leader_at: float = field(default_factory=monotonic)
    # stall_tolerance: what this follower's leader asked it to add to its election timeouts.
    leader_patience_s: float = 0.0
    # adaptive_tick: how late ``now`` is after the tick thread's last wait was due to end.
    tick_lateness: Callable[[float], float] = _never_late
    # fast_election: send the keep-alives to the other followers now (``now``).
    send_keepalives: Callable[[float], None] = _nothing
    # quiescence: the shortest keep-alive period and the shortest longest-wait it needs now (0: none).
    keepalive_period_floor_s: Callable[[], float] = _no_floor
    longest_wait_floor_s: Callable[[], float] = _no_floor


def draw_election_timeout(drawn_s: float, signals: NodeSignals) -> float:
    """An election timeout drawn as pysyncobj draws one (``drawn_s``) plus the patience this
    follower's leader asked for (``stall_tolerance``)."""
    return drawn_s + signals.leader_patience_s
