"""ftclient.Manager's healing, unit-tested (issue 31, item 2): real Managers (one or two ranks of a
replica group, as threads) on fakes of everything they talk to -- the group's TCPStore and manager
server (a scripted lighthouse quorum, the ShouldCommit barrier), the recovery source's manager,
the checkpoint transport and the process group. Nothing is started.

* Where the donor's state dict is taken. With the asynchronous quorum, the training thread calls
  the user's ``state_dict()`` at every step (a peer that heals is known only once the quorum is
  in) just before its forward pass: at its first module call after ``start_quorum`` (a global
  forward pre-hook, removed once it fired, after the step and at shutdown; a module call on
  another thread does not count), so what the loop changed in between (a batch counted) is in
  it; or, without a module call, at its next Manager call that waits for the quorum. The quorum
  thread serves exactly that object and calls no user function, even when it runs during the
  forward pass. With the synchronous quorum the quorum thread calls it, only when a peer heals,
  while the training thread waits in ``start_quorum``. A state dict that cannot be taken fails
  only a step that serves it.
* All ranks of a group agree. A recovery that fails on one rank of a healing group (or lacks a
  registered key) is applied on no rank: every rank votes against the commit, keeps its step,
  batches and weights, and heals at the next quorum, where all ranks apply it. The failing rank
  still takes part in the step's collectives (zeros, as any healing rank), so no peer waits for
  it. A load that fails after the group agreed raises. With the synchronous quorum the same
  agreement is voted in ``start_quorum``, before the forward pass.
* ``should_commit`` closes the checkpoint transport (and drops the captured state dict) even when
  its vote fails; ``_group_heals`` (which ranks vote on a synchronous heal) agrees with
  ``compute_quorum_results`` for every group rank; on an accelerator, the quorum thread serialises
  the state only after the work the training thread queued before ``start_quorum`` (an event).
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.modules.module as module_hooks
from torch import nn

import ftclient.manager as manager_module
from support.waiting import run_on_threads
from ftclient.manager import Manager, _group_heals
from ftclient.process_group import ManagedProcessGroup
from ftclient.quorum_results import PeerInfo, QuorumResult, QuorumView, compute_quorum_results

TIMEOUT = timedelta(seconds=10)
JOIN_S = 20.0


# -- fakes ---------------------------------------------------------------------------------------


class FakeStore:
    """A TCPStore of one replica group: a dict; ``get``/``wait`` block until the key is set."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def set(self, key: str, value: str | bytes) -> None:
        with self._cond:
            self._data[key] = value.encode() if isinstance(value, str) else value
            self._cond.notify_all()

    def get(self, key: str) -> bytes:
        self.wait([key], TIMEOUT)
        return self._data[key]

    def add(self, key: str, amount: int) -> int:
        with self._cond:
            value = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(value).encode()
            self._cond.notify_all()
            return value

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: all(k in self._data for k in keys), timeout.total_seconds()):
                raise TimeoutError(f"keys {keys} not set")


class FakePG:
    """The replica groups' process group: every collective completes at once with its input."""

    def __init__(self) -> None:
        self.configured: list[int | None] = []
        self.allreduces = 0

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int, quorum_id: int | None = None,
                  group_rank: int | None = None, group_world_size: int | None = None) -> None:
        self.configured.append(quorum_id)

    def allreduce(self, tensors: list[torch.Tensor], op: Any) -> Any:
        self.allreduces += 1
        fut: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        fut.set_result(tensors)
        return SimpleNamespace(get_future=lambda: fut)

    def errored(self) -> Exception | None:
        return None

    def size(self) -> int:
        return 1

    def shutdown(self) -> None:
        pass


@dataclass
class Sent:
    step: int
    state_dict: Any
    thread: threading.Thread
    during_forward: bool


