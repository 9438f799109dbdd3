"""The node's jobs at run time: one set of quorum rounds, liveness streams and manager connections
per job (``core/jobs.py``), kept in step with the replicated job table.

``JobRegistry.sync`` runs whenever the state machine's job table may have changed (the node's
watch loop, and right after this node committed a job change): a job that appeared gets its
``JobRuntime``; a job whose spec changed gets its settings (the quorum options, the tick, the
lease) updated in place; a removed job's runtime stops: its waiting calls fail (the router answers
NOT_FOUND from then on) and its liveness streams end. Every job's coordinator shares the node's
``LeaderTerm``: the registry starts and stops leadership for all of them together.

The default job's settings are the node's flags (``NodeConfig``), as they always were.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterator, Protocol

from lighthouse_cluster.core.jobs import DEFAULT_JOB, MAX_REPLICAS_LIMIT, JobSettings, JobSpec
from lighthouse_cluster.core.quorum import QuorumOptions
from lighthouse_cluster.core.state_machine import QuorumStateMachine
from lighthouse_cluster.server.config import NodeConfig, PeerSpec
from lighthouse_cluster.server.coordinator import IssuedRound, QuorumCoordinator
from lighthouse_cluster.server.leader_term import LeaderTerm
from lighthouse_cluster.server.liveness_streams import LivenessStreams, RaftLeading
from lighthouse_cluster.server.manager_connections import ManagerConnections

log = logging.getLogger(__name__)


class NodeLeadership(Protocol):
    """What a job's liveness streams read of the node (``LighthouseNode``)."""

    @property
    def raft(self) -> RaftLeading | None: ...

    def leader_peer(self) -> PeerSpec | None: ...


def default_job_settings(config: NodeConfig) -> JobSettings:
    """The default job's settings: the node's flags."""
    o = config.options
    return JobSettings(min_replicas=o.min_replicas, join_timeout_ms=o.join_timeout_ms,
                       quorum_tick_ms=config.quorum_tick_ms, heartbeat_timeout_ms=o.heartbeat_timeout_ms,
                       quorum_lease_ms=config.quorum_lease_ms, max_member_bytes=config.max_member_bytes,
                       max_replicas=MAX_REPLICAS_LIMIT)


def quorum_options(settings: JobSettings) -> QuorumOptions:
    return QuorumOptions(min_replicas=settings.min_replicas, join_timeout_ms=settings.join_timeout_ms,
                         heartbeat_timeout_ms=settings.heartbeat_timeout_ms)


@dataclass(eq=False)
class JobRuntime:
    """One job's leader-side machinery on this node."""

    name: str
    settings: JobSettings
    coordinator: QuorumCoordinator
    liveness: LivenessStreams
    connections: ManagerConnections


class _JobView:
    """A job's view of the node for its liveness streams: the node's Raft and leader, the job's
    coordinator."""

    def __init__(self, node: NodeLeadership, runtime: Callable[[], JobRuntime | None]) -> None:
        self._node = node
        self._runtime = runtime

    @property
    def raft(self) -> RaftLeading | None:
        return self._node.raft

    @property
    def coordinator(self) -> QuorumCoordinator | None:
        rt = self._runtime()
        return rt.coordinator if rt is not None else None

    def leader_peer(self) -> PeerSpec | None:
        return self._node.leader_peer()


