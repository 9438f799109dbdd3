"""A worker of the torchrun tests (tests/rendezvous): joins the Gloo process group torchrun set up
(``init_process_group("gloo")`` from the environment), checks an allreduce, and leaves files in
``OUT`` (argv[1]) for the test to read:

* ``training-<pid>.json`` after the first good allreduce: ``{rank, world_size, restart, pid,
  agent_pid}`` (``restart``: ``TORCHELASTIC_RESTART_COUNT``, the agent's restarts so far);
* ``done-<pid>.json`` when it finishes: the same and ``steps``.

``--steps N``: allreduces to do (default 3). ``--hold FILE``: after the first allreduce, go on
doing allreduces (every 50 ms) until FILE exists (at most ``--hold-timeout`` seconds, then fail),
so that a test can act while the job trains. A peer dying under an allreduce makes it raise and
the worker fail, which makes its agent restart the workers (``--max-restarts``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def _write(path: Path, record: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hold", type=Path)
    parser.add_argument("--hold-timeout", type=float, default=60.0)
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    record = {"rank": rank, "world_size": world, "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
              "pid": os.getpid(), "agent_pid": os.getppid()}

    def allreduce() -> None:
        t = torch.ones(4)
        dist.all_reduce(t)
        if not torch.equal(t, torch.full((4,), float(world))):
            raise SystemExit(f"rank {rank}: allreduce gave {t.tolist()}, expected {world}")

    allreduce()
    _write(args.out / f"training-{os.getpid()}.json", record)
    steps = 1
    if args.hold is not None:
        deadline = time.monotonic() + args.hold_timeout
        while not args.hold.exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"rank {rank}: {args.hold} did not appear within {args.hold_timeout:g} s")
            time.sleep(0.05)
            allreduce()
            steps += 1
    for _ in range(args.steps - 1):
        allreduce()
        steps += 1
    dist.barrier()
    _write(args.out / f"done-{os.getpid()}.json", {**record, "steps": steps})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
