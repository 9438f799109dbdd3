"""Section 5, footprint: idle CPU and resident memory per node (and of torchft_lighthouse).

Idle = running, leader elected, no replica group connected (the leader quiet: it quiesces once no
client called for ``--quiesce-after-ms``). CPU is measured over ``duration_s`` after that; memory is VmRSS at the end. Resident memory under
load is in the quorum-rounds results (``rss_mb`` of every run).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from lighthouse_cluster.local.cluster import LocalCluster
from lighthouse_cluster.server.config import DEFAULT_QUIESCE_AFTER_MS
from .procs import CpuMeter, RustLighthouse, rss_bytes

SETTLE_S = 1.0
# An idle cluster's leader quiesces once no client called for --quiesce-after-ms (raft/extensions/quiescence.py):
# the cluster is measured after that, as it runs idle.
QUIESCE_S = DEFAULT_QUIESCE_AFTER_MS / 1000


def run_footprint(duration_s: float, workdir: Path, say: Callable[[str], None]) -> dict:
    out: dict = {"duration_s": duration_s}
    cluster = LocalCluster(root=workdir / "footprint", nodes=3, min_replicas=1)
    try:
        cluster.start()
        leader = cluster.wait_for_leader(timeout=30)
        time.sleep(SETTLE_S + QUIESCE_S)
        pids = {f"{m.peer.node_id} ({'leader' if i == leader else 'follower'})": m.process.pid
                for i, m in enumerate(cluster.members) if m.process is not None}
        meter = CpuMeter(pids).start()
        time.sleep(duration_s)
        cpu = meter.stop()
        rss = {k: round((rss_bytes(p) or 0) / 2**20, 1) for k, p in pids.items()}
    finally:
        cluster.stop_all()
    out["cluster"] = {"cpu_pct": cpu["per_process_pct"], "cpu_total_pct": cpu["total_pct"], "rss_mb": rss,
                      "rss_total_mb": round(sum(rss.values()), 1)}
    lh = RustLighthouse(min_replicas=1, log_path=workdir / "footprint-torchft.log")
    try:
        lh.start()
        time.sleep(SETTLE_S)
        meter = CpuMeter({"torchft_lighthouse": lh.pid}).start()
        time.sleep(duration_s)
        cpu = meter.stop()
        rss_t = round((rss_bytes(lh.pid) or 0) / 2**20, 1)
    finally:
        lh.kill()
    out["torchft"] = {"cpu_pct": cpu["total_pct"], "rss_mb": rss_t}
    for name, v in out["cluster"]["cpu_pct"].items():
        say(f"  footprint {name}: idle CPU {v}% of a core, RSS {out['cluster']['rss_mb'][name]} MB")
    say(f"  footprint torchft_lighthouse: idle CPU {out['torchft']['cpu_pct']}% of a core, RSS {rss_t} MB")
    return out
