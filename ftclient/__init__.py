"""ftclient: the trainer SDK -- torchft's Manager / ProcessGroup / DDP / Optimizer semantics, with
leader discovery over a list of lighthouse endpoints (``TORCHFT_LIGHTHOUSE=http://a,http://b,...``).

Porting a torchft script: ``from ftclient import Manager`` (and the wrappers below) instead of
``from torchft import ...``; constructor arguments and environment variables are the same.

This package's modules: ``manager`` (Manager, WorldSizeMode), ``manager_server`` (the per-replica-
group ManagerService server and its client), ``quorum_results`` (the pure quorum-results rules),
``lighthouse_client`` (lighthouse calls with leader discovery; a job's configuration),
``job_selection`` (which lighthouse job a trainer's calls name), ``liveness`` (the replica group's
liveness stream to the lighthouse cluster and its peer-death notices), ``process_group``, ``ddp``,
``optim``, ``data``, ``checkpointing`` (live recovery over HTTP or the process group),
``local_sgd`` (LocalSGD, DiLoCo; FSDP2 DTensor parameters too), ``process_group_nccl``
(ProcessGroupNCCL), ``process_group_baby`` (collectives in a killable child process),
``as_torchft`` and ``torchft_compat`` (run an unedited torchft program, e.g. torchtitan, on ftclient),
``torchrun_rendezvous`` (torchrun's ``--rdzv-backend=lighthouse``).

The names below are imported on first use, not with the package (``__getattr__``).
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

# Each public name and the module it lives in. Imported on first use (PEP 562): importing the
# package, or one of its light modules (``torchrun_rendezvous.entry_point``, which torch's
# rendezvous registry loads in every process that imports it), does not import torch and the
# whole SDK.
_EXPORTS = {
    "CheckpointTransport": "checkpointing",
    "HTTPTransport": "checkpointing",
    "PGTransport": "checkpointing",
    "DistributedSampler": "data",
    "DistributedDataParallel": "ddp",
    "JobNotFoundError": "lighthouse_client",
    "LighthouseClient": "lighthouse_client",
    "LighthouseError": "lighthouse_client",
    "parse_endpoints": "lighthouse_client",
    "read_job_config": "lighthouse_client",
    "DiLoCo": "local_sgd",
    "LocalSGD": "local_sgd",
    "ExceptionWithTraceback": "manager",
    "Manager": "manager",
    "WorldSizeMode": "manager",
    "ManagerClient": "manager_server",
    "ManagerServer": "manager_server",
    "Optimizer": "optim",
    "OptimizerWrapper": "optim",
    "ErrorSwallowingProcessGroupWrapper": "process_group",
    "ManagedProcessGroup": "process_group",
    "ProcessGroup": "process_group",
    "ProcessGroupGloo": "process_group",
    "ProcessGroupBabyGloo": "process_group_baby",
    "ProcessGroupBabyNCCL": "process_group_baby",
    "ProcessGroupNCCL": "process_group_nccl",
    "QuorumResult": "quorum_results",
    "compute_quorum_results": "quorum_results",
}

if TYPE_CHECKING:
    from .checkpointing import CheckpointTransport, HTTPTransport, PGTransport
    from .data import DistributedSampler
    from .ddp import DistributedDataParallel
    from .lighthouse_client import JobNotFoundError, LighthouseClient, LighthouseError, parse_endpoints, read_job_config
    from .local_sgd import DiLoCo, LocalSGD
    from .manager import ExceptionWithTraceback, Manager, WorldSizeMode
    from .manager_server import ManagerClient, ManagerServer
    from .optim import Optimizer, OptimizerWrapper
    from .process_group import ErrorSwallowingProcessGroupWrapper, ManagedProcessGroup, ProcessGroup, ProcessGroupGloo
    from .process_group_baby import ProcessGroupBabyGloo, ProcessGroupBabyNCCL
    from .process_group_nccl import ProcessGroupNCCL
    from .quorum_results import QuorumResult, compute_quorum_results


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__all__ = [
    "CheckpointTransport",
    "DiLoCo",
    "DistributedDataParallel",
    "DistributedSampler",
    "ErrorSwallowingProcessGroupWrapper",
    "ExceptionWithTraceback",
    "HTTPTransport",
    "JobNotFoundError",
    "PGTransport",
    "LighthouseClient",
    "LighthouseError",
    "LocalSGD",
    "ManagedProcessGroup",
    "Manager",
    "ManagerClient",
    "ManagerServer",
    "Optimizer",
    "OptimizerWrapper",
    "ProcessGroup",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "QuorumResult",
    "WorldSizeMode",
    "compute_quorum_results",
    "parse_endpoints",
    "read_job_config",
]
