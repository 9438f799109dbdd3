"""Jobs as the operator and trainers see them: the ``Job`` views, and the job admin calls.

Reads (``LighthouseCluster.ListJobs`` / ``GetJob``, no token) answer from this node's replicated
state: every node knows every job's spec and last committed quorum; the serving leader adds its
live view (heartbeats, pending requesters, the reason of the last evaluation, liveness streams).

Changes (``LighthouseAdmin.AddJob`` / ``SetJob`` / ``RemoveJob``, admin token, on the leader) are
``PutJob`` / ``RemoveJob`` commands committed through Raft (compare-and-set on the job's version),
and only once the cluster has enabled the jobs schema (every node runs a version with jobs; during
a rolling upgrade they are refused with the reason). A job is added with the leader's default-job
settings unless given others; the default job's settings stay the nodes' flags (only its config
can be set); a job is removed only while none of its replicas heartbeats, unless forced.
``create_if_absent`` is the same creation for the jobs the cluster creates itself (declared in
the config file, or auto-created on first use; ``job_creation.py``): it never changes a job that
exists.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any, Awaitable, Callable, Mapping, Protocol

import grpc

from lighthouse_cluster.core import codec
from lighthouse_cluster.core.codec import PutJob, RemoveJob
from lighthouse_cluster.core.jobs import (
    DEFAULT_JOB,
    MAX_JOBS,
    SETTING_NAMES,
    JobError,
    JobSettings,
    JobSpec,
    check_job_name,
    port_conflict,
    reserved_port_clash,
)
from lighthouse_cluster.core.state_machine import JobResult, JobState, QuorumStateMachine
from lighthouse_cluster.core.torchft_wire import member_to_proto, quorum_to_proto
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.server.admin import AdminError
from lighthouse_cluster.server.job_registry import JobRegistry, JobRuntime

log = logging.getLogger(__name__)


class PortStates(Protocol):
    """This node's own port for a job (``job_ports.JobPorts``)."""

    def state(self, job: str) -> tuple[int, str]:
        """(the port it listens on for ``job`` or 0, why it cannot when it should)."""


def settings_proto(s: JobSettings) -> cpb.JobSettings:
    return cpb.JobSettings(**s.as_dict())


def settings_changes(update: cpb.JobSettingsUpdate) -> dict[str, int]:
    """The fields set in a ``JobSettingsUpdate``."""
    return {name: getattr(update, name) for name in SETTING_NAMES if update.HasField(name)}


def ports_of(entries: Any) -> tuple[tuple[str, int], ...]:
    return tuple(sorted((p.node_id or "*", int(p.port)) for p in entries))


def live_view(job: cpb.Job, rt: JobRuntime) -> None:
    """Add the serving leader's view of ``rt``'s job to ``job``."""
    coord = rt.coordinator
    if coord.term is None or not coord.serving:
        return
    job.leader_view = True
    job.quorum_reason = coord.last_reason
    job.rounds_on_lease, job.rounds_committed = coord.rounds_on_lease, coord.rounds_committed
    timeout_ms = coord.options.heartbeat_timeout_ms
    for rid, age in sorted(coord.heartbeat_ages_ms().items()):
        job.heartbeats.append(cpb.HeartbeatAge(replica_id=rid, age_ms=age))
        job.heartbeating_replicas += age < timeout_ms
    for m, waiting in coord.pending():
        job.pending.append(cpb.PendingRequester(member=member_to_proto(m), waiting_ms=waiting))
    job.open_streams = rt.liveness.open_streams


