"""Where a cluster's nodes are and which one leads: the one place endpoints are parsed and the
leader is found, for the CLI, the admin client, ftclient, job ports and the local cluster.

**Endpoints.** One string or a list of strings, items separated by commas or whitespace, each
``SCHEME://HOST:PORT[/]`` or a bare ``HOST:PORT``:

* schemes ``http://`` and ``grpc://`` are plaintext gRPC; ``https://`` and ``grpcs://`` are TLS
  (``Endpoints.tls``; ``tls.client_tls_for`` turns it into credentials);
* HOST is a host name, an IPv4 address or a bracketed IPv6 address (``[::1]:29510``); an IPv6
  address without brackets is refused, since its last group cannot be told from a port;
* a ``?job=NAME`` query on any item names the job of the whole list (``split_job_query``: items
  naming different jobs, another key or a bad name are errors);
* empty items and duplicates are dropped, order is kept; anything else is a ``ValueError``
  whose message names the item and what to write instead.

**The leader.** ``ask_every_node`` asks every endpoint ``LighthouseCluster/Leader`` at once and
returns within ``timeout`` (or ``grace_s`` after the first answer naming a leader: a node that
swallows packets must not hold up the others); ``highest_term_leader`` takes the leader named in
the highest Raft term (the first such answer on a tie), so a deposed leader still answering in
an older term is not picked. ``choose_target`` adds the fallback ftclient needs: an endpoint
without the cluster service (UNIMPLEMENTED: torchft's own lighthouse) is used as is.

**"Not the leader".** A node refusing a call because it does not lead attaches a typed detail:
trailing metadata ``NOT_LEADER_KEY`` holding a serialized ``LeaderResponse`` (leader id, its
client address, the node's term; empty fields when it knows no leader). ``not_leader`` reads it;
from nodes older than the detail (a rolling upgrade runs adjacent versions side by side) it
still recognises the sentences they answer with (``OLD_NOT_LEADER_SENTENCES``), which the nodes
keep sending for older clients.

Pure parsing and rules apart from ``ask_every_node``/``find_leader``, which make the calls.
"""

from __future__ import annotations

import ipaddress
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence
from urllib.parse import parse_qsl

import grpc

from lighthouse_cluster.core.jobs import JobError, check_job_name
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import lighthouse_cluster_pb2_grpc as cpb_grpc
from lighthouse_cluster.tls import ClientTLS
from lighthouse_cluster.tls import channel as tls_channel

PLAINTEXT_SCHEMES = ("http", "grpc")
TLS_SCHEMES = ("https", "grpcs")
JOB_QUERY = "job"
JOB_ENV = "LIGHTHOUSE_JOB"
EXAMPLE = "http://127.0.0.1:29510,http://127.0.0.1:29511"
_HOST_NAME = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_.])?$")

# After the first answer naming a leader, how long ``ask_every_node`` waits for the others.
PROBE_GRACE_S = 0.1


# -- endpoints -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoints:
    """A parsed endpoint list: ``addresses`` as gRPC dials them (``host:port``, ``[v6]:port``),
    the job a ``?job=`` query named (None: none), and whether any item asked for TLS."""

    addresses: tuple[str, ...]
    job: str | None = None
    tls: bool = False


def _items(value: str | Sequence[str]) -> list[str]:
    """The items of ``value``: split at commas and whitespace, except whitespace inside a query
    (``?job=bad name`` stays one item, for ``split_job_query`` to refuse the name)."""
    values = [value] if isinstance(value, str) else list(value)
    items: list[str] = []
    for v in values:
        for part in v.split(","):
            words: list[str] = []
            for word in part.split():
                if words and "?" in words[-1] and ":" not in word:
                    words[-1] += " " + word
                else:
                    words.append(word)
            items.extend(words)
    return items


