"""`lighthouse-cluster` administration against real node processes on loopback: members
list/add/remove (runtime membership change, routing to a new member, the table surviving a
restart), transfer-leader, snapshot save/restore, health, and the SIGTERMed leader handing over.

One 3-node cluster serves the whole module (starting nodes is the expensive part); every test
finds the leader afresh and leaves the cluster with three healthy members.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from support.cluster import cli, quorum_call, started_cluster
from support.waiting import not_none, wait_for
from lighthouse_cluster.local.cluster import LocalCluster
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb

pytestmark = pytest.mark.integration

TOKEN = "admin-token-for-tests-7f3c"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with started_cluster(tmp_path_factory.mktemp("admin"), admin_token=TOKEN, election_timeout_ms=150) as c:
        yield c


def env_for(cluster: LocalCluster, token: str | None = TOKEN, only: list[int] | None = None) -> dict[str, str]:
    addresses = [cluster.client_addresses[i] for i in (only if only is not None else range(cluster.nodes))
                 if cluster.members[i].running]
    env = {"LIGHTHOUSE_CLUSTER_ENDPOINTS": ",".join(f"http://{a}" for a in addresses)}
    if token is not None:
        env["LIGHTHOUSE_CLUSTER_ADMIN_TOKEN"] = token
    return env


def healthy_leader(cluster: LocalCluster, timeout: float = 10.0) -> int:
    """Wait until `health` passes; return the leader's index."""
    res = wait_for("a healthy cluster",
                   lambda: (r := cli("health", "-o", "json", env=env_for(cluster))).returncode == 0 and r, timeout,
                   context=cluster)
    leader = json.loads(res.stdout)["leader"]
    return next(i for i, m in enumerate(cluster.members) if m.peer.node_id == leader)


def members_json(cluster: LocalCluster, at: int | None = None) -> dict:
    res = cli("members", "list", "-o", "json", env=env_for(cluster, only=None if at is None else [at]))
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_members_list_and_health_as_table_and_json(cluster: LocalCluster) -> None:
    leader = healthy_leader(cluster)
    data = members_json(cluster, at=(leader + 1) % 3)  # a follower is enough
    assert [m["id"] for m in data["members"]] == ["n1", "n2", "n3"]
    assert data["leader"] == cluster.members[leader].peer.node_id and data["version"] == 0
    table = cli("health", env=env_for(cluster, only=[(leader + 2) % 3]))
    assert table.returncode == 0, table.stderr
    assert "healthy" in table.stdout and all(f"n{i}" in table.stdout for i in (1, 2, 3))
    health = json.loads(cli("health", "-o", "json", env=env_for(cluster)).stdout)
    assert health["healthy"] and {n["id"] for n in health["nodes"]} == {"n1", "n2", "n3"}
    assert all(n["live"] and n["ready"] and n["lag"] is not None for n in health["nodes"])


def test_bad_input_and_unreachable_cluster_give_one_line_errors(cluster: LocalCluster) -> None:
    res = cli("members", "add", "n9", "127.0.0.1:1", "not-an-address", env=env_for(cluster))
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "CLIENT_ADDR" in res.stderr
    res = cli("transfer-leader", env=env_for(cluster, token=None))
    assert res.returncode == 2 and "no admin token" in res.stderr
    res = cli("members", "list", env={})
    assert res.returncode == 2 and "no endpoints" in res.stderr
    res = cli("members", "remove", "n7", env=env_for(cluster))
    assert res.returncode == 1 and "NOT_FOUND" in res.stderr and res.stderr.count("\n") == 1
    dead = "http://127.0.0.1:9"
    res = cli("transfer-leader", "--timeout", "1",
              env={"LIGHTHOUSE_CLUSTER_ENDPOINTS": dead, "LIGHTHOUSE_CLUSTER_ADMIN_TOKEN": TOKEN}, timeout=20)
    assert res.returncode == 1 and "no leader found" in res.stderr
    assert TOKEN not in res.stdout + res.stderr


