"""The dashboard's ``/status.json`` jobs (``client/job_view.py``, ``server/http_endpoints.py``): every
job as plain data, the leader's live view preferred to this node's, and the kill endpoint naming a
job. No processes or sockets: the endpoint's routes are resolved and called on mocked requests."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from lighthouse_cluster.client.job_view import job_json, jobs_view
from lighthouse_cluster.core import codec
from lighthouse_cluster.core.codec import CommitQuorum, EnableSchema, PutJob
from lighthouse_cluster.core.jobs import JobSettings, JobSpec
from lighthouse_cluster.core.quorum import Member, Quorum
from lighthouse_cluster.core.state_machine import QuorumStateMachine
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import torchft_pb2 as pb
from aiohttp.test_utils import make_mocked_request

from lighthouse_cluster.server.http_endpoints import HttpEndpoints

SETTINGS = dict(min_replicas=2, join_timeout_ms=1000, quorum_tick_ms=50, heartbeat_timeout_ms=3000,
                quorum_lease_ms=0, max_replicas=16, max_member_bytes=4096)


def job(name: str, quorum_id: int = 0, leader: bool = False, **fields: Any) -> cpb.Job:
    j = cpb.Job(name=name, settings=cpb.JobSettings(**SETTINGS), version=2, quorum_id=quorum_id, **fields)
    if quorum_id:
        j.has_quorum = True
        j.quorum.CopyFrom(pb.Quorum(quorum_id=quorum_id, participants=[
            pb.QuorumMember(replica_id="r0", address="http://m0:1", store_address="s0", step=7, world_size=2)]))
        j.quorum.created.FromMilliseconds(1_700_000_000_123)
    if leader:
        j.leader_view = True
        j.quorum_reason = "waiting for 2 replicas"
        j.rounds_on_lease, j.rounds_committed = 11, 3
        j.heartbeats.append(cpb.HeartbeatAge(replica_id="r0", age_ms=120))
        j.heartbeating_replicas = 1
        j.pending.append(cpb.PendingRequester(member=pb.QuorumMember(replica_id="r1", step=4), waiting_ms=900))
        j.open_streams = 1
    return j


def test_a_job_as_json() -> None:
    j = job("train-b", quorum_id=5, leader=True, ports=[cpb.JobPort(node_id="*", port=29600)],
            config=[cpb.ConfigEntry(key="dataset", value="c4"), cpb.ConfigEntry(key="lr", value="3e-4")],
            listening_port=29600)
    assert job_json(j) == {
        "name": "train-b", "version": 2, "settings": SETTINGS, "settings_from_flags": False,
        "ports": [{"node_id": "*", "port": 29600}], "listening_port": 29600, "port_error": "",
        "config": {"dataset": "c4", "lr": "3e-4"}, "quorum_id": 5,
        "quorum": {"quorum_id": 5, "created_ms": 1_700_000_000_123, "participants": [
            {"replica_id": "r0", "step": 7, "address": "http://m0:1", "store_address": "s0", "world_size": 2}]},
        "leader_view": True, "quorum_reason": "waiting for 2 replicas", "rounds": {"lease": 11, "commit": 3},
        "heartbeats": [{"replica_id": "r0", "age_ms": 120}], "heartbeating_replicas": 1,
        "pending": [{"replica_id": "r1", "step": 4, "waiting_ms": 900}], "open_streams": 1}
    assert job_json(job("fresh"))["quorum"] is None


def test_the_leaders_view_wins_but_ports_are_this_nodes() -> None:
    own = cpb.ListJobsResponse(answered_by="n2", jobs=[
        job("default", quorum_id=3, listening_port=29510),
        job("train-b", quorum_id=1, listening_port=0, port_error="port 29600 in use")])
    leaders = cpb.ListJobsResponse(answered_by="n1", leader_view=True, jobs=[
        job("default", quorum_id=4, leader=True, listening_port=1),
        job("train-b", quorum_id=1, leader=True, listening_port=29600),
        job("just-added", leader=True, listening_port=29601)])
    view = jobs_view(own, leaders)
    assert view["answered_by"] == "n1" and view["leader_view"] is True
    assert [(j["name"], j["quorum_id"], j["leader_view"], j["listening_port"], j["port_error"]) for j in view["jobs"]] == [
        ("default", 4, True, 29510, ""), ("train-b", 1, True, 0, "port 29600 in use"), ("just-added", 0, True, 0, "")]
    assert view["jobs"][1]["heartbeats"] == [{"replica_id": "r0", "age_ms": 120}]

    # No leader answer, or one that is not the leader's view: this node's own, marked as such.
    for other in (None, cpb.ListJobsResponse(answered_by="n1", jobs=[job("default")])):
        view = jobs_view(own, other)
        assert view["answered_by"] == "n2" and view["leader_view"] is False
        assert [(j["name"], j["quorum_id"], j["leader_view"], j["heartbeats"]) for j in view["jobs"]] == [
            ("default", 3, False, []), ("train-b", 1, False, [])]


class FakeNode:
    """A follower that knows no leader: /status.json from its own answers only."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(node_id="n1", peer_tls=None,
                                      self_peer=SimpleNamespace(client_address="127.0.0.1:1"))
        self.other_members: tuple[Any, ...] = ()
        self.machine = QuorumStateMachine(codec.JOBS_SCHEMA_VERSION)
        self.machine.apply(EnableSchema(version=codec.JOBS_SCHEMA_VERSION))
        spec = JobSpec("train-b", settings=JobSettings(), config=(("lr", "0.1"),))
        assert self.machine.apply(PutJob(spec=spec, expected_version=0)).applied
        q = Quorum(quorum_id=1, participants=(Member(replica_id="g0", address="http://127.0.0.1:9"),), created_ms=1)
        assert self.machine.apply(CommitQuorum(expected_quorum_id=0, quorum=q, term=0, node_id="n1",
                                               job="train-b")).applied
        self.job_admin = SimpleNamespace(list_jobs=lambda: cpb.ListJobsResponse(answered_by="n1", jobs=[
            job("default"), job("train-b", quorum_id=1, config=[cpb.ConfigEntry(key="lr", value="0.1")])]))

    def status(self) -> cpb.NodeStatus:
        return cpb.NodeStatus(node=cpb.NodeInfo(id="n1", client_address="127.0.0.1:1"), role=cpb.FOLLOWER, term=2)

    def readiness(self) -> tuple[bool, str]:
        return False, "no known leader (role follower, term 2)"


