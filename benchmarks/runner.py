"""Runs the selected sections in one process and writes ``<name>.json``, ``.md`` and ``.png``.

Every section starts the systems it measures and stops them in ``finally`` blocks; a section that
fails is recorded as ``{"error": ...}`` and the others still run.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from .procs import load_snapshot, machine_info


def _command_line() -> str:
    argv = list(sys.argv)
    if argv and argv[0].endswith(os.path.join("benchmarks", "__main__.py")):
        argv[0:1] = ["python", "-m", "benchmarks"]
    elif argv and os.path.basename(argv[0]) == "lighthouse-cluster":
        argv[0] = "lighthouse-cluster"
    return " ".join(argv)


SECTIONS = ("rounds", "failover", "sdk", "recovery", "footprint", "goodput", "isolation")
SCHEMA = 1


@dataclass
class BenchOptions:
    quick: bool = False
    out_dir: Path = Path("benchmarks")
    name: str | None = None
    sections: tuple[str, ...] = SECTIONS
    ns: tuple[int, ...] | None = None
    duration_s: float | None = None
    repeats: int | None = None
    workers: int = 2
    failover_ns: tuple[int, ...] | None = None
    failover_trials: int | None = None
    restart_trials: int | None = None
    sdk_steps: int | None = None
    sdk_lighthouses: tuple[str, ...] | None = None
    recovery_sizes_mb: tuple[int, ...] | None = None
    recovery_trials: int | None = None
    footprint_s: float | None = None
    goodput_groups: tuple[int, ...] | None = None
    goodput_kills: int | None = None
    goodput_kill_every_s: float | None = None
    isolation_small: int | None = None
    isolation_large: int | None = None
    isolation_duration_s: float | None = None
    isolation_pin_leader: bool = False
    profile_ns: tuple[int, ...] = ()
    workdir: Path | None = None
    keep_workdir: bool = False
    command: str = field(default_factory=lambda: _command_line())

    def resolved(self) -> "BenchOptions":
        """Fill unset values with the quick or the full defaults."""
        q = self.quick
        d = dict(
            ns=(8, 64) if q else (8, 64, 256, 1024, 2048, 4096),
            duration_s=2.0 if q else 10.0,
            repeats=1 if q else 2,
            failover_ns=(8,) if q else (8, 64),
            failover_trials=2 if q else 10,
            restart_trials=1 if q else 5,
            sdk_steps=40 if q else 300,
            sdk_lighthouses=("torchft",) if q else ("torchft", "cluster"),
            recovery_sizes_mb=(64,) if q else (100, 1024),
            recovery_trials=1 if q else 3,
            footprint_s=2.0 if q else 15.0,
            goodput_groups=(3,) if q else (3, 8),
            goodput_kills=1 if q else 10,
            goodput_kill_every_s=8.0 if q else 15.0,
            isolation_small=8,
            isolation_large=64 if q else 256,
            isolation_duration_s=2.0 if q else 10.0,
            name="bench-quick" if q else "bench",
        )
        values = asdict(self)
        for k, v in d.items():
            if values.get(k) is None:
                values[k] = v
        values["out_dir"] = Path(values["out_dir"])
        if values["workdir"] is not None:
            values["workdir"] = Path(values["workdir"])
        return BenchOptions(**values)


def run_bench(opts: BenchOptions, say: Callable[[str], None] = print) -> dict:
    opts = opts.resolved()
    for s in opts.sections:
        if s not in SECTIONS:
            raise ValueError(f"unknown section {s!r} (known: {', '.join(SECTIONS)})")
    started = time.monotonic()
    res: dict[str, Any] = {
        "schema": SCHEMA,
        "mode": "quick" if opts.quick else "full",
        "command": opts.command,
        "started_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "loadavg": {"start": [round(x, 2) for x in os.getloadavg()]},
        "load": {"start": load_snapshot()},
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items()},
        "sections": {},
    }
    own_workdir = opts.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="lhc-bench-")) if own_workdir else opts.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    say(f"bench ({res['mode']}): sections {', '.join(opts.sections)}; work dir {workdir}; "
        f"load average {res['loadavg']['start']}")
    try:
        for section in opts.sections:
            t0 = time.monotonic()
            say(f"== {section}")
            try:
                out = _run_section(section, opts, workdir, say)
            except Exception as e:  # noqa: BLE001 -- recorded; the other sections still run
                say(f"  {section} failed: {type(e).__name__}: {e}")
                out = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            out["elapsed_s"] = round(time.monotonic() - t0, 1)
            out["load_end"] = load_snapshot()
            res["sections"][section] = out
        if opts.profile_ns and "rounds" in opts.sections:
            say("== profiles (extra runs with py-spy attached; not part of the tables)")
            try:
                res["profiles"] = _profiles(opts, workdir, say)
            except Exception as e:  # noqa: BLE001
                res["profiles"] = {"error": f"{type(e).__name__}: {e}"}
    finally:
        if own_workdir and not opts.keep_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    res["loadavg"]["end"] = [round(x, 2) for x in os.getloadavg()]
    res["load"]["end"] = load_snapshot()
    res["duration_s"] = round(time.monotonic() - started, 1)
    from .report import evaluate_targets

    res["targets"] = evaluate_targets(res)
    write_outputs(res, opts.out_dir, opts.name or "bench")
    return res


def write_outputs(res: dict, out_dir: Path, name: str) -> dict[str, Path]:
    from .report import markdown, plot

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{name}.json", "md": out_dir / f"{name}.md", "png": out_dir / f"{name}.png"}
    paths["json"].write_text(json.dumps(res, indent=1, default=str) + "\n")
    try:
        res["plot_renderer"] = plot(res, paths["png"])
    except Exception as e:  # noqa: BLE001 -- a plot problem must not lose the numbers
        res["plot_error"] = f"{type(e).__name__}: {e}"
    paths["md"].write_text(markdown(res, paths["png"].name if paths["png"].exists() else None))
    paths["json"].write_text(json.dumps(res, indent=1, default=str) + "\n")
    return paths


def _run_section(section: str, opts: BenchOptions, workdir: Path, say: Callable[[str], None]) -> dict:
    if section == "rounds":
        from .rounds import ALL_SYSTEMS, SYSTEMS, RoundsConfig, run_rounds

        cfg = RoundsConfig(duration_s=opts.duration_s, workers=opts.workers)
        # The Python gRPC floor only in full runs (--quick must stay short).
        systems = SYSTEMS if opts.quick else ALL_SYSTEMS
        return run_rounds(list(opts.ns), list(systems), cfg, workdir, say, repeats=opts.repeats)
    if section == "failover":
        from .failover import cluster_failover, torchft_restart

        cl = [cluster_failover(n, opts.failover_trials, workdir, say, opts.workers) for n in opts.failover_ns]
        tf = [torchft_restart(n, opts.restart_trials, workdir, say, opts.workers) for n in opts.failover_ns[:1]]
        return {"cluster": {"runs": cl}, "torchft": {"runs": tf}}
    if section == "sdk":
        from .sdk import run_sdk

        return run_sdk(opts.sdk_steps, min(10, opts.sdk_steps // 4), list(opts.sdk_lighthouses), workdir, say,
                       repeats=1 if opts.quick else 2)
    if section == "recovery":
        from .recovery import run_recovery

        return run_recovery(list(opts.recovery_sizes_mb), opts.recovery_trials, workdir, say)
    if section == "footprint":
        from .footprint import run_footprint

        return run_footprint(opts.footprint_s, workdir, say)
    if section == "goodput":
        from .goodput import run_goodput

        from .goodput import QUICK_SYSTEMS

        return run_goodput(list(opts.goodput_groups), opts.goodput_kills, opts.goodput_kill_every_s, workdir, say,
                           systems=list(QUICK_SYSTEMS) if opts.quick else None)
    if section == "isolation":
        from .isolation import run_isolation

        # Quick runs leave out the other clusters (port processes, the control): the CI suite's time.
        out = run_isolation(opts.isolation_small, opts.isolation_large, opts.isolation_duration_s, workdir, say,
                            workers=opts.workers, with_port_processes=not opts.quick, with_other_cluster=not opts.quick,
                            pin_leader=opts.isolation_pin_leader)
        if "error" in out:
            out["errors"] = [out.pop("error")]
        return out
    raise ValueError(section)


def _profiles(opts: BenchOptions, workdir: Path, say: Callable[[str], None]) -> dict:
    import shutil as sh

    from .profile import top_functions
    from .rounds import RoundsConfig, run_one

    if sh.which("py-spy") is None:
        return {"skipped": "py-spy is not installed (pip install -e '.[bench]')"}
    prof_dir = opts.out_dir / "profiles"
    cfg = RoundsConfig(duration_s=max(5.0, opts.duration_s), workers=opts.workers, profile_dir=prof_dir,
                       profile_ns=tuple(opts.profile_ns))
    out: dict[str, Any] = {}
    for n in opts.profile_ns:
        for system in ("leader", "followers"):
            r = run_one(system, n, cfg, workdir, say)
            files = sorted(prof_dir.glob(f"{system}-{n}-*.txt"))
            out[f"{system}-{n}"] = {
                "rounds_per_s": r.get("rounds_per_s"),
                "lighthouse_cpu": r.get("lighthouse_cpu"),
                "profiles": {f.name: top_functions(f, 12) for f in files if f.stat().st_size > 0},
            }
    return out
