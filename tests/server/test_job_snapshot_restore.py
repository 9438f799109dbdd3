"""Issue 17: a snapshot carries every job; `snapshot restore` into a cluster rebuilt from empty data
directories brings the jobs back (created with their saved specs) and each job's quorum ids go on
after the saved ones. Real processes; the CLI as a user runs it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest

from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from support.cluster import cli, quorum_call
from support.job_admin import add_job

pytestmark = pytest.mark.integration

TOKEN = "restore-jobs"


def _env(cluster: Any) -> dict[str, str]:
    return {"LIGHTHOUSE_CLUSTER_ENDPOINTS": cluster.endpoints, "LIGHTHOUSE_CLUSTER_ADMIN_TOKEN": TOKEN}


def test_a_snapshot_restores_every_job_into_a_fresh_cluster(make_cluster: Callable[..., Any], tmp_path: Path) -> None:
    old = make_cluster(nodes=1, min_replicas=1, admin_token=TOKEN)
    old.wait_for_leader(timeout=15)
    address = old.client_addresses[0]
    add_job(old, TOKEN, "train", settings=cpb.JobSettingsUpdate(min_replicas=1),
            config=[cpb.ConfigEntry(key="lr", value="0.1")])
    q_default = quorum_call(address, "d0")
    q_job = quorum_call(address, "t0", job="train")
    q_job = quorum_call(address, "t1", job="train")  # a second member set: a new id
    assert q_job.quorum_id == 2 and q_default.quorum_id == 1
    file = tmp_path / "backup.json"
    res = cli("snapshot", "save", str(file), env=_env(old))
    assert res.returncode == 0, res.stderr

    fresh = make_cluster(nodes=1, min_replicas=1, admin_token=TOKEN)
    fresh.wait_for_leader(timeout=15)
    res = cli("snapshot", "restore", str(file), "-o", "json", env=_env(fresh))
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == {
        "applied": True, "quorum_id": 1, "previous_quorum_id": 0,
        "jobs": {"train": {"created": True, "quorum_id": 2, "previous_quorum_id": 0}}}
    # The job is back with its spec, and its ids go on after the saved one.
    after = quorum_call(fresh.client_addresses[0], "t9", job="train")
    assert after.quorum_id == 3
    # Restoring again: nothing is above the cluster's ids any more.
    res = cli("snapshot", "restore", str(file), env=_env(fresh))
    assert res.returncode == 1 and "nothing to restore" in res.stderr
    assert "train: the cluster is at quorum id 3, the snapshot at 2" in res.stderr
