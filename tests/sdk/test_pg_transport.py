"""ftclient.checkpointing.PGTransport: checkpoints over a process group's send/recv.

Unit tests run real Gloo ranks as threads of the test process (torch's ``ProcessGroupGloo``
backend over an in-memory store; nothing is started): a state dict of every kind of leaf
(dtypes, views, non-contiguous and conjugate tensors, 0-d and empty tensors, tensors large
enough to go alone and hundreds small enough to be bucketed, Parameters, tied tensors, sparse
tensors and plain values in nested containers) arrives bitwise equal at two destinations at
once; a template is left alone by default (what matches it arrives in new tensors, with the
sender's types) and ``recv_checkpoint(template=...)`` replaces the template callable; with
``in_place=True`` a template is received into (its own tensor objects come back, a
non-contiguous one is copied into, one of another shape is left alone); the wrong step, a foreign header and a
silent peer fail within the timeout; the plan buckets small tensors deterministically; a sender
holds a bounded amount of staging copies (a recording fake group); aborting ftclient's
``ProcessGroupGloo`` (what a liveness notice does) ends a waiting recovery at once.

Integration tests run real processes. HSDP on CPU: 4 processes, 2 replica groups of 2 ranks,
FSDP2 (``fully_shard``) on each group's shard mesh, PGTransport on the replicate dimension's
group: group 1 receives group 0's model and AdamW state (DTensors) into its own state dict
(``in_place=True``: its own mesh and placements, the template's objects, its parameters' shards
in place), loads it and ends with group 0's full parameters and optimizer state, and both take
the same next step; by default, with a template, in new DTensors on the template's own mesh with
its placements; without a template the DTensors are rebuilt on the sender's mesh layout as
resolved in the receiving process (its own shard mesh), in new tensors. The same state over
HTTPTransport streams every shard and arrives as DTensors on the receiver's shard mesh (with a
template, on the template's own mesh objects).
A Manager with ``checkpoint_transport=PGTransport(pg, ...)`` heals a replica group that is
behind from its peer through a real 3-node lighthouse cluster, into new tensors that its
``load_state_dict`` receives once the group commits.
"""

from __future__ import annotations

import collections
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

from support.waiting import run_on_threads
from ftclient.checkpointing import (
    CheckpointStepMismatchError,
    CheckpointTransferError,
    CheckpointTransport,
    HTTPTransport,
)
from ftclient.checkpointing import pg_transport
from ftclient.checkpointing.pg_transport import PGTransport

pytestmark = pytest.mark.timeout(60)

T5 = timedelta(seconds=5)
CPU = torch.device("cpu")


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else t


def assert_bitwise_equal(got: Any, expected: Any, path: str = "") -> None:
    """Same structure, same Python values, tensors with the same type, dtype, shape and bits."""
    assert type(got) is type(expected), f"{path}: {type(got)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        if expected.layout != torch.strided:
            assert torch.equal(got.to_dense(), expected.to_dense()), path
            return
        assert got.dtype == expected.dtype and got.shape == expected.shape, path
        assert got.requires_grad == expected.requires_grad, path
        assert torch.equal(_bits(got), _bits(expected)), path
    elif isinstance(expected, dict):
        assert list(got) == list(expected), path
        for k in expected:
            assert_bitwise_equal(got[k], expected[k], f"{path}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), path
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_bitwise_equal(g, e, f"{path}[{i}]")
    else:
        assert got == expected, path


def gloo_ranks(world_size: int, timeout: timedelta = T5) -> list[dist.ProcessGroup]:
    """``world_size`` real Gloo ranks of one group in this process (built concurrently)."""
    store = dist.HashStore()
    out: list[Any] = [None] * world_size

    def build(rank: int) -> None:
        out[rank] = dist.ProcessGroupGloo(store, rank, world_size, timeout)

    run_on_threads([lambda r=r: build(r) for r in range(world_size)], THREADS_S)
    return out


THREADS_S = 30.0  # the most one exchange between the ranks' threads may take


def rich_state_dict() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(512, 600, generator=g)  # 1.2 MB: sent alone
    shared = torch.randn(7, generator=g)
    base = torch.arange(100, dtype=torch.float64)
    return {
        "big": big,
        "transposed": big[:40, :50].t(),  # non-contiguous view
        "slice": base[10:20],  # a view: only its 10 elements travel
        "conj": torch.randn(3, dtype=torch.complex64, generator=g).conj(),
        "neg": torch.randn(4, generator=g)._neg_view(),
        "dtypes": [torch.ones(3, dtype=d) for d in (torch.bfloat16, torch.float16, torch.int64, torch.uint8,
                                                     torch.int8, torch.float64)],
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "param": nn.Parameter(torch.randn(5, generator=g)),
        "frozen": nn.Parameter(torch.randn(2, generator=g), requires_grad=False),
        "grad_tensor": torch.randn(3, generator=g).requires_grad_(),
        "tied": {"a": shared, "b": shared},
        "many_small": [torch.full((300,), float(i)) for i in range(400)],  # 480 KB: 1 bucket+
        "many_medium": [torch.full((60_000,), float(i)) for i in range(20)],  # 240 KB each: 2 buckets
        "sparse": torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,), check_invariants=True),
        "values": collections.OrderedDict(step=7, name="ckpt", nothing=None, pair=(1, 2.5), nested={"x": [1, 2]}),
    }


