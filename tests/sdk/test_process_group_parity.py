"""Process-group parity with torchft (#16 item 1): ftclient's groups as torch sees them.

Two ranks of a real Gloo group run as threads of this process over a TCPStore the test hosts
(as in test_ftclient_process_group.py), and every assertion is on the tensors the collectives
produced:

* every collective of :class:`ProcessGroupGloo` (allreduce SUM/AVG/MAX, allreduce_coalesced,
  broadcast, allgather, all_gather_into_tensor and its coalesced form, reduce_scatter and
  reduce_scatter_tensor with SUM and AVG, all_to_all_single with and without split sizes,
  send/recv, barrier), called directly and through ``torch.distributed``'s own functions;
* ``register(name)`` / ``group_name`` / ``unregister()``: ``dist.all_reduce(t, group=pg)`` and
  functional collectives (``funcol.all_reduce(x, "avg", pg)``, by group or by name, and
  all_reduce_coalesced, all_gather_tensor, reduce_scatter_tensor, all_to_all_single, broadcast)
  on a registered group, a reconfiguration (new quorum, ranks swapped) keeping the registration
  working, and a group left usable by ``unregister``;
* ``ProcessGroupGloo(timeout, pg=...)`` as torchft's constructor;
* :class:`ManagedProcessGroup` passing the collectives other than allreduce through to the
  Manager's process group: with a stand-in manager over real Gloo (failures recorded through
  ``report_error``, never raised), and, in the integration test, with real Managers of two replica
  groups on a real 3-node lighthouse cluster, registered and used by ``dist`` and funcol across a
  new quorum.

Registration needs torch's default process group (as with torchft): the ``default_group``
fixture starts a one-rank one on a HashStore and destroys it afterwards.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import ReduceOp
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.futures import Future

from ftclient.process_group import (
    ErrorSwallowingProcessGroupWrapper,
    ManagedProcessGroup,
    ProcessGroup,
    ProcessGroupDummy,
    ProcessGroupGloo,
)

pytestmark = pytest.mark.timeout(120)

TIMEOUT = timedelta(seconds=10)
JOIN_S = 30.0


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    yield dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


@pytest.fixture
def default_group() -> Iterator[None]:
    """torch's default process group (one rank, HashStore), which registration needs."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def on_both(fn: Callable[[int], Any], timeout: float = JOIN_S) -> list[Any]:
    """Run ``fn(0)`` and ``fn(1)`` at the same time (one per rank); their results in rank order."""
    with ThreadPoolExecutor(2) as ex:
        futs = [ex.submit(fn, r) for r in range(2)]
        done, pending = futures.wait(futs, timeout=timeout)
        assert not pending, f"a rank is still running after {timeout}s"
        return [f.result() for f in futs]


def configure_both(pgs: list[ProcessGroupGloo], store: dist.TCPStore, quorum_id: int,
                   ranks: tuple[int, int] = (0, 1)) -> None:
    """Configure ``pgs[i]`` as rank ``ranks[i]`` of a 2-rank group for ``quorum_id``."""
    addr = f"127.0.0.1:{store.port}/torchft/{quorum_id}/0"
    on_both(lambda i: pgs[i].configure(addr, f"replica{i}", ranks[i], 2, quorum_id=quorum_id))


def two_ranks(store: dist.TCPStore, quorum_id: int = 1) -> list[ProcessGroupGloo]:
    pgs = [ProcessGroupGloo(TIMEOUT) for _ in range(2)]
    configure_both(pgs, store, quorum_id)
    return pgs


def wait(work: dist.Work) -> Any:
    assert work.wait() is True
    return work.get_future().value()


# -- ProcessGroupGloo's collectives ------------------------------------------------------------------


