"""The cluster under test: real node processes behind a network backend, with process faults.

``HarnessCluster`` owns a ``LocalCluster`` (node processes, each with its own data directory and
log under ``<run>/cluster/``), the network backend the nodes are wired through, and optionally
the libfaketime clock backend. It adds what a nemesis needs on top of ``LocalCluster``: the
current leader, ``restart_all``, ``recover`` (the fully healthy cluster again), with
``power=True`` each data directory on a lazy filesystem and ``lose_power`` (lazyfs.py), a parallel
status poll, and a ``close()`` that always kills every process, removes every namespace and
unmounts every filesystem, whatever failed before (use it as a context manager), and ``add_job`` (the nodes get an admin
token of the run's own, never written anywhere, so the runner can create the run's jobs).
"""

from __future__ import annotations

import secrets
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import grpc

from lighthouse_cluster.client.admin_client import AdminCallError, AdminClient
from lighthouse_cluster.local.cluster import LocalCluster
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import lighthouse_cluster_pb2_grpc as cpb_grpc

from . import clock as clock_skew
from . import network
from .lazyfs import LazyMount

ROLE_NAMES = {cpb.FOLLOWER: "follower", cpb.CANDIDATE: "candidate", cpb.LEADER: "leader", cpb.ROLE_UNKNOWN: "unknown"}


@dataclass
class ClusterSettings:
    """Knobs of the nodes under test (small timeouts: faults and recoveries in seconds)."""

    nodes: int = 3
    min_replicas: int = 1
    join_timeout_ms: int = 1000
    heartbeat_timeout_ms: int = 500
    quorum_tick_ms: int = 50
    election_timeout_ms: int | None = None
    # None: the node default (lighthouse_cluster.core.lease), except with the clock nemesis, which
    # runs nodes' clocks at 0.25x-4x, beyond the lease's assumption (rates within 2x of each
    # other): there the lease is off (0) unless set explicitly.
    quorum_lease_ms: int | None = None
    # The nodes run with --unsafe-no-fsync (they never sync their Raft state): what a power-loss
    # fault then finds (tests/fault_injection/test_power_loss.py). Never for a real check.
    unsafe_no_fsync: bool = False

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ClusterSettings":
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)


class PowerUnavailable(RuntimeError):
    """Power-loss faults cannot run (no lazy filesystem); the message says why."""


class ClockUnavailable(RuntimeError):
    """Clock skew cannot run here (or was not enabled); the message says why."""


def open_clock(nodes: int, root: Path) -> clock_skew.ClockNemesis:
    """The libfaketime backend for ``nodes`` nodes, its rate files under ``root`` (not yet set
    up); raises ``ClockUnavailable`` with the reason when libfaketime cannot skew a process here."""
    ok, why = clock_skew.available()
    if not ok:
        raise ClockUnavailable(f"clock skew unavailable: {why}")
    return clock_skew.ClockNemesis(nodes, directory=root)