def test_transfer_leader_to_a_named_node(cluster: LocalCluster) -> None:
    leader = healthy_leader(cluster)
    target = cluster.members[(leader + 1) % 3].peer.node_id
    res = cli("transfer-leader", "--to", target, "-o", "json", env=env_for(cluster))
    assert res.returncode == 0, res.stderr + cluster.tail_logs()
    out = json.loads(res.stdout)
    assert out["leader"] == target and out["previous_leader"] == cluster.members[leader].peer.node_id
    assert cluster.members[healthy_leader(cluster)].peer.node_id == target
    # Any follower (not only the leader) can be asked: the CLI routes to the leader.
    res = cli("transfer-leader", "-o", "json", env=env_for(cluster, only=[leader]))
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["previous_leader"] == target and out["leader"] != target
    table = cli("transfer-leader", env=env_for(cluster))
    assert table.returncode == 0 and "leadership transferred" in table.stdout


def test_snapshot_save_then_restore_into_a_fresh_cluster(cluster: LocalCluster, tmp_path: Path,
                                                         make_cluster) -> None:
    leader = healthy_leader(cluster)
    address = cluster.client_addresses[(leader + 1) % 3]
    second = quorum_call(address, "snap-a")
    assert [m.replica_id for m in second.participants] == ["snap-a"] and second.quorum_id > 0
    file = tmp_path / "backup.json"
    res = cli("snapshot", "save", str(file), "-o", "json", env=env_for(cluster))
    assert res.returncode == 0, res.stderr
    meta = json.loads(res.stdout)
    assert meta["quorum_id"] == second.quorum_id and json.loads(file.read_text())["state"]
    assert file.stat().st_mode & 0o077 == 0
    # The same cluster is at (or past) the snapshot: quorum ids never go backwards.
    res = cli("snapshot", "restore", str(file), env=env_for(cluster))
    assert res.returncode == 1 and "never go backwards" in res.stderr
    # A cluster rebuilt from empty data directories continues after the saved quorum.
    fresh = make_cluster(nodes=1, admin_token=TOKEN)
    fresh.wait_for_leader(timeout=15)
    res = cli("snapshot", "restore", str(file), "-o", "json", env=env_for(fresh))
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == {"applied": True, "quorum_id": second.quorum_id, "previous_quorum_id": 0}
    after = quorum_call(fresh.client_addresses[0], "snap-c")
    assert after.quorum_id > second.quorum_id
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    res = cli("snapshot", "restore", str(bad), env=env_for(fresh))
    assert res.returncode == 2 and "not a lighthouse-cluster snapshot" in res.stderr


