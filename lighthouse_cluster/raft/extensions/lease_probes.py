"""``LeaseProbes``: a leader confirms that it still leads with one round of heartbeats that a
majority acknowledges, not with a log entry.

The quorum lease (``core/lease.py``, point 1) needs, every ~25 ms while rounds come fast, a proof
that a majority still followed this leader in its term *after* a time ``s`` on its clock. Until
now that proof was a committed ``ConfirmLeadership`` entry: ~40 log entries a second, each
written to three journals, replicated, acknowledged, committed, announced in the next
append_entries and applied on every node (half of a busy leader's Raft thread at N=64,
docs/design/lease-renewal.md). An acknowledged heartbeat proves the same thing:

* The leader of term ``T`` asks at ``s`` (``probe_leadership``): its next append_entries to every
  follower (sent at once) carries ``LEASE_PROBE_KEY: (T, t)``, ``t >= s`` being the time it goes
  out on the leader's clock.
* A follower that takes that append_entries (a term ``>=`` its own: it is then in ``T``, follows
  the sender, and has just *heard from a current leader*, which starts its vote-refusal window,
  ``extensions.fast_election.vote_refused``) marks the acknowledgement it sends for it with the same
  ``(T, s)``, whether or not the entries matched, and never holds that acknowledgement back
  (``idle_acks``).
* The leader counts an echo of ``(T, s)`` from a member only while it still leads ``T``. Once
  itself and the members that echoed a probe of ``T`` sent at ``s`` or later are a majority of
  the configuration, every probe asked at or before ``s`` is confirmed (``confirmed_since``).

Why it is as good as a committed entry, for the lease's proof: an echo of ``(T, s)`` from ``x``
means ``x`` was in term ``T``, following this leader, at a time ``h* >= s*`` (it received a
message sent after ``s``). ``x`` cannot have voted in a later term before ``h*`` (terms only grow,
and a node in a later term ignores ``T``'s append_entries), and it grants no vote until ``R``
after ``h*``. That is all the proof in ``lease.py`` uses of "``x`` stored the entry in term ``T``
at ``h*``"; a probe with the same ``s`` is confirmed by the same majorities a commit would be.
The echo carries the leader's own clock value back to it: only durations on one clock are
compared, as before. Entries, commits and the first ``ConfirmLeadership`` of a term (which
announces the lease length to successors) are unchanged.

An older member ignores the key (pysyncobj ignores keys it does not know) and echoes nothing: a
probe it would have to confirm is not confirmed, and the caller falls back to a commit
(``LeaderTerm``). A probe not confirmed within ``PROBE_EXPIRY_S`` or by a change of term or role
is answered False.

**Heartbeats as probes** (``stream_confirmations``). While rounds come fast the lease needs a
confirmation every half lease; asked for one at a time, each probe was an append_entries of its
own, sent whenever the event loop got round to asking, and the regular heartbeat went out beside
it (~37 append_entries a second to each follower, ~27 of them probes). Instead,
while ``LeaderTerm`` says the leader is busy, *every* append_entries of term ``T`` carries
``(T, t)``, its own send time, and each time the latest majority-confirmed ``t`` moves forward it
is reported (``on_confirmed(t)``): the lease is renewed by the heartbeats the leader sends
anyway, ~27 a second, anchored at when each was sent (a confirmation of ``(T, t)`` proves what a
probe asked at ``t`` proves), however late the event loop reads it. An explicit probe is only
needed when those confirmations stop coming (``LeaderTerm`` then asks one, and falls back to
commits if it goes unanswered). Measured: docs/design/lease-renewal.md.

**As an extension.** Its ``message_out`` puts the probe into append_entries and the echo into
acknowledgements; its ``ack_out`` marks an echo ``Ack.must_send``, before ``idle_acks`` decides
whether a repeat is held back (``composed_node.extension_order``); its ``after_tick`` expires
probes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from lighthouse_cluster.raft.host import Ack, Extension
from lighthouse_cluster.raft.pysyncobj_internals import monotonic

__all__ = ["LEASE_PROBE_KEY", "LeaseProbes", "PROBE_EXPIRY_S", "confirmed_since", "parse_probe"]

# The key of a probe in an append_entries, and of its echo in the acknowledgement: (term, s).
LEASE_PROBE_KEY = "lighthouse_cluster_lease_probe"
# A probe a majority has not echoed by then is answered False.
PROBE_EXPIRY_S = 1.0


def confirmed_since(echoes: Iterable[float], voters: int) -> float | None:
    """The latest probe time ``s`` that a majority of ``voters`` (this leader included, which always
    counts as current) has confirmed, given each other member's latest echoed probe time; None
    when no probe is confirmed yet. A one-member configuration confirms everything (``inf``)."""
    needed = voters // 2  # members besides this leader
    if needed <= 0:
        return float("inf")
    latest = sorted(echoes, reverse=True)
    return latest[needed - 1] if len(latest) >= needed else None


def parse_probe(value: Any) -> tuple[int, float] | None:
    """``(term, s)`` from a probe or an echo, or None if it is not one."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        return None
    term, sent = value
    if isinstance(term, bool) or not isinstance(term, int) or not isinstance(sent, (int, float)):
        return None
    return term, float(sent)


