"""Simulated replica groups: torchft's lighthouse traffic without a trainer.

The one definition of "a replica group talking torchft's lighthouse protocol", as a torchft
manager server does it: heartbeats every 100 ms and one Quorum call per step with a deadline,
through one node's client address (any node works: followers forward). This module owns

* the requester a group sends (``requester``: replica id, placeholder addresses, step);
* what a failed call means (``classify``): ``FAILED`` when it certainly had no effect (the
  connection was refused, the request was invalid), else ``UNKNOWN`` (a timed-out Quorum call
  may still have been committed);
* when a group that knows several nodes moves to the next one (``move_on``: ``STAY``,
  ``ON_UNAVAILABLE``, ``ON_NOT_SENT``, ``ON_ANY_ERROR``; ``next_endpoint``);
* ``SimulatedReplicaGroup``: the heartbeat loop and the quorum rounds, each round a
  ``RoundResult`` (kept in ``rounds`` and passed to ``on_round``), each heartbeat a
  ``HeartbeatResult`` (``on_heartbeat``); ``on_send`` is told just before each call goes out.

Used by ``up --demo`` (``demo.py``), the fault-injection clients (``jepsen_like.clients``
records every call in its history through the three hooks), the tests (``tests/admin_support
.quorum_call`` and the cluster, partition, clock and proxy tests). Not by the benchmark load
generator (``benchmarks/loadgen.py``), which drives hundreds of groups over several processes
with pre-serialized raw-bytes requests so that it is not the bottleneck.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Sequence

import grpc

from lighthouse_cluster.core.jobs import JOB_HEADER
from lighthouse_cluster.proto import torchft_pb2 as pb
from lighthouse_cluster.proto import torchft_pb2_grpc as pb_grpc
from lighthouse_cluster.tls import ClientTLS, aio_channel

# The outcome of one call.
OK = "ok"            # answered
FAILED = "fail"      # certainly had no effect
UNKNOWN = "unknown"  # may or may not have had an effect (a deadline, a lost connection, a cancel)

# When a group with ``fallback_endpoints`` moves to the next node after a failed Quorum call.
STAY = "stay"                    # never
ON_UNAVAILABLE = "unavailable"   # on UNAVAILABLE (node down, or it knows no leader)
ON_NOT_SENT = "not-sent"         # only when the call certainly had no effect (``FAILED``)
ON_ANY_ERROR = "any-error"       # after any failed call (a client that load-balances)
MOVE_ON = (STAY, ON_UNAVAILABLE, ON_NOT_SENT, ON_ANY_ERROR)

# gRPC's words for a connection that never carried the request.
_NOT_SENT = ("failed to connect", "connection refused", "connect failed", "dns resolution failed")

# Reconnect quickly to a node that comes back (gRPC's default backoff grows to 120 s): a group
# keeps one channel per node it has used.
CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 500))


def classify(code: grpc.StatusCode, details: str | None) -> str:
    """``FAILED`` when a call that ended with ``code``/``details`` certainly had no effect,
    else ``UNKNOWN``."""
    text = (details or "").lower()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return FAILED
    if code == grpc.StatusCode.UNAVAILABLE and any(s in text for s in _NOT_SENT):
        return FAILED
    return UNKNOWN


def should_move(policy: str, error: str, outcome: str) -> bool:
    """Whether a group with policy ``policy`` moves on after a call that failed with status
    name ``error`` and ``outcome`` (``FAILED``/``UNKNOWN``)."""
    if policy == STAY or not error:
        return False
    if policy == ON_UNAVAILABLE:
        return error == grpc.StatusCode.UNAVAILABLE.name
    if policy == ON_NOT_SENT:
        return outcome == FAILED
    if policy == ON_ANY_ERROR:
        return True
    raise ValueError(f"unknown move_on policy {policy!r}; choose one of {', '.join(MOVE_ON)}")


def next_endpoint(current: str, endpoints: Sequence[str]) -> str | None:
    """The node after ``current`` in ``endpoints`` (the first one if ``current`` is not in it);
    None when there is no other node to go to."""
    if not endpoints:
        return None
    nxt = endpoints[(endpoints.index(current) + 1) % len(endpoints)] if current in endpoints else endpoints[0]
    return None if nxt == current else nxt


def requester(replica_id: str, step: int, *, address: str = "", world_size: int = 1, data: str = "",
              commit_failures: int = 0) -> pb.QuorumMember:
    """The ``QuorumMember`` a simulated group sends: ``address`` is the member address torchft
    gives (its manager server, which the lighthouse's kill reaches; default the placeholder
    ``sim://ID``); the store address is always the placeholder ``sim-store://ID``."""
    return pb.QuorumMember(replica_id=replica_id, address=address or f"sim://{replica_id}",
                           store_address=f"sim-store://{replica_id}", step=step, world_size=world_size,
                           data=data, commit_failures=commit_failures)


def next_step(step: int, participants: Sequence[pb.QuorumMember]) -> int:
    """The step after a quorum: one past the highest step in it (a group that was behind
    catches up, as torchft's manager does after healing), or ``step + 1`` without members."""
    return max((m.step for m in participants), default=step) + 1


@dataclass(frozen=True, slots=True)
class RoundResult:
    replica_id: str
    step: int                        # the step sent
    quorum_id: int | None            # None when the call failed
    participants: tuple[str, ...]
    latency_s: float
    started: float                   # time.monotonic() when the call was sent
    error: str = ""                  # gRPC status name when the call failed
    endpoint: str = ""
    outcome: str = OK                # OK, FAILED or UNKNOWN
    details: str = ""                # the gRPC error's details


@dataclass(frozen=True, slots=True)
class HeartbeatResult:
    replica_id: str
    endpoint: str
    started: float
    latency_s: float
    outcome: str = OK
    error: str = ""
    details: str = ""


@dataclass
class SimulatedReplicaGroup:
    """One replica group's lighthouse client loop; see the module docstring."""

    replica_id: str
    endpoint: str                    # the node it talks to now
    quorum_timeout_s: float = 5.0
    heartbeat_interval_s: float = 0.1
    heartbeat_timeout_s: float = 1.0
    step_time_s: float = 0.0         # pause after a round that got a quorum
    retry_sleep_s: float = 0.05      # pause after a failed round (torchft's manager retries its step)
    world_size: int = 1
    data: str = ""
    address: str = ""                # see ``requester``
    commit_failures: int = 0
    # Every node it may move to (usually all of them, its own included); empty = stay on
    # ``endpoint``. When it moves is ``move_on``.
    fallback_endpoints: tuple[str, ...] = ()
    move_on: str = ON_UNAVAILABLE
    tls: ClientTLS | None = None
    on_round: Callable[[RoundResult], None] | None = None
    on_heartbeat: Callable[[HeartbeatResult], None] | None = None
    # Called with ("quorum" or "heartbeat", endpoint) just before each call goes out.
    on_send: Callable[[str, str], None] | None = None
    keep_rounds: bool = True         # False: rounds go to ``on_round`` only (long runs)
    step: int = 0
    # The job its calls belong to (core/jobs.py), named in each call's metadata; None: the
    # default job (or the job of the port it calls), as an unchanged torchft trainer's calls.
    job: str | None = None
    rounds: list[RoundResult] = field(default_factory=list)
    _channels: dict[str, grpc.aio.Channel] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.move_on not in MOVE_ON:
            raise ValueError(f"unknown move_on policy {self.move_on!r}; choose one of {', '.join(MOVE_ON)}")
        self._metadata = None if self.job is None else ((JOB_HEADER, self.job),)

    def _stub(self, endpoint: str) -> pb_grpc.LighthouseServiceStub:
        ch = self._channels.get(endpoint)
        if ch is None:
            ch = self._channels[endpoint] = aio_channel(endpoint, self.tls, options=CHANNEL_OPTIONS)
        return pb_grpc.LighthouseServiceStub(ch)

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            await ch.close(grace=None)

    def switch_endpoint(self, endpoint: str) -> None:
        """Point later calls at another node (channels stay open until ``close()``)."""
        self.endpoint = endpoint

    # -- one call -----------------------------------------------------------------------------

    def request(self) -> pb.LighthouseQuorumRequest:
        return pb.LighthouseQuorumRequest(requester=requester(
            self.replica_id, self.step, address=self.address, world_size=self.world_size, data=self.data,
            commit_failures=self.commit_failures))

    async def call_quorum(self) -> pb.Quorum:
        """One Quorum call at the current step through ``endpoint``, with the deadline; on an
        answer the step advances. Raises the call's ``grpc.aio.AioRpcError``; reports nothing."""
        resp = await self._stub(self.endpoint).Quorum(self.request(), timeout=self.quorum_timeout_s,
                                                      metadata=self._metadata)
        self.step = next_step(self.step, resp.quorum.participants)
        return resp.quorum

    async def quorum_once(self) -> RoundResult:
        """One quorum round, reported: ``on_send``, the call, then (after moving on if the
        ``move_on`` policy says so) ``rounds`` and ``on_round``. A cancelled call is not
        reported (the cancellation propagates)."""
        endpoint, step = self.endpoint, self.step
        if self.on_send is not None:
            self.on_send("quorum", endpoint)
        started = time.monotonic()
        try:
            q = await self.call_quorum()
        except grpc.aio.AioRpcError as e:
            result = RoundResult(self.replica_id, step, None, (), time.monotonic() - started, started,
                                 error=e.code().name, endpoint=endpoint, outcome=classify(e.code(), e.details()),
                                 details=e.details() or "")
            if should_move(self.move_on, result.error, result.outcome):
                nxt = next_endpoint(self.endpoint, self.fallback_endpoints)
                if nxt is not None:
                    self.switch_endpoint(nxt)
        else:
            result = RoundResult(self.replica_id, step, q.quorum_id, tuple(m.replica_id for m in q.participants),
                                 time.monotonic() - started, started, endpoint=endpoint)
        if self.keep_rounds:
            self.rounds.append(result)
        if self.on_round is not None:
            self.on_round(result)
        return result

    async def heartbeat_once(self) -> HeartbeatResult:
        """One Heartbeat through ``endpoint``, reported to ``on_heartbeat``."""
        endpoint = self.endpoint
        if self.on_send is not None:
            self.on_send("heartbeat", endpoint)
        started = time.monotonic()
        try:
            await self._stub(endpoint).Heartbeat(pb.LighthouseHeartbeatRequest(replica_id=self.replica_id),
                                                 timeout=self.heartbeat_timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            result = HeartbeatResult(self.replica_id, endpoint, started, time.monotonic() - started,
                                     outcome=classify(e.code(), e.details()), error=e.code().name,
                                     details=e.details() or "")
        else:
            result = HeartbeatResult(self.replica_id, endpoint, started, time.monotonic() - started)
        if self.on_heartbeat is not None:
            self.on_heartbeat(result)
        return result

    # -- loops --------------------------------------------------------------------------------

    async def heartbeat_loop(self) -> None:
        while True:
            await self.heartbeat_once()  # a failure changes nothing: torchft ignores them too
            await asyncio.sleep(self.heartbeat_interval_s)

    @contextlib.asynccontextmanager
    async def heartbeating(self) -> AsyncIterator["SimulatedReplicaGroup"]:
        """Heartbeat in the background while the block runs (what a manager does while it
        waits for its quorum)."""
        hb = asyncio.get_running_loop().create_task(self.heartbeat_loop())
        try:
            yield self
        finally:
            hb.cancel()
            try:
                await hb
            except asyncio.CancelledError:
                pass

    async def run(self, rounds: int | None = None, until: Callable[[], bool] | None = None) -> list[RoundResult]:
        """Heartbeat in the background and do quorum rounds until ``rounds`` are done or
        ``until()`` is true."""
        async with self.heartbeating():
            done = 0
            while (rounds is None or done < rounds) and not (until is not None and until()):
                result = await self.quorum_once()
                done += 1
                if result.error:
                    await asyncio.sleep(self.retry_sleep_s)
                elif self.step_time_s:
                    await asyncio.sleep(self.step_time_s)
        return self.rounds
