"""Deadlines and timeouts shared by ftclient's modules.

* :class:`Deadline` -- a monotonic deadline computed once, so retries and re-sends never extend
  the caller's timeout.
* :func:`to_seconds` -- ``timedelta`` / seconds / None normalization.
* :func:`wait_within` / :func:`stop_at` -- tenacity strategies bounded by a :class:`Deadline`.
* :class:`Watchdog` / :data:`WATCHDOG` -- one thread running callbacks at deadlines; every
  ftclient timeout (this module's :func:`future_timeout`, the process groups' per-operation
  deadlines) shares the process-wide one. A raising callback is logged, never fatal to it.
* :func:`future_timeout` -- a ``torch.futures.Future`` that fails with ``TimeoutError`` unless
  the wrapped one completes in time.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import tenacity

if TYPE_CHECKING:
    import torch

T = TypeVar("T")

logger: logging.Logger = logging.getLogger(__name__)


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


class Timer:
    """A callback scheduled on a :class:`Watchdog`; :meth:`cancel` it once it is no longer needed."""

    __slots__ = ("_callback",)

    def __init__(self, callback: Callable[[], object]) -> None:
        self._callback: Callable[[], object] | None = callback

    def cancel(self) -> None:
        """The callback will not run (if it has not started yet). Drops the reference to it at
        once, so whatever it holds is freed before the deadline; cancelling twice is harmless."""
        self._callback = None

    @property
    def cancelled(self) -> bool:
        return self._callback is None

    def _take(self) -> Callable[[], object] | None:
        callback, self._callback = self._callback, None
        return callback


class Watchdog:
    """One daemon thread running callbacks at deadlines, earliest first (cheaper than a
    ``threading.Timer`` per operation: DDP may start one timed operation per gradient bucket
    per step).

    * A callback that raises is logged (``logger.exception``) and the thread goes on with the
      next timer: one bad callback never stops the timeouts of everything else.
    * Callbacks run on the watchdog thread, one at a time: they must be short and not block.
    * The thread starts on first use. In a forked child the timers of the parent are dropped
      (they belong to operations of the parent) and a fresh thread starts on the child's first
      :meth:`schedule`.
    """

    def __init__(self, name: str = "ftclient-watchdog") -> None:
        self._name = name
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, Timer]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False
        if hasattr(os, "register_at_fork"):
            reset = weakref.WeakMethod(self._after_fork_in_child)  # the hook must not keep us alive

            def after_fork_in_child() -> None:
                method = reset()
                if method is not None:
                    method()

            os.register_at_fork(after_in_child=after_fork_in_child)

    def schedule(self, delay_s: float, callback: Callable[[], object]) -> Timer:
        """Run ``callback()`` on the watchdog thread ``delay_s`` seconds from now."""
        timer = Timer(callback)
        with self._cv:
            if self._closed:
                raise RuntimeError(f"watchdog {self._name} is closed")
            item = (time.monotonic() + max(0.0, delay_s), next(self._seq), timer)
            heapq.heappush(self._heap, item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            if self._heap[0] is item:  # a later deadline than the one waited for needs no wake-up
                self._cv.notify()
        return timer

    def close(self, timeout: float | None = None) -> None:
        """Stop the thread without running the timers still pending (tests; the process-wide
        watchdog is never closed)."""
        with self._cv:
            self._closed = True
            self._heap.clear()
            self._cv.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _after_fork_in_child(self) -> None:
        self._cv = threading.Condition()  # the parent's thread may have held the old lock
        self._heap = []
        self._thread = None

    def _run(self) -> None:
        cv = self._cv
        while True:
            with cv:
                while not self._heap and not self._closed:
                    cv.wait()
                if self._closed:
                    return
                at, _, timer = self._heap[0]
                delay = at - time.monotonic()
                if delay > 0:
                    cv.wait(delay)
                    continue
                heapq.heappop(self._heap)
            callback = timer._take()
            if callback is None:  # cancelled
                continue
            try:
                callback()
            except Exception:  # a callback must never kill the watchdog
                logger.exception("ftclient watchdog: timer callback %r raised; later timers still run",
                                 callback)
            del callback  # not kept alive (with what it holds) while waiting for the next timer


WATCHDOG = Watchdog()
"""The process-wide watchdog every ftclient timeout shares."""


def future_timeout(fut: "torch.futures.Future[T]", timeout: timedelta | float) -> "torch.futures.Future[T]":
    """A new Future with ``fut``'s outcome, or ``TimeoutError`` if ``fut`` is not done within
    ``timeout``. ``fut`` itself is left alone (its late result is ignored)."""
    import torch

    seconds = to_seconds(timeout)
    assert seconds is not None
    out: torch.futures.Future[T] = torch.futures.Future()
    # ``fut`` keeps ``on_done`` until it completes, which may be never or long after the timeout:
    # it must not keep ``out`` (and the tensor it holds) alive, hence the holder. The first of
    # result, error and timeout settles ``out``.
    holder: list[torch.futures.Future[T] | None] = [out]
    lock = threading.Lock()

    def settle(method: str, value: Any) -> None:
        with lock:
            target, holder[0] = holder[0], None
        if target is not None:
            getattr(target, method)(value)

    def on_done(f: "torch.futures.Future[T]") -> None:
        timer.cancel()
        try:
            value = f.value()
        except Exception as e:  # noqa: BLE001 -- forwarded to the caller as the future's error
            settle("set_exception", e)
        else:
            settle("set_result", value)

    def on_timeout() -> None:
        settle("set_exception", TimeoutError(f"future did not complete within {seconds:g}s"))

    timer = WATCHDOG.schedule(seconds, on_timeout)
    fut.add_done_callback(on_done)  # last: a completed ``fut`` calls ``on_done`` at once
    return out
