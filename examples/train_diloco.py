#!/usr/bin/env python3
"""Semi-synchronous fault-tolerant training with ftclient: Streaming DiLoCo (or LocalSGD) on CPU.

Each replica group trains a small MLP on its own stream of a synthetic classification task (a fixed
random "teacher" network labels Gaussian inputs, so nothing is downloaded) and only meets the others
once per round: with ``--fragments K`` the model is split into K fragments and one of them is
synchronised per round (``--sync-every`` inner steps synchronise every fragment once). Run one copy
per replica group; they find each other through the lighthouse::

    lighthouse-cluster up --min_replicas 2            # prints the TORCHFT_LIGHTHOUSE value
    export TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510,http://127.0.0.1:29511,http://127.0.0.1:29512
    REPLICA_GROUP_ID=0 python examples/train_diloco.py          # terminal 1
    REPLICA_GROUP_ID=1 python examples/train_diloco.py          # terminal 2

Kill one (Ctrl-C) and start it again: the other goes on alone, and the new process heals the whole
DiLoCo state (global parameters, outer and inner optimizer state) from it at the next
synchronisation. Start a third one mid-run: it joins at the next synchronisation. Kill the
lighthouse leader: nothing happens.

Every synchronisation prints ``round= step= fragment= loss= quorum_id= participants= committed=
healed=`` (``round`` counts this process's synchronisations, ``step`` the committed ones of the
whole job, ``loss`` is the mean training loss of the round's inner steps). The end prints the sha256
of the global parameters (every fragment's backup; with ``--algorithm localsgd``, the model) and of
the outer optimizer state: every replica group ends with the same digests.

``--fail-commit-at-step S`` makes this group report an error (``manager.report_error``) just before
its commit decision at step S, once: that group's commit fails, it reports the failure with its next
quorum (which gets a new id) and catches up from a peer.

Environment: torchft's. ``REPLICA_GROUP_ID`` (default 0), ``TORCHFT_LIGHTHOUSE`` (one URL or every
lighthouse node), ``TORCHFT_MANAGER_PORT`` (default: any free port), ``TORCHFT_TIMEOUT_SEC``
(collectives, commit, checkpoint transfer; default 30), ``TORCHFT_QUORUM_TIMEOUT_SEC`` (default
60), ``TORCHFT_CONNECT_TIMEOUT_SEC`` (default 60).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from ftclient import DiLoCo, LocalSGD, Manager, ProcessGroupGloo

IN_FEATURES = 16
CLASSES = 4
HIDDEN = 32
EVAL_SAMPLES = 512


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--algorithm", choices=["diloco", "localsgd"], default="diloco")
    ap.add_argument("--rounds", type=int, default=20,
                    help="train until this many synchronisations are committed (the manager's step)")
    ap.add_argument("--sync-every", type=int, default=8,
                    help="inner steps in which every fragment is synchronised once (LocalSGD: between syncs)")
    ap.add_argument("--fragments", type=int, default=2, help="model fragments (DiLoCo; at most 4)")
    ap.add_argument("--fragment-sync-delay", type=int, default=1,
                    help="inner steps between starting a fragment's average and using it (DiLoCo)")
    ap.add_argument("--fragment-update-alpha", type=float, default=0.0,
                    help="after a committed round the fragment becomes lerp(global, local, alpha) (DiLoCo)")
    ap.add_argument("--bucket-cap-mb", type=float, default=None,
                    help="average the pseudo-gradients in buckets of this many MiB (DiLoCo; default: one "
                         "allreduce per tensor)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--inner-lr", type=float, default=3e-3)
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-sleep", type=float, default=0.0,
                    help="seconds slept before every inner step (simulated data loading), to slow training down "
                         "for demos and tests")
    ap.add_argument("--min-replica-size", type=int, default=1,
                    help="fewest replica groups a synchronisation may commit with")
    ap.add_argument("--min-final-participants", type=int, default=0,
                    help="after --rounds, go on until --final-rounds consecutive committed synchronisations had "
                         "this many replica groups (so that a group started late trains with the others before "
                         "everyone stops)")
    ap.add_argument("--final-rounds", type=int, default=1,
                    help="how many consecutive committed synchronisations --min-final-participants asks for")
    ap.add_argument("--fail-commit-at-step", type=int, default=None,
                    help="report an error just before the commit decision at this step (once)")
    ap.add_argument("--output", type=Path, help="write a JSON summary (digests, every round) here at the end")
    ap.add_argument("--log-level", default=os.environ.get("TRAIN_DILOCO_LOG_LEVEL", "warning"),
                    choices=["debug", "info", "warning", "error"], help="ftclient's log level (stderr)")
    args = ap.parse_args(argv)
    if not 1 <= args.fragments <= 4:
        ap.error("--fragments must be between 1 and 4")
    return args


def build_model() -> nn.Sequential:
    """Four blocks; fragments are contiguous runs of blocks."""
    return nn.Sequential(
        nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU()),
        nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU()),
        nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU()),
        nn.Sequential(nn.Linear(HIDDEN, CLASSES)),
    )


def split_fragments(model: nn.Sequential, k: int) -> list[nn.Module]:
    blocks = list(model)
    bounds = [round(i * len(blocks) / k) for i in range(k + 1)]
    return [nn.Sequential(*blocks[bounds[i]:bounds[i + 1]]) for i in range(k)]


class Task:
    """A fixed random teacher labels Gaussian inputs; each replica group draws its own stream."""

    def __init__(self, seed: int, group: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.w1 = torch.randn(IN_FEATURES, HIDDEN, generator=g)
        self.w2 = torch.randn(HIDDEN, CLASSES, generator=g)
        self.stream = torch.Generator().manual_seed(seed * 1_000_003 + 17 * (group + 1))
        ev = torch.Generator().manual_seed(seed + 999_983)
        self.eval_x = torch.randn(EVAL_SAMPLES, IN_FEATURES, generator=ev)
        self.eval_y = self.label(self.eval_x)

    def label(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(x @ self.w1) @ self.w2).argmax(dim=1)

    def batch(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, IN_FEATURES, generator=self.stream)
        return x, self.label(x)


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def sha256(items: Iterable[tuple[str, Any]]) -> str:
    h = hashlib.sha256()
    for name, v in items:
        h.update(name.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes() if torch.is_tensor(v) else repr(v).encode())
    return h.hexdigest()


def optimizer_items(optimizers: list[torch.optim.Optimizer]) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for j, opt in enumerate(optimizers):
        state = opt.state_dict()["state"]
        out += [(f"{j}.{i}.{k}", state[i][k]) for i in sorted(state) for k in sorted(state[i])]
    return out


def inject_commit_failure(manager: Manager, at_step: int, tag: str) -> None:
    """Make ``manager.should_commit`` see an error at ``at_step``, once (as a corrupt-gradient
    check would report one)."""
    original: Callable[..., bool] = manager.should_commit
    fired = False

    def should_commit(*args: Any, **kwargs: Any) -> bool:
        nonlocal fired
        if not fired and manager.current_step() == at_step:
            fired = True
            say(f"{tag} injecting a commit failure at step={at_step}")
            manager.report_error(RuntimeError(f"injected commit failure at step {at_step}"))
        return original(*args, **kwargs)

    manager.should_commit = should_commit  # type: ignore[method-assign]


def train(args: argparse.Namespace) -> int:
    group = int(os.environ.get("REPLICA_GROUP_ID", 0))
    tag = f"group={group}"
    torch.manual_seed(args.seed)  # the same initial weights everywhere (healing would fix them anyway)
    torch.set_num_threads(1)
    task = Task(args.seed, group)
    model = build_model()
    inner = torch.optim.AdamW(model.parameters(), lr=args.inner_lr)

    host = socket.gethostname()
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=float(os.environ.get("TORCHFT_TIMEOUT_SEC", 30)))
    diloco = args.algorithm == "diloco"

    def load_state_dict(state_dict: dict[str, Any]) -> None:  # LocalSGD: the model and its optimizer
        model.load_state_dict(state_dict["model"])
        inner.load_state_dict(state_dict["optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        # DiLoCo registers its whole state itself (manager.register_state_dict_fn).
        load_state_dict=None if diloco else load_state_dict,
        state_dict=None if diloco else state_dict,
        min_replica_size=args.min_replica_size,
        use_async_quorum=False,
        replica_id=f"train_diloco_{group}",
        store_addr=host,
        store_port=store.port,
        rank=0,
        world_size=1,
        timeout=timeout,
    )
    if args.fail_commit_at_step is not None:
        inject_commit_failure(manager, args.fail_commit_at_step, tag)

    outers: list[torch.optim.Optimizer] = []
    algo: DiLoCo | LocalSGD
    if diloco:
        fragments = split_fragments(model, args.fragments)
        outers = [torch.optim.SGD(f.parameters(), lr=args.outer_lr, momentum=0.9, nesterov=True) for f in fragments]
        algo = DiLoCo(manager, fragments, inner, outers, sync_every=args.sync_every,
                      fragment_sync_delay=args.fragment_sync_delay,
                      fragment_update_alpha=args.fragment_update_alpha,
                      use_bucketization=args.bucket_cap_mb is not None, bucket_cap_mb=args.bucket_cap_mb)
    else:
        algo = LocalSGD(manager, model, inner, sync_every=args.sync_every)
    criterion = nn.CrossEntropyLoss()
    say(f"{tag} pid={os.getpid()} algorithm={args.algorithm} fragments={args.fragments if diloco else 1} "
        f"sync_every={args.sync_every} lighthouse={os.environ.get('TORCHFT_LIGHTHOUSE', '')}")

    rounds: list[dict[str, Any]] = []
    losses: list[float] = []
    last = None
    streak = 0  # consecutive committed rounds with at least --min-final-participants groups
    t_round = time.time()
    try:
        with algo:
            while True:
                if args.step_sleep:
                    time.sleep(args.step_sleep)
                x, y = task.batch(args.batch_size)
                inner.zero_grad()
                loss = criterion(model(x), y)
                loss.backward()
                losses.append(float(loss.item()))
                inner.step()  # every few calls: quorum, average, commit (the wrapper's hook)
                sync = algo.last_sync
                if sync is None or sync is last:
                    continue
                last = sync
                now = time.time()
                rec = {"round": algo.syncs, "step": sync.step, "fragment": sync.fragment,
                       "loss": round(sum(losses) / len(losses), 6), "quorum_id": sync.quorum_id,
                       "participants": sync.participants, "committed": sync.committed, "healed": sync.healed,
                       "t_start": t_round, "t_end": now, "duration_s": round(now - t_round, 4)}
                err = manager.errored()
                rec["errored"] = None if err is None else str(err.original_exception)[:300]
                rounds.append(rec)
                losses, t_round = [], now
                say(f"{tag} round={rec['round']} step={sync.step} "
                    f"fragment={'-' if sync.fragment is None else sync.fragment} loss={rec['loss']:.4f} "
                    f"quorum_id={sync.quorum_id} participants={sync.participants} committed={sync.committed} "
                    f"healed={sync.healed} time={rec['duration_s']:.3f}s")
                streak = streak + 1 if sync.committed and sync.participants >= args.min_final_participants else 0
                if sync.committed and sync.step >= args.rounds and streak >= args.final_rounds:
                    break
        return finish(args, tag, group, model, algo, outers, task, manager, rounds)
    finally:
        manager.shutdown(wait=False)


def finish(args: argparse.Namespace, tag: str, group: int, model: nn.Sequential, algo: DiLoCo | LocalSGD,
           outers: list[torch.optim.Optimizer], task: Task, manager: Manager, rounds: list[dict[str, Any]]) -> int:
    if isinstance(algo, DiLoCo):
        global_params = [(name, t.clone()) for name, t in algo.global_parameters()]
        params = sha256(global_params)
        outer = sha256(optimizer_items(algo.outer_optimizers()))
        # Evaluate the global model: the parameters every group agrees on.
        evaluated = build_model()
        with torch.no_grad():
            for (_, p), (_, g) in zip(evaluated.named_parameters(), global_params):
                p.copy_(g)
    else:
        params = sha256(list(model.state_dict().items()))
        outer = "-"
        evaluated = model
    with torch.no_grad():
        logits = evaluated(task.eval_x)
        eval_loss = float(nn.functional.cross_entropy(logits, task.eval_y))
        accuracy = float((logits.argmax(dim=1) == task.eval_y).float().mean())
    say(f"{tag} final step={manager.current_step()} rounds={len(rounds)} eval_loss={eval_loss:.4f} "
        f"eval_accuracy={accuracy:.4f} params_sha256={params} outer_sha256={outer}")
    if args.output is not None:
        summary = {
            "replica_group": group, "pid": os.getpid(), "algorithm": args.algorithm,
            "final_step": manager.current_step(), "params_sha256": params, "outer_sha256": outer,
            "eval_loss": eval_loss, "eval_accuracy": accuracy,
            "commit_failures": sum(not r["committed"] for r in rounds), "rounds": rounds,
        }
        tmp = args.output.with_name(args.output.name + ".tmp")
        tmp.write_text(json.dumps(summary, indent=1))
        tmp.replace(args.output)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    logging.getLogger("ftclient").setLevel(args.log_level.upper())
    return train(args)


if __name__ == "__main__":
    try:
        code = main()
    except KeyboardInterrupt:
        code = 130
    except Exception as e:  # noqa: BLE001 -- one clear line after the traceback, then exit 1
        import traceback

        traceback.print_exc()
        print(f"train_diloco: error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without joining background threads (heartbeats, checkpoint server, gRPC).
    os._exit(code)
