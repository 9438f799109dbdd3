"""The Manager's CUDA stream handling (issue #16 items 2 and 5), on a real GPU; skipped without
CUDA ("CUDA is not available").

A NCCL-like work stands in for the process group's: its collective (a long GPU sleep, then an
add of the "peer's" value) runs on a communication stream, and its future is complete at launch
and CUDA-aware (an event on that stream), as ProcessGroupNCCL's is. A ``ManagedWork`` over it must
return from ``wait()`` / ``block_current_stream()`` / ``synchronize()`` without blocking the CPU
for the collective, and still order the current stream after it: the tensor read on the current
stream is the average. Also: a failed work reports to the manager and gives the input back on a
CUDA-aware future; the stream calls from another stream are refused; the accelerator helper the
Manager uses (device of the quorum thread, recovery stream, events, sync) works on CUDA. And real
Managers (two replica groups in threads, a fake lighthouse, ftclient's ProcessGroupGloo, which
torchtitan uses by default) average CUDA tensors and a CUDA model's DDP gradients and commit.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")

SLEEP_CYCLES = 2_000_000_000  # about a second of GPU time on an H100
NOT_BLOCKED_S = 0.3  # the CPU must be back well before the GPU is done


class StubManager:
    """What a ManagedWork uses of its Manager."""

    def __init__(self) -> None:
        from ftclient.manager import _ACCELERATOR

        self._accel = _ACCELERATOR
        self._timeout = timedelta(seconds=30)
        self.errors: list[Exception] = []

    def _collective_failed(self, e: Exception) -> None:
        self.errors.append(e)


class NcclLikeWork(dist.Work):
    """SUM with a peer holding ``peer`` on a side stream, after a long GPU sleep; the future is
    complete at launch, with an event on the side stream (ProcessGroupNCCL's behaviour)."""

    def __init__(self, tensor: torch.Tensor, peer: float, fail: bool = False) -> None:
        super().__init__()
        self.stream = torch.cuda.Stream()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(SLEEP_CYCLES)
            tensor.add_(peer)
            self._fut: torch.futures.Future[Any] = torch.futures.Future(devices=[tensor.device])
            if fail:
                self._fut.set_exception(RuntimeError("injected NCCL failure"))
            else:
                self._fut.set_result([tensor])

    def get_future(self) -> torch.futures.Future[Any]:
        return self._fut


def managed(tensor: torch.Tensor, peer: float, fail: bool = False) -> tuple[Any, StubManager]:
    from ftclient.manager import ManagedWork

    m = StubManager()
    work = ManagedWork(m, NcclLikeWork(tensor, peer, fail), tensor, 2, m._timeout)  # type: ignore[arg-type]
    return work, m


@pytest.fixture(scope="module", autouse=True)
def warm_up() -> None:
    """The first work pays for CUDA's lazy set-up (context, stream pool, the sleep kernel): 5 s
    on an H100, which is not what the timing below is about."""
    if torch.cuda.is_available():
        work, _ = managed(torch.ones(1, device="cuda"), 1.0)
        work.wait()
        torch.cuda.synchronize()


@pytest.mark.parametrize("call", ["wait", "block_current_stream", "synchronize", "get_future"])
def test_the_work_orders_the_current_stream_without_blocking_the_cpu(call: str) -> None:
    t = torch.full((1024,), 1.0, device="cuda")
    torch.cuda.synchronize()
    started = time.monotonic()
    work, m = managed(t, 3.0)
    if call == "get_future":
        assert work.get_future().wait() is t
    else:
        assert getattr(work, call)() in (True, None)
    returned = time.monotonic() - started
    values = t.cpu()  # on the current stream: after the collective and the division
    assert returned < NOT_BLOCKED_S, f"{call} blocked the CPU for {returned:.3f}s"
    assert values.eq(2.0).all(), values[:4]
    assert m.errors == [] and work.wait() is True


def test_a_failed_work_reports_and_gives_the_input_back() -> None:
    t = torch.full((8,), 5.0, device="cuda")
    work, m = managed(t, 1.0, fail=True)
    assert work.wait() is False
    assert work.get_future().wait() is t
    assert len(m.errors) == 1 and "injected" in str(m.errors[0])


def test_stream_calls_from_another_stream_are_refused() -> None:
    t = torch.ones(4, device="cuda")
    work, _ = managed(t, 1.0)
    with torch.cuda.stream(torch.cuda.Stream()):
        with pytest.raises(RuntimeError, match="stream the allreduce was started on"):
            work.block_current_stream()
    assert work.wait() is True and t.cpu().eq(1.0).all()


def test_the_accelerator_helper_on_cuda() -> None:
    from ftclient.manager import _ACCELERATOR as accel

    assert accel.available()
    device = torch.cuda.current_device()
    assert accel.current_device() == device
    seen: list[int] = []

    def quorum_thread() -> None:
        accel.set_device(device)
        seen.append(torch.cuda.current_device())

    th = threading.Thread(target=quorum_thread)
    th.start()
    th.join(10)
    assert seen == [device]
    recovery = accel.new_stream()
    assert recovery is not None and recovery != accel.current_stream()
    x = torch.zeros(1 << 20, device="cuda")
    with accel.stream_context(recovery):
        assert accel.current_stream() == recovery
        torch.cuda._sleep(SLEEP_CYCLES // 4)
        x.add_(1)
        event = accel.record_event()
    assert accel.current_stream() != recovery
    event.synchronize()  # what should_commit waits for before the recovered state is used
    assert recovery.query() and x[0].item() == 1.0
    accel.synchronize()


# -- real Managers on CUDA tensors -------------------------------------------------------------------


def _managers(n: int) -> Any:
    """``n`` replica groups of one Manager each (threads of this process) on a fake lighthouse
    that forms quorums of ``n``; yields them and a runner that calls functions concurrently."""
    from concurrent.futures import ThreadPoolExecutor

    from torch.distributed import TCPStore

    from ftclient.manager import Manager
    from ftclient.process_group import ProcessGroupGloo
    from support.fake_watch import FakeWatchNode
    from support.null_transport import NullTransport

    timeout = timedelta(seconds=30)
    pool = ThreadPoolExecutor(4)
    managers: list[Any] = []
    with FakeWatchNode("n1", quorum_size=n) as node:
        stores = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout) for _ in range(n)]
        try:
            for name, store in zip("abcd", stores):
                managers.append(Manager(
                    pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None, min_replica_size=1,
                    use_async_quorum=False, timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout, rank=0,
                    world_size=1, store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=node.url,
                    replica_id=name, hostname="127.0.0.1", checkpoint_transport=NullTransport(), init_sync=False,
                    liveness_interval=None))

            def run(*calls: Any) -> list[Any]:
                futs = [pool.submit(c) for c in calls]
                return [f.result(timeout=60) for f in futs]

            yield (*managers, run)
        finally:
            for m in managers:
                m.shutdown(wait=False)
            pool.shutdown(wait=False)


