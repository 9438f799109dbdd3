"""The versioned msgpack schema of everything that goes through the Raft log.

Commands and snapshots are plain msgpack maps with short, stable keys and a schema version
``v``; no pickled objects. The rules that let two adjacent versions run side by side during a
rolling upgrade:

* a reader accepts every version from ``MIN_READABLE_VERSION`` to ``SCHEMA_VERSION``
  and ignores keys it does not know (a newer writer may add optional keys);
* a key added in a later version is optional, with a default that means "absent";
* a writer never emits a version newer than the one the cluster has enabled
  (``QuorumStateMachine.schema_version``), so an old node never sees a command it cannot
  apply; a command of an unknown kind is applied as a deterministic no-op on every node;
* a command is applied by the rules of the version it was *written* at (``decode_versioned``),
  so an existing journal replays to the same state under any later version.

Version 2 adds ``set_members`` and, for commands written at 2 or later, fencing in the state
machine: a ``TermStart`` must raise the leader term, a ``CommitQuorum`` must carry it.

Version 3 keeps quorum members whole: a member that arrived from a trainer is written as its
serialized ``torchft.QuorumMember`` (key ``pb``, beside its ``r``eplica id) instead of the known
fields one by one, so fields this version does not know survive the log, snapshots and a new
leader (``torchft_wire``). Readers of every version read both forms; a version-2 writer keeps
writing the fields (an old node in the cluster could not read ``pb``), and the leader enables 3
once every member node runs a version that reads it (``LighthouseNode``).

Version 4 adds jobs (``jobs.py``): ``put_job`` and ``remove_job`` commands, and a ``j`` key on
``commit_quorum`` naming the job (absent: the default job, so a version-3 command reads the same).
An older node would apply a job's commit to its only quorum, so no writer emits a job command or
a commit for another job before version 4 is enabled, i.e. before every node reads it.

Versions 5 and 6 change nothing in the log (see their constants).

Version 7 adds the rendezvous key-value store (``kv_store.py``): ``kv_write``, ``kv_drop`` and
``kv_expire`` commands and a ``kv`` key in snapshots (absent: an empty store). An older node would
apply them as unknown kinds (no-ops) and diverge, so no writer emits one before version 7 is
enabled, i.e. before every node reads it.

This module only translates between Python values and bytes; it owns no state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import msgpack

from lighthouse_cluster.core.jobs import DEFAULT_JOB, JobSpec, spec_from_wire, spec_to_wire
from lighthouse_cluster.core.kv_store import KVOp, op_from_wire, op_to_wire
from lighthouse_cluster.core.quorum import Member, Quorum
from lighthouse_cluster.core.torchft_wire import DecodeError, member_from_bytes

SCHEMA_VERSION = 7
MIN_READABLE_VERSION = 1
# Version 2 adds the ``set_members`` command (the replicated member table).
MEMBERS_SCHEMA_VERSION = 2
# Commands written at version 2 or later are fenced (``QuorumStateMachine``): a second
# ``TermStart`` for a term, or a ``CommitQuorum`` outside the current leader term, is a no-op.
FENCING_SCHEMA_VERSION = 2
# Version 3 writes a member as the requester's serialized QuorumMember: every field passes through.
PASS_THROUGH_SCHEMA_VERSION = 3
# Version 4: jobs (put_job, remove_job, and commit_quorum for a job other than the default one).
JOBS_SCHEMA_VERSION = 4
# Version 5 changes nothing in the log: its nodes read Raft messages encrypted with AES-256-GCM
# (``raft/message_cipher.py``), and send them so once the cluster enables it.
CIPHER_SCHEMA_VERSION = 5
# Version 6 changes nothing in the log either: its nodes read a quiet leader's append_entries
# (``raft/extensions/quiescence.py``: a longer election timeout), so a leader quiesces only once it is enabled.
QUIESCENCE_SCHEMA_VERSION = 6
# Version 7: the rendezvous key-value store (kv_write, kv_drop, kv_expire; ``kv_store.py``).
KV_SCHEMA_VERSION = 7


class SchemaError(ValueError):
    """Bytes that are not a command or snapshot of a readable schema version."""


@dataclass(frozen=True, slots=True)
class TermStart:
    """Written by a new leader before it serves; applying it proves its state is caught up."""

    term: int
    node_id: str
    time_ms: int


@dataclass(frozen=True, slots=True)
class CommitQuorum:
    """Compare-and-set: install ``quorum`` as ``job``'s quorum only if that job's current quorum
    id is ``expected_quorum_id``."""

    expected_quorum_id: int
    quorum: Quorum
    term: int
    node_id: str
    job: str = DEFAULT_JOB


@dataclass(frozen=True, slots=True)
class ConfirmLeadership:
    """A no-op that renews the leader's quorum lease (``lease.py``): once it is committed while
    its writer still leads ``term``, a majority heard from that leader after it was written.
    ``lease_ms`` is the writer's lease length, which a later leader waits out before serving.
    Needs no schema version: an older node applies it as an unknown kind, a no-op."""

    term: int
    node_id: str
    lease_ms: int


@dataclass(frozen=True, slots=True)
class EnableSchema:
    """Raise the schema version writers may use (once every node runs a version that reads it)."""

    version: int


@dataclass(frozen=True, slots=True)
class UnknownCommand:
    """A command kind this version does not know; applied as a no-op."""

    kind: str


@dataclass(frozen=True, slots=True)
class SetMembers:
    """Compare-and-set of the member table: install ``members`` (node id, Raft address, client
    address) only if the table's version is ``expected_version``. Schema 2."""

    expected_version: int
    members: tuple[tuple[str, str, str], ...]