def split_job_query(value: str | Sequence[str]) -> tuple[list[str], str | None]:
    """``"http://a:1,http://b:2?job=x"`` (or a list of such strings) -> ``(["http://a:1",
    "http://b:2"], "x")``: the entries without their query, and the job the queries name (None:
    none). ``ValueError`` for URLs naming different jobs, an unknown query key, an empty or
    invalid name."""
    parts = value.split(",") if isinstance(value, str) else [p for v in value for p in v.split(",")]
    entries: list[str] = []
    named: dict[str, str] = {}  # job -> the first URL naming it
    for raw in parts:
        entry, sep, query = raw.strip().partition("?")
        entries.append(entry)
        if not sep:
            continue
        try:
            pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=True)
        except ValueError:
            raise ValueError(f"lighthouse URL {raw.strip()!r}: the query must be ?{JOB_QUERY}=NAME") from None
        keys = [k for k, _ in pairs]
        if keys != [JOB_QUERY]:
            raise ValueError(f"lighthouse URL {raw.strip()!r}: the only query understood is ?{JOB_QUERY}=NAME "
                             f"(once), got {query!r}")
        try:
            job = check_job_name(pairs[0][1])
        except JobError as e:
            raise ValueError(f"lighthouse URL {raw.strip()!r}: {e}") from None
        named.setdefault(job, raw.strip())
    if len(named) > 1:
        which = "; ".join(f"{url} names {job!r}" for job, url in named.items())
        raise ValueError(f"the lighthouse URLs name different jobs ({which}): a trainer belongs to one job; "
                         f"name it once (?{JOB_QUERY}=NAME on any URL, or {JOB_ENV})")
    return entries, next(iter(named), None)


def parse_endpoint(raw: str) -> tuple[str, bool | None]:
    """One item without its query -> (``host:port`` to dial, True for a TLS scheme / False for a
    plaintext one / None without a scheme). ``ValueError`` naming the item otherwise."""
    item = raw.strip()
    rest = item
    tls: bool | None = None
    if "://" in rest:
        scheme, rest = rest.split("://", 1)
        if scheme.lower() in TLS_SCHEMES:
            tls = True
        elif scheme.lower() in PLAINTEXT_SCHEMES:
            tls = False
        else:
            raise ValueError(f"endpoint {item!r}: unknown scheme {scheme + '://'!r}; use http:// or grpc:// "
                             "(plaintext gRPC), https:// or grpcs:// (TLS), or a bare HOST:PORT")
    rest = rest.rstrip("/")
    if "/" in rest or "@" in rest:
        raise ValueError(f"endpoint {item!r}: only SCHEME://HOST:PORT is understood (no path or user)")
    host, sep, port = rest.rpartition(":")
    if not sep or not host:
        raise ValueError(f"endpoint {item!r} is not HOST:PORT (e.g. http://127.0.0.1:29510)")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"endpoint {item!r}: the port must be a number in 1-65535")
    if host.startswith("["):
        if not host.endswith("]"):
            raise ValueError(f"endpoint {item!r}: an IPv6 address is written [ADDRESS]:PORT")
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ValueError(f"endpoint {item!r}: {host[1:-1]!r} is not an IPv6 address") from None
    elif ":" in host:
        raise ValueError(f"endpoint {item!r}: put an IPv6 address in brackets ([{host}]:{port})")
    elif not _HOST_NAME.match(host):
        raise ValueError(f"endpoint {item!r}: {host!r} is not a host name or address")
    return f"{host}:{int(port)}", tls


def parse_endpoints(value: str | Sequence[str]) -> Endpoints:
    """``"http://a:1, grpcs://b:2?job=x"`` (or a list of such strings) -> ``Endpoints(("a:1",
    "b:2"), job="x", tls=True)``; see the module docstring for the rules."""
    entries, job = split_job_query(_items(value))
    addresses: list[str] = []
    tls = False
    for entry in entries:
        address, wants = parse_endpoint(entry)
        tls = tls or bool(wants)
        if address not in addresses:
            addresses.append(address)
    if not addresses:
        raise ValueError(f"no endpoints in {value!r} (e.g. {EXAMPLE})")
    return Endpoints(tuple(addresses), job, tls)


