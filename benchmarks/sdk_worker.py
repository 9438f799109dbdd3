"""One replica group training a small model on CPU with torchft's or ftclient's SDK (section 3).

Run by ``benchmarks.sdk`` as ``python -m benchmarks.sdk_worker``, two
processes per measurement. Both SDKs run the same script: the same model, data, optimizer and
process group, ``Manager(..., use_async_quorum=True)`` with ``DistributedDataParallel`` and the
``Optimizer`` wrapper, a TCPStore of its own, the lighthouse from ``TORCHFT_LIGHTHOUSE``. A
step is ``zero_grad`` (starts the quorum) + forward + backward (allreduce through the manager)
+ ``step`` (should_commit, then the optimizer step); its wall time is recorded.

Exit status 3 with ``{"skipped": reason}`` when torch or torchft is not installed; any other
failure to import the SDK is an error (exit status 1 with ``{"error": ...}``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

from benchmarks import load_for_worker


def import_sdk(sdk: str) -> dict:
    """The SDK's Manager, DistributedDataParallel, Optimizer and ProcessGroupGloo."""
    if sdk == "torchft":
        from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    else:
        from ftclient import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    return dict(Manager=Manager, DDP=DistributedDataParallel, Optimizer=Optimizer, PG=ProcessGroupGloo)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sdk", choices=("torchft", "ftclient"), required=True)
    ap.add_argument("--group", type=int, required=True)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ready-file", type=Path, required=True)
    ap.add_argument("--go-file", type=Path, required=True)
    ap.add_argument("--go-timeout", type=float, default=120.0)
    args = ap.parse_args()

    def write(obj: dict) -> None:
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(obj))
        os.replace(tmp, args.out)

    sdk, code = load_for_worker(lambda: import_sdk(args.sdk), args.sdk, lambda r: write({"skipped": r}),
                                lambda e: write({"error": e}))
    if code:
        return code

    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(1234)
    model = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden), nn.ReLU(),
                          nn.Linear(args.hidden, 10))
    criterion = nn.CrossEntropyLoss()
    store = dist.TCPStore(host_name="127.0.0.1", port=0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=30)

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        optimizer.load_state_dict(sd["optim"])

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    manager = sdk["Manager"](
        pg=sdk["PG"](timeout=timeout), load_state_dict=load_state_dict, state_dict=state_dict,
        min_replica_size=2, replica_id=f"sdk_{args.sdk}_{args.group}", store_addr="127.0.0.1",
        store_port=store.port, rank=0, world_size=1, hostname="127.0.0.1", timeout=timeout,
        quorum_timeout=timeout, connect_timeout=timeout, use_async_quorum=True)
    ddp = sdk["DDP"](manager, model)
    optimizer = sdk["Optimizer"](manager, torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9))
    args.ready_file.write_text(str(os.getpid()))
    deadline = time.monotonic() + args.go_timeout
    while not args.go_file.exists():
        if time.monotonic() > deadline:
            write({"error": "start barrier timed out"})
            return 2
        time.sleep(0.01)

    times, committed = [], 0
    gen = torch.Generator().manual_seed(args.group)
    t_start = time.perf_counter()
    for _ in range(args.steps):
        x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        t0 = time.perf_counter()
        optimizer.zero_grad()
        loss = criterion(ddp(x), y)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - t0)
    total = time.perf_counter() - t_start
    committed = manager.current_step()
    params = sum(p.numel() for p in model.parameters())
    write({"sdk": args.sdk, "group": args.group, "step_times_s": times, "final_step": committed,
           "total_s": total, "params": params,
           "participants": manager.num_participants()})
    try:
        manager.shutdown(wait=False)
    except TypeError:
        manager.shutdown()
    sys.stdout.flush()
    os._exit(0)  # torchft's Rust threads can keep a clean interpreter exit waiting


if __name__ == "__main__":
    sys.exit(main())
