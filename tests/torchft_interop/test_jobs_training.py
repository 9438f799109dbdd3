"""Issue 17, done when: two torchft jobs and one ftclient job train at once through one 3-node
cluster, each with its own quorum ids and members, across a leader SIGKILL with no failed step.

* jobs ``torch-a`` and ``torch-b``: unchanged torchft 0.2.0 trainers (``support/torchft_trainer.py``:
  torchft's Manager, ProcessGroupGloo, DDP, Optimizer), two replica groups each, selecting their job
  by port: each job has its own client port on every node (one per node here: the local nodes share
  one host; in Kubernetes one port serves every node), and each group's ``TORCHFT_LIGHTHOUSE`` is that port on a follower;
* job ``ft-c``: ftclient trainers (``examples/train_ddp.py``), two replica groups, with every node's
  address and ``LIGHTHOUSE_JOB=ft-c`` (selection by name on the shared client ports);
* every job's replica groups carry the same replica ids as the other jobs' (the same group numbers),
  so only the job keeps them apart;
* the Raft leader is SIGKILLed while Quorum calls wait at it (one torchft group of each torchft
  job is slow, so calls wait at the leader every step).

Then, for every job: every step committed once, no trainer restarted, identical parameters and
optimizer state within the job; the torchft jobs' quorum id unchanged across the failover (no process
group rebuilt); and the cluster's last quorum of each job has exactly that job's groups, under ids
of its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import grpc
import pytest

pytest.importorskip("torch", reason="torch is not installed: the torchft training tests need it")
pytest.importorskip("torchft", reason="torchft is not installed: the torchft training tests need it")

from lighthouse_cluster.local.cluster import free_ports  # noqa: E402
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb  # noqa: E402
from lighthouse_cluster.proto import lighthouse_cluster_pb2_grpc as cpb_grpc  # noqa: E402
from lighthouse_cluster.server.admin import token_metadata  # noqa: E402
from support.cluster import quorum_call  # noqa: E402
from support.job_admin import add_job  # noqa: E402
from support.trainer_process import DdpExampleTrainer, TorchftTrainer  # noqa: E402
from support.training import TrainingRun  # noqa: E402

# exclusive: a leader SIGKILLed in the few ms between the answers of one round loses the answer to
# the later member (the earlier one waits in its allreduce until the collective timeout; an open
# problem, see the closing note of 2026-11-26): alone, a quiet machine keeps that window small.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(240), pytest.mark.exclusive]

TOKEN = "jobs-training"
GROUPS = 2
STEPS = 25
STEP_SLEEP_S = 0.1
TORCH_JOBS = ("torch-a", "torch-b")
FT_JOB = "ft-c"


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[TrainingRun]:
    with TrainingRun(tmp_path, finish_timeout=150.0) as run:
        yield run


def _jobs(address: str) -> dict[str, cpb.Job]:
    with grpc.insecure_channel(address) as ch:
        return {j.name: j for j in cpb_grpc.LighthouseClusterStub(ch).ListJobs(cpb.ListJobsRequest(), timeout=5).jobs}


def test_two_torchft_jobs_and_an_ftclient_job_train_through_a_leader_kill(harness: TrainingRun) -> None:
    cluster = harness.start_cluster(min_replicas=2, admin_token=TOKEN)
    leader = cluster.wait_for_leader()
    followers = [i for i in range(cluster.nodes) if i != leader]
    settings = cpb.JobSettingsUpdate(min_replicas=GROUPS, join_timeout_ms=1000)
    ports: dict[str, list[int]] = {}
    for job in TORCH_JOBS:
        ports[job] = free_ports(cluster.nodes)  # one per node: the local nodes share one host
        add_job(cluster, TOKEN, job, settings=settings,
                ports=[cpb.JobPort(node_id=f"n{i + 1}", port=p) for i, p in enumerate(ports[job])])
    add_job(cluster, TOKEN, FT_JOB, settings=settings)
    # torch-b's ids start further on: two quorums of simulated groups before its trainers start
    # (at min_replicas 1 for them), so every job's ids are visibly its own.
    admin = cpb_grpc.LighthouseAdminStub(grpc.insecure_channel(cluster.client_addresses[leader]))
    admin.SetJob(cpb.SetJobRequest(name="torch-b", settings=cpb.JobSettingsUpdate(
        min_replicas=1, heartbeat_timeout_ms=300)), metadata=token_metadata(TOKEN), timeout=10)
    for warm in ("warm-0", "warm-1"):  # the second once the first's heartbeat is 300 ms old
        quorum_call(cluster.client_addresses[leader], warm, job="torch-b")
    admin.SetJob(cpb.SetJobRequest(name="torch-b", settings=cpb.JobSettingsUpdate(
        min_replicas=GROUPS, heartbeat_timeout_ms=5000)), metadata=token_metadata(TOKEN), timeout=10)

    def ports_listening() -> bool:
        return all(_jobs(cluster.client_addresses[f])[job].listening_port == ports[job][f]
                   for f in followers for job in TORCH_JOBS)

    harness.wait_until("the torchft jobs' ports listening on the followers", ports_listening, 20, interval=0.1)

    # Every job trains at once across the kill: the torchft trainers set up (slow under load: 10-15 s
    # per job on a busy host, longer than a job's 25 steps) and wait at their start barrier; the
    # ftclient groups start once they are set up, and the barrier opens once both heartbeat (they
    # then ask for their first quorum).
    torch_trainers: dict[str, list[TorchftTrainer]] = {}
    for job in TORCH_JOBS:
        workdir = harness.root / job
        workdir.mkdir()
        torch_trainers[job] = harness.start(
            (TorchftTrainer(group=g, lighthouse=f"http://127.0.0.1:{ports[job][followers[g % 2]]}", workdir=workdir,
                            steps=STEPS, step_sleep=STEP_SLEEP_S, min_final_participants=GROUPS,
                            min_replica_size=GROUPS, slow=g == 1)
             for g in range(GROUPS)), release=False)
    harness.wait_until("the torchft trainers set up", lambda: all(
        t.ready_path.exists() for ts in torch_trainers.values() for t in ts), 90)
    ft_dir = harness.root / FT_JOB
    ft_dir.mkdir()
    ft_trainers = harness.start(DdpExampleTrainer.groups(
        GROUPS, ft_dir, cluster.endpoints, ["--steps", str(STEPS), "--step-sleep", str(STEP_SLEEP_S),
                                            "--min-replica-size", str(GROUPS)], env={"LIGHTHOUSE_JOB": FT_JOB}))
    harness.wait_until(f"both {FT_JOB} groups heartbeating",
                       lambda: _jobs(cluster.client_addresses[leader])[FT_JOB].heartbeating_replicas == GROUPS, 90,
                       interval=0.05)
    harness.release_barrier()
    harness.wait_all_steps(6)

    before = {job: ts[0].records()[-1]["quorum_id"] for job, ts in torch_trainers.items()}
    kill = harness.kill_while_calls_wait(leader)
    harness.check(kill.leader == leader, f"n{kill.leader + 1}, not n{leader + 1}, led when n{leader + 1} was killed")
    new_leader, failover_s = harness.wait_new_leader(kill, among=followers)

    results = harness.wait_finished()
    by_trainer = dict(zip(map(id, harness.trainers), results))
    for job, ts in torch_trainers.items():
        mine = [by_trainer[id(t)] for t in ts]
        harness.assert_identical(mine, STEPS, trainers=ts)
        for t in ts:
            harness.assert_seamless(t)
            last = t.records()[-1]["quorum_id"]
            harness.check(last == before[job], f"{job} {t.name}: quorum id {before[job]} -> {last} across the kill")
    mine = [by_trainer[id(t)] for t in ft_trainers]
    harness.assert_identical(mine, STEPS, trainers=ft_trainers)
    for t, r in zip(ft_trainers, mine):
        harness.assert_seamless(t, r)
        harness.check(all(s["participants"] == GROUPS for s in r["steps"]), f"{FT_JOB} {t.name}: a step without both groups")

    # The cluster's view: each job's last quorum holds its own groups only (the same replica ids in
    # every job: which job a member belongs to is the job alone).
    jobs = _jobs(cluster.client_addresses[new_leader])
    for job in (*TORCH_JOBS, FT_JOB):
        members = [m.replica_id for m in jobs[job].quorum.participants]
        harness.check(len(members) == GROUPS, f"{job}: last quorum {members}")
    harness.check(not jobs["default"].has_quorum, "the default job issued a quorum")
    ids = {job: jobs[job].quorum_id for job in (*TORCH_JOBS, FT_JOB)}
    harness.check(ids == {"torch-a": 1, "torch-b": 3, FT_JOB: 1}, f"quorum ids per job: {ids}")
    print(f"\njobs: leader SIGKILLed with {kill.waiting} calls waiting, new leader after {failover_s:.2f} s; every "
          f"step of every job committed; last quorum ids {ids}")
