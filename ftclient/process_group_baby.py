"""Process groups whose collectives run in a child process that can be killed ("baby" groups).

torchft's ``ProcessGroupBaby*`` idea, in ftclient's terms: a collective that hangs inside the
communication library (a peer died in the middle of a Gloo or NCCL operation) cannot always be
cancelled in-process, but a process can always be killed. So each configuration of a
:class:`ProcessGroupBaby` spawns a fresh child (``torch.multiprocessing``'s spawn context) that
connects to the quorum's store and builds the real backend; every collective is sent to it,
with its tensors shared rather than copied:

- CPU tensors are moved into shared memory (``Tensor.share_memory_()``, in place: the caller's
  tensor keeps working and sees the result);
- CUDA tensors cross as CUDA IPC handles; the child first waits for an interprocess CUDA event
  recorded on the caller's current stream (so it reads the inputs only once they are ready),
  and reports completion only after its stream finished, so the result is in the caller's
  tensor when the work completes.

Every operation has a deadline (the group's timeout). When it passes, or when :meth:`abort` is
called (the Manager's reaction to a dead peer), the child is killed with SIGKILL and reaped
before any pending work is failed, so a collective that completes late never writes into the
caller's tensors after the caller was told it failed. Operations then fail at once until the
next :meth:`configure`, which spawns a new child. A child that dies on its own fails its
pending work at once. The parent never blocks on the child beyond these deadlines.

- :class:`ProcessGroupBabyGloo`: Gloo in the child (CPU tensors); testable without a GPU.
- :class:`ProcessGroupBabyNCCL`: NCCL in the child (CUDA tensors). The child has its own CUDA
  context (memory on the GPU, and its kernels time-share the GPU with the trainer's).
- :class:`SpecProcessGroup` / :class:`OpSpec`: the torch collective methods (allreduce,
  broadcast, allgather, reduce_scatter, alltoall_base, send/recv, barrier) turned into plain,
  picklable specs handed to the subclass's ``_submit``; also the base of
  :class:`ftclient.process_group_nccl.ProcessGroupNCCL`.

The child runs ``ftclient/_collective_ops.py`` as a script, so it imports torch but not ftclient.

The cost: a process start per quorum change (importing torch in the child: seconds, not
milliseconds) and a pipe message per collective.
"""

from __future__ import annotations

import atexit
import logging
import runpy
import threading
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp  # registers the tensor reductions (shared memory, CUDA IPC)
from torch.distributed import AllreduceOptions, BroadcastOptions, ReduceOp, ReduceScatterOptions
from torch.futures import Future

from . import _collective_ops
from ._timeouts import WATCHDOG, Timer
from .process_group import DEFAULT_TIMEOUT, QuorumConfiguredGroup, as_timedelta, parse_store_addr

logger: logging.Logger = logging.getLogger(__name__)

__all__ = ["OpSpec", "ProcessGroupBaby", "ProcessGroupBabyGloo", "ProcessGroupBabyNCCL", "SpecProcessGroup",
           "reduce_op_name"]

STARTUP_TIMEOUT_S = 120.0
"""How long a new child may take to start (spawn, import torch) before the rendezvous, whose
own bound is the group's timeout."""


# --------------------------------------------------------------------------------------------
# Collectives as specs


@dataclass
class OpSpec:
    """One collective: ``name`` is the torch backend method, ``args`` its tensors and plain
    arguments (picklable: tensors travel through shared memory or CUDA IPC)."""

    name: str
    args: tuple[Any, ...]
    tensors: list[torch.Tensor] = field(default_factory=list)  # every tensor it reads or writes


def reduce_op_name(opts: object) -> str:
    """The name (``"SUM"``, ``"AVG"``, ...) of the reduce op in ``opts``: a ReduceOp, a
    ReduceOp.RedOpType, AllreduceOptions / ReduceScatterOptions, or None (SUM)."""
    if opts is None:
        return "SUM"
    if isinstance(opts, (AllreduceOptions, ReduceScatterOptions)):
        opts = opts.reduceOp
    if isinstance(opts, ReduceOp.RedOpType):  # ReduceOp.SUM and friends
        return opts.name
    if isinstance(opts, ReduceOp):
        return opts.op.name
    raise TypeError(f"expected a ReduceOp or reduce options, got {type(opts).__name__}")


def _root(opts: object) -> int:
    if isinstance(opts, BroadcastOptions):
        return int(opts.rootRank)
    return int(opts or 0)  # type: ignore[call-overload]


def _flat(tensors: object) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    out: list[torch.Tensor] = []
    for t in tensors:  # type: ignore[attr-defined]
        out.extend(_flat(t))
    return out


