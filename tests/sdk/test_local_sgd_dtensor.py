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

And the HSDP set-up with real Managers (4 processes: 2 replica groups x 2 FSDP2 ranks, torchft's
lighthouse, Gloo across groups, HTTP checkpoints): DiLoCo with a group that joins late, heals its
local shards from the other group's and then averages with it; every global value is checked
against the hand-computed one.
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
from torch import nn

PEER = 1.5  # every value of the other (simulated) replica group
LR = 0.5  # inner SGD; every gradient is C, so one inner step moves every value by -LR * C
C = 1.0
WORLD = 2
WORKER_TIMEOUT_S = 240


# -- the model: every gradient is the input c ---------------------------------------------------------


class _Frag(nn.Module):
    def __init__(self, rows: int, cols: int, offset: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.arange(rows * cols, dtype=torch.float32).view(rows, cols) + offset)
        self.b = nn.Parameter(torch.arange(rows, dtype=torch.float32) - offset)

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.w * c).sum() + (self.b * c).sum()


class _Model(nn.Module):
    def __init__(self, offset: float = 0.0) -> None:
        super().__init__()
        self.f0 = _Frag(5, 3, 0.0 + offset)  # 5 rows: local shards of 3 and 2 rows
        self.f1 = _Frag(1, 4, 100.0 + offset)  # 1 row: rank 1's shards are empty

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return self.f0(c) + self.f1(c)


def _sharded(offset: float = 0.0) -> _Model:
    """The model, FSDP2-sharded over the default process group (each fragment, then the root)."""
    from torch.distributed.fsdp import fully_shard

    m = _Model(offset)
    fully_shard(m.f0)
    fully_shard(m.f1)
    fully_shard(m)
    return m


# -- the worker (each rank of the replica group runs this file as a script) -------------------------


def _worker(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from ftclient.local_sgd import DiLoCo, LocalSGD

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)

    Model, sharded = _Model, _sharded
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


# -- HSDP with real Managers: 2 replica groups x 2 FSDP ranks ------------------------------------------

HSDP_C = (1.0, 3.0)  # each replica group's gradient: round pseudo-gradients 2 * LR * c = 1.0 and 3.0
HSDP_TARGET = 8  # committed rounds
HSDP_JOIN_AT = 2  # group 0 trains this many rounds alone; group 1 then joins and heals
HSDP_WAIT_S = 180.0


def _wait_file(path: Path, what: str) -> None:
    import time

    deadline = time.monotonic() + HSDP_WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: {path} not there after {HSDP_WAIT_S:g}s")
        time.sleep(0.05)


