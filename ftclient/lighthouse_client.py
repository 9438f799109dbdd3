"""The trainer's lighthouse client: torchft's LighthouseService (Quorum, Heartbeat) with leader
discovery over a list of lighthouse endpoints.

It owns *where* calls go and *when* they are re-sent; the lighthouse decides everything else.

* Endpoints: one URL or a comma-separated list (``TORCHFT_LIGHTHOUSE``, or an argument), each
  ``http://host:port``, ``grpc://``, ``https://``/``grpcs://`` (TLS) or ``host:port``.
  :func:`parse_endpoints` normalizes them.
* Discovery: every known endpoint is asked ``lighthouse_cluster.LighthouseCluster/Leader``
  concurrently (a dead first entry costs nothing); the answer naming a leader with the highest
  Raft term wins (:func:`choose_target`, pure). Parsing and discovery are
  ``lighthouse_cluster.client.discovery``'s, shared with the CLI and the admin client. The cluster's configured nodes are learned from
  the answers, so one reachable node is enough to find the others later. An endpoint answering
  UNIMPLEMENTED is a single lighthouse without our cluster service (torchft's Rust
  ``torchft_lighthouse``): it is used as is.
* Quorum: sent straight to the leader with the caller's deadline. When the call fails because
  the node went away or stopped leading (UNAVAILABLE, ...), or when another node reports a newer
  leader while the call waits (checked every ``leader_watch_interval``; this catches a leader
  that hangs instead of failing), the client rediscovers the leader and re-sends the same
  request -- always within the caller's original deadline (retry/backoff by tenacity). Running
  out of time raises ``TimeoutError`` naming the endpoints.
* Heartbeat: sent to the current leader; a failed one forgets the leader, so the next heartbeat
  follows the new one.
* Jobs: a cluster serves many jobs; the client's job (:mod:`ftclient.job_selection`:
  the ``job`` argument, else ``LIGHTHOUSE_JOB``, else ``?job=NAME`` on the URLs, else the default
  job) is named on every Quorum and Heartbeat call (and the liveness stream's Watch) with the
  ``x-lighthouse-job`` metadata; none is sent for the default job, exactly as before jobs. Leader
  discovery is the same for every job. A named job needs a lighthouse cluster: a single
  lighthouse without the cluster service (torchft's) is refused with ``LighthouseError``. An
  unknown job is :class:`JobNotFoundError` (NOT_FOUND from the cluster).
* Job configuration: :meth:`LighthouseClient.job_config` (and :func:`read_job_config`, for launch
  scripts without a client) read the job's key/value map with ``LighthouseCluster.GetJob``, from
  the leader when it is known, else from the first endpoint that answers (a follower's copy lags
  the leader's by its replication delay, milliseconds). Nothing is cached: every call asks.

Thread-safe: the manager server's heartbeat thread and its quorum thread share one client.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import grpc
import tenacity

from lighthouse_cluster.client import discovery
from lighthouse_cluster.client.discovery import Probe, Target, choose_target
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import lighthouse_cluster_pb2_grpc as cpb_grpc
from lighthouse_cluster.proto import torchft_pb2 as pb
from lighthouse_cluster.proto import torchft_pb2_grpc as pb_grpc

from lighthouse_cluster.tls import channel as tls_channel
from lighthouse_cluster.tls import client_tls_for

from ._env import lighthouse_addr as _lighthouse_addr_from_env
from ._timeouts import Deadline, stop_at, to_seconds, wait_within
from .job_selection import JobSelection, select_job

__all__ = ["JobNotFoundError", "LighthouseClient", "LighthouseError", "Probe", "Target", "choose_target",
           "parse_endpoints", "read_job_config"]

log = logging.getLogger(__name__)

# Channel options: fail fast and reconnect fast when a node dies or comes back.
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 500),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]

# After the first answer naming a leader, how long discovery waits for the other endpoints.
PROBE_GRACE_S = discovery.PROBE_GRACE_S
# A call failing this close to its deadline failed because of the deadline.
_DEADLINE_SLACK_S = 0.25
# What lighthouse-cluster nodes (and tonic clients) say when a Quorum call's deadline is reached.
_TIMEOUT_DETAILS = "Timeout expired"

# Codes meaning "this node cannot answer now; another (or this one, later) may": re-route.
_REROUTE_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,        # a node shutting down cancels the calls it holds
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.FAILED_PRECONDITION,  # "not the leader"
})


# Between re-sends and discovery rounds: 50 ms doubling to 500 ms, plus up to 50 ms of jitter.
_BACKOFF = tenacity.wait_exponential(multiplier=0.05, max=0.5) + tenacity.wait_random(0, 0.05)


class LighthouseError(RuntimeError):
    """A lighthouse call failed for a reason re-routing cannot fix (e.g. INTERNAL)."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class JobNotFoundError(LighthouseError):
    """The cluster has no job of the client's name (NOT_FOUND)."""

    def __init__(self, job: str, endpoints: str, details: str = "") -> None:
        super().__init__(f"no job {job!r} on the lighthouse cluster at {endpoints}"
                         + (f" ({details})" if details else "")
                         + f": create it (lighthouse-cluster jobs add {job}) or select another job (the job "
                         "argument, LIGHTHOUSE_JOB, or ?job=NAME on the lighthouse URL)", grpc.StatusCode.NOT_FOUND)
        self.job = job