class LeaseProbes(Extension):
    """A leader's confirmation of its leadership by acknowledged heartbeats (module docstring)."""

    def __init__(self) -> None:
        self._probes: list[tuple[float, int, Callable[[bool], None]]] = []  # (s, term, callback)
        # (term, on_confirmed, latest t reported): every append_entries of term carries a probe
        self._stream: tuple[int, Callable[[float], None], float] | None = None
        self._echoes: dict[Any, float] = {}  # member -> latest t it echoed in _echo_term
        self._echo_term: int | None = None
        self._echo_to: tuple[Any, Any] | None = None  # a follower: (leader, probe) being acknowledged
        self.lease_probes_sent = 0  # append_entries that carried a probe (for tests)
        self.lease_probes_echoed = 0  # acknowledgements this node marked as echoes

    # -- the leader ---------------------------------------------------------------------------------

    def probe_leadership(self, term: int, callback: Callable[[bool], None]) -> None:
        """On the tick thread: confirm that this node leads ``term`` with a majority as of now;
        ``callback(True)`` once confirmed, ``callback(False)`` if it cannot be, on the tick thread."""
        host = self.host
        if not host._isLeader() or host.raftCurrentTerm != term:
            callback(False)
            return
        if not host.otherNodes:
            callback(True)  # a one-member cluster is its own majority
            return
        self._probes.append((monotonic(), term, callback))
        host.pso_send_append_entries_now()
        host.wake()  # the tick that sends it comes at once, not after the overdue wait

    def stream_confirmations(self, term: int, on_confirmed: Callable[[float], None] | None) -> None:
        """On the tick thread: from now on every append_entries of ``term`` carries a probe, and
        ``on_confirmed(t)`` reports each later time ``t`` a majority confirmed in ``term``, until
        this node no longer leads ``term`` or ``on_confirmed`` is None."""
        self._stream = None if on_confirmed is None else (term, on_confirmed, float("-inf"))

    def _streaming(self) -> bool:
        stream = self._stream
        if stream is None:
            return False
        host = self.host
        if host._isLeader() and stream[0] == host.raftCurrentTerm:
            return True
        self._stream = None  # its term is over here
        return False

    def message_out(self, node: Any, message: Any) -> Any:
        if not isinstance(message, dict):
            return message
        kind = message.get("type")
        if kind == "append_entries":
            host = self.host
            if not host._isLeader() or not (self._probes or self._streaming()):
                return message
            self.lease_probes_sent += 1
            # Its own send time: after every probe asked before it (all on this thread).
            return {**message, LEASE_PROBE_KEY: (host.raftCurrentTerm, monotonic())}
        if kind == "next_node_idx":
            echo = self._echo_to
            if echo is None or echo[0] != node:
                return message
            self.lease_probes_echoed += 1
            return {**message, LEASE_PROBE_KEY: echo[1]}
        return message

    def _on_echo(self, node: Any, value: Any) -> None:
        host = self.host
        echo = parse_probe(value)
        if echo is None or not host._isLeader() or echo[0] != host.raftCurrentTerm:
            return
        term, sent = echo
        if sent > monotonic():
            return  # not a time of ours
        if self._echo_term != term:
            self._echoes, self._echo_term = {}, term
        self._echoes[node] = max(sent, self._echoes.get(node, float("-inf")))
        self._settle_probes()

    def _settle_probes(self) -> None:
        if not (self._probes or self._streaming()):
            return
        host = self.host
        term = host.raftCurrentTerm
        members = host.otherNodes  # the configuration now (pysyncobj returns a copy)
        echoes = [s for node, s in self._echoes.items() if node in members] if self._echo_term == term else []
        since = confirmed_since(echoes, len(members) + 1)
        if since is None:
            return
        stream = self._stream
        if stream is not None and stream[0] == term and stream[2] < since < float("inf"):
            self._stream = (term, stream[1], since)
            stream[1](since)
        waiting = []
        for probe in self._probes:
            if probe[1] == term and probe[0] <= since:
                probe[2](True)
            else:
                waiting.append(probe)
        self._probes = waiting

    def after_tick(self) -> None:
        if not self._probes:
            return
        host = self.host
        now = monotonic()
        leading = host._isLeader()
        term = host.raftCurrentTerm
        waiting = []
        for probe in self._probes:
            if not leading or probe[1] != term or now - probe[0] > PROBE_EXPIRY_S:
                probe[2](False)
            else:
                waiting.append(probe)
        self._probes = waiting

    # -- a follower ---------------------------------------------------------------------------------

    def message_in(self, node: Any, message: Any) -> bool:
        self._echo_to = None
        if isinstance(message, dict) and LEASE_PROBE_KEY in message and message.get("type") == "append_entries" \
                and message.get("term", -1) >= self.host.raftCurrentTerm:
            # pysyncobj takes it (this node is then in its term, following the sender): the
            # acknowledgements it sends while handling it echo the probe.
            self._echo_to = (node, message[LEASE_PROBE_KEY])
        return False

    def ack_out(self, ack: Ack) -> bool:
        echo = self._echo_to
        if echo is not None and echo[0] == ack.node:
            ack.must_send = True  # an echo is never held back as a repeat (idle_acks)
        return True

    def message_handled(self, node: Any, message: Any, was_leader: bool) -> None:
        self._echo_to = None
        if isinstance(message, dict) and message.get("type") == "next_node_idx" and LEASE_PROBE_KEY in message:
            self._on_echo(node, message[LEASE_PROBE_KEY])
