"""Clients: simulated replica groups doing quorum rounds and heartbeats, every call recorded.

Each client is one torchft replica group (replica id ``c0``, ``c1``, ...), a
``lighthouse_cluster.local.simulated_group.SimulatedReplicaGroup`` (a heartbeat every 100 ms
and one Quorum call per step with a deadline; the definition of that traffic and of what a
failed call means lives there). This module adds what the harness needs on top: the history.
Client ``k`` belongs to job ``jobs[k mod len(jobs)]`` (``ClientSettings.jobs``: the default job
alone unless the run asks for more; the runner creates the other jobs before the clients start)
and names it in every call, except a default-job client, which names none (an unchanged torchft
trainer); every event it records carries its job.
Client ``k`` starts on node ``k mod n``; even clients stay on their node unless a call certainly
did not reach it (connection refused: a killed node; they move on, like a client with the
endpoint list), odd clients also move on after any failed call (a client that load-balances).
Every call is an ``invoke`` followed by ``ok``, ``fail`` (the call never reached a node:
connection refused, invalid argument) or ``info`` (unknown: a timed-out Quorum call may still
have been committed; also a call cut short when the clients stop).

Two ways to run them, one history either way:

* ``ClientPool``: every client on one asyncio event loop in a background thread of the harness
  (the default: cheap, and what every scenario without client faults uses);
* ``ProcessClientPool``: each client a process of its own (``python -m jepsen_like.clients``,
  the same ``Client`` inside), which writes its events as JSON lines on its stdout; the harness
  appends them to the history with the child's own timestamps (``time.monotonic_ns`` is one
  clock for every process of the machine). This is what ``kill-client`` needs: the nemesis
  SIGKILLs the process, so its calls and heartbeats stop exactly as a dead trainer's do (the
  kernel closes its sockets; the nodes see the connections drop, not a polite cancel), then
  completes its open calls as ``info`` ("killed"). ``restart-client`` starts a new process with
  the same replica id, from step 0 (a restarted torchft group catches up through its first
  quorum). A child that exits on its own is an error of the run. Each child's stderr goes to
  ``<run>/clients/<id>.log``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from lighthouse_cluster.core.jobs import DEFAULT_JOB
from lighthouse_cluster.local.simulated_group import (
    FAILED, OK as ANSWERED, ON_ANY_ERROR, ON_NOT_SENT, HeartbeatResult, RoundResult, SimulatedReplicaGroup,
)

from .history import FAIL, INFO, INVOKE, OK, HistoryWriter


@dataclass
class ClientSettings:
    clients: int = 4
    quorum_timeout_s: float = 2.0
    heartbeat_interval_s: float = 0.1
    heartbeat_timeout_s: float = 1.0
    step_time_s: float = 0.05
    retry_sleep_s: float = 0.05
    # Each client a process of its own (``ProcessClientPool``: ``kill-client`` can SIGKILL it);
    # None: only when the schedule kills or restarts clients (``schedule.uses_client_faults``).
    processes: bool | None = None
    # The jobs the clients belong to, round-robin (client k: jobs[k % len(jobs)]); jobs other than
    # the default one are created through the admin API when the run starts.
    jobs: list[str] = field(default_factory=lambda: [DEFAULT_JOB])
    # Key-value clients (``kv_clients.py``): compare-and-set increments of one register of the
    # rendezvous store, in the namespace (kv_job, kv_clients.KV_RUN_ID); 0: none.
    kv_clients: int = 0
    kv_timeout_s: float = 3.0
    kv_job: str = DEFAULT_JOB

    def job_of(self, k: int) -> str:
        return self.jobs[k % len(self.jobs)] if self.jobs else DEFAULT_JOB


def job_names(count: int) -> list[str]:
    """``count`` jobs for a run: the default job and ``job-1``, ``job-2``, ..."""
    if count < 1:
        raise ValueError(f"a run needs at least one job, got {count}")
    return [DEFAULT_JOB] + [f"job-{i}" for i in range(1, count)]


class EventSink(Protocol):
    """Where a ``Client`` records its events: a ``HistoryWriter`` or, in a client process, its
    stdout (``EventLines``)."""

    def append(self, process: str, type: str, f: str, value: Any = None, node: str | None = None,
               error: str | None = None, time_ns: int | None = None, job: str | None = None) -> Any: ...


def completion_type(outcome: str) -> str:
    """The history's completion type for a simulated group's outcome."""
    return OK if outcome == ANSWERED else FAIL if outcome == FAILED else INFO


def error_text(error: str, details: str) -> str:
    return f"{error}: {details[:120]}"


class Client:
    """One simulated replica group whose every call goes into the history."""

    def __init__(self, replica_id: str, endpoints: list[str], node_ids: list[str], start: int, roaming: bool,
                 settings: ClientSettings, history: EventSink, job: str = DEFAULT_JOB) -> None:
        self.history = history
        self.job = job
        self._node_of = dict(zip(endpoints, node_ids))
        # The invocation of each call kind ("quorum", "heartbeat") still waiting for its
        # completion: (node, value). What is left when the client stops is completed as ``info``.
        self._open: dict[str, tuple[str, Any]] = {}
        self.group = SimulatedReplicaGroup(
            replica_id, endpoints[start % len(endpoints)], quorum_timeout_s=settings.quorum_timeout_s,
            heartbeat_interval_s=settings.heartbeat_interval_s, heartbeat_timeout_s=settings.heartbeat_timeout_s,
            step_time_s=settings.step_time_s, retry_sleep_s=settings.retry_sleep_s,
            fallback_endpoints=tuple(endpoints), move_on=ON_ANY_ERROR if roaming else ON_NOT_SENT,
            on_send=self._sent, on_round=self._round_done, on_heartbeat=self._heartbeat_done, keep_rounds=False,
            job=None if job == DEFAULT_JOB else job)

    @property
    def replica_id(self) -> str:
        return self.group.replica_id

    @property
    def node(self) -> str:
        """The node it talks to now (``n1`` ...)."""
        return self._node_of[self.group.endpoint]

    @property
    def step(self) -> int:
        return self.group.step

    def _sent(self, f: str, endpoint: str) -> None:
        node = self._node_of[endpoint]
        value = {"step": self.group.step} if f == "quorum" else None
        self._open[f] = (node, value)
        self.history.append(self.replica_id, INVOKE, f, value, node, job=self.job)

    def _round_done(self, r: RoundResult) -> None:
        node, value = self._open.pop("quorum")
        if r.outcome == ANSWERED:
            self.history.append(self.replica_id, OK, "quorum",
                                {"quorum_id": r.quorum_id, "participants": list(r.participants), "step": r.step}, node,
                                job=self.job)
        else:
            self.history.append(self.replica_id, completion_type(r.outcome), "quorum", value, node,
                                error_text(r.error, r.details), job=self.job)

    def _heartbeat_done(self, h: HeartbeatResult) -> None:
        node, _ = self._open.pop("heartbeat")
        self.history.append(self.replica_id, completion_type(h.outcome), "heartbeat", None, node,
                            None if h.outcome == ANSWERED else error_text(h.error, h.details), job=self.job)

    async def close(self) -> None:
        await self.group.close()

    async def run(self, stop: Callable[[], bool]) -> None:
        try:
            await self.group.run(until=stop)
        finally:
            for f, (node, value) in list(self._open.items()):
                self.history.append(self.replica_id, INFO, f, value, node, "cancelled at shutdown", job=self.job)
            self._open.clear()
            await self.close()


class ClientPool:
    """Runs every client on one event loop thread until ``stop()``."""

    def __init__(self, endpoints: list[str], node_ids: list[str], history: HistoryWriter,
                 settings: ClientSettings | None = None) -> None:
        self.settings = settings or ClientSettings()
        self.clients = [Client(f"c{k}", endpoints, node_ids, start=k, roaming=bool(k % 2), settings=self.settings,
                               history=history, job=self.settings.job_of(k)) for k in range(self.settings.clients)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="jepsen-clients", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> "ClientPool":
        self._thread.start()
        return self

    def _main(self) -> None:
        async def main() -> None:
            await asyncio.gather(*(c.run(self._stop.is_set) for c in self.clients))
        try:
            asyncio.run(main())
        except BaseException as e:  # reported by stop()
            self.error = e

    def stop(self) -> None:
        """Stop and wait (bounded by one quorum deadline and a margin)."""
        self._stop.set()
        self._thread.join(self.settings.quorum_timeout_s + 10.0)
        if self._thread.is_alive():
            raise RuntimeError("clients did not stop in time")
        if self.error is not None:
            raise RuntimeError(f"client loop crashed: {self.error!r}") from self.error

    @property
    def replica_ids(self) -> list[str]:
        return [c.replica_id for c in self.clients]

    @property
    def down(self) -> list[str]:
        return []

    def kill(self, replica_id: str) -> None:
        raise ClientFaultError("the clients run in-process, where a kill would only be simulated: client faults "
                               "need ClientSettings(processes=True) (a schedule with client faults gets it)")

    restart = kill

    def restart_down(self) -> list[str]:
        return []


class ClientFaultError(RuntimeError):
    """A client fault that cannot be done (unknown client, already down, clients in-process)."""


# -- clients as processes ------------------------------------------------------------------------------

KILLED = "killed (SIGKILL) by the nemesis"
_REPO_ROOT = str(Path(__file__).resolve().parents[1])


class EventLines:
    """A client process's history: each event one JSON line on a file descriptor (stdout), written
    with one ``write`` (atomic on a pipe up to 4 KiB: a SIGKILL leaves no torn line but the last),
    timed on the parent's clock (``t0_ns``: its ``HistoryWriter.t0_ns``)."""

    def __init__(self, t0_ns: int, fd: int = 1) -> None:
        self.t0_ns = t0_ns
        self.fd = fd

    def append(self, process: str, type: str, f: str, value: Any = None, node: str | None = None,
               error: str | None = None, time_ns: int | None = None, job: str | None = None) -> None:
        t = time.monotonic_ns() - self.t0_ns if time_ns is None else time_ns
        line = json.dumps({"time_ns": t, "process": process, "type": type, "f": f, "value": value, "node": node,
                           "error": error, "job": job}, separators=(",", ":")) + "\n"
        os.write(self.fd, line.encode())


