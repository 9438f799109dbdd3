"""Variant C's front end: ``RemoteRaftNode``, what ``LighthouseNode`` sees in place of ``RaftNode``.

Same constructor and the calls the node, its coordinator, router, metrics and status make
(submit, probe_leadership, stream_lease_confirmations, note_client_activity, role, term,
led_term, leader_address, indexes, is_connected, vote_refusal_s, counters). It starts the Raft
process (``raft_proc.py``) on one end of a socketpair; a reader thread here takes the Raft
process's messages in order and does what pysyncobj's tick thread does in today's node: applies
each committed command to the node's own ``QuorumStateMachine`` (a mirror of the Raft process's)
and calls ``on_apply``, settles submits and probes, reports lease confirmations, and calls
``on_view_changed`` / ``on_state_changed`` when a pushed view changed. Reads come from the last
view pushed (at most a socket hop old; nothing of the lease depends on them: a submit's
``while_leader_of`` and every confirmation are checked in the Raft process, and confirmations
carry their own time).

Left out (not needed for the rounds and failover measurements): membership changes, leadership
transfer, ``call_on_tick_thread`` (admin), ``raft_members``.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.raft_process import channel as ch
from benchmarks.raft_process.raft_proc import SECRET_ENV
from lighthouse_cluster.core import codec
from lighthouse_cluster.raft.replication import CommitError, RaftSettings, ReplicatedState, Role

log = logging.getLogger(__name__)

# Set by variant.py before the node starts.
RAFT_NICE = 0
STALL_TOLERANCE = True

_ROLES = {r.value: r for r in Role}


class RemoteRaftNode:
    def __init__(self, self_address: str, peer_addresses: list[str], state: ReplicatedState, *,
                 bind_address: str | None = None, data_dir: Path | None = None, secret: str | None = None,
                 settings: RaftSettings = RaftSettings(), on_state_changed: Callable[[Role, Role], None] | None = None,
                 dial: Mapping[str, str] | None = None, hold_elections_until_leader: bool = False,
                 on_view_changed: Callable[[], None] | None = None, fsync: bool = True) -> None:
        self.self_address = self_address
        self.state = state
        self.fsync = fsync
        self._on_state_changed = on_state_changed
        self._on_view_changed = on_view_changed
        self._view: dict[str, Any] = {"role": "follower", "term": 0, "led_term": None, "leader": None,
                                      "connected": [], "commit_index": 0, "last_applied": 0, "ready": False,
                                      "quiet": False, "stalls": 0, "patience_s": 0.0, "vote_refusal_s": 0.0,
                                      "handover_term": None, "journal_syncs": [0, 0, 0.0], "encrypted": {}}
        self._connected: frozenset[str] = frozenset()
        self._ids = itertools.count(1)
        self._waiting: dict[int, Callable[..., None]] = {}
        self._probes: dict[int, Callable[[bool], None]] = {}
        self._on_confirmed: Callable[[float], None] | None = None
        self._last_result: Any = None
        self._activity_at = 0.0
        self._send_lock = threading.Lock()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock = ours
        cfg = {"parent": os.getpid(), "self_address": self_address, "peers": list(peer_addresses),
               "bind_address": bind_address, "data_dir": str(data_dir) if data_dir is not None else None,
               "settings": asdict(settings), "dial": dict(dial or {}), "hold": hold_elections_until_leader,
               "fsync": fsync, "schema_version": state.machine.schema_version, "nice": RAFT_NICE,
               "stall_tolerance": STALL_TOLERANCE}
        env = {**os.environ, SECRET_ENV: secret or ""}
        checkout = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join([checkout] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.raft_process.raft_proc", str(theirs.fileno()), json.dumps(cfg)],
            pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self._reader = threading.Thread(target=self._read, name="raft-channel", daemon=True)
        self._reader.start()

    # -- the channel --------------------------------------------------------------------------------

    def _send(self, message: list[Any]) -> None:
        frame = ch.encode(message)
        with self._send_lock:
            self._sock.sendall(frame)

    def _read(self) -> None:
        reader = ch.FrameReader()
        machine = self.state.machine
        while True:
            try:
                data = self._sock.recv(1 << 20)
            except OSError:
                data = b""
            if not data:
                log.error("the Raft process is gone: exiting")
                os._exit(3)
            for m in reader.feed(data):
                kind = m[0]
                if kind == ch.APPLIED:
                    try:
                        self._last_result = machine.apply_bytes(m[1])
                    except codec.SchemaError:
                        self._last_result = None
                        continue
                    if self.state.on_apply is not None:
                        self.state.on_apply(self._last_result)
                elif kind == ch.DONE:
                    callback = self._waiting.pop(m[1], None)
                    if callback is not None:
                        if m[2] is None:
                            callback(self._last_result, None)
                        else:
                            callback(None, CommitError(m[2], bool(m[3])))
                elif kind == ch.VIEW:
                    self._take_view(m[1])
                elif kind == ch.CONFIRMED:
                    on_confirmed = self._on_confirmed
                    if on_confirmed is not None:
                        on_confirmed(m[1])
                elif kind == ch.PROBED:
                    probe = self._probes.pop(m[1], None)
                    if probe is not None:
                        probe(bool(m[2]))
                elif kind == ch.RESTORED:
                    machine.restore_snapshot(m[1])

    def _take_view(self, view: dict[str, Any]) -> None:
        old = self._view
        self._view = view
        self._connected = frozenset(view["connected"] or ())
        if old["role"] != view["role"] and self._on_state_changed is not None:
            self._on_state_changed(_ROLES[old["role"]], _ROLES[view["role"]])
        if self._on_view_changed is not None and any(
                old[k] != view[k] for k in ("role", "term", "led_term", "leader", "connected")):
            self._on_view_changed()

    # -- writes -------------------------------------------------------------------------------------

    def submit(self, command: codec.Command, callback: Callable[[Any, CommitError | None], None], *,
               while_leader_of: int | None = None) -> None:
        payload = codec.encode_command(command, version=self.state.machine.schema_version)
        rid = next(self._ids)
        self._waiting[rid] = callback
        self._send([ch.SUBMIT, rid, payload, while_leader_of])

    def probe_leadership(self, term: int, callback: Callable[[bool], None]) -> None:
        rid = next(self._ids)
        self._probes[rid] = callback
        self._send([ch.PROBE, rid, term])

    def stream_lease_confirmations(self, term: int, on_confirmed: Callable[[float], None] | None) -> None:
        self._on_confirmed = on_confirmed
        self._send([ch.STREAM, term, on_confirmed is not None])

    def note_client_activity(self) -> None:
        now = time.monotonic()
        if now - self._activity_at >= ch.ACTIVITY_EVERY_S:
            self._activity_at = now
            self._send([ch.ACTIVITY])

    def transfer_leadership(self, address: str | None = None,
                            callback: Callable[[str | None], None] | None = None) -> None:
        if callback is not None:
            callback("not in the split prototype")

    def destroy(self) -> None:
        try:
            self._send([ch.STOP])
        except OSError:
            pass
        try:
            self.process.wait(timeout=3)
        except subprocess.TimeoutExpired:
            self.process.kill()

    # -- reads (the last view pushed) ----------------------------------------------------------------

    @property
    def role(self) -> Role:
        return _ROLES[self._view["role"]]

    @property
    def is_leader(self) -> bool:
        return self._view["role"] == "leader"

    @property
    def led_term(self) -> int | None:
        return self._view["led_term"] if self._view["role"] == "leader" else None

    @property
    def leader_address(self) -> str | None:
        return self._view["leader"]

    @property
    def term(self) -> int:
        return self._view["term"]

    @property
    def commit_index(self) -> int:
        return self._view["commit_index"]

    @property
    def last_applied(self) -> int:
        return self._view["last_applied"]

    @property
    def is_ready(self) -> bool:
        return bool(self._view["ready"])

    def is_connected(self, address: str) -> bool:
        return address in self._connected

    def vote_refusal_s(self, term: int) -> float:
        view = self._view
        return 0.0 if view["handover_term"] == term else float(view["vote_refusal_s"] or 0.0)

    @property
    def quiet(self) -> bool:
        return bool(self._view["quiet"])

    @property
    def tick_stalls(self) -> int:
        return int(self._view["stalls"] or 0)

    @property
    def election_patience_s(self) -> float:
        return float(self._view["patience_s"] or 0.0)

    @property
    def journal_syncs(self) -> tuple[int, int, float]:
        s = self._view["journal_syncs"] or [0, 0, 0.0]
        return int(s[0]), int(s[1]), float(s[2])

    @property
    def messages_encrypted(self) -> dict[str, int]:
        return dict(self._view["encrypted"] or {})
