"""Reconfigurable, fault-tolerant process groups (ftclient's counterpart of torchft.process_group).

This module owns the collective-communication layer a replica group uses to talk to the other
replica groups of the quorum:

- :class:`ProcessGroup`: the reconfigurable process-group API the Manager drives
  (``configure`` on every new quorum, ``allreduce``, ``size``, ``errored``, ``abort``,
  ``shutdown``), torch's other collectives, and ``register(name)`` / ``unregister()`` /
  ``group_name``: a registered group is in torch's registry, so functional collectives
  (``torch.distributed._functional_collectives.all_reduce(x, "avg", pg)``) accept it.
- :class:`ProcessGroupGloo`: a fresh torch Gloo process group per quorum, rendezvoused over a
  TCPStore client + PrefixStore built from ``"host:port/prefix"``. Every operation carries a
  deadline: its work and future fail with :class:`TimeoutError` once the configured timeout has
  passed, even when Gloo itself is stuck, and ``abort`` fails them at once (a peer died).
- :class:`ErrorSwallowingProcessGroupWrapper`: records the first error and returns completed
  dummy work afterwards, so model code never sees a failure; the error surfaces through
  ``errored()`` (the Manager votes against committing) and is cleared by ``configure``.
- :class:`ManagedProcessGroup`: a process group whose allreduce goes through a Manager
  (``manager.allreduce``), whose other collectives go to the Manager's process group, and
  whose size is the number of quorum participants.
- :class:`ProcessGroupDummy`: a single-rank group that completes everything at once (used by
  :mod:`ftclient.ddp` to soak up DDP's own start-up collectives).

All classes subclass ``torch.distributed.ProcessGroup`` so they can be handed to torch APIs
that expect a process group. Operations return ``torch.distributed.Work`` objects with
``wait(timeout=None)`` and ``get_future()``; an allreduce future's value is the list of tensors
that was passed in (reduced in place), as in torch.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import sys
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions  # not re-exported by torch.distributed
from torch.distributed import (
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    ReduceOp,
    ReduceScatterOptions,
)
from torch.futures import Future

from ._timeouts import WATCHDOG

logger: logging.Logger = logging.getLogger(__name__)

__all__ = [
    "ErrorSwallowingProcessGroupWrapper",
    "ManagedProcessGroup",
    "ProcessGroup",
    "ProcessGroupDummy",
    "ProcessGroupGloo",
    "abort_process_group",
    "create_store_client",
    "parse_store_addr",
]

DEFAULT_TIMEOUT: timedelta = timedelta(seconds=60)


# --------------------------------------------------------------------------------------------
# Store addresses


def parse_store_addr(store_addr: str) -> tuple[str, int, str]:
    """Split torchft's store address ``"host:port/prefix"`` (``"[v6]:port/prefix"`` for IPv6)
    into ``(host, port, prefix)``. The prefix may be empty and may itself contain slashes."""
    addr, _, prefix = store_addr.partition("/")
    host, sep, port = addr.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit():
        raise ValueError(
            f"invalid store address {store_addr!r}: expected 'host:port/prefix' "
            "(e.g. 'localhost:29500/torchft/3/0'), as the Manager builds it from the quorum's "
            "store_address"
        )
    return host, int(port), prefix


def create_store_client(store_addr: str, timeout: timedelta) -> dist.Store:
    """Connect a TCPStore client to ``host:port`` and scope it to ``prefix`` with a PrefixStore.

    The store's timeout bounds every rendezvous wait (and so the Gloo set-up that uses it)."""
    host, port, prefix = parse_store_addr(store_addr)
    try:
        store = dist.TCPStore(
            host_name=host,
            port=port,
            is_master=False,
            wait_for_workers=False,
            timeout=timeout,
        )
    except Exception as e:  # torch raises a bare RuntimeError / DistNetworkError
        raise ConnectionError(
            f"could not connect to the quorum's TCPStore at {host}:{port} within "
            f"{timeout.total_seconds():g}s: {e}. The store runs on the primary replica group's "
            "rank 0; check that it is alive and reachable from this host."
        ) from e
    return dist.PrefixStore(prefix, store)


# --------------------------------------------------------------------------------------------
# Work objects


def _completed_future(value: object) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


class _DummyWork(dist._Work):
    """Work that is already complete with ``result``."""

    def __init__(self, result: object) -> None:
        super().__init__()
        self._fut = _completed_future(result)

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def get_future(self) -> Future[Any]:
        return self._fut


class _FutureWork(dist._Work):
    """Work backed by a torch Future: ``wait`` blocks on it (optionally with a timeout) and
    raises its exception, ``get_future`` returns it."""

    def __init__(self, fut: Future[Any]) -> None:
        super().__init__()
        self._fut = fut

    def wait(self, timeout: timedelta | None = None) -> bool:
        _wait_future(self._fut, timeout)
        self._fut.value()  # raises the operation's error, if any
        return True

    def get_future(self) -> Future[Any]:
        return self._fut


def _wait_future(fut: Future[Any], timeout: timedelta | None) -> None:
    """Block until ``fut`` is done; with a timeout, raise TimeoutError when it is not done by
    then (the future itself is left alone). A zero timeout means none: that is what torch's C++
    side passes (``kNoTimeout``) when functional collectives wait on a Python work."""
    if timeout is None or timeout <= timedelta(0):
        fut.wait()
        return
    done = threading.Event()
    fut.add_done_callback(lambda _: done.set())
    if not done.wait(max(timeout.total_seconds(), 0.0)):
        raise TimeoutError(f"work not completed within wait(timeout={timeout.total_seconds():g}s)")


def _work_future(work: dist._Work, op_name: str) -> Future[Any]:
    """The future of a torch work. Gloo's reduce_scatter, ``_reduce_scatter_base``, send and
    recv works have none: a helper thread waits for such a work (Gloo bounds the wait by the
    operation's timeout) and completes a future for it."""
    try:
        return work.get_future()
    except RuntimeError as e:
        if "not implemented" not in str(e):
            raise
    fut: Future[Any] = Future()

    def waiter() -> None:
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001 -- handed to the future
            fut.set_exception(e)
            return
        fut.set_result(None)

    threading.Thread(target=waiter, daemon=True, name=f"ftclient-gloo-{op_name}").start()
    return fut