@pytest.fixture
def two_managers() -> Any:
    yield from _managers(2)


@pytest.fixture
def one_manager() -> Any:
    yield from _managers(1)


@pytest.mark.integration
def test_managers_average_cuda_tensors_over_gloo_and_commit(two_managers: Any) -> None:
    a, b, both = two_managers
    both(a.start_quorum, b.start_quorum)
    ta = torch.tensor([1.0, 2.0], device="cuda")
    tb = torch.tensor([3.0, 6.0], device="cuda")
    wa, wb = both(lambda: a.allreduce(ta), lambda: b.allreduce(tb))
    assert both(wa.wait, wb.wait) == [True, True]
    assert ta.cpu().tolist() == tb.cpu().tolist() == [2.0, 4.0]
    assert wa.get_future().wait() is ta
    assert both(a.should_commit, b.should_commit) == [True, True]
    assert a.current_step() == b.current_step() == 1


@pytest.mark.integration
def test_ddp_on_a_cuda_model_takes_the_managers_cuda_aware_future(one_manager: Any) -> None:
    """One group (two DDP backward passes in one process would share autograd's CUDA thread):
    torch's reducer needs the comm hook's future to be CUDA-aware for CUDA gradients."""
    from torch import nn

    from ftclient.ddp import DistributedDataParallel

    m, _ = one_manager
    model = nn.Linear(3, 1, bias=False).cuda()
    with torch.no_grad():
        model.weight.fill_(1.0)
    ddp = DistributedDataParallel(m, model)
    for step in range(2):
        m.start_quorum()
        ddp(torch.full((2, 3), 3.0, device="cuda")).sum().backward()
        assert model.weight.grad is not None
        assert model.weight.grad.cpu().tolist() == [[6.0, 6.0, 6.0]]  # one participant: its own
        assert m.errored() is None and m.should_commit()
        model.weight.grad = None
    assert m.current_step() == 2


def test_a_future_made_for_a_cuda_value_orders_the_waiters_stream_after_the_producer() -> None:
    """Why ManagedWork and wrap_future make their futures for the value's devices: completing such a
    future on a side stream records that stream, and wait() makes the waiter's current stream wait
    for it, so the value read on the current stream is the finished one. (torch 2.11 also accepts a
    CUDA value in a future made without devices, but then nothing orders the streams.)"""
    from ftclient.manager import _future_for

    t = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    fut = _future_for([t])
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES // 4)  # the side stream is busy for a while
        t.add_(1.0)
        fut.set_result([t])
    (value,) = fut.wait()  # on the current (default) stream
    assert value is t
    assert value.sum().item() == t.numel(), "the current stream read the value before the side stream wrote it"


@pytest.mark.integration
def test_wrap_future_and_the_managed_groups_passthrough_on_cuda(two_managers: Any) -> None:
    """wrap_future settles with CUDA values; ManagedProcessGroup's passthrough collectives (which
    go through it) work on CUDA tensors between the two groups."""
    from ftclient.process_group import ManagedProcessGroup

    a, b, both = two_managers
    both(a.start_quorum, b.start_quorum)
    src: torch.futures.Future[Any] = torch.futures.Future(devices=[torch.device("cuda", torch.cuda.current_device())])
    value = torch.full((3,), 2.0, device="cuda")
    wrapped = a.wrap_future(src, value.clone())
    src.set_result(value)
    assert wrapped.wait().cpu().tolist() == [2.0, 2.0, 2.0] and a.errored() is None

    pgs = [ManagedProcessGroup(a), ManagedProcessGroup(b)]
    outs = [[torch.zeros(2, device="cuda") for _ in range(2)] for _ in range(2)]
    ins = [torch.tensor([1.0, 2.0], device="cuda"), torch.tensor([3.0, 4.0], device="cuda")]
    works = both(lambda: pgs[0].allgather([outs[0]], [ins[0]]), lambda: pgs[1].allgather([outs[1]], [ins[1]]))
    both(works[0].wait, works[1].wait)
    for out in outs:
        assert [t.cpu().tolist() for t in out] == [[1.0, 2.0], [3.0, 4.0]]
    assert a.errored() is None and b.errored() is None
    assert both(a.should_commit, b.should_commit) == [True, True]
