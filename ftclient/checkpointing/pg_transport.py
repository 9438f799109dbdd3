"""Live recovery over the process group: a healthy replica sends its state dict to recovering
replicas with point-to-point ``send``/``recv`` on the replica groups' process group.

This module owns :class:`PGTransport`, torchft's ``PGTransport`` with the same constructor
(``pg, timeout, device, state_dict=None``) and the :class:`CheckpointTransport` interface
ftclient's Manager calls. Use it where the replica groups' network is the fast one (NCCL over
InfiniBand/NVLink, tensors already on the GPU) or where no HTTP port may be opened::

    pg = ProcessGroupGloo(timeout=timeout)
    manager = Manager(pg=pg, ..., checkpoint_transport=PGTransport(pg, timeout, torch.device("cpu")))

Sending (``send_checkpoint``) is synchronous: it returns once every destination has every
tensor, so :meth:`PGTransport.disallow_checkpoint` has nothing to wait for. The state dict is
flattened with torch's pytree (dicts, lists, tuples, OrderedDicts, namedtuples); leaves that are
tensors are sent as raw bytes, every other leaf travels pickled with the structure.

Wire format, per destination, all with the process group's ``send`` (tags in parentheses)::

    header (1): int64[4] = [MAGIC, VERSION, step, len(meta)]
    meta   (2): uint8[len(meta)]: pickle of _Meta (treespec, paths, leaves, tensor metadata)
    data (3+k): uint8[...]: message k of the plan: one tensor's bytes, or a bucket of small ones

The plan is computed from the tensors' sizes alone, on both sides: tensors of at least
``_SMALL`` bytes go alone (and can be received in place), smaller ones are packed into buckets
of up to ``_BUCKET`` bytes (one message instead of hundreds; a few hundred microseconds each).
Empty tensors send nothing. The same tensor object appearing twice (tied weights) is sent once
and stays shared on the receiver. At most ``_MAX_INFLIGHT`` messages are outstanding per side
(and destination), and a sender holds at most ``_MAX_STAGED`` bytes of staging copies (buckets,
tensors moved to ``device`` or made contiguous) before it waits for its oldest sends.

DTensors (FSDP2 / HSDP). Only the local shard is sent, with its placements, global shape and
stride and the sender's mesh (pickled, used only as a fallback). The receiver rebuilds each
DTensor on *its own* mesh: when the template (``recv_checkpoint(template=...)``, else what the
``state_dict`` callable returns) has a DTensor at the same path, the shard arrives in a new
DTensor on that DTensor's mesh with its placements (``in_place=True``: in that DTensor's local
tensor, and the template DTensor is returned), after checking that the placements, the global
shape and the local shape agree (a different layout raises
:class:`~ftclient.checkpointing.CheckpointTransferError` naming the key). Without a template
DTensor the sender's mesh is unpickled and used if this process is in it (the same layout in
every replica group, as in HSDP); otherwise the error asks for a template. In HSDP, rank ``r`` of
a recovering group receives from rank ``r`` of the source group, whose shard is the one it needs.

Receiving (``recv_checkpoint``) is bounded by its timeout as a whole (not per message). A tensor
that matches a template tensor (path, dtype, shape) arrives in a new tensor on the template
tensor's device (``in_place=True``: in the template tensor itself, which is returned: torchft's
behaviour, which puts the values in the live state before the Manager decided to apply them);
the others are allocated on ``device`` and moved to the CPU, contiguous. Either way with their
dtype, shape, ``requires_grad`` and ``nn.Parameter`` type; DTensor shards stay on ``device``. A
header that is not this transport's, or a checkpoint of another step, raises
(:class:`~ftclient.checkpointing.CheckpointStepMismatchError` for the step). Both ends must use
ftclient's PGTransport: torchft's pickles its own classes. Peers are trusted: the metadata is
unpickled, as torchft and the HTTP transport do.
"""

from __future__ import annotations