class FakeTransport:
    """Records what is served (and from which thread); ``recv_checkpoint`` returns what the test's
    ``recover`` returns for the step, or raises it."""

    def __init__(self, world: FakeWorld, group_rank: int) -> None:
        self.world = world
        self.group_rank = group_rank
        self.sent: list[Sent] = []
        self.received: list[int] = []
        self.disallows = 0
        self.fail_recv: Exception | None = None

    def metadata(self) -> str:
        return f"fake-transport/{self.group_rank}"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        self.sent.append(Sent(step, state_dict, threading.current_thread(), self.world.forward_running.is_set()))

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        assert metadata == f"peer-meta/{self.group_rank}"  # rank r fetches from the source's rank r
        self.received.append(step)
        if self.fail_recv is not None:
            e, self.fail_recv = self.fail_recv, None
            raise e
        return self.world.recovered(step)

    def disallow_checkpoint(self) -> None:
        self.disallows += 1

    def shutdown(self, wait: bool = True) -> None:
        pass


class FakeGroup:
    """One replica group's manager server: every rank's Quorum call gets the same scripted
    lighthouse quorum (the group's member carries the step of the last rank to ask), and the
    ShouldCommit barrier (True iff every rank votes True)."""

    def __init__(self, world: FakeWorld, replica_id: str, world_size: int) -> None:
        self.world = world
        self.replica_id = replica_id
        self.world_size = world_size
        self.lighthouse = SimpleNamespace(job=SimpleNamespace(name="default"))
        self._cond = threading.Condition()
        self._quorum_round: dict[int, int] = {}
        self._issued: QuorumView | None = None
        self._quorum_gen = 0
        self._votes: dict[int, bool] = {}
        self._decision: bool | None = None
        self._commit_gen = 0
        self.vote_error: Exception | None = None
        self.votes: list[tuple[int, bool]] = []

    def address(self) -> str:
        return f"fake://{self.replica_id}"

    def shutdown(self) -> None:
        pass

    def close(self) -> None:
        pass

    def _quorum(self, group_rank: int, step: int, checkpoint_metadata: str, shrink_only: bool, timeout: float,
                commit_failures: int = 0, init_sync: bool = True) -> QuorumResult:
        assert self.world.gate.wait(JOIN_S), "the test never released the quorum"
        with self._cond:
            gen = self._quorum_gen
            self._quorum_round[group_rank] = step
            if len(self._quorum_round) == self.world_size:
                me = PeerInfo(replica_id=self.replica_id, address=self.address(), store_address="store:0",
                              step=step, world_size=self.world_size)
                self._issued = QuorumView(self.world.quorum_id, (me, *self.world.peers))
                self._quorum_round = {}
                self._quorum_gen += 1
                self._cond.notify_all()
            else:
                assert self._cond.wait_for(lambda: self._quorum_gen != gen, JOIN_S), "a group rank never asked"
            assert self._issued is not None
            return compute_quorum_results(self.replica_id, group_rank, self._issued, init_sync)

    def should_commit(self, group_rank: int, step: int, should_commit: bool, timeout: Any) -> bool:
        if self.vote_error is not None:
            raise self.vote_error
        with self._cond:
            self.votes.append((group_rank, should_commit))
            gen = self._commit_gen
            self._votes[group_rank] = should_commit
            if len(self._votes) == self.world_size:
                self._decision = all(self._votes.values())
                self._votes = {}
                self._commit_gen += 1
                self._cond.notify_all()
            else:
                assert self._cond.wait_for(lambda: self._commit_gen != gen, JOIN_S), "a group rank never voted"
            assert self._decision is not None
            return self._decision


class FakeSource:
    """The recovery source's manager server: its ranks' checkpoint metadata."""

    def __init__(self, address: str, connect_timeout: Any = None) -> None:
        self.address = address

    def _checkpoint_metadata(self, rank: int, timeout: Any) -> str:
        return f"peer-meta/{rank}"

    def close(self) -> None:
        pass


@dataclass
class Rank:
    manager: Manager
    transport: FakeTransport
    pg: FakePG
    state: dict[str, torch.Tensor]
    loads: list[dict[str, Any]] = field(default_factory=list)
    reads: list[tuple[str, bool]] = field(default_factory=list)  # (thread name, during the forward pass)