# -- the plan -------------------------------------------------------------------------------------------


def test_plan_sends_large_tensors_alone_and_buckets_small_ones_deterministically() -> None:
    small, bucket = pg_transport._SMALL, pg_transport._BUCKET
    assert pg_transport._plan([small, 10, 0, 20, small * 4, 30]) == [[0], [4], [1, 3, 5]]
    sizes = [10, small * 2] + [small - 1] * 40 + [0, 7]
    plan = pg_transport._plan(sizes)
    assert plan[0] == [1]  # large: alone, in order of appearance
    buckets = plan[1:]
    assert len(buckets) == 3 and [i for msg in buckets for i in msg] == [0, *range(2, 42), 43]  # no empty one
    assert all(sum(sizes[i] for i in msg) <= bucket for msg in buckets)
    assert pg_transport._plan(sizes) == plan


class _RecordingPG:
    """A process group whose sends complete when waited for; records how many sends of
    staging copies were outstanding at each send."""

    def __init__(self) -> None:
        self.outstanding: list[torch.Tensor] = []
        self.peak_copies = 0

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        pg = self
        self.outstanding.append(tensors[0])
        self.peak_copies = max(self.peak_copies, sum(t.numel() > 1000 for t in self.outstanding))

        class Work:
            def wait(self, timeout: timedelta | None = None) -> bool:
                pg.outstanding.remove(tensors[0])
                return True

        return Work()


def test_a_sender_holds_a_bounded_amount_of_staging_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pg_transport, "_MAX_STAGED", 1 << 20)
    pg = _RecordingPG()
    sd = {f"t{i}": torch.randn(400, 400).t() for i in range(10)}  # 640 KB each, non-contiguous: copied
    PGTransport(pg, T5, CPU).send_checkpoint([1], 1, sd, T5)
    assert pg.outstanding == [] and pg.peak_copies == 2  # 1 MiB allows one copy in flight, plus the new one


# -- transfers between in-process Gloo ranks ----------------------------------------------------------------


def test_state_dict_arrives_bitwise_equal_at_two_destinations() -> None:
    pgs = gloo_ranks(3)
    sd = rich_state_dict()
    transports = [PGTransport(pg, T5, CPU) for pg in pgs]
    _, got1, got2 = run_on_threads([
        lambda: transports[0].send_checkpoint([1, 2], step=7, state_dict=sd, timeout=T5),
        lambda: transports[1].recv_checkpoint(0, transports[0].metadata(), step=7, timeout=T5),
        lambda: transports[2].recv_checkpoint(0, "<n/a>", step=7, timeout=T5),
    ], THREADS_S)
    for got in (got1, got2):
        assert_bitwise_equal(got, sd)
        assert got["tied"]["a"] is got["tied"]["b"]  # sent once, shared again
        assert got["slice"].numel() == 10 and not got["transposed"].is_conj()
        assert got["many_small"][0]._base is None  # bucket slices don't keep the bucket alive
    assert got1["big"] is not got2["big"]
    assert isinstance(transports[0], CheckpointTransport)
    transports[0].disallow_checkpoint()  # nothing to wait for: sending is synchronous
    transports[0].shutdown()


