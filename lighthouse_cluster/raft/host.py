"""``RaftHost``: one ``SyncObj`` subclass that hosts a list of small extensions with named hooks.

It replaces the chain of ``SyncObj`` subclasses (durability, adaptive tick, idle acks, fast
election, stall tolerance, quiescence, lease probes), each overriding the same few methods, with
one class that calls each mechanism (an ``Extension``, ``raft/extensions/``) at named points
(why, and what it replaced: docs/design/raft-host.md):

======================  ===========================================================  ===========
hook                    when (all on the tick thread unless said)                     order
======================  ===========================================================  ===========
``on_started``          after ``SyncObj.__init__`` (the tick thread already runs)      list
``before_tick``         a tick's start, before pysyncobj's own work                    list
``on_tick_callback``    pysyncobj's on-tick callbacks (after its command queue, just   list
                        before the wait; before callbacks added after the host's)
``after_tick``          after pysyncobj's tick and its wait for socket events          reversed
``next_deadlines``      while the tick thread computes its wait: ``monotonic()`` times any
                        at which the extension needs a tick
``tick_wait``           how long the tick thread waits (the first answer that is not    list
                        None; none: pysyncobj's fixed ``autoTickPeriod``)
``socket_callback``     a poller callback as a socket is subscribed (wrap it)          list
``message_in``          a Raft message received, before pysyncobj handles it; True:    list
                        handled here, stop (pysyncobj never sees it)
``message_handled``     after pysyncobj handled it (``was_leader``: before it did)     reversed
``message_out``         every message sent: return it, or a copy with keys added       list
``ack_out``             an acknowledgement (``Ack``) about to be sent; False: held     list
                        back (later hooks do not see it)
``ack_sent``            after an acknowledgement was sent                              list
``node_disconnected``   after pysyncobj noted a member's connection closed             list
======================  ===========================================================  ===========

"list" is the order in which the extensions are given, outermost first (``composed_node``
gives it, with the reason for each place); "reversed" runs the innermost first. That is the
order the chain of subclasses ran its code in: work before ``super()`` outermost first, work
after it innermost first.

**What the host owns besides the dispatch.** The transport (``HostTransport``: message out,
disconnects, per-node compression), the poller the tick thread waits in (``TickPoller``, built
around pysyncobj's own as pysyncobj stores it: ``SyncObjPrivates.adopt_poller``), the journal of a node with
a data directory (opened here, per node, from the conf's ``StoragePath``, as pysyncobj stores
its ``MemoryJournal``) and its snapshot file (``durable_snapshot``, in place of pysyncobj's
``Serializer`` for the same ``StoragePath``), the tick deadlines registered from outside
(``add_tick_deadline``), and waking the tick thread (``wake``).

**Nothing of ours enters a snapshot.** pysyncobj pickles into every snapshot each attribute in
the SyncObj's ``__dict__`` that was not there when ``SyncObj.__init__`` finished (``__properies``),
and restores them on every node that loads it. The host keeps its own state in ``__slots__``
(never in ``__dict__``), and every extension keeps its own on itself: no attribute of ours is in
the dict, whatever is set when. A snapshot written by an older version with such attributes is
loaded into the dict, where nothing here reads it (a slot shadows the dict).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pysyncobj import SyncObj

from lighthouse_cluster.raft.durable_snapshot import DurableSnapshotFile
from lighthouse_cluster.raft.host_transport import HostTransport
from lighthouse_cluster.raft.pysyncobj_internals import MemoryJournal, StoragePath, SyncObjPrivates, monotonic

__all__ = ["Ack", "Extension", "HOOKS", "RaftHost", "TickPoller"]


@dataclass
class Ack:
    """An acknowledgement a follower sends its leader for an append_entries (pysyncobj's
    ``next_node_idx``): ``next_index`` the index the leader should send next (filled in before the
    hooks see it), ``success`` the entries matched, ``reset`` the leader must go back to it.
    ``must_send``: a hook asks that it go out even if it repeats the last one (``idle_acks``)."""

    node: Any
    reset: bool
    next_index: int
    success: bool
    must_send: bool = False


class Extension:
    """One mechanism of a node: override the hooks it needs (all no-ops here; see the module
    docstring for when each runs). ``attach`` gives it its host before ``SyncObj.__init__``."""

    host: Any = None

    def attach(self, host: RaftHost) -> None:
        self.host = host

    def on_started(self) -> None:
        """After ``SyncObj.__init__``."""

    def before_tick(self) -> None:
        """A tick's start."""

    def on_tick_callback(self) -> None:
        """Among pysyncobj's on-tick callbacks."""

    def after_tick(self) -> None:
        """After pysyncobj's tick and wait."""

    def next_deadlines(self) -> Iterable[float]:
        """``monotonic()`` times at which this extension needs a tick."""
        return ()

    def tick_wait(self, overdue_s: float) -> float | None:
        """How long the tick thread waits (None: another's answer, or ``overdue_s``)."""
        return None

    def socket_callback(self, callback: Any) -> Any:
        """The callback to register for a socket pysyncobj subscribes with ``callback``."""
        return callback

    def message_in(self, node: Any, message: Any) -> bool:
        """True: handled here, pysyncobj and later hooks never see it."""
        return False

    def message_handled(self, node: Any, message: Any, was_leader: bool) -> None:
        """After pysyncobj handled ``message``."""

    def message_out(self, node: Any, message: Any) -> Any:
        """The message to send instead of ``message`` (itself, or a copy with more keys)."""
        return message

    def ack_out(self, ack: Ack) -> bool:
        """False: the acknowledgement is held back."""
        return True

    def ack_sent(self, ack: Ack) -> None:
        """After ``ack`` was sent."""

    def node_disconnected(self, node: Any) -> None:
        """After pysyncobj noted ``node``'s connection down."""


