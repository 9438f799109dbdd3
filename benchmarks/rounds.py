"""Section 1, quorum rounds: N groups looping Quorum + Heartbeat against each system under test.

Systems: ``torchft`` (torchft_lighthouse, the Rust server), ``leader`` (our 3-node cluster, every
group talking to the Raft leader) and ``followers`` (every group on one of the two followers,
which forward Quorum calls and batch heartbeats to the leader); in full runs also ``pyfloor``, the
Python gRPC floor (``grpc_floor.py``: no Raft, no rules, one process), for scale. Every system gets the same flags:
``--min_replicas N --join_timeout_ms 60000 --quorum_tick_ms 100 --heartbeat_timeout_ms 5000``, so
after the first round every round is a fast quorum.

Per run: start the system, start the load generator, wait for two complete rounds (warm-up),
then measure for ``duration_s``: rounds/s, round latency, errors, the lighthouse's CPU (summed
over its processes), the generator's CPU, resident memory of every lighthouse process at the end.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from lighthouse_cluster.local.cluster import LocalCluster
from .loadgen import LoadGenerator, LoadSpec, analyze_rounds
from .procs import CpuMeter, GrpcFloor, RustLighthouse, load_snapshot, rss_bytes

SYSTEMS = ("torchft", "leader", "followers")
# Not a lighthouse: what a one-process Python grpc.aio server costs per round at the least.
FLOOR = "pyfloor"
ALL_SYSTEMS = SYSTEMS + (FLOOR,)
JOIN_TIMEOUT_MS = 60_000
QUORUM_TICK_MS = 100
HEARTBEAT_TIMEOUT_MS = 5_000


@dataclass
class RoundsConfig:
    duration_s: float = 10.0
    # A window that saw fewer complete rounds than this is extended (up to max_duration_factor x).
    min_rounds: int = 10
    max_duration_factor: float = 4.0
    warmup_timeout_s: float = 60.0
    workers: int = 2
    groups_per_connection: int = 1
    profile_dir: Path | None = None      # py-spy record the lighthouse processes while measuring
    profile_ns: tuple[int, ...] = ()     # ... for these N only


def workers_for(n: int, max_workers: int) -> int:
    """Worker processes for N groups: one per 64 groups, at most ``max_workers``."""
    return max(1, min(max_workers, (n + 63) // 64))


class _System:
    """A started system under test: addresses to give the groups, pids to measure."""

    def __init__(self, name: str, endpoints: tuple[str, ...], pids: dict[str, int], cleanup: Callable[[], None],
                 describe: Callable[[], dict] | None = None) -> None:
        self.name, self.endpoints, self.pids, self.cleanup = name, endpoints, pids, cleanup
        self.describe = describe or (lambda: {})


def stable_leader(cluster: LocalCluster, timeout: float = 30.0, settle_s: float = 1.0) -> int:
    """The leader once every node agrees on it and it kept its term for ``settle_s``.

    Three nodes started at once on a loaded machine sometimes elect two or three leaders in their
    first second; taking the first one made the groups of a "clients on leader" run talk to a
    follower and counted those start-up elections as `leader changes` under load
    (docs/design/stall-tolerance.md)."""
    deadline = time.monotonic() + timeout
    leader = cluster.wait_for_leader(timeout=timeout)
    while True:
        cluster.wait_for_followers(leader, timeout=max(0.1, min(10.0, deadline - time.monotonic())))
        st0 = cluster.status(leader, timeout=2.0)
        time.sleep(settle_s)
        now = cluster.leader_index()
        st1 = cluster.status(now, timeout=2.0) if now is not None else None
        if now == leader and st0 is not None and st1 is not None and st1.term == st0.term:
            return leader
        if time.monotonic() > deadline:
            return cluster.wait_for_leader(timeout=10)
        leader = cluster.wait_for_leader(timeout=max(1.0, deadline - time.monotonic()))


def start_system(name: str, n: int, workdir: Path) -> _System:
    if name in ("torchft", FLOOR):
        kind = RustLighthouse if name == "torchft" else GrpcFloor
        lh = kind(min_replicas=n, log_path=workdir / f"{name}-{n}.log", join_timeout_ms=JOIN_TIMEOUT_MS,
                  quorum_tick_ms=QUORUM_TICK_MS, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
        try:
            lh.start()
        except BaseException:
            lh.kill()
            raise
        return _System(name, (lh.address,), {lh.name: lh.pid}, lh.kill)
    root = Path(tempfile.mkdtemp(prefix=f"cluster-{name}-{n}-", dir=workdir))
    cluster = LocalCluster(root=root, nodes=3, min_replicas=n,
                           join_timeout_ms=JOIN_TIMEOUT_MS, quorum_tick_ms=QUORUM_TICK_MS,
                           heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    try:
        cluster.start()
        leader = stable_leader(cluster)
    except BaseException:
        cluster.stop_all()
        raise
    addrs = cluster.client_addresses
    if name == "leader":
        endpoints = (addrs[leader],)
    elif name == "followers":
        endpoints = tuple(a for i, a in enumerate(addrs) if i != leader)
    else:
        cluster.stop_all()
        raise ValueError(f"unknown system {name!r}")
    pids = {("leader" if i == leader else f"follower{i + 1}"): m.process.pid
            for i, m in enumerate(cluster.members) if m.process is not None}

    st0 = cluster.status(leader, timeout=2.0)
    term0 = st0.term if st0 is not None else None

    def describe() -> dict:
        now = cluster.leader_index()
        st1 = cluster.status(now, timeout=2.0) if now is not None else None
        return {"leader_at_start": cluster.members[leader].peer.node_id,
                "leader_at_end": cluster.members[now].peer.node_id if now is not None else None,
                "raft_terms": [term0, st1.term if st1 is not None else None],
                "leader_changes": (st1.term - term0) if st1 is not None and term0 is not None else None}

    return _System(name, endpoints, pids, cluster.stop_all, describe)


def py_spy_record(pid: int, out: Path, seconds: float) -> Any:
    """Start ``py-spy record`` on ``pid`` (speedscope + flamegraph), or None without py-spy."""
    import shutil
    import subprocess

    exe = shutil.which("py-spy")
    if exe is None:
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--duration", str(max(1, int(seconds))),
                             "--rate", "200", "--format", "raw", "--output", str(out), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=open(str(out) + ".log", "wb"),
                            start_new_session=True)


def run_one(system: str, n: int, cfg: RoundsConfig, workdir: Path, say: Callable[[str], None]) -> dict:
    """One (system, N) measurement; never raises for a system that fails under load (the result
    carries ``failed``)."""
    from .procs import kill_process

    started = time.monotonic()
    sysu = start_system(system, n, workdir)
    lg: LoadGenerator | None = None
    spies: list[Any] = []
    result: dict[str, Any] = {"system": system, "n": n}
    try:
        spec = LoadSpec(groups=n, endpoints=sysu.endpoints, prefix=f"{system}{n}",
                        groups_per_connection=cfg.groups_per_connection)
        lg = LoadGenerator(spec, workers_for(n, cfg.workers))
        lg.start(timeout=60)
        result["workers"] = lg.workers
        warm = lg.wait_rounds(2, cfg.warmup_timeout_s)
        result["warmup_s"] = round(time.monotonic() - (lg.started_at or started), 2)
        if not warm:
            result["failed"] = f"fewer than 2 complete rounds within {cfg.warmup_timeout_s:.0f}s of warm-up"
        load0 = load_snapshot()
        lh_meter = CpuMeter(dict(sysu.pids)).start()
        gen_meter = CpuMeter({f"worker{i}": p for i, p in enumerate(lg.pids)}).start()
        t0 = time.monotonic()
        if cfg.profile_dir is not None and n in cfg.profile_ns:
            for name, pid in sysu.pids.items():
                p = py_spy_record(pid, cfg.profile_dir / f"{system}-{n}-{name}.txt", cfg.duration_s)
                if p is not None:
                    spies.append(p)
        ok0 = lg.min_ok()
        time.sleep(cfg.duration_s)
        limit = t0 + cfg.duration_s * cfg.max_duration_factor
        while lg.min_ok() - ok0 < cfg.min_rounds and time.monotonic() < limit and not spies:
            time.sleep(0.1)
        t1 = time.monotonic()
        result["lighthouse_cpu"] = lh_meter.stop()
        result["loadgen_cpu"] = gen_meter.stop()
        result["rss_mb"] = {k: round((rss_bytes(p) or 0) / 2**20, 1) for k, p in sysu.pids.items()}
        result["load"] = {"start": load0, "end": load_snapshot()}
        result.update(sysu.describe())
        records = lg.stop()
        lg = None
        result.update(analyze_rounds(records, n, t0, t1))
        if not warm and result.get("rounds"):
            result.pop("failed", None)
    finally:
        for p in spies:
            try:
                p.wait(timeout=cfg.duration_s + 30)
            except Exception:  # noqa: BLE001
                kill_process(p)
        if lg is not None:
            try:
                lg.stop(timeout=10)
            except Exception as e:  # noqa: BLE001 -- the system is being torn down anyway
                result.setdefault("failed", f"load generator: {e}")
        sysu.cleanup()
    lat = result.get("latency_ms", {})
    say(f"  rounds {system:9s} N={n:<5d} {result.get('rounds_per_s') or 0:8.1f} rounds/s  "
        f"p50 {lat.get('p50') or 0:7.1f} ms  p99 {lat.get('p99') or 0:7.1f} ms  "
        f"lighthouse CPU {result.get('lighthouse_cpu', {}).get('total_pct', 0):5.0f}%  "
        f"loadgen CPU {result.get('loadgen_cpu', {}).get('total_pct', 0):5.0f}%  errors {result.get('errors_total', 0)}"
        + (f"  FAILED: {result['failed']}" if result.get("failed") else ""))
    return result


def run_rounds(ns: list[int], systems: list[str], cfg: RoundsConfig, workdir: Path,
               say: Callable[[str], None], repeats: int = 1) -> dict:
    """Every (N, system) pair, systems interleaved per N so that load changes hit all of them."""
    runs = []
    for n in ns:
        for rep in range(repeats):
            for system in systems:
                try:
                    r = run_one(system, n, cfg, workdir, say)
                except Exception as e:  # noqa: BLE001 -- one failed run must not lose the others
                    say(f"  rounds {system:9s} N={n:<5d} FAILED: {type(e).__name__}: {e}")
                    r = {"system": system, "n": n, "failed": f"{type(e).__name__}: {str(e)[:2000]}"}
                r["repeat"] = rep
                runs.append(r)
    return {"config": {"duration_s": cfg.duration_s, "min_rounds": cfg.min_rounds, "max_workers": cfg.workers,
                       "groups_per_connection": cfg.groups_per_connection, "repeats": repeats,
                       "join_timeout_ms": JOIN_TIMEOUT_MS, "quorum_tick_ms": QUORUM_TICK_MS,
                       "heartbeat_timeout_ms": HEARTBEAT_TIMEOUT_MS, "heartbeat_interval_ms": 100},
            "runs": runs, "summary": summarize(runs)}


def summarize(runs: list[dict]) -> list[dict]:
    """Per (N, system): the median over repeats; per N: ratios of ours to torchft's rounds/s."""
    import statistics

    by: dict[tuple[int, str], list[dict]] = {}
    for r in runs:
        by.setdefault((r["n"], r["system"]), []).append(r)
    out = []
    for n in sorted({k[0] for k in by}):
        row: dict[str, Any] = {"n": n}
        for system in ALL_SYSTEMS:
            rs = by.get((n, system))
            if not rs:
                continue
            rps = [r.get("rounds_per_s") or 0.0 for r in rs]
            med = statistics.median(rps)
            pick = min(rs, key=lambda r: abs((r.get("rounds_per_s") or 0.0) - med))
            row[system] = {
                "rounds_per_s": round(med, 2),
                "rounds_per_s_all": rps,
                "p50_ms": pick.get("latency_ms", {}).get("p50"),
                "p99_ms": pick.get("latency_ms", {}).get("p99"),
                "lighthouse_cpu_pct": pick.get("lighthouse_cpu", {}).get("total_pct"),
                "loadgen_cpu_pct": pick.get("loadgen_cpu", {}).get("total_pct"),
                "errors": pick.get("errors_total", 0),
                "error_kinds": pick.get("errors", {}),
                "heartbeats_per_s": pick.get("heartbeats_per_s"),
                "heartbeats_expected_per_s": pick.get("heartbeats_expected_per_s"),
                "leader_changes": pick.get("leader_changes"),
                "rss_mb": pick.get("rss_mb"),
                "window_s": pick.get("window_s"),
                "load1": (pick.get("load", {}).get("start", {}).get("loadavg") or [None])[0],
                "rounds": pick.get("rounds"),
                "answer_bytes_per_round": pick.get("answer_bytes_per_round"),
                "failed": pick.get("failed"),
            }
            cpu = row[system]["lighthouse_cpu_pct"]
            # CPU time per round (ms): less sensitive to a busy machine than rounds/s.
            row[system]["cpu_ms_per_round"] = round(cpu * 10.0 / med, 2) if cpu and med else None
        base = row.get("torchft", {}).get("rounds_per_s")
        for system in ("leader", "followers", FLOOR):
            if system in row and base:
                row[system]["ratio_vs_torchft"] = round(row[system]["rounds_per_s"] / base, 3)
        floor = row.get(FLOOR, {}).get("rounds_per_s")
        for system in ("leader", "followers"):
            if system in row and floor:
                row[system]["ratio_vs_floor"] = round(row[system]["rounds_per_s"] / floor, 3)
        if "leader" in row and "followers" in row and row["leader"]["rounds_per_s"]:
            row["followers"]["ratio_vs_leader"] = round(row["followers"]["rounds_per_s"] / row["leader"]["rounds_per_s"], 3)
        out.append(row)
    return out
