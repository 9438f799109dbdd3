"""The training tests' harness: a lighthouse, N replica groups of trainer processes, faults, and
what the groups ended with.

``TrainingRun`` (a context manager; each training test module makes one per test in a fixture)
holds one test's run:

* the lighthouse: a real 3-node ``LocalCluster`` (``start_cluster``; ``join_timeout_ms=1000``, so
  survivors wait 1 s, not 60 s, for a dead group that is still heartbeat-healthy) or torchft's Rust
  ``torchft_lighthouse`` (``start_torchft_lighthouse``);
* the trainers: any kind of ``support.trainer_process`` (``start``; with a start barrier when the
  kind has one), killed and restarted by the test through the trainer itself;
* bounded waits (``wait_until``, ``wait_all_steps``, ``wait_finished``, ``wait_new_leader``), all
  through ``support.waiting.wait_for`` or a process wait with a deadline. A wait fails at once when
  a trainer exits non-zero (unless the test killed it), and at its deadline with the diagnostics;
* faults at the lighthouse: ``kill_while_calls_wait`` SIGKILLs the leader (or a given node) while
  Quorum calls wait at the leader for a round;
* results: ``assert_identical`` (every replica group and rank at the same final step with the same
  digests, the kind's ``DIGESTS``); ``median_duration_s`` and ``slowest_step_around`` for the
  one-line summary each test prints (``-s``).

A failure (``fail``, ``check``, a timed-out wait) carries the run's events, every trainer's output
tail and the lighthouse's logs. ``close`` kills every trainer (its whole process group), every node
and the Rust lighthouse, whatever happened.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any, Callable, Iterable, NoReturn, Sequence, TypeVar

import pytest

from lighthouse_cluster.local.cluster import LocalCluster, free_ports
from support.trainer_process import TrainerProcess
from support.waiting import wait_for

JOIN_TIMEOUT_MS = 1_000
STEPS_TIMEOUT_S = 60.0  # every trainer up (imports, manager, first quorum) and at a given step
FINISH_TIMEOUT_S = 100.0  # every trainer of a run done
BARRIER_TIMEOUT_S = 90.0  # every trainer set up, at the start barrier

T = TypeVar("T")
Trainer = TypeVar("Trainer", bound=TrainerProcess)


@dataclass(frozen=True)
class Kill:
    """A node SIGKILLed by ``kill_while_calls_wait``."""

    node: int
    leader: int  # the serving leader when the node died (``node`` itself when it was)
    term: int  # the leader's term then
    at: float  # wall clock (time.time(), as the trainers' records)
    waiting: int  # Quorum calls waiting at the leader


class TrainingRun:
    def __init__(self, root: Path, *, finish_timeout: float = FINISH_TIMEOUT_S) -> None:
        self.root = root
        self.finish_timeout = finish_timeout
        self.cluster: LocalCluster | None = None
        self.rust: subprocess.Popen[bytes] | None = None
        self.rust_log: Path | None = None
        self.trainers: list[TrainerProcess] = []
        self.events: list[str] = []
        self.t0 = time.monotonic()

    def __enter__(self) -> TrainingRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    # -- lighthouses -------------------------------------------------------------------------------

    def start_cluster(self, min_replicas: int, **kwargs: Any) -> LocalCluster:
        """A 3-node ``LocalCluster`` (``kwargs`` over the defaults) with a serving leader that every
        node follows: a start-up election can be followed by a second one (a node that came up
        late times out before it hears the first leader), and a test that picks its trainers'
        nodes by who leads must not pick them from the first."""
        options: dict[str, Any] = {"nodes": 3, "join_timeout_ms": JOIN_TIMEOUT_MS, "fork_nodes": True, **kwargs}
        self.cluster = LocalCluster(root=self.root / "cluster", min_replicas=min_replicas, **options)
        self.cluster.start()
        try:
            leader = self.cluster.wait_for_agreed_leader(timeout=30)
        except (TimeoutError, RuntimeError) as e:
            self.fail(f"the cluster agreed on no leader: {e}")
        self.note(f"cluster up, leader n{leader + 1}, endpoints {self.cluster.endpoints}")
        return self.cluster

    def start_torchft_lighthouse(self, min_replicas: int) -> str:
        """torchft's Rust ``torchft_lighthouse`` on a free port; returns its URL."""
        binary = shutil.which("torchft_lighthouse")
        if binary is None:
            pytest.skip("torchft_lighthouse is not installed (pip install -e '.[interop]')")
        port = free_ports(1)[0]
        self.rust_log = self.root / "torchft_lighthouse.log"
        with open(self.rust_log, "ab") as log:
            self.rust = subprocess.Popen([binary, "--bind", f"127.0.0.1:{port}", "--min_replicas", str(min_replicas),
                                          "--join_timeout_ms", str(JOIN_TIMEOUT_MS)],
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        rust = self.rust

        def listening() -> bool:
            with socket.socket() as s:
                s.settimeout(0.2)
                return s.connect_ex(("127.0.0.1", port)) == 0

        self.wait_until("torchft_lighthouse to listen", lambda: listening() or rust.poll() is not None, 15)
        self.check(rust.poll() is None, f"torchft_lighthouse exited with {rust.poll()}")
        self.note(f"torchft_lighthouse on 127.0.0.1:{port}")
        return f"http://127.0.0.1:{port}"

    def lighthouse_logs(self, lines: int = 20) -> str:
        parts = []
        if self.cluster is not None:
            parts.append(self.cluster.tail_logs(lines=lines))
        if self.rust_log is not None:
            try:
                text = self.rust_log.read_text(errors="replace").splitlines()[-lines:]
            except FileNotFoundError:
                text = ["(no log)"]
            parts.append("\n".join([f"--- torchft_lighthouse ({self.rust_log}) ---", *text]))
        return "\n".join(parts)

    # -- trainers ----------------------------------------------------------------------------------

    def start(self, trainers: Iterable[Trainer], *, barrier_timeout: float = BARRIER_TIMEOUT_S,
              release: bool = True) -> list[Trainer]:
        """Start ``trainers`` (each one replica group) and add them to the run. When their kind
        has a start barrier, wait until every one of them is set up, then release them together;
        with ``release=False`` they stay at the barrier until ``release_barrier`` (several jobs'
        trainers, started one job after another, then released at once)."""
        started = list(trainers)
        for t in started:
            t.start()
            self.trainers.append(t)
        if started:
            urls = {t.lighthouse for t in started}
            where = (f"TORCHFT_LIGHTHOUSE={urls.pop()}" if len(urls) == 1
                     else "TORCHFT_LIGHTHOUSE " + ", ".join(f"{t.name}={t.lighthouse}" for t in started))
            self.note(f"started {', '.join(t.name for t in started)} ({type(started[0]).__name__}), {where}")
        if release:
            self.release_barrier(barrier_timeout, started)
        return started

    def release_barrier(self, barrier_timeout: float = BARRIER_TIMEOUT_S,
                        trainers: Sequence[TrainerProcess] | None = None) -> None:
        """Wait until every trainer of ``trainers`` (default: every one started) whose start
        barrier is still held is set up, then release them together."""
        held = [t for t in (self.trainers if trainers is None else trainers)
                if t.ready_path is not None and not t.go_path.exists()]
        if not held:
            return
        self.wait_until("every trainer set up", lambda: all(t.ready_path.exists() for t in held), barrier_timeout)
        for go in {t.go_path for t in held}:
            go.touch()
        self.note("start barrier released")

    # -- events and failures -----------------------------------------------------------------------

    def note(self, event: str) -> None:
        self.events.append(f"{self.elapsed():7.2f}s {event}")

    def diagnostics(self) -> str:
        """The trainers' output tails and the lighthouse's logs, then the run's events: last, so
        that a CI log that keeps only the tail of a failure still shows what happened."""
        return "\n".join([*[t.tail() for t in self.trainers], self.lighthouse_logs(), "events:", *self.events])

    def fail(self, message: str) -> NoReturn:
        # The message first (pytest's summary line) and last (after the long diagnostics).
        pytest.fail(f"{message}\n{self.diagnostics()}\nfailed: {message}", pytrace=False)

    def check(self, condition: bool, message: str) -> None:
        if not condition:
            self.fail(message)

    # -- bounded waits -----------------------------------------------------------------------------

    def _no_trainer_failed(self, what: str) -> None:
        for t in self.trainers:
            rc = t.returncode()
            if rc not in (None, 0) and not t.killed:
                self.fail(f"trainer {t.name} exited with {rc} while waiting for {what}")

    def wait_until(self, what: str, cond: Callable[[], T], timeout: float, interval: float = 0.02) -> T:
        """``cond``'s first truthy value within ``timeout`` seconds; fails at once when a trainer
        exits non-zero (and was not killed by the test) before ``cond`` holds."""

        def probe() -> T:
            value = cond()
            if not value:
                self._no_trainer_failed(what)
            return value

        try:
            value = wait_for(what, probe, timeout, interval=interval)
        except AssertionError as e:  # with the run's diagnostics, the message first and last
            self.fail(str(e))
        self.note(what)
        return value

    def wait_all_steps(self, step: int, timeout: float = STEPS_TIMEOUT_S) -> None:
        self.wait_until(f"every trainer at step >= {step}", lambda: all(t.step() >= step for t in self.trainers),
                        timeout)

    def wait_finished(self, trainers: Sequence[TrainerProcess] | None = None,
                      timeout: float | None = None) -> list[dict[str, Any]]:
        """Every trainer (of the run, or ``trainers``) exits 0 within ``timeout`` and wrote its
        results (one per rank); returns them all, in the trainers' order."""
        trainers = list(self.trainers if trainers is None else trainers)
        timeout = self.finish_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        for t in trainers:
            assert t.process is not None, f"{t.name} was never started"
            try:
                rc = t.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.fail(f"trainer {t.name} did not finish within {timeout:.0f}s")
            self.check(rc == 0, f"trainer {t.name} exited with {rc}")
        results = []
        for t in trainers:
            for i, r in enumerate(t.results()):
                self.check(r is not None, f"trainer {t.name} wrote no result (rank {i})")
                results.append(r)
        self.note("every trainer finished")
        return results

    # -- results -----------------------------------------------------------------------------------

    def assert_identical(self, results: list[dict[str, Any]], min_step: int | None = None,
                         trainers: Sequence[TrainerProcess] | None = None) -> None:
        """Every result at the same final step (at least ``min_step``) with the same digests (the
        trainers' kind's ``DIGESTS``), whatever the replica group and rank. ``trainers``: the ones
        the results are of (default: every trainer of the run), all of one kind."""
        kinds = {type(t) for t in (self.trainers if trainers is None else trainers)}
        assert len(kinds) == 1, f"a run of several trainer kinds: {kinds}"
        keys = kinds.pop().DIGESTS
        assert keys and results
        steps = {r["final_step"] for r in results}
        self.check(len(steps) == 1, f"final steps differ: {sorted(steps)}")
        if min_step is not None:
            self.check(min(steps) >= min_step, f"final step {min(steps)} < {min_step}")
        for key in keys:
            values = {(r.get("replica_group", r.get("group")), r.get("rank", 0)): r[key][:16] for r in results}
            self.check(len(set(values.values())) == 1, f"{key} differs between replica groups/ranks: {values}")

    def assert_one_process(self, trainer: TrainerProcess, result: dict[str, Any] | None = None) -> None:
        """The trainer ran as one process from its start to its end (no restart, no crash)."""
        problems = trainer.process_problems(result)
        self.check(not problems, "\n".join(problems))

    def assert_seamless(self, trainer: TrainerProcess, result: dict[str, Any] | None = None) -> None:
        """One process, and every step committed once, without error, heal or gap (the kind's
        ``seamless_problems``)."""
        problems = trainer.process_problems(result) or trainer.seamless_problems(result)
        self.check(not problems, "\n".join(problems))

    # -- faults at the lighthouse ------------------------------------------------------------------

    def kill_while_calls_wait(self, node: int | None = None, *, max_waiting_ms: float | None = None,
                              timeout: float = 20.0) -> Kill:
        """SIGKILL ``node`` (default: the serving leader) as soon as the leader reports Quorum calls
        waiting for a round, all of them for less than ``max_waiting_ms`` when given (so the round
        is not about to close: the calls are still in flight when the node dies)."""
        cluster = self.cluster
        assert cluster is not None

        def calls_waiting() -> tuple[int, Any] | None:
            leader = cluster.leader_index()
            st = cluster.status(leader, timeout=0.5) if leader is not None else None
            if st is None or not st.serving:
                return None
            # The default job's waiting calls, or any other job's (NodeStatus.jobs).
            pending = list(st.pending) + [p for j in st.jobs if j.name != "default" for p in j.pending]
            if not pending:
                return None
            if max_waiting_ms is not None and max(p.waiting_ms for p in pending) >= max_waiting_ms:
                return None
            return leader, (st, len(pending))

        leader, (st, waiting) = self.wait_until("Quorum calls waiting at the leader", calls_waiting, timeout,
                                                interval=0.01)
        victim = leader if node is None else node
        cluster.kill(victim)
        kill = Kill(node=victim, leader=leader, term=st.term, at=time.time(), waiting=waiting)
        self.note(f"SIGKILLed n{victim + 1} ({'the leader' if victim == leader else f'leader n{leader + 1}'}, "
                  f"term {st.term}) with {kill.waiting} Quorum calls waiting")
        return kill

    def wait_new_leader(self, kill: Kill, among: list[int] | None = None, timeout: float = 15.0) -> tuple[int, float]:
        """A serving leader in a later term than ``kill``'s (among ``among``, default: the nodes
        but the killed one): its index, and seconds since the kill."""
        cluster = self.cluster
        assert cluster is not None
        among = [i for i in range(cluster.nodes) if i != kill.node] if among is None else among
        try:
            leader = cluster.wait_for_leader(timeout=timeout, among=among, exclude_term=kill.term)
        except (TimeoutError, RuntimeError) as e:
            self.fail(f"no new leader: {e}")
        failover_s = time.time() - kill.at
        self.note(f"new leader n{leader + 1} after {failover_s:.2f}s")
        return leader, failover_s

    def close(self) -> None:
        for t in self.trainers:
            t.kill()
        if self.cluster is not None:
            self.cluster.stop_all()
        if self.rust is not None and self.rust.poll() is None:
            self.rust.kill()
            try:
                self.rust.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def median_duration_s(records: Iterable[dict[str, Any]]) -> float:
    """The median ``duration_s`` of step (or round) records."""
    return median(r["duration_s"] for r in records)


def slowest_step_around(records: list[dict[str, Any]], t: float) -> dict[str, Any] | None:
    """The slowest step among those running at wall-clock time ``t`` and the two after it."""
    around = [r for r in records if r["t_end"] >= t][:3]
    return max(around, key=lambda r: r["duration_s"], default=None)
