"""`lighthouse-cluster up` and `lighthouse-cluster status` as a user runs them: real processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from support.cluster import cli
from support.pids import job_port_processes
from support.waiting import wait_for
from lighthouse_cluster.local.cluster import free_ports
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.client.admin_client import query_status

pytestmark = pytest.mark.integration


def _pids_of_serve(data_dir: Path) -> list[int]:
    """Node processes started for this data dir (found through /proc, so leaks are visible)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in cmd and str(data_dir).encode() in b" ".join(cmd):
            pids.append(int(entry.name))
    return pids


def _status(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lighthouse_cluster", "status", *args], capture_output=True,
                          text=True, timeout=30, env={**os.environ, **(env or {})})


@contextlib.contextmanager
def _running_up(tmp_path: Path, *args: str, env: dict[str, str] | None = None, span: int = 102,
                args_at: Callable[[int], list[str]] | None = None):
    """`lighthouse-cluster up ARGS` (and ``args_at(base port)``) on free ports (``span`` above the
    base port must be free too), its output in a file; yields (proc, base port, output path, data
    dir) once it printed its endpoints, and stops it (and any node process it left) afterwards."""
    while True:
        base = free_ports(1)[0]
        if base + span < 65535:
            break
    out = tmp_path / "up.out"
    data = tmp_path / "data"
    with open(out, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lighthouse_cluster", "up", "--bind", f"127.0.0.1:{base}", "--min_replicas", "1",
             "--data-dir", str(data), *args, *(args_at(base) if args_at else ())],
            stdout=f, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})
    try:
        wait_for("up to print endpoints",
                 lambda: "Ctrl-C stops every node." in out.read_text() or proc.poll() is not None, 40)
        assert proc.poll() is None, out.read_text()
        yield proc, base, out, data
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        for pid in _pids_of_serve(data):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture()
def up_cluster(tmp_path: Path):
    """`lighthouse-cluster up` with torchft_lighthouse-style flags; yields (proc, ports, output path, data dir)."""
    up = _running_up(tmp_path, "--join_timeout_ms", "1000", "--heartbeat_timeout_ms", "2000")
    with up as (proc, base, out, data):
        yield proc, [base, base + 1, base + 2], out, data


def test_up_prints_endpoints_and_status_sees_the_cluster(up_cluster) -> None:
    proc, ports, out, data = up_cluster
    text = out.read_text()
    assert f"export TORCHFT_LIGHTHOUSE=http://127.0.0.1:{ports[0]}" in text
    endpoints = ",".join(f"http://127.0.0.1:{p}" for p in ports)
    assert f"export TORCHFT_LIGHTHOUSE={endpoints}" in text
    # Raft takes client port + 100, as documented.
    assert f"127.0.0.1:{ports[0] + 100}" in text

    # One endpoint is enough: status discovers the others.
    res = _status("--endpoints", f"http://127.0.0.1:{ports[1]}", "--output", "json")
    assert res.returncode == 0, res.stderr
    view = json.loads(res.stdout)
    assert view["leader"] in {"n1", "n2", "n3"}
    assert sorted(n["id"] for n in view["nodes"]) == ["n1", "n2", "n3"]
    assert all(n["reachable"] for n in view["nodes"])
    assert [n["role"] for n in view["nodes"]].count("leader") == 1
    leader_row = next(n for n in view["nodes"] if n["id"] == view["leader"])
    assert {n["term"] for n in view["nodes"]} == {leader_row["term"]}
    assert view["quorum"] is None
    assert view["settings"]["join_timeout_ms"] == 1000

    # Endpoints may come from TORCHFT_LIGHTHOUSE; the table names the leader.
    res = _status(env={"TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{ports[0]}", "COLUMNS": "200"})
    assert res.returncode == 0, res.stderr
    assert f"leader: {view['leader']}" in res.stdout
    assert "quorum: none issued yet" in res.stdout


