"""`lighthouse-cluster jobs add/set/remove`'s arguments as the admin requests they send.

Pure: the values click parsed in, a request (or a ``JobError`` saying what is wrong) out, so bad
local input (a bad name, port, setting or ``KEY=VALUE``) is refused before any call, with
``core.jobs``' own one-line reasons. What needs the cluster's state (a job that exists, the
settings a change is checked against, the config map's total size) the leader checks.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Iterable, Mapping, Sequence

from lighthouse_cluster.core.jobs import (
    DEFAULT_JOB,
    MAX_REPLICAS_LIMIT,
    SETTING_NAMES,
    JobError,
    JobSettings,
    JobSpec,
    check_job_name,
    parse_config_items,
    parse_ports,
)
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb

__all__ = ["SETTING_FLAGS", "add_request", "check_settings", "remove_request", "set_request", "settings_given"]

# The job settings as `jobs add/set` flags: (setting, flag spellings, help). The spellings are
# `serve`'s for the settings it has (torchft's underscores and dashes alike, --quorum-lease-ms
# as serve spells it), and both for the limits only jobs have.
SETTING_FLAGS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("min_replicas", ("--min_replicas", "--min-replicas"), "Fewest replica groups a new quorum of the job may have."),
    ("join_timeout_ms", ("--join_timeout_ms", "--join-timeout-ms"),
     "How long to wait for heartbeating replicas that have not asked for the quorum."),
    ("quorum_tick_ms", ("--quorum_tick_ms", "--quorum-tick-ms"),
     "How often the leader re-evaluates the job's pending quorum."),
    ("heartbeat_timeout_ms", ("--heartbeat_timeout_ms", "--heartbeat-timeout-ms"),
     "A replica of the job whose last heartbeat is older is unhealthy."),
    ("quorum_lease_ms", ("--quorum-lease-ms", "--quorum_lease_ms"),
     "The job's fast quorums go out on the leader lease (at most the nodes' --quorum-lease-ms; 0: every round "
     "committed)."),
    ("max_replicas", ("--max-replicas", "--max_replicas"), "Most replica groups the job may have at once."),
    ("max_member_bytes", ("--max-member-bytes", "--max_member_bytes"),
     "Largest serialized QuorumMember the job accepts (bytes)."),
)
assert tuple(s for s, _, _ in SETTING_FLAGS) == SETTING_NAMES


def settings_given(values: Mapping[str, int | None]) -> dict[str, int]:
    """The settings flags that were given (click passes None for the others)."""
    return {name: v for name, v in values.items() if name in SETTING_NAMES and v is not None}


def check_settings(changes: Mapping[str, int]) -> dict[str, int]:
    """Each given setting within its range (``JobSettings.check``'s bounds and messages), and
    min_replicas <= max_replicas when both are given. The leader checks the result against the
    job's other settings, which only it knows."""
    neutral = {f.name: f.default for f in fields(JobSettings)}
    neutral["max_replicas"] = MAX_REPLICAS_LIMIT  # so a lone min_replicas is checked against its own bound only
    for name, value in changes.items():
        alone = {name: value, **({"min_replicas": 1} if name == "max_replicas" else {})}
        JobSettings(**neutral).updated(alone)
    if "min_replicas" in changes and "max_replicas" in changes:
        JobSettings(**neutral).updated({k: changes[k] for k in ("min_replicas", "max_replicas")})
    return dict(changes)


def _config_entries(name: str, items: Iterable[str]) -> list[cpb.ConfigEntry]:
    config = parse_config_items(items)
    settings = None if name == DEFAULT_JOB else JobSettings()
    JobSpec(name=name, settings=settings, config=tuple(sorted(config.items()))).check()
    return [cpb.ConfigEntry(key=k, value=v) for k, v in sorted(config.items())]


def _port_entries(items: Sequence[str]) -> list[cpb.JobPort]:
    return [cpb.JobPort(node_id=node, port=port) for node, port in parse_ports(items)]


def add_request(name: str, settings: Mapping[str, int], ports: Sequence[str] = (),
                config: Sequence[str] = ()) -> cpb.AddJobRequest:
    """``jobs add NAME [settings] [--port ...] [--config K=V ...]``; settings not given take the
    leader's defaults (its own flags)."""
    check_job_name(name)
    if name == DEFAULT_JOB:
        raise JobError(f"the {DEFAULT_JOB} job always exists: its settings are the nodes' serve flags "
                       f"(jobs set {DEFAULT_JOB} --config KEY=VALUE sets its config)")
    return cpb.AddJobRequest(name=name, settings=cpb.JobSettingsUpdate(**check_settings(settings)),
                             ports=_port_entries(ports), config=_config_entries(name, config))


def set_request(name: str, settings: Mapping[str, int], ports: Sequence[str] = (), no_ports: bool = False,
                config: Sequence[str] = (), unset_config: Sequence[str] = ()) -> cpb.SetJobRequest:
    """``jobs set NAME ...``: only what was given changes. ``--port`` replaces the job's ports,
    ``--no-ports`` removes them; ``--config`` sets keys, ``--unset-config`` removes keys."""
    check_job_name(name)
    if ports and no_ports:
        raise JobError("--port and --no-ports contradict each other: give one")
    if not (settings or ports or no_ports or config or unset_config):
        raise JobError(f"nothing to change for job {name!r}: give a setting (--min_replicas ...), --port, "
                       "--no-ports, --config KEY=VALUE or --unset-config KEY")
    entries = _config_entries(name, config)
    both = sorted({e.key for e in entries} & set(unset_config))
    if both:
        raise JobError(f"config key {both[0]!r} is both set (--config) and unset (--unset-config)")
    for key in unset_config:
        if not key:
            raise JobError("--unset-config needs a KEY")
    return cpb.SetJobRequest(name=name, settings=cpb.JobSettingsUpdate(**check_settings(settings)),
                             set_ports=bool(ports) or no_ports, ports=_port_entries(ports), set_config=entries,
                             unset_config=list(dict.fromkeys(unset_config)))


def remove_request(name: str, force: bool = False) -> cpb.RemoveJobRequest:
    check_job_name(name)
    return cpb.RemoveJobRequest(name=name, force=force)
