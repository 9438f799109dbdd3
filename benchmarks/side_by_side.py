"""CPU per quorum round of two lighthouses at once, under the same fixed load.

The rounds section measures rounds per second with every replica group asking again at once
(closed loop): on a shared 2-core host that figure moves 15-20 % from one run to the next, so a
change worth a few percent is invisible in it. Here two servers run *at the same time*, each
with its own client asking for rounds of N Quorum calls (N distinct replica groups, no
heartbeats) at a fixed rate well below saturation, and the figure is CPU time per round, read
per thread from ``/proc``: whatever else the host does hits both servers alike, and the pairs
are repeated. The main thread is the event loop, which answers every call; the process adds the
gRPC poller, gRPC core's threads and, in a node, the Raft thread.

A server is one of:

* ``floor``: ``grpc_floor.py``, the least a grpc.aio lighthouse does per round
  (docs/design/python-grpc-floor.md);
* ``node``: a one-node cluster of this checkout (no Raft peers: the event loop's own cost);
* ``cluster``: a three-node cluster of this checkout, every group calling the leader;
* ``followers``: the same, the groups split between the two followers (forwarding:
  docs/design/follower-forwarding.md);
* ``node@PATH`` / ``cluster@PATH`` / ``followers@PATH``: the same from another checkout (e.g.
  ``git worktree add``), for a before / after comparison of a change.

Every process of a server is measured: ``loop`` is the busiest event-loop thread, ``process``
the busiest process (what bounds the rounds/s when each node has a core of its own, as deployed)
and ``all`` the server's processes together (what bounds it when they share the cores, as here).

Run: ``python -m benchmarks.side_by_side node@../before node --n 64 --rate 16 --pairs 6``.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import click

from .procs import CHECKOUT, GrpcFloor

# The client: N channels (group g on the g-th of the comma-separated addresses, in turn), one
# Quorum call per group per round, a round every 1/rate seconds, for the given seconds and at
# least min_rounds rounds (a host that stalls for a second still yields enough rounds to divide
# its CPU by: a stalled process spends none).
CLIENT = r'''
import asyncio, sys, grpc, uvloop
from lighthouse_cluster.proto import torchft_pb2 as pb
addresses, n, rate, seconds = sys.argv[1].split(","), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
min_rounds = int(sys.argv[5])

async def main():
    channels = [grpc.aio.insecure_channel(addresses[g % len(addresses)]) for g in range(n)]
    calls = [c.unary_unary("/torchft.LighthouseService/Quorum", request_serializer=bytes,
                           response_deserializer=bytes) for c in channels]
    members = [pb.QuorumMember(replica_id=f"group-{g:05d}", address=f"http://127.0.0.1:{20000 + g}",
                               store_address=f"127.0.0.1:{40000 + g}", world_size=1) for g in range(n)]

    async def one_round(step):
        requests = []
        for m in members:
            m.step = step
            requests.append(pb.LighthouseQuorumRequest(requester=m).SerializeToString())
        await asyncio.gather(*(calls[g](requests[g], timeout=60) for g in range(n)))

    for step in range(3):  # the first rounds change the member set; later ones are fast rounds
        await one_round(step)
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    loop = asyncio.get_running_loop()
    start, done = loop.time(), 0
    while loop.time() - start < seconds or done < min_rounds:
        due = start + done / rate
        if due > loop.time():
            await asyncio.sleep(due - loop.time())
        await one_round(3 + done)
        done += 1
    print(f"rounds {done} behind_s {loop.time() - start - done / rate:.3f}", flush=True)

uvloop.run(main())
'''


@dataclass
class Server:
    """A started server: where its client calls it (groups spread over ``addresses`` in turn),
    its processes to measure by name, how to stop it."""

    spec: str
    addresses: list[str]
    pids: dict[str, int]
    stop: Callable[[], None]


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of ``pid``: the scheduler's run time in ns
    (``schedstat``), else ``stat``'s clock ticks (10 ms each: a short run of a small server is a
    few ticks per thread, too coarse to compare two of them)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
            continue
        except (OSError, ValueError, IndexError):
            pass
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _checkout_env(path: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(path)}


def start_server(spec: str, n: int, workdir: Path) -> Server:
    kind, _, where = spec.partition("@")
    checkout = Path(where).resolve() if where else CHECKOUT
    if kind == "floor":
        floor = GrpcFloor(min_replicas=n, log_path=workdir / "floor.log")
        floor.start()
        return Server(spec, [floor.address], {"floor": floor.pid}, floor.kill)
    if kind not in ("node", "cluster", "followers"):
        raise click.BadParameter(f"{spec!r}: a server is floor, node[@PATH], cluster[@PATH] or followers[@PATH]")
    from lighthouse_cluster.local.cluster import LocalCluster

    from .rounds import HEARTBEAT_TIMEOUT_MS, JOIN_TIMEOUT_MS, QUORUM_TICK_MS, stable_leader

    # The nodes run `python -m lighthouse_cluster` from the working directory, which comes first
    # on their path: start them from the work directory, with the checkout on PYTHONPATH.
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    os.environ["PYTHONPATH"] = str(checkout)
    os.chdir(workdir)
    try:
        cluster = LocalCluster(root=Path(tempfile.mkdtemp(prefix=f"{kind}-", dir=workdir)),
                               nodes=1 if kind == "node" else 3, min_replicas=n, join_timeout_ms=JOIN_TIMEOUT_MS,
                               quorum_tick_ms=QUORUM_TICK_MS, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
        cluster.start()
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
    try:
        leader = stable_leader(cluster)
    except BaseException:
        cluster.stop_all()
        raise
    pids: dict[str, int] = {}
    for i, member in enumerate(cluster.members):
        assert member.process is not None
        pids["leader" if i == leader else f"follower {i}"] = member.process.pid
    called = [i for i in range(len(cluster.members)) if (i != leader) == (kind == "followers")]
    return Server(spec, [cluster.client_addresses[i] for i in called], pids, cluster.stop_all)


@dataclass
class PairResult:
    rounds: dict[str, int] = field(default_factory=dict)
    behind_s: dict[str, float] = field(default_factory=dict)
    main_ms: dict[str, float] = field(default_factory=dict)  # the busiest event-loop thread, per round
    process_ms: dict[str, float] = field(default_factory=dict)  # the busiest process, per round
    all_ms: dict[str, float] = field(default_factory=dict)  # every process, per round
    per_process_ms: dict[str, dict[str, float]] = field(default_factory=dict)  # each process, per round


def run_pair(specs: tuple[str, str], n: int, rate: float, seconds: float, workdir: Path,
             min_rounds: int = 0) -> PairResult:
    """Run the two servers of ``specs`` side by side, each asked for rounds of ``n`` Quorum calls
    at ``rate`` a second for ``seconds`` and at least ``min_rounds`` rounds; their CPU per round."""
    servers: list[Server] = []
    clients: list[subprocess.Popen[str]] = []
    try:
        for spec in specs:
            servers.append(start_server(spec, n, workdir))
        for s in servers:
            clients.append(subprocess.Popen([sys.executable, "-c", CLIENT, ",".join(s.addresses), str(n), str(rate),
                                             str(seconds), str(min_rounds)],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                            env=_checkout_env(CHECKOUT)))
        for c in clients:
            assert c.stdout is not None
            if not c.stdout.readline().startswith("ready"):
                raise click.ClickException("a client could not finish its first rounds")
        before = [{name: thread_cpu_s(pid) for name, pid in s.pids.items()} for s in servers]
        for c in clients:
            assert c.stdin is not None
            c.stdin.write("go\n")
            c.stdin.flush()
        outs = [c.stdout.readline().split() for c in clients if c.stdout is not None]
        after = [{name: thread_cpu_s(pid) for name, pid in s.pids.items()} for s in servers]
        result = PairResult()
        for s, out, b, a in zip(servers, outs, before, after):
            if len(out) < 4:
                raise click.ClickException(f"the client of {s.spec} ended without a result")
            label = s.spec
            rounds = int(out[1])
            result.rounds[label] = rounds
            result.behind_s[label] = float(out[3])
            per_ms = 1000 / rounds
            loops = {name: (a[name].get(pid, 0.0) - b[name].get(pid, 0.0)) * per_ms for name, pid in s.pids.items()}
            processes = {name: sum(a[name][t] - b[name].get(t, 0.0) for t in a[name]) * per_ms for name in s.pids}
            result.main_ms[label] = max(loops.values())
            result.process_ms[label] = max(processes.values())
            result.all_ms[label] = sum(processes.values())
            result.per_process_ms[label] = processes
        return result
    finally:
        for c in clients:
            c.kill()
            c.wait()
        for s in servers:
            s.stop()


@click.command()
@click.argument("a")
@click.argument("b")
@click.option("--n", default=64, show_default=True, help="Replica groups per round.")
@click.option("--rate", default=16.0, show_default=True, help="Rounds per second asked of each server.")
@click.option("--seconds", default=5.0, show_default=True, help="Measured seconds per pair.")
@click.option("--pairs", default=4, show_default=True, help="Runs of the two servers side by side.")
def main(a: str, b: str, n: int, rate: float, seconds: float, pairs: int) -> None:
    """CPU per round of servers A and B, side by side at a fixed round rate (see the module docstring)."""
    if a == b:
        raise click.BadParameter("A and B are the same server")
    rows: list[PairResult] = []
    with tempfile.TemporaryDirectory(prefix="side-by-side-") as tmp:
        for i in range(pairs):
            r = run_pair((a, b), n, rate, seconds, Path(tmp))
            rows.append(r)
            click.echo(f"pair {i + 1}/{pairs}")
            for s in (a, b):
                click.echo(f"  {s}: loop {r.main_ms[s]:.2f}, process {r.process_ms[s]:.2f}, all "
                           f"{r.all_ms[s]:.2f} ms per round")
                each = ", ".join(f"{name} {ms:.1f}" for name, ms in r.per_process_ms[s].items())
                click.echo(f"    {each} ms; {r.rounds[s]} rounds, {r.behind_s[s]:+.2f} s behind")
    for s in (a, b):
        late = max(r.behind_s[s] for r in rows)
        click.echo(f"{s}: median loop {statistics.median(r.main_ms[s] for r in rows):.2f}, process "
                   f"{statistics.median(r.process_ms[s] for r in rows):.2f}, all "
                   f"{statistics.median(r.all_ms[s] for r in rows):.2f} ms per round")
        if late > 0.25:
            click.echo(f"  fell {late:.2f} s behind the rate: saturated, lower --rate")
    diff = [r.main_ms[b] - r.main_ms[a] for r in rows]
    click.echo(f"B - A, event loop per pair: {', '.join(f'{d:+.2f}' for d in diff)} ms per round")


if __name__ == "__main__":
    main()