def test_gloo_collectives_give_real_results_on_two_ranks(store: dist.TCPStore) -> None:
    pgs = two_ranks(store)

    def collectives(rank: int) -> dict[str, Any]:
        pg, out = pgs[rank], {}
        a = torch.tensor([1.0, 2.0]) * (rank + 1)  # rank 0: [1, 2], rank 1: [2, 4]
        t = a.clone()
        assert wait(pg.allreduce([t], ReduceOp.SUM)) == [t]
        out["sum"] = t.tolist()
        t = a.clone()
        wait(pg.allreduce([t], ReduceOp.AVG))
        out["avg"] = t.tolist()
        t = torch.tensor([5.0, -1.0]) if rank == 0 else torch.tensor([3.0, 7.0])
        wait(pg.allreduce([t], ReduceOp.MAX))
        out["max"] = t.tolist()
        ts = [a.clone(), torch.tensor([10.0 * (rank + 1)])]
        wait(pg.allreduce_coalesced(ts, ReduceOp.AVG))
        out["coalesced_avg"] = [x.tolist() for x in ts]

        t = torch.tensor([float(rank), 9.0])
        wait(pg.broadcast([t], 1))
        out["broadcast"] = t.tolist()
        t = torch.tensor([float(rank)])
        wait(pg.broadcast_one(t, 0))
        out["broadcast_one"] = t.tolist()

        gathered = [[torch.zeros(2), torch.zeros(2)]]
        assert wait(pg.allgather(gathered, [a])) is gathered
        out["allgather"] = [x.tolist() for x in gathered[0]]
        flat = torch.zeros(4)
        wait(pg._allgather_base(flat, a))
        out["allgather_base"] = flat.tolist()
        flats = [torch.zeros(4), torch.zeros(2)]
        wait(pg.allgather_into_tensor_coalesced(flats, [a, torch.tensor([float(rank)])]))
        out["allgather_coalesced"] = [x.tolist() for x in flats]

        part = torch.zeros(2)
        wait(pg.reduce_scatter([part], [[a, a * 10]], ReduceOp.SUM))
        out["reduce_scatter"] = part.tolist()
        part = torch.zeros(2)
        wait(pg._reduce_scatter_base(part, torch.arange(4.0) * (rank + 1), ReduceOp.AVG))
        out["reduce_scatter_base_avg"] = part.tolist()
        parts = [torch.zeros(1), torch.zeros(2)]
        wait(pg.reduce_scatter_tensor_coalesced(parts, [torch.tensor([1.0, 2.0]) * (rank + 1),
                                                        torch.arange(4.0) + rank], ReduceOp.SUM))
        out["reduce_scatter_coalesced"] = [x.tolist() for x in parts]

        received = torch.zeros(2)
        wait(pg.alltoall_base(received, torch.tensor([10.0 * rank, 10.0 * rank + 1]), [], []))
        out["alltoall"] = received.tolist()
        # Uneven splits: rank 0 sends 1 element to rank 0 and 2 to rank 1; rank 1 sends 2 and 1.
        send_splits = [1, 2] if rank == 0 else [2, 1]
        recv_splits = [1, 2] if rank == 0 else [2, 1]
        received = torch.zeros(3)
        wait(pg.alltoall_base(received, torch.arange(3.0) + 100 * rank, recv_splits, send_splits))
        out["alltoall_splits"] = received.tolist()

        if rank == 0:
            sent = torch.tensor([42.0, 43.0])
            wait(pg.send([sent], 1, 7))
            sent.zero_()  # the send used a copy
        else:
            got = torch.zeros(2)
            wait(pg.recv([got], 0, 7))
            out["recv"] = got.tolist()
        assert wait(pg.barrier()) is None
        return out

    r0, r1 = on_both(collectives)
    assert r0["sum"] == r1["sum"] == [3.0, 6.0]
    assert r0["avg"] == r1["avg"] == [1.5, 3.0]
    assert r0["max"] == r1["max"] == [5.0, 7.0]
    assert r0["coalesced_avg"] == r1["coalesced_avg"] == [[1.5, 3.0], [15.0]]
    assert r0["broadcast"] == r1["broadcast"] == [1.0, 9.0]
    assert r0["broadcast_one"] == r1["broadcast_one"] == [0.0]
    assert r0["allgather"] == r1["allgather"] == [[1.0, 2.0], [2.0, 4.0]]
    assert r0["allgather_base"] == r1["allgather_base"] == [1.0, 2.0, 2.0, 4.0]
    assert r0["allgather_coalesced"] == r1["allgather_coalesced"] == [[1.0, 2.0, 2.0, 4.0], [0.0, 1.0]]
    # reduce_scatter: part r of (rank 0's [a0, 10*a0]) + (rank 1's [a1, 10*a1]).
    assert r0["reduce_scatter"] == [3.0, 6.0] and r1["reduce_scatter"] == [30.0, 60.0]
    # mean of [0,1,2,3] and [0,2,4,6] = [0, 1.5, 3, 4.5], scattered in halves.
    assert r0["reduce_scatter_base_avg"] == [0.0, 1.5] and r1["reduce_scatter_base_avg"] == [3.0, 4.5]
    # [1,2]+[2,4] = [3,6] scattered in 1-element parts; [0,1,2,3]+[1,2,3,4] = [1,3,5,7] in halves.
    assert r0["reduce_scatter_coalesced"] == [[3.0], [1.0, 3.0]]
    assert r1["reduce_scatter_coalesced"] == [[6.0], [5.0, 7.0]]
    assert r0["alltoall"] == [0.0, 10.0] and r1["alltoall"] == [1.0, 11.0]
    assert r0["alltoall_splits"] == [0.0, 100.0, 101.0] and r1["alltoall_splits"] == [1.0, 2.0, 102.0]
    assert r1["recv"] == [42.0, 43.0]
    assert pgs[0].errored() is None and pgs[1].errored() is None
    for pg in pgs:
        pg.shutdown()


