"""ftclient.LocalSGD and ftclient.DiLoCo: the math and the schedule, with fake managers.

A ``FakeManager`` stands in for ftclient.Manager: scripted commit decisions, an event log, and an
allreduce that either averages for real across several replica groups running in threads of this
process (``World``: a sum in rank order divided by the group count, so every group gets bitwise
the same result, as with Gloo) or applies a given function. Parameters are chosen so that every
expected value is exact in floating point.

Covered: LocalSGD averaging and keeping local parameters on a failed commit; DiLoCo's averaged
pseudo-gradients and outer step (with momentum, against a reference computation), alpha mixing,
restoring the global parameters and not stepping the outer optimizer on a failed commit (and
retrying the same fragment), the fragment schedule with ``fragment_sync_delay``, bucket boundaries
(and the packing case torchft 0.2.0 gets wrong), a shared outer optimizer leaving the other
fragments alone, the registered recovery state (round trip, snapshot semantics) and healing a
replica group from a peer in the middle of training.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from ftclient.local_sgd import DiLoCo, LocalSGD, SyncResult, plan_buckets

TIMEOUT_S = 20.0


# -- fakes ----------------------------------------------------------------------------------------


def completed(value: Any) -> torch.futures.Future[Any]:
    fut: torch.futures.Future[Any] = torch.futures.Future()
    fut.set_result(value)
    return fut


class World:
    """``n`` replica groups in threads of this process: collectives meet at a barrier."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.barrier = threading.Barrier(n, timeout=TIMEOUT_S)
        self.lock = threading.Lock()
        self.slots: dict[tuple[int, int], torch.Tensor] = {}
        self.seq = [0] * n

    def allreduce(self, rank: int, tensor: torch.Tensor) -> None:
        seq = self.seq[rank]
        self.seq[rank] += 1
        with self.lock:
            self.slots[(seq, rank)] = tensor.detach().clone()
        self.barrier.wait()
        total = torch.zeros_like(tensor)
        for r in range(self.n):  # the same order everywhere: bitwise-identical results
            total += self.slots[(seq, r)]
        self.barrier.wait()
        tensor.copy_(total / self.n)

    def meet(self) -> None:
        self.barrier.wait()


class FakeManager:
    """The part of ftclient.Manager that LocalSGD and DiLoCo use; see the module docstring."""

    _use_async_quorum = False

    def __init__(self, world: World | None = None, rank: int = 0, commits: list[bool] | None = None,
                 reduce: Callable[[torch.Tensor], None] | None = None) -> None:
        self.world, self.rank = world, rank
        self.commits = list(commits or [])
        self.reduce = reduce
        self.step = 0
        self.error: Exception | None = None
        self.events: list[tuple[Any, ...]] = []
        self.load_fns: dict[str, Callable[[Any], None]] = {}
        self.save_fns: dict[str, Callable[[], Any]] = {}
        self.read_allowed = True
        self.heal_from: FakeManager | None = None  # heal from this peer at the next quorum
        self.healed = False
        self.quorums = 0

    # quorum and healing
    def start_quorum(self) -> None:
        self.error = None
        self.quorums += 1
        self.healed = False
        self.events.append(("quorum",))
        if self.world is not None:
            self.world.meet()  # every group is at its quorum: nobody mutates state now
        if self.heal_from is not None:
            peer, self.heal_from = self.heal_from, None
            state = {k: fn() for k, fn in peer.save_fns.items()}
            for k, load in self.load_fns.items():
                load(state[k])
            self.step = peer.step
            self.healed = True
        if self.world is not None:
            self.world.meet()

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False) -> torch.futures.Future[torch.Tensor]:
        self.events.append(("allreduce", tensor.numel()))
        if self.error is None:
            if self.world is not None:
                self.world.allreduce(self.rank, tensor)
            elif self.reduce is not None:
                self.reduce(tensor)
        return completed(tensor)

    def should_commit(self) -> bool:
        decision = (self.commits.pop(0) if self.commits else True) and self.error is None
        if decision:
            self.step += 1
        self.events.append(("commit", decision))
        return decision

    def current_step(self) -> int:
        return self.step

    def report_error(self, e: Exception) -> None:
        self.error = e

    def errored(self) -> Exception | None:
        return self.error

    def num_participants(self) -> int:
        return self.world.n if self.world is not None else 1

    def register_state_dict_fn(self, key: str, load: Callable[[Any], None], save: Callable[[], Any]) -> None:
        assert key not in self.load_fns, key
        self.load_fns[key], self.save_fns[key] = load, save

    def allow_state_dict_read(self) -> None:
        assert not self.read_allowed, "allow without disallow"
        self.read_allowed = True
        self.events.append(("allow",))

    def disallow_state_dict_read(self) -> None:
        assert self.read_allowed, "disallow twice"
        self.read_allowed = False
        self.events.append(("disallow",))

    def names(self) -> list[str]:
        return [e[0] for e in self.events]


