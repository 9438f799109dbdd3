"""A replica group's liveness stream to the lighthouse cluster (``LighthouseCluster.Watch``).

One :class:`LivenessStream` runs per replica group, in the process that talks to the lighthouse
(group rank 0, next to the manager server's heartbeat loop), on a background thread:

* it opens ``Watch`` to the Raft leader the :class:`~ftclient.lighthouse_client.LighthouseClient`
  knows (discovering it when none is known), names the replica in the first message and then
  sends an empty keep-alive every ``keepalive_interval`` (100 ms by default);
* the leader answers ``accepted``: from then on the stream *is* the replica's heartbeat. The
  leader declares the replica dead the moment the stream closes (a process that dies closes its
  sockets at once) or when keep-alives stop for its liveness timeout (500 ms by default);
* while a stream is accepted, :attr:`LivenessStream.accepted` is True and the manager server
  sends no unary heartbeats: a unary heartbeat still in flight when the process dies could reach
  the leader after the stream's close and make the dead replica alive again. They resume the
  moment the stream is down (:meth:`LivenessStream.wait_down` wakes the heartbeat loop);
* the leader may push ``peer_died`` (another member of a quorum this replica belongs to died):
  the notice goes to ``on_peer_died`` (the Manager fails that quorum's collectives);
* the stream follows the leader: when it breaks (the leader died, stepped down, or a follower
  refused it with FAILED_PRECONDITION) the leader is rediscovered and a new stream opened after
  a short backoff (tenacity, 50 ms doubling to 500 ms; reset once a stream was accepted); when
  another call of the same client found a newer leader (a leader that hangs closes nothing), the
  stream is moved there;
* a lighthouse without the RPC (torchft's Rust lighthouse, an older cluster: UNIMPLEMENTED, or a
  single lighthouse without the cluster service) keeps today's behaviour silently: unary
  heartbeats only; it is asked again every ``unsupported_retry`` (a cluster may be upgraded);
* the stream belongs to the client's job: Watch carries the same ``x-lighthouse-job``
  metadata as its Quorum and Heartbeat calls (none for the default job), so the leader watches the
  replica, and sends it notices, within that job only. A job the cluster does not know
  (NOT_FOUND) is logged and asked again every ``unsupported_retry``, unary heartbeats meanwhile.

Nothing here decides anything about quorums: the stream only feeds the leader's health input and
carries its notices.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import grpc
import tenacity

from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import lighthouse_cluster_pb2_grpc as cpb_grpc

from ._timeouts import to_seconds
from .lighthouse_client import LighthouseClient, Target

__all__ = ["DEFAULT_KEEPALIVE_INTERVAL", "LivenessStream", "PeerDied", "PeerDiedError"]

log = logging.getLogger(__name__)

DEFAULT_KEEPALIVE_INTERVAL = timedelta(milliseconds=100)

# Between attempts to open a stream: 50 ms doubling to 500 ms, plus up to 50 ms of jitter.
_BACKOFF = tenacity.wait_exponential(multiplier=0.05, max=0.5) + tenacity.wait_random(0, 0.05)


@dataclass(frozen=True)
class PeerDied:
    """The leader's notice: ``replica_ids``, members of quorum ``quorum_id``, died."""

    quorum_id: int
    replica_ids: tuple[str, ...]
    reason: str

    def describe(self) -> str:
        return f"{', '.join(self.replica_ids) or '?'} of quorum {self.quorum_id} died ({self.reason})"


class PeerDiedError(RuntimeError):
    """The error a step records when a peer of its quorum died (see :class:`PeerDied`)."""

    def __init__(self, notice: PeerDied) -> None:
        super().__init__(f"peer replica group {notice.describe()}: the quorum's collectives were "
                         "aborted; the step will not commit and the next quorum goes on without it")
        self.notice = notice


class _Unsupported(Exception):
    """The lighthouse has no liveness streams (UNIMPLEMENTED, or no cluster service)."""


class _StreamDown(Exception):
    """No stream could be opened or kept: retry after a backoff."""


@dataclass
class _Stream:
    """One Watch call and what its threads share."""

    target: Target
    done: threading.Event = field(default_factory=threading.Event)
    call: Any = None
    accepted: bool = False
    cancel_reason: str = ""

    def cancel(self, reason: str) -> None:
        self.cancel_reason = self.cancel_reason or reason
        self.done.set()
        if self.call is not None:
            self.call.cancel()


