"""The fault-tolerant training loop's coordinator: torchft's ``Manager``, on ftclient's manager
server and lighthouse client (leader discovery over a list of lighthouse endpoints).

Per step, every rank of every replica group:

1. ``start_quorum()`` (before the forward pass; asynchronous by default): asks its replica
   group's manager server for the quorum. On a new quorum id the process group is reconfigured
   on ``{store_address}/torchft/{quorum_id}/{group_rank}``; a group that is behind (or, with
   ``init_sync``, not the primary on step 0) fetches the checkpoint of ``max_step`` from its
   recovery source through the checkpoint transport, and up-to-date groups serve theirs.
2. ``allreduce(tensor)`` (gradients): returns a ``torch.distributed.Work`` (:class:`ManagedWork`:
   ``wait()``, ``get_future()``, ``synchronize()``, ``block_current_stream()``, as torchft's);
   never raises for a failed collective: the failure is recorded (``errored()``), ``wait()``
   returns False and the work's future resolves with the input tensor.
3. ``should_commit()`` (before ``optimizer.step()``): syncs the accelerator's current stream (and
   the recovery stream), then a barrier over the replica group that is True iff every rank has
   no error and enough replica groups participate. True advances the step; False counts a commit
   failure (reported to the lighthouse with the next quorum) and raises after ``max_retries``
   consecutive ones.

Healing (docs/ftclient.md). The state a healing group receives is the source's state dict of
``max_step``: with the asynchronous quorum, the training thread takes it at every step just
before its forward pass (its first module call after ``start_quorum()``, or its next Manager call
that waits for the quorum; the user's state dict functions return references, no copy), and the
quorum thread only serialises what was taken: a ``state_dict()`` called on the quorum thread
would run during the forward or backward pass, where FSDP2's state-dict hook swaps the module's
parameters under the running step (torchft 0.2.0 does that: "got mixed torch.Tensor and
DTensor", "data is not allocated yet"), and where collectives a state-dict hook runs over the
replica group (torchtitan's gather DTensors) interleave with the step's. With the synchronous
quorum the quorum thread calls it while the training thread waits in ``start_quorum()``, on every
rank of every group of a quorum in which a group recovers. A healing peer reads it before its
first collective of the step, so before ours completes, and ``should_commit()`` closes the
transport before the optimizer step mutates it. What a rank receives is applied only if every
rank of its replica group has its part: with the asynchronous quorum, in ``should_commit()`` once
the group commits (a rank whose transfer failed votes against it, yet takes part in the step's
collectives with zeros like any healing rank, so that no peer waits for it); with the synchronous
quorum, in ``start_quorum()`` after a vote of the group's ranks (the ShouldCommit barrier), before
the forward pass. Then the ranks of the group that do not heal (``init_sync`` on step 0 heals some
group ranks only) load their own state at the same point, for the collectives of a load hook.
Otherwise every rank drops what it received and keeps its step, batches and weights, and the
group heals at a later quorum: the ranks of a group always agree on the step and the weights.

Accelerators (CUDA, or any ``torch.accelerator``; everything below is a no-op without one): the
quorum thread sets the device that was current when ``start_quorum()`` was called; checkpoints
are sent and received on a dedicated recovery stream, which ``should_commit()`` (and a
synchronous quorum's healing) waits for before the recovered state is used; an allreduce's
work remembers the stream it was started on, and its result is ordered after the collective on
that stream (``wait()`` / ``block_current_stream()`` / ``synchronize()`` do not block the CPU
for a CUDA-aware process group such as NCCL).

Liveness (a lighthouse cluster with ``Watch``; :mod:`ftclient.liveness`): the manager server
keeps a liveness stream to the leader, and the leader pushes a notice when a member of a quorum
this replica group belongs to dies. A notice for the quorum of the current step fails that
quorum's collectives at once: those still in flight after ``ABORT_GRACE_S`` (100 ms, for those
that are completing) are aborted, with the error recorded (``should_commit()`` is False), and any
later one fails without starting; a rendezvous for that quorum's process group is abandoned. The next ``start_quorum()`` gets the next quorum
without waiting for any timeout. A step whose collectives had all completed before the notice
(the dead member's part is in them) may still commit. A notice for a quorum whose result has not
arrived yet is kept: should that quorum come back, its step fails the same way. A notice for an
older quorum is ignored. Group rank 0 receives the notices; it hands them to the group's other
ranks through the replica group's TCPStore (``ftclient/liveness/...`` keys).

The constructor takes torchft's arguments and environment variables (``TORCHFT_LIGHTHOUSE``,
``TORCHFT_MANAGER_PORT``, ``TORCHFT_TIMEOUT_SEC``, ``TORCHFT_QUORUM_TIMEOUT_SEC``,
``TORCHFT_CONNECT_TIMEOUT_SEC``, ``TORCHFT_QUORUM_RETRIES``; ``MASTER_ADDR``/``MASTER_PORT``,
``RANK``/``WORLD_SIZE`` for the replica group's TCPStore and rank), so a torchft script ports by
changing one import. ``lighthouse_addr``/``TORCHFT_LIGHTHOUSE`` may list every lighthouse node.

Jobs: a lighthouse cluster serves many training jobs. The replica group's job is the
``job`` argument, else ``LIGHTHOUSE_JOB``, else ``?job=NAME`` on the lighthouse URL(s), else the
default job (:mod:`ftclient.job_selection`); group rank 0's Quorum, Heartbeat and liveness calls
name it. :meth:`Manager.job_config` reads the job's configuration map from the cluster, on any
rank (rank 0 publishes the lighthouse address and job in the group's TCPStore).
"""

from __future__ import annotations

import inspect
import json
import logging
import socket
import threading
import traceback
import uuid
from concurrent.futures import Future as ConcurrentFuture
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from enum import Enum
from typing import Any, Callable, Iterator, TypeVar, cast

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp, TCPStore

from . import _env
from ._timeouts import WATCHDOG
from .checkpointing import HTTPTransport
from .lighthouse_client import LighthouseClient
from .liveness import DEFAULT_KEEPALIVE_INTERVAL, PeerDied, PeerDiedError
from .manager_server import LocalManagerClient, ManagerClient, ManagerServer
from .process_group import abort_process_group
from .quorum_results import QuorumResult

__all__ = ["ExceptionWithTraceback", "ManagedWork", "Manager", "WorldSizeMode"]

T = TypeVar("T")

MANAGER_ADDR_KEY = "manager_addr"
REPLICA_ID_KEY = "replica_id"
# Group rank 0's lighthouse address (as given) and job, for the other ranks' job_config().
LIGHTHOUSE_ADDR_KEY = "ftclient/lighthouse_addr"
JOB_KEY = "ftclient/job"
# Liveness notices from group rank 0 to the group's other ranks: ``NOTICE_SEQ_KEY`` counts them,
# ``{NOTICE_KEY}/{n}`` holds the n-th (JSON; ``NOTICE_WAKE`` wakes a watcher that is closing).
NOTICE_SEQ_KEY = "ftclient/liveness/seq"
NOTICE_KEY = "ftclient/liveness/notice"
NOTICE_WAKE = b"wake"
# After a liveness notice, how long collectives in flight may still complete on their own before
# they are aborted (see _peer_died).
ABORT_GRACE_S = 0.1


class _Accelerator:
    """The Manager's use of the accelerator (``torch.accelerator``: CUDA, XPU, ...). Every method
    is a no-op (or answers None / -1) when no accelerator is available, so the CPU path runs the
    same code. One instance, :data:`_ACCELERATOR`, which tests may replace."""

    def available(self) -> bool:
        accelerator = getattr(torch, "accelerator", None)
        return bool(accelerator is not None and accelerator.is_available())

    def current_device(self) -> int:
        """The calling thread's current device index, -1 without an accelerator."""
        return torch.accelerator.current_device_index() if self.available() else -1

    def set_device(self, index: int) -> None:
        """Make ``index`` the calling thread's device (the quorum thread's, for the process group
        and the checkpoint transport); nothing for a negative index."""
        if index >= 0 and self.available():
            torch.accelerator.set_device_index(index)

    def new_stream(self) -> Any | None:
        """A new stream on the current device (the recovery stream), None without an accelerator."""
        return torch.Stream() if self.available() else None

    def current_stream(self) -> Any | None:
        return torch.accelerator.current_stream() if self.available() else None

    def stream_context(self, stream: Any | None) -> Any:
        """``with`` this: ``stream`` is the current stream inside (nothing for None)."""
        return stream if stream is not None else nullcontext()

    def record_event(self) -> Any | None:
        """An event recorded on the current stream, None without an accelerator."""
        stream = self.current_stream()
        return stream.record_event() if stream is not None else None

    def wait_event(self, event: Any | None) -> None:
        """Order the current stream's next work after ``event`` (nothing for None)."""
        stream = self.current_stream()
        if event is not None and stream is not None:
            stream.wait_event(event)

    def synchronize(self) -> None:
        """Block until the current stream's queued work is done."""
        stream = self.current_stream()
        if stream is not None:
            stream.synchronize()


