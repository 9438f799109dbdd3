"""Section 2, failover: SIGKILL the lighthouse while N replica groups loop; time to the next quorum.

Cluster: groups are spread over the three nodes and carry the endpoint list (a group whose node
dies moves to the next address, as ftclient does). Each trial waits for a few steady rounds,
SIGKILLs the current Raft leader, and measures, per group, the time from the kill to the first
answer carrying a quorum created after the killed process was gone (an answer already on its way
at the kill does not count); the trial's failover time is the slowest group's. The
killed node is then restarted, and the next trial starts once it has caught up and the groups
have done a few more rounds.

torchft_lighthouse: the same load against the single Rust lighthouse, which is SIGKILLed and
restarted at once on the same port (the best a supervisor can do); the groups retry every 50 ms
and reconnect within 50-250 ms. Its quorum ids restart from 1, which is recorded too.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from lighthouse_cluster.local.cluster import LocalCluster
from .loadgen import LoadGenerator, LoadSpec, first_answers_after, validator_quorum_ids
from .rounds import HEARTBEAT_TIMEOUT_MS, JOIN_TIMEOUT_MS, QUORUM_TICK_MS, workers_for
from .procs import RustLighthouse

SETTLE_ROUNDS = 5
NEXT_QUORUM_TIMEOUT_S = 20.0


def _trials(records: list[dict], meta: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each trial's recorded facts (without its raw kill times) and its figures from ``records``."""
    return [{**{k: v for k, v in m.items() if k not in ("t_kill", "wall_kill")},
             **_trial_stats(records, m["t_kill"], m["wall_kill"])} for m in meta]


def _stop_quietly(lg: "LoadGenerator | None") -> None:
    """Stop a load generator left running by a failed run (its own error is not the one to report)."""
    if lg is not None:
        try:
            lg.stop(timeout=10)
        except Exception:  # noqa: BLE001
            pass


def _trial_stats(records: list[dict], t_kill: float, wall_kill: float) -> dict:
    firsts = first_answers_after(records, t_kill, wall_kill)
    delays = [t - t_kill for t in firsts.values() if t is not None]
    missing = sum(1 for t in firsts.values() if t is None)
    return {
        "next_quorum_s": round(max(delays), 4) if delays and not missing else None,
        "group_median_s": round(statistics.median(delays), 4) if delays else None,
        "groups_without_next_quorum": missing,
    }


def _summary(trials: list[dict]) -> dict:
    vals = [t["next_quorum_s"] for t in trials if t.get("next_quorum_s") is not None]
    serving = [t["new_leader_serving_s"] for t in trials if t.get("new_leader_serving_s") is not None]
    groups = [t["group_median_s"] for t in trials if t.get("group_median_s") is not None]
    return {
        "trials": len(trials),
        "completed": len(vals),
        "new_leader_serving_median_s": round(statistics.median(serving), 4) if serving else None,
        "group_median_median_s": round(statistics.median(groups), 4) if groups else None,
        "median_s": round(statistics.median(vals), 4) if vals else None,
        "max_s": round(max(vals), 4) if vals else None,
        "min_s": round(min(vals), 4) if vals else None,
    }


def _ids_monotonic(ids: list[tuple[float, int]]) -> bool:
    return all(b[1] >= a[1] for a, b in zip(ids, ids[1:]))