def test_gloo_collective_errors_are_recorded_and_aborts_fail_every_kind(store: dist.TCPStore) -> None:
    pgs = two_ranks(store)
    # Rank 1 never joins: abort fails each pending operation at once and leaves its outputs alone.
    out = [[torch.full((1,), -1.0), torch.full((1,), -1.0)]]
    got = torch.full((2,), -1.0)
    works = [pgs[0].allgather(out, [torch.ones(1)]), pgs[0].recv([got], 1, 0)]
    pgs[0].abort(RuntimeError("peer replica1 died"))
    for work in works:
        with pytest.raises(RuntimeError, match="peer replica1 died"):
            work.wait()
    assert out[0][0].tolist() == [-1.0] and got.tolist() == [-1.0, -1.0]
    assert "peer replica1 died" in str(pgs[0].errored())
    with pytest.raises(RuntimeError, match="not started"):
        pgs[0].reduce_scatter([torch.zeros(1)], [[torch.ones(1), torch.ones(1)]]).wait()
    with pytest.raises(ValueError, match="floating point"):
        pgs[1].allreduce_coalesced([torch.ones(1, dtype=torch.int64)], ReduceOp.AVG)
    for pg in pgs:
        pg.shutdown()


def test_torch_distributed_functions_reach_ftclient_groups(store: dist.TCPStore, default_group: None) -> None:
    pgs = two_ranks(store)
    for i, pg in enumerate(pgs):
        pg.register(f"parity_dist_{i}")

    def via_dist(rank: int) -> dict[str, Any]:
        pg, out = pgs[rank], {}
        assert dist.get_world_size(pg) == 2
        a = torch.tensor([1.0, 2.0]) * (rank + 1)
        t = a.clone()
        dist.all_reduce(t, group=pg, op=ReduceOp.AVG)
        out["avg"] = t.tolist()
        gathered = [torch.zeros(2), torch.zeros(2)]
        dist.all_gather(gathered, a, group=pg)
        out["all_gather"] = [x.tolist() for x in gathered]
        flat = torch.zeros(4)
        dist.all_gather_into_tensor(flat, a, group=pg)
        out["all_gather_into_tensor"] = flat.tolist()
        part = torch.zeros(2)
        dist.reduce_scatter_tensor(part, torch.arange(4.0) * (rank + 1), group=pg)
        out["reduce_scatter_tensor"] = part.tolist()
        part = torch.zeros(1)
        dist.reduce_scatter(part, [a[:1].clone(), a[1:].clone()], group=pg)
        out["reduce_scatter"] = part.tolist()
        received = torch.zeros(2)
        dist.all_to_all_single(received, torch.tensor([10.0 * rank, 10.0 * rank + 1]), group=pg)
        out["all_to_all_single"] = received.tolist()
        t = torch.tensor([float(rank) + 5])
        dist.broadcast(t, group=pg, group_src=1)
        out["broadcast"] = t.tolist()
        if rank == 0:
            dist.send(torch.tensor([8.0]), group=pg, group_dst=1)
        else:
            got = torch.zeros(1)
            dist.recv(got, group=pg, group_src=0)
            out["recv"] = got.tolist()
        dist.barrier(group=pg)
        return out

    r0, r1 = on_both(via_dist)
    assert r0["avg"] == r1["avg"] == [1.5, 3.0]
    assert r0["all_gather"] == r1["all_gather"] == [[1.0, 2.0], [2.0, 4.0]]
    assert r0["all_gather_into_tensor"] == r1["all_gather_into_tensor"] == [1.0, 2.0, 2.0, 4.0]
    assert r0["reduce_scatter_tensor"] == [0.0, 3.0] and r1["reduce_scatter_tensor"] == [6.0, 9.0]
    assert r0["reduce_scatter"] == [3.0] and r1["reduce_scatter"] == [6.0]
    assert r0["all_to_all_single"] == [0.0, 10.0] and r1["all_to_all_single"] == [1.0, 11.0]
    assert r0["broadcast"] == r1["broadcast"] == [6.0]
    assert r1["recv"] == [8.0]
    for pg in pgs:
        pg.unregister()
        pg.shutdown()


