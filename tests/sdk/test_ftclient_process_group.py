"""ftclient.process_group: reconfigurable Gloo groups, deadlines, error swallowing, managed PG.

Unit tests run in-process (world size 1 groups, fake works and managers). The integration test
runs two real processes over a TCPStore hosted by the test: SUM/AVG allreduces, a
reconfiguration to a new quorum prefix with swapped ranks, a peer that stops participating
(the survivor fails at the timeout, not later) and a peer that dies (the survivor fails at
once; the error-swallowing wrapper records it and returns).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import subprocess
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed import AllreduceOptions, ReduceOp
from torch.futures import Future

from ftclient.process_group import (
    ErrorSwallowingProcessGroupWrapper,
    ManagedProcessGroup,
    ProcessGroup,
    ProcessGroupDummy,
    ProcessGroupGloo,
    _DeadlineWork,
    parse_store_addr,
)

pytestmark = [pytest.mark.timeout(60), pytest.mark.exclusive]  # exclusive: runs alone (conftest)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield master


def _addr(store: dist.TCPStore, quorum_id: int) -> str:
    return f"127.0.0.1:{store.port}/torchft/{quorum_id}/0"


# ---------------------------------------------------------------------------------------------
# Unit tests


@pytest.mark.parametrize(
    "addr, expected",
    [
        ("localhost:1234/torchft/3/0", ("localhost", 1234, "torchft/3/0")),
        ("10.0.0.1:29500/", ("10.0.0.1", 29500, "")),
        ("[::1]:29500/a/b", ("::1", 29500, "a/b")),
        ("myhost:80", ("myhost", 80, "")),
    ],
)
def test_parse_store_addr(addr: str, expected: tuple[str, int, str]) -> None:
    assert parse_store_addr(addr) == expected


@pytest.mark.parametrize("addr", ["localhost/prefix", ":1234/p", "host:port/p", ""])
def test_parse_store_addr_rejects_malformed(addr: str) -> None:
    with pytest.raises(ValueError, match="expected 'host:port/prefix'"):
        parse_store_addr(addr)


def test_gloo_single_rank_ops_and_reconfigure(store: dist.TCPStore) -> None:
    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
    with pytest.raises(RuntimeError, match="before configure"):
        pg.allreduce([torch.ones(2)], ReduceOp.SUM)
    with pytest.raises(RuntimeError, match="before configure"):
        pg.size()

    pg.configure(_addr(store, 1), "replica0", 0, 1, quorum_id=1)
    assert pg.size() == 1 and pg.errored() is None
    t = torch.tensor([1.0, 2.0])
    work = pg.allreduce([t], ReduceOp.SUM)
    assert work.wait() is True
    assert work.get_future().value() == [t]
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.AVG
    assert pg.allreduce([t], opts).get_future().wait()[0].tolist() == [1.0, 2.0]
    with pytest.raises(ValueError, match="floating point"):
        pg.allreduce([torch.tensor([1])], ReduceOp.AVG)

    pg.configure(_addr(store, 2), "replica0", 0, 1, quorum_id=2)
    out = [[torch.zeros(2)]]
    pg.allgather(out, [torch.tensor([3.0, 4.0])]).wait()
    assert out[0][0].tolist() == [3.0, 4.0]
    pg.broadcast([t], 0).wait()
    pg.barrier().wait()
    pg.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        pg.allreduce([t], ReduceOp.SUM)


def test_gloo_configure_fails_within_timeout_when_a_member_is_missing(
    store: dist.TCPStore,
) -> None:
    pg = ProcessGroupGloo(timeout=timedelta(seconds=1))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="did not join in time"):
        pg.configure(_addr(store, 1), "replica0", 0, 2, quorum_id=1)
    assert time.monotonic() - start < 5
    with pytest.raises(ValueError, match="rank must be in"):
        pg.configure(_addr(store, 2), "replica0", 2, 2)


class _NeverWork(dist._Work):
    """A work whose future never completes (a wedged collective)."""

    def __init__(self) -> None:
        super().__init__()
        self.fut: Future[Any] = Future()

    def get_future(self) -> Future[Any]:
        return self.fut

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.fut.wait()
        return True


def test_deadline_work_fails_at_the_deadline_even_if_the_backend_never_answers() -> None:
    errors: list[Exception] = []
    inner = _NeverWork()
    work = _DeadlineWork(inner, ["t"], "allreduce", timedelta(seconds=0.5), errors.append)
    with pytest.raises(TimeoutError, match=r"wait\(timeout=0.1s\)"):
        work.wait(timedelta(seconds=0.1))  # a shorter wait gives up on its own
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="allreduce timed out after 0.5s"):
        work.wait()
    assert time.monotonic() - start < 2
    assert work.get_future().done()
    assert len(errors) == 1 and isinstance(errors[0], TimeoutError)
    inner.fut.set_result(["late"])  # a late answer changes nothing
    assert len(errors) == 1


def test_deadline_work_passes_results_and_errors_through() -> None:
    errors: list[Exception] = []
    ok = _NeverWork()
    work = _DeadlineWork(ok, ["result"], "allreduce", timedelta(seconds=5), errors.append)
    ok.fut.set_result(None)
    assert work.get_future().wait() == ["result"] and errors == []

    bad = _NeverWork()
    work = _DeadlineWork(bad, None, "broadcast", timedelta(seconds=5), errors.append)
    bad.fut.set_exception(RuntimeError("Connection closed by peer"))
    with pytest.raises(RuntimeError, match="broadcast failed: Connection closed by peer"):
        work.wait()
    assert len(errors) == 1


class _FlakyPG(ProcessGroup):
    """Fails the way it is told to: at launch, or through the work's future."""

    def __init__(self) -> None:
        super().__init__()
        self.mode = "ok"
        self.calls = 0
        self.configured = 0

    def configure(self, *args: Any, **kwargs: Any) -> None:
        self.configured += 1

    def allreduce(self, tensors: list[torch.Tensor], opts: object = None) -> dist._Work:
        self.calls += 1
        if self.mode == "raise":
            raise RuntimeError("launch failed")
        work = _NeverWork()
        if self.mode == "future_error":
            work.fut.set_exception(RuntimeError("peer gone"))
        else:
            for t in tensors:
                t.mul_(2)
            work.fut.set_result(tensors)
        return work

    def size(self) -> int:
        return 2


