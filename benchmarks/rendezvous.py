"""Time to rendezvous N torchrun agents on each backend, side by side (issue 34).

``python -m benchmarks rendezvous --agents 2,8,32 --trials 3`` runs, for each N and trial, N
simulated agents (``rendezvous_agent.py``: a handler and its ``next_rendezvous()``, no workers)
on each backend, interleaved (N, trial, then every backend) so the host's load drifts over all of
them alike:

* **c10d**: torch's TCPStore backend as ``torchrun --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT``
  gives it: the agent that binds the endpoint first hosts the store (``is_host`` inferred from the
  address), a fresh port per trial;
* **etcd**: torch's ``etcd-v2`` backend (the same dynamic rendezvous on etcd's v2 API through
  ``python-etcd``) on one local etcd member (``etcd_server.py``; production runs three);
* **lighthouse**: the ``torchrun.handlers`` entry point ``lighthouse`` on a local 3-node cluster
  (``LocalCluster``), its endpoint the nodes' client addresses, comma-separated.

Every backend gets the same rendezvous conf (``RDZV_CONF``) and min_nodes == max_nodes == N, so a
rendezvous completes when the N-th agent joined. The agents come from a forkserver that imported
torch once, so starting 32 of them costs no 32 torch imports; each imports the rendezvous registry
(as torchrun does, entry points included) and waits; at the common start each creates its handler
and calls ``next_rendezvous()``. Per trial: the time from the start to the *last* agent's return
(what the user waits for), the median agent's, and the CPU of the rendezvous (every agent's process
from the start to its return, plus the server processes over the trial: etcd, the cluster's
nodes; c10d's store lives in an agent). A trial is valid when the N agents got ranks 0..N-1 of a
world of N. A backend that is not installed is a column saying so; the run goes on.

The handler's creation (whatever the backend imports then, and its first connection) is inside
the window, as it is before torchrun's first rendezvous; the median agent's is a table of its own.

Results: a table on stdout, ``<out>/<name>.json`` (every trial) and ``<name>.md`` (both tables,
the fixed waits of torch's handler, the host's load).
"""

from __future__ import annotations

import datetime as dt
import json
import multiprocessing as mp
import queue
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import click

from .procs import cpu_seconds, free_port, load_snapshot, machine_info
from .rendezvous_agent import AgentSpec, run_agent

BACKENDS = ("c10d", "etcd", "lighthouse")
# The backend name torchrun's registry knows each column by.
TORCH_NAMES = {"c10d": "c10d", "etcd": "etcd-v2", "lighthouse": "lighthouse"}
# Rendezvous conf for every backend (torch reads these as whole seconds). join_timeout bounds a
# trial; last_call_timeout applies only while min_nodes <= joined < max_nodes, which never holds
# for long here (min == max); close_timeout bounds a shutdown nobody calls here.
RDZV_CONF: dict[str, Any] = {"join_timeout": 60, "last_call_timeout": 1, "close_timeout": 10}
# How long the agents of one trial may take to be ready (the forkserver's first torch import
# included, on a loaded 2-core host), and past join_timeout to report.
READY_TIMEOUT_S = 120.0
REPORT_GRACE_S = 30.0
EXIT_TIMEOUT_S = 10.0
# What the forkserver imports once for every agent: torch and torch.distributed, what every
# torchrun agent has imported before it creates its handler. Not the rendezvous package: importing
# it loads every entry point, and an agent forked from a process that imported gRPC is not what
# torchrun runs. Whatever a backend imports to create its handler is in its measured window.
FORKSERVER_PRELOAD = ("torch.distributed",)
CLUSTER_START_TIMEOUT_S = 60.0
# What torch 2.13's DynamicRendezvousHandler (dynamic_rendezvous.py; c10d's and etcd-v2's handler,
# and the one the lighthouse entry point returns, as the agents report) waits on purpose.
FIXED_WAITS = (
    "first round: every agent sleeps a random 0-0.3 s before joining (`_delay(seconds=(0, 0.3))` in "
    "`next_rendezvous`)",
    "an agent that joined before the last one polls the backend once per second (`_Action.SYNC` -> "
    "`_delay(seconds=1)`): it sees the rendezvous complete up to 1 s after the last agent joined",
    "after the join, rank 0 writes the workers' master address and port to the store "
    "(`RendezvousStoreInfo.build`) and every other rank waits to read them: no agent returns before "
    "rank 0 (ranks go by sorted address and pid, so rank 0 is most often not the last joiner but one "
    "in its 1 s poll)",
    "`last_call_timeout` (default 30 s) runs only from min_nodes joined until max_nodes joined: none "
    "here (min == max, the N-th joiner completes the rendezvous at once)",
    "keep-alive heartbeats every `keep_alive_interval` (5 s) start after the rendezvous: not on the path",
)


