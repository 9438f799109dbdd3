"""Prometheus metrics of one node, in a per-node ``CollectorRegistry``.

Two kinds: histograms observed as things happen (a quorum round's Raft commit, observed in each
job's coordinator's ``on_issue`` hook; every Raft write, from submit to applied), and
gauges/counters read from the node at scrape time by ``NodeCollector``.

Node-wide series carry a ``node`` label: Raft role, term and indexes, leader known, serving,
ready, the number of jobs, forwarded and re-routed quorum calls, Raft write latency. Every series
that describes one job's rounds carries a ``job`` label too, one series per job on this node (the
default job's: ``job="default"``, so a dashboard written before jobs keeps working): last quorum
id and participants, heartbeating replicas, pending requesters, rounds issued on the lease or
through a commit, open liveness streams, replica deaths by reason, watched manager connections,
and the round commit latency histogram. The rendezvous store (``KVCollector``): its size, the
torchrun runs in it and the rounds they completed (read from the states' summary lines,
``core/rendezvous_state.py``), and the store calls this node answered.

Nothing here does I/O. What is read, and from what, is ``MetricsSource`` (the node: its Raft node,
state machine and jobs), ``JobReadings`` (``job_registry.JobRuntime``: the job's coordinator,
``LivenessCounts`` and ``ConnectionCounts``) and ``RoutingCounts`` (``routing.Router``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Protocol, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from lighthouse_cluster.core.rendezvous_state import STATE_KEY, is_state

if TYPE_CHECKING:
    from lighthouse_cluster.core.state_machine import JobState, QuorumStateMachine
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

    @property
    def messages_encrypted(self) -> dict[str, int]:
        """Raft messages sent encrypted, by cipher ("aes-gcm", "fernet"); empty without a secret."""

    @property
    def quiet(self) -> bool:
        """Whether this node's Raft heartbeats are quiet (no client: ``raft/extensions/quiescence.py``)."""

    @property
    def tick_stalls(self) -> int:
        """How many times the Raft tick thread stalled (``raft/extensions/stall_tolerance.py``)."""

    @property
    def election_patience_s(self) -> float:
        """What the leader's heartbeats add to its followers' election timeouts after its stalls."""

    @property
    def fsync(self) -> bool:
        """False with ``--unsafe-no-fsync`` (``raft/durable_journal.py``)."""

    @property
    def journal_syncs(self) -> tuple[int, int, float]:
        """(journal syncs, entries they made durable, seconds spent in them)."""


class RoundReadings(Protocol):
    """What is read from a job's coordinator on the leader (``coordinator.QuorumCoordinator``)."""

    @property
    def term(self) -> int | None: ...

    @property
    def serving(self) -> bool: ...

    @property
    def rounds_committed(self) -> int: ...

    @property
    def rounds_on_lease(self) -> int: ...

    @property
    def rounds_replayed(self) -> int: ...

    def heartbeat_ages_ms(self) -> dict[str, int]: ...

    def pending(self) -> Sequence[Any]:
        """The requesters waiting for the job's next quorum."""


class JobReadings(Protocol):
    """What is read of one job's machinery on this node (``job_registry.JobRuntime``)."""

    @property
    def name(self) -> str: ...

    @property
    def coordinator(self) -> RoundReadings: ...

    @property
    def liveness(self) -> LivenessCounts: ...

    @property
    def connections(self) -> ConnectionCounts: ...


class MetricsSource(Protocol):
    """What is read from the node (``LighthouseNode``)."""

    @property
    def config(self) -> NodeConfig: ...

    @property
    def raft(self) -> RaftReadings | None: ...

    @property
    def coordinator(self) -> RoundReadings | None:
        """The default job's coordinator (None before the node started)."""

    @property
    def jobs(self) -> Iterable[JobReadings]:
        """Every job on this node, the default one first (``job_registry.JobRegistry``)."""

    @property
    def machine(self) -> QuorumStateMachine: ...

    def leader_peer(self) -> PeerSpec | None: ...

    @property
    def lease_renewals(self) -> Mapping[str, int]:
        """Background renewals of the quorum lease by path, 'heartbeat', 'probe' and 'commit' (``LeaderTerm``)."""

    def readiness(self) -> tuple[bool, str]: ...


class RoutingCounts(Protocol):
    """Quorum calls forwarded and re-routed (``routing.Router``)."""

    @property
    def forwarded_quorum_calls(self) -> int: ...

    @property
    def rerouted_quorum_calls(self) -> int: ...

    @property
    def forwarded_heartbeats(self) -> int:
        """Heartbeats this follower forwarded to the leader (taken by it)."""

    @property
    def heartbeat_batches(self) -> int:
        """Batches those heartbeats went in."""

    @property
    def forwarded_quorum_messages(self) -> int:
        """Stream messages this follower's forwarded Quorum calls went in."""


