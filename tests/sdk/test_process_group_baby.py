"""ftclient.process_group_baby: collectives in a killable child process (ProcessGroupBabyGloo).

Unit tests check the pieces without processes: how reduce ops become plain spec arguments,
Gloo's AVG emulation in ``launch``, and that an operation before ``configure`` is refused (also
by ProcessGroupNCCL, whose collectives are tested on a GPU in ``tests/gpu/test_nccl.py``). The integration tests run real 2-rank groups (two ProcessGroupBabyGloo in this
process, each with its own child) over a TCPStore hosted by the test:

- SUM/AVG allreduce, broadcast and allgather results are right, in the caller's own tensors;
- ``abort`` fails a pending collective at once and kills the child; the surviving rank's next
  collective fails too (its peer's child is gone) instead of hanging;
- a reconfigure after the abort spawns fresh children and works (ranks swapped, new prefix);
- a collective that a live peer never joins fails with TimeoutError at the deadline, the child
  is SIGKILLed, the parent is not blocked, and later collectives fail at once;
- a child that dies while configure waits for the rendezvous makes configure raise at once;
- ftclient's Manager drives baby groups (two replica groups on a fake lighthouse node): a step
  commits with the right average, a peer-death notice fails the pending allreduce at once by
  killing the child, and the next quorum spawns fresh children and commits.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed import AllreduceOptions, ReduceOp

from ftclient import _collective_ops
from ftclient.manager import Manager
from ftclient.process_group_baby import ProcessGroupBabyGloo, reduce_op_name
from ftclient.process_group_nccl import ProcessGroupNCCL
from support.fake_watch import FakeWatchNode
from support.null_transport import NullTransport
from support.pids import pid_exists, wait_until_gone
from support.waiting import wait_for

pytestmark = [pytest.mark.timeout(240), pytest.mark.exclusive]  # exclusive: runs alone (conftest)

OP_TIMEOUT_S = 2.0
CONFIGURE_BOUND_S = 150.0  # child start-up (spawn + import torch, slow on a loaded 2-core machine) + rendezvous


# ---------------------------------------------------------------------------------------------
# Unit tests


def test_reduce_op_names() -> None:
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.MAX
    assert reduce_op_name(ReduceOp.SUM) == "SUM"
    assert reduce_op_name(ReduceOp(ReduceOp.AVG)) == "AVG"
    assert reduce_op_name(opts) == "MAX"
    assert reduce_op_name(None) == "SUM"
    with pytest.raises(TypeError, match="expected a ReduceOp"):
        reduce_op_name("SUM")


class _RecordingBackend:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def allreduce(self, tensors: list[torch.Tensor], opts: AllreduceOptions) -> str:
        self.calls.append(("allreduce", opts.reduceOp))
        return "work"


def test_launch_emulates_avg_for_gloo_as_a_sum_then_a_division() -> None:
    backend = _RecordingBackend()
    t = torch.tensor([4.0, 8.0])
    work, post = _collective_ops.launch(backend, "allreduce", ([t], "AVG"), 4, emulate_avg=True)
    assert work == "work" and backend.calls == [("allreduce", ReduceOp.SUM)]
    assert post is not None
    post()
    assert t.tolist() == [1.0, 2.0]
    _, post = _collective_ops.launch(backend, "allreduce", ([t], "AVG"), 4, emulate_avg=False)
    assert post is None and backend.calls[-1] == ("allreduce", ReduceOp.AVG)
    with pytest.raises(ValueError, match="floating point"):
        _collective_ops.launch(backend, "allreduce", ([torch.tensor([1])], "AVG"), 2, emulate_avg=True)
    with pytest.raises(ValueError, match="unknown collective"):
        _collective_ops.launch(backend, "gather", (), 2, emulate_avg=True)


def test_operations_before_configure_are_refused() -> None:
    pg = ProcessGroupBabyGloo(timeout=timedelta(seconds=1))
    with pytest.raises(RuntimeError, match="before configure"):
        pg.allreduce([torch.zeros(1)], ReduceOp.SUM)
    with pytest.raises(RuntimeError, match="before configure"):
        pg.size()
    assert pg.errored() is None and pg.child_pid is None
    assert pg.getBackendName() == "ftclient-baby-gloo"


def test_nccl_group_refuses_operations_before_configure_and_configure_without_cuda() -> None:
    """ProcessGroupNCCL itself is tested on a GPU (tests/gpu/test_nccl.py); here only what
    needs none."""
    pg = ProcessGroupNCCL(timeout=5)
    assert repr(pg) == "ProcessGroupNCCL(rank=None, world_size=None, quorum_id=None, timeout=5s)"
    with pytest.raises(RuntimeError, match="before configure"):
        pg.allreduce([torch.zeros(1)], ReduceOp.SUM)
    with pytest.raises(ValueError, match="rank must be in"):
        pg.configure("127.0.0.1:1/p", "replica_0", 2, 2)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs CUDA"):
            pg.configure("127.0.0.1:1/p", "replica_0", 0, 1)


# ---------------------------------------------------------------------------------------------
# Integration tests


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    yield dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


@pytest.fixture
def pgs() -> Iterator[list[ProcessGroupBabyGloo]]:
    groups = [ProcessGroupBabyGloo(timeout=timedelta(seconds=OP_TIMEOUT_S)) for _ in range(2)]
    yield groups
    for pg in groups:
        pg.shutdown()


def _configure_all(pgs: list[ProcessGroupBabyGloo], store: dist.TCPStore, quorum_id: int,
                   ranks: list[int]) -> None:
    """Configure every group at once (each waits in the rendezvous for the others)."""
    errors: list[BaseException] = []

    def run(pg: ProcessGroupBabyGloo, rank: int) -> None:
        try:
            pg.configure(f"127.0.0.1:{store.port}/torchft/{quorum_id}/0", f"replica_{rank}", rank,
                         len(pgs), quorum_id)
        except BaseException as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(pg, rank)) for pg, rank in zip(pgs, ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(CONFIGURE_BOUND_S)
    assert not any(t.is_alive() for t in threads), "configure did not return"
    assert not errors, errors






def _failure(work: dist._Work, bound_s: float) -> tuple[BaseException, float]:
    """Wait for ``work`` (at most ``bound_s``) and return the error it raised and the time."""
    start = time.monotonic()
    with pytest.raises(Exception) as info:
        work.wait(timedelta(seconds=bound_s))
    return info.value, time.monotonic() - start


@pytest.mark.integration
def test_two_ranks_results_abort_reconfigure_and_timeout(store: dist.TCPStore,
                                                         pgs: list[ProcessGroupBabyGloo]) -> None:
    _configure_all(pgs, store, quorum_id=1, ranks=[0, 1])
    children = [pg.child_pid for pg in pgs]
    assert None not in children and os.getpid() not in children and children[0] != children[1]
    assert [pg.rank() for pg in pgs] == [0, 1] and [pg.size() for pg in pgs] == [2, 2]

    # Results land in the caller's own tensors.
    tensors = [torch.tensor([1.0, 2.0, 3.0]) * (r + 1) for r in range(2)]
    for work in [pg.allreduce([t], ReduceOp.SUM) for pg, t in zip(pgs, tensors)]:
        work.wait()
    assert [t.tolist() for t in tensors] == [[3.0, 6.0, 9.0]] * 2
    works = [pg.allreduce([t], ReduceOp(ReduceOp.AVG)) for pg, t in zip(pgs, tensors)]
    assert [w.get_future().wait()[0] is t for w, t in zip(works, tensors)] == [True, True]
    assert [t.tolist() for t in tensors] == [[3.0, 6.0, 9.0]] * 2
    bcast = [torch.tensor([10.0 * r]) for r in range(2)]
    for work in [pg.broadcast([t], 1) for pg, t in zip(pgs, bcast)]:
        work.wait()
    assert [t.item() for t in bcast] == [10.0, 10.0]
    outs = [[torch.zeros(2), torch.zeros(2)] for _ in range(2)]
    for work in [pg.allgather([o], [torch.full((2,), float(r))]) for r, (pg, o) in enumerate(zip(pgs, outs))]:
        work.wait()
    assert [[x.tolist() for x in o] for o in outs] == [[[0.0, 0.0], [1.0, 1.0]]] * 2
    assert [pg.errored() for pg in pgs] == [None, None]

    # abort() fails a pending collective at once and kills the child.
    pending = pgs[1].allreduce([torch.ones(4)], ReduceOp.SUM)
    assert not pending.is_completed()
    notice = RuntimeError("replica group 0 died (lighthouse notice)")
    start = time.monotonic()
    pgs[1].abort(notice)
    error, _ = _failure(pending, OP_TIMEOUT_S)
    assert error is notice and time.monotonic() - start < 1.5
    wait_until_gone(children[1])
    assert pgs[1].errored() is notice
    error, took = _failure(pgs[1].allreduce([torch.ones(1)], ReduceOp.SUM), OP_TIMEOUT_S)
    assert "not started: the process group was aborted" in str(error) and took < 0.5
    # Rank 0's next collective fails too (its peer's child is gone), within the deadline.
    error, took = _failure(pgs[0].allreduce([torch.ones(4)], ReduceOp.SUM), OP_TIMEOUT_S + 5)
    assert took < OP_TIMEOUT_S + 3 and pgs[0].errored() is error, (error, took)

    # A reconfigure after the abort spawns fresh children and works (new prefix, ranks swapped).
    _configure_all(pgs, store, quorum_id=2, ranks=[1, 0])
    assert [pg.errored() for pg in pgs] == [None, None] and [pg.rank() for pg in pgs] == [1, 0]
    fresh = [pg.child_pid for pg in pgs]
    assert not set(fresh) & set(children)
    tensors = [torch.full((3,), float(r + 1)) for r in range(2)]
    for work in [pg.allreduce([t], ReduceOp.SUM) for pg, t in zip(pgs, tensors)]:
        work.wait()
    assert [t.tolist() for t in tensors] == [[3.0, 3.0, 3.0]] * 2

    # A collective that the (live) peer never joins: TimeoutError at the deadline, the child is
    # killed, and the parent was never blocked (submitting returned at once).
    start = time.monotonic()
    stuck = torch.full((3,), 7.0)
    work = pgs[0].allreduce([stuck], ReduceOp.SUM)
    assert time.monotonic() - start < 0.5
    error, _ = _failure(work, OP_TIMEOUT_S + 10)
    took = time.monotonic() - start
    assert isinstance(error, TimeoutError) and "child process was killed" in str(error), error
    assert OP_TIMEOUT_S - 0.1 <= took < OP_TIMEOUT_S + 3, took
    wait_until_gone(fresh[0])
    assert isinstance(pgs[0].errored(), TimeoutError)
    assert stuck.tolist() == [7.0, 7.0, 7.0]
    error, took = _failure(pgs[0].broadcast([torch.ones(1)], 0), OP_TIMEOUT_S)
    assert "not started" in str(error) and took < 0.5


@pytest.mark.integration
def test_a_child_that_dies_during_configure_fails_it_at_once(store: dist.TCPStore) -> None:
    pg = ProcessGroupBabyGloo(timeout=timedelta(seconds=60))  # the rendezvous would wait 60 s
    raised: list[BaseException] = []

    def configure() -> None:
        try:
            pg.configure(f"127.0.0.1:{store.port}/torchft/9/0", "replica_0", 0, 2, 9)  # rank 1 never comes
        except BaseException as e:  # noqa: BLE001 -- checked below
            raised.append(e)

    thread = threading.Thread(target=configure)
    thread.start()
    try:
        pid = wait_for("the child process to start", lambda: pg.child_pid, timeout=30)
        # The child is waiting in the rendezvous once its store client registered its key.
        wait_for("the child to reach the rendezvous", lambda: store.num_keys() >= 1, timeout=CONFIGURE_BOUND_S)
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        thread.join(10)
        assert not thread.is_alive()
        assert time.monotonic() - killed_at < 5
    finally:
        pg.shutdown()
        thread.join(70)
    assert len(raised) == 1 and "child process exited (exit code -9)" in str(raised[0]), raised
    assert pg.errored() is not None


@pytest.mark.integration
def test_the_manager_drives_baby_groups_and_a_peer_death_kills_the_child() -> None:
    timeout = timedelta(seconds=30)
    pool = ThreadPoolExecutor(4)

    def both(*calls: Callable[[], Any]) -> list[Any]:
        return [f.result(timeout=CONFIGURE_BOUND_S) for f in [pool.submit(c) for c in calls]]

    def step(m: Manager, value: float) -> tuple[list[float], bool]:
        m.start_quorum()
        out = m.allreduce(torch.tensor([value])).get_future().wait().tolist()
        return out, m.should_commit()

    with FakeWatchNode("n1", quorum_size=2) as node:
        pgs = [ProcessGroupBabyGloo(timeout=timeout) for _ in range(2)]
        stores = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(2)]
        managers: list[Manager] = []
        try:
            managers.extend(both(*[lambda i=i: Manager(
                pg=pgs[i], load_state_dict=None, state_dict=None, min_replica_size=1, use_async_quorum=False,
                timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout, rank=0, world_size=1,
                store_addr="127.0.0.1", store_port=stores[i].port, lighthouse_addr=node.url, replica_id=f"g{i}",
                hostname="127.0.0.1", checkpoint_transport=NullTransport(), init_sync=False,
                liveness_interval=timedelta(milliseconds=50)) for i in range(2)]))
            a, b = managers
            assert both(lambda: step(a, 1.0), lambda: step(b, 3.0)) == [([2.0], True)] * 2
            first = [pg.child_pid for pg in pgs]
            assert None not in first

            # The same quorum again: a waits in its allreduce, b never joins ("died").
            both(a.start_quorum, b.start_quorum)
            work = a.allreduce(torch.tensor([5.0]))
            assert not work.is_completed()
            (stream,) = wait_for("a's liveness stream",
                                 lambda: [s for s in node.open_streams() if s.replica_id == a.replica_id], 10)
            pushed = time.monotonic()
            stream.push_peer_died(1, [b.replica_id])  # the notice reaches a only
            assert work.wait() is False  # failed (the Manager never raises)
            assert time.monotonic() - pushed < 2.0, "the allreduce did not fail at once"
            # a's child was killed (and reaped) before the work failed; b's lives on.
            wait_until_gone(first[0])
            assert pid_exists(first[1]) and a.should_commit() is False
            b.report_error(RuntimeError("b is out of this step"))
            assert b.should_commit() is False

            # The next quorum spawns fresh children and commits.
            node.next_quorum_id = 2
            assert both(lambda: step(a, 2.0), lambda: step(b, 4.0)) == [([3.0], True)] * 2
            assert pgs[0].child_pid not in first and pgs[1].child_pid not in first
        finally:
            for m in managers:
                m.shutdown(wait=False)
            for pg in pgs:
                pg.shutdown()
            pool.shutdown(wait=False)
