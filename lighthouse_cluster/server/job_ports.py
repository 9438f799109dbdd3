"""A job's own client ports: how unchanged torchft trainers select a job.

Every job whose spec names a port for this node (``JobSpec.port_for``: its own entry, else the
``*`` one) gets a gRPC server of its own on that port, on the host of the node's client bind
address, with the client port's TLS and server options. It serves, for that job only:
``torchft.LighthouseService`` (Quorum and Heartbeat, routed like the client port's), and
``lighthouse_cluster.LighthouseCluster`` with the job fixed (Status, Leader, ListJobs, GetJob,
Watch), and gRPC health (the node's readiness). A call's ``x-lighthouse-job`` metadata is
ignored there: the port is the job.

With ``--job-port-processes`` (``processes``), each job port is served by a process of its own
instead (``job_port_process.py``: the job's calls reach the leader as a follower's do, and their
gRPC work leaves the node's event loop); ``JobPorts`` starts it, reads whether it listens, starts
it again when it exits (after ``RESTART_S``, doubling while it keeps exiting) and stops it with
SIGTERM (SIGKILL after ``STOP_GRACE_S`` + 1 s). A job's ``max_member_bytes`` is then checked by
its coordinator on the leader (the process checks the node's hard limit).

``JobPorts`` keeps the servers in step with the replicated job table: ``sync()`` (the node's
watch loop, every tick; it only looks at the table when its version moved) works out which port
each job wants and wakes a task of its own that binds, moves and stops servers, so the watch loop
never waits on a socket. A new port is bound; a port that changed moves (the old server stops,
the new port is bound); a removed job's server stops gracefully: its calls, which the router now
answers NOT_FOUND, end within ``STOP_GRACE_S``. A port that cannot be bound (in use, no
permission) is recorded with the reason (``state(job)``, shown as the job's ``listening_port``
and ``port_error``), logged once, and tried again every ``RETRY_S``; it never stops the node or
touches another job's port. A port this node has for itself (its client, Raft or HTTP port; the
leader refuses the ones it knows of, but not another node's HTTP port) is reported as such and
not tried until the job's port changes. ``close()`` stops every server when the node stops.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from lighthouse_cluster.core.state_machine import QuorumStateMachine
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import lighthouse_cluster_pb2_grpc as cpb_grpc
from lighthouse_cluster.proto import torchft_pb2 as pb
from lighthouse_cluster.core.restarts import RestartBackoff, describe_exit
from lighthouse_cluster.server.aio_server import aio_server
from lighthouse_cluster.server.bind_check import start_listening
from lighthouse_cluster.server.child_process import ChildProcess
from lighthouse_cluster.server.config import parse_host_port
from lighthouse_cluster.server.grpc_services import (
    ClusterServiceAdapter,
    HeartbeatBatchSink,
    JobViews,
    LighthouseServiceAdapter,
    NodeStatusSource,
    QuorumRouting,
    WatchStreams,
)
from lighthouse_cluster.server.job_port_process import EXIT_CANNOT_BIND, PortSpec
from lighthouse_cluster.tls import ClientTLS, ServerTLS

log = logging.getLogger(__name__)

# A port that could not be bound is tried again this often.
RETRY_S = 2.0
NEVER = float("inf")  # a _JobServer's next_try that no time reaches
# A stopped job port's calls get this long to end before they are cancelled.
STOP_GRACE_S = 1.0
# A job port process that exited is started again after this long (doubling, up to RETRY_S,
# while it keeps exiting within a few seconds of its start).
RESTART_S = 0.2
# A job port process that has not said whether it listens after this long is killed.
START_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class PortProcesses:
    """How this node starts its job port processes (``--job-port-processes``)."""

    node_address: str  # the node's own client address, which the processes dial
    client_tls: ClientTLS | None
    max_member_bytes: int  # the node's hard limit (each job's own is checked by its coordinator)
    log_level: str = "info"
    log_format: str = "text"
    nice: int = 0  # steps of CPU priority below the node (--job-port-process-nice)


@dataclass(eq=False)
class _JobServer:
    """One job's port on this node: the server while it listens, else why it does not."""

    job: str
    port: int
    max_member_bytes: int
    server: grpc.aio.Server | None = None
    lighthouse: LighthouseServiceAdapter | None = None
    process: ChildProcess | None = None  # with --job-port-processes
    started_at: float = 0.0
    error: str = ""
    next_try: float = 0.0
    logged: str = ""  # the last error logged (each is logged once)

    @property
    def listening(self) -> bool:
        return self.server is not None or self.process is not None


