"""Selecting a job by port, declared jobs and auto-created jobs, on real 3-node clusters (#17).

* a job's own client port (``server/job_ports.py``) serves that job on every node: unchanged
  torchft traffic (no job metadata) through a follower's job port gets the job's quorum, apart
  from the default job's; Status, GetJob and health answer there;
* ``jobs set`` moving the port unbinds the old one and binds the new; ``jobs remove`` closes it;
* a port already in use is reported (``listening_port`` 0 and ``port_error``) while the node and
  the other jobs keep serving, and is bound once it is free;
* jobs declared in ``serve``'s config file exist once the cluster serves, and a whole-cluster
  restart neither duplicates nor overwrites one an operator changed;
* ``--auto-create-jobs``: a job appears on its first use (Quorum, heartbeat, Watch) with the
  settings ``jobs add`` gives; off, unknown jobs stay NOT_FOUND;
* ``NodeStatus.jobs`` lists every job, the default first.

Each node of a local cluster runs on 127.0.0.1 with its own ports, so jobs are given one port per
node (``n1=P1`` ...), as in Kubernetes one ``*`` port serves on every pod.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import socket
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lighthouse_cluster.core.jobs import JOB_HEADER, JobSettings
from lighthouse_cluster.local.cluster import LocalCluster, can_bind, free_ports
from lighthouse_cluster.local.simulated_group import SimulatedReplicaGroup
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import lighthouse_cluster_pb2_grpc as cpb_grpc
from lighthouse_cluster.proto import torchft_pb2 as pb
from lighthouse_cluster.proto import torchft_pb2_grpc as pb_grpc
from lighthouse_cluster.server.admin import token_metadata
from lighthouse_cluster.tls import channel as tls_channel
from lighthouse_cluster.tls import generate_pki
from support.pids import job_port_processes, pid_running
from support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

TOKEN = "job-ports-token"
AUTH = token_metadata(TOKEN)
HOST = "127.0.0.1"


class Nodes:
    """gRPC stubs of a cluster's nodes (client ports) and of any address, channels closed at the end."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self._channels: dict[str, grpc.Channel] = {}

    def channel(self, address: str) -> grpc.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.insecure_channel(address)
        return self._channels[address]

    def cluster_stub(self, address: str) -> cpb_grpc.LighthouseClusterStub:
        return cpb_grpc.LighthouseClusterStub(self.channel(address))

    def node(self, i: int) -> cpb_grpc.LighthouseClusterStub:
        return self.cluster_stub(self.cluster.client_addresses[i])

    def admin(self) -> cpb_grpc.LighthouseAdminStub:
        leader, _ = self.cluster.wait_for_stable_leader(timeout=30)
        return cpb_grpc.LighthouseAdminStub(self.channel(self.cluster.client_addresses[leader]))

    def job(self, i: int, name: str) -> cpb.Job | None:
        """Job ``name`` as node ``i`` sees it (None: that node has no such job)."""
        try:
            return self.node(i).GetJob(cpb.JobRequest(name=name), timeout=2)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()


@contextlib.contextmanager
def started(root: Path, **kwargs: Any) -> Iterator[tuple[LocalCluster, Nodes]]:
    cluster = LocalCluster(root=root, admin_token=TOKEN, min_replicas=1, join_timeout_ms=1_000,
                           heartbeat_timeout_ms=1_000, **kwargs)
    nodes = Nodes(cluster)
    try:
        with cluster:
            cluster.wait_for_stable_leader(timeout=60)
            yield cluster, nodes
    finally:
        nodes.close()
        cluster.stop_all()


# Job ports on the node's event loop (the default), and each in a process of its own.
SERVED = {"in-node": [], "port-processes": ["--job-port-processes"]}


@pytest.fixture(scope="module", params=sorted(SERVED))
def shared(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, Nodes]]:
    with started(tmp_path_factory.mktemp("job-ports"), extra_args=SERVED[request.param],
                 http_ports=free_ports(3)) as both:
        yield both


def follower_of(cluster: LocalCluster) -> int:
    leader, _ = cluster.wait_for_stable_leader(timeout=30)
    return next(i for i in range(cluster.nodes) if i != leader)


def per_node(ports: list[int]) -> list[cpb.JobPort]:
    return [cpb.JobPort(node_id=f"n{i + 1}", port=p) for i, p in enumerate(ports)]


