"""Observability, end to end on real node processes: the HTTP port (/metrics, /livez, /readyz,
/status.json, the dashboard, the kill endpoint), gRPC health checking and reflection.

Every wait polls against a deadline; clusters come from the ``make_cluster`` fixture, which
kills every node process when the test ends.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from support.job_admin import add_job
from support.waiting import wait_for
from lighthouse_cluster.core.jobs import JOB_HEADER
from lighthouse_cluster.server.config import ConfigError, build_node_config
from lighthouse_cluster.local.cluster import LocalCluster, free_ports
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import lighthouse_cluster_pb2_grpc as cpb_grpc
from lighthouse_cluster.proto import torchft_pb2 as pb
from lighthouse_cluster.proto import torchft_pb2_grpc as pb_grpc
from lighthouse_cluster.local.simulated_group import SimulatedReplicaGroup

pytestmark = pytest.mark.integration

TOKEN = "test-admin-token-3f9c"
ROLE_NAMES = {cpb.FOLLOWER: "follower", cpb.CANDIDATE: "candidate", cpb.LEADER: "leader"}


# -- helpers ----------------------------------------------------------------------------------------


def http(cluster: LocalCluster, i: int, path: str, method: str = "GET",
         headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
    req = urllib.request.Request(f"http://{cluster.http_address(i)}{path}", method=method, headers=headers or {},
                                 data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def metrics(cluster: LocalCluster, i: int) -> dict[str, list[Any]]:
    status, body, headers = http(cluster, i, "/metrics")
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain")
    return {f.name: f.samples for f in text_string_to_metric_families(body.decode())}


def per_job(families: dict[str, list[Any]], family: str, name: str | None = None, **labels: str) -> dict[str, float]:
    """{job: value} of one per-job series."""
    return {s.labels["job"]: s.value for s in families[family]
            if s.name == (name or family) and all(s.labels.get(k) == v for k, v in labels.items())}


def sample(families: dict[str, list[Any]], family: str, name: str | None = None, **labels: str) -> float:
    for s in families[family]:
        if s.name == (name or family) and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError(f"{name or family} {labels}")


def health(cluster: LocalCluster, i: int, service: str = "") -> int:
    with grpc.insecure_channel(cluster.members[i].peer.client_address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status


def formed(cluster: LocalCluster) -> list[cpb.NodeStatus] | None:
    sts = [cluster.status(i) for i in range(cluster.nodes)]
    if any(st is None for st in sts):
        return None
    leaders = [st for st in sts if st.role == cpb.LEADER and st.serving]
    if len(leaders) != 1 or any(st.leader_id != leaders[0].node.id or st.term != leaders[0].term for st in sts):
        return None
    return sts


def run_rounds(cluster: LocalCluster, groups: int, rounds: int, job: str | None = None, prefix: str = "g") -> None:
    async def main() -> None:
        # Groups stop together once each has ``rounds`` quorums; a call sent just before the
        # others stopped waits for them until its timeout, so late failures are expected.
        sims = [SimulatedReplicaGroup(f"{prefix}{k}", cluster.client_addresses[k % cluster.nodes], quorum_timeout_s=2.0,
                                      job=job) for k in range(groups)]

        def ok(s: SimulatedReplicaGroup) -> int:
            return sum(1 for r in s.rounds if not r.error)

        def done() -> bool:
            return all(ok(s) >= rounds for s in sims)

        try:
            await asyncio.wait_for(asyncio.gather(*(s.run(until=done) for s in sims)), 60)
        finally:
            for s in sims:
                await s.close()
        assert done(), [s.rounds for s in sims]

    asyncio.run(main())


@pytest.fixture
def observed(make_cluster: Callable[..., LocalCluster]) -> Callable[..., LocalCluster]:
    def make(**kwargs: Any) -> LocalCluster:
        nodes = kwargs.get("nodes", 3)
        cluster = make_cluster(http_ports=free_ports(nodes), **kwargs)
        cluster.wait_for_leader(timeout=20)
        wait_for("a formed cluster", lambda: formed(cluster), 15.0, context=cluster, interval=0.05, retry_on=(OSError,))
        return cluster

    return make


# -- tests ------------------------------------------------------------------------------------------


def test_metrics_probes_health_and_reflection_on_a_formed_cluster(observed) -> None:
    cluster = observed()
    for i in range(3):
        wait_for(f"n{i + 1} /readyz 200", lambda i=i: http(cluster, i, "/readyz")[0] == 200, 15.0,
                 context=cluster, interval=0.05, retry_on=(OSError,))
        assert http(cluster, i, "/livez")[:2] == (200, b"ok\n")
        wait_for(f"n{i + 1} health SERVING", lambda i=i: health(cluster, i) == health_pb2.HealthCheckResponse.SERVING,
                 15.0, context=cluster, interval=0.05, retry_on=(OSError,))
        assert health(cluster, i, "torchft.LighthouseService") == health_pb2.HealthCheckResponse.SERVING

    run_rounds(cluster, groups=2, rounds=4)

    def consistent() -> bool:
        for i in range(3):
            st, fam = cluster.status(i), metrics(cluster, i)
            if st is None or not st.has_quorum:
                return False
            role = ROLE_NAMES[st.role]
            if sample(fam, "lighthouse_cluster_role", node=st.node.id, role=role) != 1.0:
                return False
            if sample(fam, "lighthouse_cluster_term") != st.term:
                return False
            if sample(fam, "lighthouse_cluster_quorum_id") != st.quorum.quorum_id:
                return False
            if sample(fam, "lighthouse_cluster_quorum_participants") != len(st.quorum.participants):
                return False
        return True

    wait_for("/metrics consistent with Status on every node", consistent, 15.0, context=cluster, interval=0.05,
             retry_on=(OSError,))
    leader = cluster.leader_index()
    assert leader is not None
    fam = metrics(cluster, leader)
    # 4 rounds of 2 groups: 4 quorums issued, each either committed through Raft (its commit
    # time observed) or, a fast round, on the leader lease.
    committed = sample(fam, "lighthouse_cluster_quorum_commit_seconds", "lighthouse_cluster_quorum_commit_seconds_count")
    assert committed >= 1  # the first quorum is a new member set
    assert sample(fam, "lighthouse_cluster_quorum_rounds", "lighthouse_cluster_quorum_rounds_total",
                  path="commit") == committed
    assert committed + sample(fam, "lighthouse_cluster_quorum_rounds", "lighthouse_cluster_quorum_rounds_total",
                              path="lease") >= 4
    # The TermStart and each committed quorum (and the lease's announcement, a ConfirmLeadership).
    assert sample(fam, "lighthouse_cluster_raft_write_seconds", "lighthouse_cluster_raft_write_seconds_count",
                  outcome="ok") >= 1 + committed
    assert sample(fam, "lighthouse_cluster_heartbeating_replicas") == 2.0  # g0 and g1 (on record: none expire)
    assert sample(fam, "lighthouse_cluster_ready") == 1.0
    # Group g1 talked to n2: unless n2 leads, its calls were forwarded.
    if leader != 1:
        follower = metrics(cluster, 1)
        forwarded = sample(follower, "lighthouse_cluster_forwarded_quorum_calls",
                           "lighthouse_cluster_forwarded_quorum_calls_total")
        assert forwarded >= 4
        # g1's calls came one at a time (one group on n2): at most a message each.
        assert 1 <= sample(follower, "lighthouse_cluster_forwarded_quorum_messages",
                           "lighthouse_cluster_forwarded_quorum_messages_total") <= forwarded
        batches = sample(follower, "lighthouse_cluster_forwarded_heartbeat_batches",
                         "lighthouse_cluster_forwarded_heartbeat_batches_total")
        assert sample(follower, "lighthouse_cluster_forwarded_heartbeats",
                      "lighthouse_cluster_forwarded_heartbeats_total") >= batches >= 1
    for name in ("lighthouse_cluster_commit_index", "lighthouse_cluster_last_applied",
                 "lighthouse_cluster_rerouted_quorum_calls", "lighthouse_cluster_raft_tick_stalls",
                 "lighthouse_cluster_raft_election_patience_seconds", "lighthouse_cluster_raft_journal_syncs",
                 "lighthouse_cluster_raft_journal_sync_seconds", "lighthouse_cluster_raft_fsync"):
        assert name in fam
    # Every node syncs its Raft journal (issue 32): a batch per acknowledged or counted append.
    assert sample(fam, "lighthouse_cluster_raft_fsync") == 1
    assert sample(fam, "lighthouse_cluster_raft_journal_syncs", "lighthouse_cluster_raft_journal_syncs_total") >= 1
    assert sample(fam, "lighthouse_cluster_raft_election_patience_seconds") <= 2.0

    with grpc.insecure_channel(cluster.client_addresses[0]) as ch:
        responses = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        services = {s.name for r in responses for s in r.list_services_response.service}
    assert {"torchft.LighthouseService", "lighthouse_cluster.LighthouseCluster", "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"} <= services

    status, body, headers = http(cluster, 0, "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert b"/status.json" in body and b"<script" in body and b"https://" not in body  # self-contained
    assert http(cluster, 0, "/nope")[0] == 404
    assert http(cluster, 0, "/metrics", method="POST")[0] == 405


def test_metrics_and_status_json_per_job(observed) -> None:
    """Two jobs beside the default one: /metrics has one series per job, with values that match
    what each job did; /status.json lists every job with its config and its leader's view."""
    cluster = observed(admin_token=TOKEN)
    added = add_job(cluster, TOKEN, "train-b", config=[cpb.ConfigEntry(key="dataset", value="c4"),
                                                cpb.ConfigEntry(key="lr", value="3e-4")])
    assert added.quorum_id == 0
    add_job(cluster, TOKEN, "idle")
    rounds = "lighthouse_cluster_quorum_rounds"
    hist = "lighthouse_cluster_quorum_commit_seconds"

    def leader_jobs() -> dict[str, cpb.Job]:
        leader = cluster.leader_index()
        assert leader is not None
        with grpc.insecure_channel(cluster.client_addresses[leader]) as ch:
            answer = cpb_grpc.LighthouseClusterStub(ch).ListJobs(cpb.ListJobsRequest(), timeout=5)
        assert answer.leader_view
        return {j.name: j for j in answer.jobs}

    # The default job's rounds first: only its series move.
    run_rounds(cluster, groups=2, rounds=3)
    leader = cluster.leader_index()
    assert leader is not None
    first = metrics(cluster, leader)
    issued_default = {path: per_job(first, rounds, rounds + "_total", path=path)["default"]
                      for path in ("commit", "lease")}
    assert sum(issued_default.values()) >= 3
    for path in ("commit", "lease"):
        assert per_job(first, rounds, rounds + "_total", path=path) == {
            "default": issued_default[path], "idle": 0, "train-b": 0}
    assert per_job(first, hist, hist + "_count") == {"default": issued_default["commit"], "idle": 0, "train-b": 0}

    # Then train-b's, through every node (followers forward the job's calls).
    run_rounds(cluster, groups=3, rounds=3, job="train-b", prefix="b")

    def consistent() -> dict[str, list[Any]] | None:
        fam, jobs = metrics(cluster, leader), leader_jobs()
        ids = per_job(fam, "lighthouse_cluster_quorum_id")
        if ids != {name: j.quorum_id for name, j in jobs.items()}:
            return None
        if per_job(fam, "lighthouse_cluster_pending_requesters") != {"default": 0, "idle": 0, "train-b": 0}:
            return None  # a late call of a group that finished waits until its deadline
        return fam

    fam = wait_for("the leader's per-job metrics to match its ListJobs", consistent, 15.0, context=cluster,
                   interval=0.1, retry_on=(OSError,))
    jobs = leader_jobs()
    assert {m.replica_id for m in jobs["default"].quorum.participants} == {"g0", "g1"}
    assert {m.replica_id for m in jobs["train-b"].quorum.participants} == {"b0", "b1", "b2"}
    assert jobs["train-b"].quorum_id >= 1 and not jobs["idle"].has_quorum
    assert per_job(fam, "lighthouse_cluster_quorum_participants") == {"default": 2, "idle": 0, "train-b": 3}
    assert per_job(fam, "lighthouse_cluster_heartbeating_replicas") == {"default": 2, "idle": 0, "train-b": 3}
    for path in ("commit", "lease"):  # train-b's rounds were counted as its own, not the default job's
        assert per_job(fam, rounds, rounds + "_total", path=path)["default"] == issued_default[path]
    issued_b = {path: per_job(fam, rounds, rounds + "_total", path=path)["train-b"] for path in ("commit", "lease")}
    assert issued_b["commit"] >= 1 and sum(issued_b.values()) >= 3  # the first round of a new member set commits
    assert per_job(fam, rounds, rounds + "_total", path="commit")["idle"] == 0
    assert per_job(fam, hist, hist + "_count") == {"default": issued_default["commit"], "idle": 0,
                                                     "train-b": issued_b["commit"]}
    assert sample(fam, "lighthouse_cluster_jobs") == 3
    for family in ("lighthouse_cluster_term", "lighthouse_cluster_ready", "lighthouse_cluster_commit_index"):
        assert all("job" not in s.labels for s in fam[family]), family
    assert all("job" not in s.labels for s in fam["lighthouse_cluster_raft_write_seconds"])

    # A follower: the replicated quorum ids per job; no leader readings.
    follower = (leader + 1) % 3
    fam_f = wait_for("the follower's per-job quorum ids",
                     lambda: (f := metrics(cluster, follower)) and per_job(f, "lighthouse_cluster_quorum_id")
                     == {name: j.quorum_id for name, j in jobs.items()} and f, 15.0, context=cluster, interval=0.1,
                     retry_on=(OSError,))
    assert per_job(fam_f, "lighthouse_cluster_heartbeating_replicas") == {"default": 0, "idle": 0, "train-b": 0}

    # /status.json, on the follower and on the leader: every job, its config, its quorum, and the
    # leader's live view of it.
    for i in (follower, leader):
        status, body, _ = http(cluster, i, "/status.json")
        assert status == 200
        data = json.loads(body)
        shown = {j["name"]: j for j in data["jobs"]}
        assert [j["name"] for j in data["jobs"]] == ["default", "idle", "train-b"]
        assert data["jobs_answered_by"] == cluster.members[leader].peer.node_id
        assert shown["train-b"]["config"] == {"dataset": "c4", "lr": "3e-4"}
        assert shown["default"]["config"] == {} and shown["default"]["settings_from_flags"] is True
        assert shown["train-b"]["settings"]["min_replicas"] == added.settings.min_replicas
        assert shown["train-b"]["quorum_id"] == jobs["train-b"].quorum_id
        assert {p["replica_id"] for p in shown["train-b"]["quorum"]["participants"]} == {"b0", "b1", "b2"}
        assert shown["idle"]["quorum"] is None
        assert all(j["leader_view"] for j in data["jobs"])
        assert {h["replica_id"] for h in shown["train-b"]["heartbeats"]} == {"b0", "b1", "b2"}
        assert {h["replica_id"] for h in shown["default"]["heartbeats"]} == {"g0", "g1"}
        # The default job is still at the top level, as before jobs.
        assert data["quorum"]["quorum_id"] == shown["default"]["quorum_id"] == jobs["default"].quorum_id


