"""Administration on a node: who may call (the admin token) and what the admin RPCs do.

``check_token`` decides whether a call carries the admin token (``authorization: Bearer <token>``
gRPC metadata, compared in constant time). ``NodeAdmin`` carries the calls out on the node:

* members: ``list`` (any node), ``add`` / ``remove`` (leader): a runtime membership change
  through pysyncobj's dynamic membership, with the member table (id, Raft address, client
  address) replicated through the state machine (``codec.SetMembers``) so every node can route
  to every member, and persisted by each node in its data directory for restarts;
* ``transfer_leader`` (leader): Raft's TimeoutNow to a caught-up follower;
* ``save_snapshot`` (leader): the state machine read on the Raft thread, so consistent as of
  ``last_applied``;
* ``restore_snapshot`` (leader): the snapshot's quorum committed through the ordinary
  compare-and-set, and only when its id is above the cluster's: quorum ids never go backwards.

Failures are ``AdminError`` with a gRPC status code and a one-line message for the operator.
What ``NodeAdmin`` uses of the node, and of the Raft node it holds, is ``AdminNode`` and
``AdminRaft``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol

import grpc

from lighthouse_cluster.client.discovery import not_leader_metadata
from lighthouse_cluster.core import codec
from lighthouse_cluster.core.defaults import ADMIN_COMMIT_TIMEOUT_S, HANDOVER_TIMEOUT_S, MEMBERSHIP_TIMEOUT_S
from lighthouse_cluster.core.codec import CommitQuorum, EnableSchema, PutJob, SetMembers
from lighthouse_cluster.core.jobs import DEFAULT_JOB
from lighthouse_cluster.core.state_machine import CommitResult, QuorumStateMachine
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.raft.replication import CommitError
from lighthouse_cluster.server.config import PeerSpec
from lighthouse_cluster.server.loop_bridge import loop_future

if TYPE_CHECKING:
    from lighthouse_cluster.server.config import NodeConfig

log = logging.getLogger(__name__)

AUTH_HEADER = "authorization"
NO_TOKEN_MESSAGE = ("admin calls are disabled on this node: it has no admin token "
                    "(start it with LIGHTHOUSE_CLUSTER_ADMIN_TOKEN or --admin-token)")
BAD_TOKEN_MESSAGE = "admin calls need 'authorization: Bearer <admin token>' metadata with this cluster's token"
# A TimeoutNow not followed by an election within this long is sent again.
RESEND_S = 1.0


class AdminError(Exception):
    """An admin call that cannot be carried out; ``code`` is the gRPC status to answer."""

    def __init__(self, code: grpc.StatusCode, message: str,
                 trailing: tuple[tuple[str, str | bytes], ...] = ()) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        # Trailing metadata sent with the refusal: ``discovery.not_leader_metadata`` on a node
        # that does not lead.
        self.trailing = trailing


def check_token(metadata: Iterable[tuple[str, Any]] | None, token: str | None) -> AdminError | None:
    """None when ``metadata`` carries ``token`` as a bearer token; else the error to answer."""
    if not token:
        return AdminError(grpc.StatusCode.PERMISSION_DENIED, NO_TOKEN_MESSAGE)
    presented = ""
    for key, value in metadata or ():
        if key.lower() == AUTH_HEADER:
            presented = value.decode() if isinstance(value, bytes) else value
    scheme, _, credential = presented.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(credential.strip().encode(), token.encode()):
        return AdminError(grpc.StatusCode.UNAUTHENTICATED, BAD_TOKEN_MESSAGE)
    return None


def token_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((AUTH_HEADER, f"Bearer {token}"),)


def _info(p: PeerSpec) -> cpb.NodeInfo:
    return cpb.NodeInfo(id=p.node_id, client_address=p.client_address, raft_address=p.raft_address)


class AdminRaft(Protocol):
    """The Raft node's reads and operations the admin calls use (``raft.replication.RaftNode``)."""

    @property
    def is_leader(self) -> bool: ...

    @property
    def led_term(self) -> int | None: ...

    @property
    def term(self) -> int: ...

    @property
    def last_applied(self) -> int: ...

    @property
    def raft_members(self) -> list[str]: ...

    def is_connected(self, address: str) -> bool: ...

    def call_on_tick_thread(self, fn: Callable[[], Any], callback: Callable[[Any, Exception | None], None]) -> None:
        ...

    def change_membership(self, add: bool, address: str, callback: Callable[[str | None], None]) -> None: ...

    def transfer_leadership(self, address: str | None = None,
                            callback: Callable[[str | None], None] | None = None) -> None: ...


