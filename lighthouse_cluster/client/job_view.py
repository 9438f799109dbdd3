"""Jobs as JSON: the cluster's ``Job`` views (``LighthouseCluster.ListJobs``) as plain data for the
dashboard's ``/status.json``.

Pure functions, no I/O. ``jobs_view`` merges what two nodes know: the serving leader's answer
(the live view: heartbeats, pending requesters, the reason of the last evaluation, rounds issued,
liveness streams) when it was reachable, else this node's own (the replicated part only: spec,
settings and each job's last committed quorum); the ports this node itself listens on always come
from this node's answer.
"""

from __future__ import annotations

from typing import Any

from lighthouse_cluster.core.jobs import SETTING_NAMES
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import torchft_pb2 as pb


def quorum_json(q: pb.Quorum) -> dict[str, Any]:
    """A torchft ``Quorum``: its id, when it was made, its participants."""
    return {
        "quorum_id": q.quorum_id,
        "created_ms": q.created.ToMilliseconds(),
        "participants": [{"replica_id": m.replica_id, "step": m.step, "address": m.address,
                          "store_address": m.store_address, "world_size": m.world_size} for m in q.participants],
    }


def job_json(job: cpb.Job) -> dict[str, Any]:
    """One job: its spec, its last committed quorum and, from the serving leader, its live view
    (``leader_view`` false: heartbeats and pending requesters are unknown, not empty)."""
    return {
        "name": job.name,
        "version": job.version,
        "settings": {name: getattr(job.settings, name) for name in SETTING_NAMES},
        "settings_from_flags": job.settings_from_flags,
        "ports": [{"node_id": p.node_id, "port": p.port} for p in job.ports],
        "listening_port": job.listening_port,
        "port_error": job.port_error,
        "config": {c.key: c.value for c in job.config},
        "quorum_id": job.quorum_id,
        "quorum": quorum_json(job.quorum) if job.has_quorum else None,
        "leader_view": job.leader_view,
        "quorum_reason": job.quorum_reason,
        "rounds": {"lease": job.rounds_on_lease, "commit": job.rounds_committed},
        "heartbeats": [{"replica_id": h.replica_id, "age_ms": h.age_ms} for h in job.heartbeats],
        "heartbeating_replicas": job.heartbeating_replicas,
        "pending": [{"replica_id": p.member.replica_id, "step": p.member.step, "waiting_ms": p.waiting_ms}
                    for p in job.pending],
        "open_streams": job.open_streams,
    }


def jobs_view(own: cpb.ListJobsResponse, leaders: cpb.ListJobsResponse | None = None) -> dict[str, Any]:
    """Every job, the default one first: from ``leaders`` (the leader's answer) when given and it
    is the leader's view, else from ``own`` (this node's answer); ``listening_port`` and
    ``port_error`` always from ``own`` (they are about the node that answered)."""
    source = leaders if leaders is not None and leaders.leader_view else own
    mine = {j.name: j for j in own.jobs}
    jobs = []
    for job in source.jobs:
        shown = job_json(job)
        here = mine.get(job.name)
        shown["listening_port"] = here.listening_port if here is not None else 0
        shown["port_error"] = here.port_error if here is not None else ""
        jobs.append(shown)
    return {"answered_by": source.answered_by, "leader_view": source.leader_view, "jobs": jobs}