def test_status_json_matches_status_cli(observed) -> None:
    cluster = observed()
    run_rounds(cluster, groups=2, rounds=2)

    def both() -> tuple[dict[str, Any], dict[str, Any]] | None:
        status, body, _ = http(cluster, 2, "/status.json")
        assert status == 200
        mine = json.loads(body)
        res = subprocess.run([sys.executable, "-m", "lighthouse_cluster", "status", "--endpoints",
                              cluster.endpoints, "-o", "json"], capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr
        theirs = json.loads(res.stdout)
        stable = ("leader", "term", "quorum", "settings")
        if any(mine[k] != theirs[k] for k in stable):
            return None
        strip = lambda nodes: [{k: n[k] for k in ("id", "address", "role", "term", "reachable")} for n in nodes]
        if strip(mine["nodes"]) != strip(theirs["nodes"]):
            return None
        return mine, theirs

    mine, theirs = wait_for("/status.json to match `status -o json`", both, 15.0, context=cluster, interval=0.05,
                            retry_on=(OSError,))
    assert set(theirs) <= set(mine)
    assert mine["self"]["id"] == "n3" and mine["self"]["ready"] is True
    assert mine["self"]["kill_enabled"] is False
    assert {p["replica_id"] for p in mine["quorum"]["participants"]} == {"g0", "g1"}
    assert {h["replica_id"] for h in mine["heartbeats"]} >= {"g0", "g1"}


def test_isolated_survivor_is_not_ready(observed) -> None:
    cluster = observed()
    survivor = 2
    cluster.kill(0)
    cluster.kill(1)
    wait_for("the survivor's /readyz 503", lambda: http(cluster, survivor, "/readyz")[0] == 503, 20, context=cluster,
             interval=0.05, retry_on=(OSError,))
    status, body, _ = http(cluster, survivor, "/readyz")
    assert status == 503 and body.count(b"\n") == 1 and body.strip()
    wait_for("health NOT_SERVING",
             lambda: health(cluster, survivor) == health_pb2.HealthCheckResponse.NOT_SERVING, 15.0,
             context=cluster, interval=0.05, retry_on=(OSError,))
    assert http(cluster, survivor, "/livez")[0] == 200
    assert sample(metrics(cluster, survivor), "lighthouse_cluster_ready") == 0.0
    # /status.json answers despite dead peers; a survivor that led steps down after pysyncobj's
    # leader fallback timeout (until then Status still says leader, as `status` would show).
    view = wait_for("/status.json without a leader",
                    lambda: (v := json.loads(http(cluster, survivor, "/status.json")[1]))["leader"] is None and v,
                    15.0, context=cluster, interval=0.05, retry_on=(OSError,))
    assert {n["id"]: n["reachable"] for n in view["nodes"]} == {"n1": False, "n2": False, "n3": True}


class FakeManager(pb_grpc.ManagerServiceServicer):
    def __init__(self) -> None:
        self.kills: list[str] = []

    async def Kill(self, request: pb.KillRequest, context: Any) -> pb.KillResponse:  # noqa: N802
        self.kills.append(request.msg)
        return pb.KillResponse()


def test_kill_endpoint(observed) -> None:
    cluster = observed(admin_token=TOKEN)
    open_cluster = observed()  # no token configured

    add_job(cluster, TOKEN, "train-b")

    async def main() -> None:
        fake, fake_b = FakeManager(), FakeManager()  # the default job's member, train-b's
        server = grpc.aio.server()
        pb_grpc.add_ManagerServiceServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        server_b = grpc.aio.server()
        pb_grpc.add_ManagerServiceServicer_to_server(fake_b, server_b)
        port_b = server_b.add_insecure_port("127.0.0.1:0")
        await server_b.start()
        try:
            async with grpc.aio.insecure_channel(cluster.client_addresses[0]) as ch:
                stub = pb_grpc.LighthouseServiceStub(ch)
                await stub.Heartbeat(pb.LighthouseHeartbeatRequest(replica_id="victim"), timeout=5)
                resp = await stub.Quorum(pb.LighthouseQuorumRequest(requester=pb.QuorumMember(
                    replica_id="victim", address=f"http://127.0.0.1:{port}", store_address="store:1", step=3,
                    world_size=1)), timeout=20)
            assert [m.replica_id for m in resp.quorum.participants] == ["victim"]

            def call(c: LocalCluster, i: int, path: str, **headers: str) -> tuple[int, bytes, dict[str, str]]:
                return http(c, i, path, method="POST", headers=headers)

            # The quorum is replicated: any node can reach the member; wait until n2 has applied it.
            def applied() -> bool:
                st = cluster.status(1)
                return st is not None and st.has_quorum and st.quorum.participants[0].replica_id == "victim"
            await asyncio.to_thread(wait_for, "n2 to apply the quorum", applied, 15.0, context=cluster, interval=0.05,
                                    retry_on=(OSError,))

            status, body, _ = await asyncio.to_thread(call, open_cluster, 0, "/replica/victim/kill",
                                                      Authorization=f"Bearer {TOKEN}")
            assert status == 403 and b"no admin token" in body
            status, _, headers = await asyncio.to_thread(call, cluster, 1, "/replica/victim/kill")
            assert status == 401 and headers.get("WWW-Authenticate", "").startswith("Bearer")
            status, _, _ = await asyncio.to_thread(call, cluster, 1, "/replica/victim/kill",
                                                   Authorization="Bearer wrong-token")
            assert status == 401
            assert http(cluster, 1, "/replica/victim/kill")[0] == 405  # GET
            assert fake.kills == []
            status, _, _ = await asyncio.to_thread(call, cluster, 1, "/replica/ghost/kill",
                                                   Authorization=f"Bearer {TOKEN}")
            assert status == 404
            status, body, _ = await asyncio.to_thread(call, cluster, 1, "/replica/victim/kill",
                                                      Authorization=f"Bearer {TOKEN}")
            assert status == 200, body
            assert json.loads(body)["killed"] == "victim"
            assert len(fake.kills) == 1 and "n2" in fake.kills[0]

            # A replica of the same id in another job: the kill names the job.
            async with grpc.aio.insecure_channel(cluster.client_addresses[0]) as ch:
                resp = await pb_grpc.LighthouseServiceStub(ch).Quorum(pb.LighthouseQuorumRequest(
                    requester=pb.QuorumMember(replica_id="victim", address=f"http://127.0.0.1:{port_b}",
                                              store_address="store:2", step=0, world_size=1)),
                    timeout=20, metadata=((JOB_HEADER, "train-b"),))
            assert [m.replica_id for m in resp.quorum.participants] == ["victim"]
            status, body, _ = await asyncio.to_thread(call, cluster, 1, "/replica/victim/kill?job=nope",
                                                      Authorization=f"Bearer {TOKEN}")
            assert status == 404 and b"no job 'nope'" in body

            def killed_in_b() -> tuple[int, bytes, dict[str, str]] | None:
                answer = call(cluster, 1, "/replica/victim/kill?job=train-b", Authorization=f"Bearer {TOKEN}")
                return answer if answer[0] != 404 else None  # until n2 applied train-b's quorum
            status, body, _ = await asyncio.to_thread(wait_for, "the kill of train-b's victim", killed_in_b, 15.0,
                                                      context=cluster, interval=0.05, retry_on=(OSError,))
            assert status == 200, body
            assert json.loads(body) == {"killed": "victim", "job": "train-b", "address": f"http://127.0.0.1:{port_b}",
                                        "answered": True}
            assert len(fake_b.kills) == 1 and len(fake.kills) == 1
        finally:
            await server.stop(None)
            await server_b.stop(None)

    asyncio.run(main())
    for m in cluster.members:  # the token is never logged
        assert TOKEN not in m.log_path.read_text(errors="replace")


def test_http_bind_config() -> None:
    common = dict(node_id="a", peers=["a=127.0.0.1:1000,127.0.0.1:2000"], client_bind=None, raft_bind=None,
                  data_dir=None, secret=None, insecure=True, min_replicas=1, join_timeout_ms=1000,
                  quorum_tick_ms=100, heartbeat_timeout_ms=1000)
    cfg = build_node_config(**common, http_bind="127.0.0.1:2200", admin_token="tok")
    assert cfg.http_bind == "127.0.0.1:2200" and cfg.admin_token == "tok"
    assert "tok" not in repr(cfg)
    assert build_node_config(**common).http_bind is None
    with pytest.raises(ConfigError, match="--http-bind"):
        build_node_config(**common, http_bind="127.0.0.1:2000")
    with pytest.raises(ConfigError, match="--http-bind"):
        build_node_config(**common, http_bind="nonsense")


def test_an_idle_cluster_goes_quiet_and_a_trainers_call_wakes_it_even_after_its_leader_died(observed) -> None:
    """raft/extensions/quiescence.py on real nodes: with no client for --quiesce-after-ms every node reports
    lighthouse_cluster_raft_quiet 1; a heartbeat on a follower wakes all three; a leader SIGKILLed
    while the cluster is quiet is replaced once a trainer calls a follower, whose Quorum call is
    answered."""
    cluster = observed(min_replicas=1, extra_args=["--quiesce-after-ms", "500"])
    live = list(range(cluster.nodes))

    def quiet() -> list[float]:
        return [sample(metrics(cluster, i), "lighthouse_cluster_raft_quiet") for i in live]

    wait_for("every node quiet", quiet, 15.0, ready=lambda q: q == [1.0] * len(live), context=cluster,
             retry_on=(OSError,))
    leader, _ = cluster.wait_for_stable_leader(timeout=10)
    follower = next(i for i in live if i != leader)
    with grpc.insecure_channel(cluster.client_addresses[follower]) as ch:
        pb_grpc.LighthouseServiceStub(ch).Heartbeat(pb.LighthouseHeartbeatRequest(replica_id="wakes"), timeout=5)
    wait_for("every node awake after a heartbeat on a follower", quiet, 5.0, ready=lambda q: q == [0.0] * len(live),
             context=cluster, retry_on=(OSError,))
    wait_for("quiet again", quiet, 15.0, ready=lambda q: q == [1.0] * len(live), context=cluster, retry_on=(OSError,))

    leader, term = cluster.wait_for_stable_leader(timeout=10)
    cluster.kill(leader)
    live.remove(leader)
    killed = time.monotonic()

    async def ask() -> pb.Quorum:
        group = SimulatedReplicaGroup("after-quiet", cluster.client_addresses[live[0]], quorum_timeout_s=20)
        try:
            return await group.call_quorum()
        finally:
            await group.close()

    quorum = asyncio.run(ask())
    took = time.monotonic() - killed
    assert [m.replica_id for m in quorum.participants] == ["after-quiet"]
    new, new_term = cluster.wait_for_stable_leader(timeout=10)
    assert new != leader and new_term > term
    print(f"a Quorum call through a follower answered {took:.2f} s after the quiet leader was SIGKILLed")


def test_the_lease_defaults_to_what_the_vote_refusal_covers() -> None:
    """No --quorum-lease-ms: 150 ms, or the election timeout where shorter, so that a new leader
    waits nothing after a failover (lease.py, point 3); one given is kept as it is."""
    common = dict(node_id="a", peers=["a=127.0.0.1:1000,127.0.0.1:2000"], client_bind=None, raft_bind=None,
                  data_dir=None, secret=None, insecure=True, min_replicas=1, join_timeout_ms=1000,
                  quorum_tick_ms=100, heartbeat_timeout_ms=1000)
    assert build_node_config(**common).quorum_lease_ms == 150
    assert build_node_config(**common, election_timeout_ms=1000).quorum_lease_ms == 150
    short = build_node_config(**common, election_timeout_ms=80)
    assert short.quorum_lease_ms == 80 and short.raft.election_timeout_min_s == pytest.approx(0.08)
    assert build_node_config(**common, election_timeout_ms=80, quorum_lease_ms=300).quorum_lease_ms == 300
    assert build_node_config(**common, quorum_lease_ms=0).quorum_lease_ms == 0