# -- registration and functional collectives ---------------------------------------------------------


def test_register_enables_functional_collectives_across_a_reconfiguration(
    store: dist.TCPStore, default_group: None
) -> None:
    pgs = [ProcessGroupGloo(TIMEOUT) for _ in range(2)]
    with pytest.raises(ValueError, match="name not set"):
        pgs[0].group_name
    # Registered before the first configure, as torchtitan does: the registration is the object.
    assert pgs[0].register("dp_replicate") is pgs[0]
    assert pgs[1].register("dp_replicate_peer") is pgs[1]
    names = [pg.group_name for pg in pgs]
    assert names[0] != names[1]
    assert all(_resolve_process_group(n) is pg for n, pg in zip(names, pgs))
    assert pgs[0].group_desc == "ftclient-gloo:dp_replicate"
    with pytest.raises(RuntimeError, match="already registered"):
        pgs[0].register("again")

    def funcol_round(rank: int) -> dict[str, Any]:
        pg, out = pgs[rank], {}
        x = torch.tensor([1.0, 3.0]) * (rank + 1)  # [1, 3] and [2, 6]
        out["avg"] = funcol.all_reduce(x, "avg", pg).tolist()
        out["sum_by_name"] = funcol.all_reduce(x, "sum", pg.group_name).tolist()
        out["max"] = funcol.all_reduce(x, reduceOp="max", group=pg).wait().tolist()
        assert x.tolist() == ([1.0, 3.0] if rank == 0 else [2.0, 6.0])  # functional: input untouched
        out["coalesced"] = [y.tolist() for y in funcol.all_reduce_coalesced([x, x[:1]], "sum", pg)]
        out["all_to_all"] = funcol.all_to_all_single(torch.tensor([10.0 * rank, 10.0 * rank + 1]), None, None,
                                                     pg).tolist()
        out["broadcast"] = funcol.broadcast(torch.tensor([float(rank)]), 1, pg).tolist()
        out["all_gather"] = funcol.all_gather_tensor(x, 0, pg).tolist()
        out["reduce_scatter"] = funcol.reduce_scatter_tensor(x, "sum", 0, pg).tolist()
        t = x.clone()
        dist.all_reduce(t, group=pg)
        out["dist_sum"] = t.tolist()
        return out

    configure_both(pgs, store, 1)
    first = on_both(funcol_round)
    # A new quorum: each group is rebuilt on a new prefix, with the ranks swapped.
    configure_both(pgs, store, 2, ranks=(1, 0))
    assert [pg.group_name for pg in pgs] == names
    second = on_both(funcol_round)

    for r0, r1 in (first, second):
        assert r0["avg"] == r1["avg"] == [1.5, 4.5]
        assert r0["sum_by_name"] == r1["sum_by_name"] == [3.0, 9.0]
        assert r0["max"] == r1["max"] == [2.0, 6.0]
        assert r0["coalesced"] == r1["coalesced"] == [[3.0, 9.0], [3.0]]
        assert r0["dist_sum"] == r1["dist_sum"] == [3.0, 9.0]
    # all_to_all and broadcast follow the ranks: pgs[0] is rank 0, then rank 1.
    assert first[0]["all_gather"] == first[1]["all_gather"] == [1.0, 3.0, 2.0, 6.0]
    assert first[0]["reduce_scatter"] == [3.0] and first[1]["reduce_scatter"] == [9.0]
    assert second[0]["all_gather"] == second[1]["all_gather"] == [2.0, 6.0, 1.0, 3.0]
    assert second[0]["reduce_scatter"] == [9.0] and second[1]["reduce_scatter"] == [3.0]
    assert first[0]["all_to_all"] == [0.0, 10.0] and first[1]["all_to_all"] == [1.0, 11.0]
    assert first[0]["broadcast"] == first[1]["broadcast"] == [1.0]
    assert second[0]["all_to_all"] == [11.0, 1.0] and second[1]["all_to_all"] == [10.0, 0.0]
    assert second[0]["broadcast"] == second[1]["broadcast"] == [0.0]

    # unregister: out of torch's registry, the group itself still configured and usable.
    for pg in pgs:
        pg.unregister()
    with pytest.raises(ValueError, match="name not set"):
        pgs[0].group_name
    with pytest.raises(ValueError, match="not registered"):
        pgs[0].unregister()
    assert on_both(lambda r: wait(pgs[r].allreduce([torch.tensor([float(r)])], ReduceOp.SUM))[0].tolist()) \
        == [[1.0], [1.0]]
    pgs[0].register("dp_replicate")  # and it can be registered again
    assert _resolve_process_group(pgs[0].group_name) is pgs[0]
    pgs[0].unregister()
    for pg in pgs:
        pg.shutdown()


