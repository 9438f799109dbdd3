"""Killing replica groups (the ``kill-client`` nemesis) and the ``survivor-wait`` checker, live.

* The client processes against an in-process fake LighthouseService: a SIGKILLed client's call
  in flight ends on the server at once (the kernel closed its socket: the server sees the
  connection drop), its heartbeats stop, its open calls are completed as ``info`` in the
  history, and a restarted client is a new process that asks again.
* A short harness run on a real 3-node cluster: three client kills (restarted by ``recover``,
  by ``restart-client``, and one with the leader killed while the client is down); every
  checker passes, the safety ones included, and ``survivor-wait`` has a wait for every survivor
  of every kill.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from support.run_lock import serial_on

from jepsen_like.clients import KILLED, ClientSettings, ProcessClientPool
from jepsen_like.history import INFO, INVOKE, OK, HistoryWriter, pair_operations
from jepsen_like.runner import RunOptions, run_schedule
from jepsen_like.schedule import FaultOp, Schedule
from lighthouse_cluster.proto import torchft_pb2 as pb
from lighthouse_cluster.proto import torchft_pb2_grpc as pb_grpc

from test_jepsen_run import explain, network_backend, runs_dir  # noqa: F401 - runs_dir is a fixture

# serial_on: one fault-harness run at a time (tests/support/run_lock.py), beside any other test
pytestmark = [pytest.mark.integration, serial_on("fault-harness"), pytest.mark.low_cpu]


class HoldingLighthouse(pb_grpc.LighthouseServiceServicer):
    """Answers every Quorum at once with a quorum of the requester alone, except those of the
    replica ids in ``hold``, which it keeps open until the caller goes away; records when each
    held call ended on the server (``ended``) and every heartbeat (replica id, time)."""

    def __init__(self) -> None:
        self.hold: set[str] = set()
        self.held: list[tuple[str, float]] = []       # (replica id, when the call arrived)
        self.ended: list[tuple[str, float]] = []      # (replica id, when the server saw it end)
        self.heartbeats: list[tuple[str, float]] = []

    async def Quorum(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC method name
        rid = request.requester.replica_id
        if rid in self.hold:
            self.held.append((rid, time.monotonic()))
            try:
                await asyncio.sleep(3600)
            finally:
                self.ended.append((rid, time.monotonic()))
        return pb.LighthouseQuorumResponse(quorum=pb.Quorum(quorum_id=1, participants=[request.requester]))

    async def Heartbeat(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.heartbeats.append((request.replica_id, time.monotonic()))
        return pb.LighthouseHeartbeatResponse()


class ServerThread:
    """A gRPC aio server with ``HoldingLighthouse`` on its own event loop thread."""

    def __init__(self) -> None:
        self.fake = HoldingLighthouse()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start() -> tuple[grpc.aio.Server, int]:
            server = grpc.aio.server()      # made on the loop it serves from
            pb_grpc.add_LighthouseServiceServicer_to_server(self.fake, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            return server, port
        self.server, self.port = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(None), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def wait_until(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_a_killed_client_process_drops_its_calls_and_a_restarted_one_asks_again(tmp_path: Path) -> None:
    server = ServerThread()
    fake = server.fake
    fake.hold.add("c1")
    history = HistoryWriter(tmp_path / "history.jsonl")
    settings = ClientSettings(clients=2, heartbeat_interval_s=0.05, step_time_s=0.02, quorum_timeout_s=30.0)
    pool = ProcessClientPool([f"127.0.0.1:{server.port}"], ["n1"], history, settings, log_dir=tmp_path / "clients")
    try:
        pool.start()
        oks = lambda c: [e for e in history.snapshot() if e["process"] == c and e["f"] == "quorum" and e["type"] == OK]  # noqa: E731
        wait_until(lambda: fake.held and len(oks("c0")) >= 2, 30, "c1's held call and two rounds of c0")
        beats_before = sum(1 for r, _ in fake.heartbeats if r == "c1")
        assert beats_before > 0 and pool.down == []
        t_kill = time.monotonic()
        pool.kill("c1")
        assert pool.down == ["c1"]
        # The server sees c1's call end at once (its connection dropped), long before the call's
        # 30 s deadline; no heartbeat of c1's arrives after the kill.
        wait_until(lambda: fake.ended, 2.0, "the server to see c1's call end")
        assert fake.ended[0][0] == "c1" and fake.ended[0][1] - t_kill < 1.0
        time.sleep(0.2)                 # a heartbeat sent just before the kill may still land
        beats_after = sum(1 for r, _ in fake.heartbeats if r == "c1")
        time.sleep(0.5)                 # 10 heartbeat intervals
        assert sum(1 for r, _ in fake.heartbeats if r == "c1") == beats_after
        # The history: c1's open quorum call is completed as info ("killed"), nothing left open.
        c1 = [op for op in pair_operations(history.snapshot()) if op.process == "c1"]
        assert c1 and all(op.complete is not None for op in c1)
        last_quorum = [op for op in c1 if op.f == "quorum"][-1]
        assert last_quorum.type == INFO and last_quorum.complete["error"] == KILLED
        # c0 is unaffected; c1 restarted is a new process that gets answers again.
        n0 = len(oks("c0"))
        wait_until(lambda: len(oks("c0")) > n0, 10, "c0 to go on")
        fake.hold.clear()
        pool.restart("c1")
        assert pool.down == []
        wait_until(lambda: oks("c1"), 30, "the restarted c1 to get a quorum")
        assert oks("c1")[0]["value"]["step"] == 0           # a new process starts from step 0
    finally:
        pool.stop()
        server.close()
        history.close()
    events = history.snapshot()
    assert all(op.complete is not None for op in pair_operations(events))
    assert pool.error is None
    # Every event came from a child process on the parent's clock: times are within the test.
    assert all(0 <= e["time_ns"] <= history.now_ns() for e in events)
    assert [json.loads(line)["index"] for line in (tmp_path / "history.jsonl").read_text().splitlines()] == \
        list(range(len(events)))
    assert {e["process"] for e in events if e["type"] == INVOKE} == {"c0", "c1"}


def test_client_kills_keep_every_checker_passing_and_survivor_waits_are_measured(runs_dir) -> None:  # noqa: F811
    backend = network_backend() or "none"
    ops = [(2.0, "kill-client", {"client": "c1"}), (6.0, "recover", {}),
           (9.0, "kill-client", {"client": "c0"}), (10.5, "restart-client", {"client": "c0"}),
           (13.0, "kill-client", {"client": "c3"}), (17.0, "kill-leader", {"node": "leader"}),
           (19.5, "recover", {})]
    schedule = Schedule(seed=3, nodes=3, clients=4, time_limit_s=22.0, name="ci-client-kills",
                        ops=[FaultOp(t, f, a) for t, f, a in ops])
    result = run_schedule(runs_dir("client-kills"), schedule, RunOptions(backend=backend))
    assert result.valid, explain(result)
    checks = {c.name: c for c in result.checks}
    assert {"no-split-brain", "monotonic-quorum-ids", "acknowledged-committed", "one-leader-per-term",
            "survivor-wait", "logs-agree"} <= set(checks)
    figures = checks["survivor-wait"].figures
    print(f"survivor-wait: {checks['survivor-wait'].summary}")
    print(json.dumps(figures["per_kill"]))
    assert figures["kills"] == 3 and figures["inconclusive"] == 0
    for kill, victim in zip(figures["per_kill"], ("c1", "c0", "c3")):
        others = sorted({"c0", "c1", "c2", "c3"} - {victim})
        assert kill["client"] == victim and kill["survivors"] == others
        assert sorted(kill["waits_s"]) == others and kill["all_survivors_s"] is not None
    assert figures["median_s"] is not None and figures["max_s"] <= figures["bound_s"]
    assert result.counts["nemesis"].get("kill-client") == 3 and result.counts["nemesis"].get("restart-client") == 1
    assert result.counts["client"]["quorum"].get("open", 0) == 0
    # Each killed client was restarted (by recover or restart-client) and got quorums again.
    history = [json.loads(line) for line in (result.directory / "history.jsonl").read_text().splitlines()]
    restarts = {c: e["time_ns"] for e in history if e["process"] == "nemesis" and e["type"] == OK
                for c in (e["value"] or {}).get("clients_restarted", [])}
    assert sorted(restarts) == ["c0", "c1", "c3"]
    for victim, t in restarts.items():
        assert any(e["process"] == victim and e["f"] == "quorum" and e["type"] == OK and e["time_ns"] > t
                   for e in history), victim
    # A kill completes the victim's open calls (if it was in one: a kill between two rounds finds
    # none) as info "killed", and nobody else's.
    killed = {e["process"] for e in history if e["type"] == INFO and e.get("error") == KILLED}
    assert killed <= {"c0", "c1", "c3"}
