"""Jobs: named quorum namespaces that share one cluster, as values and rules.

A *job* is what one torchft training job needs of a lighthouse: its own quorum settings, quorum
ids, last quorum, heartbeats, pending requesters and liveness. One cluster serves many jobs; the
cluster's historical behaviour is the job named ``default`` (``DEFAULT_JOB``), whose quorum
settings are the node's own flags (``serve --min_replicas ...``), so nothing changes for users
who never name a job.

This module owns the job's description, ``JobSpec`` (settings, client ports, configuration),
and every rule about what a valid one is: names, setting ranges, ports, the configuration map's
limits. Pure: no clock, no I/O; the state machine replicates specs and the server acts on them.
Every violation is a ``JobError`` whose message names the value and the limit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace
from typing import Any, Iterable, Mapping

from lighthouse_cluster.core.defaults import DEFAULT_HEARTBEAT_TIMEOUT_MS, DEFAULT_JOIN_TIMEOUT_MS, DEFAULT_QUORUM_TICK_MS

__all__ = [
    "ALL_NODES",
    "DEFAULT_JOB",
    "JOB_HEADER",
    "JobError",
    "JobSettings",
    "JobSpec",
    "check_job_name",
    "parse_config_items",
    "parse_ports",
    "port_conflict",
    "reserved_port_clash",
]

DEFAULT_JOB = "default"
# The gRPC metadata key by which a client's Quorum, Heartbeat and Watch calls name their job
# (absent: the default job, or the job of the port called).
JOB_HEADER = "x-lighthouse-job"
# A port entry for every node (``--port 29600``); otherwise the entry names one node.
ALL_NODES = "*"

MAX_JOBS = 256
# Removed jobs whose last quorum id the replicated state keeps by name (state_machine.py).
MAX_RETIRED_JOBS = 10_000
MAX_CONFIG_KEYS = 64
MAX_CONFIG_KEY_CHARS = 128
MAX_CONFIG_VALUE_BYTES = 4096
MAX_CONFIG_BYTES = 64 * 1024
MAX_PORTS = 16
# Upper bounds of the settings (the node's flags have the same or looser ones).
MAX_REPLICAS_LIMIT = 65_536
MAX_MEMBER_BYTES_LIMIT = 64 * 1024
MAX_TIMEOUT_MS = 24 * 3600 * 1000
MAX_LEASE_MS = 10_000

# Matched with ``fullmatch``: ``$`` also matches before a final newline ("job\n" would pass).
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_CONFIG_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-/]*")


class JobError(ValueError):
    """A job description or request that cannot be accepted; the message says why."""


def check_job_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise JobError(f"job name {name!r} must be 1-63 letters, digits, '.', '_' or '-', starting with a "
                       "letter or digit")
    return name


@dataclass(frozen=True, slots=True)
class JobSettings:
    """A job's quorum settings: torchft's lighthouse flags, the lease, and the job's limits.

    ``quorum_lease_ms``: fast quorums of this job go out on the leader's lease (0: every round
    is committed); the effective lease is at most the node's ``--quorum-lease-ms``.
    ``max_replicas``: replica groups the job may have at once (heartbeating or asking);
    ``max_member_bytes``: the largest serialized ``QuorumMember`` it accepts."""

    min_replicas: int = 1
    join_timeout_ms: int = DEFAULT_JOIN_TIMEOUT_MS
    quorum_tick_ms: int = DEFAULT_QUORUM_TICK_MS
    heartbeat_timeout_ms: int = DEFAULT_HEARTBEAT_TIMEOUT_MS
    quorum_lease_ms: int = 100
    max_replicas: int = 4096
    max_member_bytes: int = MAX_MEMBER_BYTES_LIMIT

    def check(self) -> JobSettings:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise JobError(f"{f.name} must be an integer, got {v!r}")
        bounds = {
            "min_replicas": (1, MAX_REPLICAS_LIMIT), "join_timeout_ms": (1, MAX_TIMEOUT_MS),
            "quorum_tick_ms": (1, 60_000), "heartbeat_timeout_ms": (1, MAX_TIMEOUT_MS),
            "quorum_lease_ms": (0, MAX_LEASE_MS), "max_replicas": (1, MAX_REPLICAS_LIMIT),
            "max_member_bytes": (64, MAX_MEMBER_BYTES_LIMIT),
        }
        for name, (lo, hi) in bounds.items():
            v = getattr(self, name)
            if not lo <= v <= hi:
                raise JobError(f"{name} must be between {lo} and {hi}, got {v}")
        if self.min_replicas > self.max_replicas:
            raise JobError(f"min_replicas {self.min_replicas} is above max_replicas {self.max_replicas}")
        return self

    def updated(self, changes: Mapping[str, int]) -> JobSettings:
        """These settings with ``changes`` (setting name -> value) applied and checked."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise JobError(f"unknown job setting {unknown[0]!r} (known: {', '.join(sorted(known))})")
        return replace(self, **dict(changes)).check()

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