def test_error_swallowing_wrapper_records_first_error_and_skips_until_configure() -> None:
    inner = _FlakyPG()
    pg = ErrorSwallowingProcessGroupWrapper(inner)
    t = torch.ones(2)
    assert pg.allreduce([t], ReduceOp.SUM).get_future().wait()[0].tolist() == [2.0, 2.0]
    assert pg.errored() is None

    inner.mode = "future_error"
    fut = pg.allreduce([t], ReduceOp.SUM).get_future()
    assert fut.wait() == [t]  # completed with the input, no exception
    assert "peer gone" in str(pg.errored())

    inner.mode = "raise"  # ignored: the wrapper no longer calls the inner group
    calls = inner.calls
    work = pg.allreduce([t], ReduceOp.SUM)
    assert work.wait() is True and work.get_future().value() == [t]
    assert inner.calls == calls
    assert "peer gone" in str(pg.errored())  # the first error wins

    pg.configure("h:1/p", "r", 0, 2)
    assert pg.errored() is None and inner.configured == 1
    assert pg.allreduce([t], ReduceOp.SUM).wait() is True  # launch error swallowed
    assert "launch failed" in str(pg.error())

    pg.configure("h:1/p", "r", 0, 2)
    inner.mode = "future_error"
    assert pg.allreduce([t], ReduceOp.SUM).wait() is True  # wait() swallows too
    assert "peer gone" in str(pg.errored())


class _FakeManager:
    def __init__(self, participants: int) -> None:
        self.participants = participants
        self.calls: list[tuple[torch.Tensor, dict[str, Any]]] = []

    def allreduce(self, tensor: torch.Tensor, **kwargs: Any) -> Future[torch.Tensor]:
        self.calls.append((tensor, kwargs))
        fut: Future[torch.Tensor] = Future()
        fut.set_result(tensor)
        return fut

    def num_participants(self) -> int:
        return self.participants

    def errored(self) -> Exception | None:
        return None