class FakeWorld:
    """The lighthouse's side of the fakes: the other replica groups of the next quorums (``peers``),
    what a healing rank receives (``recovered``), and a gate that holds every quorum back."""

    def __init__(self) -> None:
        self.peers: list[PeerInfo] = []
        self.quorum_id = 1
        self.gate = threading.Event()
        self.gate.set()
        self.forward_running = threading.Event()  # set by a test while it "runs the forward pass"
        self.stores: dict[int, FakeStore] = {}
        self.groups: dict[str, FakeGroup] = {}
        self.ranks: list[Rank] = []
        self.peer_state = {"w": torch.tensor([7.0, 8.0])}
        self.peer_batches = 11

    def recovered(self, step: int) -> dict[str, Any]:
        return {"user": {"default": {k: v.clone() for k, v in self.peer_state.items()}},
                "torchft": {"step": step, "batches_committed": self.peer_batches}}

    # the module-level names the Manager uses, faked

    def tcp_store(self, host_name: str = "", port: int = 0, **kwargs: Any) -> FakeStore:
        return self.stores.setdefault(port, FakeStore())

    def manager_server(self, **kwargs: Any) -> FakeGroup:
        name = kwargs["replica_id"]
        group = FakeGroup(self, name, kwargs["world_size"])
        self.groups[group.address()] = group
        return group

    def manager_client(self, address: str, connect_timeout: Any = None) -> Any:
        return self.groups.get(address) or FakeSource(address)

    def group(self, name: str, world_size: int = 1, *, use_async_quorum: bool = True,
              state_dict: Callable[[Rank], Callable[[], Any]] | None = None,
              load_state_dict: Callable[[Rank], Callable[[Any], None]] | None = None,
              **kwargs: Any) -> list[Rank]:
        """The ranks of a new replica group (rank 0 first: it publishes the manager's address)."""
        port = len(self.stores) + 1
        self.stores[port] = FakeStore()
        out = []
        for r in range(world_size):
            rank = Rank(manager=None, transport=FakeTransport(self, r), pg=FakePG(),  # type: ignore[arg-type]
                        state={"w": torch.zeros(2)})

            def default_state_dict(rank: Rank = rank) -> dict[str, torch.Tensor]:
                rank.reads.append((threading.current_thread().name, self.forward_running.is_set()))
                return dict(rank.state)

            def default_load(sd: dict[str, torch.Tensor], rank: Rank = rank) -> None:
                rank.loads.append(sd)
                rank.state.update(sd)

            rank.manager = Manager(
                pg=rank.pg, min_replica_size=1, use_async_quorum=use_async_quorum, timeout=TIMEOUT,
                quorum_timeout=TIMEOUT, connect_timeout=TIMEOUT, rank=r, world_size=world_size,
                store_addr="fakehost", store_port=port, lighthouse_addr="http://lighthouse:1", replica_id=name,
                hostname="fakehost", checkpoint_transport=rank.transport, liveness_interval=None,
                state_dict=state_dict(rank) if state_dict else default_state_dict,
                load_state_dict=load_state_dict(rank) if load_state_dict else default_load, **kwargs)
            out.append(rank)
        self.ranks.extend(out)
        return out

    def behind_us(self, step: int) -> None:
        """The next quorums have one more replica group, at ``step`` (behind: it heals from us)."""
        self.peers = [PeerInfo(replica_id="zz-behind", address="fake://zz-behind", step=step)]

    def ahead_of_us(self, step: int) -> None:
        """The next quorums have one more replica group, at ``step`` (ahead: we heal from it)."""
        self.peers = [PeerInfo(replica_id="aa-ahead", address="fake://aa-ahead", step=step)]


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeWorld]:
    w = FakeWorld()
    monkeypatch.setattr(manager_module, "TCPStore", w.tcp_store)
    monkeypatch.setattr(manager_module, "ManagerServer", w.manager_server)
    monkeypatch.setattr(manager_module, "LocalManagerClient", lambda server: server)
    monkeypatch.setattr(manager_module, "ManagerClient", w.manager_client)
    yield w
    w.gate.set()
    for r in w.ranks:
        r.manager.shutdown(wait=False)


