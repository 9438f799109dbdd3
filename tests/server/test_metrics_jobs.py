"""Per-job metrics (``server/metrics.py``) on a node seen through its ``MetricsSource``: a real
replicated state machine with two jobs, and each job's readings as its runtime would report them.
No processes: the exposition is parsed as Prometheus would read it."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lighthouse_cluster.core import codec
from lighthouse_cluster.core.codec import CommitQuorum, EnableSchema, PutJob, RemoveJob
from lighthouse_cluster.core.jobs import DEFAULT_JOB, JobSettings, JobSpec
from lighthouse_cluster.core.quorum import Member, Quorum
from lighthouse_cluster.core.state_machine import QuorumStateMachine
from lighthouse_cluster.server.metrics import NodeMetrics


@dataclass
class Coordinator:
    term: int | None = None
    serving: bool = False
    rounds_committed: int = 0
    rounds_on_lease: int = 0
    rounds_replayed: int = 0
    heartbeats: dict[str, int] = field(default_factory=dict)
    waiting: list[Any] = field(default_factory=list)

    def heartbeat_ages_ms(self) -> dict[str, int]:
        return dict(self.heartbeats)

    def pending(self) -> list[Any]:
        return list(self.waiting)


@dataclass
class Runtime:
    name: str
    coordinator: Coordinator
    liveness: Any = field(default_factory=lambda: SimpleNamespace(open_streams=0, deaths={"stream_closed": 0},
                                                                            stalls_excused=0))
    connections: Any = field(default_factory=lambda: SimpleNamespace(connected=0))


class Node:
    def __init__(self, machine: QuorumStateMachine, jobs: list[Runtime]) -> None:
        self.config = SimpleNamespace(node_id="n1")
        self.raft = None
        self.machine = machine
        self.jobs = jobs
        self.lease_renewals = {"heartbeat": 0, "probe": 0, "commit": 0}

    @property
    def coordinator(self) -> Coordinator:
        return self.jobs[0].coordinator

    def leader_peer(self) -> None:
        return None

    def readiness(self) -> tuple[bool, str]:
        return True, "leader in term 3"


def quorum(qid: int, *ids: str) -> Quorum:
    return Quorum(quorum_id=qid, participants=tuple(Member(replica_id=i, address=f"http://{i}") for i in ids),
                  created_ms=1_700_000_000_000)


def families(metrics: NodeMetrics) -> dict[str, list[Any]]:
    return {f.name: f.samples for f in text_string_to_metric_families(metrics.exposition().decode())}


def values(fams: dict[str, list[Any]], family: str, sample: str | None = None, **labels: str) -> dict[str, float]:
    """{job: value} of ``family``'s samples named ``sample`` that carry ``labels``."""
    return {s.labels.get("job", ""): s.value for s in fams[family]
            if s.name == (sample or family) and all(s.labels.get(k) == v for k, v in labels.items())}


def two_job_node() -> tuple[Node, NodeMetrics]:
    machine = QuorumStateMachine(codec.JOBS_SCHEMA_VERSION)
    machine.apply(EnableSchema(version=codec.JOBS_SCHEMA_VERSION))
    assert machine.apply(PutJob(spec=JobSpec("train-b", settings=JobSettings()), expected_version=0)).applied
    for qid, ids in ((1, ("a",)), (2, ("a", "b")), (3, ("a", "b", "c"))):
        assert machine.apply(CommitQuorum(expected_quorum_id=qid - 1, quorum=quorum(qid, *ids), term=3,
                                          node_id="n1")).applied
    assert machine.apply(CommitQuorum(expected_quorum_id=0, quorum=quorum(1, "x", "y"), term=3, node_id="n1",
                                      job="train-b")).applied
    default = Runtime(DEFAULT_JOB, Coordinator(term=3, serving=True, rounds_committed=3, rounds_on_lease=40,
                                               heartbeats={"a": 10, "b": 20, "c": 30}))
    b = Runtime("train-b", Coordinator(term=3, serving=True, rounds_committed=1, rounds_on_lease=5,
                                       heartbeats={"x": 5, "y": 6}, waiting=[object()]),
                liveness=SimpleNamespace(open_streams=2, deaths={"stream_closed": 1, "keepalive_timeout": 0},
                                         stalls_excused=7),
                connections=SimpleNamespace(connected=1))
    node = Node(machine, [default, b])
    return node, NodeMetrics(node, SimpleNamespace(forwarded_quorum_calls=4, rerouted_quorum_calls=0,
                                                  forwarded_heartbeats=0, heartbeat_batches=0,
                                                  forwarded_quorum_messages=0))