def wait_listening(nodes: Nodes, name: str, ports: list[int], timeout: float = 20.0) -> None:
    """Every node reports listening on its port of job ``name`` (0: on none, its port busy)."""
    def port(i: int) -> int | None:
        # No error is tolerated: a node's calls once failed at the HTTP/2 layer while it started
        # a port process ("Received unexpected settings ack"), gRPC's fork handlers running in
        # it (server/child_process.py).
        j = nodes.job(i, name)
        return j.listening_port if j else None

    wait_for(f"job {name} listening on {ports}", lambda: [port(i) for i in range(len(ports))] == ports, timeout,
             context=nodes.cluster)


def quorums(groups: list[SimulatedReplicaGroup]) -> list[pb.Quorum]:
    """One Quorum call from each group at once, each heartbeating while it waits (as a torchft
    manager does; a group that got its quorum stops, so it holds no one else's up)."""
    async def one(group: SimulatedReplicaGroup) -> pb.Quorum:
        try:
            async with group.heartbeating():
                return await group.call_quorum()
        finally:
            await group.close()

    async def run() -> list[pb.Quorum]:
        return list(await asyncio.gather(*(one(g) for g in groups)))
    return asyncio.run(run())


def members(q: pb.Quorum) -> set[str]:
    return {m.replica_id for m in q.participants}


