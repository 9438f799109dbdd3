"""One side of a live-recovery transfer (section 4): ``--role send`` or ``--role recv``.

Run by ``benchmarks.recovery`` as two processes, like a healthy and a healing
replica: the sender builds a state dict of ``--size-mb`` (model weights and optimizer state, 4 MiB
float32 tensors plus a few scalars, shaped like ``{"model": ..., "optim": ...}``), serves it with
``send_checkpoint`` and publishes ``metadata()``; the receiver times ``recv_checkpoint`` and checks
every tensor. Both use the implementation's ``HTTPTransport(timeout, num_chunks=0)``, as the
managers do by default. Exit status 3 with ``{"skipped": reason}`` when torch or torchft is not
installed; any other failure to import the transport is an error (exit 1, ``{"error": ...}``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from datetime import timedelta
from pathlib import Path

from benchmarks import load_for_worker

TENSOR_BYTES = 4 * 2**20
STEP = 7


def transport_class(impl: str) -> type:
    if impl == "torchft":
        from torchft.checkpointing.http_transport import HTTPTransport
    else:
        from ftclient.checkpointing import HTTPTransport
    return HTTPTransport


def make_state_dict(size_mb: int) -> dict:
    import torch

    n = max(2, (size_mb * 2**20) // TENSOR_BYTES)
    numel = TENSOR_BYTES // 4
    half = n // 2
    model = {f"layers.{i}.weight": torch.full((numel,), float(i)) for i in range(half)}
    state = {i: {"momentum_buffer": torch.full((numel,), float(half + i))} for i in range(n - half)}
    return {"model": model,
            "optim": {"state": state, "param_groups": [{"lr": 0.01, "momentum": 0.9, "params": list(range(n - half))}]},
            "step": STEP}


def check_state_dict(sd: dict, size_mb: int) -> str | None:
    n = max(2, (size_mb * 2**20) // TENSOR_BYTES)
    half = n // 2
    numel = TENSOR_BYTES // 4
    tensors = [(i, sd["model"][f"layers.{i}.weight"]) for i in range(half)]
    tensors += [(half + i, sd["optim"]["state"][i]["momentum_buffer"]) for i in range(n - half)]
    for want, t in tensors:
        if t.numel() != numel or float(t[0]) != float(want) or float(t[-1]) != float(want):
            return f"tensor {want} differs"
    if sd.get("step") != STEP:
        return "step differs"
    return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("torchft", "ftclient"), required=True)
    ap.add_argument("--role", choices=("send", "recv"), required=True)
    ap.add_argument("--size-mb", type=int, required=True)
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args()
    meta_file, done_file = args.dir / "metadata", args.dir / "done"
    out = args.dir / f"{args.role}.json"

    def write(obj: dict) -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(obj))
        os.replace(tmp, out)

    cls, code = load_for_worker(lambda: transport_class(args.impl), f"{args.impl}'s HTTPTransport",
                                lambda r: write({"skipped": r}), lambda e: write({"error": e}))
    if code:
        return code
    import torch

    torch.set_num_threads(1)
    timeout = timedelta(seconds=args.timeout)
    transport = cls(timeout=timeout, num_chunks=0)
    deadline = time.monotonic() + args.timeout
    try:
        if args.role == "send":
            sd = make_state_dict(args.size_mb)
            t0 = time.perf_counter()
            transport.send_checkpoint(dst_ranks=[1], step=STEP, state_dict=sd, timeout=timeout)
            send_s = time.perf_counter() - t0
            tmp = meta_file.with_suffix(".tmp")
            tmp.write_text(transport.metadata())
            os.replace(tmp, meta_file)
            while not done_file.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            write({"send_checkpoint_s": send_s,
                   "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
        else:
            while not meta_file.exists() and time.monotonic() < deadline:
                time.sleep(0.005)
            metadata = meta_file.read_text()
            rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            t0 = time.perf_counter()
            sd = transport.recv_checkpoint(src_rank=0, metadata=metadata, step=STEP, timeout=timeout)
            recv_s = time.perf_counter() - t0
            problem = check_state_dict(sd, args.size_mb)
            nbytes = sum(t.numel() * t.element_size() for t in
                         list(sd["model"].values()) + [s["momentum_buffer"] for s in sd["optim"]["state"].values()])
            done_file.write_text("done")
            write({"recv_s": recv_s, "bytes": nbytes, "mb_per_s": nbytes / 2**20 / recv_s, "error": problem,
                   "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                   "rss_before_mb": rss0})
    finally:
        try:
            transport.shutdown(wait=False)
        except Exception:  # noqa: BLE001
            pass
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
