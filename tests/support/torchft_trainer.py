#!/usr/bin/env python3
"""One torchft replica group (one rank) training a tiny model on CPU, for the integration tests.

Run by ``tests/torchft_interop/test_torchft_training.py`` as a subprocess, one process per replica group. It uses
torchft's real pieces, unchanged: ``torchft.Manager`` (whose Rust ManagerServer talks to the
lighthouse named by ``TORCHFT_LIGHTHOUSE``; ``TORCHFT_*`` timeouts and retries come from the
environment), ``torchft.ProcessGroupGloo``, ``torchft.DistributedDataParallel`` and
``torchft.Optimizer`` (``OptimizerWrapper``, subclassed only to record the commit decision), with
a ``TCPStore`` of its own on a free port, as torchft's examples and integration tests do.
``--ddp tolerant`` swaps in ``TolerantDDP``: torchft's DDP with its comm hook fixed for an
allreduce that fails because a peer died (a torchft 0.2.0 bug, see the class).

Determinism: the model is built from a fixed seed and the data of step ``s`` for replica group
``g`` is drawn from a generator seeded with ``(seed, s, g)``. Gradients are averaged over the
participants, so every group that commits a step applies the same update, and a group that heals
loads a peer's model and optimizer state: at the end every group must hold bit-identical
parameters, which ``--result`` records as a sha256 digest.

Output:
* ``--progress FILE``: one JSON object per step attempt (flushed at once), with ``step`` (the
  manager's step when the attempt started), ``step_after``, ``committed`` (the
  ``should_commit`` decision), ``quorum_id``, ``participants``, ``replica_rank``, ``healed``,
  ``errored``, ``loss``, ``t_start``/``t_end`` (wall clock) and ``duration_s``.
* ``--result FILE`` (written last, atomically): ``digest``, ``final_step``, ``batches_committed``,
  ``group``, ``pid``, ``steps_attempted``, ``commit_failures``.
* torchft's own logs (Python and Rust) go to stderr.

Fault-injection knobs: ``--step-sleep`` (simulated compute after ``start_quorum``, overlapping the
async quorum), ``--pre-quorum-sleep`` (a slow group: the others' Quorum calls wait at the
lighthouse meanwhile), ``--ready-file``/``--go-file`` (a start barrier).

The run ends once the manager's step reaches ``--steps`` on a committed step whose quorum had at
least ``--min-final-participants`` participants: every group of that quorum sees the same count
and the same step, so they all stop after the same step even when one of them rejoined late.
"""

import argparse
import hashlib
import json
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo


def env_seconds(name: str, default: float) -> timedelta:
    value = os.environ.get(name)
    return timedelta(seconds=float(value) if value else default)