class SpecProcessGroup(QuorumConfiguredGroup):
    """A reconfigurable process group whose collectives are :class:`OpSpec` s handed to
    :meth:`_submit` (which returns the work). Subclasses implement configure, size and
    ``_submit``; :meth:`_prepare` may adapt the tensors first (e.g. move them to shared
    memory)."""

    def _submit(self, spec: OpSpec, result: object) -> dist._Work:
        raise NotImplementedError(f"{type(self).__name__} does not implement _submit")

    def _op(self, name: str, args: tuple[Any, ...], tensors: object, result: object) -> dist._Work:
        return self._submit(OpSpec(name, args, _flat(tensors)), result)

    def allreduce(self, tensors: list[torch.Tensor], opts: object = ReduceOp.SUM) -> dist._Work:
        return self._op("allreduce", (tensors, reduce_op_name(opts)), tensors, tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: object = 0) -> dist._Work:
        return self._op("broadcast", (tensors, _root(opts)), tensors, tensors)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: object = None) -> dist._Work:
        return self._op("allgather", (output_tensors, input_tensors), [output_tensors, input_tensors],
                        output_tensors)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: object = None) -> dist._Work:
        return self._op("_allgather_base", (output, input), [output, input], [output])

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: object = None) -> dist._Work:
        return self._op("reduce_scatter", (output_tensors, input_tensors, reduce_op_name(opts)),
                        [output_tensors, input_tensors], output_tensors)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: object = None) -> dist._Work:
        return self._op("_reduce_scatter_base", (output, input, reduce_op_name(opts)), [output, input],
                        [output])

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: object = None) -> dist._Work:
        return self._op("alltoall_base", (output, input, list(output_split_sizes), list(input_split_sizes)),
                        [output, input], [output])

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int = 0) -> dist._Work:
        return self._op("send", (tensors, dst_rank, tag), tensors, tensors)

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int = 0) -> dist._Work:
        return self._op("recv", (tensors, src_rank, tag), tensors, tensors)

    def barrier(self, opts: object = None) -> dist._Work:
        return self._op("barrier", (), [], None)


# --------------------------------------------------------------------------------------------
# The parent's view of one child


_LIVE_CHILDREN: "weakref.WeakSet[_Child]" = weakref.WeakSet()


@atexit.register
def _stop_children_at_exit() -> None:
    # Runs before multiprocessing's own exit hook (registered earlier), which would SIGTERM the
    # daemon children and make their readers report a spurious failure.
    for child in list(_LIVE_CHILDREN):
        child.stop()


class _Pending:
    __slots__ = ("future", "result", "name", "timer", "keep")

    def __init__(self, future: Future[Any], result: object, name: str, keep: object) -> None:
        self.future = future
        self.result = result
        self.name = name
        self.timer: Timer | None = None
        self.keep = keep  # the tensors stay alive (CUDA IPC needs the producer's) until settled