class LivenessCounts(Protocol):
    """Open liveness streams and the deaths they declared (``liveness_streams.LivenessStreams``)."""

    @property
    def open_streams(self) -> int: ...

    @property
    def deaths(self) -> dict[str, int]:
        """Replica deaths declared on this node, by reason label."""

    @property
    def stalls_excused(self) -> int:
        """Liveness checks that ran late (the event loop was held) and excused the stall."""


class ConnectionCounts(Protocol):
    """The leader's watched manager connections (``manager_connections.ManagerConnections``)."""

    @property
    def connected(self) -> int: ...


class NodeCollector(Collector):
    """Reads the node's state at scrape time: node-wide series labelled ``node``; one series per
    job (label ``job``, the default job's ``job="default"``) for what describes a job's rounds."""

    def __init__(self, node: MetricsSource, routing: RoutingCounts) -> None:
        self.node = node
        self.routing = routing

    def collect(self) -> Iterator[Any]:
        yield from self._node_wide()
        yield from self._per_job()

    def _node_wide(self) -> Iterator[Any]:
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
        yield gauge("raft_quiet", "1 while the Raft leader heartbeats slowly, no client having called for "
                    "--quiesce-after-ms (as leader: its own; as follower: its leader's)",
                    1 if raft is not None and raft.quiet else 0)
        yield gauge("raft_election_patience_seconds", "What the Raft leader's heartbeats add to its followers' "
                    "election timeouts after its tick thread stalled (as leader: what it asks; as follower: "
                    "what its leader asked)", raft.election_patience_s if raft is not None else 0.0)
        stalls = CounterMetricFamily(PREFIX + "raft_tick_stalls", "Times this node's Raft tick thread ran 50 ms "
                                     "or more late (no CPU, or the GIL held elsewhere)", labels=["node"])
        stalls.add_metric([node_id], raft.tick_stalls if raft is not None else 0)
        yield stalls
        yield gauge("raft_fsync", "0 when this node runs with --unsafe-no-fsync (its Raft state is never synced: "
                    "a power loss can lose what it acknowledged); 1 otherwise", 0 if raft is not None and not raft.fsync
                    else 1)
        syncs, entries, sync_s = raft.journal_syncs if raft is not None else (0, 0, 0.0)
        for name, help_text, value in (
                ("raft_journal_syncs", "Batches of Raft entries (and truncations) this node wrote and synced before "
                 "acknowledging or counting them", syncs),
                ("raft_journal_entries_synced", "Raft entries made durable by those batches", entries),
                ("raft_journal_sync_seconds", "Time this node's Raft thread spent writing and syncing its journal",
                 sync_s)):
            family = CounterMetricFamily(PREFIX + name, help_text, labels=["node"])
            family.add_metric([node_id], value)
            yield family
        ready, _ = node.readiness()
        yield gauge("ready", "1 when /readyz answers 200", 1 if ready else 0)
        yield gauge("jobs", "Jobs (quorum namespaces) this node serves, the default job included",
                    sum(1 for _ in node.jobs))
        fwd = CounterMetricFamily(PREFIX + "forwarded_quorum_calls", "Quorum calls forwarded to the leader",
                                  labels=["node"])
        fwd.add_metric([node_id], self.routing.forwarded_quorum_calls)
        yield fwd
        fwm = CounterMetricFamily(PREFIX + "forwarded_quorum_messages", "Stream messages this follower's forwarded "
                                  "Quorum calls went in (forwarded_quorum_calls / this: calls per message)",
                                  labels=["node"])
        fwm.add_metric([node_id], self.routing.forwarded_quorum_messages)
        yield fwm
        hb = CounterMetricFamily(PREFIX + "forwarded_heartbeats", "Heartbeats this follower forwarded to the leader",
                                 labels=["node"])
        hb.add_metric([node_id], self.routing.forwarded_heartbeats)
        yield hb
        hbb = CounterMetricFamily(PREFIX + "forwarded_heartbeat_batches", "Batches this follower forwarded its "
                                  "heartbeats in (forwarded_heartbeats / this: heartbeats per batch)", labels=["node"])
        hbb.add_metric([node_id], self.routing.heartbeat_batches)
        yield hbb
        rer = CounterMetricFamily(PREFIX + "rerouted_quorum_calls",
                                  "Quorum call attempts re-routed after a leader change or failure", labels=["node"])
        rer.add_metric([node_id], self.routing.rerouted_quorum_calls)
        yield rer
        renewals = CounterMetricFamily(
            PREFIX + "lease_renewals", "Background renewals of the leader's quorum lease while rounds come fast, "
            "by path: 'heartbeat' (a regular heartbeat a majority acknowledged, no log entry), 'probe' (a "
            "heartbeat sent for it alone, where those came late) or 'commit' (a ConfirmLeadership entry, "
            "where a probe went unanswered)", labels=["node", "path"])
        for path, count in node.lease_renewals.items():
            renewals.add_metric([node_id, path], count)
        yield renewals
        enc = CounterMetricFamily(PREFIX + "raft_messages_encrypted",
                                  "Raft messages this node sent encrypted, by cipher (aes-gcm once every member "
                                  "reads it, fernet before)", labels=["node", "cipher"])
        for cipher, count in (raft.messages_encrypted if raft is not None else {}).items():
            enc.add_metric([node_id, cipher], count)
        yield enc

    def _per_job(self) -> Iterator[Any]:
        node = self.node
        node_id = node.config.node_id
        jobs = list(node.jobs)

        def gauge(name: str, doc: str, value_of: Callable[[JobReadings], float]) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["node", "job"])
            for job in jobs:
                g.add_metric([node_id, job.name], value_of(job))
            return g

        def quorum_state(job: JobReadings) -> JobState | None:
            return node.machine.job(job.name)

        def leading(job: JobReadings) -> bool:
            return job.coordinator.term is not None

        yield gauge("quorum_id", "Id of the job's last committed quorum (0: none yet; a job created again "
                    "starts above its predecessor's last)", lambda j: js.quorum_id if (js := quorum_state(j)) else 0)
        yield gauge("quorum_participants", "Participants of the job's last committed quorum",
                    lambda j: len(js.quorum.participants) if (js := quorum_state(j)) and js.quorum else 0)
        yield gauge("heartbeating_replicas", "The job's replicas with a heartbeat on record (leader only; 0 "
                    "elsewhere)", lambda j: len(j.coordinator.heartbeat_ages_ms()) if leading(j) else 0)
        yield gauge("pending_requesters", "The job's replica groups waiting for its next quorum (leader only; 0 "
                    "elsewhere)", lambda j: len(j.coordinator.pending()) if leading(j) else 0)
        rounds = CounterMetricFamily(
            PREFIX + "quorum_rounds", "The job's quorum rounds issued here, by path: 'commit' (a Raft commit per "
            "round) or 'lease' (a fast quorum on the leader lease, no commit)", labels=["node", "job", "path"])
        for job in jobs:
            rounds.add_metric([node_id, job.name, "commit"], job.coordinator.rounds_committed)
            rounds.add_metric([node_id, job.name, "lease"], job.coordinator.rounds_on_lease)
        yield rounds
        replayed = CounterMetricFamily(
            PREFIX + "quorum_answers_replayed", "Requests a new leader answered with its predecessor's last "
            "quorum: each equal to its member's entry in it, an answer lost when the previous leader died",
            labels=["node", "job"])
        for job in jobs:
            replayed.add_metric([node_id, job.name], job.coordinator.rounds_replayed)
        yield replayed
        yield gauge("liveness_streams", "The job's open liveness streams (Watch; the serving leader only)",
                    lambda j: j.liveness.open_streams)
        deaths = CounterMetricFamily(
            PREFIX + "replica_deaths", "The job's replica groups declared dead before their heartbeat timeout, by "
            "reason: 'stream_closed' (the liveness stream ended), 'keepalive_timeout' (no keep-alive for "
            "--liveness-timeout-ms) or 'manager_connection_lost' (the member's manager server closed the "
            "leader's connection and refused a new one: a torchft trainer's death)",
            labels=["node", "job", "reason"])
        for job in jobs:
            for reason, count in sorted(job.liveness.deaths.items()):
                deaths.add_metric([node_id, job.name, reason], count)
        yield deaths
        stalls = CounterMetricFamily(
            PREFIX + "liveness_stalls_excused", "Liveness checks of the job that ran 50 ms or more late (the "
            "node's event loop was held: a loaded host); keep-alives unread during the stall were not counted "
            "as missing", labels=["node", "job"])
        for job in jobs:
            stalls.add_metric([node_id, job.name], job.liveness.stalls_excused)
        yield stalls
        yield gauge("manager_connections", "Connections up from the serving leader to the job's running quorum's "
                    "manager servers (members without a liveness stream)", lambda j: j.connections.connected)