def test_managed_process_group_routes_through_the_manager() -> None:
    manager = _FakeManager(participants=3)
    pg = ManagedProcessGroup(manager)
    t = torch.ones(3)
    work = pg.allreduce([t], ReduceOp.AVG)
    assert work.wait() is True and work.get_future().value() is t
    assert manager.calls[-1] == (t, {})
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM
    pg.allreduce([t], opts).wait()
    assert manager.calls[-1][1] == {"reduce_op": ReduceOp.SUM}
    assert pg.size() == 3
    manager.participants = 2
    assert pg.size() == 2
    assert pg.errored() is None
    with pytest.raises(ValueError, match="exactly one tensor"):
        pg.allreduce([t, t], ReduceOp.AVG)
    with pytest.raises(RuntimeError, match="reconfigured by its Manager"):
        pg.configure("h:1/p", "r", 0, 1)


def test_dummy_process_group() -> None:
    pg = ProcessGroupDummy(0, 1)
    t = torch.ones(2)
    assert pg.allreduce([t]).get_future().value() == [t]
    out = [[torch.zeros(2)]]
    pg.allgather(out, [t]).wait()
    assert torch.equal(out[0][0], t) and pg.size() == 1
    with pytest.raises(ValueError, match="single-rank"):
        ProcessGroupDummy(1, 2)


def test_deadline_work_abort_settles_once_and_skips_post() -> None:
    errors: list[Exception] = []
    posted: list[bool] = []
    inner = _NeverWork()
    work = _DeadlineWork(inner, ["t"], "allreduce", timedelta(seconds=5), errors.append,
                         post=lambda: posted.append(True))
    assert work.abort(RuntimeError("peer died")) is True
    with pytest.raises(RuntimeError, match="peer died"):
        work.wait()
    assert work.abort(RuntimeError("again")) is False  # settled once
    inner.fut.set_result(None)  # the backend completes after the abort: post never runs
    assert posted == [] and len(errors) == 1

    done = _NeverWork()
    work = _DeadlineWork(done, ["t"], "allreduce", timedelta(seconds=5), errors.append,
                         post=lambda: posted.append(True))
    done.fut.set_result(None)
    assert work.abort(RuntimeError("too late")) is False  # completion won: the result stands
    assert work.get_future().wait() == ["t"] and posted == [True]


