"""Real ``torchrun --rdzv-backend=lighthouse`` agents for the tests of tests/torchrun: one
``TorchrunJob`` per ``--rdzv-id`` (its command line, its output folder of worker records, its
hold file), one ``Agent`` per torchrun process (each an agent of a multi-node job on this host,
``--node-rank`` unset). Workers are ``support/torchrun_worker.py``.

torchrun starts its workers in sessions of their own, so an agent is killed with its whole
process tree (``kill_tree``: the descendants are listed before the agent dies and is reaped),
and every agent a job started is killed when the job is closed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.procs import descendants

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "support" / "torchrun_worker.py"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
# Short rendezvous timeouts: a round closes 1 s after its minimum is reached; a dead agent's
# keep-alive is stale after 3 s.
FAST_CONF = {"last_call_timeout": "1", "join_timeout": "60", "keep_alive_interval": "1", "heartbeat_timeout": "3",
             "close_timeout": "10"}

# Workers forked from their agent, which has imported torch already: a round's workers start in
# well under a second instead of importing torch again (seconds on a busy 2-core runner).
FAST_WORKERS = ("--run-path", "--start-method=fork")


def agent_env() -> dict[str, str]:
    """This environment without the lighthouse's and torchrun's own variables."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LIGHTHOUSE_", "TORCHELASTIC_", "TORCHFT_")) and k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONUNBUFFERED"] = "1"
    env["LOGLEVEL"] = "INFO"  # torchrun's agents log their rendezvous rounds (kept in each agent's log file)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


@dataclass
class Agent:
    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def running(self) -> bool:
        return self.process.poll() is None

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"agent {self.name} still running after {timeout:g} s; its output:\n"
                                 f"{self.output()[-3000:]}") from None

    def kill_tree(self) -> None:
        """SIGKILL the agent and every process under it."""
        if self.process.poll() is not None:
            return
        tree = descendants(self.process.pid)
        for pid in [self.process.pid, *tree]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait(timeout=10)


@dataclass
class TorchrunJob:
    """One ``--rdzv-id`` on a cluster: starts agents, reads what the workers recorded."""

    endpoints: str
    run_id: str
    root: Path
    nnodes: str = "2"
    conf: dict[str, str] = field(default_factory=dict)
    torchrun_args: tuple[str, ...] = ()
    worker_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    agents: list[Agent] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.out = self.root / self.run_id
        self.out.mkdir(parents=True, exist_ok=True)

    @property
    def hold(self) -> Path:
        """The file whose creation lets held workers (``hold=True``) finish."""
        return self.out / "release"

    def command(self, *, hold: bool = False) -> list[str]:
        conf = ",".join(f"{k}={v}" for k, v in {**FAST_CONF, **self.conf}.items())
        worker = [*self.worker_args, *(("--hold", str(self.hold)) if hold else ())]
        return [TORCHRUN, f"--nnodes={self.nnodes}", "--nproc-per-node=1", "--rdzv-backend=lighthouse",
                f"--rdzv-endpoint={self.endpoints}", f"--rdzv-id={self.run_id}", f"--rdzv-conf={conf}",
                "--monitor-interval=0.2", "--local-addr=127.0.0.1", *FAST_WORKERS, *self.torchrun_args, str(WORKER), str(self.out),
                *worker]

    def start_agent(self, *, hold: bool = False, command: list[str] | None = None) -> Agent:
        name = f"{self.run_id}-{len(self.agents)}"
        log = self.root / f"{name}.log"
        with open(log, "wb") as f:
            process = subprocess.Popen(command or self.command(hold=hold), stdout=f, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, env={**agent_env(), **self.env}, cwd=ROOT)
        agent = Agent(name, process, log)
        self.agents.append(agent)
        return agent

    def records(self, kind: str) -> list[dict[str, Any]]:
        """What the workers wrote: ``kind`` ``training`` (after the first allreduce) or ``done``."""
        found = []
        for path in sorted(self.out.glob(f"{kind}-*.json")):
            found.append(json.loads(path.read_text()))
        return found

    def logs(self) -> str:
        return "\n".join(f"--- agent {a.name} (rc {a.process.poll()}):\n{a.output()[-2500:]}" for a in self.agents)

    def close(self) -> None:
        for agent in self.agents:
            agent.kill_tree()
