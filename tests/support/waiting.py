"""Bounded waits: poll a condition until it holds, fail with context at the deadline.

Every wait in the tests goes through here, so none is unbounded and every timeout says what was
awaited, what the condition last returned, and shows what helps to debug it (a cluster's node
logs, a process's output).

``wait_for`` and ``wait_for_async`` take the same arguments:

* ``what``: what is awaited, for the failure message;
* ``cond``: the probe, called every ``interval`` seconds (an async callable is awaited too in
  ``wait_for_async``); its value is returned once ``ready(value)`` holds;
* ``timeout``: seconds before ``AssertionError``;
* ``context``: a ``LocalCluster`` (its nodes' last log lines), a callable returning text, or text;
* ``ready``: when the probe's value is the awaited one: truthy by default; ``not_none`` for a
  probe whose awaited value may be falsy (a node index 0) and which returns ``None`` until then;
* ``retry_on``: exceptions of the probe that mean "not yet" (a port not bound yet) rather than a
  failure; any other exception propagates at once (a probe may assert that a process is still
  running, so that a wait for its output fails as soon as it died).

``run_on_threads`` runs calls side by side (the ranks of a group, a sender and a receiver) and
waits for all of them, bounded too.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Awaitable, Callable, Sequence, TypeVar

T = TypeVar("T")
POLL_S = 0.02


def not_none(value: object) -> bool:
    """``ready`` for a probe that returns ``None`` until it has a (possibly falsy) value."""
    return value is not None


def _describe(context: Any) -> str:
    if context is None:
        return ""
    if hasattr(context, "tail_logs"):  # a LocalCluster
        return "\n" + context.tail_logs()
    return "\n" + str(context() if callable(context) else context)


def _timed_out(what: str, timeout: float, last: object, context: Any) -> AssertionError:
    shown = repr(last)
    if len(shown) > 500:
        shown = shown[:500] + "..."
    return AssertionError(f"timed out after {timeout:.1f}s waiting for {what} (last: {shown}){_describe(context)}")


def wait_for(what: str, cond: Callable[[], T], timeout: float, *, context: Any = None,
             interval: float = POLL_S, ready: Callable[[Any], bool] = bool,
             retry_on: tuple[type[BaseException], ...] = ()) -> T:
    """Poll ``cond`` until ``ready`` holds for its value (truthy by default) and return that
    value; after ``timeout`` seconds raise ``AssertionError`` naming ``what``, with the last value
    and ``context``. See the module's docstring for the arguments."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = cond()
        except retry_on as e:
            value = e  # type: ignore[assignment]
        else:
            if ready(value):
                return value
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout, value, context)
        time.sleep(interval)


async def wait_for_async(what: str, cond: Callable[[], T | Awaitable[T]], timeout: float, *, context: Any = None,
                         interval: float = POLL_S, ready: Callable[[Any], bool] = bool,
                         retry_on: tuple[type[BaseException], ...] = ()) -> T:
    """``wait_for`` on an event loop: ``cond`` may be a plain or an async callable."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = cond()
            if asyncio.iscoroutine(value):
                value = await value
        except retry_on as e:
            value = e  # type: ignore[assignment]
        else:
            if ready(value):
                return value  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout, value, context)
        await asyncio.sleep(interval)


def run_on_threads(calls: Sequence[Callable[[], T]], timeout: float) -> list[T]:
    """Run ``calls`` each on a thread of its own; their results in order, or the first error
    raised. Fails if any is still running ``timeout`` seconds after the joins began (its daemon
    thread is left behind)."""
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as e:  # noqa: BLE001 -- handed to the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), f"still running after {timeout}s"
    if errors:
        raise errors[0]
    return results
