"""`serve --raft-dial ID=HOST:PORT`: reach a peer's Raft port somewhere else, identity unchanged.

Parsing and validation (one-line reasons), the three configuration sources, ``DialNode``'s
identity/dial split and its snapshot pickling, that nothing changes without the option, and an
in-process Raft group whose every connection goes through a proxy: the dialer connects to the
override, and both ends still identify each other by Raft address.
"""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from support.waiting import wait_for
from jepsen_like.proxy import ProxyNetwork
from lighthouse_cluster.cli import commands as cli
from lighthouse_cluster.cli import serve as serve_command
from lighthouse_cluster.raft import replication
from lighthouse_cluster.server.config import ConfigError, build_node_config
from lighthouse_cluster.local.cluster import free_ports
from lighthouse_cluster.raft.replication import DialNode, RaftNode, RaftSettings, ReplicatedState
from lighthouse_cluster.raft.pysyncobj_internals import TCPNode  # pysyncobj's own node class
from lighthouse_cluster.core.state_machine import QuorumStateMachine

PEERS = ["n1=127.0.0.1:7001,127.0.0.1:8001", "n2=127.0.0.1:7002,127.0.0.1:8002", "n3=127.0.0.1:7003,127.0.0.1:8003"]


def config(*dial: str, node_id: str = "n1"):
    return build_node_config(node_id=node_id, peers=PEERS, client_bind=None, raft_bind=None, data_dir=None,
                             secret="x", insecure=False, min_replicas=1, join_timeout_ms=1, quorum_tick_ms=1,
                             heartbeat_timeout_ms=1, raft_dial=list(dial))


# -- parsing ---------------------------------------------------------------------------------------


def test_parsed_and_mapped_to_raft_addresses() -> None:
    cfg = config("n2=proxy.local:9002", "n3=[::1]:9003")
    assert cfg.raft_dial == (("n2", "proxy.local:9002"), ("n3", "[::1]:9003"))
    assert cfg.raft_dial_by_address == {"127.0.0.1:7002": "proxy.local:9002", "127.0.0.1:7003": "[::1]:9003"}
    assert config().raft_dial == () and config().raft_dial_by_address == {}


