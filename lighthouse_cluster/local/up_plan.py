"""The decisions of `lighthouse-cluster up`, as pure functions and small state machines.

No processes, sockets or clocks here: ``up_session`` and ``supervise`` feed them.

* :class:`UpRequest` is what ``up`` was asked for (its options, by name), and :func:`plan_up`
  checks it before anything starts: an odd node count, no ``--demo`` with TLS, the addresses,
  the jobs, and ports free to bind. The result, an :class:`UpPlan`, is what ``up_session`` runs.
* :func:`plan_addresses` turns ``--bind``, ``--http-bind`` and ``--raft-port`` into where each
  node listens and how it is reached from this host (a wildcard such as ``[::]`` is bound as
  given and reached at 127.0.0.1).
* :class:`Stable` (with ``client.discovery.agreed_leader``, re-exported here): the leader ``up``
  names is the one every running node names, in the same term, while it serves, and it has
  stayed so for a moment.
* :func:`plan_jobs` turns ``--job NAME[=PORT]`` into the jobs ``up`` creates once the cluster
  is up (node i serves the job on PORT + i: the nodes share one host), and :func:`job_banner`
  says what a torchft and an ftclient trainer set to train as that job.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Hashable, Iterable, Sequence

from lighthouse_cluster.client.discovery import agreed_leader as agreed_leader  # re-exported
from lighthouse_cluster.core.defaults import (
    DEFAULT_HEARTBEAT_TIMEOUT_MS,
    DEFAULT_JOIN_TIMEOUT_MS,
    DEFAULT_QUORUM_TICK_MS,
)
from lighthouse_cluster.core.jobs import DEFAULT_JOB, JobError, check_job_name
from lighthouse_cluster.server.config import DEFAULT_LIVENESS_TIMEOUT_MS, ConfigError, parse_host_port

WILDCARD_HOSTS = ("[::]", "::", "0.0.0.0")
# The environment variable by which an ftclient trainer names its job.
FTCLIENT_JOB_ENV = "LIGHTHOUSE_JOB"
# Where a node bound on a wildcard (or on "localhost") is reached from this host.
LOOPBACK = "127.0.0.1"


def bracket(host: str) -> str:
    """An IPv6 literal in brackets (as HOST:PORT needs); other hosts unchanged."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def is_wildcard(host: str) -> bool:
    return bracket(host) in ("[::]", "0.0.0.0")


def reach_host(bind_host: str) -> str:
    """How a process on this host reaches a listener bound on ``bind_host``."""
    if is_wildcard(bind_host) or bind_host == "localhost":
        return LOOPBACK
    return bracket(bind_host)


def parse_host_or_host_port(value: str, what: str) -> tuple[str, int | None]:
    """``HOST`` or ``HOST:PORT`` (``[v6]``, ``[v6]:PORT`` and a bare ``::1`` too); port 0 allowed."""
    value = value.strip()
    if not value:
        raise ConfigError(f"{what} is empty: give HOST or HOST:PORT")
    if value.startswith("["):
        if value.endswith("]"):
            return value, None
    elif value.count(":") == 0:
        return value, None
    elif value.count(":") > 1:  # a bare IPv6 address: no port
        return bracket(value), None
    host, port = parse_host_port(value, what, allow_zero=True)
    return host, port


@dataclass(frozen=True)
class Listeners:
    """One kind of port of every node: the host it binds, the host it is reached at, the ports."""

    bind_host: str
    reach_host: str
    ports: tuple[int, ...]

    @property
    def wildcard(self) -> bool:
        return is_wildcard(self.bind_host)

    def bind(self, i: int) -> str:
        return f"{self.bind_host}:{self.ports[i]}"

    def reach(self, i: int) -> str:
        return f"{self.reach_host}:{self.ports[i]}"

    def describe(self) -> str:
        """Where these ports listen, for the banner: ``[::] (every interface)``."""
        if self.wildcard:
            return f"{self.bind_host} (every interface)"
        if self.bind_host.startswith("127.") or self.bind_host in ("[::1]", "localhost"):
            return f"{self.bind_host} (this host only)"
        return self.bind_host


@dataclass(frozen=True)
class AddressPlan:
    client: Listeners
    raft: Listeners
    http: Listeners
    picked: bool  # some ports were picked by the kernel (port 0): print them

    def every_port(self) -> list[tuple[str, str, int]]:
        """(kind, bind host, port) of every listener."""
        return [(kind, ls.bind_host, p) for kind, ls in (("client", self.client), ("raft", self.raft),
                                                         ("http", self.http)) for p in ls.ports]