class LivenessStream:
    """See the module docstring.

    Args:
        lighthouse: the replica group's lighthouse client (shared with its Quorum and Heartbeat
            calls: they find the leader for each other).
        replica_id: the replica group's id in the lighthouse (the one its Quorum calls use).
        keepalive_interval: how often a keep-alive is sent (the leader's liveness timeout, 500 ms
            by default, should be several of these).
        on_peer_died: called on the stream's thread with every ``peer_died`` notice; an exception
            it raises is logged.
        unsupported_retry: after a lighthouse answered that it has no liveness streams, how long
            until it is asked again.
        accept_timeout: a stream not accepted within this long is given up and reopened.
        discover_timeout: how long one attempt looks for the leader when none is known.
    """

    def __init__(self, lighthouse: LighthouseClient, replica_id: str, *,
                 keepalive_interval: timedelta | float = DEFAULT_KEEPALIVE_INTERVAL,
                 on_peer_died: Callable[[PeerDied], None] | None = None,
                 unsupported_retry: timedelta | float = 30.0, accept_timeout: timedelta | float = 5.0,
                 discover_timeout: timedelta | float = 2.0) -> None:
        interval = to_seconds(keepalive_interval)
        if interval is None or interval <= 0:
            raise ValueError(f"keepalive_interval must be positive, got {keepalive_interval!r}")
        self._lighthouse = lighthouse
        self._replica_id = replica_id
        self._interval = interval
        self._on_peer_died = on_peer_died
        self._unsupported_retry = to_seconds(unsupported_retry) or 30.0
        self._accept_timeout = to_seconds(accept_timeout) or 5.0
        self._discover_timeout = to_seconds(discover_timeout) or 2.0

        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._accepted = False
        self._stream: _Stream | None = None
        self._thread: threading.Thread | None = None
        self.state = "starting"  # starting | connecting | accepted | unsupported | closed
        self.accepted_by: cpb.WatchAccepted | None = None  # the last acceptance (leader, term, timeout)
        self.streams_opened = 0
        self.streams_accepted = 0
        self.notices = 0

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> "LivenessStream":
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"ftclient-liveness-{self._replica_id}")
                self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Close the stream (the leader then declares this replica gone) and stop the thread."""
        self._stop.set()
        with self._cond:
            stream = self._stream
            self._cond.notify_all()
        if stream is not None:
            stream.cancel("closing")
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self._set_state("closed")

    def __enter__(self) -> "LivenessStream":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- state ------------------------------------------------------------------------------------

    @property
    def accepted(self) -> bool:
        """Whether a stream is open and accepted by the leader (it is the replica's heartbeat)."""
        return self._accepted

    @property
    def keepalive_interval(self) -> float:
        return self._interval

    def wait_accepted(self, timeout: float) -> bool:
        """Until a stream is accepted (True) or ``timeout`` seconds passed (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._accepted, timeout)

    def wait_down(self, timeout: float) -> bool:
        """Until no stream is accepted or the stream is closed (True), or ``timeout`` (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._accepted or self._stop.is_set(), timeout)

    def _set_state(self, state: str) -> None:
        with self._cond:
            self.state = state

    def _set_accepted(self, stream: _Stream, accepted: cpb.WatchAccepted) -> None:
        with self._cond:
            if self._stream is not stream or self._stop.is_set():
                return
            stream.accepted = True
            self._accepted = True
            self.accepted_by = accepted
            self.state = "accepted"
            self.streams_accepted += 1
            self._cond.notify_all()
        log.info("liveness stream of %s accepted by leader %s (%s, term %d, liveness timeout %d ms): "
                 "unary heartbeats paused", self._replica_id, accepted.leader_id, stream.target.address,
                 accepted.term, accepted.liveness_timeout_ms)

    def _set_down(self, stream: _Stream) -> None:
        with self._cond:
            if self._stream is stream:
                self._stream = None
            if stream.accepted:
                self._accepted = False
                self._cond.notify_all()

    # -- the thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for attempt in tenacity.Retrying(retry=tenacity.retry_if_exception_type(_StreamDown),
                                                 wait=_BACKOFF, sleep=self._stop.wait,
                                                 stop=lambda _: self._stop.is_set(), reraise=True):
                    with attempt:
                        self._one_stream()
            except _StreamDown:
                pass  # closing
            except _Unsupported as e:
                self._set_state("unsupported")
                log.debug("no liveness stream for %s (%s): unary heartbeats only; asking again in %gs",
                          self._replica_id, e, self._unsupported_retry)
                self._stop.wait(self._unsupported_retry)
            except Exception:  # noqa: BLE001 -- never let the thread die: notices would stop for good
                if self._stop.is_set():
                    break  # e.g. the lighthouse client was closed under it
                log.exception("liveness stream of %s failed unexpectedly; retrying", self._replica_id)
                self._stop.wait(0.5)

    def _target(self) -> Target:
        target = self._lighthouse.target
        if target is None:
            try:
                target = self._lighthouse.discover(self._discover_timeout)
            except ConnectionError as e:
                raise _StreamDown(str(e)) from None
        if not target.cluster:
            raise _Unsupported("a single lighthouse without the cluster service")
        if not hasattr(cpb, "WatchRequest"):
            raise _Unsupported("this ftclient's generated stubs have no Watch")
        return target

    def _one_stream(self) -> None:
        """Run one stream until it ends. Returns when an accepted stream ended (reconnect at
        once), raises ``_StreamDown`` when none was accepted (reconnect after a backoff)."""
        self._set_state("connecting")
        target = self._target()
        stream = _Stream(target)
        with self._cond:
            if self._stop.is_set():
                raise _StreamDown("closing")
            self._stream = stream
        stub = cpb_grpc.LighthouseClusterStub(self._lighthouse._channel(target.address))
        why = "the leader ended the stream"
        try:
            stream.call = stub.Watch(self._requests(stream), metadata=self._lighthouse.call_metadata)
            self.streams_opened += 1
            if stream.done.is_set():  # cancelled before the call existed
                stream.call.cancel()
            for event in stream.call:
                kind = event.WhichOneof("event")
                if kind == "accepted":
                    self._set_accepted(stream, event.accepted)
                elif kind == "peer_died":
                    self._deliver(event.peer_died)
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.UNIMPLEMENTED:
                raise _Unsupported(f"{target.address} answered UNIMPLEMENTED") from None
            if code == grpc.StatusCode.INVALID_ARGUMENT:  # e.g. a keep-alive interval over the timeout
                log.warning("the leader refused the liveness stream of %s: %s; unary heartbeats only",
                            self._replica_id, e.details())
                raise _Unsupported(f"INVALID_ARGUMENT: {e.details()}") from None
            if code == grpc.StatusCode.NOT_FOUND:  # the job is unknown (it may be created later)
                log.warning("no liveness stream for %s: %s; unary heartbeats only", self._replica_id, e.details())
                raise _Unsupported(f"NOT_FOUND: {e.details()}") from None
            why = stream.cancel_reason if (code == grpc.StatusCode.CANCELLED and stream.cancel_reason) \
                else f"{code.name}: {e.details()}"
        finally:
            stream.done.set()
            self._set_down(stream)
        if self._stop.is_set():
            raise _StreamDown("closing")
        if not stream.cancel_reason:
            # The leader ended or refused it (died, stepped down, not the leader): look again.
            self._lighthouse._forget(target)
        if stream.accepted:
            log.info("liveness stream of %s to %s ended (%s): unary heartbeats resume; reconnecting",
                     self._replica_id, target.address, why)
            return
        log.debug("liveness stream of %s to %s not accepted: %s", self._replica_id, target.address, why)
        raise _StreamDown(why)

    def _requests(self, stream: _Stream) -> Iterator[cpb.WatchRequest]:
        """The request side of one stream, consumed by gRPC on its own thread: the replica id,
        then a keep-alive every interval. Also moves the stream to a newer leader found by the
        client's other calls, and gives up a stream not accepted in time."""
        yield cpb.WatchRequest(replica_id=self._replica_id,
                               keepalive_interval_ms=max(1, round(self._interval * 1000)))
        opened = time.monotonic()
        while not stream.done.wait(self._interval):
            current = self._lighthouse.target
            if (current is not None and current.cluster and current.address != stream.target.address
                    and current.term > stream.target.term):
                log.info("liveness stream of %s moves to the newer leader %s (term %d)", self._replica_id,
                         current.address, current.term)
                stream.cancel(f"a newer leader {current.address} was found")
                return
            if not stream.accepted and time.monotonic() - opened > self._accept_timeout:
                stream.cancel(f"not accepted within {self._accept_timeout:g}s")
                return
            yield cpb.WatchRequest()

    def _deliver(self, notice: cpb.PeerDied) -> None:
        self.notices += 1
        died = PeerDied(quorum_id=notice.quorum_id, replica_ids=tuple(notice.replica_ids), reason=notice.reason)
        if self._on_peer_died is None:
            log.info("liveness notice for %s: %s", self._replica_id, died.describe())
            return
        try:
            self._on_peer_died(died)
        except Exception:  # noqa: BLE001 -- the stream (the heartbeat) must go on
            log.exception("handling the liveness notice %s failed", died.describe())
