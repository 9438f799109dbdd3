#!/usr/bin/env python3
"""Fault-tolerant HSDP on CPU, as torchtitan does it: FSDP2 inside each replica group, ftclient across them.

Each replica group is a few ranks (2 by default) that shard the model among themselves with FSDP2
(``torch.distributed.fsdp.fully_shard`` over a Gloo default process group: it runs on CPU). Across
replica groups, rank r of every group holds the same shard, and the groups average their shards'
gradients through ftclient, the way torchtitan's fault-tolerant HSDP does:

* ``ManagedProcessGroup(manager)`` registered as ``"dp_replicate"``;
* every FSDP module gets ``set_all_reduce_hook(lambda out: dist.all_reduce(out,
  group=replicate_pg, op=ReduceOp.AVG))``: the reduce-scattered gradient shard is averaged
  across the participating replica groups by the Manager (a group that is healing contributes
  nothing);
* the loss and the number of samples are synced with functional collectives: first over the
  replica group (``funcol.all_reduce(loss, "avg", dist.group.WORLD)``), then over the managed group
  (``funcol.all_reduce(..., "avg", replicate_pg)``, ``"sum"`` for the samples);
* ``ftclient.Optimizer`` starts the quorum in ``zero_grad()`` and steps only if every group may
  commit.

A replica group that restarts heals from a peer: rank r fetches rank r's shards of the parameters
and of the optimizer state. The state dict functions are torchtitan's: ``model.state_dict()`` and
``optimizer.state_dict()`` (DTensors; only each rank's shard travels). ftclient takes them on the
training thread just before the forward pass (its first module call after ``start_quorum``), never
while FSDP2 runs a forward or backward; torchft 0.2.0's Manager takes them on its quorum thread
during the forward pass, where FSDP2's state-dict hook swaps the parameters under the running step
(``--sdk torchft`` shows it; ``--state-dict shards`` is the workaround that reads the shards
without FSDP2's hooks). Every rank counts the state-dict reads that happened while a forward or
backward ran in its process (``state_dict_reads_during_compute`` in its summary; a line is printed
for each). Run two groups against a lighthouse::

    lighthouse-cluster up --min_replicas 2                 # prints the TORCHFT_LIGHTHOUSE value
    export TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510,http://127.0.0.1:29511,http://127.0.0.1:29512
    REPLICA_GROUP_ID=0 python examples/train_hsdp.py --steps 100     # terminal 1: 2 ranks
    REPLICA_GROUP_ID=1 python examples/train_hsdp.py --steps 100     # terminal 2: 2 ranks

This process forks ``--nproc-per-group`` ranks once it has imported torch (rank 0 hosts the group's
TCPStore); when a rank dies it ends the others and, with ``--max-restarts N``, starts the whole
group again (as torchrun's ``--max-restarts`` does: FSDP's process group cannot lose a rank), which
then heals from a peer. Under torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``
set) each process is one rank: ``REPLICA_GROUP_ID=0 torchrun --nproc_per_node=2 --master_port=29600
examples/train_hsdp.py`` (each group on a host its own ``--master_port``).

Every rank prints ``group= rank= step= loss= quorum_id= participants= committed=`` per step
(``loss`` is the loss averaged over every rank of every participating group) and, at the end, the
sha256 of the full (unsharded) parameters and optimizer state: every rank of every group ends with
the same digests.

``--sdk torchft`` runs the same script on torchft's own Manager, ProcessGroupGloo,
ManagedProcessGroup and Optimizer (``pip install torchft``; its client takes exactly one
lighthouse URL). Fault injection, for tests and demonstrations: ``--fail-recovery-on-rank R``
makes group rank R's first checkpoint fetch fail (the whole group then keeps its state and heals at
a later quorum: every rank of a group always agrees on the step and the weights);
``--skip-commit-every N`` makes the group vote against committing every N-th step, so that it falls
one step behind its peers and heals from them at the next quorum.

Environment: torchft's (``REPLICA_GROUP_ID``, ``TORCHFT_LIGHTHOUSE``, ``TORCHFT_TIMEOUT_SEC``
(default 30), ``TORCHFT_QUORUM_TIMEOUT_SEC``, ``TORCHFT_CONNECT_TIMEOUT_SEC``,
``TORCHFT_MANAGER_PORT``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed import ReduceOp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

import ftclient
from ftclient.process_group import ManagedProcessGroup

IN, HIDDEN, CLASSES = 32, 64, 8


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                                    nn.Linear(HIDDEN, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--sdk", choices=("ftclient", "torchft"), default="ftclient",
                    help="the fault-tolerance SDK: ftclient, or torchft itself (one lighthouse URL)")
    ap.add_argument("--state-dict", choices=("module", "shards"), default="module",
                    help="what the Manager sends a healing group: module = model.state_dict() and "
                         "optimizer.state_dict() (torchtitan's; DTensors), shards = the parameters' and the "
                         "optimizer state's local shards, read without FSDP2's state-dict hooks")
    ap.add_argument("--steps", type=int, default=100, help="train until this many steps are committed")
    ap.add_argument("--step-sleep", type=float, default=0.0,
                    help="seconds slept at the start of every step (simulated data loading)")
    ap.add_argument("--output", type=Path, help="rank r writes a JSON summary to NAME.rank<r>.SUFFIX at the end")
    ap.add_argument("--min-replica-size", type=int, default=1,
                    help="fewest replica groups a step may commit with (Manager(min_replica_size=...))")
    ap.add_argument("--min-final-participants", type=int, default=0,
                    help="after --steps, go on until a committed step had this many replica groups")
    ap.add_argument("--nproc-per-group", type=int, default=2, help="ranks (FSDP shards) per replica group")
    ap.add_argument("--max-restarts", type=int, default=0,
                    help="start the whole replica group again this many times when one of its ranks fails")
    ap.add_argument("--ready-file", type=Path,
                    help="rank 0 creates this file once every rank of the group is set up (for scripts that "
                         "start several groups: see --go-file)")
    ap.add_argument("--go-file", type=Path,
                    help="every rank waits (up to 10 minutes) for this file before its first step, so that groups "
                         "started together are all in the first quorum")
    ap.add_argument("--stop-file", type=Path,
                    help="go on past --steps until this file exists (for scripts that decide when the run ends)")
    ap.add_argument("--batch-size", type=int, default=16, help="samples per rank and step")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                    help="the SDK's log level (stderr)")
    faults = ap.add_argument_group("fault injection (tests and demonstrations)")
    faults.add_argument("--fail-recovery-on-rank", type=int, metavar="R",
                        help="group rank R's first checkpoint fetch fails: its group keeps its step and weights on "
                             "every rank and heals at a later quorum")
    faults.add_argument("--skip-commit-every", type=int, default=0, metavar="N",
                        help="every N-th step in which another replica group is up to date, this group votes "
                             "against committing (report_error): it falls one step behind and heals from a peer "
                             "at the next quorum (not in the last 2N steps before the run may end, so that the "
                             "groups end together)")
    return ap.parse_args(argv)


def check_lighthouse(sdk: str, value: str) -> str | None:
    """Why TORCHFT_LIGHTHOUSE cannot work with ``sdk``, or None: torchft's client connects to
    exactly one URL (a list makes it wait out its connect timeout, then fail)."""
    urls = [u.strip() for u in value.split(",") if u.strip()]
    if sdk == "torchft" and len(urls) > 1:
        return (f"torchft takes exactly one lighthouse URL, but TORCHFT_LIGHTHOUSE lists {len(urls)} ({value}): "
                f"set it to one node's URL (e.g. {urls[0]}) or run with --sdk ftclient")
    return None


def say(line: str) -> None:
    """One line to stdout in one write: the ranks of a replica group share the stream."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def batch(seed: int, group: int, rank: int, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic classification batch (labels from a fixed random teacher), different for every
    (group, rank, step): no download, reproducible."""
    teacher = torch.randn(IN, CLASSES, generator=torch.Generator().manual_seed(seed + 12345))
    g = torch.Generator().manual_seed(seed * 1_000_003 + group * 10_007 + rank * 101 + step)
    x = torch.randn(size, IN, generator=g)
    return x, (x @ teacher).argmax(dim=1)


# -- the SDK, and what its Manager reads ---------------------------------------------------------------


def load_sdk(sdk: str) -> tuple[Any, type]:
    """The module with Manager, ProcessGroupGloo and Optimizer, and its ManagedProcessGroup:
    ftclient's, or torchft's own (same constructors, same training loop)."""
    if sdk == "torchft":
        import torchft
        from torchft.process_group import ManagedProcessGroup as TorchftManagedProcessGroup

        return torchft, TorchftManagedProcessGroup
    return ftclient, ManagedProcessGroup


def quorum_view(sdk: str, manager: Any, step_before: int, step_mid: int) -> tuple[int, bool, int]:
    """(quorum id, whether this group heals from a peer in this step, the step it heals to);
    ``step_mid`` is the manager's step once the step's quorum (and any heal) is done."""
    if sdk == "torchft":
        # torchft 0.2.0 has no public accessor for the quorum (the id is for display only). A group
        # that heals takes no part in its step.
        return getattr(manager, "_quorum_id", -1), not manager.is_participating(), step_mid
    quorum = manager.last_quorum_result
    healed = bool(quorum and quorum.heal)
    return (quorum.quorum_id if quorum else -1), healed, (quorum.max_step if healed else step_before)


def failing_first_recovery(sdk: str, timeout: timedelta, tag: str) -> Any:
    """The SDK's HTTP checkpoint transport, whose first ``recv_checkpoint`` fails (fault injection)."""
    if sdk == "torchft":
        from torchft.checkpointing import HTTPTransport as Base
    else:
        Base = ftclient.HTTPTransport

    class FailFirstRecovery(Base):  # type: ignore[misc, valid-type]
        failed = False

        def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
            if not self.failed:
                self.failed = True
                say(f"{tag} injected: the checkpoint fetch of step {step} fails")
                raise RuntimeError(f"injected failure of the checkpoint fetch of step {step}")
            return super().recv_checkpoint(src_rank, metadata, step, timeout)

    return FailFirstRecovery(timeout=timeout, num_chunks=0)


