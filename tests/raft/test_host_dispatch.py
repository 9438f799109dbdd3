"""``raft/host.py``: the hooks run in their order, stop where a hook says so, and reach pysyncobj.

The host here is a ``RaftHost`` made without ``SyncObj.__init__`` (no sockets, no thread), whose
pysyncobj side is replaced by a record of what reached it.
"""

from __future__ import annotations

from typing import Any

from lighthouse_cluster.raft.host import HOOKS, Ack, Extension, RaftHost, TickPoller, hook_calls


class Recorder(Extension):
    """Records each hook it sees in ``log`` as (name, hook)."""

    def __init__(self, name: str, log: list[tuple[str, str]], *, consume: bool = False, hold_ack: bool = False,
                 key: str | None = None, wait: float | None = None) -> None:
        self.name, self.log, self.consume, self.hold_ack, self.key, self.wait = name, log, consume, hold_ack, key, wait

    def before_tick(self) -> None:
        self.log.append((self.name, "before_tick"))

    def after_tick(self) -> None:
        self.log.append((self.name, "after_tick"))

    def message_in(self, node: Any, message: Any) -> bool:
        self.log.append((self.name, "message_in"))
        return self.consume

    def message_handled(self, node: Any, message: Any, was_leader: bool) -> None:
        self.log.append((self.name, f"message_handled was_leader={was_leader}"))

    def message_out(self, node: Any, message: Any) -> Any:
        return {**message, self.key: self.name} if self.key else message

    def ack_out(self, ack: Ack) -> bool:
        self.log.append((self.name, "ack_out"))
        return not self.hold_ack

    def ack_sent(self, ack: Ack) -> None:
        self.log.append((self.name, "ack_sent"))

    def tick_wait(self, overdue_s: float) -> float | None:
        return self.wait

    def next_deadlines(self) -> list[float]:
        return [len(self.name)]


class BareHost(RaftHost):
    """A RaftHost without pysyncobj: what would reach pysyncobj is recorded."""

    __slots__ = ("handled", "acks", "leader")

    def pso_handle_message(self, node: Any, message: Any) -> None:
        self.handled.append((node, message))

    def pso_send_ack(self, node: Any, reset: bool, next_index: int | None, success: bool) -> None:
        self.acks.append((node, reset, next_index, success))

    def pso_last_log(self) -> tuple[int, int]:
        return 3, 41

    def _isLeader(self) -> bool:  # noqa: N802
        return self.leader


def bare_host(*extensions: Extension) -> BareHost:
    host = BareHost.__new__(BareHost)
    host.handled, host.acks, host.leader = [], [], True
    host.host_extensions(extensions)
    return host


def test_before_hooks_run_in_list_order_and_after_hooks_in_reverse() -> None:
    log: list[tuple[str, str]] = []
    host = bare_host(Recorder("outer", log), Recorder("inner", log))
    host.on_raft_message("n1", {"type": "append_entries"})
    assert log == [("outer", "message_in"), ("inner", "message_in"),
                   ("inner", "message_handled was_leader=True"), ("outer", "message_handled was_leader=True")]
    assert host.handled == [("n1", {"type": "append_entries"})]


def test_a_consumed_message_never_reaches_pysyncobj_nor_later_hooks() -> None:
    log: list[tuple[str, str]] = []
    host = bare_host(Recorder("outer", log, consume=True), Recorder("inner", log))
    host.on_raft_message("n1", {"type": "lighthouse_cluster_keepalive"})
    assert log == [("outer", "message_in")]
    assert host.handled == []


def test_outgoing_marks_are_added_in_list_order() -> None:
    host = bare_host(Recorder("a", [], key="k1"), Recorder("b", [], key="k2"))
    out = host.outgoing_message("n1", {"type": "append_entries", "term": 2})
    assert list(out) == ["type", "term", "k1", "k2"]


def test_an_ack_is_completed_sent_and_reported_unless_held_back() -> None:
    log: list[tuple[str, str]] = []
    host = bare_host(Recorder("a", log), Recorder("b", log))
    host.on_ack("leader", False, None, True)
    assert host.acks == [("leader", False, 42, True)]  # next index filled in: after the last entry
    assert log == [("a", "ack_out"), ("b", "ack_out"), ("a", "ack_sent"), ("b", "ack_sent")]

    log.clear()
    held = bare_host(Recorder("a", log, hold_ack=True), Recorder("b", log))
    held.on_ack("leader", False, 7, True)
    assert held.acks == [] and log == [("a", "ack_out")]


def test_the_wait_is_the_first_answer_else_pysyncobjs_fixed_tick() -> None:
    assert bare_host(Recorder("a", []), Recorder("b", [], wait=0.25))._wait_for(0.01) == 0.25
    assert bare_host(Recorder("a", []))._wait_for(0.01) == 0.01


def test_tick_deadlines_gather_every_extension_and_every_registered_function() -> None:
    host = bare_host(Recorder("ab", []), Recorder("abc", []))
    host.add_tick_deadline(lambda: 9.0)
    host.add_tick_deadline(lambda: None)
    assert sorted(host.tick_deadlines()) == [2, 3, 9.0]


def test_only_overridden_hooks_are_called() -> None:
    class OnlyTicks(Extension):
        def before_tick(self) -> None:
            pass

    ext = OnlyTicks()
    assert hook_calls([ext], "before_tick") == (ext.before_tick,)
    assert all(hook_calls([ext], hook) == () for hook in HOOKS if hook != "before_tick")


def test_the_tick_poller_waits_as_told_and_wraps_every_socket_callback() -> None:
    calls: list[Any] = []

    class Inner:
        def subscribe(self, descr: Any, callback: Any, mask: int) -> None:
            calls.append(("subscribe", descr, callback(), mask))

        def poll(self, timeout: float) -> None:
            calls.append(("poll", timeout))

        def unsubscribe(self, descr: Any) -> None:
            calls.append(("unsubscribe", descr))

    poller = TickPoller(Inner(), lambda overdue: overdue * 10, lambda cb: (lambda: ("wrapped", cb())))
    poller.subscribe(5, lambda: "cb", 3)
    poller.poll(0.01)
    poller.poll_now()
    poller.unsubscribe(5)
    assert calls == [("subscribe", 5, ("wrapped", "cb"), 3), ("poll", 0.1), ("poll", 0.0), ("unsubscribe", 5)]


def test_hosts_keep_their_state_out_of_the_instance_dict() -> None:
    host = bare_host(Recorder("a", []))
    host.add_tick_deadline(lambda: 1.0)
    ours = {"extensions", "handled", "acks", "leader"} | set(RaftHost.__slots__)
    assert not ours & set(vars(host))
