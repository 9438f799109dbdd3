"""Deadlines and timeouts shared by ftclient's modules.

* :class:`Deadline` -- a monotonic deadline computed once, so retries and re-sends never extend
  the caller's timeout.
* :func:`to_seconds` -- ``timedelta`` / seconds / None normalization.
* :func:`wait_within` / :func:`stop_at` -- tenacity strategies bounded by a :class:`Deadline`.
* :func:`future_timeout` -- a ``torch.futures.Future`` that fails with ``TimeoutError`` unless
  the wrapped one completes in time. One watchdog thread serves every pending timeout (DDP may
  wrap one future per gradient bucket per step; a thread each would be wasteful).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import tenacity

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


def to_seconds(value: timedelta | float | int | None) -> float | None:
    """Seconds as a float; None stays None."""
    if value is None:
        return None
    if isinstance(value, timedelta):
        return value.total_seconds()
    return float(value)


@dataclass(frozen=True)
class Deadline:
    """A point on the monotonic clock; ``Deadline.after(5.0).remaining()`` counts down from 5."""

    at: float

    @classmethod
    def after(cls, timeout: timedelta | float) -> "Deadline":
        seconds = to_seconds(timeout)
        assert seconds is not None
        return cls(time.monotonic() + seconds)

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.at


def wait_within(deadline: Deadline,
                base: Callable[[tenacity.RetryCallState], float]) -> Callable[[tenacity.RetryCallState], float]:
    """tenacity wait strategy: ``base``'s sleep, but never past ``deadline``."""
    def wait(retry_state: tenacity.RetryCallState) -> float:
        return max(0.0, min(base(retry_state), deadline.remaining()))
    return wait


def stop_at(deadline: Deadline) -> Callable[[tenacity.RetryCallState], bool]:
    """tenacity stop condition: ``deadline`` has passed."""
    def stop(retry_state: tenacity.RetryCallState) -> bool:
        return deadline.expired()
    return stop


class _Watchdog:
    """One daemon thread firing callbacks at deadlines (earliest first)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Any]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def schedule(self, at: float, callback: Any) -> None:
        with self._cond:
            item = (at, next(self._seq), callback)
            heapq.heappush(self._heap, item)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="ftclient-timeouts", daemon=True)
                self._thread.start()
            if self._heap[0] is item:  # a later deadline than the one waited for needs no wake-up
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap:
                    self._cond.wait()
                at, _, callback = self._heap[0]
                delay = at - time.monotonic()
                if delay > 0:
                    self._cond.wait(delay)
                    continue
                heapq.heappop(self._heap)
            try:
                callback()
            except Exception:  # a callback must never kill the watchdog
                pass


_WATCHDOG = _Watchdog()


def future_timeout(fut: "torch.futures.Future[T]", timeout: timedelta | float) -> "torch.futures.Future[T]":
    """A new Future with ``fut``'s outcome, or ``TimeoutError`` if ``fut`` is not done within
    ``timeout``. ``fut`` itself is left alone (its late result is ignored)."""
    import torch

    seconds = to_seconds(timeout)
    assert seconds is not None
    out: torch.futures.Future[T] = torch.futures.Future()
    # The watchdog keeps ``on_timeout`` until the deadline even when ``fut`` finished long
    # before: it must not keep ``out`` (and the tensor it holds) alive, hence the holder.
    holder: list[torch.futures.Future[T] | None] = [out]
    lock = threading.Lock()

    def settle(method: str, value: Any) -> None:
        with lock:
            target, holder[0] = holder[0], None
        if target is not None:
            getattr(target, method)(value)

    def on_done(f: "torch.futures.Future[T]") -> None:
        try:
            value = f.value()
        except Exception as e:  # noqa: BLE001 -- forwarded to the caller as the future's error
            settle("set_exception", e)
        else:
            settle("set_result", value)

    def on_timeout() -> None:
        settle("set_exception", TimeoutError(f"future did not complete within {seconds:g}s"))

    _WATCHDOG.schedule(time.monotonic() + seconds, on_timeout)
    fut.add_done_callback(on_done)
    return out