def _wait_caught_up(cluster: LocalCluster, i: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        leader = cluster.leader_index()
        st = cluster.status(i, timeout=0.5)
        lst = cluster.status(leader, timeout=0.5) if leader is not None else None
        if st is not None and lst is not None and st.leader_id and st.last_applied >= lst.commit_index - 2:
            return True
        time.sleep(0.05)
    return False


def cluster_failover(n: int, trials: int, workdir: Path, say: Callable[[str], None], max_workers: int = 2) -> dict:
    root = Path(tempfile.mkdtemp(prefix=f"failover-{n}-", dir=workdir))
    cluster = LocalCluster(root=root, nodes=3, min_replicas=n, join_timeout_ms=JOIN_TIMEOUT_MS,
                           quorum_tick_ms=QUORUM_TICK_MS, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    lg: LoadGenerator | None = None
    meta: list[dict[str, Any]] = []
    out: dict[str, Any] = {"n": n, "placement": "spread over all 3 nodes, endpoint list for fallback"}
    try:
        cluster.start()
        cluster.wait_for_leader(timeout=30)
        addrs = tuple(cluster.client_addresses)
        lg = LoadGenerator(LoadSpec(groups=n, endpoints=addrs, fallback=addrs, quorum_timeout_s=10.0,
                                    prefix=f"failover{n}", parse_created=True), workers_for(n, max_workers))
        lg.start(timeout=60)
        if not lg.wait_rounds(2, 60):
            raise RuntimeError("no steady rounds before the first kill")
        for trial in range(trials):
            leader = cluster.wait_for_leader(timeout=15)
            lg.wait_rounds(lg.min_ok() + SETTLE_ROUNDS, 20)
            leader_id = cluster.members[leader].peer.node_id
            st = cluster.status(leader, timeout=0.5)
            t_kill = time.monotonic()
            cluster.kill(leader)  # SIGKILL, then reaped: nothing the old leader sent is created later
            wall_kill = time.time()
            deadline = t_kill + NEXT_QUORUM_TIMEOUT_S
            survivors = [i for i in range(cluster.nodes) if i != leader]
            serving_s = None
            while not lg.all_have_quorum_created_after(wall_kill) and time.monotonic() < deadline:
                if serving_s is None and cluster.leader_index(among=survivors) is not None:
                    serving_s = round(time.monotonic() - t_kill, 4)  # elected and past its TermStart
                time.sleep(0.005)
            all_ok = lg.all_have_quorum_created_after(wall_kill)
            new_leader = cluster.leader_index()
            meta.append({"trial": trial, "t_kill": t_kill, "wall_kill": wall_kill, "killed": leader_id,
                         "term": st.term if st else None, "new_leader_serving_s": serving_s,
                         "all_answered": all_ok,
                         "new_leader": cluster.members[new_leader].peer.node_id if new_leader is not None else None})
            cluster.start_node(leader)
            if not _wait_caught_up(cluster, leader, 20):
                say(f"  failover: {leader_id} did not catch up within 20 s after restart")
        records = lg.stop()
        lg = None
    finally:
        _stop_quietly(lg)
        cluster.stop_all()
    trials_out = _trials(records, meta)
    for m, t in zip(meta, trials_out):
        say(f"  failover cluster N={n} trial {m['trial'] + 1}: killed leader {m['killed']}, every group's next "
            f"quorum after {t['next_quorum_s'] if t['next_quorum_s'] is not None else 'n/a'} s "
            f"(new leader {m['new_leader']})")
    ids = validator_quorum_ids(records)
    out.update({"trials": trials_out, "summary": _summary(trials_out),
                "quorum_ids_monotonic": _ids_monotonic(ids),
                "quorum_id_first_last": [ids[0][1], ids[-1][1]] if ids else None})
    return out


def torchft_restart(n: int, trials: int, workdir: Path, say: Callable[[str], None], max_workers: int = 2) -> dict:
    lh = RustLighthouse(min_replicas=n, log_path=workdir / f"torchft-restart-{n}.log", join_timeout_ms=JOIN_TIMEOUT_MS,
                        quorum_tick_ms=QUORUM_TICK_MS, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    lg: LoadGenerator | None = None
    meta: list[dict[str, Any]] = []
    try:
        lh.start()
        lg = LoadGenerator(LoadSpec(groups=n, endpoints=(lh.address,), quorum_timeout_s=10.0,
                                    prefix=f"restart{n}", parse_created=True), workers_for(n, max_workers))
        lg.start(timeout=60)
        if not lg.wait_rounds(2, 60):
            raise RuntimeError("no steady rounds before the first kill")
        for trial in range(trials):
            lg.wait_rounds(lg.min_ok() + SETTLE_ROUNDS, 20)
            t_kill = time.monotonic()
            lh.kill()  # SIGKILL, then reaped
            wall_kill = time.time()
            startup = lh.start()
            listening = time.monotonic() - t_kill
            deadline = t_kill + NEXT_QUORUM_TIMEOUT_S
            while not lg.all_have_quorum_created_after(wall_kill) and time.monotonic() < deadline:
                time.sleep(0.005)
            meta.append({"trial": trial, "t_kill": t_kill, "wall_kill": wall_kill,
                         "process_start_s": round(startup, 4), "restart_listening_s": round(listening, 4),
                         "all_answered": lg.all_have_quorum_created_after(wall_kill)})
        records = lg.stop()
        lg = None
    finally:
        _stop_quietly(lg)
        lh.kill()
    trials_out = _trials(records, meta)
    ids = validator_quorum_ids(records)
    for m, t in zip(meta, trials_out):
        before = [q for ts, q in ids if ts <= m["t_kill"]]
        after = [q for ts, q in ids if ts > m["t_kill"]]
        t["quorum_id_before_after"] = [before[-1] if before else None, after[0] if after else None]
        say(f"  failover torchft_lighthouse N={n} trial {m['trial'] + 1}: killed and restarted "
            f"(listening after {t['restart_listening_s']} s), every group's next quorum after "
            f"{t['next_quorum_s'] if t['next_quorum_s'] is not None else 'n/a'} s, quorum id "
            f"{t['quorum_id_before_after'][0]} -> {t['quorum_id_before_after'][1]}")
    return {"n": n, "restart": "immediately after SIGKILL, same port", "trials": trials_out,
            "summary": _summary(trials_out), "quorum_ids_monotonic": _ids_monotonic(ids)}
