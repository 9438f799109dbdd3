"""Which asyncio event loop a node process runs on.

uvloop (libuv) by default: grpc.aio works with any asyncio loop, and on uvloop the node answers
14-35 % more quorum rounds per second at N >= 64 (docs/design/event-loop.md). ``asyncio`` is the
standard library's loop, for platforms without uvloop or to rule it out when debugging; a node
asked for uvloop where it is not installed says so once and runs on asyncio.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Coroutine

log = logging.getLogger(__name__)

LOOPS = ("uvloop", "asyncio")
DEFAULT_LOOP = "uvloop"


def run(main: Coroutine[Any, Any, Any], kind: str = DEFAULT_LOOP) -> Any:
    """``asyncio.run(main)`` on the loop ``kind`` (one of ``LOOPS``)."""
    if kind not in LOOPS:
        main.close()
        raise ValueError(f"unknown event loop {kind!r}; known: {', '.join(LOOPS)}")
    if kind == "uvloop":
        try:
            import uvloop
        except ImportError:
            log.warning("uvloop is not installed: running on asyncio's own event loop")
        else:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                return runner.run(main)
    return asyncio.run(main)


def running_loop_name() -> str:
    """'uvloop' or 'asyncio': what the running loop is (for the start-up log line)."""
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.startswith("uvloop") else "asyncio"