def child_config(replica_id: str, endpoints: list[str], node_ids: list[str], start: int, roaming: bool,
                 settings: ClientSettings, t0_ns: int, job: str = DEFAULT_JOB) -> dict[str, Any]:
    return {"replica_id": replica_id, "endpoints": list(endpoints), "node_ids": list(node_ids), "start": start,
            "roaming": roaming, "settings": asdict(settings), "t0_ns": t0_ns, "job": job}


def child_main(argv: list[str] | None = None) -> int:
    """A client process: ``python -m jepsen_like.clients CONFIG_JSON``. Runs one ``Client`` until
    its stdin closes (then finishes the round in flight, completes what is open as ``info`` and
    exits 0), writing every event to stdout."""
    cfg = json.loads((argv if argv is not None else sys.argv[1:])[0])
    sink = EventLines(int(cfg["t0_ns"]))
    settings = ClientSettings(**{k: v for k, v in cfg["settings"].items() if k in ClientSettings.__dataclass_fields__})
    client = Client(cfg["replica_id"], cfg["endpoints"], cfg["node_ids"], start=int(cfg["start"]),
                    roaming=bool(cfg["roaming"]), settings=settings, history=sink, job=cfg.get("job", DEFAULT_JOB))
    stop = threading.Event()

    def wait_for_eof() -> None:
        try:
            sys.stdin.buffer.read()
        finally:
            stop.set()
    threading.Thread(target=wait_for_eof, name="stdin", daemon=True).start()
    asyncio.run(client.run(stop.is_set))
    return 0