@dataclass(frozen=True, slots=True)
class PutJob:
    """Create a job (``expected_version`` 0, the job absent) or replace its spec (compare-and-set
    on the job's version). Schema 4."""

    spec: JobSpec
    expected_version: int


@dataclass(frozen=True, slots=True)
class RemoveJob:
    """Remove a job and its quorum state (compare-and-set on its version). Schema 4."""

    name: str
    expected_version: int


@dataclass(frozen=True, slots=True)
class KVWrite:
    """One write to the rendezvous store namespace ``(job, run_id)`` (``kv_store.KVStore.write``):
    ``request_id`` is the client's (kept across its retries, "" for none), ``time_ms`` the
    leader's wall clock when it submitted the write. Schema 7."""

    job: str
    run_id: str
    op: KVOp
    request_id: str
    time_ms: int


@dataclass(frozen=True, slots=True)
class KVDrop:
    """Drop the rendezvous namespace ``(job, run_id)`` and its keys. Schema 7."""

    job: str
    run_id: str


@dataclass(frozen=True, slots=True)
class KVExpire:
    """Drop every rendezvous namespace no write touched for ``idle_ms`` as of ``time_ms`` (the
    leader's wall clock). Schema 7."""

    time_ms: int
    idle_ms: int


Command = Union[TermStart, CommitQuorum, ConfirmLeadership, EnableSchema, SetMembers, PutJob, RemoveJob,
                KVWrite, KVDrop, KVExpire, UnknownCommand]

def member_to_wire(m: Member, version: int = SCHEMA_VERSION) -> dict[str, Any]:
    if m.raw and version >= PASS_THROUGH_SCHEMA_VERSION:
        return {"r": m.replica_id, "pb": m.raw}
    return {
        "r": m.replica_id, "a": m.address, "s": m.store_address, "st": m.step, "w": m.world_size,
        "so": m.shrink_only, "d": m.data, "cf": m.commit_failures,
    }


def member_from_wire(d: dict[str, Any]) -> Member:
    raw = d.get("pb")
    if raw is not None:
        try:
            return member_from_bytes(raw)
        except (DecodeError, TypeError) as e:
            raise SchemaError(f"member {d.get('r')!r} is not a serialized QuorumMember: {e}") from e
    return Member(
        replica_id=d["r"], address=d.get("a", ""), store_address=d.get("s", ""), step=d.get("st", 0),
        world_size=d.get("w", 0), shrink_only=d.get("so", False), data=d.get("d", ""),
        commit_failures=d.get("cf", 0),
    )


def quorum_to_wire(q: Quorum, version: int = SCHEMA_VERSION) -> dict[str, Any]:
    return {"id": q.quorum_id, "p": [member_to_wire(m, version) for m in q.participants], "c": q.created_ms}


def quorum_from_wire(d: dict[str, Any]) -> Quorum:
    return Quorum(
        quorum_id=d["id"],
        participants=tuple(member_from_wire(m) for m in d["p"]),
        created_ms=d.get("c", 0),
    )