@dataclass
class StepOut:
    committed: bool
    step_mid: int  # current_step() once the quorum (and the transfer) is in
    step: int
    allreduced: bool  # the allreduce ran on the process group (was not skipped)


def step(r: Rank, before_forward: Callable[[], None] = lambda: None) -> StepOut:
    """One training step of ``r``: quorum, a "forward pass", an allreduce, the commit."""
    m = r.manager
    m.start_quorum()
    before_forward()
    n = r.pg.allreduces
    m.allreduce(torch.zeros(2)).wait()
    m.wait_quorum()
    step_mid = m.current_step()
    committed = m.should_commit()
    return StepOut(committed, step_mid, m.current_step(), r.pg.allreduces > n)


# -- where the donor's state dict is taken ------------------------------------------------------------------


def test_async_quorum_takes_the_state_dict_on_the_training_thread_just_before_the_forward_pass(
        world: FakeWorld) -> None:
    batches = {"seen": 0}
    main = threading.current_thread().name

    def counting(rank: Rank) -> Callable[[], Any]:
        def state_dict() -> dict[str, Any]:
            rank.reads.append((threading.current_thread().name, world.forward_running.is_set()))
            return {"w": rank.state["w"], "batches_seen": batches["seen"]}
        return state_dict

    [donor] = world.group("donor", state_dict=counting)
    donor.manager.load_state_dict({"step": 3, "batches_committed": 3})
    world.behind_us(1)
    hooks_before = len(module_hooks._global_forward_pre_hooks)

    class Model(nn.Module):
        """Its forward pass holds until the quorum thread has served the state dict."""

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            world.forward_running.set()
            try:
                world.gate.set()  # the quorum, and the serving, happen during this forward pass
                donor.manager.wait_quorum()
                return self.lin(x)
            finally:
                world.forward_running.clear()

    model = Model()

    def fetch_batch_then_forward() -> None:
        batches["seen"] += 1  # what the training loop does between start_quorum and the forward
        model(torch.zeros(1, 2))

    world.gate.clear()  # the quorum waits for the forward pass
    out = step(donor, fetch_batch_then_forward)
    assert out.committed and out.step == 4
    assert donor.reads == [(main, False)]  # once, on the training thread, not during the forward pass
    [sent] = donor.transport.sent
    assert sent.during_forward and sent.thread.name.startswith("ftclient_async_quorum")
    assert sent.step == 3 and sent.state_dict["torchft"] == {"step": 3, "batches_committed": 3}
    assert sent.state_dict["user"]["default"]["w"] is donor.state["w"]  # references, no copy
    assert sent.state_dict["user"]["default"]["batches_seen"] == 1  # as of the forward pass
    assert donor.transport.disallows == 1 and donor.manager._captured_state_dict is None
    assert len(module_hooks._global_forward_pre_hooks) == hooks_before  # the pre-hook is gone

    # Every step takes it (the quorum's answer comes too late to know), served or not; a step
    # without a module call takes it at its first Manager call that waits for the quorum.
    world.peers = []
    out = step(donor)
    assert out.committed and donor.reads[1:] == [(main, False)] and len(donor.transport.sent) == 1
    assert len(module_hooks._global_forward_pre_hooks) == hooks_before

    # A module call on another thread is not the training thread's forward pass.
    donor.manager.start_quorum()
    assert len(module_hooks._global_forward_pre_hooks) == hooks_before + 1
    run_on_threads([lambda: model.lin(torch.zeros(1, 2))], JOIN_S)
    assert len(donor.reads) == 2
    donor.manager.shutdown()
    assert len(module_hooks._global_forward_pre_hooks) == hooks_before  # nor past shutdown