class JobAdmin:
    """Job views and job changes on one node (see the module docstring)."""

    def __init__(self, node_id: str, machine: QuorumStateMachine, registry: JobRegistry,
                 require_leader: Callable[[str], None], commit: Callable[[codec.Command], Awaitable[Any]],
                 ports: PortStates | None = None,
                 reserved_ports: Mapping[str, Mapping[int, str]] | None = None) -> None:
        self.node_id = node_id
        self.machine = machine
        self.registry = registry
        self._require_leader = require_leader
        self._commit = commit
        self.ports = ports
        # Each node's own ports (NodeConfig.reserved_ports), refused as a job's.
        self.reserved_ports = reserved_ports or {}
        self._lock = asyncio.Lock()

    # -- views ------------------------------------------------------------------------------------

    def job_proto(self, name: str, js: JobState, live: bool = True) -> cpb.Job:
        spec = js.spec
        job = cpb.Job(name=name, settings=settings_proto(self.registry.settings_of(spec)),
                      settings_from_flags=spec.settings is None, version=js.version, quorum_id=js.quorum_id,
                      ports=[cpb.JobPort(node_id=n, port=p) for n, p in spec.ports],
                      config=[cpb.ConfigEntry(key=k, value=v) for k, v in spec.config])
        if js.quorum is not None:
            job.has_quorum = True
            job.quorum.CopyFrom(quorum_to_proto(js.quorum))
        if self.ports is not None:
            job.listening_port, job.port_error = self.ports.state(name)
        rt = self.registry.get(name)
        if live and rt is not None:
            live_view(job, rt)
        return job

    def list_jobs(self) -> cpb.ListJobsResponse:
        jobs = dict(self.machine.jobs)  # one copy: Raft's thread applies changes
        names = [DEFAULT_JOB] + sorted(n for n in jobs if n != DEFAULT_JOB)
        out = cpb.ListJobsResponse(answered_by=self.node_id,
                                   jobs=[self.job_proto(n, jobs[n]) for n in names if n in jobs])
        out.leader_view = any(j.leader_view for j in out.jobs)
        return out

    def get_job(self, name: str) -> cpb.Job:
        js = self.machine.job(name)
        if js is None:
            raise AdminError(grpc.StatusCode.NOT_FOUND, f"no job {name!r} on this cluster "
                             f"(jobs: {', '.join(sorted(self.machine.jobs))})")
        return self.job_proto(name, js)

    # -- changes ----------------------------------------------------------------------------------

    def _require_jobs_schema(self) -> None:
        enabled = self.machine.schema_version
        if enabled < codec.JOBS_SCHEMA_VERSION:
            raise AdminError(grpc.StatusCode.FAILED_PRECONDITION,
                             f"jobs need replicated schema {codec.JOBS_SCHEMA_VERSION}, the cluster has {enabled} "
                             "enabled: every node must run a version with jobs first (a rolling upgrade is "
                             "in progress; `lighthouse-cluster status` shows it)")

    async def _put(self, spec: JobSpec, expected_version: int) -> cpb.Job:
        try:
            spec.check()
        except JobError as e:
            raise AdminError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        reserved = reserved_port_clash(spec, self.reserved_ports)
        if reserved is not None:
            raise AdminError(grpc.StatusCode.INVALID_ARGUMENT, f"job {spec.name!r}: {reserved}")
        jobs = dict(self.machine.jobs)  # one copy: Raft's thread applies changes
        clash = port_conflict(spec, (j.spec for j in jobs.values()))
        if clash is not None:
            raise AdminError(grpc.StatusCode.ALREADY_EXISTS, clash)
        if expected_version == 0 and len(jobs) >= MAX_JOBS:
            raise AdminError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"job {spec.name!r} not created: the cluster has {len(jobs)} jobs, its limit "
                             "(remove one first)")
        result = await self._commit(PutJob(spec=spec, expected_version=expected_version))
        if not isinstance(result, JobResult) or not result.applied:
            reason = getattr(result, "reason", "not applied")
            raise AdminError(grpc.StatusCode.ABORTED, f"job {spec.name!r} not changed: {reason}; retry")
        self.registry.sync()
        js = self.machine.job(spec.name)
        assert js is not None
        return self.job_proto(spec.name, js)

    @property
    def new_job_settings(self) -> JobSettings:
        """What a new job's settings are unless it is given others: the default job's (this
        node's flags), with ``JobSettings``' own limit on replica groups (as
        ``NodeConfig.new_job_settings``)."""
        return replace(self.registry.default_settings, max_replicas=JobSettings().max_replicas)

    async def create_if_absent(self, spec: JobSpec) -> bool:
        """Create ``spec``'s job unless the cluster has it (a declared or auto-created job):
        True when this call created it, False when it existed (it is left as it is).
        ``AdminError`` when it cannot be created now (not the serving leader, jobs schema not
        enabled, not committed) or at all (the job limit)."""
        if self.machine.job(spec.name) is not None:
            return False
        async with self._lock:
            self._require_leader(f"creating job {spec.name}")
            self._require_jobs_schema()
            if self.machine.job(spec.name) is not None:
                return False
            try:
                await self._put(spec, 0)
            except AdminError:
                if self.machine.job(spec.name) is not None:
                    return False  # created meanwhile (the version check refused ours)
                raise
        return True

    async def add_job(self, request: cpb.AddJobRequest) -> cpb.Job:
        name = request.name
        try:
            check_job_name(name)
            settings = self.new_job_settings.updated(settings_changes(request.settings))
            spec = JobSpec(name=name, settings=settings, ports=ports_of(request.ports),
                           config=tuple(sorted((c.key, c.value) for c in request.config)))
            spec.check()
        except JobError as e:
            raise AdminError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        async with self._lock:
            self._require_leader("jobs add")
            self._require_jobs_schema()
            if self.machine.job(name) is not None:
                raise AdminError(grpc.StatusCode.ALREADY_EXISTS,
                                 f"job {name!r} exists already (jobs set {name} ... changes it)")
            job = await self._put(spec, 0)
        log.warning("job %s added: %s", name, settings)
        return job

    async def set_job(self, request: cpb.SetJobRequest) -> cpb.Job:
        name = request.name
        async with self._lock:
            self._require_leader("jobs set")
            self._require_jobs_schema()
            js = self.machine.job(name)
            if js is None:
                raise AdminError(grpc.StatusCode.NOT_FOUND, f"no job {name!r} (jobs add {name} creates it)")
            spec = js.spec
            changes = settings_changes(request.settings)
            try:
                if changes or request.set_ports:
                    if name == DEFAULT_JOB:
                        raise JobError(f"the {DEFAULT_JOB} job's settings and port are the nodes' own "
                                       "(serve --min_replicas ... --client-bind); only its config can be set")
                    assert spec.settings is not None
                    spec = replace(spec, settings=spec.settings.updated(changes))
                    if request.set_ports:
                        spec = replace(spec, ports=ports_of(request.ports))
                spec = spec.with_config({c.key: c.value for c in request.set_config}, request.unset_config)
            except JobError as e:
                raise AdminError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
            if spec == js.spec:
                return self.job_proto(name, js)
            job = await self._put(spec, js.version)
        log.warning("job %s changed (version %d)", name, job.version)
        return job

    async def remove_job(self, request: cpb.RemoveJobRequest) -> cpb.RemoveJobResponse:
        name = request.name
        async with self._lock:
            self._require_leader("jobs remove")
            self._require_jobs_schema()
            js = self.machine.job(name)
            if js is None:
                raise AdminError(grpc.StatusCode.NOT_FOUND, f"no job {name!r}")
            if name == DEFAULT_JOB:
                raise AdminError(grpc.StatusCode.INVALID_ARGUMENT, f"the {DEFAULT_JOB} job cannot be removed")
            rt = self.registry.get(name)
            if rt is not None and not request.force:
                view = cpb.Job()
                live_view(view, rt)
                active = sorted({h.replica_id for h in view.heartbeats if h.age_ms
                                 < rt.coordinator.options.heartbeat_timeout_ms} | {p.member.replica_id for p in view.pending})
                if active or view.open_streams:
                    shown = ", ".join(active[:5]) + (", ..." if len(active) > 5 else "")
                    raise AdminError(grpc.StatusCode.FAILED_PRECONDITION,
                                     f"job {name!r} has {max(len(active), view.open_streams)} live replica groups "
                                     f"({shown or 'liveness streams open'}): stop its trainers first, or pass --force")
            last = js.quorum_id
            result = await self._commit(RemoveJob(name=name, expected_version=js.version))
            if not isinstance(result, JobResult) or not result.applied:
                raise AdminError(grpc.StatusCode.ABORTED,
                                 f"job {name!r} not removed: {getattr(result, 'reason', 'not applied')}; retry")
            self.registry.sync()
        log.warning("job %s removed (last quorum id %d)", name, last)
        return cpb.RemoveJobResponse(name=name, last_quorum_id=last)