class ComputeTracker:
    """Whether a forward or backward pass is running in this process (from the model's forward
    pre-hook until ``backward()`` returns), and the state-dict reads made meanwhile: FSDP2's
    state-dict hook reshards the parameters, which a running forward or backward cannot survive."""

    def __init__(self, model: nn.Module, tag: str) -> None:
        self.tag = tag
        self.phase: str | None = None  # "forward" / "backward" while one runs
        self.reads = 0
        self.reads_during_compute = 0
        self._lock = threading.Lock()
        model.register_forward_pre_hook(lambda module, args: self.enter("forward"))

    def enter(self, phase: str) -> None:
        self.phase = phase

    def leave(self) -> None:
        self.phase = None

    def record_read(self) -> None:
        phase = self.phase
        with self._lock:
            self.reads += 1
            if phase is not None:
                self.reads_during_compute += 1
        if phase is not None:
            say(f"{self.tag} state_dict read during {phase} on thread {threading.current_thread().name}")


# -- DTensor state dicts: local shards on the wire ---------------------------------------------------


def local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


def local_tree(value: Any) -> Any:
    """``value`` with every DTensor replaced by its local shard (sharing its storage)."""
    if isinstance(value, dict):
        return {k: local_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(local_tree(v) for v in value)
    return local(value)


def optimizer_state_to_dtensors(optim: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict of local shards (from a peer's rank with the same sharding) with
    each per-parameter tensor made a DTensor like its parameter again."""
    params = [p for group in optim.param_groups for p in group["params"]]
    state = {}
    for index, entries in state_dict["state"].items():
        p = params[int(index)]
        state[index] = {
            k: (DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
                if isinstance(p, DTensor) and torch.is_tensor(v) and v.dim() > 0 else v)
            for k, v in entries.items()}
    return {"state": state, "param_groups": state_dict["param_groups"]}


def full_digests(model: nn.Module, optim: torch.optim.Optimizer) -> tuple[str, str]:
    """sha256 of the full (unsharded) parameters, and of the full optimizer state (a collective
    within the replica group: every rank calls it)."""

    def full(v: Any) -> Any:
        return v.full_tensor() if isinstance(v, DTensor) else v

    def digest(items: list[tuple[str, Any]]) -> str:
        h = hashlib.sha256()
        for name, v in items:
            h.update(name.encode())
            h.update(v.detach().contiguous().numpy().tobytes() if torch.is_tensor(v) else repr(v).encode())
        return h.hexdigest()

    state = optim.state_dict()["state"]
    return (digest([(k, full(v)) for k, v in model.state_dict().items()]),
            digest([(f"{i}.{k}", full(state[i][k])) for i in sorted(state) for k in sorted(state[i])]))


# -- one rank ------------------------------------------------------------------------------------------


def env_seconds(name: str, default: float) -> timedelta:
    value = os.environ.get(name)
    return timedelta(seconds=float(value) if value else default)


def train(args: argparse.Namespace, rank: int, world_size: int, store_addr: str, store_port: int) -> int:
    group = int(os.environ.get("REPLICA_GROUP_ID", 0))
    tag = f"group={group} rank={rank}"
    sdk, managed_process_group = load_sdk(args.sdk)
    torch.manual_seed(args.seed)  # every replica group starts from the same weights
    torch.set_num_threads(1)
    timeout = env_seconds("TORCHFT_TIMEOUT_SEC", 30)

    # The replica group's TCPStore: rank 0 hosts it when this script started the ranks (torchrun's
    # agent hosts its own). The group's own process group (FSDP2 shards over it) uses it too.
    # run_group hands rank 0 the store's socket, bound before any rank started: a port only
    # chosen there (bind, close, pass the number) could be taken meanwhile by another process's
    # outgoing connection, and the store then failed with EADDRINUSE. The store owns the fd (it
    # closes it); the launcher's socket object in this forked copy is never closed (os._exit).
    listen_fd = os.environ.get("TRAIN_HSDP_STORE_FD") if rank == 0 else None
    host_store = listen_fd is not None
    store = dist.TCPStore(store_addr, store_port, is_master=host_store, wait_for_workers=False, timeout=timeout,
                          master_listen_fd=int(listen_fd) if host_store else None)
    dist.init_process_group("gloo", store=dist.PrefixStore("train_hsdp/world", store), rank=rank,
                            world_size=world_size, timeout=timeout)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))

    model = Net()
    for layer in model.layers:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False)
    tracker = ComputeTracker(model, tag)

    if args.state_dict == "module":
        # torchtitan's: FSDP2's state-dict hook reshards the module first (a no-op between steps).
        # The Manager must call this between steps only: ftclient does (just before the forward
        # pass), torchft 0.2.0 calls it on its quorum thread while the forward or backward runs.
        def state_dict() -> dict[str, Any]:
            tracker.record_read()
            return {"model": model.state_dict(), "optim": inner.state_dict()}

        def load_state_dict(sd: dict[str, Any]) -> None:  # in should_commit, between backward and step
            model.load_state_dict(sd["model"])
            inner.load_state_dict(sd["optim"])
    else:
        # The sharded parameters (DTensors), taken once: FSDP2 keeps these objects (the optimizer
        # steps them) while it swaps the module's parameters for unsharded ones during forward and
        # backward. Reading their local tensors needs none of FSDP2's hooks, so it is harmless even
        # on a thread that runs during the forward pass (torchft's quorum thread).
        shards = dict(model.named_parameters())

        def state_dict() -> dict[str, Any]:
            tracker.record_read()
            with torch.no_grad():
                return {"model": {name: local(p) for name, p in shards.items()},
                        "optim": local_tree(inner.state_dict())}

        def load_state_dict(sd: dict[str, Any]) -> None:  # in should_commit, between backward and step
            with torch.no_grad():
                for name, p in shards.items():
                    local(p).copy_(sd["model"][name])
            inner.load_state_dict(optimizer_state_to_dtensors(inner, sd["optim"]))

    transport = (failing_first_recovery(args.sdk, timeout, tag) if args.fail_recovery_on_rank == rank else None)
    manager = sdk.Manager(
        pg=sdk.ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict, state_dict=state_dict,
        min_replica_size=args.min_replica_size, replica_id=f"train_hsdp_{group}",
        store_addr=store_addr, store_port=store_port, rank=rank, world_size=world_size, timeout=timeout,
        quorum_timeout=env_seconds("TORCHFT_QUORUM_TIMEOUT_SEC", 60),
        connect_timeout=env_seconds("TORCHFT_CONNECT_TIMEOUT_SEC", 60),
        checkpoint_transport=transport,
    )
    # torchtitan's fault-tolerant HSDP: the replicate dimension is the Manager's group.
    replicate_pg = managed_process_group(manager)
    replicate_pg.register("dp_replicate")

    def all_reduce_hook(output: torch.Tensor) -> None:
        dist.all_reduce(output, group=replicate_pg, op=ReduceOp.AVG)

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_all_reduce_hook(all_reduce_hook)
    optimizer = sdk.Optimizer(manager, inner)
    criterion = nn.CrossEntropyLoss()
    say(f"{tag} pid={os.getpid()} attempt={os.environ.get('TRAIN_HSDP_ATTEMPT', '0')} world_size={world_size} "
        f"sdk={args.sdk} state_dict={args.state_dict} lighthouse={os.environ.get('TORCHFT_LIGHTHOUSE', '')}")
    skipped_at: int | None = None  # the step whose commit was last skipped (--skip-commit-every)

    records: list[dict[str, Any]] = []
    try:
        if args.ready_file is not None or args.go_file is not None:
            dist.barrier()  # every rank of the group is set up
            if args.ready_file is not None and rank == 0:
                args.ready_file.touch()
            wait_for_file(args.go_file)
        while True:
            t0 = time.time()
            if args.step_sleep:
                time.sleep(args.step_sleep)
            step_before = manager.current_step()
            optimizer.zero_grad()  # starts this step's quorum (in the background)
            x, y = batch(args.seed, group, rank, step_before, args.batch_size)
            loss = criterion(model(x), y)  # the forward pre-hook marks the forward pass
            tracker.enter("backward")
            loss.backward()  # FSDP2 reduce-scatters in the group; the hook averages across groups
            tracker.leave()
            # The loss over every rank of every participating group, and the samples behind it.
            group_loss = funcol.all_reduce(loss.detach(), "avg", dist.group.WORLD)
            job_loss = funcol.all_reduce(group_loss, "avg", replicate_pg)
            samples = funcol.all_reduce(torch.tensor([float(len(x) * world_size)]), "sum", replicate_pg)
            manager.wait_quorum()
            quorum_id, healed, healed_to = quorum_view(args.sdk, manager, step_before, manager.current_step())
            if (args.skip_commit_every and not healed and step_before != skipped_at
                    and step_before % args.skip_commit_every == args.skip_commit_every - 1
                    and not finishing(args, step_before + 2 * args.skip_commit_every)
                    and manager.num_participants() >= 2):
                skipped_at = step_before
                say(f"{tag} injected: skipping the commit of step {step_before}")
                manager.report_error(RuntimeError(f"injected: skipping the commit of step {step_before}"))
            optimizer.step()  # steps iff every replica group in the quorum may commit
            step = manager.current_step()
            committed = step == healed_to + 1
            err = manager.errored()
            rec = {"step_before": step_before, "step": step, "loss": round(float(job_loss.item()), 6),
                   "samples": int(samples.item()), "quorum_id": quorum_id,
                   "participants": manager.num_participants(), "committed": committed, "healed": healed,
                   "errored": None if err is None else str(err.original_exception)[:300],
                   "t_start": t0, "t_end": time.time()}
            rec["duration_s"] = round(rec["t_end"] - t0, 4)
            records.append(rec)
            say(f"{tag} step={step} loss={rec['loss']:.4f} quorum_id={rec['quorum_id']} "
                f"participants={rec['participants']} committed={committed} samples={rec['samples']}"
                + (f" healed_to={healed_to}" if healed else "") + f" time={rec['duration_s']:.3f}s")
            if committed and finishing(args, step) and rec["participants"] >= args.min_final_participants:
                break
        finish(args, tag, rank, world_size, group, model, inner, manager, records, tracker)
    finally:
        manager.shutdown(wait=False)
    # The store's host (rank 0) leaves last: the others' managers use the store until they are shut down.
    done = store.add("train_hsdp/done", 1)
    deadline = time.monotonic() + 10
    while host_store and done < world_size and time.monotonic() < deadline:
        time.sleep(0.02)
        done = store.add("train_hsdp/done", 0)
    return 0


def finishing(args: argparse.Namespace, step: int) -> bool:
    """Whether the run may end at ``step`` (--steps reached, and --stop-file there if given)."""
    return step >= args.steps and (args.stop_file is None or args.stop_file.exists())


def wait_for_file(path: Path | None, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while path is not None and not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s:.0f}s")
        time.sleep(0.02)


def finish(args: argparse.Namespace, tag: str, rank: int, world_size: int, group: int, model: nn.Module,
           inner: torch.optim.Optimizer, manager: Any, records: list[dict[str, Any]], tracker: ComputeTracker) -> None:
    params, optim_state = full_digests(model, inner)
    say(f"{tag} final step={manager.current_step()} params_sha256={params} optim_sha256={optim_state} "
        f"state_dict_reads={tracker.reads} during_compute={tracker.reads_during_compute}")
    if args.output is not None:
        summary = {"sdk": args.sdk, "replica_group": group, "rank": rank, "world_size": world_size,
                   "pid": os.getpid(), "attempt": int(os.environ.get("TRAIN_HSDP_ATTEMPT", "0")),
                   "final_step": manager.current_step(), "params_sha256": params, "optim_sha256": optim_state,
                   "batches_committed": manager.batches_committed(), "state_dict_reads": tracker.reads,
                   "state_dict_reads_during_compute": tracker.reads_during_compute, "steps": records}
        path = args.output.with_name(f"{args.output.stem}.rank{rank}{args.output.suffix}")
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(summary, indent=1))
        tmp.replace(path)


# -- the replica group: its store and its ranks ----------------------------------------------------------


def store_socket() -> socket.socket:
    """A socket bound to a free port on every interface, for the group's TCPStore (rank 0 listens
    on it: ``master_listen_fd``). The port stays held from here on, so no other process can take
    it before the store starts; its fd survives the fork into rank 0."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("", 0))
    return sock


def start_rank(args: argparse.Namespace, rank: int, env: dict[str, str]) -> int:
    """Fork one rank of the group (this process has imported torch and ftclient already, and runs
    no thread yet: a rank, and a restart, start in a second, not after an import of torch each).
    Returns its pid; the rank exits with train()'s status."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.update(env)
        code = train(args, rank, int(env["WORLD_SIZE"]), env["MASTER_ADDR"], int(env["MASTER_PORT"]))
    except BaseException as e:  # noqa: BLE001 -- reported, and the rank's status says it failed
        traceback.print_exc()
        print(f"train_hsdp: error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_group(args: argparse.Namespace) -> int:
    """Run the replica group's ranks (rank 0 hosts the group's TCPStore on a free port); when one
    fails, end the others and start them all again (a fresh store each time) while restarts
    remain."""
    group = int(os.environ.get("REPLICA_GROUP_ID", 0))
    host = socket.gethostname()
    running: dict[int, int] = {}  # pid -> rank

    def reap(block: bool) -> list[int]:
        """Exit statuses of the ranks that ended (waiting for one if ``block``)."""
        codes = []
        for pid in list(running):
            done, status = os.waitpid(pid, 0 if block else os.WNOHANG)
            if done:
                del running[pid]
                codes.append(os.waitstatus_to_exitcode(status))
        return codes

    def stop_all() -> None:
        for pid in running:
            try:
                os.kill(pid, signal.SIGKILL)  # a rank may be stuck in a collective with the dead one
            except ProcessLookupError:
                pass
        reap(block=True)

    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    failed: list[int] = []
    try:
        for attempt in range(args.max_restarts + 1):
            with store_socket() as sock:  # a fresh store each attempt; the parent's copy closes after it
                for rank in range(args.nproc_per_group):
                    env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(args.nproc_per_group),
                           "LOCAL_WORLD_SIZE": str(args.nproc_per_group), "MASTER_ADDR": host,
                           "MASTER_PORT": str(sock.getsockname()[1]), "TRAIN_HSDP_ATTEMPT": str(attempt)}
                    if rank == 0:
                        env["TRAIN_HSDP_STORE_FD"] = str(sock.fileno())
                    running[start_rank(args, rank, env)] = rank
                failed = []
                while running and not failed:
                    failed = [c for c in reap(block=False) if c != 0]
                    time.sleep(0.05)
            if not failed:
                return 0
            stop_all()
            if attempt < args.max_restarts:
                say(f"group={group} a rank exited with {failed[0]}: restarting the replica group "
                    f"(restart {attempt + 1} of {args.max_restarts})")
        return failed[0]
    finally:
        stop_all()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    logging.getLogger(args.sdk).setLevel(args.log_level.upper())
    if (problem := check_lighthouse(args.sdk, os.environ.get("TORCHFT_LIGHTHOUSE", ""))) is not None:
        print(f"train_hsdp: error: {problem}", file=sys.stderr, flush=True)
        return 2
    env = os.environ
    if "RANK" in env and "MASTER_PORT" in env:  # torchrun, or a rank started by run_group
        return train(args, int(env["RANK"]), int(env.get("WORLD_SIZE", 1)), env.get("MASTER_ADDR", "localhost"),
                     int(env["MASTER_PORT"]))
    return run_group(args)


if __name__ == "__main__":
    try:
        code = main()
    except KeyboardInterrupt:
        code = 130
    except Exception as e:  # noqa: BLE001 -- one clear line after the traceback, then exit 1
        import traceback

        traceback.print_exc()
        print(f"train_hsdp: error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without joining background threads (heartbeats, checkpoint server, gRPC).
    os._exit(code)