class JobPorts:
    """The job ports of one node (see the module docstring); ``state`` is ``job_admin.PortStates``."""

    def __init__(self, node_id: str, client_bind: str, tls: ServerTLS | None, options: Sequence[tuple[str, Any]],
                 machine: QuorumStateMachine, router: QuorumRouting, heartbeats: HeartbeatBatchSink,
                 node: NodeStatusSource, watch: Callable[[str], WatchStreams | None], jobs: JobViews,
                 health_servicer: health.aio.HealthServicer, processes: PortProcesses | None = None,
                 own_ports: Mapping[int, str] | None = None) -> None:
        self._node_id = node_id
        self._own_ports = dict(own_ports or {})  # port -> what it is ("HTTP port", ...)
        self._processes = processes
        self._backoff = RestartBackoff(initial_s=RESTART_S, max_s=RETRY_S)
        self._watching: set[asyncio.Task[None]] = set()  # one per running port process
        self._host = parse_host_port(client_bind, "client bind address", allow_zero=True)[0]
        self._tls = tls
        self._options = list(options)
        self._machine = machine
        self._router = router
        self._heartbeats = heartbeats
        self._node = node
        self._watch = watch
        self._jobs = jobs
        self._health = health_servicer
        self._servers: dict[str, _JobServer] = {}
        # job -> (port, max_member_bytes) wanted on this node; applied by the task.
        self._wanted: dict[str, tuple[int, int]] = {}
        self._seen_version = -1
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping: set[asyncio.Task[None]] = set()

    # -- what the node calls ----------------------------------------------------------------------

    def start(self) -> None:
        self.sync()
        self._task = asyncio.get_running_loop().create_task(self._run())

    def sync(self) -> None:
        """Read the job table when it changed and wake the task when a port must change."""
        version = self._machine.jobs_version
        if version == self._seen_version:
            return
        self._seen_version = version
        wanted: dict[str, tuple[int, int]] = {}
        for name, js in list(self._machine.jobs.items()):  # one copy: Raft's thread applies changes
            spec = js.spec
            port = spec.port_for(self._node_id)
            if port is not None and spec.settings is not None:
                wanted[name] = (port, spec.settings.max_member_bytes)
        if wanted != self._wanted:
            self._wanted = wanted
            self._wake.set()

    def state(self, job: str) -> tuple[int, str]:
        """(the port this node listens on for ``job``, or 0; why it does not, when it should)."""
        js = self._servers.get(job)
        if js is None or js.port != self._wanted.get(job, (None,))[0]:
            return 0, ""
        return (js.port, "") if js.listening else (0, js.error)

    async def close(self, grace_s: float = 0.2) -> None:
        """Stop every job port (the node stops; its calls get ``grace_s``, as the client port's)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for js in list(self._servers.values()):
            self._stop(js, "the node stops", grace_s)
        self._servers.clear()
        if self._stopping:
            await asyncio.gather(*self._stopping, return_exceptions=True)

    # -- the task ---------------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            try:
                await self._apply()
            except Exception:  # noqa: BLE001 -- a job port never takes the node down
                log.exception("job ports: unexpected error; trying again in %.0f s", RETRY_S)
            waiting = [js.next_try for js in self._servers.values() if not js.listening and js.next_try != NEVER]
            timeout = max(0.05, min(waiting) - loop.time()) if waiting else None
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    async def _apply(self) -> None:
        wanted = dict(self._wanted)
        for name, js in list(self._servers.items()):
            want = wanted.get(name)
            if want is None or want[0] != js.port:
                del self._servers[name]
                if js.listening:
                    self._stop(js, "the job was removed" if want is None else f"it moved to port {want[0]}")
                if want is None:
                    log.info("job %s: no port on this node any more", name)
        if self._stopping:
            # A port given up by one job may be another's now: bind after it is released.
            await asyncio.wait(self._stopping, timeout=STOP_GRACE_S + 1.0)
        now = asyncio.get_running_loop().time()
        for name, (port, max_member_bytes) in sorted(wanted.items()):
            js = self._servers.get(name)
            if js is None:
                js = self._servers[name] = _JobServer(name, port, max_member_bytes)
            js.max_member_bytes = max_member_bytes
            if js.lighthouse is not None:
                js.lighthouse.max_member_bytes = max_member_bytes
            if not js.listening and now >= js.next_try:
                own = self._own_ports.get(port)
                if own is not None:  # never free while this node runs; the job's next port is tried
                    self._failed(js, f"port {port} is this node's {own}", NEVER)
                elif self._processes is not None:
                    await self._start_process(js, self._processes)
                else:
                    await self._bind(js)

    async def _bind(self, js: _JobServer) -> None:
        address = f"{self._host}:{js.port}"
        server = aio_server(self._options)
        lighthouse = LighthouseServiceAdapter(self._router, js.max_member_bytes, job=js.job)
        server.add_generic_rpc_handlers((lighthouse.handler(),))
        cpb_grpc.add_LighthouseClusterServicer_to_server(
            ClusterServiceAdapter(self._node, self._heartbeats, self._node_id, self._watch, self._jobs, job=js.job),
            server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (pb.DESCRIPTOR.services_by_name["LighthouseService"].full_name,
             cpb.DESCRIPTOR.services_by_name["LighthouseCluster"].full_name,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME),
            server)
        error = await start_listening(server, self._host, js.port, self._tls)
        if error is not None:
            self._failed(js, error, RETRY_S)
            return
        js.server, js.lighthouse = server, lighthouse
        was = js.logged
        js.error = js.logged = ""
        log.info("job %s: serving torchft.LighthouseService on %s%s%s", js.job, address,
                 "" if self._tls is None else " with TLS", f" (was: {was})" if was else "")

    def _failed(self, js: _JobServer, error: str, retry_in: float) -> None:
        js.error = error
        js.next_try = asyncio.get_running_loop().time() + retry_in
        if js.error != js.logged:
            js.logged = js.error
            log.warning("job %s: %s; %s", js.job, js.error, "not trying it" if retry_in == NEVER
                        else f"trying again in {retry_in:.1f} s")

    async def _start_process(self, js: _JobServer, how: PortProcesses) -> None:
        spec = PortSpec(job=js.job, host=self._host, port=js.port, node_id=self._node_id,
                        node_address=how.node_address, max_member_bytes=how.max_member_bytes,
                        parent_pid=os.getpid(), server_tls=self._tls, client_tls=how.client_tls,
                        log_level=how.log_level, log_format=how.log_format, server_options=tuple(self._options),
                        nice=how.nice)
        # From the event loop's thread (the node's main thread): Linux's parent-death signal is
        # tied to the thread that started the process. Not asyncio's subprocess: on uvloop that
        # is a fork() that runs gRPC's fork handlers in this serving process (child_process.py).
        try:
            proc = ChildProcess.start([sys.executable, "-m", "lighthouse_cluster.server.job_port_process"])
        except OSError as e:  # no memory, too many processes
            self._failed(js, f"cannot start its port process: {e.strerror or e}", RETRY_S)
            return
        started = time.monotonic()
        try:
            proc.write_stdin(spec.encode())
            line = (await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT_S)).decode(errors="replace").strip()
        except asyncio.TimeoutError as e:
            line = f"error its process did not start ({type(e).__name__})"
        except BaseException:  # cancelled: the node stops
            proc.kill()
            proc.close()
            raise
        if not line.startswith("listening"):
            if proc.returncode is None:
                proc.kill()
            rc = await proc.wait()
            proc.close()
            why = line[len("error "):] if line.startswith("error ") else \
                f"its process exited ({describe_exit(rc)}) before it listened"
            self._failed(js, why, RETRY_S if rc == EXIT_CANNOT_BIND else self._backoff.next_delay(js.job, 0.0))
            return
        js.process, js.started_at = proc, started
        was = js.logged
        js.error = js.logged = ""
        log.info("job %s: port %d served by process %d%s", js.job, js.port, proc.pid, f" (was: {was})" if was else "")
        task = asyncio.get_running_loop().create_task(self._watch_process(js, proc))
        self._watching.add(task)
        task.add_done_callback(self._watching.discard)

    async def _watch_process(self, js: _JobServer, proc: ChildProcess) -> None:
        """Until ``proc`` exits: its stdout is drained; an exit this node did not ask for is
        reported (``port_error``) and the process started again after the backoff."""
        while await proc.stdout.read(4096):
            pass
        rc = await proc.wait()
        if js.process is not proc or self._servers.get(js.job) is not js:
            return  # stopped by this node (the job moved, was removed, or the node stops)
        js.process = None
        delay = self._backoff.next_delay(js.job, time.monotonic() - js.started_at)
        self._failed(js, f"its port process {proc.pid} exited ({describe_exit(rc)})", delay)
        self._wake.set()

    def _stop(self, js: _JobServer, why: str, grace_s: float = STOP_GRACE_S) -> None:
        proc, js.process = js.process, None
        if proc is not None:
            log.info("job %s: closing port %d (%s): stopping process %d", js.job, js.port, why, proc.pid)
            task = asyncio.get_running_loop().create_task(_stop_process(proc, grace_s))
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)
        server, js.server, js.lighthouse = js.server, None, None
        if server is None:
            return
        log.info("job %s: closing port %d (%s)", js.job, js.port, why)
        task = asyncio.get_running_loop().create_task(server.stop(grace_s))
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)


async def _stop_process(proc: ChildProcess, grace_s: float) -> None:
    """SIGTERM (its calls get ``grace_s``), then SIGKILL if it has not exited a second later."""
    if proc.returncode is not None:
        return
    try:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), grace_s + 1.0)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