class _Child:
    """One child process and its pending operations. ``fail`` kills it (once) and fails
    everything pending; operations submitted afterwards fail at once."""

    def __init__(self, kind: str, store_addr: str, rank: int, world_size: int, timeout: timedelta,
                 on_error: Any) -> None:
        self.kind = kind
        self._timeout = timeout
        self._on_error = on_error
        self._cond = threading.Condition()
        self._state = "starting"  # -> started -> ready, or -> failed from any state
        self.failure: Exception | None = None
        self._pending: dict[int, _Pending] = {}
        self._next_id = 0
        self._send_lock = threading.Lock()
        ctx = torch_mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe(duplex=True)
        device_index = torch.cuda.current_device() if kind == "nccl" else None
        # The child runs _collective_ops.py as a script: it imports torch, not ftclient.
        child_args = (kind, parse_store_addr(store_addr), rank, world_size, timeout.total_seconds(),
                      device_index, child_conn)
        self.process = ctx.Process(
            target=runpy.run_path,
            args=(_collective_ops.__file__,),
            kwargs={"init_globals": {"CHILD_ARGS": child_args}, "run_name": _collective_ops.CHILD_RUN_NAME},
            daemon=True,
            name=f"ftclient-baby-{kind}-rank{rank}",
        )
        self.process.start()
        child_conn.close()
        _LIVE_CHILDREN.add(self)
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"ftclient-baby-{kind}-reader")
        self._reader.start()

    # lifecycle ------------------------------------------------------------------------------

    def wait_ready(self, store_addr: str, rank: int, world_size: int) -> None:
        """Block until the child's group is built; raise (and kill the child) when it failed,
        was aborted, or took longer than the start-up bound plus the timeout."""
        what = f"the {self.kind} child's group on {store_addr!r} (rank {rank} of {world_size})"
        with self._cond:
            self._cond.wait_for(lambda: self._state != "starting", STARTUP_TIMEOUT_S)
            if self._state == "starting":
                late: Exception | None = TimeoutError(f"{what}: the child did not start within {STARTUP_TIMEOUT_S:g}s")
            else:
                late = None
        if late is not None:
            self.fail(late)
            raise late
        timeout_s = self._timeout.total_seconds()
        with self._cond:
            self._cond.wait_for(lambda: self._state != "started", timeout_s)
            state, failure = self._state, self.failure
        if state == "ready":
            return
        if state == "started":
            error: Exception = TimeoutError(
                f"building {what} timed out after {timeout_s:g}s: some member of the quorum did not join"
            )
            self.fail(error)
            raise error
        raise RuntimeError(f"building {what} failed: {failure}") from failure

    def fail(self, error: Exception, record: bool = True) -> bool:
        """Kill the child and fail every pending operation with ``error``; False if it had
        already failed. The child is reaped before any work is failed."""
        with self._cond:
            if self._state == "failed":
                return False
            self._state = "failed"
            self.failure = error
            pending, self._pending = list(self._pending.values()), {}
            self._cond.notify_all()
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10.0)
        if record:
            self._on_error(error)
        for p in pending:
            if p.timer is not None:
                p.timer.cancel()
            p.future.set_exception(error)
        if pending:
            logger.warning("%s child killed, %d operation(s) failed: %s", self.kind, len(pending), error)
        return True

    def stop(self) -> None:
        """Shut the child down (pending operations fail; nothing is recorded as an error)."""
        self.fail(RuntimeError("the process group was shut down or reconfigured"), record=False)

    @property
    def failed(self) -> bool:
        return self._state == "failed"

    # operations -----------------------------------------------------------------------------

    def submit(self, spec: OpSpec, result: object) -> Future[Any]:
        fut: Future[Any] = Future()
        with self._cond:
            if self._state != "ready":
                failure = self.failure
            else:
                failure = None
                op_id = self._next_id
                self._next_id += 1
                pending = _Pending(fut, result, spec.name, spec)
                self._pending[op_id] = pending
        if failure is not None:
            error = RuntimeError(f"{spec.name} not started: the process group was aborted ({failure})")
            self._on_error(error)
            fut.set_exception(error)
            return fut
        timeout_s = self._timeout.total_seconds()
        pending.timer = WATCHDOG.schedule(timeout_s, lambda: self.fail(TimeoutError(
            f"{spec.name} timed out after {timeout_s:g}s: a peer replica group is gone or stuck; "
            f"the {self.kind} child process was killed. The step will not commit; the next "
            "quorum reconfigures the group.")))
        event = None
        if any(t.is_cuda for t in spec.tensors):
            event = torch.cuda.Event(interprocess=True)
            event.record()
        try:
            with self._send_lock:
                self._conn.send(("op", op_id, spec.name, spec.args, event))
        except (OSError, EOFError, ValueError) as e:
            self.fail(RuntimeError(f"{spec.name} could not be sent to the {self.kind} child: {e}"))
        return fut

    def _settle(self, op_id: int, error: Exception | None) -> None:
        with self._cond:
            pending = self._pending.pop(op_id, None)
        if pending is None:
            return  # already failed by a timeout or an abort
        if pending.timer is not None:
            pending.timer.cancel()
        if error is not None:
            self._on_error(error)
            pending.future.set_exception(error)
        else:
            pending.future.set_result(pending.result)

    def _read(self) -> None:
        try:
            while True:
                try:
                    msg = self._conn.recv()
                except (EOFError, OSError):
                    self.process.join(1.0)
                    self.fail(RuntimeError(
                        f"the {self.kind} child process exited (exit code {self.process.exitcode})"))
                    return
                tag = msg[0]
                if tag == "started":
                    with self._cond:
                        if self._state == "starting":
                            self._state = "started"
                            self._cond.notify_all()
                elif tag == "ready":
                    with self._cond:
                        if self._state == "started":
                            self._state = "ready"
                            self._cond.notify_all()
                elif tag == "failed":
                    self.fail(RuntimeError(msg[1]))
                elif tag == "done":
                    self._settle(msg[1], None)
                elif tag == "error":
                    with self._cond:
                        pending = self._pending.get(msg[1])
                    name = pending.name if pending is not None else "operation"
                    self._settle(msg[1], RuntimeError(f"{name} failed: {msg[2]}"))
        finally:
            self._conn.close()


