"""Fault schedules: which faults, when, on which nodes. Pure: no clock, no I/O but JSON text.

A schedule is data (``Schedule``): the run's settings plus a list of ``FaultOp`` (``at``
seconds after the clients start, the action ``f``, its ``args``). ``generate`` draws one from a
seed; ``schedule.json`` is the same thing on disk, and replaying it re-runs the same actions at
the same offsets. Client actions (``kill-client``, ``restart-client``) name a replica group
(``"c1"``), not a node. Leader-relative actions (``isolate-leader``, ``isolate-follower``,
``kill-leader``, ``pause-leader``) name ``"leader"`` (or ``"follower"``) as their node and are
resolved when they run; everything
random (the halves, the ring, the bridge, which node) is drawn here, from the seed.

Actions (``f``) and their ``args``:

=================  ======================================  ==========================================
f                  args                                    effect
=================  ======================================  ==========================================
isolate            node (index or "leader")                cut the node from every other, both ways
isolate-leader     node="leader"                           same, on the current leader
isolate-follower   node="follower"                         same, on the lowest-numbered follower
halves             sides=[[..],[..]]                       random halves, cut both ways
bridge             sides=[[..],[..]], bridge=i             two halves; node ``bridge`` sees both
ring               cuts=[[src,dst],...]                    majorities ring: every node sees a
                                                           majority, no two the same one
oneway             cuts=[[src,dst]]                        drop src -> dst only
partition          sides=[[..],...]                        explicit sides (property tests)
cut                cuts=[[src,dst],...]                    explicit directed cuts
kill / kill-leader node                                    SIGKILL
restart            node                                    start a killed node again
pause / pause-leader node                                  SIGSTOP
resume             node                                    SIGCONT
restart-all        (none)                                  SIGKILL every node, then start them all
kill-client        client ("c1" ...)                       SIGKILL a replica group's process (its
                                                           calls and heartbeats stop at once)
restart-client     client                                  start a killed replica group again (a
                                                           new process, from step 0)
clock              node, rate                              the node's clocks run ``rate`` x (libfaketime)
lose-power         node (index or "leader"/"follower")     SIGKILL, then its data directory loses
                                                           every write not fsynced (lazyfs.py)
lose-power-majority nodes=[..] (a majority)                the same for a majority at once (a rack,
                                                           a zone): 2 of 3, 3 of 5
heal               (none)                                  remove every network cut
recover            (none)                                  heal, resume, restart, reset clocks, restart
                                                           killed clients: the fully healthy cluster again
=================  ======================================  ==========================================
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

NETWORK_FAULTS = ("isolate", "isolate-leader", "isolate-follower", "halves", "bridge", "ring", "oneway")
PROCESS_FAULTS = ("kill", "kill-leader", "pause", "pause-leader", "restart-all")
CLOCK_FAULTS = ("clock",)
# Power losses: the nodes' data directories on the lazy filesystem (lazyfs.py), which forgets
# what was not fsynced. Opt-in, as clock: they need FUSE, and adding them to the default set
# would change the schedule every existing seed draws.
POWER_FAULTS = ("lose-power", "lose-power-majority")
# Faults of the replica groups (the clients), not of the cluster: they need the clients to run
# as processes of their own (``clients.ProcessClientPool``).
CLIENT_FAULTS = ("kill-client",)
ALL_FAULTS = NETWORK_FAULTS + PROCESS_FAULTS + CLOCK_FAULTS + CLIENT_FAULTS + POWER_FAULTS
# What `run` uses without --nemesis: every fault but the optional clock skew and client kills
# (opt-in: adding them would change the schedule every existing seed draws).
DEFAULT_FAULTS = NETWORK_FAULTS + PROCESS_FAULTS
RESTORING = ("heal", "recover", "restart", "resume", "restart-client")
NETWORK_ACTIONS = NETWORK_FAULTS + ("partition", "cut", "heal")
CLIENT_ACTIONS = CLIENT_FAULTS + ("restart-client",)
SCHEDULE_VERSION = 1


@dataclass(frozen=True)
class FaultOp:
    """One nemesis action ``at`` seconds after the clients started."""

    at: float
    f: str
    args: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"at": round(self.at, 3), "f": self.f, "args": self.args}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "FaultOp":
        return cls(at=float(d["at"]), f=str(d["f"]), args=dict(d.get("args") or {}))


@dataclass
class Schedule:
    """Everything needed to run a scenario again: settings and the timed actions."""

    seed: int
    nodes: int = 3
    clients: int = 4
    time_limit_s: float = 30.0
    nemeses: list[str] = field(default_factory=lambda: list(DEFAULT_FAULTS))
    ops: list[FaultOp] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)   # cluster and client knobs
    name: str = ""
    note: str = ""
    # "pass", or "fail" for a saved regression that reproduces a known, not yet fixed bug
    expect: str = "pass"

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["ops"] = [op.to_json() for op in self.ops]
        d["version"] = SCHEDULE_VERSION
        return d

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1) + "\n"

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Schedule":
        return cls(seed=int(d["seed"]), nodes=int(d.get("nodes", 3)), clients=int(d.get("clients", 4)),
                   time_limit_s=float(d.get("time_limit_s", 30.0)), nemeses=list(d.get("nemeses", [])),
                   ops=[FaultOp.from_json(o) for o in d.get("ops", [])], settings=dict(d.get("settings", {})),
                   name=str(d.get("name", "")), note=str(d.get("note", "")), expect=str(d.get("expect", "pass")))

    @classmethod
    def loads(cls, text: str) -> "Schedule":
        return cls.from_json(json.loads(text))


# -- partition shapes (pure functions of a random generator) --------------------------------------


def random_halves(rng: random.Random, nodes: int) -> list[list[int]]:
    """Two sides, the smaller one a minority (Jepsen's partition-random-halves)."""
    order = list(range(nodes))
    rng.shuffle(order)
    k = nodes // 2
    return [sorted(order[:k]), sorted(order[k:])]


def bridge(rng: random.Random, nodes: int) -> tuple[list[list[int]], int]:
    """Two halves that cannot talk, and one node that talks to both (Jepsen's bridge)."""
    order = list(range(nodes))
    rng.shuffle(order)
    middle = order[0]
    rest = order[1:]
    k = len(rest) // 2
    return [sorted(rest[:k]), sorted(rest[k:])], middle


def majorities_ring(rng: random.Random, nodes: int) -> list[list[int]]:
    """Directed cuts such that every node hears from a majority (itself included) and no two nodes
    hear from the same majority (Jepsen's partition-majorities-ring).

    With ``m = nodes // 2 + 1`` nodes in a majority, each node on a shuffled ring hears itself
    and its ``m - 1`` nearest ring neighbours: symmetric (``(m-1)/2`` each way) when ``m - 1`` is
    even (5 nodes), else its ``m - 1`` successors (3 nodes: a one-way ring of cuts)."""
    ring = list(range(nodes))
    rng.shuffle(ring)
    m = nodes // 2 + 1
    cuts: set[tuple[int, int]] = set()
    for pos, dst in enumerate(ring):
        if (m - 1) % 2 == 0:
            k = (m - 1) // 2
            hears = {ring[(pos + d) % nodes] for d in range(-k, k + 1)}
        else:
            hears = {ring[(pos + d) % nodes] for d in range(0, m)}
        for src in range(nodes):
            if src not in hears:
                cuts.add((src, dst))
    return [list(c) for c in sorted(cuts)]


def one_way(rng: random.Random, nodes: int) -> list[list[int]]:
    src, dst = rng.sample(range(nodes), 2)
    return [[src, dst]]


def blocked_pairs(op: FaultOp, nodes: int) -> set[tuple[int, int]]:
    """The directed (src, dst) pairs a resolved network action drops (for tests and reports)."""
    a = op.args
    if op.f in ("isolate", "isolate-leader", "isolate-follower"):
        n = a["node"]
        return {(n, j) for j in range(nodes) if j != n} | {(j, n) for j in range(nodes) if j != n}
    if op.f in ("halves", "bridge", "partition"):
        out = set()
        for i, s in enumerate(a["sides"]):
            for j, t in enumerate(a["sides"]):
                if i != j:
                    out |= {(x, y) for x in s for y in t}
        return out
    if op.f in ("ring", "oneway", "cut"):
        return {(s, d) for s, d in a["cuts"]}
    return set()


# -- generation ------------------------------------------------------------------------------------


def client_name(k: int) -> str:
    """The replica id (and history process) of client ``k``."""
    return f"c{k}"


def fault_op(rng: random.Random, kind: str, nodes: int, at: float, clients: int = 4) -> FaultOp:
    """One fault of ``kind`` with its random parts drawn from ``rng`` (``clients``: how many
    replica groups a ``kill-client`` picks from)."""
    if kind == "isolate":
        return FaultOp(at, kind, {"node": rng.randrange(nodes)})
    if kind in ("isolate-leader", "kill-leader", "pause-leader"):
        return FaultOp(at, kind, {"node": "leader"})
    if kind == "isolate-follower":
        return FaultOp(at, kind, {"node": "follower"})
    if kind == "halves":
        return FaultOp(at, kind, {"sides": random_halves(rng, nodes)})
    if kind == "bridge":
        sides, middle = bridge(rng, nodes)
        return FaultOp(at, kind, {"sides": sides, "bridge": middle})
    if kind == "ring":
        return FaultOp(at, kind, {"cuts": majorities_ring(rng, nodes)})
    if kind == "oneway":
        return FaultOp(at, kind, {"cuts": one_way(rng, nodes)})
    if kind in ("kill", "pause"):
        return FaultOp(at, kind, {"node": rng.randrange(nodes)})
    if kind == "restart-all":
        return FaultOp(at, kind, {})
    if kind == "clock":
        return FaultOp(at, kind, {"node": rng.randrange(nodes), "rate": rng.choice([0.25, 0.5, 2.0, 4.0])})
    if kind == "kill-client":
        return FaultOp(at, kind, {"client": client_name(rng.randrange(clients))})
    if kind == "lose-power":
        return FaultOp(at, kind, {"node": rng.randrange(nodes)})
    if kind == "lose-power-majority":
        return FaultOp(at, kind, {"nodes": sorted(rng.sample(range(nodes), nodes // 2 + 1))})
    raise ValueError(f"unknown fault {kind!r}; known: {', '.join(ALL_FAULTS)}")


def generate(seed: int, nodes: int = 3, time_limit_s: float = 30.0, nemeses: Sequence[str] = DEFAULT_FAULTS,
             clients: int = 4, warmup_s: float = 3.0, fault_s: tuple[float, float] = (2.0, 6.0),
             quiet_s: tuple[float, float] = (3.0, 5.0), settings: dict[str, Any] | None = None,
             name: str = "") -> Schedule:
    """Alternate one random fault (held ``fault_s``) and ``recover`` (then quiet for ``quiet_s``)
    until ``time_limit_s``; the last ``recover`` leaves the cluster healthy for the checks."""
    unknown = [k for k in nemeses if k not in ALL_FAULTS]
    if unknown:
        raise ValueError(f"unknown nemesis {unknown}; known: {', '.join(ALL_FAULTS)}")
    if nodes not in (3, 5):
        raise ValueError("nodes must be 3 or 5")
    rng = random.Random(seed)
    ops: list[FaultOp] = []
    t = warmup_s
    while nemeses:
        hold = rng.uniform(*fault_s)
        quiet = rng.uniform(*quiet_s)
        if t + hold + quiet > time_limit_s:
            break
        ops.append(fault_op(rng, rng.choice(list(nemeses)), nodes, round(t, 3), clients))
        t += hold
        ops.append(FaultOp(round(t, 3), "recover"))
        t += quiet
    return Schedule(seed=seed, nodes=nodes, clients=clients, time_limit_s=time_limit_s, nemeses=list(nemeses),
                    ops=ops, settings=dict(settings or {}), name=name)


def uses_power_faults(s: Schedule) -> bool:
    """Whether ``s`` cuts the power of nodes (their data directories must be on lazy filesystems)."""
    return any(op.f in POWER_FAULTS for op in s.ops) or any(n in POWER_FAULTS for n in s.nemeses)


def uses_client_faults(s: Schedule) -> bool:
    """Whether ``s`` kills or restarts replica groups (its clients must then be processes)."""
    return any(op.f in CLIENT_ACTIONS for op in s.ops) or any(n in CLIENT_FAULTS for n in s.nemeses)