def health_status(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status


# -- a job by port ------------------------------------------------------------------------------------


def test_torchft_traffic_through_a_followers_job_port_gets_the_jobs_quorum(shared) -> None:
    cluster, nodes = shared
    ports = free_ports(3, HOST)
    job = nodes.admin().AddJob(cpb.AddJobRequest(name="by-port", ports=per_node(ports), settings=cpb.JobSettingsUpdate(
        min_replicas=3, join_timeout_ms=500)), metadata=AUTH, timeout=10)
    assert job.version == 1
    wait_listening(nodes, "by-port", ports)
    follower = follower_of(cluster)
    job_address = f"{HOST}:{ports[follower]}"
    # Three trainers, none naming a job, each through another node's job port: the port is the job.
    trainers = [SimulatedReplicaGroup(f"t{i}", f"{HOST}:{ports[i]}", quorum_timeout_s=20) for i in range(3)]
    defaults = [SimulatedReplicaGroup(f"d{i}", cluster.client_addresses[follower], quorum_timeout_s=20)
                for i in range(2)]
    got = quorums(trainers + defaults)
    job_q, default_q = got[:3], got[3:]
    assert all(members(q) == {"t0", "t1", "t2"} for q in job_q), job_q
    assert len({q.quorum_id for q in job_q}) == 1
    assert all(members(q) <= {"d0", "d1"} and members(q) for q in default_q), default_q
    # The job's quorum is the job's: GetJob through the job port itself (no name: the port's job),
    # once the follower applied it.
    seen = wait_for("the job's quorum on the follower",
                    lambda: nodes.cluster_stub(job_address).GetJob(cpb.JobRequest(), timeout=2), 10,
                    ready=lambda j: j.quorum_id == job_q[0].quorum_id, context=cluster)
    assert seen.name == "by-port" and members(seen.quorum) == {"t0", "t1", "t2"}
    last_default = max(default_q, key=lambda q: q.quorum_id)
    st = wait_for("the default job's quorum on the follower",
                  lambda: nodes.node(follower).Status(cpb.StatusRequest(), timeout=2), 10,
                  ready=lambda st: st.quorum.quorum_id == last_default.quorum_id, context=cluster)
    assert members(st.quorum) == members(last_default)
    # The rest of LighthouseCluster and health answer on the job port too.
    port_status = nodes.cluster_stub(job_address).Status(cpb.StatusRequest(), timeout=2)
    assert port_status.node.id == f"n{follower + 1}"
    assert nodes.cluster_stub(job_address).Leader(cpb.LeaderRequest(), timeout=2).leader_id
    assert health_status(job_address) == health_pb2.HealthCheckResponse.SERVING
    # A unary heartbeat through the follower's job port reaches the leader as the job's.
    with grpc.insecure_channel(job_address) as ch:
        pb_grpc.LighthouseServiceStub(ch).Heartbeat(pb.LighthouseHeartbeatRequest(replica_id="hb-by-port"), timeout=2)
    leader, _ = cluster.wait_for_stable_leader(timeout=30)
    wait_for("the job's heartbeat on the leader",
             lambda: "hb-by-port" in {h.replica_id for h in nodes.job(leader, "by-port").heartbeats}, 10,
             context=cluster)
    assert "hb-by-port" not in {h.replica_id for h in nodes.node(leader).Status(cpb.StatusRequest()).heartbeats}


def test_every_node_status_lists_every_job_default_first(shared) -> None:
    cluster, nodes = shared
    nodes.admin().AddJob(cpb.AddJobRequest(name="listed"), metadata=AUTH, timeout=10)
    for i in range(cluster.nodes):
        names = wait_for(f"node {i}'s status listing job 'listed'",
                         lambda i=i: [j.name for j in nodes.node(i).Status(cpb.StatusRequest(), timeout=2).jobs],
                         10, ready=lambda ns: "listed" in ns, context=cluster)
        listed = [j.name for j in nodes.node(i).ListJobs(cpb.ListJobsRequest(), timeout=2).jobs]
        assert names[0] == "default" and sorted(names) == sorted(listed), (names, listed)


def test_moving_a_port_rebinds_and_removing_the_job_closes_it(shared) -> None:
    cluster, nodes = shared
    old, new = free_ports(3, HOST), free_ports(3, HOST)
    admin = nodes.admin()
    admin.AddJob(cpb.AddJobRequest(name="moving", ports=per_node(old), settings=cpb.JobSettingsUpdate(
        min_replicas=2, join_timeout_ms=500)), metadata=AUTH, timeout=10)
    wait_listening(nodes, "moving", old)
    assert not any(can_bind(HOST, p) for p in old)
    job = nodes.admin().SetJob(cpb.SetJobRequest(name="moving", set_ports=True, ports=per_node(new)), metadata=AUTH,
                               timeout=10)
    assert [p.port for p in sorted(job.ports, key=lambda p: p.node_id)] == new
    wait_listening(nodes, "moving", new)
    wait_for("the old ports closed", lambda: all(can_bind(HOST, p) for p in old), 10, context=cluster)
    follower = follower_of(cluster)
    leader, _ = cluster.wait_for_stable_leader(timeout=30)
    q, _ = quorums([SimulatedReplicaGroup("mover-a", f"{HOST}:{new[follower]}", quorum_timeout_s=20),
                    SimulatedReplicaGroup("mover-b", f"{HOST}:{new[leader]}", quorum_timeout_s=20)])
    assert members(q) == {"mover-a", "mover-b"}
    wait_for("the moved job's quorum on the follower", lambda: nodes.job(follower, "moving").quorum_id, 10,
             ready=lambda qid: qid == q.quorum_id, context=cluster)
    # A call waiting on the follower's port (min_replicas 2, alone) ends when the job is removed.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(quorums, [SimulatedReplicaGroup("waiter", f"{HOST}:{new[follower]}",
                                                              quorum_timeout_s=60)])
        wait_for("the waiter pending on the leader", lambda: nodes.job(leader, "moving").pending, 10,
                 ready=lambda pending: [p.member.replica_id for p in pending] == ["waiter"], context=cluster)
        nodes.admin().RemoveJob(cpb.RemoveJobRequest(name="moving", force=True), metadata=AUTH, timeout=10)
        error = waiting.exception(timeout=10)  # at once, not at its 60 s deadline
    assert isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.NOT_FOUND, error
    wait_for("the removed job's ports closed", lambda: all(can_bind(HOST, p) for p in new), 10, context=cluster)
    assert all(nodes.job(i, "moving") is None for i in range(cluster.nodes))