def run_replicas(*fns: Callable[[], Any]) -> list[Any]:
    """Run ``fns`` in threads (one per replica group); results in order, errors re-raised."""
    results: list[Any] = [None] * len(fns)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001 -- re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a replica thread is stuck"
    if errors:
        raise errors[0]
    return results


# -- models with exact gradients -----------------------------------------------------------------


class Linear(nn.Module):
    """Parameters ``w`` (and ``b``) with loss ``(w * c).sum() + (b * c_b).sum()``: the gradient is
    the constant ``c``, so SGD moves ``w`` by exactly ``-lr * c`` per step."""

    def __init__(self, w: list[float], b: list[float] | None = None) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(w, dtype=torch.float64))
        self.b = nn.Parameter(torch.tensor(b, dtype=torch.float64)) if b is not None else None

    def loss(self, c: float) -> torch.Tensor:
        out = (self.w * c).sum()
        if self.b is not None:
            out = out + (self.b * c).sum()
        return out


def inner_step(model: nn.Module, opt: torch.optim.Optimizer, c: float) -> None:
    opt.zero_grad()
    loss = sum(m.loss(c) for m in model.modules() if isinstance(m, Linear))
    loss.backward()  # type: ignore[union-attr]
    opt.step()


class TwoFragments(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f0 = Linear([1.0, 2.0])
        self.f1 = Linear([10.0, 20.0, 30.0])


def values(t: torch.Tensor) -> list[float]:
    return t.detach().tolist()


# -- LocalSGD --------------------------------------------------------------------------------------


def test_local_sgd_averages_parameters_across_replica_groups() -> None:
    world = World(3)
    cs = [1.0, 2.0, 6.0]  # per-group gradients

    def replica(rank: int) -> tuple[list[float], FakeManager, list[SyncResult | None]]:
        m = FakeManager(world, rank)
        model = Linear([8.0, 16.0])
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        seen = []
        with LocalSGD(m, model, opt, sync_every=2) as sgd:
            for i in range(4):
                inner_step(model, opt, cs[rank])
                if i == 1:
                    # after one sync: w = w0 - 2 * 0.5 * mean(c) = w0 - 3
                    assert values(model.w) == [5.0, 13.0]
                    assert sgd.local_step == 0
                seen.append(sgd.last_sync)
        return values(model.w), m, seen

    results = run_replicas(*[lambda r=r: replica(r) for r in range(3)])
    for w, m, seen in results:
        assert w == [2.0, 10.0]  # two syncs
        assert m.step == 2 and m.quorums == 2
        assert m.names().count("allreduce") == 2 * 1  # one parameter, per sync
        assert seen[0] is None and seen[1] == SyncResult(None, True, 1, None, 3, False)


def test_local_sgd_failed_commit_keeps_local_parameters() -> None:
    m = FakeManager(commits=[False, True], reduce=lambda t: t.fill_(100.0))
    model = Linear([8.0])
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with LocalSGD(m, model, opt, sync_every=2) as sgd:
        inner_step(model, opt, 2.0)
        inner_step(model, opt, 2.0)
        assert values(model.w) == [6.0]  # not the "average" (100)
        assert sgd.last_sync is not None and not sgd.last_sync.committed and m.step == 0
        inner_step(model, opt, 2.0)
        inner_step(model, opt, 2.0)
        assert values(model.w) == [100.0] and m.step == 1
    # Every optimizer step is bracketed by disallow/allow of state_dict reads.
    names = [n for n in m.names() if n in ("disallow", "allow")]
    assert names == ["disallow", "allow"] * 4


def test_local_sgd_hooks_removed_on_exit_and_validation() -> None:
    with pytest.raises(ValueError, match="sync_every"):
        LocalSGD(FakeManager(), Linear([1.0]), torch.optim.SGD(Linear([1.0]).parameters(), lr=1), sync_every=0)
    m = FakeManager()
    model = Linear([1.0])
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with LocalSGD(m, model, opt, sync_every=1):
        inner_step(model, opt, 1.0)
    inner_step(model, opt, 1.0)
    assert m.quorums == 1 and m.read_allowed


# -- DiLoCo: validation ----------------------------------------------------------------------------


def _diloco(m: Any = None, fragments: list[nn.Module] | None = None, outer: Any = None, **kw: Any) -> DiLoCo:
    model = TwoFragments()
    fragments = fragments if fragments is not None else [model.f0, model.f1]
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    outer = outer if outer is not None else torch.optim.SGD(model.parameters(), lr=1.0)
    kw.setdefault("sync_every", 4)
    return DiLoCo(m or FakeManager(), fragments, inner, outer, **kw)


@pytest.mark.parametrize("kwargs, match", [
    ({"sync_every": 1}, "less than the 2 fragments"),
    ({"sync_every": 5}, "multiple of the number of fragments"),
    ({"sync_every": 4, "fragment_sync_delay": 2}, r"fragment_sync_delay=2 must be in \[0, 2\)"),
    ({"fragment_sync_delay": -1}, "fragment_sync_delay"),
    ({"fragment_update_alpha": 1.5}, "between 0 and 1"),
    ({"fragment_update_alpha": -0.1}, "between 0 and 1"),
    ({"bucket_cap_mb": 0}, "bucket_cap_mb"),
])
def test_diloco_rejects_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _diloco(**kwargs)


def test_diloco_rejects_async_quorum_overlaps_and_uncovered_parameters() -> None:
    m = FakeManager()
    m._use_async_quorum = True  # type: ignore[misc]
    with pytest.raises(ValueError, match="use_async_quorum=False"):
        _diloco(m)
    model = TwoFragments()
    with pytest.raises(ValueError, match="fragments must be disjoint"):
        _diloco(fragments=[model, model.f1], outer=torch.optim.SGD(model.parameters(), lr=1))
    with pytest.raises(ValueError, match="does not hold its parameters"):
        _diloco(fragments=[model.f0, model.f1], outer=torch.optim.SGD(model.f0.parameters(), lr=1))
    with pytest.raises(ValueError, match="2 outer optimizers for 1"):
        _diloco(fragments=[model.f0], outer=[torch.optim.SGD(model.f0.parameters(), lr=1)] * 2)


# -- DiLoCo: math ----------------------------------------------------------------------------------


def test_diloco_averages_pseudogradients_and_steps_outer_optimizer_with_momentum() -> None:
    world = World(2)
    cs = [1.0, 3.0]
    w0 = [4.0, 8.0]

    def replica(rank: int) -> tuple[list[float], list[float], dict[str, Any], FakeManager]:
        m = FakeManager(world, rank)
        model = Linear(w0)
        inner = torch.optim.SGD(model.parameters(), lr=0.5)
        outer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5, nesterov=True)
        with DiLoCo(m, [model], inner, outer, sync_every=2) as diloco:
            for _ in range(4):  # two rounds
                inner_step(model, inner, cs[rank])
        backup = dict(diloco.global_parameters())["0.w"]
        return values(model.w), values(backup), outer.state_dict(), m

    (p0, g0, s0, m0), (p1, g1, s1, m1) = run_replicas(lambda: replica(0), lambda: replica(1))

    # Reference: two local steps move group r by 2 * 0.5 * c_r, so the averaged pseudo-gradient
    # is mean(c) = 2 every round; the outer optimizer steps on it from the global parameters.
    ref = nn.Parameter(torch.tensor(w0, dtype=torch.float64))
    ref_opt = torch.optim.SGD([ref], lr=0.5, momentum=0.5, nesterov=True)
    for _ in range(2):
        ref.grad = torch.full_like(ref, 2.0)
        ref_opt.step()
    assert p0 == p1 == g0 == g1 == values(ref)
    torch.testing.assert_close(s0["state"], s1["state"], rtol=0, atol=0)
    torch.testing.assert_close(s0["state"], ref_opt.state_dict()["state"], rtol=0, atol=0)
    assert m0.step == m1.step == 2
    assert [e for e in m0.names() if e != "allow" and e != "disallow"] == ["quorum", "allreduce", "commit"] * 2