def _two_ranks(store: dist.TCPStore, quorum_id: int, timeout_s: float = 10.0) -> list[ProcessGroupGloo]:
    """Two ProcessGroupGloo ranks of one quorum, in this process (configure blocks until both joined)."""
    pgs = [ProcessGroupGloo(timeout=timedelta(seconds=timeout_s)) for _ in range(2)]
    errors: list[BaseException] = []

    def configure(rank: int) -> None:
        try:
            pgs[rank].configure(f"127.0.0.1:{store.port}/torchft/{quorum_id}/0", f"r{rank}", rank, 2,
                                quorum_id=quorum_id)
        except BaseException as e:  # noqa: BLE001 -- re-raised below
            errors.append(e)

    threads = [threading.Thread(target=configure, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors and all(not t.is_alive() for t in threads), errors
    return pgs


def test_gloo_abort_fails_a_pending_allreduce_at_once_and_later_ones_until_configure(
    store: dist.TCPStore,
) -> None:
    pgs = _two_ranks(store, 1)
    t = torch.tensor([1.0, 2.0])
    work = pgs[0].allreduce([t], ReduceOp.SUM)  # rank 1 never joins it: pending until the timeout
    time.sleep(0.1)
    assert not work.get_future().done()
    started = time.monotonic()
    pgs[0].abort(RuntimeError("peer r1 of quorum 1 died"))
    with pytest.raises(RuntimeError, match="peer r1 of quorum 1 died"):
        work.wait()
    assert time.monotonic() - started < 1.0
    assert "peer r1 of quorum 1 died" in str(pgs[0].errored())
    with pytest.raises(RuntimeError, match="not started: the process group was aborted"):
        pgs[0].allreduce([torch.ones(1)], ReduceOp.SUM).wait()

    # Rank 1 turns out to be alive (a false death): the aborted allreduce completes in Gloo
    # after all, but the caller's tensor keeps its input (Gloo reduced a staged copy).
    pgs[1].allreduce([torch.tensor([10.0, 20.0])], ReduceOp.SUM).wait()
    assert t.tolist() == [1.0, 2.0]

    # A new configuration works again.
    for pg in pgs:
        pg.shutdown()
    pgs = _two_ranks(store, 2)
    a, b = torch.tensor([1.0, 3.0]), torch.tensor([3.0, 5.0])
    works = [pgs[0].allreduce([a], ReduceOp.AVG), pgs[1].allreduce([b], ReduceOp.AVG)]
    for w in works:
        w.wait()
    assert a.tolist() == b.tolist() == [2.0, 4.0]
    assert pgs[0].errored() is None
    for pg in pgs:
        pg.shutdown()


def test_gloo_abort_ends_a_configure_waiting_for_a_member(store: dist.TCPStore) -> None:
    pg = ProcessGroupGloo(timeout=timedelta(seconds=10))
    errors: list[BaseException] = []

    def configure() -> None:
        try:
            pg.configure(_addr(store, 7), "r0", 0, 2, quorum_id=7)  # rank 1 never joins
        except BaseException as e:  # noqa: BLE001 -- checked below
            errors.append(e)

    thread = threading.Thread(target=configure)
    thread.start()
    time.sleep(0.3)
    started = time.monotonic()
    pg.abort(RuntimeError("peer r1 of quorum 7 died"))
    thread.join(5)
    assert not thread.is_alive() and time.monotonic() - started < 1.0
    assert len(errors) == 1 and "was aborted" in str(errors[0]) and "peer r1 of quorum 7 died" in str(errors[0])
    # The next configure is not affected.
    pgs = _two_ranks(store, 8)
    a, b = torch.tensor([1.0]), torch.tensor([2.0])
    for w in [pgs[0].allreduce([a], ReduceOp.SUM), pgs[1].allreduce([b], ReduceOp.SUM)]:
        w.wait()
    assert a.tolist() == [3.0] and pgs[0].errored() is None
    for g in pgs:
        g.shutdown()


def test_gloo_abort_after_completion_changes_nothing(store: dist.TCPStore) -> None:
    pgs = _two_ranks(store, 1)
    a, b = torch.tensor([1.0]), torch.tensor([2.0])
    works = [pgs[0].allreduce([a], ReduceOp.SUM), pgs[1].allreduce([b], ReduceOp.SUM)]
    for w in works:
        w.wait()
    pgs[0].abort(RuntimeError("late notice"))
    assert works[0].get_future().value() == [a] and a.tolist() == [3.0]
    assert pgs[0].errored() is None  # nothing failed: the step may commit
    with pytest.raises(RuntimeError, match="not started"):
        pgs[0].allreduce([a], ReduceOp.SUM).wait()  # but nothing more runs on this configuration
    assert "late notice" in str(pgs[0].errored())
    for pg in pgs:
        pg.shutdown()


def test_error_swallowing_wrapper_abort_records_and_forwards() -> None:
    class Aborting(_FlakyPG):
        def __init__(self) -> None:
            super().__init__()
            self.aborted: list[Exception | None] = []

        def abort(self, error: Exception | None = None) -> None:
            self.aborted.append(error)

    inner = Aborting()
    pg = ErrorSwallowingProcessGroupWrapper(inner)
    err = RuntimeError("peer died")
    pg.abort(err)
    assert inner.aborted == [err] and pg.errored() is None  # nothing failed yet
    t = torch.ones(1)
    assert pg.allreduce([t], ReduceOp.SUM).get_future().wait() == [t] and inner.calls == 0
    assert pg.errored() is err
    pg.configure("h:1/p", "r", 0, 2)
    assert pg.errored() is None and pg.allreduce([t], ReduceOp.SUM).wait() and inner.calls == 1
    ProcessGroupDummy().abort(err)  # the base class's abort is a no-op


# ---------------------------------------------------------------------------------------------
# Two real processes

TIMEOUT_S = 3.0


def _pg_worker(rank: int, port: int, barrier: Any, results: Any) -> None:
    """One replica group's rank 0: four quorums, see the module docstring."""
    try:
        timeout = timedelta(seconds=TIMEOUT_S)
        pg = ProcessGroupGloo(timeout=timeout)

        def addr(quorum_id: int) -> str:
            return f"127.0.0.1:{port}/torchft/{quorum_id}/0"

        # Quorum 1: SUM, AVG, integer SUM with AllreduceOptions.
        pg.configure(addr(1), f"replica{rank}", rank, 2, quorum_id=1)
        t = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
        pg.allreduce([t], ReduceOp.SUM).wait()
        avg = torch.tensor([float(rank), 4.0])
        avg_result = pg.allreduce([avg], ReduceOp.AVG).get_future().wait()[0]
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        ints = torch.tensor([rank + 1, 100], dtype=torch.int64)
        pg.allreduce([ints], opts).wait()
        results.put((rank, "q1", t.tolist(), avg_result.tolist(), ints.tolist(), pg.size()))

        # Quorum 2: a new prefix, ranks swapped, a bigger tensor.
        pg.configure(addr(2), f"replica{rank}", 1 - rank, 2, quorum_id=2)
        big = torch.full((100_000,), float(rank + 1))
        pg.allreduce([big], ReduceOp.SUM).wait()
        results.put((rank, "q2", big.unique().tolist(), pg.errored() is None))

        # Quorum 3: rank 1 stays alive but never joins the allreduce.
        pg.configure(addr(3), f"replica{rank}", rank, 2, quorum_id=3)
        if rank == 0:
            start = time.monotonic()
            try:
                pg.allreduce([torch.ones(4)], ReduceOp.SUM).wait()
                outcome = "no error"
            except Exception as e:
                outcome = f"{type(e).__name__}: {e}"
            results.put((rank, "q3", time.monotonic() - start, outcome, str(pg.errored())))
        barrier.wait(timeout=30)
        pg.shutdown()  # done with quorum 3, as the Manager's next configure would be

        # Quorum 4: the error-swallowing wrapper; rank 1 dies after one good allreduce.
        wrapped = ErrorSwallowingProcessGroupWrapper(ProcessGroupGloo(timeout=timeout))
        wrapped.configure(addr(4), f"replica{rank}", rank, 2, quorum_id=4)
        ok = torch.tensor([1.0])
        wrapped.allreduce([ok], ReduceOp.SUM).wait()
        barrier.wait(timeout=30)
        if rank == 1:
            os._exit(0)
        start = time.monotonic()
        t = torch.tensor([5.0])
        returned = wrapped.allreduce([t], ReduceOp.SUM).wait()
        elapsed = time.monotonic() - start
        start = time.monotonic()
        after = wrapped.allreduce([torch.tensor([7.0])], ReduceOp.SUM).get_future().wait()
        skipped = time.monotonic() - start
        results.put(
            (rank, "q4", ok.tolist(), returned, elapsed, str(wrapped.errored()),
             after[0].tolist(), skipped)
        )
        wrapped.shutdown()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))
        raise


