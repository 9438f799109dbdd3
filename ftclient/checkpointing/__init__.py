"""Live recovery: moving a healthy replica's state dict to a recovering replica.

This package owns the checkpoint-transport API (:class:`CheckpointTransport`, in
:mod:`~ftclient.checkpointing.transport`, with the :class:`RWLock` that guards a served state
dict) and its HTTP implementation (:class:`HTTPTransport`, in
:mod:`~ftclient.checkpointing.http_transport`), which streams tensors straight from memory to
the socket and into preallocated tensors on the other side, and its process-group
implementation (:class:`PGTransport`, in :mod:`~ftclient.checkpointing.pg_transport`), which
sends the tensors (DTensor shards included) with the process group's ``send``/``recv``.
"""

from ftclient.checkpointing.http_transport import (
    CheckpointStepMismatchError,
    CheckpointTransferError,
    HTTPTransport,
)
from ftclient.checkpointing.pg_transport import PGTransport
from ftclient.checkpointing.transport import CheckpointTransport, RWLock

__all__ = [
    "CheckpointStepMismatchError",
    "CheckpointTransferError",
    "CheckpointTransport",
    "HTTPTransport",
    "PGTransport",
    "RWLock",
]