def plan_addresses(nodes: int, bind: str, http_bind: str | None, raft_port: int | None,
                   pick_ports: Callable[[int, str], list[int]]) -> AddressPlan:
    """Where ``up``'s nodes listen.

    ``--bind HOST:PORT``: node i's client port is PORT + i on HOST (as torchft_lighthouse binds
    it: ``[::]`` is every interface). Raft is node-to-node on this host only: it binds the host
    the client ports are reached at (127.0.0.1 for a wildcard), on ``--raft-port`` (default
    PORT + 100) + i. ``--http-bind HOST`` or ``HOST:PORT`` (default: --bind's host, PORT + 200):
    node i's HTTP port. Port 0 (in --bind or --http-bind) takes ports ``pick_ports(n, host)``
    picks. Raises ConfigError with a one-line reason.
    """
    host, port = parse_host_port(bind, "--bind", allow_zero=True)
    host = "127.0.0.1" if host == "localhost" else bracket(host)
    if http_bind is not None:
        http_host, http_port = parse_host_or_host_port(http_bind, "--http-bind")
        http_host = "127.0.0.1" if http_host == "localhost" else http_host
    else:
        http_host, http_port = host, None
    local = reach_host(host)
    picked = False
    if port == 0:
        fresh = pick_ports(3 * nodes, local)
        picked = True
        client = fresh[:nodes]
        raft = [raft_port + i for i in range(nodes)] if raft_port else fresh[nodes:2 * nodes]
        http = fresh[2 * nodes:]
    else:
        client = [port + i for i in range(nodes)]
        raft = [(raft_port or port + 100) + i for i in range(nodes)]
        http = [port + 200 + i for i in range(nodes)]
    if http_port == 0:
        http = pick_ports(nodes, reach_host(http_host))
        picked = True
    elif http_port is not None:
        http = [http_port + i for i in range(nodes)]
    for what, ports in (("--bind", client), ("--raft-port", raft), ("--http-bind", http)):
        if ports[-1] > 65535:
            raise ConfigError(f"{what}: {nodes} nodes need ports {ports[0]}-{ports[-1]}, past 65535")
    plan = AddressPlan(client=Listeners(host, local, tuple(client)), raft=Listeners(local, local, tuple(raft)),
                       http=Listeners(http_host, reach_host(http_host), tuple(http)), picked=picked)
    seen: dict[int, str] = {}
    for kind, _host, p in plan.every_port():
        if p in seen:
            raise ConfigError(f"port {p} would serve both {seen[p]} and {kind}: pick other ports")
        seen[p] = kind
    return plan


@dataclass
class Stable:
    """Has the same value been observed, without a gap, for ``hold_s``? (None never is.)"""

    hold_s: float
    value: Hashable | None = None
    since: float | None = None

    def observe(self, value: Hashable | None, now: float) -> bool:
        if value is None or value != self.value:
            self.value, self.since = value, now
        return value is not None and self.since is not None and now - self.since >= self.hold_s


# -- --job -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class UpJob:
    """A job ``up`` creates: ``port`` is node 1's own client port for it (None: reached by name
    only); node i serves it on ``port + i``."""

    name: str
    port: int | None = None

    def ports(self, node_ids: Sequence[str]) -> tuple[tuple[str, int], ...]:
        """(node id, port) of every node; empty without a port."""
        if self.port is None:
            return ()
        return tuple((node, self.port + i) for i, node in enumerate(node_ids))


def plan_jobs(values: Sequence[str], nodes: int, taken: Iterable[int] = ()) -> tuple[UpJob, ...]:
    """``--job NAME[=PORT]`` values as jobs. Raises ConfigError with a one-line reason: a bad
    name, the default job, a name given twice, a port out of range (PORT + nodes - 1 too), or
    ports that are also a node's client, Raft or HTTP port (``taken``) or another job's."""
    jobs: list[UpJob] = []
    used = {p: "a node's own port" for p in taken}
    for value in values:
        name, sep, port_text = value.partition("=")
        try:
            check_job_name(name)
        except JobError as e:
            raise ConfigError(f"--job {value}: {e}") from None
        if name == DEFAULT_JOB:
            raise ConfigError(f"--job {value}: the {DEFAULT_JOB} job is the cluster's own (its client ports); "
                              "name another job")
        if any(j.name == name for j in jobs):
            raise ConfigError(f"--job {name} is given twice")
        port: int | None = None
        if sep:
            try:
                port = int(port_text)
            except ValueError:
                raise ConfigError(f"--job {value}: give NAME or NAME=PORT (PORT a number)") from None
            last = port + nodes - 1
            if not 0 < port or last > 65535:
                raise ConfigError(f"--job {value}: {nodes} nodes need ports {port}-{last}, within 1-65535")
            for p in range(port, last + 1):
                if p in used:
                    raise ConfigError(f"--job {value}: port {p} is {used[p]} already: pick another PORT")
                used[p] = f"job {name}'s"
        jobs.append(UpJob(name, port))
    return tuple(jobs)


