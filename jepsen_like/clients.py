"""Clients: simulated replica groups doing quorum rounds and heartbeats, every call recorded.

Each client is one torchft replica group (replica id ``c0``, ``c1``, ...), a
``lighthouse_cluster.local.simulated_group.SimulatedReplicaGroup`` (a heartbeat every 100 ms
and one Quorum call per step with a deadline; the definition of that traffic and of what a
failed call means lives there). This module adds what the harness needs on top: the history.
Client ``k`` starts on node ``k mod n``; even clients stay on their node unless a call certainly
did not reach it (connection refused: a killed node; they move on, like a client with the
endpoint list), odd clients also move on after any failed call (a client that load-balances).
Every call is an ``invoke`` followed by ``ok``, ``fail`` (the call never reached a node:
connection refused, invalid argument) or ``info`` (unknown: a timed-out Quorum call may still
have been committed; also a call cut short when the clients stop).

All clients run on one asyncio event loop in a background thread (``ClientPool``).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any, Callable

from lighthouse_cluster.local.simulated_group import (
    FAILED, OK as ANSWERED, ON_ANY_ERROR, ON_NOT_SENT, HeartbeatResult, RoundResult, SimulatedReplicaGroup,
)

from .history import FAIL, INFO, INVOKE, OK, HistoryWriter


@dataclass
class ClientSettings:
    clients: int = 4
    quorum_timeout_s: float = 2.0
    heartbeat_interval_s: float = 0.1
    heartbeat_timeout_s: float = 1.0
    step_time_s: float = 0.05
    retry_sleep_s: float = 0.05


def completion_type(outcome: str) -> str:
    """The history's completion type for a simulated group's outcome."""
    return OK if outcome == ANSWERED else FAIL if outcome == FAILED else INFO


def error_text(error: str, details: str) -> str:
    return f"{error}: {details[:120]}"


class Client:
    """One simulated replica group whose every call goes into the history."""

    def __init__(self, replica_id: str, endpoints: list[str], node_ids: list[str], start: int, roaming: bool,
                 settings: ClientSettings, history: HistoryWriter) -> None:
        self.history = history
        self._node_of = dict(zip(endpoints, node_ids))
        # The invocation of each call kind ("quorum", "heartbeat") still waiting for its
        # completion: (node, value). What is left when the client stops is completed as ``info``.
        self._open: dict[str, tuple[str, Any]] = {}
        self.group = SimulatedReplicaGroup(
            replica_id, endpoints[start % len(endpoints)], quorum_timeout_s=settings.quorum_timeout_s,
            heartbeat_interval_s=settings.heartbeat_interval_s, heartbeat_timeout_s=settings.heartbeat_timeout_s,
            step_time_s=settings.step_time_s, retry_sleep_s=settings.retry_sleep_s,
            fallback_endpoints=tuple(endpoints), move_on=ON_ANY_ERROR if roaming else ON_NOT_SENT,
            on_send=self._sent, on_round=self._round_done, on_heartbeat=self._heartbeat_done, keep_rounds=False)

    @property
    def replica_id(self) -> str:
        return self.group.replica_id

    @property
    def node(self) -> str:
        """The node it talks to now (``n1`` ...)."""
        return self._node_of[self.group.endpoint]

    @property
    def step(self) -> int:
        return self.group.step

    def _sent(self, f: str, endpoint: str) -> None:
        node = self._node_of[endpoint]
        value = {"step": self.group.step} if f == "quorum" else None
        self._open[f] = (node, value)
        self.history.append(self.replica_id, INVOKE, f, value, node)

    def _round_done(self, r: RoundResult) -> None:
        node, value = self._open.pop("quorum")
        if r.outcome == ANSWERED:
            self.history.append(self.replica_id, OK, "quorum",
                                {"quorum_id": r.quorum_id, "participants": list(r.participants), "step": r.step}, node)
        else:
            self.history.append(self.replica_id, completion_type(r.outcome), "quorum", value, node,
                                error_text(r.error, r.details))

    def _heartbeat_done(self, h: HeartbeatResult) -> None:
        node, _ = self._open.pop("heartbeat")
        self.history.append(self.replica_id, completion_type(h.outcome), "heartbeat", None, node,
                            None if h.outcome == ANSWERED else error_text(h.error, h.details))

    async def close(self) -> None:
        await self.group.close()

    async def run(self, stop: Callable[[], bool]) -> None:
        try:
            await self.group.run(until=stop)
        finally:
            for f, (node, value) in list(self._open.items()):
                self.history.append(self.replica_id, INFO, f, value, node, "cancelled at shutdown")
            self._open.clear()
            await self.close()


class ClientPool:
    """Runs every client on one event loop thread until ``stop()``."""

    def __init__(self, endpoints: list[str], node_ids: list[str], history: HistoryWriter,
                 settings: ClientSettings | None = None) -> None:
        self.settings = settings or ClientSettings()
        self.clients = [Client(f"c{k}", endpoints, node_ids, start=k, roaming=bool(k % 2), settings=self.settings,
                               history=history) for k in range(self.settings.clients)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="jepsen-clients", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> "ClientPool":
        self._thread.start()
        return self

    def _main(self) -> None:
        async def main() -> None:
            await asyncio.gather(*(c.run(self._stop.is_set) for c in self.clients))
        try:
            asyncio.run(main())
        except BaseException as e:  # reported by stop()
            self.error = e

    def stop(self) -> None:
        """Stop and wait (bounded by one quorum deadline and a margin)."""
        self._stop.set()
        self._thread.join(self.settings.quorum_timeout_s + 10.0)
        if self._thread.is_alive():
            raise RuntimeError("clients did not stop in time")
        if self.error is not None:
            raise RuntimeError(f"client loop crashed: {self.error!r}") from self.error

    @property
    def replica_ids(self) -> list[str]:
        return [c.replica_id for c in self.clients]
