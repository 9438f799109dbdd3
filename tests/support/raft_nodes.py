"""In-process pysyncobj nodes on loopback, for tests of the Raft layer alone."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from lighthouse_cluster.local.cluster import free_ports
from support.raft_counter import Counter
from support.waiting import wait_for

Node = TypeVar("Node")


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range (see ``free_ports``)."""
    return free_ports(1)[0]


def run_on_tick_thread(node: Any, fn: Callable[[], None], timeout: float = 5.0) -> None:
    """Run ``fn()`` once on ``node``'s pysyncobj tick thread (woken at once where it can be) and
    return once it ran (``timeout`` seconds at most)."""
    done: list[bool] = []

    def once() -> None:
        if not done:
            fn()
            done.append(True)

    node.addOnTickCallback(once)
    try:
        wake = getattr(node, "wake", None)
        if wake is not None:
            wake()
        wait_for("the tick thread to run it", lambda: bool(done), timeout, interval=0.001)
    finally:
        node.removeOnTickCallback(once)


def start_nodes(makers: list[Callable[..., Node]], ready: Callable[[list[Node]], bool], **kwargs: Any) -> list[Node]:
    """One node per maker on a fresh loopback port, ``maker(address, other_addresses,
    consumers=[Counter()], **kwargs)`` (each node's counter as its ``counter``), once ``ready(nodes)``
    holds (10 s at most); every node is destroyed if they do not get there."""
    addrs = [f"127.0.0.1:{free_port()}" for _ in makers]
    out: list[Any] = []
    try:
        for make, a in zip(makers, addrs):
            counter = Counter()
            out.append(make(a, [x for x in addrs if x != a], consumers=[counter], **kwargs))
            out[-1].counter = counter
        wait_for("the nodes to be ready", lambda: ready(out), 10)
    except BaseException:
        for n in out:
            n.destroy()
        raise
    return out