# -- the pure part: one trial's and one cell's figures -----------------------------------------------


def summarize_trial(t0: float, reports: list[dict[str, Any]], nodes: int) -> dict[str, Any]:
    """One trial's figures from its agents' reports (times on the host's monotonic clock, ``t0``
    the common start): ``last_s`` (start -> the last agent returned), ``median_s`` (the median
    agent), ``created_median_s`` (start -> handler created), ``start_skew_s`` (the latest agent's
    wake-up after the start), ``agents_cpu_s``; ``error`` when an agent failed or is missing, or
    the ranks are not 0..N-1 of a world of N."""
    # Distinct errors, the earliest first: the first agent to fail is the likeliest cause (an agent
    # hosting c10d's store that gives up takes the store with it, and the others fail after it).
    failed = sorted((r for r in reports if "error" in r), key=lambda r: r.get("after_s", 0.0))
    errors = list(dict.fromkeys(r["error"] for r in failed))
    done = [r for r in reports if "done" in r]
    out: dict[str, Any] = {"agents": nodes, "returned": len(done)}
    if done:
        ends = [r["done"] - t0 for r in done]
        out.update({"last_s": round(max(ends), 4), "median_s": round(statistics.median(ends), 4),
                    "created_median_s": round(statistics.median(r["created"] - t0 for r in done), 4),
                    "start_skew_s": round(max(r["started"] - t0 for r in done), 4),
                    "agents_cpu_s": round(sum(r["cpu_s"] for r in done), 4),
                    "handlers": sorted({r.get("handler", "?") for r in done})})
    if not errors and len(done) < nodes:
        errors.append(f"{nodes - len(done)} of {nodes} agents did not report")
    if not errors:
        ranks = sorted(r["rank"] for r in done)
        sizes = {r["world_size"] for r in done}
        if ranks != list(range(nodes)) or sizes != {nodes}:
            errors.append(f"ranks {ranks} in worlds of {sorted(sizes)}, expected 0..{nodes - 1} of {nodes}")
    if errors:
        out["error"] = "; ".join(errors)
    return out


def summarize_cell(trials: list[dict[str, Any]]) -> dict[str, Any]:
    """One (N, backend) cell over its trials: median and max of the last agent's time, the median
    of the median agent's and of its handler creation's, the median CPU (agents + server); only
    valid trials count."""
    ok = [t for t in trials if "error" not in t]
    out: dict[str, Any] = {"trials": len(trials), "valid": len(ok)}
    if ok:
        last = [t["last_s"] for t in ok]
        out.update({"last_median_s": round(statistics.median(last), 3), "last_max_s": round(max(last), 3),
                    "agent_median_s": round(statistics.median(t["median_s"] for t in ok), 3),
                    "created_median_s": round(statistics.median(t["created_median_s"] for t in ok), 3),
                    "cpu_median_s": round(statistics.median(t["agents_cpu_s"] + t.get("server_cpu_s", 0.0)
                                                            for t in ok), 3)})
    errors = [t["error"] for t in trials if "error" in t]
    if errors:
        out["errors"] = errors
    return out


