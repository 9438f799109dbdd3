"""Helpers of the tests that run a real cluster: a started cluster for a fixture
(``started_cluster``), the CLI as a subprocess, torchft Quorum calls (plaintext or TLS). Bounded
waits are ``support.waiting``'s."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

from lighthouse_cluster.local.cluster import LocalCluster
from lighthouse_cluster.local.simulated_group import SimulatedReplicaGroup
from lighthouse_cluster.proto import torchft_pb2 as pb
from lighthouse_cluster.tls import ClientTLS

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def started_cluster(root: Path, **kwargs: Any) -> Iterator[LocalCluster]:
    """``LocalCluster(root=root, **kwargs)`` started, with a leader every node agrees on; every
    node it started is stopped at the end, also when the start fails half-way (a ``with
    LocalCluster(...)`` would leak the nodes a failed ``start`` left running). Nodes are forked
    from the fork server (``fork_nodes``) unless ``kwargs`` says otherwise."""
    c = LocalCluster(root=root, **{"fork_nodes": True, **kwargs})
    try:
        c.start()
        c.wait_for_stable_leader(timeout=30)
        yield c
    finally:
        c.stop_all()


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """``lighthouse-cluster ARGS`` as a real process, with only ``env``'s LIGHTHOUSE_CLUSTER_*
    variables (none inherited)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTHOUSE_CLUSTER_")
            and k != "TORCHFT_LIGHTHOUSE"}
    return subprocess.run([sys.executable, "-m", "lighthouse_cluster", *args], env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def quorum_call(address: str, replica_id: str, *, step: int = 0, timeout: float = 15.0,
                tls: ClientTLS | None = None, commit_failures: int = 0, heartbeats: bool = True,
                job: str | None = None) -> pb.Quorum:
    """One torchft Quorum call (blocking) from replica group ``replica_id``, heartbeating every
    100 ms while it waits, as torchft's manager does (``heartbeats=False``: the call alone);
    ``job``: the job its calls name (``x-lighthouse-job``; None: the default job).
    A ``SimulatedReplicaGroup`` making one call; raises the call's ``grpc.RpcError``.

    The default deadline outlasts the heartbeat timeout (5 s): a leader elected since the last
    quorum seeds a fresh heartbeat for each of its members (torchft's warm-up), so a quorum
    without them is issued only once those expire; the caller's own heartbeats keep it healthy
    meanwhile (without them it would expire with the seeded members when its call reached the
    new leader before the seeding, and never get a quorum)."""
    async def call() -> pb.Quorum:
        group = SimulatedReplicaGroup(replica_id, address, quorum_timeout_s=timeout, tls=tls, step=step,
                                      commit_failures=commit_failures, job=job)
        try:
            if not heartbeats:
                return await group.call_quorum()
            async with group.heartbeating():
                return await group.call_quorum()
        finally:
            await group.close()
    return asyncio.run(call())
