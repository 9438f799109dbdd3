"""Prometheus metrics of one node, in a per-node ``CollectorRegistry``.

Two kinds: histograms observed as things happen (a quorum round's Raft commit, observed in the
coordinator's ``on_issue`` hook; every Raft write, from submit to applied), and gauges/counters
read from the node at scrape time by ``NodeCollector`` (role, term, indexes, current quorum,
heartbeating replicas, forwarded and re-routed quorum calls, rounds issued on the lease or through
a commit, open liveness streams and replica deaths by reason). Nothing here does I/O. What is
read, and from what, is ``MetricsSource`` (the node, with the Raft node and coordinator it holds),
``RoutingCounts`` (``routing.Router``), ``LivenessCounts`` (``liveness_streams.LivenessStreams``) and
``ConnectionCounts`` (``manager_connections.ManagerConnections``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Protocol

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from lighthouse_cluster.core.state_machine import QuorumStateMachine
    from lighthouse_cluster.raft.replication import Role
    from lighthouse_cluster.server.config import NodeConfig, PeerSpec

PREFIX = "lighthouse_cluster_"
ROLES = ("follower", "candidate", "leader")
# Raft commits on a LAN take milliseconds; a round waiting on an election can take seconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class RaftReadings(Protocol):
    """What is read from the Raft node (``raft.replication.RaftNode``)."""

    @property
    def role(self) -> Role: ...

    @property
    def term(self) -> int: ...

    @property
    def commit_index(self) -> int: ...

    @property
    def last_applied(self) -> int: ...


class RoundReadings(Protocol):
    """What is read from the leader's coordinator (``coordinator.QuorumCoordinator``)."""

    @property
    def term(self) -> int | None: ...

    @property
    def serving(self) -> bool: ...

    @property
    def rounds_committed(self) -> int: ...

    @property
    def rounds_on_lease(self) -> int: ...

    def heartbeat_ages_ms(self) -> dict[str, int]: ...


class MetricsSource(Protocol):
    """What is read from the node (``LighthouseNode``)."""

    @property
    def config(self) -> NodeConfig: ...

    @property
    def raft(self) -> RaftReadings | None: ...

    @property
    def coordinator(self) -> RoundReadings | None: ...

    @property
    def machine(self) -> QuorumStateMachine: ...

    def leader_peer(self) -> PeerSpec | None: ...

    def readiness(self) -> tuple[bool, str]: ...


class RoutingCounts(Protocol):
    """Quorum calls forwarded and re-routed (``routing.Router``)."""

    @property
    def forwarded_quorum_calls(self) -> int: ...

    @property
    def rerouted_quorum_calls(self) -> int: ...


class LivenessCounts(Protocol):
    """Open liveness streams and the deaths they declared (``liveness_streams.LivenessStreams``)."""

    @property
    def open_streams(self) -> int: ...

    @property
    def deaths(self) -> dict[str, int]:
        """Replica deaths declared on this node, by reason label."""


class ConnectionCounts(Protocol):
    """The leader's watched manager connections (``manager_connections.ManagerConnections``)."""

    @property
    def connected(self) -> int: ...


