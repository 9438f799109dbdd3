"""The checkpoint-transport API used for live recovery, and the lock that guards what it serves.

This module owns:

- :class:`CheckpointTransport`: how a Manager hands a healthy replica's state dict to a
  recovering replica. The healthy side calls ``send_checkpoint`` (make the state dict of a
  step available) and, once the step's commit decision is made, ``disallow_checkpoint`` (from
  then on the trainer mutates the weights, so nothing may be read). The recovering side calls
  ``recv_checkpoint`` with the string the source's ``metadata()`` returned (the Manager relays
  it through the CheckpointMetadata RPC).
- :class:`RWLock`: a writer-preferring reader-writer lock with timeouts. Transfers hold it for
  reading; the trainer holds it for writing from ``disallow_checkpoint`` until the next
  ``send_checkpoint``. It is not owned by a thread: the Manager may disallow in one thread and
  send in another.

Transports are implemented in submodules (:mod:`ftclient.checkpointing.http_transport`).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from contextlib import contextmanager
from datetime import timedelta
from typing import Generic, Iterator, TypeVar

__all__ = ["CheckpointTransport", "LockClosedError", "RWLock"]

T = TypeVar("T")


class CheckpointTransport(Generic[T], ABC):
    """Moves a replica's state dict (type ``T``) to recovering replicas.

    Lifecycle on the healthy (source) replica, once per step that has recovering peers:
    ``send_checkpoint(step=...)`` then, after the commit decision, ``disallow_checkpoint()``.
    On a recovering replica: ``recv_checkpoint(src_rank, metadata, step, timeout)``, where
    ``metadata`` is the source's :meth:`metadata`. ``shutdown`` releases everything.
    """

    @abstractmethod
    def metadata(self) -> str:
        """A string a remote transport needs to fetch checkpoints from this one (for
        HTTP: ``"http://host:port/checkpoint/"``)."""

    @abstractmethod
    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta
    ) -> None:
        """Make ``state_dict`` available as the checkpoint of ``step`` to ``dst_ranks``.

        May return before anything is transferred (HTTP serves it on request). The caller
        must not mutate ``state_dict`` until :meth:`disallow_checkpoint` has returned.
        """

    def disallow_checkpoint(self) -> None:
        """Stop serving the current checkpoint. When this returns no transfer reads the state
        dict any more, so the caller may mutate it."""

    @abstractmethod
    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> T:
        """Fetch the checkpoint of ``step`` from the replica whose :meth:`metadata` is
        ``metadata``. Raises when the source serves another step, or on ``timeout``."""

    def shutdown(self, wait: bool = True) -> None:
        """Release the transport's resources; with ``wait``, block until they are released."""


class LockClosedError(RuntimeError):
    """The lock was closed (its owner is shutting down) while waiting for it."""


class RWLock:
    """A writer-preferring reader-writer lock whose acquisitions time out.

    Any number of readers, or one writer. A waiting writer blocks new readers (so a stream of
    readers cannot starve it). Acquire and release may happen on different threads.
    ``close()`` makes every waiting and future acquisition raise :class:`LockClosedError`.

    Args:
        timeout: default timeout in seconds for acquisitions (None: wait forever).
    """

    def __init__(self, timeout: float | None = None) -> None:
        self.timeout = timeout
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0
        self._closed: str | None = None

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def acquire_read(self, timeout: float | None = None) -> None:
        """Acquire for reading; raise TimeoutError if a writer keeps it for ``timeout`` s."""
        t = self._timeout(timeout)
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self._closed is not None
                or not (self._writer or self._writers_waiting),
                t,
            )
            if self._closed is not None:
                raise LockClosedError(self._closed)
            if not ok:
                raise TimeoutError(f"timed out after {t:g}s waiting for the read lock")
            self._readers += 1

    def release_read(self) -> None:
        with self._cond:
            if self._readers <= 0:
                raise RuntimeError("release_read without a matching acquire_read")
            self._readers -= 1
            if self._readers == 0:
                self._cond.notify_all()

    def acquire_write(self, timeout: float | None = None) -> None:
        """Acquire for writing (waits for readers to leave); raise TimeoutError after
        ``timeout`` s."""
        t = self._timeout(timeout)
        with self._cond:
            self._writers_waiting += 1
            try:
                ok = self._cond.wait_for(
                    lambda: self._closed is not None or not (self._writer or self._readers),
                    t,
                )
            finally:
                self._writers_waiting -= 1
                self._cond.notify_all()  # readers held back by this waiter may go on
            if self._closed is not None:
                raise LockClosedError(self._closed)
            if not ok:
                raise TimeoutError(
                    f"timed out after {t:g}s waiting for the write lock "
                    f"({self._readers} reader(s) still active)"
                )
            self._writer = True

    def release_write(self) -> None:
        with self._cond:
            if not self._writer:
                raise RuntimeError("release_write without a matching acquire_write")
            self._writer = False
            self._cond.notify_all()

    @contextmanager
    def read_locked(self, timeout: float | None = None) -> Iterator[None]:
        self.acquire_read(timeout)
        try:
            yield
        finally:
            self.release_read()

    @contextmanager
    def write_locked(self, timeout: float | None = None) -> Iterator[None]:
        self.acquire_write(timeout)
        try:
            yield
        finally:
            self.release_write()

    @property
    def readers(self) -> int:
        """Number of current readers."""
        return self._readers

    def w_locked(self) -> bool:
        """Whether a writer holds the lock."""
        return self._writer

    def close(self, reason: str = "lock closed") -> None:
        """Fail every waiting and future acquisition with ``LockClosedError(reason)``."""
        with self._cond:
            self._closed = reason
            self._cond.notify_all()
