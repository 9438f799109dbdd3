"""Node configuration: peers, addresses, secrets, quorum options and declared jobs, validated in
one place.

Pure parsing and validation; the CLI maps flags, environment variables and a TOML config file
onto ``ServeOptions`` (one field per ``serve`` option), ``build_node_config`` validates those
into the node's ``NodeConfig``, and every error is a ``ConfigError`` with a one-line reason. Jobs
declared in the config file (``[[jobs]]`` tables, ``parse_declared_jobs``) become ``JobSpec``s
checked by ``core/jobs.py``'s rules, with the settings a ``jobs add`` on this node would give them
where the table leaves one out.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping

from lighthouse_cluster.core.codec import MEMBERS_SCHEMA_VERSION as MIN_WRITABLE_VERSION
from lighthouse_cluster.core.codec import SCHEMA_VERSION
from lighthouse_cluster.core.defaults import (
    DEFAULT_HEARTBEAT_TIMEOUT_MS,
    DEFAULT_JOIN_TIMEOUT_MS,
    DEFAULT_QUORUM_TICK_MS,
)
from lighthouse_cluster.core.jobs import (
    ALL_NODES,
    DEFAULT_JOB,
    SETTING_NAMES,
    JobError,
    JobSettings,
    JobSpec,
    check_job_name,
    parse_ports,
    reserved_port_clash,
)
from lighthouse_cluster.core.kv_store import DEFAULT_IDLE_EXPIRY_S
from lighthouse_cluster.core.lease import DEFAULT_LEASE_MS, default_lease_ms
from lighthouse_cluster.core.quorum import QuorumOptions
from lighthouse_cluster.raft.replication import RaftSettings
from lighthouse_cluster.tls import ClientTLS, ServerTLS, TLSConfigError

DEFAULT_CLIENT_PORT = 29510
# How long the Raft leader waits with no client before it heartbeats slowly (raft/extensions/quiescence.py).
DEFAULT_QUIESCE_AFTER_MS = round(RaftSettings().quiet_after_s * 1000)
MAX_QUIESCE_AFTER_MS = 3_600_000
# --rendezvous-idle-expiry-s: at most a year.
MAX_IDLE_EXPIRY_S = 365 * 86400.0
# --job-port-process-nice: a job port process runs this many steps of CPU priority below its node
# (job_port_process.lower_priority); 19 is the lowest priority Linux has.
DEFAULT_JOB_PORT_PROCESS_NICE = 10
MAX_JOB_PORT_PROCESS_NICE = 19
# A longer lease only lengthens failovers (a new leader waits it out).
MAX_LEASE_MS = 10_000
MAX_MEMBER_BYTES = 64 * 1024
# --liveness-timeout-ms: a liveness stream without a keep-alive for this long is a dead replica.
DEFAULT_LIVENESS_TIMEOUT_MS = 500
MIN_LIVENESS_TIMEOUT_MS = 50  # the leader checks every 50 ms
MAX_LIVENESS_TIMEOUT_MS = 60_000


class ConfigError(ValueError):
    """A configuration value that cannot work; the message says which and why."""


@dataclass(frozen=True, slots=True)
class PeerSpec:
    """A member of the cluster: its id, Raft address and client (gRPC) address."""

    node_id: str
    raft_address: str
    client_address: str

    def __str__(self) -> str:
        return f"{self.node_id}={self.raft_address},{self.client_address}"


_NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def parse_host_port(value: str, what: str, *, allow_zero: bool = False) -> tuple[str, int]:
    """Split ``host:port`` (``[v6]:port`` too); raise ConfigError with a clear reason.
    ``allow_zero``: port 0 (pick free ports) is accepted."""
    value = value.strip()
    if value.startswith("http://") or value.startswith("https://"):
        value = value.split("://", 1)[1].rstrip("/")
    host, sep, port = value.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"{what} {value!r} is not HOST:PORT")
    try:
        port_no = int(port)
    except ValueError:
        raise ConfigError(f"{what} {value!r} has a non-numeric port") from None
    if allow_zero and port_no == 0:
        return host, 0
    if not 0 < port_no < 65536:
        raise ConfigError(f"{what} {value!r} has a port outside {'0' if allow_zero else '1'}-65535")
    return host, port_no


def normalize_address(value: str, what: str) -> str:
    host, port = parse_host_port(value, what)
    return f"{host}:{port}"


def parse_peer(value: str) -> PeerSpec:
    """Parse ``ID=RAFT_HOST:PORT,CLIENT_HOST:PORT``."""
    node_id, sep, rest = value.strip().partition("=")
    if not sep:
        raise ConfigError(f"peer {value!r} is not ID=RAFT_HOST:PORT,CLIENT_HOST:PORT")
    addresses = rest.split(",")
    if len(addresses) != 2:
        raise ConfigError(f"peer {value!r} needs a Raft and a client address: ID=RAFT_HOST:PORT,CLIENT_HOST:PORT")
    check_node_id(node_id)
    return PeerSpec(node_id=node_id, raft_address=normalize_address(addresses[0], f"peer {node_id} Raft address"),
                    client_address=normalize_address(addresses[1], f"peer {node_id} client address"))


def check_node_id(node_id: str) -> str:
    if not _NODE_ID.match(node_id):
        raise ConfigError(f"node id {node_id!r} must be 1-63 letters, digits, '.', '_' or '-'")
    return node_id


@dataclass(frozen=True)
class NodeConfig:
    """Everything one node process needs."""

    node_id: str
    peers: tuple[PeerSpec, ...]
    client_bind: str
    raft_bind: str | None
    data_dir: Path | None
    secret: str | None = field(repr=False)  # never printed
    options: QuorumOptions
    quorum_tick_ms: int = DEFAULT_QUORUM_TICK_MS
    # --quorum-lease-ms: fast quorums are issued without a Raft commit while a majority has
    # confirmed this leader within the lease; a new leader waits this long (lease.py). 0: off.
    quorum_lease_ms: int = DEFAULT_LEASE_MS
    # --liveness-timeout-ms: a replica whose liveness stream (Watch) sent no keep-alive for this
    # long is declared dead (a closed stream is one at once); see liveness_streams.py.
    liveness_timeout_ms: int = DEFAULT_LIVENESS_TIMEOUT_MS
    # --watch-manager-connections: the leader watches a connection to every running quorum
    # member's manager server and declares the member dead when it closes and is refused
    # (torchft trainers' deaths; see manager_connections.py).
    watch_manager_connections: bool = True
    raft: RaftSettings = field(default_factory=RaftSettings)
    max_member_bytes: int = MAX_MEMBER_BYTES  # a serialized QuorumMember, every field counted
    # The newest replicated schema this node writes and reports (--schema-version, hidden: below
    # codec.SCHEMA_VERSION only to act as an older version in rolling-upgrade tests).
    schema_version: int = SCHEMA_VERSION
    # --raft-dial: (peer id, HOST:PORT) pairs; that peer is dialed there, its identity stays
    # its Raft address.
    raft_dial: tuple[tuple[str, str], ...] = ()
    # --http-bind: /metrics, /livez, /readyz, the dashboard; None = no HTTP port.
    http_bind: str | None = None
    # --admin-token: required by the admin RPCs and the dashboard's kill button; never printed
    # (repr=False). None: those are refused.
    admin_token: str | None = field(default=None, repr=False)
    # --tls-cert/--tls-key[/--tls-client-ca]: the client port serves TLS (None: plaintext).
    tls: ServerTLS | None = field(default=None, repr=False)
    # How this node dials its peers' client ports (forwarding, heartbeat batches).
    peer_tls: ClientTLS | None = field(default=None, repr=False)
    # --join: joins a running cluster (even peer counts allowed; no elections before a leader
    # is heard of while the journal is empty).
    join: bool = False
    # [[jobs]] in the config file: the serving leader creates each one the cluster does not have
    # yet (job_creation.py); an existing job is never changed by it.
    jobs: tuple[JobSpec, ...] = ()
    # --auto-create-jobs: the leader creates an unknown job on its first use (a Quorum call, a
    # heartbeat, a Watch naming it) with new_job_settings; off: unknown jobs are NOT_FOUND.
    auto_create_jobs: bool = False
    # --job-port-processes: each job port is served by a process of its own (job_port_process.py)
    # rather than on this node's event loop.
    job_port_processes: bool = False
    # --job-port-process-nice: steps of CPU priority the port processes run below this node.
    job_port_process_nice: int = DEFAULT_JOB_PORT_PROCESS_NICE
    # --unsafe-no-fsync: nothing in the data directory is fsynced (raft/durable_journal.py); a
    # power loss can then lose acknowledged quorums. Tests and benchmarks only; never the default.
    unsafe_no_fsync: bool = False
    # --rendezvous-idle-expiry-s: the serving leader drops a rendezvous namespace (job, run id)
    # that no write touched for this long (server/kv_service.py).
    rendezvous_idle_expiry_s: float = DEFAULT_IDLE_EXPIRY_S

    @property
    def new_job_settings(self) -> JobSettings:
        """The settings a job is created with unless it is given others (``jobs add``, a declared
        job, an auto-created one): this node's quorum flags, and ``JobSettings``' own limit on
        replica groups."""
        o = self.options
        return JobSettings(min_replicas=o.min_replicas, join_timeout_ms=o.join_timeout_ms,
                           quorum_tick_ms=self.quorum_tick_ms, heartbeat_timeout_ms=o.heartbeat_timeout_ms,
                           quorum_lease_ms=self.quorum_lease_ms, max_member_bytes=self.max_member_bytes)

    @functools.cached_property
    def self_peer(self) -> PeerSpec:  # cached: read on every forwarded call (a frozen config)
        return next(p for p in self.peers if p.node_id == self.node_id)

    @functools.cached_property
    def reserved_ports(self) -> dict[str, dict[int, str]]:
        """The ports each node listens on for itself (node id -> {port: what}), as far as this
        node's configuration knows them: every peer's client and Raft ports, and this node's
        binds and HTTP port. No job may be given one of these (``reserved_port_clash``)."""
        reserved: dict[str, dict[int, str]] = {}
        for peer in self.peers:
            own = reserved.setdefault(peer.node_id, {})
            own[parse_host_port(peer.raft_address, "Raft address")[1]] = "Raft port"
            own[parse_host_port(peer.client_address, "client address")[1]] = "client port"
        mine = reserved.setdefault(self.node_id, {})
        for address, what in ((self.raft_bind, "Raft port"), (self.client_bind, "client port"),
                              (self.http_bind, "HTTP port")):
            if address is not None:
                mine[parse_host_port(address, what)[1]] = what
        return reserved

    @property
    def other_peers(self) -> tuple[PeerSpec, ...]:
        return tuple(p for p in self.peers if p.node_id != self.node_id)

    def peer_by_raft_address(self, address: str | None) -> PeerSpec | None:
        return next((p for p in self.peers if p.raft_address == address), None)

    @property
    def raft_dial_by_address(self) -> dict[str, str]:
        """``--raft-dial`` as peer Raft address -> HOST:PORT to connect to instead."""
        by_id = {p.node_id: p.raft_address for p in self.peers}
        return {by_id[node_id]: target for node_id, target in self.raft_dial}


def parse_raft_dial(values: list[str] | tuple[str, ...], peers: tuple[PeerSpec, ...],
                    node_id: str) -> tuple[tuple[str, str], ...]:
    """Parse ``--raft-dial ID=HOST:PORT`` values against the peers: every id must be another
    peer, at most once."""
    ids = [p.node_id for p in peers]
    seen: dict[str, str] = {}
    for value in values:
        peer_id, sep, target = value.strip().partition("=")
        if not sep or not peer_id or not target:
            raise ConfigError(f"--raft-dial {value!r} is not ID=HOST:PORT")
        if peer_id not in ids:
            raise ConfigError(f"--raft-dial {value!r}: no peer has id {peer_id!r} (peers: {ids})")
        if peer_id == node_id:
            raise ConfigError(f"--raft-dial {value!r}: {peer_id} is this node, which never dials itself")
        if peer_id in seen:
            raise ConfigError(f"--raft-dial given twice for {peer_id}")
        seen[peer_id] = normalize_address(target, f"--raft-dial {peer_id} address")
    return tuple(seen.items())


_JOB_TABLE_KEYS = ("name", "port", "ports", "config", *SETTING_NAMES)


def _declared_ports(where: str, table: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    """``port = 29600`` / ``port = "n1=29601"``, or ``ports = [...]`` (or one string, entries
    separated by commas or spaces) as port entries."""
    if "port" in table and "ports" in table:
        raise ConfigError(f"{where}: give either port or ports, not both")
    value = table.get("port", table.get("ports", ()))
    if isinstance(value, str):
        items: list[Any] = [v for v in re.split(r"[,\s]+", value.strip()) if v]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        items = [value]
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (int, str)):
            raise ConfigError(f"{where}: port {item!r} is not PORT or \"NODE=PORT\"")
    try:
        return parse_ports(str(item) for item in items)
    except JobError as e:
        raise ConfigError(f"{where}: {e}") from None


def _declared_config(where: str, value: Any) -> tuple[tuple[str, str], ...]:
    """A ``[jobs.config]`` table (or ``config = {key = "value"}``): strings, and numbers or
    booleans written as TOML would (``lr = 0.1`` is ``"0.1"``)."""
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: config must be a table of KEY = VALUE, got {value!r}")
    out: dict[str, str] = {}
    for key, v in value.items():
        if isinstance(v, bool):
            out[key] = "true" if v else "false"
        elif isinstance(v, (str, int, float)):
            out[key] = str(v)
        else:
            raise ConfigError(f"{where}: config value of {key!r} must be a string, number or boolean, got {v!r}")
    return tuple(sorted(out.items()))


def parse_declared_jobs(tables: Any, base: JobSettings, node_id: str | None = None,
                        reserved_ports: Mapping[str, Mapping[int, str]] | None = None) -> tuple[JobSpec, ...]:
    """The ``[[jobs]]`` tables of a config file as ``JobSpec``s, each setting it leaves out taken
    from ``base``. ``reserved_ports``: the nodes' own ports (``NodeConfig.reserved_ports``), which
    a job's port on that node may not be. ``ConfigError`` naming the table on the first problem."""
    if tables is None:
        return ()
    if isinstance(tables, dict):
        tables = [tables]
    if not isinstance(tables, (list, tuple)):
        raise ConfigError(f"jobs must be an array of tables ([[jobs]]), got {tables!r}")
    specs: list[JobSpec] = []
    seen: set[str] = set()
    for i, table in enumerate(tables):
        where = f"[[jobs]] #{i + 1}"
        if not isinstance(table, dict):
            raise ConfigError(f"{where} is not a table: {table!r}")
        name = table.get("name")
        if name is None:
            raise ConfigError(f"{where} has no name")
        where = f"[[jobs]] {name!r}"
        unknown = sorted(set(table) - set(_JOB_TABLE_KEYS))
        if unknown:
            raise ConfigError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(_JOB_TABLE_KEYS)})")
        try:
            check_job_name(name)
            if name == DEFAULT_JOB:
                raise JobError(f"the {DEFAULT_JOB} job is not declared: its settings are the serve flags")
            if name in seen:
                raise JobError(f"job {name!r} is declared twice")
            seen.add(name)
            settings = base.updated({k: table[k] for k in SETTING_NAMES if k in table})
            spec = JobSpec(name=name, settings=settings, ports=_declared_ports(where, table),
                           config=_declared_config(where, table.get("config", {}))).check()
        except JobError as e:
            raise ConfigError(f"{where}: {e}") from None
        clash = reserved_port_clash(spec, reserved_ports or {})
        if clash is not None:
            raise ConfigError(f"{where}: {clash}")
        specs.append(spec)
    _check_port_clashes(specs, node_id)
    return tuple(specs)


