"""Bounded waits: poll a condition until it holds, fail with context at the deadline.

Every wait in the tests goes through here, so none is unbounded and every timeout says what was
awaited and shows what helps to debug it (a cluster's node logs, a process's output).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, TypeVar

T = TypeVar("T")
POLL_S = 0.02


def _describe(context: Any) -> str:
    if context is None:
        return ""
    if hasattr(context, "tail_logs"):  # a LocalCluster
        return "\n" + context.tail_logs()
    return "\n" + str(context() if callable(context) else context)


def wait_for(what: str, cond: Callable[[], T], timeout: float, *, context: Any = None,
             interval: float = POLL_S) -> T:
    """Poll ``cond`` until it returns something truthy and return that value; after ``timeout``
    seconds raise ``AssertionError`` naming ``what``, with ``context`` (a ``LocalCluster`` for its
    node logs, a callable returning text, or text)."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.1f}s waiting for {what}{_describe(context)}")
        time.sleep(interval)


async def wait_for_async(what: str, cond: Callable[[], T | Awaitable[T]], timeout: float, *, context: Any = None,
                         interval: float = POLL_S) -> T:
    """``wait_for`` on an event loop: ``cond`` may be a plain or an async callable."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.1f}s waiting for {what}{_describe(context)}")
        await asyncio.sleep(interval)
