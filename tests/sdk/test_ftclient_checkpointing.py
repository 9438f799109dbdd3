"""ftclient.checkpointing: the reader-writer lock and the streaming HTTP transport.

In-process tests cover the lock, the wire format (dtypes, views, tied tensors, Parameters,
nested values; one connection and chunked), refusals (wrong step, torchft-format requests),
timeouts (nothing offered, a silent server, a dead port), an early request that waits for the
offer, and disallow_checkpoint cutting off a stalled reader.

Integration tests move a state dict between real processes and compare it bitwise, and stream
a 200 MiB state dict while reading each process's peak RSS (VmHWM, reset through
/proc/self/clear_refs right before the transfer). Bounds:

- sender: peak RSS may grow by at most 10% of the state dict (20 MiB). Streaming from the live
  tensors costs ~1 MiB; a design that serializes the dict into a buffer costs >= 100%, one that
  copies tensor by tensor costs the largest tensor (12.5% here: 8 tensors of 25 MiB), so 10%
  separates "streams" from "copies" with room for allocator noise.
- receiver: at most 1.15x the state dict (it must hold the result once; a design that buffers
  the body and then deserializes needs ~2x).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import queue
import socket
import threading
import time
import traceback
import urllib.error
import urllib.parse
import urllib.request
from datetime import timedelta
from typing import Any, Iterator

import pytest
import torch
from torch import nn

from support.waiting import wait_for
from ftclient.checkpointing import (
    CheckpointStepMismatchError,
    CheckpointTransferError,
    CheckpointTransport,
    HTTPTransport,
    RWLock,
)
from ftclient.checkpointing.transport import LockClosedError

pytestmark = pytest.mark.timeout(60)

T5 = timedelta(seconds=5)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else t


def assert_bitwise_equal(got: Any, expected: Any, path: str = "") -> None:
    """Same structure, same Python values, tensors with the same dtype, shape and bits."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), path
        assert got.dtype == expected.dtype and got.shape == expected.shape, path
        assert torch.equal(_bits(got), _bits(expected)), f"{path}: bits differ"
        return
    assert type(got) is type(expected), f"{path}: {type(got)} != {type(expected)}"
    if isinstance(expected, dict):
        assert list(got) == list(expected), path
        for k in expected:
            assert_bitwise_equal(got[k], expected[k], f"{path}.{k}")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), path
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_bitwise_equal(g, e, f"{path}[{i}]")
    elif isinstance(expected, float) and math.isnan(expected):
        assert math.isnan(got), path
    else:
        assert got == expected, path


