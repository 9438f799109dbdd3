"""The rendezvous key-value store (issue 34 part 1) against real node processes on loopback: writes
through a follower, two clients racing a compare-and-set (exactly one wins), a retried write
applied once, refusals with a clear status, namespace isolation, the `rendezvous` commands, a
Wait that outlives the leader it waited on, and expiry of idle namespaces by the leader.

One 3-node cluster serves the module (the leader-kill test runs last and restarts its node); the
expiry test has a one-node cluster of its own with a short idle expiry."""

from __future__ import annotations

import json
import threading
from typing import Iterator

import grpc
import pytest

from support.cluster import cli, started_cluster
from support.waiting import wait_for
from lighthouse_cluster.client.kv_client import KVClient, KVCluster, KVError
from lighthouse_cluster.local.cluster import LocalCluster
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import lighthouse_cluster_pb2_grpc as cpb_grpc

pytestmark = pytest.mark.integration

TOKEN = "kv-admin-token-for-tests-51c2"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with started_cluster(tmp_path_factory.mktemp("kv"), admin_token=TOKEN, election_timeout_ms=150) as c:
        yield c


def endpoints(cluster: LocalCluster) -> str:
    return ",".join(f"http://{a}" for i, a in enumerate(cluster.client_addresses) if cluster.members[i].running)


def client(cluster: LocalCluster, run: str, job: str = "train") -> KVClient:
    return KVClient(endpoints(cluster), job, run, token=TOKEN, timeout=20.0)


def stub_at(address: str) -> tuple[grpc.Channel, cpb_grpc.LighthouseKVStub]:
    ch = grpc.insecure_channel(address)
    return ch, cpb_grpc.LighthouseKVStub(ch)


def follower_address(cluster: LocalCluster) -> str:
    leader, _term = cluster.wait_for_stable_leader(timeout=30)
    return next(a for i, a in enumerate(cluster.client_addresses) if i != leader and cluster.members[i].running)


def test_operations_and_versions(cluster: LocalCluster) -> None:
    with client(cluster, "ops") as kv:
        assert kv.get("missing") is None
        first = kv.set("state", b"v1")
        assert kv.get("state") == first and first.version > 0
        lost = kv.compare_and_set("state", b"v2", expected_version=first.version + 1000)
        assert not lost.applied and lost.entry == first
        won = kv.compare_and_set("state", b"v2", expected_version=first.version)
        assert won.applied and won.entry is not None and won.entry.version > first.version
        assert kv.compare_and_set("torch", b"a", expected_value=b"").applied
        assert kv.compare_and_set("torch", b"b", expected_value=b"a").entry.value == b"b"  # type: ignore[union-attr]
        assert kv.add("counter", 3) == 3 and kv.add("counter", -1) == 2
        assert kv.get("counter").value == b"2"  # type: ignore[union-attr]
        keys, total = kv.list()
        assert [e.key for e in keys] == ["counter", "state", "torch"] and total == 3 == kv.num_keys()
        assert kv.delete("torch") and not kv.delete("torch")
        assert kv.wait(["state", "counter"], timeout=5).ready


def test_a_write_through_a_follower_is_forwarded(cluster: LocalCluster) -> None:
    ch, stub = stub_at(follower_address(cluster))
    with ch:
        ns = cpb.KVNamespace(job="train", run_id="forwarded")
        r = stub.Set(cpb.KVSetRequest(ns=ns, key="k", value=b"via follower", request_id="f-1"), timeout=10)
        assert r.applied and r.entry.version > 0
        got = stub.Get(cpb.KVGetRequest(ns=ns, key="k"), timeout=10)
        assert got.found and got.entry.value == b"via follower"
        # The same request id again: answered with the first outcome, not applied twice.
        again = stub.Set(cpb.KVSetRequest(ns=ns, key="k", value=b"via follower", request_id="f-1"), timeout=10)
        assert again.duplicate and again.entry.version == r.entry.version