class _DeadlineWork(dist._Work):
    """Wraps a Gloo work (or several, launched together as one operation): its future completes with the Gloo result, or fails with the Gloo
    error, or fails with TimeoutError when the deadline passes first, or fails with the error
    given to :meth:`abort`. Whichever comes first settles it; the others are no-ops. Errors are
    reported to ``on_error`` (the owning process group's error record).

    ``post`` (e.g. copying a staged result into the caller's tensors) runs under the same lock
    that settles the work, only when the Gloo work completed first: once a timeout or an abort
    settled the work, a late completion never touches the caller's tensors."""

    def __init__(
        self,
        inner: dist._Work | list[dist._Work],
        result: object,
        op_name: str,
        timeout: timedelta,
        on_error: Callable[[Exception], None],
        post: Callable[[], None] | None = None,
        on_inner_done: Callable[[], None] | None = None,
        on_settled: Callable[["_DeadlineWork"], None] | None = None,
    ) -> None:
        super().__init__()
        self._fut: Future[Any] = Future()
        self._lock = threading.Lock()
        self._done = False
        self._on_error = on_error
        self._on_settled = on_settled
        timeout_s = timeout.total_seconds()

        def on_timeout() -> None:
            self._finish(
                TimeoutError(
                    f"{op_name} timed out after {timeout_s:g}s: a peer replica group is gone or "
                    "stuck. The step will not commit; the next quorum reconfigures the group."
                )
            )

        self._timer = WATCHDOG.schedule(timeout_s, on_timeout)

        inners = inner if isinstance(inner, list) else [inner]

        def inner_done(f: Future[Any]) -> None:
            try:
                try:
                    value = f.value()
                    if len(inners) > 1:  # collect_all: each part's own error
                        for part in value:
                            part.value()
                except Exception as e:
                    self._finish(RuntimeError(f"{op_name} failed: {e}"))
                    return
                self._finish(None, result, post)
            finally:
                if on_inner_done is not None:
                    on_inner_done()

        # Registered last: the inner future may already be complete and call back at once.
        if len(inners) == 1:
            _work_future(inners[0], op_name).add_done_callback(inner_done)
        else:
            torch.futures.collect_all([_work_future(w, op_name) for w in inners]).add_done_callback(inner_done)

    def abort(self, error: Exception) -> bool:
        """Fail the work with ``error`` unless it is already settled; True if it was not."""
        return self._finish(error)

    @property
    def settled(self) -> bool:
        return self._done

    def _finish(self, error: Exception | None, result: object = None,
                post: Callable[[], None] | None = None) -> bool:
        with self._lock:
            if self._done:
                return False
            if error is None and post is not None:
                try:
                    post()
                except Exception as e:
                    error = e
            self._done = True
        self._timer.cancel()
        if error is not None:
            self._on_error(error)
            self._fut.set_exception(error)
        else:
            self._fut.set_result(result)
        if self._on_settled is not None:
            self._on_settled(self)
        return True

    def wait(self, timeout: timedelta | None = None) -> bool:
        _wait_future(self._fut, timeout)
        self._fut.value()
        return True

    def get_future(self) -> Future[Any]:
        return self._fut


# --------------------------------------------------------------------------------------------
# Process groups


def _reduce_op(opts: object) -> ReduceOp:
    """The ReduceOp of ``opts``: a ReduceOp, a ReduceOp.RedOpType, or AllreduceOptions,
    AllreduceCoalescedOptions or ReduceScatterOptions (None: SUM)."""
    if isinstance(opts, (AllreduceOptions, AllreduceCoalescedOptions, ReduceScatterOptions)):
        return opts.reduceOp
    if isinstance(opts, ReduceOp):
        return opts
    if isinstance(opts, ReduceOp.RedOpType):
        return ReduceOp(opts)
    if opts is None:
        return ReduceOp.SUM
    raise TypeError(f"expected a ReduceOp or reduce options, got {type(opts).__name__}")


def _same_op(a: ReduceOp, b: ReduceOp.RedOpType) -> bool:
    return a == b  # ReduceOp compares equal to its RedOpType


def abort_process_group(pg: object, error: Exception) -> None:
    """``pg.abort(error)`` for ftclient's process groups, ``pg.abort()`` for others (torchft's
    take no argument); a group without ``abort`` is left alone."""
    if isinstance(pg, ProcessGroup):
        pg.abort(error)
        return
    abort = getattr(pg, "abort", None)
    if callable(abort):
        abort()


# Registration: the torch backend plugin whose creator hands torch the group being registered.

_REGISTRY_LOCK = threading.Lock()
_REGISTERING: list["ProcessGroup"] = []
_PLUGIN = "ftclient"


def _create_registered_group(store: object, rank: int, world_size: int, timeout: object) -> "ProcessGroup":
    """The creator of the ``ftclient`` backend plugin: torch's ``new_group`` asks it for the
    group, and it answers with the ftclient group being registered (torch then keeps that very
    object: it is a ``torch.distributed.ProcessGroup``)."""
    if not _REGISTERING:
        raise RuntimeError("the 'ftclient' backend only registers existing ftclient process groups: "
                           "call ProcessGroup.register(name) instead of new_group(backend='ftclient')")
    return _REGISTERING[-1]


def _ensure_plugin() -> None:
    if _PLUGIN.upper() in dist.Backend._plugins:
        return
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices.append("cuda")
    elif hasattr(torch, "xpu") and torch.xpu.is_available():
        devices.append("xpu")
    dist.Backend.register_backend(_PLUGIN, _create_registered_group, devices=devices)


def _noop() -> None:
    return None