def test_sync_quorum_takes_the_state_dict_only_to_serve_it_while_start_quorum_waits(world: FakeWorld) -> None:
    in_start_quorum = threading.Event()
    reads: list[tuple[str, bool]] = []

    def recording(rank: Rank) -> Callable[[], Any]:
        def state_dict() -> dict[str, torch.Tensor]:
            reads.append((threading.current_thread().name, in_start_quorum.is_set()))
            return dict(rank.state)
        return state_dict

    [donor] = world.group("donor", use_async_quorum=False, state_dict=recording)
    donor.manager.load_state_dict({"step": 2, "batches_committed": 2})

    def step_in_start_quorum() -> StepOut:
        original = donor.manager.start_quorum

        def start_quorum() -> None:
            in_start_quorum.set()
            try:
                original()
            finally:
                in_start_quorum.clear()

        donor.manager.start_quorum = start_quorum  # type: ignore[method-assign]
        try:
            return step(donor)
        finally:
            del donor.manager.start_quorum

    assert step_in_start_quorum().committed and reads == []  # no peer heals: never called

    world.behind_us(0)
    assert step_in_start_quorum().committed
    [(thread, waiting)] = reads
    assert thread.startswith("ftclient_async_quorum") and waiting  # while start_quorum waited for it
    [sent] = donor.transport.sent
    assert sent.step == 3 and sent.state_dict["torchft"]["step"] == 3


def test_a_state_dict_that_cannot_be_taken_fails_only_a_step_that_serves_it(world: FakeWorld) -> None:
    def failing(rank: Rank) -> Callable[[], Any]:
        def state_dict() -> Any:
            raise ValueError("no state today")
        return state_dict

    [donor] = world.group("donor", state_dict=failing)
    out = step(donor)
    assert out.committed and out.allreduced  # nobody heals from us: the error does not matter

    world.behind_us(0)
    out = step(donor)
    assert not out.committed and out.allreduced  # served nothing: no commit, but the collectives ran
    assert "no state today" in str(donor.manager.errored())
    assert donor.transport.sent == [] and donor.manager.current_step() == 1


# -- every rank of a group agrees -------------------------------------------------------------------------


def test_a_recovery_that_fails_on_one_rank_is_applied_on_no_rank(world: FakeWorld) -> None:
    r0, r1 = world.group("healer", world_size=2)
    world.ahead_of_us(5)
    r1.transport.fail_recv = RuntimeError("injected: the transfer was cut")

    o0, o1 = run_on_threads([lambda: step(r0), lambda: step(r1)], JOIN_S)
    # Rank 0 received the state (current_step() shows the step it heals to, as torchft's) ...
    assert (o0.step_mid, o1.step_mid) == (5, 0)
    # ... but the group does not commit: no rank applies it, both keep step 0 and their weights.
    assert (o0.committed, o1.committed) == (False, False) and (o0.step, o1.step) == (0, 0)
    assert r0.loads == r1.loads == [] and torch.equal(r0.state["w"], torch.zeros(2))
    assert r0.manager.batches_committed() == r1.manager.batches_committed() == 0
    assert r0.manager._pending_state_dict is None
    assert r0.manager.errored() is None and "transfer was cut" in str(r1.manager.errored())
    # The failing rank still took part in the step's collectives: its peers did not wait for it.
    assert o0.allreduced and o1.allreduced and r1.manager._collectives_errored() is None
    assert not ManagedProcessGroup(r1.manager)._errored()

    # The next quorum: the group is still behind, every rank heals and applies it.
    o0, o1 = run_on_threads([lambda: step(r0), lambda: step(r1)], JOIN_S)
    assert o0.committed and o1.committed and (o0.step, o1.step) == (6, 6)
    assert [len(r.loads) for r in (r0, r1)] == [1, 1]
    assert torch.equal(r0.state["w"], torch.tensor([7.0, 8.0])) and torch.equal(r1.state["w"], r0.state["w"])
    assert r0.manager.batches_committed() == r1.manager.batches_committed() == world.peer_batches + 1


def test_a_recovery_the_group_does_not_commit_is_dropped(world: FakeWorld) -> None:
    [r] = world.group("healer")
    world.ahead_of_us(4)

    def unlucky() -> None:
        r.manager.report_error(RuntimeError("a gradient was bad"))

    out = step(r, unlucky)
    assert not out.committed and out.step_mid == 4 and out.step == 0 and r.loads == []
    assert r.manager.batches_committed() == 0


