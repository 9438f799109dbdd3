"""Property-based partition tests: a hypothesis ``RuleBasedStateMachine`` whose rules are faults.

Each example starts a real cluster with clients running (a ``runner.Session``); hypothesis then
picks a sequence of rules (partition of some kind, heal, kill, restart, pause, resume,
restart-all, wait), each applied to the live cluster and held for ``dwell_s`` while the clients
keep going. After every step the cheap invariants (no split brain, monotonic quorum ids) are
checked over the history so far; at teardown the cluster is recovered and every checker runs.

With ``client_faults=True`` the clients run as processes and two more rules kill a replica
group (SIGKILL; at least one client always survives) and restart one; ``recover`` restarts them
all. Off by default: an extra rule would change the examples a given seed draws.

Every example writes a normal run directory (``<base>/example-<k>``) whose ``schedule.json``
is the sequence of actions it executed: ``python -m jepsen_like replay <dir>`` runs it again.
The hypothesis seed is fixed by the caller (``seed``) and printed, so an example sequence is
replayable too. Runs are bounded: ``examples`` x ``steps`` x ``dwell_s``, deadlines off, and no
shrinking unless asked (each shrink step would start a cluster).
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import hypothesis
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, get_state_machine_test, invariant, precondition, rule

from .runner import Printer, RunOptions, RunResult, Session
from .schedule import FaultOp, Schedule, client_name, fault_op

PARTITION_KINDS = ("isolate", "isolate-leader", "isolate-follower", "halves", "bridge", "ring", "oneway")
# hypothesis tries rules with fewer arguments first, by name: the simplest example is then a
# run of leader isolations (a real fault) rather than a run of heals.


class PropertyFailure(AssertionError):
    pass


def make_machine(base_dir: Path, options: RunOptions, nodes: int = 3, clients: int = 3, dwell_s: float = 1.5,
                 printer: Printer | None = None, results: list[RunResult] | None = None,
                 pulse_partitions: bool = False, tolerate_known_bugs: bool = False,
                 client_faults: bool = False) -> type[RuleBasedStateMachine]:
    """A state machine class bound to a base directory and run options (hypothesis builds one
    instance per example). With ``tolerate_known_bugs`` a failure that a known, still open bug
    explains (``known_bugs``) does not fail the example. By default partitions pile up until a
    ``heal``/``recover`` rule or the teardown (they may cut every node off from every other);
    with ``pulse_partitions`` every partition is healed at the end of its own step instead (process
    faults still accumulate). CI used pulses while BUG-1 (a node cut off from Raft for 10-30 s
    after a long partition) was open; it is fixed, so CI lets them pile up."""
    counter = itertools.count()

    class ClusterUnderFaults(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            k = next(counter)
            self.schedule = Schedule(seed=k, nodes=nodes, clients=clients, time_limit_s=0.0, nemeses=[],
                                     name=f"pbt-example-{k}")
            run_options = RunOptions.from_json(options.to_json())
            if client_faults:
                run_options.clients.processes = True
            self.session = Session(base_dir / f"example-{k}", self.schedule, run_options, printer).start()
            self.down: set[int] = set()
            self.paused: set[int] = set()
            self.clients_down: set[str] = set()

        def _do(self, op: FaultOp) -> None:
            event = self.session.apply(op)
            if pulse_partitions and op.f in PARTITION_KINDS:
                self.session.wait(dwell_s)
                self.session.apply(FaultOp(0.0, "heal"))
            if op.f in ("kill", "kill-leader") and event["type"] == "ok":
                self.down.add(event["value"]["node"])
                self.paused.discard(event["value"]["node"])
            elif op.f == "restart":
                self.down.discard(op.args["node"])
            elif op.f in ("pause", "pause-leader") and event["type"] == "ok":
                self.paused.add(event["value"]["node"])
            elif op.f == "resume":
                self.paused.discard(op.args["node"])
            elif op.f == "kill-client" and event["type"] == "ok":
                self.clients_down.add(op.args["client"])
            elif op.f == "restart-client":
                self.clients_down.discard(op.args["client"])
            elif op.f in ("restart-all", "recover"):
                self.down.clear()
                if op.f == "recover":
                    self.paused.clear()
                    self.clients_down.clear()
            self.session.wait(dwell_s)

        @rule(kind=st.sampled_from(PARTITION_KINDS), shape_seed=st.integers(0, 2**16))
        def partition(self, kind: str, shape_seed: int) -> None:
            self._do(fault_op(random.Random(shape_seed), kind, nodes, 0.0))

        @rule()
        def fault_isolate_leader(self) -> None:
            self._do(FaultOp(0.0, "isolate-leader", {"node": "leader"}))

        @rule()
        def heal(self) -> None:
            self._do(FaultOp(0.0, "heal"))

        @precondition(lambda self: len(self.down) + len(self.paused) < nodes)
        @rule(node=st.integers(0, nodes - 1) | st.just("leader"))
        def kill(self, node: Any) -> None:
            self._do(FaultOp(0.0, "kill-leader" if node == "leader" else "kill", {"node": node}))

        @precondition(lambda self: bool(self.down))
        @rule(data=st.data())
        def restart(self, data: st.DataObject) -> None:
            node = data.draw(st.sampled_from(sorted(self.down)))
            self._do(FaultOp(0.0, "restart", {"node": node}))

        @precondition(lambda self: len(self.down) + len(self.paused) < nodes)
        @rule(node=st.integers(0, nodes - 1))
        def pause(self, node: int) -> None:
            if node not in self.down:
                self._do(FaultOp(0.0, "pause", {"node": node}))

        @precondition(lambda self: bool(self.paused))
        @rule(data=st.data())
        def resume(self, data: st.DataObject) -> None:
            node = data.draw(st.sampled_from(sorted(self.paused)))
            self._do(FaultOp(0.0, "resume", {"node": node}))

        @rule()
        def restart_all(self) -> None:
            self._do(FaultOp(0.0, "restart-all"))

        @rule()
        def recover(self) -> None:
            self._do(FaultOp(0.0, "recover"))

        @rule(seconds=st.sampled_from([0.5, 1.0, 2.0]))
        def wait(self, seconds: float) -> None:
            self.session.wait(seconds)

        @invariant()
        def cheap_invariants(self) -> None:
            failed = [c for c in self.session.check_cheap() if not c.valid]
            if failed:
                raise PropertyFailure(_explain(self.session, failed))

        def teardown(self) -> None:
            try:
                result = self.session.finish()
            finally:
                self.session.close()
            if results is not None:
                results.append(result)
            if not (result.valid_but_known_bugs if tolerate_known_bugs else result.valid):
                raise PropertyFailure(_explain(self.session, [c for c in result.checks if not c.valid],
                                               result.errors))

    if not client_faults:
        return ClusterUnderFaults

    class ClusterAndClientsUnderFaults(ClusterUnderFaults):
        @precondition(lambda self: clients - len(self.clients_down) > 1)
        @rule(k=st.integers(0, clients - 1))
        def kill_client(self, k: int) -> None:
            if client_name(k) not in self.clients_down:
                self._do(FaultOp(0.0, "kill-client", {"client": client_name(k)}))

        @precondition(lambda self: bool(self.clients_down))
        @rule(data=st.data())
        def restart_client(self, data: st.DataObject) -> None:
            client = data.draw(st.sampled_from(sorted(self.clients_down)))
            self._do(FaultOp(0.0, "restart-client", {"client": client}))

    return ClusterAndClientsUnderFaults


def _explain(session: Session, failed: list[Any], errors: list[str] = ()) -> str:
    lines = [f"{c.status} {c.name}: {c.summary}; first offences: {c.offending[:2]}" for c in failed]
    lines += [f"ERROR {e}" for e in errors]
    lines.append(f"run directory: {session.dir} (replay: python -m jepsen_like replay {session.dir})")
    return "\n".join(lines)


def run_property_test(base_dir: Path, options: RunOptions, *, seed: int, examples: int = 2, steps: int = 6,
                      nodes: int = 3, clients: int = 3, dwell_s: float = 1.5, shrink: bool = False,
                      pulse_partitions: bool = False, tolerate_known_bugs: bool = False,
                      client_faults: bool = False, printer: Printer | None = None) -> list[RunResult]:
    """Run the state machine for ``examples`` examples of up to ``steps`` steps with hypothesis seed
    ``seed``; raises (hypothesis's error, with the failing run directory) on a violation."""
    results: list[RunResult] = []
    machine = make_machine(base_dir, options, nodes=nodes, clients=clients, dwell_s=dwell_s, printer=printer,
                           results=results, pulse_partitions=pulse_partitions,
                           tolerate_known_bugs=tolerate_known_bugs, client_faults=client_faults)
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if shrink else [])
    test = get_state_machine_test(machine, settings=settings(
        max_examples=examples, stateful_step_count=steps, deadline=None, phases=phases, database=None,
        suppress_health_check=list(HealthCheck), print_blob=True))
    hypothesis.seed(seed)(test)()
    return results