def test_two_clients_racing_a_compare_and_set_one_wins(cluster: LocalCluster) -> None:
    results: dict[str, bool] = {}
    start = threading.Barrier(2)

    def race(name: str) -> None:
        with client(cluster, "race") as kv:
            start.wait(timeout=10)
            results[name] = kv.compare_and_set("leader", name.encode(), expected_version=0).applied

    threads = [threading.Thread(target=race, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(results.values()) == [False, True]
    winner = next(n for n, won in results.items() if won)
    with client(cluster, "race") as kv:
        assert kv.get("leader").value == winner.encode()  # type: ignore[union-attr]


def test_refusals_carry_a_status_and_a_message(cluster: LocalCluster) -> None:
    with client(cluster, "limits") as kv:
        with pytest.raises(KVError) as big:
            kv.set("k", b"x" * (256 * 1024 + 1))
        assert big.value.code == grpc.StatusCode.INVALID_ARGUMENT and "limit is 262144" in str(big.value)
        with pytest.raises(KVError) as long_key:
            kv.set("k" * 600, b"v")
        assert long_key.value.code == grpc.StatusCode.INVALID_ARGUMENT and "bytes" in str(long_key.value)
        kv.set("text", b"abc")
        with pytest.raises(KVError) as not_int:
            kv.add("text", 1)
        assert not_int.value.code == grpc.StatusCode.FAILED_PRECONDITION and "integer" in str(not_int.value)
    with pytest.raises(KVError) as bad_run:
        client(cluster, "bad run id").set("k", b"v")
    assert bad_run.value.code == grpc.StatusCode.INVALID_ARGUMENT and "run id" in str(bad_run.value)
    ch, stub = stub_at(follower_address(cluster))
    with ch, pytest.raises(grpc.RpcError) as both:
        stub.CompareAndSet(cpb.KVCompareAndSetRequest(ns=cpb.KVNamespace(job="train", run_id="x"), key="k"),
                           timeout=10)
    assert both.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "exactly one" in both.value.details()


def test_namespaces_are_isolated(cluster: LocalCluster) -> None:
    with client(cluster, "iso-1") as one, client(cluster, "iso-2") as two, client(cluster, "iso-1", "other") as three:
        one.set("shared-name", b"one")
        two.set("shared-name", b"two")
        assert one.get("shared-name").value == b"one" and two.get("shared-name").value == b"two"  # type: ignore[union-attr]
        assert three.get("shared-name") is None and three.num_keys() == 0
        assert one.add("n", 1) == 1 and two.add("n", 1) == 1


def test_rendezvous_commands(cluster: LocalCluster) -> None:
    with client(cluster, "cli-run") as kv:
        kv.set("a", b"hello")
        kv.set("b", b"\xff\x00")
    env = {"LIGHTHOUSE_CLUSTER_ENDPOINTS": endpoints(cluster)}
    listed = cli("rendezvous", "list", "-o", "json", env=env)
    assert listed.returncode == 0, listed.stderr
    rows = {(n["job"], n["run_id"]): n for n in json.loads(listed.stdout)["namespaces"]}
    assert rows[("train", "cli-run")]["keys"] == 2
    shown = cli("rendezvous", "show", "train", "cli-run", "-o", "json", env=env)
    assert shown.returncode == 0, shown.stderr
    keys = json.loads(shown.stdout)["keys"]
    assert keys[0] == {"key": "a", "version": keys[0]["version"], "value": "hello"} and "value_base64" in keys[1]
    table = cli("rendezvous", "show", "train", "cli-run", env=env)
    assert table.returncode == 0 and "hello" in table.stdout
    no_token = cli("rendezvous", "remove", "train", "cli-run", env=env)
    assert no_token.returncode == 2 and "admin token" in no_token.stderr
    removed = cli("rendezvous", "remove", "train", "cli-run", "-o", "json",
                  env={**env, "LIGHTHOUSE_CLUSTER_ADMIN_TOKEN": TOKEN})
    assert removed.returncode == 0, removed.stderr
    assert json.loads(removed.stdout) == {"job": "train", "run_id": "cli-run", "removed": True, "keys": 2}
    with client(cluster, "cli-run") as kv:
        assert kv.num_keys() == 0


def test_a_wait_survives_its_leader_dying(cluster: LocalCluster) -> None:
    """Last: kills the leader (and restarts it)."""
    leader, _term = cluster.wait_for_stable_leader(timeout=30)
    addresses = cluster.client_addresses
    # The waiter asks the leader first: the node its wait is on dies under it.
    ordered = [addresses[leader]] + [a for i, a in enumerate(addresses) if i != leader]
    waiter = KVClient(",".join(f"http://{a}" for a in ordered), "train", "failover", timeout=20.0)
    outcome: dict[str, object] = {}
    waiting = threading.Event()

    def wait() -> None:
        waiting.set()
        outcome["result"] = waiter.wait("go", timeout=30)

    t = threading.Thread(target=wait)
    t.start()
    waiting.wait(timeout=5)
    ch, stub = stub_at(addresses[leader])
    with ch:  # the wait is pending there (a short wait on the same key answers not ready)
        pending = stub.Wait(cpb.KVWaitRequest(ns=cpb.KVNamespace(job="train", run_id="failover"), keys=["go"],
                                              timeout_ms=50), timeout=5)
        assert not pending.ready
    cluster.kill(leader)
    survivors = [i for i in range(cluster.nodes) if i != leader]
    cluster.wait_for_leader(timeout=20, among=survivors)
    with KVClient(",".join(f"http://{addresses[i]}" for i in survivors), "train", "failover", timeout=20.0) as kv:
        written = kv.set("go", b"now")
    t.join(timeout=30)
    waiter.close()
    assert not t.is_alive()
    result = outcome["result"]
    assert result.ready and result.entries[0] == written  # type: ignore[attr-defined]
    assert result.answered_by != cluster.members[leader].peer.node_id  # type: ignore[attr-defined]
    cluster.restart(leader)
    wait_for("the restarted node to follow", lambda: cluster.status(leader) is not None, 20, context=cluster)


def test_idle_namespaces_expire(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("LIGHTHOUSE_CLUSTER_RENDEZVOUS_IDLE_EXPIRY_S", "1.0")  # serve --rendezvous-idle-expiry-s
    c = LocalCluster(root=tmp_path, nodes=1, admin_token=TOKEN)
    try:
        c.start()
        c.wait_for_leader(timeout=20)
        with KVCluster(f"http://{c.client_addresses[0]}", timeout=20.0) as kvc:
            kvc.namespace("train", "short").set("k", b"v")
            assert [n.run_id for n in kvc.list_namespaces("train")] == ["short"]
            wait_for("the idle namespace to expire", lambda: kvc.list_namespaces("train") == [], 10, context=c)
            assert kvc.namespace("train", "short").get("k") is None
    finally:
        c.stop_all()
