"""The node's HTTP port (``--http-bind``): /metrics, /livez, /readyz, /status.json, the dashboard
at / and ``POST /replica/{id}/kill[?job=NAME]``.

A thin adapter: a deliberately small HTTP/1.1 server on the node's own asyncio loop (one
request per connection, ``Connection: close``; bounded header and body sizes; read and write
timeouts), dispatching to the node (readiness, metrics registry, Status, its jobs: ``ServedNode``)
and to ``cluster_view`` and ``job_view`` for the dashboard's JSON: the cluster as every node's
Status shows it (the default job at the top level, as before jobs) and ``jobs``, every job with
its settings, ports, config and last quorum, and the leader's live view of it (this node's own
``ListJobs`` on the serving leader, the leader's elsewhere). Blocking gRPC calls to peers run in
threads, so a slow or dead peer never stalls the loop that also serves quorum rounds.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import time
from dataclasses import dataclass, field
from importlib import resources
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import parse_qs, unquote, urlsplit

import grpc
from prometheus_client import CONTENT_TYPE_LATEST

from lighthouse_cluster.client.admin_client import query_status
from lighthouse_cluster.client.cluster_view import build_view, to_json
from lighthouse_cluster.client.job_view import jobs_view
from lighthouse_cluster.core.jobs import DEFAULT_JOB
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import lighthouse_cluster_pb2_grpc as cpb_grpc
from lighthouse_cluster.proto import torchft_pb2 as pb
from lighthouse_cluster.proto import torchft_pb2_grpc as pb_grpc
from lighthouse_cluster.server.config import parse_host_port
from lighthouse_cluster.tls import ClientTLS, channel

if TYPE_CHECKING:
    from lighthouse_cluster.core.state_machine import QuorumStateMachine
    from lighthouse_cluster.server.config import NodeConfig, PeerSpec

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 16 * 1024
MAX_BODY_BYTES = 64 * 1024
READ_TIMEOUT_S = 10.0
WRITE_TIMEOUT_S = 10.0
PEER_STATUS_TIMEOUT_S = 1.0
KILL_TIMEOUT_S = 5.0

_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
            405: "Method Not Allowed", 413: "Payload Too Large", 431: "Request Header Fields Too Large",
            500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable"}
TEXT = "text/plain; charset=utf-8"
JSON = "application/json"
NO_TOKEN_MESSAGE = ("kill is disabled: this node has no admin token "
                    "(start it with --admin-token or LIGHTHOUSE_CLUSTER_ADMIN_TOKEN)")


class BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes = b""
    query: dict[str, str] = field(default_factory=dict)  # the last value of each parameter


@dataclass
class Response:
    status: int
    body: bytes
    content_type: str = TEXT
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def text(cls, status: int, message: str, **headers: str) -> "Response":
        return cls(status, (message.rstrip("\n") + "\n").encode(), TEXT, headers)

    @classmethod
    def json(cls, status: int, data: Any) -> "Response":
        return cls(status, json.dumps(data).encode(), JSON)

    def encode(self, head_only: bool = False) -> bytes:
        lines = [f"HTTP/1.1 {self.status} {_REASONS.get(self.status, 'Unknown')}",
                 f"Content-Type: {self.content_type}", f"Content-Length: {len(self.body)}",
                 "Cache-Control: no-store", "Connection: close"]
        lines += [f"{k}: {v}" for k, v in self.headers.items()]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        return head if head_only else head + self.body


async def read_request(reader: asyncio.StreamReader) -> Request:
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise BadRequest(431, "request headers too large") from None
    try:
        text = raw.decode("latin-1")
        request_line, *header_lines = text.split("\r\n")
        method, target, version = request_line.split(" ")
    except ValueError:
        raise BadRequest(400, "malformed request line") from None
    if not version.startswith("HTTP/1."):
        raise BadRequest(400, "only HTTP/1.x is supported")
    headers: dict[str, str] = {}
    for line in header_lines:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise BadRequest(400, "malformed header line")
        headers[name.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise BadRequest(400, "chunked request bodies are not supported")
    try:
        length = int(headers.get("content-length", "0"))
    except ValueError:
        raise BadRequest(400, "bad Content-Length") from None
    if length < 0 or length > MAX_BODY_BYTES:
        raise BadRequest(413, f"request body over {MAX_BODY_BYTES} bytes")
    body = await reader.readexactly(length) if length else b""
    url = urlsplit(target)
    query = {k: v[-1] for k, v in parse_qs(url.query).items()}
    return Request(method=method.upper(), path=url.path or "/", headers=headers, body=body, query=query)


def manager_target(address: str) -> str:
    """A torchft member address (``http://host:port``) as a gRPC target."""
    for scheme in ("http://", "https://", "grpc://"):
        if address.startswith(scheme):
            return address[len(scheme):].rstrip("/")
    return address


class MetricsExposition(Protocol):
    """The node's metrics in Prometheus' text format (``metrics.NodeMetrics``)."""

    def exposition(self) -> bytes: ...


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
    """Serves the node's HTTP port on its event loop; ``await start()`` / ``await stop()``."""

    def __init__(self, node: ServedNode, bind: str, admin_token: str | None) -> None:
        self.node = node
        self.bind = bind
        self._token = admin_token.encode() if admin_token else None
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[asyncio.Task[Any]] = set()
        self._status_in_flight: asyncio.Future[dict[str, Any]] | None = None
        self.address = bind

    async def start(self) -> None:
        host, port = parse_host_port(self.bind, "--http-bind")
        host = host.strip("[]")
        try:
            if host == "::":
                # asyncio makes an IPv6 listener IPv6-only; [::] means every address here, as on
                # the gRPC port (and `up` prints 127.0.0.1 URLs for it).
                sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                    sock.bind(("::", port))
                except OSError:
                    sock.close()
                    raise
                self._server = await asyncio.start_server(self._handle, sock=sock, limit=MAX_HEADER_BYTES)
            else:
                self._server = await asyncio.start_server(self._handle, host, port, limit=MAX_HEADER_BYTES)
        except OSError as e:
            raise OSError(f"cannot bind HTTP address {self.bind}: {e.strerror or e}") from e
        sockname = self._server.sockets[0].getsockname()
        self.address = f"[{sockname[0]}]:{sockname[1]}" if ":" in sockname[0] else f"{sockname[0]}:{sockname[1]}"

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.wait(list(self._connections), timeout=1.0)
        try:
            await asyncio.wait_for(self._server.wait_closed(), 1.0)
        except asyncio.TimeoutError:
            pass
        self._server = None

    # -- connection handling ------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._connections.add(task)
        head_only = False
        try:
            try:
                request = await asyncio.wait_for(read_request(reader), READ_TIMEOUT_S)
            except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                return
            except BadRequest as e:
                response = Response.text(e.status, str(e))
            else:
                head_only = request.method == "HEAD"
                try:
                    response = await self.dispatch(request)
                except Exception:  # noqa: BLE001 - one bad request must not take the port down
                    log.exception("HTTP %s %s failed", request.method, request.path)
                    response = Response.text(500, "internal error (see the node's log)")
            writer.write(response.encode(head_only))
            await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)
        except (ConnectionError, asyncio.TimeoutError):
            pass
        finally:
            writer.close()
            try:
                await asyncio.wait_for(writer.wait_closed(), 1.0)
            except (ConnectionError, asyncio.TimeoutError, asyncio.CancelledError):
                pass
            if task is not None:
                self._connections.discard(task)

    async def dispatch(self, request: Request) -> Response:
        path, method = request.path, request.method
        get_routes = {
            "/metrics": self.metrics, "/livez": self.livez, "/readyz": self.readyz,
            "/status.json": self.status_json, "/": self.dashboard, "/index.html": self.dashboard,
        }
        if path in get_routes:
            if method not in ("GET", "HEAD"):
                return Response.text(405, f"{path} takes GET", Allow="GET, HEAD")
            return await get_routes[path]()
        parts = path.split("/")
        if len(parts) == 4 and parts[0] == "" and parts[1] == "replica" and parts[3] == "kill" and parts[2]:
            if method != "POST":
                return Response.text(405, "kill takes POST", Allow="POST")
            return await self.kill(unquote(parts[2]), request.headers.get("authorization", ""),
                                   request.query.get("job") or DEFAULT_JOB)
        return Response.text(404, f"no such endpoint: {path}")

    # -- endpoints --------------------------------------------------------------------------------

    async def metrics(self) -> Response:
        return Response(200, self.node.metrics.exposition(), CONTENT_TYPE_LATEST)

    async def livez(self) -> Response:
        return Response.text(200, "ok")  # answering at all proves the event loop runs

    async def readyz(self) -> Response:
        ready, reason = self.node.readiness()
        return Response.text(200 if ready else 503, reason)

    async def dashboard(self) -> Response:
        html = resources.files("lighthouse_cluster.server").joinpath("dashboard.html").read_bytes()
        return Response(200, html, "text/html; charset=utf-8")

    async def status_json(self) -> Response:
        # Single flight: a dashboard polling a cluster with a dead peer must not pile up threads.
        if self._status_in_flight is None or self._status_in_flight.done():
            self._status_in_flight = asyncio.ensure_future(self._build_status())
        return Response.json(200, await asyncio.shield(self._status_in_flight))

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

    async def kill(self, replica_id: str, authorization: str, job: str = DEFAULT_JOB) -> Response:
        if self._token is None:
            return Response.text(403, NO_TOKEN_MESSAGE)
        scheme, _, presented = authorization.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(presented.strip().encode(), self._token):
            return Response.text(401, "kill needs 'Authorization: Bearer <admin token>'",
                                 **{"WWW-Authenticate": 'Bearer realm="lighthouse-cluster"'})
        state = self.node.machine.job(job)
        if state is None:
            return Response.text(404, f"no job {job!r} on this cluster")
        quorum = state.quorum
        member = next((m for m in (quorum.participants if quorum else ()) if m.replica_id == replica_id), None)
        if member is None:
            of = "" if job == DEFAULT_JOB else f" of job {job!r}"
            return Response.text(404, f"replica {replica_id!r} is not a member of the current quorum{of}")
        target = manager_target(member.address)
        log.warning("kill of replica %s (job %s) at %s requested over HTTP", replica_id, job, target)
        try:
            async with grpc.aio.insecure_channel(target) as channel:
                try:
                    await asyncio.wait_for(channel.channel_ready(), KILL_TIMEOUT_S)
                except asyncio.TimeoutError:
                    return Response.text(502, f"Kill at {target} failed: not reachable within {KILL_TIMEOUT_S:g} s")
                await pb_grpc.ManagerServiceStub(channel).Kill(
                    pb.KillRequest(msg=f"killed from lighthouse-cluster node {self.node.config.node_id}"),
                    timeout=KILL_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                # Connected, then the connection dropped unanswered: torchft's manager acknowledges
                # a Kill by exiting at once (std::process::exit inside the handler).
                return Response.json(200, {"killed": replica_id, "job": job, "address": member.address,
                                           "answered": False})
            return Response.text(502, f"Kill at {target} failed: {e.code().name}: {e.details()}")
        return Response.json(200, {"killed": replica_id, "job": job, "address": member.address, "answered": True})
