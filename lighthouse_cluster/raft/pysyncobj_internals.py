"""Every private pysyncobj name this project uses, in one place, and the import-time check of them.

pysyncobj has no API for what the node's extensions (``raft/extensions/``) and ``RaftNode`` do
(keep-alives between followers, an election started early, elections held back on a joining node,
connects stuck in SYN-SENT dropped, a tick thread that sleeps until its next deadline, idle
heartbeats acknowledged a few times a second, a quiet leader), for reading its journal and
snapshot files, nor for plugging in a journal that syncs (adopted per node: ``SyncObjPrivates``)
or a snapshot file that syncs (adopted per node too: ``SerializerPrivates``), so those reach into
its private attributes and submodules. They do so only through this module:

* ``INTERNALS``: the table of every private name used (a ``self.__x`` attribute of a class, a
  private method, a name in a submodule), with what the check verifies for each;
* ``check()``: run when ``lighthouse_cluster.raft`` is imported; raises ``ImportError`` in one
  line naming the installed version, every missing name and the version to install;
* ``SyncObjPrivates``: SyncObj's private state under ``pso_*`` names, each built from an entry
  of ``INTERNALS`` (a name that is not in the table cannot be reached this way), mixed into the
  one ``SyncObj`` subclass, ``raft.host.RaftHost``; ``SerializerPrivates`` likewise for the one
  ``Serializer`` subclass, ``raft.durable_snapshot.DurableSnapshotFile``;
* the private module-level names (``RAFT_STATE``, ``CONNECTION_STATE``, ``monotonic``, the
  journal's layout, ...), imported only after the check passed.

The other modules of ``lighthouse_cluster.raft`` import pysyncobj's public API (``from pysyncobj
import ...``) and everything else from here (tests/raft/test_pysyncobj_internals.py checks this on the
source). pysyncobj is pinned to ``PINNED_VERSION`` in pyproject.toml: the version whose source these
names and the behaviour around them were read from.
"""

from __future__ import annotations

import dis
import importlib
import inspect
import struct
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

PINNED_VERSION = "0.3.17"

MODULE = "module"        # a name defined in the module
CLASS = "class"          # an attribute of the class (method, property, constant)
INSTANCE = "instance"    # an attribute the class's ``__init__`` sets (``self.__x = ...``)


@dataclass(frozen=True)
class Internal:
    """One private pysyncobj name: ``module`` and, for ``CLASS``/``INSTANCE``, ``owner``, the class
    in it. ``name`` is spelled as it is reached from outside (``_SyncObj__raftState`` for SyncObj's
    ``self.__raftState``). ``params``: for a method this project overrides or calls, its parameters
    (an override with other parameters would be called wrongly)."""

    module: str
    name: str
    kind: str = MODULE
    owner: str = ""
    params: tuple[str, ...] | None = None

    @property
    def label(self) -> str:
        return ".".join(p for p in (self.module, self.owner, self.name) if p)


def _syncobj(name: str, kind: str = INSTANCE, params: tuple[str, ...] | None = None) -> Internal:
    return Internal("pysyncobj.syncobj", name, kind, "SyncObj", params)


