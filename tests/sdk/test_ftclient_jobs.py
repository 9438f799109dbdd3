"""ftclient and jobs (issue 17) on a real 3-node cluster: one cluster, several training jobs.

Jobs are created through ``LighthouseAdmin.AddJob`` with the cluster's admin token; each test
uses jobs of its own names on one module-wide cluster. Covered:

* two jobs whose replica groups use the *same* replica ids (the job chosen by the ``job``
  argument and by a ``?job=`` URL) get their own quorums: ids, members, heartbeats; the default
  job's quorum is untouched; a job the cluster does not know fails with ``JobNotFoundError``
  naming the job and the cluster, for Quorum, Heartbeat and the configuration alike;
* ``Manager(job=...)`` and ``LIGHTHOUSE_JOB``: each group trains a step in its own job;
  ``Manager.job_config()`` on every rank (and ``read_job_config`` without a Manager) returns what
  AddJob set and, read again, what SetJob changed;
* a replica group SIGKILLed in job A -- an unchanged torchft program run through
  ``python -m ftclient.as_torchft``, its job named by ``?job=`` on ``TORCHFT_LIGHTHOUSE`` -- is
  declared dead and notified to job A's other member at once; job B's members, one of them with
  the same replica id as job A's survivor, see nothing (liveness streams are per job).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from torch.distributed import TCPStore

from ftclient.job_selection import JOB_ENV
from ftclient.lighthouse_client import JobNotFoundError, LighthouseClient, read_job_config
from ftclient.liveness import LivenessStream, PeerDied
from ftclient.manager import Manager
from ftclient.process_group import ProcessGroupGloo
from lighthouse_cluster.local.cluster import LocalCluster
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import lighthouse_cluster_pb2_grpc as cpb_grpc
from lighthouse_cluster.server.admin import token_metadata
from support.cluster import started_cluster
from support.waiting import wait_for
from support.null_transport import NullTransport

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "jobs-test-admin-token"
TIMEOUT = timedelta(seconds=20)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """The default job needs 2 replica groups (a lone test requester there would wait); short
    join and heartbeat timeouts keep one test's leftovers from holding up the next."""
    with started_cluster(tmp_path_factory.mktemp("jobs"), min_replicas=2, join_timeout_ms=300,
                         heartbeat_timeout_ms=1000, admin_token=TOKEN) as c:
        yield c


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(8) as ex:
        yield ex


def admin(cluster: LocalCluster, call: Callable[[cpb_grpc.LighthouseAdminStub], cpb.Job], what: str) -> cpb.Job:
    """An admin call at the leader, retried until it is accepted (a leader just elected refuses
    job changes until the jobs schema is enabled)."""
    def attempt() -> cpb.Job:
        with grpc.insecure_channel(cluster.client_addresses[cluster.wait_for_leader()]) as ch:
            return call(cpb_grpc.LighthouseAdminStub(ch))
    return wait_for(what, attempt, 20, retry_on=(grpc.RpcError,), context=cluster)


def add_job(cluster: LocalCluster, name: str, config: dict[str, str] | None = None, **settings: int) -> cpb.Job:
    request = cpb.AddJobRequest(name=name, settings=cpb.JobSettingsUpdate(**settings),
                                config=[cpb.ConfigEntry(key=k, value=v) for k, v in (config or {}).items()])
    return admin(cluster, lambda s: s.AddJob(request, metadata=token_metadata(TOKEN), timeout=5), f"job {name} added")


def set_config(cluster: LocalCluster, name: str, set_: dict[str, str], unset: list[str]) -> cpb.Job:
    request = cpb.SetJobRequest(name=name, set_config=[cpb.ConfigEntry(key=k, value=v) for k, v in set_.items()],
                                unset_config=unset)
    return admin(cluster, lambda s: s.SetJob(request, metadata=token_metadata(TOKEN), timeout=5), f"job {name} set")


def job_view(cluster: LocalCluster, name: str) -> cpb.Job:
    """The job as the serving leader sees it (heartbeats and pending filled)."""
    with grpc.insecure_channel(cluster.client_addresses[cluster.wait_for_leader()]) as ch:
        return cpb_grpc.LighthouseClusterStub(ch).GetJob(cpb.JobRequest(name=name), timeout=5)


def members(q: Any) -> list[tuple[str, str]]:
    return [(m.replica_id, m.address) for m in q.participants]


# -- quorums: same replica ids, separate jobs ------------------------------------------------------


