"""torchft's ManagerService over gRPC: the per-replica-group manager server and its client.

One :class:`ManagerServer` runs per replica group, on group rank 0 (torchft's Rust
``ManagerServer``, in Python). It owns the replica group's side of the protocol:

* **Quorum**: gathers one request from every group rank (each needs a deadline), then makes a
  single lighthouse Quorum call for the group -- as the member described by the request that
  completed the set, as torchft does -- retried ``quorum_retries`` times, sleeping
  ``max(100 ms, timeout / (quorum_retries + 1))`` between attempts, never past the deadline of
  that request. Every rank then gets :func:`~ftclient.quorum_results.compute_quorum_results`
  for its group rank. A failed lighthouse call fails every waiting rank at once.
* **ShouldCommit**: a barrier over the group's ranks; the decision is True iff no rank voted
  False.
* **CheckpointMetadata**: what each group rank last sent with its Quorum request (its
  checkpoint transport's address), for replica groups healing from this one.
* **Kill**: answers, then ends the process (exit status 1).
* **Liveness** (:mod:`ftclient.liveness`): a Watch stream to the leader of a lighthouse cluster
  that has them; it carries ``peer_died`` notices to ``on_peer_died`` (the Manager).
* **Heartbeats** to the lighthouse every ``heartbeat_interval``, following the leader -- paused
  while the liveness stream is accepted (the stream is then the heartbeat), resumed the moment it
  is down.

:class:`ManagerClient` is torchft's ``ManagerClient``: what every rank (and a healing replica
group) uses to talk to a manager server. Deadline errors raise ``TimeoutError``, others
``RuntimeError``, as torchft's Rust client does.

The protocol rules live in :mod:`ftclient.quorum_results`; this module only moves messages.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

import grpc
import tenacity

from lighthouse_cluster.proto import torchft_pb2 as pb
from lighthouse_cluster.proto import torchft_pb2_grpc as pb_grpc

from ._timeouts import Deadline, stop_at, to_seconds, wait_within
from .lighthouse_client import LighthouseClient
from .liveness import DEFAULT_KEEPALIVE_INTERVAL, LivenessStream, PeerDied
from .quorum_results import QuorumResult, ReplicaNotInQuorum, compute_quorum_results

__all__ = ["LocalManagerClient", "ManagerClient", "ManagerError", "ManagerServer", "result_from_response",
           "result_to_response"]

log = logging.getLogger(__name__)

# A server-side deadline further away than this means the caller set none.
_NO_DEADLINE_S = 1e9
# Handlers give up this long (at most a quarter of the caller's timeout) before the caller's
# deadline, so that the caller gets the handler's explanation (which ranks are missing, which
# lighthouse endpoints did not answer) rather than a bare client-side DEADLINE_EXCEEDED.
_ANSWER_MARGIN_S = 0.5
# How often a waiting handler checks that its caller is still there.
_POLL_S = 0.5
# Deadline of one heartbeat (torchft sends them without one; a hung leader must not stall them).
HEARTBEAT_TIMEOUT_S = 2.0

_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


def result_to_response(r: QuorumResult) -> pb.ManagerQuorumResponse:
    resp = pb.ManagerQuorumResponse(
        quorum_id=r.quorum_id, recover_src_manager_address=r.recover_src_manager_address,
        recover_dst_replica_ranks=r.recover_dst_replica_ranks, store_address=r.store_address,
        max_step=r.max_step, max_world_size=r.max_world_size, replica_rank=r.replica_rank,
        replica_world_size=r.replica_world_size, heal=r.heal, commit_failures=r.commit_failures,
        replica_ids=r.replica_ids)
    if r.recover_src_replica_rank is not None:
        resp.recover_src_replica_rank = r.recover_src_replica_rank
    if r.max_replica_rank is not None:
        resp.max_replica_rank = r.max_replica_rank
    return resp


def result_from_response(resp: pb.ManagerQuorumResponse) -> QuorumResult:
    return QuorumResult(
        quorum_id=resp.quorum_id, replica_rank=resp.replica_rank, replica_world_size=resp.replica_world_size,
        recover_src_manager_address=resp.recover_src_manager_address,
        recover_src_replica_rank=resp.recover_src_replica_rank if resp.HasField("recover_src_replica_rank") else None,
        recover_dst_replica_ranks=list(resp.recover_dst_replica_ranks), store_address=resp.store_address,
        max_step=resp.max_step,
        max_replica_rank=resp.max_replica_rank if resp.HasField("max_replica_rank") else None,
        max_world_size=resp.max_world_size, heal=resp.heal, commit_failures=resp.commit_failures,
        replica_ids=list(resp.replica_ids))


def _strip_scheme(addr: str) -> str:
    return addr.split("://", 1)[1] if "://" in addr else addr


@dataclass
class _Round:
    """One gathering of the group's ranks (Quorum) and its outcome."""

    done: threading.Event = field(default_factory=threading.Event)
    quorum: pb.Quorum | None = None
    error: tuple[grpc.StatusCode, str] | None = None