def _hsdp_worker(group: int, rank: int, port: int, lighthouse: str, out_dir: str) -> None:
    """One rank of one replica group: FSDP2 over the group's 2 ranks (Gloo), DiLoCo over a real
    ftclient Manager (real Gloo across the groups, HTTP checkpoint transport). Group 0 trains
    ``HSDP_JOIN_AT`` rounds alone, then lets group 1 (other weights) start its Manager; group 1
    heals from it at its first synchronisation. Both train until ``HSDP_TARGET`` rounds are
    committed."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from ftclient import DiLoCo, Manager, ProcessGroupGloo

    out = Path(out_dir)
    timeout = timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore("fsdp", store), rank=rank, world_size=WORLD)
    model = _sharded(offset=1000.0 * group)
    if group == 1:
        _wait_file(out / "start1", "group 0's go for group 1")
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None, min_replica_size=1,
                      use_async_quorum=False, timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
                      rank=rank, world_size=WORLD, store_addr="127.0.0.1", store_port=port,
                      lighthouse_addr=lighthouse, replica_id=f"hsdp_{group}", hostname="127.0.0.1")
    if group == 1:
        # Group 0 goes on once both ranks of group 1 are about to ask for their first quorum: a
        # Manager that merely exists has asked nothing, and group 0 (min_replicas 1, fast quorums
        # on its own) once finished every round before group 1's first request (CI). Group 1's
        # request then waits at the lighthouse (join timeout) until group 0's next one.
        start_quorum = manager.start_quorum

        def first_quorum_announced(*args: Any, **kwargs: Any) -> Any:
            (out / f"requesting{rank}").write_text("1")
            manager.start_quorum = start_quorum  # type: ignore[method-assign]
            return start_quorum(*args, **kwargs)

        manager.start_quorum = first_quorum_announced  # type: ignore[method-assign]
    inner = torch.optim.SGD(model.parameters(), lr=LR)
    outer = torch.optim.SGD(model.parameters(), lr=1.0)
    c = torch.tensor(HSDP_C[group])
    records: list[dict[str, Any]] = []
    with DiLoCo(manager, [model], inner, outer, sync_every=2, use_bucketization=True) as diloco:
        while manager.current_step() < HSDP_TARGET:
            inner.zero_grad()
            model(c).backward()
            inner.step()
            if diloco.syncs > len(records):
                s = diloco.last_sync
                assert s is not None
                records.append({"step": s.step, "committed": s.committed, "participants": s.participants,
                                "healed": s.healed, "quorum_id": s.quorum_id})
                if group == 0 and s.committed and s.step == HSDP_JOIN_AT:
                    if rank == 0:
                        (out / "start1").write_text("1")
                    for r in range(WORLD):
                        _wait_file(out / f"requesting{r}", f"group 1's rank {r} asking for its first quorum")
    result = {
        "records": records,
        "params": {n: p.full_tensor().tolist() for n, p in model.named_parameters()},
        "kinds": sorted({type(p).__name__ for p in model.parameters()}),
        "backups": {n: t.tolist() for n, t in diloco.global_parameters()},
        "step": manager.current_step(),
    }
    assert all(isinstance(p, DTensor) for p in model.parameters())
    (out / f"g{group}r{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    manager.shutdown()
    dist.destroy_process_group()


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


@pytest.mark.integration
def test_hsdp_diloco_with_real_managers_a_late_group_heals_its_shards(tmp_path: Path) -> None:
    """2 replica groups x 2 FSDP2 ranks, real ftclient Managers on torchft's lighthouse: group 0
    trains alone, group 1 (other weights) joins, heals its local shards over HTTP and then
    averages with group 0; every global value is the hand-computed one."""
    import torchft._torchft as lighthouse_mod
    from torch.distributed import TCPStore

    lighthouse = lighthouse_mod.LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=20000)
    stores = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(2)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = {(g, r): subprocess.Popen([sys.executable, __file__, "hsdp", str(g), str(r), str(stores[g].port),
                                       lighthouse.address(), str(tmp_path)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for g in range(2) for r in range(WORLD)}
    logs = {}
    try:
        for key, p in procs.items():
            logs[key] = p.communicate(timeout=WORKER_TIMEOUT_S)[0]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
        lighthouse.shutdown()
    for key, p in procs.items():
        assert p.returncode == 0, f"group {key[0]} rank {key[1]} exited with {p.returncode}:\n{logs[key][-4000:]}"
    res = {(g, r): json.loads((tmp_path / f"g{g}r{r}.json").read_text()) for g in range(2) for r in range(WORLD)}

    # Every rank of both groups ends on the same parameters and global backups, still DTensors.
    assert {json.dumps(v["params"]) for v in res.values()} == {json.dumps(res[0, 0]["params"])}
    for g in range(2):
        assert res[g, 0]["kinds"] == ["DTensor"] and res[g, 0]["step"] == HSDP_TARGET
        for name, full in res[0, 0]["backups"].items():
            assert cat_shards([res[g, r]["backups"][name] for r in range(WORLD)]) == cat_shards(
                [res[0, r]["backups"][name] for r in range(WORLD)]), (g, name)

    # Group 1 healed once, at its first synchronisation, and took part in that round.
    g0 = res[0, 0]["records"]
    g1 = res[1, 0]["records"]
    assert g1[0]["healed"] and g1[0]["committed"] and g1[0]["participants"] == 2
    assert not any(r["healed"] for r in g1[1:]) and not any(r["healed"] for r in g0)
    heal_step = g1[0]["step"]
    assert [r["step"] for r in g1] == list(range(heal_step, HSDP_TARGET + 1))
    # Group 0 committed every round: alone until group 1 joined, then with it.
    assert [r["step"] for r in g0] == list(range(1, HSDP_TARGET + 1)) and all(r["committed"] for r in g0)
    assert [r["participants"] for r in g0[:HSDP_JOIN_AT]] == [1] * HSDP_JOIN_AT
    assert all(r["participants"] == 2 for r in g0 if r["step"] >= heal_step)

    # By hand: each round moves every global value by the average pseudo-gradient: 1.0 alone or in
    # the healing round (group 1 holds group 0's weights then), (1.0 + 3.0) / 2 = 2.0 together.
    total = sum(1.0 if r["participants"] == 1 or r["step"] == heal_step else 2.0 for r in g0)
    params = res[0, 0]["params"]
    assert params["f0.w"] == (W0 - total).tolist()
    assert params["f0.b"] == (torch.arange(5.0) - total).tolist()
    assert params["f1.w"] == (torch.arange(4.0).view(1, 4) + 100 - total).tolist()
    assert cat_shards([res[0, r]["backups"]["0.f0.w"] for r in range(WORLD)]) == (W0 - total).tolist()


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
    if sys.argv[1] == "hsdp":
        _hsdp_worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6])
    else:
        _worker(int(sys.argv[1]), sys.argv[2], sys.argv[3])
