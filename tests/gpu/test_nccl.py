"""GPU tests of ftclient's NCCL process groups: ProcessGroupNCCL and ProcessGroupBabyNCCL.

Run on a machine with CUDA (``scripts/gpu_tests.sh``); skipped elsewhere with the reason "CUDA is
not available". One GPU is enough: NCCL refuses two ranks of one communicator on the same GPU
("Duplicate GPU detected"), so the groups here have one member, except
``test_baby_nccl_two_ranks_on_one_gpu``, which tries two and skips with NCCL's refusal as reason.

A hung collective is made without a peer: ``torch.cuda._sleep`` keeps the stream busy for
longer than the group's timeout, so the collective queued behind it cannot finish before its
deadline, exactly as when it waits for a dead peer. The tests check that the trainer is told
(TimeoutError) at the deadline instead of waiting, that the communicator (or the baby's child)
is aborted and later collectives fail at once, and that the next configure works.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Iterator

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

import torch.distributed as dist  # noqa: E402
from torch.distributed import ReduceOp  # noqa: E402

from ftclient.process_group_baby import ProcessGroupBabyNCCL  # noqa: E402
from ftclient.process_group_nccl import ProcessGroupNCCL  # noqa: E402
from support.pids import pid_exists, wait_until_gone  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

CUDA = torch.device("cuda", 0)
HANG_S = 6.0  # how long the stream stays busy in the hang tests
TIMEOUT_S = 2.0  # the groups' timeout in the hang tests


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    yield dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _addr(store: dist.TCPStore, quorum_id: int) -> str:
    return f"127.0.0.1:{store.port}/torchft/{quorum_id}/0"


def _busy_stream(seconds: float) -> None:
    """Keep the current stream busy for about ``seconds`` (a spinning kernel)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 50_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    per_s = cycles / (start.elapsed_time(end) / 1000.0)
    torch.cuda._sleep(int(per_s * seconds))





# ---------------------------------------------------------------------------------------------
# ProcessGroupNCCL


def test_nccl_collectives_and_reconfigure(store: dist.TCPStore) -> None:
    pg = ProcessGroupNCCL(timeout=timedelta(seconds=30))
    pg.configure(_addr(store, 1), "replica_0", 0, 1, quorum_id=1)
    assert (pg.rank(), pg.size(), pg.getBackendName()) == (0, 1, "ftclient-nccl")
    t = torch.arange(4, dtype=torch.float32, device=CUDA)
    pg.allreduce([t], ReduceOp.SUM).wait()
    pg.allreduce([t], ReduceOp(ReduceOp.AVG)).wait()
    fut = pg.allreduce([t], ReduceOp.MAX).get_future()
    assert fut.wait()[0] is t and t.tolist() == [0.0, 1.0, 2.0, 3.0]
    b = torch.full((2,), 5.0, device=CUDA)
    pg.broadcast([b], 0).wait()
    out = torch.zeros(4, device=CUDA)
    pg._allgather_base(out, t).wait()
    outs = [[torch.zeros(4, device=CUDA)]]
    pg.allgather(outs, [t]).wait()
    rs = torch.zeros(4, device=CUDA)
    pg._reduce_scatter_base(rs, t, ReduceOp.SUM).wait()
    a2a = torch.zeros(4, device=CUDA)
    pg.alltoall_base(a2a, t, [], []).wait()
    pg.barrier().wait()
    work = pg.allreduce([t], ReduceOp.SUM)
    work.block_current_stream()  # the stream waits; the CPU does not
    torch.cuda.synchronize()
    assert b.tolist() == [5.0, 5.0]
    assert out.tolist() == outs[0][0].tolist() == rs.tolist() == a2a.tolist() == t.tolist()
    assert pg.errored() is None

    # The next quorum gets a fresh communicator on a new prefix.
    pg.configure(_addr(store, 2), "replica_0", 0, 1, quorum_id=2)
    t2 = torch.ones(3, device=CUDA)
    pg.allreduce([t2], ReduceOp.SUM).wait()
    assert t2.tolist() == [1.0, 1.0, 1.0] and pg.errored() is None
    pg.shutdown()
    with pytest.raises(RuntimeError, match="before configure"):
        pg.allreduce([t2], ReduceOp.SUM)
    pg.configure(_addr(store, 3), "replica_0", 0, 1, quorum_id=3)
    with pytest.raises(ValueError, match="CUDA tensors"):
        pg.allreduce([torch.ones(1)], ReduceOp.SUM)
    pg.shutdown()