def test_status_json_lists_every_job_without_asking_an_unknown_leader() -> None:
    endpoints = HttpEndpoints(FakeNode(), "127.0.0.1:0", admin_token="tok")
    data = asyncio.run(endpoints._build_status())
    assert data["jobs_answered_by"] == "n1"
    assert [(j["name"], j["quorum_id"], j["config"], j["leader_view"]) for j in data["jobs"]] == [
        ("default", 0, {}, False), ("train-b", 1, {"lr": "0.1"}, False)]
    assert data["quorum"] is None and data["self"]["id"] == "n1"  # the default job, as before


def test_kill_names_the_job_of_the_member() -> None:
    endpoints = HttpEndpoints(FakeNode(), "127.0.0.1:0", admin_token="tok")

    def kill(target: str) -> tuple[int, str]:
        async def send() -> Any:
            headers = {"Authorization": "Bearer tok"}
            app = endpoints.server.app
            route = await app.router.resolve(make_mocked_request("POST", target, headers=headers, app=app))
            return await route.handler(make_mocked_request("POST", target, headers=headers, app=app,
                                                           match_info=route))
        response = asyncio.run(send())
        return response.status, response.body.decode()

    # g0 is a member of train-b's quorum, not of the default job's.
    assert kill("/replica/g0/kill") == (404, "replica 'g0' is not a member of the current quorum\n")
    assert kill("/replica/g0/kill?job=nope") == (404, "no job 'nope' on this cluster\n")
    assert kill("/replica/g0/kill?job=default") == (404, "replica 'g0' is not a member of the current quorum\n")
    assert kill("/replica/g9/kill?job=train-b") == (
        404, "replica 'g9' is not a member of the current quorum of job 'train-b'\n")
