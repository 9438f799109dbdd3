"""``torchft.process_group`` under ftclient (see :mod:`ftclient.torchft_compat`).

torchft keeps every process group in one module; ftclient has the Gloo, managed and wrapper
groups in :mod:`ftclient.process_group`, NCCL in :mod:`ftclient.process_group_nccl` and the
groups that run their collectives in a child process in :mod:`ftclient.process_group_baby`.
This module gathers their torchft names in one place; it defines nothing.
"""

from __future__ import annotations

from typing import Any

from ftclient.process_group import (
    ErrorSwallowingProcessGroupWrapper,
    ManagedProcessGroup,
    ProcessGroup,
    ProcessGroupDummy,
    ProcessGroupGloo,
    create_store_client,
)
from ftclient.process_group_baby import ProcessGroupBaby, ProcessGroupBabyGloo, ProcessGroupBabyNCCL
from ftclient.process_group_nccl import ProcessGroupNCCL

__all__ = [
    "ErrorSwallowingProcessGroupWrapper",
    "ManagedProcessGroup",
    "ProcessGroup",
    "ProcessGroupBaby",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "ProcessGroupDummy",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "create_store_client",
]

_MISSING = {
    "ProcessGroupXCCL": "ftclient has no XCCL (Intel GPU) process group",
    "ProcessGroupBabyXCCL": "ftclient has no XCCL (Intel GPU) process group",
    "FakeProcessGroupWrapper": "ftclient has no fault-injecting wrapper",
    "ProcessGroupWrapper": "ftclient's groups wrap torch backends internally, not through ProcessGroupWrapper",
}


def __getattr__(name: str) -> Any:
    if name in _MISSING:
        raise AttributeError(f"torchft.process_group.{name} is not available under ftclient "
                             f"(python -m ftclient.as_torchft): {_MISSING[name]}")
    raise AttributeError(f"module 'torchft.process_group' (ftclient's compatibility layer) has no attribute {name!r}")