def test_a_recovered_state_without_a_registered_key_is_voted_down(world: FakeWorld) -> None:
    [r] = world.group("healer")
    r.manager.register_state_dict_fn("extra", lambda sd: None, lambda: {})
    world.ahead_of_us(4)
    out = step(r)
    assert not out.committed and out.step == 0 and r.loads == []
    assert "lacks the state of ['extra']" in str(r.manager.errored())


def test_a_load_that_fails_after_the_group_agreed_raises(world: FakeWorld) -> None:
    def broken(rank: Rank) -> Callable[[Any], None]:
        def load(sd: Any) -> None:
            raise ValueError("shape mismatch")
        return load

    [r] = world.group("healer", load_state_dict=broken)
    world.ahead_of_us(4)
    with pytest.raises(RuntimeError, match="restart the replica group"):
        step(r)


def test_sync_quorum_applies_a_heal_before_the_forward_pass_only_if_every_rank_recovered(world: FakeWorld) -> None:
    r0, r1 = world.group("healer", world_size=2, use_async_quorum=False)
    world.ahead_of_us(5)
    r1.transport.fail_recv = RuntimeError("injected: the transfer was cut")

    def after_start(r: Rank) -> Callable[[], None]:
        def check() -> None:
            # Nothing applied before the forward pass, on either rank; the step fails on both.
            assert r.loads == [] and r.manager.current_step() == 0 and r.manager.errored() is not None
        return check

    o0, o1 = run_on_threads([lambda: step(r0, after_start(r0)), lambda: step(r1, after_start(r1))], JOIN_S)
    assert (o0.committed, o1.committed) == (False, False) and (o0.step, o1.step) == (0, 0)
    # The group's gradients would come from the old weights: its collectives are skipped.
    assert not o0.allreduced and not o1.allreduced
    # The heal vote, then the commit vote, on each rank.
    assert sorted(world.groups["fake://" + r0.manager.replica_id].votes) == [(0, False), (0, True), (1, False),
                                                                             (1, False)]

    def healed(r: Rank) -> Callable[[], None]:
        def check() -> None:
            assert len(r.loads) == 1 and r.manager.current_step() == 5  # applied in start_quorum
        return check

    o0, o1 = run_on_threads([lambda: step(r0, healed(r0)), lambda: step(r1, healed(r1))], JOIN_S)
    assert o0.committed and o1.committed and (o0.step, o1.step) == (6, 6) and o0.allreduced


def test_should_commit_closes_the_transport_even_when_its_vote_fails(world: FakeWorld) -> None:
    [donor] = world.group("donor")
    world.behind_us(0)
    group = world.groups["fake://" + donor.manager.replica_id]
    group.vote_error = TimeoutError("group ranks [1] did not vote in time")
    donor.manager.start_quorum()
    donor.manager.wait_quorum()
    assert donor.transport.sent and donor.manager._captured_state_dict is not None
    with pytest.raises(TimeoutError):
        donor.manager.should_commit()
    assert donor.transport.disallows == 1 and donor.manager._captured_state_dict is None


def test_group_heals_agrees_with_compute_quorum_results_for_every_group_rank() -> None:
    rng = random.Random(31)
    for _ in range(2000):
        n = rng.randint(1, 4)
        steps = [rng.choice([0, 0, 1, 3]) for _ in range(n)]
        peers = tuple(PeerInfo(replica_id=f"g{i}", address=f"a{i}", step=s) for i, s in enumerate(steps))
        quorum = QuorumView(1, peers)
        world_size, init_sync = rng.randint(1, 3), rng.random() < 0.7
        for me in (p.replica_id for p in peers):
            results = [compute_quorum_results(me, r, quorum, init_sync) for r in range(world_size)]
            expected = any(res.heal for res in results)
            assert {_group_heals(res, world_size, init_sync) for res in results} == {expected}, \
                (steps, me, world_size, init_sync)