def test_register_needs_the_default_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ProcessGroupGloo(TIMEOUT).register("dp_replicate")


def test_the_backend_plugin_refuses_new_group_without_a_group_to_register() -> None:
    from ftclient.process_group import _create_registered_group

    with pytest.raises(RuntimeError, match="register"):
        _create_registered_group(None, 0, 1, None)


def test_a_zero_wait_timeout_means_no_timeout(store: dist.TCPStore) -> None:
    """torch's C++ side waits on a Python work with timeout 0 (kNoTimeout)."""
    pgs = two_ranks(store)
    works: list[dist.Work] = []

    def late_peer() -> None:
        works.append(pgs[1].allreduce([torch.ones(1)], ReduceOp.SUM))

    t = torch.ones(1)
    work = pgs[0].allreduce([t], ReduceOp.SUM)
    threading.Timer(0.2, late_peer).start()
    assert work.wait(timedelta(0)) is True and t.tolist() == [2.0]
    with pytest.raises(TimeoutError):
        pgs[0].allreduce([torch.ones(1)], ReduceOp.SUM).wait(timedelta(milliseconds=50))
    for pg in pgs:
        pg.shutdown()


# -- the constructor ---------------------------------------------------------------------------------


def test_gloo_constructor_takes_torchfts_timeout_and_pg(store: dist.TCPStore) -> None:
    assert "timeout=2.5s" in repr(ProcessGroupGloo(2.5))
    with pytest.raises(TypeError, match="torch.distributed process group"):
        ProcessGroupGloo(TIMEOUT, pg=ProcessGroupDummy())

    # A ready torch group serves until the first configure replaces it.
    def torch_group(rank: int) -> dist.ProcessGroup:
        prefix = dist.PrefixStore("ready", dist.TCPStore("127.0.0.1", store.port, is_master=False))
        return dist.ProcessGroupGloo(prefix, rank, 2, TIMEOUT)

    ready = on_both(torch_group)
    pgs = [ProcessGroupGloo(TIMEOUT, pg=ready[r]) for r in range(2)]
    assert [pg.rank() for pg in pgs] == [0, 1] and pgs[0].size() == 2
    assert on_both(lambda r: wait(pgs[r].allreduce([torch.tensor([r + 1.0])], ReduceOp.AVG))[0].tolist()) \
        == [[1.5], [1.5]]
    configure_both(pgs, store, 3, ranks=(1, 0))
    assert [pg.rank() for pg in pgs] == [1, 0]
    assert on_both(lambda r: wait(pgs[r].allreduce([torch.tensor([r + 1.0])], ReduceOp.SUM))[0].tolist()) \
        == [[3.0], [3.0]]
    for pg in pgs:
        pg.shutdown()