class KVCollector(Collector):
    """The rendezvous store's size as this node's replicated state holds it, read at scrape time."""

    def __init__(self, node: MetricsSource) -> None:
        self.node = node

    def collect(self) -> Iterator[Any]:
        kv = getattr(self.node.machine, "kv", None)
        if kv is None:
            return
        node_id = self.node.config.node_id
        namespaces = list(kv.namespaces.values())
        ns = GaugeMetricFamily(PREFIX + "kv_namespaces", "Rendezvous namespaces (job, run id) in the store",
                               labels=["node"])
        ns.add_metric([node_id], len(namespaces))
        yield ns
        keys = GaugeMetricFamily(PREFIX + "kv_keys", "Keys in all rendezvous namespaces", labels=["node"])
        keys.add_metric([node_id], sum(len(n.entries) for n in namespaces))
        yield keys
        size = GaugeMetricFamily(PREFIX + "kv_bytes", "Bytes of keys and values in all rendezvous namespaces",
                                 labels=["node"])
        size.add_metric([node_id], sum(n.size for n in namespaces))
        yield size
        # torchrun's rendezvous in the store (``core/rendezvous_state.py``): the runs whose state
        # key holds the backend's state, and the rounds completed by the writes this node applied
        # (every node counts the same applied entries; from 0 when the node starts).
        runs = GaugeMetricFamily(PREFIX + "rendezvous_runs", "Rendezvous namespaces holding a torchrun "
                                 "rendezvous state (--rdzv-backend=lighthouse)", labels=["node"])
        runs.add_metric([node_id], sum(1 for n in namespaces if (e := n.entries.get(STATE_KEY)) is not None
                                       and is_state(e.value)))
        yield runs
        rounds = CounterMetricFamily(PREFIX + "rendezvous_rounds", "torchrun rendezvous rounds completed, counted "
                                     "in the state writes this node applied since it started (every node counts "
                                     "the same writes)", labels=["node"])
        rounds.add_metric([node_id], kv.rendezvous_rounds)
        yield rounds


