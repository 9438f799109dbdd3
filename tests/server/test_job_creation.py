"""Jobs the cluster creates by itself (``server/job_creation.py``, ``JobAdmin.create_if_absent``):
declared jobs once per leader term, never overwriting one that exists; auto-created jobs once
however many first uses race. Unit tests: a real state machine and job registry, commits applied
in this process; no servers (the real-process tests are in test_job_ports.py)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any

import grpc
import pytest

from lighthouse_cluster.core.codec import JOBS_SCHEMA_VERSION, Command, EnableSchema, PutJob
from lighthouse_cluster.core.jobs import MAX_JOBS, JobSettings, JobSpec
from lighthouse_cluster.core.lease import LeaseSettings
from lighthouse_cluster.core.state_machine import QuorumStateMachine
from lighthouse_cluster.server.admin import AdminError
from lighthouse_cluster.server.config import build_node_config
from lighthouse_cluster.server.job_admin import JobAdmin
from lighthouse_cluster.server.job_creation import JobCreator, spec_differences
from lighthouse_cluster.server.job_registry import JobRegistry
from lighthouse_cluster.server.leader_term import LeaderTerm

PEERS = ["n1=127.0.0.1:7001,127.0.0.1:8001", "n2=127.0.0.1:7002,127.0.0.1:8002", "n3=127.0.0.1:7003,127.0.0.1:8003"]


def config(**extra: Any):
    return build_node_config(node_id="n1", peers=PEERS, client_bind=None, raft_bind=None, data_dir=None,
                             secret="x", insecure=False, min_replicas=2, join_timeout_ms=700, quorum_tick_ms=30,
                             heartbeat_timeout_ms=900, **extra)


class _Node:
    raft = None

    def leader_peer(self) -> None:
        return None


class Cluster:
    """One node's job admin over a real state machine; commits are applied after ``delay_s``,
    ``refuse`` makes the next commits fail as an unserved leader's would."""

    def __init__(self, cfg: Any = None, schema: int = JOBS_SCHEMA_VERSION) -> None:
        self.config = cfg or config()
        self.machine = QuorumStateMachine()
        self.machine.apply(EnableSchema(version=schema))
        self.machine.schema_version = schema
        self.commits: list[Command] = []
        self.delay_s = 0.0
        self.leading = True
        self.term: int | None = 5

        async def submit(command: Command, while_leader_of: int | None = None) -> Any:
            return self.machine.apply(command)

        leader = LeaderTerm("n1", self.machine, submit, lease=LeaseSettings(lease_ms=0))
        self.registry = JobRegistry(_Node(), self.config, self.machine, submit, leader)
        self.admin = JobAdmin("n1", self.machine, self.registry, self.require_leader, self.commit)

    def require_leader(self, what: str) -> None:
        if not self.leading:
            raise AdminError(grpc.StatusCode.FAILED_PRECONDITION, f"{what} must run on the leader")

    async def commit(self, command: Command) -> Any:
        self.commits.append(command)
        await asyncio.sleep(self.delay_s)
        return self.machine.apply(command)

    def creator(self, declared: tuple[JobSpec, ...] = (), auto_create: bool = False) -> JobCreator:
        return JobCreator(declared, auto_create, self.admin, self.machine, lambda: self.term if self.leading else None)

    def puts(self) -> list[str]:
        return [c.spec.name for c in self.commits if isinstance(c, PutJob)]


