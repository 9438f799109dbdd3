"""ftclient.LocalSGD and ftclient.DiLoCo on FSDP2-sharded (DTensor) parameters (issue #16 item 4).

Two real processes are the two ranks of one replica group: Gloo on CPU, the model sharded with
``torch.distributed.fsdp.fully_shard`` (every parameter a DTensor, ``Shard(0)``; one fragment of
5 rows splits 3 + 2, one of a single row leaves rank 1 an empty shard). The Manager is a stand-in
for the cross-group average: one other replica group whose every value is ``PEER``, so each
allreduce is ``(t + PEER) / 2`` on what it is given. Each rank also runs the same schedule on an
unsharded copy of the model (the plain-tensor path, checked with exact values in
test_ftclient_local_sgd.py); the sharded run must match it exactly.

Covered: LocalSGD averages the local shards (allreduce sizes are the shards', empty shards send
nothing) and writes the average into them, parameters stay DTensors; DiLoCo (2 fragments,
``fragment_sync_delay=1``, ``fragment_update_alpha=0.5``, bucketized, Nesterov outer optimizer
whose momentum buffers are DTensors) with a failed commit in the middle matches the reference
parameters, global backups (local shards) and momentum, with the first round checked by hand; a
new sharded DiLoCo heals from the registered state, which holds no DTensor (it travels as local
shards through ``torch.save``), and then trains in lockstep with the one it healed from; tensor
subclasses other than DTensor are still rejected.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

PEER = 1.5  # every value of the other (simulated) replica group
LR = 0.5  # inner SGD; every gradient is C, so one inner step moves every value by -LR * C
C = 1.0
WORLD = 2
WORKER_TIMEOUT_S = 240


# -- the worker (each rank of the replica group runs this file as a script) -------------------------


def _worker(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    from ftclient.local_sgd import DiLoCo, LocalSGD

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)

    class Frag(nn.Module):
        def __init__(self, rows: int, cols: int, offset: float) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.arange(rows * cols, dtype=torch.float32).view(rows, cols) + offset)
            self.b = nn.Parameter(torch.arange(rows, dtype=torch.float32) - offset)

        def forward(self, c: torch.Tensor) -> torch.Tensor:
            return (self.w * c).sum() + (self.b * c).sum()

    class Model(nn.Module):
        def __init__(self, offset: float = 0.0) -> None:
            super().__init__()
            self.f0 = Frag(5, 3, 0.0 + offset)  # 5 rows: local shards of 3 and 2 rows
            self.f1 = Frag(1, 4, 100.0 + offset)  # 1 row: rank 1's shards are empty

        def forward(self, c: torch.Tensor) -> torch.Tensor:
            return self.f0(c) + self.f1(c)

    def sharded(offset: float = 0.0) -> Model:
        m = Model(offset)
        fully_shard(m.f0)
        fully_shard(m.f1)
        fully_shard(m)
        return m

    class Done(dist.Work):
        def __init__(self, t: torch.Tensor) -> None:
            super().__init__()
            self._fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            self._fut.set_result(t)

        def wait(self, timeout: Any = None) -> bool:
            return True

        def get_future(self) -> torch.futures.Future[torch.Tensor]:
            return self._fut

    class PeerManager:
        """The part of ftclient.Manager that LocalSGD/DiLoCo use; see the module docstring."""

        _use_async_quorum = False

        def __init__(self, commits: list[bool] | None = None) -> None:
            self.commits = list(commits or [])
            self.step = 0
            self.sizes: list[int] = []
            self.load_fns: dict[str, Any] = {}
            self.save_fns: dict[str, Any] = {}

        def start_quorum(self) -> None:
            pass

        def allreduce(self, t: torch.Tensor, should_quantize: bool = False) -> Done:
            assert type(t) is torch.Tensor, f"allreduce got a {type(t).__name__}"
            self.sizes.append(t.numel())
            t.add_(PEER).div_(2)
            return Done(t)

        def should_commit(self) -> bool:
            ok = self.commits.pop(0) if self.commits else True
            self.step += int(ok)
            return ok

        def current_step(self) -> int:
            return self.step

        def report_error(self, e: Exception) -> None:
            raise AssertionError(f"unexpected error reported: {e}")

        def num_participants(self) -> int:
            return 2

        def register_state_dict_fn(self, key: str, load: Any, save: Any) -> None:
            self.load_fns[key], self.save_fns[key] = load, save

        def allow_state_dict_read(self) -> None:
            pass

        def disallow_state_dict_read(self) -> None:
            pass

    c = torch.tensor(C)

    def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
        for _ in range(steps):
            opt.zero_grad()
            model(c).backward()
            opt.step()

    def full(model: nn.Module) -> dict[str, Any]:
        out = {}
        for name, p in model.named_parameters():
            out[name] = (p.full_tensor() if isinstance(p, DTensor) else p.detach()).tolist()
        return out

    def kinds(model: nn.Module) -> list[str]:
        return sorted({f"{type(p).__name__}:{getattr(p, 'placements', None)}" for p in model.parameters()})

    result: dict[str, Any] = {"rank": rank}

    # LocalSGD: 4 inner steps, a sync every 2.
    models = {"sharded": sharded(), "plain": Model()}
    for kind, model in models.items():
        manager = PeerManager()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        with LocalSGD(manager, model, opt, sync_every=2) as local_sgd:
            train(model, opt, 4)
        assert local_sgd.syncs == 2
        result[f"localsgd_{kind}"] = {"params": full(model), "sizes": manager.sizes, "kinds": kinds(model)}

    # DiLoCo: 2 fragments, rounds of 2 steps, 4 rounds, the second one's commit fails.
    def diloco(model: Model, manager: PeerManager) -> tuple[DiLoCo, torch.optim.Optimizer]:
        inner = torch.optim.SGD(model.parameters(), lr=LR)
        outers = [torch.optim.SGD(f.parameters(), lr=1.0, momentum=0.5, nesterov=True) for f in (model.f0, model.f1)]
        return DiLoCo(manager, [model.f0, model.f1], inner, outers, sync_every=4, fragment_sync_delay=1,
                      fragment_update_alpha=0.5, use_bucketization=True, bucket_cap_mb=24 / 2**20), inner

    def backups(d: DiLoCo) -> dict[str, Any]:
        return {name: t.tolist() for name, t in d.global_parameters()}

    def momentum(d: DiLoCo) -> dict[str, Any]:
        out = {}
        for i, outer in enumerate(d.outer_optimizers()):
            for j, p in enumerate(outer.param_groups[0]["params"]):
                buf = outer.state[p]["momentum_buffer"]
                out[f"{i}.{j}"] = {"kind": type(buf).__name__,
                                   "value": (buf.full_tensor() if isinstance(buf, DTensor) else buf).tolist()}
        return out

    runs: dict[str, Any] = {}
    for kind, model in {"sharded": sharded(), "plain": Model()}.items():
        manager = PeerManager(commits=[True, False, True, True])
        d, inner = diloco(model, manager)
        with d:
            train(model, inner, 2)
            first = {"params": full(model), "backups": backups(d)}
            train(model, inner, 6)
        assert d.syncs == 4 and manager.step == 3
        result[f"diloco_{kind}"] = {"first_round": first, "params": full(model), "backups": backups(d),
                                    "momentum": momentum(d), "sizes": list(manager.sizes), "kinds": kinds(model)}
        runs[kind] = (model, manager, d, inner)

    # Healing: a new sharded group (other weights) loads the registered state of the sharded run
    # through torch.save / torch.load, as the checkpoint transport moves it.
    model, manager, d, inner = runs["sharded"]
    state = {k: fn() for k, fn in manager.save_fns.items()}
    dtensors: list[str] = []

    def find(obj: Any, path: str) -> None:
        if isinstance(obj, DTensor):
            dtensors.append(path)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                find(v, f"{path}/{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                find(v, f"{path}/{i}")

    find(state, "")
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    received = torch.load(buf, weights_only=True)
    new_model = sharded(offset=1000.0)
    new_manager = PeerManager()
    new_d, new_inner = diloco(new_model, new_manager)
    for key, load in new_manager.load_fns.items():
        load(received[key])
    new_manager.step = manager.step
    healed = {"params": full(new_model), "backups": backups(new_d), "momentum": momentum(new_d)}
    for m_, i_, d_ in ((model, inner, d), (new_model, new_inner, new_d)):
        with d_:
            train(m_, i_, 4)  # two more rounds
    result["heal"] = {"dtensors_in_state": dtensors, "healed": healed,
                      "after_old": {"params": full(model), "backups": backups(d), "momentum": momentum(d)},
                      "after_new": {"params": full(new_model), "backups": backups(new_d),
                                    "momentum": momentum(new_d)}}

    dist.barrier()
    dist.destroy_process_group()
    Path(out).write_text(json.dumps(result))


# -- the tests --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("fsdp2")
    store = tmp / "store"
    outs = [tmp / f"rank{r}.json" for r in range(WORLD)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(store), str(outs[r])], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(WORLD)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=WORKER_TIMEOUT_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{log[-4000:]}"
    return [json.loads(o.read_text()) for o in outs]


def cat_shards(per_rank: list[Any]) -> list[Any]:
    """The full tensor from each rank's local shard (dim-0 chunks, as FSDP2 shards)."""
    return [row for shard in per_rank for row in (shard if isinstance(shard, list) else [shard])]


