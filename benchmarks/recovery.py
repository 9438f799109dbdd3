"""Section 4, live recovery: time to heal a replica with a 100 MB / 1 GB state dict over HTTP.

For each size and implementation (torchft's ``HTTPTransport`` and ftclient's), a sender and a
receiver process (``recovery_worker``) move the state dict over loopback; the figure is the
receiver's ``recv_checkpoint`` wall time (and MB/s), median over the trials. Peak resident memory
of both sides is recorded too (a transport that buffers the whole checkpoint shows up there).

A transfer whose worker reports ``skipped`` (torch or torchft not installed) is listed as skipped;
any other failure is an error: in the run, in the summary row and in the section's ``errors``,
which fails the bench.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

from .procs import child_env, kill_process, worker_command


def _one(impl: str, size_mb: int, workdir: Path, timeout_s: float) -> dict:
    d = workdir / f"recovery-{impl}-{size_mb}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for role in ("send", "recv"):
            log = open(d / f"{role}.log", "wb")
            try:
                procs[role] = subprocess.Popen(
                    worker_command("recovery_worker", "--impl", impl, "--role", role, "--size-mb", str(size_mb),
                                   "--dir", str(d), "--timeout", str(timeout_s)),
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                    env=child_env())
            finally:
                log.close()
        deadline = time.monotonic() + timeout_s + 60
        while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for p in procs.values():
            kill_process(p)
    res: dict[str, Any] = {}
    for role in ("send", "recv"):
        f = d / f"{role}.json"
        if f.exists():
            res[role] = json.loads(f.read_text())
        else:
            tail = (d / f"{role}.log").read_text(errors="replace").splitlines()[-6:]
            res[role] = {"error": f"{role} wrote no result (exit {procs[role].returncode}): " + " | ".join(tail)}
    errors = [f"{role}: {res[role]['error']}" for role in ("send", "recv") if res[role].get("error")]
    if errors:
        return {"error": "; ".join(errors), "log_dir": str(d)}
    skipped = res["send"].get("skipped") or res["recv"].get("skipped")
    if skipped:
        return {"skipped": skipped}
    shutil.rmtree(d, ignore_errors=True)
    return {"recv_s": round(res["recv"]["recv_s"], 4), "mb_per_s": round(res["recv"]["mb_per_s"], 1),
            "bytes": res["recv"]["bytes"], "recv_peak_rss_mb": round(res["recv"]["peak_rss_mb"], 1),
            "send_peak_rss_mb": round(res["send"]["peak_rss_mb"], 1),
            "send_checkpoint_s": round(res["send"]["send_checkpoint_s"], 4)}


def run_recovery(sizes_mb: list[int], trials: int, workdir: Path, say: Callable[[str], None],
                 timeout_s: float = 300.0) -> dict:
    runs = []
    for size in sizes_mb:
        for trial in range(trials):
            for impl in ("torchft", "ftclient"):
                r = {"impl": impl, "size_mb": size, "trial": trial, **_one(impl, size, workdir, timeout_s)}
                runs.append(r)
                say(f"  recovery {impl:8s} {size:5d} MB: " + (
                    f"{r['recv_s']:.3f} s ({r['mb_per_s']:.0f} MB/s), receiver peak RSS {r['recv_peak_rss_mb']:.0f} MB"
                    if "recv_s" in r else f"SKIPPED: {r['skipped']}" if "skipped" in r else f"ERROR: {r['error']}"))
    summary = []
    for size in sizes_mb:
        row: dict[str, Any] = {"size_mb": size}
        for impl in ("torchft", "ftclient"):
            rs = [r for r in runs if r["impl"] == impl and r["size_mb"] == size and "recv_s" in r]
            if rs:
                med = statistics.median(r["recv_s"] for r in rs)
                row[impl] = {"recv_s": round(med, 4), "mb_per_s": round(rs[0]["bytes"] / 2**20 / med, 1),
                             "recv_peak_rss_mb": max(r["recv_peak_rss_mb"] for r in rs),
                             "send_peak_rss_mb": max(r["send_peak_rss_mb"] for r in rs)}
            else:
                mine = [r for r in runs if r["impl"] == impl and r["size_mb"] == size]
                errors = [r["error"] for r in mine if "error" in r]
                skipped = [r["skipped"] for r in mine if "skipped" in r]
                row[impl] = {"error": errors[0]} if errors else {"skipped": skipped[0] if skipped else "not run"}
        t, f = row["torchft"].get("mb_per_s"), row["ftclient"].get("mb_per_s")
        row["throughput_ratio"] = round(f / t, 3) if t and f else None
        summary.append(row)
    errors = [f"{r['impl']} {r['size_mb']} MB, trial {r['trial']}: {r['error']}" for r in runs if "error" in r]
    return {"trials": trials, "num_chunks": 0, "runs": runs, "summary": summary, "errors": errors}