def test_every_series_of_a_jobs_rounds_has_one_sample_per_job() -> None:
    node, metrics = two_job_node()
    metrics.observe_raft_write(0.002, ok=True)
    fams = families(metrics)
    assert values(fams, "lighthouse_cluster_quorum_id") == {"default": 3, "train-b": 1}
    assert values(fams, "lighthouse_cluster_quorum_participants") == {"default": 3, "train-b": 2}
    assert values(fams, "lighthouse_cluster_heartbeating_replicas") == {"default": 3, "train-b": 2}
    assert values(fams, "lighthouse_cluster_pending_requesters") == {"default": 0, "train-b": 1}
    rounds = "lighthouse_cluster_quorum_rounds"
    assert values(fams, rounds, rounds + "_total", path="commit") == {"default": 3, "train-b": 1}
    assert values(fams, rounds, rounds + "_total", path="lease") == {"default": 40, "train-b": 5}
    assert values(fams, "lighthouse_cluster_liveness_streams") == {"default": 0, "train-b": 2}
    deaths = "lighthouse_cluster_replica_deaths"
    assert values(fams, deaths, deaths + "_total", reason="stream_closed") == {"default": 0, "train-b": 1}
    stalls = "lighthouse_cluster_liveness_stalls_excused"
    assert values(fams, stalls, stalls + "_total") == {"default": 0, "train-b": 7}
    assert values(fams, "lighthouse_cluster_manager_connections") == {"default": 0, "train-b": 1}
    for family in ("lighthouse_cluster_quorum_id", rounds, deaths):
        assert all(s.labels["node"] == "n1" for s in fams[family])
    # Node-wide series have no job label.
    for family in ("lighthouse_cluster_role", "lighthouse_cluster_term", "lighthouse_cluster_ready",
                   "lighthouse_cluster_serving", "lighthouse_cluster_forwarded_quorum_calls",
                   "lighthouse_cluster_raft_write_seconds"):
        assert fams[family] and all("job" not in s.labels for s in fams[family]), family
    assert values(fams, "lighthouse_cluster_jobs") == {"": 2}
    assert values(fams, "lighthouse_cluster_forwarded_quorum_calls",
                  "lighthouse_cluster_forwarded_quorum_calls_total") == {"": 4}


def test_a_followers_jobs_show_their_quorums_but_no_leader_readings() -> None:
    node, metrics = two_job_node()
    for job in node.jobs:
        job.coordinator.term = None
    fams = families(metrics)
    assert values(fams, "lighthouse_cluster_quorum_id") == {"default": 3, "train-b": 1}
    assert values(fams, "lighthouse_cluster_heartbeating_replicas") == {"default": 0, "train-b": 0}
    assert values(fams, "lighthouse_cluster_pending_requesters") == {"default": 0, "train-b": 0}
    assert values(fams, "lighthouse_cluster_serving") == {"": 0}


def test_commit_latency_is_observed_per_job_and_goes_with_a_removed_job() -> None:
    node, metrics = two_job_node()
    hist = "lighthouse_cluster_quorum_commit_seconds"
    # Every job has its series from the start.
    assert values(families(metrics), hist, hist + "_count") == {"default": 0, "train-b": 0}
    metrics.on_issue("train-b", None, 0.004)
    metrics.on_issue("train-b", None, 0.2)
    metrics.on_issue("default", None, 0.003)
    metrics.on_issue("default", None, None)  # on the lease: nothing to time
    fams = families(metrics)
    assert values(fams, hist, hist + "_count") == {"default": 1, "train-b": 2}
    assert values(fams, hist, hist + "_sum") == pytest.approx({"default": 0.003, "train-b": 0.204})
    assert values(fams, hist, hist + "_bucket", le="0.005") == {"default": 1, "train-b": 1}

    assert node.machine.apply(RemoveJob(name="train-b", expected_version=1)).applied
    node.jobs = node.jobs[:1]
    fams = families(metrics)
    assert values(fams, hist, hist + "_count") == {"default": 1}
    assert values(fams, "lighthouse_cluster_quorum_id") == {"default": 3}
    assert values(fams, "lighthouse_cluster_jobs") == {"": 1}