# -- the leader ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    """One endpoint's answer to ``LighthouseCluster/Leader``."""

    endpoint: str
    leader_address: str = ""       # the leader's client address; "" when none is known
    term: int = 0
    nodes: tuple[str, ...] = ()    # client addresses of the configured cluster
    unimplemented: bool = False    # a lighthouse without the cluster service
    error: str = ""                # why it did not answer ("CODE: details")
    leader_id: str = ""
    code: grpc.StatusCode | None = field(default=None, compare=False)
    details: str = field(default="", compare=False)
    response: cpb.LeaderResponse | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Target:
    """Where lighthouse calls go: a cluster leader (``cluster``) or a single lighthouse."""

    address: str
    cluster: bool
    term: int = 0


def probe_from_response(endpoint: str, r: cpb.LeaderResponse) -> Probe:
    return Probe(endpoint, leader_address=r.leader_client_address, term=r.term,
                 nodes=tuple(n.client_address for n in r.nodes if n.client_address), leader_id=r.leader_id,
                 response=r)


def probe_from_error(endpoint: str, code: grpc.StatusCode | None, details: str) -> Probe:
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return Probe(endpoint, unimplemented=True, code=code, details=details)
    if code is None:
        return Probe(endpoint, error=details or "no answer in time", details=details)
    return Probe(endpoint, error=f"{code.name}: {details}", code=code, details=details)


def highest_term_leader(probes: Iterable[Probe]) -> Probe | None:
    """The answer naming a leader in the highest term; the first such answer on a tie."""
    best: Probe | None = None
    for p in probes:
        if p.leader_address and (best is None or p.term > best.term):
            best = p
    return best


def choose_target(probes: Sequence[Probe]) -> Target | None:
    """The leader named with the highest term (the first such answer on a tie); else the first
    endpoint without the cluster service; else None (no leader known yet)."""
    best = highest_term_leader(probes)
    if best is not None:
        return Target(best.leader_address, cluster=True, term=best.term)
    for p in probes:
        if p.unimplemented:
            return Target(p.endpoint, cluster=False)
    return None


def ask_every_node(endpoints: Sequence[str], channel_for: Callable[[str], grpc.Channel], timeout: float,
                   grace_s: float = PROBE_GRACE_S) -> list[Probe]:
    """Ask every endpoint who leads, concurrently; one ``Probe`` per endpoint, in their order.

    Returns when every endpoint has answered, when ``timeout`` has passed, or ``grace_s`` after
    the first answer naming a leader; an endpoint that has not answered then is "no answer in
    time" (its call is cancelled)."""
    deadline = time.monotonic() + timeout
    cond = threading.Condition()
    done: dict[str, Probe] = {}
    calls = []
    for endpoint in endpoints:
        stub = cpb_grpc.LighthouseClusterStub(channel_for(endpoint))
        calls.append((endpoint, stub.Leader.future(cpb.LeaderRequest(), timeout=timeout)))

    def on_done(endpoint: str, call: grpc.Future) -> None:
        try:
            probe = probe_from_response(endpoint, call.result())
        except grpc.FutureCancelledError:
            probe = probe_from_error(endpoint, None, "no answer in time")
        except grpc.RpcError as e:
            probe = probe_from_error(endpoint, e.code(), e.details() or "")
        with cond:
            done[endpoint] = probe
            cond.notify_all()

    for endpoint, call in calls:
        call.add_done_callback(lambda c, e=endpoint: on_done(e, c))
    grace_until: float | None = None
    with cond:
        while len(done) < len(calls):
            now = time.monotonic()
            if grace_until is None and any(p.leader_address for p in done.values()):
                grace_until = now + grace_s
            left = min(deadline, grace_until if grace_until is not None else deadline) - now
            if left <= 0:
                break
            cond.wait(left)
        probes = [done.get(endpoint) or probe_from_error(endpoint, None, "no answer in time")
                  for endpoint, _ in calls]
    for _, call in calls:
        call.cancel()  # a no-op for finished calls
    return probes


