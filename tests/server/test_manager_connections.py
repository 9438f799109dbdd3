"""The leader's watch of the running quorum's manager servers (#15 item 5):
``server/manager_connections.py``.

Unit tests: which addresses are dialed, and which members are watched. Integration tests run a
real cluster and real manager-server processes (a gRPC server on the port each replica names as
its ``address``, as torchft's and ftclient's managers do): a member whose manager server is
SIGKILLed (and whose heartbeats stop, as a dead trainer's do) is left out of the survivors' next
quorum in well under a second, not after the 5 s heartbeat timeout; a member whose address
cannot be reached is never declared dead; with ``--no-watch-manager-connections`` the death costs
the heartbeat timeout again.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time
from typing import Any, Callable

import grpc
import pytest

from lighthouse_cluster.local.cluster import free_ports
from lighthouse_cluster.proto import torchft_pb2 as pb
from lighthouse_cluster.proto import torchft_pb2_grpc as pb_grpc
from lighthouse_cluster.server.manager_connections import ManagerConnections, manager_target
from test_liveness_streams import DEATHS, distinct_ports, heartbeats, members, scrape

# -- unit ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("address, target", [
    ("http://127.0.0.1:40851", "127.0.0.1:40851"),
    ("http://trainer-3.job.svc:29500", "trainer-3.job.svc:29500"),
    ("http://[::1]:5000", "[::1]:5000"),
    ("http://[::1]:5000/", "[::1]:5000"),
    ("10.0.0.7:4000", "10.0.0.7:4000"),
    ("https://host:443", None),       # TLS: not dialed (no credentials for it)
    ("sim://a", None),                # simulated groups' placeholders
    ("http://host", None),            # no port
    ("http://host:99999", None),      # not a port
    ("http://host:1/path", None),
    ("", None),
])
def test_only_plaintext_grpc_addresses_are_dialed(address: str, target: str | None) -> None:
    assert manager_target(address) == target


class Members:
    def __init__(self) -> None:
        self.running: dict[str, str] | None = {}

    def running_members(self) -> dict[str, str] | None:
        return self.running


def test_the_running_quorums_members_without_a_stream_are_watched_and_only_while_leading() -> None:
    async def main() -> None:
        members = Members()
        streams = {"s"}
        watch = ManagerConnections(members, lambda rid, why: None, streams.__contains__, grace_s=0.5)
        dialed: list[tuple[str, str]] = []

        async def fake_watch(rid: str, target: str) -> None:
            dialed.append((rid, target))
            await asyncio.Event().wait()

        watch._watch = fake_watch  # type: ignore[method-assign]  # no sockets in a unit test
        members.running = {"a": "http://127.0.0.1:1", "b": "sim://b", "s": "http://127.0.0.1:3"}
        watch.reconcile()
        await asyncio.sleep(0)
        assert dialed == [("a", "127.0.0.1:1")] and watch.watched == 1
        members.running = {"a": "http://127.0.0.1:1", "c": "http://127.0.0.1:4"}  # next quorum
        watch.reconcile()
        await asyncio.sleep(0)
        assert dialed[1:] == [("c", "127.0.0.1:4")] and watch.watched == 2
        members.running = {"a": "http://127.0.0.1:9"}  # a's manager moved: re-dialed
        watch.reconcile()
        await asyncio.sleep(0)
        assert dialed[2:] == [("a", "127.0.0.1:9")] and watch.watched == 1
        members.running = None  # no longer the serving leader
        watch.reconcile()
        assert watch.watched == 0
    asyncio.run(main())


def test_a_large_quorum_is_dialed_a_bounded_number_of_members_per_check() -> None:
    """A new leader of 2048 members opened every channel in one pass of the event loop (~250 ms
    with no answer going out); now at most MAX_NEW_WATCHES_PER_CHECK per check, the rest next."""
    from lighthouse_cluster.server.manager_connections import MAX_NEW_WATCHES_PER_CHECK as K

    async def main() -> None:
        members = Members()
        watch = ManagerConnections(members, lambda rid, why: None, lambda rid: False, grace_s=0.5)

        async def fake_watch(rid: str, target: str) -> None:
            watch._dialing.discard(asyncio.current_task())  # its first dial answered at once
            await asyncio.Event().wait()

        watch._watch = fake_watch  # type: ignore[method-assign]
        n = 2 * K + 10
        members.running = {f"r{i}": f"http://127.0.0.1:{1000 + i}" for i in range(n)}
        seen = []
        for _ in range(4):
            watch.reconcile()
            seen.append(watch.watched)
            await asyncio.sleep(0)  # the new watches run (their dials answered)
        assert seen == [K, 2 * K, n, n]
        watch.stop()
    asyncio.run(main())


def test_first_dials_in_flight_are_capped_and_the_rest_start_as_they_are_answered() -> None:
    from lighthouse_cluster.server.manager_connections import MAX_DIALS_IN_FLIGHT as D

    async def main() -> None:
        members = Members()
        watch = ManagerConnections(members, lambda rid, why: None, lambda rid: False, grace_s=0.5)
        answered = asyncio.Event()

        async def slow_dial(rid: str, target: str) -> None:
            await answered.wait()  # a dial whose answer the busy loop has not seen yet
            watch._dialing.discard(asyncio.current_task())
            await asyncio.Event().wait()

        watch._watch = slow_dial  # type: ignore[method-assign]
        members.running = {f"r{i}": f"http://127.0.0.1:{1000 + i}" for i in range(3 * D)}
        for _ in range(5):
            watch.reconcile()
            await asyncio.sleep(0)
        assert (watch.watched, watch.dialing) == (D, D)
        answered.set()
        await asyncio.sleep(0)
        assert watch.dialing == 0
        watch.reconcile()
        assert (watch.watched, watch.dialing) == (2 * D, D)
        # Watches cancelled before they ever ran leave no dial counted.
        members.running = {}
        watch.reconcile()
        for _ in range(3):  # the cancelled tasks end, then their done callbacks run
            await asyncio.sleep(0)
        assert (watch.watched, watch.dialing) == (0, 0)
        watch.stop()
    asyncio.run(main())


def test_a_new_leader_of_thousands_of_unreachable_members_keeps_its_file_descriptors() -> None:
    """docs/design/new-leader-large-quorum.md: a new leader of 4096 members on a loop too busy to
    see its dials answered went from 2,000 to 20,000 file descriptors in 8 s (each unanswered dial
    keeps gRPC reconnecting), and Raft then failed to open a socket or its journal. Real dials to
    refused ports, the loop held 50 ms of every turn: the descriptors stay bounded by the dials in
    flight (before the cap: 3,000-8,000 within 5 s here, or the test process's own limit)."""
    n = 4096

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    async def main() -> tuple[int, int]:
        members = Members()
        # Ports bound and released: nothing listens, the kernel refuses each dial.
        members.running = {f"r{i}": f"http://127.0.0.1:{p}" for i, p in enumerate(free_ports(n, "127.0.0.1"))}
        watch = ManagerConnections(members, lambda rid, why: None, lambda rid: False, grace_s=0.5)
        base, peak = open_fds(), 0
        watch.start()
        watch.wake()
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and len(watch._settled) < n:
            time.sleep(0.05)  # the loop busy with other work
            await asyncio.sleep(0)
            peak = max(peak, open_fds() - base)
        settled = len(watch._settled)
        watch.stop()
        return peak, settled

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("counting file descriptors needs /proc")
    peak, settled = asyncio.run(main())
    assert peak < 1500, f"{peak} file descriptors open for {n} unreachable manager servers"
    assert settled > 0, "no dial was answered: nothing was measured"  # how many: the host's load


def test_a_refused_manager_address_is_given_up_at_once_not_redialed_until_the_connect_timeout() -> None:
    """Nothing listens on the address (the kernel refuses the dial): the member is settled (heartbeat
    timeout only) after that first refusal. It used to be redialed every 50-200 ms until
    ``connect_timeout_s``: with 2048 such members a new leader spent ~7 s of CPU in its first 5 s
    (docs/design/new-leader-large-quorum.md)."""
    import socket

    async def main() -> None:
        ports = []
        for _ in range(20):
            with socket.socket() as s:  # bound and closed: refused, nothing listens
                s.bind(("127.0.0.1", 0))
                ports.append(s.getsockname()[1])
        members = Members()
        members.running = {f"r{i}": f"http://127.0.0.1:{p}" for i, p in enumerate(ports)}
        declared: list[str] = []
        watch = ManagerConnections(members, lambda rid, why: declared.append(rid), lambda rid: False,
                                   grace_s=0.5, connect_timeout_s=30.0)
        try:
            watch.reconcile()
            assert watch.watched == len(ports)
            deadline = time.monotonic() + 3.0
            while watch.watched and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert watch.watched == 0 and len(watch._settled) == len(ports)
            assert declared == [] and watch.connected == 0  # never declared anything
            watch.reconcile()  # settled: not dialed again while the quorum is the same
            assert watch.watched == 0
        finally:
            watch.stop()
            await asyncio.sleep(0.1)
    asyncio.run(main())


# -- integration --------------------------------------------------------------------------------------

MANAGER_SERVER = textwrap.dedent("""
    # A trainer's manager server as far as the lighthouse can see: a gRPC server on a port.
    import sys, time, grpc
    from concurrent import futures
    server = grpc.server(futures.ThreadPoolExecutor(1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    time.sleep(3600)
""")


def spawn_manager_server() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-c", MANAGER_SERVER], stdout=subprocess.PIPE, text=True,
                            env={**os.environ})
    assert proc.stdout is not None
    line = proc.stdout.readline()  # bounded: EOF if the process fails
    assert line.strip().isdigit(), f"manager server did not start: {line!r}"
    return proc, f"http://127.0.0.1:{line.strip()}"


