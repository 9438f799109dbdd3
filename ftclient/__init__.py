"""ftclient: the trainer SDK -- torchft's Manager / ProcessGroup / DDP / Optimizer semantics, with
leader discovery over a list of lighthouse endpoints (``TORCHFT_LIGHTHOUSE=http://a,http://b,...``).

Porting a torchft script: ``from ftclient import Manager`` (and the wrappers below) instead of
``from torchft import ...``; constructor arguments and environment variables are the same.

This package's modules: ``manager`` (Manager, WorldSizeMode), ``manager_server`` (the per-replica-
group ManagerService server and its client), ``quorum_results`` (the pure quorum-results rules),
``lighthouse_client`` (lighthouse calls with leader discovery). The process group, DDP, optimizer,
data and checkpointing modules are exported when present.
"""

from .lighthouse_client import LighthouseClient, LighthouseError, parse_endpoints
from .manager import ExceptionWithTraceback, Manager, WorldSizeMode
from .manager_server import ManagerClient, ManagerServer
from .quorum_results import QuorumResult, compute_quorum_results

__all__ = [
    "ExceptionWithTraceback",
    "LighthouseClient",
    "LighthouseError",
    "Manager",
    "ManagerClient",
    "ManagerServer",
    "QuorumResult",
    "WorldSizeMode",
    "compute_quorum_results",
    "parse_endpoints",
]

# Modules written alongside this one; exported once they land.
try:
    from .process_group import (  # noqa: F401
        ErrorSwallowingProcessGroupWrapper,
        ManagedProcessGroup,
        ProcessGroup,
        ProcessGroupGloo,
    )

    __all__ += ["ErrorSwallowingProcessGroupWrapper", "ManagedProcessGroup", "ProcessGroup", "ProcessGroupGloo"]
except ImportError:
    pass
try:
    from .ddp import DistributedDataParallel  # noqa: F401

    __all__.append("DistributedDataParallel")
except ImportError:
    pass
try:
    from .optim import OptimizerWrapper  # noqa: F401

    __all__.append("OptimizerWrapper")
except ImportError:
    pass
try:
    from .data import DistributedSampler  # noqa: F401

    __all__.append("DistributedSampler")
except ImportError:
    pass
try:
    from .checkpointing import CheckpointTransport, HTTPTransport  # noqa: F401

    __all__ += ["CheckpointTransport", "HTTPTransport"]
except ImportError:
    pass