@dataclass
class HarnessCluster:
    """Nodes + network (+ clock); see the module docstring."""

    root: Path
    settings: ClusterSettings = field(default_factory=ClusterSettings)
    backend: str = "auto"
    clock: bool = False
    # Each node's data directory on a lazy filesystem (lazyfs.py): power-loss faults.
    power: bool = False
    net: network.NetworkBackend | None = field(init=False, default=None)
    mounts: list[LazyMount] = field(init=False, default_factory=list)
    skew: clock_skew.ClockNemesis | None = field(init=False, default=None)
    local: LocalCluster | None = field(init=False, default=None)
    clock_error: str = field(init=False, default="")   # why clock skew is off although asked for
    _skewed: bool = field(init=False, default=False)    # a clock rate is not 1 now
    # The admin token the nodes take (for add_job); made per run, kept in memory only.
    _admin_token: str = field(init=False, default_factory=lambda: secrets.token_urlsafe(24), repr=False)

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, leader_timeout_s: float = 20.0) -> "HarnessCluster":
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            self.net = net = network.make_network(self.backend, self.settings.nodes)
            net.setup()
            kwargs = net.cluster_kwargs()
            if self.clock:
                try:
                    skew = open_clock(self.settings.nodes, self.root / "clock")
                    skew.setup()
                    self.skew = skew
                except (ClockUnavailable, clock_skew.ClockError, OSError) as e:
                    self.clock_error = str(e)   # optional: the run goes on without clock faults
            kwargs["launch_prefix"] = self._launch_prefix(kwargs.get("launch_prefix"))
            s = self.settings
            if s.unsafe_no_fsync:
                kwargs["extra_args"] = [*kwargs.get("extra_args", []), "--unsafe-no-fsync"]
            self.local = LocalCluster(
                root=self.root / "cluster", nodes=s.nodes, min_replicas=s.min_replicas,
                join_timeout_ms=s.join_timeout_ms, heartbeat_timeout_ms=s.heartbeat_timeout_ms,
                quorum_tick_ms=s.quorum_tick_ms, election_timeout_ms=s.election_timeout_ms,
                quorum_lease_ms=s.quorum_lease_ms if s.quorum_lease_ms is not None or self.skew is None else 0,
                admin_token=self._admin_token, **kwargs)
            net.attach(self.local)
            if self.power:
                # Mounted before any node starts, so that a node's mount namespace (netns exec
                # copies the host's) has it; it stays mounted across power losses, as a disk does.
                for m in self.local.members:
                    self.mounts.append(LazyMount(m.data_dir, log_path=m.log_path.with_suffix(".lazyfs.log")))
                    self.mounts[-1].start()
            self.local.start()
            self.local.wait_for_leader(timeout=leader_timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def _launch_prefix(self, base: Callable[[int], list[str]] | None) -> Callable[[int], list[str]] | None:
        skew = self.skew
        if skew is None:
            return base

        def prefix(i: int) -> list[str]:
            return [*(base(i) if base is not None else []), *skew.launch_prefix(i)]
        return prefix

    def close(self) -> list[str]:
        """Kill every node, remove the network and clock state. Never raises; returns problems."""
        problems: list[str] = []
        if self.local is not None:
            try:
                self.local.stop_all()
            except Exception as e:  # pragma: no cover - best effort
                problems.append(f"stopping nodes: {e}")
        for what, obj in (("network", self.net), ("clock", self.skew)):
            if obj is not None:
                try:
                    obj.teardown()
                except Exception as e:
                    problems.append(f"tearing down {what}: {e}")
        for mount in self.mounts:  # after the nodes: unmounted, each directory keeps the files
            try:
                mount.close()
            except Exception as e:  # pragma: no cover - best effort
                problems.append(f"unmounting {mount.directory}: {e}")
        self.mounts = []
        return problems

    def __enter__(self) -> "HarnessCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- names and state -------------------------------------------------------------------------

    @property
    def cluster(self) -> LocalCluster:
        assert self.local is not None, "start() first"
        return self.local

    @property
    def nodes(self) -> int:
        return self.settings.nodes

    def node_id(self, i: int) -> str:
        return f"n{i + 1}"

    def index_of(self, node_id: str) -> int:
        return int(node_id[1:]) - 1

    def running(self, i: int) -> bool:
        return self.cluster.members[i].running

    def paused(self, i: int) -> bool:
        return self.cluster.members[i].paused

    @property
    def healthy(self) -> bool:
        """Every node running and not paused, no network cut, no clock skew."""
        return (all(self.running(i) and not self.paused(i) for i in range(self.nodes))
                and not self.net.blocked and not self._skewed)

    def describe(self) -> dict[str, Any]:
        return {"down": [self.node_id(i) for i in range(self.nodes) if not self.running(i)],
                "paused": [self.node_id(i) for i in range(self.nodes) if self.running(i) and self.paused(i)],
                "cuts": sorted([self.node_id(a), self.node_id(b)] for a, b in self.net.blocked)}

    # -- observation --------------------------------------------------------------------------------

    def statuses(self, timeout: float = 0.5) -> list[cpb.NodeStatus | None]:
        """Every node's Status, polled in parallel (None: down, paused or not answering)."""
        def one(i: int) -> cpb.NodeStatus | None:
            if not self.running(i) or self.paused(i):
                return None
            return self.cluster.status(i, timeout=timeout)
        with ThreadPoolExecutor(max_workers=self.nodes) as pool:
            return list(pool.map(one, range(self.nodes)))

    def leader(self, statuses: list[cpb.NodeStatus | None] | None = None) -> int | None:
        """The running node that reports itself leader in the highest term, if any."""
        sts = self.statuses() if statuses is None else statuses
        best: tuple[int, int] | None = None
        for i, st in enumerate(sts):
            if st is not None and st.role == cpb.LEADER and (best is None or st.term > best[0]):
                best = (st.term, i)
        return best[1] if best is not None else None

    def wait_for_leader(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            i = self.leader()
            if i is not None:
                return i
            time.sleep(0.05)
        return None

    # -- jobs -----------------------------------------------------------------------------------------

    def add_job(self, name: str, timeout: float = 20.0) -> cpb.Job:
        """Create job ``name`` (the leader's default-job settings) through the admin API, routed to
        the leader; a retry that finds the job already there (its first attempt applied) is fine."""
        running = [a for i, a in enumerate(self.cluster.client_addresses) if self.running(i)]
        admin = AdminClient(running, token=self._admin_token, timeout=timeout)
        try:
            return admin.call("AddJob", cpb.AddJobRequest(name=name))
        except AdminCallError as e:
            if e.code != grpc.StatusCode.ALREADY_EXISTS:
                raise
        leader, _ = admin.leader()
        with grpc.insecure_channel(leader) as ch:
            return cpb_grpc.LighthouseClusterStub(ch).GetJob(cpb.JobRequest(name=name), timeout=timeout)

    # -- process faults ------------------------------------------------------------------------------

    def kill(self, i: int) -> None:
        self.cluster.kill(i)

    def restart(self, i: int) -> None:
        """Start node ``i`` again if it is down (a running node is left alone)."""
        if not self.running(i):
            self.cluster.start_node(i)

    def pause(self, i: int) -> None:
        if self.running(i):
            self.cluster.pause(i)

    def resume(self, i: int) -> None:
        if self.running(i) and self.paused(i):
            self.cluster.resume(i)

    def lose_power(self, nodes: list[int]) -> dict[str, Any]:
        """Cut the power of ``nodes`` at once: each is SIGKILLed (all of them before any disk is
        touched), then its data directory loses every write it had not synced. Returns, per node
        id, what its filesystem lost (``LazyFiles.lose_power``). They stay down until restarted."""
        if not self.mounts:
            raise PowerUnavailable("power-loss faults need the nodes' data directories on lazy filesystems "
                                   "(HarnessCluster(power=True))")
        for i in nodes:
            self.cluster.kill(i)
        return {self.node_id(i): self.mounts[i].lose_power() for i in nodes}

    def restart_all(self) -> None:
        for i in range(self.nodes):
            self.cluster.kill(i)
        for i in range(self.nodes):
            self.cluster.start_node(i)

    def set_clock_rate(self, i: int, rate: float) -> None:
        if self.skew is None:
            raise ClockUnavailable(self.clock_error or "clock skew not enabled (run with the clock nemesis)")
        self.skew.set_rate(i, rate)
        self._skewed = True

    def recover(self) -> None:
        """Heal the network, resume paused nodes, start killed ones, reset clocks."""
        self.net.heal()
        for i in range(self.nodes):
            if self.running(i) and self.paused(i):
                self.cluster.resume(i)
            elif not self.running(i):
                self.cluster.start_node(i)
        if self.skew is not None and self._skewed:
            self.skew.reset()
            self._skewed = False

    def signal_all_stopped(self) -> None:
        """SIGCONT anything paused (before a final stop: a stopped process ignores SIGTERM)."""
        for i in range(self.nodes):
            if self.paused(i):
                self.cluster.signal(i, signal.SIGCONT)
                self.cluster.members[i].paused = False

    def data_dir(self, i: int) -> Path:
        return self.cluster.members[i].data_dir

    def log_path(self, i: int) -> Path:
        return self.cluster.members[i].log_path
