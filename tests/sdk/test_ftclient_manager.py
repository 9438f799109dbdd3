"""ftclient.Manager and its manager server: replica groups as threads in this process (each with
its own TCPStore and manager server), a real 3-node LocalCluster as the lighthouse, Gloo for the
collectives and HTTP for checkpoints.

Covered: quorum results per group, allreduce averaging, the should_commit barrier across the
ranks of a group, commit_failures reaching the lighthouse, max_retries, two ranks per group
aggregated into one lighthouse request, healing a group that is behind, quorum timeouts,
quorum_retries, Kill (a real process), the ManagerService's protocol errors, and torchft's
environment variables.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from torch.distributed import TCPStore

from ftclient import DistributedDataParallel, HTTPTransport, Manager, ManagerClient, ManagerServer, OptimizerWrapper
from ftclient.lighthouse_client import LighthouseClient
from ftclient.manager_server import LocalManagerClient
from ftclient.process_group import ProcessGroupGloo
from ftclient.quorum_results import QuorumResult
from lighthouse_cluster.local.cluster import LocalCluster, free_ports
from lighthouse_cluster.proto import torchft_pb2 as pb
from lighthouse_cluster.proto import torchft_pb2_grpc as pb_grpc
from support.null_transport import NullTransport

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = timedelta(seconds=10)
JOIN_S = 30.0  # bound on any wait for a whole step of every rank


def make_pg() -> ProcessGroupGloo:
    return ProcessGroupGloo(timeout=TIMEOUT)


def make_transport() -> HTTPTransport[Any]:
    return HTTPTransport(timeout=TIMEOUT, num_chunks=0)


class FailingPG:
    """A process group whose collectives always fail (as after a peer died)."""

    def __init__(self) -> None:
        self.configured: list[tuple[Any, ...]] = []

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int, quorum_id: int | None = None,
                  group_rank: int | None = None, group_world_size: int | None = None) -> None:
        self.configured.append((store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size))

    def allreduce(self, tensors: list[torch.Tensor], op: Any) -> Any:
        raise RuntimeError("injected allreduce failure")

    def size(self) -> int:
        return 1

    def errored(self) -> Exception | None:
        return None

    def shutdown(self) -> None:
        pass


def run_all(*calls: Callable[[], Any], timeout: float = JOIN_S) -> list[Any]:
    """Run ``calls`` concurrently; their results in order (the first error is re-raised)."""
    with ThreadPoolExecutor(len(calls)) as ex:
        futs = [ex.submit(c) for c in calls]
        done, pending = futures.wait(futs, timeout=timeout)
        assert not pending, f"{len(pending)} of {len(calls)} calls still running after {timeout}s"
        return [f.result() for f in futs]


@dataclass
class Rank:
    """One rank of a replica group: its Manager and the user state it checkpoints."""

    manager: Manager
    state: dict[str, torch.Tensor] = field(default_factory=dict)


class Harness:
    """Builds replica groups (a TCPStore each, one Manager per rank) and shuts them all down."""

    def __init__(self, lighthouse: str) -> None:
        self.lighthouse = lighthouse
        self.ranks: list[Rank] = []
        self.stores: list[TCPStore] = []

    def group(self, name: str, world_size: int = 1, pg: Callable[[], Any] = make_pg,
              transport: Callable[[], Any] = make_transport, user_state: bool = True, **kwargs: Any) -> list[Rank]:
        """Ranks of a new replica group; with ``user_state`` each checkpoints ``Rank.state``."""
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
        self.stores.append(store)

        def build(rank: int) -> Rank:
            r = Rank(manager=None, state={"w": torch.zeros(2)})  # type: ignore[arg-type]
            r.manager = _manager(pg(), r if user_state else None, rank, world_size, store.port, self.lighthouse, name,
                                 transport(), kwargs)
            return r

        ranks = run_all(*[lambda i=i: build(i) for i in range(world_size)])
        self.ranks.extend(ranks)
        return ranks

    def close(self) -> None:
        for r in self.ranks:
            try:
                r.manager.shutdown(wait=False)
            except Exception:  # noqa: BLE001 -- best effort; the next one must still stop
                pass


def _manager(pg: Any, r: Rank | None, rank: int, world_size: int, store_port: int, lighthouse: str, name: str,
             transport: Any, kwargs: dict[str, Any]) -> Manager:
    options: dict[str, Any] = dict(min_replica_size=1, timeout=TIMEOUT, quorum_timeout=TIMEOUT,
                                   connect_timeout=TIMEOUT)
    options.update(kwargs)
    return Manager(pg=pg, load_state_dict=(lambda sd: r.state.update(sd)) if r else None,
                   state_dict=(lambda: dict(r.state)) if r else None, rank=rank, world_size=world_size,
                   store_addr="127.0.0.1", store_port=store_port, lighthouse_addr=lighthouse, replica_id=name,
                   hostname="127.0.0.1", checkpoint_transport=transport, **options)


@dataclass
class Step:
    quorum: QuorumResult
    participating: bool
    participants: int
    allreduced: list[float] | None
    committed: bool
    step: int


def step(r: Rank, grad: list[float] | None = None, error: Exception | None = None) -> Step:
    m = r.manager
    m.start_quorum()
    out = None
    if grad is not None:
        work = m.allreduce(torch.tensor(grad))
        assert isinstance(work, torch.distributed.Work)
        assert work.wait() is (m.errored() is None)
        out = work.get_future().wait().tolist()
    m.wait_quorum()
    participating, participants = m.is_participating(), m.num_participants()
    if error is not None:
        m.report_error(error)
    committed = m.should_commit()
    assert m.last_quorum_result is not None
    return Step(m.last_quorum_result, participating, participants, out, committed, m.current_step())


@pytest.fixture
def cluster(make_cluster: Callable[..., LocalCluster]) -> LocalCluster:
    # These tests assert exact quorums and sums. Under CI load, the managers of both groups (one
    # pytest process) once sent no keep-alive for 500 ms: a false death that aborted a quorum and
    # changed a sum. No test here relies on a keep-alive timeout (a killed process closes its
    # stream: a death at once), so the timeout is generous.
    c = make_cluster(min_replicas=2, liveness_timeout_ms=3000)
    c.wait_for_leader()
    return c


@pytest.fixture
def harness(cluster: LocalCluster) -> Iterator[Harness]:
    h = Harness(cluster.endpoints)
    try:
        yield h
    finally:
        h.close()


def quorum_at_leader(cluster: LocalCluster) -> pb.Quorum:
    st = cluster.status(cluster.wait_for_leader())
    assert st is not None and st.has_quorum
    return st.quorum


# -- two replica groups --------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_two_groups_quorum_allreduce_and_commit(harness: Harness) -> None:
    [a] = harness.group("ga", init_sync=False)
    [b] = harness.group("gb", init_sync=False)
    ids = sorted([a.manager.replica_id, b.manager.replica_id])

    sa, sb = run_all(lambda: step(a, [1.0, 2.0]), lambda: step(b, [3.0, 4.0]))
    for s, r in ((sa, a), (sb, b)):
        q = s.quorum
        assert q.replica_ids == ids and q.replica_world_size == 2 and q.max_world_size == 2
        assert q.replica_rank == ids.index(r.manager.replica_id) == q.max_replica_rank
        assert (q.heal, q.recover_src_replica_rank, q.recover_dst_replica_ranks, q.max_step) == (False, None, [], 0)
        assert s.participating and s.participants == 2
        assert s.allreduced == [2.0, 3.0]  # the average over both groups
        assert s.committed and s.step == 1
    assert sa.quorum.quorum_id == sb.quorum.quorum_id
    assert sa.quorum.store_address == sb.quorum.store_address  # group rank 0's primary, the same for both
    assert a.manager.batches_committed() == b.manager.batches_committed() == 2

    # Same members: the lighthouse keeps the quorum id (no reconfiguration) and max_step moves on.
    sa2, sb2 = run_all(lambda: step(a, [0.0, 0.0]), lambda: step(b, [2.0, 2.0]))
    assert sa2.quorum.quorum_id == sa.quorum.quorum_id and sa2.quorum.max_step == 1
    assert sa2.allreduced == sb2.allreduced == [1.0, 1.0]
    assert a.manager.current_step() == b.manager.current_step() == 2
    assert a.manager.state_dict() == {"step": 2, "batches_committed": 4}


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_training_continues_across_leader_sigkill(cluster: LocalCluster, harness: Harness) -> None:
    [a] = harness.group("la", init_sync=False)
    [b] = harness.group("lb", init_sync=False)
    s1 = run_all(lambda: step(a, [1.0]), lambda: step(b, [3.0]))
    leader = cluster.wait_for_leader()
    term = cluster.status(leader).term
    cluster.kill(leader)
    cluster.wait_for_leader(exclude_term=term, timeout=15)
    s2 = run_all(lambda: step(a, [1.0]), lambda: step(b, [5.0]))
    assert all(s.committed for s in s1 + s2) and [s.allreduced for s in s2] == [[3.0], [3.0]]
    # Same members, committed through Raft before the failover: the same quorum id.
    assert {s.quorum.quorum_id for s in s1 + s2} == {s1[0].quorum.quorum_id}
    assert a.manager.current_step() == b.manager.current_step() == 2


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_group_behind_in_step_heals_from_an_up_to_date_group(harness: Harness) -> None:
    [a] = harness.group("ahead")
    [b] = harness.group("behind")
    a.manager.load_state_dict({"step": 3, "batches_committed": 6})
    a.state["w"] = torch.tensor([7.0, 8.0])

    def behind_step() -> Step:
        b.manager.start_quorum()
        # Async quorum: the healing group takes part in the collective with zeros.
        out = b.manager.allreduce(torch.tensor([100.0, 100.0])).get_future().wait().tolist()
        assert b.manager.is_participating() is False
        assert b.state["w"].tolist() == [0.0, 0.0]  # the checkpoint is applied in should_commit
        committed = b.manager.should_commit()
        return Step(b.manager.last_quorum_result, False, b.manager.num_participants(), out, committed,
                    b.manager.current_step())

    sa, sb = run_all(lambda: step(a, [2.0, 4.0]), behind_step)
    qa, qb = sa.quorum, sb.quorum
    assert qb.heal and qb.max_step == 3 and qb.max_replica_rank is None and qb.max_world_size == 1
    assert qb.recover_src_replica_rank == qa.replica_rank
    assert qb.recover_src_manager_address == a.manager._manager.address()  # type: ignore[union-attr]
    assert not qa.heal and qa.recover_dst_replica_ranks == [qb.replica_rank]
    assert sa.participants == sb.participants == 1
    assert sa.allreduced == sb.allreduced == [2.0, 4.0]  # only the up-to-date group counts
    assert sa.committed and sb.committed
    assert a.manager.current_step() == b.manager.current_step() == 4
    assert b.state["w"].tolist() == [7.0, 8.0]
    assert b.manager.batches_committed() == 7  # 6 recovered + 1 participant this step

    # Healed: the next step has both groups participating.
    sa2, sb2 = run_all(lambda: step(a, [1.0, 1.0]), lambda: step(b, [3.0, 3.0]))
    assert not sb2.quorum.heal and sa2.participants == sb2.participants == 2
    assert sa2.allreduced == sb2.allreduced == [2.0, 2.0]


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_two_ranks_per_group_barrier_and_commit_failures(cluster: LocalCluster, harness: Harness) -> None:
    a0, a1 = harness.group("ra", world_size=2, init_sync=False)
    b0, b1 = harness.group("rb", world_size=2, init_sync=False)

    sa0, sa1, sb0, sb1 = run_all(lambda: step(a0, [1.0]), lambda: step(a1, [10.0], error=RuntimeError("bad grad")),
                                 lambda: step(b0, [3.0]), lambda: step(b1, [30.0]))
    # One lighthouse request per replica group, each describing its 2 ranks.
    q = quorum_at_leader(cluster)
    assert [m.world_size for m in q.participants] == [2, 2]
    assert len({s.quorum.quorum_id for s in (sa0, sa1, sb0, sb1)}) == 1
    assert sa0.quorum.replica_rank == sa1.quorum.replica_rank != sb0.quorum.replica_rank == sb1.quorum.replica_rank
    # Each group rank rendezvouses on its own primary store: group rank r uses participant r % 2.
    assert sa0.quorum.store_address == sb0.quorum.store_address == q.participants[0].store_address
    assert sa1.quorum.store_address == sb1.quorum.store_address == q.participants[1].store_address
    assert sa0.allreduced == sb0.allreduced == [2.0] and sa1.allreduced == sb1.allreduced == [20.0]
    # The barrier: one rank's error fails the whole group; the other group commits.
    assert (sa0.committed, sa1.committed, sb0.committed, sb1.committed) == (False, False, True, True)
    assert a0.manager.current_step() == a1.manager.current_step() == 0
    assert b0.manager.current_step() == b1.manager.current_step() == 1

    # Next quorum: the failed commit is reported (and bumps the quorum id); group "ra" is behind
    # now and heals from "rb", rank by rank.
    s2 = run_all(*[lambda r=r: step(r, [1.0]) for r in (a0, a1, b0, b1)])
    assert {s.quorum.commit_failures for s in s2} == {1}
    assert {s.quorum.quorum_id for s in s2} == {sa0.quorum.quorum_id + 1}
    assert s2[0].quorum.heal and s2[1].quorum.heal and not s2[2].quorum.heal
    assert all(s.committed for s in s2)
    assert {r.manager.current_step() for r in (a0, a1, b0, b1)} == {2}


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_failed_allreduce_never_raises_and_max_retries(harness: Harness) -> None:
    groups = [harness.group(name, pg=FailingPG, transport=NullTransport, init_sync=False, max_retries=1)[0]
              for name in ("fa", "fb")]

    def failing_step(r: Rank) -> tuple[list[float], bool, bool]:
        r.manager.start_quorum()
        t = torch.tensor([5.0, 6.0])
        work = r.manager.allreduce(t)
        assert work.wait() is False  # failed: never raises
        out = work.get_future().wait()
        assert out is t  # the input tensor, untouched by the failed collective
        return out.tolist(), r.manager.errored() is not None, r.manager.should_commit()

    results = run_all(*[lambda r=r: failing_step(r) for r in groups])
    assert results == [([5.0, 6.0], True, False)] * 2
    assert all(r.manager.current_step() == 0 for r in groups)

    # Second consecutive failure: more than max_retries=1 -> RuntimeError on every group.
    def second(r: Rank) -> str:
        with pytest.raises(RuntimeError, match="max_retries=1") as info:
            failing_step(r)
        assert r.manager.last_quorum_result is not None and r.manager.last_quorum_result.commit_failures == 1
        return str(info.value)

    assert all("2 times" in msg for msg in run_all(*[lambda r=r: second(r) for r in groups]))


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_quorum_timeout_raises_from_wait_quorum(cluster: LocalCluster, harness: Harness) -> None:
    [alone] = harness.group("alone", pg=FailingPG, transport=NullTransport,
                            quorum_timeout=timedelta(seconds=2))  # min_replicas=2: never a quorum
    started = time.monotonic()
    alone.manager.start_quorum()
    with pytest.raises(TimeoutError) as info:
        alone.manager.wait_quorum()
    # The manager answers 0.5 s before the 2 s deadline and its lighthouse round ends 0.1 s
    # before that (so the error can name the endpoints): ~1.4 s, never much earlier.
    assert 1.3 <= time.monotonic() - started <= 4.0
    for address in cluster.client_addresses:
        assert address in str(info.value)  # names the lighthouse endpoints


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_ddp_and_optimizer_wrapper_train_in_lockstep(harness: Harness) -> None:
    """A torchft-style training loop on ftclient's DDP and OptimizerWrapper: differently
    initialised replicas end up identical (init_sync) and every step commits."""
    def train(g: int) -> tuple[list[torch.Tensor], int]:
        torch.manual_seed(g)
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        [r] = harness.group(f"train{g}", user_state=False, min_replica_size=2)
        r.manager.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
        wrapped = DistributedDataParallel(r.manager, model)
        optimizer = OptimizerWrapper(r.manager, opt)
        gen = torch.Generator().manual_seed(100 + g)
        for _ in range(3):
            optimizer.zero_grad()
            wrapped(torch.randn(4, 3, generator=gen)).sum().backward()
            optimizer.step()
        return [p.detach().clone() for p in model.parameters()], r.manager.current_step()

    (pa, step_a), (pb_, step_b) = run_all(lambda: train(0), lambda: train(1), timeout=60)
    assert step_a == step_b == 3
    assert all(torch.equal(x, y) for x, y in zip(pa, pb_, strict=True))


# -- the manager server on its own ---------------------------------------------------------------


class FlakyLighthouse(pb_grpc.LighthouseServiceServicer):
    """torchft's MockLighthouse: fails the first ``fail`` Quorum calls with INTERNAL; a quorum of
    the requester alone afterwards. No cluster service (Leader -> UNIMPLEMENTED)."""

    def __init__(self, fail: int) -> None:
        self.fail = fail
        self.calls: list[float] = []

    def Quorum(self, request, context):  # noqa: N802
        self.calls.append(time.monotonic())
        if len(self.calls) <= self.fail:
            context.abort(grpc.StatusCode.INTERNAL, f"simulated failure {len(self.calls)}/{self.fail}")
        return pb.LighthouseQuorumResponse(quorum=pb.Quorum(quorum_id=1, participants=[request.requester]))

    def Heartbeat(self, request, context):  # noqa: N802
        return pb.LighthouseHeartbeatResponse()


@pytest.fixture
def flaky() -> Iterator[Callable[[int], tuple[FlakyLighthouse, str]]]:
    servers: list[grpc.Server] = []

    def start(fail: int) -> tuple[FlakyLighthouse, str]:
        service = FlakyLighthouse(fail)
        server = grpc.server(ThreadPoolExecutor(4))
        pb_grpc.add_LighthouseServiceServicer_to_server(service, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return service, f"http://127.0.0.1:{port}"

    yield start
    for s in servers:
        s.stop(grace=None)


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_quorum_retries_sleep_and_give_up(flaky: Callable[[int], tuple[FlakyLighthouse, str]]) -> None:
    service, addr = flaky(1)
    server = ManagerServer("retry", addr, "127.0.0.1", "[::]:0", "store:1", 1, quorum_retries=1, connect_timeout=5)
    try:
        client = ManagerClient(server.address(), connect_timeout=5)
        result = client._quorum(group_rank=0, step=5, checkpoint_metadata="m", shrink_only=False, timeout=3.0)
        assert (result.quorum_id, result.max_step, result.replica_ids) == (1, 5, ["retry"])
        # One retry, after max(100 ms, timeout / (retries + 1)) = 1.5 s.
        assert len(service.calls) == 2 and 1.4 <= service.calls[1] - service.calls[0] <= 2.5
        client.close()
    finally:
        server.shutdown()

    service, addr = flaky(5)
    server = ManagerServer("no-retry", addr, "127.0.0.1", "[::]:0", "store:1", 1, quorum_retries=0, connect_timeout=5)
    try:
        client = ManagerClient(server.address(), connect_timeout=5)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="after 0 retries.*simulated failure"):
            client._quorum(group_rank=0, step=0, checkpoint_metadata="", shrink_only=False, timeout=5.0)
        assert time.monotonic() - started < 2.0 and len(service.calls) == 1  # failed at once, not at the deadline
        client.close()
    finally:
        server.shutdown()


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_manager_service_barrier_and_protocol_errors() -> None:
    dead = f"http://127.0.0.1:{free_ports(1)[0]}"
    lighthouse = LighthouseClient(dead, connect=False)
    server = ManagerServer("proto", dead, "127.0.0.1", "[::]:0", "store:1", 2, lighthouse=lighthouse)
    try:
        client = ManagerClient(server.address(), connect_timeout=5)
        # torchft's test_should_commit: the decision is False iff some rank voted False.
        assert run_all(lambda: client.should_commit(0, 1, True, 5), lambda: client.should_commit(1, 1, True, 5)) \
            == [True, True]
        assert run_all(lambda: client.should_commit(0, 1, True, 5), lambda: client.should_commit(1, 1, False, 5)) \
            == [False, False]
        with pytest.raises(TimeoutError, match=r"group ranks \[1\] did not vote"):
            client.should_commit(0, 2, True, 1.2)
        with pytest.raises(RuntimeError, match="rank not found"):
            client._checkpoint_metadata(0, 5)

        stub = pb_grpc.ManagerServiceStub(grpc.insecure_channel(server.address().removeprefix("http://")))
        with pytest.raises(grpc.RpcError) as info:
            stub.Quorum(pb.ManagerQuorumRequest(group_rank=0))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "missing timeout" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            stub.Quorum(pb.ManagerQuorumRequest(group_rank=2), timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # A rank whose group never completes times out, naming the missing ranks; its
        # checkpoint metadata is kept for healers.
        with pytest.raises(TimeoutError, match=r"not joined: \[1\]"):
            client._quorum(group_rank=0, step=0, checkpoint_metadata="meta-0", shrink_only=False, timeout=1.2)
        assert client._checkpoint_metadata(0, 5) == "meta-0"
        client.close()
    finally:
        server.shutdown()


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_local_client_joins_the_same_rounds_as_grpc_ranks(
        flaky: Callable[[int], tuple[FlakyLighthouse, str]]) -> None:
    """Rank 0 calls its own manager server directly (LocalManagerClient, no gRPC round trip);
    the other ranks over gRPC. Same rounds, same barrier, same errors."""
    service, addr = flaky(0)
    server = ManagerServer("local", addr, "127.0.0.1", "[::]:0", "store:1", 2, connect_timeout=5)
    try:
        local, remote = LocalManagerClient(server), ManagerClient(server.address(), connect_timeout=5)
        assert local.address == remote.address
        r0, r1 = run_all(
            lambda: local._quorum(group_rank=0, step=3, checkpoint_metadata="m0", shrink_only=False, timeout=5),
            lambda: remote._quorum(group_rank=1, step=3, checkpoint_metadata="m1", shrink_only=False, timeout=5))
        assert (r0.quorum_id, r0.max_step, r0.replica_ids) == (r1.quorum_id, r1.max_step, r1.replica_ids) \
            == (1, 3, ["local"])
        assert len(service.calls) == 1  # one lighthouse call for the group
        assert local._checkpoint_metadata(1, 5) == "m1" and remote._checkpoint_metadata(0, 5) == "m0"
        assert run_all(lambda: local.should_commit(0, 3, True, 5), lambda: remote.should_commit(1, 3, False, 5)) \
            == [False, False]
        with pytest.raises(TimeoutError, match=r"ShouldCommit to manager .* group ranks \[1\] did not vote"):
            local.should_commit(0, 4, True, 1.2)
        with pytest.raises(TimeoutError, match=r"Quorum to manager .*DEADLINE_EXCEEDED.*not joined: \[1\]"):
            local._quorum(group_rank=0, step=4, checkpoint_metadata="", shrink_only=False, timeout=1.2)
        with pytest.raises(RuntimeError, match="INVALID_ARGUMENT.*outside the replica group"):
            local.should_commit(2, 4, True, 1)
        with pytest.raises(RuntimeError, match="INVALID_ARGUMENT: rank not found"):
            local._checkpoint_metadata(7, 1)
        remote.close()
    finally:
        server.shutdown()


KILL_SCRIPT = """
import sys, time
from ftclient.manager_server import ManagerServer
server = ManagerServer("kill-me", sys.argv[1], "127.0.0.1", "[::]:0", "store:1", 1, connect_timeout=10)
print(server.address(), flush=True)
time.sleep(60)
"""


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_kill_ends_the_manager_process(cluster: LocalCluster) -> None:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, cluster.endpoints], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout=30)
        if not (line and line[0].startswith("http://")):
            proc.kill()
            pytest.fail(f"the manager process printed no address; stderr:\n{proc.stderr.read()}")
        client = ManagerClient(line[0].strip(), connect_timeout=10)
        client.kill("test says bye", timeout=5)
        assert proc.wait(timeout=10) == 1
        client.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


# -- environment ---------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_torchft_environment_variables(monkeypatch: pytest.MonkeyPatch,
                                       flaky: Callable[[int], tuple[FlakyLighthouse, str]]) -> None:
    _, addr = flaky(0)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    port = free_ports(1)[0]
    dead = f"http://127.0.0.1:{free_ports(1)[0]}"
    for name, value in {"TORCHFT_LIGHTHOUSE": f"{dead},{addr}", "TORCHFT_MANAGER_PORT": str(port),
                        "TORCHFT_TIMEOUT_SEC": "7", "TORCHFT_QUORUM_TIMEOUT_SEC": "8",
                        "TORCHFT_CONNECT_TIMEOUT_SEC": "9", "TORCHFT_QUORUM_RETRIES": "2",
                        "REPLICA_GROUP_ID": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
                        "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    m = Manager(pg=FailingPG(), load_state_dict=None, state_dict=None, min_replica_size=1,
                checkpoint_transport=NullTransport(), hostname="127.0.0.1", timeout=timedelta(seconds=1),
                quorum_retries=0)
    try:
        assert m._manager is not None and m._manager.address() == f"http://127.0.0.1:{port}"
        assert (m._timeout, m._quorum_timeout, m._connect_timeout, m._quorum_retries) == (
            timedelta(seconds=7), timedelta(seconds=8), timedelta(seconds=9), 2)
        assert m.replica_id.startswith("3:")
        m.start_quorum()
        assert m.num_participants() == 1 and m.participating_rank() == 0
        assert m.last_quorum_result.replica_ids == [m.replica_id]  # type: ignore[union-attr]
    finally:
        m.shutdown()


# -- wire compatibility with torchft's Rust manager ------------------------------------------------


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_wire_compatible_with_torchft_manager_client_and_server() -> None:
    import torchft._torchft as torchft  # the interop extra: a missing torchft fails this test

    five = timedelta(seconds=5)

    # torchft's Rust ManagerClient -> our ManagerServer.
    lighthouse = torchft.LighthouseServer(bind="[::]:0", min_replicas=1)
    ours = ManagerServer("ours", lighthouse.address(), "127.0.0.1", "[::]:0", "store:1", 1, connect_timeout=5)
    try:
        rust_client = torchft.ManagerClient(ours.address(), connect_timeout=five)
        r = rust_client._quorum(group_rank=0, step=3, checkpoint_metadata="meta", shrink_only=False, timeout=five,
                                commit_failures=2, init_sync=True)
        # (The 0.2.0 wheel's QuorumResult does not expose commit_failures, though its .pyi says so.)
        assert (r.quorum_id, r.replica_rank, r.max_step, r.max_replica_rank, r.heal) == (1, 0, 3, 0, False)
        assert r.replica_ids == ["ours"] and r.recover_src_replica_rank is None
        assert rust_client._checkpoint_metadata(0, timeout=five) == "meta"
        assert rust_client.should_commit(0, 3, True, timeout=five) is True
    finally:
        ours.shutdown()
        lighthouse.shutdown()

    # Our ManagerClient -> torchft's Rust ManagerServer.
    lighthouse = torchft.LighthouseServer(bind="[::]:0", min_replicas=1)
    rust_server = torchft.ManagerServer(
        replica_id="rust", lighthouse_addr=lighthouse.address(), hostname="127.0.0.1", bind="[::]:0",
        store_addr="store:2", world_size=1, heartbeat_interval=timedelta(milliseconds=100), connect_timeout=five,
        quorum_retries=0)
    try:
        client = ManagerClient(rust_server.address(), connect_timeout=5)
        result = client._quorum(0, 4, "m2", False, 5.0, commit_failures=1, init_sync=True)
        assert (result.quorum_id, result.max_step, result.store_address, result.commit_failures) == (1, 4, "store:2", 1)
        assert result.replica_ids == ["rust"] and result.max_replica_rank == 0
        assert client._checkpoint_metadata(0, 5) == "m2"
        assert client.should_commit(0, 4, False, 5) is False
        client.close()
    finally:
        rust_server.shutdown()
        lighthouse.shutdown()


# -- helpers of the Manager ----------------------------------------------------------------------


def test_future_timeout_passes_results_and_errors_and_times_out() -> None:
    from ftclient._timeouts import future_timeout

    done: torch.futures.Future[int] = torch.futures.Future()
    wrapped = future_timeout(done, 5.0)
    done.set_result(3)
    assert wrapped.wait() == 3

    failing: torch.futures.Future[int] = torch.futures.Future()
    wrapped = future_timeout(failing, 5.0)
    failing.set_exception(ValueError("boom"))
    with pytest.raises(ValueError, match="boom"):
        wrapped.wait()

    never: torch.futures.Future[int] = torch.futures.Future()
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        future_timeout(never, 0.2).wait()
    assert 0.15 <= time.monotonic() - started < 2.0


def test_environment_parsing_errors() -> None:
    from ftclient import _env

    assert _env.env_timeout("T", timedelta(seconds=1), {"T": "2.5"}) == timedelta(seconds=2.5)
    assert _env.env_timeout("T", timedelta(seconds=1), {}) == timedelta(seconds=1)
    with pytest.raises(ValueError, match="T='soon' is not a number"):
        _env.env_timeout("T", timedelta(seconds=1), {"T": "soon"})
    with pytest.raises(ValueError, match="TORCHFT_QUORUM_RETRIES"):
        _env.quorum_retries(0, {"TORCHFT_QUORUM_RETRIES": "-1"})
    with pytest.raises(ValueError, match="TORCHFT_LIGHTHOUSE"):
        _env.lighthouse_addr(None, {})
    assert _env.lighthouse_addr(None, {"TORCHFT_LIGHTHOUSE": "http://a:1,http://b:2"}) == "http://a:1,http://b:2"
    assert (_env.replica_group_id({"REPLICA_GROUP_ID": "4"}), _env.num_replica_groups({})) == (4, None)
