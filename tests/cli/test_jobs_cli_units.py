"""`lighthouse-cluster jobs` without a cluster (#17): arguments into admin requests (only what was
given), bad local input refused before any call with one line and exit 2, Job messages as JSON
and as tables (80 columns on a terminal, one ``job:`` line each elsewhere), the exit codes of a
failed call, and `status`'s job rows."""

from __future__ import annotations

import io
import json
import re

import grpc
import pytest
from click.testing import CliRunner
from rich.console import Console

from lighthouse_cluster.cli.commands import main
from lighthouse_cluster.cli.job_requests import add_request, check_settings, remove_request, set_request
from lighthouse_cluster.cli.job_tables import (JOB_COLUMNS, members, ports_text, render_job, render_jobs,
                                               render_status_jobs)
from lighthouse_cluster.cli.status_tables import render
from lighthouse_cluster.client.admin_client import AdminCallError
from lighthouse_cluster.client.cluster_view import build_view, to_json
from lighthouse_cluster.client.job_view import job_json, jobs_view
from lighthouse_cluster.core.jobs import JobError
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import torchft_pb2 as pb

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


# -- arguments into requests ------------------------------------------------------------------------


def test_add_sends_only_the_settings_given_with_ports_and_config() -> None:
    r = add_request("train-a", {"min_replicas": 2, "quorum_lease_ms": 0}, ports=("n2=29602", "29600"),
                    config=("lr=0.1", "opt=a=b"))
    assert r.name == "train-a"
    assert r.settings.HasField("min_replicas") and r.settings.min_replicas == 2
    assert r.settings.HasField("quorum_lease_ms") and r.settings.quorum_lease_ms == 0  # 0 is a value, sent
    assert not r.settings.HasField("join_timeout_ms") and not r.settings.HasField("max_replicas")
    assert [(p.node_id, p.port) for p in r.ports] == [("*", 29600), ("n2", 29602)]
    assert [(c.key, c.value) for c in r.config] == [("lr", "0.1"), ("opt", "a=b")]  # the value may hold '='


def test_set_changes_only_what_was_given() -> None:
    r = set_request("a", {}, config=("k=v",), unset_config=("old", "old"))
    assert not r.set_ports and not r.ports and not any(r.settings.HasField(n) for n in ("min_replicas",))
    assert [(c.key, c.value) for c in r.set_config] == [("k", "v")] and list(r.unset_config) == ["old"]
    r = set_request("default", {}, config=("team=ml",))  # the default job's config can be set
    assert [(c.key, c.value) for c in r.set_config] == [("team", "ml")]
    r = set_request("a", {"heartbeat_timeout_ms": 900})
    assert r.settings.heartbeat_timeout_ms == 900 and not r.set_ports and not r.set_config
    r = set_request("a", {}, ports=("n1=30001",))
    assert r.set_ports and [(p.node_id, p.port) for p in r.ports] == [("n1", 30001)]
    r = set_request("a", {}, no_ports=True)
    assert r.set_ports and not r.ports  # set_ports with none: the ports are removed
    assert remove_request("a", force=True) == cpb.RemoveJobRequest(name="a", force=True)


