"""The CLI's bad-input paths, configuration sources, and the generated stubs' freshness."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from lighthouse_cluster.cli.commands import main
from lighthouse_cluster.client.discovery import parse_endpoints
from lighthouse_cluster.server.config import ConfigError, build_node_config, parse_peer
from lighthouse_cluster.local.cluster import free_ports

ROOT = Path(__file__).resolve().parents[2]
PEERS = ["n1=127.0.0.1:7001,127.0.0.1:8001", "n2=127.0.0.1:7002,127.0.0.1:8002", "n3=127.0.0.1:7003,127.0.0.1:8003"]


def serve_args(*extra: str) -> list[str]:
    args = ["serve", "--node-id", "n1", "--min_replicas", "1"]
    for p in PEERS:
        args += ["--peer", p]
    return args + list(extra)


def run(args: list[str], env: dict[str, str] | None = None):
    return CliRunner().invoke(main, args, env=env or {}, catch_exceptions=False)


def test_serve_refuses_to_start_without_a_secret() -> None:
    res = run(serve_args(), env={"LIGHTHOUSE_CLUSTER_SECRET": ""})
    assert res.exit_code == 2
    assert "no cluster secret" in res.output and "--insecure" in res.output
    assert len(res.output.strip().splitlines()) == 1


@pytest.mark.parametrize("extra, message", [
    (["--peer", "n4=127.0.0.1:7004"], "needs a Raft and a client address"),
    (["--peer", "bad peer"], "is not ID=RAFT_HOST:PORT,CLIENT_HOST:PORT"),
    (["--peer", "n4=127.0.0.1:7004,127.0.0.1:99999"], "port outside 1-65535"),
    (["--peer", "n1=127.0.0.1:7009,127.0.0.1:8009"], "duplicate node ids"),
    (["--heartbeat_timeout_ms", "0", "--insecure"], "'--heartbeat_timeout_ms' / '--heartbeat-timeout-ms': 0 is not in "
                                                    "the range x>=1"),
    (["--quorum-lease-ms", "-1"], "'--quorum-lease-ms': -1 is not in the range 0<=x<=10000"),
    (["--quorum-lease-ms", "60000"], "'--quorum-lease-ms': 60000 is not in the range 0<=x<=10000"),
    (["--liveness-timeout-ms", "10"], "'--liveness-timeout-ms': 10 is not in the range 50<=x<=60000"),
    (["--liveness-timeout-ms", "60001"], "'--liveness-timeout-ms': 60001 is not in the range 50<=x<=60000"),
])
def test_serve_bad_flags_give_one_line_reasons(extra: list[str], message: str) -> None:
    res = run(serve_args(*extra), env={"LIGHTHOUSE_CLUSTER_SECRET": "s3cret"})
    assert res.exit_code == 2, res.output
    assert message in res.output
    assert "s3cret" not in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_even_cluster_sizes_are_refused() -> None:
    with pytest.raises(ConfigError, match="use an odd number"):
        build_node_config(node_id="n1", peers=PEERS[:2], client_bind=None, raft_bind=None, data_dir=None,
                          secret="x", insecure=False, min_replicas=1, join_timeout_ms=1, quorum_tick_ms=1,
                          heartbeat_timeout_ms=1)


def test_the_liveness_timeout_reaches_the_node_config() -> None:
    common = dict(node_id="n1", peers=PEERS, client_bind=None, raft_bind=None, data_dir=None, secret="x",
                  insecure=False, min_replicas=1, join_timeout_ms=1, quorum_tick_ms=1, heartbeat_timeout_ms=1)
    assert build_node_config(**common).liveness_timeout_ms == 500
    assert build_node_config(**common, liveness_timeout_ms=250).liveness_timeout_ms == 250
    for bad in (0, 49, 60_001, True):
        with pytest.raises(ConfigError, match="--liveness-timeout-ms must be between 50 and 60000"):
            build_node_config(**common, liveness_timeout_ms=bad)


def test_the_quiesce_delay_reaches_the_raft_settings_and_bad_values_are_refused() -> None:
    common = dict(node_id="n1", peers=PEERS, client_bind=None, raft_bind=None, data_dir=None, secret="x",
                  insecure=False, min_replicas=1, join_timeout_ms=1, quorum_tick_ms=1, heartbeat_timeout_ms=1)
    assert build_node_config(**common).raft.quiet_after_s == 3.0
    assert build_node_config(**common, quiesce_after_ms=0).raft.quiet_after_s == 0.0  # never
    assert build_node_config(**common, election_timeout_ms=300, quiesce_after_ms=1500).raft.quiet_after_s == 1.5
    for bad in (-1, 3_600_001, True, 1.5):
        with pytest.raises(ConfigError, match="--quiesce-after-ms must be between 0 \\(never\\) and 3600000"):
            build_node_config(**common, quiesce_after_ms=bad)
    res = run(serve_args("--insecure", "--quiesce-after-ms", "-5"))
    assert res.exit_code == 2 and "--quiesce-after-ms must be between 0 (never) and 3600000, got -5" in res.output


def test_the_rendezvous_idle_expiry_reaches_the_node_config_and_bad_values_are_refused() -> None:
    common = dict(node_id="n1", peers=PEERS, client_bind=None, raft_bind=None, data_dir=None, secret="x",
                  insecure=False, min_replicas=1, join_timeout_ms=1, quorum_tick_ms=1, heartbeat_timeout_ms=1)
    assert build_node_config(**common).rendezvous_idle_expiry_s == 86400.0
    assert build_node_config(**common, rendezvous_idle_expiry_s=1.5).rendezvous_idle_expiry_s == 1.5
    for bad in (0, -1.0, float("nan"), float("inf"), 366 * 86400.0, True):
        with pytest.raises(ConfigError, match="--rendezvous-idle-expiry-s must be a number of seconds above 0"):
            build_node_config(**common, rendezvous_idle_expiry_s=bad)
    res = run(serve_args("--insecure", "--rendezvous-idle-expiry-s", "0"))
    assert res.exit_code == 2 and "--rendezvous-idle-expiry-s must be a number of seconds above 0" in res.output


def test_the_port_process_priority_reaches_the_port_processes_and_bad_values_are_refused() -> None:
    from lighthouse_cluster.server.node import port_processes

    common = dict(node_id="n1", peers=PEERS, client_bind=None, raft_bind=None, data_dir=None, secret="x",
                  insecure=False, min_replicas=1, join_timeout_ms=1, quorum_tick_ms=1, heartbeat_timeout_ms=1,
                  job_port_processes=True)
    assert port_processes(build_node_config(**common)).nice == 10  # the default: below the node
    assert port_processes(build_node_config(**common, job_port_process_nice=0)).nice == 0
    assert port_processes(build_node_config(**common, job_port_process_nice=19)).nice == 19
    for bad in (-1, 20, True, 2.5):
        with pytest.raises(ConfigError, match="--job-port-process-nice must be between 0 \\(the node's priority\\) "
                                              "and 19"):
            build_node_config(**common, job_port_process_nice=bad)
    res = run(serve_args("--insecure", "--job-port-process-nice", "20"))
    assert res.exit_code == 2 and "--job-port-process-nice must be between 0 (the node's priority) and 19, got 20" \
        in res.output


def test_config_file_and_env_and_flags_precedence(tmp_path: Path) -> None:
    cfg = tmp_path / "node.toml"
    cfg.write_text('node_id = "n9"\nmin_replicas = 2\npeers = %r\n' % PEERS)
    # From the file alone: n9 is not among the peers.
    res = run(["serve", "--config", str(cfg), "--insecure"])
    assert res.exit_code == 2 and "node id 'n9' is not among the peers" in res.output
    # The environment beats the file; the flag beats the environment.
    res = run(["serve", "--config", str(cfg), "--insecure", "--quorum_tick_ms", "-1"],
              env={"LIGHTHOUSE_CLUSTER_NODE_ID": "n2"})
    assert res.exit_code == 2 and "'--quorum_tick_ms' / '--quorum-tick-ms': -1 is not in the range x>=1" in res.output


def test_config_file_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("node_id = \n")
    res = run(["serve", "--config", str(bad)])
    assert res.exit_code == 2 and "is not valid TOML" in res.output
    res = run(["serve", "--config", str(tmp_path / "missing.toml")])
    assert res.exit_code == 2 and "cannot read" in res.output


def test_peer_and_endpoint_parsing() -> None:
    p = parse_peer("lh-0=lh-0.lh.svc:29610,lh-0.lh.svc:29510")
    assert (p.node_id, p.raft_address, p.client_address) == ("lh-0", "lh-0.lh.svc:29610", "lh-0.lh.svc:29510")
    # The endpoint rules are client.discovery's (tests/cli/test_discovery.py).
    assert parse_endpoints("http://a:1, b:2,,http://[::1]:3/").addresses == ("a:1", "b:2", "[::1]:3")
    with pytest.raises(ValueError, match="no endpoints"):
        parse_endpoints(" , ")


def test_status_with_no_reachable_node_exits_1_with_one_line() -> None:
    port = free_ports(1)[0]
    res = CliRunner().invoke(main, ["status", "--endpoints", f"http://127.0.0.1:{port}", "--timeout", "0.3"], env={})
    assert res.exit_code == 1
    assert res.output.strip() == (f"error: no node answered: 127.0.0.1:{port}: connection refused: nothing listens "
                                  "there (node down, or a wrong host or port?)")


def test_status_rejects_malformed_endpoints() -> None:
    res = CliRunner().invoke(main, ["status", "--endpoints", "not-an-address"], env={})
    assert res.exit_code == 2 and "is not HOST:PORT" in res.output


def test_up_refuses_even_node_counts() -> None:
    res = CliRunner().invoke(main, ["up", "--nodes", "2", "--min_replicas", "1"])
    assert res.exit_code == 2 and "use an odd number" in res.output


@pytest.mark.integration
def test_generated_stubs_are_current() -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the dev/test extra) regenerates the stubs")
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_tls_flags_are_validated_with_one_line_reasons(tmp_path: Path) -> None:
    from lighthouse_cluster.tls import generate_pki

    pki = generate_pki(tmp_path / "pki")
    env = {"LIGHTHOUSE_CLUSTER_SECRET": "s3cret"}
    for extra, message in [
        (["--tls-cert", str(pki.server_cert)], "needs both --tls-cert and --tls-key"),
        (["--tls-client-ca", str(pki.ca_cert)], "--tls-client-ca needs --tls-cert and --tls-key"),
        (["--tls-ca", str(pki.ca_cert)], "--tls-ca is for dialing TLS peers"),
        (["--tls-cert", str(tmp_path / "none.pem"), "--tls-key", str(pki.server_key)], "cannot read --tls-cert"),
    ]:
        res = run(serve_args(*extra), env=env)
        assert res.exit_code == 2 and message in res.output, res.output
        assert len(res.output.strip().splitlines()) == 1
    config = build_node_config(node_id="n1", peers=PEERS, client_bind=None, raft_bind=None, data_dir=None,
                               secret="x", insecure=False, min_replicas=1, join_timeout_ms=1, quorum_tick_ms=1,
                               heartbeat_timeout_ms=1, tls_cert=pki.server_cert, tls_key=pki.server_key,
                               tls_client_ca=pki.ca_cert, admin_token="tok")
    assert config.tls is not None and config.tls.mutual and config.peer_tls is not None
    assert config.peer_tls.client_cert == pki.server_cert.read_bytes()  # peers see this node's certificate
    assert "tok" not in repr(config) and "PRIVATE KEY" not in repr(config) and "'x'" not in repr(config)


def test_join_allows_an_even_peer_list() -> None:
    four = PEERS + ["n4=127.0.0.1:7004,127.0.0.1:8004"]
    with pytest.raises(ConfigError, match="--join"):
        build_node_config(node_id="n4", peers=four, client_bind=None, raft_bind=None, data_dir=None, secret="x",
                          insecure=False, min_replicas=1, join_timeout_ms=1, quorum_tick_ms=1, heartbeat_timeout_ms=1)
    config = build_node_config(node_id="n4", peers=four, client_bind=None, raft_bind=None, data_dir=None,
                               secret="x", insecure=False, min_replicas=1, join_timeout_ms=1, quorum_tick_ms=1,
                               heartbeat_timeout_ms=1, join=True)
    assert [p.node_id for p in config.other_peers] == ["n1", "n2", "n3"]


def test_admin_commands_need_endpoints_and_a_token() -> None:
    res = CliRunner().invoke(main, ["members", "remove", "n2", "--admin-token", "t"], env={})
    assert res.exit_code == 2 and "no endpoints" in res.output
    res = CliRunner().invoke(main, ["snapshot", "save", "x.json", "--endpoints", "127.0.0.1:1"], env={})
    assert res.exit_code == 2 and "no admin token" in res.output
    res = CliRunner().invoke(main, ["health", "--endpoints", f"127.0.0.1:{free_ports(1)[0]}", "--timeout", "0.3",
                                    "-o", "json"], env={})
    assert res.exit_code == 1 and '"healthy": false' in res.output


def test_admin_token_check_is_exact() -> None:
    import grpc

    from lighthouse_cluster.server.admin import check_token

    assert check_token([("authorization", "Bearer tok")], "tok") is None
    assert check_token([("authorization", "bearer tok ")], "tok") is None
    for md in ([], [("authorization", "Bearer tok2")], [("authorization", "tok")], [("authorization", "Basic tok")]):
        assert check_token(md, "tok").code == grpc.StatusCode.UNAUTHENTICATED
    assert check_token([("authorization", "Bearer tok")], None).code == grpc.StatusCode.PERMISSION_DENIED


def test_up_refuses_demo_with_tls() -> None:
    res = CliRunner().invoke(main, ["up", "--min_replicas", "1", "--tls", "--demo"])
    assert res.exit_code == 2 and "drop --tls" in res.output


def test_event_loop_choice_is_validated() -> None:
    res = run(serve_args("--event-loop", "trio"), env={"LIGHTHOUSE_CLUSTER_SECRET": "s3cret"})
    assert res.exit_code == 2 and "'trio' is not one of 'uvloop', 'asyncio'" in res.output, res.output


def test_event_loop_runner_runs_a_coroutine_on_the_chosen_loop() -> None:
    from lighthouse_cluster.server.event_loop import run as run_loop
    from lighthouse_cluster.server.event_loop import running_loop_name

    async def name() -> str:
        return running_loop_name()

    assert run_loop(name(), "uvloop") == "uvloop"
    assert run_loop(name(), "asyncio") == "asyncio"
    with pytest.raises(ValueError, match="unknown event loop"):
        run_loop(name(), "trio")
