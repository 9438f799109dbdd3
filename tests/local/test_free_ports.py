"""``free_ports`` (local/cluster.py): the ports tests and ``up`` give nodes. They are drawn from
below the kernel's ephemeral range, where another process's bind(0) or outgoing connection does
not take them between the draw and the node's bind (seen under ``pytest -n 2``: a node failed
with "Address already in use" on a port drawn for it)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from lighthouse_cluster.local import cluster
from lighthouse_cluster.local.cluster import can_bind, free_ports


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    drawable = cluster._drawable_ports()
    if drawable is None:
        pytest.skip("this machine's ephemeral port range leaves no room below it")
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = free_ports(20)
    assert len(set(ports)) == 20
    assert all(drawable[0] <= p < low for p in ports), ports
    assert all(can_bind("127.0.0.1", p) and can_bind("0.0.0.0", p) for p in ports)


def test_a_port_someone_holds_is_never_drawn(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("0.0.0.0", 0))  # held (no SO_REUSEADDR): nobody else can bind it
        busy = taken.getsockname()[1]
        monkeypatch.setattr(cluster, "_drawable_ports", lambda: (busy, busy))
        drawn = free_ports(1)  # the only port in range is held: the kernel picks another
        assert len(drawn) == 1 and drawn[0] != busy


def test_without_room_below_the_ephemeral_range_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster, "_drawable_ports", lambda: None)
    ports = free_ports(3)
    assert len(set(ports)) == 3 and all(can_bind("127.0.0.1", p) for p in ports)


def test_no_port_is_handed_out_twice_while_its_taker_has_not_bound_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # A test drew a job's three ports, then started a cluster, whose own draw gave one of them
    # again as a node's client port: the job's port could never be bound there.
    drawable = cluster._drawable_ports()
    if drawable is None:
        pytest.skip("this machine's ephemeral port range leaves no room below it")
    monkeypatch.setattr(cluster, "_HANDED_OUT", {})
    start = next(p for p in range(drawable[0], drawable[1] - 20, 20)
                 if all(can_bind("0.0.0.0", p + i) for i in range(20)))
    monkeypatch.setattr(cluster, "_drawable_ports", lambda: (start, start + 19))
    drawn = [p for _ in range(4) for p in free_ports(5)]
    assert sorted(drawn) == list(range(start, start + 20))
