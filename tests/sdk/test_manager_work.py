"""``Manager.allreduce`` returns a ``torch.distributed.Work`` (issue #16 item 2), and the
Manager's accelerator stream handling (item 5) is a no-op on CPU that keeps its order.

Real Managers on one in-process fake lighthouse node (``support.fake_watch``), real Gloo between
replica groups running in threads of this process.

Covered: the work is a ``dist.Work``; ``wait()`` (True, result in place), ``get_future()``
(resolves to the tensor, chains with ``then``), ``synchronize()`` and ``block_current_stream()``
(plain waits on CPU) and ``is_completed()``; SUM is not divided; an allreduce that fails (in the
collective or at launch) is reported to the manager, its work's ``wait()`` returns False and its
future gives the input back, later allreduces of the step are completed no-ops, and the step does
not commit; a ``wait(timeout=)`` shorter than the collective fails the step instead of hanging;
``should_quantize=True`` raises ``NotImplementedError`` (in DiLoCo's constructor too);
``wrap_future`` passes values, turns errors and its timeout into the default and a failed step; with a recording stand-in for the
accelerator: the quorum thread sets the caller's device, checkpoint work runs on the recovery
stream (made in the quorum thread for that device), ``should_commit`` waits for the recovery event and syncs the current stream before it
asks the group, and a work's stream calls from another stream are refused.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp, TCPStore

from ftclient import manager as manager_mod
from ftclient.local_sgd import DiLoCo
from ftclient.manager import ManagedWork, Manager
from ftclient.process_group import ProcessGroupGloo
from support.fake_watch import FakeWatchNode
from support.null_transport import NullTransport

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

TIMEOUT = timedelta(seconds=10)


class FailingWorkPG(ProcessGroupGloo):
    """Gloo, except that ``fail_next`` makes the next allreduce's work fail (``"work"``) or the
    call itself raise (``"launch"``)."""

    def __init__(self) -> None:
        super().__init__(timeout=TIMEOUT)
        self.fail_next: str | None = None

    def allreduce(self, tensors: list[torch.Tensor], opts: object = ReduceOp.SUM) -> dist.Work:
        mode, self.fail_next = self.fail_next, None
        if mode == "launch":
            raise RuntimeError("injected launch failure")
        if mode == "work":
            fut: torch.futures.Future[Any] = torch.futures.Future()
            fut.set_exception(RuntimeError("injected collective failure"))
            return _FailedWork(fut)
        return super().allreduce(tensors, opts)


class _FailedWork(dist.Work):
    def __init__(self, fut: torch.futures.Future[Any]) -> None:
        super().__init__()
        self._fut = fut

    def get_future(self) -> torch.futures.Future[Any]:
        return self._fut


class Groups:
    """Replica groups of one Manager each (threads of this process) on a fake lighthouse."""

    def __init__(self, node: FakeWatchNode) -> None:
        self.node = node
        self.managers: list[Manager] = []
        self.stores: list[TCPStore] = []
        self.pool = ThreadPoolExecutor(4)

    def manager(self, name: str, pg: Any | None = None, **options: Any) -> Manager:
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
        self.stores.append(store)
        m = Manager(pg=pg if pg is not None else ProcessGroupGloo(timeout=TIMEOUT), load_state_dict=None,
                    state_dict=None, min_replica_size=1, use_async_quorum=False, timeout=TIMEOUT,
                    quorum_timeout=TIMEOUT, connect_timeout=TIMEOUT, rank=0, world_size=1, store_addr="127.0.0.1",
                    store_port=store.port, lighthouse_addr=self.node.url, replica_id=name, hostname="127.0.0.1",
                    checkpoint_transport=NullTransport(), init_sync=False, liveness_interval=None, **options)
        self.managers.append(m)
        return m

    def all(self, *calls: Callable[[], Any], timeout: float = 30) -> list[Any]:
        futs = [self.pool.submit(c) for c in calls]
        return [f.result(timeout=timeout) for f in futs]

    def close(self) -> None:
        for m in self.managers:
            m.shutdown(wait=False)
        self.pool.shutdown(wait=False)


@pytest.fixture
def two() -> Iterator[tuple[Groups, Manager, Manager]]:
    with FakeWatchNode("n1", quorum_size=2) as node:
        g = Groups(node)
        try:
            yield g, g.manager("a"), g.manager("b")
        finally:
            g.close()


@pytest.fixture
def one() -> Iterator[tuple[Groups, Manager]]:
    with FakeWatchNode("n1", quorum_size=1) as node:
        g = Groups(node)
        try:
            yield g, g.manager("solo", pg=FailingWorkPG())
        finally:
            g.close()


def test_allreduce_returns_a_work_whose_calls_behave_like_torchfts(two: tuple[Groups, Manager, Manager]) -> None:
    g, a, b = two
    g.all(a.start_quorum, b.start_quorum)

    # wait(): True, the average in place.
    ta, tb = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])
    wa, wb = g.all(lambda: a.allreduce(ta), lambda: b.allreduce(tb))
    assert isinstance(wa, dist.Work) and isinstance(wa, ManagedWork)
    assert g.all(wa.wait, wb.wait) == [True, True]
    assert ta.tolist() == tb.tolist() == [2.0, 4.0]
    assert wa.is_completed() and wa.is_success() and wa.exception() is None

    # get_future(): resolves to the tensor itself and chains like a torch Future (DDP's hook).
    ta, tb = torch.tensor([10.0]), torch.tensor([20.0])
    wa, wb = g.all(lambda: a.allreduce(ta), lambda: b.allreduce(tb))
    doubled = wa.get_future().then(lambda f: f.value() * 2)
    assert wa.get_future().wait() is ta and wb.get_future().wait() is tb
    assert doubled.wait().tolist() == [30.0] and ta.tolist() == [15.0]

    # synchronize() and block_current_stream(): on CPU, waits (the result is there on return).
    for call in ("synchronize", "block_current_stream"):
        ta, tb = torch.tensor([1.0]), torch.tensor([0.0])
        wa, wb = g.all(lambda: a.allreduce(ta), lambda: b.allreduce(tb))
        g.all(getattr(wa, call), getattr(wb, call))
        assert ta.tolist() == tb.tolist() == [0.5], call

    # A zero wait timeout means none (torch's kNoTimeout, as its C++ side passes it).
    ta, tb = torch.tensor([1.0]), torch.tensor([5.0])
    wa, wb = g.all(lambda: a.allreduce(ta), lambda: b.allreduce(tb))
    assert g.all(lambda: wa.wait(timedelta(0)), lambda: wb.wait(timedelta(0))) == [True, True]
    assert ta.tolist() == tb.tolist() == [3.0] and a.errored() is None

    # A reduce op other than AVG is not divided.
    ta, tb = torch.tensor([1.0]), torch.tensor([2.0])
    wa, wb = g.all(lambda: a.allreduce(ta, reduce_op=ReduceOp.SUM), lambda: b.allreduce(tb, reduce_op=ReduceOp.SUM))
    assert g.all(wa.wait, wb.wait) == [True, True] and ta.tolist() == tb.tolist() == [3.0]

    assert g.all(a.should_commit, b.should_commit) == [True, True]
    assert a.current_step() == b.current_step() == 1


@pytest.mark.parametrize("mode", ["work", "launch"])
def test_a_failed_allreduce_reports_to_the_manager_and_completes_with_the_input(
        one: tuple[Groups, Manager], mode: str) -> None:
    _, m = one
    pg = m._pg
    assert isinstance(pg, FailingWorkPG)
    m.start_quorum()
    ok = torch.tensor([4.0])
    assert m.allreduce(ok).wait() is True and ok.tolist() == [4.0]  # one participant: the average is itself

    pg.fail_next = mode
    t = torch.tensor([5.0, 6.0])
    work = m.allreduce(t)
    assert work.wait() is False  # never raises
    assert work.get_future().wait() is t and t.tolist() == [5.0, 6.0]
    err = m.errored()
    assert err is not None and "injected" in str(err.original_exception)
    assert isinstance(work.exception(), Exception)

    # Later allreduces of the step are completed no-ops that leave their tensor alone.
    later = torch.tensor([9.0])
    w2 = m.allreduce(later)
    assert w2.is_completed() and w2.wait() is False and later.tolist() == [9.0]
    assert m.should_commit() is False and m.current_step() == 0

    # The next step is clean again.
    m.start_quorum()
    assert m.allreduce(torch.tensor([1.0])).wait() is True
    assert m.should_commit() is True and m.current_step() == 1


def test_wait_with_a_timeout_shorter_than_the_collective_fails_the_step(
        two: tuple[Groups, Manager, Manager]) -> None:
    g, a, b = two
    g.all(a.start_quorum, b.start_quorum)
    work = a.allreduce(torch.tensor([1.0]))  # b never joins this one
    started = time.monotonic()
    assert work.wait(timeout=timedelta(milliseconds=200)) is False
    assert time.monotonic() - started < 2.0
    err = a.errored()
    assert err is not None and isinstance(err.original_exception, TimeoutError)
    # b joins late: the collective completes, but a's step is already failed.
    assert b.allreduce(torch.tensor([3.0])).wait() is True
    assert work.get_future().wait().tolist() == [2.0]
    b.report_error(RuntimeError("b is out of this test"))
    assert g.all(a.should_commit, b.should_commit) == [False, False]


def test_should_quantize_raises_not_implemented(one: tuple[Groups, Manager]) -> None:
    _, m = one
    m.start_quorum()
    t = torch.tensor([1.0])
    with pytest.raises(NotImplementedError, match="quantized collectives"):
        m.allreduce(t, should_quantize=True)
    assert m.errored() is None and t.tolist() == [1.0]
    assert m.should_commit() is True
    # DiLoCo says so when it is built, not by failing every round.
    model = torch.nn.Linear(2, 2)
    with pytest.raises(NotImplementedError, match="quantized collectives"):
        DiLoCo(m, [model], torch.optim.SGD(model.parameters(), lr=0.1),
               torch.optim.SGD(model.parameters(), lr=0.7), sync_every=2, should_quantize=True)


def test_wrap_future_never_fails_and_reports_errors_and_timeouts(one: tuple[Groups, Manager]) -> None:
    _, m = one
    m.start_quorum()
    ok: torch.futures.Future[Any] = torch.futures.Future()
    wrapped = m.wrap_future(ok, "default")
    ok.set_result("value")
    assert wrapped.wait() == "value" and m.errored() is None

    failing: torch.futures.Future[Any] = torch.futures.Future()
    wrapped = m.wrap_future(failing, [torch.tensor([1.0])])
    failing.set_exception(RuntimeError("boom"))
    assert wrapped.wait()[0].tolist() == [1.0]
    err = m.errored()
    assert err is not None and "boom" in str(err.original_exception)
    assert m.should_commit() is False

    m.start_quorum()
    never: torch.futures.Future[Any] = torch.futures.Future()
    started = time.monotonic()
    assert m.wrap_future(never, 7, timeout=timedelta(milliseconds=200)).wait() == 7
    assert 0.15 <= time.monotonic() - started < 2.0
    err = m.errored()
    assert err is not None and isinstance(err.original_exception, TimeoutError)
    never.set_result(8)  # a late result changes nothing
    assert m.should_commit() is False


# -- accelerator streams, with a recording stand-in -------------------------------------------------


class FakeStream:
    def __init__(self, name: str, log: list[tuple[str, ...]]) -> None:
        self.name, self.log = name, log

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeEvent:
    def __init__(self, stream: FakeStream, log: list[tuple[str, ...]]) -> None:
        self.stream, self.log = stream, log

    def synchronize(self) -> None:
        self.log.append(("event.synchronize", self.stream.name))


class RecordingAccelerator:
    """Stands in for ``manager._ACCELERATOR``: an accelerator with device 3, a default stream per
    thread and every call logged with the calling thread's name."""

    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []
        self.local = threading.local()
        self.default = FakeStream("default", self.log)
        self.streams = 0

    def _current(self) -> FakeStream:
        return getattr(self.local, "stream", self.default)

    def available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 3

    def set_device(self, index: int) -> None:
        self.log.append(("set_device", str(index), threading.current_thread().name))

    def new_stream(self) -> FakeStream:
        self.streams += 1
        self.log.append(("new_stream", f"stream{self.streams}", threading.current_thread().name))
        return FakeStream(f"stream{self.streams}", self.log)

    def current_stream(self) -> FakeStream:
        return self._current()

    @contextmanager
    def stream_context(self, stream: FakeStream | None) -> Iterator[None]:
        previous = self._current()
        if stream is not None:
            self.local.stream = stream
        self.log.append(("enter", self._current().name, threading.current_thread().name))
        try:
            yield
        finally:
            self.local.stream = previous
            self.log.append(("exit", self._current().name))

    def record_event(self) -> FakeEvent:
        self.log.append(("record_event", self._current().name))
        return FakeEvent(self._current(), self.log)

    def synchronize(self) -> None:
        self.log.append(("synchronize", self._current().name, threading.current_thread().name))