# SyncObj's private state. Its public properties (raftCurrentTerm, selfNode, otherNodes, conf, ...)
# are used directly, not listed here.
RAFT_STATE_ATTR = _syncobj("_SyncObj__raftState")                    # _RAFT_STATE.*
VOTED_FOR_ATTR = _syncobj("_SyncObj__votedForNodeId")                # node id voted for this term, or None
TRANSPORT_ATTR = _syncobj("_SyncObj__transport")                     # the TCPTransport
RAFT_LOG_ATTR = _syncobj("_SyncObj__raftLog")                        # the journal (FileJournal / MemoryJournal)
ELECTION_DEADLINE_ATTR = _syncobj("_SyncObj__raftElectionDeadline")  # monotonic() time of the next election
ON_MESSAGE_RECEIVED = _syncobj("_SyncObj__onMessageReceived", CLASS, ("self", "node", "message"))  # overridden
LOG_TERM = _syncobj("_SyncObj__getCurrentLogTerm", CLASS, ("self",))
LOG_INDEX = _syncobj("_SyncObj__getCurrentLogIndex", CLASS, ("self",))
GENERATE_TIMEOUT = _syncobj("_SyncObj__generateRaftTimeout", CLASS, ("self",))
ON_TICK = _syncobj("_onTick", CLASS, ("self", "timeToWait"))         # overridden
# The adaptive tick (adaptive_tick.py): the poller the tick thread waits in (wrapped), the pipe that
# wakes it (pysyncobj's own, present with appendEntriesUseBatch=False), the leader's next heartbeat,
# and the command queue's drain (overridden: it stops after appendEntriesPeriod, leaving work).
POLLER_ATTR = _syncobj("_poller")
PIPE_NOTIFIER_ATTR = _syncobj("_SyncObj__pipeNotifier")
NEXT_APPEND_ENTRIES_ATTR = _syncobj("_SyncObj__newAppendEntriesTime")  # monotonic() time of a leader's next append
# A leader's highest log index known stored on each follower (quiescence.py: none is catching up).
MATCH_INDEX_ATTR = _syncobj("_SyncObj__raftMatchIndex")
CHECK_COMMANDS = _syncobj("_checkCommandsToApply", CLASS, ("self",))
# A leader's last response from each follower (its leaderFallbackTimeout counts from it), moved on
# after a stall of the leader's own (stall_tolerance.py).
LAST_RESPONSE_ATTR = _syncobj("_SyncObj__lastResponseTime")
# A follower's acknowledgement of an append_entries (``next_node_idx``; overridden: idle_acks.py).
SEND_NEXT_NODE_IDX = _syncobj("_SyncObj__sendNextNodeIdx", CLASS, ("self", "node", "reset", "nextNodeIdx", "success"))
IS_LEADER = _syncobj("_isLeader", CLASS, ("self",))
GET_LEADER = _syncobj("_getLeader", CLASS, ("self",))
# The transport's connections (node -> TcpConnection), and when a connection last read or started
# connecting (RaftNode._expire_stuck_connects; moved on after a stall: stall_tolerance.py).
CONNECTIONS_ATTR = Internal("pysyncobj.transport", "_connections", INSTANCE, "TCPTransport")
LAST_READ_ATTR = Internal("pysyncobj.tcp_connection", "_TcpConnection__lastReadTime", INSTANCE, "TcpConnection")
# When the transport last dialed a peer, and whether this node is the one that dials it (the
# adaptive tick wakes for the next re-dial, at most every connectionRetryTime).
LAST_CONNECT_ATTEMPT_ATTR = Internal("pysyncobj.transport", "_lastConnectAttempt", INSTANCE, "TCPTransport")
# The poller's callback of each socket (wrapped: a connection's read event counts as a read before
# pysyncobj checks its silence; stall_tolerance.py).
SHOULD_CONNECT = Internal("pysyncobj.transport", "_shouldConnect", CLASS, "TCPTransport", ("self", "node"))
# The transport's callback when a peer's connection closes (SyncObj's own, chained: a follower
# whose leader's connection closed stands sooner; fast_election.py).
NODE_DISCONNECTED_CALLBACK_ATTR = Internal("pysyncobj.transport", "_onNodeDisconnectedCallback", INSTANCE, "Transport")

# The node's snapshot file: pysyncobj's Serializer, which a node with a data directory replaces as
# pysyncobj stores it (``SyncObjPrivates.adopt_serializer``) by one that syncs
# (``raft.durable_snapshot``), built with the same arguments, its state read and set as
# pysyncobj's own methods do (``SerializerPrivates``).
SERIALIZER_ATTR = _syncobj("_SyncObj__serializer")
SERIALIZER = Internal("pysyncobj.serializer", "Serializer")
SERIALIZER_INIT = Internal("pysyncobj.serializer", "__init__", CLASS, "Serializer",
                           ("self", "fileName", "transmissionBatchSize", "tryUseFork", "serializer", "deserializer",
                            "serializeChecker"))
SERIALIZE = Internal("pysyncobj.serializer", "serialize", CLASS, "Serializer", ("self", "data", "id"))
SET_TRANSMISSION_DATA = Internal("pysyncobj.serializer", "setTransmissionData", CLASS, "Serializer",
                                 ("self", "data"))
SERIALIZER_PID_ATTR = Internal("pysyncobj.serializer", "_Serializer__pid", INSTANCE, "Serializer")
SERIALIZER_ID_ATTR = Internal("pysyncobj.serializer", "_Serializer__currentID", INSTANCE, "Serializer")
SERIALIZER_INCOMING_ATTR = Internal("pysyncobj.serializer", "_Serializer__incomingTransmissionFile", INSTANCE,
                                    "Serializer")
SERIALIZER_INTERNALS = (SERIALIZER_ATTR, SERIALIZER, SERIALIZER_INIT, SERIALIZE, SET_TRANSMISSION_DATA,
                        SERIALIZER_PID_ATTR, SERIALIZER_ID_ATTR, SERIALIZER_INCOMING_ATTR)
