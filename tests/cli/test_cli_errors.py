"""One-line errors (#13 item 4): every bad option value is refused before anything starts (one
line on stderr, exit 2) by `up`, `serve` and the client commands, and a failed gRPC call says what
to check: a dead node or wrong port, an HTTP port given for the client port, a TLS mismatch."""

from __future__ import annotations

import http.server
import threading

import grpc
import pytest
from click.testing import CliRunner

from support.cluster import cli, started_cluster
from lighthouse_cluster.cli.commands import main
from lighthouse_cluster.local.cluster import LocalCluster, free_ports
from lighthouse_cluster.client.admin_client import explain_rpc_error

BAD_VALUES = [
    ("up", "--min_replicas", "0"),
    ("up", "--min_replicas", "1", "--join_timeout_ms", "-5"),
    ("up", "--min_replicas", "1", "--heartbeat_timeout_ms", "0"),
    ("up", "--min_replicas", "1", "--quorum_tick_ms", "0"),
    ("up", "--min_replicas", "1", "--quorum-lease-ms", "-1"),
    ("up", "--min_replicas", "1", "--liveness-timeout-ms", "0"),
    ("up", "--min_replicas", "1", "--raft-port", "70000"),
    ("up", "--min_replicas", "1", "--demo", "--demo-replicas", "0"),
    ("serve", "--node-id", "n1", "--min_replicas", "0"),
    ("serve", "--node-id", "n1", "--min_replicas", "1", "--quorum-lease-ms", "20000"),
    ("serve", "--node-id", "n1", "--min_replicas", "1", "--liveness-timeout-ms", "20"),
    ("status", "--endpoints", "http://127.0.0.1:1", "--timeout", "-1"),
    ("health", "--endpoints", "http://127.0.0.1:1", "--timeout", "0"),
    ("members", "list", "--endpoints", "http://127.0.0.1:1", "--timeout", "-2"),
    ("status", "--no-such-flag"),
    ("no-such-command",),
]


@pytest.mark.parametrize("args", BAD_VALUES, ids=" ".join)
def test_bad_values_are_one_line_and_exit_2_before_anything_starts(args: tuple[str, ...]) -> None:
    res = CliRunner().invoke(main, list(args), env={"LIGHTHOUSE_CLUSTER_SECRET": "s"})
    lines = res.output.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), res.output
    assert "--help" in lines[0]


def test_missing_endpoints_names_both_variables() -> None:
    res = CliRunner().invoke(main, ["status"], env={"LIGHTHOUSE_CLUSTER_ENDPOINTS": "", "TORCHFT_LIGHTHOUSE": ""})
    assert res.exit_code == 2
    assert "LIGHTHOUSE_CLUSTER_ENDPOINTS" in res.output and "TORCHFT_LIGHTHOUSE" in res.output


@pytest.mark.parametrize("code, details, tls, expect", [
    (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: "
     "Failed to connect to remote host: Connection refused", False, "nothing listens there"),
    (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:9: "
     "Failed parsing HTTP/2 (Expected SETTINGS frame as the first frame, got frame type 79)", False,
     "not a gRPC port"),
    (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:9: "
     "Ssl handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: WRONG_VERSION_NUMBER", True, "TLS handshake"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", False, "no answer within 2s"),
    (grpc.StatusCode.UNIMPLEMENTED, "Method not found!", False, "not a lighthouse-cluster node"),
    (grpc.StatusCode.UNAVAILABLE, "DNS resolution failed for nosuch:1", False, "does not resolve"),
])
def test_grpc_failures_say_what_to_check(code: grpc.StatusCode, details: str, tls: bool, expect: str) -> None:
    line = explain_rpc_error("h:1", code, details, 2.0, tls)
    assert line.startswith("h:1: ") and expect in line and "\n" not in line


# -- against real processes ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory):
    with started_cluster(tmp_path_factory.mktemp("errors"), nodes=1, http_ports=free_ports(1)) as c:
        yield c


def one_error_line(res) -> str:  # type: ignore[no-untyped-def]
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


@pytest.mark.integration
@pytest.mark.parametrize("command", [("status",), ("members", "list"), ("health",)], ids=" ".join)
def test_client_commands_explain_what_went_wrong(node: LocalCluster, command: tuple[str, ...]) -> None:
    http_port = node.http_ports[0]
    dead = free_ports(1)[0]
    line = one_error_line(cli(*command, "--endpoints", f"http://127.0.0.1:{http_port}"))
    assert "not a gRPC port" in line, line
    line = one_error_line(cli(*command, "--endpoints", f"http://127.0.0.1:{dead}"))
    assert "nothing listens there" in line, line
    line = one_error_line(cli(*command, "--endpoints", f"https://{node.client_addresses[0]}"))
    assert "TLS handshake failed" in line, line
    # and the same node through the right port answers
    assert cli(*command, "--endpoints", f"http://{node.client_addresses[0]}").returncode == 0


@pytest.mark.integration
def test_a_plain_http_server_is_not_mistaken_for_a_node() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        line = one_error_line(cli("status", "--endpoints", f"http://127.0.0.1:{server.server_address[1]}"))
        assert "not a gRPC port" in line, line
    finally:
        server.shutdown()
        thread.join(timeout=5)
