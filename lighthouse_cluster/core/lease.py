"""The leader's quorum lease: fast quorums without a Raft commit, while a majority follows.

Pure: no clock, no I/O; every time value (monotonic seconds of this node) is an argument.

Why. A *fast* quorum has the members of the last committed quorum, so it keeps its quorum id
(torchft's rule): the (id, member set) it hands out is already committed, and what differs
(steps, ``created``) is never read by a later leader (``quorum.compute_quorum`` uses the previous
quorum's member ids only). A commit per fast round buys one thing: a leader cut off from the
majority cannot answer, so quorum ids never go back in real time (a deposed leader handing out
id 7 after its successor issued 8). The lease buys the same with time instead of a commit per
round, as in the Raft thesis (section 6.4.1, leases for reads):

1. The leader of term ``T`` submits an entry at its time ``s``: its first ``ConfirmLeadership``
   of the term, or any later command (a round's ``CommitQuorum``: ``LeaderTerm``). When the entry
   is applied while this node still leads ``T`` (``RaftNode.submit(while_leader_of=T)``), a
   majority ``Q`` stored it in term ``T``, after ``s``. Any later leader is elected by a majority
   that shares a node with ``Q``, and that node stored the entry before it moved to a later term;
   so every later leader was elected after ``s`` (real time). A *lease probe* asked at ``s``
   (``raft/extensions/lease_probes.py``; how ``LeaderTerm`` renews a busy leader's lease, with no entry)
   gives the same: it is confirmed once a majority ``Q`` acknowledged, while in term ``T`` and
   following this leader, a heartbeat sent after ``s``; each of them heard from a current leader
   at that moment, and none of them had moved to a later term before it.
2. The lease holder issues fast quorums on the lease until ``s + trust * L`` on its clock, and
   commits every round otherwise (what it did without a lease).
3. A new leader serves only once it has led for ``max(L, L') - R`` on its clock (at least 0),
   ``L'`` being the lease length its predecessor announced (replicated in ``ConfirmLeadership``,
   so a node with a shorter or no lease still waits out a longer one) and ``R`` the vote-refusal
   window below (0 for a leader elected on a handover). With the defaults (``L`` = 150 ms, ``R`` =
   the 150 ms minimum election timeout) a new leader serves as soon as its ``TermStart`` commits;
   a shorter ``--election-timeout-ms`` takes the default lease down with it (``default_lease_ms``).
   ``L`` is as long as that allows: a busy leader needs a confirmation every ``t*L/2`` (37.5 ms),
   which is its heartbeat period, so its heartbeats renew the lease and no message goes out for
   it alone (``LeaderTerm``; with 100 ms, a probe of its own every 25 ms:
   docs/design/lease-renewal.md).

The vote-refusal window ``R`` (``raft/extensions/fast_election.py``, ``vote_refused``; Raft thesis 4.2.3):
a node grants no vote, and a follower does not even take the candidate's term, until ``R`` after
it last heard from a current leader (an append_entries of a term >= its own; a leader hears from
itself), on its own clock, or after its own start. The one exception is a candidate standing on
its leader's TimeoutNow (a handover: ``transfer-leader``, a stopping leader), which records the
term (``FastElection.handover_term``, raft/extensions/fast_election.py) and, winning it, serves after the full ``max(L, L')``
(``R`` = 0 above: the old argument, unchanged). A node's vote for itself keeps the window too: it
stands no earlier than ``R`` after it last heard from a leader, whether its election timeout fires
(at least ``raftMinTimeout`` = ``R`` after the leader's last append_entries), it stands early after
refusing a candidate that is behind (only a request handled after the window gets there), or its
leader's connection closed (``leader_lost_deadline``: the window's end at the earliest).

Claim: with trust ``t`` and clock rates that differ by less than a factor ``1/t`` between any two
nodes, no leader of a later term serves while the leader of ``T`` still issues on a confirmation.

Proof. Take the confirmation submitted at ``s`` (real time ``s*``) by the leader ``A`` of ``T``,
stored by the majority ``Q``; ``A`` issues on it until ``s* + t*L/a`` in real time, ``a`` being
``A``'s clock rate (its clock advances ``a`` seconds per real second). Let ``B`` be a leader of a
term ``T' > T`` elected without a handover, by a majority ``V``, and ``x`` a node in ``V`` and
``Q``. ``x`` stored the entry in term ``T`` (for a probe: acknowledged the heartbeat in term
``T``) at real time ``h* >= s*``, before it voted in ``T'`` (a node that moved to ``T' > T``
rejects ``T``'s append_entries). At ``h*``, ``x`` heard from a current leader: as a follower it
received ``A``'s append_entries, and if ``x = A`` it led at that moment. So ``x`` granted the vote no earlier than ``h* + R/x_r`` (``x_r``: ``x``'s clock
rate), ``B`` became leader after that vote, and it serves ``W = max(L, L') - R`` later on its
clock (rate ``b``), at ``>= s* + R/x_r + W/b``. With ``x_r, b < a/t``, that is more than
``s* + t*(R + W)/a >= s* + t*L/a``: after ``A``'s issuing on the confirmation ended. A leader
that is itself restarted in between lost its lease with the process; a node that restarts
refuses votes for ``R`` from its start, so "heard at ``h*``" survives a restart of ``x``. A
leader elected on a handover waits ``max(L, L')`` from when it leads, after ``s*`` by point 1:
real time ``>= s* + L/b > s* + t*L/a``, the argument without ``R``. Membership changes are one
server at a time: consecutive configurations' majorities intersect, as Raft's own safety needs.

What the window costs: nothing while a leader lives (its followers hear from it every
``appendEntriesPeriod``), and in a failover the first candidate asks followers that heard the
leader's last append_entries at about the time it did, at least ``raftMinTimeout`` earlier; a
follower whose window is a few ms from its end answers when it ends (a put-off request is
handled then, not dropped). ``R`` is this node's ``--election-timeout-ms``: the members of one
cluster must not run a shorter one than the node computing the wait (the defaults are the same
on every node), and the members must all run a version that refuses votes (older members grant
them at once; during a rolling upgrade from one, run ``--quorum-lease-ms 0`` or accept that a
new leader may serve up to ``t*L`` early).

Only durations are compared, each on one node's clock: no synchronized clocks. With ``trust =
1/2`` it holds while the clock *rates* of two nodes differ by less than 2x (NTP slews by at
most 0.05 %); with the defaults (``R = L``) the refusal alone covers rates up to ``R / (t*L)`` =
2x apart as well. A node whose clock runs several times slower than its peers' (the fault-injection
harness's clock nemesis, rates 0.25x-4x) breaks that assumption: it could issue a stale fast
quorum (an id its successor already replaced; never a second member set for an id, which the
commits alone guarantee); run with ``--quorum-lease-ms 0`` where that can happen. Before the
refusal window (docs/design/leader-lease.md) a new leader waited ``L`` (then 100 ms) before
serving, and failover took that much longer; it still does when ``L > R`` (a longer
``--quorum-lease-ms`` or a shorter ``--election-timeout-ms``), by ``L - R``, and a leader elected
on a handover waits the whole ``L``.

What the lease gives up: a round issued on it is in no node's log (a record goes out at most once
a second). A leader SIGKILLed between the answers of such a round (a window of about a
millisecond per round) leaves the members it answered in their step, waiting in a collective for
the others, whose re-sent requests the new leader cannot answer with the same quorum (their
members' steps are unknown to it): that step fails at the collective's timeout. A committed
round is replayed instead (``coordinator``, "Replay after a failover"). A job with its lease at
0 commits every round, so every round is replayable, for one Raft commit per round.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_LEASE_MS", "LeaseSettings", "QuorumLease", "default_lease_ms", "lease_wait_s"]

DEFAULT_LEASE_MS = 150


def default_lease_ms(election_timeout_ms: int | None) -> int:
    """The lease a node runs when none is given: ``DEFAULT_LEASE_MS``, or the minimum election
    timeout (``R``, in ms) where that is shorter, so that a new leader still waits nothing after a
    failover (point 3: ``L - R <= 0``). None: the default election timeout (150 ms)."""
    return DEFAULT_LEASE_MS if election_timeout_ms is None else max(1, min(DEFAULT_LEASE_MS, election_timeout_ms))


@dataclass(frozen=True)
class LeaseSettings:
    """``lease_ms`` = L (0: no lease, every round is committed); ``trust``: the share of L the
    holder uses, the rest is the margin for clock-rate differences."""

    lease_ms: int = 0
    trust: float = 0.5

    def __post_init__(self) -> None:
        if self.lease_ms < 0:
            raise ValueError(f"lease_ms must be >= 0, got {self.lease_ms}")
        if not 0.0 < self.trust <= 1.0:
            raise ValueError(f"trust must be in (0, 1], got {self.trust}")

    @property
    def enabled(self) -> bool:
        return self.lease_ms > 0

    @property
    def held_s(self) -> float:
        """How long one confirmation lets the holder issue on the lease (its clock)."""
        return self.trust * self.lease_ms / 1000.0


class QuorumLease:
    """The lease of one leader: granted by confirmations of its term, valid until it runs out."""

    def __init__(self, settings: LeaseSettings) -> None:
        self.settings = settings
        self._term: int | None = None
        self._until = float("-inf")

    def reset(self) -> None:
        self._term = None
        self._until = float("-inf")

    def confirmed(self, term: int, submitted_at: float) -> None:
        """A ``ConfirmLeadership`` submitted at ``submitted_at`` was applied while leading ``term``."""
        if not self.settings.enabled:
            return
        if term != self._term:
            self._term, self._until = term, float("-inf")
        self._until = max(self._until, submitted_at + self.settings.held_s)

    def valid(self, term: int | None, now: float) -> bool:
        return term is not None and term == self._term and now < self._until

    def remaining(self, term: int | None, now: float) -> float:
        return max(0.0, self._until - now) if term is not None and term == self._term else 0.0

    def renewal_due(self, term: int | None, now: float, share: float = 0.5) -> bool:
        """Renew once less than ``share`` of a confirmation's worth is left (a confirmation takes
        one Raft commit or one acknowledged heartbeat, a few ms; half of ``held_s`` leaves room for
        a slow one)."""
        return self.remaining(term, now) < share * self.settings.held_s

    def serve_after(self, leading_since: float, predecessor_lease_ms: int, vote_refusal_s: float = 0.0) -> float:
        """When a leader that took over at ``leading_since`` may serve: every lease a predecessor
        can still hold has run out by then (point 3 of the module docstring). ``vote_refusal_s``:
        how long every member refuses votes after hearing from a leader (``R``; 0 for a leader
        elected on a handover, or when nothing is known)."""
        return leading_since + lease_wait_s(max(self.settings.lease_ms, predecessor_lease_ms), vote_refusal_s)


def lease_wait_s(lease_ms: int, vote_refusal_s: float) -> float:
    """How long a new leader waits before serving, given the longest lease ``L`` a predecessor may
    hold and the vote-refusal window ``R``: ``max(0, L - R)`` (the module docstring's proof)."""
    if vote_refusal_s < 0:
        raise ValueError(f"vote_refusal_s must be >= 0, got {vote_refusal_s}")
    return max(0.0, lease_ms / 1000.0 - vote_refusal_s)