class _BabyWork(dist._Work):
    """The work of one operation sent to the child: ``wait`` blocks (bounded by the group's
    timeout: the child is killed at the deadline) and raises the operation's error."""

    def __init__(self, fut: Future[Any]) -> None:
        super().__init__()
        self._fut = fut

    def wait(self, timeout: timedelta | None = None) -> bool:
        if timeout is None:
            self._fut.wait()
        else:
            done = threading.Event()
            self._fut.add_done_callback(lambda _: done.set())
            if not done.wait(max(timeout.total_seconds(), 0.0)):
                raise TimeoutError(f"work not completed within wait(timeout={timeout.total_seconds():g}s)")
        self._fut.value()
        return True

    def is_completed(self) -> bool:
        return self._fut.done()

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> Future[Any]:
        return self._fut


# --------------------------------------------------------------------------------------------
# The process groups


class ProcessGroupBaby(SpecProcessGroup):
    """Base of the baby groups: a reconfigurable process group whose backend lives in a child
    process (see the module docstring). Subclasses name the backend (``_KIND``).

    Args:
        timeout: bound on each operation and on the rendezvous of each configure (the child's
            start-up, which imports torch, has its own bound, ``STARTUP_TIMEOUT_S``); a
            ``timedelta`` or seconds.
    """

    _KIND = ""

    def __init__(self, timeout: timedelta | float = DEFAULT_TIMEOUT) -> None:
        super().__init__(timeout)
        self._lock = threading.Lock()
        self._child: _Child | None = None

    # configuration --------------------------------------------------------------------------

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
        self._stop_child()
        start = time.monotonic()
        child_box: list[_Child] = []

        def record(error: Exception) -> None:
            with self._lock:
                if child_box and self._child is child_box[0] and self._error is None:
                    self._error = error
            logger.warning("%s operation failed: %s", type(self).__name__, error)

        child = _Child(self._KIND, store_addr, rank, world_size, self._timeout, record)
        child_box.append(child)
        with self._lock:
            self._child = child
            self._error = None
            self._rank, self._world_size, self._quorum_id = rank, world_size, quorum_id
        child.wait_ready(store_addr, rank, world_size)
        logger.info("configured %s: store=%s rank=%d world_size=%d quorum_id=%s child pid=%s (%.2fs)",
                    type(self).__name__, store_addr, rank, world_size, quorum_id, child.process.pid,
                    time.monotonic() - start)

    def _stop_child(self) -> None:
        with self._lock:
            child, self._child = self._child, None
            self._world_size = None
        if child is not None:
            child.stop()

    def shutdown(self) -> None:
        self._stop_child()

    def __del__(self) -> None:
        try:
            self._stop_child()
        except Exception:
            pass

    def abort(self, error: Exception | None = None) -> None:
        """Kill the child now: pending operations fail with ``error`` (a configure in progress
        raises), and later ones fail at once until the next :meth:`configure`."""
        error = error if error is not None else RuntimeError("process group aborted")
        child = self._child
        if child is not None and child.fail(error):
            logger.warning("%s aborted (quorum %s): %s", type(self).__name__, self._quorum_id, error)

    # state (rank, size, errored, set_timeout, repr: QuorumConfiguredGroup) -------------------

    @property
    def child_pid(self) -> int | None:
        """The pid of the current child process (None before configure or after shutdown)."""
        child = self._child
        return child.process.pid if child is not None else None

    # operations -----------------------------------------------------------------------------

    def _prepare(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            if t.is_cuda:
                raise ValueError(f"{type(self).__name__} takes CPU tensors, got one on {t.device}")
            if not t.is_shared():
                t.share_memory_()

    def _submit(self, spec: OpSpec, result: object) -> dist._Work:
        child = self._child
        if child is None:
            raise RuntimeError(
                f"{type(self).__name__}.{spec.name} called before configure() (or after shutdown()); "
                "the Manager configures the group when it gets a quorum"
            )
        self._prepare(spec.tensors)
        return _BabyWork(child.submit(spec, result))


class ProcessGroupBabyGloo(ProcessGroupBaby):
    """Gloo in a killable child process (CPU tensors, moved to shared memory in place).
    ``ReduceOp.AVG`` is a sum divided by the group's size (Gloo has no AVG)."""

    _KIND = "gloo"

    def getBackendName(self) -> str:
        return "ftclient-baby-gloo"


class ProcessGroupBabyNCCL(ProcessGroupBaby):
    """NCCL in a killable child process on the caller's current CUDA device (CUDA tensors,
    shared through CUDA IPC). A work completes once the child's GPU stream finished it."""

    _KIND = "nccl"

    def _prepare(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            if not t.is_cuda:
                raise ValueError(f"ProcessGroupBabyNCCL takes CUDA tensors, got one on {t.device}")

    def getBackendName(self) -> str:
        return "ftclient-baby-nccl"
