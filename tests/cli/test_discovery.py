"""client.discovery: the one endpoint parser and leader finder of the CLI, the admin client,
ftclient, job ports and the local cluster, and the typed "not the leader" detail.

The cases that diverged before it existed are named: ``split_endpoints('grpcs://h:1')`` kept the
scheme (the CLI dialed ``grpcs://h:1``), ``http://h:1?job=x`` failed in the CLI though ftclient
took it, and ``AdminClient.leader`` took the first node naming a leader where ftclient took the
highest term.
"""

from __future__ import annotations

from concurrent import futures
from typing import Any

import grpc
import pytest
from click.testing import CliRunner

from ftclient.lighthouse_client import parse_endpoints as ftclient_parse_endpoints
from lighthouse_cluster.cli.commands import main
from lighthouse_cluster.client import discovery
from lighthouse_cluster.client.admin_client import AdminCallError, AdminClient
from lighthouse_cluster.client.discovery import (
    NOT_LEADER_KEY,
    Endpoints,
    NotLeader,
    Probe,
    Target,
    agreed_leader,
    ask_every_node,
    choose_target,
    highest_term_leader,
    not_leader,
    not_leader_metadata,
    parse_endpoints,
    serving_leader,
)
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb

# -- endpoints ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "addresses", "job", "tls"), [
    ("http://a:1", ("a:1",), None, False),
    ("grpc://a:1", ("a:1",), None, False),
    ("https://a:1", ("a:1",), None, True),
    ("grpcs://h:1", ("h:1",), None, True),        # the CLI kept "grpcs://h:1" and dialed that
    ("HTTPS://A.example.com:29510/", ("A.example.com:29510",), None, True),
    ("a:1", ("a:1",), None, False),
    ("lh-0.lh.svc.cluster.local:29510", ("lh-0.lh.svc.cluster.local:29510",), None, False),
    ("http://[::1]:3/, [fe80::1]:4", ("[::1]:3", "[fe80::1]:4"), None, False),
    ("http://h:1?job=x", ("h:1",), "x", False),   # raised in the CLI; ftclient took it
    ("http://a:1,http://b:2?job=x", ("a:1", "b:2"), "x", False),
    (" http://a:1 , ,b:2  http://a:1 ", ("a:1", "b:2"), None, False),  # whitespace, empty items, duplicates
    (["http://a:1,b:2", "c:3"], ("a:1", "b:2", "c:3"), None, False),
    ("http://a:1,grpcs://b:2", ("a:1", "b:2"), None, True),
    ("a:01", ("a:1",), None, False),
])
def test_endpoints_parse_the_same_everywhere(value: Any, addresses: tuple[str, ...], job: str | None,
                                             tls: bool) -> None:
    assert parse_endpoints(value) == Endpoints(addresses, job, tls)
    assert ftclient_parse_endpoints(value) == list(addresses)