def test_nccl_hung_collective_is_aborted_at_the_deadline(store: dist.TCPStore) -> None:
    pg = ProcessGroupNCCL(timeout=timedelta(seconds=TIMEOUT_S))
    pg.configure(_addr(store, 1), "replica_0", 0, 1, quorum_id=1)
    t = torch.ones(8, device=CUDA)
    pg.allreduce([t], ReduceOp.SUM).wait()  # the communicator is up

    _busy_stream(HANG_S)
    start = time.monotonic()
    work = pg.allreduce([t], ReduceOp.SUM)
    assert time.monotonic() - start < 1.0  # launching does not block
    with pytest.raises(TimeoutError, match="NCCL communicator was aborted"):
        work.wait()
    took = time.monotonic() - start
    assert TIMEOUT_S - 0.1 <= took < TIMEOUT_S + 2, took
    assert isinstance(pg.errored(), TimeoutError)
    later = time.monotonic()
    with pytest.raises(RuntimeError, match="not started: the process group was aborted"):
        pg.broadcast([t], 0).wait()
    assert time.monotonic() - later < 0.5

    torch.cuda.synchronize()  # the stream drains once the busy kernel ends
    pg.configure(_addr(store, 2), "replica_0", 0, 1, quorum_id=2)
    t2 = torch.full((2,), 3.0, device=CUDA)
    pg.allreduce([t2], ReduceOp.SUM).wait()
    assert t2.tolist() == [3.0, 3.0] and pg.errored() is None
    pg.shutdown()


def test_nccl_abort_fails_pending_work_at_once(store: dist.TCPStore) -> None:
    pg = ProcessGroupNCCL(timeout=timedelta(seconds=30))
    pg.configure(_addr(store, 1), "replica_0", 0, 1, quorum_id=1)
    t = torch.ones(8, device=CUDA)
    pg.allreduce([t], ReduceOp.SUM).wait()
    _busy_stream(HANG_S)
    work = pg.allreduce([t], ReduceOp.SUM)
    notice = RuntimeError("replica group 1 died (lighthouse notice)")
    start = time.monotonic()
    pg.abort(notice)
    with pytest.raises(RuntimeError, match="lighthouse notice"):
        work.wait()
    assert time.monotonic() - start < 1.0 and pg.errored() is notice
    torch.cuda.synchronize()
    pg.configure(_addr(store, 2), "replica_0", 0, 1, quorum_id=2)
    pg.allreduce([t], ReduceOp.SUM).wait()
    assert pg.errored() is None
    pg.shutdown()


def test_nccl_member_that_never_joins_fails_within_the_timeout(store: dist.TCPStore) -> None:
    """World size 2, rank 1 never comes: configure fails with TimeoutError at the timeout
    instead of hanging (or returning a communicator whose first collective would block the
    trainer inside torch); the group is usable again after a reconfigure."""
    pg = ProcessGroupNCCL(timeout=timedelta(seconds=TIMEOUT_S + 1))
    t = torch.ones(4, device=CUDA)
    start = time.monotonic()
    try:
        pg.configure(_addr(store, 1), "replica_0", 0, 2, quorum_id=1)
    except (TimeoutError, RuntimeError) as e:
        where, error = "configure", e
    else:
        work = pg.allreduce([t], ReduceOp.SUM)
        with pytest.raises(Exception) as info:
            work.wait()
        where, error = "allreduce", info.value
    took = time.monotonic() - start
    print(f"a member that never joins: {where} failed after {took:.2f}s: {error}")
    # configure waits for every member (one small collective), bounded by the timeout.
    assert where == "configure" and isinstance(error, TimeoutError), (where, took, error)
    assert TIMEOUT_S + 1 - 0.1 <= took < TIMEOUT_S + 1 + 2, took
    assert pg.errored() is not None
    pg.configure(_addr(store, 2), "replica_0", 0, 1, quorum_id=2)
    pg.allreduce([t], ReduceOp.SUM).wait()
    assert pg.errored() is None
    pg.shutdown()


# ---------------------------------------------------------------------------------------------
# ProcessGroupBabyNCCL