class ProcessGroup(dist.ProcessGroup):
    """Base of ftclient's process groups: a ``torch.distributed.ProcessGroup`` that can be
    reconfigured (new store prefix, rank and world size) on every quorum.

    Subclasses implement :meth:`configure`, :meth:`allreduce` and :meth:`size`, and whichever
    other collectives they support (the ones here raise NotImplementedError): ``allgather``,
    ``_allgather_base``, ``allgather_into_tensor_coalesced``, ``allreduce_coalesced``,
    ``broadcast``, ``reduce_scatter``, ``_reduce_scatter_base``,
    ``reduce_scatter_tensor_coalesced``, ``alltoall_base``, ``send``, ``recv``, ``barrier``.
    Their signatures are torch's, so ``torch.distributed.all_gather(..., group=pg)`` and the
    like call them.

    :meth:`register` puts the group in torch's registry of process groups, which functional
    collectives (``torch.distributed._functional_collectives.all_reduce(x, "avg", pg)``) and
    DeviceMesh need; the registration survives every reconfiguration.
    """

    def __init__(self) -> None:
        super().__init__(0, 1)  # torch's static rank/size are unused; see size()
        self._group_name: str | None = None

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
        """Tear down the current group and build one for ``world_size`` members where this
        process is ``rank``, rendezvousing on ``store_addr`` (``"host:port/prefix"``; the
        prefix must be unique per quorum, e.g. ``.../torchft/{quorum_id}/{group_rank}``).
        Blocks until the group is ready; raises if it cannot be built within the timeout.
        ``global_ranks`` is accepted for torchft compatibility and unused."""
        raise NotImplementedError(f"{type(self).__name__} does not implement configure")

    def allreduce(self, tensors: list[torch.Tensor], opts: object) -> dist._Work:
        """Reduce ``tensors`` in place across the group; ``opts`` is a ReduceOp or
        AllreduceOptions. Returns a Work whose future's value is ``tensors``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement allreduce")

    def _unsupported(self, op_name: str) -> NotImplementedError:
        return NotImplementedError(f"{type(self).__name__} does not implement {op_name}")

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: object = None) -> dist._Work:
        """Reduce every tensor of ``tensors`` in place in one operation."""
        raise self._unsupported("allreduce_coalesced")

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: object = None) -> dist._Work:
        """Gather ``input_tensors`` from every member into ``output_tensors`` (one list per
        input, one tensor per member)."""
        raise self._unsupported("allgather")

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: object = None) -> dist._Work:
        """Gather ``input`` from every member into ``output``, concatenated in rank order
        (``torch.distributed.all_gather_into_tensor``)."""
        raise self._unsupported("_allgather_base")

    def allgather_into_tensor_coalesced(self, output_tensors: list[torch.Tensor],
                                        input_tensors: list[torch.Tensor], opts: object = None) -> dist._Work:
        """``_allgather_base`` for each (output, input) pair, as one operation."""
        raise self._unsupported("allgather_into_tensor_coalesced")

    def broadcast(self, tensors: list[torch.Tensor], opts: object = 0) -> dist._Work:
        """Broadcast ``tensors`` from ``opts`` (a root rank or BroadcastOptions)."""
        raise self._unsupported("broadcast")

    def broadcast_one(self, tensor: torch.Tensor, root: int) -> dist._Work:
        """Broadcast one tensor from rank ``root`` (torchft's helper)."""
        opts = BroadcastOptions()
        opts.rootRank = root
        return self.broadcast([tensor], opts)

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: object = None) -> dist._Work:
        """Reduce ``input_tensors[i]`` (one tensor per member) across the group and leave
        member r's part in ``output_tensors[i]`` on member r."""
        raise self._unsupported("reduce_scatter")

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: object = None) -> dist._Work:
        """Reduce ``input`` across the group and leave this member's chunk (rank order) in
        ``output`` (``torch.distributed.reduce_scatter_tensor``)."""
        raise self._unsupported("_reduce_scatter_base")

    def reduce_scatter_tensor_coalesced(self, output_tensors: list[torch.Tensor],
                                        input_tensors: list[torch.Tensor], opts: object = None) -> dist._Work:
        """``_reduce_scatter_base`` for each (output, input) pair, as one operation."""
        raise self._unsupported("reduce_scatter_tensor_coalesced")

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: object = None) -> dist._Work:
        """Scatter ``input``'s chunks to the members and gather theirs into ``output``
        (``torch.distributed.all_to_all_single``; empty split sizes mean equal chunks)."""
        raise self._unsupported("alltoall_base")

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int = 0) -> dist._Work:
        """Send ``tensors`` to member ``dst_rank``."""
        raise self._unsupported("send")

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int = 0) -> dist._Work:
        """Receive into ``tensors`` from member ``src_rank``."""
        raise self._unsupported("recv")

    def barrier(self, opts: object = None) -> dist._Work:
        """Complete once every member reached the barrier."""
        raise self._unsupported("barrier")

    # torch 2.13's names for the tensor forms (torch.distributed's functions call these; the
    # C++ side prefers them too): each delegates to the name above, which subclasses implement.

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: object = None) -> dist._Work:
        """torch's newer name for :meth:`_allgather_base`."""
        return self._allgather_base(output, input, opts)

    def all_gather_single_coalesced(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                                    opts: object = None) -> dist._Work:
        """torch's newer name for :meth:`allgather_into_tensor_coalesced`."""
        return self.allgather_into_tensor_coalesced(output_tensors, input_tensors, opts)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: object = None) -> dist._Work:
        """torch's newer name for :meth:`_reduce_scatter_base`."""
        return self._reduce_scatter_base(output, input, opts)

    def reduce_scatter_single_coalesced(self, output_tensors: list[torch.Tensor],
                                        input_tensors: list[torch.Tensor], opts: object = None) -> dist._Work:
        """torch's newer name for :meth:`reduce_scatter_tensor_coalesced`."""
        return self.reduce_scatter_tensor_coalesced(output_tensors, input_tensors, opts)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts: object = None) -> dist._Work:
        """torch's newer name for :meth:`alltoall_base`."""
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def size(self) -> int:
        """Number of members of the current group."""
        raise NotImplementedError(f"{type(self).__name__} does not implement size")

    def errored(self) -> Exception | None:
        """The first error seen since the last configure, if any (the Manager checks this
        before voting in should_commit)."""
        return None

    def shutdown(self) -> None:
        """Release the current group; further operations need a new configure."""

    def abort(self, error: Exception | None = None) -> None:
        """Fail the current configuration's pending operations at once with ``error`` (a peer
        of the quorum is known to be gone: they cannot complete), and fail later operations at
        once until the next :meth:`configure`. A no-op here; torchft calls it without
        arguments. (torch's own ``ProcessGroup.abort`` does nothing for Gloo.)"""

    def set_timeout(self, timeout: timedelta) -> None:
        """Change the timeout of subsequent configures and operations."""
        raise NotImplementedError(f"{type(self).__name__} has no timeout")

    def getBackendName(self) -> str:
        return "ftclient"

    # registration ---------------------------------------------------------------------------

    def register(self, name: str) -> "ProcessGroup":
        """Register this group in torch's process-group registry under the description
        ``"{backend}:{name}"`` and return it (the same object, as torchft's ``register``
        returns the group torch created). Afterwards :attr:`group_name` is torch's name for it,
        and functional collectives, ``torch.distributed.get_world_size(pg)`` and DeviceMesh
        accept it. Once per group; the registration survives every :meth:`configure`.

        Like torchft, this creates a one-rank torch group for this rank with
        ``torch.distributed.new_group``, so the default process group must be initialized
        (``torch.distributed.init_process_group``, as torchrun/torchtitan do; a one-process
        job can use ``init_process_group("gloo", rank=0, world_size=1,
        store=torch.distributed.HashStore())``). Every rank of the default group registers its
        groups in the same order, as with any ``new_group``."""
        if not dist.is_initialized():
            raise RuntimeError(
                f"{type(self).__name__}.register({name!r}) needs torch's default process group: call "
                "torch.distributed.init_process_group first (torchrun and torchtitan do; one process "
                "alone can use init_process_group('gloo', rank=0, world_size=1, store=torch.distributed.HashStore()))"
            )
        with _REGISTRY_LOCK:
            if self._group_name is not None:
                raise RuntimeError(f"{self!r} is already registered (group_name {self._group_name!r}); "
                                   "call unregister() first")
            _ensure_plugin()
            _REGISTERING.append(self)
            try:
                created = dist.new_group(ranks=[dist.get_rank()], backend=_PLUGIN,
                                         group_desc=f"{self.getBackendName()}:{name}")
            finally:
                _REGISTERING.pop()
        if created is not self:  # torch keeps a ProcessGroup returned by a plugin as it is
            raise RuntimeError(f"torch registered {created!r} instead of {self!r}")
        logger.info("registered %r as torch process group %r (%s)", self, self._group_name, name)
        return self

    def unregister(self) -> None:
        """Remove the group from torch's registry (:meth:`register` undone). Unlike torchft's,
        the group itself is left configured and usable."""
        with _REGISTRY_LOCK:
            name = self._group_name
            if name is None:
                raise ValueError(f"{self!r} is not registered")
            if self in dist.distributed_c10d._world.pg_map:
                # torch's destroy_process_group shuts the group down: keep it as it is.
                self.__dict__["shutdown"] = _noop
                try:
                    dist.destroy_process_group(self)
                finally:
                    del self.__dict__["shutdown"]
            self._group_name = None

    @property
    def group_name(self) -> str:  # type: ignore[override]
        """torch's name for the group once :meth:`register` ran (functional collectives take
        it, or the group itself); ValueError before."""
        if self._group_name is None:
            raise ValueError(f"ProcessGroup name not set: call {type(self).__name__}.register(name) first "
                             "(functional collectives need a registered group)")
        return self._group_name

    def _set_group_name(self, name: str) -> None:
        # torch names the group it registers through this (the C++ base keeps names on its
        # backends, and these groups have none).
        self._group_name = name

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class _Backend:
    """A Gloo group plus a count of its in-flight operations.

    torch's Gloo destructor joins Gloo's worker threads, i.e. waits for an in-flight operation
    to hit Gloo's own timeout. So an idle group is destroyed at once, and a busy one is handed
    to the reaper, which destroys it when its last operation has finished."""

    def __init__(self, pg: dist.ProcessGroupGloo) -> None:
        self.pg: dist.ProcessGroupGloo | None = pg
        self._lock = threading.Lock()
        self._inflight = 0
        self.idle = threading.Event()
        self.idle.set()
        _REAPER.track(self)

    def op_started(self) -> None:
        with self._lock:
            self._inflight += 1
            self.idle.clear()

    def op_finished(self) -> None:
        with self._lock:
            self._inflight -= 1
            if self._inflight == 0:
                self.idle.set()

    def release(self) -> None:
        """Destroy the group now if it is idle and this is a thread Python started; else hand
        it to the reaper. A finalizer (``ProcessGroupGloo.__del__``) runs on whatever thread the
        garbage collector ran on, possibly one of Gloo's own (a thread Python did not start),
        whose destructor would then join itself: "terminate called after throwing an instance
        of 'std::system_error' ... Resource deadlock avoided" (seen in CI). While Python
        finalizes no new thread can start, and the group is destroyed here as before."""
        if self.idle.is_set() and (not _on_a_foreign_thread() or sys.is_finalizing()):
            self.pg = None  # destroyed here: nothing to wait for
        else:
            _REAPER.retire(self)