def test_template_tensors_are_received_in_place_when_asked() -> None:
    pgs = gloo_ranks(2)
    src = {"w": torch.randn(600, 300), "b": torch.randn(8), "t": torch.randn(6, 4).t().contiguous().t(),
           "other_shape": torch.randn(3), "only_there": torch.randn(2)}
    tmpl = {"w": torch.zeros(600, 300), "b": torch.zeros(8), "t": torch.zeros(4, 6).t(),  # non-contiguous
            "other_shape": torch.zeros(4)}
    before_other = tmpl["other_shape"].clone()
    sender = PGTransport(pgs[0], T5, CPU)
    receiver = PGTransport(pgs[1], T5, CPU, state_dict=lambda: tmpl, in_place=True)
    _, got = run_on_threads([lambda: sender.send_checkpoint([1], 3, src, T5),
                              lambda: receiver.recv_checkpoint(0, "<n/a>", 3, T5)], THREADS_S)
    for k in ("w", "b", "t"):
        assert got[k] is tmpl[k], k  # the template's own tensor, filled
        assert torch.equal(tmpl[k], src[k]), k
    assert got["other_shape"] is not tmpl["other_shape"] and torch.equal(got["other_shape"], src["other_shape"])
    assert torch.equal(tmpl["other_shape"], before_other)  # a template of another shape is left alone
    assert torch.equal(got["only_there"], src["only_there"])


def test_a_template_is_left_alone_by_default_and_may_be_passed_to_recv() -> None:
    """The default: what matches the template arrives in new tensors like it (the template, the
    live state of a Manager's rank, changes only when the Manager applies the recovery: never
    half-applied); ``recv_checkpoint(template=...)`` replaces the callable (the Manager passes the
    state it took on the training thread)."""
    pgs = gloo_ranks(2)
    src = {"w": torch.randn(600, 300), "b": torch.randn(8), "p": nn.Parameter(torch.randn(3)),
           "frozen": torch.randn(2).requires_grad_()}
    tmpl = {"w": torch.zeros(600, 300), "b": torch.zeros(8), "p": nn.Parameter(torch.zeros(3)),
            "frozen": torch.zeros(2)}
    before = {k: v.detach().clone() for k, v in tmpl.items()}

    def never() -> Any:
        raise AssertionError("the template callable was called although a template was passed")

    sender = PGTransport(pgs[0], T5, CPU)
    for receiver, kwargs in ((PGTransport(pgs[1], T5, CPU, state_dict=lambda: tmpl), {}),
                             (PGTransport(pgs[1], T5, CPU, state_dict=never), {"template": tmpl})):
        _, got = run_on_threads([lambda: sender.send_checkpoint([1], 3, src, T5),
                                  lambda: receiver.recv_checkpoint(0, "<n/a>", 3, T5, **kwargs)], THREADS_S)
        assert_bitwise_equal(got, src)  # values, Parameter type and requires_grad: the sender's
        for k in tmpl:
            assert got[k] is not tmpl[k] and torch.equal(tmpl[k], before[k]), k


def test_wrong_step_and_foreign_header_are_refused() -> None:
    pgs = gloo_ranks(2)
    sender, receiver = PGTransport(pgs[0], T5, CPU), PGTransport(pgs[1], T5, CPU)
    short = timedelta(seconds=1)
    # The sender's small header and metadata complete without the receiver reading the rest,
    # or time out: either way it returns or raises within its timeout.
    results: list[Any] = []

    def send() -> None:
        try:
            sender.send_checkpoint([1], 5, {"x": torch.ones(2)}, short)
            results.append("sent")
        except TimeoutError as e:
            results.append(e)

    def recv() -> None:
        with pytest.raises(CheckpointStepMismatchError, match="rank 0 sent step 5 but step 6 was requested"):
            receiver.recv_checkpoint(0, "<n/a>", 6, T5)

    run_on_threads([send, recv], THREADS_S)
    assert len(results) == 1

    pgs = gloo_ranks(2)
    foreign = torch.tensor([1, 2, 3, 4], dtype=torch.int64)  # e.g. another transport's first message
    receiver = PGTransport(pgs[1], T5, CPU)

    def recv_foreign() -> None:
        with pytest.raises(CheckpointTransferError, match="did not send an ftclient PGTransport checkpoint"):
            receiver.recv_checkpoint(0, "<n/a>", 1, T5)

    run_on_threads([lambda: pgs[0].send([foreign], 1, pg_transport._TAG_HEADER).wait(), recv_foreign], THREADS_S)


