"""`lighthouse-cluster jobs` against a real 3-node cluster with an admin token (#17): add (its JSON
has the settings given and the leader's for the others), list (the default job and two more),
show, set (config set and unset, one setting, ports), remove (refused while a replica group of
the job heartbeats, accepted with --force), every error a one-line reason (exit 2 for what the
node refuses and for bad input, 1 for a cluster that does not answer), `status`'s job rows, and
`jobs list` from a node without a leader saying it is not the leader's view.

One cluster serves the module (starting nodes is the expensive part); the jobs the tests add
have names of their own, and the last test leaves the cluster as it found it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from typing import Iterator

import pytest

from support.cluster import cli, started_cluster
from support.waiting import wait_for
from lighthouse_cluster.local.cluster import LocalCluster, free_ports
from lighthouse_cluster.local.simulated_group import SimulatedReplicaGroup
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb

pytestmark = pytest.mark.integration

TOKEN = "jobs-admin-token-5b1e"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with started_cluster(tmp_path_factory.mktemp("jobs"), admin_token=TOKEN, election_timeout_ms=150,
                         heartbeat_timeout_ms=2000) as c:
        yield c


def env_for(cluster: LocalCluster, token: str | None = TOKEN, only: list[int] | None = None) -> dict[str, str]:
    nodes = only if only is not None else range(cluster.nodes)
    env = {"LIGHTHOUSE_CLUSTER_ENDPOINTS": ",".join(f"http://{cluster.client_addresses[i]}" for i in nodes)}
    if token is not None:
        env["LIGHTHOUSE_CLUSTER_ADMIN_TOKEN"] = token
    return env


def ok_json(cluster: LocalCluster, *args: str) -> dict:
    res = cli(*args, "-o", "json", env=env_for(cluster))
    assert res.returncode == 0, res.stderr + cluster.tail_logs()
    assert TOKEN not in res.stdout + res.stderr
    return json.loads(res.stdout)


def error_line(res, code: int = 2) -> str:  # type: ignore[no-untyped-def]
    """The one line a failed command prints (stdout empty), after checking its exit status."""
    lines = res.stderr.strip().splitlines()
    assert res.returncode == code and len(lines) == 1 and lines[0].startswith("error: "), \
        (res.returncode, res.stdout, res.stderr)
    assert res.stdout == "" and TOKEN not in res.stderr
    return lines[0]


@contextlib.contextmanager
def heartbeating_group(address: str, replica_id: str, job: str) -> Iterator[SimulatedReplicaGroup]:
    """A replica group of ``job`` (through ``address``) that gets one quorum, then heartbeats
    every 100 ms until the block ends; on its own event loop in a thread."""
    stop = threading.Event()
    failure: list[BaseException] = []
    group = SimulatedReplicaGroup(replica_id, address, job=job, quorum_timeout_s=15)

    async def main() -> None:
        try:
            async with group.heartbeating():
                await group.call_quorum()
                while not stop.is_set():
                    await asyncio.sleep(0.02)
        finally:
            await group.close()

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as e:  # reported in the test's thread
            failure.append(e)

    thread = threading.Thread(target=run, name=f"group-{replica_id}", daemon=True)
    thread.start()
    try:
        yield group
    finally:
        stop.set()
        thread.join(timeout=20)
    assert not thread.is_alive(), "the replica group did not stop"
    if failure:
        raise failure[0]


def test_add_then_list_and_show_every_field(cluster: LocalCluster) -> None:
    ports = free_ports(3)
    job = ok_json(cluster, "jobs", "add", "train-a", "--min_replicas", "2", "--join_timeout_ms", "500",
                  "--quorum-lease-ms", "0", "--max-replicas", "64", "--max-member-bytes", "2048",
                  "--config", "lr=0.1", "--config", "opt=adam=beta",
                  *(a for i, p in enumerate(ports) for a in ("--port", f"n{i + 1}={p}")))
    assert job["name"] == "train-a" and job["version"] > 0 and not job["settings_from_flags"]
    assert job["settings"] == {"min_replicas": 2, "join_timeout_ms": 500, "quorum_tick_ms": 100,
                               "heartbeat_timeout_ms": 2000,  # not given: the leader's own flags
                               "quorum_lease_ms": 0, "max_replicas": 64, "max_member_bytes": 2048}
    assert job["ports"] == [{"node_id": f"n{i + 1}", "port": p} for i, p in enumerate(ports)]
    assert job["config"] == {"lr": "0.1", "opt": "adam=beta"} and job["quorum_id"] == 0 and job["quorum"] is None

    shared = free_ports(1)[0]
    res = cli("jobs", "add", "train-b", "--port", str(shared), env=env_for(cluster))
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("job train-b added: name=train-b ") and f"ports={shared}" in res.stdout

    listing = ok_json(cluster, "jobs", "list")
    names = [j["name"] for j in listing["jobs"]]
    assert names[0] == "default" and {"train-a", "train-b"} <= set(names), names
    assert listing["leader_view"] and listing["jobs"][0]["settings_from_flags"]
    assert next(j for j in listing["jobs"] if j["name"] == "train-a")["settings"]["min_replicas"] == 2
    res = cli("jobs", "list", env=env_for(cluster, token=None, only=[1]))  # no token needed, any node asked
    assert res.returncode == 0, res.stderr
    rows = {line.split()[1]: line for line in res.stdout.splitlines() if line.startswith("job: ")}
    assert {"job=default", "job=train-a", "job=train-b"} <= set(rows), res.stdout
    assert rows["job=default"].startswith("job: job=default ports='client port' min=1 quorum_id=")
    assert f"ports=n1={ports[0]},n2={ports[1]},n3={ports[2]} min=2 quorum_id=none members=0 heartbeating=0 " \
           "config=lr,opt" in rows["job=train-a"], rows["job=train-a"]
    assert f"ports={shared} " in rows["job=train-b"] and "not the serving leader" not in res.stdout

    shown = ok_json(cluster, "jobs", "show", "train-a")
    assert {k: shown[k] for k in ("settings", "ports", "config", "version")} == \
        {k: job[k] for k in ("settings", "ports", "config", "version")}
    assert shown["leader_view"] and shown["heartbeats"] == [] and shown["answered_by"]
    res = cli("jobs", "show", "train-a", env=env_for(cluster, token=None))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("job train-a: name=train-a version=") and "join_timeout_ms=500" in lines[0]
    assert "config: key=lr value=0.1" in lines and "config: key=opt value=adam=beta" in lines


def test_set_changes_only_what_is_given(cluster: LocalCluster) -> None:
    before = ok_json(cluster, "jobs", "add", "train-set", "--min_replicas", "2", "--config", "lr=0.1")
    after = ok_json(cluster, "jobs", "set", "train-set", "--config", "batch=32", "--config", "lr=0.2")
    assert after["config"] == {"batch": "32", "lr": "0.2"} and after["version"] > before["version"]
    assert after["settings"] == before["settings"]
    after = ok_json(cluster, "jobs", "set", "train-set", "--unset-config", "batch")
    assert after["config"] == {"lr": "0.2"}
    after = ok_json(cluster, "jobs", "set", "train-set", "--heartbeat_timeout_ms", "900")
    assert after["settings"] == {**before["settings"], "heartbeat_timeout_ms": 900} and after["config"] == {"lr": "0.2"}
    port = free_ports(1)[0]
    assert ok_json(cluster, "jobs", "set", "train-set", "--port", str(port))["ports"] == [{"node_id": "*", "port": port}]
    assert ok_json(cluster, "jobs", "set", "train-set", "--no-ports")["ports"] == []
    res = cli("jobs", "set", "train-set", "--min-replicas", "3", env=env_for(cluster))
    assert res.returncode == 0 and res.stdout.startswith("job train-set changed: ") and "min_replicas=3" in res.stdout
    # The default job: its config can be set, its settings are the nodes' flags.
    assert ok_json(cluster, "jobs", "set", "default", "--config", "team=ml")["config"] == {"team": "ml"}
    line = error_line(cli("jobs", "set", "default", "--min_replicas", "3", env=env_for(cluster)))
    assert "INVALID_ARGUMENT" in line and "only its config can be set" in line


def test_remove_is_refused_while_a_replica_group_heartbeats_unless_forced(cluster: LocalCluster) -> None:
    ok_json(cluster, "jobs", "add", "train-live", "--min_replicas", "1")
    leader = cluster.leader_index()
    follower = next(i for i in range(3) if i != leader)
    with heartbeating_group(cluster.client_addresses[follower], "live-0", "train-live"):
        shown = wait_for("the job's replica group heartbeating, seen by the leader",
                         lambda: (j := ok_json(cluster, "jobs", "show", "train-live"))["heartbeating_replicas"] == 1
                         and j["quorum_id"] > 0 and j, 15, context=cluster)
        assert [p["replica_id"] for p in shown["quorum"]["participants"]] == ["live-0"]
        assert [h["replica_id"] for h in shown["heartbeats"]] == ["live-0"]
        row = next(line for line in cli("jobs", "list", env=env_for(cluster)).stdout.splitlines()
                   if line.startswith("job: job=train-live "))
        assert f"quorum_id={shown['quorum_id']} members=1 heartbeating=1" in row, row
        line = error_line(cli("jobs", "remove", "train-live", env=env_for(cluster)))
        assert "FAILED_PRECONDITION" in line and "live-0" in line and "--force" in line
        assert "train-live" in [j["name"] for j in ok_json(cluster, "jobs", "list")["jobs"]]
        removed = ok_json(cluster, "jobs", "remove", "train-live", "--force")
        assert removed == {"name": "train-live", "last_quorum_id": shown["quorum_id"]}
    assert "train-live" not in [j["name"] for j in ok_json(cluster, "jobs", "list")["jobs"]]
    ok_json(cluster, "jobs", "add", "train-gone")
    res = cli("jobs", "remove", "train-gone", env=env_for(cluster))
    assert res.returncode == 0 and res.stdout.strip() == "job train-gone removed: last_quorum_id=0", res.stdout


@pytest.mark.parametrize("args, token, code, expect", [
    (("jobs", "add", "err-a"), None, 2, "no admin token"),
    (("jobs", "add", "err-a"), "wrong-token", 2, "UNAUTHENTICATED"),
    (("jobs", "remove", "err-a"), "wrong-token", 2, "UNAUTHENTICATED"),
    (("jobs", "show", "no-such-job"), None, 2, "NOT_FOUND: no job 'no-such-job'"),
    (("jobs", "set", "no-such-job", "--config", "a=1"), TOKEN, 2, "NOT_FOUND: no job 'no-such-job'"),
    (("jobs", "remove", "no-such-job"), TOKEN, 2, "NOT_FOUND: no job 'no-such-job'"),
    (("jobs", "add", "default"), TOKEN, 2, "the default job always exists"),
    (("jobs", "remove", "default"), TOKEN, 2, "the default job cannot be removed"),
    (("jobs", "add", "bad name"), TOKEN, 2, "job name 'bad name' must be"),
    (("jobs", "add", "err-a", "--port", "65536"), TOKEN, 2, "port 65536 is outside 1-65535"),
    (("jobs", "add", "err-a", "--heartbeat_timeout_ms", "0"), TOKEN, 2, "heartbeat_timeout_ms must be between"),
    (("jobs", "add", "err-a", "--config", "novalue"), TOKEN, 2, "config 'novalue' is not KEY=VALUE"),
], ids=lambda v: " ".join(v) if isinstance(v, tuple) else str(v))
def test_every_error_is_one_line_naming_the_problem(cluster: LocalCluster, args: tuple[str, ...],
                                                    token: str | None, code: int, expect: str) -> None:
    line = error_line(cli(*args, env=env_for(cluster, token=token)), code)
    assert expect in line, line
    if token == "wrong-token":
        assert "LIGHTHOUSE_CLUSTER_ADMIN_TOKEN" in line and "wrong-token" not in line


def test_a_duplicate_add_is_refused_and_an_unreachable_cluster_exits_1(cluster: LocalCluster) -> None:
    ok_json(cluster, "jobs", "add", "train-dup")
    line = error_line(cli("jobs", "add", "train-dup", env=env_for(cluster)))
    assert "ALREADY_EXISTS: job 'train-dup' exists already (jobs set train-dup ... changes it)" in line
    dead = {"LIGHTHOUSE_CLUSTER_ENDPOINTS": f"http://127.0.0.1:{free_ports(1)[0]}",
            "LIGHTHOUSE_CLUSTER_ADMIN_TOKEN": TOKEN}
    line = error_line(cli("jobs", "add", "x", "--timeout", "1", env=dead), 1)
    assert "no leader found" in line and "nothing listens there" in line
    line = error_line(cli("jobs", "list", "--timeout", "1", env=dead), 1)
    assert "nothing listens there" in line


def test_status_shows_a_row_per_job(cluster: LocalCluster) -> None:
    ok_json(cluster, "jobs", "add", "train-status", "--port", str(free_ports(1)[0]))
    view = ok_json(cluster, "status")
    jobs = {j["name"]: j for j in view["jobs"]}
    assert view["jobs"][0]["name"] == "default" and "train-status" in jobs
    assert jobs["train-status"]["leader_view"] and jobs["train-status"]["heartbeating_replicas"] == 0
    res = cli("status", env=env_for(cluster, token=None))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert sum(line.startswith("node: id=n") for line in lines) == 3  # the rest of status as before
    row = next(line for line in lines if line.startswith("job: job=train-status "))
    assert row.endswith("quorum_id=none members=0 heartbeating=0") and "ports=" in row, row
    assert any(line.startswith("job: job=default ports='client port' ") for line in lines)


def test_jobs_list_without_a_leader_is_another_nodes_view(cluster: LocalCluster) -> None:
    """Last: it kills two nodes, then brings them back."""
    ok_json(cluster, "jobs", "add", "train-alone", "--config", "k=v")
    survivor = 0
    for i in (1, 2):
        cluster.kill(i)
    try:
        wait_for("the survivor to lose its leader",
                 lambda: (st := cluster.status(survivor)) is not None and not st.leader_id
                 and st.role != cpb.LEADER, 15, context=cluster)
        env = env_for(cluster, token=None, only=[survivor])
        listing = json.loads(cli("jobs", "list", "-o", "json", "--timeout", "2", env=env).stdout)
        assert not listing["leader_view"] and listing["answered_by"].startswith("n1 ")
        alone = next(j for j in listing["jobs"] if j["name"] == "train-alone")
        assert alone["config"] == {"k": "v"} and not alone["leader_view"] and alone["heartbeats"] == []
        res = cli("jobs", "list", "--timeout", "2", env=env)
        assert res.returncode == 0, res.stderr
        assert "heartbeating=- " in next(line for line in res.stdout.splitlines() if "job=train-alone" in line)
        assert res.stdout.splitlines()[-1].startswith("answered by n1 (") and "not the serving leader" in res.stdout
        shown = cli("jobs", "show", "train-alone", "--timeout", "2", env=env)
        assert shown.returncode == 0 and "live_view='unknown: not answered by the serving leader'" in shown.stdout
    finally:
        for i in (1, 2):
            cluster.restart(i)
        cluster.wait_for_agreed_leader()
