"""Variant C's Raft process: ``RaftNode`` and the ``QuorumStateMachine``, driven over the channel.

Started by ``remote.RemoteRaftNode`` as ``python -m benchmarks.raft_process.raft_proc FD CONFIG``
with one end of a socketpair as ``FD`` and its settings as JSON (the secret in the environment).
Everything pysyncobj calls back (applies, submit results, probe results, lease confirmations,
view changes) happens on its tick thread, which writes the frame at once (one lock, one
``sendall``); the main thread reads the front end's requests and hands them to ``RaftNode``.
It dies with its front end (``PR_SET_PDEATHSIG``) and exits when the channel closes.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.raft_process import channel as ch

log = logging.getLogger("raft_proc")

SECRET_ENV = "RAFT_PROC_SECRET"
VIEW_EVERY_S = 0.02  # indexes and counters are pushed at most this often between view changes


def die_with_parent(parent: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(0)


class Sender:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()

    def __call__(self, message: list[Any]) -> None:
        frame = ch.encode(message)
        with self.lock:
            try:
                self.sock.sendall(frame)
            except OSError:
                os._exit(0)  # the front end is gone


class TappedMachine:
    """The state machine, telling the front end every command applied and snapshot restored."""

    def __init__(self, machine: Any, send: Sender) -> None:
        self._machine = machine
        self._send = send

    def apply_bytes(self, payload: bytes) -> Any:
        self._send([ch.APPLIED, payload])
        return self._machine.apply_bytes(payload)

    def restore_snapshot(self, data: Any) -> None:
        self._machine.restore_snapshot(data)
        self._send([ch.RESTORED, data])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._machine, name)


def view_of(raft: Any) -> dict[str, Any]:
    syncobj = raft._syncobj
    return {
        "role": raft.role.value, "term": raft.term, "led_term": raft.led_term, "leader": raft.leader_address,
        "connected": sorted(n.address for n in syncobj.otherNodes if syncobj.isNodeConnected(n)),
        "commit_index": raft.commit_index, "last_applied": raft.last_applied, "ready": raft.is_ready,
        "quiet": raft.quiet, "stalls": raft.tick_stalls, "patience_s": raft.election_patience_s,
        "vote_refusal_s": syncobj.vote_refusal_s, "handover_term": syncobj.handover_term,
        "journal_syncs": list(raft.journal_syncs), "encrypted": raft.messages_encrypted,
    }


def submit_payload(raft: Any, payload: bytes, while_leader_of: int | None, done: Any) -> None:
    """``RaftNode.submit`` for an already encoded command; ``done(error, unknown)``."""
    from pysyncobj import FAIL_REASON

    from lighthouse_cluster.raft.pysyncobj_internals import monotonic
    from lighthouse_cluster.raft.replication import _FAIL_NAMES

    if raft._handing_over_until > monotonic() and raft.is_leader:
        done("leadership transfer in progress", False)
        return

    def settled(_result: Any, err: int) -> None:
        if err == FAIL_REASON.SUCCESS:
            if while_leader_of is not None and raft.led_term != while_leader_of:
                done(f"applied after this node stopped leading term {while_leader_of}", False)
            else:
                done(None, False)
            return
        unknown = err not in (FAIL_REASON.QUEUE_FULL, FAIL_REASON.MISSING_LEADER,
                              FAIL_REASON.NOT_LEADER, FAIL_REASON.REQUEST_DENIED)
        done(_FAIL_NAMES.get(err, str(err)), unknown)

    raft.state.apply_command(payload, callback=settled)


def main() -> None:
    fd, cfg = int(sys.argv[1]), json.loads(sys.argv[2])
    die_with_parent(cfg["parent"])
    if cfg.get("nice"):
        os.setpriority(os.PRIO_PROCESS, 0, int(cfg["nice"]))  # before any thread: they inherit it
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s raft[{cfg['self_address']}] %(levelname)s "
                                                    "%(name)s: %(message)s")
    from benchmarks.raft_process import tweaks

    if not cfg.get("stall_tolerance", True):
        tweaks.stall_tolerance_off()
    from lighthouse_cluster.core.state_machine import QuorumStateMachine
    from lighthouse_cluster.raft.replication import RaftNode, RaftSettings, ReplicatedState
    from lighthouse_cluster.server.gc_thresholds import use_serving_thresholds

    use_serving_thresholds()  # as the node does
    sock = socket.socket(fileno=fd)
    send = Sender(sock)
    machine = TappedMachine(QuorumStateMachine(cfg["schema_version"]), send)
    raft_box: list[Any] = []
    last = {"view": None, "at": 0.0}

    def push_view() -> None:
        if raft_box:
            view = view_of(raft_box[0])
            last["view"], last["at"] = view, time.monotonic()
            send(ch.view_message(view))

    def maybe_push() -> None:
        if not raft_box or time.monotonic() - last["at"] < VIEW_EVERY_S:
            return
        view = view_of(raft_box[0])
        if view != last["view"]:
            last["view"], last["at"] = view, time.monotonic()
            send(ch.view_message(view))

    raft = RaftNode(cfg["self_address"], cfg["peers"], ReplicatedState(machine),  # type: ignore[arg-type]
                    bind_address=cfg["bind_address"],
                    data_dir=Path(cfg["data_dir"]) if cfg["data_dir"] else None,
                    secret=os.environ.get(SECRET_ENV) or None, settings=RaftSettings(**cfg["settings"]),
                    on_state_changed=lambda _old, _new: push_view(), dial=cfg["dial"] or None,
                    hold_elections_until_leader=cfg["hold"], on_view_changed=push_view, fsync=cfg["fsync"])
    raft_box.append(raft)
    tweaks.on_tick_thread_once(raft._syncobj)
    raft._syncobj.addOnTickCallback(maybe_push)
    push_view()

    reader = ch.FrameReader()
    while True:
        data = sock.recv(1 << 20)
        if not data:
            break
        for m in reader.feed(data):
            kind = m[0]
            if kind == ch.SUBMIT:
                rid = m[1]
                submit_payload(raft, m[2], m[3], lambda error, unknown, rid=rid: send([ch.DONE, rid, error, unknown]))
            elif kind == ch.PROBE:
                rid = m[1]
                raft.probe_leadership(m[2], lambda ok, rid=rid: send([ch.PROBED, rid, bool(ok)]))
            elif kind == ch.STREAM:
                raft.stream_lease_confirmations(m[1], (lambda t: send([ch.CONFIRMED, t])) if m[2] else None)
            elif kind == ch.ACTIVITY:
                raft.note_client_activity()
            elif kind == ch.STOP:
                raft.destroy()
                os._exit(0)
    os._exit(0)


if __name__ == "__main__":
    main()