@dataclass
class _CommitRound:
    """One ShouldCommit barrier: who voted, who voted False, the decision."""

    done: threading.Event = field(default_factory=threading.Event)
    voted: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)
    decision: bool = False


class ManagerError(Exception):
    """A manager-server call failed with this gRPC status (over gRPC: the call's status)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


def _always_active() -> bool:
    return True


def _wait(event: threading.Event, deadline: Deadline, is_active: Callable[[], bool]) -> bool:
    """Wait for ``event`` until ``deadline`` or until the caller goes away."""
    while not event.is_set():
        left = deadline.remaining()
        if left <= 0 or not is_active():
            return event.is_set()
        event.wait(min(left, _POLL_S))
    return True


def _answer_deadline(timeout: float) -> Deadline:
    return Deadline.after(timeout - min(_ANSWER_MARGIN_S, 0.25 * timeout))


def _exit_process(msg: str) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 -- exiting anyway
            pass
    os._exit(1)


class ManagerServer:
    """torchft's ManagerService for one replica group; see the module docstring.

    Args (torchft's ``ManagerServer``):
        replica_id: this replica group's id in the lighthouse.
        lighthouse_addr: one lighthouse URL or a comma-separated list of cluster nodes.
        hostname: advertised in ``address()`` (other replica groups heal through it).
        bind: ``host:port`` to listen on (``[::]:0``: any free port).
        store_addr: ``host:port`` of this replica group's TCPStore.
        world_size: number of ranks in the replica group.
        heartbeat_interval: lighthouse heartbeat period.
        connect_timeout: how long to look for the lighthouse at start.
        quorum_retries: extra lighthouse Quorum attempts after a failed one.
        on_kill: what Kill does after answering (default: exit the process with status 1).
        lighthouse: a ready client (tests); by default one is made from ``lighthouse_addr``.
        liveness_interval: keep-alive period of the liveness stream (None: no stream, unary
            heartbeats only).
        on_peer_died: called with every ``peer_died`` notice of the liveness stream.
        job: the lighthouse job of the group's Quorum, Heartbeat and Watch calls (None:
            ``LIGHTHOUSE_JOB``, else ``?job=`` on the URL, else the default job;
            :mod:`ftclient.job_selection`). Ignored when ``lighthouse`` is given.
    """

    def __init__(self, replica_id: str, lighthouse_addr: str, hostname: str, bind: str, store_addr: str,
                 world_size: int, heartbeat_interval: timedelta | float = timedelta(milliseconds=100),
                 connect_timeout: timedelta | float = timedelta(seconds=60), quorum_retries: int = 0, *,
                 on_kill: Callable[[str], None] | None = None, lighthouse: LighthouseClient | None = None,
                 liveness_interval: timedelta | float | None = DEFAULT_KEEPALIVE_INTERVAL,
                 on_peer_died: Callable[[PeerDied], None] | None = None, job: str | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if quorum_retries < 0:
            raise ValueError(f"quorum_retries must be >= 0, got {quorum_retries}")
        self._replica_id = replica_id
        self._hostname = hostname
        self._store_address = store_addr
        self._world_size = world_size
        self._heartbeat_interval = to_seconds(heartbeat_interval) or 0.1
        self._quorum_retries = quorum_retries
        self._on_kill = on_kill or _exit_process
        self._lighthouse = lighthouse or LighthouseClient(lighthouse_addr, connect_timeout, job=job)

        self._lock = threading.Lock()
        self._checkpoint_metadata: dict[int, str] = {}
        self._participants: dict[int, pb.QuorumMember] = {}
        self._round = _Round()
        self._commit = _CommitRound()
        self.lighthouse_calls = 0
        self.heartbeats_sent = 0
        self.heartbeat_failures = 0

        self._server = grpc.server(ThreadPoolExecutor(max_workers=2 * world_size + 16,
                                                      thread_name_prefix=f"ftclient-manager-{replica_id}"))
        pb_grpc.add_ManagerServiceServicer_to_server(_Servicer(self), self._server)
        self._port = self._bind(bind)
        self._server.start()

        self._stop = threading.Event()
        self._liveness: LivenessStream | None = None
        if liveness_interval is not None:
            self._liveness = LivenessStream(self._lighthouse, replica_id, keepalive_interval=liveness_interval,
                                            on_peer_died=on_peer_died).start()
        self._heartbeat_thread = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                                  name=f"ftclient-heartbeat-{replica_id}")
        self._heartbeat_thread.start()
        log.info("manager server for %s listening on %s (lighthouse %s, %s)", replica_id, self.address(),
                 self._lighthouse.describe(), self._lighthouse.job.describe())

    def _bind(self, bind: str) -> int:
        candidates = [bind]
        host, _, port = bind.rpartition(":")
        if host in ("[::]", "::"):
            candidates.append(f"0.0.0.0:{port}")  # no IPv6 on this host
        for addr in candidates:
            try:
                bound = self._server.add_insecure_port(addr)
            except RuntimeError:
                continue
            if bound:
                return bound
        raise OSError(f"manager server could not listen on {bind}")

    @property
    def replica_id(self) -> str:
        return self._replica_id

    @property
    def lighthouse(self) -> LighthouseClient:
        return self._lighthouse

    @property
    def liveness(self) -> LivenessStream | None:
        """The liveness stream (None when disabled)."""
        return self._liveness

    def address(self) -> str:
        """``http://hostname:port``: what other ranks and replica groups connect to."""
        return f"http://{self._hostname}:{self._port}"

    def shutdown(self) -> None:
        """Stop heartbeats and the server (idempotent). Waiting calls fail with CANCELLED."""
        self._stop.set()
        if self._liveness is not None:
            self._liveness.close()
        self._server.stop(grace=None)
        self._heartbeat_thread.join(timeout=5)
        self._lighthouse.close()

    # -- heartbeats -------------------------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        while not self._stop.is_set():
            live = self._liveness
            if live is not None and live.accepted:
                # The stream is the heartbeat. A unary one now could reach the leader after this
                # process died and the stream's close was seen, making it alive again.
                live.wait_down(timeout=1.0)
                continue
            try:
                self._lighthouse.heartbeat(self._replica_id, timeout=HEARTBEAT_TIMEOUT_S)
                self.heartbeats_sent += 1
            except Exception as e:  # noqa: BLE001 -- like torchft: log, rediscover, go on
                self.heartbeat_failures += 1
                if not self._stop.is_set():
                    log.debug("heartbeat for %s failed: %s", self._replica_id, e)
            self._stop.wait(self._heartbeat_interval)

    # -- Quorum -----------------------------------------------------------------------------------

    def _check_rank(self, group_rank: int) -> None:
        if not 0 <= group_rank < self._world_size:
            raise ManagerError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"group_rank {group_rank} is outside the replica group (world_size {self._world_size})")

    def quorum(self, req: pb.ManagerQuorumRequest, context: grpc.ServicerContext) -> pb.ManagerQuorumResponse:
        """The gRPC Quorum handler (other ranks, torchft's ManagerClient)."""
        timeout = context.time_remaining()
        try:
            self._check_rank(req.group_rank)
            if timeout is None or timeout > _NO_DEADLINE_S:
                raise ManagerError(grpc.StatusCode.INVALID_ARGUMENT, "missing timeout: Quorum needs a deadline")
            result = self.quorum_local(req.group_rank, req.step, req.checkpoint_metadata, req.shrink_only,
                                       timeout, req.commit_failures, req.init_sync, context.is_active)
        except ManagerError as e:
            context.abort(e.code, e.details)
        return result_to_response(result)

    def quorum_local(self, group_rank: int, step: int, checkpoint_metadata: str, shrink_only: bool,
                     timeout: float, commit_failures: int = 0, init_sync: bool = True,
                     is_active: Callable[[], bool] = _always_active) -> QuorumResult:
        """Quorum for one group rank, called directly (the rank in this process) or by the gRPC
        handler; raises :class:`ManagerError` with the status the gRPC caller gets."""
        self._check_rank(group_rank)
        deadline = _answer_deadline(timeout)
        member = pb.QuorumMember(replica_id=self._replica_id, address=self.address(),
                                 store_address=self._store_address, step=step, world_size=self._world_size,
                                 shrink_only=shrink_only, commit_failures=commit_failures)
        run = False
        with self._lock:
            self._checkpoint_metadata[group_rank] = checkpoint_metadata
            self._participants[group_rank] = member
            rnd = self._round
            if len(self._participants) == self._world_size:
                self._participants.clear()
                self._round = _Round()
                run = True
        if run:
            # The rank completing the set asks the lighthouse itself (it would wait anyway).
            log.info("[%s] all %d ranks joined: asking the lighthouse", self._replica_id, self._world_size)
            self._run_quorum(rnd, member, timeout, deadline)
        if not _wait(rnd.done, deadline, is_active):
            with self._lock:
                missing = sorted(set(range(self._world_size)) - set(self._participants)) if rnd is self._round else []
            raise ManagerError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"quorum for {self._replica_id} group_rank {group_rank} not ready within {timeout:.1f}s"
                               + (f" (group ranks not joined: {missing})" if missing
                                  else " (waiting for the lighthouse)"))
        if rnd.error is not None:
            raise ManagerError(*rnd.error)
        assert rnd.quorum is not None
        try:
            return compute_quorum_results(self._replica_id, group_rank, rnd.quorum, init_sync)
        except ReplicaNotInQuorum as e:
            raise ManagerError(grpc.StatusCode.NOT_FOUND, str(e)) from None

    def _run_quorum(self, rnd: _Round, member: pb.QuorumMember, timeout: float, deadline: Deadline) -> None:
        # ``timeout`` is the rank's; ``deadline`` a little before its end (see _ANSWER_MARGIN_S).
        # The lighthouse round ends a little earlier still, so that the waiting ranks receive its
        # explanation (endpoints, leader answers) rather than a bare "not ready in time".
        deadline = Deadline(deadline.at - min(0.1, 0.1 * timeout))
        pause = max(0.1, timeout / (self._quorum_retries + 1))
        attempts = 0
        try:
            for attempt in tenacity.Retrying(
                    stop=tenacity.stop_after_attempt(self._quorum_retries + 1) | stop_at(deadline),
                    wait=wait_within(deadline, tenacity.wait_fixed(pause)),
                    retry=tenacity.retry_if_exception_type(Exception), reraise=True):
                with attempt:
                    attempts += 1
                    self.lighthouse_calls += 1
                    try:
                        rnd.quorum = self._lighthouse.quorum_request(member, max(0.0, deadline.remaining()))
                    except Exception as e:
                        log.warning("[%s] lighthouse quorum attempt %d failed: %s", self._replica_id, attempts, e)
                        raise
        except TimeoutError as e:
            rnd.error = (grpc.StatusCode.DEADLINE_EXCEEDED,
                         f"no lighthouse quorum within the {timeout:g}s quorum timeout "
                         f"(TORCHFT_QUORUM_TIMEOUT_SEC) after {attempts - 1} retries: {e}")
        except Exception as e:  # noqa: BLE001 -- becomes every waiting rank's error
            rnd.error = (grpc.StatusCode.INTERNAL, f"lighthouse quorum failed after {attempts - 1} retries: {e}")
        else:
            if log.isEnabledFor(logging.INFO):
                log.info("[%s] lighthouse quorum %d: %s", self._replica_id, rnd.quorum.quorum_id,
                         [p.replica_id for p in rnd.quorum.participants])
        rnd.done.set()

    # -- CheckpointMetadata / ShouldCommit / Kill ------------------------------------------------

    def checkpoint_metadata(self, req: pb.CheckpointMetadataRequest,
                            context: grpc.ServicerContext) -> pb.CheckpointMetadataResponse:
        try:
            return pb.CheckpointMetadataResponse(checkpoint_metadata=self.checkpoint_metadata_local(req.rank))
        except ManagerError as e:
            context.abort(e.code, e.details)

    def checkpoint_metadata_local(self, rank: int) -> str:
        with self._lock:
            metadata = self._checkpoint_metadata.get(rank)
        if metadata is None:
            raise ManagerError(grpc.StatusCode.INVALID_ARGUMENT, f"rank not found: {rank}")
        return metadata

    def should_commit(self, req: pb.ShouldCommitRequest, context: grpc.ServicerContext) -> pb.ShouldCommitResponse:
        """The gRPC ShouldCommit handler."""
        try:
            decision = self.should_commit_local(req.group_rank, req.step, req.should_commit,
                                                context.time_remaining(), context.is_active)
        except ManagerError as e:
            context.abort(e.code, e.details)
        return pb.ShouldCommitResponse(should_commit=decision)

    def should_commit_local(self, group_rank: int, step: int, should_commit: bool, timeout: float | None,
                            is_active: Callable[[], bool] = _always_active) -> bool:
        """The ShouldCommit barrier for one group rank, called directly or by the gRPC handler."""
        self._check_rank(group_rank)
        deadline = _answer_deadline(_NO_DEADLINE_S if timeout is None else min(timeout, _NO_DEADLINE_S))
        with self._lock:
            c = self._commit
            c.voted.add(group_rank)
            if not should_commit:
                c.failed.add(group_rank)
            if len(c.voted) == self._world_size:
                c.decision = not c.failed
                self._commit = _CommitRound()
                c.done.set()
                log.info("[%s] should_commit step %d: %s", self._replica_id, step, c.decision)
        if not _wait(c.done, deadline, is_active):
            with self._lock:
                missing = sorted(set(range(self._world_size)) - c.voted)
            raise ManagerError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"should_commit for {self._replica_id}: group ranks {missing} did not vote in time")
        return c.decision

    def kill(self, req: pb.KillRequest, context: grpc.ServicerContext) -> pb.KillResponse:
        log.warning("[%s] got kill request: %s", self._replica_id, req.msg)
        # Answer first, so the caller knows the kill was accepted, then act.
        threading.Timer(0.05, self._on_kill, args=(req.msg,)).start()
        return pb.KillResponse()