def cell_text(cell: dict[str, Any] | None, missing: str | None) -> str:
    """A table cell: ``median / max s (agent X s), CPU Y s``, or why there is none."""
    if missing:
        return missing
    if cell is None:
        return "-"
    if not cell["valid"]:
        return "failed: " + cell["errors"][0][:80]
    text = (f"{cell['last_median_s']:.2f} / {cell['last_max_s']:.2f} s (agent {cell['agent_median_s']:.2f} s), "
            f"CPU {cell['cpu_median_s']:.2f} s")
    if cell["valid"] < cell["trials"]:
        text += f"; {cell['trials'] - cell['valid']} of {cell['trials']} trials failed"
    return text


def table(res: dict[str, Any], figure: Callable[[dict[str, Any] | None, str | None], str] = cell_text) -> list[str]:
    """The side-by-side markdown table: a row per N, a column per backend, ``figure`` in each cell."""
    names = [b["name"] for b in res["backends"]]
    rows = ["| agents | " + " | ".join(f"{n} ({TORCH_NAMES[n]})" if TORCH_NAMES[n] != n else n for n in names) + " |",
            "|---|" + "---|" * len(names)]
    for n in res["config"]["agents"]:
        cells = [figure(res["cells"].get(f"{n}/{b['name']}"), b.get("missing")) for b in res["backends"]]
        rows.append(f"| {n} | " + " | ".join(cells) + " |")
    return rows


def creation_text(cell: dict[str, Any] | None, missing: str | None) -> str:
    """A cell of the second table: the median agent's handler creation, imports included."""
    if missing or cell is None or not cell["valid"] or "created_median_s" not in cell:
        return "-"
    return f"{cell['created_median_s']:.2f} s"


# -- the servers each backend needs ----------------------------------------------------------------


def lighthouse_missing() -> str | None:
    from importlib.metadata import entry_points

    if not any(ep.name == "lighthouse" for ep in entry_points(group="torchrun.handlers")):
        return "backend not installed (no `lighthouse` entry point in `torchrun.handlers`)"
    return None


def torch_missing() -> str | None:
    import importlib.util

    return None if importlib.util.find_spec("torch") else "torch not installed (pip install -e '.[bench]')"


def backend_missing(name: str) -> str | None:
    """Why a backend's column cannot run here (a one-line reason), or None."""
    from .etcd_server import etcd_missing

    return torch_missing() or {"c10d": lambda: None, "etcd": etcd_missing, "lighthouse": lighthouse_missing}[name]()


@dataclass
class Server:
    """What one backend's trials run against: its endpoint per trial and its server processes."""

    name: str
    endpoint: Callable[[], str]
    pids: Callable[[], list[int]] = lambda: []
    stop: Callable[[], None] = lambda: None
    detail: dict[str, Any] = field(default_factory=dict)


def start_server(name: str, workdir: Path) -> Server:
    """Start what ``name`` needs (nothing for c10d: an agent hosts its store)."""
    if name == "c10d":
        return Server(name, endpoint=lambda: f"127.0.0.1:{free_port()}", detail={"store": "hosted by an agent"})
    if name == "etcd":
        from .etcd_server import LocalEtcd

        etcd = LocalEtcd(workdir / "etcd")
        took = etcd.start()
        return Server(name, endpoint=lambda: etcd.endpoint, pids=lambda: [etcd.pid], stop=etcd.kill,
                      detail={"members": 1, "started_s": round(took, 2), "version": etcd_version()})
    from lighthouse_cluster.local.cluster import LocalCluster

    cluster = LocalCluster(root=workdir / "lighthouse", nodes=3)
    try:
        cluster.start()
        cluster.wait_for_stable_leader(timeout=CLUSTER_START_TIMEOUT_S)
    except BaseException:
        cluster.stop_all()
        raise
    endpoint = ",".join(cluster.client_addresses)
    return Server(name, endpoint=lambda: endpoint,
                  pids=lambda: [m.process.pid for m in cluster.members if m.process is not None],
                  stop=cluster.stop_all, detail={"nodes": 3})