def test_diloco_fragment_update_alpha_mixes_local_into_global() -> None:
    m = FakeManager(reduce=lambda t: None)  # a single group: the average is its own pseudo-gradient
    model = Linear([10.0])
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    outer = torch.optim.SGD(model.parameters(), lr=0.5)
    with DiLoCo(m, [model], inner, outer, sync_every=2, fragment_update_alpha=0.25) as diloco:
        inner_step(model, inner, 2.0)
        inner_step(model, inner, 2.0)  # local = 6, pseudo-gradient = 4, new global = 10 - 0.5 * 4 = 8
        assert values(dict(diloco.global_parameters())["0.w"]) == [8.0]
        assert values(model.w) == [8.0 + 0.25 * (6.0 - 8.0)]
    for alpha, expected in ((0.0, 8.0), (1.0, 6.0)):
        model = Linear([10.0])
        inner = torch.optim.SGD(model.parameters(), lr=1.0)
        with DiLoCo(FakeManager(), [model], inner, torch.optim.SGD(model.parameters(), lr=0.5), sync_every=2,
                    fragment_update_alpha=alpha):
            inner_step(model, inner, 2.0)
            inner_step(model, inner, 2.0)
        assert values(model.w) == [expected]


def test_diloco_failed_commit_restores_global_parameters_and_retries_the_fragment() -> None:
    m = FakeManager(commits=[False, True, True])
    model = TwoFragments()
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    outer = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    with DiLoCo(m, [model.f0, model.f1], inner, outer, sync_every=4) as diloco:
        inner_step(model, inner, 1.0)
        inner_step(model, inner, 1.0)  # round 1: fragment 0, commit fails
        assert diloco.last_sync is not None
        assert (diloco.last_sync.fragment, diloco.last_sync.committed, diloco.last_sync.step) == (0, False, 0)
        assert values(model.f0.w) == [1.0, 2.0]  # back to the global parameters: local progress dropped
        assert values(model.f1.w) == [8.0, 18.0, 28.0]  # not synchronised: local
        assert outer.state_dict()["state"] == {}  # the outer optimizer did not step
        assert values(model.f0.w.grad) == [1.0, 1.0]  # grads untouched (the inner ones: c = 1)
        inner_step(model, inner, 1.0)
        inner_step(model, inner, 1.0)  # round 2: fragment 0 again (step did not advance)
        assert (diloco.last_sync.fragment, diloco.last_sync.committed, diloco.last_sync.step) == (0, True, 1)
        # pseudo-gradient 2 (two steps from the restored global): 1 - 2, 2 - 2
        assert values(model.f0.w) == [-1.0, 0.0]
        inner_step(model, inner, 1.0)
        inner_step(model, inner, 1.0)  # round 3: fragment 1, four local steps since its global
        assert (diloco.last_sync.fragment, diloco.last_sync.committed) == (1, True)
        assert values(model.f1.w) == [4.0, 14.0, 24.0]  # six local steps: pseudo-gradient 6
        assert model.f1.w.grad is None and values(model.f0.w.grad) == [1.0, 1.0]


