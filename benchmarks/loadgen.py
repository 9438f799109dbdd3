"""Load generator: N simulated replica groups in k worker processes, each with its own asyncio loop.

Each group does what a torchft manager server does to the lighthouse: a ``Heartbeat`` every
100 ms (the next one 100 ms after the previous one returned, as torchft's heartbeat loop does;
torchft sets no deadline on it, we set 30 s)
and one ``Quorum`` call after another (the next one as soon as the previous answer arrived).
Every group has its own gRPC channel and TCP connection (``grpc.use_local_subchannel_pool``), as
separate trainer processes would.

This is a leaner twin of ``lighthouse_cluster.local.simulated_group.SimulatedReplicaGroup`` (same traffic,
same semantics), built so that the generator is not the bottleneck: requests are serialized once
per step with raw-bytes stubs and responses are not parsed, except by one "validating" group per
worker, which checks that every quorum has all N groups and includes itself. With
``min_replicas = N`` every quorum contains every group, so the k-th answer of every group belongs
to the same round: rounds are reconstructed from per-group answer times afterwards
(:func:`analyze_rounds`), with no coordination between the workers while they run.

Clocks: ``time.monotonic()`` is CLOCK_MONOTONIC, shared by every process on the host, so the
workers' timestamps are comparable with each other and with the main process's (the kill time of
a failover trial, the measurement window).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import queue
import random
import time
import traceback
import uuid
from array import array
from dataclasses import dataclass, field
from typing import Any

SPAWN = mp.get_context("spawn")

QUORUM_METHOD = "/torchft.LighthouseService/Quorum"
HEARTBEAT_METHOD = "/torchft.LighthouseService/Heartbeat"

CHANNEL_OPTIONS = [
    # One TCP connection per group, like one trainer process per group (grpc would otherwise
    # share one connection between every channel of a process with the same target).
    ("grpc.use_local_subchannel_pool", 1),
    # Reconnect quickly after a lighthouse restart (both systems get the same settings).
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 250),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]


@dataclass(frozen=True)
class LoadSpec:
    """What to run. Group ``i`` talks to ``endpoints[i % len(endpoints)]``; with ``fallback``,
    a group whose call fails UNAVAILABLE moves to the next address of ``fallback`` (what a client
    with an endpoint list, like ftclient, does)."""

    groups: int
    endpoints: tuple[str, ...]
    fallback: tuple[str, ...] = ()
    quorum_timeout_s: float = 30.0
    heartbeat_interval_s: float = 0.1
    # torchft's manager sends heartbeats without a deadline; a long one keeps every wait bounded.
    heartbeat_timeout_s: float = 30.0
    retry_sleep_s: float = 0.05
    prefix: str = "bench"
    # 1 = one connection per group, like separate trainer processes; k > 1 = k groups of one
    # worker share a connection (cheaper for the generator, less like real trainers).
    groups_per_connection: int = 1
    # Parse every answer for its quorum's creation time (failover trials: an answer counts as
    # "the next quorum" only if that quorum was created after the kill). O(N) per answer.
    parse_created: bool = False
    # The job the groups belong to (named in every call's metadata); None: the default job.
    job: str | None = None
    # A pause after each answered Quorum call before the next (a training step); 0: back to back.
    step_time_s: float = 0.0
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])

    def replica_id(self, i: int) -> str:
        # torchft managers use "<name>:<uuid4>"; keep the same length so responses have real sizes.
        return f"{self.prefix}_{i}:{self.run_id}-{i:04d}-4000-8000-000000000000"


# -- worker process ----------------------------------------------------------------------------------


def _worker_main(spec: LoadSpec, gids: list[int], ready: Any, go: Any, stop: Any, ok_count: Any,
                 last_ok: Any, last_created: Any, out_q: Any) -> None:
    try:
        result = asyncio.run(_worker(spec, gids, ready, go, stop, ok_count, last_ok, last_created))
    except BaseException:  # noqa: BLE001 -- reported to the parent, which fails the run
        ready.set()
        out_q.put({"pid": os.getpid(), "fatal": traceback.format_exc()})
        return
    out_q.put(result)


async def _worker(spec: LoadSpec, gids: list[int], ready: Any, go: Any, stop: Any, ok_count: Any,
                  last_ok: Any, last_created: Any) -> dict:
    import grpc

    from lighthouse_cluster.core.jobs import JOB_HEADER
    from lighthouse_cluster.proto import torchft_pb2 as pb

    metadata = None if spec.job is None else ((JOB_HEADER, spec.job),)

    loop = asyncio.get_running_loop()
    channels: dict[int, Any] = {}
    endpoint: dict[int, str] = {}
    ring: dict[int, list[str]] = {}

    def open_channel(g: int) -> None:
        channels[g] = grpc.aio.insecure_channel(endpoint[g], options=CHANNEL_OPTIONS)

    shared: dict[tuple[str, int], Any] = {}
    for i, g in enumerate(gids):
        endpoint[g] = spec.endpoints[g % len(spec.endpoints)]
        if spec.fallback:
            fb = list(spec.fallback)
            start = fb.index(endpoint[g]) if endpoint[g] in fb else 0
            ring[g] = fb[start:] + fb[:start]
        if spec.groups_per_connection > 1:
            key = (endpoint[g], i // (spec.groups_per_connection * len(spec.endpoints)))
            if key not in shared:
                open_channel(g)
                shared[key] = channels[g]
            channels[g] = shared[key]
        else:
            open_channel(g)

    # Connect every channel before the start signal, so connection set-up is not measured.
    async def connect(g: int) -> bool:
        try:
            await asyncio.wait_for(channels[g].channel_ready(), 30.0)
            return True
        except asyncio.TimeoutError:
            return False

    firsts = list({id(channels[g]): g for g in gids}.values())
    connected = await asyncio.gather(*(connect(g) for g in firsts))
    ready.set()
    while not go.is_set():
        await asyncio.sleep(0.005)

    sends: dict[int, array] = {g: array("d") for g in gids}
    recvs: dict[int, array] = {g: array("d") for g in gids}
    created: dict[int, array] = {g: array("d") for g in gids}
    sizes: dict[int, array] = {g: array("d") for g in gids}  # each answer's serialized bytes
    errors: list[tuple[int, float, str, float]] = []
    error_examples: list[str] = []
    validation = {"checked": 0, "bad": 0, "quorum_ids": [], "examples": []}
    hb = {"ok": 0, "err": 0, "lat": array("d")}
    validator = gids[0]
    members = [pb.QuorumMember(replica_id=spec.replica_id(g), address=f"http://127.0.0.1:{20000 + g}",
                               store_address=f"127.0.0.1:{40000 + g}", world_size=1) for g in gids]
    member_of = dict(zip(gids, members))

    def identity(b: bytes) -> bytes:
        return b

    def quorum_stub(g: int) -> Any:
        return channels[g].unary_unary(QUORUM_METHOD, request_serializer=identity, response_deserializer=identity)

    def heartbeat_stub(g: int) -> Any:
        return channels[g].unary_unary(HEARTBEAT_METHOD, request_serializer=identity,
                                       response_deserializer=identity)

    def move_on(g: int) -> None:
        r = ring.get(g)
        if not r or len(r) < 2:
            return
        r.append(r.pop(0))
        old = channels[g]
        endpoint[g] = r[0]
        open_channel(g)
        if spec.groups_per_connection <= 1:
            loop.create_task(old.close(grace=None))

    async def quorum_loop(g: int) -> None:
        step = 0
        me = member_of[g]
        rid = me.replica_id
        while True:
            me.step = step
            raw = pb.LighthouseQuorumRequest(requester=me).SerializeToString()
            t_send = time.monotonic()
            try:
                resp = await quorum_stub(g)(raw, timeout=spec.quorum_timeout_s, metadata=metadata)
            except grpc.aio.AioRpcError as e:
                t = time.monotonic()
                errors.append((g, t, e.code().name, t - t_send))
                if len(error_examples) < 5:
                    error_examples.append(f"{e.code().name} after {t - t_send:.3f}s: {e.details()} "
                                          f"({(e.debug_error_string() or '')[:160]})")
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    move_on(g)
                await asyncio.sleep(spec.retry_sleep_s)
                continue
            t_recv = time.monotonic()
            sends[g].append(t_send)
            recvs[g].append(t_recv)
            sizes[g].append(len(resp))
            ok_count[g] += 1
            last_ok[g] = t_recv
            if spec.parse_created:
                c = pb.LighthouseQuorumResponse.FromString(resp).quorum.created
                wall = c.seconds + c.nanos / 1e9
                created[g].append(wall)
                last_created[g] = wall
            if g == validator:
                q = pb.LighthouseQuorumResponse.FromString(resp).quorum
                ids = {m.replica_id for m in q.participants}
                validation["checked"] += 1
                validation["quorum_ids"].append((t_recv, q.quorum_id))
                if rid not in ids or len(ids) != spec.groups:
                    validation["bad"] += 1
                    if len(validation["examples"]) < 3:
                        validation["examples"].append(f"quorum {q.quorum_id}: {len(ids)} members, "
                                                      f"includes me: {rid in ids}")
            step += 1
            if spec.step_time_s:
                await asyncio.sleep(spec.step_time_s)

    async def heartbeat_loop(g: int) -> None:
        raw = pb.LighthouseHeartbeatRequest(replica_id=member_of[g].replica_id).SerializeToString()
        await asyncio.sleep(random.random() * spec.heartbeat_interval_s)  # spread the phases
        n = 0
        while True:
            t = time.monotonic()
            try:
                await heartbeat_stub(g)(raw, timeout=spec.heartbeat_timeout_s, metadata=metadata)
                hb["ok"] += 1
                n += 1
                if n % 10 == 0:
                    hb["lat"].append(time.monotonic() - t)
            except grpc.aio.AioRpcError:
                hb["err"] += 1
            await asyncio.sleep(spec.heartbeat_interval_s)

    started = time.monotonic()
    tasks = [loop.create_task(heartbeat_loop(g)) for g in gids]
    # Heartbeats first: a group should be healthy before it asks, as a trainer's manager is.
    await asyncio.sleep(0.05)
    tasks += [loop.create_task(quorum_loop(g)) for g in gids]
    while not stop.is_set():
        await asyncio.sleep(0.02)
    stopped = time.monotonic()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    unique = {id(ch): ch for ch in channels.values()}.values()
    await asyncio.gather(*(ch.close(grace=None) for ch in unique), return_exceptions=True)
    ru = os.times()
    return {
        "pid": os.getpid(),
        "gids": gids,
        "connections": len(firsts),
        "connected": sum(connected),
        "started": started,
        "stopped": stopped,
        "sends": {g: sends[g].tobytes() for g in gids},
        "recvs": {g: recvs[g].tobytes() for g in gids},
        "sizes": {g: sizes[g].tobytes() for g in gids},
        "created": {g: created[g].tobytes() for g in gids},
        "errors": errors,
        "error_examples": error_examples,
        "validation": validation,
        "heartbeats": {"ok": hb["ok"], "err": hb["err"], "lat": hb["lat"].tobytes()},
        "cpu_s": ru.user + ru.system,
    }


# -- parent side -----------------------------------------------------------------------------------


class LoadGenerator:
    """``spec.groups`` groups over ``workers`` processes; ``start()``, then ``stop()`` (always, in a
    finally block: it kills whatever is still running)."""

    def __init__(self, spec: LoadSpec, workers: int) -> None:
        self.spec = spec
        self.workers = max(1, min(workers, spec.groups))
        self._ready = [SPAWN.Event() for _ in range(self.workers)]
        self._go = SPAWN.Event()
        self._stop = SPAWN.Event()
        self.ok_count = SPAWN.Array("q", spec.groups, lock=False)
        self.last_ok = SPAWN.Array("d", spec.groups, lock=False)
        self.last_created = SPAWN.Array("d", spec.groups, lock=False)
        self._out = SPAWN.Queue()
        self._procs: list[Any] = []
        self.started_at: float | None = None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def start(self, timeout: float = 60.0) -> None:
        gids = list(range(self.spec.groups))
        for w in range(self.workers):
            mine = gids[w::self.workers]
            p = SPAWN.Process(target=_worker_main, name=f"loadgen-{w}", daemon=True,
                              args=(self.spec, mine, self._ready[w], self._go, self._stop, self.ok_count,
                                    self.last_ok, self.last_created, self._out))
            p.start()
            self._procs.append(p)
        deadline = time.monotonic() + timeout
        while not all(ev.is_set() for ev in self._ready):
            for p in self._procs:
                if not p.is_alive():
                    raise RuntimeError(f"load generator worker {p.name} exited with {p.exitcode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"load generator workers not ready within {timeout}s")
            time.sleep(0.02)
        self.started_at = time.monotonic()
        self._go.set()

    def min_ok(self) -> int:
        return min(self.ok_count[:]) if self.spec.groups else 0

    def wait_rounds(self, rounds: int, timeout: float) -> bool:
        """Wait until every group has had ``rounds`` answers (bounded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.min_ok() >= rounds:
                return True
            self._check_alive()
            time.sleep(0.01)
        return False

    def all_answered_after(self, t: float) -> bool:
        return all(x > t for x in self.last_ok[:])

    def all_have_quorum_created_after(self, wall: float) -> bool:
        """Every group has an answer whose quorum was created after ``wall`` (time.time());
        needs ``spec.parse_created``."""
        return all(x > wall for x in self.last_created[:])

    def _check_alive(self) -> None:
        for p in self._procs:
            if not p.is_alive() and p.exitcode not in (0, None):
                raise RuntimeError(f"load generator worker {p.name} died with exit code {p.exitcode}")

    def stop(self, timeout: float = 30.0) -> list[dict]:
        """Stop every worker and collect their records; kills stragglers."""
        self._stop.set()
        self._go.set()
        results: list[dict] = []
        deadline = time.monotonic() + timeout
        try:
            while len(results) < len(self._procs) and time.monotonic() < deadline:
                try:
                    results.append(self._out.get(timeout=0.2))
                except queue.Empty:
                    if all(not p.is_alive() for p in self._procs) and self._out.empty():
                        break
        finally:
            for p in self._procs:
                p.join(timeout=max(0.1, deadline - time.monotonic()))
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
            self._procs = []
        fatal = [r["fatal"] for r in results if "fatal" in r]
        if fatal:
            raise RuntimeError("load generator worker failed:\n" + fatal[0])
        return results

    def __enter__(self) -> "LoadGenerator":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._procs:
            try:
                self.stop(timeout=10)
            except RuntimeError:
                if exc == (None, None, None):
                    raise


# -- analysis ----------------------------------------------------------------------------------------


def _pct(values: Any, q: float) -> float | None:
    import numpy as np

    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values), q))