class LeaderRounds(Protocol):
    """What the admin calls read from the leader's coordinator (``coordinator.QuorumCoordinator``)."""

    @property
    def term(self) -> int | None: ...

    @property
    def serving(self) -> bool: ...


class AdminNode(Protocol):
    """What the admin calls use of the node (``LighthouseNode``)."""

    @property
    def config(self) -> NodeConfig: ...

    @property
    def raft(self) -> AdminRaft | None: ...

    @property
    def coordinator(self) -> LeaderRounds | None: ...

    @property
    def machine(self) -> QuorumStateMachine: ...

    @property
    def members(self) -> tuple[PeerSpec, ...]: ...

    @property
    def other_members(self) -> tuple[PeerSpec, ...]: ...

    def leader_peer(self) -> PeerSpec | None: ...

    def submit(self, command: codec.Command) -> asyncio.Future[Any]:
        """Append ``command`` to the Raft log; the future settles once it is applied or failed."""

    def refresh_members(self) -> None:
        """Adopt (and persist) the replicated member table after it changed."""


def _named_leader(node: AdminNode, leader: PeerSpec | None) -> tuple[str, str, int]:
    """(leader id, its client address, this node's term) for the "not the leader" detail; empty
    names when no other node is known to lead."""
    term = node.raft.term if node.raft is not None else 0
    if leader is None or leader.node_id == node.config.node_id:
        return "", "", term
    return leader.node_id, leader.client_address, term


