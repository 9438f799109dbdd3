"""torchft's own Rust LighthouseClient selects a job by port (#17): an unchanged torchft trainer
pointed at a follower's port of a job gets that job's quorums, heartbeats there count for that
job, and the default job on the client port stays apart (its own quorum ids and members). Both
with the job port on the node's event loop and served by a port process (``--job-port-processes``)."""

from __future__ import annotations

import pytest

torchft = pytest.importorskip("torchft", reason="torchft (with its Rust LighthouseClient) is not installed")

from lighthouse_cluster.local.cluster import LocalCluster, free_ports  # noqa: E402
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb  # noqa: E402
from lighthouse_cluster.proto import lighthouse_cluster_pb2_grpc as cpb_grpc  # noqa: E402
from lighthouse_cluster.server.admin import token_metadata  # noqa: E402
from support.torchft_support import replica_set, run_concurrently  # noqa: E402
from support.waiting import wait_for  # noqa: E402

import grpc  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

TOKEN = "torchft-job-port"
CALL_TIMEOUT_S = 20.0


@pytest.mark.parametrize("extra_args", [[], ["--job-port-processes"]], ids=["in-node", "port-processes"])
def test_torchfts_client_gets_quorums_from_a_followers_job_port(tmp_path, extra_args: list[str]) -> None:
    ports = free_ports(3)
    with LocalCluster(tmp_path, min_replicas=1, join_timeout_ms=1_000, heartbeat_timeout_ms=1_000,
                      admin_token=TOKEN, extra_args=extra_args) as cluster, replica_set() as replica:
        leader, _ = cluster.wait_for_stable_leader(timeout=60)
        follower = next(i for i in range(cluster.nodes) if i != leader)
        with grpc.insecure_channel(cluster.client_addresses[leader]) as ch:
            cpb_grpc.LighthouseAdminStub(ch).AddJob(cpb.AddJobRequest(
                name="torchft-job", settings=cpb.JobSettingsUpdate(min_replicas=2, join_timeout_ms=500),
                ports=[cpb.JobPort(node_id=f"n{i + 1}", port=p) for i, p in enumerate(ports)]),
                metadata=token_metadata(TOKEN), timeout=10)
        with grpc.insecure_channel(cluster.client_addresses[follower]) as ch:
            stub = cpb_grpc.LighthouseClusterStub(ch)

            def follower_port() -> int | None:
                # AddJob returned once the leader applied it; the follower applies it a moment later.
                try:
                    return stub.GetJob(cpb.JobRequest(name="torchft-job"), timeout=2).listening_port
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.NOT_FOUND:
                        raise
                    return None

            wait_for("the follower listening on the job's port", follower_port, 20,
                     ready=lambda p: p == ports[follower], context=cluster)
        job_url = f"http://127.0.0.1:{ports[follower]}"
        default_url = f"http://{cluster.client_addresses[follower]}"
        trainers = [replica(f"job-{k}", job_url).start_heartbeats() for k in range(2)]
        plain = replica("default-0", default_url).start_heartbeats()
        for step in range(3):
            calls = {r.replica_id: (lambda r=r: r.quorum(CALL_TIMEOUT_S, step=step)) for r in trainers}
            calls["default-0"] = lambda: plain.quorum(CALL_TIMEOUT_S, step=step)
            results = run_concurrently(calls, CALL_TIMEOUT_S)
            for name, result in results.items():
                assert result.error is None, f"{name}: {result.error}\n{cluster.tail_logs()}"
            job_views = [results[r.replica_id].quorum for r in trainers]
            assert all(v.ids == ("job-0", "job-1") for v in job_views), job_views
            assert len({v.quorum_id for v in job_views}) == 1
            assert results["default-0"].quorum.ids == ("default-0",)
        # The leader counts the trainers' heartbeats (sent to the follower's job port) for the job,
        # not for the default job. Asked of the node that leads now: under load the leader can
        # change meanwhile (the quorums above re-route), and a new one counts them from the
        # follower's next batch (every 50 ms); a follower's own view has none.
        def leaders_heartbeats() -> tuple[set[str], set[str]]:
            with grpc.insecure_channel(cluster.client_addresses[cluster.wait_for_leader(timeout=30)]) as ch:
                stub = cpb_grpc.LighthouseClusterStub(ch)
                job = stub.GetJob(cpb.JobRequest(name="torchft-job"), timeout=2)
                status = stub.Status(cpb.StatusRequest(), timeout=2)
            return {h.replica_id for h in job.heartbeats}, {h.replica_id for h in status.heartbeats}

        _, default_job = wait_for("the leader counting the trainers' heartbeats for the job", leaders_heartbeats, 20,
                                  ready=lambda seen: {"job-0", "job-1"} <= seen[0], context=cluster)
        assert not {"job-0", "job-1"} & default_job
        for r in [*trainers, plain]:
            assert not r.heartbeat_errors, r.heartbeat_errors[:3]