# -- wrappers ------------------------------------------------------------------------------------------


def test_error_swallowing_wrapper_and_dummy_have_every_collective(store: dist.TCPStore) -> None:
    wrapped = [ErrorSwallowingProcessGroupWrapper(pg) for pg in two_ranks(store)]

    def run(rank: int) -> dict[str, Any]:
        pg, out = wrapped[rank], {}
        a = torch.tensor([1.0, 2.0]) * (rank + 1)
        flat = torch.zeros(4)
        wait(pg._allgather_base(flat, a))
        out["allgather_base"] = flat.tolist()
        part = torch.zeros(1)
        wait(pg._reduce_scatter_base(part, a, ReduceOp.SUM))
        out["reduce_scatter_base"] = part.tolist()
        received = torch.zeros(2)
        wait(pg.alltoall_base(received, a, [], []))
        out["alltoall"] = received.tolist()
        ts = [a.clone()]
        wait(pg.allreduce_coalesced(ts, ReduceOp.SUM))
        out["coalesced"] = ts[0].tolist()
        if rank == 0:
            wait(pg.send([a], 1, 0))
        else:
            got = torch.zeros(2)
            wait(pg.recv([got], 0, 0))
            out["recv"] = got.tolist()
        assert pg.rank() == rank
        return out

    r0, r1 = on_both(run)
    assert r0["allgather_base"] == r1["allgather_base"] == [1.0, 2.0, 2.0, 4.0]
    assert r0["reduce_scatter_base"] == [3.0] and r1["reduce_scatter_base"] == [6.0]
    assert r0["alltoall"] == [1.0, 2.0] and r1["alltoall"] == [2.0, 4.0]
    assert r0["coalesced"] == r1["coalesced"] == [3.0, 6.0]
    assert r1["recv"] == [1.0, 2.0]

    # A failure is swallowed: the work completes with the caller's tensors, errored() says why.
    wrapped[0].abort(RuntimeError("peer gone"))
    out = torch.full((2,), -1.0)
    assert wrapped[0].reduce_scatter_tensor_coalesced([out], [torch.ones(4)]).wait() is True
    assert out.tolist() == [-1.0, -1.0] and "peer gone" in str(wrapped[0].errored())
    for pg in wrapped:
        pg.shutdown()

    dummy = ProcessGroupDummy()
    parts = [torch.zeros(2)]
    wait(dummy.reduce_scatter(parts, [[torch.ones(2)]]))
    received = torch.zeros(2)
    wait(dummy.alltoall_base(received, torch.tensor([4.0, 5.0]), [], []))
    assert parts[0].tolist() == [1.0, 1.0] and received.tolist() == [4.0, 5.0]
    with pytest.raises(NotImplementedError, match="ProcessGroupDummy does not implement send"):
        dummy.send([torch.ones(1)], 0, 0)


# -- ManagedProcessGroup ------------------------------------------------------------------------------


class StandInManager:
    """The part of the Manager that ManagedProcessGroup uses, over a real configured Gloo group:
    the errors it records, the quorum waits, and a wrap_future that never raises."""

    def __init__(self, pg: ProcessGroupGloo, participants: int = 2) -> None:
        self._pg = pg
        self.participants = participants
        self.error: Exception | None = None
        self.quorum_waits = 0

    def wait_quorum(self) -> None:
        self.quorum_waits += 1

    def errored(self) -> Exception | None:
        return self.error

    def report_error(self, e: Exception) -> None:
        self.error = self.error or e

    def wrap_future(self, fut: Future[Any], default: Any) -> Future[Any]:
        out: Future[Any] = Future()

        def settle(f: Future[Any]) -> None:
            try:
                out.set_result(f.value())
            except Exception as e:  # noqa: BLE001 -- recorded, as the Manager does
                self.report_error(e)
                out.set_result(default)

        fut.add_done_callback(settle)
        return out

    def allreduce(self, tensor: torch.Tensor, reduce_op: ReduceOp = ReduceOp.AVG) -> dist.Work:
        return self._pg.allreduce([tensor], reduce_op)

    def num_participants(self) -> int:
        return self.participants


