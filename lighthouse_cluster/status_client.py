"""Blocking client calls to the lighthouse_cluster.LighthouseCluster service (CLI and harnesses)."""

from __future__ import annotations

import grpc

from .proto import lighthouse_cluster_pb2 as cpb
from .proto import lighthouse_cluster_pb2_grpc as cpb_grpc


def query_status(address: str, timeout: float = 1.0) -> cpb.NodeStatus | None:
    """One node's Status, or None when it does not answer in time."""
    try:
        with grpc.insecure_channel(address) as ch:
            return cpb_grpc.LighthouseClusterStub(ch).Status(cpb.StatusRequest(), timeout=timeout)
    except grpc.RpcError:
        return None