class EventLog:
    """Stands in for ``manager._ACCELERATOR``: one stream per thread unless entered, events that
    name their stream; every call that orders work is logged with the calling thread."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, str]] = []
        self.local = threading.local()

    def _stream(self) -> str:
        return getattr(self.local, "stream", f"default@{threading.current_thread().name}")

    def available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def set_device(self, index: int) -> None:
        pass

    def new_stream(self) -> str:
        return "recovery"

    def current_stream(self) -> str:
        return self._stream()

    @contextlib.contextmanager
    def stream_context(self, stream: str | None) -> Iterator[None]:
        previous = getattr(self.local, "stream", None)
        self.local.stream = stream or self._stream()
        try:
            yield
        finally:
            if previous is None:
                del self.local.stream
            else:
                self.local.stream = previous

    def record_event(self) -> Any:
        event = SimpleNamespace(name=f"event on {self._stream()}", synchronize=lambda: None)
        self.log.append(("record_event", event.name, threading.current_thread().name))
        return event

    def wait_event(self, event: Any) -> None:
        self.log.append(("wait_event", f"{self._stream()} waits for {event.name}", threading.current_thread().name))

    def synchronize(self) -> None:
        pass


def test_on_an_accelerator_the_served_state_is_ordered_after_the_training_threads_work(
        world: FakeWorld, monkeypatch: pytest.MonkeyPatch) -> None:
    accel = EventLog()
    monkeypatch.setattr(manager_module, "_ACCELERATOR", accel)
    [donor] = world.group("donor")
    world.behind_us(0)
    sends: list[int] = []
    original = donor.transport.send_checkpoint

    def send(*args: Any, **kwargs: Any) -> None:
        sends.append(len(accel.log))
        original(*args, **kwargs)

    donor.transport.send_checkpoint = send  # type: ignore[method-assign]
    assert step(donor).committed
    main = threading.current_thread().name
    # start_quorum records an event on the training thread's stream (after the last optimizer
    # step's work); the quorum thread's recovery stream waits for it before serialising.
    first = accel.log[0]
    assert first == ("record_event", f"event on default@{main}", main)
    waits = [e for e in accel.log if e[0] == "wait_event"]
    assert waits == [("wait_event", f"recovery waits for event on default@{main}", waits[0][2])]
    assert waits[0][2].startswith("ftclient_async_quorum")
    assert accel.log.index(waits[0]) < sends[0]


@pytest.mark.parametrize("use_async_quorum", [True, False], ids=["async", "sync"])
def test_every_rank_of_a_group_takes_and_loads_a_state_dict_when_one_of_them_heals(
        world: FakeWorld, use_async_quorum: bool) -> None:
    """``init_sync`` on step 0 heals some ranks of a group only: group rank r heals unless its
    group is r's primary. A user's state_dict() and load_state_dict() may run collectives over the
    replica group (torchtitan's FSDP2 hooks gather DTensors), so every rank of the group calls
    them at the same point: the rank that does not heal loads its own state alongside."""
    r0, r1 = world.group("healer", world_size=2, use_async_quorum=use_async_quorum)
    world.behind_us(0)  # both at step 0: rank 0's primary is this group, rank 1's the other

    o0, o1 = run_on_threads([lambda: step(r0), lambda: step(r1)], JOIN_S)
    assert o0.committed and o1.committed and (o0.step, o1.step) == (1, 1)
    q0, q1 = r0.manager.last_quorum_result, r1.manager.last_quorum_result
    assert q0 is not None and q1 is not None and not q0.heal and q1.heal
    assert len(r0.transport.sent) == 1 and r1.transport.received == [0]
    # Both ranks took their state dict once, and both loaded one: rank 1 the peer's, rank 0 its own.
    assert len(r0.reads) == len(r1.reads) == 1
    [own] = r0.loads
    assert own["w"] is r0.state["w"]
    [peer] = r1.loads
    assert torch.equal(peer["w"], world.peer_state["w"])

    # Without a heal in the group, nobody loads (and with the synchronous quorum nobody reads).
    world.peers = []
    run_on_threads([lambda: step(r0), lambda: step(r1)], JOIN_S)
    assert (len(r0.loads), len(r1.loads)) == (1, 1)
    assert len(r0.reads) == len(r1.reads) == (2 if use_async_quorum else 1)