def test_diloco_fragment_schedule_with_sync_delay() -> None:
    m = FakeManager(reduce=lambda t: None)
    model = TwoFragments()
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    outer = [torch.optim.SGD(model.f0.parameters(), lr=1.0), torch.optim.SGD(model.f1.parameters(), lr=1.0)]
    trace: list[tuple[int, int, bool, list[str]]] = []
    with DiLoCo(m, [model.f0, model.f1], inner, outer, sync_every=6, fragment_sync_delay=1) as diloco:
        assert diloco.round_steps == 3
        for step in range(1, 7):
            before = len(m.events)
            inner_step(model, inner, 1.0)
            events = [e[0] for e in m.events[before:] if e[0] not in ("allow", "disallow")]
            trace.append((step, diloco.current_fragment(), diloco.sync_in_flight, events))
            if step == 2:
                # the pseudo-gradient was taken now (global 1 - local -1 = 2): the delay step that
                # follows must not change what is committed
                assert values(model.f0.w) == [-1.0, 0.0]
    assert trace == [
        (1, 0, False, []),
        (2, 0, True, ["quorum", "allreduce"]),  # fragment 0: one tensor
        (3, 1, False, ["commit"]),
        (4, 1, False, []),
        (5, 1, True, ["quorum", "allreduce"]),
        (6, 0, False, ["commit"]),
    ]
    # fragment 0: global (1, 2) - pseudo-gradient 2 taken at step 2 = (-1, 0) at step 3, then three
    # local steps; fragment 1: five local steps until its prepare at step 5 (pseudo-gradient 5),
    # committed at step 6 (the sixth local step is dropped).
    assert values(model.f0.w) == [-4.0, -3.0]
    assert values(model.f1.w) == [5.0, 15.0, 25.0]
    assert m.step == 2


# -- bucketization ---------------------------------------------------------------------------------


def f32(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.float32)


