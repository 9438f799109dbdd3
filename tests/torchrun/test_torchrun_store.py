"""``LighthouseKVStore`` and ``LighthouseRendezvousBackend`` in this process against a real 3-node
cluster: the Store semantics torch's agents rely on, called through a ``PrefixStore`` (so through
the C++ dispatch to Python, as the handler does), and the backend's compare-and-set with the
version as token; refusals (an oversized value, a garbage state) are clear and change nothing;
the rounds torch's states reach, as every node's /metrics, /rendezvous.json and `rendezvous list`
show them from the states' summary lines."""

from __future__ import annotations

import json
import pickle
import threading
import time
import urllib.request
from datetime import timedelta
from typing import Any, Iterator

import pytest
import torch.distributed as dist
from prometheus_client.parser import text_string_to_metric_families
from torch.distributed.elastic.rendezvous.api import RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from support.cluster import cli, started_cluster
from support.waiting import wait_for
from ftclient.torchrun_rendezvous.kv_store import LighthouseKVStore
from ftclient.torchrun_rendezvous.state_backend import STATE_HEADER, STATE_KEY, LighthouseRendezvousBackend
from lighthouse_cluster.client.kv_client import KVClient
from lighthouse_cluster.local.cluster import LocalCluster, free_ports

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with started_cluster(tmp_path_factory.mktemp("store-cluster"), election_timeout_ms=150,
                         http_ports=free_ports(3)) as c:
        yield c


def kv_of(cluster: LocalCluster, run_id: str) -> KVClient:
    return KVClient(cluster.endpoints, "default", run_id, timeout=20.0)


def test_store_semantics_through_a_prefix_store(cluster: LocalCluster) -> None:
    with kv_of(cluster, "store-ops") as kv:
        raw = LighthouseKVStore(kv, timeout=timedelta(seconds=5))
        store = dist.PrefixStore("round.0", raw)
        store.set("a", "one")
        assert store.get("a") == b"one"
        assert store.add("n", 3) == 3 and store.add("n", -1) == 2
        # compare_set: b"" expects absence; a mismatch answers what is there.
        assert store.compare_set("c", "", "first") == b"first"
        assert store.compare_set("c", "wrong", "second") == b"first"
        assert store.compare_set("c", "first", "second") == b"second"
        assert store.compare_set("absent", "x", "y") == b"x"  # TCPStore's answer for an absent key
        assert store.check(["a", "n"]) and not store.check(["a", "missing"])
        store.multi_set(["m1", "m2"], ["v1", "v2"])
        assert store.multi_get(["m1", "m2"]) == [b"v1", b"v2"]
        assert store.num_keys() == raw.num_keys() == kv.num_keys() == 5
        assert store.delete_key("m1") and not store.delete_key("m1")
        assert kv.get("round.0/a").value == b"one"  # type: ignore[union-attr]


def test_get_and_wait_block_until_the_key_exists_or_time_out(cluster: LocalCluster) -> None:
    with kv_of(cluster, "store-waits") as kv, kv_of(cluster, "store-waits") as writer:
        # The Python store must outlive the PrefixStore's use of it (pybind keeps only the C++
        # part alive; torch's handler holds its store for its lifetime too).
        raw = LighthouseKVStore(kv, timeout=timedelta(seconds=10))
        store = dist.PrefixStore("p", raw)
        timer = threading.Timer(0.5, lambda: writer.set("p/late", b"here"))
        timer.start()
        started = time.monotonic()
        try:
            assert store.get("late") == b"here"
        finally:
            timer.join()
        assert 0.4 < time.monotonic() - started < 8
        store.wait(["late"])
        with pytest.raises(dist.DistStoreError, match=r"wait timeout after 0.3 s for keys \['p/never'\]"):
            store.wait(["never"], timedelta(seconds=0.3))
        store.set_timeout(timedelta(seconds=0.3))
        with pytest.raises(dist.DistStoreError, match="wait timeout"):
            store.get("never")


def test_an_oversized_value_is_refused_and_the_old_one_kept(cluster: LocalCluster) -> None:
    with kv_of(cluster, "store-limits") as kv:
        store = LighthouseKVStore(kv)
        store.set("k", b"small")
        with pytest.raises(dist.DistStoreError) as e:
            store.set("k", b"x" * (256 * 1024 + 1))
        assert "rendezvous store default/store-limits: set 'k': INVALID_ARGUMENT" in str(e.value)
        assert "limit is 262144" in str(e.value) and "\n" not in str(e.value)
        assert store.get("k") == b"small"
        backend = LighthouseRendezvousBackend(kv)
        state, token, ok = backend.set_state(b"state-1")  # type: ignore[misc]
        assert ok and state == b"state-1"
        with pytest.raises(RendezvousStateError, match="write of 262145 bytes refused: INVALID_ARGUMENT"):
            backend.set_state(b"x" * (256 * 1024 + 1), token)
        assert backend.get_state() == (b"state-1", token)


def test_the_backend_compares_and_sets_on_the_version(cluster: LocalCluster) -> None:
    with kv_of(cluster, "backend") as kv:
        a, b = LighthouseRendezvousBackend(kv), LighthouseRendezvousBackend(kv)
        assert a.get_state() is None and a.name == "lighthouse"
        state, token, ok = a.set_state(b"from a")  # type: ignore[misc]
        assert ok and state == b"from a"
        # Without a token: only when there is no state yet; else the state there and its token.
        assert b.set_state(b"from b") == (b"from a", token, False)
        state, newer, ok = b.set_state(b"from b", token)  # type: ignore[misc]
        assert ok and newer > token
        assert a.set_state(b"stale", token) == (b"from b", newer, False)
        assert a.set_state(b"foreign", "not-a-version") == (b"from b", newer, False)
        assert a.get_state() == (b"from b", newer)


