"""Live recovery over HTTP: a healthy replica streams its state dict to recovering replicas.

This module owns :class:`HTTPTransport` (server and client) and its wire format.

Serving. ``send_checkpoint(step=s)`` does not copy anything: it records references to the
state dict's tensors, pickles the non-tensor structure (a few KB) and opens the gate. A request
for step ``s`` is then answered by writing each tensor's bytes straight from its memory to the
socket (a non-contiguous or non-CPU tensor is made contiguous on the CPU one tensor at a time),
so serving costs O(largest such tensor) memory, never a copy of the state dict.
``disallow_checkpoint()`` closes the gate: it waits for in-flight transfers (a reader-writer
lock) and, if they outlast the timeout, cuts them off, so the trainer never mutates weights
that are being sent. Requests that arrive while the gate is closed wait for the next
``send_checkpoint`` (up to the timeout); a request for another step is refused (HTTP 409).

Receiving. ``recv_checkpoint`` reads the manifest (structure + dtype/shape of every tensor),
allocates each tensor once and reads the bytes directly into it. With ``num_chunks > 0`` the
tensors are fetched over that many parallel connections. The whole call is bounded by its
timeout. Tensors arrive on the CPU, contiguous, bitwise equal to the source's.

Wire format (all integers little-endian), ``GET {metadata}{step}/stream``::

    b"FTCKPT1\\n"  u64 manifest_len  manifest (pickle)       -- the "preamble"
    then per tensor:  b"TNSR"  u32 index  u64 nbytes  raw bytes (C order)

``GET {metadata}{step}/manifest`` returns only the preamble and
``GET {metadata}{step}/chunk/{i}?of={n}&gen={g}`` only the records of tensors ``i, i+n, ...``.
The manifest is ``{"step", "generation", "tensors": [(dtype, shape, requires_grad,
is_parameter)], "tree": bytes}`` where ``tree`` pickles the state dict with every tensor
replaced by a persistent id ``("ftclient.tensor", index)``. The same tensor object appearing
twice (tied weights) is sent once and stays shared; distinct views of one storage are sent as
independent tensors. A DTensor (FSDP2, HSDP) is ``("ftclient.dtensor", index of its local
shard, its mesh pickled, placements, global shape, stride, requires_grad)``: only the shard is
streamed, and the receiver rebuilds the DTensor on the mesh as its own process resolves it (the
same layout in every replica group of HSDP). Other tensor subclasses, sparse and quantized
tensors are not streamed: they travel inside the pickled structure.

The format is ftclient's own, not torchft's (``/full`` requests are refused with an
explanation): both ends of a recovery must use ftclient. Peers are trusted (the structure is
unpickled, as torchft does): don't expose the port outside the training cluster.
"""

from __future__ import annotations

import ctypes
import http.client
import io
import logging
import pickle
import socket
import socketserver
import struct
import sys
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from http.server import BaseHTTPRequestHandler
from typing import Any, TypeVar

import torch
from torch import nn

from ftclient.checkpointing.transport import CheckpointTransport, LockClosedError, RWLock

logger: logging.Logger = logging.getLogger(__name__)

__all__ = ["CheckpointStepMismatchError", "CheckpointTransferError", "HTTPTransport"]

T = TypeVar("T")

_MAGIC = b"FTCKPT1\n"
_PREAMBLE = struct.Struct("<8sQ")
_RECORD = struct.Struct("<4sIQ")
_RECORD_TAG = b"TNSR"
_TENSOR_PID = "ftclient.tensor"
_DTENSOR_PID = "ftclient.dtensor"
_IO_CHUNK = 4 << 20  # bytes per socket write / read call (bounds each blocking call)
_ABORT_GRACE_S = 5.0  # after cutting transfers off, how long their threads may take to let go
_MAX_ERROR_BODY = 64 << 10


class CheckpointTransferError(RuntimeError):
    """A checkpoint could not be fetched from the source replica."""


class CheckpointStepMismatchError(CheckpointTransferError):
    """The source replica serves a different step than the one requested."""


# --------------------------------------------------------------------------------------------
# Tensors <-> bytes


