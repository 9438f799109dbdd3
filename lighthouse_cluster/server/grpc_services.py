"""gRPC adapters: torchft.LighthouseService, lighthouse_cluster.LighthouseCluster (liveness
streams included) and lighthouse_cluster.LighthouseAdmin, and the validation of a Quorum call's
requester.

Thin by design: parse and validate the request, hand it to the router (``routing.Router``), the
node, ``admin.NodeAdmin`` or ``job_admin.JobAdmin``, map outcomes to gRPC status codes. A call's
job is the one its port serves (an adapter made for a job's own port), else the one its
``x-lighthouse-job`` metadata names, else the default job. Each adapter depends on a small
``Protocol`` of what it calls, never on the node class. Quorum responses travel as pre-serialized
bytes (encoded once per round by the coordinator, relayed unparsed by followers), so the Quorum
handler is registered with an identity response serializer.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Protocol

import grpc
from google.protobuf.message import DecodeError

from lighthouse_cluster.client.discovery import not_leader_metadata
from lighthouse_cluster.core.jobs import DEFAULT_JOB, JOB_HEADER
from lighthouse_cluster.core.quorum import Member
from lighthouse_cluster.core.torchft_wire import member_from_proto, requester_bytes
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import lighthouse_cluster_pb2_grpc as cpb_grpc
from lighthouse_cluster.proto import torchft_pb2 as pb
from lighthouse_cluster.server.admin import AdminError, NodeAdmin, check_token
from lighthouse_cluster.server.forwarding import FORWARDED_HEADER

log = logging.getLogger(__name__)

_EMPTY_HEARTBEAT_RESPONSE = pb.LighthouseHeartbeatResponse().SerializeToString()


class InvalidRequest(ValueError):
    """A request the lighthouse cannot act on; becomes INVALID_ARGUMENT."""


def validate_requester(request: pb.LighthouseQuorumRequest, max_member_bytes: int,
                       raw_request: bytes | None = None) -> Member:
    """The requester as a ``Member`` carrying every field it sent (verbatim when ``raw_request``,
    the request's bytes, is given), or ``InvalidRequest``."""
    if not request.HasField("requester"):
        raise InvalidRequest("missing requester")
    r = request.requester
    if not r.replica_id:
        raise InvalidRequest("requester.replica_id is empty")
    if r.step < 0:
        raise InvalidRequest(f"requester.step must be >= 0, got {r.step}")
    if r.commit_failures < 0:
        raise InvalidRequest(f"requester.commit_failures must be >= 0, got {r.commit_failures}")
    if r.world_size >= 2**63:
        raise InvalidRequest(f"requester.world_size {r.world_size} is out of range (negative when signed)")
    raw = requester_bytes(raw_request) if raw_request is not None else None
    size = len(raw) if raw is not None else r.ByteSize()  # every field, known or not: all of it is replicated
    if size > max_member_bytes:
        raise InvalidRequest(f"requester is {size} bytes serialized ({len(r.data.encode())} of them data); "
                             f"the limit on a member is {max_member_bytes}")
    if len(r.replica_id) > 1024:
        raise InvalidRequest("requester.replica_id is longer than 1024 characters")
    return member_from_proto(r, raw)


def _text(value: str | bytes) -> str:
    return value if isinstance(value, str) else value.decode()


def _metadata_value(context: grpc.aio.ServicerContext, name: str) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == name:
            return _text(value)
    return None


def call_job(context: grpc.aio.ServicerContext, port_job: str | None = None) -> str:
    """The job a call belongs to: its port's, else its ``x-lighthouse-job`` metadata's, else the
    default job."""
    if port_job is not None:
        return port_job
    return _metadata_value(context, JOB_HEADER) or DEFAULT_JOB


def quorum_call_headers(context: grpc.aio.ServicerContext, port_job: str | None = None) -> tuple[str, str | None]:
    """A Quorum call's job (as ``call_job``) and the node that forwarded it (None: a client's own
    call), from one pass over its metadata: gRPC builds the metadata tuple anew on every read."""
    job = port_job
    forwarded_by = None
    for key, value in context.invocation_metadata() or ():
        if key == FORWARDED_HEADER and forwarded_by is None:
            forwarded_by = _text(value)
        elif key == JOB_HEADER and job is None:  # a port's own job (port_job) wins over the header
            job = _text(value)
    return job or DEFAULT_JOB, forwarded_by


class QuorumRouting(Protocol):
    """Where torchft's calls go (``routing.Router``)."""

    async def route_quorum(self, member: Member, raw: bytes, time_remaining: float | None,
                           forwarded_by: str | None, context: grpc.aio.ServicerContext,
                           job: str = DEFAULT_JOB) -> bytes: ...

    def route_heartbeat(self, replica_id: str, job: str = DEFAULT_JOB) -> None: ...

    def known_job(self, job: str) -> bool:
        """Whether this node takes calls of ``job``: its copy of the job table has it, or the job
        would be created on its first use (``--auto-create-jobs``)."""


class LighthouseServiceAdapter:
    """torchft.LighthouseService over raw bytes; ``job``: the job of the port it serves (None:
    the node's client port, where calls name their job)."""

    def __init__(self, router: QuorumRouting, max_member_bytes: int, job: str | None = None) -> None:
        self.router = router
        self.max_member_bytes = max_member_bytes
        self.job = job

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler("torchft.LighthouseService", {
            "Quorum": grpc.unary_unary_rpc_method_handler(self.quorum),
            "Heartbeat": grpc.unary_unary_rpc_method_handler(self.heartbeat),
        })

    async def quorum(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            request = pb.LighthouseQuorumRequest.FromString(raw)
            member = validate_requester(request, self.max_member_bytes, raw)
        except DecodeError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed LighthouseQuorumRequest: {e}")
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        job, forwarded_by = quorum_call_headers(context, self.job)
        return await self.router.route_quorum(member, raw, context.time_remaining(), forwarded_by, context, job)

    async def heartbeat(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            request = pb.LighthouseHeartbeatRequest.FromString(raw)
        except DecodeError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed LighthouseHeartbeatRequest: {e}")
        if not request.replica_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "replica_id is empty")
        job = call_job(context, self.job)
        if not self.router.known_job(job):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no job {job!r} on this cluster (lighthouse-cluster jobs list)")
        self.router.route_heartbeat(request.replica_id, job)
        return _EMPTY_HEARTBEAT_RESPONSE


class NodeStatusSource(Protocol):
    """What ``LighthouseCluster``'s Status and Leader answer with (``LighthouseNode``)."""

    def status(self) -> cpb.NodeStatus: ...

    def leader_info(self) -> cpb.LeaderResponse: ...


class HeartbeatBatchSink(Protocol):
    """Takes the heartbeat batches followers forward (``routing.Router``)."""

    def accept_heartbeat_batch(self, replica_ids: Iterable[str], job: str = DEFAULT_JOB) -> bool: ...


class WatchStreams(Protocol):
    """Serves liveness streams (``liveness_streams.LivenessStreams``)."""

    async def serve(self, context: grpc.aio.ServicerContext) -> None:
        """One Watch stream, read and written through ``context``."""


class JobViews(Protocol):
    """Jobs as this node sees them (``job_admin.JobAdmin``)."""

    def list_jobs(self) -> cpb.ListJobsResponse: ...

    def get_job(self, name: str) -> cpb.Job:
        """The job, or ``AdminError`` NOT_FOUND."""


class ClusterServiceAdapter(cpb_grpc.LighthouseClusterServicer):
    """lighthouse_cluster.LighthouseCluster: status, leader discovery, jobs, heartbeat batches and
    liveness streams. ``watch(job)``: the liveness streams of a job (None: no such job here);
    ``job``: the job of the port it serves (None: the node's client port)."""

    def __init__(self, node: NodeStatusSource, heartbeats: HeartbeatBatchSink, node_id: str,
                 watch: Callable[[str], WatchStreams | None], jobs: JobViews, job: str | None = None) -> None:
        self.node = node
        self.heartbeats = heartbeats
        self.node_id = node_id
        self.watch = watch
        self.jobs = jobs
        self.job = job

    async def Status(self, request: cpb.StatusRequest, context: grpc.aio.ServicerContext) -> cpb.NodeStatus:
        return self.node.status()

    async def Leader(self, request: cpb.LeaderRequest, context: grpc.aio.ServicerContext) -> cpb.LeaderResponse:
        return self.node.leader_info()

    async def ForwardHeartbeats(self, request: cpb.HeartbeatBatch,
                                context: grpc.aio.ServicerContext) -> cpb.HeartbeatBatchResponse:
        if not self.heartbeats.accept_heartbeat_batch(request.replica_ids, request.job or DEFAULT_JOB):
            info = self.node.leader_info()
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"node {self.node_id} is not the leader",
                                not_leader_metadata(info.leader_id, info.leader_client_address, info.term))
        return cpb.HeartbeatBatchResponse()

    async def Watch(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        # A coroutine, not a generator: gRPC's read/write API on the context (the stream reads
        # keep-alives while it writes notices).
        job = call_job(context, self.job)
        streams = self.watch(job)
        if streams is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no job {job!r} on this cluster (lighthouse-cluster jobs list)")
        await streams.serve(context)

    async def ListJobs(self, request: cpb.ListJobsRequest, context: grpc.aio.ServicerContext) -> cpb.ListJobsResponse:
        return self.jobs.list_jobs()

    async def GetJob(self, request: cpb.JobRequest, context: grpc.aio.ServicerContext) -> cpb.Job:
        try:
            return self.jobs.get_job(request.name or call_job(context, self.job))
        except AdminError as e:
            await context.abort(e.code, e.message, e.trailing)


class JobChanges(Protocol):
    """The job admin calls (``job_admin.JobAdmin``)."""

    async def add_job(self, request: cpb.AddJobRequest) -> cpb.Job: ...

    async def set_job(self, request: cpb.SetJobRequest) -> cpb.Job: ...

    async def remove_job(self, request: cpb.RemoveJobRequest) -> cpb.RemoveJobResponse: ...


class AdminServiceAdapter(cpb_grpc.LighthouseAdminServicer):
    """lighthouse_cluster.LighthouseAdmin: the token check, then ``admin.NodeAdmin`` or
    ``job_admin.JobAdmin``."""

    def __init__(self, admin: NodeAdmin, admin_token: str | None, jobs: JobChanges) -> None:
        self.admin = admin
        self.admin_token = admin_token
        self.jobs = jobs

    async def _authorized(self, context: grpc.aio.ServicerContext, what: str) -> None:
        error = check_token(context.invocation_metadata(), self.admin_token)
        if error is not None:
            log.warning("refused %s from %s: %s", what, context.peer(), error.code.name)
            await context.abort(error.code, error.message)

    async def _run(self, context: grpc.aio.ServicerContext, what: str, call):  # type: ignore[no-untyped-def]
        await self._authorized(context, what)
        try:
            return await call()
        except AdminError as e:
            await context.abort(e.code, e.message, e.trailing)

    async def AddJob(self, request: cpb.AddJobRequest, context: grpc.aio.ServicerContext) -> cpb.Job:
        return await self._run(context, "jobs add", lambda: self.jobs.add_job(request))

    async def SetJob(self, request: cpb.SetJobRequest, context: grpc.aio.ServicerContext) -> cpb.Job:
        return await self._run(context, "jobs set", lambda: self.jobs.set_job(request))

    async def RemoveJob(self, request: cpb.RemoveJobRequest,
                        context: grpc.aio.ServicerContext) -> cpb.RemoveJobResponse:
        return await self._run(context, "jobs remove", lambda: self.jobs.remove_job(request))

    async def ListMembers(self, request: cpb.MembersRequest, context: grpc.aio.ServicerContext) -> cpb.MembersResponse:
        return self.admin.list_members()  # read-only, like Status: no token

    async def AddMember(self, request: cpb.AddMemberRequest, context: grpc.aio.ServicerContext) -> cpb.MembersResponse:
        return await self._run(context, "members add", lambda: self.admin.add_member(request.node))

    async def RemoveMember(self, request: cpb.RemoveMemberRequest,
                           context: grpc.aio.ServicerContext) -> cpb.MembersResponse:
        return await self._run(context, "members remove", lambda: self.admin.remove_member(request.node_id))

    async def TransferLeader(self, request: cpb.TransferLeaderRequest,
                             context: grpc.aio.ServicerContext) -> cpb.TransferLeaderResponse:
        return await self._run(context, "transfer-leader", lambda: self.admin.transfer_leader(request.to_node_id))

    async def SaveSnapshot(self, request: cpb.SnapshotRequest, context: grpc.aio.ServicerContext) -> cpb.Snapshot:
        return await self._run(context, "snapshot save", self.admin.save_snapshot)

    async def RestoreSnapshot(self, request: cpb.Snapshot,
                              context: grpc.aio.ServicerContext) -> cpb.RestoreResponse:
        return await self._run(context, "snapshot restore", lambda: self.admin.restore_snapshot(request))
