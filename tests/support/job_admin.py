"""Adding a job to a running ``LocalCluster`` (``LighthouseAdmin.AddJob`` with the admin token), for
the observability and dashboard tests. The wait is ``support.waiting``'s, bounded."""

from __future__ import annotations

from typing import Any

import grpc

from support.waiting import wait_for
from lighthouse_cluster.local.cluster import LocalCluster
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import lighthouse_cluster_pb2_grpc as cpb_grpc
from lighthouse_cluster.server.admin import token_metadata


def add_job(cluster: LocalCluster, token: str, name: str, timeout: float = 20.0, **fields: Any) -> cpb.Job:
    """``AddJob(name, **fields)`` on the leader; retried while no leader serves it yet (an
    election, or the jobs schema not enabled yet). Any other refusal raises."""
    def add() -> cpb.Job | None:
        leader = cluster.leader_index()
        if leader is None:
            return None
        with grpc.insecure_channel(cluster.client_addresses[leader]) as ch:
            try:
                return cpb_grpc.LighthouseAdminStub(ch).AddJob(cpb.AddJobRequest(name=name, **fields), timeout=5,
                                                              metadata=token_metadata(token))
            except grpc.RpcError as e:
                if e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE):
                    return None
                raise
    return wait_for(f"job {name} added", add, timeout, context=cluster.tail_logs, interval=0.1)