def test_status_shows_quorum_and_heartbeats(up_cluster) -> None:
    import asyncio

    from lighthouse_cluster.local.simulated_group import SimulatedReplicaGroup

    proc, ports, out, data = up_cluster
    steps = {"replica_0": 7, "replica_1": 8}

    async def one_round() -> list[SimulatedReplicaGroup]:
        groups = [SimulatedReplicaGroup(rid, f"127.0.0.1:{ports[i]}", quorum_timeout_s=10)
                  for i, rid in enumerate(steps)]
        for g in groups:
            g.step = steps[g.replica_id]
        await asyncio.gather(*(g.run(rounds=1) for g in groups))
        await asyncio.gather(*(g.close() for g in groups))
        assert all(g.rounds[0].quorum_id for g in groups), [g.rounds for g in groups]
        return groups

    started = time.monotonic()
    rounds = [g.rounds[0] for g in asyncio.run(one_round())]
    res = _status("--endpoints", f"127.0.0.1:{ports[2]}", "-o", "json")
    elapsed_ms = (time.monotonic() - started) * 1000
    assert res.returncode == 0, res.stderr
    view = json.loads(res.stdout)
    # The quorum shown is the last one issued (both groups in one, or each in its own), with the
    # steps its members sent.
    last = max(rounds, key=lambda r: r.quorum_id)
    q = view["quorum"]
    assert q is not None and q["quorum_id"] == last.quorum_id, (q, rounds)
    assert {p["replica_id"]: p["step"] for p in q["participants"]} == {r: steps[r] for r in last.participants}
    assert {h["replica_id"] for h in view["heartbeats"]} == {"replica_0", "replica_1"}
    assert all(0 <= h["age_ms"] <= elapsed_ms for h in view["heartbeats"]), (view["heartbeats"], elapsed_ms)
    # The first quorum of a member set is always committed, so each group's one round was a
    # commit (one per distinct quorum) and none went out on the lease.
    assert view["rounds"] == {"commit": len({r.quorum_id for r in rounds}), "lease": 0}, (view["rounds"], rounds)
    assert view["settings"]["quorum_lease_ms"] == 150
    res = _status("--endpoints", f"127.0.0.1:{ports[2]}", env={"COLUMNS": "200"})
    assert f"quorum {q['quorum_id']}" in res.stdout and "replica_0" in res.stdout and "heartbeat: replica_id=replica_0 age_ms=" in res.stdout
    assert "on the leader lease" in res.stdout and "(lease 150 ms)" in res.stdout


@pytest.fixture()
def up_cluster_no_restart(tmp_path: Path):
    """As ``up_cluster``, with --no-restart: nodes the test kills stay dead."""
    up = _running_up(tmp_path, "--join_timeout_ms", "1000", "--heartbeat_timeout_ms", "2000", "--no-restart")
    with up as (proc, base, out, data):
        yield proc, [base, base + 1, base + 2], out, data


def test_status_exits_1_without_a_leader_and_up_stops_every_node(up_cluster_no_restart) -> None:
    proc, ports, out, data = up_cluster_no_restart
    pids = _pids_of_serve(data)
    assert len(pids) == 3
    # Kill two of three nodes: the survivor cannot know a leader.
    survivors = []
    for pid in pids:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if cmd[cmd.index(b"--node-id") + 1] == b"n1":
            survivors.append(pid)
        else:
            os.kill(pid, signal.SIGKILL)
    assert len(survivors) == 1

    def leaderless():
        st = query_status(f"127.0.0.1:{ports[0]}", timeout=0.5)
        return st is not None and st.role != cpb.LEADER and not st.leader_id

    wait_for("the survivor to lose its leader", leaderless, 15)
    res = _status("--endpoints", f"127.0.0.1:{ports[0]}", "-o", "json")
    assert res.returncode == 1
    assert "no leader is known" in res.stderr
    view = json.loads(res.stdout)
    assert view["leader"] is None
    assert {n["id"]: n["reachable"] for n in view["nodes"]} == {"n1": True, "n2": False, "n3": False}

    # SIGTERM to `up` stops the remaining node and `up` exits.
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    wait_for("every node process to exit", lambda: not _pids_of_serve(data), 15)