@pytest.mark.parametrize(("value", "message"), [
    ("", "no endpoints"),
    (" , ", "no endpoints"),
    ("ftp://a:1", r"unknown scheme 'ftp://'; use http:// or grpc://"),
    ("http://a", "is not HOST:PORT"),
    ("a:port", "port must be a number in 1-65535"),
    ("a:0", "port must be a number in 1-65535"),
    ("a:65536", "port must be a number in 1-65535"),
    ("::1:29510", r"put an IPv6 address in brackets \(\[::1\]:29510\)"),
    ("[::1:29510", "an IPv6 address is written"),
    ("[zz::1]:3", "is not an IPv6 address"),
    ("http://a:1/path", "no path or user"),
    ("http://u@a:1", "no path or user"),
    ("http://a b:1", "not HOST:PORT|not a host name"),
    ("bad!host:1", "is not a host name or address"),
    ("http://a:1?job=x,http://b:2?job=y", "name different jobs"),
    ("http://a:1?lr=1", r"only query understood is \?job=NAME"),
    ("http://a:1?job=bad name", "job name 'bad name'"),
])
def test_a_bad_endpoint_is_a_clear_value_error(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_endpoints(value)
    with pytest.raises(ValueError, match=message):
        ftclient_parse_endpoints(value)


def test_the_cli_takes_what_ftclient_takes() -> None:
    # Before: "endpoint 'http://h:1?job=x' has a non-numeric port"; ftclient took it. Now both
    # parse it alike, and the CLI gets as far as dialing h:1 (nothing listens: exit 1, not 2).
    res = CliRunner().invoke(main, ["status", "--endpoints", "http://127.0.0.1:1?job=x", "--timeout", "0.3"],
                             env={"LIGHTHOUSE_CLUSTER_TLS_CA": None})
    assert res.exit_code == 1 and "non-numeric" not in res.output and "127.0.0.1:1" in res.output
    res = CliRunner().invoke(main, ["status", "--endpoints", "ftp://h:1"])
    assert res.exit_code == 2 and "unknown scheme" in res.output


# -- the leader -----------------------------------------------------------------------------------


def test_the_leader_named_in_the_highest_term_wins() -> None:
    probes = [Probe("a:1", leader_address="x:1", term=3), Probe("b:2", error="UNAVAILABLE: down"),
              Probe("c:3", leader_address="y:1", term=4), Probe("d:4", leader_address="z:1", term=4)]
    assert highest_term_leader(probes) == probes[2]  # the first answer of the highest term
    assert choose_target(probes) == Target("y:1", cluster=True, term=4)
    assert highest_term_leader([Probe("a:1"), Probe("b:2", error="x")]) is None
    assert choose_target([Probe("a:1", unimplemented=True)]) == Target("a:1", cluster=False)


class _Future:
    """A finished ``Leader.future`` call (a reply or an RpcError), or one that never finishes."""

    def __init__(self, reply: cpb.LeaderResponse | None = None, code: grpc.StatusCode | None = None) -> None:
        self.reply, self.code, self.cancelled = reply, code, False

    def add_done_callback(self, fn: Any) -> None:
        if self.reply is not None or self.code is not None:
            fn(self)

    def result(self) -> cpb.LeaderResponse:
        if self.code is not None:
            error = grpc.RpcError()
            error.code = lambda: self.code  # type: ignore[attr-defined]
            error.details = lambda: "down"  # type: ignore[attr-defined]
            raise error
        assert self.reply is not None
        return self.reply

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class _Channel:
    """``LighthouseClusterStub(channel).Leader.future`` answers ``answer`` (a ``_Future``)."""

    def __init__(self, answer: _Future) -> None:
        self.answer = answer
        self.closed = False

    def unary_unary(self, path: str, *args: Any, **kwargs: Any) -> Any:
        answer = self.answer

        class Method:
            def future(self, request: Any, timeout: float) -> _Future:
                return answer
        return Method()

    def unary_stream(self, *args: Any, **kwargs: Any) -> Any:
        return None

    stream_unary = stream_stream = unary_stream

    def close(self) -> None:
        self.closed = True


def _leader(leader_id: str, address: str, term: int) -> cpb.LeaderResponse:
    return cpb.LeaderResponse(leader_id=leader_id, leader_client_address=address, term=term)


def test_every_node_is_asked_and_a_silent_one_does_not_hold_it_up() -> None:
    answers = {"a:1": _Future(_leader("n1", "a:1", 3)), "b:2": _Future(code=grpc.StatusCode.UNAVAILABLE),
               "c:3": _Future(_leader("n3", "c:3", 4)), "d:4": _Future()}  # d never answers
    probes = ask_every_node(list(answers), lambda e: _Channel(answers[e]), timeout=30.0, grace_s=0.05)
    assert [p.endpoint for p in probes] == ["a:1", "b:2", "c:3", "d:4"]
    assert probes[1].error == "UNAVAILABLE: down" and probes[1].code == grpc.StatusCode.UNAVAILABLE
    assert probes[3].error == "no answer in time" and answers["d:4"].cancelled
    assert highest_term_leader(probes) == probes[2] and probes[2].leader_id == "n3"


def test_admin_client_takes_the_highest_term_not_the_first_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: the first endpoint naming a leader won, here a deposed leader still in term 3.
    answers = {"a:1": _Future(_leader("n1", "a:1", 3)), "b:2": _Future(_leader("n2", "b:2", 4))}
    channels: list[_Channel] = []

    def channel(address: str, tls: Any) -> _Channel:
        channels.append(_Channel(answers[address]))
        return channels[-1]

    monkeypatch.setattr(discovery, "tls_channel", channel)
    address, answer = AdminClient(["a:1", "b:2"], timeout=5.0).leader()
    assert (address, answer.leader_id, answer.term) == ("b:2", "n2", 4)
    assert all(c.closed for c in channels)


def test_admin_client_says_why_no_leader_was_found(monkeypatch: pytest.MonkeyPatch) -> None:
    answers = {"a:1": _Future(cpb.LeaderResponse(term=2)), "b:2": _Future(code=grpc.StatusCode.UNAVAILABLE)}
    monkeypatch.setattr(discovery, "tls_channel", lambda address, tls: _Channel(answers[address]))
    with pytest.raises(AdminCallError, match=r"no leader found \(a:1: no leader known; b:2: UNAVAILABLE: down\)"):
        AdminClient(["a:1", "b:2"], timeout=0.5).leader()


def _status(node_id: str, leader_id: str, term: int, role: int = cpb.FOLLOWER, serving: bool = True) -> cpb.NodeStatus:
    return cpb.NodeStatus(node=cpb.NodeInfo(id=node_id), leader_id=leader_id, term=term, role=role, serving=serving)


def test_local_clusters_find_the_serving_leader_of_the_highest_term() -> None:
    old, new = _status("n1", "n1", 3, cpb.LEADER), _status("n2", "n2", 4, cpb.LEADER)
    assert serving_leader([(0, old), (1, None), (2, new)]) == 2
    assert serving_leader([(0, _status("n1", "n1", 5, cpb.LEADER, serving=False)), (1, _status("n2", "n1", 5))]) is None
    views = [_status("n1", "n2", 4), new, _status("n3", "n2", 4)]
    assert agreed_leader(views) == ("n2", 4)
    assert agreed_leader(views[:2] + [_status("n3", "n2", 3)]) is None


# -- "not the leader" -----------------------------------------------------------------------------


def test_not_leader_is_a_typed_detail() -> None:
    trailing = not_leader_metadata("n2", "h:2", 7)
    assert trailing[0][0] == NOT_LEADER_KEY and NOT_LEADER_KEY.endswith("-bin")  # binary metadata
    # Whatever the sentence says: the detail decides.
    assert not_leader(grpc.StatusCode.FAILED_PRECONDITION, "anything", trailing) == NotLeader("n2", "h:2", 7)
    assert not_leader(grpc.StatusCode.FAILED_PRECONDITION, "x", not_leader_metadata("", "", 7)) == NotLeader(term=7)
    assert not_leader(grpc.StatusCode.FAILED_PRECONDITION, "jobs add: job 'x' has live replicas") is None
    assert not_leader(grpc.StatusCode.NOT_FOUND, "no job 'x'", ()) is None


@pytest.mark.parametrize(("code", "details", "expected"), [
    # What nodes before the detail answer (a rolling upgrade runs both versions side by side).
    (grpc.StatusCode.FAILED_PRECONDITION,
     "jobs add must run on the leader; node n1 is not (the leader is n2 at 127.0.0.1:4)", NotLeader("n2", "127.0.0.1:4")),
    (grpc.StatusCode.FAILED_PRECONDITION,
     "snapshot save must run on the leader; node n1 is not (no leader is serving yet; retry shortly)", NotLeader()),
    (grpc.StatusCode.FAILED_PRECONDITION, "node n1 is not the leader; the leader is n2 at [::1]:4",
     NotLeader("n2", "[::1]:4")),
    (grpc.StatusCode.UNAVAILABLE, "node n1 is not the leader (forwarded)", NotLeader()),
    (grpc.StatusCode.INVALID_ARGUMENT, "must run on the leader", None),
])
def test_older_nodes_sentences_still_count(code: grpc.StatusCode, details: str, expected: NotLeader | None) -> None:
    assert not_leader(code, details) == expected
    assert AdminCallError(f"h:1: {code.name}: {details}", code).refused is (expected is None and
                                                                          code == grpc.StatusCode.INVALID_ARGUMENT)


def test_admin_error_on_a_follower_carries_the_detail() -> None:
    from types import SimpleNamespace

    from lighthouse_cluster.server.admin import AdminError, NodeAdmin
    from lighthouse_cluster.server.config import PeerSpec

    node = SimpleNamespace(raft=SimpleNamespace(is_leader=False, term=9), coordinator=None,
                           config=SimpleNamespace(node_id="n1"),
                           leader_peer=lambda: PeerSpec("n2", "h:12", "h:22"))
    with pytest.raises(AdminError) as caught:
        NodeAdmin(node).require_leader("jobs add")  # type: ignore[arg-type]
    e = caught.value
    assert "jobs add must run on the leader" in e.message  # for clients older than the detail
    assert not_leader(e.code, "", e.trailing) == NotLeader("n2", "h:22", 9)


# -- with a server: a follower's typed refusal routes the call to the leader it names --------------


class _Admin(grpc.GenericRpcHandler):
    """LighthouseAdmin/AddJob and LighthouseCluster/Leader of one fake node."""

    def __init__(self, leads: bool, leader: cpb.LeaderResponse, typed: bool) -> None:
        self.leads, self.leader, self.typed, self.calls = leads, leader, typed, 0

    def service(self, details: grpc.HandlerCallDetails) -> Any:
        if details.method.endswith("/Leader"):
            return grpc.unary_unary_rpc_method_handler(
                lambda req, ctx: self.leader, request_deserializer=cpb.LeaderRequest.FromString,
                response_serializer=cpb.LeaderResponse.SerializeToString)
        if details.method.endswith("/AddJob"):
            def add(req: cpb.AddJobRequest, ctx: grpc.ServicerContext) -> cpb.Job:
                self.calls += 1
                if self.leads:
                    return cpb.Job(name=req.name)
                named = getattr(self, "refusal_names", self.leader)
                if self.typed:
                    ctx.set_trailing_metadata(not_leader_metadata(named.leader_id, named.leader_client_address,
                                                                  named.term))
                    ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, "not leading")  # the detail alone decides
                ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, "jobs add must run on the leader; node n1 is not "
                          f"(the leader is {named.leader_id} at {named.leader_client_address})")
            return grpc.unary_unary_rpc_method_handler(add, request_deserializer=cpb.AddJobRequest.FromString,
                                                       response_serializer=cpb.Job.SerializeToString)
        return None