def _on_a_foreign_thread() -> bool:
    """Whether the calling thread was started outside ``threading`` (Gloo's workers, gRPC's
    pollers: C++ threads that call into Python), which ``threading`` represents by a dummy."""
    return isinstance(threading.current_thread(), threading._DummyThread)


class _Reaper:
    """Destroys Gloo groups off the trainer's thread once idle, and every group still alive at
    interpreter exit.

    Exit is the dangerous moment: an operation that completes while Python finalizes runs its
    completion callbacks (this module's Python code) on a Gloo worker thread, and a thread that
    asks for the GIL then is ended by Python with a forced unwind, which aborts the process
    ("terminate called after throwing an instance of 'gloo::IoException'"): a peer that exits
    or dies makes the last operation of the others fail at just that moment. So an ``atexit``
    hook -- it runs before finalization -- waits (bounded) for each group's in-flight operations
    and destroys it, which joins its Gloo threads while Python still runs normally."""

    EXIT_WAIT_S = 5.0
    """How long exit waits, over all groups, for in-flight operations to finish."""

    def __init__(self) -> None:
        self._queue: queue.Queue[_Backend | None] = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid: int | None = None
        self._live: weakref.WeakSet[_Backend] = weakref.WeakSet()
        atexit.register(self._at_exit)
        if hasattr(os, "register_at_fork"):
            # A forked child has none of the parent's Gloo threads: it must not join them.
            os.register_at_fork(after_in_child=self._live.clear)

    def track(self, backend: _Backend) -> None:
        self._live.add(backend)

    def retire(self, backend: _Backend) -> None:
        with self._lock:
            if self._pid != os.getpid():
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._run, name="ftclient-pg-reaper", daemon=True)
                self._thread.start()
        self._queue.put(backend)

    def _run(self) -> None:
        while True:
            backend = self._queue.get()
            if backend is None:
                return
            backend.idle.wait()
            backend.pg = None

    def _at_exit(self) -> None:
        deadline = time.monotonic() + self.EXIT_WAIT_S
        with self._lock:
            thread = self._thread if self._pid == os.getpid() else None
        if thread is not None and thread.is_alive():
            self._queue.put(None)  # after the groups already retired
            thread.join(max(0.0, deadline - time.monotonic()))
        for backend in list(self._live):
            if backend.pg is None:
                continue
            if backend.idle.wait(max(0.0, deadline - time.monotonic())):
                backend.pg = None  # torch releases the GIL while it joins the group's threads
            else:
                logger.warning("a Gloo group still has an operation in flight at exit; left to the OS "
                               "(the process may abort if it completes while Python finalizes)")


_REAPER = _Reaper()


