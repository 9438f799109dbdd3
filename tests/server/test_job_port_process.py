"""The job port process's pure parts: its settings on stdin, and when it asks its node who leads.

The process itself (listening, forwarding, pass-through, restarts, dying with its node, TLS) is
exercised on real clusters in ``test_job_ports.py`` (the ``port-processes`` cases).
"""

from __future__ import annotations

from lighthouse_cluster.server.job_port_process import (
    IDLE_LEADER_POLL_S,
    LEADER_POLL_S,
    CallActivity,
    NodeView,
    PortSpec,
)
from lighthouse_cluster.tls import ClientTLS, ServerTLS


def spec(**changes: object) -> PortSpec:
    base = dict(job="train-a", host="[::]", port=29511, node_id="n2", node_address="10.0.0.2:29510",
                max_member_bytes=65536, parent_pid=4242, log_level="debug", log_format="json",
                server_options=(("grpc.so_reuseport", 0), ("grpc.max_send_message_length", 1 << 26)), nice=7)
    base.update(changes)
    return PortSpec(**base)  # type: ignore[arg-type]


def test_settings_survive_the_trip_through_stdin_tls_keys_included() -> None:
    plain = spec()
    assert PortSpec.decode(plain.encode()) == plain
    tls = spec(server_tls=ServerTLS(b"CHAIN", b"SERVER-KEY", b"CLIENT-CA"),
               client_tls=ClientTLS(b"ROOT", b"CERT", b"CLIENT-KEY"))
    back = PortSpec.decode(tls.encode())
    assert back == tls
    assert back.server_tls.private_key == b"SERVER-KEY" and back.client_tls.client_key == b"CLIENT-KEY"
    # Keys never show in a printed spec (a log line, an error).
    assert "SERVER-KEY" not in repr(back) and "CLIENT-KEY" not in repr(back)


def test_a_port_process_forwards_even_to_its_own_node() -> None:
    # Its identity is no node id, so the router never takes its node's calls for its own.
    assert spec().identity == "n2/train-a"
    view = NodeView()
    assert view.job_coordinator("train-a") is None and view.leader_peer() is None
    assert view.raft.is_leader is False


def test_the_leader_is_asked_often_only_while_calls_come() -> None:
    activity = CallActivity()
    assert activity.poll_interval() == IDLE_LEADER_POLL_S and not activity.woken.is_set()
    activity.note_client_activity()  # the first call after a quiet spell wakes the poll at once
    assert activity.woken.is_set() and activity.poll_interval() == LEADER_POLL_S
    activity.woken.clear()
    activity.note_client_activity()  # later calls do not
    assert not activity.woken.is_set()
    activity.last_call -= 10.0
    assert activity.poll_interval() == IDLE_LEADER_POLL_S


def test_a_port_process_that_may_not_lower_its_priority_says_so_and_serves(monkeypatch, caplog) -> None:
    from lighthouse_cluster.server import job_port_process

    def refused(steps: int) -> int:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(job_port_process.os, "nice", refused)
    with caplog.at_level("WARNING", logger=job_port_process.__name__):
        job_port_process.lower_priority(10)  # no exception
    assert "cannot lower this process's CPU priority by 10: [Errno 1] Operation not permitted" in caplog.text
    calls: list[int] = []
    monkeypatch.setattr(job_port_process.os, "nice", calls.append)
    job_port_process.lower_priority(0)
    assert calls == []  # 0: the node's own priority, nothing to do
