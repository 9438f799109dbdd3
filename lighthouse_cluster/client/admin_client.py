"""Blocking client calls to a cluster's own services (CLI and harnesses): Status, Leader, the
admin RPCs routed to the leader, and reads (ListJobs, GetJob) preferably answered by the leader."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import grpc

from lighthouse_cluster.client.discovery import NotLeader, find_leader
from lighthouse_cluster.client.discovery import not_leader as read_not_leader
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import lighthouse_cluster_pb2_grpc as cpb_grpc
from lighthouse_cluster.tls import ClientTLS, channel


def query_status(address: str, timeout: float = 1.0, tls: ClientTLS | None = None) -> cpb.NodeStatus | None:
    """One node's Status, or None when it does not answer in time."""
    return probe_status(address, timeout, tls)[0]


def probe_status(address: str, timeout: float = 1.0,
                 tls: ClientTLS | None = None) -> tuple[cpb.NodeStatus | None, str]:
    """(one node's Status, "") or (None, one line saying why not and what to check)."""
    try:
        with channel(address, tls) as ch:
            return cpb_grpc.LighthouseClusterStub(ch).Status(cpb.StatusRequest(), timeout=timeout), ""
    except grpc.RpcError as e:
        return None, explain_rpc_error(address, e.code(), e.details() or "", timeout, tls is not None)


def explain_rpc_error(address: str, code: grpc.StatusCode, details: str, timeout: float,
                      tls: bool) -> str:
    """A failed call as one line for an operator: what went wrong and what to check."""
    d = details.lower()
    if "http/2" in d or "http1" in d or "settings frame" in d or "http2" in d:
        why = "not a gRPC port (an HTTP port such as the dashboard's?); give the node's client port"
    elif "ssl" in d or "tls" in d or "handshake" in d or "certificate" in d:
        why = ("TLS handshake failed; check http:// versus https:// (the node's client port may be plaintext "
               "or TLS) and --tls-ca / --tls-client-cert")
    elif tls and code == grpc.StatusCode.UNAVAILABLE and ("socket closed" in d or "connection reset" in d
                                                          or "end of file" in d):
        why = ("the node closed the connection during the TLS handshake: does it require a client certificate "
               "(--tls-client-cert, --tls-client-key), or is its port plaintext (http://)?")
    elif "connection refused" in d:
        why = "connection refused: nothing listens there (node down, or a wrong host or port?)"
    elif "resolution" in d or "resolve" in d or "dns" in d:
        why = "the host name does not resolve"
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
        why = (f"no answer within {timeout:g}s (a paused or overloaded node, or a firewall that drops packets; "
               "--timeout waits longer)")
    elif code == grpc.StatusCode.UNIMPLEMENTED:
        why = "not a lighthouse-cluster node (a torchft_lighthouse, or another gRPC server?)"
    elif code == grpc.StatusCode.UNAVAILABLE and not tls and ("socket closed" in d or "connection reset" in d):
        why = "the connection closed at once; does the node's client port require TLS (https://)?"
    else:
        why = f"{code.name}: {details.splitlines()[0] if details else 'no details'}"
    return f"{address}: {why}"


RETRY_S = 0.1
# How long ``AdminClient.leader`` waits for the nodes' Leader answers (at most the call timeout).
LEADER_TIMEOUT_S = 2.0


# A node's answers that refuse the request itself: the command must change (its arguments, the
# token, the job's state); asking again as it is will not help.
REFUSALS = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE,
})