class JobRegistry:
    """Every job's runtime on this node (see the module docstring)."""

    def __init__(self, node: NodeLeadership, config: NodeConfig, machine: QuorumStateMachine,
                 submit: Callable[..., Awaitable[Any]], leader: LeaderTerm,
                 on_issue: Callable[[str], Callable[[IssuedRound, float | None], None]] | None = None,
                 on_serving: Callable[[str], None] | None = None) -> None:
        """``on_issue(job)``: the coordinator's ``on_issue`` for ``job``; ``on_serving(job)``:
        called when ``job``'s coordinator starts serving a term."""
        self._node = node
        self._config = config
        self._machine = machine
        self._submit = submit
        self.leader = leader
        self._on_issue = on_issue
        self._on_serving = on_serving
        self._jobs: dict[str, JobRuntime] = {}
        self._synced_version = -1
        self._term: int | None = None
        self._started = False
        self.default_settings = default_job_settings(config)
        self._add(DEFAULT_JOB, self.default_settings)

    # -- lookup -----------------------------------------------------------------------------------

    def get(self, name: str) -> JobRuntime | None:
        return self._jobs.get(name)

    @property
    def default(self) -> JobRuntime:
        return self._jobs[DEFAULT_JOB]

    def __iter__(self) -> Iterator[JobRuntime]:
        """The default job first, then by name."""
        yield self._jobs[DEFAULT_JOB]
        for name in sorted(self._jobs):
            if name != DEFAULT_JOB:
                yield self._jobs[name]

    def __len__(self) -> int:
        return len(self._jobs)

    def spec(self, name: str) -> JobSpec | None:
        js = self._machine.job(name)
        return js.spec if js is not None else None

    def settings_of(self, spec: JobSpec) -> JobSettings:
        return spec.settings if spec.settings is not None else self.default_settings

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        self._started = True
        for rt in self._jobs.values():
            self._start_runtime(rt)
        self.sync()

    def stop(self) -> None:
        self.stop_leading()
        for rt in self._jobs.values():
            rt.liveness.stop()
            rt.connections.stop()
        self._started = False

    def start_leading(self, term: int) -> None:
        self._term = term
        self.leader.start(term)
        for rt in list(self._jobs.values()):
            rt.coordinator.start_leading(term)

    def stop_leading(self) -> None:
        self._term = None
        for rt in self._jobs.values():
            rt.coordinator.stop_leading()
        self.leader.stop()

    def leadership_changed(self) -> None:
        for rt in self._jobs.values():
            rt.liveness.leadership_changed()
            rt.connections.wake()

    # -- keeping up with the job table ------------------------------------------------------------

    def sync(self) -> bool:
        """Create, update and remove runtimes to match the replicated job table; True when
        anything changed."""
        version = self._machine.jobs_version
        if version == self._synced_version:
            return False
        self._synced_version = version
        table = dict(self._machine.jobs)  # one copy: Raft's thread applies changes
        changed = False
        for name in [n for n in self._jobs if n not in table and n != DEFAULT_JOB]:
            self._remove(name)
            changed = True
        for name, js in table.items():
            if name == DEFAULT_JOB:
                continue
            settings = self.settings_of(js.spec)
            rt = self._jobs.get(name)
            if rt is None:
                rt = self._add(name, settings)
                if self._started:
                    self._start_runtime(rt)
                if self._term is not None:
                    rt.coordinator.start_leading(self._term)
                log.info("job %s: serving it (version %d)", name, js.version)
                changed = True
            elif rt.settings != settings:
                self._update(rt, settings)
                changed = True
        return changed

    def _add(self, name: str, settings: JobSettings) -> JobRuntime:
        cfg = self._config
        holder: list[JobRuntime] = []
        report_issue = self._on_issue(name) if self._on_issue is not None else None

        def on_issue(issued: IssuedRound, commit_s: float | None) -> None:
            if holder:
                holder[0].connections.wake()  # a new running quorum to watch
            if report_issue is not None:
                report_issue(issued, commit_s)

        def on_serving() -> None:
            if holder:
                holder[0].connections.wake()
            if self._on_serving is not None:
                self._on_serving(name)

        coordinator = QuorumCoordinator(
            cfg.node_id, quorum_options(settings), settings.quorum_tick_ms, self._machine, self._submit,
            on_issue=on_issue,
            job=name, leader=self.leader, job_lease_ms=None if name == DEFAULT_JOB else settings.quorum_lease_ms)
        liveness = LivenessStreams(_JobView(self._node, lambda: holder[0] if holder else None), cfg.node_id,
                                   cfg.liveness_timeout_ms / 1000.0)
        connections = ManagerConnections(liveness, liveness.declare_dead, liveness.has_stream,
                                         grace_s=cfg.liveness_timeout_ms / 1000.0)
        coordinator.max_replicas, coordinator.max_member_bytes = settings.max_replicas, settings.max_member_bytes
        coordinator.on_serving = on_serving
        rt = JobRuntime(name=name, settings=settings, coordinator=coordinator, liveness=liveness,
                        connections=connections)
        holder.append(rt)
        self._jobs[name] = rt
        return rt

    def _start_runtime(self, rt: JobRuntime) -> None:
        rt.liveness.start()
        if self._config.watch_manager_connections:
            rt.connections.start()

    def _update(self, rt: JobRuntime, settings: JobSettings) -> None:
        rt.settings = settings
        coord = rt.coordinator
        coord.options = quorum_options(settings)
        coord.tick_s = settings.quorum_tick_ms / 1000.0
        coord.job_lease_ms = settings.quorum_lease_ms
        coord.max_replicas, coord.max_member_bytes = settings.max_replicas, settings.max_member_bytes
        log.info("job %s: settings now %s", rt.name, settings)

    def _remove(self, name: str) -> None:
        rt = self._jobs.pop(name)
        rt.coordinator.stop_leading()
        rt.liveness.stop()
        rt.connections.stop()
        self.leader.forget(rt.coordinator.stop_leading)
        log.info("job %s: removed", name)
