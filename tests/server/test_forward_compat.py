"""Forward compatibility through real nodes: a QuorumMember field this project does not know
(number 15, bytes) sent through a follower comes back unchanged in every participant, and stays
in every node's replicated state across a leader SIGKILL, a journal replay and a snapshot restore.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from support.cluster import cli
from support.waiting import wait_for
from lighthouse_cluster.local.cluster import LocalCluster
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import torchft_pb2 as pb
from lighthouse_cluster.proto import torchft_pb2_grpc as pb_grpc
from support.member_bytes import member_bytes, unknown_field

pytestmark = pytest.mark.integration

TOKEN = "forward-compat-token-5d1e"
GROUPS = ("a", "b")


def sent_members(step: int, tag: bytes) -> dict[str, bytes]:
    """Each group's member as a newer torchft would send it: nightly's reconfigure_handles plus an
    unknown field 15 with bytes that are not valid UTF-8."""
    return {g: member_bytes(g, step=step, reconfigure_handles=[json.dumps({"pg": g, "rank": r}) for r in (0, 1)],
                            extra=unknown_field(15, b"\xfe" + tag + g.encode())) for g in GROUPS}


def call_raw(address: str, raw_member: bytes, timeout: float = 20.0) -> dict[str, bytes]:
    """One Quorum call with ``raw_member`` as the requester, heartbeating every 100 ms meanwhile
    (as torchft's manager does); returns every participant as serialized bytes."""
    request = pb.LighthouseQuorumRequest()
    request.requester.MergeFromString(raw_member)
    rid = request.requester.replica_id
    done = threading.Event()
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.LighthouseServiceStub(ch)

        def heartbeat() -> None:
            while not done.wait(0.1):
                try:
                    stub.Heartbeat(pb.LighthouseHeartbeatRequest(replica_id=rid), timeout=1.0)
                except grpc.RpcError:
                    pass  # a node changing leaders: the next one goes through
        beats = threading.Thread(target=heartbeat, daemon=True)
        beats.start()
        try:
            quorum = stub.Quorum(request, timeout=timeout).quorum
        finally:
            done.set()
            beats.join(timeout=5)
    return {p.replica_id: p.SerializeToString() for p in quorum.participants}


def round_through(address: str, sent: dict[str, bytes]) -> list[dict[str, bytes]]:
    with ThreadPoolExecutor(len(sent)) as pool:
        return list(pool.map(lambda raw: call_raw(address, raw), sent.values()))


def stored(cluster: LocalCluster, i: int) -> dict[str, bytes] | None:
    """The participants of node ``i``'s replicated quorum, as serialized bytes."""
    st = cluster.status(i)
    if st is None or not st.has_quorum:
        return None
    return {p.replica_id: p.SerializeToString() for p in st.quorum.participants}


def env(cluster: LocalCluster) -> dict[str, str]:
    running = [cluster.client_addresses[i] for i, m in enumerate(cluster.members) if m.running]
    return {"LIGHTHOUSE_CLUSTER_ENDPOINTS": ",".join(f"http://{a}" for a in running),
            "LIGHTHOUSE_CLUSTER_ADMIN_TOKEN": TOKEN}


def test_unknown_member_field_survives_forwarding_failover_replay_and_restore(make_cluster, tmp_path: Path) -> None:
    cluster = make_cluster(min_replicas=2, admin_token=TOKEN)
    leader = cluster.wait_for_agreed_leader()
    follower = (leader + 1) % 3

    # 1. Through a follower (forwarded to the leader): every participant exactly as sent.
    first = sent_members(step=1, tag=b"one")
    for seen in round_through(cluster.client_addresses[follower], first):
        assert seen == first, cluster.tail_logs()
    # ... and in every node's replicated state (the Raft log, schema 3).
    for i in range(3):
        wait_for(f"node {i} to hold the members as sent", lambda: stored(cluster, i) == first, 10.0, context=cluster)

    backup = tmp_path / "backup.json"
    res = cli("snapshot", "save", str(backup), env=env(cluster))
    assert res.returncode == 0, res.stderr

    # 2. The leader SIGKILLed: the new leader hands the fields on just the same.
    cluster.kill(leader)
    survivors = [i for i in range(3) if i != leader]
    new_leader = cluster.wait_for_leader(among=survivors, timeout=15.0)
    other = next(i for i in survivors if i != new_leader)
    second = sent_members(step=2, tag=b"two")
    for seen in round_through(cluster.client_addresses[other], second):
        assert seen == second, cluster.tail_logs()
    # A round on the leader lease reaches the log at most once a second: ask again until it has.
    wait_for("the new leader to hold round 2's members",
             lambda: all(seen == second for seen in round_through(cluster.client_addresses[other], second))
             and stored(cluster, new_leader) == second, 15.0, context=cluster)
    for i in survivors:
        wait_for(f"node {i} to hold round 2's members", lambda: stored(cluster, i) == second, 10.0, context=cluster)

    # 3. The killed node replays its journal (and catches up): the same whole members.
    cluster.restart(leader)
    wait_for("the restarted node to hold round 2's members", lambda: stored(cluster, leader) == second, 20.0,
             context=cluster)

    # 4. The snapshot restored into a cluster rebuilt from empty data directories.
    fresh = make_cluster(nodes=1, admin_token=TOKEN)
    fresh.wait_for_leader(timeout=15.0)
    res = cli("snapshot", "restore", str(backup), env=env(fresh))
    assert res.returncode == 0, res.stderr
    assert stored(fresh, 0) == first, fresh.tail_logs()
    st = fresh.status(0)
    assert st is not None and st.schema_version >= 3 and st.role == cpb.LEADER


def enabled_schemas(cluster: LocalCluster) -> list[int | None]:
    return [(st.enabled_schema_version if (st := cluster.status(i)) is not None else None) for i in range(3)]


def test_rolling_upgrade_from_schema_2_keeps_whole_members_once_every_node_reads_them(make_cluster) -> None:
    """Nodes of a version that writes schema 2 (simulated with the hidden --schema-version 2) are
    restarted one by one as the version that writes 3 (--schema-version 3; this version writes 4,
    jobs: test_rolling_upgrade_from_schema_3_...): members are written field by field (what an old node
    reads) until the last old node is gone; then the leader enables schema 3 by itself, and the
    replicated state keeps every field. Trainers get their fields back throughout (a response is
    built from the requests, never from the log)."""
    cluster = make_cluster(min_replicas=1, extra_args=["--schema-version", "2"])
    leader = cluster.wait_for_agreed_leader()
    old = {"a": member_bytes("a", step=1, extra=unknown_field(15, b"old"))}
    assert call_raw(cluster.client_addresses[(leader + 1) % 3], old["a"]) == old, cluster.tail_logs()
    fields_only = {"a": member_bytes("a", step=1)}
    for i in range(3):
        wait_for(f"node {i} to hold the member's known fields", lambda: stored(cluster, i) == fields_only,
                 10.0, context=cluster)
    assert enabled_schemas(cluster) == [2, 2, 2]

    cluster.extra_args = ["--schema-version", "3"]  # the version with whole members (jobs came later: schema 4)
    order = [i for i in range(3) if i != leader] + [leader]
    for k, i in enumerate(order):
        cluster.restart(i)
        leader = cluster.wait_for_agreed_leader()
        if k == 1:  # one old node left: it could not read a whole member, so none is written
            mid = {"a": member_bytes("a", step=2, extra=unknown_field(15, b"mid"))}
            assert call_raw(cluster.client_addresses[leader], mid["a"]) == mid, cluster.tail_logs()
            # A round on the leader lease reaches the log at most once a second: ask again until it has.
            wait_for("the leader to hold round 2's known fields",
                     lambda: call_raw(cluster.client_addresses[leader], mid["a"]) == mid
                     and stored(cluster, leader) == {"a": member_bytes("a", step=2)}, 15.0, context=cluster)
            assert 2 in enabled_schemas(cluster)
            table = cli("status", env=env(cluster))
            assert table.returncode == 0 and "replicated schema 2 enabled, 3 once the leader sees every node" \
                in " ".join(table.stdout.split()), table.stdout
            nodes = json.loads(cli("status", "-o", "json", env=env(cluster)).stdout)["nodes"]
            assert sorted(n["schema"]["writes"] for n in nodes) == [2, 3, 3], nodes
    wait_for("schema 3 enabled on every node", lambda: enabled_schemas(cluster) == [3, 3, 3], 15.0, context=cluster)
    assert "rolling upgrade" not in cli("status", env=env(cluster)).stdout
    new = {"a": member_bytes("a", step=3, extra=unknown_field(15, b"new"))}
    assert call_raw(cluster.client_addresses[leader], new["a"]) == new, cluster.tail_logs()
    wait_for("the leader to hold the whole member",
             lambda: call_raw(cluster.client_addresses[leader], new["a"]) == new and stored(cluster, leader) == new,
             15.0, context=cluster)
    for i in range(3):
        wait_for(f"node {i} to hold the whole member", lambda: stored(cluster, i) == new, 10.0, context=cluster)
