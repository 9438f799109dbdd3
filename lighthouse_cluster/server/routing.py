"""Where each call goes: every routing decision of a node, in ``Router``.

The leader answers a Quorum call from its coordinator. A follower does not answer Quorum itself:
it forwards the caller's bytes to the node it believes leads and relays the leader's bytes back
unparsed. A forwarded call is never forwarded twice: a node that receives one but no longer leads
answers UNAVAILABLE, and the origin re-routes. A call whose leader changed while it waited is
re-sent to the new leader until the caller's deadline; just before that deadline
(``DEADLINE_MARGIN_S``) it ends as torchft's own client timer would end it (``TIMEOUT_MESSAGE``).

Heartbeats go to the coordinator on the leader and to the leader in batches from a follower; the
leader accepts followers' batches while it has a coordinator with a term.

Every call belongs to a job (``core/jobs.py``; the default job unless the call names another).
The leader answers it from that job's coordinator, or NOT_FOUND when the cluster has no such job;
a follower forwards it with its job whatever its own (possibly lagging) copy of the job table
says, and the leader decides. A job's limits (members, member size) are checked where the call is
answered, on the leader. With auto-creation on (``--auto-create-jobs``, ``creator``), the leader
first creates a job it does not have (``job_creation.JobCreator.ensure``) and then answers, and
a follower takes a unary heartbeat for any job to the leader.

The router reads who leads from the node (``Leadership``; ``LighthouseNode`` satisfies it) and is
told by the node when that may have changed (``leadership_changed``); it never touches Raft. How
calls travel (channels, the forwarding stream, heartbeat batches) is ``forwarding.py``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol

import grpc
from google.protobuf.message import DecodeError

from lighthouse_cluster.core.jobs import DEFAULT_JOB, JobError, check_job_name
from lighthouse_cluster.core.quorum import Member
from lighthouse_cluster.proto import torchft_pb2 as pb
from lighthouse_cluster.server.admin import AdminError
from lighthouse_cluster.server.coordinator import JobLimitError, NotLeader, QuorumCoordinator
from lighthouse_cluster.server.forwarding import (
    HeartbeatBatcher,
    PeerChannels,
    QuorumForwarder,
    QuorumForwardingService,
    failure_as_is,
    forward_error,
)
from lighthouse_cluster.server.grpc_services import InvalidRequest, validate_requester

if TYPE_CHECKING:
    from lighthouse_cluster.server.config import PeerSpec

log = logging.getLogger(__name__)

# While no leader is known, a waiting call re-checks at least this often.
REROUTE_POLL_S = 0.05
# A call for a job that exists before this node serves it looks again this often.
JOB_SYNC_POLL_S = 0.005
# A Quorum call is answered this long before the caller's deadline (see Router.route_quorum).
DEADLINE_MARGIN_S = 0.02
TIMEOUT_MESSAGE = "Timeout expired"


class RaftLeadership(Protocol):
    """The Raft node's view of leadership that routing reads (``raft.replication.RaftNode``)."""

    @property
    def is_leader(self) -> bool: ...

    def note_client_activity(self) -> None:
        """A client called (the Raft leader stays, or wakes, out of quiescence)."""


class Leadership(Protocol):
    """What the router reads from its node: Raft's leadership, the coordinator, the leader."""

    @property
    def raft(self) -> RaftLeadership | None: ...

    def job_coordinator(self, job: str) -> QuorumCoordinator | None:
        """The coordinator of ``job`` on this node (None: no such job here)."""

    def leader_peer(self) -> PeerSpec | None:
        """The leader as far as the node knows; None when unknown or not connected."""


class JobAutoCreation(Protocol):
    """Creates a job on its first use (``job_creation.JobCreator``)."""

    async def ensure(self, job: str) -> None:
        """Return once ``job`` exists, creating it; ``AdminError`` when it cannot be created."""

    def ensure_soon(self, job: str, then: Callable[[], None]) -> None:
        """``ensure(job)`` in the background, then ``then()``."""


