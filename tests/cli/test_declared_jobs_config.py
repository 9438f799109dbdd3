"""Jobs declared in `serve`'s config file (``[[jobs]]`` tables) and ``--auto-create-jobs``: parsed
into ``NodeConfig.jobs`` with the settings `jobs add` would give where a table leaves one out,
and every mistake refused at startup with one line and exit status 2."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from lighthouse_cluster.cli.commands import main
from lighthouse_cluster.core.jobs import JobSpec
from lighthouse_cluster.server.config import ConfigError, build_node_config, parse_declared_jobs

PEERS = ["n1=127.0.0.1:7001,127.0.0.1:8001", "n2=127.0.0.1:7002,127.0.0.1:8002", "n3=127.0.0.1:7003,127.0.0.1:8003"]
COMMON = dict(node_id="n1", peers=PEERS, client_bind=None, raft_bind=None, data_dir=None, secret="x",
              insecure=False, min_replicas=2, join_timeout_ms=700, quorum_tick_ms=30, heartbeat_timeout_ms=900)

GOOD = '''
auto_create_jobs = true

[[jobs]]
name = "llama"
port = 29600
min_replicas = 4
join_timeout_ms = 30000

[jobs.config]
lr = 0.1
warmup = true
schedule = "cosine"

[[jobs]]
name = "bert"
ports = ["n1=29601", "n2=29602", "29603"]
config = {owner = "team-a"}

[[jobs]]
name = "small"
port = "n3=29700"
'''


def serve_with(tmp_path: Path, text: str, monkeypatch: pytest.MonkeyPatch, *extra: str) -> tuple[Any, list[Any]]:
    """`serve --config FILE` up to the node's start: the NodeConfig it would run with."""
    started: list[Any] = []
    monkeypatch.setattr("lighthouse_cluster.cli.serve._serve", lambda config: started.append(config))
    monkeypatch.setattr("lighthouse_cluster.cli.serve.run_event_loop", lambda coro, loop: None)
    monkeypatch.setattr("lighthouse_cluster.server.logs.configure_logging", lambda *a, **k: None)
    cfg = tmp_path / "node.toml"
    cfg.write_text(text)
    args = ["serve", "--config", str(cfg), "--node-id", "n1", "--min_replicas", "2", "--insecure", *extra]
    for p in PEERS:
        args += ["--peer", p]
    res = CliRunner().invoke(main, args, env={}, catch_exceptions=False)
    return res, started


def test_declared_jobs_reach_the_node_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    res, started = serve_with(tmp_path, GOOD, monkeypatch)
    assert res.exit_code == 0, res.output
    (config,) = started
    assert config.auto_create_jobs is True
    base = config.new_job_settings
    llama, bert, small = config.jobs
    assert llama == JobSpec("llama", settings=replace(base, min_replicas=4, join_timeout_ms=30_000),
                            ports=(("*", 29600),), config=(("lr", "0.1"), ("schedule", "cosine"), ("warmup", "true")))
    assert bert.settings == base and bert.config == (("owner", "team-a"),)
    assert [bert.port_for(n) for n in ("n1", "n2", "n3")] == [29601, 29602, 29603]
    assert small.port_for("n3") == 29700 and small.port_for("n1") is None


def test_without_jobs_nothing_is_declared_and_auto_creation_is_off(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    res, started = serve_with(tmp_path, "quorum_tick_ms = 50\n", monkeypatch)
    assert res.exit_code == 0, res.output
    assert started[0].jobs == () and started[0].auto_create_jobs is False
    res, started = serve_with(tmp_path, "", monkeypatch, "--auto-create-jobs")
    assert started[0].auto_create_jobs is True


@pytest.mark.parametrize("text, message", [
    ('[[jobs]]\nport = 1\n', "[[jobs]] #1 has no name"),
    ('[[jobs]]\nname = "a b"\n', "job name 'a b' must be"),
    ('[[jobs]]\nname = "default"\n', "the default job is not declared"),
    ('[[jobs]]\nname = "a"\n[[jobs]]\nname = "a"\n', "job 'a' is declared twice"),
    ('[[jobs]]\nname = "a"\nminreplicas = 2\n', "unknown key 'minreplicas'"),
    ('[[jobs]]\nname = "a"\nmin_replicas = 0\n', "[[jobs]] 'a': min_replicas must be between 1"),
    ('[[jobs]]\nname = "a"\nmin_replicas = "2"\n', "min_replicas must be an integer"),
    ('[[jobs]]\nname = "a"\nport = 1\nports = ["2"]\n', "either port or ports"),
    ('[[jobs]]\nname = "a"\nport = 70000\n', "port 70000 is outside 1-65535"),
    ('[[jobs]]\nname = "a"\nport = "n1=x"\n', "is not PORT or NODE=PORT"),
    ('[[jobs]]\nname = "a"\nport = 8001\n', "port 8001 on node n1 is n1's client port"),
    ('[[jobs]]\nname = "a"\nports = ["n2=7002"]\n', "port 7002 on node n2 is n2's Raft port"),
    ('[[jobs]]\nname = "a"\nport = 7001\n', "port 7001 on node n1 is n1's Raft port"),
    ('[[jobs]]\nname = "a"\nport = 9000\n[[jobs]]\nname = "b"\nports = ["n2=9000"]\n',
     "port 9000 on node n2 is also job 'a''s"),
    ('[[jobs]]\nname = "a"\nconfig = {k = [1]}\n', "config value of 'k' must be a string, number or boolean"),
    ('[[jobs]]\nname = "a"\nconfig = "lr=1"\n', "config must be a table"),
    ('[[jobs]]\nname = "a"\nconfig = {"bad key" = "v"}\n', "config key 'bad key'"),
    ('jobs = 3\n', "jobs must be an array of tables"),
])
def test_bad_declared_jobs_are_one_line_and_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str,
                                                    message: str) -> None:
    res, started = serve_with(tmp_path, text, monkeypatch)
    lines = res.output.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), res.output
    assert message in lines[0]
    assert started == []


def test_parse_declared_jobs_directly() -> None:
    config = build_node_config(**COMMON)
    assert config.jobs == () and build_node_config(**COMMON, jobs=[]).jobs == ()
    specs = parse_declared_jobs([{"name": "a", "ports": "n1=1, n2=2"}], config.new_job_settings, "n1")
    assert specs[0].ports == (("n1", 1), ("n2", 2))
    # Two jobs on one port of different nodes do not clash.
    parse_declared_jobs([{"name": "a", "port": "n1=5"}, {"name": "b", "port": "n2=5"}], config.new_job_settings, "n1")
    with pytest.raises(ConfigError, match="port 5 on every node is also job 'a''s"):
        parse_declared_jobs([{"name": "a", "port": 5}, {"name": "b", "port": "n2=6"}, {"name": "c", "port": 5}],
                            config.new_job_settings, "n1")


def test_the_ports_no_job_may_have_are_every_nodes_own() -> None:
    config = build_node_config(**{**COMMON, "client_bind": "0.0.0.0:8101", "raft_bind": "0.0.0.0:7101"},
                               http_bind="127.0.0.1:9001")
    assert config.reserved_ports == {
        "n1": {7001: "Raft port", 8001: "client port", 7101: "Raft port", 8101: "client port", 9001: "HTTP port"},
        "n2": {7002: "Raft port", 8002: "client port"},
        "n3": {7003: "Raft port", 8003: "client port"},
    }
    with pytest.raises(ConfigError, match="port 9001 on node n1 is n1's HTTP port"):
        build_node_config(**COMMON, http_bind="127.0.0.1:9001", jobs=[{"name": "a", "port": "n1=9001"}])
