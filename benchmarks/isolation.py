"""Section 7, isolation: one job's load must not slow another job's quorums.

One 3-node cluster, two jobs created through the admin API: job B (``small`` replica groups, a
small training job, on the leader's client port, naming its job in each call's metadata as
ftclient does) and job A (``large`` groups hammering quorums: each group asks again as soon as it
has its answer, the rounds section's load), whose groups talk to the leader too. Phases, each
measured for ``duration_s``:

1. **alone**: only job B's groups run; its round latency (last request -> last answer) and rounds/s;
2. **beside, one port**: job A's groups on the same client port as job B (selecting their job by
   name): both jobs' calls go through one gRPC server;
3. **beside, own port**: job A on its own job port (as unchanged torchft trainers select a job),
   served on the node's event loop (the default); the isolation bound (<= 2x alone) is on this phase;
4. **beside, another cluster** (full runs): job A on a second 3-node cluster of its own, which
   shares no process with job B's: the control. What job B loses there is the host's (CPU and
   scheduler shared with job A's nodes and load generator), not the cluster's: the floor of the
   phases above on this host;
5. **beside training**: job A on its own port as a training job runs it, a round per step of
   ``TRAINING_STEP_S`` (heartbeats every 100 ms as before): what a neighbour usually looks like;
6. **beside, port process** (full runs): job A on its own port on another cluster whose nodes run
   ``--job-port-processes`` (job A's port served by a process of its own, which forwards its calls
   to the leader as a follower would), with job B measured alone there first.

Both jobs use the rounds section's settings (min_replicas = the job's group count, so every round
is the job's full set and, after the first, a fast quorum). What the figures do not separate on a
2-core machine: job A's load generator competes with the nodes for the CPU. ``pin_leader``
(``--isolation-pin-leader``) gives the leader and job B's load generator CPU 0 and everything else
(followers, port processes, job A's load generator) the other CPUs: a leader with a core of its own,
as on a machine where the trainers are elsewhere.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import grpc

from lighthouse_cluster.local.cluster import LocalCluster, free_ports
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import lighthouse_cluster_pb2_grpc as cpb_grpc
from lighthouse_cluster.server.admin import token_metadata
from .loadgen import LoadGenerator, LoadSpec, analyze_rounds
from .procs import CpuMeter, descendants, load_snapshot, pin_process
from .rounds import HEARTBEAT_TIMEOUT_MS, JOIN_TIMEOUT_MS, QUORUM_TICK_MS, stable_leader, workers_for

TOKEN = "isolation-bench"
BOUND = 2.0  # the isolation target: job B's round latency beside job A within 2x of alone
SMALL_JOB, LARGE_JOB = "job-b", "job-a"
TRAINING_STEP_S = 1.0  # phase 4: job A asks for a quorum once per training step of this long


def add_job(address: str, name: str, groups: int, ports: list[int] | None = None) -> None:
    stub = cpb_grpc.LighthouseAdminStub(grpc.insecure_channel(address))
    stub.AddJob(cpb.AddJobRequest(
        name=name, ports=[cpb.JobPort(node_id=f"n{i + 1}", port=p) for i, p in enumerate(ports or [])],
        settings=cpb.JobSettingsUpdate(min_replicas=groups, join_timeout_ms=JOIN_TIMEOUT_MS,
                                       quorum_tick_ms=QUORUM_TICK_MS, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)),
        metadata=token_metadata(TOKEN), timeout=10)


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


class _Cpus:
    """With ``pin`` (and 2+ CPUs): CPU 0 for the leader and job B's load generator, the others for
    everything else. Processes inherit this process's CPUs, so it switches before starting each."""

    def __init__(self, pin: bool) -> None:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.on = pin and len(cpus) >= 2
        self.all = set(cpus)
        self.first, self.rest = ({cpus[0]}, set(cpus[1:])) if self.on else (set(), set())

    def _set(self, cpus: set[int]) -> None:
        if self.on:
            os.sched_setaffinity(0, cpus)

    def for_measured(self) -> None:
        self._set(self.first)

    def for_others(self) -> None:
        self._set(self.rest)

    def pin_leader(self, pid: int) -> None:
        if self.on:
            pin_process(pid, self.first)

    def pin_others(self, pid: int) -> None:
        if self.on:
            pin_process(pid, self.rest)

    def reset(self) -> None:
        self._set(self.all)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(b / a, 3) if a and b else None