def test_two_jobs_with_the_same_replica_ids_get_their_own_quorums(cluster: LocalCluster,
                                                                   pool: ThreadPoolExecutor) -> None:
    add_job(cluster, "same-a", min_replicas=2, join_timeout_ms=300)
    add_job(cluster, "same-b", min_replicas=2, join_timeout_ms=300)
    default_before = job_view(cluster, "default")
    clients = {  # job A by the argument, job B by the URL
        ("a", rid): LighthouseClient(cluster.endpoints, connect_timeout=10, job="same-a") for rid in ("r0", "r1")}
    clients.update({
        ("b", rid): LighthouseClient(f"{cluster.endpoints}?job=same-b", connect_timeout=10) for rid in ("r0", "r1")})
    try:
        assert {c.job.name for c in clients.values()} == {"same-a", "same-b"}

        def round_(who: dict[tuple[str, str], LighthouseClient], first_waiting: tuple[str, str] | None = None,
                   ) -> dict[tuple[str, str], Any]:
            """Quorum calls of ``who``, all at once (``first_waiting``'s first, once it waits)."""
            def ask(key: tuple[str, str]) -> Any:
                return pool.submit(who[key].quorum, key[1], 20, address=f"{key[0]}-{key[1]}", step=1)

            futs = {}
            if first_waiting is not None:
                futs[first_waiting] = ask(first_waiting)
                wait_for(f"{first_waiting} waiting at the leader", lambda: first_waiting[1] in {
                    p.member.replica_id for p in job_view(cluster, f"same-{first_waiting[0]}").pending}, 10)
            futs.update({key: ask(key) for key in who if key not in futs})
            return {k: f.result(timeout=25) for k, f in futs.items()}

        first = round_(clients)
        qa, qb = first[("a", "r0")], first[("b", "r0")]
        assert first[("a", "r1")].quorum_id == qa.quorum_id and first[("b", "r1")].quorum_id == qb.quorum_id
        # Same replica ids, each job's own members (their addresses say which job they are).
        assert members(qa) == [("r0", "a-r0"), ("r1", "a-r1")]
        assert members(qb) == [("r0", "b-r0"), ("r1", "b-r1")]
        assert members(first[("a", "r1")]) == members(qa) and members(first[("b", "r1")]) == members(qb)
        wait_for("job B's quorum committed", lambda: job_view(cluster, "same-b"), 10,
                 ready=lambda j: j.quorum_id == qb.quorum_id)

        # A second round of job A alone, with a third member: A's quorum id moves on, B's stays.
        # (The new member waits first: once the previous members are back, the quorum goes out.)
        clients[("a", "r2")] = LighthouseClient(cluster.endpoints, connect_timeout=10, job="same-a")
        second = round_({k: c for k, c in clients.items() if k[0] == "a"}, first_waiting=("a", "r2"))
        assert second[("a", "r0")].quorum_id > qa.quorum_id
        view_a = wait_for("job A's second quorum committed", lambda: job_view(cluster, "same-a"), 10,
                          ready=lambda j: j.quorum_id == second[("a", "r0")].quorum_id)
        view_b = job_view(cluster, "same-b")
        assert view_b.quorum_id == qb.quorum_id and members(view_b.quorum) == members(qb)
        assert members(view_a.quorum) == [("r0", "a-r0"), ("r1", "a-r1"), ("r2", "a-r2")]

        # Heartbeats are per job too.
        clients[("b", "r1")].heartbeat("beats-in-b")
        assert "beats-in-b" in {h.replica_id for h in job_view(cluster, "same-b").heartbeats}
        assert "beats-in-b" not in {h.replica_id for h in job_view(cluster, "same-a").heartbeats}

        # The default job saw none of it.
        default_after = job_view(cluster, "default")
        assert default_after.quorum_id == default_before.quorum_id
        assert members(default_after.quorum) == members(default_before.quorum)
        assert not {"r0", "r1", "r2", "beats-in-b"} & {h.replica_id for h in default_after.heartbeats}
    finally:
        for c in clients.values():
            c.close()


def test_an_unknown_job_fails_with_an_error_naming_it_and_the_cluster(cluster: LocalCluster) -> None:
    with LighthouseClient(cluster.endpoints, connect_timeout=10, job="no-such-job") as client:
        for call in (lambda: client.quorum("u0", 10), lambda: client.heartbeat("u0"), client.job_config):
            with pytest.raises(JobNotFoundError) as info:
                call()
            assert info.value.job == "no-such-job"
            assert "no job 'no-such-job' on the lighthouse cluster at" in str(info.value)
            assert cluster.client_addresses[0] in str(info.value)
    with pytest.raises(JobNotFoundError, match="no job 'no-such-job'"):
        read_job_config(f"{cluster.endpoints}?job=no-such-job", timeout=10)