_ACCELERATOR = _Accelerator()


class WorldSizeMode(Enum):
    """How many replica groups a step averages over when more than ``min_replica_size`` are up.

    DYNAMIC: every participating replica group contributes; gradients are divided by their count.
    FIXED_WITH_SPARES: exactly ``min_replica_size`` groups contribute; the others are spares
    (they take part in the collectives with zeroed gradients).
    """

    DYNAMIC = 0
    FIXED_WITH_SPARES = 1


class ExceptionWithTraceback(Exception):
    """An error recorded by ``report_error``, with the traceback of where it was recorded."""

    def __init__(self, e: Exception) -> None:
        self.original_exception = e
        self.stack_trace: str = traceback.format_exc()
        super().__init__(f"{e}\n{self.stack_trace}")


class _ReadWriteLock:
    """Many readers or one writer; every wait bounded (``TimeoutError``)."""

    def __init__(self, timeout: float) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._timeout = timeout

    @contextmanager
    def read(self) -> Iterator[None]:
        with self._cond:
            if not self._cond.wait_for(lambda: not self._writer, self._timeout):
                raise TimeoutError(f"state_dict read not allowed within {self._timeout:g}s")
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    def acquire_write(self) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: not self._writer and self._readers == 0, self._timeout):
                raise TimeoutError(f"state_dict still being read after {self._timeout:g}s")
            self._writer = True

    def release_write(self) -> None:
        with self._cond:
            self._writer = False
            self._cond.notify_all()


def _default_checkpoint_transport(timeout: timedelta) -> HTTPTransport[Any]:
    return HTTPTransport(timeout=timeout, num_chunks=0)


