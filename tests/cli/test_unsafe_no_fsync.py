"""`--unsafe-no-fsync` (issue 32): never the default, and visible wherever an operator looks.

Without a cluster: the flag's default in `serve` and in ``NodeConfig``, and what `status` makes of
a node that reports it (a red warning line on a terminal and off one, ``fsync: false`` per node in
``--output json``); a cluster whose nodes all sync shows nothing new. That a node started with the
flag logs the warning and reports it in Status is checked on real nodes in
tests/fault_injection/test_power_loss.py.
"""

from __future__ import annotations

import io
import re

from click.testing import CliRunner
from rich.console import Console

from lighthouse_cluster.cli.commands import main
from lighthouse_cluster.cli.status_tables import render
from lighthouse_cluster.client.cluster_view import build_view, to_json
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.server.config import NodeConfig, build_node_config

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def status(node_id: str, role: int, unsafe: bool) -> cpb.NodeStatus:
    return cpb.NodeStatus(node=cpb.NodeInfo(id=node_id, client_address=f"127.0.0.1:{node_id[1:]}"), role=role, term=3,
                          leader_id="n1", serving=role == cpb.LEADER, unsafe_no_fsync=unsafe)


def rendered(view, terminal: bool) -> list[str]:  # type: ignore[no-untyped-def]
    buf = io.StringIO()
    render(view, Console(file=buf, force_terminal=terminal, width=100, highlight=False))
    return [ANSI.sub("", line) for line in buf.getvalue().splitlines()]


def test_syncing_is_the_default_everywhere() -> None:
    assert NodeConfig.__dataclass_fields__["unsafe_no_fsync"].default is False
    config = build_node_config(node_id="n1", peers=["n1=127.0.0.1:1,127.0.0.1:2"], client_bind=None, raft_bind=None,
                               data_dir=None, secret=None, insecure=True, min_replicas=1, join_timeout_ms=100,
                               quorum_tick_ms=100, heartbeat_timeout_ms=100)
    assert config.unsafe_no_fsync is False
    help_text = CliRunner().invoke(main, ["serve", "--help"]).output
    assert "--unsafe-no-fsync" in help_text and "UNSAFE" in help_text


def test_status_warns_about_a_node_that_does_not_sync_in_tables_and_json() -> None:
    view = build_view([("127.0.0.1:1", status("n1", cpb.LEADER, False)),
                       ("127.0.0.1:2", status("n2", cpb.FOLLOWER, True)),
                       ("127.0.0.1:3", status("n3", cpb.FOLLOWER, True))])
    data = to_json(view)
    assert {n["id"]: n["fsync"] for n in data["nodes"]} == {"n1": True, "n2": False, "n3": False}
    warning = ("warning: n2, n3 run with --unsafe-no-fsync: a power loss can lose acknowledged quorums "
               "(tests and benchmarks only)")
    for terminal in (True, False):
        assert warning in rendered(view, terminal)   # one line, never folded (grep finds it)


def test_status_of_a_syncing_cluster_says_nothing_about_it() -> None:
    view = build_view([("127.0.0.1:1", status("n1", cpb.LEADER, False)),
                       ("127.0.0.1:2", status("n2", cpb.FOLLOWER, False))])
    assert all(n["fsync"] for n in to_json(view)["nodes"])
    assert not any("fsync" in line for line in rendered(view, False))
