"""Processes under test: CPU and memory from /proc, torchft's Rust lighthouse, cleanup.

CPU time is read from ``/proc/<pid>/stat`` (utime + stime, every thread of the process) and
summed over the process and its live descendants; resident memory from ``/proc/<pid>/status``
(VmRSS). ``CpuMeter`` turns two readings into "percent of one core" over the interval between
them. ``RustLighthouse`` runs ``torchft_lighthouse`` (torchft's console script, the real Rust
server) as a child process and always kills it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
# The repository root: child processes run ``python -m benchmarks.<worker>`` with it on their path,
# whatever directory the bench was started from.
CHECKOUT = Path(__file__).resolve().parents[1]


def worker_command(module: str, *args: str) -> list[str]:
    """``python -m benchmarks.<module> ARGS`` with this interpreter (pair it with ``child_env``)."""
    return [sys.executable, "-m", f"{__package__}.{module}", *args]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment plus ``extra``, with the checkout first on PYTHONPATH."""
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join([str(CHECKOUT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _read_stat(pid: int) -> tuple[int, float] | None:
    """(ppid, cpu seconds of the process itself) or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    rest = data[data.rindex(")") + 2:].split()
    ppid = int(rest[1])
    utime, stime = int(rest[11]), int(rest[12])
    return ppid, (utime + stime) / CLK_TCK


def descendants(pid: int) -> list[int]:
    """``pid``'s live descendants (children, grandchildren, ...)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        st = _read_stat(int(entry))
        if st is not None:
            children.setdefault(st[0], []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def pin_process(pid: int, cpus: set[int]) -> None:
    """Run every thread of ``pid`` on ``cpus`` (Linux; threads it starts later inherit them)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass  # the thread ended


def cpu_seconds(pid: int, with_children: bool = False) -> float | None:
    """CPU seconds used so far by ``pid`` (all its threads), plus its live descendants if asked."""
    st = _read_stat(pid)
    if st is None:
        return None
    total = st[1]
    if with_children:
        for c in descendants(pid):
            cs = _read_stat(c)
            if cs is not None:
                total += cs[1]
    return total


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return None


def machine_info() -> dict:
    """What the numbers were measured on."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    import platform

    versions = {}
    for mod in ("grpc", "torch", "torchft", "pysyncobj"):
        try:
            m = __import__(mod)
            versions[mod] = getattr(m, "__version__", "?")
        except Exception:  # noqa: BLE001 -- optional
            versions[mod] = None
    try:
        from importlib.metadata import version
        versions["torchft"] = version("torchft")
        versions["pysyncobj"] = version("pysyncobj")
    except Exception:  # noqa: BLE001
        pass
    return {
        "cpu_model": model,
        "cpus": os.cpu_count(),
        "mem_bytes": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "versions": versions,
    }


def load_snapshot() -> dict:
    """Load average and CPU pressure (PSI "some" avg10/avg60, when the kernel has it): how busy
    the machine was with other work."""
    out: dict = {"loadavg": [round(x, 2) for x in os.getloadavg()]}
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        fields = dict(f.split("=") for f in line.split()[1:])
        out["cpu_pressure_some"] = {"avg10": float(fields["avg10"]), "avg60": float(fields["avg60"])}
    except (OSError, KeyError, ValueError, IndexError):
        pass
    return out


@dataclass
class CpuMeter:
    """CPU used by a fixed set of processes between ``start()`` and ``stop()``."""

    pids: dict[str, int]
    with_children: bool = False
    _t0: float = 0.0
    _c0: dict[str, float] = field(default_factory=dict)

    def start(self) -> "CpuMeter":
        self._t0 = time.monotonic()
        self._c0 = {k: cpu_seconds(p, self.with_children) or 0.0 for k, p in self.pids.items()}
        return self

    def stop(self) -> dict:
        """``{"wall_s", "per_process": {name: percent of one core}, "total_pct"}``."""
        wall = max(1e-9, time.monotonic() - self._t0)
        per = {}
        for k, p in self.pids.items():
            c1 = cpu_seconds(p, self.with_children)
            per[k] = None if c1 is None else round(100.0 * (c1 - self._c0.get(k, 0.0)) / wall, 1)
        total = round(sum(v for v in per.values() if v is not None), 1)
        return {"wall_s": round(wall, 3), "per_process_pct": per, "total_pct": total}


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host``, drawn below the kernel's ephemeral range (``free_ports``): a port
    bind(0) returns is the kind another process's outgoing connection takes next."""
    from lighthouse_cluster.local.cluster import free_ports

    return free_ports(1, host)[0]


def wait_port(host: str, port: int, timeout: float) -> bool:
    """True once ``host:port`` accepts a TCP connection (bounded by ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.005)
    return False


def lighthouse_command() -> list[str]:
    """torchft's ``torchft_lighthouse`` console script, run by this interpreter directly (no
    pyenv shim or wrapper process in between, so the pid we measure is the server). The Rust
    entry point parses the process's own argv, so it cannot be started with ``python -c``."""
    for bin_dir in (Path(sys.executable).parent, Path(sys.base_prefix) / "bin"):
        script = bin_dir / "torchft_lighthouse"
        if script.exists():
            return [sys.executable, str(script)]
    found = shutil.which("torchft_lighthouse")
    if found:
        return [found]
    raise RuntimeError("torchft_lighthouse not found: install the interop extra (torchft==0.2.0)")


@dataclass
class RustLighthouse:
    """``torchft_lighthouse`` as a child process on a loopback port."""

    min_replicas: int
    log_path: Path
    join_timeout_ms: int = 60_000
    quorum_tick_ms: int = 100
    heartbeat_timeout_ms: int = 5_000
    host: str = "127.0.0.1"
    port: int = 0
    process: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        if not self.port:
            self.port = free_port(self.host)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self, timeout: float = 20.0) -> float:
        """Start and wait until the port accepts connections; returns the seconds that took."""
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError("torchft_lighthouse is already running")
        t0 = time.monotonic()
        cmd = self.command()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True, env=child_env(RUST_LOG="warn"))
        if not wait_port(self.host, self.port, timeout):
            code = self.process.poll()
            self.kill()
            raise RuntimeError(f"{self.name} did not listen on {self.address} within {timeout}s "
                               f"(exit {code}); log {self.log_path}")
        return time.monotonic() - t0

    name = "torchft_lighthouse"

    def command(self) -> list[str]:
        return [*lighthouse_command(), "--bind", self.address, "--min_replicas", str(self.min_replicas),
                "--join_timeout_ms", str(self.join_timeout_ms), "--quorum_tick_ms", str(self.quorum_tick_ms),
                "--heartbeat_timeout_ms", str(self.heartbeat_timeout_ms)]

    def kill(self) -> None:
        """SIGKILL and reap (idempotent)."""
        p, self.process = self.process, None
        kill_process(p)

    def __enter__(self) -> "RustLighthouse":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


class GrpcFloor(RustLighthouse):
    """``benchmarks/grpc_floor.py`` (the Python gRPC floor) as a child process, handled like
    torchft_lighthouse (the timeouts are ignored: it has none)."""

    name = "grpc_floor"

    def command(self) -> list[str]:
        return worker_command("grpc_floor", "--bind", self.address, "--min_replicas", str(self.min_replicas))


def kill_process(p: subprocess.Popen | None, timeout: float = 10.0) -> None:
    """SIGKILL a child we started (its session too, when it leads one) and reap it."""
    if p is None:
        return
    if p.poll() is None:
        try:
            if os.getpgid(p.pid) == p.pid:  # started with start_new_session: take its group too
                os.killpg(p.pid, signal.SIGKILL)
            else:
                p.kill()
        except OSError:
            pass
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