class ClientProcess:
    """One replica group run as a process; restartable (each start is a new incarnation)."""

    def __init__(self, replica_id: str, config: dict[str, Any], history: HistoryWriter,
                 log_path: Path | None = None) -> None:
        self.replica_id = replica_id
        self.config = config
        self.history = history
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.incarnation = 0
        self.errors: list[str] = []
        self._reader: threading.Thread | None = None
        self._open: dict[str, tuple[str | None, Any]] = {}    # f -> (node, value) of the open call
        self.job = str(config.get("job", DEFAULT_JOB))
        self._ending = False                                  # killed or stopped by the harness

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        if self.alive:
            raise ClientFaultError(f"client {self.replica_id} is running")
        self.incarnation += 1
        self._ending = False
        self._open = {}
        env = dict(os.environ)
        env["PYTHONPATH"] = _REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        log = None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            log = open(self.log_path, "ab")
            log.write(f"--- {self.replica_id} incarnation {self.incarnation}\n".encode())
            log.flush()
        try:
            # A session of its own: a Ctrl-C in the terminal stops the harness (which then stops
            # the clients in order), not the clients behind its back.
            self.proc = subprocess.Popen([sys.executable, "-m", "jepsen_like.clients", json.dumps(self.config)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log if log is not None else subprocess.DEVNULL,
                                         env=env, start_new_session=True)
        finally:
            if log is not None:
                log.close()
        self._reader = threading.Thread(target=self._read, args=(self.proc,), name=f"jepsen-{self.replica_id}",
                                        daemon=True)
        self._reader.start()

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            try:
                e = json.loads(raw)
            except ValueError:
                continue            # a torn last line (cannot happen below 4 KiB; never mind)
            if e["type"] == INVOKE:
                self._open[e["f"]] = (e.get("node"), e.get("value"))
            else:
                self._open.pop(e["f"], None)
            self.history.append(e["process"], e["type"], e["f"], e.get("value"), e.get("node"), e.get("error"),
                                time_ns=int(e["time_ns"]), job=e.get("job"))
        rc = proc.wait()
        if not self._ending:
            self.errors.append(f"client {self.replica_id} (pid {proc.pid}) exited on its own with status {rc}"
                               + (f"; see {self.log_path}" if self.log_path is not None else ""))
            self._complete_open(f"client process exited (status {rc})")

    def _complete_open(self, error: str) -> None:
        for f, (node, value) in list(self._open.items()):
            self.history.append(self.replica_id, INFO, f, value, node, error, job=self.job)
        self._open.clear()

    def _join_reader(self, timeout: float) -> None:
        if self._reader is not None:
            self._reader.join(timeout)
            if self._reader.is_alive():
                self.errors.append(f"client {self.replica_id}: its output did not end within {timeout:.0f}s")

    def kill(self) -> None:
        """SIGKILL now; returns once the process is reaped (its sockets closed) and its last events
        and the ``info`` completions of its open calls are in the history."""
        if not self.alive:
            raise ClientFaultError(f"client {self.replica_id} is not running")
        assert self.proc is not None
        self._ending = True
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self._join_reader(10.0)
        self._complete_open(KILLED)
        self._close_pipes()

    def request_stop(self) -> None:
        """Ask it to stop (close its stdin): it finishes the round in flight and exits."""
        self._ending = True
        if self.proc is not None and self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass

    def wait_stopped(self, timeout: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.errors.append(f"client {self.replica_id} did not stop within {timeout:.0f}s: killed")
            self.proc.kill()
            self.proc.wait()
        self._join_reader(10.0)
        self._complete_open("cancelled at shutdown")
        self._close_pipes()

    def _close_pipes(self) -> None:
        assert self.proc is not None
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass


class ProcessClientPool:
    """``ClientPool``'s interface with each client a process (see the module docstring), plus
    ``kill``/``restart`` of one client and ``restart_down``."""

    def __init__(self, endpoints: list[str], node_ids: list[str], history: HistoryWriter,
                 settings: ClientSettings | None = None, log_dir: Path | None = None) -> None:
        self.settings = settings or ClientSettings()
        self.history = history
        self.clients = [
            ClientProcess(f"c{k}", child_config(f"c{k}", endpoints, node_ids, start=k, roaming=bool(k % 2),
                                                settings=self.settings, t0_ns=history.t0_ns,
                                                job=self.settings.job_of(k)),
                          history, None if log_dir is None else Path(log_dir) / f"c{k}.log")
            for k in range(self.settings.clients)]
        self._by_id = {c.replica_id: c for c in self.clients}
        self._lock = threading.Lock()
        self._stopped = False

    def start(self) -> "ProcessClientPool":
        try:
            for c in self.clients:
                c.start()
        except BaseException:
            self.stop(raise_errors=False)
            raise
        return self

    @property
    def replica_ids(self) -> list[str]:
        return [c.replica_id for c in self.clients]

    @property
    def down(self) -> list[str]:
        """The clients not running now (killed and not restarted)."""
        return [c.replica_id for c in self.clients if not c.alive]

    @property
    def error(self) -> str | None:
        errors = [e for c in self.clients for e in c.errors]
        return "; ".join(errors) if errors else None

    def _client(self, replica_id: str) -> ClientProcess:
        c = self._by_id.get(replica_id)
        if c is None:
            raise ClientFaultError(f"no client {replica_id!r}; clients: {', '.join(self._by_id)}")
        return c

    def kill(self, replica_id: str) -> None:
        with self._lock:
            self._client(replica_id).kill()

    def restart(self, replica_id: str) -> None:
        with self._lock:
            self._client(replica_id).start()

    def restart_down(self) -> list[str]:
        """Start every killed client again; returns their ids."""
        with self._lock:
            down = [c for c in self.clients if not c.alive]
            for c in down:
                c.start()
            return [c.replica_id for c in down]

    def stop(self, raise_errors: bool = True) -> None:
        """Stop every client (each finishes its round in flight: bounded by one quorum deadline
        and a margin), then raise if any of them failed on its own. Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            for c in self.clients:
                c.request_stop()
            deadline = time.monotonic() + self.settings.quorum_timeout_s + 10.0
            for c in self.clients:
                c.wait_stopped(max(0.1, deadline - time.monotonic()))
        if raise_errors and self.error is not None:
            raise RuntimeError(f"client processes: {self.error}")


def make_pool(endpoints: list[str], node_ids: list[str], history: HistoryWriter, settings: ClientSettings,
              processes: bool, log_dir: Path | None = None) -> "ClientPool | ProcessClientPool":
    if processes:
        return ProcessClientPool(endpoints, node_ids, history, settings, log_dir)
    return ClientPool(endpoints, node_ids, history, settings)


if __name__ == "__main__":
    sys.exit(child_main())