JOURNAL_INTERFACE = tuple(Internal("pysyncobj.journal", name, CLASS, "FileJournal", params) for name, params in (
    ("add", ("self", "command", "idx", "term")),
    ("clear", ("self",)),
    ("deleteEntriesFrom", ("self", "entryFrom")),
    ("deleteEntriesTo", ("self", "entryTo")),
    ("__getitem__", ("self", "idx")),
    ("__len__", ("self",)),
    ("_destroy", ("self",)),
    ("flush", ("self",)),
    ("setCurrentTerm", ("self", "term", "votedForNodeId")),
    ("getCurrentTerm", ("self",)),
    ("getVotedForNodeId", ("self",)),
    ("onOneSecondTimer", ("self",)),
))

# The composed node (raft/host.py, raft/host_transport.py): a transport subclass passed as
# SyncObj's transportClass, whose send, incoming connections and disconnect callback are its own;
# the connections it re-types to compress per node (host_transport.CompactTcpConnection, whose
# send is pysyncobj's with another compressor: ``send_compressed``); pysyncobj's MemoryJournal,
# which a node with a data directory replaces as pysyncobj stores it (``SyncObjPrivates.adopt_journal``).
TCP_TRANSPORT = Internal("pysyncobj.transport", "TCPTransport")
TRANSPORT_SEND = Internal("pysyncobj.transport", "send", CLASS, "TCPTransport", ("self", "node", "message"))
TRANSPORT_ADD_NODE = Internal("pysyncobj.transport", "addNode", CLASS, "TCPTransport", ("self", "node"))
ON_NEW_INCOMING_CONNECTION = Internal("pysyncobj.transport", "_onNewIncomingConnection", CLASS, "TCPTransport",
                                      ("self", "conn"))
ON_NODE_DISCONNECTED = Internal("pysyncobj.transport", "_onNodeDisconnected", CLASS, "Transport", ("self", "node"))
CONNECTION_SEND = Internal("pysyncobj.tcp_connection", "send", CLASS, "TcpConnection", ("self", "message"))
WRITE_BUFFER_ATTR = Internal("pysyncobj.tcp_connection", "_TcpConnection__writeBuffer", INSTANCE, "TcpConnection")
TRY_SEND_BUFFER = Internal("pysyncobj.tcp_connection", "_TcpConnection__trySendBuffer", CLASS, "TcpConnection",
                           ("self",))
MEMORY_JOURNAL = Internal("pysyncobj.journal", "MemoryJournal")
HOST_INTERNALS = (TCP_TRANSPORT, TRANSPORT_SEND, TRANSPORT_ADD_NODE, ON_NEW_INCOMING_CONNECTION, ON_NODE_DISCONNECTED,
                  CONNECTION_SEND, WRITE_BUFFER_ATTR, TRY_SEND_BUFFER, MEMORY_JOURNAL)

INTERNALS: tuple[Internal, ...] = (
    Internal("pysyncobj.version", "VERSION"),
    RAFT_STATE_ATTR, VOTED_FOR_ATTR, TRANSPORT_ATTR, RAFT_LOG_ATTR, ELECTION_DEADLINE_ATTR,
    ON_MESSAGE_RECEIVED, LOG_TERM, LOG_INDEX, GENERATE_TIMEOUT, ON_TICK, IS_LEADER, GET_LEADER,
    POLLER_ATTR, PIPE_NOTIFIER_ATTR, NEXT_APPEND_ENTRIES_ATTR, MATCH_INDEX_ATTR, CHECK_COMMANDS, SEND_NEXT_NODE_IDX,
    LAST_RESPONSE_ATTR,
    # ReplicatedState's snapshot hooks (overridden).
    Internal("pysyncobj.syncobj", "_serialize", CLASS, "SyncObjConsumer", ("self",)),
    Internal("pysyncobj.syncobj", "_deserialize", CLASS, "SyncObjConsumer", ("self", "data")),
    CONNECTIONS_ATTR, LAST_READ_ATTR, LAST_CONNECT_ATTEMPT_ATTR, SHOULD_CONNECT,
    NODE_DISCONNECTED_CALLBACK_ATTR,
    Internal("pysyncobj.poller", "POLL_EVENT_TYPE"),
    Internal("pysyncobj.tcp_connection", "TcpConnection"),
    # Module-level names outside pysyncobj's public API (its package's __init__).
    Internal("pysyncobj.syncobj", "_RAFT_STATE"),
    Internal("pysyncobj.syncobj", "_COMMAND_TYPE"),
    Internal("pysyncobj.tcp_connection", "CONNECTION_STATE"),
    Internal("pysyncobj.monotonic", "monotonic"),
    Internal("pysyncobj.dns_resolver", "globalDnsResolver"),
    Internal("pysyncobj.node", "TCPNode"),
    Internal("pysyncobj.pickle", "dumps"),
    Internal("pysyncobj.pickle", "loads"),
    Internal("pysyncobj.pickle", "load"),
    Internal("pysyncobj.pickle", "dump"),
    # How pysyncobj derives the Fernet key from the cluster secret (message_cipher.py reads both formats).
    Internal("pysyncobj.encryptor", "SALT"),
    Internal("pysyncobj.encryptor", "getEncryptor"),
    # FileJournal's layout: a header (name, version, format, offset after the last record).
    Internal("pysyncobj.journal", "APP_NAME"),
    Internal("pysyncobj.journal", "APP_VERSION"),
    Internal("pysyncobj.journal", "NAME_SIZE"),
    Internal("pysyncobj.journal", "VERSION_SIZE"),
    Internal("pysyncobj.journal", "JOURNAL_FORMAT_VERSION"),
    Internal("pysyncobj.journal", "LAST_RECORD_OFFSET_OFFSET"),
    Internal("pysyncobj.journal", "FIRST_RECORD_OFFSET"),
    # The snapshot file a node with a data directory adopts (listed above).
    *SERIALIZER_INTERNALS,
    # The journal interface SyncObj calls, as FileJournal defines it (raft/durable_journal.py
    # implements the same methods; a changed signature here means a changed interface).
    *JOURNAL_INTERFACE,
    # The composed node's transport, connections and journal adoption (listed above).
    *HOST_INTERNALS,
)