async def quorum_as(address: str, replica_id: str, manager: str, step: int, timeout: float = 30.0) -> pb.Quorum:
    async with grpc.aio.insecure_channel(address) as channel:
        response = await pb_grpc.LighthouseServiceStub(channel).Quorum(pb.LighthouseQuorumRequest(
            requester=pb.QuorumMember(replica_id=replica_id, address=manager, store_address=f"{replica_id}:2",
                                      step=step, world_size=1)), timeout=timeout)
        return response.quorum


def run_kill(cluster: Any, leader: int) -> tuple[float, dict[Any, float]]:
    """a, b and c (c's manager address unreachable) in a quorum; b's manager server SIGKILLed and
    its heartbeats stopped while a and c wait for their next quorum. Returns the seconds from the
    kill until that quorum ([a, c]) was issued, and the leader's metrics then."""
    address = cluster.client_addresses[leader]
    servers = {r: spawn_manager_server() for r in ("a", "b")}
    managers = {"a": servers["a"][1], "b": servers["b"][1], "c": "http://127.0.0.1:1"}

    async def main() -> tuple[float, dict[Any, float]]:
        beats = {"ac": asyncio.ensure_future(heartbeats(lambda: [address], ["a", "c"])),
                 "b": asyncio.ensure_future(heartbeats(lambda: [address], ["b"]))}
        try:
            await asyncio.sleep(0.3)  # every one heartbeating: the first round waits for all three
            first = await asyncio.wait_for(asyncio.gather(
                *(quorum_as(address, r, managers[r], 1) for r in ("a", "b", "c"))), 30)
            assert members(first[0]) == ["a", "b", "c"]
            survivors = [asyncio.ensure_future(quorum_as(address, r, managers[r], 2)) for r in ("a", "c")]
            await asyncio.sleep(0.5)
            assert not any(s.done() for s in survivors)  # b is healthy: they wait for it
            killed = time.monotonic()
            servers["b"][0].kill()
            beats.pop("b").cancel()  # a dead trainer's heartbeats stop with it
            second = await asyncio.wait_for(asyncio.gather(*survivors), 15)
            issued = time.monotonic() - killed
            assert members(second[0]) == ["a", "c"] and second[0].quorum_id == first[0].quorum_id + 1
            return issued, await asyncio.to_thread(scrape, cluster, leader)
        finally:
            for task in beats.values():
                task.cancel()
            for proc, _ in servers.values():
                proc.kill()
                proc.wait(10)

    return asyncio.run(main())