@pytest.mark.parametrize("build, message", [
    (lambda: add_request("bad/name", {}), "job name 'bad/name' must be"),
    (lambda: add_request("", {}), "job name '' must be"),
    (lambda: add_request("default", {}), "the default job always exists"),
    (lambda: add_request("a", {}, ports=("70000",)), "port 70000 is outside 1-65535"),
    (lambda: add_request("a", {}, ports=("n1=x",)), "port 'n1=x' is not PORT or NODE=PORT"),
    (lambda: add_request("a", {}, ports=("1", "2")), "two ports given for every node"),
    (lambda: add_request("a", {}, config=("novalue",)), "config 'novalue' is not KEY=VALUE"),
    (lambda: add_request("a", {}, config=("bad key=1",)), "config key 'bad key' must be"),
    (lambda: add_request("a", {"min_replicas": 0}), "min_replicas must be between 1 and 65536, got 0"),
    (lambda: add_request("a", {"quorum_lease_ms": 20000}), "quorum_lease_ms must be between 0 and 10000"),
    (lambda: add_request("a", {"max_member_bytes": 10}), "max_member_bytes must be between 64"),
    (lambda: add_request("a", {"min_replicas": 5, "max_replicas": 3}), "min_replicas 5 is above max_replicas 3"),
    (lambda: set_request("a", {}), "nothing to change for job 'a'"),
    (lambda: set_request("a", {}, ports=("1",), no_ports=True), "--port and --no-ports"),
    (lambda: set_request("a", {}, config=("k=1",), unset_config=("k",)), "'k' is both set"),
    (lambda: remove_request("-a"), "job name '-a' must be"),
])
def test_bad_local_input_is_a_job_error(build, message: str) -> None:
    with pytest.raises(JobError, match=re.escape(message)):
        build()


def test_one_setting_is_checked_against_its_own_bound_only() -> None:
    # The job's other settings are the leader's to check: a lone min_replicas above the default
    # max_replicas (4096) may be fine for a job whose max_replicas is higher.
    assert check_settings({"min_replicas": 5000}) == {"min_replicas": 5000}
    assert check_settings({"max_replicas": 1}) == {"max_replicas": 1}


@pytest.mark.parametrize("args, message", [
    (["jobs", "add", "bad/name"], "job name 'bad/name'"),
    (["jobs", "add", "a", "--port", "0"], "port 0 is outside 1-65535"),
    (["jobs", "add", "a", "--config", "x"], "config 'x' is not KEY=VALUE"),
    (["jobs", "add", "a", "--min_replicas", "0"], "min_replicas must be between 1 and 65536"),
    (["jobs", "add", "a", "--min-replicas", "x"], "'x' is not a valid integer"),
    (["jobs", "set", "a", "--max-member-bytes", "1"], "max_member_bytes must be between 64"),
    (["jobs", "set", "a"], "nothing to change"),
    (["jobs", "set", "a", "--port", "70000"], "port 70000"),
    (["jobs", "remove", "a b"], "job name 'a b'"),
    (["jobs", "show", "a/b"], "job name 'a/b'"),
    (["jobs", "add", "a"], "no admin token"),
    (["jobs", "list"], "no endpoints"),
])
def test_bad_input_is_one_line_and_exit_2_before_any_call(args: list[str], message: str) -> None:
    # No endpoint is reachable (none given, or none listening): refused before any call.
    res = CliRunner().invoke(main, args, env={"LIGHTHOUSE_CLUSTER_ENDPOINTS": "", "TORCHFT_LIGHTHOUSE": "",
                                              "LIGHTHOUSE_CLUSTER_ADMIN_TOKEN": ""})
    lines = res.output.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), res.output
    assert message in lines[0], lines[0]


def test_setting_flags_are_not_read_from_a_nodes_environment() -> None:
    # serve reads LIGHTHOUSE_CLUSTER_MIN_REPLICAS; a job's settings come from its flags alone.
    res = CliRunner().invoke(main, ["jobs", "set", "a"], env={"LIGHTHOUSE_CLUSTER_MIN_REPLICAS": "3"})
    assert res.exit_code == 2 and "nothing to change" in res.output


@pytest.mark.parametrize("code, refused", [
    (grpc.StatusCode.NOT_FOUND, True), (grpc.StatusCode.ALREADY_EXISTS, True),
    (grpc.StatusCode.UNAUTHENTICATED, True), (grpc.StatusCode.PERMISSION_DENIED, True),
    (grpc.StatusCode.INVALID_ARGUMENT, True), (grpc.StatusCode.FAILED_PRECONDITION, True),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, True),
    (grpc.StatusCode.UNAVAILABLE, False), (grpc.StatusCode.DEADLINE_EXCEEDED, False),
    (grpc.StatusCode.ABORTED, False), (grpc.StatusCode.UNIMPLEMENTED, False), (None, False),
])
def test_a_refused_request_is_told_from_an_unreachable_cluster(code, refused: bool) -> None:
    assert AdminCallError("h:1: x", code).refused is refused
    # A follower's "must run on the leader" after the leader kept moving is the cluster's state.
    assert not AdminCallError("h:1: FAILED_PRECONDITION: jobs add must run on the leader; ...",
                              grpc.StatusCode.FAILED_PRECONDITION).refused