class TinyModel(nn.Module):
    def __init__(self, in_dim: int = 8, hidden: int = 16, out_dim: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Linear(hidden, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def batch(seed: int, step: int, group: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + group)
    return torch.randn(size, 8, generator=g), torch.randint(0, 4, (size,), generator=g)


def digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """sha256 over every parameter and every optimizer state tensor, in a fixed order."""
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    state = optimizer.state_dict()["state"]
    for idx in sorted(state):
        for key in sorted(state[idx]):
            v = state[idx][key]
            h.update(f"{idx}.{key}".encode())
            h.update(v.detach().cpu().contiguous().numpy().tobytes() if torch.is_tensor(v) else repr(v).encode())
    return h.hexdigest()


class TolerantDDP(DistributedDataParallel):
    """torchft's DistributedDataParallel with its comm hook corrected for a failed allreduce.

    torchft 0.2.0 (and upstream main as of 2025-10): when the gloo allreduce fails because a peer
    replica group died mid-step, ``_ManagedWork.wait()`` records the error in the manager and
    returns False *before* it builds the future chain, so ``DistributedDataParallel._comm_hook``
    hits ``assert fut._fut`` and the surviving trainer dies with an AssertionError instead of
    voting ``should_commit=False`` and going on. (When the manager has already errored,
    ``allreduce`` returns a ``_DummyWork`` whose plain future has no ``_fut`` at all.) This hook
    is torchft's, except that it returns the (discarded) bucket in those cases: the manager has
    recorded the error, so the step is not committed, as torchft intends.
    """

    @staticmethod
    def _comm_hook(state: Manager, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        work = state.allreduce(bucket.buffer())
        work.wait()
        fut = work.get_future()
        inner = getattr(fut, "_fut", fut)
        if inner is None:
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done
        return inner


class RecordingOptimizer(Optimizer):
    """torchft's OptimizerWrapper, unchanged, except that it remembers the commit decision."""

    last_commit: bool | None = None

    def step(self, closure: object | None = None) -> None:
        assert closure is None
        self.last_commit = self.manager.should_commit()
        if self.last_commit:
            self.optim.step()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replica-group", type=int, default=int(os.environ.get("REPLICA_GROUP_ID", "0")))
    ap.add_argument("--steps", type=int, default=20, help="train until the manager's step reaches this")
    ap.add_argument("--min-final-participants", type=int, default=0)
    ap.add_argument("--min-replica-size", type=int, default=2)
    ap.add_argument("--step-sleep", type=float, default=0.0,
                    help="seconds of simulated compute per step (after start_quorum, before forward)")
    ap.add_argument("--pre-quorum-sleep", type=float, default=0.0,
                    help="seconds spent before start_quorum every step (a slower group, e.g. data loading): "
                         "the other groups' Quorum calls wait at the lighthouse meanwhile")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--progress", type=Path, required=True)
    ap.add_argument("--result", type=Path, required=True)
    ap.add_argument("--ddp", choices=("torchft", "tolerant"), default="torchft",
                    help="torchft's DistributedDataParallel as is, or with the comm hook fix (TolerantDDP), "
                         "needed when a peer may die in the middle of an allreduce")
    ap.add_argument("--ready-file", type=Path, help="created once the manager and model are set up")
    ap.add_argument("--go-file", type=Path, help="wait for this file before the first step (a start barrier)")
    ap.add_argument("--go-timeout", type=float, default=120.0)
    ap.add_argument("--max-attempts", type=int, default=1000, help="safety bound on step attempts")
    args = ap.parse_args()

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s g{args.replica_group} %(name)s %(levelname)s %(message)s")
    log = logging.getLogger("trainer")
    torch.set_num_threads(1)

    # torchft reads TORCHFT_TIMEOUT_SEC / TORCHFT_QUORUM_TIMEOUT_SEC / TORCHFT_CONNECT_TIMEOUT_SEC
    # itself, but some objects only get the constructor arguments (the process group, the HTTP
    # checkpoint transport, the Rust ManagerServer's connect timeout): pass the same values.
    timeout = env_seconds("TORCHFT_TIMEOUT_SEC", 30)
    quorum_timeout = env_seconds("TORCHFT_QUORUM_TIMEOUT_SEC", 60)
    connect_timeout = env_seconds("TORCHFT_CONNECT_TIMEOUT_SEC", 60)

    store = dist.TCPStore(host_name="127.0.0.1", port=0, is_master=True, wait_for_workers=False)

    torch.manual_seed(args.seed)
    model = TinyModel()
    criterion = nn.CrossEntropyLoss()

    def load_state_dict(sd: dict) -> None:
        ddp.load_state_dict(sd["model"])
        optimizer.load_state_dict(sd["optim"])

    def state_dict() -> dict:
        return {"model": ddp.state_dict(), "optim": optimizer.state_dict()}

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=args.min_replica_size,
        replica_id=f"train_ddp_{args.replica_group}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        hostname="127.0.0.1",
        timeout=timeout,
        quorum_timeout=quorum_timeout,
        connect_timeout=connect_timeout,
        use_async_quorum=True,
    )
    ddp = (TolerantDDP if args.ddp == "tolerant" else DistributedDataParallel)(manager, model)
    optimizer = RecordingOptimizer(manager, torch.optim.Adam(ddp.parameters(), lr=0.01))
    log.info("replica group %d started (pid %d, lighthouse %s)", args.replica_group, os.getpid(),
             os.environ.get("TORCHFT_LIGHTHOUSE"))
    if args.ready_file is not None:
        args.ready_file.write_text(str(os.getpid()))
    if args.go_file is not None:
        # Start barrier: set-up (imports, DDP) takes seconds and varies between processes; the
        # first quorum should not depend on it.
        deadline = time.monotonic() + args.go_timeout
        while not args.go_file.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{args.go_file} did not appear within {args.go_timeout}s")
            time.sleep(0.01)

    progress = args.progress.open("a", buffering=1)
    attempts = commit_failures = 0
    try:
        while True:
            attempts += 1
            if attempts > args.max_attempts:
                raise RuntimeError(f"gave up after {args.max_attempts} step attempts")
            t0 = time.time()
            step_before = manager.current_step()
            if args.pre_quorum_sleep:
                time.sleep(args.pre_quorum_sleep)
            optimizer.zero_grad()  # starts the (async) quorum
            if args.step_sleep:
                time.sleep(args.step_sleep)  # "compute" overlapping the quorum
            inputs, labels = batch(args.seed, step_before, args.replica_group)
            loss = criterion(ddp(inputs), labels)
            loss.backward()  # allreduce through the manager
            optimizer.step()  # should_commit, then the inner step if committed
            t1 = time.time()
            err = manager.errored()
            committed = bool(optimizer.last_commit)
            commit_failures += not committed
            participants = manager.num_participants()
            record = {
                "group": args.replica_group,
                "pid": os.getpid(),
                "attempt": attempts,
                "step": step_before,
                "step_after": manager.current_step(),
                "committed": committed,
                "quorum_id": manager._quorum_id,
                "participants": participants,
                "replica_rank": manager.participating_rank(),
                "healed": bool(manager._healing),
                "errored": None if err is None else str(err.original_exception)[:500],
                "loss": float(loss.item()),
                "t_start": t0,
                "t_end": t1,
                "duration_s": round(t1 - t0, 4),
            }
            progress.write(json.dumps(record) + "\n")
            if (committed and manager.current_step() >= args.steps
                    and participants >= args.min_final_participants):
                break
        result = {
            "group": args.replica_group,
            "pid": os.getpid(),
            "digest": digest(ddp.module, optimizer.optim),
            "final_step": manager.current_step(),
            "batches_committed": manager.batches_committed(),
            "steps_attempted": attempts,
            "commit_failures": commit_failures,
        }
        tmp = args.result.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(args.result)
        log.info("done: %s", result)
    finally:
        progress.close()
        manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    try:
        rc = main()
    except SystemExit as e:  # argparse (--help, bad arguments)
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except BaseException:  # noqa: BLE001 - report, then leave without joining torchft's threads
        import traceback

        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without waiting for torchft's background threads (heartbeats, checkpoint server).
    os._exit(rc)