CONNECTED = "lighthouse_cluster_manager_connections"
LOST = (DEATHS, (("reason", "manager_connection_lost"),))


@pytest.mark.integration
def test_a_dead_trainers_manager_server_costs_the_survivors_well_under_a_second(
        make_cluster: Callable[..., Any]) -> None:
    cluster = make_cluster(min_replicas=1, heartbeat_timeout_ms=5_000, join_timeout_ms=60_000, **distinct_ports(3))
    leader, _ = cluster.wait_for_stable_leader()
    issued, metrics = run_kill(cluster, leader)
    print(f"manager server SIGKILLed -> next quorum issued {issued * 1000:.0f} ms (heartbeat timeout 5 s)")
    assert issued < 1.0
    assert metrics[LOST] == 1
    # a is watched (c's address is not reachable: it keeps the heartbeat timeout, never declared).
    assert metrics[(CONNECTED, ())] == 1


@pytest.mark.integration
def test_without_the_watch_the_death_costs_the_heartbeat_timeout(make_cluster: Callable[..., Any]) -> None:
    cluster = make_cluster(min_replicas=1, heartbeat_timeout_ms=2_000, join_timeout_ms=60_000,
                           extra_args=["--no-watch-manager-connections"], **distinct_ports(3))
    leader, _ = cluster.wait_for_stable_leader()
    issued, metrics = run_kill(cluster, leader)
    print(f"without the watch: next quorum issued {issued * 1000:.0f} ms after the kill (heartbeat timeout 2 s)")
    assert issued > 1.5
    assert metrics[LOST] == 0 and metrics[(CONNECTED, ())] == 0
