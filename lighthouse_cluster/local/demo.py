"""`lighthouse-cluster up --demo`: simulated replica groups train through a leader failure.

Each simulated replica group (``simulated_group.SimulatedReplicaGroup``) talks to a different
node (followers forward to the leader), moves to the next node when its own is unavailable, and
does one quorum round per step. Every ``kill_every_s`` the demo SIGKILLs the current leader and
reports the new leader, how long until every group had its next quorum, and whether the quorum
id stayed the same (it should: the members did not change). It does not restart the killed node
itself: ``up``'s supervisor restarts any node that exits (``supervise.NodeSupervisor``), and the
node catches up from its journal and its peers. Runs until ``should_stop()`` (or ``duration_s``).
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any, Callable

from lighthouse_cluster.local.cluster import LocalCluster
from lighthouse_cluster.local.simulated_group import ON_UNAVAILABLE, RoundResult, SimulatedReplicaGroup


def kill_line(name: str, new_leader: str | None, leader_after_s: float | None, recovered_after_s: float | None,
              quorum_before: int | None, quorum_after: int | None) -> str:
    """What the demo prints after a kill: ``killed leader n2 (SIGKILL); new leader n3 after
    0.31 s; every group had its next quorum after 0.35 s; quorum id still 4``."""
    parts = [f"killed leader {name} (SIGKILL)"]
    if new_leader is None or leader_after_s is None:
        parts.append("no new leader yet")
    else:
        parts.append(f"new leader {new_leader} after {leader_after_s:.2f} s")
    if recovered_after_s is None:
        parts.append("not every group had its next quorum within 10 s")
    else:
        parts.append(f"every group had its next quorum after {recovered_after_s:.2f} s")
    if quorum_before is None:
        parts.append("no quorum before the kill")
    elif quorum_after is None or quorum_after == quorum_before:
        parts.append(f"quorum id still {quorum_before}" if quorum_after is not None
                     else f"quorum id was {quorum_before}")
    else:
        parts.append(f"quorum id {quorum_before} -> {quorum_after}")
    return "; ".join(parts)


def run_demo(cluster: LocalCluster, replicas: int = 3, console: Any = None, kill_every_s: float = 8.0,
             step_time_s: float = 0.2, duration_s: float | None = None,
             should_stop: Callable[[], bool] | None = None, say: Callable[[str], None] | None = None) -> None:
    asyncio.run(_demo(cluster, replicas, console, kill_every_s, step_time_s, duration_s, should_stop, say))


async def _demo(cluster: LocalCluster, replicas: int, console: Any, kill_every_s: float, step_time_s: float,
                duration_s: float | None, should_stop: Callable[[], bool] | None,
                say_fn: Callable[[str], None] | None) -> None:
    def say(text: str) -> None:
        if say_fn is not None:
            say_fn(text)
        elif console is not None:
            console.print(text, soft_wrap=True)
        else:
            print(text, flush=True)
    addresses = cluster.client_addresses
    last_seen: dict[str, RoundResult] = {}
    printed_ids: set[int] = set()

    def on_round(r: RoundResult) -> None:
        if r.quorum_id is None:
            return
        last_seen[r.replica_id] = r
        if r.quorum_id not in printed_ids:
            printed_ids.add(r.quorum_id)
            say(f"quorum {r.quorum_id}: {', '.join(r.participants)} (step {r.step}, via {r.endpoint}, "
                f"{r.latency_s * 1000:.0f} ms)")

    groups = [SimulatedReplicaGroup(f"replica_{i}", addresses[i % len(addresses)], quorum_timeout_s=3.0,
                                    step_time_s=step_time_s, on_round=on_round,
                                    fallback_endpoints=tuple(addresses), move_on=ON_UNAVAILABLE)
              for i in range(replicas)]
    started = time.monotonic()
    stopped = False

    def done() -> bool:
        return stopped or (should_stop is not None and should_stop()) or \
            (duration_s is not None and time.monotonic() - started > duration_s)

    async def pause(seconds: float) -> None:
        until = time.monotonic() + seconds
        while not done() and time.monotonic() < until:
            await asyncio.sleep(min(0.1, max(0.0, until - time.monotonic())))

    tasks = [asyncio.ensure_future(g.run(until=done)) for g in groups]
    say(f"demo: {replicas} simulated replica groups, a leader SIGKILL every {kill_every_s:g} s")
    try:
        while not done():
            await pause(kill_every_s)
            if done():
                break
            leader = await asyncio.to_thread(cluster.leader_index)
            if leader is None:
                continue
            name = cluster.members[leader].peer.node_id
            ids = [r.quorum_id for r in last_seen.values() if r.quorum_id is not None]
            quorum_before = max(ids) if ids else None
            killed_at = time.monotonic()
            cluster.signal(leader, signal.SIGKILL)  # the supervisor restarts it
            others = [i for i in range(cluster.nodes) if i != leader]
            new_leader, leader_after = None, None
            deadline = killed_at + 10
            while time.monotonic() < deadline and not done():
                i = await asyncio.to_thread(cluster.leader_index, others)
                if i is not None:
                    new_leader, leader_after = cluster.members[i].peer.node_id, time.monotonic() - killed_at
                    break
                await asyncio.sleep(0.01)
            while time.monotonic() < deadline and not done() and not all(
                    r.started + r.latency_s > killed_at for r in last_seen.values()):
                await asyncio.sleep(0.01)
            after = [r for r in last_seen.values() if r.started + r.latency_s > killed_at]
            recovered = (max(r.started + r.latency_s for r in after) - killed_at
                         if after and len(after) == len(last_seen) else None)
            ids_after = {r.quorum_id for r in after if r.quorum_id is not None}
            quorum_after = quorum_before if ids_after == {quorum_before} else max(ids_after, default=None)
            if done():
                break
            say(kill_line(name, new_leader, leader_after, recovered, quorum_before, quorum_after))
    except asyncio.CancelledError:
        pass
    finally:
        stopped = True
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(g.close() for g in groups), return_exceptions=True)
