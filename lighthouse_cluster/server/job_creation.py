"""Jobs the cluster creates by itself: the jobs declared in ``serve``'s config file, and, with
``--auto-create-jobs``, a job on its first use.

Both go through ``job_admin.JobAdmin.create_if_absent`` on the serving leader: a ``PutJob``
expecting version 0, committed through Raft, so a job that exists is never changed by them and
two creations of one job (two leaders' terms, a ``jobs add`` racing a declaration) make one job.

Declared jobs (``NodeConfig.jobs``, the config file's ``[[jobs]]`` tables; every node is meant to
declare the same ones): each time this node starts serving a term as leader, and once the cluster
has enabled the jobs schema, it creates every declared job the cluster does not have, retrying
(``RETRY_S``) until each is committed or the term ends. A declared job that exists with another
spec is left as it is (``jobs set`` changes it), which is logged at info. A declared job an
operator removed is created again by the next leader's term (declaring it says it should exist).

Auto-creation (``NodeConfig.auto_create_jobs``): ``ensure(name)`` creates an unknown job with
the settings ``jobs add NAME`` would give it (``JobAdmin.new_job_settings``) and returns once it
exists; concurrent first uses of one job share one creation. The router calls it where a call
names a job this leader does not have (``routing.Router``), and the node for a Watch stream.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Protocol

import grpc

from lighthouse_cluster.core.codec import JOBS_SCHEMA_VERSION
from lighthouse_cluster.core.defaults import WATCH_FIRST_MESSAGE_TIMEOUT_S
from lighthouse_cluster.core.jobs import SETTING_NAMES, JobError, JobSettings, JobSpec, check_job_name
from lighthouse_cluster.core.state_machine import QuorumStateMachine
from lighthouse_cluster.server.admin import AdminError

log = logging.getLogger(__name__)

# How often the leader tries again to create declared jobs not committed yet.
RETRY_S = 1.0
# Failures that no retry mends: the job cannot be created as it is.
_PERMANENT = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)


class JobCreation(Protocol):
    """How jobs are created (``job_admin.JobAdmin``)."""

    @property
    def new_job_settings(self) -> JobSettings: ...

    async def create_if_absent(self, spec: JobSpec) -> bool:
        """True when created, False when the job existed; ``AdminError`` when it cannot be."""


def spec_differences(declared: JobSpec, actual: JobSpec) -> list[str]:
    """What differs between a declared spec and the cluster's (``"min_replicas 2 (declared 3)"``)."""
    out: list[str] = []
    if declared.settings is not None and actual.settings is not None:
        for name in SETTING_NAMES:
            have, want = getattr(actual.settings, name), getattr(declared.settings, name)
            if have != want:
                out.append(f"{name} {have} (declared {want})")
    if declared.ports != actual.ports:
        out.append(f"ports {_ports_text(actual)} (declared {_ports_text(declared)})")
    if declared.config != actual.config:
        out.append(f"config {dict(actual.config)} (declared {dict(declared.config)})")
    return out


def _ports_text(spec: JobSpec) -> str:
    return ",".join(f"{n}={p}" for n, p in spec.ports) or "none"