SETTING_NAMES = tuple(f.name for f in fields(JobSettings))


@dataclass(frozen=True, slots=True)
class JobSpec:
    """What the cluster replicates about a job.

    ``settings`` is None only for the default job, whose settings are each node's flags.
    ``ports``: (node id or ``ALL_NODES``, port) pairs: extra client ports serving
    ``torchft.LighthouseService`` for this job only, so unchanged torchft trainers select the
    job by port; a node-specific entry wins over ``ALL_NODES`` for that node.
    ``config``: (key, value) pairs, sorted by key: configuration shared with the job's trainers
    (torchft #130), read by ``ftclient.Manager.job_config()``."""

    name: str
    settings: JobSettings | None = None
    ports: tuple[tuple[str, int], ...] = ()
    config: tuple[tuple[str, str], ...] = field(default=())

    def check(self) -> JobSpec:
        check_job_name(self.name)
        if self.settings is None:
            if self.name != DEFAULT_JOB:
                raise JobError(f"job {self.name!r} has no settings")
            if self.ports:
                raise JobError(f"the {DEFAULT_JOB} job is served on the node's client port: it takes no ports")
        else:
            if self.name == DEFAULT_JOB:
                raise JobError(f"the {DEFAULT_JOB} job's settings are the nodes' flags (serve --min_replicas ...)")
            self.settings.check()
        _check_ports(self.ports)
        _check_config(self.config)
        return self

    def port_for(self, node_id: str) -> int | None:
        """The extra client port ``node_id`` serves this job on, if any."""
        own = next((p for n, p in self.ports if n == node_id), None)
        return own if own is not None else next((p for n, p in self.ports if n == ALL_NODES), None)

    @property
    def config_map(self) -> dict[str, str]:
        return dict(self.config)

    def with_config(self, set_items: Mapping[str, str] = {}, unset: Iterable[str] = ()) -> JobSpec:
        cfg = self.config_map
        for key in unset:
            if key not in cfg:
                raise JobError(f"job {self.name!r} has no config key {key!r}")
            del cfg[key]
        cfg.update(set_items)
        return replace(self, config=tuple(sorted(cfg.items()))).check()


def port_conflict(spec: JobSpec, others: Iterable[JobSpec]) -> str | None:
    """Why ``spec``'s ports clash with another job's (one node would serve two jobs on one port),
    or None. Deterministic (the state machine refuses such a spec): the nodes compared are the
    ones either job names, plus any other node (where only ``ALL_NODES`` entries apply)."""
    if not spec.ports:
        return None
    for other in others:
        if other.name == spec.name or not other.ports:
            continue
        nodes = {n for n, _ in spec.ports + other.ports if n != ALL_NODES}
        for node in sorted(nodes) + [None]:
            mine = spec.port_for(node) if node is not None else spec.port_for(ALL_NODES)
            theirs = other.port_for(node) if node is not None else other.port_for(ALL_NODES)
            if mine is not None and mine == theirs:
                where = f"node {node}" if node is not None else "every node"
                return f"port {mine} on {where} is job {other.name!r}'s already"
    return None


def reserved_port_clash(spec: JobSpec, reserved: Mapping[str, Mapping[int, str]]) -> str | None:
    """Why one of ``spec``'s ports is one a node already listens on for itself, or None.
    ``reserved``: node id -> {port: what it is there ("client port", "Raft port", ...)}. Such a
    job port could never be bound: the node would retry it for as long as the job lives."""
    for node in sorted(reserved):
        port = spec.port_for(node)
        if port is not None and port in reserved[node]:
            return f"port {port} on node {node} is {node}'s {reserved[node][port]}; give the job a port of its own"
    return None