import logging
import pickle
import sys
import time
import warnings
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Generic, TypeGuard, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import KeyPath, keystr, tree_flatten_with_path, tree_unflatten

from ftclient.checkpointing.http_transport import CheckpointStepMismatchError, CheckpointTransferError
from ftclient.checkpointing.transport import CheckpointTransport

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

logger: logging.Logger = logging.getLogger(__name__)

__all__ = ["PGTransport"]

T = TypeVar("T")

_MAGIC = 0x46544350475431  # "FTCPGT1"
_VERSION = 1
_TAG_HEADER = 1
_TAG_META = 2
_TAG_DATA = 3
_SMALL = 256 << 10  # tensors below this many bytes are bucketed
_BUCKET = 4 << 20  # a bucket's byte budget
_MAX_INFLIGHT = 32  # messages posted and not yet waited for, per side (per destination)
_MAX_STAGED = 256 << 20  # bytes of staging copies a sender holds before it waits for its sends
_ALIGN = 16  # bytes: each tensor's offset in a bucket, so that it can be viewed as its dtype


@dataclass(frozen=True)
class _TensorMeta:
    """One distinct tensor that is sent (for a DTensor: its local shard)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool
    is_parameter: bool

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


@dataclass(frozen=True)
class _TensorLeaf:
    index: int  # into _Meta.tensors


@dataclass(frozen=True)
class _DTensorLeaf:
    index: int  # the local shard, into _Meta.tensors
    placements: tuple[Any, ...]
    shape: tuple[int, ...]  # global
    stride: tuple[int, ...]  # global
    mesh_index: int  # into _Meta.meshes
    requires_grad: bool


@dataclass(frozen=True)
class _MeshInfo:
    shape: tuple[int, ...]
    dim_names: tuple[str, ...] | None
    pickled: bytes | None  # None when the mesh could not be pickled


@dataclass(frozen=True)
class _Meta:
    step: int
    treespec: Any
    paths: list[KeyPath]
    leaves: list[object]  # _TensorLeaf | _DTensorLeaf | any picklable value
    tensors: list[_TensorMeta]
    meshes: list[_MeshInfo]


def _is_dtensor(v: object) -> TypeGuard[DTensor]:
    """``isinstance(v, DTensor)`` without importing DTensor (seconds) in a process that has none:
    no object is a DTensor until torch.distributed.tensor was imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(v, module.DTensor)


def _plan(nbytes: list[int]) -> list[list[int]]:
    """The messages: lists of tensor indices, each sent as one buffer. Deterministic in
    ``nbytes``, so both sides compute the same plan."""
    plan: list[list[int]] = []
    bucket: list[int] = []
    size = 0
    for i, n in enumerate(nbytes):
        if n == 0:
            continue
        if n >= _SMALL:
            plan.append([i])
            continue
        if bucket and size + n > _BUCKET:
            plan.append(bucket)
            bucket, size = [], 0
        bucket.append(i)
        size += n
    if bucket:
        plan.append(bucket)
    return plan


