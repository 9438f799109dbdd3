"""How the node's HTTP port is served: aiohttp on the node's event loop, its limits, its timeouts
and its TLS. What it serves (the routes) is ``http_endpoints``.

Why aiohttp. The node runs one asyncio event loop (uvloop) shared with ``grpc.aio``; the HTTP
port must live on that loop, cost no thread, and answer /livez only when the loop itself runs.
aiohttp's server is an asyncio protocol on whatever loop is running (uvloop included), takes an
``ssl.SSLContext`` for HTTPS, parses HTTP/1.1 with bounded line, field and header counts, and
is maintained by aio-libs with regular security releases of that parser. The alternatives were
weighed against that: uvicorn (+ Starlette) wants to own the process (its signal handlers, its
loop policy, its logging config) and brings two dependencies for what one does here; hypercorn
adds HTTP/2 nobody here needs; tornado wraps asyncio in an IOLoop of its own; the standard
library's ``http.server`` is threads, blocking and without limits. The port serves five small
routes; aiohttp's ``web`` module with a route table is the smallest well-kept fit.

The limits and timeouts are those the hand-written server enforced, kept one by one:

* the request's head (request line and headers): at most ``MAX_HEADER_BYTES`` in all, else 431
  (aiohttp refuses a single line over it by itself, with 400), and at most ``MAX_HEADERS`` lines;
* the body: at most ``MAX_BODY_BYTES`` (413); chunked bodies are refused (400);
* one request per connection, answered with ``Connection: close``; ``Cache-Control: no-store``
  on every answer;
* ``read_timeout_s`` (10 s) from the connection's start (after the TLS handshake, itself
  bounded by the same time) to the end of the request's head, and again for its body: a client
  that has not sent them by then is disconnected without an answer;
* ``write_timeout_s`` (10 s) to send the answer; a client that does not read it is disconnected;
* the listen backlog (100) and a second's grace for open connections when the node stops. No cap
  on concurrent connections, as before: each is bounded in time and size instead.

TLS. Whenever the node serves its gRPC port with TLS (``--tls-cert``/``--tls-key``), this port
serves HTTPS with the same certificate and key (TLS 1.2 or later), never plain HTTP: a plaintext
request to it fails in the handshake, so the kill route's bearer token never crosses a plain
socket. Client certificates are not asked for, even when the gRPC port requires them
(``--tls-client-ca``): Kubernetes' HTTPS probes, Prometheus and browsers present none, the
routes other than kill only read, and kill needs the admin token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from aiohttp import web

from lighthouse_cluster.server.config import parse_host_port
from lighthouse_cluster.tls import ServerTLS

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 16 * 1024
MAX_HEADERS = 128
MAX_BODY_BYTES = 64 * 1024
READ_TIMEOUT_S = 10.0
WRITE_TIMEOUT_S = 10.0
BACKLOG = 100
SHUTDOWN_GRACE_S = 1.0
TEXT = "text/plain; charset=utf-8"


def text_response(status: int, message: str, **headers: str) -> web.Response:
    """A one-line ``text/plain`` answer (a trailing newline added)."""
    return web.Response(status=status, body=(message.rstrip("\n") + "\n").encode(),
                        headers={"Content-Type": TEXT, **headers})


def server_ssl_context(tls: ServerTLS) -> ssl.SSLContext:
    """An HTTPS context with the node's certificate chain and key (TLS 1.2 or later, HTTP/1.1)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])
    with _pem_paths(tls.cert_chain, tls.private_key) as (cert, key):
        context.load_cert_chain(cert, key)
    return context


@contextlib.contextmanager
def _pem_paths(*pems: bytes) -> Iterator[list[str]]:
    """Paths OpenSSL can read ``pems`` from (``ssl`` loads a certificate and key only from files):
    anonymous memory files on Linux, so that the key is never written anywhere; elsewhere a
    private temporary directory, removed at once."""
    if hasattr(os, "memfd_create") and Path("/proc/self/fd").is_dir():
        fds = [os.memfd_create("lighthouse-cluster-http-tls") for _ in pems]
        try:
            for fd, pem in zip(fds, pems):
                os.write(fd, pem)
            yield [f"/proc/self/fd/{fd}" for fd in fds]
        finally:
            for fd in fds:
                os.close(fd)
        return
    with tempfile.TemporaryDirectory(prefix="lighthouse-cluster-http-tls-") as directory:
        paths = []
        for i, pem in enumerate(pems):
            path = Path(directory) / f"{i}.pem"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(pem)
            paths.append(str(path))
        yield paths


