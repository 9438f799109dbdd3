"""One replica group's trainer process, as the training tests drive it.

Shared by tests/sdk/test_ftclient_training.py, tests/sdk/test_ftclient_diloco_integration.py and
tests/torchft_interop/test_torchft_training.py: a trainer starts in its own session (so a SIGKILL takes the
ranks it started too), logs to ``<workdir>/g<group>.<incarnation>.log``, and a restart is a new
incarnation with its own files. Subclasses say what to run (``command``) and with which
environment (``environment``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(kw_only=True)
class TrainerProcess:
    group: int
    lighthouse: str
    workdir: Path
    incarnation: int = 0
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    killed: bool = False  # SIGKILLed on purpose (and not restarted yet)
    history: list[int] = field(default_factory=list)  # pids of earlier incarnations

    @property
    def name(self) -> str:
        return f"g{self.group}.{self.incarnation}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        raise NotImplementedError

    def start(self) -> None:
        env = self.environment()
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=env, cwd=str(self.workdir),
                                            start_new_session=True)
        self.started_at = time.time()
        self.killed = False

    def kill(self) -> None:
        """SIGKILL the trainer's whole process group (the ranks it started too) and reap it."""
        p = self.process
        if p is None:
            return
        self.killed = True
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def restart(self) -> None:
        self.kill()
        if self.process is not None:
            self.history.append(self.process.pid)
        self.incarnation += 1
        self.start()

    def output(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