class JobCreator:
    """Creates declared jobs once per term and unknown jobs on first use (module docstring).

    ``serving_term()``: the term this node serves as leader (None when it does not)."""

    def __init__(self, declared: tuple[JobSpec, ...], auto_create: bool, jobs: JobCreation,
                 machine: QuorumStateMachine, serving_term: Callable[[], int | None]) -> None:
        self.declared = declared
        self.auto_create = auto_create
        self._jobs = jobs
        self._machine = machine
        self._serving_term = serving_term
        self._declared_term: int | None = None  # the last term that created every declared job
        self._declared_task: asyncio.Task[None] | None = None
        self._creating: dict[str, asyncio.Future[None]] = {}
        self._tasks: set[asyncio.Future[None]] = set()

    def stop(self) -> None:
        for task in [self._declared_task, *self._creating.values(), *self._tasks]:
            if task is not None and not task.done():
                task.cancel()

    # -- declared jobs ----------------------------------------------------------------------------

    def tick(self) -> None:
        """Start creating the declared jobs when this node serves a term that has not yet (the
        node's watch loop calls this)."""
        if not self.declared:
            return
        term = self._serving_term()
        if term is None or term == self._declared_term or self._machine.schema_version < JOBS_SCHEMA_VERSION:
            return
        if self._declared_task is not None and not self._declared_task.done():
            return
        self._declared_task = asyncio.get_running_loop().create_task(self._create_declared(term))

    @property
    def declared_done(self) -> bool:
        """Whether the declared jobs were all created (or found) in this node's current term."""
        term = self._serving_term()
        return term is not None and term == self._declared_term

    async def _create_declared(self, term: int) -> None:
        pending = list(self.declared)
        while True:
            left: list[JobSpec] = []
            for spec in pending:
                if self._serving_term() != term:
                    return  # the next term this node serves starts over
                try:
                    created = await self._jobs.create_if_absent(spec)
                except AdminError as e:
                    if e.code in _PERMANENT:
                        log.warning("declared job %s cannot be created: %s", spec.name, e.message)
                        continue
                    log.debug("declared job %s not created yet: %s", spec.name, e.message)
                    left.append(spec)
                    continue
                if created:
                    log.info("job %s created as declared in the config file", spec.name)
                else:
                    self._note_existing(spec)
            if not left:
                self._declared_term = term
                return
            pending = left
            await asyncio.sleep(RETRY_S)

    def _note_existing(self, declared: JobSpec) -> None:
        js = self._machine.job(declared.name)
        if js is None:
            return
        differences = spec_differences(declared, js.spec)
        if differences:
            log.info("job %s exists with another spec than declared (version %d kept; `jobs set` changes it): %s",
                     declared.name, js.version, "; ".join(differences))

    # -- auto-creation ----------------------------------------------------------------------------

    async def ensure(self, name: str) -> None:
        """Return once job ``name`` exists, creating it first when auto-creation is on;
        ``AdminError``: it does not exist and cannot be created (now: FAILED_PRECONDITION,
        ABORTED; at all: INVALID_ARGUMENT, RESOURCE_EXHAUSTED, NOT_FOUND with auto-creation off)."""
        if self._machine.job(name) is not None:
            return
        if not self.auto_create:
            raise AdminError(grpc.StatusCode.NOT_FOUND, f"no job {name!r} on this cluster")
        future = self._creating.get(name)
        if future is None:
            future = asyncio.ensure_future(self._create_new(name))
            self._creating[name] = future
            future.add_done_callback(lambda f, n=name: self._created(n, f))
        await asyncio.shield(future)

    def _created(self, name: str, future: asyncio.Future[None]) -> None:
        if self._creating.get(name) is future:
            del self._creating[name]
        if not future.cancelled():
            future.exception()  # retrieved: every waiter got it already

    async def _create_new(self, name: str) -> None:
        try:
            check_job_name(name)
        except JobError as e:
            raise AdminError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        settings = self._jobs.new_job_settings
        if await self._jobs.create_if_absent(JobSpec(name=name, settings=settings)):
            log.warning("job %s created on its first use (--auto-create-jobs): %s", name, settings)

    def ensure_soon(self, name: str, then: Callable[[], None]) -> None:
        """``ensure(name)`` in the background, then ``then()`` when the job exists (a heartbeat of
        an unknown job: recorded once it is created; dropped when it cannot be)."""
        task = asyncio.ensure_future(self._ensure_then(name, then))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _ensure_then(self, name: str, then: Callable[[], None]) -> None:
        try:
            await self.ensure(name)
        except AdminError as e:
            log.debug("heartbeat for job %s dropped: %s", name, e.message)
            return
        then()


class WatchStreams(Protocol):
    """Serves liveness streams (``liveness_streams.LivenessStreams``)."""

    async def serve(self, context: grpc.aio.ServicerContext) -> None: ...


class WatchOfNewJob:
    """A Watch stream naming a job this node does not have, with auto-creation on. On the serving
    leader the job is created, then its streams serve it; on any other node ``refusing`` (the
    default job's streams) ends it as every follower ends a Watch: FAILED_PRECONDITION naming
    the leader, where the client reconnects."""

    def __init__(self, creator: JobCreator, job: str, streams_of: Callable[[str], WatchStreams | None],
                 refusing: WatchStreams, serving_term: Callable[[], int | None]) -> None:
        self._creator = creator
        self._job = job
        self._streams_of = streams_of
        self._refusing = refusing
        self._serving_term = serving_term

    async def serve(self, context: grpc.aio.ServicerContext) -> None:
        if self._serving_term() is None:
            await self._refusing.serve(context)
            return
        try:
            await self._creator.ensure(self._job)
            streams = self._streams_of(self._job)
            if streams is None:
                raise AdminError(grpc.StatusCode.UNAVAILABLE, f"job {self._job!r} is not served here yet; retry")
        except AdminError as e:
            try:
                await asyncio.wait_for(context.read(), WATCH_FIRST_MESSAGE_TIMEOUT_S)
            except asyncio.TimeoutError:
                pass
            await context.abort(e.code, e.message)
        await streams.serve(context)