def problems(import_module: Callable[[str], ModuleType] = importlib.import_module) -> tuple[str | None, list[str]]:
    """(the version pysyncobj says it is, or None; every entry of ``INTERNALS`` that is missing
    or changed, by label, and every module that does not import). ``import_module`` is
    replaceable for tests."""
    missing: list[str] = []
    modules: dict[str, ModuleType | None] = {}
    for entry in INTERNALS:
        if entry.module not in modules:
            try:
                modules[entry.module] = import_module(entry.module)
            except ImportError:
                modules[entry.module] = None
                missing.append(f"module {entry.module}")
        module = modules[entry.module]
        if module is not None and not _present(module, entry):
            missing.append(entry.label)
    version_module = modules.get("pysyncobj.version")
    version = getattr(version_module, "VERSION", None) if version_module is not None else None
    return (str(version) if version is not None else None), missing


def _present(module: ModuleType, entry: Internal) -> bool:
    if entry.kind == MODULE:
        return hasattr(module, entry.name)
    owner = getattr(module, entry.owner, None)
    if not inspect.isclass(owner):
        return False
    if entry.kind == INSTANCE:
        init = owner.__dict__.get("__init__")
        return inspect.isfunction(init) and entry.name in _stored_attributes(init)
    if not hasattr(owner, entry.name):
        return False
    if entry.params is None:
        return True
    try:
        params = tuple(inspect.signature(getattr(owner, entry.name)).parameters)
    except (TypeError, ValueError):
        return False
    return params == entry.params


_STORE_ATTR = dis.opmap["STORE_ATTR"]
_EXTENDED_ARG = dis.EXTENDED_ARG


def _stored_attributes(function: Any) -> frozenset[str]:
    """The attribute names ``function``'s own code assigns (``x.name = ...``): the names of its
    ``STORE_ATTR`` instructions. Read from the raw bytecode (two bytes per instruction, its
    argument widened by any ``EXTENDED_ARG`` before it; ``STORE_ATTR``'s indexes ``co_names``):
    ``dis.get_instructions`` gives the same set, but it builds an object per instruction, and on
    ``SyncObj.__init__`` that was a tenth of a second of every node's and command's start-up."""
    code = function.__code__
    found = _STORED.get(code)
    if found is None:
        raw, names, widened, stored = code.co_code, code.co_names, 0, set()
        for i in range(0, len(raw), 2):
            op, arg = raw[i], raw[i + 1] | widened
            widened = arg << 8 if op == _EXTENDED_ARG else 0
            if op == _STORE_ATTR:
                stored.add(names[arg])
        found = _STORED[code] = frozenset(stored)
    return found


_STORED: dict[Any, frozenset[str]] = {}


def message(version: str | None, missing: list[str]) -> str | None:
    """The one-line reason pysyncobj cannot be used, or None when it can."""
    if version == PINNED_VERSION and not missing:
        return None
    found = f"pysyncobj {version} is installed" if version is not None else "no pysyncobj with a version is installed"
    lacks = f"; missing: {', '.join(missing)}" if missing else ""
    return (f"lighthouse_cluster.raft needs pysyncobj=={PINNED_VERSION} (it uses that version's private "
            f"internals), but {found}{lacks}; run: pip install pysyncobj=={PINNED_VERSION}")


def check(import_module: Callable[[str], ModuleType] = importlib.import_module) -> None:
    """Raise ImportError (one line) unless pysyncobj is the pinned version with every name used."""
    reason = message(*problems(import_module))
    if reason is not None:
        raise ImportError(reason)


check()

# -- only past the check: the private module-level names, under this module's names -----------------