# -- Job messages as JSON and tables ----------------------------------------------------------------


def sample_jobs(leader_view: bool = True) -> list[cpb.Job]:
    quorum = pb.Quorum(quorum_id=12, participants=[
        pb.QuorumMember(replica_id="r0", address="http://10.0.0.1:40000", store_address="10.0.0.1:29500", step=3,
                        world_size=2),
        pb.QuorumMember(replica_id="r1", address="http://10.0.0.2:40000", step=3, world_size=2)])
    default = cpb.Job(name="default", settings=cpb.JobSettings(min_replicas=1, join_timeout_ms=60000,
                                                                heartbeat_timeout_ms=5000, quorum_tick_ms=100),
                      settings_from_flags=True, version=1, quorum_id=12, has_quorum=True, quorum=quorum)
    train = cpb.Job(name="train-llama-70b", version=4,
                    settings=cpb.JobSettings(min_replicas=2, join_timeout_ms=500, quorum_tick_ms=50,
                                             heartbeat_timeout_ms=5000, quorum_lease_ms=0, max_replicas=64,
                                             max_member_bytes=4096),
                    ports=[cpb.JobPort(node_id="n1", port=29601), cpb.JobPort(node_id="n2", port=29602),
                           cpb.JobPort(node_id="n3", port=29603)],
                    config=[cpb.ConfigEntry(key="checkpoint.dir", value="/mnt/" + "very-long-directory/" * 8),
                            cpb.ConfigEntry(key="lr", value="0.1")],
                    listening_port=29601, port_error="")
    shared = cpb.Job(name="b", settings=cpb.JobSettings(min_replicas=8, join_timeout_ms=100,
                                                        heartbeat_timeout_ms=86_400_000),
                     ports=[cpb.JobPort(node_id="*", port=29700)], port_error="port 29700: address in use")
    if leader_view:
        for j in (default, train, shared):
            j.leader_view = True
        default.heartbeating_replicas = 2
        default.heartbeats.extend([cpb.HeartbeatAge(replica_id="r0", age_ms=40),
                                   cpb.HeartbeatAge(replica_id="r1", age_ms=7000)])
        train.heartbeating_replicas = 256
        train.pending.append(cpb.PendingRequester(member=pb.QuorumMember(replica_id="w9", step=1), waiting_ms=30))
        train.quorum_reason = "waiting for min_replicas 2: 1 asked"
        train.rounds_on_lease, train.rounds_committed, train.open_streams = 5, 2, 1
    return [default, train, shared]


def jobs_to_json(jobs: list[cpb.Job], answered_by: str, leader_view: bool) -> dict:
    """What `jobs list -o json` prints for a ListJobs answer."""
    return jobs_view(cpb.ListJobsResponse(jobs=jobs, answered_by=answered_by, leader_view=leader_view))