@pytest.mark.parametrize("value, message", [
    ("n4=127.0.0.1:9004", "no peer has id 'n4'"),
    ("n1=127.0.0.1:9001", "n1 is this node, which never dials itself"),
    ("n2", "is not ID=HOST:PORT"),
    ("=127.0.0.1:9002", "is not ID=HOST:PORT"),
    ("n2=127.0.0.1", "--raft-dial n2 address '127.0.0.1' is not HOST:PORT"),
    ("n2=127.0.0.1:0", "port outside 1-65535"),
    ("n2=127.0.0.1:x", "non-numeric port"),
])
def test_bad_values_are_config_errors(value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        config(value)


def test_a_peer_given_twice_is_refused() -> None:
    with pytest.raises(ConfigError, match="--raft-dial given twice for n2"):
        config("n2=127.0.0.1:9002", "n2=127.0.0.1:9012")


# -- the CLI: flag, environment, config file -----------------------------------------------------


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Run `serve` up to the point where it would start the node; collect the NodeConfig."""
    seen: list[Any] = []

    async def fake_serve(cfg: Any) -> None:
        seen.append(cfg)

    monkeypatch.setattr(serve_command, "_serve", fake_serve)
    monkeypatch.setattr("lighthouse_cluster.server.logs.configure_logging", lambda *a, **k: None)
    return seen


def serve(*extra: str, env: dict[str, str] | None = None):
    args = ["serve", "--node-id", "n1", "--min_replicas", "1", "--insecure"]
    for p in PEERS:
        args += ["--peer", p]
    return CliRunner().invoke(cli.main, args + list(extra), env=env or {}, catch_exceptions=False)


def test_flag_env_and_config_file(served: list[Any], tmp_path: Path) -> None:
    res = serve("--raft-dial", "n2=127.0.0.1:9002", "--raft-dial", "n3=127.0.0.1:9003")
    assert res.exit_code == 0, res.output
    assert served[-1].raft_dial == (("n2", "127.0.0.1:9002"), ("n3", "127.0.0.1:9003"))

    res = serve(env={"LIGHTHOUSE_CLUSTER_RAFT_DIAL": "n3=127.0.0.1:9103  n2=127.0.0.1:9102"})
    assert res.exit_code == 0, res.output
    assert dict(served[-1].raft_dial) == {"n2": "127.0.0.1:9102", "n3": "127.0.0.1:9103"}

    cfg = tmp_path / "node.toml"
    cfg.write_text('raft_dial = ["n2=127.0.0.1:9202"]\n')
    res = serve("--config", str(cfg))
    assert res.exit_code == 0, res.output
    assert served[-1].raft_dial == (("n2", "127.0.0.1:9202"),)
    cfg.write_text('raft_dial = "n2=127.0.0.1:9302 n3=127.0.0.1:9303"\n')
    res = serve("--config", str(cfg), env={"LIGHTHOUSE_CLUSTER_RAFT_DIAL": "n3=127.0.0.1:9403"})
    assert res.exit_code == 0, res.output
    assert served[-1].raft_dial == (("n3", "127.0.0.1:9403"),)   # the environment beats the file

    res = serve()
    assert res.exit_code == 0 and served[-1].raft_dial == ()


def test_cli_error_is_one_line(served: list[Any]) -> None:
    res = serve("--raft-dial", "n7=127.0.0.1:9007")
    assert res.exit_code == 2 and not served
    assert res.output.strip().splitlines() == [
        "error: --raft-dial 'n7=127.0.0.1:9007': no peer has id 'n7' (peers: ['n1', 'n2', 'n3'])"]


# -- DialNode ----------------------------------------------------------------------------------------


def test_dial_node_keeps_identity_and_dials_elsewhere() -> None:
    node = DialNode("10.0.0.2:7002", "127.0.0.1:9002")
    plain = TCPNode("10.0.0.2:7002")
    assert node == plain and hash(node) == hash(plain) and node in {plain}
    assert (node.address, node.id, str(node)) == ("10.0.0.2:7002",) * 3
    assert (node.ip, node.port) == ("127.0.0.1", 9002)
    assert (plain.ip, plain.port) == ("10.0.0.2", 7002)
    v6 = DialNode("10.0.0.3:7003", "[::1]:9003")
    assert (v6.ip, v6.port) == ("::1", 9003)
    # pysyncobj pickles the cluster's nodes into snapshots (sent to other nodes): the override
    # must not travel, and must not need our class to load.
    restored = pickle.loads(pickle.dumps(node, protocol=2))
    assert type(restored) is TCPNode and restored == plain and (restored.ip, restored.port) == ("10.0.0.2", 7002)
    for c in (copy.copy(node), copy.deepcopy(node)):                # in-process copies keep it
        assert type(c) is DialNode and c == node and (c.ip, c.port) == ("127.0.0.1", 9002)


def test_no_option_constructs_syncobj_exactly_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    class FakeSyncObj:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            calls.append((args, kwargs))

        def addOnTickCallback(self, callback: Any) -> None:
            pass

        def add_tick_deadline(self, fn: Any) -> None:
            pass

    monkeypatch.setattr(replication, "LighthouseSyncObj", FakeSyncObj)  # RaftNode's SyncObj class
    peers = ["127.0.0.1:7002", "127.0.0.1:7003"]
    RaftNode("127.0.0.1:7001", peers, ReplicatedState(QuorumStateMachine()))
    RaftNode("127.0.0.1:7001", peers, ReplicatedState(QuorumStateMachine()), dial={})
    for args, kwargs in calls:
        assert args == ("127.0.0.1:7001", peers) and set(kwargs) == {"conf", "consumers", "longest_s", "cipher",
                                                                     "quiet_after_s", "quiet_period_s", "quiet_allowed"}
    RaftNode("127.0.0.1:7001", peers, ReplicatedState(QuorumStateMachine()), dial={"127.0.0.1:7003": "h:9"})
    args, kwargs = calls[-1]
    nodes = args[1]
    assert [type(n) for n in nodes] == [TCPNode, DialNode] and nodes == [TCPNode(p) for p in peers]
    assert (nodes[1].dial_address, nodes[1].port) == ("h:9", 9)
    made = kwargs["nodeClass"]("127.0.0.1:7003")
    assert isinstance(made, DialNode) and made.port == 9
    assert type(kwargs["nodeClass"]("127.0.0.1:7002")) is TCPNode
    with pytest.raises(ValueError, match="not peers"):
        RaftNode("127.0.0.1:7001", peers, ReplicatedState(QuorumStateMachine()), dial={"127.0.0.1:7009": "h:9"})


# -- a real Raft group through a proxy --------------------------------------------------------------


FAST = RaftSettings(election_timeout_min_s=0.15, election_timeout_max_s=0.45, append_entries_period_s=0.0375,
                    tick_period_s=0.01, leader_fallback_s=1.0, reconnect_s=0.1)


@pytest.mark.integration
def test_raft_group_connects_through_overrides_with_identities_intact() -> None:
    addrs = [f"127.0.0.1:{p}" for p in free_ports(3)]
    with ProxyNetwork(3) as net:
        net.set_targets(addrs)
        nodes: list[RaftNode] = []
        try:
            for i in range(3):
                others = [a for a in addrs if a != addrs[i]]
                dial = {addrs[j]: net.listen_address(i, j) for j in range(3) if j != i}
                nodes.append(RaftNode(addrs[i], others, ReplicatedState(QuorumStateMachine()), secret="s3cret",
                                      settings=FAST, dial=dial))

            def formed() -> bool:
                leaders = {n.leader_address for n in nodes}
                return (len(leaders) == 1 and None not in leaders and all(n.commit_index >= 1 for n in nodes)
                        and all(n.is_connected(a) for n in nodes for a in addrs if a != n.self_address))
            wait_for("3 nodes connected to each other by Raft address, one leader, entries committed", formed, 10)
            # Every connection went through the proxy, dialed by the greater address (pysyncobj's
            # rule: identity decides who dials), through the dialer's own listener.
            stats = net.stats()
            accepted = {k for k in stats if k.startswith("accepted")}
            expected = {f"accepted {i}->{j}" for i in range(3) for j in range(3) if addrs[i] > addrs[j]}
            assert accepted == expected, stats
            assert all(stats.get(f"bytes {i}->{j}", 0) > 0 for i in range(3) for j in range(3) if i != j), stats

            # Cutting the proxy disconnects the nodes: nothing reaches a peer's real address.
            net.isolate(0)
            wait_for("n1 disconnected from both", lambda: not any(nodes[0].is_connected(a) for a in addrs[1:])
                     and not any(n.is_connected(addrs[0]) for n in nodes[1:]), 5)
            net.heal()
            wait_for("reconnected after heal", formed, 10)
        finally:
            for n in nodes:
                n.destroy()