_EXIT_DURING_OP = """
import sys, threading, time
from datetime import timedelta

import torch
import torch.distributed as dist

from ftclient.process_group import ProcessGroupGloo

store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
addr = f"127.0.0.1:{store.port}/exit/1/0"
pgs = [ProcessGroupGloo(timeout=timedelta(seconds=1.0)) for _ in range(2)]
peer = threading.Thread(target=pgs[1].configure, args=(addr, "r1", 1, 2))
peer.start()
pgs[0].configure(addr, "r0", 0, 2)
peer.join()
work = pgs[0].allreduce([torch.ones(4)])  # rank 1 never joins it: it fails after 1 s


class SleepsWhilePythonFinalizes:
    def __del__(self, sleep=time.sleep):
        sleep(2.5)  # module teardown: a thread that asks for the GIL now is ended by Python


keep = SleepsWhilePythonFinalizes()
print("exiting with an operation in flight", flush=True)
"""


@pytest.mark.parametrize("started_by", ["threading", "_thread"])
def test_a_group_finalized_on_a_thread_python_did_not_start_is_destroyed_by_the_reaper(started_by: str) -> None:
    """CI: a worker aborted ("terminate called after throwing an instance of 'std::system_error'
    ... Resource deadlock avoided") in ``ProcessGroupGloo.__del__``: the garbage collector ran it
    on one of Gloo's own threads, the idle group was destroyed there, and its destructor joined
    the thread it ran on. A thread started outside ``threading`` (as Gloo's C++ workers are; here
    ``_thread``) now hands the group to the reaper; a thread of ``threading`` still destroys an
    idle group at once (handing every group to the reaper broke exit)."""
    import _thread

    from ftclient import process_group as pg_module

    destroyed_on: list[str] = []
    destroyed = threading.Event()

    class GroupStandIn:  # records the thread its last reference dropped on
        def __del__(self) -> None:
            destroyed_on.append(threading.current_thread().name)
            destroyed.set()

    group = pg_module.ProcessGroupGloo()
    group._backend = pg_module._Backend(GroupStandIn())  # type: ignore[arg-type]
    finalized = threading.Event()

    def finalize() -> None:
        threading.current_thread().name = "finalizer"
        group.__del__()
        finalized.set()

    if started_by == "threading":
        threading.Thread(target=finalize).start()
    else:
        _thread.start_new_thread(finalize, ())
    assert finalized.wait(5.0) and destroyed.wait(5.0)
    assert destroyed_on == (["finalizer"] if started_by == "threading" else ["ftclient-pg-reaper"])


