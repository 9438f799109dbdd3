"""The fault-injection harness's backend selection (``jepsen_like.network``, ``cluster.open_clock``),
without root, namespaces or node processes: every backend has the whole ``NetworkBackend``
interface, and a backend that cannot run here is refused with its reason."""

from __future__ import annotations

import os
import shutil
import typing
from pathlib import Path

import pytest

from jepsen_like import clock, cluster, netns, network, proxy


def protocol_members(proto: type) -> set[str]:
    return {name for name in (*proto.__dict__, *typing.get_type_hints(proto)) if not name.startswith("_")}


@pytest.mark.parametrize("backend", [network.NoNetwork, netns.NetnsNetwork, proxy.ProxyNetwork])
def test_every_backend_has_the_whole_interface(backend: type) -> None:
    members = protocol_members(network.NetworkBackend)
    assert {"setup", "teardown", "cluster_kwargs", "attach", "isolate", "partition", "cut", "heal", "blocked",
            "name"} <= members
    assert all(hasattr(backend, m) for m in members), sorted(m for m in members if not hasattr(backend, m))
    assert backend.name in network.BACKENDS


def test_make_network_names_and_wiring_without_setup() -> None:
    none = network.make_network("none", 3)
    assert none.name == "none" and none.cluster_kwargs() == {} and none.blocked == frozenset()
    with pytest.raises(network.BackendUnavailable, match="injects no network faults"):
        none.isolate(0)
    net = network.make_network("proxy", 3)
    assert isinstance(net, proxy.ProxyNetwork) and set(net.cluster_kwargs()) == {"launch_prefix"}
    with pytest.raises(network.BackendUnavailable, match="unknown network backend 'wifi'"):
        network.make_network("wifi", 3)


def test_netns_without_root_or_tools_is_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns, "_available_cache", None)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert network.default_backend() == "proxy"
    with pytest.raises(network.BackendUnavailable, match=r"netns backend unavailable: .*need root.*--backend proxy"):
        network.make_network("netns", 3)
    monkeypatch.setattr(netns, "_available_cache", None)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name: None if name in ("nft", "iptables-restore") else real_which(name))
    if real_which("ip") is None:
        pytest.skip("no `ip` here: the firewall check comes after it")
    assert network.default_backend() == "proxy"
    with pytest.raises(network.BackendUnavailable, match="neither `nft` nor `iptables-restore`"):
        network.make_network("netns", 3)


def test_clock_without_libfaketime_is_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    monkeypatch.setattr(clock, "_available_cache", None)
    monkeypatch.setattr(clock, "find_library", lambda *a: None)
    with pytest.raises(cluster.ClockUnavailable, match="apt-get install -y faketime libfaketime"):
        cluster.open_clock(3, tmp_path)