# Every hook, and whether it runs innermost first.
HOOKS: dict[str, bool] = {
    "on_started": False, "before_tick": False, "on_tick_callback": False, "after_tick": True,
    "next_deadlines": False, "tick_wait": False, "socket_callback": False, "message_in": False,
    "message_handled": True, "message_out": False, "ack_out": False, "ack_sent": False,
    "node_disconnected": False,
}


def hook_calls(extensions: Iterable[Extension], hook: str) -> tuple[Callable[..., Any], ...]:
    """The bound ``hook`` of each extension that overrides it, in the hook's order."""
    calls = [getattr(e, hook) for e in extensions if getattr(type(e), hook) is not getattr(Extension, hook)]
    return tuple(reversed(calls)) if HOOKS[hook] else tuple(calls)


class TickPoller:
    """pysyncobj's poller, around which the host is built: the tick thread's ``poll(timeout)``
    waits ``wait(timeout)``, and each socket's callback is the host's ``socket_callback`` of it."""

    def __init__(self, poller: Any, wait: Callable[[float], float], wrap: Callable[[Any], Any]) -> None:
        self.inner = poller
        self.wait = wait
        self.wrap = wrap

    def subscribe(self, descr: Any, callback: Any, eventMask: int) -> None:  # noqa: N803 -- pysyncobj's name
        self.inner.subscribe(descr, self.wrap(callback), eventMask)

    def unsubscribe(self, descr: Any) -> None:
        self.inner.unsubscribe(descr)

    def poll(self, timeout: float) -> None:
        self.inner.poll(self.wait(timeout))

    def poll_now(self) -> None:
        """Handle what has arrived, without waiting."""
        self.inner.poll(0.0)