def test_a_garbage_state_is_a_clear_error_and_is_kept(cluster: LocalCluster) -> None:
    with kv_of(cluster, "garbage-state") as kv:
        kv.set(STATE_KEY, b"\x80\x04garbage")
        backend = LighthouseRendezvousBackend(kv)
        with pytest.raises(RendezvousStateError, match="not a rendezvous state written by the lighthouse backend"):
            backend.get_state()
        with pytest.raises(RendezvousStateError, match="not a rendezvous state"):
            backend.set_state(b"mine")  # the compare-and-set fails and answers the garbage
        assert kv.get(STATE_KEY).value == b"\x80\x04garbage"  # type: ignore[union-attr]


def http_get(cluster: LocalCluster, i: int, path: str) -> bytes:
    with urllib.request.urlopen(f"http://{cluster.http_address(i)}{path}", timeout=5) as r:
        return r.read()  # type: ignore[no-any-return]


def rendezvous_metrics(cluster: LocalCluster, i: int) -> tuple[float, float]:
    """(lighthouse_cluster_rendezvous_runs, lighthouse_cluster_rendezvous_rounds_total) of node ``i``."""
    samples = {s.name: s.value for f in text_string_to_metric_families(http_get(cluster, i, "/metrics").decode())
               for s in f.samples}
    return samples["lighthouse_cluster_rendezvous_runs"], samples["lighthouse_cluster_rendezvous_rounds_total"]


def test_rounds_show_on_every_nodes_metrics_dashboard_json_and_rendezvous_list(cluster: LocalCluster) -> None:
    nodes = range(len(cluster.members))
    before = [rendezvous_metrics(cluster, i) for i in nodes]
    a, b, c = (_NodeDesc(f"host-{x}", 100, 0) for x in "abc")
    state = _RendezvousState()

    with kv_of(cluster, "rounds") as kv, kv_of(cluster, "old-agent") as old:
        backend = LighthouseRendezvousBackend(kv)
        token = None

        def write(**changes: Any) -> None:
            nonlocal token
            for name, value in changes.items():
                setattr(state, name, value)
            _bits, token, ok = backend.set_state(pickle.dumps(state), token)  # type: ignore[misc]
            assert ok

        write(participants={a: 0})                              # round 0 gathers
        write(participants={a: 0, b: 1}, complete=True)         # round 0 complete
        write(last_heartbeats={a: None})                        # a keep-alive: the same round
        write(wait_list={c})                                    # c waits for the next round
        write(round=1, complete=False, participants={}, wait_list=set())
        write(participants={a: 0, b: 1, c: 2}, complete=True)   # round 1 complete
        # torch gets back exactly the bytes it pickled (the summary line is the backend's).
        bits, version = backend.get_state()  # type: ignore[misc]
        assert bits == pickle.dumps(state) and version == token
        # A state written by an agent without summaries: a run whose round is unknown.
        old.set(STATE_KEY, STATE_HEADER + pickle.dumps(_RendezvousState()))

        # Every node counts the same two completed rounds from the writes it applied.
        wait_for("every node counted the two rounds", lambda: [rendezvous_metrics(cluster, i) for i in nodes],
                 timeout=20, context=cluster,
                 ready=lambda now: all(n[1] - b[1] == 2 and n[0] == b[0] + 2 for n, b in zip(now, before)))

        for i in nodes:
            panel = json.loads(http_get(cluster, i, "/rendezvous.json"))
            runs = {r["run_id"]: r for r in panel["runs"] if r["job"] == "default"}
            assert {k: runs["rounds"][k] for k in ("round", "state", "participants", "waiting", "keys")} == {
                "round": 1, "state": "complete", "participants": 3, "waiting": 0, "keys": 1}
            assert 0 <= runs["rounds"]["write_age_ms"] < 60_000
            assert runs["old-agent"]["state"] == "unknown" and runs["old-agent"]["round"] is None
            assert panel["rounds_completed"] >= 2 and panel["revision"] > 0
        assert sum(json.loads(http_get(cluster, i, "/rendezvous.json"))["kv_calls"] for i in nodes) >= 8

    listed = cli("rendezvous", "list", "--job", "default", "-o", "json", env={"LIGHTHOUSE_CLUSTER_ENDPOINTS":
                                                                             cluster.endpoints})
    assert listed.returncode == 0, listed.stderr
    rows = {n["run_id"]: n for n in json.loads(listed.stdout)["namespaces"]}
    assert (rows["rounds"]["rendezvous"], rows["rounds"]["round"], rows["rounds"]["participants"]) == ("complete", 1, 3)
    assert rows["old-agent"]["rendezvous"] == "unknown" and "round" not in rows["old-agent"]
    table = cli("rendezvous", "list", "--job", "default", env={"LIGHTHOUSE_CLUSTER_ENDPOINTS": cluster.endpoints})
    assert table.returncode == 0 and "1 complete" in table.stdout and "unknown" in table.stdout, table.stdout