def test_baby_nccl_results_cross_cuda_ipc_and_reconfigure(store: dist.TCPStore) -> None:
    pg = ProcessGroupBabyNCCL(timeout=timedelta(seconds=30))
    pg.configure(_addr(store, 1), "replica_0", 0, 1, quorum_id=1)
    first_child = pg.child_pid
    assert first_child is not None and first_child != os.getpid() and pid_exists(first_child)
    t = torch.arange(6, dtype=torch.float32, device=CUDA)
    pg.allreduce([t], ReduceOp.SUM).wait()
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    # The child writes the outputs into this process's memory (CUDA IPC).
    out = torch.zeros(6, device=CUDA)
    pg._allgather_base(out, t).wait()
    a2a = torch.zeros(6, device=CUDA)
    pg.alltoall_base(a2a, t * 2, [], []).wait()
    assert out.tolist() == t.tolist()
    assert a2a.tolist() == (t * 2).tolist()
    with pytest.raises(ValueError, match="CUDA tensors"):
        pg.allreduce([torch.ones(1)], ReduceOp.SUM)
    assert pg.errored() is None

    pg.configure(_addr(store, 2), "replica_0", 0, 1, quorum_id=2)
    assert pg.child_pid != first_child
    wait_until_gone(first_child)
    out = torch.zeros(6, device=CUDA)
    pg._allgather_base(out, t + 1).wait()
    assert out.tolist() == (t + 1).tolist()
    pg.shutdown()


def test_baby_nccl_hung_collective_kills_the_child(store: dist.TCPStore) -> None:
    pg = ProcessGroupBabyNCCL(timeout=timedelta(seconds=TIMEOUT_S))
    pg.configure(_addr(store, 1), "replica_0", 0, 1, quorum_id=1)
    child = pg.child_pid
    assert child is not None
    t = torch.ones(4, device=CUDA)
    pg.allreduce([t], ReduceOp.SUM).wait()

    _busy_stream(HANG_S)  # the child waits for this stream's event before its collective
    start = time.monotonic()
    work = pg.allreduce([t], ReduceOp.SUM)
    assert time.monotonic() - start < 1.0
    with pytest.raises(TimeoutError, match="child process was killed"):
        work.wait()
    took = time.monotonic() - start
    assert TIMEOUT_S - 0.1 <= took < TIMEOUT_S + 3, took
    wait_until_gone(child)
    assert isinstance(pg.errored(), TimeoutError)

    torch.cuda.synchronize()
    pg.configure(_addr(store, 2), "replica_0", 0, 1, quorum_id=2)
    out = torch.zeros(4, device=CUDA)
    pg._allgather_base(out, t * 3).wait()
    assert out.tolist() == [3.0] * 4 and pg.errored() is None
    pg.shutdown()


def test_baby_nccl_two_ranks_on_one_gpu(store: dist.TCPStore) -> None:
    """Two ranks, each in its own child on the same GPU. NCCL refuses this in most versions
    ("Duplicate GPU detected"); then the test skips with NCCL's message as the reason."""
    pgs = [ProcessGroupBabyNCCL(timeout=timedelta(seconds=30)) for _ in range(2)]
    errors: list[BaseException] = []

    def configure(rank: int) -> None:
        try:
            pgs[rank].configure(_addr(store, 1), f"replica_{rank}", rank, 2, quorum_id=1)
        except BaseException as e:  # noqa: BLE001 -- checked below
            errors.append(e)

    threads = [threading.Thread(target=configure, args=(r,)) for r in range(2)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(200)
        assert not any(th.is_alive() for th in threads)
        tensors = [torch.full((3,), float(r + 1), device=CUDA) for r in range(2)]
        if not errors:
            works = [pg.allreduce([x], ReduceOp.SUM) for pg, x in zip(pgs, tensors)]
            for w in works:
                try:
                    w.wait()
                except Exception as e:  # noqa: BLE001 -- checked below
                    errors.append(e)
        refused = [e for e in errors if "Duplicate GPU" in str(e) or "invalid usage" in str(e)]
        if refused:
            pytest.skip(f"NCCL refuses two ranks on one GPU: {str(refused[0])[:300]}")
        assert not errors, errors
        assert [x.tolist() for x in tensors] == [[3.0, 3.0, 3.0]] * 2
    finally:
        for pg in pgs:
            pg.shutdown()
