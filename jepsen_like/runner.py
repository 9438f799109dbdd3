"""A run: cluster + clients + monitor + nemesis, then the final state, the checks and the report.

``Session`` is one run as a context manager: ``start()`` brings up the network, the nodes, the
run's jobs (``ClientSettings.jobs`` other than the default one, added through the admin API), the
monitor and the clients; ``apply(op)`` injects a fault now; ``finish()`` recovers the cluster,
waits for every client to get a quorum, stops the clients, waits for the nodes to converge,
stops them, replays every node's committed log into the history (``final-state`` events), runs
every checker and writes the run directory:

    history.jsonl   the history (one event per line)
    schedule.json   settings + every nemesis action with its offset: ``replay`` runs it again
    results.json    checks, operation counts, unavailability per fault
    timeline.html   self-contained timeline
    cluster/        node logs (n1.log ...) and data directories (Raft journals)

Whatever fails, every node process and namespace is removed (``close()`` in ``__exit__``).
``run_schedule`` drives a ``Session`` through a ``Schedule`` in real time; the property tests
drive one rule by rule.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import checkers, known_bugs, stats, timeline
from .checkers import CheckResult
from .cluster import ClusterSettings, HarnessCluster
from .clients import ClientPool, ClientSettings, ProcessClientPool, make_pool
from lighthouse_cluster.core.jobs import DEFAULT_JOB

from .history import INFO, JOURNAL, MONITOR, OK, Event, HistoryWriter, read_history
from .kv_clients import KV_FS, KVClientPool, final_read
from .journal import parse_journal, read_meta_commit_index, summarize
from .monitor import Monitor
from .nemesis import Nemesis
from .schedule import FaultOp, Schedule, uses_client_faults, uses_power_faults

WARMUP_TIMEOUT_S = 20.0
CONVERGE_TIMEOUT_S = 15.0


@dataclass
class RunOptions:
    backend: str = "auto"
    recovery_bound_s: float = checkers.DEFAULT_RECOVERY_BOUND_S
    cluster: ClusterSettings = field(default_factory=ClusterSettings)
    clients: ClientSettings = field(default_factory=ClientSettings)
    # None: the nodes' heartbeat timeout + join timeout + 2 s (checkers.survivor_wait_bound)
    survivor_wait_bound_s: float | None = None

    @property
    def survivor_bound_s(self) -> float:
        """The bound ``survivor-wait`` checks against."""
        if self.survivor_wait_bound_s is not None:
            return self.survivor_wait_bound_s
        return checkers.survivor_wait_bound(self.cluster.heartbeat_timeout_ms, self.cluster.join_timeout_ms)

    def to_json(self) -> dict[str, Any]:
        return {"backend": self.backend, "recovery_bound_s": self.recovery_bound_s,
                "survivor_wait_bound_s": self.survivor_wait_bound_s,
                "cluster": asdict(self.cluster), "clients": asdict(self.clients)}

    @classmethod
    def from_json(cls, d: dict[str, Any], backend: str | None = None) -> "RunOptions":
        cs = d.get("clients", {})
        sw = d.get("survivor_wait_bound_s")
        return cls(backend=backend or d.get("backend", "auto"),
                   recovery_bound_s=float(d.get("recovery_bound_s", checkers.DEFAULT_RECOVERY_BOUND_S)),
                   cluster=ClusterSettings.from_json(d.get("cluster", {})),
                   clients=ClientSettings(**{k: v for k, v in cs.items() if k in ClientSettings.__dataclass_fields__}),
                   survivor_wait_bound_s=None if sw is None else float(sw))


@dataclass
class RunResult:
    directory: Path
    checks: list[CheckResult]
    counts: dict[str, Any]
    windows: list[dict[str, Any]]
    by_kind: dict[str, dict[str, Any]]
    errors: list[str] = field(default_factory=list)
    known: dict[str, str] = field(default_factory=dict)     # failed check -> known bug explaining it

    @property
    def valid(self) -> bool:
        return all(c.valid for c in self.checks) and not self.errors

    @property
    def valid_but_known_bugs(self) -> bool:
        """Valid except for failures that a known, still open bug explains (see known_bugs)."""
        return all(c.valid or c.name in self.known for c in self.checks) and not self.errors


class Printer:
    """Where a run reports progress; the CLI uses rich, tests stay quiet."""

    def line(self, text: str) -> None:
        pass


class Session:
    def __init__(self, directory: Path, schedule: Schedule, options: RunOptions,
                 printer: Printer | None = None) -> None:
        self.dir = Path(directory)
        self.schedule = schedule
        self.options = options
        self.printer = printer or Printer()
        self.cluster: HarnessCluster | None = None
        self.history: HistoryWriter | None = None
        self.monitor: Monitor | None = None
        self.clients: ClientPool | ProcessClientPool | None = None
        self.kv_clients: KVClientPool | None = None
        self.nemesis: Nemesis | None = None
        self.t_clients = 0.0
        self.executed: list[FaultOp] = []
        self.errors: list[str] = []
        self.result: RunResult | None = None

    # -- lifecycle ---------------------------------------------------------------------------------

    def __enter__(self) -> "Session":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self.history is not None:
            self.history.close()

    def start(self) -> "Session":
        self.dir.mkdir(parents=True, exist_ok=True)
        self.options.cluster.nodes = self.schedule.nodes
        self.options.clients.clients = self.schedule.clients
        if self.options.clients.processes is None:
            # Client faults need real processes to kill; otherwise the cheaper in-process pool.
            self.options.clients.processes = uses_client_faults(self.schedule)
        self.schedule.settings = self.options.to_json()
        self._save_schedule(self.schedule.ops)
        wants_clock = any(op.f == "clock" for op in self.schedule.ops) or "clock" in self.schedule.nemeses
        try:
            self.history = HistoryWriter(self.dir / "history.jsonl")
            self.cluster = HarnessCluster(self.dir, self.options.cluster, backend=self.options.backend,
                                          clock=wants_clock, power=uses_power_faults(self.schedule)).start()
            if self.options.cluster.unsafe_no_fsync:
                self.printer.line("[yellow]the nodes run with --unsafe-no-fsync: a power loss may lose what they "
                                  "acknowledged[/]")
            if self.cluster.clock_error:
                self.printer.line(f"[yellow]clock skew unavailable: {self.cluster.clock_error}[/]")
            self._add_jobs()
            self.nemesis = Nemesis(self.cluster, self.history, on_event=self._print_nemesis)
            self.monitor = Monitor(self.cluster, self.history).start()
            c = self.cluster.cluster
            self.clients = make_pool(c.client_addresses, [self.cluster.node_id(i) for i in range(c.nodes)],
                                     self.history, self.options.clients, bool(self.options.clients.processes),
                                     log_dir=self.dir / "clients").start()
            self.nemesis.clients = self.clients
            if self.options.clients.kv_clients > 0:
                self.kv_clients = KVClientPool(c.client_addresses, [self.cluster.node_id(i) for i in range(c.nodes)],
                                               self.history, self.options.clients.kv_clients,
                                               job=self.options.clients.kv_job,
                                               timeout_s=self.options.clients.kv_timeout_s,
                                               seed=self.schedule.seed or 0).start()
            self.t_clients = time.monotonic()
            self._wait_clients_ok(since_ns=0, timeout=WARMUP_TIMEOUT_S, what="warm-up")
            self._wait_kv_ok(timeout=WARMUP_TIMEOUT_S)
        except BaseException:
            self.close()
            if self.history is not None:
                self.history.close()
            raise
        return self

    def _add_jobs(self) -> None:
        """Create the run's jobs other than the default one (the clients' ``jobs``) through the
        admin API, each recorded as a ``monitor`` ``add-job`` event naming the job."""
        assert self.cluster is not None and self.history is not None
        for name in dict.fromkeys(self.options.clients.jobs):
            if name == DEFAULT_JOB:
                continue
            job = self.cluster.add_job(name)
            self.history.append(MONITOR, INFO, "add-job", {"version": job.version, "quorum_id": job.quorum_id},
                                job=name)
            self.printer.line(f"job {name} added (version {job.version})")

    def close(self) -> None:
        """Stop everything this session started (idempotent, never raises)."""
        for stop in (lambda: self.clients and self.clients.stop(), lambda: self.kv_clients and self.kv_clients.stop(),
                     lambda: self.monitor and self.monitor.stop()):
            try:
                stop()
            except Exception as e:
                self.errors.append(str(e))
        if self.cluster is not None:
            self.errors.extend(self.cluster.close())

    # -- driving -----------------------------------------------------------------------------------

    def elapsed(self) -> float:
        return time.monotonic() - self.t_clients

    def apply(self, op: FaultOp) -> Event:
        assert self.nemesis is not None
        self.executed.append(FaultOp(round(self.elapsed(), 3), op.f, op.args))
        return self.nemesis.apply(op)

    def wait(self, seconds: float) -> None:
        """Let the clients run against the cluster as it is for ``seconds``."""
        time.sleep(seconds)

    def check_cheap(self) -> list[CheckResult]:
        assert self.history is not None
        return checkers.check_cheap(self.history.snapshot())

    def _print_nemesis(self, e: Event) -> None:
        v = {k: val for k, val in (e.get("value") or {}).items() if val not in ([], None)}
        status = "" if e["type"] == OK else f" [red]FAILED: {e.get('error')}[/]"
        self.printer.line(f"{e['time_ns'] / 1e9:8.2f}s  nemesis {e['f']:<14} {json.dumps(v)}{status}")

    def _client_oks_since(self, since_ns: int) -> set[str]:
        assert self.history is not None
        return {e["process"] for e in self.history.snapshot() if e["f"] == "quorum" and e["type"] == OK
                and e["time_ns"] >= since_ns}

    def _wait_clients_ok(self, since_ns: int, timeout: float, what: str) -> bool:
        assert self.clients is not None
        want = set(self.clients.replica_ids)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if want <= self._client_oks_since(since_ns):
                return True
            time.sleep(0.1)
        missing = sorted(want - self._client_oks_since(since_ns))
        self.printer.line(f"[yellow]{what}: clients {missing} got no quorum within {timeout:.0f}s[/]")
        return False

    def _wait_kv_ok(self, timeout: float) -> bool:
        """Warm-up of the KV clients: each has had a call answered (the store needs its replicated
        schema enabled first, which the leader does soon after it starts)."""
        if self.kv_clients is None:
            return True
        assert self.history is not None
        want = set(self.kv_clients.names)
        deadline = time.monotonic() + timeout
        done: set[str] = set()
        while time.monotonic() < deadline:
            done = {e["process"] for e in self.history.snapshot() if e["f"] in KV_FS and e["type"] == OK}
            if want <= done:
                return True
            time.sleep(0.1)
        self.printer.line(f"[yellow]warm-up: KV clients {sorted(want - done)} got no answer within {timeout:.0f}s[/]")
        return False

    # -- the end -----------------------------------------------------------------------------------

    def finish(self) -> RunResult:
        """Recover, quiesce, collect final states, check, write the run directory."""
        assert self.cluster is not None and self.history is not None and self.monitor is not None
        history = self.history
        try:
            event = self.apply(FaultOp(0, "recover"))
            self._wait_clients_ok(since_ns=event["time_ns"], timeout=self.options.recovery_bound_s + 2.0,
                                  what="final recovery")
            time.sleep(0.5)
            assert self.clients is not None
            self.clients.stop()
            if self.kv_clients is not None:
                try:
                    self.kv_clients.stop()
                except RuntimeError as e:
                    self.errors.append(str(e))
                # The register as the healed cluster has it, once no KV client writes any more.
                final_read(self.cluster.cluster.client_addresses, history, self.options.clients.kv_job)
            statuses = self._converge()
            self.monitor.stop()
            self.monitor.poll_journals(statuses)
        except Exception as e:
            self.errors.append(f"finishing: {type(e).__name__}: {e}")
        finally:
            self.close()
        self._record_final_states()
        history.close()
        self._save_schedule(self.executed)
        self.result = write_results(self.dir, history.snapshot(), self.options.recovery_bound_s, self.errors,
                                    title=f"{self.schedule.name or 'run'} seed {self.schedule.seed}",
                                    survivor_wait_bound_s=self.options.survivor_bound_s)
        return self.result

    def _converge(self) -> list[Any]:
        """Wait until every node reports the same commit index, applied; return the statuses."""
        assert self.cluster is not None and self.history is not None
        deadline = time.monotonic() + CONVERGE_TIMEOUT_S
        sts: list[Any] = []
        while time.monotonic() < deadline:
            sts = self.cluster.statuses(timeout=1.0)
            if all(s is not None for s in sts) and len({(s.commit_index, s.last_applied) for s in sts}) == 1 \
                    and sts[0].commit_index == sts[0].last_applied:
                return sts
            time.sleep(0.1)
        self.history.append(MONITOR, INFO, "converge",
                            {"commit_index": [None if s is None else s.commit_index for s in sts]},
                            error=f"nodes did not converge on one commit index within {CONVERGE_TIMEOUT_S:.0f}s")
        self.errors.append("nodes did not converge after the final heal")
        return sts

    def _record_final_states(self) -> None:
        """Each node's committed log (tailed during the run, plus the journal after the stop)."""
        assert self.cluster is not None and self.history is not None and self.monitor is not None
        events = []
        for i, log in enumerate(self.monitor.logs):
            data_dir = self.cluster.data_dir(i)
            meta_ci = read_meta_commit_index(data_dir) or 0
            log.absorb(parse_journal(data_dir / "raft.journal"), max(meta_ci, log.commit_index))
            self.monitor.keep_snapshot(i)
            try:
                events.append((self.cluster.node_id(i), summarize(log, self.monitor.snapshots[i])))
            except Exception as e:
                self.errors.append(f"replaying {self.cluster.node_id(i)}'s journal: {e}")
        for node, summary in events:
            self.history.append(JOURNAL, INFO, "final-state", summary, node)

    def _save_schedule(self, ops: list[FaultOp]) -> None:
        s = self.schedule
        # A schedule recorded step by step (property tests) has no time limit of its own: replay
        # it up to its last action.
        limit = max([s.time_limit_s] + [op.at + 1.0 for op in ops])
        saved = Schedule(seed=s.seed, nodes=s.nodes, clients=s.clients, time_limit_s=round(limit, 3),
                         nemeses=s.nemeses, ops=list(ops), settings=s.settings, name=s.name, note=s.note,
                         expect=s.expect)
        (self.dir / "schedule.json").write_text(saved.dumps())