def test_job_json_has_every_field() -> None:
    default, train, shared = (job_json(j) for j in sample_jobs())
    assert train["settings"] == {"min_replicas": 2, "join_timeout_ms": 500, "quorum_tick_ms": 50,
                                 "heartbeat_timeout_ms": 5000, "quorum_lease_ms": 0, "max_replicas": 64,
                                 "max_member_bytes": 4096}
    assert train["ports"] == [{"node_id": "n1", "port": 29601}, {"node_id": "n2", "port": 29602},
                              {"node_id": "n3", "port": 29603}]
    assert train["config"]["lr"] == "0.1" and train["version"] == 4 and train["listening_port"] == 29601
    assert train["pending"] == [{"replica_id": "w9", "step": 1, "waiting_ms": 30}]
    assert train["rounds"] == {"lease": 5, "commit": 2} and train["open_streams"] == 1
    assert train["quorum"] is None and members(train) == [] and train["heartbeating_replicas"] == 256
    assert default["settings_from_flags"] and default["quorum_id"] == 12 and members(default) == ["r0", "r1"]
    assert default["quorum"]["participants"][0]["store_address"] == "10.0.0.1:29500"
    assert default["heartbeats"][1] == {"replica_id": "r1", "age_ms": 7000}
    assert shared["port_error"].startswith("port 29700") and shared["listening_port"] == 0
    assert shared["ports"] == [{"node_id": "*", "port": 29700}]
    json.dumps(jobs_to_json(sample_jobs(), "n1", True))  # JSON-ready throughout
    follower = job_json(sample_jobs(leader_view=False)[1])
    assert not follower["leader_view"] and follower["heartbeats"] == [] and follower["pending"] == []


def test_ports_text() -> None:
    default, train, shared = (job_json(j) for j in sample_jobs())
    assert ports_text(default) == "client port"
    assert ports_text(train) == "n1=29601,n2=29602,n3=29603"
    assert ports_text(shared) == "29700"
    assert ports_text({"name": "x", "ports": []}) == "-"
    assert ports_text({"name": "x", "ports": [{"node_id": "n2", "port": 2}, {"node_id": "*", "port": 1}]}) == "1,n2=2"


def rendered(write, terminal: bool, width: int = 80) -> list[str]:  # type: ignore[no-untyped-def]
    buf = io.StringIO()
    write(Console(file=buf, force_terminal=terminal, width=width, highlight=False))
    return [ANSI.sub("", line) for line in buf.getvalue().splitlines()]


def test_jobs_list_off_a_terminal_is_one_job_line_each() -> None:
    listing = jobs_to_json(sample_jobs(), "n2 (127.0.0.1:29511)", True)
    lines = rendered(lambda c: render_jobs(listing, c), terminal=False)
    assert lines == [
        "job: job=default ports='client port' min=1 quorum_id=12 members=2 heartbeating=2 config=-",
        "job: job=train-llama-70b ports=n1=29601,n2=29602,n3=29603 min=2 quorum_id=none members=0 "
        "heartbeating=256 config=checkpoint.dir,lr",
        "job: job=b ports=29700 min=8 quorum_id=none members=0 heartbeating=0 config=-",
    ]
    follower = jobs_to_json(sample_jobs(leader_view=False), "n2 (127.0.0.1:29511)", False)
    lines = rendered(lambda c: render_jobs(follower, c), terminal=False)
    assert all("heartbeating=-" in line for line in lines[:3])
    assert len(lines) == 4 and lines[3].startswith("answered by n2 (127.0.0.1:29511), not the serving leader")
    assert lines[3].endswith("quorums and settings are the replicated ones")  # one line, however long


@pytest.mark.parametrize("width", [80, 100])
def test_job_tables_fit_the_terminal_and_nothing_is_cut(width: int) -> None:
    listing = jobs_to_json(sample_jobs(), "n1", True)
    train = listing["jobs"][1]

    def write(c: Console) -> None:
        render_jobs(listing, c)
        render_status_jobs(listing["jobs"], c)
        render_job(train, c, answered_by="127.0.0.1:29510")
        render_job(listing["jobs"][0], c)

    lines = rendered(write, terminal=True, width=width)
    text = "\n".join(lines)
    assert max(len(line) for line in lines) <= width, text
    assert "…" not in text, text
    for column in JOB_COLUMNS:
        assert column in text
    # Names, numbers and short texts are never folded: whole in every table that shows them (the
    # name: in jobs list, status, and show's title, name field and config title).
    assert text.count("train-llama-70b") == 5 and text.count("client port") >= 2, text  # the list may fold it
    for value in ("256", "29700", "waiting for min_replicas 2: 1 asked", "5 on the leader lease, 2 committed",
                  "w9", "checkpoint.dir", "127.0.0.1:29510", "r0,r1"):
        assert value in text, (value, text)