@pytest.mark.parametrize("sizes, cap_elems, expected", [
    ([2, 3, 4, 1], 6, [[0, 1], [2, 3]]),  # 5 fit, 5 + 4 does not; 4 + 1 fit
    ([3, 3], 6, [[0, 1]]),  # an exact fit stays in the bucket
    ([3, 4], 6, [[0], [1]]),  # one element over closes it
    ([1, 10, 1], 4, [[0], [1], [2]]),  # an oversized tensor is a bucket of its own
    ([10], 4, [[0]]),
    ([], 4, []),
])
def test_plan_buckets_boundaries(sizes: list[int], cap_elems: int, expected: list[list[int]]) -> None:
    assert plan_buckets([f32(n) for n in sizes], cap_elems * 4) == expected


def test_plan_buckets_never_mixes_dtypes_and_rejects_bad_caps() -> None:
    ts = [f32(2), torch.zeros(2, dtype=torch.float64), f32(2), torch.zeros(2, dtype=torch.float64)]
    assert plan_buckets(ts, 1 << 20) == [[0, 2], [1, 3]]
    with pytest.raises(ValueError):
        plan_buckets(ts, 0)


def _bucketized_round(sizes: list[int], cap_mb: float,
                      **kw: Any) -> tuple[list[torch.Tensor], list[torch.Tensor], FakeManager, DiLoCo]:
    """One round of a single group whose allreduce doubles: the outer step (SGD lr=1) then moves
    each parameter by exactly 2x its pseudo-gradient."""
    m = FakeManager(reduce=lambda t: t.mul_(2))
    params = nn.ParameterList([nn.Parameter(torch.full((n,), 10.0)) for n in sizes])
    holder = nn.Module()
    holder.params = params
    inner = torch.optim.SGD(params.parameters(), lr=1.0)
    outer = torch.optim.SGD(params.parameters(), lr=1.0)
    diloco = DiLoCo(m, [holder], inner, outer, sync_every=1, bucket_cap_mb=cap_mb, **kw)
    with diloco:
        inner.zero_grad()
        for i, p in enumerate(params):
            p.grad = torch.full_like(p, float(i + 1))  # local step: p -= i + 1
        inner.step()
    return list(params), [torch.full((n,), 10.0 - 2 * (i + 1)) for i, n in enumerate(sizes)], m, diloco


def test_diloco_bucketized_allreduce_reduces_every_tensor() -> None:
    # torchft 0.2.0 skips the second tensor of this layout (3 + 3 elements, 4-element buckets).
    cap_mb = 16 / (1024 * 1024)  # 4 float32 elements
    for sizes, calls in (([3, 3], 2), ([2, 2, 3, 1], 2), ([2, 3, 4, 1], 4), ([1, 1, 1, 1, 1], 2), ([9], 1)):
        got, expected, m, diloco = _bucketized_round(sizes, cap_mb, use_bucketization=True)
        for g, e in zip(got, expected):
            assert values(g) == values(e), sizes
        assert diloco.allreduce_calls == calls == m.names().count("allreduce"), sizes
    got, expected, m, diloco = _bucketized_round([2, 3, 4, 1], 1.0, use_bucketization=True)
    assert diloco.allreduce_calls == 1 and [values(g) for g in got] == [values(e) for e in expected]
    got, expected, m, diloco = _bucketized_round([2, 3, 4, 1], 1.0)  # off: one call per tensor
    assert diloco.allreduce_calls == 4 and [values(g) for g in got] == [values(e) for e in expected]


def test_diloco_bucketization_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHFT_USE_BUCKETIZATION", "True")
    _, _, _, diloco = _bucketized_round([2, 3, 4, 1], 1.0)
    assert diloco.allreduce_calls == 1


# -- several fragments, one outer optimizer --------------------------------------------------------


def test_shared_outer_optimizer_steps_only_the_synchronised_fragment() -> None:
    m = FakeManager()
    model = TwoFragments()
    inner = torch.optim.SGD(model.parameters(), lr=0.0)  # the parameters never move locally
    outer = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    with DiLoCo(m, [model.f0, model.f1], inner, outer, sync_every=2):
        inner_step(model, inner, 1.0)  # fragment 0 synchronised with a zero pseudo-gradient
    # torchft 0.2.0 would step fragment 1 with its stale inner gradient here.
    assert values(model.f0.w) == [1.0, 2.0] and values(model.f1.w) == [10.0, 20.0, 30.0]
    assert model.f1.w.grad is not None and values(model.f1.w.grad) == [1.0, 1.0, 1.0]  # restored
    assert len(outer.state_dict()["state"]) == 1  # momentum only for fragment 0's parameter


