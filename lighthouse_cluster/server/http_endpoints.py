"""The node's HTTP port (``--http-bind``): /metrics, /livez, /readyz, /status.json,
/rendezvous.json, the dashboard at / and ``POST /replica/{id}/kill[?job=NAME]``: what each route
answers. /rendezvous.json is the dashboard's rendezvous panel, from this node's replicated store
alone (``rendezvous_view``; no I/O).

A thin adapter: the routes, dispatching to the node (readiness, metrics registry, Status, its
jobs: ``ServedNode``) and to ``cluster_view`` and ``job_view`` for the dashboard's JSON: the
cluster as every node's Status shows it (the default job at the top level, as before jobs) and
``jobs``, every job with its settings, ports, config and last quorum, and the leader's live view
of it (this node's own ``ListJobs`` on the serving leader, the leader's elsewhere). Blocking gRPC
calls to peers run in threads, so a slow or dead peer never stalls the loop that also serves
quorum rounds. How the port is served (aiohttp, its limits and timeouts, HTTPS whenever the node
has TLS, so that kill's bearer token never crosses a plain socket) is ``http_server``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from importlib import resources
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from lighthouse_cluster.client.admin_client import query_status
from lighthouse_cluster.client.cluster_view import build_view, to_json
from lighthouse_cluster.client.job_view import jobs_view
from lighthouse_cluster.core.jobs import DEFAULT_JOB
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import lighthouse_cluster_pb2_grpc as cpb_grpc
from lighthouse_cluster.proto import torchft_pb2 as pb
from lighthouse_cluster.proto import torchft_pb2_grpc as pb_grpc
from lighthouse_cluster.server.http_server import READ_TIMEOUT_S, WRITE_TIMEOUT_S, HttpServer, text_response
from lighthouse_cluster.server.rendezvous_view import rendezvous_view
from lighthouse_cluster.tls import ClientTLS, ServerTLS, channel

if TYPE_CHECKING:
    from lighthouse_cluster.core.state_machine import QuorumStateMachine
    from lighthouse_cluster.server.config import NodeConfig, PeerSpec

log = logging.getLogger(__name__)

PEER_STATUS_TIMEOUT_S = 1.0
KILL_TIMEOUT_S = 5.0

JSON = "application/json"
HTML = "text/html; charset=utf-8"
NO_TOKEN_MESSAGE = ("kill is disabled: this node has no admin token "
                    "(start it with --admin-token or LIGHTHOUSE_CLUSTER_ADMIN_TOKEN)")


def json_response(status: int, data: Any) -> web.Response:
    return web.Response(status=status, body=json.dumps(data).encode(), headers={"Content-Type": JSON})


def manager_target(address: str) -> str:
    """A torchft member address (``http://host:port``) as a gRPC target."""
    for scheme in ("http://", "https://", "grpc://"):
        if address.startswith(scheme):
            return address[len(scheme):].rstrip("/")
    return address


class MetricsExposition(Protocol):
    """The node's metrics in Prometheus' text format (``metrics.NodeMetrics``)."""

    def exposition(self) -> bytes: ...

    def kv_calls(self) -> int:
        """Rendezvous store calls this node answered."""


class JobViews(Protocol):
    """Every job as this node knows it (``job_admin.JobAdmin``)."""

    def list_jobs(self) -> cpb.ListJobsResponse: ...


def leader_jobs(address: str, timeout: float, tls: ClientTLS | None) -> cpb.ListJobsResponse | None:
    """The leader's ``ListJobs`` (its live view of every job), or None when it does not answer."""
    try:
        with channel(address, tls) as ch:
            return cpb_grpc.LighthouseClusterStub(ch).ListJobs(cpb.ListJobsRequest(), timeout=timeout)
    except grpc.RpcError as e:
        log.debug("ListJobs at the leader %s: %s", address, e.code().name)
        return None


class ServedNode(Protocol):
    """What the HTTP endpoints use of the node (``LighthouseNode``)."""

    @property
    def config(self) -> NodeConfig: ...

    @property
    def machine(self) -> QuorumStateMachine: ...

    @property
    def metrics(self) -> MetricsExposition: ...

    @property
    def other_members(self) -> tuple[PeerSpec, ...]: ...

    @property
    def job_admin(self) -> JobViews: ...

    def readiness(self) -> tuple[bool, str]: ...

    def status(self) -> cpb.NodeStatus: ...


class HttpEndpoints:
    """Serves the node's HTTP port on its event loop (HTTPS when ``tls`` is given: the node's own
    certificate); ``await start()`` / ``await stop()``."""

    def __init__(self, node: ServedNode, bind: str, admin_token: str | None, tls: ServerTLS | None = None, *,
                 read_timeout_s: float = READ_TIMEOUT_S, write_timeout_s: float = WRITE_TIMEOUT_S) -> None:
        self.node = node
        self._token = admin_token.encode() if admin_token else None
        self._status_in_flight: asyncio.Future[dict[str, Any]] | None = None
        self.server = HttpServer(self.routes(), bind, tls, middlewares=[self._unrouted],
                                 read_timeout_s=read_timeout_s, write_timeout_s=write_timeout_s)

    @property
    def address(self) -> str:
        """``host:port`` as bound (the bind address until started)."""
        return self.server.address

    @property
    def url(self) -> str:
        """``http://host:port`` or, with TLS, ``https://host:port``."""
        return self.server.url

    async def start(self) -> None:
        await self.server.start()

    async def stop(self) -> None:
        await self.server.stop()

    # -- routes -----------------------------------------------------------------------------------

    def routes(self) -> list[web.RouteDef]:
        """The route table (a GET route answers HEAD too)."""
        return [web.get("/metrics", self.metrics), web.get("/livez", self.livez), web.get("/readyz", self.readyz),
                web.get("/status.json", self.status_json), web.get("/rendezvous.json", self.rendezvous_json),
                web.get("/", self.dashboard),
                web.get("/index.html", self.dashboard), web.post("/replica/{replica_id}/kill", self.kill_route)]

    @web.middleware
    async def _unrouted(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """The route table's 404 and 405, said as this port always said them."""
        try:
            return await handler(request)
        except web.HTTPNotFound:
            return text_response(404, f"no such endpoint: {request.path}")
        except web.HTTPMethodNotAllowed as e:
            if "POST" in e.allowed_methods:
                return text_response(405, "kill takes POST", Allow="POST")
            return text_response(405, f"{request.path} takes GET", Allow="GET, HEAD")

    # -- endpoints --------------------------------------------------------------------------------

    async def metrics(self, _request: web.Request | None = None) -> web.Response:
        return web.Response(body=self.node.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def livez(self, _request: web.Request | None = None) -> web.Response:
        return text_response(200, "ok")  # answering at all proves the event loop runs

    async def readyz(self, _request: web.Request | None = None) -> web.Response:
        ready, reason = self.node.readiness()
        return text_response(200 if ready else 503, reason)

    async def dashboard(self, _request: web.Request | None = None) -> web.Response:
        html = resources.files("lighthouse_cluster.server").joinpath("dashboard.html").read_bytes()
        return web.Response(body=html, headers={"Content-Type": HTML})

    async def status_json(self, _request: web.Request | None = None) -> web.Response:
        # Single flight: a dashboard polling a cluster with a dead peer must not pile up threads.
        if self._status_in_flight is None or self._status_in_flight.done():
            self._status_in_flight = asyncio.ensure_future(self._build_status())
        return json_response(200, await asyncio.shield(self._status_in_flight))

    async def rendezvous_json(self, _request: web.Request | None = None) -> web.Response:
        return json_response(200, rendezvous_view(self.node.machine.kv, int(time.time() * 1000),
                                                  self.node.metrics.kv_calls()))

    async def _build_status(self) -> dict[str, Any]:
        """``cluster_view`` from this node's perspective: its own Status (no I/O) and each peer's
        Status (blocking gRPC, in threads); ``jobs``: ``job_view`` of this node's jobs and, unless
        this node is the serving leader, the leader's (its ``ListJobs``, in a thread too)."""
        node = self.node
        cfg = node.config
        own = node.status()
        own_jobs = node.job_admin.list_jobs()
        others = [p.client_address for p in node.other_members]
        ask_leader = not own_jobs.leader_view and bool(own.leader_client_address) and own.leader_id != cfg.node_id
        answers, leaders = await asyncio.gather(
            asyncio.gather(*(asyncio.to_thread(query_status, a, PEER_STATUS_TIMEOUT_S, cfg.peer_tls) for a in others)),
            asyncio.to_thread(leader_jobs, own.leader_client_address, PEER_STATUS_TIMEOUT_S, cfg.peer_tls)
            if ask_leader else asyncio.sleep(0, result=None))
        view = build_view([(cfg.self_peer.client_address, own), *zip(others, answers)])
        data = to_json(view)
        jobs = jobs_view(own_jobs, leaders)
        data["jobs"] = jobs["jobs"]
        data["jobs_answered_by"] = jobs["answered_by"]
        ready, reason = node.readiness()
        data["self"] = {"id": cfg.node_id, "ready": ready, "reason": reason,
                        "kill_enabled": self._token is not None}
        data["generated_ms"] = int(time.time() * 1000)
        return data

    async def kill_route(self, request: web.Request) -> web.Response:
        """``POST /replica/{id}/kill[?job=NAME]`` (the last ``job`` given counts)."""
        job = (request.query.getall("job", []) or [""])[-1] or DEFAULT_JOB
        return await self.kill(request.match_info["replica_id"], request.headers.get("Authorization", ""), job)

    async def kill(self, replica_id: str, authorization: str, job: str = DEFAULT_JOB) -> web.Response:
        if self._token is None:
            return text_response(403, NO_TOKEN_MESSAGE)
        scheme, _, presented = authorization.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(presented.strip().encode(), self._token):
            return text_response(401, "kill needs 'Authorization: Bearer <admin token>'",
                                 **{"WWW-Authenticate": 'Bearer realm="lighthouse-cluster"'})
        state = self.node.machine.job(job)
        if state is None:
            return text_response(404, f"no job {job!r} on this cluster")
        quorum = state.quorum
        member = next((m for m in (quorum.participants if quorum else ()) if m.replica_id == replica_id), None)
        if member is None:
            of = "" if job == DEFAULT_JOB else f" of job {job!r}"
            return text_response(404, f"replica {replica_id!r} is not a member of the current quorum{of}")
        target = manager_target(member.address)
        log.warning("kill of replica %s (job %s) at %s requested over HTTP", replica_id, job, target)
        try:
            async with grpc.aio.insecure_channel(target) as channel:
                try:
                    await asyncio.wait_for(channel.channel_ready(), KILL_TIMEOUT_S)
                except asyncio.TimeoutError:
                    return text_response(502, f"Kill at {target} failed: not reachable within {KILL_TIMEOUT_S:g} s")
                await pb_grpc.ManagerServiceStub(channel).Kill(
                    pb.KillRequest(msg=f"killed from lighthouse-cluster node {self.node.config.node_id}"),
                    timeout=KILL_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                # Connected, then the connection dropped unanswered: torchft's manager acknowledges
                # a Kill by exiting at once (std::process::exit inside the handler).
                return json_response(200, {"killed": replica_id, "job": job, "address": member.address,
                                           "answered": False})
            return text_response(502, f"Kill at {target} failed: {e.code().name}: {e.details()}")
        return json_response(200, {"killed": replica_id, "job": job, "address": member.address, "answered": True})
