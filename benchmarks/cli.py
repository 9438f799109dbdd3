"""``python -m benchmarks``: side-by-side benchmarks against torchft's Rust lighthouse.

From the repository root, with the ``bench`` extra installed (``pip install -e '.[bench]'``):

    python -m benchmarks run            # full run (~15 min on 2 cores, + ~35 min of goodput): benchmarks/bench.{json,md,png}
    python -m benchmarks run --quick    # smoke run (~3 min): benchmarks/bench-quick.{json,md,png}
    python -m benchmarks report benchmarks/bench.json   # re-render the table and plot

``lighthouse-cluster bench ...`` hands over to this group when run from a source checkout.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from .runner import SECTIONS, BenchOptions


def _ints(value: str | None) -> tuple[int, ...] | None:
    if not value:
        return None
    try:
        return tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
def bench() -> None:
    """Benchmarks side by side with torchft's Rust lighthouse (benchmarks/README.md)."""


@bench.command()
@click.option("--quick", is_flag=True, help="Smoke-test sizes (N=8,64; short windows; G=3 with 1 kill; under 3 minutes).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("benchmarks"),
              show_default=True, help="Where the JSON, markdown table and PNG plot go.")
@click.option("--name", help="Output file stem (default: bench, or bench-quick with --quick).")
@click.option("--sections", default=",".join(SECTIONS), show_default=True,
              help="Comma-separated subset of the sections to run.")
@click.option("--ns", help="Replica-group counts for the rounds section (default 8,64,256,1024,2048,4096; quick 8,64).")
@click.option("--duration", "duration_s", type=float, help="Seconds measured per rounds run (default 10; quick 2).")
@click.option("--repeats", type=int, help="Runs per (N, system); the table shows the median (default 2; quick 1).")
@click.option("--workers", type=int, default=2, show_default=True,
              help="Most load-generator processes (one per 64 groups up to this).")
@click.option("--failover-ns", help="N for the failover trials (default 8,64; quick 8).")
@click.option("--failover-trials", type=int, help="Leader kills per N (default 10; quick 2).")
@click.option("--restart-trials", type=int, help="torchft_lighthouse kill+restart trials (default 5; quick 1).")
@click.option("--sdk-steps", type=int, help="Training steps per replica group (default 300; quick 40).")
@click.option("--recovery-sizes", help="State dict sizes in MB (default 100,1024; quick 64).")
@click.option("--recovery-trials", type=int, help="Transfers per size and implementation (default 3; quick 1).")
@click.option("--footprint-seconds", "footprint_s", type=float, help="Idle CPU window (default 15; quick 2).")
@click.option("--goodput-groups", help="Replica groups per goodput run (default 3,8; quick 3).")
@click.option("--goodput-kills", type=int, help="Group kills per goodput run (default 10; quick 1).")
@click.option("--goodput-kill-every", "goodput_kill_every_s", type=float,
              help="Seconds between group kills; the no-failure window is kills x this (default 15; quick 8).")
@click.option("--isolation-groups", help="Replica groups of the small and the large job in the isolation "
                                          "section, SMALL,LARGE (default 8,256; quick 8,64).")
@click.option("--isolation-duration", "isolation_duration_s", type=float,
              help="Seconds measured per isolation phase (default 10; quick 2).")
@click.option("--isolation-pin-leader", is_flag=True,
              help="In the isolation section, give the leader and job B's load generator CPU 0 and everything "
                   "else the other CPUs (a leader with a core of its own; needs 2+ CPUs).")
@click.option("--profile-ns", help="After the rounds section, re-run the cluster at these N with py-spy "
                                   "attached to every node and summarize the profiles (e.g. 256,1024).")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path),
              help="Keep node logs and data here (default: a temporary directory, removed afterwards).")
def run(quick: bool, out_dir: Path, name: str | None, sections: str, ns: str | None, duration_s: float | None,
        repeats: int | None, workers: int, failover_ns: str | None, failover_trials: int | None,
        restart_trials: int | None, sdk_steps: int | None, recovery_sizes: str | None,
        recovery_trials: int | None, footprint_s: float | None, goodput_groups: str | None,
        goodput_kills: int | None, goodput_kill_every_s: float | None, isolation_groups: str | None,
        isolation_duration_s: float | None, isolation_pin_leader: bool, profile_ns: str | None,
        workdir: Path | None) -> None:
    """Start every system under test, measure, write <out>/<name>.{json,md,png}."""
    from . import INSTALL_HINT, missing_modules
    from .runner import run_bench

    missing = missing_modules()
    if missing:
        click.echo(f"error: the benchmarks need {', '.join(missing)}: {INSTALL_HINT}", err=True)
        sys.exit(2)

    chosen = tuple(s.strip() for s in sections.split(",") if s.strip())
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        raise click.BadParameter(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}", param_hint="--sections")
    iso = _ints(isolation_groups)
    if iso is not None and len(iso) != 2:
        raise click.BadParameter("expected SMALL,LARGE (two group counts)", param_hint="--isolation-groups")
    opts = BenchOptions(quick=quick, out_dir=out_dir, name=name, sections=chosen, ns=_ints(ns), duration_s=duration_s,
                        repeats=repeats, workers=workers, failover_ns=_ints(failover_ns),
                        failover_trials=failover_trials, restart_trials=restart_trials, sdk_steps=sdk_steps,
                        recovery_sizes_mb=_ints(recovery_sizes), recovery_trials=recovery_trials,
                        footprint_s=footprint_s, goodput_groups=_ints(goodput_groups), goodput_kills=goodput_kills,
                        goodput_kill_every_s=goodput_kill_every_s,
                        isolation_small=iso[0] if iso else None, isolation_large=iso[1] if iso else None,
                        isolation_duration_s=isolation_duration_s, isolation_pin_leader=isolation_pin_leader,
                        profile_ns=_ints(profile_ns) or (), workdir=workdir,
                        keep_workdir=workdir is not None)
    res = run_bench(opts, say=lambda s: click.echo(s))
    stem = opts.name or ("bench-quick" if quick else "bench")
    click.echo(f"\nwrote {out_dir / stem}.json, .md, .png ({res['duration_s']} s)")
    failed = [k for k, v in res["sections"].items() if "error" in v or v.get("errors")]
    for t in res.get("targets", []):
        mark = {True: "met", False: "MISSED", None: "n/a"}[t["met"]]
        click.echo(f"  {mark:6s} {t['name']}: {t['value']} (target {t['target']})")
    if failed:
        click.echo(f"error: sections failed: {', '.join(failed)}", err=True)
        sys.exit(1)


@bench.command()
@click.argument("results", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Default: next to RESULTS.")
def report(results: Path, out_dir: Path | None) -> None:
    """Re-render the markdown table and the PNG plot from a results JSON."""
    from .report import evaluate_targets
    from .runner import write_outputs

    res = json.loads(results.read_text())
    res["targets"] = evaluate_targets(res)
    paths = write_outputs(res, out_dir or results.parent, results.stem)
    click.echo(f"wrote {paths['md']} and {paths['png']}")


from .torchtitan import command as _torchtitan  # noqa: E402 -- torchtitan's FT trainer on each lighthouse
bench.add_command(_torchtitan)
from .rendezvous import command as _rendezvous  # noqa: E402 -- time to rendezvous N torchrun agents per backend
bench.add_command(_rendezvous)


def main() -> None:
    bench(prog_name="python -m benchmarks")
