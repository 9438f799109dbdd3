"""``python -m jepsen_like``: run, check and replay fault-injection scenarios.

    python -m jepsen_like run --time-limit 60 --nodes 3 --nemesis halves,kill --seed 7
    python -m jepsen_like run --time-limit 60 --nemesis kill-client     # kill and restart replica groups
    python -m jepsen_like run --time-limit 60 --jobs 1                  # the default job only
    python -m jepsen_like run --time-limit 60 --nemesis lose-power,lose-power-majority   # power losses
    python -m jepsen_like check jepsen-runs/<run>        # exit status 1 if any checker fails
    python -m jepsen_like replay jepsen-runs/<run>       # the same schedule, again
"""

from __future__ import annotations

import datetime
import random
import signal
import sys
import threading
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from . import checkers
from .cluster import ClusterSettings
from .clients import ClientSettings, job_names
from .network import BACKENDS, BackendUnavailable
from .runner import Printer, RunOptions, RunResult, check_directory, load_schedule, run_schedule
from .schedule import ALL_FAULTS, DEFAULT_FAULTS, NETWORK_FAULTS, Schedule, generate

console = Console(highlight=False, width=None if sys.stdout.isatty() else 140)
DEFAULT_OUT = Path("jepsen-runs")


class RichPrinter(Printer):
    def line(self, text: str) -> None:
        console.print(text)


def _out_dir(out: Path | None, seed: int, tag: str = "") -> Path:
    if out is not None:
        return out
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return DEFAULT_OUT / f"{stamp}-seed{seed}{tag}"


def _parse_nemeses(values: tuple[str, ...]) -> list[str]:
    """Comma-separated names; ``all`` (alone or in a list) stands for the default set."""
    names: list[str] = []
    for v in values:
        for n in (n.strip() for n in v.split(",") if n.strip()):
            names += list(DEFAULT_FAULTS) if n == "all" else [n]
    if not names:
        return list(DEFAULT_FAULTS)
    names = list(dict.fromkeys(names))
    unknown = [n for n in names if n not in ALL_FAULTS]
    if unknown:
        raise click.BadParameter(f"unknown nemesis {unknown}; choose from {', '.join(ALL_FAULTS)} or all")
    return names


def report(result: RunResult) -> None:
    counts = result.counts
    t = Table(title="operations", title_justify="left")
    for col in ("f", "ok", "fail", "info", "open"):
        t.add_column(col, justify="right" if col != "f" else "left")
    for f, c in counts["client"].items():
        t.add_row(f, *(str(c.get(k, 0)) for k in ("ok", "fail", "info", "open")))
    per_job = counts.get("jobs", {})
    if len(per_job) > 1:
        for job, fs in per_job.items():
            c = fs.get("quorum", {})
            t.add_row(f"  quorum of {job}", *(str(c.get(k, 0)) for k in ("ok", "fail", "info", "open")))
    console.print(t)
    if counts["nemesis"]:
        console.print("faults: " + ", ".join(f"{f} x{n}" for f, n in counts["nemesis"].items()))
    if result.by_kind:
        u = Table(title="unavailability per fault (s): longest stretch with no quorum anywhere; "
                        "recovery = heal until every client has a quorum", title_justify="left")
        for col in ("fault", "count", "unavail. median", "unavail. max", "recovery median", "recovery max"):
            u.add_column(col, justify="right" if col != "fault" else "left")
        for f, s in result.by_kind.items():
            u.add_row(f, str(s["count"]), f"{s['unavailable_median_s']:.2f}", f"{s['unavailable_max_s']:.2f}",
                      "-" if s["recovery_median_s"] is None else f"{s['recovery_median_s']:.2f}",
                      "-" if s["recovery_max_s"] is None else f"{s['recovery_max_s']:.2f}")
        console.print(u)
    for c in result.checks:
        colour = "green" if c.valid else "red"
        known = f" [yellow](known bug {result.known[c.name]}: jepsen_like/README.md)[/]" if c.name in result.known else ""
        console.print(f"[{colour}]{c.status}[/] {c.name}: {c.summary}{known}")
        for o in c.offending[:3]:
            console.print(f"      {str(o)[:400]}")
    for e in result.errors:
        console.print(f"[red]ERROR[/] {e}")
    console.print(f"results: {result.directory}/results.json   timeline: {result.directory}/timeline.html")
    console.print("[green]VALID[/]" if result.valid else "[red]INVALID[/]")


def _run(directory: Path, schedule: Schedule, options: RunOptions) -> RunResult:
    stop = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set())   # Ctrl-C: finish early, still check
    try:
        console.print(f"seed {schedule.seed}  nodes {schedule.nodes}  clients {schedule.clients}  "
                      f"jobs {', '.join(options.clients.jobs)}  "
                      + (f"kv clients {options.clients.kv_clients}  " if options.clients.kv_clients else "")
                      + f"time limit {schedule.time_limit_s:g}s  backend {options.backend}  -> {directory}")
        console.print(f"schedule: {len(schedule.ops)} actions: "
                      + ", ".join(op.f for op in schedule.ops if op.f != "recover"))
        return run_schedule(directory, schedule, options, RichPrinter(), should_stop=stop.is_set)
    finally:
        signal.signal(signal.SIGINT, previous)