def _byte_view(t: torch.Tensor) -> memoryview:
    """A writable, zero-copy byte view of a contiguous CPU tensor. The caller keeps ``t``
    alive while the view is used."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    assert t.is_contiguous() and t.device.type == "cpu"
    return memoryview((ctypes.c_ubyte * nbytes).from_address(t.data_ptr())).cast("B")


def _sendable(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous CPU tensor with plain bits; a copy only when it must be."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return t


def _streamable(obj: object) -> bool:
    return (
        type(obj) in (torch.Tensor, nn.Parameter)
        and obj.layout == torch.strided  # type: ignore[attr-defined]
        and not obj.is_quantized  # type: ignore[attr-defined]
        and obj.device.type != "meta"  # type: ignore[attr-defined]
    )


def _is_dtensor(v: object) -> bool:
    """``isinstance(v, DTensor)`` without importing DTensor (seconds) where none can exist."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(v, module.DTensor)


class _TreePickler(pickle.Pickler):
    """Pickles a state dict with tensors replaced by indices into ``self.tensors``; a DTensor
    by its local shard's index, its mesh (pickled once per mesh), placements, global shape
    and stride, so its shard is streamed like any tensor."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self._index: dict[int, int] = {}
        self._meshes: dict[int, bytes] = {}

    def _tensor_index(self, t: torch.Tensor) -> int:
        index = self._index.get(id(t))
        if index is None:
            index = len(self.tensors)
            self._index[id(t)] = index
            self.tensors.append(t)
        return index

    def persistent_id(self, obj: object) -> object:
        if _is_dtensor(obj):
            local = obj._local_tensor  # type: ignore[attr-defined]
            if not _streamable(local):
                return None  # torch pickles it whole
            mesh = obj.device_mesh  # type: ignore[attr-defined]
            if id(mesh) not in self._meshes:  # the same bytes object: pickled once, then memoized
                self._meshes[id(mesh)] = pickle.dumps(mesh, protocol=pickle.HIGHEST_PROTOCOL)
            return (_DTENSOR_PID, self._tensor_index(local), self._meshes[id(mesh)],
                    tuple(obj.placements), tuple(obj.shape), tuple(obj.stride()),  # type: ignore[attr-defined]
                    obj.requires_grad)  # type: ignore[attr-defined]
        if not _streamable(obj):
            return None
        return (_TENSOR_PID, self._tensor_index(obj))  # type: ignore[arg-type]


class _TreeUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file)
        self._tensors = tensors
        self._meshes: dict[bytes, Any] = {}
        self._dtensors: dict[int, Any] = {}  # one DTensor per shard: tied DTensors stay shared

    def persistent_load(self, pid: object) -> torch.Tensor:
        if isinstance(pid, tuple) and len(pid) == 2 and pid[0] == _TENSOR_PID:
            return self._tensors[pid[1]]
        if isinstance(pid, tuple) and len(pid) == 7 and pid[0] == _DTENSOR_PID:
            return self._dtensor(*pid[1:])
        raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")

    def _dtensor(self, index: int, mesh_bytes: bytes, placements: tuple[Any, ...], shape: tuple[int, ...],
                 stride: tuple[int, ...], requires_grad: bool) -> torch.Tensor:
        """The DTensor on the sender's mesh as this process resolves it (torch's own DTensor
        unpickling does the same; in HSDP every replica group has the same layout)."""
        if index not in self._dtensors:
            from torch.distributed.tensor import DTensor

            if mesh_bytes not in self._meshes:
                self._meshes[mesh_bytes] = pickle.loads(mesh_bytes)
            t = DTensor.from_local(self._tensors[index], self._meshes[mesh_bytes], placements, run_check=False,
                                   shape=torch.Size(shape), stride=stride)
            self._dtensors[index] = t.requires_grad_(requires_grad) if requires_grad else t
        return self._dtensors[index]


@dataclass
class _Offer:
    """What send_checkpoint made available: references to the live tensors, no copies."""

    step: int
    generation: int
    preamble: bytes
    tensors: list[torch.Tensor]
    nbytes: list[int]


def _make_offer(state_dict: object, step: int, generation: int) -> _Offer:
    buf = io.BytesIO()
    pickler = _TreePickler(buf)
    try:
        pickler.dump(state_dict)
    except Exception as e:
        raise TypeError(
            f"the state dict of step {step} cannot be served: {e}. Every non-tensor value in "
            "it must be picklable."
        ) from e
    tensors = pickler.tensors
    metas = [
        (t.dtype, tuple(t.shape), t.requires_grad, type(t) is nn.Parameter) for t in tensors
    ]
    manifest = pickle.dumps(
        {"step": step, "generation": generation, "tensors": metas, "tree": buf.getvalue()},
        protocol=pickle.HIGHEST_PROTOCOL,
    )
    return _Offer(
        step=step,
        generation=generation,
        preamble=_PREAMBLE.pack(_MAGIC, len(manifest)) + manifest,
        tensors=tensors,
        nbytes=[t.numel() * t.element_size() for t in tensors],
    )


def _allocate(metas: list[tuple[torch.dtype, tuple[int, ...], bool, bool]]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for dtype, shape, requires_grad, is_parameter in metas:
        t = torch.empty(shape, dtype=dtype)
        if is_parameter:
            t = nn.Parameter(t, requires_grad=requires_grad)
        elif requires_grad:
            t.requires_grad_(True)
        out.append(t)
    return out


def _on_template_meshes(received: object, template: object) -> object:
    """``received`` with each DTensor that matches the template's DTensor at the same pytree path
    (placements, global and local shape) rebuilt on the template's mesh, around the same local
    tensor; everything else as it is."""
    if not _is_dtensor_module_loaded():
        return received
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_flatten_with_path, tree_unflatten

    flat, spec = tree_flatten_with_path(received)
    mine = {path: v for path, v in tree_flatten_with_path(template)[0] if _is_dtensor(v)}
    if not mine:
        return received
    out = []
    for path, value in flat:
        tmpl = mine.get(path)
        if (tmpl is not None and _is_dtensor(value) and tuple(value.placements) == tuple(tmpl.placements)
                and value.shape == tmpl.shape and value._local_tensor.shape == tmpl._local_tensor.shape
                and value.device_mesh is not tmpl.device_mesh):
            rebuilt = DTensor.from_local(value._local_tensor, tmpl.device_mesh, tmpl.placements, run_check=False,
                                         shape=value.shape, stride=value.stride())
            value = rebuilt.requires_grad_(value.requires_grad) if value.requires_grad else rebuilt
        out.append(value)
    return tree_unflatten(out, spec)


def _is_dtensor_module_loaded() -> bool:
    return sys.modules.get("torch.distributed.tensor") is not None


# --------------------------------------------------------------------------------------------
# Server


@dataclass
class _Request:
    step: int
    kind: str  # "stream" | "manifest" | "chunk"
    chunk: int = 0
    num_chunks: int = 1
    generation: int | None = None
    wait_s: float | None = None


def _parse_request(raw_path: str) -> _Request:
    url = urllib.parse.urlsplit(raw_path)
    query = urllib.parse.parse_qs(url.query)
    parts = url.path.strip("/").split("/")
    if len(parts) < 3 or parts[0] != "checkpoint":
        raise ValueError(
            f"unknown path {url.path!r}: expected /checkpoint/<step>/stream, "
            "/checkpoint/<step>/manifest or /checkpoint/<step>/chunk/<i>?of=<n>"
        )
    try:
        step = int(parts[1])
    except ValueError:
        raise ValueError(f"invalid step {parts[1]!r} in {url.path!r}") from None
    wait_s = float(query["wait"][0]) if "wait" in query else None
    kind = parts[2]
    if kind in ("stream", "manifest") and len(parts) == 3:
        return _Request(step, kind, wait_s=wait_s)
    if kind == "chunk" and len(parts) == 4:
        try:
            chunk, num_chunks = int(parts[3]), int(query["of"][0])
            generation = int(query["gen"][0]) if "gen" in query else None
        except (KeyError, ValueError):
            raise ValueError(f"chunk requests need /chunk/<i>?of=<n>, got {raw_path!r}") from None
        if not 0 <= chunk < num_chunks:
            raise ValueError(f"chunk {chunk} out of range for of={num_chunks}")
        return _Request(step, kind, chunk, num_chunks, generation, wait_s)
    if kind == "full" or (kind.isdigit() and len(parts) == 3) or kind == "metadata":
        raise ValueError(
            f"{url.path!r} is a torchft HTTPTransport request; this is ftclient's HTTPTransport, "
            "which streams its own format from /checkpoint/<step>/stream. Use ftclient on both "
            "the source and the recovering replica."
        )
    raise ValueError(f"unknown checkpoint request {url.path!r}")


class _Server(socketserver.ThreadingTCPServer):
    """Threaded TCP server bound to all addresses (dual-stack when IPv6 is available).
    ThreadingTCPServer rather than http.server.HTTPServer: the latter resolves the bind address
    to a name at start-up, which can stall on hosts with slow DNS."""

    daemon_threads = True
    allow_reuse_address = True
    block_on_close = False

    def __init__(self, handler: type[BaseHTTPRequestHandler], transport: HTTPTransport) -> None:
        self.transport = transport
        if socket.has_ipv6:
            try:
                self.address_family = socket.AF_INET6
                super().__init__(("::", 0), handler)
                return
            except OSError:
                pass
        self.address_family = socket.AF_INET
        super().__init__(("0.0.0.0", 0), handler)

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "ftclient-checkpoint/1"

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        try:
            request = _parse_request(self.path)
        except ValueError as e:
            self.send_text(400, str(e))
            return
        self.server.transport._serve(self, request)

    def send_text(self, code: int, text: str) -> None:
        body = text.encode()
        try:
            self.send_response(code)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass  # the client went away

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("checkpoint server: " + format, *args)


# --------------------------------------------------------------------------------------------
# Client helpers


def _read_into(
    resp: http.client.HTTPResponse,
    sock: socket.socket,
    view: memoryview,
    deadline: float,
    what: str,
) -> None:
    """Fill ``view`` from ``resp`` (whose socket is ``sock``) within the deadline."""
    filled, total = 0, len(view)
    while filled < total:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"timed out receiving {what} ({filled} of {total} bytes)")
        sock.settimeout(remaining)
        try:
            n = resp.readinto(view[filled : filled + _IO_CHUNK])
        except socket.timeout:
            raise TimeoutError(f"timed out receiving {what} ({filled} of {total} bytes)") from None
        except (OSError, http.client.HTTPException) as e:
            n, cause = 0, e
        else:
            cause = None
        if not n:
            raise CheckpointTransferError(
                f"connection lost while receiving {what} ({filled} of {total} bytes): the "
                "source replica died or shut down, or its disallow_checkpoint cut the transfer "
                "(it does so with transfers still running after its timeout)"
            ) from cause
        filled += n


def _read_exact(
    resp: http.client.HTTPResponse, sock: socket.socket, n: int, deadline: float, what: str
) -> bytes:
    buf = bytearray(n)
    _read_into(resp, sock, memoryview(buf), deadline, what)
    return bytes(buf)


class _Get:
    """Context manager: one GET of the checkpoint server, bounded by ``deadline``; non-200
    answers become the matching exception. Yields ``(socket, response)``."""

    def __init__(
        self, url: urllib.parse.SplitResult, path: str, deadline: float, src: str
    ) -> None:
        self.url, self.path, self.deadline, self.src = url, path, deadline, src
        self.conn: http.client.HTTPConnection | None = None

    def __enter__(self) -> tuple[socket.socket, http.client.HTTPResponse]:
        remaining = self.deadline - time.monotonic()
        what = f"checkpoint request http://{self.src}{self.path}"
        if remaining <= 0:
            raise TimeoutError(f"timed out before sending {what}")
        # The server waits a little less than we do, so its explanation (503) reaches us.
        server_wait = max(0.0, remaining - min(0.5, 0.1 * remaining))
        sep = "&" if "?" in self.path else "?"
        path = f"{self.path}{sep}wait={server_wait:.3f}"
        assert self.url.hostname is not None
        conn = self.conn = http.client.HTTPConnection(
            self.url.hostname, self.url.port, timeout=remaining
        )
        try:
            conn.connect()
            sock = conn.sock  # kept: getresponse() detaches it from conn for HTTP/1.0
            conn.request("GET", path, headers={"Connection": "close"})
            resp = conn.getresponse()
        except socket.timeout:
            conn.close()
            raise TimeoutError(
                f"timed out after {remaining:.3g}s waiting for the answer to {what}"
            ) from None
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise CheckpointTransferError(
                f"{what} failed: {e}. The source replica may be gone; the next quorum picks "
                "another source."
            ) from e
        self.resp = resp
        if resp.status != 200:
            try:
                body = resp.read(_MAX_ERROR_BODY).decode("utf-8", "replace").strip()
            except OSError:
                body = "(no body)"
            self.close()
            message = f"{what} refused (HTTP {resp.status}): {body}"
            if resp.status == 409:
                raise CheckpointStepMismatchError(message)
            if resp.status == 503:
                raise TimeoutError(message)
            raise CheckpointTransferError(message)
        return sock, resp

    def close(self) -> None:
        resp = getattr(self, "resp", None)
        if resp is not None:
            resp.close()
        if self.conn is not None:
            self.conn.close()

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------
# Transport


class HTTPTransport(CheckpointTransport[T]):
    """Checkpoint transport that serves this replica's state dict over HTTP and fetches peers'.

    The server starts at construction on an ephemeral port (all interfaces); it serves nothing
    until :meth:`send_checkpoint`. See the module docstring for the protocol and the memory
    guarantees.

    Args:
        timeout: bound on every wait of the server: a request waits this long for a checkpoint
            to be offered; ``disallow_checkpoint`` waits this long for in-flight transfers
            before cutting them off; a stalled client is dropped after this long.
        num_chunks: 0 to fetch over one connection; n > 0 to fetch over n parallel connections
            (a receiver-side choice; the server handles both).
        hostname: host name put in :meth:`metadata` (default: ``socket.gethostname()``).
    """

    def __init__(
        self, timeout: timedelta, num_chunks: int = 0, *, hostname: str | None = None
    ) -> None:
        if num_chunks < 0:
            raise ValueError(f"num_chunks must be >= 0, got {num_chunks}")
        self._timeout = timeout
        self._num_chunks = num_chunks
        self._hostname = hostname or socket.gethostname()
        self._lock = RWLock(timeout=timeout.total_seconds())
        self._state_lock = threading.Lock()  # serializes send/disallow/shutdown
        self._offer: _Offer | None = None
        self._generation = 0
        self._closed = False
        self._inflight: set[socket.socket] = set()
        self._inflight_lock = threading.Lock()
        # Closed gate until the first send_checkpoint: requests wait rather than see step -1.
        self._lock.acquire_write()
        self._disallowed = True

        class Handler(_Handler):
            timeout = self._timeout.total_seconds()  # socket timeout of each connection

        self._server = _Server(Handler, self)
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.1},
            name="ftclient-checkpoint-server",
            daemon=True,
        )
        self._thread.start()
        logger.info("checkpoint server listening at %s", self.metadata())

    # API ------------------------------------------------------------------------------------

    def metadata(self) -> str:
        port = self._server.server_address[1]
        host = f"[{self._hostname}]" if ":" in self._hostname else self._hostname
        return f"http://{host}:{port}/checkpoint/"

    address = metadata

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta
    ) -> None:
        """Serve ``state_dict`` as the checkpoint of ``step`` until :meth:`disallow_checkpoint`.
        Nothing is copied or sent here; recovering replicas pull it."""
        with self._state_lock:
            if self._closed:
                raise RuntimeError("send_checkpoint on a transport that was shut down")
            if not self._disallowed:  # a new offer replaces the current one
                self._close_gate()
            self._generation += 1
            self._offer = _make_offer(state_dict, step, self._generation)
            self._disallowed = False
            self._lock.release_write()
        logger.info(
            "offering checkpoint of step %d to %s (%d tensors, %.1f MB)",
            step,
            dst_ranks,
            len(self._offer.tensors),
            sum(self._offer.nbytes) / 1e6,
        )

    def allow_checkpoint(self, step: int) -> None:
        """torchft's name for re-opening the gate: only valid for the step already offered."""
        offer = self._offer
        if offer is None or offer.step != step:
            raise ValueError(
                f"allow_checkpoint({step}): no state dict was offered for step {step}; "
                "call send_checkpoint"
            )
        with self._state_lock:
            if self._disallowed and not self._closed:
                self._disallowed = False
                self._lock.release_write()

    def disallow_checkpoint(self) -> None:
        """Stop serving. Returns once no transfer reads the state dict: in-flight transfers
        get ``timeout`` to finish, then are cut off (their receivers see an error)."""
        with self._state_lock:
            if not self._disallowed and not self._closed:
                self._close_gate()

    def _close_gate(self) -> None:
        try:
            self._lock.acquire_write()
        except TimeoutError:
            aborted = self._abort_inflight()
            logger.warning(
                "disallow_checkpoint: %d transfer(s) still running after %gs; cut them off",
                aborted,
                self._timeout.total_seconds(),
            )
            self._lock.acquire_write(timeout=_ABORT_GRACE_S)
        self._disallowed = True

    def _abort_inflight(self) -> int:
        with self._inflight_lock:
            conns = list(self._inflight)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return len(conns)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta,
                        template: object | None = None) -> T:
        """Fetch the checkpoint of ``step`` from the transport whose :meth:`metadata` is
        ``metadata``. Raises :class:`CheckpointStepMismatchError` if it serves another step,
        :class:`TimeoutError` if the whole transfer does not finish within ``timeout``, and
        :class:`CheckpointTransferError` for other failures.

        ``template``: this replica's own state dict of the same layout (ftclient's Manager
        passes the one it took in this step). A received DTensor whose path, placements and
        shapes match a template DTensor is rebuilt on the template's mesh, this process's own,
        rather than on the sender's mesh as unpickled here: collectives on it (a load hook that
        redistributes it) then run on this process's process groups."""
        deadline = time.monotonic() + timeout.total_seconds()
        url = urllib.parse.urlsplit(metadata)
        if url.scheme != "http" or not url.hostname or url.port is None:
            raise ValueError(
                f"invalid checkpoint metadata {metadata!r}: expected 'http://host:port/checkpoint/'"
            )
        base = url.path if url.path.endswith("/") else url.path + "/"
        src = f"{url.hostname}:{url.port}"
        start = time.monotonic()

        if self._num_chunks == 0:
            with _Get(url, f"{base}{step}/stream", deadline, src) as (sock, resp):
                manifest = self._read_manifest(resp, sock, step, deadline, src)
                tensors = _allocate(manifest["tensors"])
                self._read_records(resp, sock, tensors, range(len(tensors)), deadline, src)
        else:
            with _Get(url, f"{base}{step}/manifest", deadline, src) as (sock, resp):
                manifest = self._read_manifest(resp, sock, step, deadline, src)
            tensors = _allocate(manifest["tensors"])
            n, gen = self._num_chunks, manifest["generation"]

            def fetch(i: int) -> None:
                path = f"{base}{step}/chunk/{i}?of={n}&gen={gen}"
                with _Get(url, path, deadline, src) as (sock_i, r):
                    self._read_records(r, sock_i, tensors, range(i, len(tensors), n), deadline, src)

            with ThreadPoolExecutor(max_workers=n, thread_name_prefix="ftclient-ckpt-recv") as ex:
                for fut in [ex.submit(fetch, i) for i in range(n)]:
                    fut.result()

        state_dict = _TreeUnpickler(io.BytesIO(manifest["tree"]), tensors).load()
        if template is not None:
            state_dict = _on_template_meshes(state_dict, template)
        elapsed = time.monotonic() - start
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        logger.info(
            "received checkpoint of step %d from %s: %.1f MB in %.2fs (%.0f MB/s)",
            step,
            src,
            nbytes / 1e6,
            elapsed,
            nbytes / 1e6 / max(elapsed, 1e-9),
        )
        return state_dict  # type: ignore[no-any-return]

    def shutdown(self, wait: bool = True) -> None:
        """Stop the server. With ``wait``, in-flight transfers get up to the timeout to finish
        and the server thread is joined; without, transfers are cut off at once."""
        with self._state_lock:
            if self._closed:
                return
            if wait and not self._disallowed:
                try:
                    self._close_gate()
                except TimeoutError:
                    pass
            self._closed = True
            self._lock.close("the checkpoint transport is shutting down")
        self._abort_inflight()
        if wait:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=self._timeout.total_seconds())
        else:

            def stop() -> None:
                self._server.shutdown()
                self._server.server_close()

            threading.Thread(target=stop, name="ftclient-checkpoint-stop", daemon=True).start()

    def __enter__(self) -> HTTPTransport[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown(wait=True)

    def __repr__(self) -> str:
        offer = self._offer
        state = "disallowed" if self._disallowed else f"serving step {offer.step if offer else None}"
        return f"HTTPTransport({self.metadata()}, {state})"

    # server side ----------------------------------------------------------------------------

    def _serve(self, handler: _Handler, request: _Request) -> None:
        wait_s = self._timeout.total_seconds()
        if request.wait_s is not None:
            wait_s = max(0.0, min(wait_s, request.wait_s))
        try:
            self._lock.acquire_read(timeout=wait_s)
        except TimeoutError:
            handler.send_text(
                503,
                f"timed out after {wait_s:g}s waiting for a checkpoint to be offered (step "
                f"{request.step} requested): this replica serves only between send_checkpoint "
                "and disallow_checkpoint",
            )
            return
        except LockClosedError as e:
            handler.send_text(503, f"not serving checkpoints: {e}")
            return
        conn: socket.socket = handler.connection
        with self._inflight_lock:
            self._inflight.add(conn)
        try:
            offer = self._offer
            if offer is None or offer.step != request.step:
                serving = "nothing" if offer is None else f"step {offer.step}"
                handler.send_text(
                    409,
                    f"wrong step: this replica is serving {serving} but step {request.step} "
                    f"was requested",
                )
                return
            if request.generation is not None and request.generation != offer.generation:
                handler.send_text(
                    409,
                    f"the checkpoint of step {request.step} was re-offered (generation "
                    f"{offer.generation}, request for {request.generation}); fetch it again",
                )
                return
            if request.kind == "chunk":
                indices = range(request.chunk, len(offer.tensors), request.num_chunks)
            elif request.kind == "stream":
                indices = range(len(offer.tensors))
            else:
                indices = range(0)
            preamble = offer.preamble if request.kind != "chunk" else b""
            length = len(preamble) + sum(_RECORD.size + offer.nbytes[i] for i in indices)
            self._write(handler, offer, preamble, indices, length)
        except OSError as e:
            logger.warning("checkpoint transfer of step %d aborted: %s", request.step, e)
        except Exception as e:
            logger.exception("checkpoint server failed on %s", handler.path)
            handler.send_text(500, f"checkpoint server error: {e}")
        finally:
            with self._inflight_lock:
                self._inflight.discard(conn)
            self._lock.release_read()

    @staticmethod
    def _write(
        handler: _Handler, offer: _Offer, preamble: bytes, indices: range, length: int
    ) -> None:
        conn: socket.socket = handler.connection
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        handler.send_response(200)
        handler.send_header("Content-Type", "application/octet-stream")
        handler.send_header("Content-Length", str(length))
        handler.end_headers()
        out = handler.wfile
        if preamble:
            out.write(preamble)
        for i in indices:
            out.write(_RECORD.pack(_RECORD_TAG, i, offer.nbytes[i]))
            t = _sendable(offer.tensors[i])  # a copy only if not contiguous / not on CPU
            view = _byte_view(t)
            for pos in range(0, len(view), _IO_CHUNK):
                out.write(view[pos : pos + _IO_CHUNK])
            del view, t

    # client side ----------------------------------------------------------------------------

    @staticmethod
    def _read_manifest(
        resp: http.client.HTTPResponse,
        sock: socket.socket,
        step: int,
        deadline: float,
        src: str,
    ) -> dict[str, Any]:
        magic, size = _PREAMBLE.unpack(_read_exact(resp, sock, _PREAMBLE.size, deadline, "preamble"))
        if magic != _MAGIC:
            raise CheckpointTransferError(
                f"{src} did not answer in ftclient's checkpoint format (got {magic!r})"
            )
        manifest: dict[str, Any] = pickle.loads(_read_exact(resp, sock, size, deadline, "manifest"))
        if manifest["step"] != step:
            raise CheckpointStepMismatchError(
                f"{src} sent step {manifest['step']} but step {step} was requested"
            )
        return manifest

    @staticmethod
    def _read_records(
        resp: http.client.HTTPResponse,
        sock: socket.socket,
        tensors: list[torch.Tensor],
        indices: range,
        deadline: float,
        src: str,
    ) -> None:
        for expected in indices:
            tag, index, nbytes = _RECORD.unpack(
                _read_exact(resp, sock, _RECORD.size, deadline, f"header of tensor {expected}")
            )
            t = tensors[expected]
            want = t.numel() * t.element_size()
            if tag != _RECORD_TAG or index != expected or nbytes != want:
                raise CheckpointTransferError(
                    f"corrupt checkpoint stream from {src}: expected tensor {expected} "
                    f"({want} bytes), got tag={tag!r} index={index} nbytes={nbytes}"
                )
            _read_into(resp, sock, _byte_view(t.data), deadline, f"tensor {expected}")