def per_group_times(results: list[dict]) -> dict[int, tuple[Any, Any]]:
    import numpy as np

    out = {}
    for r in results:
        for g in r["gids"]:
            out[g] = (np.frombuffer(r["sends"][g], dtype="d"), np.frombuffer(r["recvs"][g], dtype="d"))
    return out


def analyze_rounds(results: list[dict], groups: int, t0: float, t1: float) -> dict:
    """Rounds completed in [t0, t1]: a round is complete when its last requester has its
    answer; its latency runs from the last request sent to the last answer received."""
    import numpy as np

    times = per_group_times(results)
    if len(times) != groups:
        raise RuntimeError(f"records for {len(times)} of {groups} groups")
    n = min(len(s) for s, _ in times.values())
    sends = np.vstack([times[g][0][:n] for g in range(groups)]) if n else np.zeros((groups, 0))
    recvs = np.vstack([times[g][1][:n] for g in range(groups)]) if n else np.zeros((groups, 0))
    last_send = sends.max(axis=0) if n else np.zeros(0)
    last_recv = recvs.max(axis=0) if n else np.zeros(0)
    first_recv = recvs.min(axis=0) if n else np.zeros(0)
    in_window = (last_recv >= t0) & (last_recv <= t1)
    # What the lighthouse sent per round in answers: the serialized responses (gRPC's framing aside).
    answer_bytes = (np.vstack([np.frombuffer(r["sizes"][g], dtype="d")[:n] for r in results for g in r["gids"]])
                    .sum(axis=0)[in_window] if n and all("sizes" in r for r in results) else np.zeros(0))
    lat = (last_recv - last_send)[in_window]
    spread = (last_recv - first_recv)[in_window]
    window = t1 - t0
    errors: dict[str, int] = {}
    for r in results:
        for _g, t, code, _lat in r["errors"]:
            if t0 <= t <= t1:
                errors[code] = errors.get(code, 0) + 1
    hb_ok = sum(r["heartbeats"]["ok"] for r in results)
    hb_lat = np.concatenate([np.frombuffer(r["heartbeats"]["lat"], dtype="d") for r in results])
    run_s = max(r["stopped"] for r in results) - min(r["started"] for r in results)
    val = {"checked": sum(r["validation"]["checked"] for r in results),
           "bad": sum(r["validation"]["bad"] for r in results),
           "examples": [e for r in results for e in r["validation"]["examples"]][:3]}
    return {
        "window_s": round(window, 3),
        "rounds": int(in_window.sum()),
        "rounds_per_s": round(float(in_window.sum()) / window, 2) if window > 0 else None,
        "latency_ms": {
            "p50": _ms(_pct(lat, 50)), "p99": _ms(_pct(lat, 99)), "max": _ms(float(lat.max()) if len(lat) else None)},
        "broadcast_spread_ms_p50": _ms(_pct(spread, 50)),
        "answer_bytes_per_round": int(_pct(answer_bytes, 50)) if len(answer_bytes) else None,
        "errors": errors,
        "errors_total": sum(errors.values()),
        "error_examples": [e for r in results for e in r.get("error_examples", [])][:5],
        "heartbeats_per_s": round(hb_ok / run_s, 1) if run_s > 0 else None,
        "heartbeats_expected_per_s": round(groups / 0.1, 1),
        "heartbeat_rtt_ms": {"p50": _ms(_pct(hb_lat, 50)), "p99": _ms(_pct(hb_lat, 99))},
        "heartbeat_errors": sum(r["heartbeats"]["err"] for r in results),
        "validation": val,
        "connections": sum(r.get("connections", 0) for r in results),
        "connected": sum(r["connected"] for r in results),
    }


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000.0, 2)


def validator_quorum_ids(results: list[dict]) -> list[tuple[float, int]]:
    """(time received, quorum id) of every quorum the validating groups saw, by time."""
    return sorted(x for r in results for x in r["validation"]["quorum_ids"])


def first_answers_after(results: list[dict], t: float, wall: float | None = None) -> dict[int, float | None]:
    """For each group, the time (monotonic) of its first answer received after ``t`` -- with
    ``wall``, of its first answer whose quorum was created after ``wall`` (time.time()), so that
    an answer already on its way when ``t`` came does not count. None: no such answer."""
    import numpy as np

    out: dict[int, float | None] = {}
    for r in results:
        for g in r["gids"]:
            recv = np.frombuffer(r["recvs"][g], dtype="d")
            if wall is not None:
                created = np.frombuffer(r["created"][g], dtype="d")
                idx = np.nonzero(created > wall)[0]
                out[g] = float(recv[idx[0]]) if len(idx) else None
            else:
                i = int(np.searchsorted(recv, t, side="right"))
                out[g] = float(recv[i]) if i < len(recv) else None
    return out