# -- the Manager: job selection and job_config -----------------------------------------------------


def replica_group(pool: ThreadPoolExecutor, lighthouse: str, name: str, world_size: int, **kwargs: Any,
                  ) -> tuple[TCPStore, list[Manager]]:
    """A replica group's Manager ranks, as threads of this process."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)

    def build(rank: int) -> Manager:
        return Manager(pg=ProcessGroupGloo(timeout=TIMEOUT), load_state_dict=None, state_dict=None,
                       min_replica_size=1, use_async_quorum=False, timeout=TIMEOUT, quorum_timeout=TIMEOUT,
                       connect_timeout=TIMEOUT, rank=rank, world_size=world_size, store_addr="127.0.0.1",
                       store_port=store.port, lighthouse_addr=lighthouse, replica_id=name, hostname="127.0.0.1",
                       checkpoint_transport=NullTransport(), init_sync=False, **kwargs)

    futs = [pool.submit(build, r) for r in range(world_size)]
    return store, [f.result(timeout=30) for f in futs]


def one_step(m: Manager) -> bool:
    m.start_quorum()
    m.allreduce(torch.tensor([1.0])).wait()
    return m.should_commit()


def test_managers_train_in_their_jobs_and_read_the_job_config(cluster: LocalCluster, pool: ThreadPoolExecutor,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    add_job(cluster, "cfg-a", config={"lr": "0.1", "schedule": "cosine"}, min_replicas=1)
    add_job(cluster, "cfg-b", min_replicas=1)
    monkeypatch.delenv(JOB_ENV, raising=False)
    managers: list[Manager] = []
    stores: list[TCPStore] = []  # each group's store lives as long as its group
    try:
        store, group_a = replica_group(pool, cluster.endpoints, "g", 2, job="cfg-a")  # the job argument
        stores.append(store)
        managers += group_a
        monkeypatch.setenv(JOB_ENV, "cfg-b")
        store, group_b = replica_group(pool, cluster.endpoints, "g", 1)  # LIGHTHOUSE_JOB
        stores.append(store)
        managers += group_b
        monkeypatch.delenv(JOB_ENV)
        assert [m.job for m in managers] == ["cfg-a", "cfg-a", "cfg-b"]

        # One step each, at once: each group alone in its job's quorum (min_replicas=1).
        assert [f.result(timeout=60) for f in [pool.submit(one_step, m) for m in managers]] == [True] * 3
        a0, b0 = group_a[0], group_b[0]
        assert a0.last_quorum_result is not None and a0.last_quorum_result.replica_world_size == 1
        view_a = wait_for("job A's quorum committed", lambda: job_view(cluster, "cfg-a"), 10,
                          ready=lambda j: j.has_quorum)
        view_b = wait_for("job B's quorum committed", lambda: job_view(cluster, "cfg-b"), 10,
                          ready=lambda j: j.has_quorum)
        assert [m.replica_id for m in view_a.quorum.participants] == [a0.replica_id]
        assert [m.replica_id for m in view_b.quorum.participants] == [b0.replica_id]

        # job_config on every rank (rank 1 through rank 0's address and job in the store), and
        # without a Manager; read again after SetJob.
        assert [m.job_config() for m in group_a] == [{"lr": "0.1", "schedule": "cosine"}] * 2
        assert b0.job_config() == {}
        assert read_job_config(f"{cluster.endpoints}?job=cfg-a") == {"lr": "0.1", "schedule": "cosine"}
        set_config(cluster, "cfg-a", {"lr": "0.05", "warmup": "100"}, ["schedule"])
        changed = {"lr": "0.05", "warmup": "100"}
        assert group_a[0].job_config() == changed  # the leader answers rank 0: it has the change
        wait_for("rank 1 reads the change", group_a[1].job_config, 10, ready=lambda c: c == changed)
        assert b0.job_config() == {}
    finally:
        for m in managers:
            m.shutdown(wait=False)


# -- liveness: a death in job A is job A's news only -----------------------------------------------

# An unchanged torchft program (run through python -m ftclient.as_torchft): its job is named by
# ``?job=`` on TORCHFT_LIGHTHOUSE. Its quorum includes the test's member of job A; it holds there
# (the process group waits for a peer that never comes) until the test SIGKILLs it.
TORCHFT_PROGRAM = textwrap.dedent('''
    import sys, time
    from datetime import timedelta
    import torchft
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = torchft.Manager(pg=torchft.ProcessGroupGloo(timeout=timedelta(seconds=60)), load_state_dict=None,
                              state_dict=None, min_replica_size=2, replica_id="victim", rank=0, world_size=1,
                              store_addr="127.0.0.1", store_port=store.port, hostname="127.0.0.1")
    manager.start_quorum()  # asynchronous: the quorum and the group's configuration go on in the background
    print("started", manager.replica_id, getattr(manager, "job", "?"), flush=True)  # for the test (ftclient's)
    time.sleep(300)
''')


class Member:
    """A test replica group: a lighthouse client and its liveness stream, collecting notices."""

    def __init__(self, lighthouse: str, replica_id: str, job: str) -> None:
        self.replica_id = replica_id
        self.notices: list[PeerDied] = []
        self.client = LighthouseClient(lighthouse, connect_timeout=10, job=job)
        self.stream = LivenessStream(self.client, replica_id, keepalive_interval=0.05,
                                     on_peer_died=self.notices.append).start()
        assert self.stream.wait_accepted(10), self.stream.state

    def close(self) -> None:
        self.stream.close()
        self.client.close()


def test_a_replica_group_killed_in_one_job_is_notified_in_that_job_only(cluster: LocalCluster,
                                                                        pool: ThreadPoolExecutor,
                                                                        tmp_path: Path) -> None:
    add_job(cluster, "live-a", min_replicas=2, join_timeout_ms=60_000)
    add_job(cluster, "live-b", min_replicas=2, join_timeout_ms=60_000)
    log_path = tmp_path / "victim.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHFT_", "FTCLIENT_")) and k != JOB_ENV}
    env.update(PYTHONPATH=str(ROOT), TORCHFT_LIGHTHOUSE=f"{cluster.endpoints}?job=live-a",
               TORCHFT_CONNECT_TIMEOUT_SEC="20", TORCHFT_QUORUM_TIMEOUT_SEC="60")
    members_: list[Member] = []
    with open(log_path, "w") as log:
        victim = subprocess.Popen([sys.executable, "-m", "ftclient.as_torchft", "-c", TORCHFT_PROGRAM], cwd=ROOT,
                                  env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    output = lambda: log_path.read_text(errors="replace")[-4000:]  # noqa: E731
    try:
        survivor = Member(cluster.endpoints, "survivor", "live-a")
        # Job B: the same replica id as job A's survivor, and another.
        b_same, b_other = Member(cluster.endpoints, "survivor", "live-b"), Member(cluster.endpoints, "b1", "live-b")
        members_ += [survivor, b_same, b_other]
        qb = [f.result(timeout=30) for f in [pool.submit(m.client.quorum, m.replica_id, 20) for m in (b_same, b_other)]]
        assert [m.replica_id for m in qb[0].participants] == ["b1", "survivor"]

        qa = pool.submit(survivor.client.quorum, "survivor", 90).result(timeout=95)  # once the torchft program joins
        assert victim.poll() is None, output()
        (victim_id,) = [m.replica_id for m in qa.participants if m.replica_id != "survivor"]
        assert victim_id.startswith("victim:"), qa
        # A whole line: print() may reach the file in pieces (CI read "started" alone).
        started = wait_for("the torchft program to say its job",
                           lambda: re.search(r"^started (\S+) (\S+)\n", output(), re.M), 30, context=output)
        assert started.groups() == (victim_id, "live-a"), output()
        # The program's stream opens beside its Quorum call, and may be accepted after the quorum
        # is issued: a group killed before that has no stream to close (and the leader dialled no
        # connection to its manager yet), so nothing would tell its peers before its heartbeat ages.
        wait_for("the torchft program's liveness stream accepted", lambda: job_view(cluster, "live-a").open_streams,
                 10, ready=lambda n: n == 2, context=lambda: f"{cluster.tail_logs()}\n--- the torchft program ---\n"
                                                           f"{output()}")

        killed = time.monotonic()
        os.killpg(victim.pid, 9)
        victim.wait(timeout=10)
        notice = wait_for("job A's survivor notified", lambda: survivor.notices, 5,
                          context=lambda: f"{cluster.tail_logs()}\n--- the torchft program ---\n{output()}")[0]
        took = time.monotonic() - killed
        assert notice.quorum_id == qa.quorum_id and notice.replica_ids == (victim_id,), notice
        assert took < 2.0, took
        # The leader sends a death's notices at once: job B's would have come with job A's. Give
        # them the liveness timeout (500 ms) twice over.
        time.sleep(1.0)
        assert b_same.notices == [] and b_other.notices == []
        assert b_same.stream.accepted and b_other.stream.accepted
        assert survivor.notices == [notice]
    finally:
        if victim.poll() is None:
            os.killpg(victim.pid, 9)
            victim.wait(timeout=10)
        for m in members_:
            m.close()
