"""``LighthouseSyncObj``: a node's ``RaftHost`` with this project's extensions, in their order.

The one place the order of the extensions is decided (``extension_order``). A ``RaftHost`` runs
the "before" hooks (``before_tick``, ``message_in``, ``message_out``, ``ack_out``) in this order and
the "after" hooks (``after_tick``, ``message_handled``) in reverse, as the chain of subclasses it
replaced ran its code (lease probes outermost, durable sync innermost). Each constraint:

1. ``lease_probes`` before ``idle_acks`` (``ack_out``): it marks an echo ``must_send`` before
   ``idle_acks`` decides whether a repeat is held back. Its ``message_out`` runs first, so its key
   comes first in a marked append_entries (the old chain's key order: same bytes on the wire).
   Its ``after_tick`` runs last: probes expire after every other extension's tick work.
2. ``quiescence`` before ``stall_tolerance`` and ``fast_election`` (``before_tick``): the leader's
   heartbeat period and a follower's wake are settled before stalls are measured and keep-alives
   sent; its ``message_in`` takes ``WAKE`` before anything else sees it; its ``message_handled``
   runs after stall tolerance's (a quiet deadline is never shorter than a patient one).
3. ``stall_tolerance`` before ``fast_election`` (``before_tick``): a stall moves the election
   deadline and reads what arrived before deferred votes are handled; its ``message_handled``
   runs after fast election's (patience extends the deadline fast election left).
4. ``fast_election`` before ``idle_acks``/``adaptive_tick``/``durable_sync`` (``before_tick``): deferred
   votes are handled before the tick starts being timed; its ``message_in`` sees every message the
   later ones do not consume (keep-alives, put-off votes).
5. ``adaptive_tick`` after everything that may act before pysyncobj's tick: it times the tick
   from the moment pysyncobj's own work starts.
6. ``durable_sync`` last: its ``before_tick`` sync is the last thing before pysyncobj counts the
   leader's own copy, and its ``ack_out`` syncs only an acknowledgement that is really sent.

``LighthouseSyncObj`` adds the calls ``RaftNode`` makes on its SyncObj (``quiet``,
``probe_leadership``, ``vote_refusal_s``, ...), each delegating to the extension that owns it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from pysyncobj import SyncObjConf

from lighthouse_cluster.raft.durable_journal import open_journal
from lighthouse_cluster.raft.extensions.adaptive_tick import AdaptiveTick
from lighthouse_cluster.raft.extensions.durable_sync import DurableSync
from lighthouse_cluster.raft.extensions.fast_election import FastElection
from lighthouse_cluster.raft.extensions.idle_acks import IdleAcks
from lighthouse_cluster.raft.extensions.lease_probes import LeaseProbes
from lighthouse_cluster.raft.extensions.quiescence import Quiescence
from lighthouse_cluster.raft.extensions.signals import NodeSignals
from lighthouse_cluster.raft.extensions.stall_tolerance import StallTolerance
from lighthouse_cluster.raft.host import Extension, RaftHost
from lighthouse_cluster.raft.host_transport import HostTransport

__all__ = ["EXTENSION_CLASSES", "LighthouseExtensions", "LighthouseSyncObj", "build_extensions", "extension_order"]


@dataclass(frozen=True)
class LighthouseExtensions:
    """One node's extensions, by what they are."""

    signals: NodeSignals
    lease_probes: LeaseProbes
    quiescence: Quiescence
    stall_tolerance: StallTolerance
    fast_election: FastElection
    idle_acks: IdleAcks
    adaptive_tick: AdaptiveTick
    durable_sync: DurableSync


def extension_order(ext: LighthouseExtensions) -> tuple[Extension, ...]:
    """The extensions outermost first (the module docstring gives the reason for each place)."""
    return (ext.lease_probes, ext.quiescence, ext.stall_tolerance, ext.fast_election, ext.idle_acks,
            ext.adaptive_tick, ext.durable_sync)


