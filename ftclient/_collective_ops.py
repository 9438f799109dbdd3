"""Torch collectives by name, and the child process of ftclient's "baby" process groups.

This module imports nothing but the standard library and torch, so that the child process of a
:class:`ProcessGroupBaby <ftclient.process_group_baby.ProcessGroupBaby>` can run it as a plain
script (``runpy.run_path``) without importing ftclient, whose import costs seconds (grpc, the
lighthouse protos, DTensor). Everything that crosses the pipe is therefore built from tuples,
strings, numbers, tensors and CUDA events, never from a class of ftclient.

- :func:`launch`: start one collective, given by its torch backend method's name and plain
  arguments (a reduce op by name, a root rank), on a torch backend; the one place that maps
  ftclient's collectives onto ``torch.distributed.ProcessGroupGloo`` / ``ProcessGroupNCCL``.
- :func:`build_backend`: build such a backend on a store (NCCL non-blocking, connected eagerly).
- :func:`child_main`: the baby child's life: connect to the store, build the backend, run the
  collectives the parent sends and report each one's completion.
"""

from __future__ import annotations

import os
import queue
import threading
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions  # not re-exported by torch.distributed
from torch.distributed import (
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    ReduceOp,
    ReduceScatterOptions,
)

__all__ = ["build_backend", "child_main", "connect_store", "launch", "nccl_backend_timeout"]

CHILD_RUN_NAME = "__ftclient_baby_child__"
"""The module name the baby child runs this file under (``runpy.run_path(run_name=...)``)."""


def _red_op(name: str) -> ReduceOp:
    return ReduceOp(getattr(ReduceOp.RedOpType, name))


def _with_timeout(opts: Any, timeout: timedelta | None) -> Any:
    if timeout is not None:
        opts.timeout = timeout
    return opts


def launch(backend: Any, name: str, a: tuple[Any, ...], world_size: int, *, emulate_avg: bool,
           timeout: timedelta | None = None,
           device: torch.device | None = None) -> tuple[dist._Work, Callable[[], None] | None]:
    """Start the collective ``name`` (a torch backend method) with arguments ``a`` on a torch
    backend. Returns its work and an optional ``post`` step to run
    once the work completed (Gloo has no AVG: with ``emulate_avg`` the sum is divided by
    ``world_size`` there). ``timeout`` goes into the backend's options (None: the backend's
    own); ``device`` is the device a NCCL barrier runs on."""
    post: Callable[[], None] | None = None
    if name == "allreduce":
        tensors, op = a
        if op == "AVG" and emulate_avg:
            if not all(torch.is_floating_point(t) for t in tensors):
                raise ValueError("ReduceOp.AVG needs floating point tensors")
            op = "SUM"

            def post() -> None:
                for t in tensors:
                    t.div_(world_size)

        o = _with_timeout(AllreduceOptions(), timeout)
        o.reduceOp = _red_op(op)
        return backend.allreduce(tensors, o), post
    if name == "broadcast":
        tensors, root = a
        o = _with_timeout(BroadcastOptions(), timeout)
        o.rootRank = root
        return backend.broadcast(tensors, o), None
    if name == "allgather":
        outputs, inputs = a
        return backend.allgather(outputs, inputs, _with_timeout(AllgatherOptions(), timeout)), None
    if name == "_allgather_base":
        output, inp = a
        return backend._allgather_base(output, inp, _with_timeout(AllgatherOptions(), timeout)), None
    if name in ("reduce_scatter", "_reduce_scatter_base"):
        output, inputs, op = a
        if op == "AVG" and emulate_avg:
            raise ValueError("ReduceOp.AVG is not supported by Gloo's reduce_scatter")
        o = _with_timeout(ReduceScatterOptions(), timeout)
        o.reduceOp = _red_op(op)
        return getattr(backend, name)(output, inputs, o), None
    if name == "alltoall_base":
        output, inp, out_splits, in_splits = a
        o = _with_timeout(AllToAllOptions(), timeout)
        return backend.alltoall_base(output, inp, out_splits, in_splits, o), None
    if name in ("send", "recv"):
        tensors, peer, tag = a
        return getattr(backend, name)(tensors, peer, tag), None
    if name == "barrier":
        o = _with_timeout(BarrierOptions(), timeout)
        if device is not None and device.type == "cuda":
            o.device_ids = [device.index]
        return backend.barrier(o), None
    raise ValueError(f"unknown collective {name!r}")


def nccl_backend_timeout(timeout: timedelta) -> timedelta:
    """The timeout given to torch's own NCCL watchdog: well past ftclient's, so that ftclient's
    deadline (which aborts the communicator and fails the work) always comes first and torch's
    watchdog (which by default tears the whole process down) never fires."""
    return timeout * 2 + timedelta(seconds=60)


