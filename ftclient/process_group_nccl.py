"""ProcessGroupNCCL: a reconfigurable NCCL process group that is aborted instead of hanging.

torchft's ``ProcessGroupNCCL`` in ftclient's terms. Every :meth:`ProcessGroupNCCL.configure`
(the Manager calls it on each new quorum) connects a TCPStore client scoped to the quorum's
prefix and builds a fresh ``torch.distributed.ProcessGroupNCCL`` backend on the caller's current
CUDA device: non-blocking (so that ``ncclCommAbort`` can end a communicator that waits for a
peer), and configure returns only once one small allreduce on it completed, i.e. once every
member joined. A member that never joins makes configure raise ``TimeoutError`` at the timeout
(the build runs on a helper thread); otherwise the trainer's first collective would wait for it
inside torch, on the trainer's thread, where nothing can interrupt it (seen on an H100: 30 s,
torch's ``TORCH_NCCL_NONBLOCKING_TIMEOUT``). The previous communicator is released in the
background.

Collectives are launched on the caller's thread and streams, as torch does. What NCCL cannot do
by itself is give up: a collective whose peer died waits on the GPU forever, and every later
kernel of the trainer's stream waits behind it. So every operation has a deadline (the group's
timeout): a completer thread watches each operation finish on the GPU
(``Work.is_completed``, in order), and when the deadline passes first, or :meth:`abort` is
called (the Manager's reaction to a dead peer), the communicator is aborted
(``ncclCommAbort``, on a helper thread), every pending operation fails (``TimeoutError`` or the
abort's error) and every later one fails at once until the next configure. torch's own NCCL
watchdog, which by default tears the whole process down on a timeout, is given a much longer
timeout than ftclient's, so ftclient's deadline always comes first.

Works: ``wait()`` blocks the calling thread until the operation finished on the GPU (bounded by
the deadline) and raises its error; ``block_current_stream()`` only makes the current stream wait
(torch's NCCL semantics, no CPU block); ``get_future()`` completes, with the tensors passed in,
once the GPU finished (its callbacks run on the completer thread).

Needs a CUDA build of torch with NCCL; tested on a GPU by ``tests/gpu/test_nccl.py``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.futures import Future

from ._collective_ops import build_backend, launch
from ._timeouts import WATCHDOG, Timer
from .process_group import DEFAULT_TIMEOUT, create_store_client
from .process_group_baby import OpSpec, SpecProcessGroup

logger: logging.Logger = logging.getLogger(__name__)

__all__ = ["ProcessGroupNCCL"]

_POLL_MIN_S = 0.0001
_POLL_MAX_S = 0.002


def _release_backend(backend: Any, busy: bool) -> None:
    """Shut a backend down off the caller's thread: abort it when operations may still be in
    flight (they can hang), shut it down cleanly otherwise."""

    def run() -> None:
        try:
            backend.abort() if busy else backend.shutdown()
        except Exception as e:  # noqa: BLE001 -- nothing to report to: the group moved on
            logger.warning("releasing a NCCL communicator failed: %s", e)

    threading.Thread(target=run, daemon=True, name="ftclient-nccl-release").start()


class _Op:
    __slots__ = ("name", "future", "result", "work", "timer", "settled")

    def __init__(self, name: str, result: object) -> None:
        self.name = name
        self.future: Future[Any] = Future()
        self.result = result
        self.work: Any = None
        self.timer: Timer | None = None
        self.settled = False


class _Comm:
    """One configuration: its backend, its pending operations (in launch order) and the thread
    that completes them. ``fail`` (timeout, abort, error) is final for it."""

    def __init__(self, device: torch.device, timeout: timedelta, on_error: Callable[[Exception], None]) -> None:
        self.device = device
        self._timeout = timeout
        self._on_error = on_error
        self._cond = threading.Condition()
        self._state = "building"  # -> ready | failed
        self.failure: Exception | None = None
        self.backend: Any = None
        self.world_size = 0
        self._pending: deque[_Op] = deque()

    # build ----------------------------------------------------------------------------------

    def build(self, store_addr: str, rank: int, world_size: int) -> None:
        """Build the backend on a helper thread; wait at most the timeout, or until aborted."""
        self.world_size = world_size
        result: dict[str, Any] = {}

        def target() -> None:
            try:
                torch.cuda.set_device(self.device)
                store = create_store_client(store_addr, self._timeout)
                backend = build_backend("nccl", store, rank, world_size, self._timeout, self.device)
            except BaseException as e:  # noqa: BLE001 -- handed to the waiting configure
                result["error"] = e
                backend = None
            with self._cond:
                if self._state == "building" and backend is not None:
                    self.backend = backend
                    self._state = "ready"
                    threading.Thread(target=self._complete, daemon=True, name="ftclient-nccl-completer").start()
                elif backend is not None:  # abandoned (aborted or timed out) meanwhile
                    _release_backend(backend, busy=True)
                result["done"] = True
                self._cond.notify_all()

        threading.Thread(target=target, daemon=True, name="ftclient-nccl-configure").start()
        timeout_s = self._timeout.total_seconds()
        with self._cond:
            self._cond.wait_for(lambda: "done" in result or self._state == "failed", timeout_s)
            state, failure = self._state, self.failure
        what = f"the NCCL group on {store_addr!r} (rank {rank} of {world_size}, device {self.device})"
        if state == "ready":
            return
        if state == "failed":
            raise RuntimeError(f"building {what} was aborted: {failure}") from failure
        error: Exception
        if "error" in result:
            error = RuntimeError(f"building {what} failed: {result['error']}")
        else:
            error = TimeoutError(f"building {what} timed out after {timeout_s:g}s: "
                                 "some member of the quorum did not join")
        self.fail(error)
        raise error

    # operations -----------------------------------------------------------------------------

    def submit(self, spec: OpSpec, result: object) -> _Op:
        op = _Op(spec.name, result)
        with self._cond:
            failure = self.failure if self._state != "ready" else None
            backend = self.backend
        if failure is not None or backend is None:
            error = RuntimeError(f"{spec.name} not started: the process group was aborted ({failure})")
            self._on_error(error)
            op.settled = True
            op.future.set_exception(error)
            return op
        timeout_s = self._timeout.total_seconds()
        # Scheduled before the launch: a launch that blocks (a communicator still connecting)
        # is ended by the abort too.
        op.timer = WATCHDOG.schedule(timeout_s, lambda: self.fail(TimeoutError(
            f"{spec.name} timed out after {timeout_s:g}s: a peer replica group is gone or stuck; the "
            "NCCL communicator was aborted. The step will not commit; the next quorum reconfigures "
            "the group.")))
        try:
            op.work, _ = launch(backend, spec.name, spec.args, self.world_size, emulate_avg=False,
                                device=self.device)
        except Exception as e:
            op.timer.cancel()
            error = RuntimeError(f"{spec.name} failed to launch: {e}")
            self._on_error(error)
            op.settled = True
            op.future.set_exception(error)
            return op
        with self._cond:
            if self._state == "failed":
                failure = self.failure
            else:
                self._pending.append(op)
                self._cond.notify_all()
        if failure is not None:  # aborted while launching
            self._settle(op, failure)
        return op

    def _settle(self, op: _Op, error: Exception | None) -> bool:
        with self._cond:
            if op.settled:
                return False
            op.settled = True
        if op.timer is not None:
            op.timer.cancel()
        if error is None:
            op.future.set_result(op.result)
        else:
            op.future.set_exception(error)
        return True

    def _complete(self) -> None:
        """Settle each pending operation once the GPU finished it, in launch order."""
        stream = torch.cuda.Stream(device=self.device)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._state == "failed")
                if self._state == "failed":
                    return
                op = self._pending[0]
            delay = _POLL_MIN_S
            while not op.settled and not self._finished(op):
                time.sleep(delay)
                delay = min(delay * 2, _POLL_MAX_S)
            with self._cond:
                if self._pending and self._pending[0] is op:
                    self._pending.popleft()
            if op.settled:
                continue
            error: Exception | None = None
            try:
                with torch.cuda.stream(stream):
                    op.work.wait()  # raises the operation's NCCL error, if any
            except Exception as e:  # noqa: BLE001 -- the operation's error
                error = RuntimeError(f"{op.name} failed: {e}")
            if self._settle(op, error) and error is not None:
                self.fail(error)  # records the error; the communicator is unusable now

    @staticmethod
    def _finished(op: _Op) -> bool:
        try:
            return bool(op.work.is_completed())
        except Exception:  # noqa: BLE001 -- an error: wait() below raises it
            return True

    def fail(self, error: Exception) -> bool:
        """Abort the communicator and fail every pending operation with ``error`` (once)."""
        with self._cond:
            if self._state == "failed":
                return False
            self._state = "failed"
            self.failure = error
            pending, self._pending = list(self._pending), deque()
            backend = self.backend
            self._cond.notify_all()
        if backend is not None:
            _release_backend(backend, busy=True)
        self._on_error(error)
        failed = sum(self._settle(op, error) for op in pending)
        logger.warning("NCCL communicator aborted (%d operation(s) in flight failed): %s", failed, error)
        return True

    def release(self) -> None:
        """Give the backend up (reconfigure, shutdown); pending operations fail, nothing is
        recorded as an error."""
        with self._cond:
            if self._state == "failed":
                return
            self._state = "failed"
            self.failure = RuntimeError("the process group was shut down or reconfigured")
            pending, self._pending = list(self._pending), deque()
            backend = self.backend
            self._cond.notify_all()
        for op in pending:
            self._settle(op, self.failure)
        if backend is not None:
            _release_backend(backend, busy=bool(pending))


class _NcclWork(dist._Work):
    """See the module docstring: ``wait`` blocks until the GPU finished (bounded by the
    deadline) and raises the operation's error."""

    def __init__(self, op: _Op) -> None:
        super().__init__()
        self._op = op

    def wait(self, timeout: timedelta | None = None) -> bool:
        fut = self._op.future
        if timeout is None or timeout <= timedelta(0):
            done = threading.Event()
            fut.add_done_callback(lambda _: done.set())
            done.wait()  # bounded: the deadline settles every operation
        else:
            done = threading.Event()
            fut.add_done_callback(lambda _: done.set())
            if not done.wait(timeout.total_seconds()):
                raise TimeoutError(f"work not completed within wait(timeout={timeout.total_seconds():g}s)")
        fut.value()  # raises the operation's error
        self.block_current_stream()
        return True

    def synchronize(self) -> None:
        self.wait()

    def block_current_stream(self) -> None:
        """Make the current CUDA stream wait for the operation, without blocking the CPU (an
        operation that failed leaves the stream alone: its communicator was aborted)."""
        work, fut = self._op.work, self._op.future
        if work is None:
            return
        if fut.done():
            try:
                fut.value()
            except Exception:
                return
        work.wait()

    def is_completed(self) -> bool:
        return self._op.future.done()

    def get_future(self) -> Future[Any]:
        return self._op.future


