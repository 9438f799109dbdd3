"""A job's client port served by a process of its own (``serve --job-port-processes``).

Why: every call a node serves shares its one event loop. With the job ports in the node's
process, a job whose many replica groups hammer quorums fills that loop with its calls, and
another job's rounds wait behind them (docs/design/job-port-processes.md). Here each job port is a
child process of the node that does what a follower does with a call (``routing.Router`` with no
Raft and no coordinator): Quorum calls travel to the leader on one batched
``ForwardQuorums`` stream, heartbeats in one batch per 50 ms (``forwarding.py``). The node that
leads, this node included, then handles a few messages per round for that job instead of one gRPC
call per replica group, and the gRPC work of the job's calls is done on a core of their own.

What the port serves, for its job only (as the in-process port does, ``job_ports.py``):
``torchft.LighthouseService`` (Quorum, Heartbeat), and, passed through to the node's own client
port with the job set (``x-lighthouse-job``; the caller's is ignored: the port is the job),
``lighthouse_cluster.LighthouseCluster`` (Status, Leader, ListJobs, GetJob, Watch, ...) and gRPC
health (the node's readiness); server reflection answers locally.

The leader: asked of the node (``Leader``, read by ``client.discovery``) every ``LEADER_POLL_S``; a change wakes the waiting
calls (``Router.leadership_changed``), and a forwarded call whose leader stops leading is re-sent
as a follower's is. Unchanged semantics: the calls are the same bytes, with the same deadlines
and errors, as through a follower.

Process contract (``JobPorts`` starts it): the settings come as one msgpack map on stdin (TLS keys
included, so no secret is on the command line or in the environment); once its port listens the
process writes ``listening PORT`` on stdout, or ``error REASON`` and exits with ``EXIT_CANNOT_BIND``;
it logs to stderr (the node's log); SIGTERM stops it (calls get ``STOP_GRACE_S``); it dies with
the node (``PR_SET_PDEATHSIG`` on Linux, and a check of its parent every poll elsewhere).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

import grpc
import msgpack
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection

from lighthouse_cluster.client.discovery import probe_from_response
from lighthouse_cluster.core.jobs import JOB_HEADER
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import lighthouse_cluster_pb2_grpc as cpb_grpc
from lighthouse_cluster.proto import torchft_pb2 as pb
from lighthouse_cluster.server.aio_server import aio_server
from lighthouse_cluster.server.bind_check import start_listening
from lighthouse_cluster.server.forwarding import CHANNEL_OPTIONS, PeerChannels
from lighthouse_cluster.server.grpc_services import LighthouseServiceAdapter
from lighthouse_cluster.server.parent_death import die_with_parent
from lighthouse_cluster.server.routing import Router
from lighthouse_cluster.tls import ClientTLS, ServerTLS, aio_channel

log = logging.getLogger(__name__)

# How often the process asks its node who leads while its port has calls (a leader change reaches
# waiting calls this late at most), and with no call for IDLE_AFTER_S (the first call then asks
# at once).
LEADER_POLL_S = 0.02
IDLE_LEADER_POLL_S = 1.0
IDLE_AFTER_S = 2.0
# A stopping port's calls get this long to end.
STOP_GRACE_S = 1.0
EXIT_CANNOT_BIND = 3
# Metadata a pass-through call does not copy: gRPC's own, and the job (the port's is set).
_NOT_COPIED = {"user-agent", "content-type", "te", "grpc-accept-encoding", "grpc-encoding", "grpc-timeout",
               JOB_HEADER}


@dataclass(frozen=True)
class PortSpec:
    """What a job port process needs (``JobPorts`` sends it msgpack-encoded on stdin)."""

    job: str
    host: str  # the bind host of the node's client port ("[::]", "127.0.0.1", ...)
    port: int
    node_id: str
    node_address: str  # the node's own client address, dialed for the leader and pass-through calls
    max_member_bytes: int
    parent_pid: int
    server_tls: ServerTLS | None = None
    client_tls: ClientTLS | None = None  # how to dial nodes' TLS client ports
    log_level: str = "info"
    log_format: str = "text"
    server_options: tuple[tuple[str, Any], ...] = ()
    nice: int = 0  # how many steps of CPU priority below its node the process runs (os.nice)

    def encode(self) -> bytes:
        st, ct = self.server_tls, self.client_tls
        return msgpack.packb({
            "job": self.job, "host": self.host, "port": self.port, "node_id": self.node_id,
            "node_address": self.node_address, "max_member_bytes": self.max_member_bytes,
            "parent_pid": self.parent_pid, "log_level": self.log_level, "log_format": self.log_format,
            "server_tls": None if st is None else [st.cert_chain, st.private_key, st.client_ca],
            "client_tls": None if ct is None else [ct.root_ca, ct.client_cert, ct.client_key],
            "server_options": [list(o) for o in self.server_options], "nice": self.nice,
        })

    @classmethod
    def decode(cls, data: bytes) -> "PortSpec":
        d = msgpack.unpackb(data)
        st, ct = d["server_tls"], d["client_tls"]
        return cls(job=d["job"], host=d["host"], port=d["port"], node_id=d["node_id"],
                   node_address=d["node_address"], max_member_bytes=d["max_member_bytes"],
                   parent_pid=d["parent_pid"], log_level=d["log_level"], log_format=d["log_format"],
                   server_tls=None if st is None else ServerTLS(st[0], st[1], st[2]),
                   client_tls=None if ct is None else ClientTLS(ct[0], ct[1], ct[2]),
                   server_options=tuple(tuple(o) for o in d["server_options"]), nice=d.get("nice", 0))

    @property
    def identity(self) -> str:
        """This process's name in forwarded calls and logs: never a node id (so even the node's
        own port process forwards to its node, as to any leader)."""
        return f"{self.node_id}/{self.job}"


@dataclass(frozen=True)
class LeaderAddress:
    """The leader as the node reported it (``routing.Leadership.leader_peer``'s shape)."""

    node_id: str
    client_address: str


class CallActivity:
    """``routing.RaftLeadership`` of a job port process: never the leader; it notes when calls
    come, so that the leader is asked often only while there are calls."""

    is_leader = False

    def __init__(self) -> None:
        self.last_call = -IDLE_AFTER_S
        self.woken = asyncio.Event()

    def note_client_activity(self) -> None:
        now = time.monotonic()
        if now - self.last_call >= IDLE_AFTER_S:
            self.woken.set()  # after a quiet spell: ask the node who leads now
        self.last_call = now

    def poll_interval(self) -> float:
        return LEADER_POLL_S if time.monotonic() - self.last_call < IDLE_AFTER_S else IDLE_LEADER_POLL_S


class NodeView:
    """``routing.Leadership`` of a job port process: no Raft, no coordinator; the leader is what
    its node last reported (``JobPortProcess._poll_leader``)."""

    def __init__(self) -> None:
        self.leader: LeaderAddress | None = None
        self.raft = CallActivity()

    def job_coordinator(self, job: str) -> None:
        return None

    def leader_peer(self) -> LeaderAddress | None:
        return self.leader


class PortRouter(Router):
    """``Router`` of a job port process: every call is its port's job, which exists while the
    process runs (its node stops it when the job goes); the leader has the last word."""

    def known_job(self, job: str) -> bool:
        return True


class PassThrough:
    """Every method of the given services, bytes in and out, to the node's client port with the
    job set; the node's status code and details come back unchanged."""

    def __init__(self, channel: grpc.aio.Channel, job: str) -> None:
        self._channel = channel
        self._job = job

    def _metadata(self, context: grpc.aio.ServicerContext) -> tuple[tuple[str, str | bytes], ...]:
        kept = tuple((k, v) for k, v in (context.invocation_metadata() or ())
                     if not k.startswith(":") and k not in _NOT_COPIED)
        return kept + ((JOB_HEADER, self._job),)

    def handlers(self, *services: Any) -> list[grpc.GenericRpcHandler]:
        out = []
        for service in services:
            methods = {}
            for m in service.methods:
                path = f"/{service.full_name}/{m.name}"
                if m.client_streaming and m.server_streaming:
                    methods[m.name] = grpc.stream_stream_rpc_method_handler(self._stream_stream(path))
                elif m.server_streaming:
                    methods[m.name] = grpc.unary_stream_rpc_method_handler(self._unary_stream(path))
                elif m.client_streaming:
                    methods[m.name] = grpc.stream_unary_rpc_method_handler(self._stream_unary(path))
                else:
                    methods[m.name] = grpc.unary_unary_rpc_method_handler(self._unary_unary(path))
            out.append(grpc.method_handlers_generic_handler(service.full_name, methods))
        return out

    def _unary_unary(self, path: str) -> Any:
        return self._single(self._channel.unary_unary(path))

    def _stream_unary(self, path: str) -> Any:
        return self._single(self._channel.stream_unary(path))

    def _single(self, method: Any) -> Any:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> bytes:
            try:
                return await method(request, timeout=context.time_remaining(), metadata=self._metadata(context))
            except grpc.aio.AioRpcError as e:
                await context.abort(e.code(), e.details() or "")
        return call

    def _unary_stream(self, path: str) -> Any:
        return self._streaming(self._channel.unary_stream(path))

    def _stream_stream(self, path: str) -> Any:
        return self._streaming(self._channel.stream_stream(path))

    def _streaming(self, method: Any) -> Any:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            upstream = method(request, timeout=context.time_remaining(), metadata=self._metadata(context))
            try:
                async for item in upstream:
                    yield item
            except grpc.aio.AioRpcError as e:
                await context.abort(e.code(), e.details() or "")
            finally:
                upstream.cancel()  # the caller went away (a trainer died): so does the node's side
        return call


class JobPortProcess:
    """The port of one job (see the module docstring); made and ``await run()`` on the running
    event loop, until SIGTERM."""

    def __init__(self, spec: PortSpec) -> None:
        self.spec = spec
        self.view = NodeView()
        self.channels = PeerChannels(spec.client_tls)
        self.router = PortRouter(self.view, self.channels, spec.identity, spec.max_member_bytes)
        self._node_channel = aio_channel(spec.node_address, spec.client_tls, CHANNEL_OPTIONS)
        self._stop = asyncio.Event()

    def _server(self) -> grpc.aio.Server:
        spec = self.spec
        server = aio_server(spec.server_options)
        server.add_generic_rpc_handlers((LighthouseServiceAdapter(self.router, spec.max_member_bytes,
                                                                  job=spec.job).handler(),))
        health_service = health_pb2.DESCRIPTOR.services_by_name["Health"]
        cluster_service = cpb.DESCRIPTOR.services_by_name["LighthouseCluster"]
        server.add_generic_rpc_handlers(tuple(PassThrough(self._node_channel, spec.job).handlers(
            cluster_service, health_service)))
        reflection.enable_server_reflection(
            (pb.DESCRIPTOR.services_by_name["LighthouseService"].full_name, cluster_service.full_name,
             health_service.full_name, reflection.SERVICE_NAME), server)
        return server

    async def _poll_leader(self) -> None:
        stub = cpb_grpc.LighthouseClusterStub(self._node_channel)
        while not self._stop.is_set():
            if os.getppid() != self.spec.parent_pid:
                log.warning("job %s: the node (pid %d) is gone; stopping", self.spec.job, self.spec.parent_pid)
                self._stop.set()
                return
            try:
                said = probe_from_response(self.spec.node_address, await stub.Leader(cpb.LeaderRequest(), timeout=1.0))
                leader = LeaderAddress(said.leader_id, said.leader_address) if said.leader_id else None
            except grpc.aio.AioRpcError:
                leader = self.view.leader  # the node is (re)starting: keep what it said last
            if leader != self.view.leader:
                self.view.leader = leader
                self.router.leadership_changed()
            activity = self.view.raft
            activity.woken.clear()
            stop, woken = asyncio.ensure_future(self._stop.wait()), asyncio.ensure_future(activity.woken.wait())
            await asyncio.wait((stop, woken), timeout=activity.poll_interval(), return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            woken.cancel()

    async def run(self) -> int:
        spec = self.spec
        address = f"{spec.host}:{spec.port}"
        server = self._server()
        reason = await start_listening(server, spec.host, spec.port, spec.server_tls)
        if reason is not None:
            sys.stdout.write(f"error {reason}\n")
            sys.stdout.flush()
            return EXIT_CANNOT_BIND
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._stop.set)
        loop.add_signal_handler(signal.SIGINT, self._stop.set)
        self.router.start()
        poll = loop.create_task(self._poll_leader())
        log.debug("job %s: serving torchft.LighthouseService on %s in process %d%s", spec.job, address, os.getpid(),
                 "" if spec.server_tls is None else " with TLS")
        sys.stdout.write(f"listening {spec.port}\n")
        sys.stdout.flush()
        try:
            await self._stop.wait()
        finally:
            await server.stop(STOP_GRACE_S)
            poll.cancel()
            await self.router.stop()
            await self.channels.close()
            await self._node_channel.close(None)
        return 0


def main() -> None:
    from lighthouse_cluster.server.event_loop import run
    from lighthouse_cluster.server.gc_thresholds import use_serving_thresholds
    from lighthouse_cluster.server.logs import configure_logging

    spec = PortSpec.decode(sys.stdin.buffer.read())
    die_with_parent(spec.parent_pid, f"job port process of {spec.identity}")
    configure_logging(spec.log_level, spec.log_format, spec.identity)
    lower_priority(spec.nice)
    use_serving_thresholds()
    sys.exit(run(serve(spec)))


def lower_priority(steps: int) -> None:
    """Run ``steps`` of CPU priority below the node (a child starts at its parent's niceness).

    Where the node and its port processes share cores, the kernel then runs the node first: its
    Raft thread and the event loop that every job's rounds pass through (a port process only takes
    calls in and hands them on). A busy job's intake yields to the cluster's own work instead of
    slowing every job's rounds and the leader's heartbeats; with cores to spare it changes nothing.
    """
    if steps > 0:
        try:
            os.nice(steps)
        except OSError as e:  # a sandbox that forbids even lowering one's own priority: serve anyway
            log.warning("cannot lower this process's CPU priority by %d: %s", steps, e)


async def serve(spec: PortSpec) -> int:
    """Serve until SIGTERM; built on the running loop (grpc.aio channels bind to the loop they are
    made on)."""
    return await JobPortProcess(spec).run()


if __name__ == "__main__":
    log = logging.getLogger("lighthouse_cluster.server.job_port_process")  # not "__main__"
    main()