def _required_env(value: Any, name: str, what: str, cast_fn: Callable[[str], Any] = str) -> Any:
    if value is not None:
        return value
    import os

    raw = os.environ.get(name)
    if raw is None or raw == "":
        raise ValueError(f"{what} not given: pass it to Manager(...) or set {name}")
    try:
        return cast_fn(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not valid for {what}") from None


class Manager:
    """torchft's ``Manager``: quorum, healing, fault-tolerant allreduce and commit for one rank
    of one replica group; see the module docstring.

    Args (as torchft's, same defaults):
        pg: the reconfigurable process group spanning replica groups (``configure``,
            ``allreduce``, ``errored``, ``shutdown``).
        load_state_dict / state_dict: the user's state, sent to and loaded by healing groups
            (registered as ``"default"``; more with ``register_state_dict_fn``).
        min_replica_size: fewest replica groups a step may commit with.
        use_async_quorum: run the quorum (and healing) in the background during the forward pass.
        timeout: collectives, should_commit, checkpoint transfer. ``TORCHFT_TIMEOUT_SEC`` wins.
        quorum_timeout: the quorum. ``TORCHFT_QUORUM_TIMEOUT_SEC`` wins.
        connect_timeout: connecting to the manager server, the store and the lighthouse.
            ``TORCHFT_CONNECT_TIMEOUT_SEC`` wins.
        rank / world_size: this rank within the replica group and the group's size
            (``RANK`` / ``WORLD_SIZE``).
        world_size_mode: see :class:`WorldSizeMode`.
        store_addr / store_port: the replica group's TCPStore (``MASTER_ADDR`` / ``MASTER_PORT``).
        lighthouse_addr: group rank 0 only: one URL or a comma-separated list
            (``TORCHFT_LIGHTHOUSE``).
        replica_id: group rank 0 only: this replica group's name (a uuid is appended);
            default ``REPLICA_GROUP_ID`` if set.
        port: group rank 0 only: manager server port (``TORCHFT_MANAGER_PORT``, else any).
        hostname: group rank 0 only: advertised to other replica groups.
        heartbeat_interval: lighthouse heartbeat period.
        checkpoint_transport: moves checkpoints between replica groups (default
            ``ftclient.checkpointing.HTTPTransport``).
        init_sync: on step 0, make every group load the primary's weights.
        max_retries: consecutive failed commits tolerated before ``should_commit`` raises.
        quorum_retries: extra lighthouse attempts per quorum (``TORCHFT_QUORUM_RETRIES`` wins).
        liveness_interval: group rank 0 only: keep-alive period of the liveness stream; None
            turns it off (unary heartbeats only). ``FTCLIENT_LIVENESS_INTERVAL_MS`` wins (0: off).
        job: group rank 0 only: the lighthouse job of this replica group (ftclient's own; None:
            ``LIGHTHOUSE_JOB``, else ``?job=NAME`` on the lighthouse URL, else the default job).
    """

    def __init__(
        self,
        pg: Any,
        load_state_dict: Callable[[Any], None] | None,
        state_dict: Callable[[], Any] | None,
        min_replica_size: int,
        use_async_quorum: bool = True,
        timeout: timedelta = timedelta(seconds=60),
        quorum_timeout: timedelta = timedelta(seconds=60),
        connect_timeout: timedelta = timedelta(seconds=60),
        rank: int | None = None,
        world_size: int | None = None,
        world_size_mode: WorldSizeMode = WorldSizeMode.DYNAMIC,
        store_addr: str | None = None,
        store_port: int | None = None,
        lighthouse_addr: str | None = None,
        replica_id: str | None = None,
        port: int | None = None,
        hostname: str = socket.gethostname(),
        heartbeat_interval: timedelta = timedelta(milliseconds=100),
        checkpoint_transport: Any | None = None,
        init_sync: bool = True,
        max_retries: int | None = None,
        quorum_retries: int = 0,
        liveness_interval: timedelta | None = DEFAULT_KEEPALIVE_INTERVAL,
        job: str | None = None,
    ) -> None:
        self.quorum_logger = logging.getLogger("torchft_quorums")
        self.commits_logger = logging.getLogger("torchft_commits")
        self.errors_logger = logging.getLogger("torchft_errors")
        self._log = logging.getLogger(__name__)

        self._load_state_dict_fns: dict[str, Callable[[Any], None]] = {}
        self._user_state_dicts: dict[str, Callable[[], Any]] = {}
        if load_state_dict is not None and state_dict is not None:
            self.register_state_dict_fn("default", load_state_dict, state_dict)

        self._timeout = _env.env_timeout(_env.TIMEOUT_SEC_ENV, timeout)
        self._quorum_timeout = _env.env_timeout(_env.QUORUM_TIMEOUT_SEC_ENV, quorum_timeout)
        self._connect_timeout = _env.env_timeout(_env.CONNECT_TIMEOUT_SEC_ENV, connect_timeout)
        self._quorum_retries = _env.quorum_retries(quorum_retries)
        self._state_dict_lock = _ReadWriteLock(self._timeout.total_seconds())
        self._is_state_dict_read_allowed = True

        if min_replica_size < 1:
            raise ValueError(f"min_replica_size must be >= 1, got {min_replica_size}")
        if max_retries is not None and max_retries < 0:
            raise ValueError(f"max_retries must be >= 0 or None, got {max_retries}")
        self._min_replica_size = min_replica_size
        self._use_async_quorum = use_async_quorum
        self._replica_world_size_mode = world_size_mode
        self._init_sync = init_sync
        self._max_retries = max_retries
        self._commit_failures = 0

        store_addr = _required_env(store_addr, "MASTER_ADDR", "store_addr")
        store_port = _required_env(store_port, "MASTER_PORT", "store_port", int)
        self._group_rank: int = _required_env(rank, "RANK", "rank", int)
        self._group_world_size: int = _required_env(world_size, "WORLD_SIZE", "world_size", int)
        if not 0 <= self._group_rank < self._group_world_size:
            raise ValueError(f"rank {self._group_rank} is outside the replica group (world_size "
                             f"{self._group_world_size})")
        if replica_id is None and (group_id := _env.replica_group_id()) is not None:
            replica_id = str(group_id)
        self._replica_id = replica_id

        self._step = 0
        self._quorum_id = -1
        self._errored: ExceptionWithTraceback | None = None
        # This step's recovery failed on this rank: it votes against committing, but (unlike
        # _errored) it still takes part in the step's collectives, with zeros as any healing rank.
        self._recovery_error: ExceptionWithTraceback | None = None
        self._healing = False  # this rank recovers from a peer in this step
        # Some rank of this replica group recovers in this step (the same on every rank of the
        # group): then every rank of the group loads a state dict at the same point, the ranks
        # that do not recover their own (see _apply_recovery).
        self._heal_in_group = False
        # What this rank recovered in this step: applied only once every rank of the replica group
        # agreed (see "Healing" in the module docstring).
        self._pending_state_dict: dict[str, Any] | None = None
        # The state dict this step may serve to healing peers (asynchronous quorum): taken on the
        # training thread just before its forward pass (see _arm_capture), or why it could not be.
        # _capture_done is set once it is taken (or nothing is to be taken).
        self._captured_state_dict: dict[str, Any] | None = None
        self._capture_error: Exception | None = None
        self._capture_done = threading.Event()
        self._capture_done.set()
        self._capture_hook: Any | None = None  # the global forward pre-hook armed by start_quorum
        self._training_thread: int | None = None  # the thread that called start_quorum
        # Recorded on the training thread's stream with the state dict: a checkpoint is serialised
        # (on the recovery stream) only after the work queued before it (the last optimizer step).
        self._state_event: Any | None = None
        self._batches_committed = 0
        self._participating_replica_rank: int | None = None
        self._participating_replica_world_size = 0
        self._last_quorum: QuorumResult | None = None
        # Liveness notices (see the module docstring). The lock orders a notice against the
        # start of a step and the arrival of its quorum: exactly one of them fails the step.
        self._liveness_lock = threading.RLock()  # an abort runs collectives' callbacks in its thread
        self._step_quorum_id: int | None = None  # the current step's quorum, once it is known
        self._configuring_quorum_id: int | None = None  # the quorum whose group is being built
        self._inflight = 0  # this Manager's allreduces not settled yet
        self._dead_quorums: dict[int, PeerDied] = {}
        self.peer_died_notices = 0  # notices received (for tests and logs)
        self._closing = threading.Event()
        self._notice_thread: threading.Thread | None = None
        self._full_replica_id = replica_id or "?"
        self._lighthouse_addr: str | None = None  # group rank 0's, for job_config() on any rank
        self._job: str | None = None
        self._job_client: LighthouseClient | None = None  # ranks other than 0: made by job_config()
        self._job_client_lock = threading.Lock()

        self._pg = pg
        # Accelerator streams (all None on CPU): checkpoints move on a recovery stream (one per
        # device, made on first use in the quorum thread, on the device it runs for); its event,
        # recorded after a transfer, is waited for before the recovered state is used.
        self._accel = _ACCELERATOR
        self._recovery_streams: dict[int, Any | None] = {}
        self._recovery_event: Any | None = None
        self._manager: ManagerServer | None = None
        self._client: ManagerClient | LocalManagerClient | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftclient_async_quorum")
        self._quorum_future: ConcurrentFuture[None] | None = None
        self._checkpoint_transport = (checkpoint_transport if checkpoint_transport is not None
                                      else _default_checkpoint_transport(self._timeout))
        # ftclient's PGTransport takes this rank's own state as the template of what it receives.
        self._recv_takes_template = _accepts_keyword(self._checkpoint_transport.recv_checkpoint, "template")
        try:
            self._store = TCPStore(host_name=store_addr, port=store_port, is_master=False, wait_for_workers=False,
                                   timeout=self._connect_timeout)
            if self._group_rank == 0:
                if port is None:
                    port = _env.env_int(_env.MANAGER_PORT_ENV, 0)
                # A restarted replica group must not be mistaken for its previous incarnation.
                full_id = str(uuid.uuid4()) if not replica_id else f"{replica_id}:{uuid.uuid4()}"
                self._full_replica_id = full_id
                self._lighthouse_addr = _env.lighthouse_addr(lighthouse_addr)
                self._manager = ManagerServer(
                    replica_id=full_id, lighthouse_addr=self._lighthouse_addr, hostname=hostname,
                    bind=f"[::]:{port}", store_addr=f"{store_addr}:{store_port}", world_size=self._group_world_size,
                    heartbeat_interval=heartbeat_interval, connect_timeout=self._connect_timeout,
                    quorum_retries=self._quorum_retries, liveness_interval=_env.liveness_interval(liveness_interval),
                    on_peer_died=self._on_lighthouse_notice, job=job)
                self._job = self._manager.lighthouse.job.name
                # Before the manager's address: a rank that has read that finds these set.
                self._store.set(LIGHTHOUSE_ADDR_KEY, self._lighthouse_addr)
                self._store.set(JOB_KEY, self._job)
                self._store.set(MANAGER_ADDR_KEY, self._manager.address())
                self._store.set(REPLICA_ID_KEY, full_id)
                # Rank 0 hosts the manager server: it calls it directly; other ranks use gRPC.
                self._client = LocalManagerClient(self._manager)
            else:
                manager_addr = self._store.get(MANAGER_ADDR_KEY).decode()
                self._full_replica_id = self._store.get(REPLICA_ID_KEY).decode()
                self._lighthouse_addr = self._store.get(LIGHTHOUSE_ADDR_KEY).decode()
                self._job = self._store.get(JOB_KEY).decode()
                self._client = ManagerClient(manager_addr, connect_timeout=self._connect_timeout)
                if self._group_world_size > 1:
                    self._notice_thread = threading.Thread(
                        target=self._watch_group_notices, args=(store_addr, store_port), daemon=True,
                        name=f"ftclient-notices-{self._full_replica_id}/{self._group_rank}")
                    self._notice_thread.start()
        except BaseException:
            self.shutdown(wait=False)
            raise

    # -- logging ---------------------------------------------------------------------------------

    def _prefix(self) -> str:
        return f"[{self._full_replica_id}/{self._group_rank} - step {self._step}]"

    def _info(self, msg: str) -> None:
        self._log.info("%s %s", self._prefix(), msg)

    def _exception(self, msg: str) -> None:
        self._log.exception("%s %s", self._prefix(), msg)

    # -- state dicts -----------------------------------------------------------------------------

    def register_state_dict_fn(self, key: str, load_state_dict: Callable[[T], None],
                               state_dict: Callable[[], T]) -> None:
        """Add user state sent to healing replica groups under ``key`` (unique)."""
        if key in self._load_state_dict_fns or key in self._user_state_dicts:
            raise ValueError(f"state_dict fn {key!r} is already registered")
        self._load_state_dict_fns[key] = cast(Callable[[Any], None], load_state_dict)
        self._user_state_dicts[key] = state_dict

    def set_state_dict_fns(self, load_state_dict: Callable[[T], None], state_dict: Callable[[], T]) -> None:
        """Deprecated in torchft: use ``register_state_dict_fn``."""
        self.register_state_dict_fn("set_state_dict_fns", load_state_dict, state_dict)

    def allow_state_dict_read(self) -> None:
        if not self._is_state_dict_read_allowed:
            self._is_state_dict_read_allowed = True
            self._state_dict_lock.release_write()

    def disallow_state_dict_read(self) -> None:
        if self._is_state_dict_read_allowed:
            self._is_state_dict_read_allowed = False
            self._state_dict_lock.acquire_write()

    def _manager_state_dict(self) -> dict[str, Any]:
        """The user's state dicts (every registered fn called now) and the manager's own state.
        Called only where no forward or backward pass can run, at the same point on every rank
        of the replica group: see :meth:`_arm_capture` and :meth:`_async_quorum`."""
        with self._state_dict_lock.read():
            if not self._user_state_dicts:
                raise RuntimeError("no user state_dict registered: pass state_dict= or call register_state_dict_fn")
            return {"user": {k: fn() for k, fn in self._user_state_dicts.items()}, "torchft": self.state_dict()}

    def _arm_capture(self, allow_heal: bool) -> None:
        """start_quorum, on the training thread: arrange for the state dict this step may serve
        to healing peers to be taken on this thread, at the last point before its forward pass.

        With the asynchronous quorum the quorum runs on the quorum thread while this thread goes
        on with the step; a peer that heals from us is known only once the quorum is in.
        Calling the user's ``state_dict()`` on the quorum thread then (as torchft 0.2.0 does) runs
        it concurrently with the forward or backward pass: FSDP2's state-dict hook reshards the
        module's parameters under it ("got mixed torch.Tensor and DTensor", "data is not
        allocated yet"). So it is called on this thread, every step, by whichever comes first:
        the first module call on this thread (a global forward pre-hook, which runs before any of
        the module's own hooks, FSDP2's unsharding included: nothing is in flight yet), or this
        Manager's next call that waits for the quorum (``wait_quorum``, ``allreduce``,
        ``num_participants``, ``should_commit``), for a step without a module. Until then the
        parameters hold the state of ``current_step()`` (the last optimizer step is done, the next
        one waits for ``should_commit``): the state a peer healing to our step must receive.
        What the training loop changed since ``start_quorum`` (the batch it fetched, counted in
        torchtitan's ``ntokens_seen``) is in it, as it is in what a healing rank has when it
        applies the state (in ``should_commit``). Only references are taken (no copy); the quorum
        thread serialises them. A healing peer reads them before its first collective of the
        step (its ``allreduce`` waits for its recovery), so before ours completes, and
        ``should_commit`` closes the transport before the optimizer step mutates them.

        The cost: the user's state dict functions run at every step (the quorum's answer comes too
        late to call them only when a peer heals); docs/ftclient.md gives the measured cost. An
        error is kept for the step that needs the state dict (a step without healing peers does
        not fail because of it). With the synchronous quorum nothing is armed: the quorum thread
        takes the state dict while this thread waits in start_quorum, only in a quorum in which a
        group recovers (see :meth:`_async_quorum`)."""
        self._disarm_capture()
        self._captured_state_dict, self._capture_error, self._state_event = None, None, None
        if not (allow_heal and self._user_state_dicts):
            return
        if not self._use_async_quorum:
            self._state_event = self._accel.record_event()
            return
        self._training_thread = threading.get_ident()
        self._capture_done.clear()
        self._capture_hook = torch.nn.modules.module.register_module_forward_pre_hook(self._capture_before_forward)

    def _capture_before_forward(self, module: torch.nn.Module, args: Any) -> None:
        """The global forward pre-hook armed by start_quorum (removed once it fires)."""
        self._capture_now()

    def _capture_now(self) -> None:
        """Take the state dict armed by start_quorum, if not taken yet and if called on the
        training thread (a module call or a Manager call on another thread does nothing)."""
        if self._capture_done.is_set() or threading.get_ident() != self._training_thread:
            return
        self._remove_capture_hook()
        try:
            self._captured_state_dict = self._manager_state_dict()
        except Exception as e:  # noqa: BLE001 -- raised where it is needed (_state_dict_to_send)
            self._capture_error = e
        self._state_event = self._accel.record_event()
        self._capture_done.set()

    def _remove_capture_hook(self) -> None:
        hook, self._capture_hook = self._capture_hook, None
        if hook is not None:
            hook.remove()

    def _disarm_capture(self) -> None:
        """The step is over (or the Manager shuts down): no capture any more, no global hook."""
        self._remove_capture_hook()
        self._capture_done.set()

    def _wait_capture(self) -> None:
        """The quorum thread: wait until the training thread took the state dict."""
        if not self._capture_done.wait(self._timeout.total_seconds()):
            raise TimeoutError(
                f"the training thread took no state dict within {self._timeout.total_seconds():g}s of start_quorum: "
                "it is taken at its first module call or its next Manager call (wait_quorum, allreduce, "
                "should_commit)")

    def _state_dict_to_send(self, step: int) -> dict[str, Any]:
        """The quorum thread: the state dict to serve as the checkpoint of ``step``. With the
        asynchronous quorum, the one the training thread took (see :meth:`_arm_capture`; no user
        function is called here, where the forward pass may be running); with the synchronous
        quorum, the one this thread took once the quorum was in, while the training thread waits
        in start_quorum (see :meth:`_async_quorum`)."""
        self._wait_capture()  # at once with the synchronous quorum: _async_quorum took it
        if self._capture_error is not None:
            raise self._capture_error
        captured = self._captured_state_dict
        if captured is None:
            raise RuntimeError("no user state_dict registered: pass state_dict= or call register_state_dict_fn")
        if captured["torchft"]["step"] != step:
            raise RuntimeError(f"the state dict taken in this step is of step {captured['torchft']['step']}, "
                               f"but peers heal to step {step}: not serving it")
        return captured

    def state_dict(self) -> dict[str, int]:
        """The manager's own state, to save with periodic checkpoints (the committed step)."""
        return {"step": self._step, "batches_committed": self._batches_committed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Restore ``step`` and ``batches_committed`` from ``state_dict()``'s output."""
        self._step = state_dict["step"]
        self._batches_committed = state_dict["batches_committed"]

    # -- lifecycle -------------------------------------------------------------------------------

    def shutdown(self, wait: bool = True) -> None:
        """Stop the checkpoint transport, the manager server (rank 0) and the quorum thread."""
        self._closing.set()
        self._disarm_capture()  # no global forward pre-hook outlives the Manager
        self._checkpoint_transport.shutdown(wait=wait)
        if self._manager is not None:
            self._manager.shutdown()
        if self._client is not None:
            self._client.close()
        with self._job_client_lock:
            if self._job_client is not None:
                self._job_client.close()
                self._job_client = None
        if self._notice_thread is not None and self._notice_thread.is_alive():
            try:  # wake the notice watcher out of its store wait
                seq = self._store.add(NOTICE_SEQ_KEY, 1)
                self._store.set(f"{NOTICE_KEY}/{seq}", NOTICE_WAKE)
            except Exception:  # noqa: BLE001 -- the store is gone: so is the watcher's wait
                pass
            if wait:
                self._notice_thread.join(timeout=2)
        self._executor.shutdown(wait=wait)

    # -- errors ----------------------------------------------------------------------------------

    def report_error(self, e: Exception) -> None:
        """Record an error: this step will not commit (call it when a gradient is corrupt)."""
        self._errored = ExceptionWithTraceback(e)

    def errored(self) -> ExceptionWithTraceback | None:
        """The error recorded in this step, if any (a failed recovery included)."""
        return self._errored if self._errored is not None else self._recovery_error

    def _collectives_errored(self) -> ExceptionWithTraceback | None:
        """The error that makes this step's remaining collectives no-ops (a failed collective,
        ``report_error``, a dead peer). Not a failed recovery: a healing rank takes part in the
        step's collectives with zeros whether or not its transfer succeeded, so that its peers
        in the other replica groups (and the other ranks of its own group, in their next
        collective) never wait for it until a timeout."""
        return self._errored

    def wrap_future(self, fut: "torch.futures.Future[T]", default: T,
                    timeout: timedelta | None = None) -> "torch.futures.Future[T]":
        """``fut`` with errors and a timeout (the manager's by default) turned into
        ``report_error`` + ``default``: the returned future never fails.

        It is CUDA-aware for the accelerator devices of the tensors in ``default`` (the value is
        expected on the same devices): waiting on it orders the current stream after the value.
        """
        seconds = (timeout or self._timeout).total_seconds()
        out: torch.futures.Future[T] = _future_for(default)
        # ``fut`` keeps ``on_done`` until it completes, which may be never: what it reaches is
        # dropped once settled, so a lost future does not keep ``out`` and ``default`` alive.
        holder: list[Any] = [out, default]
        lock = threading.Lock()

        def settle(value: Any, error: Exception | None) -> None:
            with lock:
                if not holder:
                    return
                target, fallback = holder
                holder.clear()
            timer.cancel()
            if error is not None:
                if self._peer_died_error() is not None:
                    # Aborted because a peer died: that is the error to report, not its echo.
                    self._log.debug("%s collective aborted: %s", self._prefix(), error)
                else:
                    self._log.error("%s got exception in future -- skipping remaining: %s", self._prefix(), error)
                    self.report_error(error)
                value = fallback
            target.set_result(value)

        def on_done(f: "torch.futures.Future[T]") -> None:
            try:
                value = f.value()
            except Exception as e:  # noqa: BLE001 -- recorded, never raised
                settle(None, e)
                return
            settle(value, None)

        timer = WATCHDOG.schedule(seconds, lambda: settle(None, TimeoutError(
            f"future did not complete within {seconds:g}s")))
        fut.add_done_callback(on_done)  # last: a completed ``fut`` calls back at once
        return out

    # -- liveness notices --------------------------------------------------------------------------

    def _on_lighthouse_notice(self, notice: PeerDied) -> None:
        """Group rank 0, on the liveness stream's thread: act, then tell the group's other ranks."""
        self._peer_died(notice)
        if self._group_world_size > 1:
            try:
                seq = self._store.add(NOTICE_SEQ_KEY, 1)
                self._store.set(f"{NOTICE_KEY}/{seq}", json.dumps(
                    {"quorum_id": notice.quorum_id, "replica_ids": list(notice.replica_ids), "reason": notice.reason}))
            except Exception as e:  # noqa: BLE001 -- the other ranks then fail at their timeout
                self._log.warning("%s could not pass the liveness notice to the group's other ranks: %s",
                                  self._prefix(), e)

    def _watch_group_notices(self, store_addr: str, store_port: int) -> None:
        """Group ranks > 0: wait for the notices rank 0 publishes in the group's store."""
        try:
            store = TCPStore(host_name=store_addr, port=store_port, is_master=False, wait_for_workers=False,
                             timeout=self._connect_timeout)
            seq = int(store.add(NOTICE_SEQ_KEY, 0))
        except Exception as e:  # noqa: BLE001 -- notices then never reach this rank: it fails at timeouts
            self._log.warning("%s no liveness notices for this rank: %s", self._prefix(), e)
            return
        while not self._closing.is_set():
            key = f"{NOTICE_KEY}/{seq + 1}"
            try:
                store.wait([key], timedelta(hours=1))
                payload = store.get(key)
            except Exception:  # noqa: BLE001 -- the hour passed, or the store went away
                if self._closing.wait(1.0):
                    return
                continue
            seq += 1
            if payload == NOTICE_WAKE:
                continue
            try:
                fields = json.loads(payload)
                notice = PeerDied(quorum_id=int(fields["quorum_id"]), replica_ids=tuple(fields["replica_ids"]),
                                  reason=str(fields["reason"]))
            except (ValueError, KeyError, TypeError) as e:
                self._log.warning("%s malformed liveness notice %r: %s", self._prefix(), payload[:200], e)
                continue
            self._peer_died(notice)

    def _peer_died(self, notice: PeerDied) -> None:
        """A member of quorum ``notice.quorum_id`` died: fail the step if it runs on that quorum,
        else remember it for when that quorum comes (an older quorum's notice is ignored)."""
        q = notice.quorum_id
        with self._liveness_lock:
            self.peer_died_notices += 1
            current = self._quorum_id
            if q < current:
                self._info(f"liveness notice ignored: {notice.describe()}, older than quorum {current}")
                return
            self._dead_quorums[q] = notice
            if self._step_quorum_id == q and self._inflight == 0:
                # Every collective of the step so far completed, with the dead member's part: the
                # step may commit on them. Any later one fails at once (allreduce checks).
                self._info(f"liveness notice: {notice.describe()}: no collective of this step in flight; "
                           f"later ones of this quorum will fail at once")
                self._abort_pg(notice)
                return
            if self._step_quorum_id == q:
                # A member that completed its part and then exited (its last step) or died is
                # reported just like one that died in the middle: give collectives that are
                # completing ABORT_GRACE_S to do so; those still pending then are aborted.
                self._info(f"liveness notice: {notice.describe()}: aborting this step's {self._inflight} "
                           f"collective(s) still in flight in {ABORT_GRACE_S * 1000:.0f} ms")
                timer = threading.Timer(ABORT_GRACE_S, self._abort_after_grace, args=(notice,))
                timer.daemon = True
                timer.start()
                return
            if self._configuring_quorum_id == q:
                self._info(f"liveness notice: {notice.describe()}: aborting the process group's rendezvous "
                           f"for that quorum; the step will not commit")
            else:
                self._info(f"liveness notice: {notice.describe()}: kept (this step's quorum is not known yet)")
                return
            self._fail_step(notice)

    def _abort_after_grace(self, notice: PeerDied) -> None:
        with self._liveness_lock:
            if self._step_quorum_id != notice.quorum_id or self._inflight == 0:
                return  # they completed (or the step is over)
            self._info(f"aborting {self._inflight} collective(s) of quorum {notice.quorum_id}: "
                       "the step will not commit")
            self._fail_step(notice)

    def _peer_died_error(self) -> PeerDiedError | None:
        """The step's recorded error when it is a PeerDiedError."""
        current = self._errored
        if current is not None and isinstance(current.original_exception, PeerDiedError):
            return current.original_exception
        return None

    def _fail_step(self, notice: PeerDied) -> None:
        """Abort the step's collectives and record why; called with ``_liveness_lock`` held, so
        the step (and its process group's configuration) cannot change meanwhile."""
        # Before the abort: the failures of the aborted collectives keep this cause (wrap_future).
        self._errored = ExceptionWithTraceback(PeerDiedError(notice))
        self._abort_pg(notice)

    def _abort_pg(self, notice: PeerDied) -> None:
        try:
            abort_process_group(self._pg, PeerDiedError(notice))
        except Exception as e:  # noqa: BLE001 -- the collectives then fail at their timeout
            self._log.warning("%s aborting the process group failed: %s", self._prefix(), e)

    def _quorum_known(self, quorum_id: int) -> None:
        """The current step runs on ``quorum_id``: fail it at once if a notice already said a
        member of that quorum died."""
        with self._liveness_lock:
            self._step_quorum_id = quorum_id
            for old in [k for k in self._dead_quorums if k < quorum_id]:
                del self._dead_quorums[old]
            notice = self._dead_quorums.get(quorum_id)
            if notice is not None:
                self._info(f"quorum {quorum_id} is already known to have lost a member ({notice.describe()}): "
                           "the step will not commit")
                self._fail_step(notice)

    # -- quorum ----------------------------------------------------------------------------------

    def start_quorum(self, allow_heal: bool = True, shrink_only: bool = False,
                     timeout: timedelta | None = None) -> None:
        """Start this step's quorum (in the background unless ``use_async_quorum=False``).

        ``allow_heal``: recover from a peer in this quorum if behind (every replica group must
        pass the same value). ``shrink_only``: only accept a quorum of the previous members.
        """
        if self._quorum_future is not None:
            # The previous step's quorum must be over; its error, if any, was raised there.
            wait_futures([self._quorum_future])
        with self._liveness_lock:
            self._errored = None
            self._step_quorum_id = None
        self._recovery_error = None
        self._healing = self._heal_in_group = False
        self._pending_state_dict = None  # a recovery that the last step did not apply is dropped
        self._arm_capture(allow_heal)
        self._quorum_future = self._executor.submit(self._async_quorum, allow_heal, shrink_only,
                                                    timeout or self._quorum_timeout,
                                                    self._accel.current_device())
        if not self._use_async_quorum:
            self.wait_quorum()
            # Heal before the forward pass (the step then runs on the recovered weights), once
            # every rank of the replica group recovered.
            self._settle_synchronous_heal()

    def wait_quorum(self) -> None:
        """Wait for the quorum started by ``start_quorum``; raises its error (e.g. TimeoutError)."""
        if self._quorum_future is None:
            raise RuntimeError("call start_quorum before wait_quorum")
        self._capture_now()  # the quorum thread may need it (a step without a module call)
        self._quorum_future.result()

    def _async_quorum(self, allow_heal: bool, shrink_only: bool, quorum_timeout: timedelta,
                      device: int = -1) -> None:
        # The caller's device: the process group's configure and the checkpoint transfers below
        # allocate on the current device of this (the quorum) thread.
        self._accel.set_device(device)
        assert self._client is not None
        quorum = self._client._quorum(
            group_rank=self._group_rank, step=self._step, checkpoint_metadata=self._checkpoint_transport.metadata(),
            shrink_only=shrink_only, timeout=quorum_timeout, commit_failures=self._commit_failures,
            init_sync=self._init_sync)
        self._last_quorum = quorum

        # With the async quorum, healing groups sit this step out: only the groups at the max
        # step take part. Synchronous healing makes every group participate.
        if self._use_async_quorum or not allow_heal:
            rank, size = quorum.max_replica_rank, quorum.max_world_size
        else:
            rank, size = quorum.replica_rank, quorum.replica_world_size
        if self._replica_world_size_mode == WorldSizeMode.FIXED_WITH_SPARES:
            size = min(size, self._min_replica_size)
            if rank is not None and rank >= self._min_replica_size:
                rank = None
        self._participating_replica_rank, self._participating_replica_world_size = rank, size
        # Whether this rank must recover in this step: known now, whatever fails below (a rank
        # that should heal and could not votes against applying anybody's recovery).
        self._healing = allow_heal and quorum.heal
        self._heal_in_group = allow_heal and _group_heals(quorum, self._group_world_size, self._init_sync)
        if (allow_heal and not self._use_async_quorum and self._user_state_dicts
                and _quorum_recovers(quorum, self._init_sync)):
            # The synchronous quorum: the training thread waits in start_quorum, so the state
            # dict is taken here, by every rank of every group of a quorum in which a group
            # recovers, whatever fails below: a user's state_dict() may run collectives over its
            # replica group (torchtitan's FSDP2 state-dict hooks gather DTensors), so all ranks
            # of a group call it at the same point (or none does).
            try:
                self._captured_state_dict = self._manager_state_dict()
            except Exception as e:  # noqa: BLE001 -- raised where it is needed (_state_dict_to_send)
                self._capture_error = e

        if quorum.quorum_id != self._quorum_id:
            self.quorum_logger.info("", extra={"replica_id": self._replica_id, "rank": self._group_rank,
                                               "quorum_id": quorum.quorum_id, "step": quorum.max_step})
            store_prefixed_addr = f"{quorum.store_address}/torchft/{quorum.quorum_id}/{self._group_rank}"
            self._info(f"reconfiguring for quorum_id={quorum.quorum_id} store={store_prefixed_addr}")
            with self._liveness_lock:
                self._quorum_id = quorum.quorum_id
                known_dead = quorum.quorum_id in self._dead_quorums
                if not known_dead:
                    self._configuring_quorum_id = quorum.quorum_id  # a notice now aborts the rendezvous
            if known_dead:
                # Its rendezvous would wait for the dead member: fail the step without it.
                self._quorum_known(quorum.quorum_id)
                return
            try:
                self._accel.synchronize()  # nothing queued on the current stream uses the old group
                self._pg.configure(store_prefixed_addr, self._replica_id if self._replica_id is not None else "0",
                                   quorum.replica_rank, quorum.replica_world_size, quorum_id=quorum.quorum_id,
                                   group_rank=self._group_rank, group_world_size=self._group_world_size)
            except Exception as e:  # noqa: BLE001 -- recorded: this step will not commit
                if self._peer_died_error() is None:
                    self._exception(f"got exception in pg configure: {e}")
                    self.report_error(e)
                else:
                    self._info(f"pg configure aborted: {e}")
                return
            finally:
                with self._liveness_lock:
                    self._configuring_quorum_id = None
        self._quorum_known(quorum.quorum_id)

        if not allow_heal:
            return
        with self._accel.stream_context(self._recovery_stream()):
            self._send_or_recover(quorum)
            self._recovery_event = self._accel.record_event()  # on the recovery stream

    def _send_or_recover(self, quorum: QuorumResult) -> None:
        """Serve our checkpoint to the groups that heal from us; fetch ours if we heal. What is
        fetched is only kept (``_pending_state_dict``): it is applied once the whole replica
        group agreed (should_commit, or start_quorum with the synchronous quorum)."""
        try:
            if quorum.recover_dst_replica_ranks:
                self._info(f"peers need recovery from us: {quorum.recover_dst_replica_ranks}")
                state = self._state_dict_to_send(quorum.max_step)
                self._accel.wait_event(self._state_event)
                self._checkpoint_transport.send_checkpoint(
                    dst_ranks=quorum.recover_dst_replica_ranks, step=quorum.max_step, state_dict=state,
                    timeout=self._timeout)
        except Exception as e:  # noqa: BLE001 -- recorded: this step will not commit
            # Like a failed recovery, it does not stop this rank's collectives: peers would wait.
            self._exception(f"got exception serving the checkpoint: {e}")
            self._recovery_error = ExceptionWithTraceback(e)
        if not quorum.heal:
            return
        try:
            assert quorum.recover_src_replica_rank is not None, "a healing quorum names a recovery source"
            self._info(f"healing from {quorum.recover_src_manager_address} "
                       f"(replica rank {quorum.recover_src_replica_rank}) at max_step={quorum.max_step}")
            source = ManagerClient(quorum.recover_src_manager_address, connect_timeout=self._connect_timeout)
            try:
                metadata = source._checkpoint_metadata(self._group_rank, timeout=self._timeout)
            finally:
                source.close()
            kwargs: dict[str, Any] = {}
            if self._recv_takes_template:
                # Our own state, taken already: the layout to receive into (its devices, and its
                # DTensors' meshes: collectives on them work here), with no state_dict() call now.
                self._wait_capture()
                kwargs["template"] = self._captured_state_dict if self._captured_state_dict is not None else {}
            recovered = self._checkpoint_transport.recv_checkpoint(
                src_rank=quorum.recover_src_replica_rank, metadata=metadata, step=quorum.max_step,
                timeout=self._timeout, **kwargs)
            self._check_recovered(recovered, quorum.max_step)
            self._pending_state_dict = recovered
        except Exception as e:  # noqa: BLE001 -- recorded: no rank of the group applies this recovery
            self._exception(f"got exception in recovery: {e}")
            self._recovery_error = ExceptionWithTraceback(e)

    def _check_recovered(self, recovered: Any, step: int) -> None:
        """What a rank can check before its group decides to apply a recovered state dict: it
        has every registered key, the manager's state of ``step``, and a loader for each key."""
        if not isinstance(recovered, dict) or "user" not in recovered or "torchft" not in recovered:
            raise RuntimeError(f"the recovered checkpoint is not a Manager state dict ({type(recovered).__name__})")
        if recovered["torchft"].get("step") != step:
            raise RuntimeError(f"the recovered checkpoint is of step {recovered['torchft'].get('step')}, not {step}")
        if not self._load_state_dict_fns:
            raise RuntimeError("no user load_state_dict registered: pass load_state_dict= or call "
                               "register_state_dict_fn")
        missing = sorted(set(self._load_state_dict_fns) - set(recovered["user"]))
        if missing:
            raise RuntimeError(f"the recovered checkpoint lacks the state of {missing} (it has "
                               f"{sorted(recovered['user'])}): the source registers other state_dict fns")

    def _recovery_stream(self) -> Any | None:
        """The recovery stream of the calling thread's device (None without an accelerator)."""
        device = self._accel.current_device()
        if device not in self._recovery_streams:
            self._recovery_streams[device] = self._accel.new_stream()
        return self._recovery_streams[device]

    def _wait_recovery_stream(self) -> None:
        """Block until the last checkpoint transfer's work on the recovery stream is done."""
        event, self._recovery_event = self._recovery_event, None
        if event is not None:
            event.synchronize()

    def _recovered_here(self) -> bool:
        """Whether this rank did its part of the step's checkpoint transfers (a healing rank: the
        state is received and checked; a source: it is served). Waits for the quorum thread and
        the recovery stream."""
        assert self._quorum_future is not None
        self._quorum_future.result()
        self._wait_recovery_stream()
        if self._healing and self._pending_state_dict is None and self._recovery_error is None:
            # No transfer was attempted (the step failed before it): nothing to apply.
            self._recovery_error = ExceptionWithTraceback(RuntimeError("this step's recovery did not run"))
        if (self._heal_in_group and not self._healing and self._recovery_error is None
                and self._captured_state_dict is None):
            # Another rank of the group recovers; this one must load its own state alongside.
            self._recovery_error = ExceptionWithTraceback(self._capture_error or RuntimeError(
                "no state dict of this rank to load while another rank of its replica group recovers"))
        return self._recovery_error is None

    def _apply_recovery(self) -> None:
        """Once the whole replica group agreed (every rank has its part): a healing rank loads
        what it recovered (the user's state dicts, then the manager's step and batches); a rank of
        the group that does not heal (``init_sync`` on step 0 heals some group ranks only) loads
        its own state, taken in this step, at the same point: a user's ``load_state_dict`` may run
        collectives over the replica group (torchtitan's FSDP2 load hooks gather DTensors), which
        every rank of the group must join. A failure here leaves this rank apart from its group:
        it raises (the replica group must be restarted)."""
        if self._healing:
            pending, self._pending_state_dict = self._pending_state_dict, None
            assert pending is not None, "applying a recovery that did not complete"
            what = f"the recovered state_dict of step {pending['torchft']['step']}"
        elif self._heal_in_group:
            assert self._captured_state_dict is not None, "no state of this rank to load"
            pending = self._captured_state_dict
            what = "its own state_dict, alongside the ranks of its replica group that recover"
        else:
            return
        self._info(f"applying {what}")
        try:
            user = pending["user"]
            for key, load in self._load_state_dict_fns.items():
                load(user[key])
        except Exception as e:
            self._exception(f"applying {what} failed after the replica group agreed to apply it: {e}")
            raise RuntimeError(
                f"applying {what} failed after every rank of the replica group agreed to apply it ({e}): this "
                "rank's state no longer matches its group's; restart the replica group") from e
        if self._healing:
            self.load_state_dict(pending["torchft"])

    def _drop_pending_state_dict(self, why: str) -> None:
        if self._pending_state_dict is not None:
            self._info(f"dropping the recovered state_dict of step {self._pending_state_dict['torchft']['step']}: "
                       f"{why}; this rank keeps its step and weights, as every rank of its group does")
        self._pending_state_dict = None

    def _settle_synchronous_heal(self) -> None:
        """Synchronous quorum, in start_quorum: when some rank of this replica group heals in this
        quorum, every rank votes whether it has its part (the ShouldCommit barrier of the group);
        only if all have does each rank apply (see :meth:`_apply_recovery`). Otherwise no rank
        applies anything and the step fails on every rank of the group (its collectives are
        skipped, as for any error before them: the group's gradients would come from the old
        weights)."""
        try:
            if not self._heal_in_group:
                return
            recovered = self._recovered_here()
            assert self._client is not None
            agreed = self._client.should_commit(self._group_rank, self._step, recovered, timeout=self._timeout)
            if agreed:
                self._apply_recovery()
                return
            self._drop_pending_state_dict("the recovery failed on a rank of this replica group")
            if self._errored is None:
                self.report_error(self._recovery_error.original_exception if self._recovery_error is not None
                                  else RuntimeError("the recovery failed on another rank of this replica group"))
        finally:
            self._healing = self._heal_in_group = False
            self._captured_state_dict, self._capture_error = None, None

    # -- collectives and commit ------------------------------------------------------------------

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False,
                  reduce_op: ReduceOp = ReduceOp.AVG) -> "ManagedWork":
        """Allreduce ``tensor`` in place across the participating replica groups; returns a
        ``torch.distributed.Work`` (:class:`ManagedWork`).

        AVG is a SUM divided by ``num_participants()``; a replica group that is not
        participating (healing, or a spare) contributes zeros. Never raises for a failed
        collective: the error is recorded (then ``should_commit()`` returns False), the work's
        ``wait()`` returns False and its future resolves with ``tensor`` (whose content is then
        undefined). After an error, further calls are no-ops that return a completed work.

        ``should_quantize=True`` raises ``NotImplementedError``: ftclient has no quantized
        collectives (torchft's are fp8 Triton kernels, CUDA only).
        """
        if should_quantize:
            raise NotImplementedError(
                "Manager.allreduce(should_quantize=True): ftclient has no quantized collectives "
                "(torchft's fp8 path needs CUDA and Triton); pass should_quantize=False")
        if self._collectives_errored():
            return ManagedWork._completed(self, tensor, "skipped: this step already failed")
        self.wait_quorum()
        with self._liveness_lock:
            notice = self._dead_quorums.get(self._step_quorum_id) if self._step_quorum_id is not None else None
            if notice is not None and self._errored is None:
                self._errored = ExceptionWithTraceback(PeerDiedError(notice))
        if notice is not None:  # a member of this step's quorum died: it would never complete
            return ManagedWork._completed(self, tensor, "skipped: a member of this step's quorum died")
        num_participants = self.num_participants()
        if not self.is_participating():
            tensor.zero_()
        pg_op = reduce_op
        if reduce_op == ReduceOp.AVG:
            if not torch.is_floating_point(tensor):
                raise ValueError("average reduce op is only supported for floating point tensors")
            pg_op = ReduceOp.SUM
        with self._liveness_lock:
            self._inflight += 1  # a notice from now on aborts it (before: the group is aborted already)
        try:
            work = self._pg.allreduce([tensor], pg_op)
        except Exception as e:  # noqa: BLE001 -- recorded, never raised
            self._collective_settled()
            self._exception(f"got exception in allreduce -- skipping remaining: {e}")
            self.report_error(e)
            return ManagedWork._completed(self, tensor, f"the allreduce failed to start: {e}")
        divisor = num_participants if reduce_op == ReduceOp.AVG and num_participants > 0 else None
        return ManagedWork(self, work, tensor, divisor, self._timeout, on_settled=self._collective_settled)

    def _collective_failed(self, e: Exception) -> None:
        """A collective of this step failed (or timed out): record it, unless the step already
        failed because a peer died (its abort is what failed the collective)."""
        if self._peer_died_error() is not None:
            self._log.debug("%s collective aborted: %s", self._prefix(), e)
            return
        self._exception(f"got exception in allreduce -- skipping remaining: {e}")
        self.report_error(e)

    def _collective_settled(self) -> None:
        with self._liveness_lock:
            self._inflight -= 1

    def should_commit(self, timeout: timedelta | None = None) -> bool:
        """Whether to step the optimizer: the same answer on every rank of the replica group.

        Raises ``RuntimeError`` after more than ``max_retries`` consecutive False answers.
        """
        try:
            self._capture_now()  # not taken yet: the quorum thread may be waiting for it
            # The step's kernels (and a checkpoint transfer's) must be done before the decision:
            # an asynchronous error or a late collective would otherwise go unnoticed.
            self._wait_recovery_stream()
            self._accel.synchronize()
            if err := self._pg.errored():
                self.report_error(err)
            # A failed transfer (received or served) fails the step; the received state is
            # applied only if every rank of the group has its part (each votes on it here).
            transfers_ok = self._recovered_here() if self._quorum_future is not None else True
            enough_replicas = self.num_participants() >= self._min_replica_size
            local_should_commit = enough_replicas and self._errored is None and transfers_ok
            assert self._client is not None
            should_commit = self._client.should_commit(self._group_rank, self.current_step(), local_should_commit,
                                                       timeout=timeout or self._timeout)
        except BaseException:
            self._captured_state_dict, self._capture_error = None, None
            raise
        finally:
            # From here on the optimizer may mutate what we served (whatever happened above: an
            # offer must never outlive its step): no transfer reads it any more.
            self._disarm_capture()
            self._checkpoint_transport.disallow_checkpoint()
        self._info(f"should_commit={should_commit} enough_replicas={enough_replicas} errored={self.errored()}")
        self.commits_logger.info("", extra={"replica_id": self._replica_id, "rank": self._group_rank,
                                            "quorum_id": self._quorum_id, "step": self.current_step(),
                                            "commit_result": should_commit})
        if should_commit:
            # Every rank of the group has its part (each voted on it): all apply, or the process ends.
            self._apply_recovery()
        elif self._healing:
            self._drop_pending_state_dict("the replica group did not commit this step")
        self._captured_state_dict, self._capture_error = None, None
        if should_commit:
            self._step += 1
            self._batches_committed += self.num_participants()
            self._commit_failures = 0
        else:
            self._commit_failures += 1
            if self._max_retries is not None and self._commit_failures > self._max_retries:
                msg = (f"should_commit failed {self._commit_failures} times consecutively, exceeding "
                       f"max_retries={self._max_retries}")
                self._log.error("%s %s", self._prefix(), msg)
                raise RuntimeError(msg)
        return should_commit

    # -- accessors -------------------------------------------------------------------------------

    def current_step(self) -> int:
        """Committed steps so far (advanced by a True ``should_commit``; set by healing).

        As torchft's, on a rank that heals with the asynchronous quorum it is the step it heals
        to once its transfer is in (between the quorum and ``should_commit``); that step is kept
        only if the replica group commits, otherwise every rank of the group is back at its old
        step after ``should_commit``."""
        pending = self._pending_state_dict
        return int(pending["torchft"]["step"]) if pending is not None else self._step

    def batches_committed(self) -> int:
        """Batches committed over all replica groups (participants summed per committed step;
        a healing rank's as :meth:`current_step`'s)."""
        pending = self._pending_state_dict
        return int(pending["torchft"]["batches_committed"]) if pending is not None else self._batches_committed

    def participating_rank(self) -> int | None:
        """This replica group's rank among the participants, None if not participating
        (waits for the quorum)."""
        if self._quorum_future is None:
            return None
        self.wait_quorum()
        return self._participating_replica_rank

    def num_participants(self) -> int:
        """How many replica groups take part in this step (waits for the quorum)."""
        if self._quorum_future is None:
            return 0
        self.wait_quorum()
        return self._participating_replica_world_size

    def is_participating(self) -> bool:
        """Whether this replica group's gradients count in this step (not healing, not a spare)."""
        if self._participating_replica_rank is None:
            return False
        if self._healing:
            assert self._use_async_quorum
            return False
        return True

    @property
    def replica_id(self) -> str:
        """This replica group's full id in the lighthouse (``name:uuid``)."""
        return self._full_replica_id

    @property
    def job(self) -> str:
        """The lighthouse job of this replica group (``"default"`` when none was selected)."""
        assert self._job is not None, "the Manager was not constructed"
        return self._job

    def job_config(self, timeout: timedelta = timedelta(seconds=10)) -> dict[str, str]:
        """The job's configuration map (``lighthouse-cluster jobs set NAME --config KEY=VALUE``),
        read from the lighthouse cluster at each call (no cache: one ``GetJob`` call, answered by
        the leader when it is known; call it when the value is needed, e.g. at start or between
        steps). Works on every rank of the group; the default job's map is empty unless set.

        Raises ``ftclient.lighthouse_client.JobNotFoundError`` (naming the job and the cluster)
        when the cluster has no such job, ``ConnectionError`` when no endpoint answered within
        ``timeout``."""
        if self._manager is not None:
            return self._manager.lighthouse.job_config(timeout)
        with self._job_client_lock:
            if self._job_client is None:
                if self._lighthouse_addr is None:
                    raise RuntimeError("the Manager was not constructed: no lighthouse address")
                self._job_client = LighthouseClient(self._lighthouse_addr, connect=False, job=self._job)
            client = self._job_client
        return client.job_config(timeout)

    @property
    def last_quorum_result(self) -> QuorumResult | None:
        """What the last quorum told this rank (for logging and tests); None before the first."""
        return self._last_quorum


def _group_heals(quorum: QuorumResult, group_world_size: int, init_sync: bool) -> bool:
    """Whether some rank of the replica group that got ``quorum`` heals in it (the same answer on
    every rank of the group: all of them get the same lighthouse quorum; see
    ``compute_quorum_results``). A group behind the highest step heals on every rank. With
    ``init_sync`` on step 0, group rank r heals unless its group is r's primary, the participant
    ``r % n``: with two ranks or more, one of them is not."""
    if quorum.max_replica_rank is None:
        return True
    if init_sync and quorum.max_step == 0 and quorum.replica_world_size > 1:
        return group_world_size > 1 or quorum.replica_rank != 0
    return False


def _quorum_recovers(quorum: QuorumResult, init_sync: bool) -> bool:
    """Whether some replica group of ``quorum`` recovers in it (the same answer for every rank of
    every group: a function of the lighthouse quorum they all got)."""
    if quorum.max_world_size < quorum.replica_world_size:
        return True
    return init_sync and quorum.max_step == 0 and quorum.replica_world_size > 1


def _accepts_keyword(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` takes a keyword argument ``name`` (a parameter of that name, not **kwargs:
    a transport that forwards **kwargs to torchft's would pass it on)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    param = params.get(name)
    return param is not None and param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                  inspect.Parameter.KEYWORD_ONLY)


def _accelerator_devices(obj: Any, found: dict[str, torch.device] | None = None) -> list[torch.device]:
    """The non-CPU devices of the tensors in ``obj`` (lists, tuples and dicts walked)."""
    found = {} if found is None else found
    if isinstance(obj, torch.Tensor):
        if obj.device.type not in ("cpu", "meta"):
            found.setdefault(str(obj.device), obj.device)
    elif isinstance(obj, dict):
        for v in obj.values():
            _accelerator_devices(v, found)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _accelerator_devices(v, found)
    return list(found.values())


def _future_for(value: Any) -> "torch.futures.Future[Any]":
    """A future that may be completed with ``value``: CUDA-aware for its accelerator tensors, so
    completing it records the producing stream and waiting orders the waiter's stream after it
    (some torch versions refuse a CUDA value in a future made without its device; the others
    accept it but order no streams)."""
    devices = _accelerator_devices(value)
    return torch.futures.Future(devices=devices) if devices else torch.futures.Future()


def _done_event(fut: "torch.futures.Future[Any]") -> threading.Event:
    done = threading.Event()
    fut.add_done_callback(lambda _: done.set())
    return done


class ManagedWork(dist._Work):
    """What :meth:`Manager.allreduce` returns: a ``torch.distributed.Work`` over the process
    group's work, with torchft's ``_ManagedWork`` behaviour.

    * The result (the tensor, divided by the number of participants for AVG) is in place once
      the work is done; an error or the manager's timeout is reported to the manager
      (``errored()``, the step does not commit) and the work completes with the input tensor.
    * ``wait(timeout=None)``: returns True when the tensor holds the allreduced result, False
      when it does not (the allreduce failed, or was skipped because the step had already
      failed; never raises). With an accelerator it orders the current stream after the result
      instead of blocking the CPU (for a CUDA-aware process group such as NCCL). A ``timeout``
      that passes first is reported as an error and returns False; a zero timeout means none
      (torch's ``kNoTimeout``).
    * ``get_future()``: a ``torch.futures.Future`` resolving to the tensor (CUDA-aware for a
      tensor on an accelerator: waiting on it orders the current stream after the result).
    * ``block_current_stream()`` / ``synchronize()``: order the current stream after the result;
      on CPU (no stream) they wait like ``wait()``.
    * Like torchft, the stream calls must come from the stream the allreduce was started on
      (``RuntimeError`` otherwise).
    """

    def __init__(self, manager: Manager, work: dist._Work | None, tensor: torch.Tensor, divisor: int | None,
                 timeout: timedelta | None, on_settled: Callable[[], None] | None = None) -> None:
        super().__init__()
        self._manager = manager
        self._work = work
        self._tensor = tensor
        self._stream = manager._accel.current_stream()
        self._error: Exception | None = None
        self._lock = threading.Lock()
        self._settled = False
        self._on_settled = on_settled
        # A tensor on an accelerator needs a CUDA-aware future: completing it records an event on
        # the callback's stream, waiting on it makes the current stream wait for that event.
        self._fut: torch.futures.Future[torch.Tensor] = _future_for(tensor)
        self._timer: Any | None = None
        if work is None:
            return
        self._timer = (WATCHDOG.schedule(timeout.total_seconds(), self._on_timeout)
                       if timeout is not None else None)

        def on_done(f: "torch.futures.Future[Any]") -> None:
            # On an accelerator torch runs this on a stream ordered after the collective.
            try:
                f.value()  # raises the collective's error, if any
            except Exception as e:  # noqa: BLE001 -- recorded, never raised
                self._settle(e)
                return
            # Under the settle lock: after a timeout the late result leaves the tensor alone.
            self._settle(None, (lambda: tensor.div_(divisor)) if divisor is not None else None)

        work.get_future().add_done_callback(on_done)  # last: a completed work calls back at once

    @classmethod
    def _completed(cls, manager: Manager, tensor: torch.Tensor, reason: str) -> "ManagedWork":
        """A work that is already done with ``tensor`` untouched: no allreduce ran (``wait()``
        returns False; the step's error is already recorded)."""
        w = cls(manager, None, tensor, None, None)
        w._error = RuntimeError(reason)
        w._settled = True
        w._fut.set_result(tensor)
        return w

    def _on_timeout(self) -> None:
        self._settle(TimeoutError(f"allreduce did not complete within the manager's timeout "
                                  f"({self._manager._timeout.total_seconds():g}s)"))

    def _settle(self, error: Exception | None, apply: Callable[[], object] | None = None) -> None:
        with self._lock:
            if self._settled:
                return
            if apply is not None:
                try:
                    apply()
                except Exception as e:  # noqa: BLE001 -- recorded, never raised
                    error = e
            self._settled = True
            self._error = error
        if self._timer is not None:
            self._timer.cancel()
        try:
            if error is not None:
                self._manager._collective_failed(error)
        finally:
            if self._on_settled is not None:
                self._on_settled()
            self._fut.set_result(self._tensor)

    def _check_stream(self) -> None:
        if self._stream is not None and self._stream != self._manager._accel.current_stream():
            raise RuntimeError("ManagedWork: wait()/block_current_stream()/synchronize() must be called on the "
                               f"stream the allreduce was started on ({self._stream}), not "
                               f"{self._manager._accel.current_stream()}")

    def _wait_settled(self, timeout: timedelta | None) -> bool:
        """Block the CPU until the work is settled; False (and an error reported) if ``timeout``
        passes first. A zero ``timeout`` means none, as torch's ``kNoTimeout`` (what its C++
        side passes when, say, a functional collective waits)."""
        if timeout is None or timeout <= timedelta(0):
            _done_event(self._fut).wait()  # bounded: the manager's timeout settles it
            return True
        if _done_event(self._fut).wait(max(timeout.total_seconds(), 0.0)):
            return True
        self._manager._collective_failed(TimeoutError(
            f"allreduce not completed within wait(timeout={timeout.total_seconds():g}s)"))
        return False

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._check_stream()
        if not self._wait_settled(timeout):
            return False
        self._fut.wait()  # an accelerator's current stream now waits for the result
        return self._error is None

    def block_current_stream(self, timeout: timedelta | None = None) -> None:
        self.wait(timeout)

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> "torch.futures.Future[torch.Tensor]":
        return self._fut

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        return self._fut.done() and self._error is None

    def exception(self) -> Exception | None:  # type: ignore[override]
        return self._error

    def __repr__(self) -> str:
        state = "pending" if not self._fut.done() else ("failed" if self._error is not None else "done")
        return f"ManagedWork({state}, work={self._work!r})"
