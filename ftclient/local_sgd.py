"""Semi-synchronous training: fault-tolerant LocalSGD and (Streaming) DiLoCo on ftclient's Manager
(ftclient's counterpart of ``torchft.local_sgd``; same constructor arguments).

Both wrap a plain torch optimizer with step hooks: replica groups train locally and only meet every
few steps, so a quorum, a collective and a commit happen once per synchronisation instead of once
per step.

:class:`LocalSGD` (https://arxiv.org/abs/1805.09767): every ``sync_every`` optimizer steps, start a
quorum, average the parameters across the participating replica groups and, only if the commit
succeeds, replace the local parameters with the average (a failed commit keeps the local ones).

:class:`DiLoCo` (https://arxiv.org/abs/2311.08105) and its streaming variant
(https://arxiv.org/abs/2501.18512): every replica group keeps a backup of the *global* parameters
(the ones every group agrees on). The model is split into fragments; every ``sync_every /
len(fragments)`` inner steps (a *round*) one fragment is synchronised, in turn (fragment
``manager.current_step() % len(fragments)``, so every group picks the same one and a failed round
retries its fragment):

1. ``fragment_sync_delay`` inner steps before the end of the round: start the quorum (a replica
   group that is behind or new heals here, before anything is sent), compute the fragment's
   pseudo-gradient ``global - local`` and start averaging it across the participants (one
   allreduce per tensor, or per bucket with ``use_bucketization``). Training goes on meanwhile.
2. At the end of the round: wait for the average, reset the fragment to its global parameters and
   ask ``manager.should_commit()``. On commit the outer optimizer steps the fragment with the
   averaged pseudo-gradient as its gradient, the result becomes the new global backup, and the
   fragment's parameters become ``lerp(new_global, local, fragment_update_alpha)``. Without a
   commit nothing global changes: the fragment stays at its previous global parameters (its local
   progress is dropped) and the outer optimizer does not step.

Recovery: DiLoCo registers its whole state with ``manager.register_state_dict_fn``: per fragment
the global backup and the outer optimizer state (``StreamingDiLoCoFragment_{i}``, torchft's key and
layout), and the local state, i.e. the fragments' parameters and buffers and the inner optimizer
state (``DiLoCo``). A replica group that restarts, or joins mid-run, heals all of it from a peer at
the next synchronisation's quorum and takes part in that very round.

The Manager must use the synchronous quorum for DiLoCo (``use_async_quorum=False``), as in torchft.

Sharded parameters (FSDP2's ``fully_shard``, i.e. ``DTensor``s, as in torchtitan's HSDP): each rank
of a replica group averages its *local shard* (``param.to_local()``) with the same rank of the other
replica groups, which hold the same shard, and writes the result back into its local shard; the
global backups are local shards too (torchft's ``extract_local_tensor`` layout), and the outer
optimizer steps the DTensor parameters with DTensor gradients built from the averaged local
pseudo-gradients. Nothing is gathered.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "USE_BUCKETIZATION_ENV",
    "DiLoCo",
    "LocalSGD",
    "SyncResult",
    "plan_buckets",
]

logger: logging.Logger = logging.getLogger(__name__)

USE_BUCKETIZATION_ENV = "TORCHFT_USE_BUCKETIZATION"
"""``True`` turns bucketization on for every DiLoCo (torchft's variable)."""

DEFAULT_BUCKET_CAP_MB = 32.0
"""Bucket size (MiB) when bucketization is on and ``bucket_cap_mb`` is not given."""

_FRAGMENT_KEY = "StreamingDiLoCoFragment_{}"  # torchft's key: fragment backup + outer optimizer
_LOCAL_KEY = "DiLoCo"  # fragments' parameters and buffers + inner optimizer state


class _Manager(Protocol):
    """What LocalSGD and DiLoCo use of :class:`ftclient.Manager`."""

    def start_quorum(self) -> None: ...

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False) -> Any: ...

    def should_commit(self) -> bool: ...

    def current_step(self) -> int: ...

    def report_error(self, e: Exception) -> None: ...

    def num_participants(self) -> int: ...

    def register_state_dict_fn(self, key: str, load_state_dict: Callable[[Any], None],
                               state_dict: Callable[[], Any]) -> None: ...

    def allow_state_dict_read(self) -> None: ...

    def disallow_state_dict_read(self) -> None: ...