@click.group()
def main() -> None:
    """Fault injection for lighthouse-cluster, in the spirit of Jepsen."""


@main.command()
@click.option("--time-limit", type=float, default=60.0, show_default=True, help="seconds of faults and traffic")
@click.option("--nodes", type=click.Choice(["3", "5"]), default="3", show_default=True)
@click.option("--jobs", type=click.IntRange(1, 16), default=3, show_default=True,
              help="jobs the clients belong to, round-robin: the default job and job-1, job-2, ... (created "
                   "through the admin API when the run starts); every checker runs per job")
@click.option("--clients", type=click.IntRange(1), default=None,
              help="simulated replica groups (default: 2 per job, 4 with one job)")
@click.option("--kv-clients", type=click.IntRange(0, 32), default=0, show_default=True,
              help="key-value clients racing compare-and-set increments of one register in the rendezvous "
                   "store (checked by kv-cas-linearizable)")
@click.option("--nemesis", "nemeses", multiple=True,
              help=f"comma-separated faults (default all but clock, kill-client and the power losses; "
                   f"'all,kill-client' adds client kills to the default set): {', '.join(ALL_FAULTS)}")
@click.option("--seed", type=int, default=None, help="random seed (default: random, printed)")
@click.option("--backend", type=click.Choice(["auto", *BACKENDS]), default="auto", show_default=True,
              help="network faults: netns (root), proxy, none")
@click.option("--fault-seconds", type=(float, float), default=(2.0, 6.0), show_default=True,
              help="how long each fault is held (min max)")
@click.option("--quiet-seconds", type=(float, float), default=(3.0, 5.0), show_default=True,
              help="healthy time after each fault (min max)")
@click.option("--recovery-bound", type=float, default=checkers.DEFAULT_RECOVERY_BOUND_S, show_default=True,
              help="seconds within which every client must get a quorum after a heal")
@click.option("--survivor-wait-bound", type=float, default=None,
              help="seconds within which every surviving client must get a quorum without a killed one "
                   "(default: the nodes' heartbeat timeout + join timeout + 2 s)")
@click.option("--unsafe-no-fsync", is_flag=True,
              help="run the nodes with --unsafe-no-fsync (to see what lose-power faults find when nothing syncs)")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="run directory")
def run(time_limit: float, nodes: str, jobs: int, clients: int | None, kv_clients: int, nemeses: tuple[str, ...], seed: int | None,
        backend: str,
        fault_seconds: tuple[float, float], quiet_seconds: tuple[float, float], recovery_bound: float,
        survivor_wait_bound: float | None, unsafe_no_fsync: bool, out: Path | None) -> None:
    """Start a cluster, inject faults while clients run, check the history."""
    seed = seed if seed is not None else random.randrange(2**31)
    if clients is None:
        clients = 4 if jobs == 1 else 2 * jobs
    chosen = _parse_nemeses(nemeses)
    if backend == "none":
        network_faults = [n for n in chosen if n in NETWORK_FAULTS]
        if nemeses and network_faults:
            raise click.BadParameter(f"--backend none injects no network faults; drop {network_faults}")
        chosen = [n for n in chosen if n not in NETWORK_FAULTS]
    try:
        schedule = generate(seed, nodes=int(nodes), time_limit_s=time_limit, nemeses=chosen,
                            clients=clients, fault_s=fault_seconds, quiet_s=quiet_seconds, name="run")
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    options = RunOptions(backend=backend, recovery_bound_s=recovery_bound,
                         cluster=ClusterSettings(nodes=int(nodes), unsafe_no_fsync=unsafe_no_fsync),
                         clients=ClientSettings(clients=clients, jobs=job_names(jobs), kv_clients=kv_clients),
                         survivor_wait_bound_s=survivor_wait_bound)
    try:
        result = _run(_out_dir(out, seed), schedule, options)
    except BackendUnavailable as e:
        raise click.ClickException(str(e)) from None
    report(result)
    sys.exit(0 if result.valid else 1)


@main.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--recovery-bound", type=float, default=None, help="override the run's recovery bound")
@click.option("--survivor-wait-bound", type=float, default=None, help="override the run's survivor-wait bound")
def check(directory: Path, recovery_bound: float | None, survivor_wait_bound: float | None) -> None:
    """Re-check a stored run; exit status 1 when any checker fails."""
    result = check_directory(directory, recovery_bound, survivor_wait_bound)
    report(result)
    sys.exit(0 if all(c.valid for c in result.checks) else 1)


@main.command()
@click.argument("source", type=click.Path(exists=True, path_type=Path))
@click.option("--backend", type=click.Choice(["auto", *BACKENDS]), default=None,
              help="default: the one the schedule was recorded with")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="run directory")
def replay(source: Path, backend: str | None, out: Path | None) -> None:
    """Run a stored schedule again (a run directory or a schedule.json)."""
    schedule = load_schedule(source)
    options = RunOptions.from_json(schedule.settings, backend=backend)
    try:
        result = _run(_out_dir(out, schedule.seed, "-replay"), schedule, options)
    except BackendUnavailable as e:
        raise click.ClickException(str(e)) from None
    report(result)
    sys.exit(0 if result.valid else 1)


if __name__ == "__main__":  # pragma: no cover
    main()
