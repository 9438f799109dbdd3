"""Fault-tolerant DistributedDataParallel (ftclient's counterpart of torchft.ddp).

This module owns the data-parallel model wrapper: torch's DistributedDataParallel runs over a
single-rank :class:`~ftclient.process_group.ProcessGroupDummy` (its start-up broadcast and
shape checks become no-ops) and every gradient bucket is averaged across the quorum by a
communication hook that calls ``manager.allreduce(bucket.buffer())`` and returns that work's
future (``Work.get_future()``, as torchft's hook does; a manager that returns a Future directly
is accepted too). The Manager decides who participates, records errors instead of raising, and
divides by the number of participants.
"""


from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.futures import Future
from torch.nn import parallel

from ftclient.process_group import ProcessGroupDummy, as_future

__all__ = ["DistributedDataParallel"]


class _AllreduceManager(Protocol):
    def allreduce(self, tensor: torch.Tensor) -> Any: ...


def _first_tensor(fut: Future[Any]) -> torch.Tensor:
    value = fut.value()
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    raise TypeError(
        f"manager.allreduce's future resolved to {type(value).__name__}; DDP needs the tensor"
    )


class DistributedDataParallel(parallel.DistributedDataParallel):
    """torch DDP whose gradient allreduce goes through a Manager.

    Use it like torch's DDP: ``model = DistributedDataParallel(manager, module)``. Notes:

    * Replicas must start from the same weights; the Manager syncs them (live recovery), DDP's
      own start-up broadcast is a no-op here.
    * ``find_unused_parameters=True`` is forced: it stops DDP from rebuilding its gradient
      buckets after the first step, which would give a recovering replica different buckets
      from the others (torchft does the same).
    * ``process_group`` cannot be passed: the quorum's group belongs to the Manager.

    Args:
        manager: the Manager (anything with ``allreduce(tensor)`` returning a ``Work`` whose
            ``get_future()`` resolves to the tensor, or such a Future itself).
        module: the model.
        **kwargs: passed to ``torch.nn.parallel.DistributedDataParallel``.
    """

    def __init__(self, manager: _AllreduceManager, module: nn.Module, **kwargs: Any) -> None:
        if "process_group" in kwargs:
            raise ValueError(
                "ftclient.ddp.DistributedDataParallel takes no process_group: gradients are "
                "averaged through manager.allreduce"
            )
        if kwargs.pop("find_unused_parameters", True) is not True:
            raise ValueError(
                "find_unused_parameters=False is not supported: it lets DDP rebuild its "
                "buckets, which diverges between healthy and recovering replicas"
            )
        super().__init__(
            module,
            process_group=ProcessGroupDummy(0, 1),
            find_unused_parameters=True,
            **kwargs,
        )
        self.register_comm_hook(manager, self._comm_hook)

    @staticmethod
    def _comm_hook(
        manager: _AllreduceManager, bucket: dist.GradBucket
    ) -> Future[torch.Tensor]:
        fut = as_future(manager.allreduce(bucket.buffer()))
        return fut.then(_first_tensor)