class _Servicer(pb_grpc.ManagerServiceServicer):
    """Binds the generated service's method names to a ManagerServer."""

    def __init__(self, server: ManagerServer) -> None:
        self._s = server

    def Quorum(self, request, context):  # noqa: N802 -- gRPC method name
        return self._s.quorum(request, context)

    def CheckpointMetadata(self, request, context):  # noqa: N802
        return self._s.checkpoint_metadata(request, context)

    def ShouldCommit(self, request, context):  # noqa: N802
        return self._s.should_commit(request, context)

    def Kill(self, request, context):  # noqa: N802
        return self._s.kill(request, context)


class ManagerClient:
    """torchft's ``ManagerClient``: calls one manager server.

    Args:
        addr: ``http://host:port`` (or ``host:port``) of the manager server.
        connect_timeout: how long to wait for the connection in the constructor
            (``ConnectionError`` after that).
    """

    def __init__(self, addr: str, connect_timeout: timedelta | float = timedelta(seconds=60)) -> None:
        self._addr = _strip_scheme(addr)
        self._channel = grpc.insecure_channel(self._addr, options=_CHANNEL_OPTIONS)
        seconds = to_seconds(connect_timeout) or 0.0
        try:
            grpc.channel_ready_future(self._channel).result(timeout=seconds)
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise ConnectionError(f"manager server at {addr} not reachable within {seconds:g}s") from None
        self._stub = pb_grpc.ManagerServiceStub(self._channel)

    @property
    def address(self) -> str:
        return self._addr

    def close(self) -> None:
        self._channel.close()

    def _call(self, name: str, method: Callable, request: object, timeout: timedelta | float) -> object:
        seconds = to_seconds(timeout) or 0.0
        try:
            return method(request, timeout=seconds)
        except grpc.RpcError as e:
            code = e.code()
            msg = f"{name} to manager {self._addr} failed: {code.name}: {e.details()}"
            if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                raise TimeoutError(msg) from None
            raise RuntimeError(msg) from None

    def _quorum(self, group_rank: int, step: int, checkpoint_metadata: str, shrink_only: bool,
                timeout: timedelta | float, commit_failures: int = 0, init_sync: bool = True) -> QuorumResult:
        req = pb.ManagerQuorumRequest(group_rank=group_rank, step=step, checkpoint_metadata=checkpoint_metadata,
                                      shrink_only=shrink_only, init_sync=init_sync, commit_failures=commit_failures)
        resp = self._call("Quorum", self._stub.Quorum, req, timeout)
        assert isinstance(resp, pb.ManagerQuorumResponse)
        return result_from_response(resp)

    def _checkpoint_metadata(self, rank: int, timeout: timedelta | float) -> str:
        resp = self._call("CheckpointMetadata", self._stub.CheckpointMetadata,
                          pb.CheckpointMetadataRequest(rank=rank), timeout)
        assert isinstance(resp, pb.CheckpointMetadataResponse)
        return resp.checkpoint_metadata

    def should_commit(self, group_rank: int, step: int, should_commit: bool, timeout: timedelta | float) -> bool:
        resp = self._call("ShouldCommit", self._stub.ShouldCommit,
                          pb.ShouldCommitRequest(group_rank=group_rank, step=step, should_commit=should_commit),
                          timeout)
        assert isinstance(resp, pb.ShouldCommitResponse)
        return resp.should_commit

    def kill(self, msg: str, timeout: timedelta | float = timedelta(seconds=10)) -> None:
        """Ask the manager server's process to exit."""
        self._call("Kill", self._stub.Kill, pb.KillRequest(msg=msg), timeout)


