"""Data sharding across replica groups (ftclient's counterpart of torchft.data).

This module owns :class:`DistributedSampler`, which splits a dataset over every rank of every
replica group. Shards are fixed by the maximum number of replica groups, not by the current
quorum: a group that is down simply leaves its shard unread, and a recovering group resumes its
own shard, so no two ranks ever read the same sample in an epoch.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.utils import data

__all__ = ["DistributedSampler"]


class DistributedSampler(data.distributed.DistributedSampler):  # type: ignore[type-arg]
    """A ``torch.utils.data.DistributedSampler`` over ``num_replicas * num_replica_groups``
    shards.

    The shard of group rank ``group_rank`` in replica group ``replica_rank`` is
    ``global_rank = group_rank + num_replicas * replica_rank`` (torchft's numbering: the ranks
    of one replica group are consecutive), out of ``global_world_size = num_replicas *
    num_replica_groups``.

    Like torchft's sampler this is lossy under faults: the shards of replica groups that are
    down are not read, and batches of a step that does not commit are not retried. Checkpoint
    the data loader (e.g. torchdata's StatefulDataLoader) to avoid repeating batches.

    Args:
        dataset: the dataset to shard.
        replica_rank: this replica group's index, in ``[0, num_replica_groups)`` (e.g. the
            ``REPLICA_GROUP_ID`` of the launch scripts).
        num_replica_groups: the maximum number of replica groups (``NUM_REPLICA_GROUPS``).
        group_rank: this process's rank within its replica group. Default: the rank of the
            default torch.distributed group if it is initialized, else 0.
        num_replicas: the number of ranks in a replica group. Default: the world size of the
            default torch.distributed group if it is initialized, else 1.
        **kwargs: passed to torch's DistributedSampler (``shuffle``, ``seed``, ``drop_last``).
    """

    def __init__(
        self,
        dataset: data.Dataset,  # type: ignore[type-arg]
        replica_rank: int,
        num_replica_groups: int,
        group_rank: int | None = None,
        num_replicas: int | None = None,
        **kwargs: Any,
    ) -> None:
        initialized = dist.is_available() and dist.is_initialized()
        if group_rank is None:
            group_rank = dist.get_rank() if initialized else 0
        if num_replicas is None:
            num_replicas = dist.get_world_size() if initialized else 1
        if num_replica_groups < 1 or num_replicas < 1:
            raise ValueError(
                f"num_replica_groups and num_replicas must be >= 1, got {num_replica_groups} "
                f"and {num_replicas}"
            )
        if not 0 <= replica_rank < num_replica_groups:
            raise ValueError(
                f"replica_rank must be in [0, num_replica_groups={num_replica_groups}), got "
                f"{replica_rank}"
            )
        if not 0 <= group_rank < num_replicas:
            raise ValueError(
                f"group_rank must be in [0, num_replicas={num_replicas}), got {group_rank}"
            )
        self.replica_rank = replica_rank
        self.num_replica_groups = num_replica_groups
        self.group_rank = group_rank
        self.global_rank: int = group_rank + num_replicas * replica_rank
        self.global_world_size: int = num_replicas * num_replica_groups
        super().__init__(
            dataset, num_replicas=self.global_world_size, rank=self.global_rank, **kwargs
        )
