"""Side-by-side measurements of the variants (A, B, C, C2; see the package docstring).

``python -m benchmarks.raft_process.measure rounds --variants A,B,C --ns 1024,2048 --repeats 2 --duration 30``
``python -m benchmarks.raft_process.measure failover --variants A,B,C --n 8 --kills 5``
``python -m benchmarks.raft_process.measure idle --variants A,B,C --seconds 30``

Variants alternate (A, B, C, A, B, C, ...) so that the host's drift hits each alike. Before
each run: no ``/tmp/host-busy`` and a 1-minute load average below ``--max-load`` (polled every
20 s, at most ``--max-wait-s`` in all; the waits are recorded). Each run is appended to the JSON
lines file ``--out`` as it finishes (one object per line), so a cut-short session keeps what it
measured.

rounds: a 3-node cluster of the variant, every group on the stable leader (``rounds.stable_leader``);
after two complete rounds, a ``--duration`` window: rounds/s and latency (``loadgen.analyze_rounds``),
CPU seconds of the three nodes with their children (the Raft processes of C), tick stalls per
node (``lighthouse_cluster_raft_tick_stalls`` on /metrics) and the term on every node, before and
after (leader changes = the rise of the highest term).
failover: ``benchmarks.failover.cluster_failover`` on clusters of the variant.
idle: 3 nodes of the variant, no client, after quiescence: CPU per node over ``--seconds``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks import failover as failover_mod
from benchmarks.loadgen import LoadGenerator, LoadSpec, analyze_rounds
from benchmarks.procs import cpu_seconds, load_snapshot
from benchmarks.raft_process.variant import prefix
from benchmarks.rounds import HEARTBEAT_TIMEOUT_MS, JOIN_TIMEOUT_MS, QUORUM_TICK_MS, stable_leader, workers_for
from lighthouse_cluster.local.cluster import LocalCluster, free_ports

BUSY_FLAG = Path("/tmp/host-busy")
# The session's waiting budget, shared by every measure process of one session: "HH:MM" (UTC)
# after which no run waits for the host any more (the first wait plus --max-wait-s).
WAIT_UNTIL_FILE = Path("/tmp/raft-process-wait-until")
_STALLS = re.compile(r'^lighthouse_cluster_raft_tick_stalls(?:_total)?\{[^}]*\}\s+([0-9.e+]+)', re.M)
_ROUNDS = re.compile(r'^lighthouse_cluster_quorum_rounds(?:_total)?\{[^}]*path="(\w+)"[^}]*\}\s+([0-9.e+]+)', re.M)
_RENEWALS = re.compile(r'^lighthouse_cluster_lease_renewals(?:_total)?\{[^}]*path="(\w+)"[^}]*\}\s+([0-9.e+]+)', re.M)
_waited = {"s": 0.0}


def say(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


def wait_for_host(max_load: float, max_wait_s: float) -> dict:
    """Wait until the host is free (see the module docstring); returns what was seen and waited."""
    t0 = time.monotonic()
    while True:
        load1 = os.getloadavg()[0]
        busy = BUSY_FLAG.exists()
        if not busy and load1 < max_load:
            break
        if not WAIT_UNTIL_FILE.exists():
            WAIT_UNTIL_FILE.write_text(time.strftime("%H:%M", time.gmtime(time.time() + max_wait_s)))
        past = time.strftime("%H:%M", time.gmtime()) >= WAIT_UNTIL_FILE.read_text().strip()
        if past or _waited["s"] + (time.monotonic() - t0) >= max_wait_s:
            say(f"host still busy (flag {busy}, load {load1:.2f}) after {max_wait_s:.0f} s of waiting: going on")
            break
        say(f"host busy (flag {busy}, load {load1:.2f}): waiting 20 s")
        time.sleep(20)
    waited = time.monotonic() - t0
    _waited["s"] += waited
    return {"waited_s": round(waited, 1), "load_before": load_snapshot()}


def variant_cluster(variant: str, stall: bool, root: Path, n: int, http: bool = True) -> LocalCluster:
    return LocalCluster(root=root, nodes=3, min_replicas=n, join_timeout_ms=JOIN_TIMEOUT_MS,
                        quorum_tick_ms=QUORUM_TICK_MS, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
                        http_ports=free_ports(3) if http else None,
                        launch_prefix=lambda _i: prefix(variant, stall))


def tick_thread_ids(cluster: LocalCluster) -> list[int | None]:
    """Each node's Raft tick thread (its last ``TICK_THREAD_LINE`` in the node's log)."""
    from benchmarks.raft_process.tweaks import TICK_THREAD_LINE

    out: list[int | None] = []
    for m in cluster.members:
        try:
            found = re.findall(TICK_THREAD_LINE + r" (\d+)", Path(m.log_path).read_text(errors="replace"))
        except OSError:
            found = []
        out.append(int(found[-1]) if found else None)
    return out


def schedstat(tid: int | None) -> tuple[float, float, int] | None:
    """(seconds on a CPU, seconds runnable but waiting for one, times it was given a CPU) of
    thread ``tid`` so far (/proc/TID/schedstat). A thread waiting for the GIL sleeps: that is in
    neither."""
    if tid is None:
        return None
    try:
        run, wait, slices = Path(f"/proc/{tid}/schedstat").read_text().split()
    except (OSError, ValueError):
        return None
    return int(run) / 1e9, int(wait) / 1e9, int(slices)


def node_readings(cluster: LocalCluster, tick_tids: list[int | None] | None = None) -> list[dict]:
    """Per node: tick stalls (from /metrics), term, role, CPU seconds with children, and the
    scheduler statistics of its Raft tick thread and its main (event loop) thread."""
    out = []
    for i, m in enumerate(cluster.members):
        r: dict[str, Any] = {"node": m.peer.node_id}
        r["tick_sched"] = schedstat(tick_tids[i]) if tick_tids else None
        r["loop_sched"] = schedstat(m.process.pid) if m.process is not None else None
        try:
            with urllib.request.urlopen(f"http://{cluster.http_address(i)}/metrics", timeout=3) as f:
                text = f.read().decode()
            found = _STALLS.search(text)
            r["stalls"] = int(float(found.group(1))) if found else None
            r["rounds_by_path"] = {p: int(float(v)) for p, v in _ROUNDS.findall(text)}
            r["renewals_by_path"] = {p: int(float(v)) for p, v in _RENEWALS.findall(text)}
        except OSError:
            r["stalls"] = None
        st = cluster.status(i, timeout=2.0)
        r["term"] = st.term if st is not None else None
        r["leader_id"] = st.leader_id if st is not None else None
        r["cpu_s"] = cpu_seconds(m.process.pid, with_children=True) if m.process is not None else None
        r["front_cpu_s"] = cpu_seconds(m.process.pid) if m.process is not None else None  # C: without Raft
        out.append(r)
    return out


def _sched_delta(before: tuple[float, float, int] | None, after: tuple[float, float, int] | None,
                 wall_s: float) -> dict | None:
    """A thread's CPU and run-queue wait over the window, in ms per second of it, and the mean
    wait each time it was given a CPU."""
    if before is None or after is None:
        return None
    slices = after[2] - before[2]
    return {"cpu_ms_per_s": round(1000 * (after[0] - before[0]) / wall_s, 1),
            "runqueue_wait_ms_per_s": round(1000 * (after[1] - before[1]) / wall_s, 1),
            "slices_per_s": round(slices / wall_s, 1),
            "wait_ms_per_slice": round(1000 * (after[1] - before[1]) / slices, 2) if slices else None}


def _delta(before: dict | None, after: dict | None) -> dict | None:
    if before is None or after is None:
        return None
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def rounds_run(variant: str, stall: bool, n: int, duration_s: float, workdir: Path, workers: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix=f"rp-{variant}-{n}-", dir=workdir))
    cluster = variant_cluster(variant, stall, root, n)
    lg: LoadGenerator | None = None
    out: dict[str, Any] = {"kind": "rounds", "variant": variant, "stall_tolerance": stall, "n": n,
                           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        cluster.start()
        leader = stable_leader(cluster)
        out["leader"] = cluster.members[leader].peer.node_id
        lg = LoadGenerator(LoadSpec(groups=n, endpoints=(cluster.client_addresses[leader],),
                                    prefix=f"rp{variant}{n}"), workers_for(n, workers))
        lg.start(timeout=60)
        if not lg.wait_rounds(2, 90):
            out["failed"] = "fewer than 2 rounds in 90 s of warm-up"
        load0 = load_snapshot()
        tids = tick_thread_ids(cluster)
        before = node_readings(cluster, tids)
        gen0 = sum(cpu_seconds(p) or 0.0 for p in lg.pids)
        t0 = time.monotonic()
        time.sleep(duration_s)
        t1 = time.monotonic()
        after = node_readings(cluster, tids)
        gen1 = sum(cpu_seconds(p) or 0.0 for p in lg.pids)
        out["load"] = {"start": load0, "end": load_snapshot()}
        records = lg.stop()
        lg = None
        out.update(analyze_rounds(records, n, t0, t1))
        out["nodes"] = [{"node": a["node"], "stalls": (a["stalls"] - b["stalls"]) if None not in (a["stalls"], b["stalls"]) else None,
                         "term": [b["term"], a["term"]],
                         "cpu_s": round(a["cpu_s"] - b["cpu_s"], 2) if None not in (a["cpu_s"], b["cpu_s"]) else None,
                         "tick_thread": _sched_delta(b["tick_sched"], a["tick_sched"], t1 - t0),
                         "loop_thread": _sched_delta(b["loop_sched"], a["loop_sched"], t1 - t0),
                         "front_cpu_s": round(a["front_cpu_s"] - b["front_cpu_s"], 2)
                         if None not in (a["front_cpu_s"], b["front_cpu_s"]) else None,
                         "rounds_by_path": _delta(b.get("rounds_by_path"), a.get("rounds_by_path")),
                         "renewals_by_path": _delta(b.get("renewals_by_path"), a.get("renewals_by_path"))}
                        for b, a in zip(before, after)]
        terms0 = [b["term"] for b in before if b["term"] is not None]
        terms1 = [a["term"] for a in after if a["term"] is not None]
        out["leader_changes"] = (max(terms1) - max(terms0)) if terms0 and terms1 else None
        cpu = [x["cpu_s"] for x in out["nodes"] if x["cpu_s"] is not None]
        out["lighthouse_cpu_s"] = round(sum(cpu), 2)
        out["lighthouse_cpu_pct"] = round(100 * sum(cpu) / (t1 - t0), 1)
        out["loadgen_cpu_s"] = round(gen1 - gen0, 2)
        out["cpu_s_per_round"] = round(sum(cpu) / out["rounds"], 3) if out.get("rounds") else None
        out.pop("error_examples", None)
    except Exception as e:  # noqa: BLE001 -- one failed run must not lose the others
        out["failed"] = f"{type(e).__name__}: {e}"
    finally:
        if lg is not None:
            try:
                lg.stop(timeout=10)
            except Exception:  # noqa: BLE001
                pass
        cluster.stop_all()
    lat = out.get("latency_ms", {})
    say(f"rounds {variant}{'' if stall else ' (no ST)'} N={n}: {out.get('rounds_per_s')} rounds/s p50 {lat.get('p50')} "
        f"p99 {lat.get('p99')} ms, leader changes {out.get('leader_changes')}, stalls "
        f"{[x['stalls'] for x in out.get('nodes', [])]}, CPU/round {out.get('cpu_s_per_round')} s, "
        f"errors {out.get('errors_total')} load {out.get('load', {}).get('start', {}).get('loadavg')}"
        + (f" FAILED {out['failed']}" if out.get("failed") else ""))
    return out


def failover_run(variant: str, stall: bool, n: int, kills: int, workdir: Path) -> dict:
    class VariantCluster(LocalCluster):
        def __post_init__(self) -> None:
            super().__post_init__()
            self.launch_prefix = lambda _i: prefix(variant, stall)

    saved = failover_mod.LocalCluster
    failover_mod.LocalCluster = VariantCluster  # type: ignore[misc]
    out: dict[str, Any] = {"kind": "failover", "variant": variant, "stall_tolerance": stall, "n": n,
                           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_start": load_snapshot()}
    try:
        out.update(failover_mod.cluster_failover(n, kills, workdir, lambda m: None))
    except Exception as e:  # noqa: BLE001
        out["failed"] = f"{type(e).__name__}: {e}"
    finally:
        failover_mod.LocalCluster = saved  # type: ignore[misc]
    out["load_end"] = load_snapshot()
    say(f"failover {variant} N={n}: {out.get('summary')}" + (f" FAILED {out['failed']}" if out.get("failed") else ""))
    return out


def idle_run(variant: str, stall: bool, seconds: float, workdir: Path) -> dict:
    from benchmarks.footprint import QUIESCE_S, SETTLE_S

    root = Path(tempfile.mkdtemp(prefix=f"rp-idle-{variant}-", dir=workdir))
    cluster = variant_cluster(variant, stall, root, 1, http=False)
    out: dict[str, Any] = {"kind": "idle", "variant": variant, "stall_tolerance": stall, "seconds": seconds,
                           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        cluster.start()
        cluster.wait_for_leader(timeout=30)
        time.sleep(SETTLE_S + QUIESCE_S)
        pids = {m.peer.node_id: m.process.pid for m in cluster.members if m.process is not None}
        out["load_start"] = load_snapshot()
        c0 = {k: cpu_seconds(p, with_children=True) or 0.0 for k, p in pids.items()}
        t0 = time.monotonic()
        time.sleep(seconds)
        wall = time.monotonic() - t0
        out["cpu_pct"] = {k: round(100 * ((cpu_seconds(p, with_children=True) or 0.0) - c0[k]) / wall, 2)
                          for k, p in pids.items()}
        out["cpu_total_pct"] = round(sum(out["cpu_pct"].values()), 2)
        out["load_end"] = load_snapshot()
    except Exception as e:  # noqa: BLE001
        out["failed"] = f"{type(e).__name__}: {e}"
    finally:
        cluster.stop_all()
    say(f"idle {variant}: {out.get('cpu_pct')} % of a core per node")
    return out


def parse_variants(text: str) -> list[tuple[str, bool]]:
    """``A,B,C,A-nost`` -> [("A", True), ..., ("A", False)] (``-nost``: stall tolerance off)."""
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        name, _, flag = item.partition("-")
        if flag not in ("", "nost"):
            raise ValueError(f"bad variant {item!r}")
        out.append((name, flag != "nost"))
    return out


def summarize(rows: list[dict]) -> dict:
    """Per (kind, variant, stall tolerance, n): median, min and max of the headline figures."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("failed") or r.get("excluded"):  # counted nowhere; the JSON keeps why
            continue
        key = f"{r['kind']} {r['variant']}{'' if r.get('stall_tolerance', True) else '-nost'} N={r.get('n', '-')}"
        groups.setdefault(key, []).append(r)

    def spread(values: list[Any]) -> dict | None:
        vals = [v for v in values if v is not None]
        if not vals:
            return None
        return {"median": round(statistics.median(vals), 3), "min": min(vals), "max": max(vals), "all": vals}

    out = {}
    for key, rs in groups.items():
        if rs[0]["kind"] == "rounds":
            out[key] = {
                "runs": len(rs),
                "leader_changes": spread([r.get("leader_changes") for r in rs]),
                "stalls_leader": spread([next((x["stalls"] for x in r.get("nodes", []) if x["node"] == r.get("leader")), None) for r in rs]),
                "stalls_followers": spread([sum(x["stalls"] or 0 for x in r.get("nodes", []) if x["node"] != r.get("leader")) if r.get("nodes") else None for r in rs]),
                "rounds_per_s": spread([r.get("rounds_per_s") for r in rs]),
                "p50_ms": spread([r.get("latency_ms", {}).get("p50") for r in rs]),
                "p99_ms": spread([r.get("latency_ms", {}).get("p99") for r in rs]),
                "cpu_s_per_round": spread([r.get("cpu_s_per_round") for r in rs]),
                "errors": spread([r.get("errors_total") for r in rs]),
                "load1": spread([r.get("load", {}).get("start", {}).get("loadavg", [None])[0] for r in rs]),
            }
        elif rs[0]["kind"] == "failover":
            trials = [t.get("next_quorum_s") for r in rs for t in r.get("trials", [])]
            out[key] = {"runs": len(rs), "next_quorum_s": spread(trials),
                        "load1": spread([r.get("load_start", {}).get("loadavg", [None])[0] for r in rs])}
        else:
            out[key] = {"runs": len(rs), "cpu_total_pct": spread([r.get("cpu_total_pct") for r in rs]),
                        "load1": spread([r.get("load_start", {}).get("loadavg", [None])[0] for r in rs])}
    return out