def _check_ports(ports: tuple[tuple[str, int], ...]) -> None:
    if len(ports) > MAX_PORTS:
        raise JobError(f"a job has at most {MAX_PORTS} port entries, got {len(ports)}")
    seen: set[str] = set()
    for node, port in ports:
        if node != ALL_NODES and not _NAME.fullmatch(node):
            raise JobError(f"port entry {node}={port}: {node!r} is not a node id")
        if node in seen:
            raise JobError(f"two ports given for {'every node' if node == ALL_NODES else 'node ' + node}")
        seen.add(node)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise JobError(f"port {port!r} is outside 1-65535")


def _check_config(config: tuple[tuple[str, str], ...]) -> None:
    if len(config) > MAX_CONFIG_KEYS:
        raise JobError(f"a job's config has at most {MAX_CONFIG_KEYS} keys, got {len(config)}")
    keys = [k for k, _ in config]
    if keys != sorted(set(keys)):
        raise JobError("config keys must be unique and sorted")
    total = 0
    for key, value in config:
        if not isinstance(key, str) or not _CONFIG_KEY.fullmatch(key) or len(key) > MAX_CONFIG_KEY_CHARS:
            raise JobError(f"config key {key!r} must be 1-{MAX_CONFIG_KEY_CHARS} letters, digits, '_', '.', '-' "
                           "or '/'")
        if not isinstance(value, str):
            raise JobError(f"config value of {key!r} must be a string")
        size = len(value.encode())
        if size > MAX_CONFIG_VALUE_BYTES:
            raise JobError(f"config value of {key!r} is {size} bytes; the limit is {MAX_CONFIG_VALUE_BYTES}")
        total += len(key) + size
    if total > MAX_CONFIG_BYTES:
        raise JobError(f"the job's config is {total} bytes; the limit is {MAX_CONFIG_BYTES}")


def parse_config_items(items: Iterable[str]) -> dict[str, str]:
    """``KEY=VALUE`` strings (the CLI's ``--config``) as a map; the value may contain '='."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise JobError(f"config {item!r} is not KEY=VALUE")
        out[key] = value
    return out


def parse_ports(items: Iterable[str]) -> tuple[tuple[str, int], ...]:
    """``PORT`` (every node) or ``NODE=PORT`` strings (the CLI's ``--port``) as port entries."""
    out: list[tuple[str, int]] = []
    for item in items:
        node, sep, port = item.rpartition("=")
        if not sep:
            node = ALL_NODES
        try:
            number = int(port)
        except ValueError:
            raise JobError(f"port {item!r} is not PORT or NODE=PORT") from None
        out.append((node, number))
    ports = tuple(sorted(out))
    _check_ports(ports)
    return ports


# -- msgpack form (the Raft log and snapshots; see codec.py) -----------------------------------

_SETTING_KEYS = {"min_replicas": "min", "join_timeout_ms": "join", "quorum_tick_ms": "tick",
                 "heartbeat_timeout_ms": "hb", "quorum_lease_ms": "lease", "max_replicas": "maxr",
                 "max_member_bytes": "maxb"}


def spec_to_wire(spec: JobSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"n": spec.name}
    if spec.settings is not None:
        out["s"] = {_SETTING_KEYS[k]: v for k, v in spec.settings.as_dict().items()}
    if spec.ports:
        out["p"] = [[n, p] for n, p in spec.ports]
    if spec.config:
        out["c"] = [[k, v] for k, v in spec.config]
    return out


def spec_from_wire(d: Mapping[str, Any]) -> JobSpec:
    """The spec a log entry or snapshot carries; keys a later version adds are ignored, settings
    it leaves out take their defaults."""
    s = d.get("s")
    settings = None
    if s is not None:
        if not isinstance(s, Mapping):
            raise TypeError(f"job {d.get('n')!r}: settings are a {type(s).__name__}, not a map")
        settings = JobSettings(**{k: s[w] for k, w in _SETTING_KEYS.items() if w in s})
    return JobSpec(name=str(d["n"]), settings=settings,
                   ports=tuple((str(n), int(p)) for n, p in d.get("p", ())),
                   config=tuple((str(k), str(v)) for k, v in d.get("c", ())))
