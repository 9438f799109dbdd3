"""`up`'s decisions without processes: addresses, leader agreement, restart backoff."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest

from lighthouse_cluster.server.config import ConfigError
from lighthouse_cluster.local.demo import kill_line
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.core.restarts import RestartBackoff, describe_exit
from lighthouse_cluster.local.up_plan import (Stable, UpJob, UpRequest, agreed_leader, job_banner,
                                              parse_host_or_host_port, picked_ports_line, plan_addresses,
                                              plan_jobs, plan_up)


def picker():
    ports = iter(range(40000, 41000))
    return lambda n, host: [next(ports) for _ in range(n)]


def test_default_bind_is_every_interface_reached_at_loopback_with_raft_on_loopback() -> None:
    plan = plan_addresses(3, "[::]:29510", None, None, picker())
    assert [plan.client.bind(i) for i in range(3)] == ["[::]:29510", "[::]:29511", "[::]:29512"]
    assert plan.client.reach(0) == "127.0.0.1:29510" and plan.client.wildcard
    assert [plan.raft.bind(i) for i in range(3)] == ["127.0.0.1:29610", "127.0.0.1:29611", "127.0.0.1:29612"]
    assert plan.http.bind(0) == "[::]:29710" and plan.http.reach(2) == "127.0.0.1:29712"
    assert not plan.picked


def test_a_specific_bind_host_is_bound_everywhere() -> None:
    plan = plan_addresses(3, "127.0.0.1:30000", None, 31000, picker())
    assert {plan.client.bind_host, plan.raft.bind_host, plan.http.bind_host} == {"127.0.0.1"}
    assert plan.raft.ports == (31000, 31001, 31002) and plan.http.ports == (30200, 30201, 30202)
    assert plan_addresses(1, "localhost:30000", None, None, picker()).client.bind_host == "127.0.0.1"


@pytest.mark.parametrize("value, bind_host, ports", [
    ("127.0.0.2", "127.0.0.2", (30200, 30201, 30202)),
    ("127.0.0.2:9000", "127.0.0.2", (9000, 9001, 9002)),
    ("[::]", "[::]", (30200, 30201, 30202)),
    ("[::1]:9000", "[::1]", (9000, 9001, 9002)),
    ("::1", "[::1]", (30200, 30201, 30202)),
    ("0.0.0.0:0", "0.0.0.0", (40000, 40001, 40002)),
])
def test_http_bind_takes_a_host_or_the_first_address(value: str, bind_host: str, ports: tuple[int, ...]) -> None:
    plan = plan_addresses(3, "127.0.0.1:30000", value, None, picker())
    assert plan.http.bind_host == bind_host and plan.http.ports == ports
    assert plan.client.bind_host == "127.0.0.1"
    assert plan.picked == value.endswith(":0")


def test_port_zero_picks_every_port() -> None:
    plan = plan_addresses(3, "127.0.0.1:0", None, None, picker())
    every = plan.client.ports + plan.raft.ports + plan.http.ports
    assert len(set(every)) == 9 and plan.picked


@pytest.mark.parametrize("bind, http, raft, message", [
    ("127.0.0.1:65534", None, None, "past 65535"),
    ("127.0.0.1:30000", "127.0.0.1:30001", None, "would serve both client and http"),
    ("127.0.0.1:30000", None, 30002, "would serve both client and raft"),
    ("127.0.0.1", None, None, "is not HOST:PORT"),
    ("127.0.0.1:30000", "", None, "--http-bind is empty"),
    ("127.0.0.1:30000", "h:x", None, "non-numeric port"),
])
def test_bad_addresses_are_one_line_config_errors(bind: str, http: str | None, raft: int | None,
                                                  message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        plan_addresses(3, bind, http, raft, picker())


def test_parse_host_or_host_port() -> None:
    assert parse_host_or_host_port("[::]", "x") == ("[::]", None)
    assert parse_host_or_host_port("[::]:80", "x") == ("[::]", 80)
    assert parse_host_or_host_port("example.org:0", "x") == ("example.org", 0)


def view(node: str, leader: str, term: int, role: int = cpb.FOLLOWER, serving: bool = False) -> cpb.NodeStatus:
    return cpb.NodeStatus(node=cpb.NodeInfo(id=node), leader_id=leader, term=term, role=role, serving=serving)


def test_agreed_leader_needs_every_node_and_a_serving_leader() -> None:
    lead = view("n1", "n1", 2, cpb.LEADER, serving=True)
    assert agreed_leader([lead, view("n2", "n1", 2), view("n3", "n1", 2)]) == ("n1", 2)
    assert agreed_leader([lead, view("n2", "n1", 2), view("n3", "", 2)]) is None  # n3 knows no leader yet
    assert agreed_leader([lead, view("n2", "n1", 2), view("n3", "n1", 1)]) is None  # n3 still in term 1
    assert agreed_leader([lead, view("n2", "n1", 2), None]) is None  # n3 did not answer
    warming = view("n1", "n1", 2, cpb.LEADER, serving=False)
    assert agreed_leader([warming, view("n2", "n1", 2), view("n3", "n1", 2)]) is None
    # A deposition: n3 stands in term 3; nobody agrees until the next leader is followed by all.
    assert agreed_leader([lead, view("n2", "n1", 2), view("n3", "", 3, cpb.CANDIDATE)]) is None
    assert agreed_leader([]) is None


def test_stable_needs_the_same_value_for_the_whole_hold() -> None:
    s = Stable(0.5)
    assert not s.observe(("n1", 1), 0.0)
    assert not s.observe(("n1", 1), 0.3)
    assert not s.observe(None, 0.4)  # the deposition resets the clock
    assert not s.observe(("n2", 2), 0.6)
    assert not s.observe(("n2", 2), 1.0)
    assert s.observe(("n2", 2), 1.1)
    assert not Stable(0.0).observe(None, 5.0)


def test_restart_backoff_doubles_while_failing_and_starts_over_after_a_good_run() -> None:
    b = RestartBackoff(initial_s=0.5, factor=2, max_s=4, healthy_after_s=5)
    assert [b.next_delay("n1", 0.1) for _ in range(5)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert b.next_delay("n2", 0.1) == 0.5  # per node
    assert b.next_delay("n1", 60.0) == 0.5  # it ran a minute: a fresh failure


def test_describe_exit() -> None:
    assert describe_exit(-9) == "-9 (SIGKILL)"
    assert describe_exit(1) == "1"
    assert describe_exit(-200) == "-200"


def test_kill_line_says_whether_the_quorum_id_changed() -> None:
    assert kill_line("n2", "n3", 0.314, 0.35, 4, 4) == (
        "killed leader n2 (SIGKILL); new leader n3 after 0.31 s; every group had its next quorum after 0.35 s; "
        "quorum id still 4")
    assert kill_line("n2", "n3", 0.3, 0.4, 4, 5).endswith("quorum id 4 -> 5")
    assert "no new leader yet" in kill_line("n2", None, None, None, None, None)


# -- up --job -------------------------------------------------------------------------------------------


def test_up_jobs_get_one_port_per_node_from_the_first() -> None:
    plan = plan_addresses(3, "127.0.0.1:29510", None, None, picker())
    jobs = plan_jobs(["train-a=29600", "train-b"], 3, [p for _, _, p in plan.every_port()])
    assert jobs == (UpJob("train-a", 29600), UpJob("train-b", None))
    assert jobs[0].ports(["n1", "n2", "n3"]) == (("n1", 29600), ("n2", 29601), ("n3", 29602))
    assert jobs[1].ports(["n1", "n2", "n3"]) == ()
    assert plan_jobs([], 3) == ()


@pytest.mark.parametrize("values, message", [
    (["default"], "the default job is the cluster's own"),
    (["a/b"], "job name 'a/b' must be"),
    (["a", "a=29600"], "--job a is given twice"),
    (["a=x"], "give NAME or NAME=PORT"),
    (["a=0"], "within 1-65535"),
    (["a=65534"], "3 nodes need ports 65534-65536, within 1-65535"),
    (["a=29610"], "port 29610 is a node's own port already"),   # n1's Raft port
    (["a=29508"], "port 29510 is a node's own port already"),   # a=29508..29510 reaches n1's client port
    (["a=29600", "b=29602"], "port 29602 is job a's already"),
])
def test_up_job_values_are_refused_with_one_line(values: list[str], message: str) -> None:
    plan = plan_addresses(3, "127.0.0.1:29510", None, None, picker())
    with pytest.raises(ConfigError, match=re.escape(message)):
        plan_jobs(values, 3, [p for _, _, p in plan.every_port()])


def test_up_job_banner_says_what_each_kind_of_trainer_sets() -> None:
    endpoints = "http://127.0.0.1:29510,http://127.0.0.1:29511,http://127.0.0.1:29512"
    nodes = ["n1", "n2", "n3"]
    assert job_banner(UpJob("train-a", 29600), nodes, "127.0.0.1", endpoints, tls=False) == [
        "job train-a (n1=29600, n2=29601, n3=29602):",
        "  torchft trainers:  export TORCHFT_LIGHTHOUSE=http://127.0.0.1:29600",
        f"  ftclient trainers: export TORCHFT_LIGHTHOUSE={endpoints} LIGHTHOUSE_JOB=train-a",
    ]
    by_name = job_banner(UpJob("train-b"), nodes, "127.0.0.1", endpoints, tls=False)
    assert by_name[0] == "job train-b (no own port):" and "up --job train-b=PORT" in by_name[1]
    assert by_name[2].endswith("LIGHTHOUSE_JOB=train-b")
    tls = job_banner(UpJob("train-a", 29600), nodes, "127.0.0.1", endpoints.replace("http", "https"), tls=True)
    assert not any("torchft trainers" in line for line in tls) and tls[-1].endswith("LIGHTHOUSE_JOB=train-a")


# -- the whole request ----------------------------------------------------------------------------


def test_every_up_option_is_an_up_request_field_with_the_same_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from lighthouse_cluster.cli.up import up

    for name in [n for n in os.environ if n.startswith("LIGHTHOUSE_CLUSTER_")]:
        monkeypatch.delenv(name)
    with up.make_context("up", ["--min_replicas", "2"]) as ctx:
        given = ctx.params
    assert given == dataclasses.asdict(UpRequest(min_replicas=2))


@pytest.mark.parametrize("changes, message", [
    ({"nodes": 4}, "--nodes 4: use an odd number so a majority survives a split"),
    ({"demo": True, "mtls": True}, "--demo's simulated replica groups speak plaintext: drop --tls/--mtls"),
    ({"bind": "127.0.0.1:65534"}, "--bind: 3 nodes need ports 65534-65536, past 65535"),
    ({"jobs": ("default",)}, "the default job is the cluster's own"),
    ({"jobs": ("a=29600",)}, "ports already in use: 29510 (client on 127.0.0.1), 29601 (job on 127.0.0.1) "
                             "(pick another --bind, or HOST:0 for free ports)"),
])
def test_plan_up_refuses_a_request_before_anything_starts(changes: dict, message: str) -> None:
    request = UpRequest(**{"min_replicas": 1, "bind": "127.0.0.1:29510", **changes})
    with pytest.raises(ConfigError, match=re.escape(message)):
        plan_up(request, picker(), lambda host, port: port not in (29510, 29601))


def test_plan_up_plans_addresses_and_jobs_and_names_picked_ports() -> None:
    plan = plan_up(UpRequest(min_replicas=1, bind="127.0.0.1:0", jobs=("a=30000", "b")), picker(),
                   lambda host, port: True)
    assert plan.node_ids == ["n1", "n2", "n3"] and plan.addresses.client.ports == (40000, 40001, 40002)
    assert plan.jobs == (UpJob("a", 30000), UpJob("b"))
    assert picked_ports_line(plan) == ("--bind 127.0.0.1:0: chose client ports 40000,40001,40002, "
                                       "raft ports 40003,40004,40005, http ports 40006,40007,40008")
    assert picked_ports_line(plan_up(UpRequest(min_replicas=1), picker(), lambda host, port: True)) is None
