"""A single-member etcd on loopback, with its v2 API, for torch's ``etcd-v2`` rendezvous backend.

``LocalEtcd(root)`` runs the ``etcd`` program (Debian's ``etcd-server``, 3.4) as a child process
with its data directory and log under ``root``, client and peer URLs on free loopback ports, and
``--enable-v2=true`` (torch's backend speaks v2 through ``python-etcd``). ``start()`` waits,
bounded, until ``/version`` answers; the process is always killed on exit. One member is what a
benchmark on one host can run; a production etcd has three or five.
"""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from .procs import free_port, kill_process

START_TIMEOUT_S = 30.0


def etcd_missing() -> str | None:
    """Why the etcd column cannot run here, or None when it can."""
    import importlib.util

    if shutil.which("etcd") is None:
        return "etcd not installed (apt-get install etcd-server)"
    if importlib.util.find_spec("etcd") is None:
        return "python-etcd not installed (pip install python-etcd==0.4.5)"
    return None


@dataclass
class LocalEtcd:
    root: Path
    host: str = "127.0.0.1"
    client_port: int = field(default_factory=free_port)
    peer_port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        """``host:port`` of the client URL, the form torch's ``--rdzv-endpoint`` takes."""
        return f"{self.host}:{self.client_port}"

    @property
    def pid(self) -> int:
        if self.process is None:
            raise RuntimeError("etcd is not running")
        return self.process.pid

    def command(self) -> list[str]:
        client = f"http://{self.endpoint}"
        peer = f"http://{self.host}:{self.peer_port}"
        return ["etcd", "--name", "bench", "--data-dir", str(self.root / "data"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"bench={peer}", "--initial-cluster-state", "new",
                "--enable-v2=true", "--log-level", "warn"]

    def start(self, timeout: float = START_TIMEOUT_S) -> float:
        """Start etcd and wait until it answers; the seconds that took."""
        self.root.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with open(self.root / "etcd.log", "wb") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
        while time.monotonic() - started < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.process.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://{self.endpoint}/version", timeout=1.0) as r:
                    if r.status == 200:
                        return time.monotonic() - started
            except (urllib.error.URLError, OSError):
                time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"etcd did not answer within {timeout:.0f} s: {self.log_tail()}")

    def log_tail(self, lines: int = 5) -> str:
        try:
            return " | ".join((self.root / "etcd.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        kill_process(self.process)

    def __enter__(self) -> "LocalEtcd":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