class AdminCallError(Exception):
    """An admin call failed; the message is one line for the operator."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None,
                 not_leader: NotLeader | None = None) -> None:
        super().__init__(message)
        self.code = code
        # The node does not lead (``discovery.not_leader``: the typed detail, or an older node's
        # sentence): the leader moved, so the call is routed again.
        self.not_leader = not_leader if not_leader is not None else read_not_leader(code, message)

    @property
    def refused(self) -> bool:
        """The node refused the request (bad input, token, state), as opposed to a cluster that
        could not be reached or did not answer (no leader, a node down, a timeout)."""
        return self.code in REFUSALS and self.not_leader is None


class AdminClient:
    """Calls ``LighthouseAdmin`` on the leader, found through any of ``endpoints``."""

    def __init__(self, endpoints: Sequence[str], tls: ClientTLS | None = None, token: str | None = None,
                 timeout: float = 10.0) -> None:
        self.endpoints = list(endpoints)
        self.tls = tls
        self.timeout = timeout
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def leader(self) -> tuple[str, cpb.LeaderResponse]:
        """(leader's client address, the Leader answer naming it): every endpoint is asked at
        once and the leader named in the highest term wins (``discovery.find_leader``);
        AdminCallError when none names a leader."""
        timeout = min(self.timeout, LEADER_TIMEOUT_S)
        best, probes = find_leader(self.endpoints, self.tls, timeout)
        if best is not None and best.response is not None:
            return best.leader_address, best.response
        errors = [f"{p.endpoint}: no leader known" if p.response is not None else
                  explain_rpc_error(p.endpoint, p.code or grpc.StatusCode.DEADLINE_EXCEEDED, p.details, timeout,
                                    self.tls is not None) for p in probes]
        raise AdminCallError("no leader found (" + "; ".join(errors) + ")")

    def call(self, method: str, request: Any, at: str | None = None) -> Any:
        """``LighthouseAdmin/<method>`` on ``at``, or on the leader: then re-routed while the
        leader moves (an election, a node that just stepped down), until ``timeout``. A node that
        names the leader in its refusal is taken at its word for the next try."""
        if at is not None:
            return self._call_at(at, method, request, self.timeout)
        deadline = time.monotonic() + self.timeout
        hint: str | None = None
        while True:
            try:
                target = hint or self.leader()[0]
                return self._call_at(target, method, request, max(0.5, deadline - time.monotonic()))
            except AdminCallError as e:
                moving = e.code == grpc.StatusCode.UNAVAILABLE or e.not_leader is not None or e.code is None
                if not moving or time.monotonic() + RETRY_S >= deadline:
                    raise
                named = e.not_leader.leader_address if e.not_leader is not None else ""
                hint = named if named and named != hint else None
            if hint is None:
                time.sleep(RETRY_S)

    def read(self, method: str, request: Any) -> tuple[Any, str]:
        """``LighthouseCluster/<method>`` (a read: no token sent) on the leader, whose answer has
        its live view (heartbeats, pending requesters); when no leader is found or it does not
        answer, on the first endpoint that does. (the answer, the address that gave it). A
        refusal (NOT_FOUND, ...) is raised at once."""
        unreachable = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        try:
            at = self.leader()[0]
            return self._call_at(at, method, request, self.timeout, stub=cpb_grpc.LighthouseClusterStub), at
        except AdminCallError as e:
            if e.code is not None and e.code not in unreachable:
                raise
        last: AdminCallError | None = None
        for address in self.endpoints:
            try:
                return self._call_at(address, method, request, self.timeout,
                                     stub=cpb_grpc.LighthouseClusterStub), address
            except AdminCallError as e:
                last = e
                if e.code not in unreachable:
                    raise
        assert last is not None
        raise last

    def _call_at(self, address: str, method: str, request: Any, timeout: float,
                 stub: Callable[[Any], Any] = cpb_grpc.LighthouseAdminStub) -> Any:
        try:
            with channel(address, self.tls) as ch:
                rpc: Callable[..., Any] = getattr(stub(ch), method)
                admin = stub is cpb_grpc.LighthouseAdminStub
                return rpc(request, timeout=timeout, metadata=self._metadata if admin else ())
        except grpc.RpcError as e:
            code = e.code()
            details = e.details() or ""
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNIMPLEMENTED):
                message = explain_rpc_error(address, code, details, timeout, self.tls is not None)
            else:  # the node's own answer (a refused token, a bad argument): already one line for the operator
                message = f"{address}: {code.name}: {details}"
            raise AdminCallError(message, code, read_not_leader(code, details, e.trailing_metadata())) from None

    def any_node(self, method: str, request: Any) -> Any:
        """``method`` on the first endpoint that answers (read-only calls)."""
        last: AdminCallError | None = None
        for address in self.endpoints:
            try:
                return self.call(method, request, at=address)
            except AdminCallError as e:
                last = e
                if e.code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
        assert last is not None
        raise last