class _BuildAborted(Exception):
    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class _Build:
    """One Gloo group being built (store connection and rendezvous) on a helper thread, so that
    ``abort`` can end the wait for a member that will never join. An abandoned build finishes on
    its own within the timeout; a group it still builds is released, never used."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None
        self._aborted: Exception | None = None

    def run(self, build: Callable[[], dist.ProcessGroupGloo]) -> dist.ProcessGroupGloo:
        def target() -> None:
            result: Any = None
            error: BaseException | None = None
            try:
                result = build()
            except BaseException as e:  # noqa: BLE001 -- handed to the waiting configure
                error = e
            with self._cond:
                self._done, self._result, self._error = True, result, error
                abandoned = self._aborted is not None
                self._cond.notify_all()
            if abandoned and result is not None:
                _Backend(result).release()

        threading.Thread(target=target, daemon=True, name="ftclient-gloo-configure").start()
        with self._cond:
            self._cond.wait_for(lambda: self._done or self._aborted is not None)
            if self._aborted is not None:
                raise _BuildAborted(self._aborted)
            if self._error is not None:
                raise self._error
            return self._result

    def abort(self, error: Exception) -> None:
        with self._cond:
            if not self._done and self._aborted is None:
                self._aborted = error
                self._cond.notify_all()


def as_timedelta(timeout: timedelta | float) -> timedelta:
    """A timeout given as a ``timedelta`` or as seconds, as a ``timedelta``."""
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))


class QuorumConfiguredGroup(ProcessGroup):
    """The state every group that :meth:`configure` rebuilds per quorum keeps (Gloo, NCCL, the
    baby groups): rank and size of the current configuration, its quorum id, the timeout and
    the first error of the current configuration. Subclasses set the attributes; this class
    answers for them."""

    def __init__(self, timeout: timedelta | float = DEFAULT_TIMEOUT) -> None:
        super().__init__()
        self._timeout = as_timedelta(timeout)
        self._rank: int | None = None
        self._world_size: int | None = None
        self._quorum_id: int | None = None
        self._error: Exception | None = None

    def set_timeout(self, timeout: timedelta | float) -> None:
        self._timeout = as_timedelta(timeout)

    def size(self) -> int:
        if self._world_size is None:
            raise RuntimeError(f"{type(self).__name__}.size() called before configure()")
        return self._world_size

    def rank(self) -> int:
        if self._rank is None:
            raise RuntimeError(f"{type(self).__name__}.rank() called before configure()")
        return self._rank

    def errored(self) -> Exception | None:
        return self._error

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rank={self._rank}, world_size={self._world_size}, "
                f"quorum_id={self._quorum_id}, timeout={self._timeout.total_seconds():g}s)")


class ProcessGroupGloo(QuorumConfiguredGroup):
    """A reconfigurable Gloo process group (CPU tensors).

    Every :meth:`configure` connects a new TCPStore client scoped by the address's prefix and
    builds a fresh ``torch.distributed.ProcessGroupGloo`` on it; the previous group is released
    in the background (torch's Gloo destructor waits for in-flight operations, which could
    otherwise block the trainer for a whole timeout).

    Every operation is bounded by ``timeout``: Gloo fails it when a peer closes its connection
    (a dead peer is noticed at once) or when the timeout elapses, and a watchdog fails the
    returned work and future with :class:`TimeoutError` at the deadline in any case (e.g. when
    the operation is queued behind a stuck one). The first error is kept for :meth:`errored`.

    :meth:`abort` (the Manager calls it when the lighthouse says a peer of the quorum died) fails
    every pending operation of the current configuration at once, and every later one until the
    next :meth:`configure`. Gloo cannot cancel an operation: its threads stay blocked until
    Gloo's own timeout, when the reaper destroys the group. Allreduces therefore run on a staged
    copy of their tensors, copied back only when the operation completes before any timeout or
    abort: an operation that completes after it was aborted (the peer was merely slow, a false
    death) never writes into tensors the trainer has moved on with (DDP reuses its gradient
    buckets every step). The copy costs one memcpy of the tensors each way.

    Collectives: allreduce (SUM, AVG, MIN, MAX, PRODUCT, ...; AVG is a SUM divided by the
    group's size), allreduce_coalesced, broadcast, allgather, ``_allgather_base``
    (all_gather_into_tensor), allgather_into_tensor_coalesced, reduce_scatter,
    ``_reduce_scatter_base`` (reduce_scatter_tensor), reduce_scatter_tensor_coalesced,
    alltoall_base (all_to_all_single), send, recv and barrier.

    Args:
        timeout: bound on configure (store connection and rendezvous) and on each operation
            (a ``timedelta``, or seconds).
        pg: a ready ``torch.distributed`` process group (or Gloo backend) to use until the
            first :meth:`configure` replaces it, as torchft's ``pg=`` argument; None (the
            default) starts unconfigured.
    """

    def __init__(self, timeout: timedelta | float = DEFAULT_TIMEOUT, pg: Any = None) -> None:
        super().__init__(timeout)
        self._backend: _Backend | None = None
        if pg is not None:
            if isinstance(pg, ProcessGroup):
                raise TypeError(
                    f"ProcessGroupGloo(pg=...) takes a torch.distributed process group, not ftclient's "
                    f"{type(pg).__name__}: use that group directly (it is reconfigurable itself)"
                )
            self._backend = _Backend(pg)
            self._rank, self._world_size = pg.rank(), pg.size()
        self._replica_id: str | None = None
        self._error_lock = threading.Lock()
        self._generation = 0  # errors of works from an older configure are not recorded
        self._aborted: Exception | None = None  # set by abort() until the next configure
        self._pending: set[_DeadlineWork] = set()  # this configuration's unsettled works
        self._building: _Build | None = None  # the configure in progress

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
        self._release_backend()
        building = _Build()
        with self._error_lock:
            self._generation += 1
            self._error = None
            self._aborted = None
            self._pending = set()
            self._building = building
        self._replica_id = replica_id
        self._quorum_id = quorum_id
        start = time.monotonic()
        try:
            backend = building.run(lambda: dist.ProcessGroupGloo(create_store_client(store_addr, self._timeout),
                                                                 rank, world_size, self._timeout))
        except _BuildAborted as e:
            raise RuntimeError(
                f"building the Gloo group on {store_addr!r} (rank {rank} of {world_size}, quorum {quorum_id}) "
                f"was aborted after {time.monotonic() - start:.1f}s: {e.error}"
            ) from e.error
        except ConnectionError:
            raise
        except Exception as e:
            raise RuntimeError(
                f"building the Gloo group on {store_addr!r} (rank {rank} of {world_size}, "
                f"quorum {quorum_id}) failed after {time.monotonic() - start:.1f}s: {e}. "
                "Some member of the quorum did not join in time."
            ) from e
        finally:
            with self._error_lock:
                if self._building is building:
                    self._building = None
        self._backend = _Backend(backend)
        self._rank = rank
        self._world_size = world_size
        logger.info(
            "configured gloo group: store=%s rank=%d world_size=%d quorum_id=%s",
            store_addr,
            rank,
            world_size,
            quorum_id,
        )

    def _release_backend(self) -> None:
        backend, self._backend = self._backend, None
        self._world_size = None
        if backend is not None:
            backend.release()

    def shutdown(self) -> None:
        self._release_backend()

    def __del__(self) -> None:
        # The garbage collector may run this on one of Gloo's own threads: _Backend.release then
        # hands the group to the reaper (as it does a busy group) rather than letting its
        # destructor join the thread it runs on.
        try:
            self._release_backend()
        except Exception:
            pass

    # state (rank, size, errored, set_timeout, repr: QuorumConfiguredGroup) -------------------

    def getBackendName(self) -> str:
        return "ftclient-gloo"

    def _error_recorder(self) -> Callable[[Exception], None]:
        generation = self._generation

        def record(e: Exception) -> None:
            with self._error_lock:
                if self._generation == generation and self._error is None:
                    self._error = e
            logger.warning("process group operation failed: %s", e)

        return record

    def abort(self, error: Exception | None = None) -> None:
        """See :meth:`ProcessGroup.abort`. Safe against a racing completion: each operation is
        settled once, by whichever of completion, timeout or abort comes first. A
        :meth:`configure` in progress (waiting in the rendezvous for a member that died) raises
        at once. :meth:`errored` reports the error once an operation failed because of it: an
        abort after every operation completed fails nothing."""
        error = error if error is not None else RuntimeError("process group aborted")
        with self._error_lock:
            if self._aborted is None:
                self._aborted = error
            pending, self._pending = list(self._pending), set()
            building = self._building
        if building is not None:
            building.abort(error)
        aborted = sum(work.abort(error) for work in pending)
        logger.warning("process group aborted (quorum %s, %d operation(s) in flight failed): %s",
                       self._quorum_id, aborted, error)

    def _require_backend(self, op_name: str) -> _Backend:
        backend = self._backend
        if backend is None or backend.pg is None:
            raise RuntimeError(
                f"ProcessGroupGloo.{op_name} called before configure() (or after shutdown()); "
                "the Manager configures the group when it gets a quorum"
            )
        return backend

    def _run(
        self,
        op_name: str,
        launch: Callable[[dist.ProcessGroupGloo], dist._Work],
        result: object,
        post: Callable[[], None] | None = None,
    ) -> dist._Work:
        backend = self._require_backend(op_name)
        pg = backend.pg
        assert pg is not None
        record = self._error_recorder()
        aborted = self._aborted
        if aborted is not None:
            record(aborted)
            fut: Future[Any] = Future()
            fut.set_exception(RuntimeError(f"{op_name} not started: the process group was aborted ({aborted})"))
            return _FutureWork(fut)
        backend.op_started()
        try:
            inner = launch(pg)
        except Exception as e:
            backend.op_finished()
            record(e)
            raise
        generation = self._generation
        work = _DeadlineWork(
            inner, result, op_name, self._timeout, record, post, on_inner_done=backend.op_finished,
            on_settled=self._settled,
        )
        with self._error_lock:
            if self._generation == generation and not work.settled:
                self._pending.add(work)
            abort_now = self._aborted if self._generation == generation else None
        if abort_now is not None:  # aborted while launching
            work.abort(abort_now)
        return work

    def _settled(self, work: _DeadlineWork) -> None:
        with self._error_lock:
            self._pending.discard(work)

    # collectives ----------------------------------------------------------------------------
    #
    # Every operation runs on staged copies of its tensors: Gloo reads the staged inputs and
    # writes the staged outputs, which are copied into the caller's tensors only if the
    # operation settles by completing (see the class docstring).

    def _avg_divisor(self, op: ReduceOp, tensors: list[torch.Tensor]) -> tuple[ReduceOp, int | None]:
        """Gloo has no AVG: it becomes a SUM divided by the group's size afterwards."""
        if not _same_op(op, ReduceOp.AVG):
            return op, None
        if not all(torch.is_floating_point(t) for t in tensors):
            raise ValueError("ReduceOp.AVG needs floating point tensors")
        return ReduceOp(ReduceOp.SUM), self.size()

    def _staged_run(self, op_name: str, launch: Callable[..., Any], outputs: list[torch.Tensor],
                    staged_outputs: list[torch.Tensor], result: object,
                    divide_by: int | None = None) -> dist._Work:
        def post() -> None:
            for t, staged in zip(outputs, staged_outputs):
                if divide_by is not None:
                    staged.div_(divide_by)
                t.copy_(staged)

        return self._run(op_name, launch, result, post)

    def _options(self, kind: Callable[[], Any], op: ReduceOp | None = None) -> Any:
        opts = kind()
        if op is not None:
            opts.reduceOp = op
        opts.timeout = self._timeout
        return opts

    def allreduce(self, tensors: list[torch.Tensor], opts: object = ReduceOp.SUM) -> dist._Work:
        op, divide_by = self._avg_divisor(_reduce_op(opts), tensors)
        staged = _clones(tensors)
        gloo_opts = self._options(AllreduceOptions, op)
        return self._staged_run("allreduce", lambda b: b.allreduce(staged, gloo_opts), tensors, staged,
                                tensors, divide_by)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: object = ReduceOp.SUM) -> dist._Work:
        """Reduce every tensor of ``tensors`` in place in one Gloo operation (AVG: a SUM
        divided by the group's size)."""
        op, divide_by = self._avg_divisor(_reduce_op(opts), tensors)
        staged = _clones(tensors)
        gloo_opts = self._options(AllreduceCoalescedOptions, op)
        return self._staged_run("allreduce_coalesced", lambda b: b.allreduce_coalesced(staged, gloo_opts),
                                tensors, staged, tensors, divide_by)

    def broadcast(self, tensors: list[torch.Tensor], opts: object = 0) -> dist._Work:
        """Broadcast ``tensors`` from ``opts`` (a root rank or BroadcastOptions)."""
        gloo_opts = self._options(BroadcastOptions)
        gloo_opts.rootRank = int(opts.rootRank) if isinstance(opts, BroadcastOptions) else int(opts)  # type: ignore[call-overload]
        staged = _clones(tensors)
        return self._staged_run("broadcast", lambda b: b.broadcast(staged, gloo_opts), tensors, staged, tensors)

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: object = None,
    ) -> dist._Work:
        """Gather ``input_tensors`` from every member into ``output_tensors``."""
        staged_out = [[torch.empty_like(t) for t in outs] for outs in output_tensors]
        staged_in = _clones(input_tensors)
        gloo_opts = self._options(AllgatherOptions)
        return self._staged_run(
            "allgather", lambda b: b.allgather(staged_out, staged_in, gloo_opts),
            [t for outs in output_tensors for t in outs], [t for outs in staged_out for t in outs],
            output_tensors,
        )

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: object = None) -> dist._Work:
        """Gather every member's ``input`` into ``output`` in rank order."""
        return self.allgather_into_tensor_coalesced([output], [input], opts, op_name="_allgather_base")

    def allgather_into_tensor_coalesced(self, output_tensors: list[torch.Tensor],
                                        input_tensors: list[torch.Tensor], opts: object = None,
                                        op_name: str = "allgather_into_tensor_coalesced") -> dist._Work:
        """``_allgather_base`` for each (output, input) pair, as one operation (Gloo runs them
        one after the other)."""
        staged_out = [torch.empty_like(t) for t in output_tensors]
        staged_in = _clones(input_tensors)

        def launch(b: Any) -> list[dist._Work]:
            return [b._allgather_base(o, i, self._options(AllgatherOptions)) for o, i in zip(staged_out, staged_in)]

        return self._staged_run(op_name, launch, output_tensors, staged_out, output_tensors)

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: object = ReduceOp.SUM) -> dist._Work:
        """Reduce ``input_tensors[i]`` across the group; member r gets part r in
        ``output_tensors[i]`` (AVG: a SUM divided by the group's size)."""
        op, divide_by = self._avg_divisor(_reduce_op(opts), output_tensors)
        staged_out = [torch.empty_like(t) for t in output_tensors]
        staged_in = [_clones(parts) for parts in input_tensors]
        gloo_opts = self._options(ReduceScatterOptions, op)
        return self._staged_run("reduce_scatter", lambda b: b.reduce_scatter(staged_out, staged_in, gloo_opts),
                                output_tensors, staged_out, output_tensors, divide_by)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor,
                             opts: object = ReduceOp.SUM) -> dist._Work:
        """Reduce ``input`` across the group; this member's chunk (rank order) goes to ``output``."""
        return self.reduce_scatter_tensor_coalesced([output], [input], opts, op_name="_reduce_scatter_base")

    def reduce_scatter_tensor_coalesced(self, output_tensors: list[torch.Tensor],
                                        input_tensors: list[torch.Tensor], opts: object = ReduceOp.SUM,
                                        op_name: str = "reduce_scatter_tensor_coalesced") -> dist._Work:
        """``_reduce_scatter_base`` for each (output, input) pair, as one operation."""
        op, divide_by = self._avg_divisor(_reduce_op(opts), output_tensors)
        staged_out = [torch.empty_like(t) for t in output_tensors]
        staged_in = _clones(input_tensors)

        def launch(b: Any) -> list[dist._Work]:
            return [b._reduce_scatter_base(o, i, self._options(ReduceScatterOptions, op))
                    for o, i in zip(staged_out, staged_in)]

        return self._staged_run(op_name, launch, output_tensors, staged_out, output_tensors, divide_by)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: object = None) -> dist._Work:
        """Send ``input``'s chunks to the members, receive theirs into ``output`` (empty split
        sizes: equal chunks)."""
        staged_out, staged_in = torch.empty_like(output), input.detach().clone()
        gloo_opts = self._options(AllToAllOptions)
        return self._staged_run(
            "alltoall_base",
            lambda b: b.alltoall_base(staged_out, staged_in, list(output_split_sizes), list(input_split_sizes),
                                      gloo_opts),
            [output], [staged_out], [output],
        )

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int = 0) -> dist._Work:
        """Send ``tensors`` to member ``dst_rank`` (a copy: the caller may reuse them at once)."""
        staged = _clones(tensors)
        return self._run("send", lambda b: b.send(staged, dst_rank, tag), tensors)

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int = 0) -> dist._Work:
        """Receive into ``tensors`` from member ``src_rank``."""
        staged = [torch.empty_like(t) for t in tensors]
        return self._staged_run("recv", lambda b: b.recv(staged, src_rank, tag), tensors, staged, tensors)

    def barrier(self, opts: object = None) -> dist._Work:
        """Wait until every member reached the barrier."""
        gloo_opts = self._options(BarrierOptions)
        return self._run("barrier", lambda b: b.barrier(gloo_opts), None)


