"""Results that pysyncobj hands over on its tick thread, delivered to an asyncio event loop."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

Settle = Callable[[Any, "BaseException | None"], None]


def loop_future(loop: asyncio.AbstractEventLoop,
                on_settle: Settle | None = None) -> tuple["asyncio.Future[Any]", Settle]:
    """A future of ``loop`` and ``callback(result, error)``, callable from any thread, that
    settles it on the loop. ``on_settle(result, error)`` runs on the loop first, even when the
    future was cancelled meanwhile; a future already done is left as it is."""
    future: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if on_settle is not None:
            on_settle(result, error)
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def callback(result: Any, error: BaseException | None) -> None:
        loop.call_soon_threadsafe(settle, result, error)

    return future, callback