@pytest.mark.integration
def test_exit_with_an_operation_in_flight_does_not_abort(tmp_path: Any) -> None:
    """Without the exit hook, the operation failing while Python finalizes ran its completion
    callback on a Gloo thread that Python ended with a forced unwind: "terminate called after
    throwing an instance of 'gloo::IoException'" and SIGABRT (what once hit the two-process
    test below when rank 1 died just before rank 0 exited)."""
    script = tmp_path / "exit_during_op.py"
    script.write_text(_EXIT_DURING_OP)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path, env=env)
    assert "exiting with an operation in flight" in proc.stdout, proc.stderr
    assert "terminate called" not in proc.stderr, proc.stderr
    assert proc.returncode == 0, proc.stderr


def _get(results: Any, deadline: float) -> tuple[Any, ...]:
    try:
        item = results.get(timeout=max(0.1, deadline - time.monotonic()))
    except queue.Empty:
        pytest.fail("a worker process did not report in time")
    if item[1] == "error":
        pytest.fail(f"worker {item[0]} failed:\n{item[2]}")
    return item  # type: ignore[no-any-return]


@pytest.mark.integration
def test_two_processes_allreduce_reconfigure_and_survive_a_lost_peer(
    store: dist.TCPStore,
) -> None:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    results = ctx.Queue()
    procs = [ctx.Process(target=_pg_worker, args=(r, store.port, barrier, results)) for r in (0, 1)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + 45
        got: dict[tuple[int, str], tuple[Any, ...]] = {}
        while len(got) < 6:  # q1 and q2 from both ranks, q3 and q4 from rank 0
            item = _get(results, deadline)
            got[(item[0], item[1])] = item

        for rank in (0, 1):
            _, _, summed, avg, ints, size = got[(rank, "q1")]
            assert summed == [3.0, 30.0]
            assert avg == [0.5, 4.0]
            assert ints == [3, 200]
            assert size == 2
            assert got[(rank, "q2")][2:] == ([3.0], True)

        _, _, elapsed, outcome, recorded = got[(0, "q3")]
        assert "timed out" in outcome.lower(), outcome
        assert TIMEOUT_S * 0.8 <= elapsed <= TIMEOUT_S + 2.0, elapsed
        assert recorded != "None"

        _, _, ok, returned, elapsed, error, after, skipped = got[(0, "q4")]
        assert ok == [2.0]
        assert returned is True
        assert elapsed < TIMEOUT_S, f"a dead peer took {elapsed:.2f}s to notice"
        assert error != "None"
        assert after == [7.0] and skipped < 0.5  # dummy work, no communication
        for p in procs:
            p.join(timeout=15)
        assert procs[0].exitcode == 0 and procs[1].exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