from pysyncobj import SyncObj
from pysyncobj import pickle as pso_pickle  # pysyncobj's pickle (journal, snapshot)
from pysyncobj.dns_resolver import globalDnsResolver
from pysyncobj.encryptor import SALT as ENCRYPTOR_SALT  # with ENCRYPTOR_ITERATIONS: getEncryptor's key
from pysyncobj.journal import APP_NAME as JOURNAL_APP_NAME
from pysyncobj.journal import APP_VERSION as JOURNAL_APP_VERSION
from pysyncobj.journal import FIRST_RECORD_OFFSET as JOURNAL_FIRST_RECORD_OFFSET
from pysyncobj.journal import JOURNAL_FORMAT_VERSION
from pysyncobj.journal import LAST_RECORD_OFFSET_OFFSET as JOURNAL_LAST_RECORD_OFFSET_OFFSET
from pysyncobj.journal import NAME_SIZE as JOURNAL_NAME_SIZE
from pysyncobj.journal import VERSION_SIZE as JOURNAL_VERSION_SIZE
from pysyncobj.monotonic import monotonic  # pysyncobj's clock (its deadlines)
from pysyncobj.node import TCPNode
from pysyncobj.poller import POLL_EVENT_TYPE
from pysyncobj.syncobj import _COMMAND_TYPE as COMMAND_TYPE  # REGULAR: a replicated call of ours
from pysyncobj.syncobj import _RAFT_STATE as RAFT_STATE  # FOLLOWER, CANDIDATE, LEADER
from pysyncobj.tcp_connection import CONNECTION_STATE, TcpConnection

# getEncryptor's PBKDF2 iterations (a literal there; tests/raft/test_message_cipher.py checks it).
ENCRYPTOR_ITERATIONS = 100_000

__all__ = [
    "COMMAND_TYPE", "CONNECTION_STATE", "ENCRYPTOR_ITERATIONS", "ENCRYPTOR_SALT", "INTERNALS", "JOURNAL_APP_NAME",
    "JOURNAL_APP_VERSION", "JOURNAL_FIRST_RECORD_OFFSET", "JOURNAL_FORMAT_VERSION", "JOURNAL_LAST_RECORD_OFFSET_OFFSET",
    "JOURNAL_NAME_SIZE", "JOURNAL_VERSION_SIZE", "PINNED_VERSION", "RAFT_STATE", "Internal", "StoragePath",
    "SyncObjPrivates", "TCPNode", "check", "connecting_since", "message", "monotonic", "problems", "pso_pickle",
    "SerializerPrivates", "resolve_host",
]


class StoragePath(str):
    """A file name in a ``SyncObjConf`` (``journalFile``, ``fullDumpFile``) that this project's
    storage handles (the host's journal and snapshot file), with ``sync``: whether it is fsynced (False only
    with ``--unsafe-no-fsync``). A ``str``, as pysyncobj expects (``os.path.isfile``, ``+ '.tmp'``):
    pysyncobj hands these two names, and only them, to the journal factory and to the snapshot's
    rename, so the name itself says which storage and which durability a node asked for, with no
    state outside the node's own conf."""

    sync: bool

    def __new__(cls, path: str, *, sync: bool = True) -> "StoragePath":
        self = super().__new__(cls, path)
        self.sync = sync
        return self


def _counting_arrival(callback: Any) -> Any:
    connection = getattr(callback, "__self__", None)
    if not isinstance(connection, TcpConnection):
        return callback
    readable = POLL_EVENT_TYPE.READ

    def on_event(descr: Any, event_mask: int) -> None:
        if event_mask & readable and connection.state == CONNECTION_STATE.CONNECTED:
            setattr(connection, LAST_READ_ATTR.name, monotonic())
        callback(descr, event_mask)

    return on_event


def resolve_host(host: str) -> str | None:
    """``host`` resolved through pysyncobj's DNS cache (``dnsCacheTime``), as pysyncobj dials."""
    return globalDnsResolver().resolve(host)


def connecting_since(connection: Any) -> float | None:
    """When a ``TcpConnection`` still connecting started to (pysyncobj's ``monotonic()``); None
    for one that is connected or disconnected."""
    if connection.state != CONNECTION_STATE.CONNECTING:
        return None
    return getattr(connection, LAST_READ_ATTR.name)


def _attr(entry: Internal, doc: str, *, writable: bool = False, owner: str = "SyncObj") -> property:
    """The private attribute ``entry`` of ``owner`` (SyncObj's by default) as a property (read-only
    unless ``writable``)."""
    if entry not in INTERNALS or entry.kind != INSTANCE or entry.owner != owner:
        raise TypeError(f"{entry.label} is not a checked {owner} attribute")
    name = entry.name

    def get(self: Any) -> Any:
        return getattr(self, name)

    def put(self: Any, value: Any) -> None:
        setattr(self, name, value)

    return property(get, put if writable else None, doc=doc)


