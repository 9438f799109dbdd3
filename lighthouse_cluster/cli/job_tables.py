"""What `lighthouse-cluster jobs list/show/add/set/remove` and `status`'s job rows print: jobs (as
``client.job_view.job_json`` dicts, the dashboard's too) as tables on a terminal, plain ``RECORD:``
lines elsewhere (``output.print_table``)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from lighthouse_cluster.cli.output import Cell, CellLike, print_record, print_table
from lighthouse_cluster.core.jobs import ALL_NODES, DEFAULT_JOB

__all__ = ["job_fields", "jobs_rows", "members", "ports_text", "render_job", "render_jobs", "render_status_jobs"]

UNKNOWN = "-"  # a live value only the serving leader knows, asked elsewhere


def ports_text(job: Mapping[str, Any]) -> str:
    """A job's own client ports in a cell: ``29600`` (every node), ``n1=29601,n2=29602``,
    ``client port`` for the default job (the nodes' main port), ``-`` when it has none (it is
    reached by name on the client port)."""
    if not job["ports"]:
        return "client port" if job["name"] == DEFAULT_JOB else "-"
    every = [p for p in job["ports"] if p["node_id"] in (ALL_NODES, "")]
    own = sorted((p for p in job["ports"] if p not in every), key=lambda p: p["node_id"])
    return ",".join([str(p["port"]) for p in every] + [f"{p['node_id']}={p['port']}" for p in own])


def members(job: Mapping[str, Any]) -> list[str]:
    """The replica ids of the job's last committed quorum."""
    return [p["replica_id"] for p in job["quorum"]["participants"]] if job["quorum"] else []


def _heartbeating(job: Mapping[str, Any]) -> str:
    return str(job["heartbeating_replicas"]) if job["leader_view"] else UNKNOWN


def _config_keys(job: Mapping[str, Any]) -> str:
    return ",".join(job["config"]) or UNKNOWN


def _quorum_id(job: Mapping[str, Any]) -> str:
    return str(job["quorum_id"]) if job["quorum_id"] else "none"


JOB_COLUMNS = ("job", "ports", "min", "quorum id", "members", "heartbeating", "config")


def jobs_rows(jobs: Sequence[Mapping[str, Any]]) -> list[tuple[CellLike, ...]]:
    """`jobs list`'s rows (``JOB_COLUMNS``): the job's own ports, its min_replicas, its last
    quorum id and member count, its heartbeating replicas (the leader's view; ``-`` elsewhere)
    and its config keys. Every other setting is in `jobs show` and `--output json`."""
    rows: list[tuple[CellLike, ...]] = []
    for j in jobs:
        s = j["settings"]
        rows.append((Cell(j["name"], "bold"), ports_text(j), str(s["min_replicas"]), _quorum_id(j),
                     str(len(members(j))), _heartbeating(j), _config_keys(j)))
    return rows


def not_leader_note(answered_by: str) -> str:
    return (f"answered by {answered_by}, not the serving leader: heartbeats and pending requests are "
            "unknown (-); quorums and settings are the replicated ones")


def _folding(jobs: Sequence[Mapping[str, Any]], *columns: str) -> tuple[str, ...]:
    """The columns that may fold: ``columns``, and the job names when one is too long to keep
    whole beside the others (``print_table`` keeps a short column's values whole up to 24 chars)."""
    return columns + (("job",) if any(len(j["name"]) > 24 for j in jobs) else ())


def render_jobs(listing: Mapping[str, Any], console: Any) -> None:
    """`jobs list`: one row per job, the default job first."""
    print_table("jobs", JOB_COLUMNS, jobs_rows(listing["jobs"]), out=console,
                wide=_folding(listing["jobs"], "ports", "config"), record="job")
    if not listing["leader_view"]:
        # One line off a terminal (greppable, as the rows); folded to the width on one.
        console.print(not_leader_note(listing["answered_by"]), markup=False, soft_wrap=not console.is_terminal)


def render_status_jobs(jobs: Sequence[Mapping[str, Any]], console: Any) -> None:
    """`status`'s job rows: where each job is served, its quorum, members and heartbeats."""
    if not jobs:
        return
    print_table("jobs", ("job", "ports", "quorum id", "members", "heartbeating"), [
        (j["name"], ports_text(j), _quorum_id(j), str(len(members(j))), _heartbeating(j)) for j in jobs],
        out=console, wide=_folding(jobs, "ports"), record="job")


def job_fields(job: Mapping[str, Any], answered_by: str = "") -> dict[str, str]:
    """`jobs show`'s record: every scalar field of ``job`` as text (lists get their own tables);
    ``answered_by``: the node that answered (`jobs show`), whose own port and view are shown."""
    s = job["settings"]
    fields = {"name": job["name"], "version": str(job["version"])}
    fields.update({name.replace("_", " "): str(v) for name, v in s.items()})
    if job["settings_from_flags"]:
        fields["settings from"] = "the serve flags of each node"
    fields["ports"] = ports_text(job)
    if answered_by:
        here = f"port {job['listening_port']}" if job["listening_port"] else "no own port"
        fields[f"listening on {answered_by}"] = f"{here}; {job['port_error']}" if job["port_error"] else here
    fields["quorum id"] = _quorum_id(job)
    fields["members"] = ",".join(members(job)) or "none"
    fields["config keys"] = str(len(job["config"]))
    if job["leader_view"]:
        fields["heartbeating replicas"] = _heartbeating(job)
        fields["pending requests"] = str(len(job["pending"]))
        fields["open liveness streams"] = str(job["open_streams"])
        r = job["rounds"]
        fields["rounds"] = f"{r['lease']} on the leader lease, {r['commit']} committed"
        if job["quorum_reason"]:
            fields["next quorum"] = job["quorum_reason"]
    elif answered_by:  # `jobs show` (add and set answer on the leader, before the new job serves)
        fields["live view"] = "unknown: not answered by the serving leader"
    return fields


def render_job(job: Mapping[str, Any], console: Any, answered_by: str = "", title: str = "") -> None:
    """`jobs show` (and what add/set print): the job's fields, then its config map, the members
    of its last quorum, its heartbeats and pending requesters (the leader's view)."""
    print_record(title or f"job {job['name']}", job_fields(job, answered_by), out=console)
    if job["config"]:
        print_table(f"config of {job['name']}", ("key", "value"), list(job["config"].items()), out=console,
                    wide=("value",), record="config")
    if job["quorum"] is not None:
        q = job["quorum"]
        print_table(f"quorum {q['quorum_id']}", ("replica id", "step", "address", "world size"), [
            (p["replica_id"], str(p["step"]), p["address"], str(p["world_size"])) for p in q["participants"]],
            out=console, wide=("address",), record="participant")
    if job["leader_view"]:
        timeout = job["settings"]["heartbeat_timeout_ms"]
        if job["heartbeats"]:
            print_table("heartbeats", ("replica id", "age (ms)"), [
                (h["replica_id"], Cell(str(h["age_ms"]), "red" if h["age_ms"] >= timeout else ""))
                for h in job["heartbeats"]], out=console, record="heartbeat")
        if job["pending"]:
            print_table("pending", ("replica id", "step", "waiting (ms)"), [
                (p["replica_id"], str(p["step"]), str(p["waiting_ms"])) for p in job["pending"]], out=console,
                record="pending")