def markdown(rows: list[dict]) -> str:
    """The summary as markdown tables (median [min-max] over runs)."""
    s = summarize(rows)

    def f(d: dict | None, nd: int = 2) -> str:
        if not d:
            return "-"
        med, lo, hi = d["median"], d["min"], d["max"]
        if len(d["all"]) == 1:
            return f"{round(med, nd)}"
        return f"{round(med, nd)} [{round(lo, nd)}-{round(hi, nd)}]"

    lines = ["| run | runs | load1 at start | leader changes | stalls leader | stalls followers | rounds/s | "
             "p50 ms | p99 ms | CPU s/round | errors |", "|" + "---|" * 11]
    for key, v in sorted(s.items()):
        if key.startswith("rounds"):
            lines.append(f"| {key[7:]} | {v['runs']} | {f(v['load1'], 1)} | {f(v['leader_changes'], 1)} | "
                         f"{f(v['stalls_leader'], 1)} | {f(v['stalls_followers'], 1)} | {f(v['rounds_per_s'])} | "
                         f"{f(v['p50_ms'], 0)} | {f(v['p99_ms'], 0)} | {f(v['cpu_s_per_round'])} | {f(v['errors'], 0)} |")
    lines += ["", "| failover | runs | load1 | next quorum s, median [min-max] over kills |", "|---|---|---|---|"]
    for key, v in sorted(s.items()):
        if key.startswith("failover"):
            lines.append(f"| {key[9:]} | {v['runs']} | {f(v['load1'], 1)} | {f(v['next_quorum_s'], 3)} |")
    lines += ["", "| idle | runs | load1 | CPU % of a core, 3 nodes together |", "|---|---|---|---|"]
    for key, v in sorted(s.items()):
        if key.startswith("idle"):
            lines.append(f"| {key[5:]} | {v['runs']} | {f(v['load1'], 1)} | {f(v['cpu_total_pct'], 2)} |")
    return "\n".join(lines)


