"""Reconfigurable, fault-tolerant process groups (ftclient's counterpart of torchft.process_group).

This module owns the collective-communication layer a replica group uses to talk to the other
replica groups of the quorum:

- :class:`ProcessGroup`: the reconfigurable process-group API the Manager drives
  (``configure`` on every new quorum, ``allreduce``, ``size``, ``errored``, ``abort``,
  ``shutdown``).
- :class:`ProcessGroupGloo`: a fresh torch Gloo process group per quorum, rendezvoused over a
  TCPStore client + PrefixStore built from ``"host:port/prefix"``. Every operation carries a
  deadline: its work and future fail with :class:`TimeoutError` once the configured timeout has
  passed, even when Gloo itself is stuck, and ``abort`` fails them at once (a peer died).
- :class:`ErrorSwallowingProcessGroupWrapper`: records the first error and returns completed
  dummy work afterwards, so model code never sees a failure; the error surfaces through
  ``errored()`` (the Manager votes against committing) and is cleared by ``configure``.
- :class:`ManagedProcessGroup`: a process group whose allreduce goes through a Manager
  (``manager.allreduce``) and whose size is the number of quorum participants.
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
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist
from torch.distributed import AllreduceOptions, BroadcastOptions, ReduceOp
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
    then (the future itself is left alone)."""
    if timeout is None:
        fut.wait()
        return
    done = threading.Event()
    fut.add_done_callback(lambda _: done.set())
    if not done.wait(max(timeout.total_seconds(), 0.0)):
        raise TimeoutError(f"work not completed within wait(timeout={timeout.total_seconds():g}s)")