class RaftHost(SyncObjPrivates, SyncObj):
    """``SyncObj`` that runs ``extensions`` at the hooks of the module docstring.

    ``open_journal(path)``: the journal of a conf whose ``journalFile`` is a ``StoragePath`` (this
    project's durable journal); ``cipher``: what encrypts the Raft port (``message_cipher``; None:
    pysyncobj's own Fernet, or none without a secret); ``transportClass``: pysyncobj's, by default
    ``HostTransport`` (another one, a test's simulated network, must hand every message it sends
    to ``outgoing_message`` and report a closed connection to ``node_disconnected`` as it does).
    The other arguments are ``SyncObj``'s."""

    __slots__ = ("extensions", "_hook_calls", "_cipher", "_journal_path", "_open_journal", "_deadline_fns",
                 "_commands_overran", "_tick_poller")

    def __init__(self, selfNode: Any, otherNodes: Any, conf: Any = None, consumers: Any = None,  # noqa: N803
                 nodeClass: Any = None, *, extensions: Iterable[Extension] = (),  # noqa: N803
                 open_journal: Callable[[StoragePath], Any] | None = None, cipher: Any = None,
                 transportClass: Any = HostTransport) -> None:  # noqa: N803 -- pysyncobj's name
        # Every slot before SyncObj.__init__: it reads every attribute (looking for replicated
        # methods) and starts the tick thread, which calls the hooks.
        self.host_extensions(extensions, cipher=cipher)
        journal_file = getattr(conf, "journalFile", None)
        self._journal_path = journal_file if isinstance(journal_file, StoragePath) and open_journal else None
        self._open_journal = open_journal
        if self._journal_path is not None:
            conf.journalFile = None  # pysyncobj makes a MemoryJournal, which adopt_journal replaces
        kwargs: dict[str, Any] = {"transportClass": transportClass}
        if nodeClass is not None:
            kwargs["nodeClass"] = nodeClass
        try:
            super().__init__(selfNode, otherNodes, conf, consumers, **kwargs)
        finally:
            if self._journal_path is not None:
                conf.journalFile = self._journal_path  # the conf as it was given
        # After pysyncobj's own callbacks (the transport's), before any added later.
        self.addOnTickCallback(self._on_tick_callback)
        for call in self._hook_calls["on_started"]:
            call()

    def host_extensions(self, extensions: Iterable[Extension], *, cipher: Any = None) -> None:
        """Set the host's own state and attach ``extensions`` (``__init__``, before
        ``SyncObj.__init__``; tests call it on a host made without pysyncobj's)."""
        self.extensions = tuple(extensions)
        self._hook_calls = {hook: hook_calls(self.extensions, hook) for hook in HOOKS}
        self._cipher = cipher
        self._deadline_fns: list[Callable[[], float | None]] = []
        self._commands_overran = False
        self._tick_poller: TickPoller | None = None
        self._journal_path = None
        self._open_journal = None
        for extension in self.extensions:
            extension.attach(self)

    # -- what the host adopts as pysyncobj builds it ----------------------------------------------

    def adopt_journal(self, journal: Any) -> Any:
        path = self._journal_path
        if path is None or not isinstance(journal, MemoryJournal) or self._open_journal is None:
            return journal
        return self._open_journal(path)

    def adopt_serializer(self, serializer: Any) -> Any:
        """The snapshot file of a conf whose ``fullDumpFile`` is a ``StoragePath``: one that syncs
        (``durable_snapshot``); any other, pysyncobj's."""
        path = self.conf.fullDumpFile
        if not isinstance(path, StoragePath):
            return serializer
        return DurableSnapshotFile(path, self.conf.logCompactionBatchSize)

    def adopt_poller(self, poller: Any) -> Any:
        self._tick_poller = TickPoller(poller, self._wait_for, self._wrap_socket_callback)
        return self._tick_poller

    @property
    def encryptor(self) -> Any:
        """What encrypts this node's Raft messages: the host's ``cipher``, else pysyncobj's own."""
        cipher = self._cipher
        return cipher if cipher is not None else SyncObj.encryptor.fget(self)  # type: ignore[attr-defined]

    # -- the tick ---------------------------------------------------------------------------------

    def _onTick(self, timeToWait: float = 0.0) -> None:  # noqa: N803 -- pysyncobj's name
        for call in self._hook_calls["before_tick"]:
            call()
        super()._onTick(timeToWait)
        for call in self._hook_calls["after_tick"]:
            call()

    def _on_tick_callback(self) -> None:
        for call in self._hook_calls["on_tick_callback"]:
            call()

    def _checkCommandsToApply(self) -> None:
        # pysyncobj drains the command queue for at most appendEntriesPeriod per tick: when it ran
        # that long, commands may be left (their wake-ups already read).
        started = monotonic()
        super()._checkCommandsToApply()
        self._commands_overran = monotonic() - started >= self.conf.appendEntriesPeriod

    @property
    def commands_overran(self) -> bool:
        """Whether this tick's drain of the command queue stopped at its time limit."""
        return self._commands_overran

    def add_tick_deadline(self, fn: Callable[[], float | None]) -> None:
        """``fn()``, called on the tick thread before each wait: the ``monotonic()`` time of the
        next tick that ``fn``'s owner needs, or None. Register before anything is due."""
        self._deadline_fns.append(fn)

    def tick_deadlines(self) -> list[float]:
        """Every ``monotonic()`` time at which a tick is due: the extensions' and those added."""
        out: list[float] = []
        for call in self._hook_calls["next_deadlines"]:
            out.extend(call())
        for fn in self._deadline_fns:
            deadline = fn()
            if deadline is not None:
                out.append(deadline)
        return out

    def _wait_for(self, overdue_s: float) -> float:
        for call in self._hook_calls["tick_wait"]:
            wait = call(overdue_s)
            if wait is not None:
                return wait
        return overdue_s

    def _wrap_socket_callback(self, callback: Any) -> Any:
        for call in self._hook_calls["socket_callback"]:
            callback = call(callback)
        return callback

    def read_now(self) -> None:
        """On the tick thread: handle the messages that have arrived, without waiting."""
        poller = self._tick_poller
        if poller is not None:
            poller.poll_now()

    def wake(self) -> None:
        """End the tick thread's wait now (from any thread)."""
        self.pso_wake()

    def destroy(self) -> None:
        super().destroy()
        self.wake()  # the tick thread sees the request at its next tick, not after a long wait

    # -- messages ---------------------------------------------------------------------------------

    def on_raft_message(self, node: Any, message: Any) -> None:
        """Every Raft message from ``node`` (and one an extension hands back later): the
        extensions' ``message_in``, pysyncobj's handling, their ``message_handled``."""
        for call in self._hook_calls["message_in"]:
            if call(node, message):
                return
        was_leader = self._isLeader()
        self.pso_handle_message(node, message)
        for call in self._hook_calls["message_handled"]:
            call(node, message, was_leader)

    def outgoing_message(self, node: Any, message: Any) -> Any:
        """The message the transport sends to ``node`` for ``message`` (``HostTransport.send``)."""
        for call in self._hook_calls["message_out"]:
            message = call(node, message)
        return message

    def on_ack(self, node: Any, reset: bool, next_index: int | None, success: bool) -> None:
        if next_index is None:
            next_index = self.pso_last_log()[1] + 1
        ack = Ack(node, reset, next_index, success)
        for call in self._hook_calls["ack_out"]:
            if not call(ack):
                return
        self.pso_send_ack(ack.node, ack.reset, ack.next_index, ack.success)
        for call in self._hook_calls["ack_sent"]:
            call(ack)

    def node_disconnected(self, node: Any) -> None:
        """After pysyncobj noted ``node``'s connection down (``HostTransport``)."""
        for call in self._hook_calls["node_disconnected"]:
            call(node)

    # -- shared reads for the extensions ------------------------------------------------------------

    def is_current_leaders_append(self, node: Any, message: Any) -> bool:
        """Whether ``message`` from ``node`` is an append_entries of this follower's leader in its
        current term (after pysyncobj has handled it)."""
        return (isinstance(message, dict) and message.get("type") == "append_entries"
                and not self._isLeader() and message.get("term") == self.raftCurrentTerm
                and node == self._getLeader())