def test_a_port_in_use_is_reported_and_bound_once_free(shared) -> None:
    cluster, nodes = shared
    follower = follower_of(cluster)
    ports = free_ports(3, HOST)
    blocker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    blocker.bind((HOST, ports[follower]))
    blocker.listen()
    try:
        nodes.admin().AddJob(cpb.AddJobRequest(name="blocked", ports=per_node(ports)), metadata=AUTH, timeout=10)
        job = wait_for("the busy port reported", lambda: nodes.job(follower, "blocked"), 15,
                       ready=lambda j: j is not None and j.port_error, context=cluster)
        assert job.listening_port == 0
        assert f"{HOST}:{ports[follower]}" in job.port_error and "in use" in job.port_error, job.port_error
        others = [i for i in range(cluster.nodes) if i != follower]
        # The other follower may apply the job a moment after this one (CI once found it without).
        wait_listening(nodes, "blocked", [ports[i] if i in others else 0 for i in range(cluster.nodes)], 15)
        # The node and the job's other ports keep serving.
        other = others[0]
        got = quorums([SimulatedReplicaGroup("busy-d", cluster.client_addresses[follower], quorum_timeout_s=20),
                       SimulatedReplicaGroup("busy-j", f"{HOST}:{ports[other]}", quorum_timeout_s=20)])
        assert members(got[0]) == {"busy-d"} and members(got[1]) == {"busy-j"}
    finally:
        blocker.close()
    wait_for("the freed port bound", lambda: nodes.job(follower, "blocked").listening_port, 15,
             ready=lambda p: p == ports[follower], context=cluster)
    assert nodes.job(follower, "blocked").port_error == ""
    (q,) = quorums([SimulatedReplicaGroup("freed", f"{HOST}:{ports[follower]}", quorum_timeout_s=20)])
    assert members(q) == {"freed"}
    log = cluster.members[follower].log_path.read_text()
    assert log.count("job blocked: cannot listen on") == 1, "a failing port is logged once"