def _clones(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


class ProcessGroupDummy(ProcessGroup):
    """A single-rank process group that completes every operation at once without moving
    data (outputs of gathers are copies of the inputs). :mod:`ftclient.ddp` gives it to torch
    DDP so DDP's start-up collectives are no-ops; the real communication goes through the
    Manager."""

    def __init__(self, rank: int = 0, world: int = 1) -> None:
        super().__init__()
        if (rank, world) != (0, 1):
            raise ValueError(f"ProcessGroupDummy is single-rank: need rank=0, world=1, got {rank}, {world}")
        self.configure_count = 0

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
        self.configure_count += 1

    def allreduce(self, tensors: list[torch.Tensor], opts: object = None) -> dist._Work:
        return _DummyWork(tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: object = None) -> dist._Work:
        return _DummyWork(tensors)

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: object = None,
    ) -> dist._Work:
        for out, inp in zip(output_tensors[0], input_tensors):
            out.copy_(inp)
        return _DummyWork(output_tensors)

    def _allgather_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: object = None
    ) -> dist._Work:
        output.copy_(input)
        return _DummyWork([output])

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: object = None) -> dist._Work:
        return _DummyWork(tensors)

    def allgather_into_tensor_coalesced(self, output_tensors: list[torch.Tensor],
                                        input_tensors: list[torch.Tensor], opts: object = None) -> dist._Work:
        for out, inp in zip(output_tensors, input_tensors):
            out.copy_(inp)
        return _DummyWork(output_tensors)

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: object = None) -> dist._Work:
        for out, parts in zip(output_tensors, input_tensors):
            out.copy_(parts[0])
        return _DummyWork(output_tensors)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: object = None) -> dist._Work:
        output.copy_(input)
        return _DummyWork([output])

    def reduce_scatter_tensor_coalesced(self, output_tensors: list[torch.Tensor],
                                        input_tensors: list[torch.Tensor], opts: object = None) -> dist._Work:
        for out, inp in zip(output_tensors, input_tensors):
            out.copy_(inp)
        return _DummyWork(output_tensors)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: object = None) -> dist._Work:
        output.copy_(input)
        return _DummyWork([output])

    def barrier(self, opts: object = None) -> dist._Work:
        return _DummyWork(None)

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0

    def getBackendName(self) -> str:
        return "ftclient-dummy"


