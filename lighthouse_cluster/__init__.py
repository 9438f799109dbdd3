"""lighthouse-cluster: a Raft-replicated, highly-available lighthouse for torchft.

Every node serves torchft's own ``torchft.LighthouseService``; quorum decisions are committed
through Raft before any trainer sees them. See README.md.
"""

__version__ = "0.1.0"
