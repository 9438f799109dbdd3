"""`lighthouse-cluster up --demo`: simulated replica groups train through a leader failure.

Each simulated replica group talks to a different node (followers forward to the leader) and
does one quorum round per step. Every ``kill_every_s`` the demo SIGKILLs the current leader,
reports how long until every group had its next quorum, and restarts the killed node, which
catches up from its journal and its peers. Runs until Ctrl-C.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from .local_cluster import LocalCluster
from .replica_sim import RoundResult, SimulatedReplicaGroup


def run_demo(cluster: LocalCluster, replicas: int = 3, console: Any = None, kill_every_s: float = 8.0,
             step_time_s: float = 0.2, duration_s: float | None = None) -> None:
    asyncio.run(_demo(cluster, replicas, console, kill_every_s, step_time_s, duration_s))


async def _demo(cluster: LocalCluster, replicas: int, console: Any, kill_every_s: float, step_time_s: float,
                duration_s: float | None) -> None:
    def say(text: str) -> None:
        if console is not None:
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
                                    fallback_endpoints=tuple(addresses)) for i in range(replicas)]
    stop = False
    started = time.monotonic()

    def done() -> bool:
        return stop or (duration_s is not None and time.monotonic() - started > duration_s)

    tasks = [asyncio.ensure_future(g.run(until=done)) for g in groups]
    say(f"demo: {replicas} simulated replica groups, a leader SIGKILL every {kill_every_s:g}s (Ctrl-C to stop)")
    try:
        while not done():
            await asyncio.sleep(kill_every_s)
            if done():
                break
            leader = await asyncio.to_thread(cluster.leader_index)
            if leader is None:
                continue
            name = cluster.members[leader].peer.node_id
            killed_at = time.monotonic()
            await asyncio.to_thread(cluster.kill, leader)
            say(f"[bold red]SIGKILL leader {name}[/]" if console is not None else f"SIGKILL leader {name}")
            deadline = killed_at + 10
            while time.monotonic() < deadline and not all(
                    r.started + r.latency_s > killed_at for r in last_seen.values()):
                await asyncio.sleep(0.01)
            recovered = max(r.started + r.latency_s for r in last_seen.values()) - killed_at
            new_leader = await asyncio.to_thread(cluster.leader_index)
            new_name = cluster.members[new_leader].peer.node_id if new_leader is not None else "?"
            say(f"every replica group had its next quorum {recovered * 1000:.0f} ms after the kill "
                f"(new leader {new_name}); restarting {name}")
            await asyncio.to_thread(cluster.start_node, leader)
    except asyncio.CancelledError:
        pass
    finally:
        stop = True
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(g.close() for g in groups), return_exceptions=True)