def test_a_silent_peer_fails_the_transfer_within_its_timeout() -> None:
    pgs = gloo_ranks(2, timeout=timedelta(seconds=30))
    receiver = PGTransport(pgs[1], T5, CPU)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="receiving the checkpoint of step 2 from rank 0 timed out"):
        receiver.recv_checkpoint(0, "<n/a>", 2, timedelta(seconds=1))
    assert 0.9 <= time.monotonic() - t0 < 4.0

    pgs = gloo_ranks(2, timeout=timedelta(seconds=30))  # Gloo closed the pair that timed out
    sender = PGTransport(pgs[0], T5, CPU)
    big = {"x": torch.zeros(64 << 20, dtype=torch.uint8)}  # too large to sit in socket buffers
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="sending the checkpoint of step 2 to ranks \\[1\\] timed out"):
        sender.send_checkpoint([1], 2, big, timedelta(seconds=1))
    assert 0.9 <= time.monotonic() - t0 < 4.0


def test_aborting_ftclients_group_ends_a_waiting_transfer_at_once() -> None:
    """A liveness notice (the source died) aborts the Manager's group: a recovery waiting on it
    over PGTransport fails then, not after its timeout."""
    from support.waiting import wait_for

    from ftclient import ProcessGroupGloo

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=T5)
    pgs = [ProcessGroupGloo(timeout=timedelta(seconds=30)) for _ in range(2)]
    run_on_threads([lambda r=r: pgs[r].configure(f"127.0.0.1:{store.port}/pgt/0", str(r), r, 2) for r in range(2)], THREADS_S)
    outcome: list[BaseException] = []

    def recv() -> None:
        try:
            PGTransport(pgs[1], T5, CPU).recv_checkpoint(0, "<n/a>", 1, timedelta(seconds=30))
        except BaseException as e:  # noqa: BLE001 -- examined below
            outcome.append(e)

    receiver = threading.Thread(target=recv, daemon=True)
    receiver.start()
    wait_for("the receiver's header recv to be pending", lambda: pgs[1]._pending, timeout=10)
    t0 = time.monotonic()
    pgs[1].abort(RuntimeError("peer died: the source replica group"))
    receiver.join(10)
    assert not receiver.is_alive() and time.monotonic() - t0 < 2.0
    assert isinstance(outcome[0], CheckpointTransferError) and "peer died" in str(outcome[0]), outcome
    assert "receiving the checkpoint of step 1 from rank 0 failed at the header" in str(outcome[0])
    for pg in pgs:
        pg.shutdown()


def test_unpicklable_values_are_named() -> None:
    pgs = gloo_ranks(1)
    with pytest.raises(TypeError, match="must be picklable"):
        PGTransport(pgs[0], T5, CPU).send_checkpoint([0], 1, {"f": lambda: 1}, T5)


# -- HSDP on CPU: DTensor state dicts between replica groups (real processes) ------------------------------