class _ErrorSwallowingWork(dist._Work):
    def __init__(
        self, pg: ErrorSwallowingProcessGroupWrapper, inner: dist._Work, default: object
    ) -> None:
        super().__init__()
        self._pg = pg
        self._inner = inner
        self._default = default

    def wait(self, timeout: timedelta | None = None) -> bool:
        try:
            # torch's native works reject timeout=None
            self._inner.wait() if timeout is None else self._inner.wait(timeout)
        except Exception as e:
            self._pg.report_error(e)
        return True

    def get_future(self) -> Future[Any]:
        default, pg = self._default, self._pg

        def swallow(f: Future[Any]) -> object:
            try:
                return f.value()
            except Exception as e:
                pg.report_error(e)
                return default

        return self._inner.get_future().then(swallow)


class ErrorSwallowingProcessGroupWrapper(ProcessGroup):
    """Wraps a process group so collectives never raise to the caller.

    The first error (raised at launch, by ``wait`` or through the future) is recorded; the
    failed work completes with its input tensors (their contents are then undefined and must
    not be committed), and every later operation returns already-completed dummy work without
    communicating, until :meth:`configure` clears the error. :meth:`errored` exposes the error
    so the Manager can vote against committing the step.

    Args:
        pg: the process group to wrap (e.g. :class:`ProcessGroupGloo`).
    """

    def __init__(self, pg: ProcessGroup) -> None:
        super().__init__()
        self._pg = pg
        self._error: Exception | None = None
        self._aborted: Exception | None = None
        self._lock = threading.Lock()

    @property
    def parent(self) -> ProcessGroup:
        """The wrapped process group."""
        return self._pg

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
        with self._lock:
            self._error = None
            self._aborted = None
        try:
            self._pg.configure(
                store_addr,
                replica_id,
                rank,
                world_size,
                quorum_id,
                group_rank,
                group_world_size,
                global_ranks,
            )
        except Exception as e:
            self.report_error(e)
            raise

    def report_error(self, e: Exception) -> None:
        """Record ``e`` (the first error wins) and skip operations until the next configure."""
        with self._lock:
            if self._error is None:
                self._error = e
                logger.warning("swallowed process group error: %s", e)

    def abort(self, error: Exception | None = None) -> None:
        """Abort the wrapped group's pending operations (their works complete with their inputs
        and record the error); later operations are skipped, recording ``error``, until the
        next configure."""
        error = error if error is not None else RuntimeError("process group aborted")
        with self._lock:
            self._aborted = error
        abort_process_group(self._pg, error)

    def errored(self) -> Exception | None:
        return self._error or self._pg.errored()

    def error(self) -> Exception | None:
        """The recorded error (torchft's name for :meth:`errored`)."""
        return self.errored()

    def _swallow(self, launch: Callable[[], dist._Work], default: object) -> dist._Work:
        if self._aborted is not None:
            self.report_error(self._aborted)
        if self.errored() is not None:
            return _DummyWork(default)
        try:
            inner = launch()
        except Exception as e:
            self.report_error(e)
            return _DummyWork(default)
        return _ErrorSwallowingWork(self, inner, default)

    def allreduce(self, tensors: list[torch.Tensor], opts: object = ReduceOp.SUM) -> dist._Work:
        return self._swallow(lambda: self._pg.allreduce(tensors, opts), tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: object = 0) -> dist._Work:
        return self._swallow(lambda: self._pg.broadcast(tensors, opts), tensors)

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: object = None,
    ) -> dist._Work:
        return self._swallow(
            lambda: self._pg.allgather(output_tensors, input_tensors, opts), output_tensors
        )

    def barrier(self, opts: object = None) -> dist._Work:
        return self._swallow(lambda: self._pg.barrier(opts), None)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: object = ReduceOp.SUM) -> dist._Work:
        return self._swallow(lambda: self._pg.allreduce_coalesced(tensors, opts), tensors)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: object = None) -> dist._Work:
        return self._swallow(lambda: self._pg._allgather_base(output, input, opts), [output])

    def allgather_into_tensor_coalesced(self, output_tensors: list[torch.Tensor],
                                        input_tensors: list[torch.Tensor], opts: object = None) -> dist._Work:
        return self._swallow(
            lambda: self._pg.allgather_into_tensor_coalesced(output_tensors, input_tensors, opts), output_tensors)

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: object = ReduceOp.SUM) -> dist._Work:
        return self._swallow(lambda: self._pg.reduce_scatter(output_tensors, input_tensors, opts), output_tensors)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor,
                             opts: object = ReduceOp.SUM) -> dist._Work:
        return self._swallow(lambda: self._pg._reduce_scatter_base(output, input, opts), [output])

    def reduce_scatter_tensor_coalesced(self, output_tensors: list[torch.Tensor],
                                        input_tensors: list[torch.Tensor], opts: object = ReduceOp.SUM) -> dist._Work:
        return self._swallow(
            lambda: self._pg.reduce_scatter_tensor_coalesced(output_tensors, input_tensors, opts), output_tensors)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: object = None) -> dist._Work:
        return self._swallow(
            lambda: self._pg.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts), [output])

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int = 0) -> dist._Work:
        return self._swallow(lambda: self._pg.send(tensors, dst_rank, tag), tensors)

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int = 0) -> dist._Work:
        return self._swallow(lambda: self._pg.recv(tensors, src_rank, tag), tensors)

    def size(self) -> int:
        return self._pg.size()

    def rank(self) -> int:
        return self._pg.rank()

    def shutdown(self) -> None:
        self._pg.shutdown()

    def set_timeout(self, timeout: timedelta) -> None:
        self._pg.set_timeout(timeout)

    def getBackendName(self) -> str:
        return self._pg.getBackendName()

    def __repr__(self) -> str:
        return f"ErrorSwallowingProcessGroupWrapper(pg={self._pg!r})"


class _ManagerLike(Protocol):
    def allreduce(self, tensor: torch.Tensor, **kwargs: Any) -> Any: ...

    def num_participants(self) -> int: ...


def as_future(result: object) -> Future[Any]:
    """The future of a Manager allreduce result: the Future itself, or a Work's future."""
    # torch._C.Future is the base of torch.futures.Future and what Future.then() returns.
    if isinstance(result, torch._C.Future):
        return result  # type: ignore[return-value]
    get_future = getattr(result, "get_future", None)
    if get_future is None:
        raise TypeError(
            f"manager.allreduce returned {type(result).__name__}; expected a "
            "torch.futures.Future (or a Work with get_future())"
        )
    return get_future()


