"""Jobs as `lighthouse-cluster jobs` and `status` show them: a ``Job`` message (``ListJobs`` /
``GetJob`` / the admin calls' answers) as a plain JSON-ready dict, and the short texts its table
cells need. Pure: no I/O (``admin_client.AdminClient.read`` asks the nodes)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from lighthouse_cluster.core.jobs import ALL_NODES, DEFAULT_JOB, SETTING_NAMES
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import torchft_pb2 as pb

__all__ = ["job_to_json", "jobs_to_json", "ports_text", "quorum_to_json"]


def quorum_to_json(q: pb.Quorum) -> dict[str, Any]:
    return {
        "quorum_id": q.quorum_id,
        "created_ms": q.created.ToMilliseconds(),
        "participants": [{"replica_id": m.replica_id, "step": m.step, "address": m.address,
                          "store_address": m.store_address, "world_size": m.world_size} for m in q.participants],
    }


def job_to_json(job: cpb.Job) -> dict[str, Any]:
    """Every field of ``job``. The live fields (heartbeats, pending, reason, rounds, streams) are
    the serving leader's view: with ``leader_view`` false they are unknown, and
    ``heartbeating_replicas`` is None rather than 0."""
    quorum = quorum_to_json(job.quorum) if job.has_quorum else None
    return {
        "name": job.name,
        "version": job.version,
        "settings": {name: getattr(job.settings, name) for name in SETTING_NAMES},
        "settings_from_flags": job.settings_from_flags,
        "ports": [{"node_id": p.node_id or ALL_NODES, "port": p.port} for p in job.ports],
        "config": {c.key: c.value for c in job.config},
        "quorum_id": job.quorum_id,
        "quorum": quorum,
        "members": [p["replica_id"] for p in quorum["participants"]] if quorum else [],
        "listening_port": job.listening_port or None,
        "port_error": job.port_error,
        "leader_view": job.leader_view,
        "heartbeating_replicas": job.heartbeating_replicas if job.leader_view else None,
        "heartbeats": [{"replica_id": h.replica_id, "age_ms": h.age_ms} for h in job.heartbeats],
        "pending": [{"replica_id": p.member.replica_id, "step": p.member.step, "waiting_ms": p.waiting_ms}
                    for p in job.pending],
        "quorum_reason": job.quorum_reason,
        "rounds": {"lease": job.rounds_on_lease, "commit": job.rounds_committed},
        "open_streams": job.open_streams,
    }


def jobs_to_json(jobs: Sequence[cpb.Job], answered_by: str, leader_view: bool) -> dict[str, Any]:
    """What `jobs list --output json` prints."""
    return {"answered_by": answered_by, "leader_view": leader_view, "jobs": [job_to_json(j) for j in jobs]}


def ports_text(job: Mapping[str, Any]) -> str:
    """A job's own client ports in a table cell: ``29600`` (every node), ``n1=29601,n2=29602``,
    ``client port`` for the default job (the nodes' main port), ``-`` when it has none (it is
    reached by name on the client port)."""
    if not job["ports"]:
        return "client port" if job["name"] == DEFAULT_JOB else "-"
    return ",".join(str(p["port"]) if p["node_id"] == ALL_NODES else f"{p['node_id']}={p['port']}"
                    for p in sorted(job["ports"], key=lambda p: (p["node_id"] != ALL_NODES, p["node_id"])))
