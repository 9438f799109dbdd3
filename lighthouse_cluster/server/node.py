"""One lighthouse node: Raft replication, the leader's quorum rounds and the gRPC server, wired.

``LighthouseNode`` owns the event loop side of a node. It watches Raft (pysyncobj's callbacks
plus a short poll for leader changes that involve no local state change), starts and stops every
job's coordinator as leadership comes and goes (``job_registry.JobRegistry``: one coordinator,
liveness streams and manager connections per job, the default job's being ``coordinator``,
``liveness`` and ``connections``), keeps the registry and the jobs' own client ports
(``job_ports.JobPorts``) in step with the replicated job table, creates the jobs declared in its
config and, with ``--auto-create-jobs``, unknown jobs on first use (``job_creation``), tells
the router (``routing.Router``, where every call goes) and the liveness streams when leadership may
have changed, adopts the replicated member table (persisted by
``member_table``), enables newer state schemas once every node reads them, and answers for the
node as a whole: readiness, the leader, Status. The adapters (gRPC services, admin, HTTP,
metrics) are handed the node or the router and see each only through a ``Protocol`` of their
own, so nothing else in ``server`` imports this module.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from lighthouse_cluster import __version__
from lighthouse_cluster.core.codec import Command, EnableSchema
from lighthouse_cluster.core.lease import LeaseSettings
from lighthouse_cluster.core.state_machine import QuorumStateMachine
from lighthouse_cluster.core.torchft_wire import member_to_proto, quorum_to_proto
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import lighthouse_cluster_pb2_grpc as cpb_grpc
from lighthouse_cluster.proto import torchft_pb2 as pb
from lighthouse_cluster.raft.replication import RaftNode, ReplicatedState, Role
from lighthouse_cluster.server.admin import NodeAdmin
from lighthouse_cluster.server.aio_server import aio_server
from lighthouse_cluster.server.config import NodeConfig, PeerSpec
from lighthouse_cluster.server.coordinator import QuorumCoordinator
from lighthouse_cluster.server.job_admin import JobAdmin
from lighthouse_cluster.server.job_creation import JobCreator, WatchOfNewJob
from lighthouse_cluster.server.job_ports import JobPorts, PortProcesses
from lighthouse_cluster.server.logs import JsonFormatter
from lighthouse_cluster.server.job_registry import JobRegistry, JobRuntime
from lighthouse_cluster.server.kv_service import KVService
from lighthouse_cluster.server.leader_term import LeaderTerm
from lighthouse_cluster.server.event_loop import running_loop_name
from lighthouse_cluster.server.grpc_services import (
    AdminServiceAdapter,
    ClusterServiceAdapter,
    LighthouseServiceAdapter,
)
from lighthouse_cluster.server.loop_bridge import loop_future
from lighthouse_cluster.server.liveness_streams import LivenessStreams
from lighthouse_cluster.server.manager_connections import ManagerConnections
from lighthouse_cluster.server.member_table import load_members, save_members
from lighthouse_cluster.server.forwarding import PeerChannels
from lighthouse_cluster.server.metrics import NodeMetrics
from lighthouse_cluster.server.routing import Router
from lighthouse_cluster.server import stop_watchdog

log = logging.getLogger(__name__)

# The watch loop runs when Raft's view changes (role, term, leader, connected peers, the member,
# job and schema versions: RaftNode's on_view_changed), when a job starts serving, and at least
# this often (the schema upgrade check, anything else that changes without telling).
WATCH_FALLBACK_S = 0.5
# How often a leader whose cluster runs an older schema than this version writes asks the other
# nodes which version they read (see _upgrade_schema).
SCHEMA_CHECK_PERIOD_S = 2.0

# The most one step of a node's stop may take (closing a server, its channels) before the stop
# logs it and goes on without it.
STOP_STEP_TIMEOUT_S = 3.0

_ROLE_PB = {Role.FOLLOWER: cpb.FOLLOWER, Role.CANDIDATE: cpb.CANDIDATE, Role.LEADER: cpb.LEADER}

# Calls gRPC core may hold for the application (see SERVER_OPTIONS); gRPC's default is 1000.
MAX_PENDING_CALLS = 1 << 16

SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    # gRPC core queues calls that arrived before the (asyncio) application asked for the next
    # one and, past 1000 queued calls (randomly, all past 3000), cancels new ones: the client
    # sees CANCELLED "CANCELLED" (docs/design/grpc-pending-calls.md). N replica groups send N
    # Quorum calls in one burst when a round is issued, plus their heartbeats, while the event loop
    # is busy sending N answers, so N >~ 500 hit it. A waiting call costs a few KB: queue instead.
    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
]


def port_processes(config: NodeConfig) -> PortProcesses | None:
    """How this node starts its job port processes (``--job-port-processes``); None: in process."""
    if not config.job_port_processes:
        return None
    root = logging.getLogger()
    json_logs = any(isinstance(h.formatter, JsonFormatter) for h in root.handlers)
    return PortProcesses(node_address=config.self_peer.client_address, client_tls=config.peer_tls,
                         max_member_bytes=config.max_member_bytes,
                         log_level=logging.getLevelName(root.getEffectiveLevel()).lower(),
                         log_format="json" if json_logs else "text", nice=config.job_port_process_nice)


class LighthouseNode:
    """A lighthouse-cluster node; ``await start()``, then ``await wait_closed()``."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.started = time.monotonic()
        self.machine = QuorumStateMachine(config.schema_version)
        self.raft: RaftNode | None = None
        self.server: grpc.aio.Server | None = None
        self.channels = PeerChannels(config.peer_tls)
        # The cluster's members: the replicated member table once an admin changed it, else
        # the last table this node persisted (MEMBERS_FILE), else the --peer list.
        self._members: tuple[PeerSpec, ...] = load_members(config) or config.peers
        self._members_version = self.machine.members_version
        self.router = Router(self, self.channels, config.node_id, config.max_member_bytes)
        self.bound_port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._seen: tuple[Role, int, str | None] | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._watch_wake = asyncio.Event()
        self._stopping = False
        self._jobs_stopped = False
        self._stopped = asyncio.Event()
        self.leader_term = LeaderTerm(config.node_id, self.machine, self.submit, probe=self.probe_leadership,
                                      stream=self.stream_lease_confirmations,
                                      lease=LeaseSettings(lease_ms=config.quorum_lease_ms),
                                      vote_refusal_s=lambda term: self.raft.vote_refusal_s(term) if self.raft else 0.0)
        self.jobs = JobRegistry(self, config, self.machine, self.submit, self.leader_term,
                                on_issue=lambda job: lambda issued, commit_s: self.metrics.on_issue(job, issued, commit_s),
                                on_serving=lambda _job: self._watch_wake.set())
        self._started_jobs = False
        self.metrics = NodeMetrics(self, self.router)
        # The rendezvous key-value store's service (issue 34); woken by every applied entry.
        self.kv = KVService(self, self.channels, config.node_id, config.admin_token,
                            idle_expiry_s=config.rendezvous_idle_expiry_s,
                            count=lambda op, result: self.metrics.kv_operations.labels(op, result).inc())
        self.health = health.aio.HealthServicer()
        self._health_serving: bool | None = None
        self.http = None  # http_endpoints.HttpEndpoints when --http-bind is set
        self._schema_checked_at = float("-inf")
        self._schema_task: asyncio.Task[None] | None = None
        self.admin = NodeAdmin(self)
        self.job_admin = JobAdmin(config.node_id, self.machine, self.jobs, self.admin.require_leader,
                                  self.admin.commit, reserved_ports=config.reserved_ports)
        self.job_ports = JobPorts(config.node_id, config.client_bind, config.tls, SERVER_OPTIONS, self.machine,
                                  self.router, self.router, self, self.watch_streams, self.job_admin, self.health,
                                  processes=port_processes(config),
                                  own_ports=config.reserved_ports[config.node_id])
        self.job_admin.ports = self.job_ports  # each job's listening_port / port_error
        self.creator = JobCreator(config.jobs, config.auto_create_jobs, self.job_admin, self.machine,
                                  self.serving_term)
        if config.auto_create_jobs:
            self.router.creator = self.creator

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        cfg = self.config
        self.server = aio_server(SERVER_OPTIONS)
        self.server.add_generic_rpc_handlers((LighthouseServiceAdapter(self.router, cfg.max_member_bytes).handler(),
                                              self.router.forwarding.handler()))
        cpb_grpc.add_LighthouseClusterServicer_to_server(
            ClusterServiceAdapter(self, self.router, cfg.node_id, self.watch_streams, self.job_admin), self.server)
        cpb_grpc.add_LighthouseAdminServicer_to_server(
            AdminServiceAdapter(self.admin, cfg.admin_token, self.job_admin), self.server)
        cpb_grpc.add_LighthouseKVServicer_to_server(self.kv, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (pb.DESCRIPTOR.services_by_name["LighthouseService"].full_name,
             cpb.DESCRIPTOR.services_by_name["LighthouseCluster"].full_name,
             cpb.DESCRIPTOR.services_by_name["LighthouseAdmin"].full_name,
             cpb.DESCRIPTOR.services_by_name["LighthouseKV"].full_name,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME),
            self.server)
        await self._update_health()
        if cfg.http_bind:
            from lighthouse_cluster.server.http_endpoints import HttpEndpoints

            self.http = HttpEndpoints(self, cfg.http_bind, cfg.admin_token, cfg.tls)  # HTTPS with TLS
            await self.http.start()
        try:
            if cfg.tls is not None:
                self.bound_port = self.server.add_secure_port(cfg.client_bind, cfg.tls.credentials())
            else:
                self.bound_port = self.server.add_insecure_port(cfg.client_bind)
        except RuntimeError as e:
            raise OSError(f"cannot bind client address {cfg.client_bind}: {e}") from e
        await self.server.start()
        self.raft = RaftNode(
            cfg.self_peer.raft_address,
            [p.raft_address for p in self.other_members],
            ReplicatedState(self.machine, on_apply=self.kv.on_apply),
            bind_address=cfg.raft_bind,
            data_dir=cfg.data_dir,
            secret=cfg.secret,
            settings=cfg.raft,
            on_state_changed=lambda old, new: self._from_raft_thread(),
            dial=cfg.raft_dial_by_address,
            hold_elections_until_leader=cfg.join,
            on_view_changed=self._from_raft_thread,
            fsync=not cfg.unsafe_no_fsync,
        )
        self.router.start()
        self.kv.start()
        self.jobs.start()
        self._started_jobs = True
        self.job_ports.start()
        self._watch_task = asyncio.get_running_loop().create_task(self._watch())
        if self.http is not None:
            log.info("node %s serving /metrics, /livez, /readyz and the dashboard on %s", cfg.node_id,
                     self.http.url)
        log.info("node %s serving torchft.LighthouseService on %s%s (Raft %s, peers %s; %s event loop, gc thresholds %s)",
                 cfg.node_id, cfg.client_bind,
                 "" if cfg.tls is None else (" with mutual TLS" if cfg.tls.mutual else " with TLS"),
                 cfg.self_peer.raft_address, ", ".join(str(p) for p in self.other_members), running_loop_name(),
                 "/".join(str(t) for t in gc.get_threshold()))

    async def stop(self, grace_s: float = 1.0) -> None:
        """Hand leadership over if leading, then stop serving and leave the Raft group.

        A stopping node starts no term of its own: a follower that the stopping leader hands over
        to may be stopping too, and win (it steps down, so that its calls go elsewhere, until its
        jobs stop). A second call waits for the first to finish. Each step is bounded
        (``STOP_STEP_TIMEOUT_S``): one that overruns is logged by name and left behind, so that
        the rest of the node still stops."""
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        if self.raft is not None and self.raft.is_leader and self.other_members:
            leader_id, _, why_not = await self.admin.hand_over(None, grace_s)
            if leader_id is not None:
                log.info("leadership handed over before shutdown")
            else:
                log.warning("leadership not handed over before shutdown: %s", why_not)
        if self._watch_task is not None:
            self._watch_task.cancel()
        if self._schema_task is not None:
            self._schema_task.cancel()
        self.creator.stop()
        await _bounded("the jobs' client ports", self.job_ports.close())
        self._jobs_stopped = True
        self.jobs.stop()
        await _bounded("the router", self.router.stop())
        await _bounded("the rendezvous store", self.kv.stop())
        self._health_serving = False
        await _bounded("the health service", self.health.enter_graceful_shutdown())
        if self.http is not None:
            await _bounded("the HTTP server", self.http.stop())
        if self.server is not None:
            await _bounded("the gRPC server", self.server.stop(grace=0.2))
        await _bounded("the channels to the other nodes", self.channels.close())
        if self.raft is not None:
            self.raft.destroy()
        log.info("node %s stopped", self.config.node_id)
        self._stopped.set()

    async def wait_closed(self) -> None:
        await self._stopped.wait()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda s=sig: loop.create_task(self._on_signal(s)))

    async def _on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self._stopping:
            log.info("received %s; already shutting down", name)
            return
        log.info("received %s; shutting down", name)
        stop_watchdog.arm()  # the process exits within its deadline, however the stop goes
        await self.stop()

    # -- Raft -> loop ---------------------------------------------------------------------------

    def submit(self, command: Command, while_leader_of: int | None = None) -> "asyncio.Future[Any]":
        loop = self._loop
        assert loop is not None and self.raft is not None
        started = time.monotonic()
        future, on_result = loop_future(
            loop, on_settle=lambda _result, error: self.metrics.observe_raft_write(time.monotonic() - started,
                                                                                   error is None))
        self.raft.submit(command, on_result, while_leader_of=while_leader_of)
        return future

    @property
    def lease_renewals(self) -> dict[str, int]:
        return dict(self.leader_term.renewals)

    def probe_leadership(self, term: int) -> "asyncio.Future[bool]":
        """Whether a majority still follows this node as leader of ``term`` as of now, from one
        acknowledged heartbeat (``RaftNode.probe_leadership``): no log entry."""
        loop = self._loop
        assert loop is not None and self.raft is not None
        future, on_result = loop_future(loop)
        self.raft.probe_leadership(term, lambda ok: on_result(ok, None))
        return future

    def stream_lease_confirmations(self, term: int, on_confirmed: Callable[[float], None] | None) -> None:
        """Every heartbeat of ``term`` a lease probe (``RaftNode.stream_lease_confirmations``):
        ``on_confirmed(t)`` on the event loop, ``t`` a ``time.monotonic()`` time; None stops it."""
        loop = self._loop
        if self.raft is None or loop is None:
            return

        def to_loop(since: float) -> None:
            try:
                loop.call_soon_threadsafe(on_confirmed, since)
            except RuntimeError:  # the loop closed while the tick thread ran on (shutdown)
                pass

        self.raft.stream_lease_confirmations(term, None if on_confirmed is None else to_loop)

    # -- jobs -----------------------------------------------------------------------------------

    @property
    def coordinator(self) -> QuorumCoordinator | None:
        """The default job's coordinator (None before ``start``)."""
        return self.jobs.default.coordinator if self._started_jobs else None

    @property
    def liveness(self) -> LivenessStreams:
        return self.jobs.default.liveness

    @property
    def connections(self) -> ManagerConnections:
        return self.jobs.default.connections

    def job_coordinator(self, job: str) -> QuorumCoordinator | None:
        """The coordinator of ``job`` (None: no such job on this node, or not started)."""
        rt = self.jobs.get(job) if self._started_jobs else None
        return rt.coordinator if rt is not None else None

    def job_runtime(self, job: str) -> JobRuntime | None:
        return self.jobs.get(job) if self._started_jobs else None

    def job_streams(self, job: str) -> LivenessStreams | None:
        """The liveness streams of ``job`` (None: no such job on this node)."""
        rt = self.job_runtime(job)
        return rt.liveness if rt is not None else None

    def watch_streams(self, job: str) -> Any:
        """What serves a Watch stream of ``job`` (None: NOT_FOUND): the job's liveness streams;
        for a job this node does not have, with auto-creation on, ``WatchOfNewJob``."""
        streams = self.job_streams(job)
        if streams is not None or not self.config.auto_create_jobs or not self._started_jobs:
            return streams
        return WatchOfNewJob(self.creator, job, self.job_streams, self.liveness, self.serving_term)

    def serving_term(self) -> int | None:
        """The term this node serves quorum rounds in as leader (None: it does not)."""
        raft, coord = self.raft, self.coordinator
        if raft is None or coord is None or not raft.is_leader or coord.term is None or not coord.serving:
            return None
        return coord.term

    def _from_raft_thread(self) -> None:
        """Raft's role or view changed (on its tick thread): ``_raft_changed`` on the loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._raft_changed)
        except RuntimeError:  # closed in between: the node is gone
            pass

    def _raft_changed(self) -> None:
        """On the loop, when Raft's role or view changed: act on a new role at once, and run the
        watch loop."""
        self._check_raft()
        self._watch_wake.set()

    async def _watch(self) -> None:
        while True:
            self._watch_wake.clear()
            self.jobs.sync()
            self.job_ports.sync()
            self.creator.tick()
            self._check_raft()
            self.refresh_members()
            await self._update_health()
            self._maybe_upgrade_schema()
            try:
                await asyncio.wait_for(self._watch_wake.wait(), WATCH_FALLBACK_S)
            except asyncio.TimeoutError:
                pass

    # -- schema upgrades ----------------------------------------------------------------------

    def _maybe_upgrade_schema(self) -> None:
        coord = self.coordinator
        if self.machine.schema_version >= self.config.schema_version or coord is None or not coord.serving:
            return
        if self._schema_task is not None and not self._schema_task.done():
            return
        now = time.monotonic()
        if now - self._schema_checked_at < SCHEMA_CHECK_PERIOD_S:
            return
        self._schema_checked_at = now
        self._schema_task = asyncio.get_running_loop().create_task(self._upgrade_schema())

    async def _upgrade_schema(self) -> None:
        """Enable the newest schema every member node reads (each reports the version it writes
        in ``Status``; 0 from a version that predates the field). Until the last node of a
        rolling upgrade runs this version, the cluster keeps writing the schema it has."""
        enabled = self.machine.schema_version
        readable = [self.config.schema_version]
        for peer in self.other_members:
            stub = cpb_grpc.LighthouseClusterStub(self.channels.get(peer.client_address))
            try:
                st = await stub.Status(cpb.StatusRequest(), timeout=1.0)
            except grpc.aio.AioRpcError as e:
                log.debug("schema %d enabled, %d written here: node %s did not answer (%s)", enabled,
                          self.config.schema_version, peer.node_id, e.code().name)
                return
            readable.append(st.schema_version)
        target = min(readable)
        if target <= enabled:
            return
        try:
            now_enabled = await asyncio.wait_for(self.submit(EnableSchema(version=target)), 2.0)
        except Exception as e:  # noqa: BLE001 -- not committed: retried at the next check
            log.info("schema %d not enabled yet (%s)", target, str(e) or type(e).__name__)
            return
        log.info("every node reads schema %d: enabled (was %d)", now_enabled, enabled)

    # -- members -------------------------------------------------------------------------------

    @property
    def members(self) -> tuple[PeerSpec, ...]:
        """Every member of the cluster, this node included (see ``__init__``)."""
        return self._members

    @property
    def other_members(self) -> tuple[PeerSpec, ...]:
        return tuple(p for p in self._members if p.node_id != self.config.node_id)

    def member_by_raft_address(self, address: str | None) -> PeerSpec | None:
        return next((p for p in self._members if p.raft_address == address), None)

    def refresh_members(self) -> None:
        """Adopt the replicated member table when it changed, and persist it for restarts."""
        version = self.machine.members_version
        if version == self._members_version:
            return
        self._members_version = version
        members = tuple(PeerSpec(*m) for m in self.machine.members)
        if not members:
            return
        self._members = members
        log.info("member table version %d: %s", version, ", ".join(str(p) for p in members))
        save_members(self.config, version, members)

    # -- readiness -------------------------------------------------------------------------------

    def readiness(self) -> tuple[bool, str]:
        """(ready, one-line reason): ready only as part of a cluster with a known, connected
        leader, and, on the leader, while it serves quorum rounds with a majority connected."""
        raft, coord = self.raft, self.coordinator
        if self._stopping:
            return False, "node is shutting down"
        if raft is None or coord is None:
            return False, "node is starting"
        peer = self.leader_peer()
        if peer is None:
            return False, f"no known leader (role {raft.role.value}, term {raft.term})"
        if peer.node_id != self.config.node_id:
            return True, f"follower of {peer.node_id} in term {raft.term}"
        others = self.other_members
        connected = sum(1 for p in others if raft.is_connected(p.raft_address))
        if (connected + 1) * 2 <= len(self._members):
            return False, f"leader without a majority ({connected + 1}/{len(self._members)} nodes connected)"
        if coord.term is None or not coord.serving:
            return False, f"leader of term {raft.term} is not serving yet (warming up)"
        return True, f"leader in term {raft.term}"

    async def _update_health(self) -> None:
        ready, _ = self.readiness()
        if ready == self._health_serving:
            return
        self._health_serving = ready
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", "torchft.LighthouseService", "lighthouse_cluster.LighthouseCluster"):
            await self.health.set(service, status)

    def _check_raft(self) -> None:
        raft = self.raft
        if raft is None or not self._started_jobs or self._jobs_stopped:
            return
        leader_peer = self.leader_peer()
        seen = (raft.role, raft.term, leader_peer.raft_address if leader_peer else None)
        if seen == self._seen:
            return
        old, self._seen = self._seen, seen
        role, term, leader = seen
        if role is Role.LEADER and raft.led_term == term:
            # A stopping node steps down (its calls go to the new leader) but starts no term.
            if self.leader_term.term != term and not self._stopping:
                self.jobs.start_leading(term)
        elif self.leader_term.term is not None:
            self.jobs.stop_leading()
        if old is None or old[2] != leader or old[0] != role:
            peer = self.member_by_raft_address(leader)
            log.info("raft: %s in term %d, leader %s", role.value, term, peer.node_id if peer else "unknown")
        self.router.leadership_changed()
        self.jobs.leadership_changed()

    # -- leader lookup ---------------------------------------------------------------------------

    def leader_peer(self) -> PeerSpec | None:
        """The leader as far as this node knows; None when unknown or when this follower has no
        connection to it (pysyncobj keeps naming a lost leader until an election starts, and an
        isolated node never starts one)."""
        raft = self.raft
        if raft is None:
            return None
        address = raft.leader_address
        if address is None:
            return None
        if address == self.config.self_peer.raft_address and raft.led_term != raft.term:
            return None  # being deposed: pysyncobj raised the term before stepping down (BUG-3)
        if address != self.config.self_peer.raft_address and not raft.is_connected(address):
            return None
        return self.member_by_raft_address(address)

    # -- introspection ------------------------------------------------------------------------------

    def leader_info(self) -> cpb.LeaderResponse:
        _role, term, peer = self._leader_view()
        return cpb.LeaderResponse(
            leader_id=peer.node_id if peer else "",
            leader_client_address=peer.client_address if peer else "",
            term=term,
            nodes=[cpb.NodeInfo(id=p.node_id, client_address=p.client_address, raft_address=p.raft_address)
                   for p in self._members],
        )

    def _role_and_term(self) -> tuple[Role, int]:
        """Role and term read consistently. pysyncobj raises a deposed leader's term (a
        synchronous meta-file write) before it steps down, so separate reads can see LEADER next
        to the new term: a node is reported leader only of the term it won (BUG-3)."""
        raft = self.raft
        if raft is None:
            return Role.FOLLOWER, 0
        term = raft.term  # first: a deposition raises the term before it changes the role
        role = raft.role
        if role is Role.LEADER and raft.led_term != term:
            role = Role.FOLLOWER
        return role, term

    def _leader_view(self) -> tuple[Role, int, Any]:
        """(role, term, leader member or None) that agree with each other: this node is named
        leader exactly when it reports the LEADER role. A term change between the reads (a
        deposition, an election) is re-read; if it keeps moving, no leader is named."""
        me = self.config.self_peer.raft_address
        for _ in range(3):
            role, term = self._role_and_term()
            peer = self.leader_peer()
            if (role is Role.LEADER) == (peer is not None and peer.raft_address == me) and \
                    (self.raft is None or self.raft.term == term):
                return role, term, peer
        return (Role.FOLLOWER if role is Role.LEADER else role), term, None

    def status(self) -> cpb.NodeStatus:
        cfg, raft, coord = self.config, self.raft, self.coordinator
        me = cfg.self_peer
        role, term, peer = self._leader_view()
        st = cpb.NodeStatus(
            node=cpb.NodeInfo(id=me.node_id, client_address=me.client_address, raft_address=me.raft_address),
            role=_ROLE_PB[role] if raft else cpb.ROLE_UNKNOWN,
            term=term,
            commit_index=raft.commit_index if raft else 0,
            last_applied=raft.last_applied if raft else 0,
            leader_id=peer.node_id if peer else "",
            leader_client_address=peer.client_address if peer else "",
            peers=[cpb.PeerState(node=cpb.NodeInfo(id=p.node_id, client_address=p.client_address,
                                                   raft_address=p.raft_address),
                                 connected=bool(raft and raft.is_connected(p.raft_address)))
                   for p in self.other_members],
            uptime_ms=int((time.monotonic() - self.started) * 1000),
            version=__version__,
            schema_version=self.config.schema_version,
            enabled_schema_version=self.machine.schema_version,
            members_version=self.machine.members_version,
            tls=cfg.tls is not None,
            unsafe_no_fsync=cfg.unsafe_no_fsync,
            settings=cpb.QuorumSettings(min_replicas=cfg.options.min_replicas,
                                        join_timeout_ms=cfg.options.join_timeout_ms,
                                        quorum_tick_ms=cfg.quorum_tick_ms,
                                        heartbeat_timeout_ms=cfg.options.heartbeat_timeout_ms,
                                        quorum_lease_ms=cfg.quorum_lease_ms,
                                        liveness_timeout_ms=cfg.liveness_timeout_ms),
        )
        st.ready, st.ready_reason = self.readiness()
        st.jobs.extend(self.job_admin.list_jobs().jobs)
        q = self.machine.quorum
        if q is not None:
            st.has_quorum = True
            st.quorum.CopyFrom(quorum_to_proto(q))
        if coord is not None and coord.term is not None:
            st.serving = coord.serving
            st.quorum_reason = coord.last_reason
            st.rounds_on_lease, st.rounds_committed = coord.rounds_on_lease, coord.rounds_committed
            for rid, age in sorted(coord.heartbeat_ages_ms().items()):
                st.heartbeats.append(cpb.HeartbeatAge(replica_id=rid, age_ms=age))
            for m, waiting in coord.pending():
                st.pending.append(cpb.PendingRequester(member=member_to_proto(m), waiting_ms=waiting))
        return st


async def _bounded(what: str, step: Any, timeout_s: float = STOP_STEP_TIMEOUT_S) -> None:
    """Await one step of a stop for at most ``timeout_s``; one that overruns (or fails) is logged
    and left behind."""
    try:
        await asyncio.wait_for(step, timeout_s)
    except asyncio.TimeoutError:
        log.warning("stopping: %s did not stop within %.0f s; going on without it", what, timeout_s)
    except Exception:  # noqa: BLE001 -- the rest of the node still stops
        log.exception("stopping: %s failed to stop; going on", what)