class LocalManagerClient:
    """:class:`ManagerClient`'s interface for the rank whose process hosts the manager server:
    calls the server's logic directly, without a gRPC round trip through this process's own
    server (torchft does that round trip in Rust, off the GIL; in Python it cost ~1 ms a step).
    Same deadlines, same barriers, same errors (``TimeoutError`` for DEADLINE_EXCEEDED, else
    ``RuntimeError``, with the gRPC client's messages) as a remote rank gets over gRPC.
    """

    def __init__(self, server: ManagerServer) -> None:
        self._server = server
        self._addr = _strip_scheme(server.address())

    @property
    def address(self) -> str:
        return self._addr

    def close(self) -> None:
        pass  # the server belongs to its owner

    def _error(self, name: str, e: ManagerError) -> Exception:
        msg = f"{name} to manager {self._addr} failed: {e.code.name}: {e.details}"
        if e.code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
            return TimeoutError(msg)
        return RuntimeError(msg)

    def _quorum(self, group_rank: int, step: int, checkpoint_metadata: str, shrink_only: bool,
                timeout: timedelta | float, commit_failures: int = 0, init_sync: bool = True) -> QuorumResult:
        try:
            return self._server.quorum_local(group_rank, step, checkpoint_metadata, shrink_only,
                                             to_seconds(timeout) or 0.0, commit_failures, init_sync)
        except ManagerError as e:
            raise self._error("Quorum", e) from None

    def _checkpoint_metadata(self, rank: int, timeout: timedelta | float) -> str:
        try:
            return self._server.checkpoint_metadata_local(rank)
        except ManagerError as e:
            raise self._error("CheckpointMetadata", e) from None

    def should_commit(self, group_rank: int, step: int, should_commit: bool, timeout: timedelta | float) -> bool:
        try:
            return self._server.should_commit_local(group_rank, step, should_commit, to_seconds(timeout) or 0.0)
        except ManagerError as e:
            raise self._error("ShouldCommit", e) from None

    def kill(self, msg: str, timeout: timedelta | float = timedelta(seconds=10)) -> None:
        """Ask the manager server's process to exit."""
        self._server.kill(pb.KillRequest(msg=msg), None)  # type: ignore[arg-type]