async def wait_until(cond: Any, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def test_new_job_settings_are_what_jobs_add_gives() -> None:
    c = Cluster()
    assert c.config.new_job_settings == c.admin.new_job_settings
    assert c.admin.new_job_settings == JobSettings(min_replicas=2, join_timeout_ms=700, quorum_tick_ms=30,
                                                   heartbeat_timeout_ms=900, quorum_lease_ms=c.config.quorum_lease_ms)


def test_create_if_absent_creates_once_and_never_changes_an_existing_job() -> None:
    c = Cluster()
    spec = JobSpec("a", settings=c.admin.new_job_settings, ports=(("*", 29600),), config=(("lr", "0.1"),))

    async def run() -> None:
        assert await c.admin.create_if_absent(spec) is True
        other = replace(spec, settings=replace(spec.settings, min_replicas=7))
        assert await c.admin.create_if_absent(other) is False
    asyncio.run(run())
    js = c.machine.job("a")
    assert js is not None and js.spec == spec and js.version == 1
    assert c.registry.get("a") is not None  # served at once
    assert c.puts() == ["a"]


def test_create_if_absent_is_refused_with_a_reason_off_the_leader_before_the_schema_and_past_the_limit() -> None:
    spec = lambda name: JobSpec(name, settings=JobSettings())  # noqa: E731
    c = Cluster()
    c.leading = False
    with pytest.raises(AdminError) as e:
        asyncio.run(c.admin.create_if_absent(spec("a")))
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    old = Cluster(schema=JOBS_SCHEMA_VERSION - 1)
    with pytest.raises(AdminError) as e:
        asyncio.run(old.admin.create_if_absent(spec("a")))
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "schema" in e.value.message
    full = Cluster()
    for i in range(MAX_JOBS - 1):
        full.machine.apply(PutJob(spec=spec(f"j{i}"), expected_version=0))
    full.commits.clear()
    with pytest.raises(AdminError) as e:
        asyncio.run(full.admin.create_if_absent(spec("one-too-many")))
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and str(MAX_JOBS) in e.value.message
    assert full.commits == []  # refused before anything is written to the log


def test_concurrent_first_uses_create_the_job_once() -> None:
    c = Cluster()
    c.delay_s = 0.05
    creator = c.creator(auto_create=True)

    async def run() -> None:
        await asyncio.gather(*(creator.ensure("new-job") for _ in range(20)))
    asyncio.run(run())
    assert c.puts() == ["new-job"]
    js = c.machine.job("new-job")
    assert js is not None and js.spec.settings == c.admin.new_job_settings and js.spec.ports == ()


def test_auto_creation_off_or_a_bad_name_is_an_error_and_writes_nothing() -> None:
    c = Cluster()
    with pytest.raises(AdminError) as e:
        asyncio.run(c.creator(auto_create=False).ensure("unknown"))
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(AdminError) as e:
        asyncio.run(c.creator(auto_create=True).ensure("no spaces allowed"))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "job name" in e.value.message
    assert c.commits == []


def test_a_heartbeat_of_an_unknown_job_is_recorded_once_the_job_exists() -> None:
    c = Cluster()
    creator = c.creator(auto_create=True)
    seen: list[bool] = []

    async def run() -> None:
        creator.ensure_soon("hb-job", lambda: seen.append(c.machine.job("hb-job") is not None))
        creator.ensure_soon("bad name", lambda: seen.append(False))
        await wait_until(lambda: seen)
        await asyncio.sleep(0.05)
    asyncio.run(run())
    assert seen == [True]


def test_declared_jobs_are_created_once_per_term_and_existing_ones_kept(caplog: pytest.LogCaptureFixture) -> None:
    c = Cluster()
    base = c.admin.new_job_settings
    a = JobSpec("a", settings=base, ports=(("n1", 29601), ("n2", 29602)))
    b = JobSpec("b", settings=replace(base, min_replicas=3), config=(("k", "v"),))
    c.machine.apply(PutJob(spec=replace(b, settings=replace(base, min_replicas=5)), expected_version=0))
    creator = c.creator(declared=(a, b))

    async def run() -> None:
        c.leading = False
        creator.tick()
        await asyncio.sleep(0.05)
        assert c.puts() == []  # only the serving leader creates them
        c.leading = True
        with caplog.at_level(logging.INFO, logger="lighthouse_cluster.server.job_creation"):
            creator.tick()
            await wait_until(lambda: creator.declared_done)
        creator.tick()
        await asyncio.sleep(0.05)
    asyncio.run(run())
    assert c.puts() == ["a"]  # once, and b (existing) untouched
    assert c.machine.job("a").spec == a
    assert c.machine.job("b").spec.settings.min_replicas == 5
    assert any("job b exists with another spec than declared" in r.message and "min_replicas 5 (declared 3)"
               in r.message for r in caplog.records), caplog.text


def test_declared_jobs_retry_until_committed_and_a_new_term_declares_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("lighthouse_cluster.server.job_creation.RETRY_S", 0.02)
    c = Cluster()
    spec = JobSpec("a", settings=c.admin.new_job_settings)
    failures = [AdminError(grpc.StatusCode.ABORTED, "not committed")] * 3
    real_commit = c.commit

    async def flaky(command: Command) -> Any:
        if failures:
            c.commits.append(command)
            raise failures.pop()
        return await real_commit(command)
    c.admin._commit = flaky
    creator = c.creator(declared=(spec,))

    async def run() -> None:
        creator.tick()
        await wait_until(lambda: creator.declared_done)
        assert c.machine.job("a") is not None
        # An operator removes it; the next term this node serves creates it again.
        from lighthouse_cluster.core.codec import RemoveJob
        c.machine.apply(RemoveJob(name="a", expected_version=c.machine.job("a").version))
        creator.tick()
        await asyncio.sleep(0.05)
        assert c.machine.job("a") is None
        c.term = 6
        creator.tick()
        await wait_until(lambda: creator.declared_done)
    asyncio.run(run())
    assert c.machine.job("a") is not None
    assert c.puts() == ["a"] * 5  # 3 failed, then one per term


def test_spec_differences_name_each_field() -> None:
    s = JobSettings()
    a = JobSpec("a", settings=s, ports=(("*", 1),), config=(("k", "v"),))
    assert spec_differences(a, a) == []
    b = JobSpec("a", settings=replace(s, join_timeout_ms=5), ports=(("n1", 2),))
    assert spec_differences(a, b) == [f"join_timeout_ms 5 (declared {s.join_timeout_ms})",
                                      "ports n1=2 (declared *=1)", "config {} (declared {'k': 'v'})"]


# -- routing a first use: the job exists before this node serves it -------------------------------

class _LeadingRaft:
    is_leader = True

    def note_client_activity(self) -> None:
        pass


class _Coordinator:
    term = 5

    def request(self, member: Any, timeout: float | None) -> "asyncio.Future[bytes]":
        answered: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        answered.set_result(b"answered")
        return answered


class _RouterNode:
    def __init__(self) -> None:
        self.raft = _LeadingRaft()
        self.coordinators: dict[str, _Coordinator] = {}

    def job_coordinator(self, job: str) -> _Coordinator | None:
        return self.coordinators.get(job)

    def leader_peer(self) -> None:
        return None


class _JobExists:
    """Auto-creation that finds the job in the state machine (applied on Raft's thread) at once."""

    async def ensure(self, job: str) -> None:
        return None

    def ensure_soon(self, job: str, then: Any) -> None:
        then()


class _Context:
    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise AssertionError(f"the call ended {code.name}: {details}")


def test_a_call_for_a_job_that_exists_before_its_coordinator_waits_for_the_registry() -> None:
    """CI: a first-use Quorum call ended CANCELLED "Timeout expired" after its 20 s. The job had
    been applied (Raft's thread) but the registry had not built its coordinator (it does on the
    event loop); ``ensure`` returned without suspending, so the call's loop spun on the event loop
    until its deadline, and the registry's sync could never run."""
    from lighthouse_cluster.core.quorum import Member
    from lighthouse_cluster.server.routing import Router

    async def run() -> bytes:
        node = _RouterNode()
        router = Router(node, None, "n1", 65536)  # type: ignore[arg-type]
        router.creator = _JobExists()
        # The registry's sync, next on the event loop.
        asyncio.get_running_loop().call_soon(lambda: node.coordinators.__setitem__("fresh", _Coordinator()))
        return await router.route_quorum(Member("r0"), b"", 2.0, None, _Context(), job="fresh")  # type: ignore[arg-type]

    assert asyncio.run(asyncio.wait_for(run(), 5.0)) == b"answered"
