"""One replica group training until it is killed, recording every step (the goodput section).

Run by ``benchmarks.goodput`` as ``python -m benchmarks.goodput_worker``, one process per replica
group; the section SIGKILLs groups and starts them again. The training step is the SDK section's
(``benchmarks.sdk_worker``: the same MLP 64-256-256-10, SGD with momentum, ``ProcessGroupGloo``,
``Manager(use_async_quorum=True)`` + ``DistributedDataParallel`` + ``Optimizer``, a TCPStore of
its own, the lighthouse from ``TORCHFT_LIGHTHOUSE``), with ``--compute-s`` of simulated compute
after ``zero_grad`` (it overlaps the async quorum, as a forward pass does) and torchft's process
group, collective and quorum timeouts from ``TORCHFT_TIMEOUT_SEC`` / ``TORCHFT_QUORUM_TIMEOUT_SEC``
/ ``TORCHFT_CONNECT_TIMEOUT_SEC``.

torchft runs with ``ToleratingDDP``: torchft 0.2.0's DDP comm hook asserts (``assert fut._fut``)
when an allreduce fails because a peer died, so a survivor would crash instead of voting not to
commit (a torchft bug, not a lighthouse's; the training tests' torchft trainer has the same fix). The
benchmark measures the lighthouses and the managers, not that bug.

``--progress FILE`` gets one JSON line per event, flushed at once (wall-clock times, ``time.time()``):
``{"event": "ready", "t", "pid"}`` once the manager is set up, then per step attempt
``{"event": "step", "t_start", "t_end", "step" (before), "step_after", "committed", "participants",
"quorum_id", "errored"}``. ``committed`` is whether ``should_commit`` advanced the manager's step
(after any heal, which sets it first). A missing torch/torchft writes ``{"event": "skipped",
"reason"}`` and exits 3; any other import failure ``{"event": "error"}`` and exits 1.
"""

# No ``from __future__ import annotations``: torch's DDP checks the comm hook's annotations at
# run time (``bucket: dist.GradBucket`` and the returned ``Future[Tensor]`` as objects, not strings).
import argparse
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

from benchmarks import load_for_worker
from benchmarks.sdk_worker import import_sdk


def _seconds(name: str, default: float) -> timedelta:
    value = os.environ.get(name)
    return timedelta(seconds=float(value) if value else default)


def tolerating_ddp(ddp_class: type) -> type:
    """torchft's DistributedDataParallel whose comm hook survives an allreduce that failed
    (``_ManagedWork.wait()`` records the error and returns before building the future chain, or
    the manager hands back a ``_DummyWork`` whose future has no ``_fut``): the hook returns the
    bucket, the manager has recorded the error, the step is not committed -- as torchft intends."""
    import torch
    import torch.distributed as dist

    class ToleratingDDP(ddp_class):  # type: ignore[misc, valid-type]
        @staticmethod
        def _comm_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            work = state.allreduce(bucket.buffer())  # type: ignore[attr-defined]
            work.wait()
            fut = work.get_future()
            inner = getattr(fut, "_fut", fut)
            if inner is None:
                done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
                done.set_result(bucket.buffer())
                return done
            return inner

    return ToleratingDDP


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sdk", choices=("torchft", "ftclient"), required=True)
    ap.add_argument("--group", type=int, required=True)
    ap.add_argument("--progress", type=Path, required=True)
    ap.add_argument("--compute-s", type=float, default=0.05, help="simulated compute per step")
    ap.add_argument("--min-replica-size", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--go-file", type=Path, help="wait for this file before the first step (start barrier)")
    ap.add_argument("--go-timeout", type=float, default=120.0)
    ap.add_argument("--max-seconds", type=float, default=3600.0, help="safety bound: stop after this long")
    args = ap.parse_args()
    progress = args.progress.open("a", buffering=1)

    def emit(obj: dict) -> None:
        progress.write(json.dumps(obj) + "\n")

    sdk, code = load_for_worker(lambda: import_sdk(args.sdk), args.sdk,
                                lambda r: emit({"event": "skipped", "reason": r}),
                                lambda e: emit({"event": "error", "error": e}))
    if code:
        return code

    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(1234)  # every group (and every restart) starts from the same weights
    model = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden), nn.ReLU(),
                          nn.Linear(args.hidden, 10))
    criterion = nn.CrossEntropyLoss()
    store = dist.TCPStore(host_name="127.0.0.1", port=0, is_master=True, wait_for_workers=False)
    timeout = _seconds("TORCHFT_TIMEOUT_SEC", 60)

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        optimizer.load_state_dict(sd["optim"])

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    manager = sdk["Manager"](
        pg=sdk["PG"](timeout=timeout), load_state_dict=load_state_dict, state_dict=state_dict,
        min_replica_size=args.min_replica_size, replica_id=f"goodput_{args.group}", store_addr="127.0.0.1",
        store_port=store.port, rank=0, world_size=1, hostname="127.0.0.1", timeout=timeout,
        quorum_timeout=_seconds("TORCHFT_QUORUM_TIMEOUT_SEC", 60),
        connect_timeout=_seconds("TORCHFT_CONNECT_TIMEOUT_SEC", 60), use_async_quorum=True)
    ddp_class = tolerating_ddp(sdk["DDP"]) if args.sdk == "torchft" else sdk["DDP"]
    ddp = ddp_class(manager, model)
    optimizer = sdk["Optimizer"](manager, torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9))
    emit({"event": "ready", "t": time.time(), "pid": os.getpid()})
    if args.go_file is not None:
        deadline = time.monotonic() + args.go_timeout
        while not args.go_file.exists():
            if time.monotonic() > deadline:
                emit({"event": "error", "error": "start barrier timed out"})
                return 2
            time.sleep(0.01)

    gen = torch.Generator().manual_seed(args.group)
    stop_at = time.monotonic() + args.max_seconds
    while time.monotonic() < stop_at:
        x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        t0 = time.time()
        step_before = manager.current_step()
        optimizer.zero_grad()  # starts this step's quorum in the background
        if args.compute_s:
            time.sleep(args.compute_s)
        loss = criterion(ddp(x), y)
        loss.backward()  # allreduce through the manager
        manager.wait_quorum()
        step_mid = manager.current_step()  # after a heal: the step healed to
        optimizer.step()  # should_commit, then the optimizer step if committed
        step_after = manager.current_step()
        err = manager.errored()
        emit({"event": "step", "t_start": t0, "t_end": time.time(), "step": step_before, "step_after": step_after,
              "committed": step_after == step_mid + 1, "participants": manager.num_participants(),
              "quorum_id": getattr(manager, "_quorum_id", None),
              "errored": None if err is None else str(getattr(err, "original_exception", err))[:200]})
    progress.close()
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except BaseException:  # noqa: BLE001 -- into the log, then leave without joining SDK threads
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
