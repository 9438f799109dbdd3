"""The node's HTTP port on aiohttp (``server/http_server.py``, ``server/http_endpoints.py``): every
route's answer and headers, the limits and timeouts the hand-written server enforced, and HTTPS
with the node's certificate whenever the node has TLS, so that the kill route's bearer token never
crosses a plain socket.

The endpoints serve in-process on loopback (a uvloop event loop in a thread of its own, as in a
node) in front of a fake node; the last test runs a real TLS node. The wire test relays the
connection through a loopback proxy that records every byte both ways.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import json
import socket
import ssl
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import grpc
import pytest
import uvloop
from prometheus_client import CONTENT_TYPE_LATEST

from support.waiting import wait_for
from lighthouse_cluster.core import codec
from lighthouse_cluster.core.codec import CommitQuorum
from lighthouse_cluster.core.quorum import Member, Quorum
from lighthouse_cluster.core.state_machine import QuorumStateMachine
from lighthouse_cluster.local.cluster import LocalCluster, free_ports
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import torchft_pb2 as pb
from lighthouse_cluster.proto import torchft_pb2_grpc as pb_grpc
from lighthouse_cluster.server.http_endpoints import HttpEndpoints
from lighthouse_cluster.server.http_server import MAX_BODY_BYTES, MAX_HEADER_BYTES
from lighthouse_cluster.tls import PKIFiles, ServerTLS, generate_pki

pytestmark = pytest.mark.integration

TOKEN = "http-port-token-7e1f0a9c"
TEXT = "text/plain; charset=utf-8"


# -- a fake node, a fake torchft manager, the endpoints on a loop of their own ----------------------


class FakeManager(pb_grpc.ManagerServiceServicer):
    def __init__(self) -> None:
        self.kills: list[str] = []

    def Kill(self, request: pb.KillRequest, context: Any) -> pb.KillResponse:  # noqa: N802
        self.kills.append(request.msg)
        return pb.KillResponse()


class FakeNode:
    """A ready follower whose default job's quorum has one member, ``victim`` at ``manager``."""

    def __init__(self, manager: str) -> None:
        self.config = SimpleNamespace(node_id="n1", peer_tls=None,
                                      self_peer=SimpleNamespace(client_address="127.0.0.1:1"))
        self.other_members: tuple[Any, ...] = ()
        self.metrics = SimpleNamespace(exposition=lambda: b"# HELP lighthouse_cluster_ready x\n")
        self.machine = QuorumStateMachine(codec.JOBS_SCHEMA_VERSION)
        q = Quorum(quorum_id=1, participants=(Member(replica_id="victim", address=f"http://{manager}"),),
                   created_ms=1)
        assert self.machine.apply(CommitQuorum(expected_quorum_id=0, quorum=q, term=0, node_id="n1")).applied
        self.job_admin = SimpleNamespace(list_jobs=lambda: cpb.ListJobsResponse(answered_by="n1"))
        self.ready = True

    def status(self) -> cpb.NodeStatus:
        return cpb.NodeStatus(node=cpb.NodeInfo(id="n1", client_address="127.0.0.1:1"), role=cpb.FOLLOWER, term=2)

    def readiness(self) -> tuple[bool, str]:
        return (True, "ready") if self.ready else (False, "no known leader (role follower, term 2)")


class Served:
    """``HttpEndpoints`` serving in a thread with its own uvloop event loop, as in a node."""

    def __init__(self, endpoints: HttpEndpoints) -> None:
        self.endpoints = endpoints
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.call(endpoints.start())

    def call(self, coro: Any, timeout: float = 10) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def port(self) -> int:
        return int(self.endpoints.address.rsplit(":", 1)[1])

    def close(self) -> None:
        self.call(self.endpoints.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture
def manager() -> Iterator[tuple[str, FakeManager]]:
    fake = FakeManager()
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
    pb_grpc.add_ManagerServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", fake
    finally:
        server.stop(None)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKIFiles:
    return generate_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def serve(manager: tuple[str, FakeManager]) -> Iterator[Callable[..., Served]]:
    started: list[Served] = []

    def make(tls: ServerTLS | None = None, token: str | None = TOKEN, **kwargs: Any) -> Served:
        served = Served(HttpEndpoints(FakeNode(manager[0]), "127.0.0.1:0", token, tls, **kwargs))
        started.append(served)
        return served

    yield make
    for served in started:
        served.close()


def client_context(pki: PKIFiles) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(pki.ca_cert))