def _pack(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(data: bytes, what: str) -> dict[str, Any]:
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (msgpack.UnpackException, ValueError, TypeError) as e:
        raise SchemaError(f"{what} is not valid msgpack: {e}") from e
    if not isinstance(obj, dict) or "v" not in obj:
        raise SchemaError(f"{what} has no schema version")
    v = obj["v"]
    if not isinstance(v, int) or not MIN_READABLE_VERSION <= v:
        raise SchemaError(f"{what} has unreadable schema version {v!r}")
    return obj


def encode_command(cmd: Command, version: int = SCHEMA_VERSION) -> bytes:
    """Encode a command at schema ``version`` (the cluster's enabled version)."""
    if isinstance(cmd, TermStart):
        body = {"k": "term_start", "term": cmd.term, "node": cmd.node_id, "t": cmd.time_ms}
    elif isinstance(cmd, CommitQuorum):
        body = {"k": "commit_quorum", "expect": cmd.expected_quorum_id, "q": quorum_to_wire(cmd.quorum, version),
                "term": cmd.term, "node": cmd.node_id}
        if cmd.job != DEFAULT_JOB:
            _need_jobs(version, f"a commit for job {cmd.job!r}")
            body["j"] = cmd.job
    elif isinstance(cmd, ConfirmLeadership):
        body = {"k": "confirm", "term": cmd.term, "node": cmd.node_id, "lease": cmd.lease_ms}
    elif isinstance(cmd, EnableSchema):
        body = {"k": "enable_schema", "version": cmd.version}
    elif isinstance(cmd, SetMembers):
        if version < MEMBERS_SCHEMA_VERSION:
            raise ValueError(f"set_members needs schema {MEMBERS_SCHEMA_VERSION}; the cluster has {version} enabled")
        body = {"k": "set_members", "expect": cmd.expected_version, "m": [list(m) for m in cmd.members]}
    elif isinstance(cmd, PutJob):
        _need_jobs(version, "put_job")
        body = {"k": "put_job", "expect": cmd.expected_version, "spec": spec_to_wire(cmd.spec)}
    elif isinstance(cmd, RemoveJob):
        _need_jobs(version, "remove_job")
        body = {"k": "remove_job", "expect": cmd.expected_version, "n": cmd.name}
    elif isinstance(cmd, KVWrite):
        _need_kv(version, "kv_write")
        body = {"k": "kv_write", "j": cmd.job, "r": cmd.run_id, "op": op_to_wire(cmd.op), "t": cmd.time_ms}
        if cmd.request_id:
            body["rid"] = cmd.request_id
    elif isinstance(cmd, KVDrop):
        _need_kv(version, "kv_drop")
        body = {"k": "kv_drop", "j": cmd.job, "r": cmd.run_id}
    elif isinstance(cmd, KVExpire):
        _need_kv(version, "kv_expire")
        body = {"k": "kv_expire", "t": cmd.time_ms, "idle": cmd.idle_ms}
    else:
        raise TypeError(f"cannot encode {cmd!r}")
    body["v"] = version
    return _pack(body)


def _need_jobs(version: int, what: str) -> None:
    if version < JOBS_SCHEMA_VERSION:
        raise ValueError(f"{what} needs schema {JOBS_SCHEMA_VERSION}; the cluster has {version} enabled")


def _need_kv(version: int, what: str) -> None:
    if version < KV_SCHEMA_VERSION:
        raise ValueError(f"{what} needs schema {KV_SCHEMA_VERSION}; the cluster has {version} enabled")


def decode_command(data: bytes) -> Command:
    """Decode a command; kinds this version does not know become ``UnknownCommand``."""
    return decode_versioned(data)[0]


def decode_versioned(data: bytes) -> tuple[Command, int]:
    """Decode a command and the schema version it was written at."""
    obj = _unpack(data, "command")
    return _command_of(obj), obj["v"]


def _command_of(obj: dict[str, Any]) -> Command:
    kind = obj.get("k")
    try:
        if kind == "term_start":
            return TermStart(term=obj["term"], node_id=obj["node"], time_ms=obj["t"])
        if kind == "commit_quorum":
            return CommitQuorum(expected_quorum_id=obj["expect"], quorum=quorum_from_wire(obj["q"]),
                                term=obj["term"], node_id=obj["node"], job=str(obj.get("j", DEFAULT_JOB)))
        if kind == "confirm":
            return ConfirmLeadership(term=obj["term"], node_id=obj["node"], lease_ms=obj["lease"])
        if kind == "enable_schema":
            return EnableSchema(version=obj["version"])
        if kind == "put_job":
            return PutJob(spec=spec_from_wire(obj["spec"]), expected_version=obj["expect"])
        if kind == "remove_job":
            return RemoveJob(name=str(obj["n"]), expected_version=obj["expect"])
        if kind == "kv_write":
            return KVWrite(job=str(obj["j"]), run_id=str(obj["r"]), op=op_from_wire(obj["op"]),
                           request_id=str(obj.get("rid", "")), time_ms=int(obj["t"]))
        if kind == "kv_drop":
            return KVDrop(job=str(obj["j"]), run_id=str(obj["r"]))
        if kind == "kv_expire":
            return KVExpire(time_ms=int(obj["t"]), idle_ms=int(obj["idle"]))
        if kind == "set_members":
            return SetMembers(expected_version=obj["expect"],
                              members=tuple((str(m[0]), str(m[1]), str(m[2])) for m in obj["m"]))
    except SchemaError:
        raise
    except KeyError as e:
        raise SchemaError(f"malformed {kind} command: missing {e}") from e
    except (TypeError, ValueError, AttributeError) as e:
        # A value of the wrong shape (a port that is no integer, a pair of three): any exception
        # but SchemaError would fail the apply on every node at this entry, at every tick.
        raise SchemaError(f"malformed {kind} command: {e}") from e
    return UnknownCommand(kind=str(kind))


def encode_snapshot(state: dict[str, Any], version: int = SCHEMA_VERSION) -> bytes:
    """Encode a state-machine snapshot (a dict of msgpack-able values)."""
    return _pack({**state, "v": version})


def decode_snapshot(data: bytes) -> dict[str, Any]:
    return _unpack(data, "snapshot")
