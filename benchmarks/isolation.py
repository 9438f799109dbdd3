"""Section 7, isolation (issue 17): one job's load must not slow another job's quorums.

One 3-node cluster, two jobs created through the admin API: job B (``small`` replica groups, a
small training job) and job A (``large`` groups hammering quorums: each group asks again as soon
as it has its answer, the rounds section's load). Every group talks to the leader and names its
job in each call's metadata. Phases, each measured for ``duration_s``:

1. **alone**: only job B's groups run; its round latency (last request -> last answer) and rounds/s;
2. **beside**: job A's groups run (warmed up first), and job B's groups again, a new set;
3. the ratio of job B's median round latency beside job A to alone (issue 17's bound: <= 2);
4. **beside training**: job A's groups as a training job runs them, a round per step of
   ``TRAINING_STEP_S`` (their heartbeats every 100 ms as before), and job B's groups again: what
   a job's neighbour usually looks like, as opposed to the hammering of phase 2.

Both jobs use the rounds section's settings (min_replicas = the job's group count, so every round
is the job's full set and, after the first, a fast quorum). What the figure does not separate:
on a 2-core machine job A's load generator competes with the nodes for the CPU as well.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import grpc

from lighthouse_cluster.local.cluster import LocalCluster
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import lighthouse_cluster_pb2_grpc as cpb_grpc
from lighthouse_cluster.server.admin import token_metadata
from .loadgen import LoadGenerator, LoadSpec, analyze_rounds
from .procs import CpuMeter, load_snapshot
from .rounds import HEARTBEAT_TIMEOUT_MS, JOIN_TIMEOUT_MS, QUORUM_TICK_MS, stable_leader, workers_for

TOKEN = "isolation-bench"
BOUND = 2.0  # issue 17: job B's round latency beside job A within 2x of alone
SMALL_JOB, LARGE_JOB = "job-b", "job-a"
TRAINING_STEP_S = 1.0  # phase 4: job A asks for a quorum once per training step of this long


def add_job(address: str, name: str, groups: int) -> None:
    stub = cpb_grpc.LighthouseAdminStub(grpc.insecure_channel(address))
    stub.AddJob(cpb.AddJobRequest(name=name, settings=cpb.JobSettingsUpdate(
        min_replicas=groups, join_timeout_ms=JOIN_TIMEOUT_MS, quorum_tick_ms=QUORUM_TICK_MS,
        heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)), metadata=token_metadata(TOKEN), timeout=10)


def _measure(spec: LoadSpec, workers: int, duration_s: float, warmup_timeout_s: float,
             pids: dict[str, int]) -> dict:
    lg = LoadGenerator(spec, workers)
    try:
        lg.start(timeout=60)
        if not lg.wait_rounds(2, warmup_timeout_s):
            raise RuntimeError(f"job {spec.job}: fewer than 2 rounds within {warmup_timeout_s:.0f} s")
        meter = CpuMeter(dict(pids)).start()
        t0 = time.monotonic()
        time.sleep(duration_s)
        t1 = time.monotonic()
        cpu = meter.stop()
        records = lg.stop()
        lg = None
    finally:
        if lg is not None:
            lg.stop(timeout=10)
    out = analyze_rounds(records, spec.groups, t0, t1)
    out["lighthouse_cpu"] = cpu
    return out


def run_isolation(small: int, large: int, duration_s: float, workdir: Path, say: Callable[[str], None],
                  workers: int = 2, warmup_timeout_s: float = 60.0, with_training: bool = True) -> dict:
    root = Path(tempfile.mkdtemp(prefix="cluster-isolation-", dir=workdir))
    cluster = LocalCluster(root=root, nodes=3, min_replicas=1, admin_token=TOKEN)
    res: dict[str, Any] = {"config": {"small": small, "large": large, "duration_s": duration_s, "bound": BOUND,
                                      "join_timeout_ms": JOIN_TIMEOUT_MS, "quorum_tick_ms": QUORUM_TICK_MS,
                                      "heartbeat_timeout_ms": HEARTBEAT_TIMEOUT_MS,
                                      "training_step_s": TRAINING_STEP_S}}
    background: LoadGenerator | None = None
    try:
        cluster.start()
        leader = stable_leader(cluster)
        address = cluster.client_addresses[leader]
        pids = {("leader" if i == leader else f"follower{i + 1}"): m.process.pid
                for i, m in enumerate(cluster.members) if m.process is not None}
        add_job(address, SMALL_JOB, small)
        add_job(address, LARGE_JOB, large)
        res["load_start"] = load_snapshot()
        alone = _measure(LoadSpec(groups=small, endpoints=(address,), prefix="alone", job=SMALL_JOB),
                         1, duration_s, warmup_timeout_s, pids)
        res["alone"] = alone
        say(f"  isolation job B (N={small}) alone: p50 {alone['latency_ms']['p50']} ms, "
            f"{alone['rounds_per_s']} rounds/s")
        background = LoadGenerator(LoadSpec(groups=large, endpoints=(address,), prefix="large", job=LARGE_JOB),
                                   workers_for(large, workers))
        background.start(timeout=60)
        if not background.wait_rounds(2, warmup_timeout_s):
            raise RuntimeError(f"job A (N={large}): fewer than 2 rounds within {warmup_timeout_s:.0f} s")
        a0, ta0 = background.min_ok(), time.monotonic()
        beside = _measure(LoadSpec(groups=small, endpoints=(address,), prefix="beside", job=SMALL_JOB),
                          1, duration_s, warmup_timeout_s, pids)
        res["beside"] = beside
        res["large_rounds_per_s"] = round((background.min_ok() - a0) / (time.monotonic() - ta0), 2)
        records = background.stop()
        background = None
        bad = sum(r["validation"]["bad"] for r in records)
        training: dict[str, Any] | None = None
        if with_training:
            background = LoadGenerator(LoadSpec(groups=large, endpoints=(address,), prefix="training",
                                                job=LARGE_JOB, step_time_s=TRAINING_STEP_S),
                                       workers_for(large, workers))
            background.start(timeout=60)
            if not background.wait_rounds(2, warmup_timeout_s + 2 * TRAINING_STEP_S):
                raise RuntimeError(f"job A training (N={large}): fewer than 2 rounds within {warmup_timeout_s:.0f} s")
            training = _measure(LoadSpec(groups=small, endpoints=(address,), prefix="training-b", job=SMALL_JOB),
                                1, duration_s, warmup_timeout_s, pids)
            bad += sum(r["validation"]["bad"] for r in background.stop())
            background = None
            res["beside_training"] = training
            say(f"  isolation job B (N={small}) beside job A training (a round per {TRAINING_STEP_S:g} s step): "
                f"p50 {training['latency_ms']['p50']} ms, {training['rounds_per_s']} rounds/s")
        res["large_validation_bad"] = bad
        res["load_end"] = load_snapshot()
    finally:
        if background is not None:
            try:
                background.stop(timeout=10)
            except Exception:  # noqa: BLE001 -- the cluster is being torn down anyway
                pass
        cluster.stop_all()
    p50a, p50b = alone["latency_ms"]["p50"], beside["latency_ms"]["p50"]
    res["ratio_p50"] = round(p50b / p50a, 3) if p50a and p50b else None
    p99a, p99b = alone["latency_ms"]["p99"], beside["latency_ms"]["p99"]
    res["ratio_p99"] = round(p99b / p99a, 3) if p99a and p99b else None
    training = res.get("beside_training")
    if training is not None:
        p50t = training["latency_ms"]["p50"]
        res["ratio_p50_training"] = round(p50t / p50a, 3) if p50a and p50t else None
    phases = [alone, beside] + ([training] if training is not None else [])
    errors = sum(r["errors_total"] for r in phases)
    incomplete = res["large_validation_bad"] + sum(r["validation"]["bad"] for r in phases)
    if errors or incomplete:
        res["error"] = f"{errors} failed calls, {incomplete} quorums without every group of their job"
    say(f"  isolation job B (N={small}) beside job A (N={large}, {res['large_rounds_per_s']} rounds/s): "
        f"p50 {p50b} ms, {beside['rounds_per_s']} rounds/s; ratio p50 {res['ratio_p50']} (bound {BOUND}), "
        f"p99 {res['ratio_p99']}")
    return res