def _method(entry: Internal) -> Callable[..., Any]:
    """SyncObj's private method ``entry``, unbound (pysyncobj's own, whatever a subclass overrides)."""
    if entry not in INTERNALS or entry.kind != CLASS or entry.owner != "SyncObj":
        raise TypeError(f"{entry.label} is not a checked SyncObj method")
    return getattr(SyncObj, entry.name)


class _AdoptOnStore:
    """A set-only descriptor: when pysyncobj stores the SyncObj attribute ``entry`` (in
    ``SyncObj.__init__``), the instance's method ``adopt`` gets the value and what it returns is
    stored instead, in the instance's ``__dict__`` (reads stay plain attribute reads: a descriptor
    without ``__get__`` does not shadow the instance's dict)."""

    def __init__(self, entry: Internal, adopt: str) -> None:
        if entry not in INTERNALS or entry.kind != INSTANCE or entry.owner != "SyncObj":
            raise TypeError(f"{entry.label} is not a checked SyncObj attribute")
        self.name = entry.name
        self.adopt = adopt

    def __set__(self, instance: Any, value: Any) -> None:
        instance.__dict__[self.name] = getattr(instance, self.adopt)(value)


class SerializerPrivates:
    """pysyncobj's ``Serializer``'s private state under ``pso_*`` names, mixed into the one
    subclass (``raft.durable_snapshot.DurableSnapshotFile(SerializerPrivates, Serializer)``), for
    the two methods it writes its own way, as pysyncobj's do."""

    __slots__ = ()

    pso_pid = _attr(SERIALIZER_PID_ATTR, "0: idle; -1: the last snapshot written, -2: it failed (without "
                    "useFork; checkSerializing reports and clears it).", writable=True, owner="Serializer")
    pso_current_id = _attr(SERIALIZER_ID_ATTR, "The id (log index) of the snapshot being written.", writable=True,
                           owner="Serializer")
    pso_incoming_file = _attr(SERIALIZER_INCOMING_ATTR, "The open temporary file of a snapshot being received, "
                              "or None.", owner="Serializer")


