#!/usr/bin/env python3
"""One ftclient replica group (one rank) whose steps record when each phase began and ended, for
the liveness integration tests (``tests/sdk/test_ftclient_liveness_training.py``).

A step: ``start_quorum`` (asynchronous), a gradient drawn from ``(seed, step, group)``,
``manager.allreduce`` (AVG over the participants), ``should_commit``, and on commit an SGD update
of a small parameter vector. Every group that commits a step applies the same update and a group
that heals loads a peer's parameters, so the survivors of any failure end bit-identical
(``--result``'s ``digest``).

Fault-injection knobs, for the replica group the test will SIGKILL:

* ``--hold allreduce --hold-at-step S``: at step S, once its quorum is in, write a ``holding``
  record and sleep: the other groups sit in that step's allreduce, waiting for this one;
* ``--hold quorum --hold-at-step S``: at step S, sleep before asking for the quorum: the others'
  Quorum calls wait at the lighthouse for this group (a death between steps);
* ``--state-mb M``: M MiB more state (never averaged) that a healing group fetches from a peer,
  so that a checkpoint transfer lasts long enough to be interrupted. ``recv_start``/``recv_end``
  records bracket the transfer on the receiving side.

Output: ``--progress FILE``, one JSON object per line, flushed at once: a record per step attempt
(``kind: "step"``: ``step``, ``step_after``, ``quorum_id``, ``participants``, ``committed``,
``healed``, ``errored``, and wall-clock ``t_start``, ``t_allreduce_start``, ``t_allreduce_end``,
``t_end``), an ``allreduce`` record as each allreduce starts, and the ``holding``/``recv_start``/
``recv_end`` records (every record has ``kind`` and ``t``).
``--result FILE`` (written last, atomically): ``digest``, ``final_step``, ``pid``, ``group``.
``--ready-file``/``--go-file``: a start barrier (every group's manager is up, so heartbeating,
before any asks for a quorum: the first quorum has every group).
ftclient's log (``--log-level``) goes to stderr.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ftclient import HTTPTransport, Manager, ProcessGroupGloo

DIM = 256
LR = 0.1


class Progress:
    def __init__(self, path: Path) -> None:
        self._f = open(path, "a", buffering=1)

    def write(self, kind: str, **fields: Any) -> None:
        self._f.write(json.dumps({"kind": kind, "t": time.time(), **fields}) + "\n")
        self._f.flush()


class RecordingTransport(HTTPTransport):
    """HTTPTransport that records when a checkpoint transfer to this group starts and ends."""

    def __init__(self, progress: Progress, timeout: timedelta, hostname: str) -> None:
        super().__init__(timeout=timeout, num_chunks=0, hostname=hostname)
        self._progress = progress

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        self._progress.write("recv_start", src_rank=src_rank, step=step)
        state = super().recv_checkpoint(src_rank=src_rank, metadata=metadata, step=step, timeout=timeout)
        self._progress.write("recv_end", step=step)
        return state


def gradient(seed: int, step: int, group: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + group)
    return torch.randn(DIM, generator=g)


def env_seconds(name: str, default: float) -> timedelta:
    value = os.environ.get(name)
    return timedelta(seconds=float(value) if value else default)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replica-group", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True, help="run until this many steps are committed")
    ap.add_argument("--min-replica-size", type=int, default=1)
    ap.add_argument("--min-final-participants", type=int, default=1)
    ap.add_argument("--step-sleep", type=float, default=0.0, help="simulated compute at the start of each step")
    ap.add_argument("--hold", choices=["none", "quorum", "allreduce"], default="none")
    ap.add_argument("--hold-at-step", type=int, default=-1)
    ap.add_argument("--state-mb", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--progress", type=Path, required=True)
    ap.add_argument("--result", type=Path, required=True)
    ap.add_argument("--ready-file", type=Path, help="created once the manager is up (the start barrier)")
    ap.add_argument("--go-file", type=Path, help="the first step waits for this file (the start barrier)")
    ap.add_argument("--log-level", default="info")
    ap.add_argument("--host", default="127.0.0.1",
                    help="the address other replica groups reach this one at (its store, manager server and "
                         "checkpoints); a trainer in a network namespace gives its namespace's address")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    logging.getLogger("ftclient").setLevel(args.log_level.upper())
    torch.set_num_threads(1)

    progress = Progress(args.progress)
    timeout = env_seconds("TORCHFT_TIMEOUT_SEC", 30)
    params = torch.zeros(DIM)
    ballast = torch.zeros(args.state_mb * (1 << 20) // 4)

    def state_dict() -> dict[str, Any]:
        return {"params": params, "ballast": ballast}

    def load_state_dict(sd: dict[str, Any]) -> None:
        params.copy_(sd["params"])
        ballast.copy_(sd["ballast"])

    store = dist.TCPStore(args.host, 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict, state_dict=state_dict,
                      min_replica_size=args.min_replica_size, replica_id=f"liveness_{args.replica_group}",
                      store_addr=args.host, store_port=store.port, rank=0, world_size=1, hostname=args.host,
                      timeout=timeout, quorum_timeout=env_seconds("TORCHFT_QUORUM_TIMEOUT_SEC", 60),
                      connect_timeout=env_seconds("TORCHFT_CONNECT_TIMEOUT_SEC", 60),
                      checkpoint_transport=RecordingTransport(progress, timeout, args.host))
    print(f"group={args.replica_group} pid={os.getpid()} replica_id={manager.replica_id}", flush=True)
    if args.ready_file is not None:
        args.ready_file.touch()
    if args.go_file is not None:
        deadline = time.monotonic() + 120
        while not args.go_file.exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"no {args.go_file} within 120 s")
            time.sleep(0.01)
    try:
        while True:
            step = manager.current_step()
            t_start = time.time()
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if args.hold == "quorum" and step == args.hold_at_step:
                progress.write("holding", step=step, where="quorum")
                time.sleep(3600)
            manager.start_quorum()
            grad = gradient(args.seed, step, args.replica_group)
            manager.wait_quorum()
            if args.hold == "allreduce" and step == args.hold_at_step:
                progress.write("holding", step=step, where="allreduce")
                time.sleep(3600)
            t_allreduce_start = time.time()
            progress.write("allreduce", step=step, quorum_id=manager.last_quorum_result.quorum_id)  # type: ignore[union-attr]
            manager.allreduce(grad).wait()
            t_allreduce_end = time.time()
            step_mid = manager.current_step()  # a healing group is at its peers' step now
            committed = manager.should_commit()
            if committed:
                params.sub_(LR * grad)
            err = manager.errored()
            quorum = manager.last_quorum_result
            progress.write("step", step=step, step_after=manager.current_step(), healed=step_mid != step,
                           quorum_id=quorum.quorum_id if quorum else -1, participants=manager.num_participants(),
                           committed=committed, errored=None if err is None else str(err.original_exception)[:300],
                           t_start=t_start, t_allreduce_start=t_allreduce_start, t_allreduce_end=t_allreduce_end,
                           t_end=time.time())
            if committed and manager.current_step() >= args.steps \
                    and manager.num_participants() >= args.min_final_participants:
                break
        result = {"group": args.replica_group, "pid": os.getpid(), "final_step": manager.current_step(),
                  "digest": hashlib.sha256(params.numpy().tobytes()).hexdigest()}
        tmp = args.result.with_name(args.result.name + ".tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(args.result)
        print(f"group={args.replica_group} final step={result['final_step']} digest={result['digest']}", flush=True)
        return 0
    finally:
        manager.shutdown(wait=False)


if __name__ == "__main__":
    sys.exit(main())
