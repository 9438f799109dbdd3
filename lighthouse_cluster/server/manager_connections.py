"""The leader's connections to the manager servers of the running quorum: a torchft trainer's
death learnt from its closed socket.

An unchanged torchft trainer has no liveness stream: the lighthouse knows it only through unary
heartbeats, so a SIGKILLed replica group stays healthy for the quorum rules until its heartbeat is
``--heartbeat_timeout_ms`` old (5 s by default), and its peers, whose allreduce failed at once,
wait that long for the next quorum. But every member of a quorum names its manager server (the
``address`` of its ``QuorumMember``, the gRPC server its peers heal through). The serving leader
opens one plain HTTP/2 connection to each member's manager server, sends nothing on it, and
watches it (gRPC channel connectivity):

* when a connection that was up goes down and the manager server refuses a new one (the process
  is gone: the kernel closed its sockets and nothing listens on the port), or is not back within
  ``grace_s``, the replica is declared dead: unhealthy for the quorum rules at once, exactly as if
  its heartbeat had gone stale; the pending quorum is evaluated now;
* a member whose manager server cannot be reached at all (another network, a placeholder
  address: the first dial is refused, or not up within ``CONNECT_TIMEOUT_S``) is never declared
  anything: it keeps torchft's heartbeat timeout;
* members with an open liveness stream (ftclient) are not watched: the stream says more.

What torchft trainers see does not change: no RPC is sent to them, their heartbeats and Quorum
calls are answered as before; a replica that is in fact alive (its manager server restarted in
place) is alive again with its next heartbeat (``QuorumCoordinator.declare_dead``). A host that
is cut off closes nothing, so it still costs the heartbeat timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from functools import lru_cache
from typing import Callable, Protocol
from urllib.parse import urlsplit

import grpc

log = logging.getLogger(__name__)

# How often the serving leader reconciles the watched set with the running quorum.
CHECK_PERIOD_S = 0.05
# The same members (the same running quorum) are looked at again this often only, for members
# whose liveness stream opened or closed since: the 50 ms check then costs nothing per member.
FULL_CHECK_PERIOD_S = 1.0
# With nothing to watch (not the serving leader, or no running quorum) the check waits for
# ``wake()`` (a new term served, a quorum issued, a leadership change), and runs at least this often.
IDLE_CHECK_PERIOD_S = 1.0
# A first connection that is not up within this long is given up (the member keeps the
# heartbeat timeout): the address is not reachable from here.
CONNECT_TIMEOUT_S = 5.0
# At most this many new watches (channels, dials) per check: a new leader of 2048 members opened
# them all in one pass of the event loop (a ~250 ms stall, just as its first answers go out); the
# rest follow at the next checks (2048 in ~0.8 s).
MAX_NEW_WATCHES_PER_CHECK = 128
# At most this many first dials in flight: a dial not yet settled keeps gRPC reconnecting every
# 50-200 ms, and while the event loop is too busy to see its answer (a new leader of thousands of
# members) each such channel held ~7 file descriptors. Uncapped, a new leader of 4096 members went
# from 2,000 to 20,000 descriptors in 8 s, and then Raft could open neither a socket nor its
# journal (docs/design/new-leader-large-quorum.md). Watches whose connection is up hold one socket
# each.
MAX_DIALS_IN_FLIGHT = 128
# No traffic is ever sent: the channel must not close itself for being idle.
CHANNEL_OPTIONS = [
    ("grpc.client_idle_timeout_ms", 2**31 - 1),
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 200),
    ("grpc.enable_retries", 0),
]
LOST = "manager connection lost"


@lru_cache(maxsize=4096)
def manager_target(address: str) -> str | None:
    """The ``host:port`` to dial for a member's manager address (``http://host:port``, as torchft
    and ftclient advertise it), or None when it is not a plaintext gRPC address."""
    try:
        url = urlsplit(address if "://" in address else f"http://{address}")
        port = url.port
    except ValueError:
        return None
    if url.scheme != "http" or not url.hostname or port is None or url.path not in ("", "/"):
        return None
    host = f"[{url.hostname}]" if ":" in url.hostname else url.hostname
    return f"{host}:{port}"


class QuorumMembers(Protocol):
    def running_members(self) -> dict[str, str] | None:
        """The running quorum's members (replica id -> manager address) while this node serves
        as leader, else None."""


class ManagerConnections:
    """See the module docstring. ``declare(replica_id, reason)`` declares a death (the liveness
    streams' ``declare_dead``); ``has_stream(replica_id)`` says whether it has a liveness stream."""

    def __init__(self, members: QuorumMembers, declare: Callable[[str, str], None],
                 has_stream: Callable[[str], bool], grace_s: float, *,
                 check_period_s: float = CHECK_PERIOD_S, connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        self._members = members
        self._declare = declare
        self._has_stream = has_stream
        self._grace_s = grace_s
        self._check_period_s = check_period_s
        self._connect_timeout_s = connect_timeout_s
        self._watches: dict[str, tuple[str, asyncio.Task[None]]] = {}  # replica id -> (target, task)
        self._settled: dict[str, str] = {}  # replica id -> target: given up on, or declared dead
        self._task: asyncio.Task[None] | None = None
        self._checked: tuple[dict[str, str] | None, float] = (None, float("-inf"))  # members, when
        self._idle = True  # the last check found nothing to watch
        self._wake = asyncio.Event()
        self.connected = 0  # watches whose connection is up
        self._dialing: set[asyncio.Task[None]] = set()  # watches whose first dial is not answered yet
        self.declared = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._close_all()

    @property
    def watched(self) -> int:
        return len(self._watches)

    @property
    def dialing(self) -> int:
        """Watches whose first dial has not been answered yet (at most ``MAX_DIALS_IN_FLIGHT``)."""
        return len(self._dialing)

    def _close_all(self) -> None:
        for _, task in self._watches.values():
            task.cancel()
        self._watches.clear()
        self._settled.clear()
        self._checked = (None, float("-inf"))

    def wake(self) -> None:
        """The running quorum or this node's leadership may have changed: check now (on the loop)."""
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            if self._idle:
                try:
                    await asyncio.wait_for(self._wake.wait(), IDLE_CHECK_PERIOD_S)
                except asyncio.TimeoutError:
                    pass
            # Woken or not, one check period before the check, as when it ran every period: a
            # wake-up comes with a new term's first round or a quorum just issued, and opening
            # every member's channel then would hold up the answers that are going out.
            await asyncio.sleep(self._check_period_s)
            self._wake.clear()
            try:
                self.reconcile()
            except Exception:  # noqa: BLE001 -- the watch must keep running
                log.exception("manager connection watch failed")

    def reconcile(self) -> None:
        """Watch every member of the running quorum without a liveness stream; stop watching the
        others. Nothing is watched while this node does not serve as leader."""
        members = self._members.running_members()
        self._idle = not members
        if members is None:
            self._close_all()
            return
        now = time.monotonic()
        if members is self._checked[0] and now - self._checked[1] < FULL_CHECK_PERIOD_S:
            return
        self._checked = (members, now)
        wanted = {}
        for rid, address in members.items():
            target = manager_target(address)
            if target is not None and not self._has_stream(rid) and self._settled.get(rid) != target:
                wanted[rid] = target
        for rid in [r for r, (target, _) in self._watches.items() if wanted.get(r) != target]:
            self._watches.pop(rid)[1].cancel()
        self._settled = {r: t for r, t in self._settled.items() if r in members}
        room = min(MAX_NEW_WATCHES_PER_CHECK, MAX_DIALS_IN_FLIGHT - self.dialing)
        for rid, target in wanted.items():
            if rid not in self._watches:
                if room <= 0:
                    self._checked = (None, float("-inf"))  # the rest at the next check
                    break
                task = asyncio.get_running_loop().create_task(self._watch(rid, target))
                self._dialing.add(task)  # until its first dial is answered, or it ends (even unstarted)
                task.add_done_callback(self._dialing.discard)
                self._watches[rid] = (target, task)
                room -= 1

    async def _watch(self, rid: str, target: str) -> None:
        channel: grpc.aio.Channel | None = None
        up = False
        try:
            channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
            # A first dial that is refused (TRANSIENT_FAILURE) settles the member at once, as one
            # that is not up within the connect timeout does: redialing every 50-200 ms until then
            # cost 2048 members ~7 s of CPU in a new leader's first 5 s
            # (docs/design/new-leader-large-quorum.md).
            reached = await self._until(channel, {grpc.ChannelConnectivity.READY,
                                                  grpc.ChannelConnectivity.TRANSIENT_FAILURE}, self._connect_timeout_s)
            self._dialing.discard(asyncio.current_task())  # type: ignore[arg-type]
            if not reached or channel.get_state() is not grpc.ChannelConnectivity.READY:
                log.debug("manager server of %s at %s not reachable: heartbeat timeout only", rid, target)
                self._settle(rid, target)
                return
            up = True
            self.connected += 1
            state = grpc.ChannelConnectivity.READY
            while True:
                await channel.wait_for_state_change(state)
                state = channel.get_state(try_to_connect=True)
                if state is grpc.ChannelConnectivity.READY:
                    continue
                lost_at = time.monotonic()
                back = await self._until(channel, {grpc.ChannelConnectivity.READY,
                                                   grpc.ChannelConnectivity.TRANSIENT_FAILURE}, self._grace_s)
                state = channel.get_state(try_to_connect=True)
                if back and state is grpc.ChannelConnectivity.READY:
                    continue
                why = ("refused" if state is grpc.ChannelConnectivity.TRANSIENT_FAILURE
                       else f"not back within {self._grace_s * 1000:.0f} ms")
                self._settle(rid, target)
                self.declared += 1
                log.info("replica %s: its manager server %s closed its connection and a new one was %s "
                         "(%.0f ms): declared dead", rid, target, why, (time.monotonic() - lost_at) * 1000)
                self._declare(rid, f"{LOST}: {why}")
                return
        finally:
            if up:
                self.connected -= 1
            if channel is not None:
                await channel.close()

    def _settle(self, rid: str, target: str) -> None:
        self._settled[rid] = target
        current = self._watches.get(rid)
        if current is not None and current[0] == target:
            del self._watches[rid]

    @staticmethod
    async def _until(channel: grpc.aio.Channel, states: set[grpc.ChannelConnectivity], timeout: float) -> bool:
        """Until the channel is in one of ``states`` (True) or ``timeout`` seconds passed (False);
        keeps asking it to connect."""
        deadline = time.monotonic() + timeout
        state = channel.get_state(try_to_connect=True)
        while state not in states:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(channel.wait_for_state_change(state), left)
            except asyncio.TimeoutError:
                return False
            state = channel.get_state(try_to_connect=True)
        return True