class NodeAdmin:
    """The admin calls, carried out on ``node``; see the module docstring."""

    def __init__(self, node: AdminNode) -> None:
        self.node = node
        self._membership_lock = asyncio.Lock()

    # -- helpers ----------------------------------------------------------------------------------

    def require_leader(self, what: str) -> None:
        node = self.node
        raft, coord = node.raft, node.coordinator
        if raft is None or coord is None or not raft.is_leader or coord.term is None or not coord.serving:
            leader = node.leader_peer()
            where = f"the leader is {leader.node_id} at {leader.client_address}" if leader is not None and \
                leader.node_id != node.config.node_id else "no leader is serving yet; retry shortly"
            # The sentence stays for clients older than the typed detail (a rolling upgrade).
            raise AdminError(grpc.StatusCode.FAILED_PRECONDITION,
                             f"{what} must run on the leader; node {node.config.node_id} is not ({where})",
                             not_leader_metadata(*_named_leader(node, leader)))

    async def commit(self, command: codec.Command) -> Any:
        try:
            return await asyncio.wait_for(self.node.submit(command), ADMIN_COMMIT_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise AdminError(grpc.StatusCode.ABORTED, "the change was not committed in time (outcome unknown; "
                             "check with `members list` / `status` and retry)") from None
        except CommitError as e:
            raise AdminError(grpc.StatusCode.ABORTED, f"the change was not committed ({e.reason}); retry") from None

    async def _on_tick_thread(self, fn: Any) -> Any:
        future, done = loop_future(asyncio.get_running_loop())
        assert self.node.raft is not None
        self.node.raft.call_on_tick_thread(fn, done)
        return await asyncio.wait_for(future, ADMIN_COMMIT_TIMEOUT_S)

    async def _raft_membership(self, add: bool, address: str) -> None:
        future, done = loop_future(asyncio.get_running_loop())
        assert self.node.raft is not None
        self.node.raft.change_membership(add, address, lambda error: done(error, None))
        try:
            error = await asyncio.wait_for(future, MEMBERSHIP_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise AdminError(grpc.StatusCode.ABORTED, "the Raft membership change was not committed in time "
                             "(outcome unknown; check `members list` and retry)") from None
        if error is not None:
            raise AdminError(grpc.StatusCode.ABORTED,
                             f"Raft refused the membership change ({error}): one change at a time, "
                             "and only once the leader's first entry of its term committed; retry")

    async def _set_members(self, members: tuple[PeerSpec, ...]) -> None:
        machine = self.node.machine
        if machine.schema_version < codec.MEMBERS_SCHEMA_VERSION:
            await self.commit(EnableSchema(version=codec.MEMBERS_SCHEMA_VERSION))
        result = await self.commit(SetMembers(
            expected_version=machine.members_version,
            members=tuple((m.node_id, m.raft_address, m.client_address) for m in members)))
        if not isinstance(result, CommitResult) or not result.applied:
            raise AdminError(grpc.StatusCode.ABORTED, "the member table changed meanwhile; retry")
        self.node.refresh_members()

    # -- calls ------------------------------------------------------------------------------------

    def list_members(self) -> cpb.MembersResponse:
        node = self.node
        raft = node.raft
        leader = node.leader_peer()
        connected = [p.node_id for p in node.other_members if raft is not None and raft.is_connected(p.raft_address)]
        return cpb.MembersResponse(
            members=[_info(p) for p in node.members], leader_id=leader.node_id if leader else "",
            term=raft.term if raft else 0, version=node.machine.members_version, connected=connected)

    async def add_member(self, info: cpb.NodeInfo) -> cpb.MembersResponse:
        from lighthouse_cluster.server.config import ConfigError, check_node_id, normalize_address

        try:
            check_node_id(info.id)
            new = PeerSpec(info.id, normalize_address(info.raft_address, "Raft address"),
                           normalize_address(info.client_address, "client address"))
        except ConfigError as e:
            raise AdminError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        async with self._membership_lock:
            self.require_leader("members add")
            members = self.node.members
            same = next((m for m in members if m.node_id == new.node_id), None)
            if same is not None and same != new:
                raise AdminError(grpc.StatusCode.ALREADY_EXISTS,
                                 f"{new.node_id} is already a member as {same}; remove it first")
            clash = [m.node_id for m in members if m.node_id != new.node_id and
                     (m.raft_address == new.raft_address or m.client_address == new.client_address)]
            if clash:
                raise AdminError(grpc.StatusCode.ALREADY_EXISTS, f"{clash[0]} already uses one of {new}'s addresses")
            if same is None:
                await self._set_members(members + (new,))
            # The table first: whoever leads next can route to the new member at once.
            if new.raft_address not in await self._on_tick_thread(lambda: self.node.raft.raft_members):
                await self._raft_membership(True, new.raft_address)
            log.warning("member %s added", new)
        return self.list_members()

    async def remove_member(self, node_id: str) -> cpb.MembersResponse:
        async with self._membership_lock:
            self.require_leader("members remove")
            members = self.node.members
            target = next((m for m in members if m.node_id == node_id), None)
            if target is None:
                raise AdminError(grpc.StatusCode.NOT_FOUND,
                                 f"{node_id!r} is not a member (members: {', '.join(m.node_id for m in members)})")
            if node_id == self.node.config.node_id:
                raise AdminError(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"{node_id} is the leader: run `lighthouse-cluster transfer-leader` first")
            if len(members) <= 1:
                raise AdminError(grpc.StatusCode.FAILED_PRECONDITION, "cannot remove the last member")
            # Raft first: once the node no longer votes, the table stops naming it.
            if target.raft_address in await self._on_tick_thread(lambda: self.node.raft.raft_members):
                await self._raft_membership(False, target.raft_address)
            await self._set_members(tuple(m for m in members if m.node_id != node_id))
            log.warning("member %s removed", target)
        return self.list_members()

    async def transfer_leader(self, to_node_id: str) -> cpb.TransferLeaderResponse:
        node = self.node
        self.require_leader("transfer-leader")
        raft = node.raft
        assert raft is not None
        target_address = None
        if to_node_id:
            target = next((m for m in node.members if m.node_id == to_node_id), None)
            if target is None:
                raise AdminError(grpc.StatusCode.NOT_FOUND, f"{to_node_id!r} is not a member")
            if target.node_id == node.config.node_id:
                raise AdminError(grpc.StatusCode.FAILED_PRECONDITION, f"{to_node_id} already leads")
            if not raft.is_connected(target.raft_address):
                raise AdminError(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"{to_node_id} is not connected to the leader; pick another node")
            target_address = target.raft_address
        elif not node.other_members:
            raise AdminError(grpc.StatusCode.FAILED_PRECONDITION, "a one-node cluster has nobody to hand over to")
        leader_id, term, reason = await self.hand_over(target_address, HANDOVER_TIMEOUT_S)
        if leader_id is None:
            raise AdminError(grpc.StatusCode.DEADLINE_EXCEEDED,
                             f"leadership did not move within {HANDOVER_TIMEOUT_S:g} s ({reason}); retry")
        return cpb.TransferLeaderResponse(previous_leader_id=node.config.node_id, leader_id=leader_id, term=term)

    async def hand_over(self, target_address: str | None, timeout: float) -> tuple[str | None, int, str]:
        """Move leadership to ``target_address`` (None: the most caught-up connected follower)
        within ``timeout`` seconds: ``(new leader id, term, "")``, or ``(None, term, why not)``.

        Raft's TimeoutNow is refused while the target is even one entry behind, which under load
        (a commit every few ms) is common: a refusal is retried every 20 ms, and a request that
        was sent but followed by no election is re-sent after ``RESEND_S``. Used by
        ``transfer-leader`` and by a leader that stops (SIGTERM)."""
        node = self.node
        raft = node.raft
        assert raft is not None
        me = node.config.node_id
        sent_term: int | None = None
        sent_at = 0.0
        refusal = "the target is not caught up"
        deadline = time.monotonic() + timeout
        while True:
            leader = node.leader_peer()
            if sent_term is not None and raft.term > sent_term and leader is not None and leader.node_id != me:
                log.warning("leadership handed over to %s (term %d)", leader.node_id, raft.term)
                return leader.node_id, raft.term, ""
            if time.monotonic() >= deadline:
                return None, raft.term, ("no election followed" if sent_term is not None else refusal)
            coord = node.coordinator
            leading = raft.led_term == raft.term and coord is not None and coord.term == raft.term and coord.serving
            # Send TimeoutNow while this node leads: at first, again after a split vote it won
            # back (a newer term), or when the last one was lost (no election followed).
            if leading and (sent_term is None or raft.term > sent_term or time.monotonic() - sent_at > RESEND_S):
                outcome: list[str | None] = []

                def send() -> int:  # on the Raft thread: the term is the one the request was sent in
                    raft.transfer_leadership(target_address, outcome.append)
                    return raft.term

                term = await self._on_tick_thread(send)
                if outcome and outcome[0] is None:
                    sent_term, sent_at = term, time.monotonic()
                elif outcome:
                    refusal = outcome[0] or refusal  # e.g. the target is a few entries behind: retry
            await asyncio.sleep(0.02)

    async def save_snapshot(self) -> cpb.Snapshot:
        node = self.node
        self.require_leader("snapshot save")
        raft, machine = node.raft, node.machine
        assert raft is not None

        def read() -> cpb.Snapshot:  # on the Raft thread: no entry applies meanwhile
            return cpb.Snapshot(state=machine.to_snapshot(), term=raft.term, last_applied=raft.last_applied,
                                quorum_id=machine.quorum_id, leader_id=node.config.node_id,
                                taken_ms=int(time.time() * 1000), schema_version=machine.schema_version)

        return await self._on_tick_thread(read)

    async def restore_snapshot(self, snapshot: cpb.Snapshot) -> cpb.RestoreResponse:
        """Commit the snapshot's quorums where the cluster's ids are below them: the default job's,
        and every other job's (a job the cluster lacks is created with its saved spec first)."""
        node = self.node
        self.require_leader("snapshot restore")
        saved = QuorumStateMachine()
        try:
            saved.restore_snapshot(snapshot.state)
        except (codec.SchemaError, KeyError, TypeError, ValueError) as e:
            raise AdminError(grpc.StatusCode.INVALID_ARGUMENT, f"not a readable snapshot: {e}") from None
        others = sorted(n for n in saved.jobs if n != DEFAULT_JOB)
        if saved.quorum is None and not others:
            raise AdminError(grpc.StatusCode.FAILED_PRECONDITION, "the snapshot holds no quorum: nothing to restore")
        current = node.machine.quorum_id
        restored = saved.quorum is not None and saved.quorum.quorum_id > current
        if saved.quorum is not None and not restored and not others:
            raise AdminError(grpc.StatusCode.FAILED_PRECONDITION,
                             f"the cluster is at quorum id {current}, the snapshot at {saved.quorum.quorum_id}: "
                             "nothing to restore (quorum ids never go backwards)")
        if restored:
            assert saved.quorum is not None
            await self._restore_quorum(DEFAULT_JOB, current, saved.quorum)
            log.warning("restored quorum %d from a snapshot (was %d)", saved.quorum.quorum_id, current)
        out = cpb.RestoreResponse(applied=restored, quorum_id=node.machine.quorum_id, previous_quorum_id=current)
        for name in others:
            out.jobs.append(await self._restore_job(name, saved))
        if not restored and not any(j.created or j.quorum_id > j.previous_quorum_id for j in out.jobs):
            why = "; ".join(f"{j.name}: {j.not_restored}" for j in out.jobs if j.not_restored)
            raise AdminError(grpc.StatusCode.FAILED_PRECONDITION,
                             f"nothing to restore (quorum ids never go backwards){': ' + why if why else ''}")
        out.applied = True
        return out

    async def _restore_quorum(self, job: str, current: int, quorum: Any) -> None:
        coord = self.node.coordinator
        result = await self.commit(CommitQuorum(expected_quorum_id=current, quorum=quorum,
                                                term=coord.term if coord and coord.term else 0,
                                                node_id=self.node.config.node_id, job=job))
        if not isinstance(result, CommitResult) or not result.applied:
            raise AdminError(grpc.StatusCode.ABORTED, f"a quorum of job {job} committed meanwhile; retry the restore")

    async def _restore_job(self, name: str, saved: QuorumStateMachine) -> cpb.RestoredJob:
        machine = self.node.machine
        js = saved.jobs[name]
        out = cpb.RestoredJob(name=name)
        here = machine.job(name)
        if here is None:
            if machine.schema_version < codec.JOBS_SCHEMA_VERSION:
                out.not_restored = f"the cluster has schema {machine.schema_version} enabled, jobs need {codec.JOBS_SCHEMA_VERSION}"
                return out
            result = await self.commit(PutJob(spec=js.spec, expected_version=0))
            if not getattr(result, "applied", False):
                out.not_restored = f"not created: {getattr(result, 'reason', 'not applied')}"
                return out
            out.created = True
            here = machine.job(name)
            assert here is not None
        out.previous_quorum_id = out.quorum_id = here.quorum_id
        if js.quorum is None:
            return out
        if js.quorum.quorum_id <= here.quorum_id:
            out.not_restored = f"the cluster is at quorum id {here.quorum_id}, the snapshot at {js.quorum.quorum_id}"
            return out
        await self._restore_quorum(name, here.quorum_id, js.quorum)
        out.quorum_id = js.quorum.quorum_id
        log.warning("restored job %s's quorum %d from a snapshot (was %d)", name, out.quorum_id, out.previous_quorum_id)
        return out