def _layout(indices: list[int], nbytes: list[int]) -> tuple[list[int], int]:
    """Offsets of a message's tensors in its buffer (aligned) and the buffer's size."""
    offsets: list[int] = []
    pos = 0
    for i in indices:
        pos = -(-pos // _ALIGN) * _ALIGN
        offsets.append(pos)
        pos += nbytes[i]
    return offsets, pos


def _bytes_of(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t``'s elements as a flat uint8 tensor on ``device``; a copy only when it must be."""
    t = t.detach()
    if t.device != device:
        t = t.to(device)
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def _is_streamed(v: object) -> bool:
    """Whether a leaf's bytes are sent (else it is pickled with the structure)."""
    if _is_dtensor(v):
        return True
    return (type(v) in (torch.Tensor, nn.Parameter) and v.layout == torch.strided  # type: ignore[attr-defined]
            and not v.is_quantized and v.device.type != "meta")  # type: ignore[attr-defined]


def _prepare(state_dict: object, step: int) -> tuple[_Meta, list[torch.Tensor]]:
    """The metadata and the distinct tensors to send, in index order (references, no copies)."""
    flat, treespec = tree_flatten_with_path(state_dict)
    tensors: list[torch.Tensor] = []
    metas: list[_TensorMeta] = []
    seen: dict[int, object] = {}  # id(leaf) -> its leaf descriptor (tied tensors are sent once)
    meshes: list[_MeshInfo] = []
    mesh_ids: dict[int, int] = {}
    paths: list[KeyPath] = []
    leaves: list[object] = []
    for path, v in flat:
        paths.append(path)
        if not (isinstance(v, torch.Tensor) and _is_streamed(v)):
            leaves.append(v)
            continue
        if id(v) in seen:
            leaves.append(seen[id(v)])
            continue
        local = v._local_tensor if _is_dtensor(v) else v
        index = len(tensors)
        tensors.append(local)
        if _is_dtensor(v):  # the DTensor leaf carries requires_grad; its shard is plain
            metas.append(_TensorMeta(local.dtype, tuple(local.shape), False, False))
        else:
            metas.append(_TensorMeta(local.dtype, tuple(local.shape), v.requires_grad, type(v) is nn.Parameter))
        leaf: object
        if _is_dtensor(v):
            mesh = v.device_mesh
            if id(mesh) not in mesh_ids:
                try:
                    pickled: bytes | None = pickle.dumps(mesh, protocol=pickle.HIGHEST_PROTOCOL)
                except Exception:  # noqa: BLE001 -- only the no-template fallback needs it
                    pickled = None
                mesh_ids[id(mesh)] = len(meshes)
                meshes.append(_MeshInfo(tuple(mesh.shape), mesh.mesh_dim_names, pickled))
            leaf = _DTensorLeaf(index, tuple(v.placements), tuple(v.shape), tuple(v.stride()),
                                mesh_ids[id(mesh)], v.requires_grad)
        else:
            leaf = _TensorLeaf(index)
        seen[id(v)] = leaf
        leaves.append(leaf)
    return _Meta(step, treespec, paths, leaves, metas, meshes), tensors


class _Deadline:
    def __init__(self, timeout: timedelta, what: str) -> None:
        self.end = time.monotonic() + timeout.total_seconds()
        self.timeout = timeout
        self.what = what

    def post(self, start: Callable[[], Any], part: str) -> Any:
        """Start an operation (``pg.send``/``pg.recv``); errors name the transfer and ``part``."""
        try:
            return start()
        except Exception as e:  # noqa: BLE001 -- re-raised with what was being transferred
            raise CheckpointTransferError(f"{self.what} failed at {part}: {e}") from e

    def wait(self, work: Any, part: str) -> None:
        """Wait for ``work`` until the deadline; errors name the transfer and ``part``."""
        remaining = self.end - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{self.what} timed out after {self.timeout.total_seconds():g}s at {part}")
        try:
            ok = work.wait(timedelta(seconds=remaining))
        except Exception as e:  # noqa: BLE001 -- re-raised with what was being transferred
            if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                raise TimeoutError(f"{self.what} timed out after {self.timeout.total_seconds():g}s at {part}: "
                                   f"{e}") from e
            raise CheckpointTransferError(f"{self.what} failed at {part}: {e}") from e
        if ok is False:
            raise TimeoutError(f"{self.what} timed out after {self.timeout.total_seconds():g}s at {part}")


class PGTransport(CheckpointTransport[T], Generic[T]):
    """Checkpoint transport over a process group's ``send``/``recv`` (torchft's constructor).

    Args:
        pg: the process group to send on; ranks are its ranks (for a Manager: the replica
            groups' process group, whose replica ranks the quorum names).
        timeout: default bound for a whole transfer (the Manager passes its own).
        device: where tensors are staged for the process group (``cpu`` for Gloo, the GPU
            for NCCL).
        state_dict: optional template callable: on receive, tensors whose path, dtype and shape
            match a template tensor arrive on its device (and DTensors on its mesh, with its
            placements). For a Manager, the template has the Manager's layout: ``{"user": {key:
            ...}, "torchft": ...}``; ftclient's Manager passes its own state (taken in the step,
            where no forward pass runs) as ``recv_checkpoint(template=...)``, and this callable is
            not called.
        in_place: receive into the template's own tensors (torchft's behaviour: no second copy of
            the state). Off by default: the received values would then be in the live state
            before the replica group decided to apply them, so a recovery that fails on another
            rank of the group, or a step the group does not commit, would leave this rank's
            state changed (half-applied) while its step is not.
    """

    def __init__(self, pg: Any, timeout: timedelta, device: torch.device,
                 state_dict: Callable[[], object] | None = None, *, in_place: bool = False) -> None:
        self._pg = pg
        self._timeout = timeout
        self._device = torch.device(device)
        self._state_dict = state_dict
        self._in_place = in_place

    def metadata(self) -> str:
        return "<n/a>"  # the process group is the address; nothing to look up

    def disallow_checkpoint(self) -> None:
        pass  # send_checkpoint returns after the last byte was sent

    def __repr__(self) -> str:
        return f"PGTransport(pg={self._pg!r}, device={self._device})"

    # sender ---------------------------------------------------------------------------------------

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta) -> None:
        """Send the checkpoint of ``step`` to every rank of ``dst_ranks``; returns when all of it
        was sent. Raises ``TimeoutError`` after ``timeout`` for the whole transfer."""
        started = time.monotonic()
        meta, tensors = _prepare(state_dict, step)
        try:
            buf = pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise TypeError(f"the state dict of step {step} cannot be sent: {e}. Every non-tensor value in it "
                            "must be picklable.") from e
        deadline = _Deadline(timeout, f"sending the checkpoint of step {step} to ranks {dst_ranks}")
        header = torch.tensor([_MAGIC, _VERSION, step, len(buf)], dtype=torch.int64, device=self._device)
        meta_t = torch.frombuffer(bytearray(buf), dtype=torch.uint8).to(self._device)
        # (work, what, the buffer it sends (kept alive until waited for), bytes of staging copy)
        pending: deque[tuple[Any, str, torch.Tensor, int]] = deque()
        staged = 0  # bytes of staging copies (buckets, device moves) held by pending sends

        def settle_one() -> None:
            nonlocal staged
            work, part, _, copy_bytes = pending.popleft()
            deadline.wait(work, part)
            staged -= copy_bytes

        def post(t: torch.Tensor, tag: int, what: str, copy_bytes: int = 0) -> None:
            nonlocal staged
            for i, dst in enumerate(dst_ranks):
                part = f"{what} to rank {dst}"
                held = copy_bytes if i == len(dst_ranks) - 1 else 0  # freed after the last send
                pending.append((deadline.post(lambda: self._pg.send([t], dst, tag), part), part, t, held))
                staged += held
            while pending and (len(pending) > _MAX_INFLIGHT * len(dst_ranks) or staged > _MAX_STAGED):
                settle_one()

        post(header, _TAG_HEADER, "the header")
        post(meta_t, _TAG_META, "the metadata")
        total = 0
        nbytes = [m.nbytes for m in meta.tensors]
        for k, indices in enumerate(_plan(nbytes)):
            if len(indices) == 1:
                src = tensors[indices[0]]
                data = _bytes_of(src, self._device)
                copied = data.device != src.device or data.data_ptr() != src.data_ptr()
            else:
                offsets, size = _layout(indices, nbytes)
                data = torch.zeros(size, dtype=torch.uint8, device=self._device)
                for i, pos in zip(indices, offsets):
                    data[pos:pos + nbytes[i]] = _bytes_of(tensors[i], self._device)
                copied = True
            total += data.numel()
            post(data, _TAG_DATA + k, f"message {k} (tensors {indices[0]}..{indices[-1]})",
                 data.numel() if copied else 0)
        while pending:
            settle_one()
        logger.info("sent the checkpoint of step %d (%d tensors, %.1f MiB) to ranks %s in %.3fs", step,
                    len(tensors), total / 2**20, dst_ranks, time.monotonic() - started)

    # receiver -------------------------------------------------------------------------------------

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta,
                        template: object | None = None) -> T:
        """Receive the checkpoint of ``step`` from ``src_rank`` (``metadata`` is unused).

        ``template``: a state dict to take the layout from (or to receive into, ``in_place``)
        instead of calling the constructor's ``state_dict`` callable (ftclient's Manager passes
        the state it took in the step: a state-dict call here could run during a forward pass)."""
        started = time.monotonic()
        deadline = _Deadline(timeout, f"receiving the checkpoint of step {step} from rank {src_rank}")
        flat_template: dict[KeyPath, object] = {}
        if template is None and self._state_dict is not None:
            template = self._state_dict()
        if template is not None:
            flat_template = dict(tree_flatten_with_path(template)[0])

        header = torch.zeros(4, dtype=torch.int64, device=self._device)
        deadline.wait(deadline.post(lambda: self._pg.recv([header], src_rank, _TAG_HEADER), "the header"),
                      "the header")
        magic, version, sent_step, meta_len = (int(x) for x in header.cpu().tolist())
        if magic != _MAGIC or version != _VERSION:
            raise CheckpointTransferError(
                f"rank {src_rank} did not send an ftclient PGTransport checkpoint (header {header.tolist()}): "
                "both ends of a recovery must use ftclient's PGTransport")
        if sent_step != step:
            raise CheckpointStepMismatchError(f"rank {src_rank} sent step {sent_step} but step {step} was requested")
        meta_t = torch.empty(meta_len, dtype=torch.uint8, device=self._device)
        deadline.wait(deadline.post(lambda: self._pg.recv([meta_t], src_rank, _TAG_META), "the metadata"),
                      "the metadata")
        with warnings.catch_warnings():  # torch's TreeSpec warns about its own LeafSpec when unpickled
            warnings.simplefilter("ignore", FutureWarning)
            meta: _Meta = pickle.loads(meta_t.cpu().numpy().tobytes())

        # Where each distinct tensor goes: a template tensor (in place), a new tensor like it (on
        # its device), or a new one.
        targets: list[torch.Tensor | None] = [None] * len(meta.tensors)
        like_template = [False] * len(meta.tensors)
        for path, leaf in zip(meta.paths, meta.leaves):
            if isinstance(leaf, (_TensorLeaf, _DTensorLeaf)) and targets[leaf.index] is None:
                tm = meta.tensors[leaf.index]
                target = self._target(path, leaf, tm, flat_template.get(path))
                if target is not None and not self._in_place:
                    target = torch.empty(tm.shape, dtype=tm.dtype, device=target.device)
                    like_template[leaf.index] = True
                targets[leaf.index] = target
        received = self._receive(src_rank, meta.tensors, targets, deadline)

        values: list[object] = []
        meshes: dict[int, Any] = {}  # the sender's meshes, unpickled (no-template DTensors only)
        for path, leaf in zip(meta.paths, meta.leaves):
            if isinstance(leaf, _TensorLeaf):
                t = received[leaf.index]
                values.append(self._typed(meta.tensors[leaf.index], t) if like_template[leaf.index] else t)
            elif isinstance(leaf, _DTensorLeaf):
                values.append(self._dtensor(path, leaf, received[leaf.index], flat_template.get(path), meta, meshes))
            else:
                values.append(leaf)
        # Tied tensors: one object per distinct tensor, DTensors included.
        shared: dict[int, object] = {}
        for i, (path, leaf) in enumerate(zip(meta.paths, meta.leaves)):
            if isinstance(leaf, (_TensorLeaf, _DTensorLeaf)):
                values[i] = shared.setdefault(leaf.index, values[i])
        logger.info("received the checkpoint of step %d (%d tensors) from rank %d in %.3fs", step, len(meta.tensors),
                    src_rank, time.monotonic() - started)
        return tree_unflatten(values, meta.treespec)

    def _target(self, path: KeyPath, leaf: object, tm: _TensorMeta, tmpl: object) -> torch.Tensor | None:
        """The template tensor to receive into, if it fits (DTensor: its local shard)."""
        if isinstance(leaf, _DTensorLeaf):
            if not _is_dtensor(tmpl):
                return None
            self._check_layout(path, leaf, tm, tmpl)
            local = tmpl._local_tensor
        else:
            if not isinstance(tmpl, torch.Tensor) or _is_dtensor(tmpl) or not _is_streamed(tmpl):
                return None
            local = tmpl
        if local.dtype != tm.dtype or tuple(local.shape) != tm.shape:
            return None
        return local

    @staticmethod
    def _check_layout(path: KeyPath, leaf: _DTensorLeaf, tm: _TensorMeta, tmpl: DTensor) -> None:
        mine = (tuple(tmpl.placements), tuple(tmpl.shape), tuple(tmpl._local_tensor.shape), tmpl.dtype)
        theirs = (leaf.placements, leaf.shape, tm.shape, tm.dtype)
        if mine != theirs:
            raise CheckpointTransferError(
                f"DTensor {keystr(path)} has another layout on the source replica: (placements, global shape, "
                f"local shape, dtype) {theirs} there, {mine} here; recovery needs the same sharding in both "
                "replica groups")

    def _receive(self, src_rank: int, metas: list[_TensorMeta], targets: list[torch.Tensor | None],
                 deadline: _Deadline) -> list[torch.Tensor]:
        """Receive every message of the plan; the tensors in index order."""
        out: list[torch.Tensor | None] = list(targets)
        for i, m in enumerate(metas):
            if m.nbytes == 0 and out[i] is None:
                out[i] = self._fresh(m, torch.empty(0, dtype=torch.uint8, device=self._device), False)
        pending: deque[tuple[Any, str, Callable[[], None]]] = deque()

        def finish_one() -> None:
            work, part, done = pending.popleft()
            deadline.wait(work, part)
            done()

        nbytes = [m.nbytes for m in metas]
        for k, indices in enumerate(_plan(nbytes)):
            direct = targets[indices[0]] if len(indices) == 1 else None
            if direct is not None and direct.is_contiguous() and self._on_device(direct):
                buf = direct.detach().reshape(-1).view(torch.uint8)  # in place

                def done() -> None:
                    pass
            else:
                offsets, size = _layout(indices, nbytes)
                buf = torch.empty(size, dtype=torch.uint8, device=self._device)

                def done(buf: torch.Tensor = buf, indices: list[int] = indices, offsets: list[int] = offsets) -> None:
                    for i, pos in zip(indices, offsets):
                        part = buf[pos:pos + nbytes[i]]
                        target = targets[i]
                        if target is not None:
                            with torch.no_grad():
                                target.copy_(part.view(metas[i].dtype).view(metas[i].shape))
                        else:
                            out[i] = self._fresh(metas[i], part, len(indices) > 1)
            part = f"message {k} (tensors {indices[0]}..{indices[-1]})"
            pending.append((deadline.post(lambda: self._pg.recv([buf], src_rank, _TAG_DATA + k), part), part, done))
            if len(pending) > _MAX_INFLIGHT:
                finish_one()
        while pending:
            finish_one()
        assert all(t is not None for t in out)
        return out  # type: ignore[return-value]

    def _on_device(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is on this transport's device (``cuda`` matches any CUDA index)."""
        return t.device.type == self._device.type and (self._device.index is None
                                                       or t.device.index == self._device.index)

    @staticmethod
    def _typed(m: _TensorMeta, t: torch.Tensor) -> torch.Tensor:
        """A new tensor received like a template's: the sender's Parameter type and requires_grad."""
        if m.is_parameter:
            return nn.Parameter(t, requires_grad=m.requires_grad)
        return t.requires_grad_(m.requires_grad) if m.requires_grad else t

    def _fresh(self, m: _TensorMeta, data: torch.Tensor, in_bucket: bool) -> torch.Tensor:
        """A new tensor from received bytes (on the CPU, as torchft's receiver does)."""
        t = data.view(m.dtype).view(m.shape) if m.nbytes else torch.empty(m.shape, dtype=m.dtype)
        if t.device.type != "cpu":
            t = t.cpu()
        elif in_bucket:
            t = t.clone()  # a slice of a bucket: don't keep the whole bucket alive
        if m.is_parameter:
            return nn.Parameter(t, requires_grad=m.requires_grad)
        return t.requires_grad_(m.requires_grad) if m.requires_grad else t

    @staticmethod
    def _source_mesh(meta: _Meta, index: int, cache: dict[int, Any]) -> Any:
        """The sender's mesh, unpickled once per transfer (``cache``), if this process is one of
        its ranks (as in HSDP, where every replica group has the same layout in a world of its
        own)."""
        if index not in cache:
            info, mesh = meta.meshes[index], None
            if info.pickled is not None and dist.is_initialized():
                try:
                    mesh = pickle.loads(info.pickled)
                except Exception:  # noqa: BLE001 -- the caller reports that there is no mesh
                    mesh = None
                if mesh is not None and dist.get_rank() not in mesh.mesh.flatten().tolist():
                    mesh = None
            cache[index] = mesh
        return cache[index]

    def _dtensor(self, path: KeyPath, leaf: _DTensorLeaf, local: torch.Tensor, tmpl: object, meta: _Meta,
                 meshes: dict[int, Any]) -> object:
        if _is_dtensor(tmpl) and not self._in_place:
            # A new DTensor on the template's mesh, with its placements: the template is untouched.
            self._check_layout(path, leaf, meta.tensors[leaf.index], tmpl)
            from torch.distributed.tensor import DTensor

            if local.device != tmpl._local_tensor.device:
                local = local.to(tmpl._local_tensor.device)
            t = DTensor.from_local(local.detach(), tmpl.device_mesh, tmpl.placements, run_check=False,
                                   shape=torch.Size(leaf.shape), stride=leaf.stride)
            return t.requires_grad_(leaf.requires_grad) if leaf.requires_grad else t
        if _is_dtensor(tmpl):
            if local is not tmpl._local_tensor:  # a tied shard, received into another template
                self._check_layout(path, leaf, meta.tensors[leaf.index], tmpl)
                with torch.no_grad():
                    tmpl._local_tensor.copy_(local)
            return tmpl
        info = meta.meshes[leaf.mesh_index]
        mesh = self._source_mesh(meta, leaf.mesh_index, meshes)
        if mesh is None:
            raise CheckpointTransferError(
                f"DTensor {keystr(path)} (mesh {info.shape} {info.dim_names}, placements {leaf.placements}) cannot "
                "be rebuilt here: this process is not in the source's mesh. Give PGTransport a state_dict= "
                "template (the Manager's layout) so that DTensors are received on this replica's own mesh")
        if mesh.device_type != local.device.type:
            local = local.to(self._device if self._device.type == mesh.device_type else mesh.device_type)
        from torch.distributed.tensor import DTensor

        t = DTensor.from_local(local.detach(), mesh, leaf.placements, run_check=False, shape=torch.Size(leaf.shape),
                               stride=leaf.stride)
        return t.requires_grad_(leaf.requires_grad) if leaf.requires_grad else t