@pytest.mark.integration
@pytest.mark.parametrize("typed", [True, False], ids=["typed-detail", "older-node-sentence"])
def test_a_call_refused_by_a_follower_goes_to_the_leader_it_names(typed: bool) -> None:
    servers = [grpc.server(futures.ThreadPoolExecutor(4)) for _ in range(2)]
    ports = [s.add_insecure_port("127.0.0.1:0") for s in servers]
    follower_address, leader_address = (f"127.0.0.1:{p}" for p in ports)
    # The follower still names itself leader (a stale term-4 view: the only endpoint given, so
    # discovery picks it); its refusal names the real leader, which the client goes to next.
    follower = _Admin(False, _leader("n1", follower_address, 4), typed)
    follower.refusal_names = _leader("n2", leader_address, 5)  # type: ignore[attr-defined]
    leader = _Admin(True, _leader("n2", leader_address, 5), typed)
    servers[0].add_generic_rpc_handlers((follower,))
    servers[1].add_generic_rpc_handlers((leader,))
    for s in servers:
        s.start()
    try:
        client = AdminClient([follower_address], timeout=5.0)
        assert client.call("AddJob", cpb.AddJobRequest(name="j")).name == "j"
        assert follower.calls == 1 and leader.calls == 1
    finally:
        for s in servers:
            s.stop(None)
