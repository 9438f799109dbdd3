#!/usr/bin/env python3
"""Fault-tolerant data-parallel training with ftclient or torchft, on scikit-learn's bundled digits.

torchft's ``train_ddp.py`` on a real dataset that ships with an installed package (no download):
8x8 images of handwritten digits (``sklearn.datasets.load_digits``, 1,797 samples, 10 classes),
a small MLP, AdamW. Run one copy per replica group; they find each other through the lighthouse::

    lighthouse-cluster up --min_replicas 2            # prints the TORCHFT_LIGHTHOUSE value
    export TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510,http://127.0.0.1:29511,http://127.0.0.1:29512
    REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 python examples/train_ddp.py     # terminal 1
    REPLICA_GROUP_ID=1 NUM_REPLICA_GROUPS=2 python examples/train_ddp.py     # terminal 2

Kill one (Ctrl-C) and start it again: it heals from a peer and trains on. Kill the lighthouse
leader: nothing happens (the SDK follows the leader through the endpoint list).

``--sdk torchft`` runs the same script on torchft's own Manager, ProcessGroupGloo,
DistributedDataParallel, Optimizer and DistributedSampler (``pip install torchft``). torchft's
client takes exactly ONE lighthouse URL: give each replica group one node's URL (any node works;
spread the groups over the nodes), or a host name with one address per node (deploy/README.md,
"One name for every node"); a comma-separated list is refused at start::

    REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 \
        python examples/train_ddp.py --sdk torchft
    REPLICA_GROUP_ID=1 NUM_REPLICA_GROUPS=2 TORCHFT_LIGHTHOUSE=http://127.0.0.1:29511 \
        python examples/train_ddp.py --sdk torchft

With torchft, set ``TORCHFT_QUORUM_RETRIES`` (e.g. 9, with ``TORCHFT_QUORUM_TIMEOUT_SEC=10``) to
ride out a restart of the node a group talks to (README.md, "Using it with torchft").

Every step prints ``step= loss= quorum_id= participants= committed=`` (``step`` counts the
committed steps, ``loss`` is this rank's batch loss); the end prints the sha256 of the parameters
(and of the optimizer state): every replica group ends with the same digests.

Ranks per replica group:

* one process (default): the script hosts its replica group's TCPStore itself;
* ``--nproc-per-group N``: the script hosts the store and starts N ranks itself;
* torchrun: ``torchrun --nproc_per_node=N examples/train_ddp.py`` (RANK, WORLD_SIZE,
  MASTER_ADDR and MASTER_PORT set by torchrun; its agent hosts the store).

Each rank trains on its own shard (``DistributedSampler``); rank r of every replica group averages
its gradients with rank r of the others through the Manager (DDP), then the ranks of a group
average among themselves (a plain Gloo group on the replica group's store).

Environment: torchft's. ``REPLICA_GROUP_ID`` / ``NUM_REPLICA_GROUPS`` (default 0 / 2),
``TORCHFT_LIGHTHOUSE`` (ftclient: one URL or every lighthouse node; torchft: one URL),
``TORCHFT_QUORUM_RETRIES`` (torchft; default 0), ``TORCHFT_MANAGER_PORT`` (default:
any free port), ``TORCHFT_TIMEOUT_SEC`` (collectives, commit, checkpoint transfer; default 30),
``TORCHFT_QUORUM_TIMEOUT_SEC`` (default 60), ``TORCHFT_CONNECT_TIMEOUT_SEC`` (default 60).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

SDKS = ("ftclient", "torchft")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--sdk", choices=SDKS, default="ftclient",
                    help="the fault-tolerance SDK: ftclient (this package; TORCHFT_LIGHTHOUSE may list every "
                         "node) or torchft (TORCHFT_LIGHTHOUSE must be exactly one URL)")
    ap.add_argument("--steps", type=int, default=200, help="train until this many steps are committed")
    ap.add_argument("--step-sleep", type=float, default=0.0,
                    help="seconds slept at the start of every step (simulated data loading), to slow training "
                         "down for demos and tests")
    ap.add_argument("--output", type=Path,
                    help="write a JSON summary (digests, every step) here at the end; with several ranks per "
                         "replica group, rank r writes NAME.rank<r>.SUFFIX")
    ap.add_argument("--min-replica-size", type=int, default=1,
                    help="fewest replica groups a step may commit with (Manager(min_replica_size=...))")
    ap.add_argument("--min-final-participants", type=int, default=0,
                    help="after --steps, go on until a committed step had this many replica groups (so that "
                         "a group restarted late still trains with the others before everyone stops)")
    ap.add_argument("--nproc-per-group", type=int, default=1,
                    help="ranks in this replica group, started by this script (ignored under torchrun)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the model trains: cuda puts rank r of every group on GPU r %% (GPUs on the machine) "
                         "(LOCAL_RANK under torchrun); the collectives across replica groups stay on --pg")
    ap.add_argument("--pg", choices=("gloo", "nccl"), default="gloo",
                    help="the process group across replica groups: gloo (CPU or CUDA tensors) or nccl (--device cuda, "
                         "one GPU per rank: NCCL refuses two ranks of one group on the same GPU)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-level", default="warning",
                    choices=["debug", "info", "warning", "error"], help="the SDK's log level (stderr)")
    return ap.parse_args(argv)


class UsageError(Exception):
    """A setting the script refuses before it starts (exit status 2)."""


def check_lighthouse(sdk: str, value: str) -> None:
    """torchft's client connects to exactly one URL: with a comma-separated list its Manager waits
    out its connect timeout (60 s by default) and then fails with "invalid URI". Refuse it at once."""
    urls = [u.strip() for u in value.split(",") if u.strip()]
    if sdk == "torchft" and len(urls) > 1:
        raise UsageError(
            f"torchft takes exactly one lighthouse URL, but TORCHFT_LIGHTHOUSE lists {len(urls)} ({value}): "
            f"set it to one node's URL (e.g. TORCHFT_LIGHTHOUSE={urls[0]}; spread replica groups over the nodes) "
            "or to a host name with one address per node (deploy/README.md, \"One name for every node\"), "
            "or run with --sdk ftclient, which takes the whole list")


def preflight(argv: list[str] | None = None) -> int | None:
    """Check the command line and TORCHFT_LIGHTHOUSE: the exit status to stop with, or None."""
    args = parse_args(argv)
    try:
        check_lighthouse(args.sdk, os.environ.get("TORCHFT_LIGHTHOUSE", ""))
        if args.pg == "nccl" and args.device != "cuda":
            raise UsageError("--pg nccl needs --device cuda (NCCL runs on GPUs only)")
    except UsageError as e:
        print(f"train_ddp: error: {e}", file=sys.stderr, flush=True)
        return 2
    return None


if __name__ == "__main__" and (_code := preflight()) is not None:
    sys.exit(_code)  # at once, without the seconds that importing torch takes

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

TEST_SAMPLES = 297  # held out (fixed split): 1,500 training samples remain


def load_sdk(sdk: str) -> Any:
    """The module with Manager, ProcessGroupGloo, DistributedDataParallel, Optimizer and
    DistributedSampler: ftclient, or torchft itself (same constructors, same training loop)."""
    if sdk == "torchft":
        import torchft

        return torchft
    import ftclient

    return ftclient


def quorum_view(sdk: str, manager: Any, step_before: int, step_mid: int) -> tuple[int, bool, int]:
    """(quorum id, whether this group healed from a peer in this step, the step it healed to).

    ``step_mid`` is the manager's step once this step's quorum (and any heal) is done."""
    if sdk == "torchft":
        # torchft 0.2.0 has no public accessor for the quorum id (display only). A group that
        # heals takes no part in its step (is_participating() is False until the next quorum).
        return getattr(manager, "_quorum_id", -1), not manager.is_participating(), step_mid
    quorum = manager.last_quorum_result
    healed = bool(quorum and quorum.heal)  # loaded a peer's state at quorum.max_step first
    return (quorum.quorum_id if quorum else -1), healed, (quorum.max_step if healed else step_before)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def load_data() -> tuple[TensorDataset, TensorDataset]:
    """The digits bundled with scikit-learn, scaled to [0, 1]; a fixed train/test split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    test, train = order[:TEST_SAMPLES], order[TEST_SAMPLES:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def say(line: str) -> None:
    """One line to stdout in one write: the ranks of a replica group may share the stream."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def pick_device(kind: str, local_rank: int) -> torch.device:
    """``cpu``, or the GPU of this rank (``cuda:local_rank % count``) made the current device."""
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UsageError("--device cuda: CUDA is not available on this machine (torch.cuda.is_available() is False)")
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def sha256(tensors: list[tuple[str, Any]]) -> str:
    h = hashlib.sha256()
    for name, v in tensors:
        h.update(name.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes() if torch.is_tensor(v) else repr(v).encode())
    return h.hexdigest()


def digests(net: nn.Module, optim: torch.optim.Optimizer) -> tuple[str, str]:
    """sha256 of the parameters (and buffers), and of the optimizer state, in a fixed order."""
    state = optim.state_dict()["state"]
    return (sha256(list(net.state_dict().items())),
            sha256([(f"{i}.{k}", state[i][k]) for i in sorted(state) for k in sorted(state[i])]))


def average_within_group(intra: dist.ProcessGroup, model: nn.Module, world_size: int) -> None:
    """Average the gradients over the ranks of this replica group (one flat allreduce)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    intra.allreduce([flat]).wait()
    flat.div_(world_size)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def output_path(path: Path, rank: int, world_size: int) -> Path:
    return path if world_size == 1 else path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def train(args: argparse.Namespace, rank: int, world_size: int, store_addr: str, store_port: int) -> int:
    group = int(os.environ.get("REPLICA_GROUP_ID", 0))
    num_groups = int(os.environ.get("NUM_REPLICA_GROUPS", 2))
    tag = f"group={group}" + (f" rank={rank}" if world_size > 1 else "")
    torch.manual_seed(args.seed)  # every replica group starts from the same weights
    torch.set_num_threads(1)
    sdk = load_sdk(args.sdk)
    device = pick_device(args.device, int(os.environ.get("LOCAL_RANK", rank)))

    trainset, testset = load_data()
    sampler = sdk.DistributedSampler(trainset, replica_rank=group, num_replica_groups=num_groups, group_rank=rank,
                                     num_replicas=world_size, shuffle=True, seed=args.seed)
    loader = DataLoader(trainset, batch_size=args.batch_size, sampler=sampler)

    # Collectives, commit and checkpoint transfer (the Manager reads TORCHFT_TIMEOUT_SEC itself too).
    timeout = timedelta(seconds=float(os.environ.get("TORCHFT_TIMEOUT_SEC", 30)))
    intra = None
    if world_size > 1:
        # The ranks of this replica group average their gradients among themselves too.
        store = dist.TCPStore(store_addr, store_port, is_master=False, wait_for_workers=False)
        intra = dist.ProcessGroupGloo(dist.PrefixStore("train_ddp/intra", store), rank, world_size, timeout)

    def load_state_dict(state_dict: dict[str, Any]) -> None:
        model.load_state_dict(state_dict["model"])
        optimizer.load_state_dict(state_dict["optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    pg = sdk.ProcessGroupNCCL(timeout=timeout) if args.pg == "nccl" else sdk.ProcessGroupGloo(timeout=timeout)
    manager = sdk.Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=args.min_replica_size,
        replica_id=f"train_ddp_{group}",
        store_addr=store_addr,
        store_port=store_port,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        # torchft passes the constructor's value, not the environment's, to its lighthouse
        # connection: give both SDKs the environment's values.
        quorum_timeout=env_seconds("TORCHFT_QUORUM_TIMEOUT_SEC", 60),
        connect_timeout=env_seconds("TORCHFT_CONNECT_TIMEOUT_SEC", 60),
    )
    net = Net().to(device)
    model = sdk.DistributedDataParallel(manager, net)
    optimizer = sdk.Optimizer(manager, torch.optim.AdamW(model.parameters(), lr=args.lr))
    criterion = nn.CrossEntropyLoss()
    say(f"{tag} pid={os.getpid()}" + (f" sdk={args.sdk}" if args.sdk != "ftclient" else "")
        + f" replica_group {group}/{num_groups} rank {rank}/{world_size} device={device} "
        f"lighthouse={os.environ.get('TORCHFT_LIGHTHOUSE', '')} train_samples={len(sampler)}")

    records: list[dict[str, Any]] = []
    epoch = 0
    try:
        while True:
            sampler.set_epoch(epoch)
            for inputs, labels in loader:
                t0 = time.time()
                if args.step_sleep:
                    time.sleep(args.step_sleep)
                step_before = manager.current_step()
                optimizer.zero_grad()  # starts this step's quorum (in the background)
                inputs, labels = inputs.to(device), labels.to(device)
                loss = criterion(model(inputs), labels)
                loss.backward()  # DDP: gradients averaged across replica groups by the Manager
                if intra is not None:
                    average_within_group(intra, model, world_size)
                manager.wait_quorum()  # done already (the allreduce waited for it): a healed group is at its peers' step
                step_mid = manager.current_step()
                optimizer.step()  # steps iff every replica group in the quorum may commit
                step = manager.current_step()
                quorum_id, healed, healed_to = quorum_view(args.sdk, manager, step_before, step_mid)
                committed = step == healed_to + 1
                err = manager.errored()
                rec = {
                    "step_before": step_before, "step": step, "loss": round(float(loss.item()), 6),
                    "quorum_id": quorum_id, "participants": manager.num_participants(),
                    "committed": committed, "healed": healed,
                    "errored": None if err is None else str(err.original_exception)[:300],
                    "t_start": t0, "t_end": time.time(),
                }
                rec["duration_s"] = round(rec["t_end"] - t0, 4)
                records.append(rec)
                say(f"{tag} step={step} loss={rec['loss']:.4f} quorum_id={rec['quorum_id']} "
                    f"participants={rec['participants']} committed={committed}"
                    + (f" healed_to={healed_to}" if healed else "") + f" time={rec['duration_s']:.3f}s")
                if committed and step >= args.steps and rec["participants"] >= args.min_final_participants:
                    return finish(args, tag, rank, world_size, group, num_groups, net, optimizer, manager,
                                  testset, records)
            epoch += 1
    finally:
        manager.shutdown(wait=False)


def finish(args: argparse.Namespace, tag: str, rank: int, world_size: int, group: int, num_groups: int,
           net: nn.Module, optimizer: Any, manager: Any, testset: TensorDataset,
           records: list[dict[str, Any]]) -> int:
    params, optim_state = digests(net, optimizer.optim)
    with torch.no_grad():
        x, y = (t.to(next(net.parameters()).device) for t in testset.tensors)
        accuracy = (net(x).argmax(dim=1) == y).float().mean().item()
    say(f"{tag} final step={manager.current_step()} test_accuracy={accuracy:.4f} "
        f"params_sha256={params} optim_sha256={optim_state}")
    if args.output is not None:
        summary = {
            "sdk": args.sdk, "replica_group": group, "num_replica_groups": num_groups, "rank": rank,
            "world_size": world_size,
            "pid": os.getpid(), "final_step": manager.current_step(), "params_sha256": params,
            "optim_sha256": optim_state, "test_accuracy": accuracy,
            "batches_committed": manager.batches_committed(),
            "commit_failures": sum(not r["committed"] for r in records), "steps": records,
        }
        path = output_path(args.output, rank, world_size)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(summary, indent=1))
        tmp.replace(path)
    return 0


def spawn_group(args: argparse.Namespace) -> int:
    """Host the replica group's TCPStore and run ``--nproc-per-group`` ranks (torchrun-like env)."""
    host = socket.gethostname()
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    procs = []
    for rank in range(args.nproc_per_group):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(args.nproc_per_group),
               "LOCAL_WORLD_SIZE": str(args.nproc_per_group), "MASTER_ADDR": host, "MASTER_PORT": str(store.port)}
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env=env))

    def stop(*_: Any) -> None:
        for p in procs:
            if p.poll() is None:
                p.terminate()

    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    failed: list[int] = []
    try:
        # Ranks of a replica group fail together: the first one to fail takes the others down.
        while not failed:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if all(c == 0 for c in codes):
                break
            time.sleep(0.1)
    finally:
        stop()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
    return failed[0] if failed else 0


def env_seconds(name: str, default: float) -> timedelta:
    value = os.environ.get(name)
    return timedelta(seconds=float(value) if value else default)


def main(argv: list[str] | None = None) -> int:
    if (code := preflight(argv)) is not None:
        return code
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    logging.getLogger(args.sdk).setLevel(args.log_level.upper())
    env = os.environ
    if "RANK" in env and "MASTER_PORT" in env:  # torchrun, or a rank started by spawn_group
        return train(args, int(env["RANK"]), int(env.get("WORLD_SIZE", 1)), env.get("MASTER_ADDR", "localhost"),
                     int(env["MASTER_PORT"]))
    if args.nproc_per_group > 1:
        return spawn_group(args)
    # One process per replica group: host the group's store here.
    store = dist.TCPStore(socket.gethostname(), 0, is_master=True, wait_for_workers=False)
    return train(args, 0, 1, socket.gethostname(), store.port)


if __name__ == "__main__":
    try:
        code = main()
    except KeyboardInterrupt:
        code = 130
    except Exception as e:  # noqa: BLE001 -- one clear line after the traceback, then exit 1
        import traceback

        traceback.print_exc()
        print(f"train_ddp: error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without joining background threads (heartbeats, checkpoint server, gRPC).
    os._exit(code)