def write_results(directory: Path, history: list[Event], recovery_bound_s: float, errors: list[str] | None = None,
                  title: str = "run", survivor_wait_bound_s: float = checkers.DEFAULT_SURVIVOR_WAIT_BOUND_S) -> RunResult:
    checks = checkers.check_all(history, recovery_bound_s, survivor_wait_bound_s)
    counts = stats.operation_counts(history)
    windows = stats.fault_windows(history)
    by_kind = stats.unavailability_by_kind(windows)
    known = {c.name: bug for c in checks if (bug := known_bugs.explain(c, history)) is not None}
    result = RunResult(directory, checks, counts, windows, by_kind, list(errors or []), known)
    (directory / "results.json").write_text(json.dumps({
        "valid": result.valid, "errors": result.errors, "known_bugs": known,
        "checks": [c.to_json() for c in checks],
        "operations": counts, "unavailability_by_fault": by_kind, "faults": windows,
    }, indent=1, default=str) + "\n")
    (directory / "timeline.html").write_text(timeline.render(history, [c.to_json() for c in checks], title))
    return result


def run_schedule(directory: Path, schedule: Schedule, options: RunOptions, printer: Printer | None = None,
                 should_stop: Callable[[], bool] = lambda: False) -> RunResult:
    """Run ``schedule`` in real time: each action at its offset after the clients start."""
    with Session(directory, schedule, options, printer) as s:
        for op in schedule.ops:
            while s.elapsed() < op.at and not should_stop():
                # elapsed() moves on between the check and here: never a negative sleep
                time.sleep(min(0.05, max(0.0, op.at - s.elapsed())))
            if should_stop() or op.at > schedule.time_limit_s:
                break
            s.apply(op)
        while s.elapsed() < schedule.time_limit_s and not should_stop():
            time.sleep(min(0.2, max(0.0, schedule.time_limit_s - s.elapsed())))
        return s.finish()


def check_directory(directory: Path, recovery_bound_s: float | None = None,
                    survivor_wait_bound_s: float | None = None) -> RunResult:
    """Re-run every checker over a stored run (rewrites results.json and timeline.html); the
    bounds default to the run's own (its ``schedule.json`` settings)."""
    history = read_history(directory / "history.jsonl")
    try:
        recorded = RunOptions.from_json(Schedule.loads((directory / "schedule.json").read_text()).settings)
    except FileNotFoundError:
        recorded = RunOptions()
    bound = recorded.recovery_bound_s if recovery_bound_s is None else recovery_bound_s
    survivor = recorded.survivor_bound_s if survivor_wait_bound_s is None else survivor_wait_bound_s
    return write_results(directory, history, bound, title=f"check of {directory.name}",
                         survivor_wait_bound_s=survivor)


def load_schedule(path: Path) -> Schedule:
    """A schedule from a run directory or a schedule file."""
    p = path / "schedule.json" if path.is_dir() else path
    return Schedule.loads(p.read_text())