def etcd_version() -> str | None:
    import subprocess

    try:
        out = subprocess.run(["etcd", "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("etcd Version")), None)


# -- one trial -------------------------------------------------------------------------------------


def _server_cpu(pids: list[int]) -> float:
    return sum(cpu_seconds(p, with_children=True) or 0.0 for p in pids)


def run_trial(ctx: Any, backend: str, server: Server, nodes: int, run_id: str,
              log_dir: Path | None = None) -> dict[str, Any]:
    """N agents on ``server``; the trial's figures (``summarize_trial``) plus the server's CPU.
    Never raises for the trial's own failures: they are its ``error``. The agents' output goes to
    ``log_dir/<run_id>-<index>.log`` when given."""
    spec = AgentSpec(backend=TORCH_NAMES[backend], endpoint=server.endpoint(), run_id=run_id, nodes=nodes,
                     conf=dict(RDZV_CONF), start_timeout_s=READY_TIMEOUT_S + 10,
                     finish_timeout_s=RDZV_CONF["join_timeout"] + REPORT_GRACE_S + 10,
                     log_dir=None if log_dir is None else str(log_dir))
    results, start, finish = ctx.Queue(), ctx.Event(), ctx.Event()
    procs = [ctx.Process(target=run_agent, args=(i, spec, results, start, finish), daemon=True,
                         name=f"rdzv-agent-{i}") for i in range(nodes)]
    reports: list[dict[str, Any]] = []
    started: list[Any] = []
    try:
        for p in procs:
            p.start()
            started.append(p)
        ready, deadline = 0, time.monotonic() + READY_TIMEOUT_S
        while ready < nodes:
            msg = _get(results, deadline)
            if msg is None:
                return {"agents": nodes, "error": f"{ready} of {nodes} agents ready within {READY_TIMEOUT_S:g} s"}
            if "error" in msg:
                return {"agents": nodes, "error": f"agent {msg['index']} before the start: {msg['error']}"}
            ready += 1
        cpu0 = _server_cpu(server.pids())
        t0 = time.monotonic()
        start.set()
        deadline = t0 + RDZV_CONF["join_timeout"] + REPORT_GRACE_S
        while len(reports) < nodes:
            msg = _get(results, deadline)
            if msg is None:
                break
            reports.append(msg)
        server_cpu = _server_cpu(server.pids()) - cpu0
    finally:
        finish.set()
        for p in started:
            p.join(timeout=max(0.1, EXIT_TIMEOUT_S / max(1, nodes)))
        for p in started:
            if p.is_alive():
                p.kill()
                p.join(timeout=EXIT_TIMEOUT_S)
        results.close()
    out = summarize_trial(t0, reports, nodes)
    out["server_cpu_s"] = round(server_cpu, 4)
    return out


def _get(q: Any, deadline: float) -> dict[str, Any] | None:
    try:
        return q.get(timeout=max(0.01, deadline - time.monotonic()))
    except queue.Empty:
        return None


# -- the run ---------------------------------------------------------------------------------------


def agent_context() -> Any:
    """The agents' process context: a forkserver that imports torch once (children
    start in milliseconds and inherit nothing of this process: no gRPC channel, no thread). It is
    started now, so that its torch import overlaps the servers' start."""
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    forkserver.ensure_running()
    return ctx


def run_rendezvous(agents: list[int], trials: int, backends: list[str], workdir: Path,
                   command: str = "") -> dict[str, Any]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console()
    started = time.time()
    res: dict[str, Any] = {
        "schema": 1, "command": command,
        "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(), "load_start": load_snapshot(),
        "config": {"agents": agents, "trials": trials, "rdzv_conf": RDZV_CONF, "min_nodes_equals_max_nodes": True,
                   "agent_start": f"multiprocessing forkserver, preloaded {', '.join(FORKSERVER_PRELOAD)}"},
        "fixed_waits": list(FIXED_WAITS), "backends": [], "trials": [], "cells": {}, "errors": [],
    }
    servers: dict[str, Server] = {}
    agent_logs = workdir / "agents"
    agent_logs.mkdir(parents=True, exist_ok=True)
    try:
        ctx = agent_context()
        for name in backends:
            entry: dict[str, Any] = {"name": name, "torch_backend": TORCH_NAMES[name]}
            missing = backend_missing(name)
            if missing is None:
                console.print(f"[bold]{name}[/]: starting its server")
                try:
                    servers[name] = start_server(name, workdir)
                    entry.update(servers[name].detail)
                except Exception as e:  # noqa: BLE001 -- that column's error; the others still run
                    entry["error"] = f"server did not start: {type(e).__name__}: {e}"[:500]
                    res["errors"].append(f"{name}: {entry['error']}")
            else:
                entry["missing"] = missing
                console.print(f"[bold]{name}[/]: {missing}; its column says so")
            res["backends"].append(entry)
        total = len(agents) * trials * len(servers)
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=False) as progress:
            task = progress.add_task("rendezvous", total=total)
            for n in agents:
                for k in range(trials):
                    for name, server in servers.items():
                        progress.update(task, description=f"N={n} trial {k + 1}/{trials} {name}")
                        trial = run_trial(ctx, name, server, n, f"bench-{name}-{n}-{k}-{uuid.uuid4().hex[:8]}",
                                          log_dir=agent_logs)
                        trial.update({"backend": name, "trial": k})
                        res["trials"].append(trial)
                        line = (f"error: {trial['error']}" if "error" in trial else
                                f"last {trial['last_s']:.3f} s, median agent {trial['median_s']:.3f} s, CPU "
                                f"{trial['agents_cpu_s'] + trial['server_cpu_s']:.2f} s")
                        progress.console.print(f"  N={n:<3} {name:<10} trial {k + 1}: {line}")
                        progress.advance(task)
    finally:
        for server in servers.values():
            server.stop()
    for n in agents:
        for name in servers:
            cell = summarize_cell([t for t in res["trials"] if t["agents"] == n and t["backend"] == name])
            res["cells"][f"{n}/{name}"] = cell
            res["errors"] += [f"{name} N={n}: {e}" for e in cell.get("errors", [])]
    for entry in res["backends"]:
        if "error" in entry:
            entry["missing"] = entry["error"]
        entry["handlers"] = sorted({h for t in res["trials"] if t["backend"] == entry["name"]
                                    for h in t.get("handlers", [])})
    res["load_end"] = load_snapshot()
    res["duration_s"] = round(time.time() - started, 1)
    return res


def markdown(res: dict[str, Any]) -> str:
    load = res["load_start"].get("loadavg", ["?"])[0], res["load_end"].get("loadavg", ["?"])[0]
    psi = [r.get("cpu_pressure_some", {}).get("avg60") for r in (res["load_start"], res["load_end"])]
    pressure = f", CPU pressure {psi[0]:.0f} % and {psi[1]:.0f} %" if None not in psi else ""
    conf = ", ".join(f"`{k}={v}`" for k, v in res["config"]["rdzv_conf"].items())
    lines = [f"# Rendezvous: time to rendezvous N agents, {res['started'][:16].replace('T', ' ')} UTC", "",
             f"`{res['command'] or 'python -m benchmarks rendezvous'}`: {res['config']['trials']} trials per N and "
             f"backend, interleaved; N simulated agents (a handler and `next_rendezvous()`, no workers) started "
             f"together; min_nodes = max_nodes = N; rendezvous conf {conf} for every backend. Each cell: the "
             f"time from the common start until the last agent returned (what the user waits for), median / max "
             f"over the trials; the median agent's (median over trials); the rendezvous's CPU (every agent from "
             f"the start to its return, plus the server processes: etcd, the cluster's nodes), median over "
             f"trials. etcd is one local member (production runs 3); the lighthouse cluster has 3 nodes. "
             f"On {res['machine'].get('cpus', '?')} CPUs shared with other work: load average {load[0]} at "
             f"the start, {load[1]} at the end{pressure} (PSI some, avg60). All N agents share the host's CPUs, "
             f"where torchrun would give each its own: at large N the figures say as much about the CPU the "
             f"rendezvous burns as about its latency.", "", *table(res), "",
             "Of that, creating the handler (`get_rendezvous_handler`, with whatever the backend imports "
             "then and its first connection), median agent, median over trials; N agents import at once on "
             "the host's cores:", "", *table(res, creation_text), "",
             "Handlers the agents got: " + "; ".join(f"{', '.join(names)}: `{h}`"
                                                     for h, names in _by_handler(res).items()) + ".", "",
             "Fixed waits in torch's `DynamicRendezvousHandler` (dynamic_rendezvous.py):", ""]
    lines += [f"- {w}" for w in res["fixed_waits"]]
    if res["errors"]:
        lines += ["", f"Errors ({len(res['errors'])}):", ""] + [f"- {e[:300]}" for e in res["errors"]]
    return "\n".join(lines) + "\n"


def _by_handler(res: dict[str, Any]) -> dict[str, list[str]]:
    """Handler class -> the backends whose agents got it."""
    out: dict[str, list[str]] = {}
    for b in res["backends"]:
        for h in b.get("handlers", []):
            out.setdefault(h, []).append(b["name"])
    return out


def write_outputs(res: dict[str, Any], out_dir: Path, name: str) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{name}.json", "md": out_dir / f"{name}.md"}
    paths["json"].write_text(json.dumps(res, indent=1) + "\n")
    paths["md"].write_text(markdown(res))
    return paths


def _ints(value: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}", param_hint=what) from None
    if not out or any(x < 1 for x in out):
        raise click.BadParameter(f"expected agent counts of at least 1, got {value!r}", param_hint=what)
    return out


@click.command("rendezvous")
@click.option("--agents", default="2,8,32", show_default=True, help="Comma-separated agent counts N.")
@click.option("--trials", type=click.IntRange(min=1), default=3, show_default=True, help="Trials per N and backend.")
@click.option("--backends", default=",".join(BACKENDS), show_default=True,
              help="Comma-separated subset of the backends (c10d, etcd, lighthouse).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("benchmarks"),
              show_default=True, help="Where <name>.json and <name>.md go.")
@click.option("--name", default="bench-rendezvous", show_default=True, help="Output file stem.")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path),
              help="Keep the agents' logs and etcd's and the cluster's data and logs here (default: a "
                   "temporary directory, removed afterwards).")
def command(agents: str, trials: int, backends: str, out_dir: Path, name: str, workdir: Path | None) -> None:
    """Time to rendezvous N agents with c10d, etcd and the lighthouse (benchmarks/README.md)."""
    ns = _ints(agents, "--agents")
    chosen = [b.strip() for b in backends.split(",") if b.strip()]
    unknown = [b for b in chosen if b not in BACKENDS]
    if unknown or not chosen:
        raise click.BadParameter(f"unknown backends {unknown}; known: {', '.join(BACKENDS)}", param_hint="--backends")
    wd = workdir or Path(tempfile.mkdtemp(prefix="bench-rendezvous-"))
    try:
        res = run_rendezvous(ns, trials, chosen, wd.resolve(),
                             command=" ".join(["python -m benchmarks", *sys.argv[1:]]))
    finally:
        if workdir is None:
            shutil.rmtree(wd, ignore_errors=True)
    paths = write_outputs(res, out_dir, name)
    click.echo("")
    click.echo("\n".join(table(res)))
    click.echo(f"\nwrote {paths['json']} and {paths['md']} ({res['duration_s']} s)")
    if res["errors"]:
        click.echo("error: " + "; ".join(res["errors"])[:2000], err=True)
        sys.exit(1)