def test_add_a_member_route_through_it_and_remove_it(cluster: LocalCluster) -> None:
    leader = healthy_leader(cluster)
    i = cluster.add_node("n4")
    try:
        cluster.start_node(i)
        new = cluster.members[i].peer
        wait_for("n4 answering", lambda: cluster.status(i) is not None, 15, context=cluster)
        term = cluster.status(leader).term
        res = cli("members", "add", new.node_id, new.raft_address, new.client_address, "-o", "json",
                  env=env_for(cluster, only=[0, 1, 2]))
        assert res.returncode == 0, res.stderr + cluster.tail_logs()
        assert [m["id"] for m in json.loads(res.stdout)["members"]] == ["n1", "n2", "n3", "n4"]
        # The new member catches up and follows the leader; every node routes with the new table.
        wait_for("n4 following the leader, connected to every member",
                 lambda: (st := cluster.status(i)) is not None and st.leader_id == cluster.members[leader].peer.node_id
                 and st.members_version >= 1 and st.ready and all(p.connected for p in st.peers), 10, context=cluster)
        for j in range(4):
            assert [m["id"] for m in members_json(cluster, at=j)["members"]] == ["n1", "n2", "n3", "n4"]
        # Waiting to be added, n4 started no election of its own: nobody was deposed.
        assert cluster.status(leader).term == term and cluster.status(leader).role == cpb.LEADER
        assert "taking part in elections from now on" in cluster.members[i].log_path.read_text()
        # n4 leads: the old members learn its client address from the table and forward to it.
        res = cli("transfer-leader", "--to", "n4", env=env_for(cluster))
        assert res.returncode == 0, res.stderr + cluster.tail_logs()
        before = cluster.status(0).quorum.quorum_id
        q = quorum_call(cluster.client_addresses[0], "via-n1")
        assert [m.replica_id for m in q.participants] == ["via-n1"] and q.quorum_id > before
        assert cluster.status(i).quorum.quorum_id == q.quorum_id  # issued by n4, the leader
        res = cli("members", "remove", "n4", env=env_for(cluster))
        assert res.returncode == 1 and "transfer-leader" in res.stderr
        assert cli("transfer-leader", "--to", "n1", env=env_for(cluster)).returncode == 0
        res = cli("members", "remove", "n4", "-o", "json", env=env_for(cluster, only=[0, 1, 2]))
        assert res.returncode == 0, res.stderr
        assert [m["id"] for m in json.loads(res.stdout)["members"]] == ["n1", "n2", "n3"]
        # The removed node hears nothing more while the others keep committing.
        frozen = cluster.status(i).commit_index
        quorum_call(cluster.client_addresses[1], "after-removal")
        wait_for("the members committing past n4",
                 lambda: all((st := cluster.status(j)) is not None and st.commit_index > frozen for j in range(3)), 10,
                 context=cluster)
        assert cluster.status(i).commit_index == frozen
    finally:
        cluster.kill(i)
    # The table survives a restart: n2 comes back with its --peer list but the persisted table.
    assert json.loads((cluster.members[1].data_dir / "members.json").read_text())["version"] == 2
    cluster.members.pop()
    cluster.nodes = 3
    cluster.restart(1)
    wait_for("n2 back with member table version 2",
             lambda: (st := cluster.status(1)) is not None and st.members_version == 2 and st.ready, 15,
             context=cluster)
    st = cluster.status(healthy_leader(cluster))
    assert st.role == cpb.LEADER and st.members_version == 2, st


def test_health_fails_while_a_node_is_down(cluster: LocalCluster) -> None:
    leader = healthy_leader(cluster)
    victim = (leader + 1) % 3
    cluster.kill(victim)
    try:
        res = cli("health", "-o", "json", "--timeout", "0.5", env=env_for(cluster, only=[leader]))
        assert res.returncode == 1
        out = json.loads(res.stdout)
        assert not out["healthy"]
        assert any(cluster.members[victim].peer.node_id in p for p in out["problems"])
        assert "does not answer" in res.stderr
    finally:
        cluster.start_node(victim)
    healthy_leader(cluster, timeout=15)


def test_sigterm_on_the_leader_hands_over_without_failing_clients(cluster: LocalCluster) -> None:
    leader = healthy_leader(cluster)
    follower = (leader + 1) % 3
    old_term = cluster.status(leader).term
    errors: list[str] = []
    done: list[int] = []
    stop = threading.Event()

    def client() -> None:  # a trainer asking a follower for quorums throughout
        step = 0
        while not stop.is_set():
            try:
                quorum_call(cluster.client_addresses[follower], "sigterm-client", step=step, timeout=5)
                done.append(step)
            except grpc.RpcError as e:
                errors.append(f"{e.code().name}: {e.details()}")
            step += 1
            time.sleep(0.01)

    t = threading.Thread(target=client, daemon=True)
    t.start()
    try:
        wait_for("the client's first quorums", lambda: len(done) >= 3, 10, context=cluster)
        before = len(done)
        started = time.monotonic()
        code = cluster.stop(leader, timeout=10)
        exited_after = time.monotonic() - started
        assert code == 0
        log = cluster.members[leader].log_path.read_text()
        assert "leadership handed over before shutdown" in log, log[-2000:]
        # Elected before the old leader exited: a follower already serves in a newer term.
        new = wait_for("a new leader", cluster.leader_index, 1.0, context=cluster, ready=not_none)
        assert cluster.status(new).term > old_term
        wait_for("quorums after the handover", lambda: len(done) >= before + 3, 10, context=cluster)
    finally:
        stop.set()
        t.join(timeout=10)
    assert exited_after < 5
    assert errors == []
    cluster.start_node(leader)
    healthy_leader(cluster, timeout=15)
