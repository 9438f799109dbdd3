"""What durability costs: quorum rounds and failover with and without fsync, on this
machine's disk and on tmpfs, side by side.

Every Raft entry a node acknowledges, and every entry a leader counts as its own, is now synced
first (``lighthouse_cluster/raft/durable_journal.py``, one fdatasync per batch); term and vote
before a vote. This measures what that costs where it shows:

* **new quorum**: every round commits a new quorum through Raft (the groups report a failed
  commit, so each round gets the next quorum id, as after a membership change: the leader writes
  a ``CommitQuorum`` entry and answers once a majority has it, each copy synced);
* **fast quorum**: the same members and id again, issued on the leader lease with no Raft commit
  (nothing is written per round, so syncing must not slow it down);
* **failover**: the leader SIGKILLed; time until every group has a quorum again (a new leader's
  election writes its term and vote, synced, and commits a no-op and a ``TermStart``).

Each combination of storage (``disk``: a directory on the root filesystem; ``tmpfs``:
``/dev/shm``, where fsync returns at once) and syncing (``fsync``: the default; ``no-fsync``:
``--unsafe-no-fsync``) runs a fresh 3-node cluster with two replica groups calling the leader back
to back. Results: a table on stdout and ``--out``.md/.json.

    python -m benchmarks.durability --seconds 6 --kills 5 --out benchmarks/bench-durability
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from lighthouse_cluster.local.cluster import LocalCluster
from lighthouse_cluster.local.simulated_group import SimulatedReplicaGroup

GROUPS = 2
STORAGES = {"disk": None, "tmpfs": Path("/dev/shm")}   # None: tempfile's default (/tmp, the root disk here)
NEXT_QUORUM_TIMEOUT_S = 20.0


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def _rounds(endpoint: str, seconds: float, new_quorum: bool) -> dict[str, Any]:
    """Two groups on ``endpoint`` doing rounds back to back for ``seconds``: round latency (each
    group's call) and rounds per second (rounds both groups completed)."""
    groups = [SimulatedReplicaGroup(f"g{k}", endpoint, commit_failures=1 if new_quorum else 0, keep_rounds=True)
              for k in range(GROUPS)]
    deadline = time.monotonic() + seconds
    try:
        await asyncio.gather(*(g.run(until=lambda: time.monotonic() > deadline) for g in groups))
    finally:
        for g in groups:
            await g.close()
    ok = [r for g in groups for r in g.rounds if not r.error]
    warm = [r for r in ok if r.started > deadline - seconds + 0.5] or ok   # the first half second: warm-up
    ids = {r.quorum_id for r in ok}
    latencies = [r.latency_s * 1000 for r in warm]
    return {"rounds_per_s": round(min(len([r for r in warm if r.replica_id == g.replica_id]) for g in groups)
                                  / (seconds - 0.5), 1),
            "p50_ms": round(_pct(latencies, 0.5), 2), "p90_ms": round(_pct(latencies, 0.9), 2),
            "p99_ms": round(_pct(latencies, 0.99), 2), "quorum_ids": len(ids),
            "errors": sum(1 for g in groups for r in g.rounds if r.error)}


async def _failover(cluster: LocalCluster, kills: int) -> list[float]:
    """SIGKILL the leader ``kills`` times (restarting it after each): seconds from the kill until
    every group had a quorum from a round it started after the kill."""
    endpoints = tuple(cluster.client_addresses)
    out: list[float] = []
    for _ in range(kills):
        leader, _ = cluster.wait_for_stable_leader(timeout=30.0)
        groups = [SimulatedReplicaGroup(f"f{k}", endpoints[(leader + 1 + k) % len(endpoints)],
                                        fallback_endpoints=endpoints, retry_sleep_s=0.02, quorum_timeout_s=2.0)
                  for k in range(GROUPS)]
        stop = False
        runs = [asyncio.get_running_loop().create_task(g.run(until=lambda: stop)) for g in groups]
        await asyncio.sleep(1.0)    # steady rounds first
        killed_at = time.monotonic()
        cluster.kill(leader)
        firsts: dict[str, float] = {}
        while len(firsts) < len(groups) and time.monotonic() - killed_at < NEXT_QUORUM_TIMEOUT_S:
            await asyncio.sleep(0.01)
            for g in groups:
                done = [r for r in g.rounds if not r.error and r.started > killed_at]
                if done and g.replica_id not in firsts:
                    firsts[g.replica_id] = done[0].started + done[0].latency_s - killed_at
        stop = True
        await asyncio.gather(*runs)
        for g in groups:
            await g.close()
        out.append(round(max(firsts.values()), 3) if len(firsts) == len(groups) else float("nan"))
        cluster.start_node(leader)
        cluster.wait_for_agreed_leader(timeout=30.0)
    return out


def measure(storage: str, fsync: bool, seconds: float, kills: int) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix=f"bench-durability-{storage}-", dir=STORAGES[storage]))
    try:
        cluster = LocalCluster(root=root, nodes=3, min_replicas=GROUPS, join_timeout_ms=1000, quorum_tick_ms=50,
                               heartbeat_timeout_ms=500, extra_args=[] if fsync else ["--unsafe-no-fsync"])
        with cluster:
            leader, _ = cluster.wait_for_stable_leader(timeout=30.0)
            endpoint = cluster.client_addresses[leader]
            # Fast quorums first, on a cluster nothing has loaded yet: measured after the new-quorum
            # phase they also paid for its aftermath (hundreds of entries just written, each node's
            # commit index saved), whichever the syncing.
            fast = asyncio.run(_rounds(endpoint, seconds, new_quorum=False))
            new_quorum = asyncio.run(_rounds(endpoint, seconds, new_quorum=True))
            failover = asyncio.run(_failover(cluster, kills))
        return {"storage": storage, "fsync": fsync, "new_quorum": new_quorum, "fast_quorum": fast,
                "failover_s": failover}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def fsync_latency_ms(storage: str, n: int = 200) -> float:
    """The median time of one 4 KiB write + fdatasync on ``storage`` (what one journal batch costs)."""
    root = Path(tempfile.mkdtemp(prefix="bench-fsync-", dir=STORAGES[storage]))
    try:
        fd = os.open(root / "f", os.O_WRONLY | os.O_CREAT, 0o644)
        times = []
        for i in range(n):
            started = time.perf_counter()
            os.pwrite(fd, b"x" * 4096, i * 4096)
            os.fdatasync(fd)
            times.append((time.perf_counter() - started) * 1000)
        os.close(fd)
        return round(statistics.median(times), 3)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's runs as one row: each figure the median of the runs' (failovers pooled)."""
    out: dict[str, Any] = {"storage": runs[0]["storage"], "fsync": runs[0]["fsync"], "runs": runs}
    for phase in ("new_quorum", "fast_quorum"):
        out[phase] = {k: round(statistics.median(r[phase][k] for r in runs), 2) for k in runs[0][phase]}
    out["failover_s"] = [x for r in runs for x in r["failover_s"]]
    return out


def table(results: list[dict[str, Any]], fsync_ms: dict[str, float]) -> str:
    rows = ["| storage | syncing | fdatasync p50 (ms) | new quorum p50 / p90 / p99 (ms) | new quorums/s | "
            "fast quorum p50 / p90 / p99 (ms) | fast rounds/s | failover median / max (s) |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results:
        n, f, fo = r["new_quorum"], r["fast_quorum"], [x for x in r["failover_s"] if x == x]
        rows.append(f"| {r['storage']} | {'fsync' if r['fsync'] else 'no-fsync (--unsafe-no-fsync)'} | "
                    f"{fsync_ms[r['storage']]:.2f} | {n['p50_ms']:.1f} / {n['p90_ms']:.1f} / {n['p99_ms']:.1f} | "
                    f"{n['rounds_per_s']:.0f} | {f['p50_ms']:.1f} / {f['p90_ms']:.1f} / {f['p99_ms']:.1f} | "
                    f"{f['rounds_per_s']:.0f} | "
                    + (f"{statistics.median(fo):.2f} / {max(fo):.2f}" if fo else "-") + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="seconds of rounds per phase")
    parser.add_argument("--kills", type=int, default=5, help="leader kills per configuration")
    parser.add_argument("--storage", default="disk,tmpfs")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of each configuration, interleaved (fsync, no-fsync, fsync, ...): a shared "
                             "machine's load drifts; the table shows the median of the runs' figures")
    parser.add_argument("--out", type=Path, default=None, help="write OUT.md and OUT.json")
    opts = parser.parse_args(argv)
    storages = [s for s in opts.storage.split(",") if s]
    fsync_ms = {s: fsync_latency_ms(s) for s in storages}
    runs: dict[tuple[str, bool], list[dict[str, Any]]] = {}
    load = [round(os.getloadavg()[0], 1)]
    for storage in storages:
        for repeat in range(opts.repeats):
            for fsync in (True, False):
                print(f"{storage}, {'fsync' if fsync else 'no fsync'}, run {repeat + 1} ...", flush=True)
                runs.setdefault((storage, fsync), []).append(measure(storage, fsync, opts.seconds, opts.kills))
    load.append(round(os.getloadavg()[0], 1))
    results = [combine(rs) for rs in runs.values()]
    text = table(results, fsync_ms)
    print(text)
    if opts.out is not None:
        meta = {"when": time.strftime("%Y-%m-%d %H:%M"), "host": platform.node(), "seconds": opts.seconds,
                "kills": opts.kills, "repeats": opts.repeats, "groups": GROUPS, "fdatasync_p50_ms": fsync_ms,
                "load_average_start_end": load}
        opts.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
        opts.out.with_suffix(".md").write_text(
            f"# Durability cost (issue 32), {meta['when']}\n\n3 nodes on one 2-core machine, {GROUPS} replica groups "
            f"calling the leader back to back, {opts.seconds:g} s per phase, {opts.kills} leader kills per run, "
            f"{opts.repeats} interleaved runs per row (medians; failovers pooled); load average "
            f"{load[0]} at the start, {load[1]} at the end (`python -m benchmarks.durability`).\n\n{text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