class NodeCollector(Collector):
    """Reads the node's state at scrape time."""

    def __init__(self, node: MetricsSource, routing: RoutingCounts, liveness: LivenessCounts,
                 connections: ConnectionCounts) -> None:
        self.node = node
        self.routing = routing
        self.liveness = liveness
        self.connections = connections

    def collect(self) -> Iterator[Any]:
        node = self.node
        node_id = node.config.node_id
        raft, coord = node.raft, node.coordinator
        role_name = raft.role.value if raft is not None else "unknown"
        role = GaugeMetricFamily(PREFIX + "role", "1 for this node's current Raft role", labels=["node", "role"])
        for r in ROLES:
            role.add_metric([node_id, r], 1.0 if role_name == r else 0.0)
        yield role

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["node"])
            g.add_metric([node_id], value)
            return g

        yield gauge("term", "Current Raft term", raft.term if raft else 0)
        yield gauge("commit_index", "Raft commit index", raft.commit_index if raft else 0)
        yield gauge("last_applied", "Raft last applied index", raft.last_applied if raft else 0)
        leader = node.leader_peer()
        yield gauge("leader_known", "1 when this node knows a (connected) leader", 1 if leader else 0)
        yield gauge("serving", "1 when this node is the leader and serves quorum rounds",
                    1 if coord is not None and coord.term is not None and coord.serving else 0)
        ready, _ = node.readiness()
        yield gauge("ready", "1 when /readyz answers 200", 1 if ready else 0)
        q = node.machine.quorum
        yield gauge("quorum_id", "Id of the last committed quorum (0: none yet)", q.quorum_id if q else 0)
        yield gauge("quorum_participants", "Participants of the last committed quorum",
                    len(q.participants) if q else 0)
        beating = len(coord.heartbeat_ages_ms()) if coord is not None and coord.term is not None else 0
        yield gauge("heartbeating_replicas", "Replicas with a heartbeat on record (leader only; 0 elsewhere)", beating)
        fwd = CounterMetricFamily(PREFIX + "forwarded_quorum_calls", "Quorum calls forwarded to the leader",
                                  labels=["node"])
        fwd.add_metric([node_id], self.routing.forwarded_quorum_calls)
        yield fwd
        rer = CounterMetricFamily(PREFIX + "rerouted_quorum_calls",
                                  "Quorum call attempts re-routed after a leader change or failure", labels=["node"])
        rer.add_metric([node_id], self.routing.rerouted_quorum_calls)
        yield rer
        rounds = CounterMetricFamily(
            PREFIX + "quorum_rounds", "Quorum rounds issued, by path: 'commit' (a Raft commit per round) "
            "or 'lease' (a fast quorum on the leader lease, no commit)", labels=["node", "path"])
        rounds.add_metric([node_id, "commit"], coord.rounds_committed if coord is not None else 0)
        rounds.add_metric([node_id, "lease"], coord.rounds_on_lease if coord is not None else 0)
        yield rounds
        yield gauge("liveness_streams", "Open liveness streams (Watch; the serving leader only)",
                    self.liveness.open_streams)
        deaths = CounterMetricFamily(
            PREFIX + "replica_deaths", "Replica groups declared dead before their heartbeat timeout, by reason: "
            "'stream_closed' (the liveness stream ended), 'keepalive_timeout' (no keep-alive for "
            "--liveness-timeout-ms) or 'manager_connection_lost' (the member's manager server closed the "
            "leader's connection and refused a new one: a torchft trainer's death)",
            labels=["node", "reason"])
        for reason, count in sorted(self.liveness.deaths.items()):
            deaths.add_metric([node_id, reason], count)
        yield deaths
        yield gauge("manager_connections", "Connections up from the serving leader to the running quorum's "
                    "manager servers (members without a liveness stream)", self.connections.connected)


class NodeMetrics:
    """The node's registry and the histograms it observes into."""

    def __init__(self, node: MetricsSource, routing: RoutingCounts, liveness: LivenessCounts,
                 connections: ConnectionCounts) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(NodeCollector(node, routing, liveness, connections))
        self.quorum_commit_seconds = Histogram(
            PREFIX + "quorum_commit_seconds", "Raft commit latency of issued quorum rounds",
            registry=self.registry, buckets=LATENCY_BUCKETS)
        self.raft_write_seconds = Histogram(
            PREFIX + "raft_write_seconds", "Latency of Raft writes from submit to applied (or failed)",
            ["outcome"], registry=self.registry, buckets=LATENCY_BUCKETS)

    def on_issue(self, _issued: Any, commit_s: float | None) -> None:
        if commit_s is not None:  # None: issued on the lease, no commit to time
            self.quorum_commit_seconds.observe(commit_s)

    def observe_raft_write(self, seconds: float, ok: bool) -> None:
        self.raft_write_seconds.labels("ok" if ok else "error").observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