class _Cluster:
    """One cluster of the section, its leader, the jobs' addresses and the pids to measure."""

    def __init__(self, workdir: Path, cpus: _Cpus, small: int, large: int, port_processes: bool,
                 pin: bool = True) -> None:
        root = Path(tempfile.mkdtemp(prefix="cluster-isolation-", dir=workdir))
        cpus.for_others()  # followers, port processes and the leader until it is known
        self.cluster = LocalCluster(root=root, nodes=3, min_replicas=1, admin_token=TOKEN,
                                    extra_args=["--job-port-processes"] if port_processes else [])
        try:
            self._start(cpus if pin else _Cpus(False), small, large)
        except BaseException:
            self.cluster.stop_all()  # the caller never holds a cluster that failed to set up
            raise

    def _start(self, cpus: _Cpus, small: int, large: int) -> None:
        self.cluster.start()
        leader = stable_leader(self.cluster)
        self.address = self.cluster.client_addresses[leader]
        self.pids = {("leader" if i == leader else f"follower{i + 1}"): m.process.pid
                     for i, m in enumerate(self.cluster.members) if m.process is not None}
        cpus.pin_leader(self.pids["leader"])
        ports = free_ports(3, "127.0.0.1")
        add_job(self.address, SMALL_JOB, small)
        add_job(self.address, LARGE_JOB, large, ports)
        self.large_port_address = f"127.0.0.1:{ports[leader]}"
        wait_listening(self.address, LARGE_JOB, ports[leader])
        for n, pid in enumerate(descendants(self.pids["leader"])):  # the leader's port process
            self.pids[f"leader's port process{'' if n == 0 else n + 1}"] = pid
            cpus.pin_others(pid)

    def stop(self) -> None:
        self.cluster.stop_all()


def wait_listening(address: str, job: str, port: int, timeout: float = 30.0) -> None:
    stub = cpb_grpc.LighthouseClusterStub(grpc.insecure_channel(address))
    deadline = time.monotonic() + timeout
    while stub.GetJob(cpb.JobRequest(name=job), timeout=5).listening_port != port:
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {job}: port {port} not listening within {timeout:.0f} s")
        time.sleep(0.05)