class SyncObjPrivates:
    """SyncObj's private state under ``pso_*`` names, mixed into the one ``SyncObj`` subclass
    (``RaftHost(SyncObjPrivates, SyncObj)``; not a subclass itself): ``on_raft_message``, called
    with every Raft message the node receives, and ``on_ack``, with every acknowledgement it
    sends (on the tick thread). pysyncobj's protected ``_onTick``, ``_isLeader`` and
    ``_getLeader`` are used as they are (listed in ``INTERNALS``).

    It also adopts three objects pysyncobj creates in ``SyncObj.__init__``, as it stores them,
    before anything uses them and before the tick thread starts: its journal (``adopt_journal``:
    pysyncobj's creation goes through the module-level ``createJournal``, which only a
    process-wide replacement could change), its snapshot file (``adopt_serializer``: pysyncobj
    renames a snapshot through a module-level ``atomicReplace``, likewise) and its poller
    (``adopt_poller``: the tick thread's wait, and every socket's registration). Each returns the
    object to use; by default the one pysyncobj made."""

    __slots__ = ()

    _SyncObj__raftLog = _AdoptOnStore(RAFT_LOG_ATTR, "adopt_journal")
    _SyncObj__serializer = _AdoptOnStore(SERIALIZER_ATTR, "adopt_serializer")
    _poller = _AdoptOnStore(POLLER_ATTR, "adopt_poller")

    def adopt_journal(self, journal: Any) -> Any:
        return journal

    def adopt_serializer(self, serializer: Any) -> Any:
        return serializer

    def adopt_poller(self, poller: Any) -> Any:
        return poller


    pso_state = _attr(RAFT_STATE_ATTR, "RAFT_STATE.FOLLOWER, CANDIDATE or LEADER.")
    pso_voted_for = _attr(VOTED_FOR_ATTR, "The node id this node voted for in its term, or None.", writable=True)
    pso_election_deadline = _attr(ELECTION_DEADLINE_ATTR,
                                  "``monotonic()`` time at which a follower starts an election.", writable=True)
    _pso_transport = _attr(TRANSPORT_ATTR, "The TCPTransport.")
    _pso_handle_message = _method(ON_MESSAGE_RECEIVED)
    _pso_log_term = _method(LOG_TERM)
    _pso_log_index = _method(LOG_INDEX)
    _pso_generate_timeout = _method(GENERATE_TIMEOUT)
    _pso_send_next_node_idx = _method(SEND_NEXT_NODE_IDX)

    @property
    def pso_connections(self) -> dict[Any, Any]:
        """The transport's connections: node -> ``TcpConnection`` (see ``connecting_since``)."""
        return getattr(self._pso_transport, CONNECTIONS_ATTR.name)

    def pso_next_append_entries(self) -> float:
        """``monotonic()`` time at which a leader sends its next append_entries (heartbeat). A
        method, not a property: SyncObj.__init__ reads every attribute (looking for replicated
        methods) before it sets this one."""
        return self.__dict__.get(NEXT_APPEND_ENTRIES_ATTR.name, 0.0)

    def pso_send_append_entries_now(self) -> None:
        """Make a leader send its next append_entries at its next tick."""
        setattr(self, NEXT_APPEND_ENTRIES_ATTR.name, 0.0)

    def pso_match_index(self, node: Any) -> int:
        """A leader's highest log index known stored on ``node`` (0 when unknown)."""
        return int(self.__dict__.get(MATCH_INDEX_ATTR.name, {}).get(node, 0))

    @property
    def pso_can_wake(self) -> bool:
        """Whether ``pso_wake`` can interrupt the tick thread's wait (pysyncobj creates its pipe only
        with ``appendEntriesUseBatch=False``)."""
        return PIPE_NOTIFIER_ATTR.name in self.__dict__

    def pso_wake(self) -> None:
        """Interrupt the tick thread's wait (its poll returns; it ticks again at once), from any
        thread. pysyncobj's own pipe, which ``_applyCommand`` writes to for the same purpose."""
        notifier = self.__dict__.get(PIPE_NOTIFIER_ATTR.name)
        if notifier is None:
            return
        try:
            notifier.notify()
        except BlockingIOError:
            pass  # the pipe is full of unread wake-ups: the tick thread wakes anyway

    def pso_redial_deadlines(self) -> list[float]:
        """``monotonic()`` times at which the transport re-dials a disconnected peer that this node
        dials (pysyncobj re-dials at most every ``connectionRetryTime``; a peer never dialed is due
        at once)."""
        transport = self._pso_transport
        attempts = getattr(transport, LAST_CONNECT_ATTEMPT_ATTR.name)
        should_connect = getattr(transport, SHOULD_CONNECT.name)
        retry = self.conf.connectionRetryTime
        return [attempts.get(node, float("-inf")) + retry for node, conn in list(self.pso_connections.items())
                if conn.state == CONNECTION_STATE.DISCONNECTED and should_connect(node)]

    def pso_excuse_stall(self, stall_s: float, now: float) -> None:
        """This node's tick thread did not run for ``stall_s``: its silence timers do not count
        that time against its peers. Every connection's last read (pysyncobj drops a link that
        read nothing for ``connectionTimeout``, and checks before it reads) and, on a leader, every
        follower's last response (``leaderFallbackTimeout``) move on by ``stall_s``, never past ``now``."""
        for connection in list(self.pso_connections.values()):
            last = getattr(connection, LAST_READ_ATTR.name)
            setattr(connection, LAST_READ_ATTR.name, min(now, last + stall_s))
        responses = self.__dict__.get(LAST_RESPONSE_ATTR.name, {})
        for node, last in list(responses.items()):
            responses[node] = min(now, last + stall_s)

    def pso_send(self, node: Any, message: Any) -> bool:
        """Send ``message`` to ``node`` on its Raft connection; False if not connected."""
        return bool(self._pso_transport.send(node, message))

    def pso_last_log(self) -> tuple[int, int]:
        """(term, index) of this node's last log entry."""
        return self._pso_log_term(), self._pso_log_index()

    def pso_election_timeout(self) -> float:
        """A random election timeout in [raftMinTimeout, raftMaxTimeout], as pysyncobj draws one."""
        return self._pso_generate_timeout()

    @property
    def pso_journal(self) -> Any:
        """pysyncobj's journal (``raft.durable_journal.DurableJournal`` for a node with a data
        directory: ``RaftHost.adopt_journal``)."""
        return getattr(self, RAFT_LOG_ATTR.name)

    def on_raft_message(self, node: Any, message: Any) -> None:
        """Every Raft message from ``node``, on the tick thread. Override; call
        ``pso_handle_message`` for pysyncobj's own handling."""
        self.pso_handle_message(node, message)

    def pso_handle_message(self, node: Any, message: Any) -> None:
        """pysyncobj's handling of a Raft message (votes, appends, responses)."""
        self._pso_handle_message(node, message)

    # pysyncobj hands every received message to ``self.__onMessageReceived``.
    def _SyncObj__onMessageReceived(self, node: Any, message: Any) -> None:
        self.on_raft_message(node, message)

    def on_ack(self, node: Any, reset: bool, next_index: int | None, success: bool) -> None:
        """Every acknowledgement this node sends a leader for its append_entries (pysyncobj's
        ``next_node_idx`` message: the index the leader should send next, None for "after my last
        entry"; ``success``: the entries matched; ``reset``: the leader must go back to
        ``next_index``), on the tick thread. Override; call ``pso_send_ack`` to send it."""
        self.pso_send_ack(node, reset, next_index, success)

    def pso_send_ack(self, node: Any, reset: bool, next_index: int | None, success: bool) -> None:
        """pysyncobj's sending of an acknowledgement (see ``on_ack``)."""
        self._pso_send_next_node_idx(node, reset=reset, nextNodeIdx=next_index, success=success)

    # pysyncobj sends every acknowledgement through ``self.__sendNextNodeIdx``.
    def _SyncObj__sendNextNodeIdx(self, node: Any, reset: bool = False, nextNodeIdx: int | None = None,  # noqa: N803
                                  success: bool = False) -> None:
        self.on_ack(node, reset, nextNodeIdx, success)