def job_banner(job: UpJob, node_ids: Sequence[str], reach_host: str, endpoints: str, tls: bool) -> list[str]:
    """What ``up`` prints for ``job``: its ports, then the environment a torchft trainer (one
    URL: the job's port on the first node) and an ftclient trainer (every node, and the job's
    name) set to train as the job."""
    ports = job.ports(node_ids)
    where = ", ".join(f"{node}={port}" for node, port in ports) if ports else "no own port"
    lines = [f"job {job.name} ({where}):"]
    if tls:
        pass  # torchft's lighthouse client speaks plaintext only; the main banner says so
    elif ports:
        lines.append(f"  torchft trainers:  export TORCHFT_LIGHTHOUSE=http://{reach_host}:{ports[0][1]}")
    else:
        lines.append(f"  torchft trainers:  select a job by its port: up --job {job.name}=PORT")
    lines.append(f"  ftclient trainers: export TORCHFT_LIGHTHOUSE={endpoints} {FTCLIENT_JOB_ENV}={job.name}")
    return lines


# -- the whole request -----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class UpRequest:
    """What ``up`` was asked for: one field per option of ``lighthouse-cluster up``, named as
    its click parameter, with its default."""

    min_replicas: int
    nodes: int = 3
    bind: str = "[::]:29510"
    http_bind: str | None = None
    raft_port: int | None = None
    data_dir: Path | None = None  # None: a temporary directory, removed on exit
    log_dir: Path | None = None  # None: data_dir, else a new directory kept after exit
    no_restart: bool = False
    join_timeout_ms: int = DEFAULT_JOIN_TIMEOUT_MS
    quorum_tick_ms: int = DEFAULT_QUORUM_TICK_MS
    heartbeat_timeout_ms: int = DEFAULT_HEARTBEAT_TIMEOUT_MS
    tls: bool = False
    mtls: bool = False
    admin_token: str | None = None
    quorum_lease_ms: int | None = None
    liveness_timeout_ms: int = DEFAULT_LIVENESS_TIMEOUT_MS
    jobs: tuple[str, ...] = ()  # --job NAME[=PORT]
    job_port_processes: bool = False
    demo: bool = False
    demo_replicas: int = 3
    demo_kill_every: float = 8.0
    log_level: str = "info"


@dataclass(frozen=True)
class UpPlan:
    """A checked request: where every node listens and the jobs to create."""

    request: UpRequest
    addresses: AddressPlan
    jobs: tuple[UpJob, ...]

    @property
    def node_ids(self) -> list[str]:
        return [f"n{i + 1}" for i in range(self.request.nodes)]


def plan_up(request: UpRequest, pick_ports: Callable[[int, str], list[int]],
            can_bind: Callable[[str, int], bool]) -> UpPlan:
    """Check ``request`` before anything starts; ``can_bind(host, port)`` says whether a port is
    free. Raises ConfigError with a one-line reason."""
    r = request
    if r.nodes % 2 == 0:
        raise ConfigError(f"--nodes {r.nodes}: use an odd number so a majority survives a split")
    if r.demo and (r.tls or r.mtls):
        raise ConfigError("--demo's simulated replica groups speak plaintext: drop --tls/--mtls")
    addresses = plan_addresses(r.nodes, r.bind, r.http_bind, r.raft_port, pick_ports)
    jobs = plan_jobs(r.jobs, r.nodes, [p for _kind, _host, p in addresses.every_port()])
    plan = UpPlan(r, addresses, jobs)
    job_ports = [("job", addresses.client.bind_host, p) for j in jobs for _node, p in j.ports(plan.node_ids)]
    busy = [f"{p} ({kind} on {host})" for kind, host, p in addresses.every_port() + job_ports if not can_bind(host, p)]
    if busy:
        raise ConfigError(f"ports already in use: {', '.join(busy)} (pick another --bind, or HOST:0 for free ports)")
    return plan


def picked_ports_line(plan: UpPlan) -> str | None:
    """The line saying which ports the kernel picked (port 0), or None when none were."""
    a, r = plan.addresses, plan.request
    if not a.picked:
        return None
    flag = f"--bind {r.bind}" if r.bind.strip().endswith(":0") else f"--http-bind {r.http_bind}"
    return (f"{flag}: chose client ports {','.join(map(str, a.client.ports))}, "
            f"raft ports {','.join(map(str, a.raft.ports))}, "
            f"http ports {','.join(map(str, a.http.ports))}")


def listening(kind: str, ls: Listeners) -> str:
    """``client on [::] (every interface; reached here at 127.0.0.1)``: what the ports bind."""
    where = ls.describe()
    if ls.reach_host != ls.bind_host:
        where = where[:-1] + f"; reached here at {ls.reach_host})" if where.endswith(")") else \
            f"{where} (reached here at {ls.reach_host})"
    return f"{kind} on {where}"
