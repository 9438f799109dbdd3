"""lighthouse-cluster: a Raft-replicated, highly-available lighthouse for torchft.

Every node serves torchft's own ``torchft.LighthouseService``; quorum decisions are committed
through Raft before any trainer sees them. See README.md.
"""

__version__ = "0.1.0"

__all__ = ["LighthouseServer", "__version__"]


def __getattr__(name: str):  # PEP 562: importing the package stays light (no gRPC, no processes)
    if name == "LighthouseServer":
        from lighthouse_cluster.local.lighthouse_server import LighthouseServer

        return LighthouseServer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