class _ManagerWork(dist._Work):
    """The Manager's allreduce work as :class:`ManagedProcessGroup` hands it to torch: the
    Manager's own (its stream handling kept), except that a zero ``wait`` timeout means none,
    as torch's C++ side means it (``kNoTimeout``) when a functional collective waits."""

    def __init__(self, work: dist._Work) -> None:
        super().__init__()
        self._work = work

    def wait(self, timeout: timedelta | None = None) -> bool:
        if timeout is None or timeout <= timedelta(0):
            return bool(self._work.wait())
        return bool(self._work.wait(timeout))

    def get_future(self) -> Future[Any]:
        return self._work.get_future()

    def block_current_stream(self, timeout: timedelta | None = None) -> None:
        block = getattr(self._work, "block_current_stream", None)
        if block is None:
            self.wait(timeout)
        elif timeout is None or timeout <= timedelta(0):
            block()
        else:
            block(timeout)

    def synchronize(self) -> None:
        synchronize = getattr(self._work, "synchronize", None)
        if synchronize is None:
            self.wait()
        else:
            synchronize()


class ManagedProcessGroup(ProcessGroup):
    """A process group whose collectives go through a Manager (torchft's ``ManagedProcessGroup``;
    torchtitan registers one as ``"dp_replicate"`` for HSDP).

    ``allreduce([t], op)`` calls ``manager.allreduce(t)`` for ``ReduceOp.AVG`` and
    ``manager.allreduce(t, reduce_op=op)`` for any other op, so errors are handled (recorded,
    never raised) by the Manager and averages use the number of participants. :meth:`size` is
    the Manager's ``num_participants()``, which changes from quorum to quorum.

    Every other collective (allgather, ``_allgather_base``, broadcast, reduce_scatter,
    ``_reduce_scatter_base``, the coalesced ones, alltoall_base, send, recv, barrier) is passed
    through to the Manager's own process group (``manager._pg``, reconfigured on every quorum)
    once the step's quorum is ready. Its ranks are those of that group (every member of the
    quorum, a healing group included; :meth:`rank` is this group's), which equal the
    participants' in a steady state. Failures are handled the Manager's way too: recorded
    through ``manager.report_error`` (the step will not commit) and never raised; the work then
    completes with the caller's tensors untouched, and once the step has an error further
    collectives return at once without communicating. The Manager owns reconfiguration, so
    :meth:`configure` is refused.

    Args:
        manager: the Manager of this replica group.
    """

    def __init__(self, manager: _ManagerLike) -> None:
        super().__init__()
        self._manager = manager

    @property
    def parent(self) -> Any:
        """The Manager's process group (torchft's ``ProcessGroupWrapper.parent``)."""
        pg = getattr(self._manager, "_pg", None)
        if pg is None:
            raise RuntimeError(f"{self._manager!r} has no process group (_pg) to pass collectives to")
        return pg

    def configure(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "ManagedProcessGroup is reconfigured by its Manager on every quorum; "
            "call manager.start_quorum() instead of configure()"
        )

    def allreduce(self, tensors: list[torch.Tensor], opts: object = ReduceOp.AVG) -> dist._Work:
        if len(tensors) != 1:
            raise ValueError(
                f"ManagedProcessGroup.allreduce takes exactly one tensor, got {len(tensors)}"
            )
        op = _reduce_op(opts)
        if _same_op(op, ReduceOp.AVG):
            result = self._manager.allreduce(tensors[0])
        else:
            result = self._manager.allreduce(tensors[0], reduce_op=op)
        if isinstance(result, dist._Work):
            return _ManagerWork(result)
        return _FutureWork(as_future(result))

    def _errored(self) -> bool:
        """Whether the step's collectives are no-ops: ftclient's Manager says so apart from its
        ``errored()`` (a failed recovery fails the step, but the rank still takes part in its
        collectives, so that no peer waits for it); another manager by ``errored()``."""
        errored = getattr(self._manager, "_collectives_errored", None) or getattr(self._manager, "errored", None)
        return errored is not None and errored() is not None

    def _pass(self, op_name: str, launch: Callable[[Any], dist._Work], default: object) -> dist._Work:
        """Run ``launch(manager's pg)`` for the current step; failures go to the Manager."""
        manager = self._manager
        if self._errored():
            return _DummyWork(default)
        wait_quorum = getattr(manager, "wait_quorum", None)
        if wait_quorum is not None:
            wait_quorum()  # the group is configured for this step's quorum
            if self._errored():
                return _DummyWork(default)
        report = getattr(manager, "report_error", None)
        try:
            work = launch(self.parent)
        except Exception as e:
            if report is None:
                raise
            logger.warning("ManagedProcessGroup.%s failed: %s", op_name, e)
            report(e)
            return _DummyWork(default)
        wrap_future = getattr(manager, "wrap_future", None)
        if wrap_future is None:
            return work
        return _FutureWork(wrap_future(work.get_future(), default))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: object = ReduceOp.SUM) -> dist._Work:
        """Passed through as it is: an AVG here divides by the process group's size, not by
        the participants (use :meth:`allreduce` for the Manager's average)."""
        return self._pass("allreduce_coalesced", lambda pg: pg.allreduce_coalesced(tensors, opts), tensors)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: object = None) -> dist._Work:
        return self._pass("allgather", lambda pg: pg.allgather(output_tensors, input_tensors, opts),
                          output_tensors)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: object = None) -> dist._Work:
        return self._pass("_allgather_base", lambda pg: pg._allgather_base(output, input, opts), [output])

    def allgather_into_tensor_coalesced(self, output_tensors: list[torch.Tensor],
                                        input_tensors: list[torch.Tensor], opts: object = None) -> dist._Work:
        return self._pass("allgather_into_tensor_coalesced",
                          lambda pg: pg.allgather_into_tensor_coalesced(output_tensors, input_tensors, opts),
                          output_tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: object = 0) -> dist._Work:
        return self._pass("broadcast", lambda pg: pg.broadcast(tensors, opts), tensors)

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: object = ReduceOp.SUM) -> dist._Work:
        return self._pass("reduce_scatter", lambda pg: pg.reduce_scatter(output_tensors, input_tensors, opts),
                          output_tensors)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor,
                             opts: object = ReduceOp.SUM) -> dist._Work:
        return self._pass("_reduce_scatter_base", lambda pg: pg._reduce_scatter_base(output, input, opts),
                          [output])

    def reduce_scatter_tensor_coalesced(self, output_tensors: list[torch.Tensor],
                                        input_tensors: list[torch.Tensor], opts: object = ReduceOp.SUM) -> dist._Work:
        return self._pass("reduce_scatter_tensor_coalesced",
                          lambda pg: pg.reduce_scatter_tensor_coalesced(output_tensors, input_tensors, opts),
                          output_tensors)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: object = None) -> dist._Work:
        return self._pass(
            "alltoall_base",
            lambda pg: pg.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts), [output])

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int = 0) -> dist._Work:
        return self._pass("send", lambda pg: pg.send(tensors, dst_rank, tag), tensors)

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int = 0) -> dist._Work:
        return self._pass("recv", lambda pg: pg.recv(tensors, src_rank, tag), tensors)

    def barrier(self, opts: object = None) -> dist._Work:
        return self._pass("barrier", lambda pg: pg.barrier(opts), None)

    def size(self) -> int:
        return self._manager.num_participants()

    def rank(self) -> int:
        """This replica group's rank in the Manager's process group (0 before its first
        quorum, as torchft's always answers)."""
        try:
            return int(self.parent.rank())
        except Exception:  # noqa: BLE001 -- not configured yet
            return 0

    def errored(self) -> Exception | None:
        errored = getattr(self._manager, "errored", None)
        return errored() if errored is not None else None

    def getBackendName(self) -> str:
        return "ftclient-managed"

    def __repr__(self) -> str:
        return f"ManagedProcessGroup(manager={self._manager!r})"