def make_state_dict(seed: int = 0) -> dict[str, Any]:
    """A deterministic state dict shaped like Manager's {"user": ..., "torchft": ...}."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(64, 48, generator=g)
    base[0, 0] = float("nan")
    weight = torch.randn(128, 64, generator=g)
    return {
        "user": {
            "model": {
                "fc.weight": weight,
                "fc.bias": torch.randn(128, generator=g),
                "transposed": base.t(),  # non-contiguous view
                "strided": base[::3, 1::5],  # non-contiguous, offset view
                "bf16": torch.randn(33, 7, generator=g).to(torch.bfloat16),
                "fp16": torch.randn(5, generator=g).half(),
                "int64": torch.randint(-(2**40), 2**40, (17,), generator=g),
                "int8": torch.randint(-128, 127, (9, 3), generator=g, dtype=torch.int8),
                "bool": torch.rand(11, generator=g) > 0.5,
                "scalar": torch.tensor(2.5),
                "empty": torch.empty(0, 3),
                "complex_conj": torch.randn(4, dtype=torch.complex64, generator=g).conj(),
            },
            "optim": {
                "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(128, 64, generator=g)}},
                "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": [0], "name": None}],
            },
            "tied": weight,  # the same tensor object twice
        },
        "torchft": {"step": 11, "batches_committed": 4242, "nested": [1, "two", (3.0, float("nan"))]},
    }


@pytest.fixture
def transports() -> Iterator[list[HTTPTransport[Any]]]:
    created: list[HTTPTransport[Any]] = []
    yield created
    for t in created:
        t.shutdown(wait=False)


def _new(created: list[HTTPTransport[Any]], timeout: timedelta = T5, **kw: Any) -> HTTPTransport[Any]:
    t: HTTPTransport[Any] = HTTPTransport(timeout, **kw)
    created.append(t)
    return t


# ---------------------------------------------------------------------------------------------
# RWLock


def test_rwlock_readers_share_and_writer_waits_for_them() -> None:
    lock = RWLock(timeout=0.2)
    lock.acquire_read()
    lock.acquire_read()
    assert lock.readers == 2
    with pytest.raises(TimeoutError, match="2 reader"):
        lock.acquire_write()
    lock.release_read()
    lock.release_read()
    with lock.write_locked():
        assert lock.w_locked()
        with pytest.raises(TimeoutError, match="read lock"):
            lock.acquire_read()
    assert not lock.w_locked()
    with pytest.raises(RuntimeError, match="without a matching"):
        lock.release_read()
    with pytest.raises(RuntimeError, match="without a matching"):
        lock.release_write()


def test_rwlock_prefers_a_waiting_writer_and_releases_across_threads() -> None:
    lock = RWLock(timeout=5)
    lock.acquire_read()
    writer_has_it = threading.Event()

    def writer() -> None:
        lock.acquire_write()
        writer_has_it.set()

    thread = threading.Thread(target=writer)
    thread.start()
    wait_for("the writer to wait", lambda: lock._writers_waiting > 0, 5, interval=0.01)
    with pytest.raises(TimeoutError):  # new readers wait behind the waiting writer
        lock.acquire_read(timeout=0.1)
    lock.release_read()
    assert writer_has_it.wait(5)
    thread.join(5)
    lock.release_write()  # released by another thread than the one that acquired
    lock.acquire_read(timeout=0.1)
    lock.release_read()


def test_rwlock_close_wakes_waiters() -> None:
    lock = RWLock(timeout=10)
    lock.acquire_write()
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            lock.acquire_read()
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=reader)
    thread.start()
    time.sleep(0.1)
    lock.close("shutting down")
    thread.join(5)
    assert len(errors) == 1 and isinstance(errors[0], LockClosedError)


# ---------------------------------------------------------------------------------------------
# HTTPTransport in one process


@pytest.mark.integration
@pytest.mark.parametrize("num_chunks", [0, 3])
def test_round_trip_is_bitwise_and_keeps_structure(
    transports: list[HTTPTransport[Any]], num_chunks: int
) -> None:
    src, dst = _new(transports), _new(transports, num_chunks=num_chunks)
    assert isinstance(src, CheckpointTransport)
    assert src.metadata().startswith("http://") and src.metadata().endswith("/checkpoint/")
    sent = make_state_dict()
    param = nn.Parameter(torch.randn(4, 4))
    sent["user"]["param"] = param
    src.send_checkpoint(dst_ranks=[1], step=11, state_dict=sent, timeout=T5)

    got = dst.recv_checkpoint(src_rank=0, metadata=src.metadata(), step=11, timeout=T5)

    assert_bitwise_equal(got, sent)
    assert got["user"]["tied"] is got["user"]["model"]["fc.weight"]
    assert isinstance(got["user"]["param"], nn.Parameter) and got["user"]["param"].requires_grad
    assert got["user"]["model"]["transposed"].is_contiguous()
    assert got["user"]["model"]["fc.weight"].data_ptr() != sent["user"]["model"]["fc.weight"].data_ptr()


@pytest.mark.integration
def test_wrong_step_is_refused_with_a_clear_error(transports: list[HTTPTransport[Any]]) -> None:
    src, dst = _new(transports), _new(transports)
    src.send_checkpoint([1], 7, {"w": torch.ones(3)}, T5)
    with pytest.raises(CheckpointStepMismatchError, match="serving step 7 but step 8 was requested"):
        dst.recv_checkpoint(0, src.metadata(), 8, T5)
    # re-offering without disallow in between replaces the offer
    src.send_checkpoint([1], 8, {"w": torch.full((3,), 2.0)}, T5)
    assert dst.recv_checkpoint(0, src.metadata(), 8, T5)["w"].tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(CheckpointStepMismatchError, match="serving step 8 but step 7"):
        dst.recv_checkpoint(0, src.metadata(), 7, T5)


@pytest.mark.integration
def test_torchft_format_requests_are_refused_with_an_explanation(
    transports: list[HTTPTransport[Any]],
) -> None:
    src = _new(transports)
    src.send_checkpoint([1], 3, {"w": torch.ones(1)}, T5)
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"{src.metadata()}3/full", timeout=5)
    assert info.value.code == 400
    assert "ftclient's HTTPTransport" in info.value.read().decode()


@pytest.mark.integration
def test_request_waits_for_the_offer_then_times_out(transports: list[HTTPTransport[Any]]) -> None:
    src, dst = _new(transports), _new(transports)
    # Nothing offered yet: the request waits, then fails at the caller's timeout.
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="waiting for a checkpoint to be offered"):
        dst.recv_checkpoint(0, src.metadata(), 1, timedelta(seconds=1))
    assert 0.5 < time.monotonic() - start < 3

    # A request that arrives before send_checkpoint is served once the offer is made.
    result: list[Any] = []
    thread = threading.Thread(
        target=lambda: result.append(dst.recv_checkpoint(0, src.metadata(), 2, T5))
    )
    thread.start()
    time.sleep(0.3)
    src.send_checkpoint([1], 2, {"w": torch.arange(4)}, T5)
    thread.join(10)
    assert result and result[0]["w"].tolist() == [0, 1, 2, 3]

    # After disallow_checkpoint nothing is served.
    src.disallow_checkpoint()
    with pytest.raises(TimeoutError):
        dst.recv_checkpoint(0, src.metadata(), 2, timedelta(seconds=0.5))


@pytest.mark.integration
def test_silent_server_and_dead_port_fail_within_the_timeout(
    transports: list[HTTPTransport[Any]],
) -> None:
    dst = _new(transports)
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    try:
        port = silent.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="timed out"):
            dst.recv_checkpoint(0, f"http://127.0.0.1:{port}/checkpoint/", 1, timedelta(seconds=1))
        assert time.monotonic() - start < 3
    finally:
        silent.close()
    with pytest.raises(CheckpointTransferError, match="may be gone"):
        dst.recv_checkpoint(0, f"http://127.0.0.1:{port}/checkpoint/", 1, T5)
    with pytest.raises(ValueError, match="invalid checkpoint metadata"):
        dst.recv_checkpoint(0, "127.0.0.1:1/checkpoint/", 1, T5)


@pytest.mark.integration
def test_disallow_cuts_off_a_stalled_reader_before_weights_change(
    transports: list[HTTPTransport[Any]],
) -> None:
    """A healer that stops reading must not keep the trainer from mutating its weights for
    more than the timeout, and must not receive a torn state dict."""
    src = _new(transports, timeout=timedelta(seconds=1))
    # Keep the server's per-connection socket timeout out of the way: the cut must come from
    # disallow_checkpoint itself.
    src._server.RequestHandlerClass.timeout = 30  # type: ignore[attr-defined]
    weights = torch.randn(16 * 2**20 // 4)  # 16 MiB: more than the socket buffers hold
    src.send_checkpoint([1], 5, {"w": weights}, T5)
    url = urllib.parse.urlsplit(src.metadata())
    stalled = socket.create_connection((url.hostname, url.port))
    try:
        stalled.sendall(b"GET /checkpoint/5/stream HTTP/1.0\r\n\r\n")
        wait_for("the stalled download to take the read lock", lambda: src._lock.readers > 0, 5, interval=0.01)
        assert src._lock.readers == 1

        start = time.monotonic()
        src.disallow_checkpoint()
        assert 0.8 < time.monotonic() - start < 3  # waited the 1 s timeout, then cut it off
        assert src._lock.readers == 0
        weights.zero_()  # the trainer may now mutate

        stalled.settimeout(5)
        received = 0
        while chunk := stalled.recv(1 << 20):
            received += len(chunk)
        assert received < weights.numel() * 4  # cut off, not completed
    finally:
        stalled.close()


@pytest.mark.integration
def test_shutdown_is_idempotent_and_refuses_new_offers(transports: list[HTTPTransport[Any]]) -> None:
    src = _new(transports)
    src.send_checkpoint([1], 1, {"w": torch.ones(1)}, T5)
    src.shutdown()
    src.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        src.send_checkpoint([1], 2, {"w": torch.ones(1)}, T5)


# ---------------------------------------------------------------------------------------------
# Real processes


def _vm_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        pass  # then VmHWM before the transfer is simply the peak so far


def _sender(kind: str, step: int, to_parent: Any, done: Any) -> None:
    """Offer a state dict for ``step``, report the metadata, serve until ``done``, then
    report the peak-RSS growth during serving."""
    try:
        if kind == "mixed":
            state_dict = make_state_dict(seed=1)
        else:  # 200 MiB in 8 float32 tensors of 25 MiB
            g = torch.Generator().manual_seed(2)
            state_dict = {f"layer{i}": torch.randn(25 * 2**20 // 4, generator=g) for i in range(8)}
        transport: HTTPTransport[Any] = HTTPTransport(timedelta(seconds=30))
        transport.send_checkpoint([1], step, state_dict, timedelta(seconds=30))
        _reset_peak_rss()
        before = _vm_bytes("VmHWM")
        to_parent.put(("metadata", transport.metadata()))
        if not done.wait(50):
            raise TimeoutError("the test never said it was done")
        to_parent.put(("peak", _vm_bytes("VmHWM") - before))
        transport.shutdown()
    except Exception:
        to_parent.put(("error", traceback.format_exc()))


def _receiver(metadata: str, step: int, num_chunks: int, to_parent: Any) -> None:
    try:
        transport: HTTPTransport[Any] = HTTPTransport(timedelta(seconds=30), num_chunks=num_chunks)
        _reset_peak_rss()
        before = _vm_bytes("VmHWM")
        start = time.monotonic()
        state_dict = transport.recv_checkpoint(0, metadata, step, timedelta(seconds=30))
        elapsed = time.monotonic() - start
        nbytes = sum(t.numel() * t.element_size() for t in state_dict.values())
        to_parent.put(("received", nbytes, elapsed, _vm_bytes("VmHWM") - before))
        transport.shutdown()
    except Exception:
        to_parent.put(("error", traceback.format_exc()))


def _expect(q: Any, kind: str, timeout: float = 45) -> tuple[Any, ...]:
    try:
        item = q.get(timeout=timeout)
    except queue.Empty:
        pytest.fail(f"no {kind!r} report from a child process within {timeout}s")
    if item[0] == "error":
        pytest.fail(f"child process failed:\n{item[1]}")
    assert item[0] == kind, item
    return item  # type: ignore[no-any-return]


def _stop(procs: list[Any]) -> None:
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


@pytest.mark.integration
def test_two_process_transfer_is_bitwise_equal(transports: list[HTTPTransport[Any]]) -> None:
    ctx = mp.get_context("spawn")
    to_parent, done = ctx.Queue(), ctx.Event()
    sender = ctx.Process(target=_sender, args=("mixed", 11, to_parent, done))
    try:
        sender.start()
        metadata = _expect(to_parent, "metadata")[1]
        expected = make_state_dict(seed=1)
        for num_chunks in (0, 2):
            dst = _new(transports, timeout=timedelta(seconds=30), num_chunks=num_chunks)
            got = dst.recv_checkpoint(0, metadata, 11, timedelta(seconds=30))
            assert_bitwise_equal(got, expected)
            assert got["user"]["tied"] is got["user"]["model"]["fc.weight"]
        with pytest.raises(CheckpointStepMismatchError, match="serving step 11 but step 12"):
            dst.recv_checkpoint(0, metadata, 12, timedelta(seconds=30))
        done.set()
        _expect(to_parent, "peak")
    finally:
        done.set()
        _stop([sender])


@pytest.mark.integration
def test_streaming_200mib_keeps_the_senders_memory_flat() -> None:
    size = 200 * 2**20
    ctx = mp.get_context("spawn")
    to_parent, done = ctx.Queue(), ctx.Event()
    sender = ctx.Process(target=_sender, args=("big", 3, to_parent, done))
    procs = [sender]
    try:
        sender.start()
        metadata = _expect(to_parent, "metadata", timeout=60)[1]
        receiver = ctx.Process(target=_receiver, args=(metadata, 3, 0, to_parent))
        procs.append(receiver)
        receiver.start()
        _, nbytes, elapsed, receiver_growth = _expect(to_parent, "received")
        done.set()
        _, sender_growth = _expect(to_parent, "peak")
        assert nbytes == size
        print(
            f"\n200 MiB over loopback in {elapsed:.2f}s ({size / 2**20 / elapsed:.0f} MiB/s); "
            f"peak RSS growth: sender {sender_growth / 2**20:.1f} MiB, "
            f"receiver {receiver_growth / 2**20:.1f} MiB"
        )
        assert sender_growth < 0.10 * size, f"sender grew {sender_growth / 2**20:.1f} MiB"
        assert receiver_growth < 1.15 * size, f"receiver grew {receiver_growth / 2**20:.1f} MiB"
    finally:
        done.set()
        _stop(procs)