# The class of each extension, by its name in ``LighthouseExtensions``. A node class may name
# others (``LighthouseSyncObj.extension_classes``), each taking the same arguments: the tests'
# simulated cluster switches one mechanism off this way (tests/support/sim_raft.py).
EXTENSION_CLASSES: Mapping[str, type[Extension]] = MappingProxyType({
    "lease_probes": LeaseProbes, "quiescence": Quiescence, "stall_tolerance": StallTolerance,
    "fast_election": FastElection, "idle_acks": IdleAcks, "adaptive_tick": AdaptiveTick,
    "durable_sync": DurableSync,
})


def build_extensions(conf: Any, *, longest_s: float, quiet_after_s: float, quiet_period_s: float,
                     quiet_allowed: Callable[[], bool], vote_refusal_s: float | None,
                     classes: Mapping[str, type[Extension]] = EXTENSION_CLASSES) -> LighthouseExtensions:
    """One node's extensions, sharing one ``NodeSignals``, each of its class in ``classes``."""
    signals = NodeSignals()
    c: Any = classes
    return LighthouseExtensions(
        signals=signals,
        lease_probes=c["lease_probes"](),
        quiescence=c["quiescence"](signals, quiet_after_s=quiet_after_s, quiet_period_s=quiet_period_s,
                                   quiet_allowed=quiet_allowed),
        stall_tolerance=c["stall_tolerance"](signals),
        fast_election=c["fast_election"](signals, conf, vote_refusal_s=vote_refusal_s),
        idle_acks=c["idle_acks"](),
        adaptive_tick=c["adaptive_tick"](signals, longest_s=longest_s),
        durable_sync=c["durable_sync"](),
    )


class LighthouseSyncObj(RaftHost):
    """A ``RaftHost`` with this project's extensions (``ext``), and the calls ``RaftNode`` makes on
    its SyncObj, each delegated to the extension that owns it."""

    __slots__ = ("ext",)
    extension_classes: Mapping[str, type[Extension]] = EXTENSION_CLASSES

    def __init__(self, selfNode: Any, otherNodes: Any, conf: Any = None, consumers: Any = None,  # noqa: N803
                 nodeClass: Any = None, *, longest_s: float = 0.1, cipher: Any = None,  # noqa: N803
                 quiet_after_s: float = 0.0, quiet_period_s: float = 0.2,
                 quiet_allowed: Callable[[], bool] = lambda: False, vote_refusal_s: float | None = None,
                 open_journal: Callable[[Any], Any] | None = open_journal,
                 transportClass: Any = HostTransport) -> None:  # noqa: N803 -- pysyncobj's name
        conf = conf if conf is not None else SyncObjConf()  # pysyncobj's default, as SyncObj uses it
        self.ext = build_extensions(conf, longest_s=longest_s, quiet_after_s=quiet_after_s,
                                    quiet_period_s=quiet_period_s, quiet_allowed=quiet_allowed,
                                    vote_refusal_s=vote_refusal_s, classes=self.extension_classes)
        super().__init__(selfNode, otherNodes, conf, consumers, nodeClass, extensions=extension_order(self.ext),
                         open_journal=open_journal, cipher=cipher, transportClass=transportClass)

    # -- quiescence ---------------------------------------------------------------------------------

    def note_client_activity(self) -> None:
        self.ext.quiescence.note_client_activity()

    @property
    def quiet(self) -> bool:
        return self.ext.quiescence.quiet

    @property
    def leader_quiet(self) -> bool:
        return self.ext.quiescence.leader_quiet

    # -- stall tolerance ----------------------------------------------------------------------------

    @property
    def stalls(self) -> int:
        return self.ext.stall_tolerance.stalls

    @property
    def patience_asked_s(self) -> float:
        return self.ext.stall_tolerance.patience_asked_s

    @property
    def leader_patience_s(self) -> float:
        return self.ext.signals.leader_patience_s

    # -- fast election ------------------------------------------------------------------------------

    @property
    def handover_term(self) -> int | None:
        return self.ext.fast_election.handover_term

    @property
    def vote_refusal_s(self) -> float:
        return self.ext.fast_election.vote_refusal_s

    # -- lease probes -------------------------------------------------------------------------------

    def probe_leadership(self, term: int, callback: Callable[[bool], None]) -> None:
        self.ext.lease_probes.probe_leadership(term, callback)

    def stream_confirmations(self, term: int, on_confirmed: Callable[[float], None] | None) -> None:
        self.ext.lease_probes.stream_confirmations(term, on_confirmed)
