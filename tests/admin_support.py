"""Helpers of tests/test_admin.py and tests/test_security.py: bounded waits, the CLI as a
subprocess, torchft Quorum calls (plaintext or TLS)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, TypeVar

import grpc

from lighthouse_cluster.local.cluster import LocalCluster
from lighthouse_cluster.proto import torchft_pb2 as pb
from lighthouse_cluster.proto import torchft_pb2_grpc as pb_grpc
from lighthouse_cluster.tls import ClientTLS, channel

ROOT = Path(__file__).resolve().parent.parent
POLL_S = 0.02
T = TypeVar("T")


def wait_for(cluster: LocalCluster | None, what: str, cond: Callable[[], T], timeout: float) -> T:
    """Poll ``cond`` until it returns something truthy; fail with the nodes' logs at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() >= deadline:
            logs = cluster.tail_logs() if cluster is not None else ""
            raise AssertionError(f"timed out after {timeout:.1f}s waiting for {what}\n{logs}")
        time.sleep(POLL_S)


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """``lighthouse-cluster ARGS`` as a real process, with only ``env``'s LIGHTHOUSE_CLUSTER_*
    variables (none inherited)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTHOUSE_CLUSTER_")
            and k != "TORCHFT_LIGHTHOUSE"}
    return subprocess.run([sys.executable, "-m", "lighthouse_cluster", *args], env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def quorum_call(address: str, replica_id: str, *, step: int = 0, timeout: float = 15.0,
                tls: ClientTLS | None = None) -> pb.Quorum:
    """One torchft Quorum call (blocking) from replica group ``replica_id``, heartbeating every
    100 ms while it waits, as torchft's manager does.

    The default deadline outlasts the heartbeat timeout (5 s): a leader elected since the last
    quorum seeds a fresh heartbeat for each of its members (torchft's warm-up), so a quorum
    without them is issued only once those expire; the caller's own heartbeats keep it healthy
    meanwhile (without them it would expire with the seeded members when its call reached the
    new leader before the seeding, and never get a quorum)."""
    request = pb.LighthouseQuorumRequest(requester=pb.QuorumMember(
        replica_id=replica_id, address=f"sim://{replica_id}", store_address=f"sim-store://{replica_id}",
        step=step, world_size=1))
    done = threading.Event()
    with channel(address, tls) as ch:
        stub = pb_grpc.LighthouseServiceStub(ch)

        def heartbeat() -> None:
            while not done.wait(0.1):
                try:
                    stub.Heartbeat(pb.LighthouseHeartbeatRequest(replica_id=replica_id), timeout=1.0)
                except grpc.RpcError:
                    pass  # the node may be changing leaders: the next one goes through
        beats = threading.Thread(target=heartbeat, daemon=True)
        beats.start()
        try:
            return stub.Quorum(request, timeout=timeout).quorum
        finally:
            done.set()
            beats.join(timeout=5)
