"""ftclient's one watchdog (``ftclient._timeouts.Watchdog``): timers fire after their deadline,
earliest first; a cancelled timer never runs; a raising callback is logged and the thread goes
on; the process groups and ``future_timeout`` share the process-wide one.

Every wait here is on an event, bounded by ``WAIT``; no test sleeps."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest

from ftclient import _timeouts, process_group
from ftclient._timeouts import WATCHDOG, Watchdog

WAIT = 10.0  # generous bound on every wait: the deadlines below are 0.05-0.3 s


@pytest.fixture
def watchdog() -> Iterator[Watchdog]:
    wd = Watchdog(name="test-watchdog")
    yield wd
    wd.close(timeout=WAIT)


def test_fires_after_its_deadline(watchdog: Watchdog) -> None:
    fired = threading.Event()
    fired_at: list[float] = []
    thread_names: list[str] = []

    def callback() -> None:
        fired_at.append(time.monotonic())
        thread_names.append(threading.current_thread().name)
        fired.set()

    scheduled_at = time.monotonic()
    watchdog.schedule(0.2, callback)
    assert fired.wait(WAIT)
    assert fired_at[0] - scheduled_at >= 0.2
    assert thread_names == ["test-watchdog"]  # on the watchdog's thread, not the caller's


def test_timers_fire_in_deadline_order(watchdog: Watchdog) -> None:
    order: list[str] = []
    done = threading.Event()
    watchdog.schedule(0.3, lambda: (order.append("late"), done.set()))
    watchdog.schedule(0.1, lambda: order.append("early"))  # scheduled second, due first
    watchdog.schedule(0.0, lambda: order.append("now"))
    assert done.wait(WAIT)
    assert order == ["now", "early", "late"]


def test_cancelled_timer_never_runs(watchdog: Watchdog) -> None:
    ran: list[str] = []
    later = threading.Event()
    timer = watchdog.schedule(0.05, lambda: ran.append("cancelled"))
    timer.cancel()
    timer.cancel()  # twice is harmless
    assert timer.cancelled
    # Due after the cancelled one: once it ran, the cancelled one's deadline has been handled.
    watchdog.schedule(0.15, later.set)
    assert later.wait(WAIT)
    assert ran == []


def test_cancel_releases_the_callback(watchdog: Watchdog) -> None:
    """A cancelled timer does not keep what its callback holds alive until its deadline."""
    import gc
    import weakref

    class Payload:
        pass

    payload = Payload()
    ref = weakref.ref(payload)
    timer = watchdog.schedule(3600.0, lambda p=payload: p)
    del payload
    gc.collect()
    assert ref() is not None  # held by the pending timer
    timer.cancel()
    gc.collect()
    assert ref() is None


def test_raising_callback_is_logged_and_later_timers_still_fire(
    watchdog: Watchdog, caplog: pytest.LogCaptureFixture
) -> None:
    later = threading.Event()

    def boom() -> None:
        raise ValueError("callback failure for the test")

    caplog.set_level(logging.ERROR, logger=_timeouts.__name__)
    watchdog.schedule(0.0, boom)
    watchdog.schedule(0.05, later.set)
    assert later.wait(WAIT), "the watchdog thread died with the raising callback"
    records = [r for r in caplog.records if r.name == _timeouts.__name__]
    assert len(records) == 1
    assert records[0].levelno == logging.ERROR
    assert records[0].exc_info is not None and records[0].exc_info[0] is ValueError
    assert "callback failure for the test" in caplog.text
    # And it keeps serving timers scheduled after the failure.
    again = threading.Event()
    watchdog.schedule(0.0, again.set)
    assert again.wait(WAIT)


def test_closed_watchdog_stops_its_thread_and_refuses_timers() -> None:
    wd = Watchdog(name="test-watchdog-closed")
    ran = threading.Event()
    wd.schedule(0.0, ran.set)
    assert ran.wait(WAIT)
    thread = wd._thread
    assert thread is not None and thread.is_alive()
    wd.close(timeout=WAIT)
    assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        wd.schedule(0.0, ran.set)


def _child_after_fork(wd: Watchdog, parent_ran: list[str]) -> None:
    import os

    fired = threading.Event()
    wd.schedule(0.0, fired.set)  # a fresh thread in the child
    ok = fired.wait(WAIT) and len(wd._heap) == 0 and parent_ran == []
    os._exit(0 if ok else 1)


@pytest.mark.integration
@pytest.mark.skipif(not hasattr(__import__("os"), "register_at_fork"), reason="no os.fork here")
def test_forked_child_drops_the_parents_timers_and_starts_its_own_thread(watchdog: Watchdog) -> None:
    import multiprocessing

    parent_ran: list[str] = []
    watchdog.schedule(0.0, lambda: None)  # the parent's thread is running at the fork
    watchdog.schedule(3600.0, lambda: parent_ran.append("parent's timer"))
    child = multiprocessing.get_context("fork").Process(target=_child_after_fork,
                                                         args=(watchdog, parent_ran))
    child.start()
    child.join(WAIT)
    if child.exitcode is None:
        child.kill()
        child.join(WAIT)
    assert child.exitcode == 0


def test_one_watchdog_serves_both_places() -> None:
    """The process groups' per-operation deadlines use the same process-wide watchdog as
    ``future_timeout``: there is no second heap-timer thread."""
    assert process_group.WATCHDOG is WATCHDOG
    assert not hasattr(process_group, "_Watchdog")
    fired = threading.Event()
    WATCHDOG.schedule(0.0, fired.set)
    assert fired.wait(WAIT)
    names = [t.name for t in threading.enumerate()]
    assert names.count("ftclient-watchdog") == 1
    assert "ftclient-pg-watchdog" not in names
