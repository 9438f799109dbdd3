"""The rolling upgrade to jobs (replicated schema 4), through real node processes: nodes of the
version before jobs (simulated with the hidden ``serve --schema-version 3``) are restarted one by
one as this version. Until the last old node is gone, ``AddJob`` is refused with the reason (an
old node would apply a job's commit to its only quorum), the default job's quorums go on and the
Raft port stays on Fernet (what an old node reads); then the leader enables this version's schema
(``codec.SCHEMA_VERSION``: jobs, and AES-GCM on the Raft port, ``raft/message_cipher.py``) by
itself (``node._upgrade_schema``), every node sends AES-GCM, jobs can be added and their quorums
run, and a restart of every node (a journal replay) keeps every job and its quorum ids.

(The upgrade to schema 3 is ``test_forward_compat.py``'s.)"""

from __future__ import annotations

import grpc
import pytest

from support.cluster import cli, quorum_call
from support.waiting import wait_for
from lighthouse_cluster.client.admin_client import AdminCallError, AdminClient
from lighthouse_cluster.core.codec import SCHEMA_VERSION
from lighthouse_cluster.core.jobs import DEFAULT_JOB
from lighthouse_cluster.local.cluster import LocalCluster, free_ports
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import lighthouse_cluster_pb2_grpc as cpb_grpc

pytestmark = pytest.mark.integration

TOKEN = "jobs-upgrade-token-81c2"
OLD = ["--schema-version", "3"]


def admin(cluster: LocalCluster) -> AdminClient:
    running = [a for a, m in zip(cluster.client_addresses, cluster.members) if m.running]
    return AdminClient(running, token=TOKEN, timeout=15.0)


def add_job(cluster: LocalCluster, name: str) -> cpb.Job:
    return admin(cluster).call("AddJob", cpb.AddJobRequest(name=name))


def gcm_sent(cluster: LocalCluster, i: int) -> float:
    """Raft messages node ``i`` sent encrypted with AES-GCM (its ``/metrics``)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{cluster.node_host(i)}:{cluster.http_ports[i]}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "lighthouse_cluster_raft_messages_encrypted_total" and s.labels["cipher"] == "aes-gcm")


def enabled_schemas(cluster: LocalCluster) -> list[int | None]:
    return [(st.enabled_schema_version if (st := cluster.status(i)) is not None else None) for i in range(3)]


def round_id(cluster: LocalCluster, node: int, replica: str, job: str | None = None) -> tuple[int, list[str]]:
    """One quorum round of ``replica`` alone through node ``node``: (quorum id, member ids); a
    call that fails while leaders change is made again."""
    def once() -> tuple[int, list[str]] | None:
        try:
            q = quorum_call(cluster.client_addresses[node], replica, timeout=10.0, job=job)
        except grpc.RpcError:
            return None
        return q.quorum_id, sorted(p.replica_id for p in q.participants)
    return wait_for(f"a quorum of {replica} ({job or DEFAULT_JOB}) through node {node}", once, 30.0,
                    context=cluster)


def jobs_on(cluster: LocalCluster, i: int) -> dict[str, tuple[int, int]] | None:
    """Node ``i``'s replicated job table: name -> (version, quorum id); None if it does not answer."""
    try:
        with grpc.insecure_channel(cluster.client_addresses[i]) as ch:
            listed = cpb_grpc.LighthouseClusterStub(ch).ListJobs(cpb.ListJobsRequest(), timeout=2.0)
    except grpc.RpcError:
        return None
    return {j.name: (j.version, j.quorum_id) for j in listed.jobs}


def test_rolling_upgrade_from_schema_3_enables_jobs_once_every_node_runs_them(make_cluster) -> None:
    # Short heartbeat and join timeouts: a round of a new replica group waits for the previous
    # one's heartbeat to go stale (jobs added later take the leader's default settings: these).
    cluster = make_cluster(min_replicas=1, admin_token=TOKEN, heartbeat_timeout_ms=500, join_timeout_ms=1000,
                           extra_args=OLD, http_ports=free_ports(3))
    leader = cluster.wait_for_agreed_leader()
    assert enabled_schemas(cluster) == [3, 3, 3]
    ids = [round_id(cluster, (leader + 1) % 3, "d0")[0]]

    def refused_for_the_schema() -> None:
        with pytest.raises(AdminCallError) as e:
            add_job(cluster, "train")
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION, e.value
        assert "jobs need replicated schema 4, the cluster has 3 enabled: every node must run a version with " \
               "jobs first" in str(e.value)

    refused_for_the_schema()
    cluster.extra_args = []   # this version from now on
    order = [i for i in range(3) if i != leader] + [leader]
    for k, i in enumerate(order):
        cluster.restart(i)
        leader = cluster.wait_for_agreed_leader()
        # The default job's quorums go on through every step, ids never back.
        qid, members = round_id(cluster, i, f"d{k + 1}")
        assert members == [f"d{k + 1}"] and qid > ids[-1], (ids, qid)
        ids.append(qid)
        if k < 2:   # an old node is left: it reads no job command, so none may be written
            assert enabled_schemas(cluster) == [3, 3, 3]
            refused_for_the_schema()
            # ... nor an AES-GCM message: the new nodes send Fernet.
            assert [gcm_sent(cluster, n) for n in range(3)] == [0, 0, 0], cluster.tail_logs()
            if k == 1:
                table = " ".join(cli("status", env={"LIGHTHOUSE_CLUSTER_ENDPOINTS": cluster.endpoints}).stdout.split())
                assert f"replicated schema 3 enabled, {SCHEMA_VERSION} once the leader sees every node run it" \
                    in table, table
    wait_for(f"schema {SCHEMA_VERSION} enabled on every node",
             lambda: enabled_schemas(cluster) == [SCHEMA_VERSION] * 3, 15.0, context=cluster)
    before = [gcm_sent(cluster, n) for n in range(3)]
    wait_for("every node sending AES-GCM on the Raft port",
             lambda: all(gcm_sent(cluster, n) > b for n, b in zip(range(3), before)), 10.0, context=cluster)

    train, evals = add_job(cluster, "train"), add_job(cluster, "eval")
    assert (train.name, train.version, train.quorum_id, evals.version) == ("train", 1, 0, 1)
    follower = next(i for i in range(3) if i != cluster.wait_for_agreed_leader())
    assert round_id(cluster, follower, "t1", job="train") == (1, ["t1"])
    assert round_id(cluster, follower, "t2", job="train") == (2, ["t2"])
    assert round_id(cluster, follower, "e1", job="eval") == (1, ["e1"])
    qid, members = round_id(cluster, follower, "d9")   # the default job is still its own
    assert members == ["d9"] and qid > ids[-1]
    expected = {DEFAULT_JOB: (0, qid), "eval": (1, 1), "train": (1, 2)}
    for i in range(3):
        wait_for(f"node {i} to hold every job", lambda: jobs_on(cluster, i) == expected, 10.0, context=cluster)

    # Every node killed and started again: each replays its journal (or snapshot) to the same jobs.
    for i in range(3):
        cluster.kill(i)
    for i in range(3):
        cluster.start_node(i)
    cluster.wait_for_agreed_leader()
    for i in range(3):
        wait_for(f"node {i} to hold every job after the restart", lambda: jobs_on(cluster, i) == expected, 20.0,
                 context=cluster)
    assert enabled_schemas(cluster) == [SCHEMA_VERSION] * 3
    # And each job's ids go on from where they were.
    assert round_id(cluster, 0, "t3", job="train") == (3, ["t3"])
    assert round_id(cluster, 1, "e2", job="eval") == (2, ["e2"])
