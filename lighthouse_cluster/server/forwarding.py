"""How calls travel to the leader: channels to peers, batched Quorum forwarding (both sides) and
heartbeat batching. Where each call goes is decided in ``routing.py``; this module only carries.

A follower forwards a Quorum call's bytes to the leader and relays the leader's bytes back
unparsed. Forwarding is batched (docs/design/follower-forwarding.md): each follower keeps one
``LighthouseQuorumForwarding/ForwardQuorums`` stream to the leader (``QuorumForwarder``). The
Quorum calls that reach the follower within ``FORWARD_BATCH_WINDOW_S`` travel in one message
(the first after a quiet spell at once); the leader (``QuorumForwardingService``) registers each
with its coordinator exactly as a direct call (same deadline, same "withdraw if cancelled
unanswered" rule) and sends each issued round's response once, with the keys of every forwarded
call it answers; the follower fans it out. A caller that goes away is withdrawn with a message on
the same stream. So the leader handles a handful of stream messages per follower and round
instead of one gRPC call per replica group, and a waiting call is one future on each side (no
task). A leader without the stream service (an older node) gets plain forwarded
calls carrying ``FORWARDED_HEADER``.

Heartbeats are fire-and-forget in torchft (every 100 ms, no deadline): a follower acknowledges
them at once and forwards the ids it saw in one batch per ``HEARTBEAT_FLUSH_S`` to the leader
(``HeartbeatBatcher``). The first heartbeat of a replica the follower has not forwarded recently
goes out with the next batch, at most ``HEARTBEAT_MIN_GAP_S`` after the last one rather than
``HEARTBEAT_FLUSH_S``: a replica that just started must count as healthy at the leader as early
as it would with a single lighthouse, or a round already in progress could leave it out.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import grpc

from lighthouse_cluster.core.jobs import DEFAULT_JOB, JOB_HEADER
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.tls import ClientTLS, aio_channel

log = logging.getLogger(__name__)

FORWARDED_HEADER = "x-lighthouse-cluster-forwarded-by"
QUORUM_METHOD = "/torchft.LighthouseService/Quorum"
FORWARD_HEARTBEATS_METHOD = "/lighthouse_cluster.LighthouseCluster/ForwardHeartbeats"
FORWARD_QUORUMS_SERVICE = "lighthouse_cluster.LighthouseQuorumForwarding"
FORWARD_QUORUMS_METHOD = f"/{FORWARD_QUORUMS_SERVICE}/ForwardQuorums"
# A forwarded call the leader has not answered this long after the caller's deadline fails here
# (a hung leader): as a plain forwarded call's own deadline would have.
FORWARD_SLACK_S = 0.5
# Forwarded calls go to the leader at most this often per stream (the rest wait for the next
# message); the first after a quiet spell goes at once.
FORWARD_BATCH_WINDOW_S = 0.002
HEARTBEAT_FLUSH_S = 0.05
# Two batches of heartbeats go out at least this far apart, a new replica's included.
HEARTBEAT_MIN_GAP_S = 0.01
HEARTBEAT_BATCH_TIMEOUT_S = 1.0
# A replica not forwarded for this long is treated as new: its next heartbeat goes with the next
# batch, HEARTBEAT_MIN_GAP_S after the last one at most, not HEARTBEAT_FLUSH_S.
NEW_REPLICA_AFTER_S = 1.0

# Channel options shared by every node-to-node channel: fail fast on a dead peer.
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 500),
    ("grpc.keepalive_time_ms", 10_000),
]


def _identity(x: bytes) -> bytes:
    return x


class PeerChannels:
    """One long-lived grpc.aio channel per peer client address."""

    def __init__(self, tls: ClientTLS | None = None) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._tls = tls  # None: plaintext; else how to dial peers' TLS client ports

    def get(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = aio_channel(address, self._tls, CHANNEL_OPTIONS)
            self._channels[address] = ch
        return ch

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close(grace=None)
        self._channels.clear()


def forward_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a forwarded call fails with: what a plain forwarded gRPC call would raise."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


_CODE_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}


def failure_as_is(error: BaseException) -> grpc.aio.AioRpcError:
    """A forwarded call's failure as a status: an ``grpc.aio.AioRpcError``'s own, else INTERNAL."""
    if isinstance(error, grpc.aio.AioRpcError):
        return error
    return forward_error(grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}")


class QuorumForwarder:
    """Follower side: forwards raw ``LighthouseQuorumRequest``s to the leader and returns its raw
    responses, over one batched stream per leader (see the module docstring)."""

    def __init__(self, channels: PeerChannels, node_id: str) -> None:
        self._channels = channels
        self._node_id = node_id
        self._metadata = ((FORWARDED_HEADER, node_id),)
        self._streams: dict[str, _ForwardStream] = {}
        self._unary_only: set[str] = set()  # leaders without the stream service
        self.streams_opened = 0
        self.messages_sent = 0  # stream messages the forwarded calls (and withdrawals) went in

    def forward(self, leader_address: str, request: bytes, timeout: float | None,
                job: str = DEFAULT_JOB) -> asyncio.Future[bytes]:
        """A future of the leader's response to ``request`` (a Quorum call of ``job``); it fails
        with ``grpc.aio.AioRpcError`` as a forwarded gRPC call with deadline ``timeout`` would.
        Cancelling it withdraws the request.

        A future, not a coroutine: a follower holds one per waiting call (thousands at large N),
        and the stream answers it directly, with no task or wrapper per call
        (docs/design/follower-forwarding.md)."""
        if leader_address in self._unary_only:
            return asyncio.ensure_future(self._forward_unary(leader_address, request, timeout, job))
        stream = self._streams.get(leader_address)
        if stream is None or stream.closed:
            stream = _ForwardStream(self, leader_address)
            self._streams[leader_address] = stream
            self.streams_opened += 1
        return stream.request(request, timeout, job)

    def _stream_failed(self, leader_address: str, error: grpc.aio.AioRpcError, heard: bool) -> bool:
        """Whether the calls a stream to ``leader_address`` was carrying when it failed with
        ``error`` go to the leader one by one instead (else they fail with ``error``)."""
        if error.code() == grpc.StatusCode.INTERNAL and not heard:
            # The stream failed in this process before the leader said anything: gRPC reports a
            # message write that lost the race with the leader's "no such method" as INTERNAL,
            # hiding the UNIMPLEMENTED. The leader withdraws whatever the stream registered when it
            # ends, so these calls go plain; the next call opens a new stream.
            log.info("forwarding stream to %s failed before any answer (%s); forwarding its calls one by one",
                     leader_address, error.details())
            return True
        if error.code() == grpc.StatusCode.UNIMPLEMENTED:
            log.info("leader %s has no batched forwarding; forwarding calls one by one", leader_address)
            self._unary_only.add(leader_address)
            return True
        return False

    def _relay_unary(self, answer: asyncio.Future[bytes], leader_address: str, request: bytes,
                     timeout: float | None, job: str) -> None:
        """Forward ``request`` as a plain call and settle ``answer`` with its outcome (cancelling
        ``answer`` cancels the call)."""
        call = asyncio.ensure_future(self._forward_unary(leader_address, request, timeout, job))

        def settle(done: asyncio.Future[bytes]) -> None:
            if answer.done():
                if not done.cancelled():
                    done.exception()  # retrieved: the answer was given up on
            elif done.cancelled():
                answer.cancel()
            elif done.exception() is not None:
                answer.set_exception(done.exception())  # type: ignore[arg-type]
            else:
                answer.set_result(done.result())

        call.add_done_callback(settle)
        answer.add_done_callback(lambda a: call.cancel() if a.cancelled() else None)

    async def _forward_unary(self, leader_address: str, request: bytes, timeout: float | None,
                             job: str = DEFAULT_JOB) -> bytes:
        call = self._channels.get(leader_address).unary_unary(
            QUORUM_METHOD, request_serializer=_identity, response_deserializer=_identity)
        metadata = self._metadata if job == DEFAULT_JOB else self._metadata + ((JOB_HEADER, job),)
        return await call(request, timeout=timeout, metadata=metadata, wait_for_ready=False)

    def close(self) -> None:
        for stream in list(self._streams.values()):
            stream.close("forwarder closed")
        self._streams.clear()


@dataclass(slots=True)
class _Forwarded:
    """A call on a forwarding stream, until the leader answers it."""

    answer: asyncio.Future[bytes]
    request: bytes
    job: str
    deadline: float | None  # the event loop's time; None: no deadline
    timer: asyncio.TimerHandle | None


class _ForwardStream:
    """One ``ForwardQuorums`` stream from this follower to one leader.

    A writer task sends the calls (and withdrawals) that came in since its last message as one
    message, at most every ``FORWARD_BATCH_WINDOW_S``: a call after a quiet spell goes at once, the
    calls of a round, which arrive over a few ms, share messages."""

    def __init__(self, owner: QuorumForwarder, leader: str) -> None:
        self._owner = owner
        self._leader = leader
        self._loop = asyncio.get_running_loop()
        self._keys = itertools.count(1)
        self._pending: dict[int, _Forwarded] = {}
        self._adds: list[cpb.ForwardedQuorum] = []
        self._withdraws: list[int] = []
        self._wake: asyncio.Future[None] | None = None  # the writer waits on it while it has nothing to send
        self.closed = False
        self.heard = False  # whether the leader sent any message on this stream
        call = owner._channels.get(leader).stream_stream(
            FORWARD_QUORUMS_METHOD, request_serializer=cpb.QuorumForwardUp.SerializeToString,
            response_deserializer=cpb.QuorumForwardDown.FromString)
        self._call = call(metadata=owner._metadata, wait_for_ready=False)
        self._reader = self._loop.create_task(self._read())
        self._writer = self._loop.create_task(self._write())

    def request(self, raw: bytes, timeout: float | None, job: str = DEFAULT_JOB) -> asyncio.Future[bytes]:
        key = next(self._keys)
        answer: asyncio.Future[bytes] = self._loop.create_future()
        add = cpb.ForwardedQuorum(key=key, request=raw, job="" if job == DEFAULT_JOB else job)
        deadline = timer = None
        if timeout is not None:
            add.has_deadline = True
            add.timeout_ms = max(0, int(timeout * 1000))
            deadline = self._loop.time() + timeout
            timer = self._loop.call_later(timeout + FORWARD_SLACK_S, self._expire, key)
        self._pending[key] = _Forwarded(answer, raw, job, deadline, timer)
        answer.add_done_callback(lambda a: self._settled(key, a))
        self._adds.append(add)
        self._kick()
        return answer

    def _settled(self, key: int, answer: asyncio.Future[bytes]) -> None:
        forwarded = self._pending.pop(key, None)
        if forwarded is None:
            return  # answered, expired or failed: already out of the table
        if forwarded.timer is not None:
            forwarded.timer.cancel()
        if answer.cancelled() and not self.closed:  # its caller went away: withdrawn at the leader
            self._withdraws.append(key)
            self._kick()

    def _expire(self, key: int) -> None:
        forwarded = self._pending.pop(key, None)
        # Still registered at the leader, as a timed-out call is (torchft keeps it for the round).
        if forwarded is not None and not forwarded.answer.done():
            forwarded.answer.set_exception(forward_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def _kick(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def _write(self) -> None:
        last = float("-inf")
        try:
            while not self.closed:
                if not (self._adds or self._withdraws):
                    self._wake = self._loop.create_future()
                    await self._wake
                    continue
                wait = last + FORWARD_BATCH_WINDOW_S - self._loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                    continue
                last = self._loop.time()
                msg = cpb.QuorumForwardUp(from_node=self._owner._node_id, add=self._adds, withdraw=self._withdraws)
                self._adds, self._withdraws = [], []
                self._owner.messages_sent += 1
                await self._call.write(msg)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the call ended: the reader sees how, and fails or re-sends what is pending

    def _answer(self, key: int) -> asyncio.Future[bytes] | None:
        forwarded = self._pending.pop(key, None)
        if forwarded is None or forwarded.answer.done():
            return None
        if forwarded.timer is not None:
            forwarded.timer.cancel()
        return forwarded.answer

    async def _read(self) -> None:
        error: grpc.aio.AioRpcError
        try:
            async for down in self._call:
                self.heard = True
                if down.keys:
                    response = down.response
                    for key in down.keys:
                        answer = self._answer(key)
                        if answer is not None:
                            answer.set_result(response)
                for err in down.errors:
                    answer = self._answer(err.key)
                    if answer is not None:
                        # One call's failure, whatever its status: only the stream's own failure
                        # sends calls plainly (``_stream_failed``).
                        code = _CODE_BY_VALUE.get(err.code, grpc.StatusCode.UNKNOWN)
                        answer.set_exception(forward_error(code, err.details))
            error = forward_error(grpc.StatusCode.UNAVAILABLE, f"forwarding stream to {self._leader} ended")
        except grpc.aio.AioRpcError as e:
            error = e
        except asyncio.CancelledError:
            error = forward_error(grpc.StatusCode.UNAVAILABLE, f"forwarding stream to {self._leader} closed")
        self._fail_all(error)

    def _fail_all(self, error: grpc.aio.AioRpcError) -> None:
        self.closed = True
        pending, self._pending = self._pending, {}
        unary = bool(pending) and self._owner._stream_failed(self._leader, error, self.heard)
        now = self._loop.time()
        for forwarded in pending.values():
            if forwarded.timer is not None:
                forwarded.timer.cancel()
            if forwarded.answer.done():
                continue
            if unary:
                left = None if forwarded.deadline is None else max(0.0, forwarded.deadline - now)
                self._owner._relay_unary(forwarded.answer, self._leader, forwarded.request, left, forwarded.job)
            else:
                forwarded.answer.set_exception(error)
        self._kick()

    def close(self, why: str) -> None:
        if self.closed:
            return
        self._call.cancel()
        self._reader.cancel()
        self._writer.cancel()
        self._fail_all(forward_error(grpc.StatusCode.UNAVAILABLE, why))


class QuorumForwardingService:
    """Leader side of ``ForwardQuorums``: each forwarded call is answered by ``answer(raw,
    timeout, job)`` (``routing.Router.answer_forwarded``: registers with the coordinator, withdrawn
    if the call ends unanswered), a future (or a coroutine, run as a task); answers of one round go
    out in one message; a withdrawn key, or the stream ending, cancels it (which withdraws the
    registration, as a cancelled forwarded call does). A failed answer's status is
    ``failure(error)`` (by default :func:`failure_as_is`)."""

    def __init__(self, answer: Callable[[bytes, float | None, str], Awaitable[bytes]],
                 failure: Callable[[BaseException], grpc.aio.AioRpcError] | None = None) -> None:
        self._answer = answer
        self._failure = failure or failure_as_is
        self.streams = 0
        self.forwarded_calls = 0
        self.messages_in = 0
        self.messages_out = 0

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(FORWARD_QUORUMS_SERVICE, {
            "ForwardQuorums": grpc.stream_stream_rpc_method_handler(
                self.forward_quorums, request_deserializer=cpb.QuorumForwardUp.FromString,
                response_serializer=cpb.QuorumForwardDown.SerializeToString),
        })

    async def forward_quorums(self, requests, context: grpc.aio.ServicerContext) -> None:  # type: ignore[no-untyped-def]
        loop = asyncio.get_running_loop()
        waiting: dict[int, asyncio.Future[bytes]] = {}
        answered: dict[bytes, list[int]] = {}
        errors: list[cpb.ForwardedQuorumError] = []
        outbox: asyncio.Queue[cpb.QuorumForwardDown] = asyncio.Queue()
        flush_scheduled = False
        self.streams += 1

        def flush() -> None:
            nonlocal flush_scheduled, answered, errors
            flush_scheduled = False
            for response, keys in answered.items():
                outbox.put_nowait(cpb.QuorumForwardDown(response=response, keys=keys))
            if errors:
                outbox.put_nowait(cpb.QuorumForwardDown(errors=errors))
            answered, errors = {}, []

        def done(key: int, answer: asyncio.Future[bytes]) -> None:
            nonlocal flush_scheduled
            if waiting.pop(key, None) is None or answer.cancelled():
                return  # withdrawn
            e = answer.exception()
            if e is None:
                # Every requester of a round gets the same bytes object: one message per round.
                answered.setdefault(answer.result(), []).append(key)
            else:
                status = self._failure(e)
                errors.append(cpb.ForwardedQuorumError(key=key, code=status.code().value[0],
                                                       details=status.details() or ""))
            if not flush_scheduled:
                flush_scheduled = True
                loop.call_soon(flush)

        async def read() -> None:
            async for up in requests:
                self.messages_in += 1
                for add in up.add:
                    self.forwarded_calls += 1
                    answer = asyncio.ensure_future(self._answer(
                        add.request, add.timeout_ms / 1000.0 if add.has_deadline else None, add.job or DEFAULT_JOB))
                    waiting[add.key] = answer
                    answer.add_done_callback(lambda a, k=add.key: done(k, a))
                for key in up.withdraw:
                    answer = waiting.pop(key, None)
                    if answer is not None:
                        answer.cancel()

        reader = loop.create_task(read())
        try:
            while True:
                get = loop.create_task(outbox.get())
                finished, _ = await asyncio.wait({get, reader}, return_when=asyncio.FIRST_COMPLETED)
                if get in finished:
                    self.messages_out += 1
                    await context.write(get.result())
                    continue
                get.cancel()
                break  # the follower closed its side: nothing more to answer on this stream
        finally:
            reader.cancel()
            for answer in list(waiting.values()):
                answer.cancel()
            waiting.clear()


class HeartbeatBatcher:
    """Collects heartbeat replica ids on a follower and forwards them to the leader in batches
    (one message per job)."""

    def __init__(self, channels: PeerChannels, node_id: str, leader_address: Callable[[], str | None]) -> None:
        self._channels = channels
        self._node_id = node_id
        self._leader_address = leader_address
        self._pending: set[tuple[str, str]] = set()  # (job, replica id)
        self._last_sent: dict[tuple[str, str], float] = {}
        self._urgent = asyncio.Event()
        self._flushed_at = float("-inf")  # time.monotonic() of the last batch
        self._added = asyncio.Event()  # set by add(): the task idles until there is something to send
        self._task: asyncio.Task[None] | None = None
        self._in_flight: set[asyncio.Task[None]] = set()
        self.forwarded = 0  # heartbeats the leader took
        self.batches = 0  # batches sent (one call per job in each)
        self.failed_batches = 0

    def add(self, replica_id: str, job: str = DEFAULT_JOB) -> None:
        key = (job, replica_id)
        self._pending.add(key)
        self._added.set()
        last = self._last_sent.get(key)
        if last is None or time.monotonic() - last > NEW_REPLICA_AFTER_S:
            self._urgent.set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        for task in list(self._in_flight):
            task.cancel()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        while True:
            if not self._pending:  # idle: no timer until a heartbeat arrives
                self._added.clear()
                await self._added.wait()
            try:
                await asyncio.wait_for(self._urgent.wait(), HEARTBEAT_FLUSH_S)
            except asyncio.TimeoutError:
                pass
            self._urgent.clear()
            # Urgent or not, batches go out at most every HEARTBEAT_MIN_GAP_S: where every
            # replica's heartbeats come more than NEW_REPLICA_AFTER_S apart (a follower short of
            # CPU), each would otherwise be urgent and go out alone
            # (docs/design/heartbeat-batching.md).
            wait = self._flushed_at + HEARTBEAT_MIN_GAP_S - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not self._pending:
                continue
            leader = self._leader_address()
            if leader is None:
                await asyncio.sleep(HEARTBEAT_FLUSH_S)
                continue  # keep them for when a leader is known
            pending, self._pending = self._pending, set()
            now = self._flushed_at = time.monotonic()
            self.batches += 1
            by_job: dict[str, set[str]] = {}
            for key in pending:
                self._last_sent[key] = now
                by_job.setdefault(key[0], set()).add(key[1])
            if len(self._last_sent) > 4 * len(pending) + 1024:
                self._last_sent = {r: t for r, t in self._last_sent.items() if now - t <= NEW_REPLICA_AFTER_S}
            # Each batch is its own task, so a leader that stopped answering never holds up the
            # batches for the next one.
            for job, batch in by_job.items():
                task = asyncio.get_running_loop().create_task(self._send(leader, batch, job))
                self._in_flight.add(task)
                task.add_done_callback(self._in_flight.discard)

    async def _send(self, leader: str, batch: set[str], job: str = DEFAULT_JOB) -> None:
        call = self._channels.get(leader).unary_unary(
            FORWARD_HEARTBEATS_METHOD,
            request_serializer=cpb.HeartbeatBatch.SerializeToString,
            response_deserializer=cpb.HeartbeatBatchResponse.FromString)
        try:
            await call(cpb.HeartbeatBatch(from_node=self._node_id, replica_ids=sorted(batch),
                                          job="" if job == DEFAULT_JOB else job),
                       timeout=HEARTBEAT_BATCH_TIMEOUT_S)
            self.forwarded += len(batch)
        except grpc.aio.AioRpcError as e:
            self.failed_batches += 1
            log.debug("heartbeat batch to %s failed: %s", leader, e.code())
            # Not re-queued: a late heartbeat would overstate how recently the replica was alive,
            # and its next one arrives within 100 ms.