def find_leader(endpoints: Sequence[str], tls: ClientTLS | None, timeout: float,
                grace_s: float = PROBE_GRACE_S) -> tuple[Probe | None, list[Probe]]:
    """(the answer naming the highest-term leader or None, every endpoint's answer), asking every
    endpoint at once over channels of its own (closed before it returns), within ``timeout``."""
    channels: dict[str, grpc.Channel] = {}

    def channel_for(address: str) -> grpc.Channel:
        if address not in channels:
            channels[address] = tls_channel(address, tls)
        return channels[address]

    try:
        probes = ask_every_node(list(dict.fromkeys(endpoints)), channel_for, timeout, grace_s)
    finally:
        for ch in channels.values():
            ch.close()
    return highest_term_leader(probes), probes


# -- "not the leader" ------------------------------------------------------------------------------

# Trailing metadata of a refusal from a node that does not lead: a serialized LeaderResponse.
NOT_LEADER_KEY = "x-lighthouse-not-leader-bin"
# What nodes without the typed detail answer (and every node still says, for older clients).
OLD_NOT_LEADER_SENTENCES = ("must run on the leader", "is not the leader")
_OLD_LEADER_NAMED = re.compile(r"the leader is (?P<id>[A-Za-z0-9][A-Za-z0-9_.-]*) at (?P<address>\S+?)[);]?(\s|$)")


@dataclass(frozen=True)
class NotLeader:
    """A node's "I do not lead": who it thinks does ("" when it knows none) and its term (0:
    not said, an older node)."""

    leader_id: str = ""
    leader_address: str = ""
    term: int = 0


def not_leader_metadata(leader_id: str, leader_address: str, term: int) -> tuple[tuple[str, bytes], ...]:
    """The trailing metadata a node attaches to a "not the leader" refusal."""
    detail = cpb.LeaderResponse(leader_id=leader_id, leader_client_address=leader_address, term=term)
    return ((NOT_LEADER_KEY, detail.SerializeToString()),)


def not_leader(code: grpc.StatusCode | None, details: str,
               trailing_metadata: Iterable[tuple[str, Any]] | None = ()) -> NotLeader | None:
    """The refusal's "not the leader" detail, or None when it is another error. Reads the typed
    detail; from an older node, the sentence (FAILED_PRECONDITION or UNAVAILABLE naming it)."""
    for key, value in trailing_metadata or ():
        if key == NOT_LEADER_KEY:
            try:
                r = cpb.LeaderResponse.FromString(bytes(value))
            except Exception:  # a garbled detail: fall back to the sentence
                break
            return NotLeader(r.leader_id, r.leader_client_address, r.term)
    if code not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE) or \
            not any(s in details for s in OLD_NOT_LEADER_SENTENCES):
        return None
    named = _OLD_LEADER_NAMED.search(details)
    return NotLeader(named["id"], named["address"]) if named else NotLeader()


def not_leader_of_error(error: grpc.RpcError) -> NotLeader | None:
    """``not_leader`` of a failed blocking or asyncio call."""
    trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else ()
    return not_leader(error.code(), error.details() or "", trailing)


# -- agreement (local clusters, `up`) --------------------------------------------------------------


def serving_leader(statuses: Sequence[tuple[Any, cpb.NodeStatus | None]]) -> Any | None:
    """The key (an index, an address) of the node whose own Status says it leads and serves, in
    the highest term among such nodes (a deposed leader that has not heard yet is passed over)."""
    best: tuple[Any, int] | None = None
    for key, st in statuses:
        if st is not None and st.role == cpb.LEADER and st.serving and (best is None or st.term > best[1]):
            best = (key, st.term)
    return None if best is None else best[0]


def agreed_leader(views: Sequence[cpb.NodeStatus | None]) -> tuple[str, int] | None:
    """``(leader id, term)`` when every view (a ``NodeStatus`` of each running node; None: no
    answer) names the same leader in the same term and that leader's own view says it leads
    and serves; otherwise None."""
    if not views or any(v is None for v in views):
        return None
    names = {(v.leader_id, v.term) for v in views if v is not None}
    if len(names) != 1:
        return None
    leader_id, term = names.pop()
    if not leader_id:
        return None
    own = [v for v in views if v is not None and v.node.id == leader_id]
    if len(own) != 1 or own[0].role != cpb.LEADER or not own[0].serving:
        return None
    return leader_id, term