def parse_endpoints(value: str | Sequence[str]) -> list[str]:
    """``"http://a:1, b:2"`` (or a list of such strings) -> ``["a:1", "b:2"]``: the scheme is
    dropped, duplicates and empty entries removed, order kept. A ``?job=NAME`` query is checked
    and dropped. The rules are ``lighthouse_cluster.client.discovery.parse_endpoints``' (the
    CLI's too)."""
    return list(discovery.parse_endpoints(value).addresses)


class _Reroute(Exception):
    """Internal: the call must be re-sent to the (re)discovered leader."""


class _NoLeader(Exception):
    """Internal: no endpoint named a leader in this discovery round."""


class LighthouseClient:
    """torchft's LighthouseService client with leader discovery; see the module docstring.

    Args:
        addr: one URL or a comma-separated list (or a list); None reads ``TORCHFT_LIGHTHOUSE``.
        connect_timeout: how long the constructor looks for a leader (or a single lighthouse)
            before raising ``ConnectionError``.
        connect: look for the leader in the constructor (torchft's client connects eagerly).
        probe_timeout: deadline of one ``Leader`` call during discovery.
        leader_watch_interval: while a Quorum call waits on the leader, how often the other
            nodes are asked whether a newer leader exists (None: never).
        job: the job its calls name; None: ``LIGHTHOUSE_JOB``, else ``?job=`` on the URLs, else
            the default job (:mod:`ftclient.job_selection`).
    """

    def __init__(self, addr: str | Sequence[str] | None = None,
                 connect_timeout: timedelta | float = timedelta(seconds=60), *, connect: bool = True,
                 probe_timeout: float = 1.0, leader_watch_interval: float | None = 1.0,
                 job: str | None = None) -> None:
        given = _lighthouse_addr_from_env(addr if isinstance(addr, str) or addr is None else ",".join(addr))
        self._given = parse_endpoints(given)
        self._job = select_job(job, given)
        # None (not an empty tuple) for the default job: its calls are exactly those before jobs.
        self._metadata = self._job.metadata or None
        # TLS when an endpoint is https:// or grpcs://, or LIGHTHOUSE_CLUSTER_TLS_CA is set.
        self._tls = client_tls_for(given)
        self._learned: list[str] = []
        self._connect_timeout = to_seconds(connect_timeout) or 0.0
        self._probe_timeout = probe_timeout
        self._watch = leader_watch_interval
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._target: Target | None = None
        self._closed = False
        self.reroutes = 0  # how many times a call was re-sent after a failover
        if connect:
            self.discover(self._connect_timeout)

    # -- state --------------------------------------------------------------------------------

    @property
    def endpoints(self) -> list[str]:
        """The given endpoints, then the cluster nodes learned from Leader answers."""
        with self._lock:
            return self._given + [e for e in self._learned if e not in self._given]

    @property
    def target(self) -> Target | None:
        """Where calls currently go (None until discovered, or after a failure)."""
        with self._lock:
            return self._target

    @property
    def job(self) -> JobSelection:
        """The job this client's calls name (and where the name came from)."""
        return self._job

    @property
    def call_metadata(self) -> tuple[tuple[str, str], ...] | None:
        """The gRPC metadata of the job's calls (Quorum, Heartbeat, Watch); None for the default job."""
        return self._metadata

    def describe(self) -> str:
        scheme = "https" if self._tls is not None else "http"
        return ", ".join(f"{scheme}://{e}" for e in self.endpoints)

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            if self._closed:
                raise RuntimeError("LighthouseClient is closed")
            ch = self._channels.get(address)
            if ch is None:
                ch = tls_channel(address, self._tls, CHANNEL_OPTIONS)
                self._channels[address] = ch
            return ch

    def _forget(self, target: Target) -> None:
        """Drop ``target`` unless someone already replaced it."""
        with self._lock:
            if self._target == target:
                self._target = None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            ch.close()

    def __enter__(self) -> "LighthouseClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- discovery ----------------------------------------------------------------------------

    def probe(self, timeout: float) -> list[Probe]:
        """Ask every known endpoint who leads, concurrently; learn the cluster's nodes.

        Returns when every endpoint has answered, when ``timeout`` has passed, or shortly
        (``PROBE_GRACE_S``) after the first answer naming a leader: an unreachable endpoint
        that swallows packets must not hold up discovery for the whole timeout."""
        probes = discovery.ask_every_node(self.endpoints, self._channel, timeout, PROBE_GRACE_S)
        with self._lock:
            for p in probes:
                for node in p.nodes:
                    if node not in self._given and node not in self._learned:
                        self._learned.append(node)
        return probes

    def discover(self, timeout: timedelta | float) -> Target:
        """Find the leader (or a single lighthouse) within ``timeout``; ``ConnectionError``
        naming the endpoints and their answers otherwise."""
        deadline = Deadline.after(timeout)
        last: list[Probe] = []
        try:
            for attempt in tenacity.Retrying(
                    retry=tenacity.retry_if_exception_type(_NoLeader),
                    wait=wait_within(deadline, _BACKOFF),
                    stop=stop_at(deadline), reraise=True):
                with attempt:
                    last = self.probe(max(0.05, min(self._probe_timeout, deadline.remaining())))
                    target = choose_target(last)
                    if target is None:
                        raise _NoLeader()
                    if not target.cluster and not self._job.is_default:
                        raise LighthouseError(
                            f"{self._job.describe()} needs a lighthouse cluster, but {target.address} is a single "
                            "lighthouse without jobs (torchft's): select no job, or point the trainer at the "
                            "cluster")
                    with self._lock:
                        self._target = target
                    if target.cluster:
                        log.debug("lighthouse leader: %s (term %d)", target.address, target.term)
                    return target
        except _NoLeader:
            pass
        answers = "; ".join(f"{p.endpoint}: {p.error or 'no leader known'}" for p in last) or "none"
        raise ConnectionError(f"no lighthouse leader found within {to_seconds(timeout):g}s at "
                              f"{self.describe()} (answers: {answers})")

    def _target_within(self, deadline: Deadline) -> Target:
        target = self.target
        if target is not None:
            return target
        return self.discover(deadline.remaining())

    def _newer_leader(self, current: Target, deadline: Deadline) -> Target | None:
        """A leader other than ``current`` in a later term, if the nodes report one."""
        found = choose_target(self.probe(max(0.05, min(self._probe_timeout, deadline.remaining()))))
        if found is not None and found.cluster and found.address != current.address and found.term > current.term:
            return found
        return None

    # -- Quorum ---------------------------------------------------------------------------------

    def quorum(self, replica_id: str, timeout: timedelta | float, address: str = "", store_address: str = "",
               step: int = 0, world_size: int = 1, shrink_only: bool = False,
               data: dict[str, Any] | str | None = None, commit_failures: int = 0) -> pb.Quorum:
        """Block until the lighthouse issues a quorum including ``replica_id`` (torchft's
        ``LighthouseClient.quorum``; ``data`` is a dict sent as JSON, or a JSON string)."""
        member = pb.QuorumMember(
            replica_id=replica_id, address=address, store_address=store_address, step=step,
            world_size=world_size, shrink_only=shrink_only, commit_failures=commit_failures,
            data=data if isinstance(data, str) else json.dumps(data) if data is not None else "")
        return self.quorum_request(member, timeout)

    def quorum_request(self, member: pb.QuorumMember, timeout: timedelta | float) -> pb.Quorum:
        """``quorum`` with a ready-made ``QuorumMember``; see the module docstring for re-sends."""
        seconds = to_seconds(timeout) or 0.0
        deadline = Deadline.after(seconds)
        request = pb.LighthouseQuorumRequest(requester=member)
        try:
            for attempt in tenacity.Retrying(
                    retry=tenacity.retry_if_exception_type(_Reroute),
                    wait=wait_within(deadline, _BACKOFF),
                    stop=stop_at(deadline), reraise=True):
                with attempt:
                    if attempt.retry_state.attempt_number > 1:
                        self.reroutes += 1
                    return self._quorum_once(request, deadline, seconds)
        except (_Reroute, ConnectionError) as e:
            raise self._timeout_error(member.replica_id, seconds, str(e)) from None
        raise AssertionError("unreachable")

    def _timeout_error(self, replica_id: str, seconds: float, why: str = "") -> TimeoutError:
        return TimeoutError(f"lighthouse quorum for replica {replica_id} timed out after {seconds:g}s "
                            f"(lighthouse endpoints: {self.describe()})" + (f": {why}" if why else ""))

    def _quorum_once(self, request: pb.LighthouseQuorumRequest, deadline: Deadline, seconds: float) -> pb.Quorum:
        replica_id = request.requester.replica_id
        target = self._target_within(deadline)
        remaining = deadline.remaining()
        if remaining <= 0:
            raise self._timeout_error(replica_id, seconds)
        stub = pb_grpc.LighthouseServiceStub(self._channel(target.address))
        try:
            if not (target.cluster and self._watch is not None):
                # Nothing to watch (a single lighthouse): a blocking call. ``future()`` would
                # start a gRPC channel-spin thread for every call, ~0.1-0.5 ms a step.
                return stub.Quorum(request, timeout=remaining, metadata=self._metadata).quorum
            call = stub.Quorum.future(request, timeout=remaining, metadata=self._metadata)
            while True:
                left = deadline.remaining()
                watching = target.cluster and self._watch is not None and left > 0
                try:
                    # After the deadline, give the call a moment to end with its own status.
                    return call.result(timeout=min(self._watch, left) if watching else left + 1.0).quorum
                except grpc.FutureTimeoutError:
                    if not watching:
                        call.cancel()
                        raise self._timeout_error(replica_id, seconds) from None
                    newer = self._newer_leader(target, deadline)
                    if newer is not None:
                        log.info("lighthouse leader moved %s -> %s while quorum for %s waited; re-sending",
                                 target.address, newer.address, replica_id)
                        with self._lock:
                            self._target = newer
                        call.cancel()
                        raise _Reroute(f"leader moved to {newer.address}") from None
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED or (code == grpc.StatusCode.CANCELLED and (
                    e.details() == _TIMEOUT_DETAILS or deadline.remaining() < _DEADLINE_SLACK_S)):
                raise self._timeout_error(replica_id, seconds) from None
            if code in _REROUTE_CODES:
                log.info("lighthouse quorum for %s via %s failed (%s: %s); re-routing", replica_id,
                         target.address, code.name, e.details())
                self._forget(target)
                raise _Reroute(f"{target.address}: {code.name}: {e.details()}") from None
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(f"lighthouse rejected the quorum request: {e.details()}") from None
            if code == grpc.StatusCode.NOT_FOUND:
                raise JobNotFoundError(self._job.name, self.describe(), e.details()) from None
            raise LighthouseError(f"lighthouse quorum for {replica_id} via {target.address} failed: "
                                  f"{code.name}: {e.details()}", code) from None

    # -- Heartbeat ------------------------------------------------------------------------------

    def heartbeat(self, replica_id: str, timeout: timedelta | float = timedelta(seconds=5)) -> None:
        """One heartbeat to the leader. A failure forgets the leader (the next heartbeat
        rediscovers it) and raises ``TimeoutError``/``ConnectionError``/``LighthouseError``."""
        deadline = Deadline.after(timeout)
        target = self._target_within(deadline)
        stub = pb_grpc.LighthouseServiceStub(self._channel(target.address))
        try:
            stub.Heartbeat(pb.LighthouseHeartbeatRequest(replica_id=replica_id),
                           timeout=max(0.01, deadline.remaining()), metadata=self._metadata)
        except grpc.RpcError as e:
            self._forget(target)
            code = e.code()
            msg = f"heartbeat for {replica_id} to {target.address} failed: {code.name}: {e.details()}"
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TimeoutError(msg) from None
            if code in _REROUTE_CODES:
                raise ConnectionError(msg) from None
            if code == grpc.StatusCode.NOT_FOUND:
                raise JobNotFoundError(self._job.name, self.describe(), e.details()) from None
            raise LighthouseError(msg, code) from None

    # -- the job's configuration ------------------------------------------------------------------

    def get_job(self, timeout: timedelta | float = 10.0) -> cpb.Job:
        """This client's job as the cluster describes it (``LighthouseCluster.GetJob``): asked of
        the leader when it is known, then of every endpoint in turn, in rounds until ``timeout``.

        Raises :class:`JobNotFoundError` when the leader, or every node that answered, has no
        such job (a follower may not have applied a job just created: the others are asked),
        ``LighthouseError`` when the lighthouse has no jobs at all (torchft's, or a cluster older
        than jobs) and a job is named, ``ConnectionError`` naming the endpoints and their answers
        when none answered."""
        deadline = Deadline.after(timeout)
        request = cpb.JobRequest(name=self._job.name)
        answers: dict[str, str] = {}
        unimplemented: set[str] = set()
        not_found = ""
        try:
            for attempt in tenacity.Retrying(
                    retry=tenacity.retry_if_exception_type(_NoLeader),
                    wait=wait_within(deadline, _BACKOFF), stop=stop_at(deadline), reraise=True):
                with attempt:
                    target = self.target
                    first = [target.address] if target is not None and target.cluster else []
                    for address in first + [e for e in self.endpoints if e not in first]:
                        left = deadline.remaining()
                        if left <= 0:
                            break
                        stub = cpb_grpc.LighthouseClusterStub(self._channel(address))
                        try:
                            return stub.GetJob(request, timeout=min(left, max(1.0, self._probe_timeout)))
                        except grpc.RpcError as e:
                            code = e.code()
                            if code == grpc.StatusCode.NOT_FOUND:
                                if address in first:  # the leader's word is final
                                    raise JobNotFoundError(self._job.name, self.describe(), e.details()) from None
                                not_found = not_found or e.details()
                            if code == grpc.StatusCode.UNIMPLEMENTED:
                                unimplemented.add(address)
                            answers[address] = f"{code.name}: {e.details()}"
                    if not_found:
                        raise JobNotFoundError(self._job.name, self.describe(), not_found)
                    if unimplemented and unimplemented >= set(answers):
                        # Every endpoint that answered has no jobs: no use asking again.
                        break
                    raise _NoLeader()
        except _NoLeader:
            pass
        if unimplemented and unimplemented >= set(answers):
            if self._job.is_default:
                return cpb.Job(name=self._job.name)  # a lighthouse without jobs: no configuration
            raise LighthouseError(f"{self._job.describe()} needs a lighthouse cluster with jobs, but "
                                  f"{', '.join(sorted(unimplemented))} answered GetJob with UNIMPLEMENTED "
                                  "(torchft's lighthouse, or a cluster older than jobs)",
                                  grpc.StatusCode.UNIMPLEMENTED)
        listed = "; ".join(f"{a}: {why}" for a, why in answers.items()) or "no answer in time"
        raise ConnectionError(f"job {self._job.name!r}: no lighthouse endpoint answered GetJob within "
                              f"{to_seconds(timeout):g}s at {self.describe()} (answers: {listed})")

    def job_config(self, timeout: timedelta | float = 10.0) -> dict[str, str]:
        """The job's configuration map (``lighthouse-cluster jobs set NAME --config KEY=VALUE``),
        read from the cluster now (not cached); see :meth:`get_job` for where and the errors."""
        return {entry.key: entry.value for entry in self.get_job(timeout).config}


def read_job_config(addr: str | Sequence[str] | None = None, job: str | None = None,
                    timeout: timedelta | float = 10.0) -> dict[str, str]:
    """A job's configuration map without a Manager (e.g. in a launch script): ``addr`` and
    ``job`` as :class:`LighthouseClient`'s (None: ``TORCHFT_LIGHTHOUSE``; ``LIGHTHOUSE_JOB``, a
    ``?job=`` query, else the default job), the same TLS settings; read once, not cached."""
    with LighthouseClient(addr, connect_timeout=timeout, connect=False, job=job) as client:
        return client.job_config(timeout)
