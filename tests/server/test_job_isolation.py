"""Issue 17 item 5: one job's bad input never touches another job's quorums, and a job's limits
(members, member size) fail a call with a clear error.

A real 3-node cluster on loopback, simulated replica groups of two jobs. One job's load beside
another's is the benchmark's isolation section (``python -m benchmarks run --sections isolation``;
the --quick run of tests/bench/test_bench.py checks it at small sizes).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import grpc
import pytest

from lighthouse_cluster.local.simulated_group import SimulatedReplicaGroup
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import lighthouse_cluster_pb2_grpc as cpb_grpc
from lighthouse_cluster.server.admin import token_metadata

pytestmark = pytest.mark.integration

TOKEN = "isolation-test"


def _add_job(address: str, name: str, **settings: int) -> cpb.Job:
    stub = cpb_grpc.LighthouseAdminStub(grpc.insecure_channel(address))
    return stub.AddJob(cpb.AddJobRequest(name=name, settings=cpb.JobSettingsUpdate(**settings)),
                       metadata=token_metadata(TOKEN), timeout=10)


def test_job_limits_fail_calls_clearly_and_leave_other_jobs_alone(make_cluster: Callable[..., Any]) -> None:
    cluster = make_cluster(min_replicas=1, admin_token=TOKEN)
    leader, _ = cluster.wait_for_stable_leader(timeout=30)
    addresses = cluster.client_addresses
    follower = addresses[(leader + 1) % 3]
    _add_job(addresses[leader], "small", min_replicas=2, max_replicas=2, max_member_bytes=512)
    _add_job(addresses[leader], "other", min_replicas=1, join_timeout_ms=200)

    async def run() -> None:
        groups: list[SimulatedReplicaGroup] = []
        beating: list[asyncio.Task[None]] = []

        def group(rid: str, job: str, **kw: Any) -> SimulatedReplicaGroup:
            g = SimulatedReplicaGroup(rid, follower, job=job, quorum_timeout_s=10, **kw)
            groups.append(g)
            return g

        try:
            a, b = group("a", "small"), group("b", "small")
            # Heartbeating, as a trainer's manager does: a and b stay live members of the job.
            beating += [asyncio.get_running_loop().create_task(g.heartbeat_loop()) for g in (a, b)]
            qa, qb = await asyncio.gather(a.call_quorum(), b.call_quorum())
            assert {m.replica_id for m in qa.participants} == {"a", "b"} == {m.replica_id for m in qb.participants}
            # A third replica group while two are live: over max_replicas, refused at once.
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await group("c", "small").call_quorum()
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert e.value.details() == "job small has 2 replica groups, its limit (max_replicas) is 2"
            # A member over the job's size limit (the node's own limit is 64 KiB).
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await group("a", "small", data="x" * 600).call_quorum()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "job small's limit on a member is 512 (max_member_bytes)" in (e.value.details() or "")
            # Another job is untouched by both: same replica ids, its own quorum.
            qo = await group("c", "other", data="x" * 600).call_quorum()
            assert [m.replica_id for m in qo.participants] == ["c"]
            # And job "small" still serves its live members.
            qa2, qb2 = await asyncio.gather(a.call_quorum(), b.call_quorum())
            assert qa2.quorum_id == qb2.quorum_id >= qa.quorum_id
        finally:
            for t in beating:
                t.cancel()
            await asyncio.gather(*beating, return_exceptions=True)
            for g in groups:
                await g.close()

    asyncio.run(run())