def request(port: int, method: str, path: str, headers: dict[str, str] | None = None, body: bytes | None = None,
            context: ssl.SSLContext | None = None) -> tuple[int, bytes, http.client.HTTPMessage]:
    conn: http.client.HTTPConnection
    if context is None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    else:
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=context)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read(), resp.headers
    finally:
        conn.close()


def raw(port: int, data: bytes, timeout: float = 10) -> bytes:
    """``data`` sent on a plain socket, and everything that comes back until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except ConnectionResetError:
            pass
        return out


# -- routes, answers and headers ------------------------------------------------------------------


def test_every_route_answers_as_before(serve, manager) -> None:
    served = serve()
    port = served.port
    status, body, headers = request(port, "GET", "/livez")
    assert (status, body, headers["Content-Type"]) == (200, b"ok\n", TEXT)
    assert headers["Cache-Control"] == "no-store" and headers["Connection"] == "close"
    assert headers["Content-Length"] == "3" and "aiohttp" not in headers.get("Server", "")
    assert request(port, "GET", "/readyz")[:2] == (200, b"ready\n")
    served.endpoints.node.ready = False
    assert request(port, "GET", "/readyz")[:2] == (503, b"no known leader (role follower, term 2)\n")
    status, body, headers = request(port, "GET", "/metrics")
    assert (status, headers["Content-Type"]) == (200, CONTENT_TYPE_LATEST) and body.startswith(b"# HELP")
    for path in ("/", "/index.html"):
        status, body, headers = request(port, "GET", path)
        assert (status, headers["Content-Type"]) == (200, "text/html; charset=utf-8") and b"/status.json" in body
    status, body, headers = request(port, "GET", "/status.json")
    assert (status, headers["Content-Type"]) == (200, "application/json")
    assert json.loads(body)["self"] == {"id": "n1", "ready": False, "reason": "no known leader (role follower, term 2)",
                                        "kill_enabled": True}
    status, body, headers = request(port, "HEAD", "/livez")
    assert (status, body, headers["Content-Length"]) == (200, b"", "3")

    # What is not routed, said as before.
    status, body, headers = request(port, "GET", "/nope?x=1")
    assert (status, body, headers["Content-Type"]) == (404, b"no such endpoint: /nope\n", TEXT)
    assert request(port, "GET", "/replica//kill")[0] == 404
    status, body, headers = request(port, "POST", "/metrics")
    assert (status, body, headers["Allow"]) == (405, b"/metrics takes GET\n", "GET, HEAD")
    status, body, headers = request(port, "GET", "/replica/victim/kill")
    assert (status, body, headers["Allow"]) == (405, b"kill takes POST\n", "POST")

    # Kill: the token, the job, the member, as before.
    status, body, headers = request(port, "POST", "/replica/victim/kill")
    assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
    assert request(port, "POST", "/replica/victim/kill", {"Authorization": "Bearer wrong"})[0] == 401
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert request(port, "POST", "/replica/victim/kill?job=nope", auth)[:2] == (404, b"no job 'nope' on this cluster\n")
    assert request(port, "POST", "/replica/ghost/kill", auth)[:2] == (
        404, b"replica 'ghost' is not a member of the current quorum\n")
    assert manager[1].kills == []
    status, body, _ = request(port, "POST", "/replica/victim/kill?job=nope&job=default", auth)  # the last counts
    assert status == 200 and json.loads(body) == {"killed": "victim", "job": "default",
                                                  "address": f"http://{manager[0]}", "answered": True}
    assert manager[1].kills == ["killed from lighthouse-cluster node n1"]


def test_kill_without_a_token_configured_is_refused(serve) -> None:
    served = serve(token=None)
    status, body, _ = request(served.port, "POST", "/replica/victim/kill", {"Authorization": f"Bearer {TOKEN}"})
    assert status == 403 and b"no admin token" in body


# -- limits and timeouts --------------------------------------------------------------------------


def test_request_size_limits(serve) -> None:
    port = serve().port
    # The head: 16 KiB in all, however it is split into lines.
    many = {f"X-Filler-{i}": "x" * 1000 for i in range(MAX_HEADER_BYTES // 1000 + 1)}
    status, body, _ = request(port, "GET", "/livez", many)
    assert (status, body) == (431, b"request headers too large\n")
    assert request(port, "GET", "/livez", {"X-Long": "x" * (MAX_HEADER_BYTES + 1)})[0] in (400, 431)
    assert request(port, "GET", "/livez", {f"X-Filler-{i}": "x" * 100 for i in range(100)})[0] == 200
    # The body: 64 KiB; chunked bodies refused.
    assert request(port, "POST", "/replica/victim/kill", body=b"x" * (MAX_BODY_BYTES + 1))[:2] == (
        413, f"request body over {MAX_BODY_BYTES} bytes\n".encode())
    assert request(port, "POST", "/replica/victim/kill", body=b"x" * MAX_BODY_BYTES)[0] == 401
    answer = raw(port, b"POST /replica/victim/kill HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                       b"3\r\nabc\r\n0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400 ") and answer.endswith(b"chunked request bodies are not supported\n")


def test_one_request_per_connection(serve) -> None:
    port = serve().port
    answer = raw(port, b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\nGET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.count(b"HTTP/1.1 ") == 1 and answer.endswith(b"\r\n\r\nok\n")
    assert b"Connection: close\r\n" in answer


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
def test_a_client_that_sends_no_request_is_disconnected_after_the_read_timeout(serve, pki, tls: bool) -> None:
    served = serve(tls=ServerTLS.from_files(pki.server_cert, pki.server_key) if tls else None, read_timeout_s=0.5)
    context = client_context(pki) if tls else None

    def silence(head: bytes | None) -> float:
        """Seconds until the server hangs up on a client that sends ``head`` (None: not even a TLS
        handshake) and then nothing."""
        with socket.create_connection(("127.0.0.1", served.port), timeout=10) as plain:
            started = time.monotonic()
            s = plain if context is None or head is None else context.wrap_socket(plain, server_hostname="127.0.0.1")
            s.sendall(head or b"")
            try:
                out = s.recv(65536)
            except (ConnectionResetError, ssl.SSLError):
                out = b""
            assert not out.startswith(b"HTTP/"), out
            return time.monotonic() - started

    for head in (None, b"", b"GET /livez HTTP/1.1\r\nHost: x\r\n"):  # nothing, no request, half a head
        took = silence(head)
        assert 0.3 < took < 5.0, (head, took)
    assert request(served.port, "GET", "/livez", context=context)[0] == 200


def test_a_client_that_does_not_read_its_answer_is_cut_off_after_the_write_timeout(serve) -> None:
    served = serve(write_timeout_s=0.5)
    big = b"# " + b"x" * (64 * 1024 * 1024) + b"\n"  # more than any socket buffers hold
    served.endpoints.node.metrics = SimpleNamespace(exposition=lambda: big)
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(2.0)  # not reading: the server's write times out meanwhile
        got = 0
        try:
            while chunk := s.recv(1 << 20):
                got += len(chunk)
        except ConnectionResetError:
            pass
    assert 0 < got < len(big)
    assert request(served.port, "GET", "/livez")[0] == 200  # the port serves on


# -- HTTPS with the node's certificate; the token never on a plain socket ------------------------


class RecordingProxy:
    """A loopback TCP relay to ``port`` that records every byte in both directions."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.recorded = bytearray()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target), timeout=10)
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                with self._lock:
                    self.recorded += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._listener.close()