def _check_port_clashes(specs: list[JobSpec], node_id: str | None) -> None:
    """No two declared jobs may listen on one port of one node (this one, every node an entry
    names, and a node no entry names, which takes the ``*`` ports)."""
    nodes = {n for spec in specs for n, _ in spec.ports} | ({node_id} if node_id is not None else set())
    for node in sorted(nodes):
        owners: dict[int, str] = {}
        for spec in specs:
            port = spec.port_for(node)
            if port is None:
                continue
            if port in owners:
                on = "every node" if node == ALL_NODES else f"node {node}"
                raise ConfigError(f"[[jobs]] {spec.name!r}: port {port} on {on} is also job {owners[port]!r}'s")
            owners[port] = spec.name


def _int_between(value: Any, low: int, high: int) -> bool:
    """``value`` is an int (not a bool: TOML and click can hand those over) in ``[low, high]``."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


@dataclass(frozen=True, kw_only=True)
class ServeOptions:
    """``serve``'s options as given (flags, environment variables, the ``--config`` file), before
    validation: one field per option, named as the option's click parameter (``--node-id`` is
    ``node_id``, ``--peer`` is ``peers``), with the option's default. ``build_node_config``
    validates them into a ``NodeConfig``. A new option is a ``serve`` click option and a field
    here; a field ``NodeConfig`` has under the same name is copied as given, unless
    ``build_node_config`` derives it (see ``_derived_fields``)."""

    node_id: str
    peers: tuple[str, ...] | list[str]  # ID=RAFT_HOST:PORT,CLIENT_HOST:PORT, this node's included
    client_bind: str | None = None
    raft_bind: str | None = None
    raft_dial: tuple[str, ...] | list[str] = ()  # ID=HOST:PORT
    data_dir: Path | None = None
    secret: str | None = field(default=None, repr=False)
    insecure: bool = False
    http_bind: str | None = None
    admin_token: str | None = field(default=None, repr=False)
    tls_cert: str | Path | None = None
    tls_key: str | Path | None = None
    tls_client_ca: str | Path | None = None
    tls_ca: str | Path | None = None
    join: bool = False
    # torchft_lighthouse's own flags
    min_replicas: int
    join_timeout_ms: int = DEFAULT_JOIN_TIMEOUT_MS
    quorum_tick_ms: int = DEFAULT_QUORUM_TICK_MS
    heartbeat_timeout_ms: int = DEFAULT_HEARTBEAT_TIMEOUT_MS
    election_timeout_ms: int | None = None  # None: RaftSettings' (150)
    quiesce_after_ms: int = DEFAULT_QUIESCE_AFTER_MS
    quorum_lease_ms: int | None = None  # None: lease.default_lease_ms(election_timeout_ms)
    rendezvous_idle_expiry_s: float = DEFAULT_IDLE_EXPIRY_S
    liveness_timeout_ms: int = DEFAULT_LIVENESS_TIMEOUT_MS
    watch_manager_connections: bool = True
    auto_create_jobs: bool = False
    job_port_processes: bool = False
    job_port_process_nice: int = DEFAULT_JOB_PORT_PROCESS_NICE
    unsafe_no_fsync: bool = False
    schema_version: int = SCHEMA_VERSION


def build_node_config(options: ServeOptions | None = None, /, *, jobs: Any = None, **given: Any) -> NodeConfig:
    """Validate ``options`` (or ``ServeOptions(**given)``) and the config file's ``[[jobs]]``
    tables into a NodeConfig, or raise ConfigError naming the problem."""
    o = options if options is not None else ServeOptions(**given)
    derived = _derived_fields(o)
    same_named = {f.name: getattr(o, f.name) for f in fields(ServeOptions) if f.name in _NODE_CONFIG_FIELDS}
    config = NodeConfig(**{**same_named, **derived})
    if jobs is None:
        return config
    try:
        base = config.new_job_settings.check()
    except JobError as e:
        raise ConfigError(f"[[jobs]]: the serve flags cannot be a job's settings: {e}") from None
    return replace(config, jobs=parse_declared_jobs(jobs, base, o.node_id, config.reserved_ports))


def _derived_fields(o: ServeOptions) -> dict[str, Any]:
    """The ``NodeConfig`` fields that are not an option copied as given: checked, normalized or
    computed from several options. Raises ConfigError on the first problem."""
    check_node_id(o.node_id)
    specs = tuple(parse_peer(p) for p in o.peers)
    if not specs:
        raise ConfigError("no peers given: pass --peer ID=RAFT_HOST:PORT,CLIENT_HOST:PORT for every node, this one included")
    ids = [p.node_id for p in specs]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"duplicate node ids in peers: {sorted(ids)}")
    for attr in ("raft_address", "client_address"):
        values = [getattr(p, attr) for p in specs]
        if len(set(values)) != len(values):
            raise ConfigError(f"two peers share a {attr.replace('_', ' ')}: {sorted(values)}")
    if o.node_id not in ids:
        raise ConfigError(f"node id {o.node_id!r} is not among the peers {ids}")
    if len(specs) % 2 == 0 and not o.join:
        raise ConfigError(f"{len(specs)} nodes: use an odd number (3 or 5) so a majority survives a split "
                          "(a node joining a running cluster passes --join)")
    if not o.secret and not o.insecure:
        raise ConfigError("no cluster secret: set --secret/--secret-file/LIGHTHOUSE_CLUSTER_SECRET "
                          "(the Raft port carries pickled data), or pass --insecure on a trusted network")
    if o.min_replicas < 1:
        raise ConfigError("--min_replicas must be at least 1")
    for name, value in (("--join_timeout_ms", o.join_timeout_ms), ("--quorum_tick_ms", o.quorum_tick_ms),
                        ("--heartbeat_timeout_ms", o.heartbeat_timeout_ms)):
        if value <= 0:
            raise ConfigError(f"{name} must be positive, got {value}")
    self_spec = next(p for p in specs if p.node_id == o.node_id)
    bind = normalize_address(o.client_bind, "--client-bind") if o.client_bind else (
        f"[::]:{parse_host_port(self_spec.client_address, 'client address')[1]}")
    if o.election_timeout_ms is not None and o.election_timeout_ms < 50:
        raise ConfigError("--election-timeout-ms must be at least 50")
    # not given: as long as the vote refusal covers (lease.py)
    lease_ms = o.quorum_lease_ms if o.quorum_lease_ms is not None else default_lease_ms(o.election_timeout_ms)
    if not 0 <= lease_ms <= MAX_LEASE_MS:
        raise ConfigError(f"--quorum-lease-ms must be between 0 (off) and {MAX_LEASE_MS}, got {lease_ms}")
    if not _int_between(o.liveness_timeout_ms, MIN_LIVENESS_TIMEOUT_MS, MAX_LIVENESS_TIMEOUT_MS):
        raise ConfigError(f"--liveness-timeout-ms must be between {MIN_LIVENESS_TIMEOUT_MS} and "
                          f"{MAX_LIVENESS_TIMEOUT_MS}, got {o.liveness_timeout_ms!r}")
    if not MIN_WRITABLE_VERSION <= o.schema_version <= SCHEMA_VERSION:
        raise ConfigError(f"--schema-version must be between {MIN_WRITABLE_VERSION} and {SCHEMA_VERSION}, "
                          f"got {o.schema_version}")
    raft = RaftSettings.from_election_timeout_ms(o.election_timeout_ms) if o.election_timeout_ms else RaftSettings()
    expiry = o.rendezvous_idle_expiry_s
    if isinstance(expiry, bool) or not (isinstance(expiry, (int, float)) and 0 < expiry <= MAX_IDLE_EXPIRY_S):
        raise ConfigError(f"--rendezvous-idle-expiry-s must be a number of seconds above 0 and at most "
                          f"{MAX_IDLE_EXPIRY_S:g} (a year), got {o.rendezvous_idle_expiry_s!r}")
    if not _int_between(o.quiesce_after_ms, 0, MAX_QUIESCE_AFTER_MS):
        raise ConfigError(f"--quiesce-after-ms must be between 0 (never) and {MAX_QUIESCE_AFTER_MS}, "
                          f"got {o.quiesce_after_ms!r}")
    raft = replace(raft, quiet_after_s=o.quiesce_after_ms / 1000.0)
    if not _int_between(o.job_port_process_nice, 0, MAX_JOB_PORT_PROCESS_NICE):
        raise ConfigError(f"--job-port-process-nice must be between 0 (the node's priority) and "
                          f"{MAX_JOB_PORT_PROCESS_NICE}, got {o.job_port_process_nice!r}")
    dial = parse_raft_dial(o.raft_dial, specs, o.node_id)
    http = normalize_address(o.http_bind, "--http-bind") if o.http_bind else None
    try:
        server_tls = ServerTLS.from_files(o.tls_cert, o.tls_key, o.tls_client_ca)
        # Peers are dialed with this node's own certificate (when they require one) and trust
        # --tls-ca, else the client CA, else the system's roots.
        peer_tls = None if server_tls is None else ClientTLS(
            root_ca=ClientTLS.from_files(o.tls_ca).root_ca if o.tls_ca else server_tls.client_ca,
            client_cert=server_tls.cert_chain, client_key=server_tls.private_key)
    except TLSConfigError as e:
        raise ConfigError(str(e)) from None
    if o.tls_ca and server_tls is None:
        raise ConfigError("--tls-ca is for dialing TLS peers: it needs --tls-cert and --tls-key too")
    if http is not None and http in (bind, self_spec.client_address):
        raise ConfigError(f"--http-bind {http} is the client (gRPC) address; give the HTTP port its own port")
    return dict(
        peers=specs,
        client_bind=bind,
        raft_bind=normalize_address(o.raft_bind, "--raft-bind") if o.raft_bind else None,
        secret=o.secret or None,
        options=QuorumOptions(min_replicas=o.min_replicas, join_timeout_ms=o.join_timeout_ms,
                              heartbeat_timeout_ms=o.heartbeat_timeout_ms),
        quorum_lease_ms=lease_ms,
        raft=raft,
        raft_dial=dial,
        http_bind=http,
        admin_token=o.admin_token or None,
        tls=server_tls,
        peer_tls=peer_tls,
        auto_create_jobs=bool(o.auto_create_jobs),
        job_port_processes=bool(o.job_port_processes),
    )


_NODE_CONFIG_FIELDS = frozenset(f.name for f in fields(NodeConfig))