def run_isolation(small: int, large: int, duration_s: float, workdir: Path, say: Callable[[str], None],
                  workers: int = 2, warmup_timeout_s: float = 60.0, with_training: bool = True,
                  with_port_processes: bool = True, with_other_cluster: bool = True,
                  pin_leader: bool = False) -> dict:
    cpus = _Cpus(pin_leader)
    res: dict[str, Any] = {"config": {"small": small, "large": large, "duration_s": duration_s, "bound": BOUND,
                                      "join_timeout_ms": JOIN_TIMEOUT_MS, "quorum_tick_ms": QUORUM_TICK_MS,
                                      "heartbeat_timeout_ms": HEARTBEAT_TIMEOUT_MS,
                                      "training_step_s": TRAINING_STEP_S, "pin_leader": cpus.on}}
    bad = 0

    def measure_b(c: _Cluster, prefix: str) -> dict:
        cpus.for_measured()
        try:
            return _measure(LoadSpec(groups=small, endpoints=(c.address,), prefix=prefix, job=SMALL_JOB),
                            1, duration_s, warmup_timeout_s, c.pids)
        finally:
            cpus.for_others()

    def beside(c: _Cluster, phase: str, endpoint: str, step_time_s: float = 0.0) -> None:
        nonlocal bad
        cpus.for_others()
        background = LoadGenerator(LoadSpec(groups=large, endpoints=(endpoint,), prefix=phase, job=LARGE_JOB,
                                            step_time_s=step_time_s), workers_for(large, workers))
        try:
            background.start(timeout=60)
            if not background.wait_rounds(2, warmup_timeout_s + 2 * step_time_s):
                raise RuntimeError(f"job A (N={large}, {phase}): fewer than 2 rounds within {warmup_timeout_s:.0f} s")
            a0, ta0 = background.min_ok(), time.monotonic()
            r = res[phase] = measure_b(c, phase)
            r["large_rounds_per_s"] = round((background.min_ok() - a0) / (time.monotonic() - ta0), 2)
        finally:
            records = background.stop(timeout=10)
        bad += sum(rec["validation"]["bad"] for rec in records)
        say(f"  isolation job B (N={small}) {phase.replace('_', ' ')} (job A {r['large_rounds_per_s']} rounds/s): "
            f"p50 {r['latency_ms']['p50']} ms, {r['rounds_per_s']} rounds/s")

    clusters: list[_Cluster] = []
    try:
        c = _Cluster(workdir, cpus, small, large, port_processes=False)
        clusters.append(c)
        res["load_start"] = load_snapshot()
        res["alone"] = alone = measure_b(c, "alone")
        say(f"  isolation job B (N={small}) alone: p50 {alone['latency_ms']['p50']} ms, "
            f"{alone['rounds_per_s']} rounds/s")
        beside(c, "beside", c.address)
        beside(c, "beside_own_port", c.large_port_address)
        if with_other_cluster:
            # The control: job A on a cluster of its own (its nodes on the CPUs of "everything else").
            other = _Cluster(workdir, cpus, small, large, port_processes=False, pin=False)
            clusters.append(other)
            beside(c, "beside_other_cluster", other.address)
            other.stop()
        if with_training:
            beside(c, "beside_training", c.large_port_address, TRAINING_STEP_S)
        c.stop()
        if with_port_processes:
            c = _Cluster(workdir, cpus, small, large, port_processes=True)
            clusters.append(c)
            res["alone_port_processes"] = measure_b(c, "alone_port_processes")
            beside(c, "beside_port_process", c.large_port_address)
            c.stop()
        res["large_validation_bad"] = bad
        res["load_end"] = load_snapshot()
    finally:
        for c in clusters:
            c.stop()
        cpus.reset()
    p50 = lambda phase: (res.get(phase) or {}).get("latency_ms", {}).get("p50")  # noqa: E731
    p99 = lambda phase: (res.get(phase) or {}).get("latency_ms", {}).get("p99")  # noqa: E731
    res["large_rounds_per_s"] = res["beside"]["large_rounds_per_s"]
    res["ratio_p50_one_port"] = _ratio(p50("alone"), p50("beside"))
    res["ratio_p50"] = _ratio(p50("alone"), p50("beside_own_port"))
    res["ratio_p99"] = _ratio(p99("alone"), p99("beside_own_port"))
    res["ratio_p50_training"] = _ratio(p50("alone"), p50("beside_training"))
    res["ratio_p50_port_process"] = _ratio(p50("alone_port_processes"), p50("beside_port_process"))
    res["ratio_p50_other_cluster"] = _ratio(p50("alone"), p50("beside_other_cluster"))
    phases = [res[k] for k in ("alone", "beside", "beside_own_port", "beside_other_cluster", "beside_training",
                               "alone_port_processes", "beside_port_process") if k in res]
    errors = sum(r["errors_total"] for r in phases)
    incomplete = bad + sum(r["validation"]["bad"] for r in phases)
    if errors or incomplete:
        res["error"] = f"{errors} failed calls, {incomplete} quorums without every group of their job"
    say(f"  isolation job B (N={small}) beside job A (N={large}): p50 ratio own port {res['ratio_p50']} "
        f"(bound {BOUND}), one port {res['ratio_p50_one_port']}, port process {res['ratio_p50_port_process']}, "
        f"training {res['ratio_p50_training']}, a cluster of its own (the control) "
        f"{res['ratio_p50_other_cluster']}")
    return res