def test_managed_group_passes_other_collectives_to_the_managers_group(
    store: dist.TCPStore, default_group: None
) -> None:
    managers = [StandInManager(pg) for pg in two_ranks(store)]
    managed = [ManagedProcessGroup(m) for m in managers]
    for i, pg in enumerate(managed):
        assert pg.register(f"dp_replicate_{i}") is pg and pg.parent is managers[i]._pg

    def run(rank: int) -> dict[str, Any]:
        pg, out = managed[rank], {}
        assert pg.rank() == rank and pg.size() == dist.get_world_size(pg) == 2
        a = torch.tensor([1.0, 2.0]) * (rank + 1)
        t = a.clone()
        dist.all_reduce(t, group=pg, op=ReduceOp.AVG)  # through manager.allreduce
        out["avg"] = t.tolist()
        out["funcol_sum"] = funcol.all_reduce(a, "sum", pg).tolist()
        t = torch.tensor([float(rank)])
        dist.broadcast(t, group=pg, group_src=1)
        out["broadcast"] = t.tolist()
        gathered = [torch.zeros(2), torch.zeros(2)]
        dist.all_gather(gathered, a, group=pg)
        out["all_gather"] = [x.tolist() for x in gathered]
        flat = torch.zeros(4)
        dist.all_gather_into_tensor(flat, a, group=pg)
        out["all_gather_into_tensor"] = flat.tolist()
        part = torch.zeros(1)
        dist.reduce_scatter_tensor(part, a, group=pg)
        out["reduce_scatter_tensor"] = part.tolist()
        part = torch.zeros(1)
        dist.reduce_scatter(part, [a[:1].clone(), a[1:].clone()], group=pg)
        out["reduce_scatter"] = part.tolist()
        received = torch.zeros(2)
        dist.all_to_all_single(received, a, group=pg)
        out["all_to_all_single"] = received.tolist()
        if rank == 0:
            dist.send(torch.tensor([8.0]), group=pg, group_dst=1)
        else:
            got = torch.zeros(1)
            dist.recv(got, group=pg, group_src=0)
            out["recv"] = got.tolist()
        dist.barrier(group=pg)
        return out

    r0, r1 = on_both(run)
    assert r0["avg"] == r1["avg"] == [1.5, 3.0]
    assert r0["funcol_sum"] == r1["funcol_sum"] == [3.0, 6.0]
    assert r0["broadcast"] == r1["broadcast"] == [1.0]
    assert r0["all_gather"] == r1["all_gather"] == [[1.0, 2.0], [2.0, 4.0]]
    assert r0["all_gather_into_tensor"] == r1["all_gather_into_tensor"] == [1.0, 2.0, 2.0, 4.0]
    assert r0["reduce_scatter_tensor"] == [3.0] and r1["reduce_scatter_tensor"] == [6.0]
    assert r0["reduce_scatter"] == [3.0] and r1["reduce_scatter"] == [6.0]
    assert r0["all_to_all_single"] == [1.0, 2.0] and r1["all_to_all_single"] == [2.0, 4.0]
    assert r1["recv"] == [8.0]
    assert [(m.error, m.quorum_waits) for m in managers] == [(None, 8), (None, 8)]  # one per pass-through

    # A failure goes to the Manager (the step will not commit) and is never raised; the caller's
    # tensors are untouched, and the step's later collectives do not communicate.
    managers[0]._pg.abort(RuntimeError("peer replica1 died"))
    t = torch.tensor([-1.0])
    dist.broadcast(t, group=managed[0], group_src=1)
    assert t.tolist() == [-1.0] and "peer replica1 died" in str(managers[0].error)
    waits = managers[0].quorum_waits
    gathered = [torch.zeros(1), torch.zeros(1)]
    assert managed[0].allgather([gathered], [torch.ones(1)]).wait() is True
    assert gathered[0].tolist() == [0.0] and managers[0].quorum_waits == waits  # skipped at once
    # A collective that fails to launch is recorded too.
    managers[1]._pg.shutdown()
    assert managed[1].barrier().wait() is True and "before configure" in str(managers[1].error)
    for pg in managed:
        pg.unregister()
    managers[0]._pg.shutdown()


# -- real Managers on a real lighthouse cluster --------------------------------------------------------


