"""Section 3, SDK step overhead: ftclient vs torchft's Manager, same model, 2 replica groups, CPU.

Each measurement runs two ``sdk_worker`` processes (one per replica group) against the same
lighthouse, released together by a start barrier, and records every step's wall time. The
first ``warmup`` steps (first quorum, process group set-up) are dropped; the figure is the median
step time over both groups. Lighthouses: ``torchft`` (torchft_lighthouse: isolates the SDKs) and,
in the full run, ``cluster`` (our 3 nodes: torchft's Manager gets the leader's URL, ftclient
the endpoint list).

A run whose worker reports ``skipped`` (torch or torchft not installed) is listed as skipped; any
other failure is an error: in the run, in the summary and in the section's ``errors``, which
fails the bench.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

from lighthouse_cluster.local.cluster import LocalCluster
from .procs import RustLighthouse, child_env, kill_process, worker_command

WORKER_TIMEOUT_S = 180.0


def _run_pair(sdk: str, lighthouse_url: str, steps: int, workdir: Path, tag: str) -> dict:
    run_dir = workdir / f"sdk-{tag}-{sdk}"
    run_dir.mkdir(parents=True, exist_ok=True)
    go = run_dir / "go"
    go.unlink(missing_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    outs = [run_dir / f"group{g}.json" for g in range(2)]
    readies = [run_dir / f"group{g}.ready" for g in range(2)]
    for p in outs + readies:
        p.unlink(missing_ok=True)
    env = child_env(TORCHFT_LIGHTHOUSE=lighthouse_url, TORCHFT_QUORUM_TIMEOUT_SEC="30", TORCHFT_TIMEOUT_SEC="30",
                    TORCHFT_CONNECT_TIMEOUT_SEC="30", RUST_LOG="warn", OMP_NUM_THREADS="1")
    try:
        for g in range(2):
            log = open(run_dir / f"group{g}.log", "wb")
            try:
                procs.append(subprocess.Popen(
                    worker_command("sdk_worker", "--sdk", sdk, "--group", str(g), "--steps", str(steps),
                                   "--out", str(outs[g]), "--ready-file", str(readies[g]), "--go-file", str(go)),
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                    start_new_session=True))
            finally:
                log.close()
        deadline = time.monotonic() + 120
        while not all(r.exists() for r in readies):
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        go.write_text("go")
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for p in procs:
            kill_process(p)
    results = []
    for g, out in enumerate(outs):
        if out.exists():
            results.append(json.loads(out.read_text()))
        else:
            tail = (run_dir / f"group{g}.log").read_text(errors="replace").splitlines()[-8:]
            results.append({"error": f"group {g} wrote no result (exit {procs[g].returncode}); log tail: "
                                     + " | ".join(tail)})
    return {"groups": results, "log_dir": str(run_dir)}


def _outcome(pair: dict, warmup: int) -> dict:
    """``{"error": ...}`` when a group failed, else ``{"skipped": ...}`` when a group skipped (an
    optional package is missing), else the step times after ``warmup`` of both groups together."""
    groups = pair["groups"]
    errors = [f"group {g}: {r['error']}" for g, r in enumerate(groups) if "error" in r]
    if errors:
        return {"error": "; ".join(errors)}
    skipped = [r["skipped"] for r in groups if "skipped" in r]
    if skipped:
        return {"skipped": skipped[0]}
    times = [t for r in groups for t in r["step_times_s"][warmup:]]
    if len(times) < 2:
        return {"error": f"{len(times)} step(s) measured after {warmup} warm-up steps"}
    return {"times": times}


def run_sdk(steps: int, warmup: int, lighthouses: list[str], workdir: Path, say: Callable[[str], None],
            repeats: int = 1) -> dict:
    out: dict[str, Any] = {"steps": steps, "warmup_steps": warmup, "groups": 2, "model": "MLP 64-256-256-10, SGD",
                           "runs": []}
    for lh_kind in lighthouses:
        for rep in range(repeats):
            for sdk in ("torchft", "ftclient"):
                run: dict[str, Any] = {"lighthouse": lh_kind, "sdk": sdk, "repeat": rep}
                if lh_kind == "torchft":
                    lh = RustLighthouse(min_replicas=2, log_path=workdir / f"sdk-lighthouse-{sdk}.log",
                                        join_timeout_ms=10_000)
                    try:
                        lh.start()
                        pair = _run_pair(sdk, f"http://{lh.address}", steps, workdir, f"{lh_kind}{rep}")
                    finally:
                        lh.kill()
                else:
                    cluster = LocalCluster(root=workdir / f"sdk-cluster-{sdk}-{rep}", min_replicas=2,
                                           join_timeout_ms=10_000)
                    try:
                        cluster.start()
                        leader = cluster.wait_for_leader(timeout=30)
                        url = (f"http://{cluster.client_addresses[leader]}" if sdk == "torchft"
                               else cluster.endpoints)
                        pair = _run_pair(sdk, url, steps, workdir, f"{lh_kind}{rep}")
                    finally:
                        cluster.stop_all()
                got = _outcome(pair, warmup)
                if "times" in got:
                    times = got["times"]
                    run["median_step_ms"] = round(statistics.median(times) * 1000, 3)
                    run["p90_step_ms"] = round(statistics.quantiles(times, n=10, method="inclusive")[-1] * 1000, 3)
                    run["final_steps"] = [g.get("final_step") for g in pair["groups"]]
                    say(f"  sdk {sdk:8s} (lighthouse {lh_kind}): median step {run['median_step_ms']:.2f} ms, "
                        f"committed steps {run['final_steps']}")
                else:
                    run.update(got, median_step_ms=None, log_dir=pair["log_dir"])
                    say(f"  sdk {sdk:8s} (lighthouse {lh_kind}): "
                        + (f"SKIPPED: {got['skipped']}" if "skipped" in got else f"ERROR: {got['error']}"))
                out["runs"].append(run)
    out["summary"] = _summary(out["runs"])
    out["errors"] = [f"{r['sdk']} (lighthouse {r['lighthouse']}, repeat {r['repeat']}): {r['error']}"
                     for r in out["runs"] if "error" in r]
    return out


def _summary(runs: list[dict]) -> dict:
    res: dict[str, Any] = {}
    for lh_kind in sorted({r["lighthouse"] for r in runs}):
        by = {sdk: [r["median_step_ms"] for r in runs if r["lighthouse"] == lh_kind and r["sdk"] == sdk
                    and r.get("median_step_ms") is not None] for sdk in ("torchft", "ftclient")}
        t = statistics.median(by["torchft"]) if by["torchft"] else None
        f = statistics.median(by["ftclient"]) if by["ftclient"] else None
        mine = [r for r in runs if r["lighthouse"] == lh_kind]
        skipped = [r["skipped"] for r in mine if r["sdk"] == "ftclient" and "skipped" in r]
        res[lh_kind] = {"torchft_ms": t, "ftclient_ms": f,
                        "ratio": round(f / t, 3) if t and f else None,
                        "ftclient_skipped": skipped[0] if skipped and f is None else None,
                        "errors": [f"{r['sdk']}: {r['error']}" for r in mine if "error" in r]}
    return res
