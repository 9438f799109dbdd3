"""``lighthouse_cluster.LighthouseServer`` (torchft's LighthouseServer API on a 3-node cluster) and
``lighthouse-cluster up --bind HOST:0``: real node processes, torchft 0.2.0's Rust client.

* the server answers torchft's ``LighthouseClient`` (quorum of two replicas, heartbeats) at
  ``address()``, with torchft's defaults, and ``shutdown()`` leaves no process and no directory;
* an explicit port is served by node n1; a busy one is a clear error, before any process starts;
* no node outlives its owner: not when the owner forgets ``shutdown()`` and exits, and not when
  the owner is SIGKILLed (the guardian process);
* ``up --bind 127.0.0.1:0`` picks free ports, prints them, and serves on them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest

from support.waiting import wait_for
from lighthouse_cluster import LighthouseServer
from lighthouse_cluster.local.cluster import free_ports
from lighthouse_cluster.client.admin_client import query_status

pytestmark = pytest.mark.integration


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def _node_pids(server: LighthouseServer) -> list[int]:
    return [m.process.pid for m in server.cluster.members if m.process is not None]


def test_torchft_client_gets_a_quorum_and_shutdown_leaves_nothing() -> None:
    torchft = pytest.importorskip("torchft._torchft", reason="torchft is not installed")
    server = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        pids = _node_pids(server)
        guardian = server.cluster.guardian.process.pid
        assert len(pids) == 3 and all(_alive(p) for p in pids) and _alive(guardian)
        address = server.address()
        assert address.startswith("http://") and int(address.rsplit(":", 1)[1]) > 0
        print(f"\nLighthouseServer('[::]:0') served at {address} after {server.start_seconds:.2f}s")

        # torchft's LighthouseServer defaults for what was not given, as every node reports them (the
        # Python class's join timeout is 100 ms; torchft_lighthouse's command line has 60000).
        for i in range(3):
            st = query_status(server.cluster.client_addresses[i], 2.0)
            assert st is not None
            s = st.settings
            assert (s.min_replicas, s.join_timeout_ms, s.quorum_tick_ms, s.heartbeat_timeout_ms) == (2, 100, 100, 5_000)

        # Two replicas through torchft's own Rust client, at address(): one quorum of both.
        results: dict[str, object] = {}

        def ask(rid: str) -> None:
            client = torchft.LighthouseClient(addr=address, connect_timeout=timedelta(seconds=5))
            client.heartbeat(rid, timeout=timedelta(seconds=5))
            try:
                results[rid] = client.quorum(replica_id=rid, timeout=timedelta(seconds=20), address=f"a-{rid}",
                                             store_address=f"s-{rid}", step=3, world_size=1, shrink_only=False,
                                             data={"rid": rid})
            except Exception as e:  # noqa: BLE001 -- asserted below
                results[rid] = e

        threads = [threading.Thread(target=ask, args=(rid,)) for rid in ("r0", "r1")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "quorum calls still running after 30 s"
        quorums = [results["r0"], results["r1"]]
        assert all(isinstance(q, torchft.Quorum) for q in quorums), quorums
        assert quorums[0].quorum_id == quorums[1].quorum_id
        for q in quorums:
            assert sorted(p.replica_id for p in q.participants) == ["r0", "r1"]
            assert {p.replica_id: p.data for p in q.participants} == {"r0": {"rid": "r0"}, "r1": {"rid": "r1"}}
        root = server.root
        assert root.is_dir()
    finally:
        server.shutdown()
    assert not server.alive
    assert not any(_alive(p) for p in pids), "a node process outlived shutdown()"
    assert not _alive(guardian), "the guardian outlived shutdown()"
    assert not root.exists(), "the data directory outlived shutdown()"
    server.shutdown()  # idempotent


@pytest.mark.exclusive  # looks for node processes machine-wide: runs alone
def test_explicit_port_is_node_n1_and_a_busy_port_is_a_clear_error() -> None:
    port = free_ports(1)[0]
    with LighthouseServer(bind=f"127.0.0.1:{port}", min_replicas=1, join_timeout_ms=100,
                          quorum_tick_ms=50, heartbeat_timeout_ms=1000) as server:
        assert server.address() == f"http://127.0.0.1:{port}"
        assert server.cluster.client_addresses[0] == f"127.0.0.1:{port}"
        st = query_status(f"127.0.0.1:{port}", 2.0)
        assert st is not None and st.leader_id in {"n1", "n2", "n3"}
        assert (st.settings.join_timeout_ms, st.settings.quorum_tick_ms, st.settings.heartbeat_timeout_ms) == (
            100, 50, 1000)

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        before = set(os.listdir("/proc"))
        with pytest.raises(OSError, match=f"port {taken} is already in use"):
            LighthouseServer(bind=f"127.0.0.1:{taken}", min_replicas=1)
        assert not any(d.isdigit() and d not in before and _is_serve(int(d)) for d in os.listdir("/proc"))

    for bad, match in [("nonsense", "not HOST:PORT"), ("127.0.0.1:x", "non-numeric"),
                       ("127.0.0.1:70000", "outside 0-65535")]:
        with pytest.raises(ValueError, match=match):
            LighthouseServer(bind=bad, min_replicas=1)
    with pytest.raises(ValueError, match="odd number"):
        LighthouseServer(bind="127.0.0.1:0", min_replicas=1, nodes=2)


def _is_serve(pid: int) -> bool:
    """A node exec'd (``lighthouse_cluster serve``) or forked (by, or as, the fork server)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"lighthouse_cluster\0serve" in cmdline or b"multiprocessing.forkserver" in cmdline