def test_a_long_job_name_folds_instead_of_being_cut() -> None:
    long_name = "a-job-name-far-longer-than-the-others-" + "x" * 25
    listing = jobs_to_json([cpb.Job(name=long_name, settings=cpb.JobSettings(min_replicas=1))], "n1", True)
    lines = rendered(lambda c: (render_jobs(listing, c), render_status_jobs(listing["jobs"], c)), terminal=True)
    text = "\n".join(lines)
    assert max(len(line) for line in lines) <= 80 and "…" not in text, text
    assert "a-job-name" in text and "xxxxx" in text


def test_jobs_show_off_a_terminal() -> None:
    default, train, shared = (job_json(j) for j in sample_jobs())
    lines = rendered(lambda c: render_job(train, c, answered_by="127.0.0.1:29510"), terminal=False)
    first = lines[0]
    assert first.startswith("job train-llama-70b: name=train-llama-70b version=4 min_replicas=2 join_timeout_ms=500 ")
    for fact in ("quorum_lease_ms=0", "max_replicas=64", "max_member_bytes=4096",
                 "ports=n1=29601,n2=29602,n3=29603", "listening_on_127.0.0.1:29510='port 29601'",
                 "heartbeating_replicas=256", "pending_requests=1", "open_liveness_streams=1",
                 "next_quorum='waiting for min_replicas 2: 1 asked'"):
        assert fact in first, (fact, first)
    assert "config: key=lr value=0.1" in lines and "pending: replica_id=w9 step=1 waiting_ms=30" in lines
    lines = rendered(lambda c: render_job(default, c), terminal=False)
    assert "settings_from='the serve flags of each node'" in lines[0], lines[0]
    assert "participant: replica_id=r0 step=3 address=http://10.0.0.1:40000 world_size=2" in lines
    assert "heartbeat: replica_id=r1 age_ms=7000" in lines
    lines = rendered(lambda c: render_job(shared, c, answered_by="n3"), terminal=False)
    assert "listening_on_n3='no own port; port 29700: address in use'" in lines[0], lines[0]
    follower = job_json(sample_jobs(leader_view=False)[0])
    lines = rendered(lambda c: render_job(follower, c, answered_by="127.0.0.1:29511"), terminal=False)
    assert "live_view='unknown: not answered by the serving leader'" in lines[0] and not any(
        line.startswith("heartbeat:") for line in lines)
    # What `jobs add/set` print: the leader's answer, before the new job's own view is served.
    lines = rendered(lambda c: render_job(follower, c, title="job default changed"), terminal=False)
    assert lines[0].startswith("job default changed: name=default ") and "live_view" not in lines[0]


# -- status's job rows -------------------------------------------------------------------------------


def leader_status(jobs: list[cpb.Job]) -> cpb.NodeStatus:
    return cpb.NodeStatus(node=cpb.NodeInfo(id="n1", client_address="127.0.0.1:1"), role=cpb.LEADER, term=3,
                          leader_id="n1", serving=True, jobs=jobs)


def test_status_lists_the_leaders_jobs_in_json_and_as_rows() -> None:
    view = build_view([("127.0.0.1:1", leader_status(sample_jobs()))])
    data = to_json(view)
    assert [j["name"] for j in data["jobs"]] == ["default", "train-llama-70b", "b"]
    assert data["jobs"][1]["settings"]["min_replicas"] == 2
    lines = rendered(lambda c: render(view, c), terminal=False)
    assert "job: job=default ports='client port' quorum_id=12 members=2 heartbeating=2" in lines
    assert "job: job=train-llama-70b ports=n1=29601,n2=29602,n3=29603 quorum_id=none members=0 heartbeating=256" \
        in lines
    assert lines[0].startswith("node: id=n1 ")  # the rest of status is as before
    # No jobs known (a node of an older version): no job rows, and the rest unchanged.
    lines = rendered(lambda c: render(build_view([("127.0.0.1:1", leader_status([]))]), c), terminal=False)
    assert not any(line.startswith("job:") for line in lines)