class ProcessGroupNCCL(SpecProcessGroup):
    """A reconfigurable NCCL process group (CUDA tensors) that aborts its communicator on a
    timeout or on :meth:`abort` instead of hanging; see the module docstring.

    Args:
        timeout: bound on each configure (store connection, communicator set-up) and on each
            operation (a ``timedelta`` or seconds).
    """

    def __init__(self, timeout: timedelta | float = DEFAULT_TIMEOUT) -> None:
        super().__init__(timeout)
        self._lock = threading.Lock()
        self._comm: _Comm | None = None

    def configure(
        self,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        quorum_id: int | None = None,
        group_rank: int | None = None,
        group_world_size: int | None = None,
        global_ranks: list[int] | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got rank={rank}")
        if not torch.cuda.is_available():
            raise RuntimeError("ProcessGroupNCCL needs CUDA, which is not available here")
        self._release()
        device = torch.device("cuda", torch.cuda.current_device())
        box: list[_Comm] = []

        def record(error: Exception) -> None:
            with self._lock:
                if box and self._comm is box[0] and self._error is None:
                    self._error = error
            logger.warning("ProcessGroupNCCL operation failed: %s", error)

        comm = _Comm(device, self._timeout, record)
        box.append(comm)
        with self._lock:
            self._comm = comm
            self._error = None
            self._rank, self._world_size, self._quorum_id = rank, world_size, quorum_id
        start = time.monotonic()
        comm.build(store_addr, rank, world_size)
        logger.info("configured NCCL group: store=%s rank=%d world_size=%d quorum_id=%s device=%s (%.2fs)",
                    store_addr, rank, world_size, quorum_id, device, time.monotonic() - start)

    def _release(self) -> None:
        with self._lock:
            comm, self._comm = self._comm, None
            self._world_size = None
        if comm is not None:
            comm.release()

    def shutdown(self) -> None:
        self._release()

    def __del__(self) -> None:
        try:
            self._release()
        except Exception:
            pass

    def abort(self, error: Exception | None = None) -> None:
        """Abort the communicator now (``ncclCommAbort``): pending operations fail with
        ``error``, a configure in progress raises, and later operations fail at once until the
        next :meth:`configure`."""
        error = error if error is not None else RuntimeError("process group aborted")
        comm = self._comm
        if comm is not None:
            comm.fail(error)

    def getBackendName(self) -> str:
        return "ftclient-nccl"

    def _submit(self, spec: OpSpec, result: object) -> dist._Work:
        comm = self._comm
        if comm is None:
            raise RuntimeError(
                f"ProcessGroupNCCL.{spec.name} called before configure() (or after shutdown()); "
                "the Manager configures the group when it gets a quorum"
            )
        for t in spec.tensors:
            if not t.is_cuda:
                raise ValueError(f"ProcessGroupNCCL takes CUDA tensors, got one on {t.device}")
        return _NcclWork(comm.submit(spec, result))