def build_backend(kind: str, store: dist.Store, rank: int, world_size: int, timeout: timedelta,
                  device: torch.device | None = None) -> Any:
    """A torch backend of ``kind`` (``"gloo"`` or ``"nccl"``) for ``world_size`` members on
    ``store``, returned once every member joined. A NCCL backend is built non-blocking (so
    ``abort`` can end a communicator that waits for a peer) and connected on ``device`` (the
    current CUDA device by default) by one small allreduce, so that a member that never joins
    is noticed while configuring, not by the trainer's first collective."""
    if kind == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if kind != "nccl":
        raise ValueError(f"unknown backend kind {kind!r}")
    if not dist.is_nccl_available():
        raise RuntimeError("NCCL is not available in this torch build (a CUDA build of torch is needed)")
    # torch waits this long for a non-blocking communicator to become ready.
    os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(int(timeout.total_seconds()) or 1))
    opts = dist.ProcessGroupNCCL.Options()
    opts.config.blocking = False
    opts._timeout = nccl_backend_timeout(timeout)
    backend = dist.ProcessGroupNCCL(store, rank, world_size, opts)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    backend.eager_connect_single_device(device)
    # A non-blocking communicator is still connecting when eager_connect returns, and the first
    # collective would then wait for it inside torch, on the trainer's thread, where nothing can
    # interrupt it. So the build waits for one small collective: it returns once every member
    # joined (the caller bounds the wait, on another thread or process).
    probe = torch.zeros(1, device=device)
    stream = torch.cuda.Stream(device=device)
    with torch.cuda.stream(stream):
        work = backend.allreduce([probe], AllreduceOptions())
        work.wait()
    stream.synchronize()
    return backend




def connect_store(host: str, port: int, prefix: str, timeout: timedelta) -> dist.Store:
    """A TCPStore client on ``host:port`` scoped to ``prefix`` (what
    ``ftclient.process_group.create_store_client`` builds from ``"host:port/prefix"``)."""
    store = dist.TCPStore(host_name=host, port=port, is_master=False, wait_for_workers=False,
                          timeout=timeout)
    return dist.PrefixStore(prefix, store)


# --------------------------------------------------------------------------------------------
# The baby child


class _Completer:
    """In a NCCL child: reports each work once the GPU finished it (FIFO, as NCCL completes a
    communicator's operations in order)."""

    def __init__(self, send: Callable[[tuple[Any, ...]], None]) -> None:
        self._send = send
        self._queue: queue.Queue[tuple[int, Any, Any]] = queue.Queue()
        self._stream = torch.cuda.Stream()
        threading.Thread(target=self._run, daemon=True, name="ftclient-baby-completer").start()

    def add(self, op_id: int, work: Any, keep: Any) -> None:
        self._queue.put((op_id, work, keep))

    def _run(self) -> None:
        while True:
            op_id, work, _keep = self._queue.get()
            try:
                with torch.cuda.stream(self._stream):
                    work.wait()  # this stream waits for the NCCL stream
                self._stream.synchronize()
            except Exception as e:  # noqa: BLE001 -- reported to the parent
                self._send(("error", op_id, f"{type(e).__name__}: {e}"))
            else:
                self._send(("done", op_id))


def child_main(kind: str, store: tuple[str, int, str], rank: int, world_size: int, timeout_s: float,
               device_index: int | None, conn: Any) -> None:
    """The baby child's whole life: build the backend, then run every collective the parent
    sends until the parent says ``exit`` or goes away (the pipe closes: the child exits).

    Messages to the parent: ``("started", pid)``, then ``("ready",)`` or ``("failed", text)``,
    then ``("done", op_id)`` or ``("error", op_id, text)`` per operation. From the parent:
    ``("op", op_id, name, args, cuda_event_or_None)`` and ``("exit",)``."""
    send_lock = threading.Lock()

    def send(msg: tuple[Any, ...]) -> None:
        with send_lock:
            try:
                conn.send(msg)
            except (OSError, EOFError):
                os._exit(0)  # the parent is gone

    send(("started", os.getpid()))
    device: torch.device | None = None
    timeout = timedelta(seconds=timeout_s)
    try:
        if device_index is not None:
            torch.cuda.set_device(device_index)
            device = torch.device("cuda", device_index)
        backend = build_backend(kind, connect_store(*store, timeout), rank, world_size, timeout, device)
    except Exception as e:  # noqa: BLE001 -- reported to the parent
        send(("failed", f"{type(e).__name__}: {e}"))
        os._exit(0)
    send(("ready",))
    completer = _Completer(send) if kind == "nccl" else None
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            os._exit(0)
        if msg[0] == "exit":
            os._exit(0)
        _, op_id, name, args, event = msg
        try:
            if event is not None:
                event.wait()  # the current stream waits until the parent's inputs are ready
            work, post = launch(backend, name, args, world_size, emulate_avg=(kind == "gloo"),
                                timeout=timeout, device=device)
        except Exception as e:  # noqa: BLE001 -- reported to the parent
            send(("error", op_id, f"{type(e).__name__}: {e}"))
            continue
        if completer is not None:
            completer.add(op_id, work, args)
            continue

        def done(fut: Any, op_id: int = op_id, post: Any = post, keep: Any = args) -> None:
            try:
                fut.value()
                if post is not None:
                    post()
            except Exception as e:  # noqa: BLE001 -- reported to the parent
                send(("error", op_id, f"{type(e).__name__}: {e}"))
            else:
                send(("done", op_id))

        work.get_future().add_done_callback(done)


if __name__ == CHILD_RUN_NAME:  # run by the baby child: runpy.run_path(__file__, init_globals=...)
    child_main(*globals()["CHILD_ARGS"])