def _digest(t: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(_bits(t).numpy().tobytes()).hexdigest()[:16]


def _full_digests(sd: dict[str, Any]) -> dict[str, str]:
    """Digests of a model / optimizer state dict's full tensors (DTensors gathered: a collective
    over the shard mesh, so every rank of the replica group calls it)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import keystr, tree_flatten_with_path

    out = {}
    for path, v in tree_flatten_with_path(sd)[0]:
        if isinstance(v, DTensor):
            out[keystr(path)] = _digest(v.full_tensor())
        elif isinstance(v, torch.Tensor):
            out[keystr(path)] = _digest(v)
    return out


def _hsdp_worker(rank: int, store_port: int, out: Any) -> None:
    """One rank of 2 replica groups x 2 ranks: FSDP2 inside the group, PGTransport across."""
    try:
        import os

        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        torch.set_num_threads(1)
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
        timeout = timedelta(seconds=30)
        store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=4, timeout=timeout)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        group = rank // 2
        torch.manual_seed(100 + group)  # the groups start from different weights
        # 10 and 3 rows over 2 ranks: even and uneven (padded) Shard(0) shards.
        model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.randn(4, 6)).sum().backward()
        opt.step()  # optimizer state: exp_avg / exp_avg_sq DTensors, step tensors
        before = _full_digests({"model": model.state_dict(), "optim": opt.state_dict()})

        replicate = mesh["replicate"].get_group()  # rank r of group 0 <-> rank r of group 1
        template = lambda: {"model": model.state_dict(), "optim": opt.state_dict()}  # noqa: E731
        transport = PGTransport(replicate, timeout, torch.device("cpu"), state_dict=template, in_place=True)
        report: dict[str, Any] = {"rank": rank, "group": group, "before": before}
        if group == 0:
            transport.send_checkpoint([1], 4, template(), timeout)  # received in place
            transport.send_checkpoint([1], 5, template(), timeout)  # to a receiver without template
            transport.send_checkpoint([1], 7, template(), timeout)  # like the template (the default)
            # The same state over HTTPTransport (the Manager's default): DTensor shards streamed.
            with HTTPTransport(timeout, hostname="127.0.0.1") as http:
                http.send_checkpoint([1], 6, template(), timeout)
                report["http_streamed"] = len(http._offer.tensors)  # type: ignore[union-attr]
                store.set(f"http/{rank}", http.metadata())
                store.wait([f"http_done/{rank}"])  # bounded by the store's timeout
                http.disallow_checkpoint()
        else:
            params = dict(model.named_parameters())
            got = transport.recv_checkpoint(0, "<n/a>", 4, timeout)
            checks = {}
            for k, v in got["model"].items():
                checks[k] = (isinstance(v, DTensor), v.device_mesh == mesh["shard"], tuple(map(str, v.placements)),
                             v._local_tensor.data_ptr() == params[k]._local_tensor.data_ptr())
            report["checks"] = checks
            report["in_place"] = _full_digests({"model": model.state_dict()})  # before load_state_dict
            model.load_state_dict(got["model"])
            opt.load_state_dict(got["optim"])
            # Without a template: rebuilt on the sender's mesh layout, resolved in this process.
            plain = PGTransport(replicate, timeout, torch.device("cpu")).recv_checkpoint(0, "<n/a>", 5, timeout)
            report["no_template"] = {
                k: (isinstance(v, DTensor), v.device_mesh == mesh["shard"], tuple(map(str, v.placements)),
                    torch.equal(v._local_tensor, params[k]._local_tensor),
                    v._local_tensor.data_ptr() != params[k]._local_tensor.data_ptr())
                for k, v in plain["model"].items()}
            # The default with a template: new DTensors on the template's own mesh and placements.
            like = PGTransport(replicate, timeout, torch.device("cpu"), state_dict=template).recv_checkpoint(
                0, "<n/a>", 7, timeout)
            report["like_template"] = {
                k: (isinstance(v, DTensor), v.device_mesh is params[k].device_mesh, tuple(map(str, v.placements)),
                    torch.equal(v._local_tensor, params[k]._local_tensor),
                    v._local_tensor.data_ptr() != params[k]._local_tensor.data_ptr())
                for k, v in like["model"].items()}
            with HTTPTransport(timeout, hostname="127.0.0.1") as http:
                fetched = http.recv_checkpoint(0, store.get(f"http/{rank - 2}").decode(), 6, timeout)
                # With this replica's own state as the template (what the Manager passes): on its
                # own mesh objects, whose process groups collectives use here.
                own = http.recv_checkpoint(0, store.get(f"http/{rank - 2}").decode(), 6, timeout, template=template())
            store.set(f"http_done/{rank - 2}", b"1")
            report["http_template"] = {
                k: (isinstance(v, DTensor), v.device_mesh is params[k].device_mesh, tuple(map(str, v.placements)),
                    torch.equal(v._local_tensor, params[k]._local_tensor))
                for k, v in own["model"].items()}
            report["http"] = {
                k: (isinstance(v, DTensor), v.device_mesh == mesh["shard"], tuple(map(str, v.placements)),
                    torch.equal(v._local_tensor, params[k]._local_tensor))
                for k, v in fetched["model"].items()}
        report["after"] = _full_digests({"model": model.state_dict(), "optim": opt.state_dict()})
        # One more identical step in both groups: they stay identical (the optimizer state too).
        torch.manual_seed(7)
        opt.zero_grad()
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
        report["next_step"] = _full_digests({"model": model.state_dict()})
        dist.destroy_process_group()
        out.put(report)
    except BaseException:  # noqa: BLE001 -- reported to the test
        import traceback

        out.put({"rank": rank, "error": traceback.format_exc()})


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_hsdp_dtensor_state_dict_heals_into_the_receivers_own_shards() -> None:
    import multiprocessing as mp
    import queue

    # One interpreter imports torch, ftclient and what fully_shard imports (torch._dynamo: 3.5 s),
    # then forks the 4 ranks: 4 spawned interpreters would spend ~20 s of 2 shared cores importing.
    # The fork server is single-threaded, so forking it is safe.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([_hsdp_worker.__module__, "torch.distributed.fsdp", "torch.distributed.tensor",
                                "torch._dynamo"])
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    out = ctx.Queue()
    procs = [ctx.Process(target=_hsdp_worker, args=(r, store.port, out), daemon=True) for r in range(4)]
    for p in procs:
        p.start()
    reports: dict[int, dict[str, Any]] = {}
    try:
        while len(reports) < 4:
            try:
                r = out.get(timeout=60)
            except queue.Empty:
                raise AssertionError(f"ranks {sorted(set(range(4)) - set(reports))} reported nothing in 60 s") from None
            assert "error" not in r, f"rank {r['rank']} failed:\n{r['error']}"
            reports[r["rank"]] = r
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for rank in (2, 3):  # group 1: the receiving ranks
        r, src = reports[rank], reports[rank - 2]
        assert r["before"] != src["before"]  # the groups did start apart
        assert r["checks"] and all(c == (True, True, ("S(0)",), True) for c in r["checks"].values()), r["checks"]
        model_keys = [k for k in src["before"] if k.startswith("['model']")]
        assert {k: r["in_place"][k] for k in model_keys} == {k: src["before"][k] for k in model_keys}
        assert r["after"] == src["after"] == src["before"]  # model and optimizer state
        assert r["next_step"] == src["next_step"]
        assert r["no_template"] and all(c == (True, True, ("S(0)",), True, True) for c in r["no_template"].values())
        assert r["like_template"] and all(c == (True, True, ("S(0)",), True, True)
                                          for c in r["like_template"].values()), r["like_template"]
        assert r["http"] and all(c == (True, True, ("S(0)",), True) for c in r["http"].values())
        assert r["http_template"] and all(c == (True, True, ("S(0)",), True) for c in r["http_template"].values())
        # 4 parameters + their exp_avg and exp_avg_sq shards + 4 step tensors, all streamed
        assert src["http_streamed"] == 16


# -- a Manager healing through PGTransport --------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_manager_heals_a_group_that_is_behind_through_pg_transport(make_cluster: Callable[..., Any]) -> None:
    from ftclient import Manager, ProcessGroupGloo

    cluster = make_cluster(min_replicas=2)
    cluster.wait_for_leader()
    timeout = timedelta(seconds=10)
    managers: list[Manager] = []
    stores: list[dist.TCPStore] = []  # each group's store, alive as long as its manager

    def group(name: str, state: dict[str, torch.Tensor]) -> Manager:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
        stores.append(store)
        pg = ProcessGroupGloo(timeout=timeout)
        holder: list[Manager] = []
        # The template has the Manager's layout: tensors arrive in the group's own state.
        transport = PGTransport(pg, timeout, CPU,
                                state_dict=lambda: {"user": {"default": state}, "torchft": holder[0].state_dict()})
        m = Manager(pg=pg, load_state_dict=state.update, state_dict=lambda: dict(state), min_replica_size=1,
                    timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout, rank=0, world_size=1,
                    store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=cluster.endpoints,
                    replica_id=name, hostname="127.0.0.1", checkpoint_transport=transport)
        holder.append(m)
        managers.append(m)
        return m

    try:
        ahead_state = {"w": torch.randn(512, 512), "b": torch.arange(5.0)}
        behind_state = {"w": torch.zeros(512, 512), "b": torch.zeros(5)}
        w_object = behind_state["w"]
        a, b = group("ahead", ahead_state), group("behind", behind_state)
        a.load_state_dict({"step": 3, "batches_committed": 6})

        def step(m: Manager, grad: float) -> tuple[bool, list[float]]:
            m.start_quorum()
            out = m.allreduce(torch.full((2,), grad))
            out.wait()
            reduced = out.get_future().value() if hasattr(out, "get_future") else out.value()
            return m.should_commit(), reduced.tolist()

        (ca, ra), (cb, rb) = run_on_threads([lambda: step(a, 2.0), lambda: step(b, 100.0)], THREADS_S)
        assert b.last_quorum_result is not None and b.last_quorum_result.heal
        assert ca and cb and ra == rb == [2.0, 2.0]  # the healing group sat the step out
        assert a.current_step() == b.current_step() == 4 and b.batches_committed() == 7
        # Received into a new tensor (the group's own was not written before the commit), then
        # loaded (here: load_state_dict=state.update) once the group committed.
        assert behind_state["w"] is not w_object and torch.equal(w_object, torch.zeros(512, 512))
        assert torch.equal(behind_state["w"], ahead_state["w"]) and torch.equal(behind_state["b"], ahead_state["b"])

        (ca, ra), (cb, rb) = run_on_threads([lambda: step(a, 1.0), lambda: step(b, 3.0)], THREADS_S)
        assert ca and cb and ra == rb == [2.0, 2.0]  # healed: both take part
    finally:
        for m in managers:
            m.shutdown(wait=False)
