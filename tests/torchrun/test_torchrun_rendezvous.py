"""``torchrun --rdzv-backend=lighthouse`` with real torchrun agents on a real 3-node cluster on
loopback (issue 34 part 2). Each agent is a node of a multi-node job on this host (``--nnodes``,
``--node-rank`` unset, ``--rdzv-id``); its worker (``support/torchrun_worker.py``) joins the Gloo
process group torchrun set up and checks an allreduce.

* two agents rendezvous and train, and the rendezvous is in the cluster's store;
* the Raft leader is SIGKILLed while an agent waits in the rendezvous, and again while the
  workers train: the job forms and finishes;
* ``--nnodes=1:3``: an agent is SIGKILLed, the survivors re-rendezvous at world size 2; a new
  agent joins and the world grows to 3;
* two runs with different ``--rdzv-id`` on one cluster never see each other;
* bad input (a garbage state, an unknown job, a bad endpoint) ends torchrun with one line and
  starts no worker; what was in the store stays.

One 3-node cluster serves the module but the leader-kill test, which has its own.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Iterator

import pytest

from ftclient.torchrun_rendezvous.state_backend import STATE_KEY
from lighthouse_cluster.client.kv_client import KVClient
from lighthouse_cluster.core.jobs import DEFAULT_JOB
from lighthouse_cluster.core.rendezvous_state import read_summary
from lighthouse_cluster.local.cluster import LocalCluster
from support.cluster import started_cluster
from support.torchrun_agents import TorchrunJob
from support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

FINISH_S = 90.0     # torchrun agents (two torch imports each) up, rendezvoused, trained, gone
TRAINING_S = 60.0   # every worker of a round past its first allreduce


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with started_cluster(tmp_path_factory.mktemp("torchrun-cluster"), election_timeout_ms=150) as c:
        yield c


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[list[TorchrunJob]]:
    made: list[TorchrunJob] = []
    yield made
    for job in made:
        job.close()


def endpoints_of(cluster: LocalCluster) -> str:
    return ",".join(f"http://{a}" for a in cluster.client_addresses)


def new_job(jobs: list[TorchrunJob], cluster: LocalCluster, tmp_path: Path, run_id: str, **kwargs) -> TorchrunJob:
    job = TorchrunJob(endpoints_of(cluster), run_id, tmp_path, **kwargs)
    jobs.append(job)
    return job


def kv_of(cluster: LocalCluster, run_id: str, job: str = DEFAULT_JOB) -> KVClient:
    return KVClient(endpoints_of(cluster), job, run_id, timeout=20.0)


def finish(job: TorchrunJob, timeout: float = FINISH_S) -> None:
    for agent in job.agents:
        if agent.running() or agent.process.returncode is None:
            rc = agent.wait(timeout)
            assert rc == 0, f"agent {agent.name} exited {rc}\n{job.logs()}"


def ranks_and_worlds(records: list[dict]) -> list[tuple[int, int]]:
    return sorted((r["rank"], r["world_size"]) for r in records)


def wait_training(job: TorchrunJob, world: int, *, after: list[dict] = (), timeout: float = TRAINING_S) -> list[dict]:
    """The training records of a round of ``world`` workers (each rank once), among workers not
    in ``after`` (the records of earlier rounds)."""
    earlier = {r["pid"] for r in after}

    def round_up() -> list[dict] | None:
        latest = [r for r in job.records("training") if r["world_size"] == world and r["pid"] not in earlier]
        return latest if sorted(r["rank"] for r in latest) == list(range(world)) else None
    return wait_for(f"{world} workers of {job.run_id} training", round_up, timeout, context=job.logs, interval=0.1)


def test_two_agents_rendezvous_and_train(cluster: LocalCluster, jobs: list[TorchrunJob], tmp_path: Path) -> None:
    job = new_job(jobs, cluster, tmp_path, "two-agents")
    agents = [job.start_agent(), job.start_agent()]
    finish(job)
    done = job.records("done")
    assert ranks_and_worlds(done) == [(0, 2), (1, 2)]
    assert sorted(r["agent_pid"] for r in done) == sorted(a.process.pid for a in agents)
    # The rendezvous went through the cluster: its state and the agents' keys are in the run's namespace.
    with kv_of(cluster, "two-agents") as kv:
        state = kv.get(STATE_KEY)
        keys = [e.key for e in kv.list()[0]]
    # Its round as the nodes read it, from the summary line the agents wrote after torch's state.
    assert state is not None
    summary = read_summary(state.value)
    assert summary is not None and (summary.round, summary.complete, summary.participants) == (0, True, 2), summary
    assert any(k.endswith("/MASTER_ADDR") for k in keys), keys
    assert any("torchelastic/assigned_ranks/1" in k for k in keys), keys


def test_leader_killed_during_rendezvous_and_training(make_cluster, jobs: list[TorchrunJob], tmp_path: Path) -> None:
    cluster: LocalCluster = make_cluster(election_timeout_ms=150)
    cluster.wait_for_stable_leader(timeout=30)
    job = new_job(jobs, cluster, tmp_path, "leader-kills")
    first = job.start_agent(hold=True)
    # The first agent has joined the rendezvous (its state is in the store) and waits for a second.
    with kv_of(cluster, "leader-kills") as kv:
        wait_for("the first agent's rendezvous state", lambda: kv.get(STATE_KEY), FINISH_S,
                 context=job.logs, interval=0.1)
    leader, _ = cluster.wait_for_stable_leader(timeout=30)
    cluster.kill(leader)
    job.start_agent(hold=True)
    wait_training(job, 2)
    assert first.running()
    # A majority again before the next kill: the killed node comes back.
    cluster.start_node(leader)
    wait_for("the restarted node to follow", lambda: cluster.status(leader) is not None, 30, context=cluster)
    second_leader, _ = cluster.wait_for_stable_leader(timeout=30)
    cluster.kill(second_leader)
    job.hold.touch()
    finish(job)
    assert ranks_and_worlds(job.records("done")) == [(0, 2), (1, 2)]
    assert {r["restart"] for r in job.records("done")} == {0}


def test_elastic_shrink_then_grow(cluster: LocalCluster, jobs: list[TorchrunJob], tmp_path: Path) -> None:
    # Rank 0 may move to another agent between rounds here. torch 2.13's agents then keep the
    # workers' TCPStore of an earlier round's rank 0 (DynamicRendezvousHandler.next_rendezvous
    # rebuilds it only on the new rank 0) and the workers split between two stores: elastic jobs
    # turn the shared agent store off, so that each round's rank 0 publishes a fresh
    # MASTER_ADDR/MASTER_PORT in the rendezvous store (docs/operations.md).
    job = new_job(jobs, cluster, tmp_path, "elastic", nnodes="1:3", torchrun_args=("--max-restarts=5",),
                  env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    agents = [job.start_agent(hold=True) for _ in range(3)]
    round3 = wait_training(job, 3)
    victim = next(a for a in agents if a.process.pid == next(r["agent_pid"] for r in round3 if r["rank"] == 2))
    victim.kill_tree()
    # The survivors' workers fail on the dead peer; their agents restart them in a world of 2.
    shrunk = wait_training(job, 2, after=round3)
    # (torch may need more than one restart to get there: a survivor can start its round first.)
    assert min(r["restart"] for r in shrunk) >= 1 and victim.process.pid not in {r["agent_pid"] for r in shrunk}
    newcomer = job.start_agent(hold=True)
    grown = wait_training(job, 3, after=round3 + shrunk)
    assert newcomer.process.pid in {r["agent_pid"] for r in grown}, grown
    job.hold.touch()
    for agent in job.agents:
        if agent is not victim:
            assert agent.wait(FINISH_S) == 0, job.logs()
    done = job.records("done")
    assert ranks_and_worlds(done) == [(0, 3), (1, 3), (2, 3)]
    assert victim.process.pid not in {r["agent_pid"] for r in done}


def test_two_runs_never_see_each_other(cluster: LocalCluster, jobs: list[TorchrunJob], tmp_path: Path) -> None:
    a = new_job(jobs, cluster, tmp_path, "run-a")
    b = new_job(jobs, cluster, tmp_path, "run-b")
    # One agent of each waits in its rendezvous: together they would make a world of 2.
    a.start_agent()
    b.start_agent()
    with kv_of(cluster, "run-a") as kv_a, kv_of(cluster, "run-b") as kv_b:
        wait_for("both runs' first agents in their rendezvous",
                 lambda: kv_a.get(STATE_KEY) and kv_b.get(STATE_KEY), FINISH_S, interval=0.1,
                 context=lambda: a.logs() + b.logs())
    assert not a.records("training") and not b.records("training")
    a.start_agent()
    b.start_agent()
    finish(a)
    finish(b)
    for job in (a, b):
        done = job.records("done")
        assert ranks_and_worlds(done) == [(0, 2), (1, 2)]
        assert sorted(r["agent_pid"] for r in done) == sorted(x.process.pid for x in job.agents)


def last_line_of_failure(job: TorchrunJob) -> str:
    """The one line a torchrun that refused to start ended with (and it started no worker)."""
    agent = job.agents[-1]
    rc = agent.wait(FINISH_S)
    lines = [line for line in agent.output().strip().splitlines() if line.strip()]
    assert rc == 1, job.logs()
    assert lines and lines[-1].startswith("torchrun --rdzv-backend=lighthouse: "), job.logs()
    assert not job.records("training"), "no worker may start"
    return lines[-1]


def test_bad_input_fails_in_one_line_and_loses_nothing(cluster: LocalCluster, jobs: list[TorchrunJob],
                                                       tmp_path: Path) -> None:
    garbage = new_job(jobs, cluster, tmp_path, "garbage")
    with kv_of(cluster, "garbage") as kv:
        kv.set(STATE_KEY, b"\x80not a pickle")
        kv.set("torchrun/other", b"kept")
    unknown = new_job(jobs, cluster, tmp_path, "unknown-job", conf={"job": "no-such-job"})
    bad_endpoint = new_job(jobs, cluster, tmp_path, "bad-endpoint")
    bad_conf = new_job(jobs, cluster, tmp_path, "bad-conf", conf={"tls_cert": "/nonexistent/cert.pem"})
    # All four at once (each is a torchrun process importing torch).
    garbage.start_agent()
    unknown.start_agent()
    bad_endpoint.start_agent(command=[c if not c.startswith("--rdzv-endpoint=") else "--rdzv-endpoint=http://[::1:29510"
                                      for c in bad_endpoint.command()])
    bad_conf.start_agent()
    lines = {name: last_line_of_failure(job) for name, job in (
        ("garbage", garbage), ("unknown", unknown), ("endpoint", bad_endpoint), ("conf", bad_conf))}
    assert "not a rendezvous state written by the lighthouse backend" in lines["garbage"]
    assert "lighthouse-cluster rendezvous remove default garbage" in lines["garbage"]
    assert "job 'no-such-job' is not known to the cluster" in lines["unknown"]
    assert lines["endpoint"].startswith("torchrun --rdzv-backend=lighthouse: --rdzv-endpoint"), lines["endpoint"]
    assert "client certificate needs both" in lines["conf"], lines["conf"]
    with kv_of(cluster, "garbage") as kv:
        assert kv.get(STATE_KEY).value == b"\x80not a pickle"  # type: ignore[union-attr]
        assert kv.get("torchrun/other").value == b"kept"  # type: ignore[union-attr]
    with kv_of(cluster, "unknown-job", job="no-such-job") as kv:
        assert kv.num_keys() == 0
