"""The timeouts and defaults more than one module uses, defined once (pure constants).

``COMMIT_TIMEOUT_S``: how long the leader's quorum path waits for one Raft commit it submitted
(a quorum round's ``CommitQuorum``, a term's ``TermStart`` and lease confirmations) before it
gives it up as "outcome unknown": with elections of 150-450 ms, a commit still pending after 2 s
belongs to a leader that has lost its majority, and the round retries on the next tick (the
failover timings were measured with it).

``ADMIN_COMMIT_TIMEOUT_S``: the same wait for an admin change (jobs, members, settings). Longer:
an operator's change is rare, waits for nothing else, and should ride out an election or a slow
disk's fsync under load rather than answer "outcome unknown; retry".

The torchft flags' defaults (``--join_timeout_ms``, ``--heartbeat_timeout_ms``,
``--quorum_tick_ms``) are torchft_lighthouse's own; ``serve``, ``up``, a job's settings and the
quorum rules all start from them.
"""

from __future__ import annotations

COMMIT_TIMEOUT_S = 2.0
ADMIN_COMMIT_TIMEOUT_S = 5.0
# A Raft membership change (joint consensus: two commits and the new member catching up).
MEMBERSHIP_TIMEOUT_S = 10.0
# transfer-leader on the leader: how long it waits for the target to win an election (the
# client's TRANSFER_TIMEOUT_S per call is longer, so the leader's answer reaches it).
HANDOVER_TIMEOUT_S = 6.0
# A liveness stream (ftclient's Watch) must name its replica in its first message within this
# long; a refused one's first message is read, within it too, before the refusal.
WATCH_FIRST_MESSAGE_TIMEOUT_S = 10.0

# torchft_lighthouse's flags and their defaults.
DEFAULT_JOIN_TIMEOUT_MS = 60_000
DEFAULT_HEARTBEAT_TIMEOUT_MS = 5_000
DEFAULT_QUORUM_TICK_MS = 100

# The client commands' --timeout (seconds per call): the admin and job commands, and the slower
# or quicker ones.
CLIENT_TIMEOUT_S = 5.0
STATUS_TIMEOUT_S = 2.0          # status, health: a node that takes longer is reported as such
TRANSFER_TIMEOUT_S = 10.0       # transfer-leader: an election and a retry
# `up`: how long the nodes get to elect a leader every node follows, for how long it must hold,
# and the per-call timeout of the admin calls creating `up --job`'s jobs.
UP_LEADER_TIMEOUT_S = 30.0
UP_LEADER_STABLE_S = 0.5
UP_ADMIN_TIMEOUT_S = 10.0