# -- the composed node (raft/host.py): message shapes, adoption at construction, per-node compression --

# The keys of pysyncobj's Raft messages that this project's extensions read or write (by message
# type). ``message_shape_problems`` checks at import that pysyncobj's own code writes or reads each
# of them: ``'type': '<type>'`` and every ``'<key>'`` appear in the source of syncobj.py.
MESSAGE_SHAPES: dict[str, tuple[str, ...]] = {
    "request_vote": ("term", "last_log_index", "last_log_term"),   # built by fast_election (handover, depose)
    "append_entries": ("term", "commit_index", "entries", "prevLogIdx", "prevLogTerm"),  # read and marked
    "next_node_idx": ("next_node_idx", "reset", "success"),        # acks: held back (idle_acks), marked
    "timeout_now": ("term",),                                      # read by fast_election (handover)
    "response_vote": ("term",),                                    # a vote (not read; listed as Raft's reply)
}


def message_shape_problems(source: str | None = None) -> list[str]:
    """Every ``type.key`` of ``MESSAGE_SHAPES`` that pysyncobj's syncobj.py (``source``; by default
    the installed one's) no longer names; empty when all are there."""
    if source is None:
        source = inspect.getsource(importlib.import_module("pysyncobj.syncobj"))
    missing = []
    for kind, keys in MESSAGE_SHAPES.items():
        if f"'type': '{kind}'" not in source and f"== '{kind}'" not in source:
            missing.append(kind)
        missing += [f"{kind}.{key}" for key in keys if f"'{key}'" not in source]
    return missing


def check_message_shapes(source: str | None = None) -> None:
    """Raise ImportError (one line) when pysyncobj's messages lack a key this project relies on."""
    missing = message_shape_problems(source)
    if missing:
        raise ImportError(f"lighthouse_cluster.raft needs pysyncobj=={PINNED_VERSION}: its Raft messages lack "
                          f"{', '.join(missing)}; run: pip install pysyncobj=={PINNED_VERSION}")


check_message_shapes()

from pysyncobj.journal import MemoryJournal  # noqa: E402 -- past the checks
from pysyncobj.serializer import Serializer  # noqa: E402 -- past the checks
from pysyncobj.transport import TCPTransport  # noqa: E402 -- past the checks


def send_compressed(connection: Any, message: Any, compress: Callable[[bytes], bytes]) -> None:
    """``TcpConnection.send(message)`` as pysyncobj does it (its random key, its Fernet or our
    cipher, the length prefix, the write buffer), with ``compress`` in place of
    ``zlib.compress(data, 3)``: one connection's compression, with nothing process-wide changed."""
    if connection.sendRandKey:
        message = (connection.sendRandKey, message)
    data = compress(pso_pickle.dumps(message))
    if connection.encryptor:
        data = connection.encryptor.encrypt_at_time(data, int(monotonic()))
    data = struct.pack("i", len(data)) + data
    setattr(connection, WRITE_BUFFER_ATTR.name, getattr(connection, WRITE_BUFFER_ATTR.name) + data)
    getattr(connection, TRY_SEND_BUFFER.name)()


def counting_arrivals(callback: Any) -> Any:
    """A poller callback that first counts a read event of a connected ``TcpConnection`` as a read
    any other callback as it is. pysyncobj checks a connection's silence (nothing read for
    ``connectionTimeout``) *before* it reads, so a node whose thread stalled past that timeout
    dropped the link on the very read that would have ended the silence. For the host's poller,
    which wraps each callback as it is subscribed (``extensions/stall_tolerance.py``)."""
    return _counting_arrival(callback)


__all__ += ["MESSAGE_SHAPES", "MemoryJournal", "Serializer", "TCPTransport", "check_message_shapes",
            "counting_arrivals", "message_shape_problems", "send_compressed"]