def sched_markdown(rows: list[dict]) -> str:
    """Per variant and N: the tick threads' and the leader's event loop's scheduler figures
    (median over runs; ms per second of the window, wait per slice in ms)."""
    groups: dict[str, dict[str, list[float]]] = {}
    for r in rows:
        if r["kind"] != "rounds" or r.get("failed") or r.get("excluded"):
            continue
        key = f"{r['variant']}{'' if r.get('stall_tolerance', True) else '-nost'} N={r['n']}"
        g = groups.setdefault(key, {})
        for x in r.get("nodes", []):
            role = "leader" if x["node"] == r.get("leader") else "follower"
            for thread in ("tick_thread", "loop_thread"):
                t = x.get(thread)
                if not t:
                    continue
                for metric, value in t.items():
                    if value is not None:
                        g.setdefault(f"{role} {thread} {metric}", []).append(value)

    def med(g: dict, k: str) -> str:
        return f"{statistics.median(g[k]):.0f}" if g.get(k) else "-"

    def med2(g: dict, k: str) -> str:
        return f"{statistics.median(g[k]):.1f}" if g.get(k) else "-"

    lines = ["| run | leader tick: CPU / run-queue wait | followers' ticks: CPU / run-queue wait | "
             "followers' ticks: wait per slice (ms) | leader's loop: CPU / run-queue wait |", "|---|---|---|---|---|"]
    for key in sorted(groups):
        g = groups[key]
        lines.append(f"| {key} | {med(g, 'leader tick_thread cpu_ms_per_s')} / {med(g, 'leader tick_thread runqueue_wait_ms_per_s')} | "
                     f"{med(g, 'follower tick_thread cpu_ms_per_s')} / {med(g, 'follower tick_thread runqueue_wait_ms_per_s')} | "
                     f"{med2(g, 'follower tick_thread wait_ms_per_slice')} | "
                     f"{med(g, 'leader loop_thread cpu_ms_per_s')} / {med(g, 'leader loop_thread runqueue_wait_ms_per_s')} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=("rounds", "failover", "idle", "summary", "table", "sched"))
    p.add_argument("--variants", default="A,B,C")
    p.add_argument("--ns", default="1024,2048")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-load", type=float, default=3.0)
    p.add_argument("--max-wait-s", type=float, default=2400.0)
    p.add_argument("--no-wait", action="store_true", help="smoke tests: do not wait for a free host")
    p.add_argument("--stop-at", default=None, help="HH:MM UTC: start no run after this time")
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "raft-process")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "runs.jsonl")
    a = p.parse_args()
    if a.kind in ("summary", "table", "sched"):
        rows = [json.loads(line) for line in a.out.read_text().splitlines() if line.strip()]
        print(json.dumps(summarize(rows), indent=1) if a.kind == "summary" else
              markdown(rows) if a.kind == "table" else sched_markdown(rows))
        return
    a.workdir.mkdir(parents=True, exist_ok=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    variants = parse_variants(a.variants)
    plan: list[tuple[str, bool, int]] = []
    for rep in range(a.repeats):
        for n in ([int(x) for x in a.ns.split(",")] if a.kind == "rounds" else [a.n]):
            plan += [(v, s, n) for v, s in variants]
    for variant, stall, n in plan:
        if a.stop_at and time.strftime("%H:%M", time.gmtime()) >= a.stop_at:
            say(f"past {a.stop_at} UTC: no more runs")
            break
        host = {"waited_s": 0.0, "load_before": load_snapshot(), "smoke": True} if a.no_wait else \
            wait_for_host(a.max_load, a.max_wait_s)
        if a.kind == "rounds":
            row = rounds_run(variant, stall, n, a.duration, a.workdir, a.workers)
        elif a.kind == "failover":
            row = failover_run(variant, stall, n, a.kills, a.workdir)
        else:
            row = idle_run(variant, stall, a.seconds, a.workdir)
        row["host"] = host
        with a.out.open("a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