# Failures of a job's creation that no retry mends: the call ends with them.
_CREATION_FINAL = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND)


def _failed(error: BaseException) -> asyncio.Future[bytes]:
    failed: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
    failed.set_exception(error)
    return failed


def _retrieve(task: "asyncio.Future[Any]") -> None:
    if not task.cancelled():
        task.exception()


class Router:
    """Routes Quorum calls and heartbeats to the leader's coordinator (see the module docstring).

    Owns the mechanisms it drives: ``forwarder`` (follower side of forwarding), ``forwarding``
    (the leader side, a gRPC service the node registers) and ``heartbeats`` (the follower's
    batcher); ``start()`` and ``await stop()`` with the node."""

    def __init__(self, node: Leadership, channels: PeerChannels, node_id: str, max_member_bytes: int) -> None:
        self._node = node
        self._node_id = node_id
        self._max_member_bytes = max_member_bytes
        self._changed = asyncio.Event()
        # Forwarded calls waiting for their answer: forward -> the leader it went to. One that
        # leadership_changed gave up is no longer here.
        self._forwards: dict[asyncio.Future[bytes | None], str] = {}
        self.forwarder = QuorumForwarder(channels, node_id)
        # The leader side of forwarder.
        self.forwarding = QuorumForwardingService(self.answer_forwarded, self.forwarded_failure)
        self.heartbeats = HeartbeatBatcher(channels, node_id, self.remote_leader_address)
        self.forwarded_quorum_calls = 0
        self.rerouted_quorum_calls = 0
        # Set by the node with --auto-create-jobs: unknown jobs are created on first use.
        self.creator: JobAutoCreation | None = None

    @property
    def forwarded_heartbeats(self) -> int:
        return self.heartbeats.forwarded

    @property
    def heartbeat_batches(self) -> int:
        return self.heartbeats.batches

    @property
    def forwarded_quorum_messages(self) -> int:
        return self.forwarder.messages_sent

    def start(self) -> None:
        self.heartbeats.start()

    async def stop(self) -> None:
        await self.heartbeats.stop()
        self.forwarder.close()

    # -- leadership ------------------------------------------------------------------------------

    def leadership_changed(self) -> None:
        """The node saw Raft's role, term or leader change: waiting calls look again, and the
        forwarded calls whose leader is no longer the one are given up (``_forward_while_leader``)."""
        self._changed.set()
        self._changed = asyncio.Event()
        if self._forwards:
            now, leading = self.remote_leader_address(), self._leading()
            for forward, leader in list(self._forwards.items()):
                if leading or (now is not None and now != leader):
                    del self._forwards[forward]
                    forward.cancel()

    async def _wait_for_change(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def remote_leader_address(self) -> str | None:
        """The client address to forward to: the leader's, unless unknown or this node leads."""
        peer = self._node.leader_peer()
        if peer is None or peer.node_id == self._node_id:
            return None
        return peer.client_address

    def _client_called(self) -> None:
        raft = self._node.raft
        if raft is not None:
            raft.note_client_activity()

    def _leading(self) -> bool:
        raft = self._node.raft
        return raft is not None and raft.is_leader

    def _leading_coordinator(self, job: str = DEFAULT_JOB) -> QuorumCoordinator | None:
        """The job's coordinator, when this node leads and that coordinator has taken the term."""
        coord = self._node.job_coordinator(job)
        if self._leading() and coord is not None and coord.term is not None:
            return coord
        return None

    def known_job(self, job: str) -> bool:
        """Whether this node's copy of the job table has ``job``, or, with auto-creation on,
        whether ``job`` could be created (a valid name)."""
        if job == DEFAULT_JOB or self._node.job_coordinator(job) is not None:
            return True
        if self.creator is None:
            return False
        try:
            check_job_name(job)
        except JobError:
            return False
        return True

    async def _create_job(self, job: str, left: float | None) -> AdminError | None:
        """With auto-creation on, on the leader: create ``job``. None: it exists now, or it could
        not be created yet (not committed, the jobs schema not enabled yet: this waits a little
        first, the caller tries again); the error when it cannot be created."""
        assert self.creator is not None
        try:
            await self.creator.ensure(job)
            if self._node.job_coordinator(job) is not None:
                return None
            # The job exists, but this node's registry has not built its coordinator yet (it does
            # on this event loop: the creating call's sync, the watch loop). ``ensure`` returned
            # without suspending, so the caller's loop would spin here, blocking the event loop
            # (and that sync) until the call's deadline: wait a moment instead.
            await asyncio.sleep(JOB_SYNC_POLL_S if left is None else max(0.0, min(JOB_SYNC_POLL_S, left)))
            return None
        except AdminError as e:
            if e.code in _CREATION_FINAL:
                return e
            log.debug("job %s not created yet (%s); trying again", job, e.message)
        await self._wait_for_change(REROUTE_POLL_S if left is None else max(0.0, min(REROUTE_POLL_S, left)))
        return None

    def _missing_job(self, job: str) -> str | None:
        """The NOT_FOUND message when this node leads and has no ``job`` (None otherwise)."""
        if job != DEFAULT_JOB and self._leading() and self._node.job_coordinator(job) is None:
            return f"no job {job!r} on this cluster (lighthouse-cluster jobs list; jobs add {job} creates it)"
        return None

    # -- Quorum ----------------------------------------------------------------------------------

    async def route_quorum(self, member: Member, raw: bytes, time_remaining: float | None,
                           forwarded_by: str | None, context: grpc.aio.ServicerContext,
                           job: str = DEFAULT_JOB) -> bytes:
        """Answer a Quorum call of ``job`` from the leader's coordinator, wherever it is, until
        the deadline."""
        self._client_called()
        loop = asyncio.get_running_loop()
        deadline = None if time_remaining is None else loop.time() + time_remaining

        def remaining() -> float | None:
            """Seconds until this node gives up, a margin before the caller's deadline."""
            return None if deadline is None else deadline - loop.time() - DEADLINE_MARGIN_S

        attempt = 0
        while True:
            left = remaining()
            if left is not None and left <= 0:
                # torchft's lighthouse never ends a waiting call; its client's own timer does, with
                # exactly this status. Answering it just before the deadline keeps trainers'
                # error handling (and torchft's tests) seeing the same thing from us.
                await context.abort(grpc.StatusCode.CANCELLED, TIMEOUT_MESSAGE)
            if attempt:
                self.rerouted_quorum_calls += 1
            attempt += 1
            coord = self._leading_coordinator(job)
            if coord is not None:
                try:
                    return await coord.request(member, left)
                except NotLeader:
                    continue
                except asyncio.TimeoutError:
                    continue  # the deadline check above aborts
                except JobLimitError as e:
                    await context.abort(e.code, str(e))
            missing = self._missing_job(job)
            if missing is not None:
                if self.creator is None:
                    await context.abort(grpc.StatusCode.NOT_FOUND, missing)
                error = await self._create_job(job, left)
                if error is not None:
                    await context.abort(error.code, error.message, getattr(error, "trailing", ()))
                continue
            if forwarded_by is not None:
                # Never forward twice: the origin re-routes once it knows the new leader.
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    f"node {self._node_id} is not the leader (forwarded by {forwarded_by})")
            leader = self.remote_leader_address()
            if leader is not None:
                try:
                    self.forwarded_quorum_calls += 1
                    response = await self._forward_while_leader(
                        leader, raw, None if left is None else left + DEADLINE_MARGIN_S, job)
                    if response is not None:
                        return response
                    continue  # the leader moved while the call waited: re-send to the new one
                except grpc.aio.AioRpcError as e:
                    code = e.code()
                    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                                grpc.StatusCode.RESOURCE_EXHAUSTED):
                        await context.abort(code, e.details() or code.name.lower())
                    if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED) and \
                            e.details() in (TIMEOUT_MESSAGE, "Deadline Exceeded"):
                        # The leader gave up on our behalf: the caller's deadline is (almost) here.
                        await context.abort(grpc.StatusCode.CANCELLED, TIMEOUT_MESSAGE)
                    (log.info if attempt == 1 else log.debug)(
                        "quorum call for %s via leader %s failed (%s); re-routing", member.replica_id, leader,
                        code.name)
                    if self.remote_leader_address() != leader:
                        continue
            left = remaining()
            await self._wait_for_change(REROUTE_POLL_S if left is None else max(0.0, min(REROUTE_POLL_S, left)))

    async def _forward_while_leader(self, leader: str, raw: bytes, timeout: float | None,
                                    job: str = DEFAULT_JOB) -> bytes | None:
        """Forward to ``leader``; give up (None) as soon as Raft names another leader or this node
        leads, since a deposed leader can commit nothing and would only fail the call after stepping
        down.

        A leader merely *unknown* is no reason to: that is also this node's Raft link to the leader
        dropping and coming back within the term (a reset connection, a tick stall under load;
        docs/design/follower-forwarding.md), and withdrawing then would take the call out of the
        round the leader is collecting, only to send it again a moment later. The call stays with
        the leader, which answers it, or fails it when it steps down; a dead leader ends the stream;
        its deadline bounds the wait."""
        forward = self.forwarder.forward(leader, raw, timeout, job)
        # A forward given up on may still end in an error (its answer raced the cancel): seen here,
        # not logged as "Future exception was never retrieved".
        forward.add_done_callback(_retrieve)
        # leadership_changed gives it up (cancels it) when the leader changes. One registration
        # per call, not a task and an asyncio.wait per call and per change: a follower holds
        # thousands of them at large N (docs/design/follower-forwarding.md).
        self._forwards[forward] = leader
        try:
            # Not shielded: this call cancelled (its client went away) cancels its forward, which
            # withdraws it at the leader, and ends cancelled here whatever the forward ended with
            # (a task cancelled while the future it awaits is already done is cancelled at its
            # next step all the same).
            return await forward
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if forward not in self._forwards and (current is None or not current.cancelling()):
                return None  # given up
            raise
        except Exception:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                # Cancelled while waiting, and the forward (a plain call's task) ended with an
                # error rather than cancelled: this call still ends cancelled.
                raise asyncio.CancelledError() from None
            if forward not in self._forwards:
                return None  # it failed as it was given up (its answer raced the cancel)
            raise
        finally:
            self._forwards.pop(forward, None)
            if not forward.done():
                forward.cancel()

    def answer_forwarded(self, raw: bytes, timeout: float | None, job: str = DEFAULT_JOB) -> asyncio.Future[bytes]:
        """The leader's side of a call forwarded on a batched stream (``forwarding.QuorumForwarder``):
        what ``route_quorum`` does for a call carrying ``FORWARDED_HEADER`` (``timeout`` is that
        call's deadline). A future of the answer: the coordinator's own when it serves the job
        (no task per call), failures as ``forwarded_failure`` describes them."""
        self._client_called()
        try:
            member = validate_requester(pb.LighthouseQuorumRequest.FromString(raw), self._max_member_bytes, raw)
        except DecodeError as e:
            return _failed(forward_error(grpc.StatusCode.INVALID_ARGUMENT, f"malformed LighthouseQuorumRequest: {e}"))
        except InvalidRequest as e:
            return _failed(forward_error(grpc.StatusCode.INVALID_ARGUMENT, str(e)))
        left = None if timeout is None else timeout - DEADLINE_MARGIN_S
        coord = self._leading_coordinator(job)
        if coord is not None:
            if left is not None and left <= 0:
                return _failed(forward_error(grpc.StatusCode.CANCELLED, TIMEOUT_MESSAGE))
            try:
                return coord.request(member, left)
            except JobLimitError as e:
                return _failed(e)
            except NotLeader:
                pass
        return asyncio.ensure_future(self._answer_forwarded_later(member, left, job))

    async def _answer_forwarded_later(self, member: Member, left: float | None, job: str) -> bytes:
        """``answer_forwarded`` where no coordinator of this node serves ``job`` yet: the job
        created first (``--auto-create-jobs``), or the call refused."""
        loop = asyncio.get_running_loop()
        deadline = None if left is None else loop.time() + left
        while True:
            left = None if deadline is None else deadline - loop.time()
            coord = self._leading_coordinator(job)
            if coord is not None:
                if left is not None and left <= 0:
                    raise forward_error(grpc.StatusCode.CANCELLED, TIMEOUT_MESSAGE)
                try:
                    return await coord.request(member, left)  # its failures: see forwarded_failure
                except NotLeader:
                    pass
            missing = self._missing_job(job)
            if missing is None:
                break
            if self.creator is None:
                raise forward_error(grpc.StatusCode.NOT_FOUND, missing)
            if left is not None and left <= 0:
                raise forward_error(grpc.StatusCode.CANCELLED, TIMEOUT_MESSAGE)
            error = await self._create_job(job, left)
            if error is not None:
                raise forward_error(error.code, error.message)
        raise NotLeader("not the leader")

    def forwarded_failure(self, error: BaseException) -> grpc.aio.AioRpcError:
        """The status a forwarded call ends with when its answer failed with ``error``: what
        ``route_quorum`` would have ended the call with."""
        if isinstance(error, asyncio.TimeoutError):
            return forward_error(grpc.StatusCode.CANCELLED, TIMEOUT_MESSAGE)
        if isinstance(error, JobLimitError):
            return forward_error(error.code, str(error))
        if isinstance(error, NotLeader):
            return forward_error(grpc.StatusCode.UNAVAILABLE, f"node {self._node_id} is not the leader (forwarded)")
        return failure_as_is(error)

    # -- heartbeats ------------------------------------------------------------------------------

    def route_heartbeat(self, replica_id: str, job: str = DEFAULT_JOB) -> None:
        self._client_called()
        coord = self._leading_coordinator(job)
        if coord is not None:
            coord.heartbeat(replica_id)
        elif not self._leading():
            self.heartbeats.add(replica_id, job)
        elif self.creator is not None and self._node.job_coordinator(job) is None:
            self.creator.ensure_soon(job, lambda: self._heartbeat_if_known([replica_id], job))
        # else: this node leads and has no such job (or is warming up): dropped, as torchft drops
        # nothing it would count

    def _heartbeat_if_known(self, replica_ids: Iterable[str], job: str) -> None:
        coord = self._leading_coordinator(job)
        if coord is not None:
            for rid in replica_ids:
                coord.heartbeat(rid)

    def accept_heartbeat_batch(self, replica_ids: Iterable[str], job: str = DEFAULT_JOB) -> bool:
        """A follower's batch (``ForwardHeartbeats``): recorded, and True, while this node has a
        coordinator with a term; False otherwise (the follower's batch fails FAILED_PRECONDITION).
        A batch for a job this node does not have is dropped (True: the follower is not wrong
        about who leads)."""
        self._client_called()
        default = self._node.job_coordinator(DEFAULT_JOB)
        if default is None or default.term is None:
            return False
        coord = self._node.job_coordinator(job)
        if coord is None and self.creator is not None:
            ids = list(replica_ids)
            self.creator.ensure_soon(job, lambda: self._heartbeat_if_known(ids, job))
            return True
        if coord is None or coord.term is None:
            return True
        for rid in replica_ids:
            coord.heartbeat(rid)
        return True
