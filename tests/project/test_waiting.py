"""support.waiting, the one bounded wait every test uses."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from support.waiting import not_none, wait_for, wait_for_async


def test_returns_the_first_truthy_value() -> None:
    values = iter([None, 0, [], "ready"])
    assert wait_for("a value", lambda: next(values), 1.0, interval=0.001) == "ready"


def test_times_out_naming_what_the_last_value_and_the_context() -> None:
    with pytest.raises(AssertionError) as info:
        wait_for("the impossible", lambda: [], 0.05, context=lambda: "the logs", interval=0.01)
    assert str(info.value) == "timed out after 0.1s waiting for the impossible (last: [])\nthe logs"


def test_context_of_a_cluster_is_its_logs() -> None:
    class Cluster:
        def tail_logs(self) -> str:
            return "--- n1 ---"

    with pytest.raises(AssertionError, match="--- n1 ---"):
        wait_for("x", lambda: False, 0.0, context=Cluster())


def test_not_none_accepts_a_falsy_value() -> None:
    values = iter([None, None, 0])
    assert wait_for("node index", lambda: next(values), 1.0, ready=not_none, interval=0.001) == 0


def test_retry_on_treats_those_errors_as_not_yet_and_others_fail_at_once() -> None:
    calls = itertools.count()

    def probe() -> str:
        if next(calls) < 2:
            raise ConnectionRefusedError("not bound yet")
        return "up"

    def refused() -> str:
        raise ConnectionRefusedError("not bound yet")

    assert wait_for("a port", probe, 1.0, retry_on=(OSError,), interval=0.001) == "up"
    with pytest.raises(AssertionError, match=r"last: ConnectionRefusedError\('not bound yet'\)"):
        wait_for("a port", refused, 0.02, retry_on=(OSError,), interval=0.005)
    with pytest.raises(KeyError):
        wait_for("a key", lambda: {}["missing"], 1.0, retry_on=(OSError,))


def test_async_awaits_a_coroutine_probe_and_keeps_the_same_rules() -> None:
    values = iter([None, 0, 7])

    async def probe() -> int | None:
        return next(values)

    async def main() -> None:
        assert await wait_for_async("a value", probe, 1.0, ready=not_none, interval=0.001) == 0
        assert await wait_for_async("a value", probe, 1.0, interval=0.001) == 7
        with pytest.raises(AssertionError, match="waiting for never"):
            await wait_for_async("never", lambda: False, 0.02, interval=0.005)

    asyncio.run(main())