def test_a_nodes_own_client_or_raft_port_is_refused_as_a_jobs(shared) -> None:
    # Once accepted: the node retried binding its own port for as long as the job lived.
    cluster, nodes = shared
    follower = follower_of(cluster)
    peer = cluster.peers[follower]
    client_port = int(peer.client_address.rsplit(":", 1)[1])
    raft_port = int(peer.raft_address.rsplit(":", 1)[1])
    for entries, what in (([cpb.JobPort(node_id=peer.node_id, port=client_port)], "client port"),
                          ([cpb.JobPort(port=raft_port)], "Raft port")):
        with pytest.raises(grpc.RpcError) as e:
            nodes.admin().AddJob(cpb.AddJobRequest(name="own-port", ports=entries), metadata=AUTH, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
        port = entries[0].port
        assert e.value.details() == (f"job 'own-port': port {port} on node {peer.node_id} is {peer.node_id}'s "
                                     f"{what}; give the job a port of its own"), e.value.details()
        assert all(nodes.job(i, "own-port") is None for i in range(cluster.nodes))
    # Nor can a job's port be moved onto one.
    ports = free_ports(3, HOST)
    nodes.admin().AddJob(cpb.AddJobRequest(name="own-port", ports=per_node(ports)), metadata=AUTH, timeout=10)
    with pytest.raises(grpc.RpcError) as e:
        nodes.admin().SetJob(cpb.SetJobRequest(name="own-port", set_ports=True, ports=[cpb.JobPort(port=client_port)]),
                             metadata=AUTH, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "client port" in e.value.details(), e.value
    wait_listening(nodes, "own-port", ports)
    nodes.admin().RemoveJob(cpb.RemoveJobRequest(name="own-port", force=True), metadata=AUTH, timeout=10)


def test_a_port_only_its_node_has_is_reported_as_its_own_and_not_bound(shared) -> None:
    # The leader knows its peers' client and Raft ports, not their HTTP ports: the node does.
    cluster, nodes = shared
    follower = follower_of(cluster)
    http_port = cluster.http_ports[follower]
    ports = free_ports(3, HOST)
    ports[follower] = http_port
    nodes.admin().AddJob(cpb.AddJobRequest(name="on-http", ports=per_node(ports)), metadata=AUTH, timeout=10)
    job = wait_for("the node's own port reported", lambda: nodes.job(follower, "on-http"), 15,
                   ready=lambda j: j is not None and j.port_error, context=cluster)
    assert (job.listening_port, job.port_error) == (0, f"port {http_port} is this node's HTTP port")
    wait_listening(nodes, "on-http", [0 if i == follower else p for i, p in enumerate(ports)], 15)
    with urllib.request.urlopen(f"http://{cluster.http_address(follower)}/livez", timeout=5) as r:
        assert r.status == 200
    # Moved to a port of its own, the job is served there.
    ports[follower] = free_ports(1, HOST)[0]
    nodes.admin().SetJob(cpb.SetJobRequest(name="on-http", set_ports=True, ports=per_node(ports)), metadata=AUTH,
                         timeout=10)
    wait_listening(nodes, "on-http", ports, 15)
    assert nodes.job(follower, "on-http").port_error == ""
    nodes.admin().RemoveJob(cpb.RemoveJobRequest(name="on-http", force=True), metadata=AUTH, timeout=10)
    log = cluster.members[follower].log_path.read_text()
    assert log.count(f"job on-http: port {http_port} is this node's HTTP port; not trying it") == 1, log[-3000:]


def test_without_auto_creation_unknown_jobs_are_not_found(shared) -> None:
    cluster, nodes = shared
    follower = follower_of(cluster)
    address = cluster.client_addresses[follower]
    with pytest.raises(grpc.aio.AioRpcError) as e:
        quorums([SimulatedReplicaGroup("lost", address, job="no-such-job", quorum_timeout_s=10)])
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "no-such-job" in e.value.details()
    with grpc.insecure_channel(address) as ch, pytest.raises(grpc.RpcError) as e2:
        pb_grpc.LighthouseServiceStub(ch).Heartbeat(pb.LighthouseHeartbeatRequest(replica_id="lost"), timeout=2,
                                                    metadata=((JOB_HEADER, "no-such-job"),))
    assert e2.value.code() == grpc.StatusCode.NOT_FOUND
    assert all(nodes.job(i, "no-such-job") is None for i in range(cluster.nodes))


# -- declared and auto-created jobs -------------------------------------------------------------------


DECLARED = '''
[[jobs]]
name = "declared"
ports = [{ports}]
min_replicas = 2
join_timeout_ms = 500

[jobs.config]
lr = 0.1
'''


@pytest.fixture(scope="module")
def creating(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, Nodes, list[int]]]:
    root = tmp_path_factory.mktemp("job-creation")
    ports = free_ports(3, HOST)
    config = root / "jobs.toml"
    config.write_text(DECLARED.format(ports=", ".join(f'"n{i + 1}={p}"' for i, p in enumerate(ports))))
    with started(root / "cluster", extra_args=["--config", str(config), "--auto-create-jobs"]) as (cluster, nodes):
        yield cluster, nodes, ports


def test_declared_jobs_exist_and_a_restart_keeps_an_operators_change(creating) -> None:
    cluster, nodes, ports = creating
    wait_listening(nodes, "declared", ports, timeout=30)
    job = nodes.job(0, "declared")
    assert job.version == 1 and job.settings.min_replicas == 2 and job.settings.join_timeout_ms == 500
    assert [(c.key, c.value) for c in job.config] == [("lr", "0.1")]
    changed = nodes.admin().SetJob(cpb.SetJobRequest(name="declared", settings=cpb.JobSettingsUpdate(min_replicas=3)),
                                   metadata=AUTH, timeout=10)
    assert changed.version == 2
    # The whole cluster restarts from its journals; the serving leader finds the job declared.
    for i in range(cluster.nodes):
        cluster.kill(i)
    for i in range(cluster.nodes):
        cluster.start_node(i)
    cluster.wait_for_stable_leader(timeout=60)
    wait_for("the new leader noticing the changed declared job",
             lambda: any("job declared exists with another spec than declared" in m.log_path.read_text()
                         for m in cluster.members), 30, context=cluster)
    wait_listening(nodes, "declared", ports, timeout=30)
    for i in range(cluster.nodes):
        job = nodes.job(i, "declared")
        assert job.version == 2 and job.settings.min_replicas == 3, job
        assert [j.name for j in nodes.node(i).ListJobs(cpb.ListJobsRequest(), timeout=2).jobs].count("declared") == 1


def test_auto_creation_creates_a_job_on_its_first_use_once(creating) -> None:
    cluster, nodes, _ = creating
    leader, _ = cluster.wait_for_stable_leader(timeout=30)
    defaults = nodes.node(leader).Status(cpb.StatusRequest(), timeout=2).settings
    # First use by Quorum calls racing on every node: one job, created once.
    try:
        got = quorums([SimulatedReplicaGroup(f"f{i}", cluster.client_addresses[i], job="fresh", quorum_timeout_s=20)
                       for i in range(cluster.nodes)])
    except grpc.aio.AioRpcError as e:
        raise AssertionError(f"a first use's Quorum call failed: {e.code().name} {e.details()}\n"
                             f"{cluster.tail_logs(40)}") from e
    assert set().union(*(members(q) for q in got)) == {"f0", "f1", "f2"}
    job = nodes.job(leader, "fresh")
    assert job is not None and job.version == 1 and not job.ports
    assert (job.settings.min_replicas, job.settings.join_timeout_ms, job.settings.quorum_tick_ms,
            job.settings.heartbeat_timeout_ms, job.settings.quorum_lease_ms) == (
        defaults.min_replicas, defaults.join_timeout_ms, defaults.quorum_tick_ms, defaults.heartbeat_timeout_ms,
        defaults.quorum_lease_ms)
    assert job.settings.max_replicas == JobSettings().max_replicas
    wait_for("the job's last quorum", lambda: nodes.job(leader, "fresh").quorum_id, 10,
             ready=lambda qid: qid == max(q.quorum_id for q in got), context=cluster)
    # First use by a unary heartbeat through a follower (which does not know the job yet).
    follower = follower_of(cluster)
    with grpc.insecure_channel(cluster.client_addresses[follower]) as ch:
        beat = lambda: pb_grpc.LighthouseServiceStub(ch).Heartbeat(  # noqa: E731
            pb.LighthouseHeartbeatRequest(replica_id="hb-first"), timeout=2, metadata=((JOB_HEADER, "hb-first"),))
        beat()
        wait_for("job hb-first created and its heartbeat recorded",
                 lambda: beat() is not None and nodes.job(leader, "hb-first"), 10,
                 ready=lambda j: j is not None and "hb-first" in {h.replica_id for h in j.heartbeats},
                 context=cluster)
    # First use by a Watch stream: the leader creates the job and accepts it; a follower refuses
    # it as any Watch, naming the leader.
    first = asyncio.run(watch_first_event(cluster.client_addresses[leader], "watched"))
    assert first.HasField("accepted"), first
    assert nodes.job(leader, "watched") is not None
    with pytest.raises(grpc.aio.AioRpcError) as e:
        asyncio.run(watch_first_event(cluster.client_addresses[follower], "watched-elsewhere"))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # A name that is no job name is refused, not created.
    with pytest.raises(grpc.aio.AioRpcError) as e:
        quorums([SimulatedReplicaGroup("bad", cluster.client_addresses[follower], job="no spaces",
                                       quorum_timeout_s=10)])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "job name" in e.value.details()


async def watch_first_event(address: str, job: str) -> cpb.WatchEvent:
    async with grpc.aio.insecure_channel(address) as ch:
        call = cpb_grpc.LighthouseClusterStub(ch).Watch(metadata=((JOB_HEADER, job),), timeout=10)
        await call.write(cpb.WatchRequest(replica_id=f"w-{job}", keepalive_interval_ms=100))
        event = await call.read()
        if event is grpc.aio.EOF:
            raise AssertionError(f"the Watch stream ended without an event: {await call.code()}")
        call.cancel()
        return event


def port_process_of(node_pid: int) -> int | None:
    """The pid of the process serving the (one) job port of the node ``node_pid``, if one runs."""
    found = job_port_processes(node_pid)
    assert len(found) <= 1, found
    return found[0] if found else None


def niceness_below_node(port_pid: int, node_pid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, port_pid) - os.getpriority(os.PRIO_PROCESS, node_pid)


def test_port_processes_restart_die_with_their_node_and_carry_calls_across_a_leader_kill(tmp_path: Path) -> None:
    """``--job-port-processes``: port processes run ``--job-port-process-nice`` steps of CPU
    priority below their node; a port process SIGKILLed is started again; the leader SIGKILLed
    takes its port processes with it (the port is free) and the other nodes' ports carry the
    job's rounds to the new leader, under higher quorum ids; a liveness stream passes through, and
    its end reaches the leader at once (a 10 s liveness timeout: no timeout ends it)."""
    with started(tmp_path, extra_args=["--job-port-processes", "--job-port-process-nice", "7"],
                 liveness_timeout_ms=10_000) as (cluster, nodes):
        ports = free_ports(3, HOST)
        nodes.admin().AddJob(cpb.AddJobRequest(name="own", ports=per_node(ports), settings=cpb.JobSettingsUpdate(
            min_replicas=2, join_timeout_ms=500)), metadata=AUTH, timeout=10)
        wait_listening(nodes, "own", ports)
        leader, _ = cluster.wait_for_stable_leader(timeout=30)
        follower = follower_of(cluster)
        pids = [port_process_of(m.process.pid) for m in cluster.members]
        assert all(pids), pids
        assert [niceness_below_node(p, m.process.pid) for p, m in zip(pids, cluster.members)] == [7, 7, 7]
        first = quorums([SimulatedReplicaGroup("p0", f"{HOST}:{ports[leader]}", quorum_timeout_s=20),
                         SimulatedReplicaGroup("p1", f"{HOST}:{ports[follower]}", quorum_timeout_s=20)])
        assert all(members(q) == {"p0", "p1"} for q in first), first
        # A liveness stream through the leader's port is the port's job's (its metadata ignored);
        # the leader sees it open, and closed as soon as the trainer's end goes.
        open_streams = lambda: nodes.job(leader, "own").open_streams  # noqa: E731

        async def watch_then_go() -> cpb.WatchEvent:
            async with grpc.aio.insecure_channel(f"{HOST}:{ports[leader]}") as ch:
                call = cpb_grpc.LighthouseClusterStub(ch).Watch(metadata=((JOB_HEADER, "some-other-job"),))
                await call.write(cpb.WatchRequest(replica_id="watcher", keepalive_interval_ms=100))
                event = await call.read()
                await asyncio.to_thread(wait_for, "the stream open on the leader", open_streams, 10,
                                        ready=lambda n: n == 1, context=cluster)
                call.cancel()
                return event

        event = asyncio.run(watch_then_go())
        assert event.HasField("accepted"), event
        wait_for("the stream's end on the leader", open_streams, 5, ready=lambda n: n == 0, context=cluster)

        os.kill(pids[follower], signal.SIGKILL)
        node_pid = cluster.members[follower].process.pid
        restarted = wait_for("the follower's port process started again",
                             lambda: port_process_of(node_pid), 15,
                             ready=lambda pid: pid is not None and pid != pids[follower], context=cluster)
        wait_listening(nodes, "own", ports)
        assert niceness_below_node(restarted, node_pid) == 7
        assert f"its port process {pids[follower]} exited (-9 (SIGKILL))" in \
            cluster.members[follower].log_path.read_text()

        cluster.kill(leader)
        wait_for("the dead leader's port process gone", lambda: not pid_running(pids[leader]), 10, context=cluster)
        wait_for("the dead leader's port free", lambda: can_bind(HOST, ports[leader]), 10, context=cluster)
        others = [i for i in range(cluster.nodes) if i != leader]
        # New groups (new members: a new quorum id, committed by the new leader).
        after = quorums([SimulatedReplicaGroup(f"q{i}", f"{HOST}:{ports[i]}", quorum_timeout_s=30) for i in others])
        assert all(members(q) == {f"q{i}" for i in others} for q in after), after
        assert min(q.quorum_id for q in after) > first[0].quorum_id
        assert port_process_of(node_pid) == restarted


@pytest.mark.parametrize("served", sorted(SERVED))
def test_a_job_port_has_the_client_ports_tls(tmp_path: Path, served: str) -> None:
    """A TLS node serves a declared job's port (``port = P``: every node) with TLS too (a port
    process gets the node's certificate and dials its node with TLS)."""
    pki = generate_pki(tmp_path / "pki")
    (port,) = free_ports(1, HOST)
    config = tmp_path / "jobs.toml"
    config.write_text(f'[[jobs]]\nname = "secure"\nport = {port}\n')
    cluster = LocalCluster(root=tmp_path / "cluster", nodes=1, pki=pki,
                           extra_args=["--config", str(config)] + SERVED[served])
    tls = pki.client_tls(with_cert=False)
    with cluster:
        address = f"{HOST}:{port}"

        def secure_job() -> cpb.Job | None:
            with tls_channel(cluster.client_addresses[0], tls) as ch:
                try:
                    return cpb_grpc.LighthouseClusterStub(ch).GetJob(cpb.JobRequest(name="secure"), timeout=2)
                except grpc.RpcError:
                    return None
        wait_for("the declared job's TLS port", secure_job, 30, ready=lambda j: j is not None and j.listening_port,
                 context=cluster)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            quorums([SimulatedReplicaGroup("plain", address, quorum_timeout_s=3)])
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        (q,) = quorums([SimulatedReplicaGroup("tls", address, quorum_timeout_s=20, tls=tls)])
        assert members(q) == {"tls"}
        assert secure_job().quorum_id == q.quorum_id
