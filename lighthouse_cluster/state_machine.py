"""The replicated state machine: what every node agrees on, and the only rules that change it.

Deterministic by construction: ``apply`` depends only on the state and the command (time, term
and node ids arrive inside the command, chosen by the leader that wrote it). No clock, no
randomness, no I/O. ``replication.ReplicatedState`` feeds it the Raft log; tests feed it
directly.

State:
* ``quorum``: the last committed quorum (``None`` before the first one). Quorum ids only grow:
  a ``CommitQuorum`` is a compare-and-set on the id it was computed from, so a command computed
  from a stale view (a deposed leader, a retried write whose first attempt did apply) is
  rejected on every node alike, and no id is ever committed twice with different members.
* ``history``: the ids and member ids of the last ``HISTORY_LENGTH`` committed quorums, for
  audits (the fault-injection checkers compare it across nodes).
* ``leader_term`` / ``leader_id`` / ``leader_since_ms``: the last ``TermStart`` applied.
* ``schema_version``: the codec version writers may use.
* ``members`` / ``members_version``: the replicated member table (node id, Raft address,
  client address), written by ``SetMembers`` (compare-and-set on the version) when an admin
  changes the membership; empty until the first change (then the configured peers apply).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from . import codec
from .codec import CommitQuorum, EnableSchema, SetMembers, TermStart, UnknownCommand
from .quorum import Quorum

HISTORY_LENGTH = 256


@dataclass(frozen=True, slots=True)
class CommitResult:
    """Outcome of a ``CommitQuorum``: applied, or rejected with the quorum id actually in place."""

    applied: bool
    current_quorum_id: int


@dataclass(frozen=True, slots=True)
class HistoryEntry:
    quorum_id: int
    replica_ids: tuple[str, ...]
    created_ms: int
    term: int


class QuorumStateMachine:
    """The lighthouse cluster's replicated state; see the module docstring."""

    def __init__(self) -> None:
        self.quorum: Quorum | None = None
        self.history: deque[HistoryEntry] = deque(maxlen=HISTORY_LENGTH)
        self.leader_term = 0
        self.leader_id = ""
        self.leader_since_ms = 0
        self.schema_version = codec.MIN_READABLE_VERSION
        self.commands_applied = 0
        self.rejected_commits = 0
        self.members: tuple[tuple[str, str, str], ...] = ()
        self.members_version = 0

    @property
    def quorum_id(self) -> int:
        return self.quorum.quorum_id if self.quorum is not None else 0

    def apply(self, command: codec.Command) -> Any:
        """Apply one command and return its result (the same on every node)."""
        self.commands_applied += 1
        if isinstance(command, CommitQuorum):
            return self._commit_quorum(command)
        if isinstance(command, TermStart):
            if command.term >= self.leader_term:
                self.leader_term = command.term
                self.leader_id = command.node_id
                self.leader_since_ms = command.time_ms
            return command.term
        if isinstance(command, EnableSchema):
            if codec.MIN_READABLE_VERSION <= command.version <= codec.SCHEMA_VERSION:
                self.schema_version = max(self.schema_version, command.version)
            return self.schema_version
        if isinstance(command, SetMembers):
            if command.expected_version != self.members_version:
                return CommitResult(applied=False, current_quorum_id=self.members_version)
            self.members = command.members
            self.members_version += 1
            return CommitResult(applied=True, current_quorum_id=self.members_version)
        if isinstance(command, UnknownCommand):
            return None
        raise TypeError(f"not a command: {command!r}")

    def apply_bytes(self, payload: bytes) -> Any:
        return self.apply(codec.decode_command(payload))

    def _commit_quorum(self, cmd: CommitQuorum) -> CommitResult:
        current = self.quorum_id
        q = cmd.quorum
        same_id_other_members = (
            self.quorum is not None and q.quorum_id == current
            and [m.replica_id for m in q.participants] != [m.replica_id for m in self.quorum.participants]
        )
        if cmd.expected_quorum_id != current or q.quorum_id < current or same_id_other_members:
            self.rejected_commits += 1
            return CommitResult(applied=False, current_quorum_id=current)
        self.quorum = q
        self.history.append(HistoryEntry(
            quorum_id=q.quorum_id,
            replica_ids=tuple(m.replica_id for m in q.participants),
            created_ms=q.created_ms,
            term=cmd.term,
        ))
        return CommitResult(applied=True, current_quorum_id=q.quorum_id)

    # -- snapshots ------------------------------------------------------------------------

    def to_snapshot(self) -> bytes:
        return codec.encode_snapshot({
            "quorum": codec.quorum_to_wire(self.quorum) if self.quorum is not None else None,
            "history": [[h.quorum_id, list(h.replica_ids), h.created_ms, h.term] for h in self.history],
            "leader": [self.leader_term, self.leader_id, self.leader_since_ms],
            "schema": self.schema_version,
            "applied": self.commands_applied,
            "rejected": self.rejected_commits,
            **({"members": [list(m) for m in self.members], "members_v": self.members_version}
               if self.members_version else {}),
        }, version=self.schema_version)

    def restore_snapshot(self, data: bytes) -> None:
        obj = codec.decode_snapshot(data)
        q = obj.get("quorum")
        self.quorum = codec.quorum_from_wire(q) if q is not None else None
        self.history = deque(
            (HistoryEntry(quorum_id=h[0], replica_ids=tuple(h[1]), created_ms=h[2], term=h[3])
             for h in obj.get("history", [])),
            maxlen=HISTORY_LENGTH,
        )
        self.leader_term, self.leader_id, self.leader_since_ms = obj.get("leader", [0, "", 0])
        self.schema_version = obj.get("schema", codec.MIN_READABLE_VERSION)
        self.commands_applied = obj.get("applied", 0)
        self.rejected_commits = obj.get("rejected", 0)
        self.members = tuple((str(m[0]), str(m[1]), str(m[2])) for m in obj.get("members", []))
        self.members_version = obj.get("members_v", 0)
