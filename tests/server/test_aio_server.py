"""The nodes' gRPC servers accept each call waiting on one request
(docs/design/aio-server-generic-handlers.md).

grpc.aio's accept loop waits, after every call it accepts, on one outstanding request per
registered method plus the generic one; generated ``add_*Servicer_to_server`` code registers
every method of a service. ``aio_server`` serves them through the generic handlers the same code
adds. Here: what the accept loop waits on (grpc.aio calls ``asyncio.wait`` through the module, so
a wrapper sees it), and that every service still answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import lighthouse_cluster_pb2_grpc as cpb_grpc
from lighthouse_cluster.server.aio_server import aio_server
from lighthouse_cluster.server.node import SERVER_OPTIONS

pytestmark = pytest.mark.integration  # real servers on loopback (in this process)


@pytest.fixture
def accept_waits(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many futures each ``asyncio.wait`` in this process waited on, in order."""
    sizes: list[int] = []
    wait = asyncio.wait

    async def counting_wait(fs, *args, **kwargs):  # type: ignore[no-untyped-def]
        fs = list(fs)
        sizes.append(len(fs))
        return await wait(fs, *args, **kwargs)

    monkeypatch.setattr(asyncio, "wait", counting_wait)
    yield sizes


class _Cluster(cpb_grpc.LighthouseClusterServicer):
    async def Leader(self, request: cpb.LeaderRequest, context: grpc.aio.ServicerContext) -> cpb.LeaderResponse:
        return cpb.LeaderResponse(leader_id="n1", term=7)


class _Admin(cpb_grpc.LighthouseAdminServicer):
    async def ListMembers(self, request: cpb.MembersRequest, context: grpc.aio.ServicerContext) -> cpb.MembersResponse:
        return cpb.MembersResponse()


async def _serve_and_call(make_server: Callable[[], grpc.aio.Server]) -> dict[str, object]:
    """Serve the services a node serves (cluster, admin, health, reflection) and call each."""
    server = make_server()
    cpb_grpc.add_LighthouseClusterServicer_to_server(_Cluster(), server)
    cpb_grpc.add_LighthouseAdminServicer_to_server(_Admin(), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    cluster = cpb.DESCRIPTOR.services_by_name["LighthouseCluster"].full_name
    reflection.enable_server_reflection((cluster, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    answers: dict[str, object] = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            leader = await cpb_grpc.LighthouseClusterStub(channel).Leader(cpb.LeaderRequest(), timeout=10)
            answers["leader"] = (leader.leader_id, leader.term)
            check = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            answers["health"] = health_pb2.HealthCheckResponse.ServingStatus.Name(check.status)
            members = await cpb_grpc.LighthouseAdminStub(channel).ListMembers(cpb.MembersRequest(), timeout=10)
            answers["admin"] = type(members).__name__
            stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
            async for reply in stream:
                answers["services"] = sorted(s.name for s in reply.list_services_response.service)
            for _ in range(20):
                await cpb_grpc.LighthouseClusterStub(channel).Leader(cpb.LeaderRequest(), timeout=10)
    finally:
        await server.stop(None)
    return answers


def test_the_accept_loop_waits_on_one_request_per_call(accept_waits: list[int]) -> None:
    answers = asyncio.run(_serve_and_call(lambda: aio_server(SERVER_OPTIONS)))
    assert answers["leader"] == ("n1", 7)
    assert answers["health"] == "SERVING"
    assert answers["admin"] == "MembersResponse"
    assert answers["services"] == sorted(["lighthouse_cluster.LighthouseCluster", reflection.SERVICE_NAME])
    assert len(accept_waits) >= 24, accept_waits  # one per accepted call at least
    assert set(accept_waits) == {1}, accept_waits


def test_a_plain_grpc_aio_server_waits_on_every_registered_method(accept_waits: list[int]) -> None:
    """What ``aio_server`` avoids (and what makes the test above able to fail): a plain server
    with the same services waits on one request per registered method and the generic one."""
    answers = asyncio.run(_serve_and_call(lambda: grpc.aio.server(options=SERVER_OPTIONS)))
    assert answers["leader"] == ("n1", 7)
    registered = (len(cpb.DESCRIPTOR.services_by_name["LighthouseCluster"].methods)
                  + len(cpb.DESCRIPTOR.services_by_name["LighthouseAdmin"].methods)
                  + len(health_pb2.DESCRIPTOR.services_by_name["Health"].methods)
                  + len(reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"].methods))
    if max(accept_waits, default=0) <= 1:
        pytest.skip(f"this gRPC version ({grpc.__version__}) does not wait on registered methods")
    assert max(accept_waits) == registered + 1, (accept_waits, registered)