def test_with_tls_the_port_speaks_only_https_with_the_nodes_certificate(serve, pki, manager) -> None:
    served = serve(tls=ServerTLS.from_files(pki.server_cert, pki.server_key))
    port = served.port
    assert served.endpoints.url == f"https://127.0.0.1:{port}"
    context = client_context(pki)
    assert request(port, "GET", "/livez", context=context)[:2] == (200, b"ok\n")
    # The certificate is the node's own.
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s, \
            context.wrap_socket(s, server_hostname="127.0.0.1") as tls_sock:
        presented = tls_sock.getpeercert(binary_form=True)
        assert tls_sock.version() in ("TLSv1.2", "TLSv1.3")
    assert presented == ssl.PEM_cert_to_DER_cert(pki.server_cert.read_text())
    # A client that does not trust the CA is refused by its own TLS; Kubernetes' HTTPS probe
    # (which verifies nothing) gets its answer.
    with pytest.raises(ssl.SSLCertVerificationError):
        request(port, "GET", "/livez", context=ssl.create_default_context())
    kubelet = ssl.create_default_context()
    kubelet.check_hostname, kubelet.verify_mode = False, ssl.CERT_NONE
    assert request(port, "GET", "/readyz", context=kubelet)[0] == 200

    # Plain HTTP to the TLS port: no HTTP answer, and the kill route never runs.
    kill = (f"POST /replica/victim/kill HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Length: 0\r\n\r\n").encode()
    assert not raw(port, kill).startswith(b"HTTP/")
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        request(port, "POST", "/replica/victim/kill", {"Authorization": f"Bearer {TOKEN}"})
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/livez", timeout=10)
    assert manager[1].kills == []

    # Over TLS the kill is answered, and a capture of the wire holds TLS records, never the token.
    proxy = RecordingProxy(port)
    try:
        status, body, _ = request(proxy.port, "POST", "/replica/victim/kill", {"Authorization": f"Bearer {TOKEN}"},
                                  context=context)
        assert status == 200 and json.loads(body)["killed"] == "victim"
        wire = bytes(proxy.recorded)
    finally:
        proxy.close()
    assert manager[1].kills == ["killed from lighthouse-cluster node n1"]
    assert wire[:1] == b"\x16" and len(wire) > 500  # a TLS handshake record, and the exchange after it
    assert TOKEN.encode() not in wire and b"Bearer" not in wire and b"/replica/" not in wire