@dataclass(frozen=True)
class SyncResult:
    """What one synchronisation did (``LocalSGD.last_sync`` / ``DiLoCo.last_sync``).

    ``fragment``: the fragment synchronised (DiLoCo), None for LocalSGD. ``committed``: the
    manager's commit decision. ``step``: ``manager.current_step()`` after it (committed
    synchronisations so far, over the whole job). ``quorum_id`` / ``participants``: the quorum the
    synchronisation ran in (``quorum_id`` is None with a manager that does not expose
    ``last_quorum_result``). ``healed``: this replica group loaded a peer's state in that quorum.
    """

    fragment: int | None
    committed: bool
    step: int
    quorum_id: int | None
    participants: int
    healed: bool


def _sync_result(manager: _Manager, fragment: int | None, committed: bool) -> SyncResult:
    quorum = getattr(manager, "last_quorum_result", None)
    try:
        participants = int(manager.num_participants())
    except Exception:  # noqa: BLE001 -- informational only
        participants = 0
    return SyncResult(fragment=fragment, committed=bool(committed), step=int(manager.current_step()),
                      quorum_id=getattr(quorum, "quorum_id", None), participants=participants,
                      healed=bool(getattr(quorum, "heal", False)))


def _check_supported(name: str, p: torch.Tensor) -> None:
    if type(p) not in (torch.Tensor, nn.Parameter) and not isinstance(p, DTensor):
        raise TypeError(f"parameter {name!r} is a {type(p).__name__}: ftclient's LocalSGD/DiLoCo handle plain "
                        "tensors and DTensors (FSDP2) only, no other tensor subclass")


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``p``, detached, sharing its storage: the local shard of a DTensor
    (writes land in the parameter), else ``p`` itself."""
    t = p.detach()
    return t.to_local() if isinstance(t, DTensor) else t


def _like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's part) as a tensor of ``p``'s kind: a DTensor with ``p``'s mesh,
    placements, shape and stride for a DTensor ``p``, else ``local`` itself."""
    if isinstance(p, DTensor):
        return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    return local


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` with ``fn`` applied to every tensor (dicts, lists and tuples rebuilt)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        out = {k: _map_tensors(v, fn) for k, v in obj.items()}
        metadata = getattr(obj, "_metadata", None)  # a module state_dict's version info
        if metadata is not None:
            out = OrderedDict(out)
            out._metadata = metadata  # type: ignore[attr-defined]
        return out
    if isinstance(obj, list):
        return [_map_tensors(v, fn) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_map_tensors(v, fn) for v in obj)
    return obj


def _clone_tree(obj: Any) -> Any:
    """``obj`` with every tensor cloned; a DTensor becomes a clone of its local shard."""
    return _map_tensors(obj, lambda t: _local(t).clone())


def _localized(obj: Any) -> Any:
    """``obj`` with every DTensor replaced by its local shard (a view, not a copy)."""
    return _map_tensors(obj, lambda t: _local(t) if isinstance(t, DTensor) else t)


def _load_module_state(module: nn.Module, state: dict[str, Any]) -> None:
    """``module.load_state_dict(state)`` where ``state`` holds local shards for the module's
    DTensor entries (as :func:`_clone_tree` saves them)."""
    current = module.state_dict()
    out = OrderedDict((k, _like(current[k], v) if isinstance(current.get(k), DTensor) and not isinstance(v, DTensor)
                       else v) for k, v in state.items())
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:
        out._metadata = metadata  # type: ignore[attr-defined]
    module.load_state_dict(out)


def _load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """``optimizer.load_state_dict`` of a copy of ``state``, whose per-parameter tensors of a
    DTensor parameter may be local shards (as :func:`_clone_tree` / :func:`_localized` save
    them): those shaped like the parameter's local shard become DTensors like the parameter.

    Two layouts: torch's own (per-parameter state under ``"state"``, keyed by the parameter's
    index), and any other whose ``state_dict()`` already holds this optimizer's state as DTensors
    (torchtitan's ``OptimizersContainer``: DCP's flattened ``"state.<fqn>.exp_avg"`` keys). In the
    second, an entry is made a DTensor like the receiver's own entry at the same place; a
    plain tensor left there would meet DTensor parameters in the next step ("got mixed
    torch.Tensor and DTensor", in fused AdamW)."""
    state = _clone_tree(state)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for index, per_param in state.get("state", {}).items():
        if not (isinstance(index, int) and 0 <= index < len(params) and isinstance(params[index], DTensor)):
            continue
        p = params[index]
        local_shape = _local(p).shape
        for key, value in list(per_param.items()):
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == local_shape:
                per_param[key] = _like(p, value)
    if params and any(isinstance(p, DTensor) for p in params):
        state = _as_dtensors_like(optimizer.state_dict(), state)
    optimizer.load_state_dict(state)


def _as_dtensors_like(template: Any, value: Any) -> Any:
    """``value`` with each plain tensor that sits where ``template`` (the same structure) has a
    DTensor whose local shard is of its shape turned into a DTensor like that one."""
    if isinstance(value, torch.Tensor):
        if (isinstance(template, DTensor) and not isinstance(value, DTensor)
                and value.shape == template.to_local().shape):
            return _like(template, value)
        return value
    if isinstance(value, dict) and isinstance(template, dict):
        out = type(value)() if isinstance(value, OrderedDict) else {}
        for k, v in value.items():
            out[k] = _as_dtensors_like(template.get(k), v)
        metadata = getattr(value, "_metadata", None)
        if metadata is not None:
            out = OrderedDict(out)
            out._metadata = metadata  # type: ignore[attr-defined]
        return out
    if isinstance(value, (list, tuple)) and isinstance(template, (list, tuple)) and len(value) == len(template):
        items = [_as_dtensors_like(t, v) for t, v in zip(template, value)]
        return type(value)(items) if isinstance(value, tuple) else items
    return value


def _is_ftclient_manager(manager: object) -> bool:
    from .manager import Manager  # here: the manager's module is heavy and needs nothing from this one

    return isinstance(manager, Manager)


def _env_bucketization() -> bool:
    return os.environ.get(USE_BUCKETIZATION_ENV, "").strip().lower() in ("true", "1", "yes")


# -- averaging -------------------------------------------------------------------------------------


def plan_buckets(tensors: Sequence[torch.Tensor], cap_bytes: int) -> list[list[int]]:
    """Group ``tensors`` (by index) into allreduce buckets of at most ``cap_bytes`` each.

    Tensors of one dtype and device go together, in order (groups in order of first appearance);
    a bucket is closed when the next tensor would overflow it. A tensor larger than ``cap_bytes``
    is a bucket of its own (it is reduced in place, without a copy). Every tensor is in exactly
    one bucket.
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive, got {cap_bytes} bytes")
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    buckets: list[list[int]] = []
    for indices in groups.values():
        current: list[int] = []
        size = 0
        for i in indices:
            nbytes = tensors[i].numel() * tensors[i].element_size()
            if current and size + nbytes > cap_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append(i)
            size += nbytes
        if current:
            buckets.append(current)
    return buckets


class _Average:
    """An in-flight average of ``tensors`` (in place) through ``manager.allreduce``: one call per
    tensor, or per bucket when ``cap_bytes`` is given. ``wait()`` blocks until every result is in
    the tensors; it never raises (an error is reported to the manager, so the commit fails)."""

    def __init__(self, manager: _Manager, tensors: list[torch.Tensor], cap_bytes: int | None,
                 should_quantize: bool) -> None:
        self._manager = manager
        self._pending: list[tuple[Any, torch.Tensor | None, list[torch.Tensor]]] = []
        self.calls = 0
        if cap_bytes is None:
            buckets = [[i] for i in range(len(tensors))]
        else:
            buckets = plan_buckets(tensors, cap_bytes)
        for bucket in buckets:
            members = [tensors[i] for i in bucket]
            if len(members) == 1:
                flat = None
                target = members[0]
            else:
                flat = torch.cat([t.reshape(-1) for t in members])
                target = flat
            if target.numel() == 0:
                continue  # an empty local shard (FSDP2 on more ranks than rows): nothing to average
            self.calls += 1
            try:
                work = manager.allreduce(target, should_quantize=should_quantize)
            except NotImplementedError:
                raise  # a setting the manager does not support (should_quantize): not a failed step
            except Exception as e:  # noqa: BLE001 -- ftclient's Manager never raises; others might
                manager.report_error(e)
                work = None
            self._pending.append((work, flat, members))

    def wait(self) -> None:
        pending, self._pending = self._pending, []
        for work, flat, members in pending:
            if work is None:
                continue
            try:
                work.wait()
            except Exception as e:  # noqa: BLE001 -- the commit will fail
                self._manager.report_error(e)
                continue
            if flat is not None:
                offset = 0
                for t in members:
                    n = t.numel()
                    t.copy_(flat[offset:offset + n].view_as(t))
                    offset += n


# -- LocalSGD ----------------------------------------------------------------------------------------


class _StepHooks:
    """Registers pre/post step hooks on an optimizer while used as a context manager."""

    _optimizer: torch.optim.Optimizer
    _manager: _Manager

    def _hooks_enter(self) -> None:
        if self._handles:
            raise RuntimeError(f"{type(self).__name__} is already entered")
        self._handles = [self._optimizer.register_step_pre_hook(self._step_pre_hook),
                         self._optimizer.register_step_post_hook(self._step_post_hook)]

    def _hooks_exit(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _step_pre_hook(self, _optim: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        # A peer may be reading our state for a checkpoint: not while the optimizer mutates it.
        self._manager.disallow_state_dict_read()

    def _step_post_hook(self, _optim: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        self._manager.allow_state_dict_read()
        self._after_step()

    def _after_step(self) -> None:
        raise NotImplementedError


class LocalSGD(_StepHooks):
    """Fault-tolerant LocalSGD: local optimizer steps, and every ``sync_every`` steps a quorum and
    an average of the parameters across the participating replica groups, applied only when the
    commit succeeds (otherwise the local parameters are kept and training goes on).

    Use as a context manager around the training loop (it hooks ``optimizer.step()``)::

        with LocalSGD(manager, model, optimizer, sync_every=8) as local_sgd:
            for batch in data:
                optimizer.zero_grad()
                loss_fn(model(batch)).backward()
                optimizer.step()          # syncs on every 8th call

    The optimizer is a plain torch optimizer (not ``ftclient.Optimizer``). Register the model and
    optimizer state with the Manager (``state_dict=``/``load_state_dict=``) so a restarted replica
    group heals; it is brought in at the next synchronisation. Buffers are not averaged.
    Works with the asynchronous and the synchronous quorum.

    Args:
        manager: the replica group's :class:`ftclient.Manager`.
        model: the model whose parameters are averaged.
        optimizer: the local optimizer.
        sync_every: optimizer steps between synchronisations (>= 1).
    """

    def __init__(self, manager: _Manager, model: nn.Module, optimizer: torch.optim.Optimizer,
                 sync_every: int) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        for name, p in model.named_parameters():
            _check_supported(name, p)
        self._manager = manager
        self._model = model
        self._optimizer = optimizer
        self._sync_every = sync_every
        self._local_step = 0
        self._handles: list[RemovableHandle] = []
        self.last_sync: SyncResult | None = None
        self.syncs = 0

    def __enter__(self) -> "LocalSGD":
        self._hooks_enter()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        self._hooks_exit()
        return False

    @property
    def local_step(self) -> int:
        """Optimizer steps since the last synchronisation."""
        return self._local_step

    def _after_step(self) -> None:
        self._local_step += 1
        if self._local_step >= self._sync_every:
            self.sync()

    def sync(self) -> bool:
        """Synchronise now: quorum, average, commit. Returns whether the average was applied."""
        self._manager.start_quorum()
        params = [p for p in self._model.parameters()]
        averaged = [_local(p).clone() for p in params]  # a DTensor's local shard
        _Average(self._manager, averaged, None, False).wait()
        committed = self._manager.should_commit()
        if committed:
            with torch.no_grad():
                for p, avg in zip(params, averaged):
                    _local(p).copy_(avg)
        self._local_step = 0
        self.syncs += 1
        self.last_sync = _sync_result(self._manager, None, committed)
        return committed


# -- DiLoCo ------------------------------------------------------------------------------------------


def _pin_memory_possible() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    return bool(accelerator is not None and accelerator.is_available())


class _Fragment:
    """One model fragment: its global backup, its outer optimizer, its in-flight average."""

    def __init__(self, index: int, module: nn.Module, outer_optimizer: torch.optim.Optimizer,
                 backup_device: torch.device | None, pin_memory: bool) -> None:
        self.index = index
        self.module = module
        self.outer_optimizer = outer_optimizer
        self.named_params: list[tuple[str, nn.Parameter]] = list(module.named_parameters())
        if not self.named_params:
            raise ValueError(f"model fragment {index} has no parameters")
        for name, p in self.named_params:
            _check_supported(name, p)
        outer_params = {id(p) for g in outer_optimizer.param_groups for p in g["params"]}
        missing = [name for name, p in self.named_params if id(p) not in outer_params]
        if missing:
            raise ValueError(f"the outer optimizer of fragment {index} does not hold its parameters {missing}: "
                             "the outer step could never move them")
        own = {id(p) for _, p in self.named_params}
        # Parameters of the outer optimizer that belong to other fragments (one shared outer
        # optimizer): their gradients are kept out of this fragment's outer step.
        self.foreign_params = [p for g in outer_optimizer.param_groups for p in g["params"] if id(p) not in own]
        device = backup_device or torch.device("cpu")
        self.backup: dict[str, torch.Tensor] = {}
        for name, p in self.named_params:
            t = torch.empty(_local(p).shape, dtype=p.dtype, device=device)  # a DTensor's local shard
            if pin_memory and t.device.type == "cpu" and _pin_memory_possible():
                t = t.pin_memory()
            self.backup[name] = t
        self._pseudograds: list[torch.Tensor] | None = None
        self._average: _Average | None = None

    @property
    def in_flight(self) -> bool:
        return self._average is not None

    def save_backup(self) -> None:
        with torch.no_grad():
            for name, p in self.named_params:
                self.backup[name].copy_(_local(p))

    def restore(self) -> None:
        with torch.no_grad():
            for name, p in self.named_params:
                _local(p).copy_(self.backup[name])

    def prepare(self, manager: _Manager, cap_bytes: int | None, should_quantize: bool) -> int:
        """Compute the pseudo-gradients (global - local) and start averaging them. Returns the
        number of allreduce calls."""
        assert self._average is None, "the previous synchronisation of this fragment was not performed"
        with torch.no_grad():
            self._pseudograds = [self.backup[name].to(p.device) - _local(p) for name, p in self.named_params]
        self._average = _Average(manager, self._pseudograds, cap_bytes, should_quantize)
        return self._average.calls

    def perform(self, manager: _Manager, alpha: float) -> bool:
        """Wait for the average, reset to the global parameters, commit and (on commit) step the
        outer optimizer. Returns the commit decision."""
        assert self._average is not None and self._pseudograds is not None, "prepare() was not called"
        average, self._average = self._average, None
        pseudograds, self._pseudograds = self._pseudograds, None
        average.wait()
        local = [_local(p).clone() for _, p in self.named_params] if alpha > 0 else None
        self.restore()
        committed = manager.should_commit()
        if not committed:
            return False
        stashed = [p.grad for p in self.foreign_params]
        try:
            for p in self.foreign_params:
                p.grad = None
            for (_, p), g in zip(self.named_params, pseudograds):
                p.grad = _like(p, g)  # a DTensor parameter gets a DTensor gradient
            self.outer_optimizer.step()
        finally:
            for (_, p) in self.named_params:
                p.grad = None
            for p, g in zip(self.foreign_params, stashed):
                p.grad = g
        self.save_backup()
        if local is not None:
            with torch.no_grad():
                for (_, p), mine in zip(self.named_params, local):
                    _local(p).lerp_(mine, alpha)
        return True

    # recovery

    def state_dict(self) -> dict[str, Any]:
        # References: the backup and the outer state change only after should_commit, which
        # closes the checkpoint transport first.
        # DTensor states (an FSDP2 model's momentum buffers) travel as their local shards.
        return {"original_parameters": dict(self.backup),
                "outer_optimizer": _localized(self.outer_optimizer.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for name, t in state["original_parameters"].items():
                if name not in self.backup:
                    raise KeyError(f"fragment {self.index} has no parameter {name!r}")
                self.backup[name].copy_(t)
        _load_optimizer_state(self.outer_optimizer, state["outer_optimizer"])


class DiLoCo(_StepHooks):
    """Fault-tolerant (Streaming) DiLoCo: see the module docstring.

    Use as a context manager around the training loop (it hooks ``inner_optimizer.step()``)::

        manager = Manager(pg, None, None, min_replica_size=1, use_async_quorum=False, ...)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        with DiLoCo(manager, [model], inner, outer, sync_every=32) as diloco:
            for batch in data:
                inner.zero_grad()
                loss_fn(model(batch)).backward()
                inner.step()            # every 32nd call synchronises

    Args:
        manager: the replica group's :class:`ftclient.Manager`, with ``use_async_quorum=False``.
        model_fragments: disjoint modules covering the model; one is synchronised per round.
        inner_optimizer: a plain torch optimizer over the model, stepped every step.
        outer_optimizer: one optimizer over every fragment, or a list with one per fragment;
            it steps each fragment on its averaged pseudo-gradient.
        sync_every: inner steps in which every fragment is synchronised once (a multiple of the
            number of fragments); a round is ``sync_every / len(model_fragments)`` steps.
        backup_device: where the global backups live (default CPU).
        pin_memory: pin CPU backups when an accelerator is present.
        use_bucketization: average the pseudo-gradients in flat buckets (fewer, larger
            allreduces); also turned on by ``TORCHFT_USE_BUCKETIZATION=True``.
        bucket_cap_mb: bucket size in MiB (default :data:`DEFAULT_BUCKET_CAP_MB`).
        should_quantize: passed to ``manager.allreduce``; ftclient's Manager has no quantized
            collectives, so with it DiLoCo raises ``NotImplementedError`` here.
        fragment_sync_delay: inner steps between starting a fragment's average and using it
            (Streaming DiLoCo's tau); less than a round.
        fragment_update_alpha: after a committed round the fragment becomes
            ``lerp(global, local, alpha)``: 0 = the new global parameters, 1 = keep local ones.
    """

    def __init__(
        self,
        manager: _Manager,
        model_fragments: list[nn.Module],
        inner_optimizer: torch.optim.Optimizer,
        outer_optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
        sync_every: int,
        backup_device: torch.device | None = None,
        pin_memory: bool = True,
        use_bucketization: bool = False,
        bucket_cap_mb: float | None = None,
        should_quantize: bool = False,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
    ) -> None:
        if should_quantize and _is_ftclient_manager(manager):
            raise NotImplementedError("DiLoCo(should_quantize=True): ftclient's Manager has no quantized collectives "
                                      "(torchft's fp8 path needs CUDA and Triton); pass should_quantize=False")
        if getattr(manager, "_use_async_quorum", False):
            raise ValueError("DiLoCo needs the synchronous quorum: create the Manager with use_async_quorum=False")
        fragments = list(model_fragments)
        if not fragments:
            raise ValueError("DiLoCo needs at least one model fragment")
        n = len(fragments)
        if isinstance(outer_optimizer, (list, tuple)):
            if len(outer_optimizer) != n:
                raise ValueError(f"got {len(outer_optimizer)} outer optimizers for {n} model fragments")
            outers = list(outer_optimizer)
        else:
            outers = [outer_optimizer] * n
        if sync_every < n:
            raise ValueError(f"sync_every={sync_every} is less than the {n} fragments: only one fragment is "
                             "synchronised at a time")
        if sync_every % n != 0:
            raise ValueError(f"sync_every={sync_every} must be a multiple of the number of fragments ({n})")
        round_steps = sync_every // n
        if not 0 <= fragment_sync_delay < round_steps:
            raise ValueError(f"fragment_sync_delay={fragment_sync_delay} must be in [0, {round_steps}) (the inner "
                             "steps of a round): a fragment must be synchronised before it is sent again")
        if not 0.0 <= fragment_update_alpha <= 1.0:
            raise ValueError(f"fragment_update_alpha={fragment_update_alpha} must be between 0 and 1")
        seen: dict[int, int] = {}
        for i, module in enumerate(fragments):
            for name, p in module.named_parameters():
                if id(p) in seen and seen[id(p)] != i:
                    raise ValueError(f"parameter {name!r} is in fragments {seen[id(p)]} and {i}: fragments must be "
                                     "disjoint")
                seen[id(p)] = i
        if bucket_cap_mb is not None and bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")

        self._manager = manager
        self._optimizer = inner_optimizer
        self._round_steps = round_steps
        self._sync_every = sync_every
        self._fragment_sync_delay = fragment_sync_delay
        self._alpha = float(fragment_update_alpha)
        self._should_quantize = should_quantize
        self._use_bucketization = use_bucketization or _env_bucketization()
        cap_mb = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        self._bucket_cap_bytes: int | None = (max(1, int(cap_mb * 1024 * 1024)) if self._use_bucketization
                                              else None)
        self._fragments = [_Fragment(i, m, o, backup_device, pin_memory)
                           for i, (m, o) in enumerate(zip(fragments, outers))]
        self._local_step = 0
        self._pending_fragment: int | None = None
        self._handles: list[RemovableHandle] = []
        self.last_sync: SyncResult | None = None
        self.syncs = 0
        self.allreduce_calls = 0

        # The model as it is now is the first global state (a healing group replaces it).
        for f in self._fragments:
            f.save_backup()
        for f in self._fragments:
            manager.register_state_dict_fn(_FRAGMENT_KEY.format(f.index), f.load_state_dict, f.state_dict)
        manager.register_state_dict_fn(_LOCAL_KEY, self._load_local_state, self._local_state)

    # -- context ---------------------------------------------------------------------------------

    def __enter__(self) -> "DiLoCo":
        self._hooks_enter()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        self._hooks_exit()
        return False

    # -- schedule --------------------------------------------------------------------------------

    @property
    def local_step(self) -> int:
        """Inner steps into the current round."""
        return self._local_step

    @property
    def round_steps(self) -> int:
        """Inner steps per round (``sync_every / len(model_fragments)``)."""
        return self._round_steps

    @property
    def num_fragments(self) -> int:
        return len(self._fragments)

    @property
    def sync_in_flight(self) -> bool:
        """A fragment's quorum has started and its average is in flight (``fragment_sync_delay``)."""
        return self._pending_fragment is not None

    def current_fragment(self) -> int:
        """The fragment the next (or in-flight) synchronisation handles."""
        if self._pending_fragment is not None:
            return self._pending_fragment
        return self._manager.current_step() % len(self._fragments)

    def _after_step(self) -> None:
        self._local_step += 1
        if self._local_step == self._round_steps - self._fragment_sync_delay:
            # Every group is here at the same round: the quorum (and healing) first, then the
            # fragment is chosen from the (possibly healed) step, so every group picks the same.
            self._manager.start_quorum()
            index = self._manager.current_step() % len(self._fragments)
            self._pending_fragment = index
            calls = self._fragments[index].prepare(self._manager, self._bucket_cap_bytes, self._should_quantize)
            self.allreduce_calls += calls
            logger.debug("fragment %d: averaging started at inner step %d (%d allreduce calls)", index,
                         self._local_step, calls)
        if self._local_step == self._round_steps:
            index = self._pending_fragment
            assert index is not None
            self._pending_fragment = None
            self._local_step = 0
            committed = self._fragments[index].perform(self._manager, self._alpha)
            self.syncs += 1
            self.last_sync = _sync_result(self._manager, index, committed)
            logger.info("fragment %d synchronised: committed=%s step=%d", index, committed,
                        self.last_sync.step)

    # -- state -----------------------------------------------------------------------------------

    def global_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The global parameters (every fragment's backup) as ``("{fragment}.{name}", tensor)``:
        identical in every replica group after a committed round."""
        for f in self._fragments:
            for name, t in f.backup.items():
                yield f"{f.index}.{name}", t

    def outer_optimizers(self) -> list[torch.optim.Optimizer]:
        """The distinct outer optimizers, in fragment order."""
        out: list[torch.optim.Optimizer] = []
        for f in self._fragments:
            if all(o is not f.outer_optimizer for o in out):
                out.append(f.outer_optimizer)
        return out

    def _local_state(self) -> dict[str, Any]:
        # Copies: with fragment_sync_delay > 0 the inner steps go on while a peer downloads.
        # DTensors (FSDP2) as their local shards: rank r heals from rank r of a peer group.
        return {"fragments": [_clone_tree(f.module.state_dict()) for f in self._fragments],
                "inner_optimizer": _clone_tree(self._optimizer.state_dict())}

    def _load_local_state(self, state: dict[str, Any]) -> None:
        if len(state["fragments"]) != len(self._fragments):
            raise ValueError(f"the peer's DiLoCo has {len(state['fragments'])} fragments, this one "
                             f"{len(self._fragments)}")
        for f, sd in zip(self._fragments, state["fragments"]):
            _load_module_state(f.module, sd)
        _load_optimizer_state(self._optimizer, state["inner_optimizer"])