# -- recovery state --------------------------------------------------------------------------------


def test_registered_state_round_trips_and_local_state_is_a_snapshot() -> None:
    torch.manual_seed(0)
    src_m = FakeManager()
    src = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    src_inner = torch.optim.AdamW(src.parameters(), lr=0.1)
    src_outer = torch.optim.SGD(src.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    with DiLoCo(src_m, [src[0], src[1]], src_inner, src_outer, sync_every=2):
        for _ in range(4):
            src_inner.zero_grad()
            src(torch.randn(5, 3)).square().mean().backward()
            src_inner.step()
    assert sorted(src_m.save_fns) == ["DiLoCo", "StreamingDiLoCoFragment_0", "StreamingDiLoCoFragment_1"]
    state = {k: fn() for k, fn in src_m.save_fns.items()}
    # The local part is a copy: training on does not change what a peer is sent.
    original = src[0].weight.detach().clone()
    with torch.no_grad():
        src[0].weight.add_(1.0)
    assert torch.equal(state["DiLoCo"]["fragments"][0]["weight"], original)
    with torch.no_grad():
        src[0].weight.copy_(original)

    dst_m = FakeManager()
    dst = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    dst_inner = torch.optim.AdamW(dst.parameters(), lr=0.1)
    dst_outer = torch.optim.SGD(dst.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    dst_diloco = DiLoCo(dst_m, [dst[0], dst[1]], dst_inner, dst_outer, sync_every=2)
    for k, load in dst_m.load_fns.items():
        load(state[k])
    src_diloco_globals = {k: v for k, v in state["StreamingDiLoCoFragment_0"]["original_parameters"].items()}
    torch.testing.assert_close(dict(dst_diloco.global_parameters())["0.weight"], src_diloco_globals["weight"],
                               rtol=0, atol=0)
    torch.testing.assert_close(dst.state_dict(), src.state_dict(), rtol=0, atol=0)
    torch.testing.assert_close(dst_inner.state_dict(), src_inner.state_dict(), rtol=0, atol=0)
    torch.testing.assert_close(dst_outer.state_dict(), src_outer.state_dict(), rtol=0, atol=0)
    # The loaded outer state is the destination's own (no aliasing of the sender's tensors).
    a = next(iter(src_outer.state.values()))["momentum_buffer"]
    b = next(iter(dst_outer.state.values()))["momentum_buffer"]
    assert a.data_ptr() != b.data_ptr()


def test_a_replica_group_heals_from_a_peer_at_the_synchronisation_and_takes_part() -> None:
    """Group 1 starts from other weights and a fresh optimizer (a restart): at the first quorum it
    loads group 0's whole DiLoCo state, then both train on; the global state ends identical."""
    world = World(2)
    managers = [FakeManager(world, 0), FakeManager(world, 1)]
    managers[1].heal_from = managers[0]

    def replica(rank: int) -> tuple[dict[str, torch.Tensor], dict[str, Any], list[SyncResult]]:
        gen = torch.Generator().manual_seed(100 + rank)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        with torch.no_grad():
            for p in model.parameters():  # different initial weights per group
                p.copy_(torch.randn(p.shape, generator=gen))
        inner = torch.optim.AdamW(model.parameters(), lr=0.05)
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        syncs: list[SyncResult] = []
        with DiLoCo(managers[rank], [model[0], model[2]], inner, outer, sync_every=4, fragment_sync_delay=1,
                    use_bucketization=True) as diloco:
            for _ in range(12):
                inner.zero_grad()
                model(torch.randn(8, 3, generator=gen)).square().mean().backward()
                inner.step()
                if diloco.last_sync is not None and (not syncs or syncs[-1] is not diloco.last_sync):
                    syncs.append(diloco.last_sync)
        return {k: v.clone() for k, v in diloco.global_parameters()}, outer.state_dict(), syncs

    (g0, o0, s0), (g1, o1, s1) = run_replicas(lambda: replica(0), lambda: replica(1))
    torch.testing.assert_close(g0, g1, rtol=0, atol=0)
    torch.testing.assert_close(o0, o1, rtol=0, atol=0)
    assert [s.fragment for s in s0] == [s.fragment for s in s1] == [0, 1, 0, 1, 0, 1]
    assert all(s.committed for s in s0 + s1)
    assert managers[1].step == managers[0].step == 6