class NodeMetrics:
    """The node's registry and the histograms it observes into."""

    def __init__(self, node: MetricsSource, routing: RoutingCounts) -> None:
        self.node = node
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(NodeCollector(node, routing))
        # process_open_fds / process_max_fds, CPU, memory and start time of the node's process.
        ProcessCollector(registry=self.registry)
        self.quorum_commit_seconds = Histogram(
            PREFIX + "quorum_commit_seconds", "Raft commit latency of the job's issued quorum rounds",
            ["job"], registry=self.registry, buckets=LATENCY_BUCKETS)
        self.raft_write_seconds = Histogram(
            PREFIX + "raft_write_seconds", "Latency of Raft writes from submit to applied (or failed)",
            ["outcome"], registry=self.registry, buckets=LATENCY_BUCKETS)
        self._histogram_jobs: set[str] = set()
        self._match_jobs()
        # The rendezvous store (issue 34): calls this node answered, and its replicated contents.
        self.kv_operations = Counter(
            PREFIX + "kv_operations", "Rendezvous store calls answered by this node (forwarded ones included), "
            "by operation and result (ok, or the refusal's kind or status)", ["op", "result"],
            registry=self.registry)
        self.registry.register(KVCollector(node))

    def kv_calls(self) -> int:
        """Rendezvous store calls this node answered, every operation and result together."""
        return int(sum(sample.value for metric in self.kv_operations.collect() for sample in metric.samples
                       if sample.name.endswith("_total")))

    def on_issue(self, job: str, _issued: Any, commit_s: float | None) -> None:
        """A round of ``job`` was issued (the coordinator's ``on_issue`` hook)."""
        if commit_s is not None:  # None: issued on the lease, no commit to time
            self.quorum_commit_seconds.labels(job).observe(commit_s)
            self._histogram_jobs.add(job)

    def observe_raft_write(self, seconds: float, ok: bool) -> None:
        self.raft_write_seconds.labels("ok" if ok else "error").observe(seconds)

    def _match_jobs(self) -> None:
        """One histogram series per job on this node, from its start (a count of 0 until its first
        committed round); a removed job's goes with it (its other series are read from its runtime)."""
        current = {job.name for job in self.node.jobs}
        for job in current - self._histogram_jobs:
            self.quorum_commit_seconds.labels(job)
        for job in self._histogram_jobs - current:
            self.quorum_commit_seconds.remove(job)
        self._histogram_jobs = current

    def exposition(self) -> bytes:
        self._match_jobs()
        return generate_latest(self.registry)