class _DeadlineWork(dist._Work):
    """Wraps a Gloo work: its future completes with the Gloo result, or fails with the Gloo
    error, or fails with TimeoutError when the deadline passes first, or fails with the error
    given to :meth:`abort`. Whichever comes first settles it; the others are no-ops. Errors are
    reported to ``on_error`` (the owning process group's error record).

    ``post`` (e.g. copying a staged result into the caller's tensors) runs under the same lock
    that settles the work, only when the Gloo work completed first: once a timeout or an abort
    settled the work, a late completion never touches the caller's tensors."""

    def __init__(
        self,
        inner: dist._Work,
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

        def inner_done(f: Future[Any]) -> None:
            try:
                try:
                    f.value()
                except Exception as e:
                    self._finish(RuntimeError(f"{op_name} failed: {e}"))
                    return
                self._finish(None, result, post)
            finally:
                if on_inner_done is not None:
                    on_inner_done()

        # Registered last: the inner future may already be complete and call back at once.
        inner.get_future().add_done_callback(inner_done)

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
    """The ReduceOp of ``opts``: a ReduceOp, a ReduceOp.RedOpType or AllreduceOptions."""
    if isinstance(opts, AllreduceOptions):
        return opts.reduceOp
    if isinstance(opts, ReduceOp):
        return opts
    if isinstance(opts, ReduceOp.RedOpType):
        return ReduceOp(opts)
    if opts is None:
        return ReduceOp.SUM
    raise TypeError(f"allreduce expects a ReduceOp or AllreduceOptions, got {type(opts).__name__}")


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


class ProcessGroup(dist.ProcessGroup):
    """Base of ftclient's process groups: a ``torch.distributed.ProcessGroup`` that can be
    reconfigured (new store prefix, rank and world size) on every quorum.

    Subclasses implement :meth:`configure`, :meth:`allreduce` and :meth:`size`.
    """

    def __init__(self) -> None:
        super().__init__(0, 1)  # torch's static rank/size are unused; see size()

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
        if self.idle.is_set():
            self.pg = None  # destroyed here: nothing to wait for
        else:
            _REAPER.retire(self)


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


class ProcessGroupGloo(ProcessGroup):
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

    Args:
        timeout: bound on configure (store connection and rendezvous) and on each operation.
    """

    def __init__(self, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        super().__init__()
        self._timeout = timeout
        self._backend: _Backend | None = None
        self._world_size: int | None = None
        self._rank: int | None = None
        self._quorum_id: int | None = None
        self._replica_id: str | None = None
        self._error: Exception | None = None
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
        # Hand a busy group to the reaper rather than letting the last reference to it drop in
        # one of Gloo's own threads (whose destructor would then join itself).
        try:
            self._release_backend()
        except Exception:
            pass

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    # state ----------------------------------------------------------------------------------

    def size(self) -> int:
        if self._world_size is None:
            raise RuntimeError("ProcessGroupGloo.size() called before configure()")
        return self._world_size

    def rank(self) -> int:
        if self._rank is None:
            raise RuntimeError("ProcessGroupGloo.rank() called before configure()")
        return self._rank

    def errored(self) -> Exception | None:
        return self._error

    def getBackendName(self) -> str:
        return "ftclient-gloo"

    def __repr__(self) -> str:
        return (
            f"ProcessGroupGloo(rank={self._rank}, world_size={self._world_size}, "
            f"quorum_id={self._quorum_id}, timeout={self._timeout.total_seconds():g}s)"
        )

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

    def allreduce(self, tensors: list[torch.Tensor], opts: object = ReduceOp.SUM) -> dist._Work:
        op = _reduce_op(opts)
        divide_by: int | None = None
        if _same_op(op, ReduceOp.AVG):  # Gloo has no AVG: sum, then divide
            if not all(torch.is_floating_point(t) for t in tensors):
                raise ValueError("ReduceOp.AVG needs floating point tensors")
            op = ReduceOp(ReduceOp.SUM)
            divide_by = self.size()
        # Gloo reduces a staged copy; the result is copied back only if the operation settles by
        # completing (see the class docstring).
        staged = [t.detach().clone() for t in tensors]

        def post() -> None:
            for t, s in zip(tensors, staged):
                if divide_by is not None:
                    s.div_(divide_by)
                t.copy_(s)

        gloo_opts = AllreduceOptions()
        gloo_opts.reduceOp = op
        gloo_opts.timeout = self._timeout
        return self._run("allreduce", lambda b: b.allreduce(staged, gloo_opts), tensors, post)

    def broadcast(self, tensors: list[torch.Tensor], opts: object = 0) -> dist._Work:
        """Broadcast ``tensors`` from ``opts`` (a root rank or BroadcastOptions)."""
        if isinstance(opts, BroadcastOptions):
            gloo_opts = opts
        else:
            gloo_opts = BroadcastOptions()
            gloo_opts.rootRank = int(opts)  # type: ignore[call-overload]
        gloo_opts.timeout = self._timeout
        return self._run("broadcast", lambda b: b.broadcast(tensors, gloo_opts), tensors)

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: object = None,
    ) -> dist._Work:
        """Gather ``input_tensors`` from every member into ``output_tensors``."""
        return self._run(
            "allgather", lambda b: b.allgather(output_tensors, input_tensors), output_tensors
        )

    def barrier(self, opts: object = None) -> dist._Work:
        """Wait until every member reached the barrier."""
        return self._run("barrier", lambda b: b.barrier(), None)


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

    def size(self) -> int:
        return self._pg.size()

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


class ManagedProcessGroup(ProcessGroup):
    """A process group that sends allreduces through a Manager.

    ``allreduce([t], op)`` calls ``manager.allreduce(t)`` for ``ReduceOp.AVG`` and
    ``manager.allreduce(t, reduce_op=op)`` for any other op, so errors are handled (recorded,
    never raised) by the Manager and averages use the number of participants. :meth:`size` is
    the Manager's ``num_participants()``, which changes from quorum to quorum. The Manager
    owns reconfiguration, so :meth:`configure` is refused.

    Args:
        manager: the Manager of this replica group.
    """

    def __init__(self, manager: _ManagerLike) -> None:
        super().__init__()
        self._manager = manager

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
        return _FutureWork(as_future(result))

    def size(self) -> int:
        return self._manager.num_participants()

    def errored(self) -> Exception | None:
        errored = getattr(self._manager, "errored", None)
        return errored() if errored is not None else None

    def getBackendName(self) -> str:
        return "ftclient-managed"

    def __repr__(self) -> str:
        return f"ManagedProcessGroup(manager={self._manager!r})"

