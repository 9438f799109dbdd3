"""Each node's committed Raft log, read from its data directory, replayed through the real state
machine.

The files are read through ``lighthouse_cluster.raft.journal`` (re-exported here:
``parse_journal``, ``parse_journal_bytes``, ``read_meta_commit_index``, ``read_snapshot``), which
reads a live node's journal read-only, so the monitor can collect committed entries during a run,
before log compaction drops them. Only entries at or below a commit index the node reported
*before* the read are taken as committed: those never change.

``summarize`` replays committed entries through ``QuorumStateMachine`` (compare-and-set
rejections included) and returns what the checkers need, as JSON-able data: the distinct
committed quorums of every job (id, member ids, job), each job's state at the end, every
``TermStart`` and the (term, node) of every command,
and digests of the log per bucket of ``DIGEST_EVERY`` indexes so logs of different nodes can
be compared; and the rendezvous key-value store's keys at the end (``kv``), with how many writes
the replayed log applied per key (``kv_applied``) and the request ids it applied more than once
(``kv_reapplied``: a retried write applied twice; always empty unless the store is wrong). ``read_snapshot`` reads the node's snapshot file; the monitor keeps every one it
sees, so a gap left by log compaction between two reads is bridged by a snapshot.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Any

from lighthouse_cluster.core import codec
from lighthouse_cluster.core.codec import CommitQuorum, KVWrite, TermStart
from lighthouse_cluster.core.kv_store import KVResult
from lighthouse_cluster.core.state_machine import HISTORY_LENGTH, CommitResult, QuorumStateMachine
from lighthouse_cluster.raft.journal import (Entry, command_payload, parse_journal, parse_journal_bytes,
                                           read_meta_commit_index, read_snapshot)

__all__ = ["DIGEST_EVERY", "CommittedLog", "Entry", "parse_journal", "parse_journal_bytes", "read_meta_commit_index",
           "read_snapshot", "summarize"]

DIGEST_EVERY = 100         # committed-log digests per bucket of this many indexes


@dataclass
class CommittedLog:
    """Committed entries of one node, accumulated from repeated reads (index -> term, command)."""

    node: str
    entries: dict[int, tuple[int, bytes]] = field(default_factory=dict)
    commit_index: int = 0
    conflicts: list[int] = field(default_factory=list)   # indexes whose committed bytes changed (!)

    def absorb(self, entries: list[Entry], commit_index: int) -> None:
        for idx, term, cmd in entries:
            if idx > commit_index:
                break
            old = self.entries.get(idx)
            if old is None:
                self.entries[idx] = (term, cmd)
            elif old != (term, cmd) and idx not in self.conflicts:
                self.conflicts.append(idx)
        self.commit_index = max(self.commit_index, commit_index)


def _decode(cmd: bytes) -> tuple[codec.Command, int] | None:
    """The command of a journal entry and the schema version it was written at (the state
    machine applies it by that version's rules), or None for pysyncobj's own entries."""
    try:
        payload = command_payload(cmd)
        if payload is None:
            return None  # pysyncobj's own entries (no-op of a new leader, membership changes)
        return codec.decode_versioned(payload)
    except Exception:
        return None


def summarize(log: CommittedLog, snapshots: dict[int, bytes] | None = None) -> dict[str, Any]:
    """Replay the committed entries through ``QuorumStateMachine``.

    Where entries are missing (log compaction removed them between two reads of the journal),
    the replay jumps over the gap with a snapshot of the node taken at an index inside or at the
    end of it (``snapshots``: index -> state-machine snapshot, collected during the run): the
    snapshot's ``history`` holds the last ``HISTORY_LENGTH`` quorums committed before it, per job.

    ``quorums``: ``[quorum id, member ids, first index (0: from a snapshot), term, job]``;
    ``unverifiable_quorum_ids``: ``[lo, hi, job]``, the job's ids strictly between unknown;
    ``jobs``: each job's ``quorum_id`` and ``version`` at the end (removed ones as ``retired``)."""
    snaps = dict(snapshots or {})
    machine = QuorumStateMachine()
    indexes = sorted(i for i in log.entries if i <= log.commit_index)
    # (job, id, members) -> [first index (0: from a snapshot), term]
    quorums: dict[tuple[str, int, tuple[str, ...]], list[int]] = {}
    term_starts: list[list[Any]] = []
    leaders: dict[int, list[str]] = {}
    buckets: dict[int, Any] = {}
    bucket_len: dict[int, int] = {}
    bridged: list[list[int]] = []
    unverifiable: list[list[int]] = []     # [lo, hi]: quorum ids strictly between are unknown
    unbridged: list[int] | None = None
    expected, last, started_from = 1, 0, 0
    kv_seen: set[tuple[str, str, str]] = set()          # (job, run id, request id) applied
    kv_reapplied: list[list[str]] = []
    kv_applied: dict[tuple[str, str, str], int] = {}    # (job, run id, key) -> applied writes
    for idx in indexes:
        if idx < expected:
            continue
        if idx > expected:
            usable = [k for k in snaps if k >= expected - 1 and k >= idx - 1]
            if not usable:
                unbridged = [expected, idx - 1]
                break
            k = min(usable)
            before = {name: js.quorum_id for name, js in machine.jobs.items()}
            machine.restore_snapshot(snaps[k])
            for name, js in machine.jobs.items():
                if len(js.history) >= HISTORY_LENGTH:
                    # Quorums committed in the gap before the snapshot's history window are unknown here.
                    oldest = min(h.quorum_id for h in js.history)
                    if oldest - before.get(name, 0) > 1:
                        unverifiable.append([before.get(name, 0), oldest, name])
                for h in js.history:
                    quorums.setdefault((name, h.quorum_id, tuple(h.replica_ids)), [0, h.term])
            if expected == 1:
                started_from = k
            bridged.append([expected, k])
            expected = k + 1
            if idx < expected:
                continue
        term, cmd = log.entries[idx]
        b = idx // DIGEST_EVERY
        buckets.setdefault(b, hashlib.sha256()).update(struct.pack("<QQ", idx, term) + cmd)
        bucket_len[b] = bucket_len.get(b, 0) + 1
        expected = last = idx
        expected += 1
        decoded = _decode(cmd)
        if decoded is None:
            continue
        command, version = decoded
        result = machine.apply(command, version)
        if isinstance(command, TermStart):
            term_starts.append([command.term, command.node_id, idx])
            _note_leader(leaders, command.term, command.node_id)
        elif isinstance(command, CommitQuorum):
            _note_leader(leaders, command.term, command.node_id)
            if isinstance(result, CommitResult) and result.applied:
                key = (command.job, command.quorum.quorum_id, tuple(m.replica_id for m in command.quorum.participants))
                quorums.setdefault(key, [idx, command.term])
        elif isinstance(command, KVWrite) and isinstance(result, KVResult) and result.applied \
                and not result.duplicate:
            reg = (command.job, command.run_id, command.op.key)
            kv_applied[reg] = kv_applied.get(reg, 0) + 1
            if command.request_id:
                rid = (command.job, command.run_id, command.request_id)
                if rid in kv_seen:
                    kv_reapplied.append([*rid, str(idx)])
                kv_seen.add(rid)
    # A bucket [b*N, (b+1)*N) is comparable across nodes only when this node has all of it.
    digests = {str(b * DIGEST_EVERY): h.hexdigest()[:16] for b, h in buckets.items()
               if bucket_len[b] == DIGEST_EVERY - (1 if b == 0 else 0)}
    return {
        "commit_index": log.commit_index,
        "replayed_to": last,
        "complete": unbridged is None and started_from == 0,
        "gaps_bridged_by_snapshot": bridged,
        "missing": unbridged,
        "from_snapshot": started_from,
        "unverifiable_quorum_ids": unverifiable,
        "quorum_id": machine.quorum_id,
        "quorums": [[q, list(m), first, term, job] for (job, q, m), (first, term) in sorted(quorums.items())],
        "jobs": {name: {"quorum_id": js.quorum_id, "version": js.version} for name, js in sorted(machine.jobs.items())},
        "retired": dict(sorted(machine.retired.items())),
        "term_starts": term_starts,
        "leaders": {str(t): nodes for t, nodes in sorted(leaders.items())},
        "digests": digests,
        "conflicts": list(log.conflicts),
        "rejected_commits": machine.rejected_commits,
        **_kv_summary(machine, kv_applied, kv_reapplied, complete=unbridged is None and started_from == 0
                      and not bridged),
    }


KV_SUMMARY_KEYS = 100   # the store's keys a summary lists at most (the harness writes one or two)


def _kv_summary(machine: QuorumStateMachine, applied: dict[tuple[str, str, str], int],
                reapplied: list[list[str]], complete: bool) -> dict[str, Any]:
    """The store at the end: ``kv``: ``[job, run id, key, value (text, at most 64 characters),
    version]``; ``kv_applied``: ``[job, run id, key, writes applied]``, counted over the replayed
    log (``kv_complete``: the whole log, no stretch known only from a snapshot);
    ``kv_reapplied``: ``[job, run id, request id, log index]``. Nothing when the store is empty."""
    kv = machine.kv
    if not kv.namespaces and not applied:
        return {}
    entries = [[job, run_id, key, e.value[:64].decode("utf-8", "replace"), e.version]
               for (job, run_id), n in sorted(kv.namespaces.items()) for key, e in sorted(n.entries.items())]
    return {"kv": entries[:KV_SUMMARY_KEYS],
            "kv_applied": [[*reg, count] for reg, count in sorted(applied.items())][:KV_SUMMARY_KEYS],
            "kv_complete": complete, "kv_reapplied": reapplied[:KV_SUMMARY_KEYS]}


def _note_leader(leaders: dict[int, list[str]], term: int, node: str) -> None:
    seen = leaders.setdefault(term, [])
    if node not in seen:
        seen.append(node)
