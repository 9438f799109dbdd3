"""The cluster as the only coordination service a torchft job needs (issue 34, item 4).

Each replica group is a torchrun job of its own (``--rdzv-backend=lighthouse``, ``--rdzv-id``
``group-N``) whose rank finds its group's store through the cluster's rendezvous store, and the
groups train together through the same cluster's torchft quorums: unchanged torchft 0.2.0
(``examples/train_ddp.py --sdk torchft``, one lighthouse URL per group, each on another node).
No TCPStore host of the launcher's and no etcd: the groups end with the same weights, and the
cluster holds both groups' rendezvous next to their quorums.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest

from ftclient.torchrun_rendezvous.state_backend import STATE_KEY
from lighthouse_cluster.client.kv_client import KVClient
from lighthouse_cluster.core.jobs import DEFAULT_JOB
from lighthouse_cluster.local.cluster import LocalCluster
from support.cluster import started_cluster
from support.torchrun_agents import TORCHRUN, FAST_CONF, TorchrunJob

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "train_ddp.py"
STEPS = 15
FINISH_S = 150.0  # two torchrun agents, each with a worker importing torch and torchft, then training


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with started_cluster(tmp_path / "cluster", min_replicas=2) as c:
        yield c


def test_each_replica_group_is_a_torchrun_job_on_the_cluster(cluster: LocalCluster, tmp_path: Path) -> None:
    pytest.importorskip("torchft", reason="torchft 0.2.0 is the interop extra")
    nodes = ",".join(f"http://{a}" for a in cluster.client_addresses)
    conf = ",".join(f"{k}={v}" for k, v in FAST_CONF.items())
    groups: list[TorchrunJob] = []
    try:
        for group in (0, 1):
            job = TorchrunJob(nodes, f"group-{group}", tmp_path / "jobs", nnodes="1", env={
                "REPLICA_GROUP_ID": str(group), "NUM_REPLICA_GROUPS": "2",
                # torchft's client takes one URL: each group on another node
                "TORCHFT_LIGHTHOUSE": f"http://{cluster.client_addresses[group]}",
                "TORCHFT_QUORUM_TIMEOUT_SEC": "60"})
            groups.append(job)
            job.start_agent(command=[
                TORCHRUN, "--nnodes=1", "--nproc-per-node=1", "--rdzv-backend=lighthouse",
                f"--rdzv-endpoint={nodes}", f"--rdzv-id={job.run_id}", f"--rdzv-conf={conf}",
                "--monitor-interval=0.2", "--local-addr=127.0.0.1",
                str(TRAIN), "--sdk", "torchft", "--steps", str(STEPS), "--min-replica-size", "2",
                "--output", str(job.out / "summary.json")])
        for job in groups:
            rc = job.agents[0].wait(FINISH_S)
            assert rc == 0, job.logs()
        summaries = [json.loads((job.out / "summary.json").read_text()) for job in groups]
        assert [s["replica_group"] for s in summaries] == [0, 1]
        assert all(s["final_step"] >= STEPS for s in summaries), summaries
        # Trained together: the same weights and optimizer state at the end.
        assert summaries[0]["params_sha256"] == summaries[1]["params_sha256"], [job.logs() for job in groups]
        assert summaries[0]["optim_sha256"] == summaries[1]["optim_sha256"]
        # Both launches went through the cluster's rendezvous store, each in its own namespace.
        for job in groups:
            with KVClient(nodes, DEFAULT_JOB, job.run_id, timeout=20.0) as kv:
                assert kv.get(STATE_KEY) is not None, job.run_id
    finally:
        for job in groups:
            job.close()