def test_the_proxy_would_see_the_token_on_a_plain_port(serve) -> None:
    """The capture above is a real one: on a plaintext port (a node without TLS) the same relay
    records the token."""
    proxy = RecordingProxy(serve().port)
    try:
        assert request(proxy.port, "POST", "/replica/ghost/kill", {"Authorization": f"Bearer {TOKEN}"})[0] == 404
        wait_for("the relay to record the request", lambda: TOKEN.encode() in bytes(proxy.recorded), 5)
    finally:
        proxy.close()


def test_a_tls_node_serves_https_on_its_http_port(make_cluster, pki: PKIFiles) -> None:
    """A real node with --tls-cert/--tls-key and --http-bind: /readyz over HTTPS with the node's
    CA, nothing over plain HTTP, and its log names the https:// URL."""
    cluster: LocalCluster = make_cluster(nodes=1, min_replicas=1, pki=pki, http_ports=free_ports(1))
    address = cluster.http_address(0)
    context = client_context(pki)

    def readyz() -> int:
        return request(int(address.rsplit(":", 1)[1]), "GET", "/readyz", context=context)[0]

    wait_for("the node's /readyz 200 over HTTPS", readyz, 20, ready=lambda s: s == 200, context=cluster,
             retry_on=(OSError,))
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://{address}/readyz", timeout=10)
    logged = cluster.members[0].log_path.read_text()
    assert f"dashboard on https://{address}" in logged
    assert "Traceback" not in logged  # a plaintext client is no error of the node's