@pytest.mark.integration
def test_managed_groups_of_real_managers_registered_across_a_new_quorum(
    make_cluster: Callable[..., Any], default_group: None
) -> None:
    from ftclient import Manager

    cluster = make_cluster(min_replicas=2)
    cluster.wait_for_leader()
    stores = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(2)]

    def build(i: int) -> Manager:
        return Manager(pg=ProcessGroupGloo(TIMEOUT), load_state_dict=None, state_dict=None, min_replica_size=2,
                       use_async_quorum=False, timeout=TIMEOUT, quorum_timeout=timedelta(seconds=30),
                       connect_timeout=TIMEOUT, rank=0, world_size=1, store_addr="127.0.0.1",
                       store_port=stores[i].port, lighthouse_addr=cluster.endpoints, replica_id=f"parity{i}",
                       hostname="127.0.0.1", init_sync=False)

    managers = on_both(build)
    try:
        managed = [ManagedProcessGroup(m) for m in managers]
        names = [pg.register(f"dp_replicate_{i}").group_name for i, pg in enumerate(managed)]

        def step(i: int, fail: bool = False) -> dict[str, Any]:
            m, pg, out = managers[i], managed[i], {}
            m.start_quorum()
            a = torch.tensor([1.0, 2.0]) * (i + 1)
            t = a.clone()
            dist.all_reduce(t, group=pg, op=ReduceOp.AVG)
            out["avg"] = t.tolist()
            out["funcol_sum"] = funcol.all_reduce(a, "sum", pg.group_name).tolist()
            gathered = [torch.zeros(2), torch.zeros(2)]
            dist.all_gather(gathered, a, group=pg)
            out["all_gather"] = sorted(x.tolist() for x in gathered)
            if fail:
                m.report_error(RuntimeError("injected: this step must not commit"))
            out["committed"] = m.should_commit()
            out["quorum_id"] = m.last_quorum_result.quorum_id  # type: ignore[union-attr]
            return out

        first = on_both(lambda i: step(i, fail=True))
        # The failed commits are reported with the next quorum: a new quorum id, so both groups
        # rebuild their Gloo group; the registration (and funcol by name) still works.
        second = on_both(step)
        assert [pg.group_name for pg in managed] == names
        for r0, r1 in (first, second):
            assert r0["avg"] == r1["avg"] == [1.5, 3.0]
            assert r0["funcol_sum"] == r1["funcol_sum"] == [3.0, 6.0]
            assert r0["all_gather"] == r1["all_gather"] == [[1.0, 2.0], [2.0, 4.0]]
        assert [first[0]["committed"], first[1]["committed"]] == [False, False]
        assert second[0]["committed"] and second[1]["committed"]
        assert second[0]["quorum_id"] == second[1]["quorum_id"] > first[0]["quorum_id"]
        for pg in managed:
            pg.unregister()
    finally:
        for m in managers:
            m.shutdown(wait=False)


def test_managed_allreduce_gives_torch_the_managers_work_with_a_zero_timeout_meaning_none() -> None:
    class RecordingWork(dist._Work):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[str, Any]] = []

        def wait(self, timeout: timedelta | None = None) -> bool:
            self.calls.append(("wait", timeout))
            return True

        def block_current_stream(self, timeout: timedelta | None = None) -> None:
            self.calls.append(("block", timeout))

        def synchronize(self) -> None:
            self.calls.append(("synchronize", None))

        def get_future(self) -> Future[Any]:
            fut: Future[Any] = Future()
            fut.set_result("result")
            return fut

    inner = RecordingWork()

    class WorkManager:
        def allreduce(self, tensor: torch.Tensor, reduce_op: ReduceOp = ReduceOp.AVG) -> dist.Work:
            return inner

        def num_participants(self) -> int:
            return 2

    work = ManagedProcessGroup(WorkManager()).allreduce([torch.ones(1)], ReduceOp.AVG)
    # torch's C++ side (a functional collective's wait) passes 0 for "no timeout".
    assert work.wait(timedelta(0)) is True and work.wait(timedelta(seconds=3)) is True
    work.block_current_stream()
    work.synchronize()
    assert work.get_future().value() == "result"
    assert inner.calls == [("wait", None), ("wait", timedelta(seconds=3)), ("block", None), ("synchronize", None)]