OWNER = r"""
import json, os, signal, sys
from lighthouse_cluster import LighthouseServer
server = LighthouseServer("127.0.0.1:0", min_replicas=1)
print(json.dumps({"nodes": [m.process.pid for m in server.cluster.members],
                  "guardian": server.cluster.guardian.process.pid, "root": str(server.root)}), flush=True)
how = sys.argv[1]
if how == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
elif how == "os_exit":
    os._exit(3)
# "exit": return without shutdown(); the finalizer runs at interpreter exit
"""


@pytest.mark.parametrize("how", ["exit", "os_exit", "sigkill"])
def test_nodes_never_outlive_their_owner(how: str) -> None:
    res = subprocess.run([sys.executable, "-c", OWNER, how], capture_output=True, text=True, timeout=90,
                         stdin=subprocess.DEVNULL)
    expected = {"exit": 0, "os_exit": 3, "sigkill": -signal.SIGKILL}[how]
    assert res.returncode == expected, res.stderr[-3000:]
    info = json.loads(res.stdout.strip().splitlines()[-1])
    try:
        wait_for(f"the nodes and the guardian to be gone after the owner's {how}",
                 lambda: not any(_alive(p) for p in info["nodes"] + [info["guardian"]]), 15)
        wait_for("the data directory to be removed", lambda: not Path(info["root"]).exists(), 5)
    finally:
        for pid in info["nodes"]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def test_garbage_collected_server_stops_its_nodes() -> None:
    import gc

    server = LighthouseServer("127.0.0.1:0", min_replicas=1)
    pids = _node_pids(server)
    del server
    gc.collect()
    wait_for("the nodes of a collected server to stop", lambda: not any(_alive(p) for p in pids), 15)


def test_up_bind_port_zero_picks_and_prints_free_ports(tmp_path: Path) -> None:
    out = tmp_path / "up.out"
    data = tmp_path / "data"
    with open(out, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "lighthouse_cluster", "up", "--bind", "127.0.0.1:0",
                                 "--min_replicas", "1", "--data-dir", str(data)],
                                stdout=f, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL,
                                env={**os.environ, "COLUMNS": "250"})
    try:
        wait_for("up to print its endpoints",
                 lambda: "Ctrl-C stops every node." in out.read_text() or proc.poll() is not None, 40)
        text = out.read_text()
        assert proc.poll() is None, text
        line = next(ln for ln in text.splitlines() if ln.startswith("--bind 127.0.0.1:0: chose client ports "))
        parts = dict(p.strip().split(" ports ") for p in line.split(": chose ", 1)[1].split(", "))
        ports = {k: [int(x) for x in v.split(",")] for k, v in parts.items()}
        assert set(ports) == {"client", "raft", "http"}
        every = ports["client"] + ports["raft"] + ports["http"]
        assert len(every) == 9 and len(set(every)) == 9 and all(0 < p < 65536 for p in every)
        assert f"export TORCHFT_LIGHTHOUSE=http://127.0.0.1:{ports['client'][0]}" in text
        for port in ports["client"]:
            st = query_status(f"127.0.0.1:{port}", 2.0)
            assert st is not None and st.leader_id in {"n1", "n2", "n3"}, f"nothing serves on {port}"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
    assert proc.returncode == 0, out.read_text()[-2000:]
