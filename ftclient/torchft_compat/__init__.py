"""ftclient under torchft's module names: what ``import torchft`` gives a program started with
``python -m ftclient.as_torchft`` (see :mod:`ftclient.as_torchft`, which installs it).

This package owns the mapping from torchft 0.2.0's public names to ftclient's objects, and
nothing else: no class here has code of its own. The top level mirrors ``torchft/__init__.py``
(``Manager``, ``Optimizer`` (= ``OptimizerWrapper``), ``DistributedDataParallel``,
``DistributedSampler``, ``ProcessGroupGloo``, ``ProcessGroupNCCL``, ``ProcessGroupBabyNCCL``,
plus ``ProcessGroupBabyGloo``); :data:`MODULES` maps each torchft submodule to the module that
answers for it: ftclient's own module where it has torchft's names (``torchft.manager`` ->
``ftclient.manager``, ``torchft.local_sgd``, ``torchft.ddp``, ``torchft.optim``,
``torchft.data``, ``torchft.checkpointing`` with ``transport``, ``http_transport`` and
``pg_transport``), and :mod:`ftclient.torchft_compat.process_group` for
``torchft.process_group``, whose names ftclient spreads over three modules. torchft names with
no ftclient counterpart (``ProcessGroupXCCL``, ``ProcessGroupBabyXCCL``, ``torchft.torchcomms``,
``torchft.coordination``, quantization, the parameter server) raise an error that says so.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import ftclient.checkpointing
import ftclient.checkpointing.http_transport
import ftclient.checkpointing.pg_transport
import ftclient.checkpointing.transport
import ftclient.data
import ftclient.ddp
import ftclient.local_sgd
import ftclient.manager
import ftclient.optim
from ftclient.data import DistributedSampler
from ftclient.ddp import DistributedDataParallel
from ftclient.manager import Manager
from ftclient.optim import OptimizerWrapper as Optimizer
from ftclient.torchft_compat import process_group
from ftclient.torchft_compat.process_group import (
    ProcessGroupBabyGloo,
    ProcessGroupBabyNCCL,
    ProcessGroupGloo,
    ProcessGroupNCCL,
)

# torchft's submodules as attributes (``import torchft`` then ``torchft.process_group.X``, as
# torchtitan does, works because torchft's __init__ imports them).
manager = ftclient.manager
local_sgd = ftclient.local_sgd
ddp = ftclient.ddp
optim = ftclient.optim
data = ftclient.data
checkpointing = ftclient.checkpointing

# torchft submodule name (without the leading "torchft.") -> the module answering for it.
MODULES: dict[str, ModuleType] = {
    "process_group": process_group,
    "manager": ftclient.manager,
    "local_sgd": ftclient.local_sgd,
    "ddp": ftclient.ddp,
    "optim": ftclient.optim,
    "data": ftclient.data,
    "checkpointing": ftclient.checkpointing,
    "checkpointing.transport": ftclient.checkpointing.transport,
    "checkpointing.http_transport": ftclient.checkpointing.http_transport,
    "checkpointing.pg_transport": ftclient.checkpointing.pg_transport,
}

# torchft names ftclient does not have, and why (the error a caller sees).
MISSING: dict[str, str] = {
    "ProcessGroupXCCL": "ftclient has no XCCL (Intel GPU) process group",
    "ProcessGroupBabyXCCL": "ftclient has no XCCL (Intel GPU) process group",
    "torchcomms": "ftclient has no torchcomms process group (torchtitan's process_group='mccl')",
    "coordination": "ftclient's lighthouse and manager clients are ftclient.lighthouse_client and "
                    "ftclient.manager_server, with their own constructors",
    "quantization": "ftclient has no quantized collectives",
    "collectives": "ftclient has no quantized collectives",
    "parameter_server": "ftclient has no parameter server",
    "otel": "ftclient has no OpenTelemetry logging",
}

__all__ = [
    "DistributedDataParallel",
    "DistributedSampler",
    "MISSING",
    "MODULES",
    "Manager",
    "Optimizer",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
]


def __getattr__(name: str) -> Any:
    if name in MISSING:
        raise AttributeError(f"torchft.{name} is not available under ftclient (python -m ftclient.as_torchft): "
                             f"{MISSING[name]}")
    raise AttributeError(f"module 'torchft' (ftclient's compatibility layer) has no attribute {name!r}")
