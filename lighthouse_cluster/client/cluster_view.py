"""What `lighthouse-cluster status` shows: the cluster as seen through a list of endpoints.

``collect`` asks each endpoint for its Status, and ``collect_jobs`` one node for its jobs (the
only I/O here); ``build_view`` is a pure function from those answers to a ``ClusterView``;
``to_json`` writes it as JSON (``cli.status_tables`` prints it as tables).
The leader's answer supplies the quorum, pending requesters, heartbeat ages and the jobs (each
job's quorum, members and heartbeating replicas); every node supplies its own role, term and
commit index.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

import grpc

from lighthouse_cluster.client.admin_client import probe_status
from lighthouse_cluster.client.job_view import quorum_json
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import lighthouse_cluster_pb2_grpc as cpb_grpc
from lighthouse_cluster.client.job_view import job_json
from lighthouse_cluster.tls import ClientTLS, channel

_ROLE_NAMES = {cpb.FOLLOWER: "follower", cpb.CANDIDATE: "candidate", cpb.LEADER: "leader", cpb.ROLE_UNKNOWN: "unknown"}


@dataclass
class NodeRow:
    id: str
    address: str
    role: str
    term: int
    commit_index: int
    reachable: bool
    leader_id: str = ""
    version: str = ""
    schema_writes: int = 0    # the newest replicated schema the node's version writes
    schema_enabled: int = 0   # the schema the cluster has enabled, as applied on the node
    fsync: bool = True        # False: the node runs with --unsafe-no-fsync


@dataclass
class ClusterView:
    leader: str | None
    term: int
    nodes: list[NodeRow]
    quorum: dict[str, Any] | None
    heartbeats: list[dict[str, Any]] = field(default_factory=list)
    pending: list[dict[str, Any]] = field(default_factory=list)
    quorum_reason: str = ""
    settings: dict[str, int] = field(default_factory=dict)
    # Rounds the leader issued (since it started): on the lease / after a Raft commit each.
    rounds: dict[str, int] = field(default_factory=dict)
    # Every job (``job_view.job_json``), the default one first: the leader's Status lists them
    # (NodeStatus.jobs), else ``collect_jobs`` asks it (or, without a leader, any node) for them.
    jobs: list[dict[str, Any]] = field(default_factory=list)


def collect(endpoints: Sequence[str], timeout: float = 2.0, tls: ClientTLS | None = None,
            reasons: dict[str, str] | None = None) -> list[tuple[str, cpb.NodeStatus | None]]:
    """Ask every endpoint, then every peer those answers name that was not asked yet. Why an
    endpoint did not answer goes into ``reasons`` (one line each), when given."""
    asked: dict[str, cpb.NodeStatus | None] = {}
    todo = list(dict.fromkeys(endpoints))
    with ThreadPoolExecutor(max_workers=8) as pool:
        while todo:
            for endpoint, (answer, why) in zip(todo, pool.map(lambda e: probe_status(e, timeout, tls), todo)):
                asked[endpoint] = answer
                if answer is None and reasons is not None:
                    reasons[endpoint] = why
            named = [p.node.client_address for st in asked.values() if st is not None for p in st.peers]
            todo = [a for a in dict.fromkeys(named) if a not in asked]
    return list(asked.items())


def collect_jobs(address: str, timeout: float = 2.0, tls: ClientTLS | None = None) -> list[dict[str, Any]] | None:
    """``address``'s jobs (ListJobs), or None when it does not answer or has no jobs service (a
    node of a version before jobs)."""
    try:
        with channel(address, tls) as ch:
            r = cpb_grpc.LighthouseClusterStub(ch).ListJobs(cpb.ListJobsRequest(), timeout=timeout)
    except grpc.RpcError:
        return None
    return [job_json(j) for j in r.jobs]


def build_view(answers: Sequence[tuple[str, cpb.NodeStatus | None]]) -> ClusterView:
    """Merge per-node answers into one view; nodes named in peer lists but not asked are listed
    as unreachable only if some answer names them and they did not answer themselves."""
    rows: dict[str, NodeRow] = {}
    unanswered: list[str] = []
    leader_status: cpb.NodeStatus | None = None
    known: dict[str, cpb.NodeInfo] = {}
    for endpoint, st in answers:
        if st is None:
            unanswered.append(endpoint)
            continue
        rows[st.node.id] = NodeRow(id=st.node.id, address=st.node.client_address, role=_ROLE_NAMES[st.role],
                                   term=st.term, commit_index=st.commit_index, reachable=True,
                                   leader_id=st.leader_id, version=st.version, schema_writes=st.schema_version,
                                   schema_enabled=st.enabled_schema_version, fsync=not st.unsafe_no_fsync)
        for p in st.peers:
            known.setdefault(p.node.id, p.node)
        if st.role == cpb.LEADER and (leader_status is None or st.term > leader_status.term):
            leader_status = st
    for node_id, info in known.items():
        if node_id not in rows:
            rows[node_id] = NodeRow(id=node_id, address=info.client_address, role="unknown", term=0,
                                    commit_index=0, reachable=False)
    listed = {r.address for r in rows.values()}
    for endpoint in unanswered:
        if endpoint not in listed:
            rows[endpoint] = NodeRow(id="?", address=endpoint, role="unknown", term=0, commit_index=0,
                                     reachable=False)
    view = ClusterView(leader=None, term=max((r.term for r in rows.values()), default=0),
                       nodes=sorted(rows.values(), key=lambda r: (r.id == "?", r.id, r.address)), quorum=None)
    if leader_status is None:
        # No leader answered; fall back to the newest-term node's answer for the committed quorum.
        reachable = [st for _, st in answers if st is not None]
        if reachable:
            newest = max(reachable, key=lambda s: (s.term, s.commit_index))
            view.quorum = _quorum_dict(newest)
        return view
    st = leader_status
    view.leader = st.node.id
    view.term = st.term
    view.quorum = _quorum_dict(st)
    view.quorum_reason = st.quorum_reason
    view.heartbeats = [{"replica_id": h.replica_id, "age_ms": h.age_ms} for h in st.heartbeats]
    view.pending = [{"replica_id": p.member.replica_id, "step": p.member.step, "waiting_ms": p.waiting_ms}
                    for p in st.pending]
    view.settings = {"min_replicas": st.settings.min_replicas, "join_timeout_ms": st.settings.join_timeout_ms,
                     "quorum_tick_ms": st.settings.quorum_tick_ms,
                     "heartbeat_timeout_ms": st.settings.heartbeat_timeout_ms,
                     "quorum_lease_ms": st.settings.quorum_lease_ms,
                     "liveness_timeout_ms": st.settings.liveness_timeout_ms}
    view.rounds = {"lease": st.rounds_on_lease, "commit": st.rounds_committed}
    view.jobs = [job_json(j) for j in st.jobs]
    return view


def _quorum_dict(st: cpb.NodeStatus) -> dict[str, Any] | None:
    return quorum_json(st.quorum) if st.has_quorum else None


def to_json(view: ClusterView) -> dict[str, Any]:
    return {
        "leader": view.leader,
        "term": view.term,
        "nodes": [{"id": r.id, "address": r.address, "role": r.role, "term": r.term,
                   "commit_index": r.commit_index, "reachable": r.reachable, "version": r.version,
                   "schema": {"writes": r.schema_writes, "enabled": r.schema_enabled},
                   "fsync": r.fsync} for r in view.nodes],
        "quorum": view.quorum,
        "quorum_reason": view.quorum_reason,
        "pending": view.pending,
        "heartbeats": view.heartbeats,
        "settings": view.settings,
        "rounds": view.rounds,
        "jobs": view.jobs,
    }


def upgrade_note(view: ClusterView) -> str:
    """One line while a rolling upgrade is under way (nodes on different versions, or a newer
    replicated schema not enabled yet); empty otherwise."""
    up = [r for r in view.nodes if r.reachable]
    versions = sorted({r.version for r in up if r.version})
    enabled = min((r.schema_enabled for r in up if r.schema_enabled), default=0)
    writes = max((r.schema_writes for r in up), default=0)
    if len(versions) <= 1 and enabled >= writes:
        return ""
    return (f"rolling upgrade: versions {', '.join(versions) or '?'}; replicated schema {enabled} enabled"
            + (f", {writes} once the leader sees every node run it" if writes > enabled else ""))


def unsafe_storage_note(view: ClusterView) -> str:
    """One warning line when a reachable node runs with --unsafe-no-fsync; empty otherwise."""
    unsafe = [r.id for r in view.nodes if r.reachable and not r.fsync]
    if not unsafe:
        return ""
    return (f"warning: {', '.join(unsafe)} run{'s' if len(unsafe) == 1 else ''} with --unsafe-no-fsync: "
            "a power loss can lose acknowledged quorums (tests and benchmarks only)")


# -- health ----------------------------------------------------------------------------------------


@dataclass
class HealthRow:
    id: str
    address: str
    live: bool
    ready: bool
    reason: str
    role: str
    term: int
    leader_id: str
    commit_index: int
    lag: int | None


@dataclass
class Health:
    healthy: bool
    leader: str | None
    term: int
    nodes: list[HealthRow]
    problems: list[str]


def build_health(answers: Sequence[tuple[str, cpb.NodeStatus | None]], max_lag: int = 100) -> Health:
    """Healthy when every node named anywhere answers, is ready, follows the same leader in the
    same term, and is within ``max_lag`` entries of the leader's commit index."""
    by_id: dict[str, cpb.NodeStatus] = {}
    named: dict[str, str] = {}
    unanswered: list[str] = []
    for endpoint, st in answers:
        if st is None:
            unanswered.append(endpoint)
            continue
        by_id[st.node.id] = st
        named.setdefault(st.node.id, st.node.client_address)
        for p in st.peers:
            named.setdefault(p.node.id, p.node.client_address)
    leaders = [st for st in by_id.values() if st.role == cpb.LEADER]
    leader = max(leaders, key=lambda st: st.term) if leaders else None
    rows: list[HealthRow] = []
    problems: list[str] = []
    for node_id, address in sorted(named.items()):
        st = by_id.get(node_id)
        if st is None:
            rows.append(HealthRow(node_id, address, False, False, "does not answer", "unknown", 0, "", 0, None))
            problems.append(f"{node_id} ({address}) does not answer")
            continue
        lag = leader.commit_index - st.commit_index if leader is not None else None
        rows.append(HealthRow(node_id, address, True, st.ready, st.ready_reason, _ROLE_NAMES[st.role], st.term,
                              st.leader_id, st.commit_index, lag))
        if not st.ready:
            problems.append(f"{node_id} is not ready: {st.ready_reason}")
        if leader is not None and (st.leader_id != leader.node.id or st.term != leader.term):
            problems.append(f"{node_id} follows {st.leader_id or 'nobody'} in term {st.term}, "
                            f"not {leader.node.id} in term {leader.term}")
        if lag is not None and lag > max_lag:
            problems.append(f"{node_id} is {lag} entries behind the leader (more than {max_lag})")
    listed = set(named.values())
    for endpoint in unanswered:
        if endpoint not in listed:
            rows.append(HealthRow("?", endpoint, False, False, "does not answer", "unknown", 0, "", 0, None))
            problems.append(f"{endpoint} does not answer")
    if leader is None:
        problems.insert(0, "no leader is known")
    return Health(healthy=not problems, leader=leader.node.id if leader else None,
                  term=leader.term if leader else max((r.term for r in rows), default=0), nodes=rows,
                  problems=problems)


def health_to_json(h: Health) -> dict[str, Any]:
    return {"healthy": h.healthy, "leader": h.leader, "term": h.term, "problems": h.problems,
            "nodes": [{"id": r.id, "address": r.address, "live": r.live, "ready": r.ready, "reason": r.reason,
                       "role": r.role, "term": r.term, "leader_id": r.leader_id, "commit_index": r.commit_index,
                       "lag": r.lag} for r in h.nodes]}