def test_up_with_mutual_tls_and_an_admin_token(tmp_path: Path) -> None:
    """`up --mtls --admin-token`: the printed variables are all a client needs."""
    token = "up-token-0c1d"
    up = _running_up(tmp_path, "--mtls", env={"LIGHTHOUSE_CLUSTER_ADMIN_TOKEN": token}, span=202)
    with up as (_proc, base, out, _data):
        text = out.read_text()
        exports = dict(line.strip().removeprefix("export ").split("=", 1) for line in text.splitlines()
                       if line.strip().startswith("export LIGHTHOUSE_CLUSTER_TLS_"))
        assert set(exports) == {"LIGHTHOUSE_CLUSTER_TLS_CA", "LIGHTHOUSE_CLUSTER_TLS_CLIENT_CERT",
                                "LIGHTHOUSE_CLUSTER_TLS_CLIENT_KEY"}
        endpoints = ",".join(f"https://127.0.0.1:{base + i}" for i in range(3))
        assert f"export TORCHFT_LIGHTHOUSE={endpoints}" in text and token not in text
        res = _status("--endpoints", endpoints, "-o", "json", env=exports)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["leader"] in {"n1", "n2", "n3"}
        res = _status("--endpoints", endpoints, "--timeout", "0.5",
                      env={"LIGHTHOUSE_CLUSTER_TLS_CA": exports["LIGHTHOUSE_CLUSTER_TLS_CA"]})
        assert res.returncode == 1 and "no node answered" in res.stderr  # no client certificate
        res = subprocess.run([sys.executable, "-m", "lighthouse_cluster", "transfer-leader", "-o", "json"],
                             capture_output=True, text=True, timeout=30,
                             env={**os.environ, **exports, "LIGHTHOUSE_CLUSTER_ENDPOINTS": endpoints,
                                  "LIGHTHOUSE_CLUSTER_ADMIN_TOKEN": token})
        assert res.returncode == 0, res.stderr


def test_up_job_creates_the_jobs_and_prints_what_trainers_set(tmp_path: Path) -> None:
    """`up --job NAME=PORT --job NAME --job-port-processes`: the jobs exist once `up` printed its
    banner, node i serves the first on PORT + i (from a port process of its own), and the banner
    says what a torchft and an ftclient trainer set; without --admin-token the run's own token is
    in a file only its user reads."""
    up = _running_up(tmp_path, "--job", "train-b", "--job-port-processes",
                     args_at=lambda base: ["--job", f"train-a={base + 50}"])
    with up as (_proc, base, out, data):
        text = out.read_text()
        port = base + 50
        endpoints = ",".join(f"http://127.0.0.1:{base + i}" for i in range(3))
        lines = text.splitlines()
        at = lines.index(f"job train-a (n1={port}, n2={port + 1}, n3={port + 2}):")
        assert lines[at + 1:at + 3] == [
            f"  torchft trainers:  export TORCHFT_LIGHTHOUSE=http://127.0.0.1:{port}",
            f"  ftclient trainers: export TORCHFT_LIGHTHOUSE={endpoints} LIGHTHOUSE_JOB=train-a"]
        assert "job train-b (no own port):" in lines
        assert f"  ftclient trainers: export TORCHFT_LIGHTHOUSE={endpoints} LIGHTHOUSE_JOB=train-b" in lines
        token_file = data / "admin-token"
        assert f"  export LIGHTHOUSE_CLUSTER_ADMIN_TOKEN=$(cat {token_file})" in lines
        token = token_file.read_text().strip()
        assert len(token) >= 24 and token not in text and token_file.stat().st_mode & 0o777 == 0o600

        res = cli("jobs", "list", "-o", "json", env={"LIGHTHOUSE_CLUSTER_ENDPOINTS": endpoints})
        assert res.returncode == 0, res.stderr
        jobs = {j["name"]: j for j in json.loads(res.stdout)["jobs"]}
        assert set(jobs) == {"default", "train-a", "train-b"}
        assert jobs["train-a"]["ports"] == [{"node_id": f"n{i + 1}", "port": port + i} for i in range(3)]
        assert jobs["train-b"]["ports"] == [] and jobs["train-a"]["settings"]["join_timeout_ms"] == 60000
        # One port process per node for train-a (train-b has no port), each under `up`.
        wait_for("train-a's port processes", lambda: len(job_port_processes(_proc.pid)), 20,
                 ready=lambda n: n == 3)
        # The printed token is the cluster's: the job commands work with it.
        res = cli("jobs", "set", "train-b", "--config", "k=v", "-o", "json",
                  env={"LIGHTHOUSE_CLUSTER_ENDPOINTS": endpoints, "LIGHTHOUSE_CLUSTER_ADMIN_TOKEN": token})
        assert res.returncode == 0 and json.loads(res.stdout)["config"] == {"k": "v"}, res.stderr


def test_up_job_values_are_refused_before_anything_starts(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "lighthouse_cluster", "up", "--min_replicas", "1", "--bind",
                          "127.0.0.1:29510", "--data-dir", str(tmp_path / "d"), "--job", "a=29511"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and res.stderr.strip() == \
        "error: --job a=29511: port 29511 is a node's own port already: pick another PORT", res.stderr
    assert not (tmp_path / "d").exists()