def test_stream_handling_order_with_an_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    accel = RecordingAccelerator()
    monkeypatch.setattr(manager_mod, "_ACCELERATOR", accel)
    with FakeWatchNode("n1", quorum_size=1) as node:
        g = Groups(node)
        try:
            m = g.manager("solo")
            asked: list[list[tuple[str, ...]]] = []
            assert m._client is not None
            real_should_commit = m._client.should_commit

            def should_commit(*args: Any, **kwargs: Any) -> bool:
                asked.append(list(accel.log))  # what had happened when the group was asked
                return real_should_commit(*args, **kwargs)

            monkeypatch.setattr(m._client, "should_commit", should_commit)
            m.start_quorum()
            t = torch.tensor([2.0])
            work = m.allreduce(t)
            assert work.wait() is True and t.tolist() == [2.0]

            # The stream calls of a work must come from the stream it was started on.
            accel.local.stream = FakeStream("other", accel.log)
            with pytest.raises(RuntimeError, match="stream the allreduce was started on"):
                work.synchronize()
            accel.local.stream = accel.default
            assert m.should_commit() is True
        finally:
            g.close()

    names = [e[0] for e in accel.log]
    quorum_thread = accel.log[names.index("set_device")][2]
    assert accel.log[names.index("set_device")][:2] == ("set_device", "3")
    assert quorum_thread.startswith("ftclient_async_quorum")
    # The recovery stream is made once, in the quorum thread, after it set the device.
    assert [e for e in accel.log if e[0] == "new_stream"] == [("new_stream", "stream1", quorum_thread)]
    assert names.index("new_stream") > names.index("set_device")
    # The process group is reconfigured after the quorum thread synced its stream.
    assert ("synchronize", "default", quorum_thread) in accel.log
    # Checkpoint work (none here: nobody heals) runs on the recovery stream, whose event is
    # recorded there; should_commit waits for it, then syncs the current stream, then asks.
    enter = accel.log.index(("enter", "stream1", quorum_thread))
    assert accel.log[enter + 1] == ("record_event", "stream1")
    assert accel.log[enter + 2] == ("exit", "default")
    [before_commit] = asked
    assert before_commit[-2:] == [("event.synchronize", "stream1"),
                                  ("synchronize", "default", threading.current_thread().name)]