W0 = torch.arange(15, dtype=torch.float32).view(5, 3)


@pytest.mark.integration
def test_local_sgd_averages_the_local_shards_and_writes_them_back(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        sharded, plain = r["localsgd_sharded"], r["localsgd_plain"]
        assert sharded["params"] == plain["params"]
        assert sharded["kinds"] == ["DTensor:(Shard(dim=0),)"] and plain["kinds"] == ["Parameter:None"]
    # By hand: 2 steps (-2 * LR * C = -1), average with PEER, twice.
    once = (W0 - 1 + PEER) / 2
    assert ranks[0]["localsgd_sharded"]["params"]["f0.w"] == ((once - 1 + PEER) / 2).tolist()
    # Each rank sent its local shards: w 3x3 / 2x3, b 3 / 2, f1 only on rank 0 (4 + 1 values).
    assert ranks[0]["localsgd_sharded"]["sizes"] == [9, 3, 4, 1] * 2
    assert ranks[1]["localsgd_sharded"]["sizes"] == [6, 2] * 2
    assert ranks[0]["localsgd_plain"]["sizes"] == [15, 5, 4, 1] * 2


@pytest.mark.integration
def test_diloco_on_shards_matches_the_plain_run_and_the_hand_computed_first_round(
        ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        sharded, plain = r["diloco_sharded"], r["diloco_plain"]
        assert sharded["kinds"] == ["DTensor:(Shard(dim=0),)"]
        assert sharded["first_round"]["params"] == plain["first_round"]["params"]
        assert sharded["params"] == plain["params"]
        assert {k: v["value"] for k, v in sharded["momentum"].items()} == \
            {k: v["value"] for k, v in plain["momentum"].items()}
        assert {v["kind"] for v in sharded["momentum"].values()} == {"DTensor"}
    # The global backups are local shards: rank 0's rows then rank 1's are the plain backup.
    plain_backups = ranks[0]["diloco_plain"]["backups"]
    for name, full in plain_backups.items():
        assert cat_shards([r["diloco_sharded"]["backups"][name] for r in ranks]) == full, name
    # Round 1 by hand, fragment 0: pseudo-gradient LR * C (1 step before the delay) averaged with
    # PEER -> 1.0; Nesterov (momentum 0.5, lr 1): global - 1.5; alpha 0.5 with the local (-1.0).
    first = ranks[0]["diloco_sharded"]["first_round"]
    assert cat_shards([r["diloco_sharded"]["first_round"]["backups"]["0.w"] for r in ranks]) == (W0 - 1.5).tolist()
    assert first["params"]["f0.w"] == (W0 - 1.25).tolist()
    assert first["params"]["f1.w"] == (torch.arange(4.0).view(1, 4) + 100 - 2 * LR * C).tolist()  # still training
    # Bucketized on local shards (cap 24 bytes = 6 floats), fragments 0, 1, 1 (the retry after
    # the failed commit), 0: f0's w and b in buckets of their own, f1's in one; rank 1 never
    # sends fragment 1 (its shards are empty).
    assert ranks[0]["diloco_sharded"]["sizes"] == [9, 3, 5, 5, 9, 3]
    assert ranks[1]["diloco_sharded"]["sizes"] == [6, 2, 6, 2]


@pytest.mark.integration
def test_a_sharded_group_heals_from_local_shards_and_trains_in_lockstep(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        heal = r["heal"]
        assert heal["dtensors_in_state"] == [], "the registered state must travel as local shards"
        sharded = r["diloco_sharded"]
        assert heal["healed"]["params"] == sharded["params"]
        assert heal["healed"]["backups"] == sharded["backups"]
        assert heal["healed"]["momentum"] == sharded["momentum"]
        assert heal["after_new"] == heal["after_old"]
        assert heal["after_old"]["params"] != sharded["params"]  # the two rounds did train


class _OddTensor(torch.Tensor):
    """A tensor subclass that is not a DTensor."""


def test_other_tensor_subclasses_are_still_rejected() -> None:
    from torch import nn

    from ftclient.local_sgd import LocalSGD

    model = nn.Linear(2, 2)
    model.weight = nn.Parameter(torch.ones(2, 2).as_subclass(_OddTensor))
    assert type(model.weight) is _OddTensor
    with pytest.raises(TypeError, match="plain tensors and DTensors"):
        LocalSGD(object(), model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=1)  # type: ignore[arg-type]


if __name__ == "__main__":
    _worker(int(sys.argv[1]), sys.argv[2], sys.argv[3])