class _ProtocolLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's protocol-level messages (a malformed request, a client gone) as one debug line,
    never a traceback: the text of a malformed request's error may quote its header lines, and
    one of them may carry the admin token."""

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kwargs: Any) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        self.debug(f"{msg} ({type(exc).__name__ if exc is not None else 'no exception'})", *args)


class HttpServer:
    """aiohttp serving ``routes`` at ``bind`` (HTTPS when ``tls`` is given) with the limits of the
    module's docstring; ``middlewares`` run inside those limits, around each route's handler."""

    def __init__(self, routes: Iterable[web.AbstractRouteDef], bind: str, tls: ServerTLS | None = None, *,
                 middlewares: Iterable[Any] = (), read_timeout_s: float = READ_TIMEOUT_S,
                 write_timeout_s: float = WRITE_TIMEOUT_S) -> None:
        self.bind = bind
        self.tls = tls
        self.read_timeout_s = read_timeout_s
        self.write_timeout_s = write_timeout_s
        self.address = bind
        self.app = web.Application(client_max_size=MAX_BODY_BYTES,
                                   middlewares=[self._limits, *middlewares])
        self.app.add_routes(list(routes))
        self._runner: web.AppRunner | None = None
        self._server: asyncio.AbstractServer | None = None
        # Each connection's deadline for its request's head, until that head has arrived.
        self._head_deadlines: dict[Any, asyncio.TimerHandle] = {}

    @property
    def scheme(self) -> str:
        return "http" if self.tls is None else "https"

    @property
    def url(self) -> str:
        """The port's base URL as bound (``https://127.0.0.1:8443``)."""
        return f"{self.scheme}://{self.address}"

    async def start(self) -> None:
        host, port = parse_host_port(self.bind, "--http-bind", allow_zero=True)  # 0: any free port
        host = host.strip("[]")
        context = server_ssl_context(self.tls) if self.tls is not None else None
        runner = web.AppRunner(self.app, handle_signals=False, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S,
                               keepalive_timeout=self.read_timeout_s, max_line_size=MAX_HEADER_BYTES,
                               max_field_size=MAX_HEADER_BYTES, max_headers=MAX_HEADERS, lingering_time=0,
                               logger=_ProtocolLog(logging.getLogger(f"{__name__}.protocol"), {}))
        await runner.setup()
        loop = asyncio.get_running_loop()
        tls_args: dict[str, Any] = {} if context is None else dict(
            ssl=context, ssl_handshake_timeout=self.read_timeout_s, ssl_shutdown_timeout=self.write_timeout_s)
        try:
            if host == "::":
                # asyncio makes an IPv6 listener IPv6-only; [::] means every address here, as on
                # the gRPC port (and `up` prints 127.0.0.1 URLs for it).
                sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                    sock.bind(("::", port))
                except OSError:
                    sock.close()
                    raise
                self._server = await loop.create_server(self._connection, sock=sock, backlog=BACKLOG, **tls_args)
            else:
                self._server = await loop.create_server(self._connection, host, port, backlog=BACKLOG, **tls_args)
        except OSError as e:
            await runner.cleanup()
            raise OSError(f"cannot bind HTTP address {self.bind}: {e.strerror or e}") from e
        self._runner = runner
        sockname = self._server.sockets[0].getsockname()
        self.address = f"[{sockname[0]}]:{sockname[1]}" if ":" in sockname[0] else f"{sockname[0]}:{sockname[1]}"

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for deadline in self._head_deadlines.values():
            deadline.cancel()
        self._head_deadlines.clear()
        if self._runner is not None:
            await self._runner.cleanup()  # open connections get SHUTDOWN_GRACE_S, then are closed
        self._server, self._runner = None, None

    # -- the limits -----------------------------------------------------------------------------

    def _connection(self) -> asyncio.BaseProtocol:
        """A new connection's aiohttp protocol, with a deadline for its request's head."""
        assert self._runner is not None and self._runner.server is not None
        protocol = self._runner.server()
        loop = asyncio.get_running_loop()
        self._head_deadlines[protocol] = loop.call_later(self.read_timeout_s, self._head_overdue, protocol)
        return protocol

    def _head_overdue(self, protocol: Any) -> None:
        if self._head_deadlines.pop(protocol, None) is not None:
            protocol.force_close()  # no request head within the read timeout: drop it, unanswered

    @web.middleware
    async def _limits(self, request: web.Request, handler: Any) -> web.StreamResponse:
        deadline = self._head_deadlines.pop(request.protocol, None)
        if deadline is not None:
            deadline.cancel()
        head = len(request.method) + len(request.raw_path) + 12 + sum(len(k) + len(v) + 4
                                                                         for k, v in request.raw_headers)
        if head > MAX_HEADER_BYTES:
            response: web.StreamResponse = text_response(431, "request headers too large")
        elif "chunked" in request.headers.get("Transfer-Encoding", "").lower():
            response = text_response(400, "chunked request bodies are not supported")
        elif (request.content_length or 0) > MAX_BODY_BYTES:
            response = text_response(413, f"request body over {MAX_BODY_BYTES} bytes")
        else:
            try:
                # Read (and ignore) the body, so that closing the connection after the answer
                # does not reset it under a client still sending.
                await asyncio.wait_for(request.read(), self.read_timeout_s)
            except asyncio.TimeoutError:
                request.protocol.force_close()
                raise ConnectionResetError("request body not received within the read timeout") from None
            try:
                response = await handler(request)
            except web.HTTPException as e:  # what the middlewares given left of the route table's 404 and 405
                allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else {}
                response = text_response(e.status, e.reason, **allow)
            except Exception:  # noqa: BLE001 - one bad request must not take the port down
                log.exception("HTTP %s %s failed", request.method, request.path)
                response = text_response(500, "internal error (see the node's log)")
        response.headers["Cache-Control"] = "no-store"
        response.headers["Server"] = "lighthouse-cluster"
        response.force_close()  # one request per connection: Connection: close
        try:
            await asyncio.wait_for(self._send(request, response), self.write_timeout_s)
        except asyncio.TimeoutError:
            if request.transport is not None:
                request.transport.abort()  # the client does not read its answer
        return response

    @staticmethod
    async def _send(request: web.Request, response: web.StreamResponse) -> None:
        await response.prepare(request)
        await response.write_eof()
