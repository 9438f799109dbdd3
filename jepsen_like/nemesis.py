"""The nemesis: carries out one ``FaultOp`` on the cluster and records it in the history.

Every action is an ``invoke`` then an ``ok`` (done; ``value`` says exactly what was done, with
leader-relative targets resolved and the cluster's state afterwards) or ``info`` (it failed
half-way, ``error`` says why). Process ``nemesis``, ``f`` the action's name.

Power losses (``lose-power``, ``lose-power-majority``) SIGKILL the nodes, all of them first, then
make each one's data directory forget what it had not fsynced (``HarnessCluster.lose_power``);
``lost`` in the completion says, per node, which files went back and by how many bytes. The nodes
stay down until ``restart`` or ``recover``.

Client actions act on the replica groups (``clients``, a ``ProcessClientPool``): ``kill-client``
SIGKILLs one (its ``ok`` comes once the process is reaped and its open calls are completed as
``info`` in the history), ``restart-client`` starts it again, and ``recover`` also restarts
every killed one (``clients_restarted`` in its value). Every completion's value lists
``clients_down`` (the clients not running after the action) when there is a pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from .cluster import HarnessCluster
from .history import INFO, INVOKE, NEMESIS, OK, HistoryWriter
from .schedule import FaultOp

if TYPE_CHECKING:
    from .clients import ClientPool, ProcessClientPool

LEADER = "leader"
FOLLOWER = "follower"


class NemesisError(RuntimeError):
    pass


class Nemesis:
    def __init__(self, cluster: HarnessCluster, history: HistoryWriter,
                 on_event: Callable[[dict[str, Any]], None] | None = None,
                 clients: "ClientPool | ProcessClientPool | None" = None) -> None:
        self.cluster = cluster
        self.history = history
        self.on_event = on_event
        self.clients = clients      # set once the clients run (the session starts them after the nemesis)

    def _client(self, arg: Any) -> str:
        if self.clients is None:
            raise NemesisError("no clients to act on")
        if not isinstance(arg, str) or arg not in self.clients.replica_ids:
            raise NemesisError(f"no client {arg!r}; clients: {', '.join(self.clients.replica_ids)}")
        return arg

    def _describe(self) -> dict[str, Any]:
        d = self.cluster.describe()
        if self.clients is not None:
            d["clients_down"] = list(self.clients.down)
        return d

    def _node(self, arg: Any) -> int:
        if arg in (LEADER, FOLLOWER):
            i = self.cluster.wait_for_leader(timeout=5.0)
            if i is None:
                raise NemesisError("no leader (to target it or a follower) within 5s")
            if arg == FOLLOWER:   # the lowest-numbered running follower: deterministic for replays
                i = next(j for j in range(self.cluster.nodes) if j != i and self.cluster.running(j))
            return i
        i = int(arg)
        if not 0 <= i < self.cluster.nodes:
            raise NemesisError(f"no node {i}")
        return i

    def apply(self, op: FaultOp) -> dict[str, Any]:
        """Do ``op`` now; returns the completion event."""
        c = self.cluster
        node_arg = op.args.get("node")
        self.history.append(NEMESIS, INVOKE, op.f, dict(op.args),
                            c.node_id(node_arg) if isinstance(node_arg, int) else None)
        done: dict[str, Any] = {}
        node: str | None = None
        try:
            if op.f in ("isolate", "isolate-leader", "isolate-follower"):
                i = self._node(node_arg)
                c.net.isolate(i)
                node, done = c.node_id(i), {"node": i}
            elif op.f in ("halves", "bridge", "partition"):
                c.net.partition(*op.args["sides"])
                done = {"sides": op.args["sides"]}
            elif op.f in ("ring", "oneway", "cut"):
                for src, dst in op.args["cuts"]:
                    c.net.cut(int(src), int(dst))
                done = {"cuts": op.args["cuts"]}
            elif op.f in ("kill", "kill-leader"):
                i = self._node(node_arg)
                c.kill(i)
                node, done = c.node_id(i), {"node": i}
            elif op.f == "restart":
                i = self._node(node_arg)
                c.restart(i)
                node, done = c.node_id(i), {"node": i}
            elif op.f in ("pause", "pause-leader"):
                i = self._node(node_arg)
                c.pause(i)
                node, done = c.node_id(i), {"node": i}
            elif op.f == "resume":
                i = self._node(node_arg)
                c.resume(i)
                node, done = c.node_id(i), {"node": i}
            elif op.f == "restart-all":
                c.restart_all()
            elif op.f == "lose-power":
                i = self._node(node_arg)
                node, done = c.node_id(i), {"node": i}
                done["lost"] = c.lose_power([i])
            elif op.f == "lose-power-majority":
                targets = sorted({self._node(n) for n in op.args["nodes"]})
                if len(targets) <= c.nodes // 2:
                    raise NemesisError(f"lose-power-majority needs a majority of the {c.nodes} nodes, got {targets}")
                done = {"nodes": targets, "lost": c.lose_power(targets)}
            elif op.f == "clock":
                i = self._node(node_arg)
                c.set_clock_rate(i, float(op.args.get("rate", 2.0)))
                node, done = c.node_id(i), {"node": i, "rate": op.args.get("rate", 2.0)}
            elif op.f == "heal":
                c.net.heal()
            elif op.f == "kill-client":
                client = self._client(op.args.get("client"))
                self.clients.kill(client)
                done = {"client": client}
            elif op.f == "restart-client":
                client = self._client(op.args.get("client"))
                self.clients.restart(client)
                done = {"client": client, "clients_restarted": [client]}
            elif op.f == "recover":
                c.recover()
                if self.clients is not None:
                    done = {"clients_restarted": self.clients.restart_down()}
            elif op.f == "wait":
                pass
            else:
                raise NemesisError(f"unknown nemesis action {op.f!r}")
        except Exception as e:
            event = self.history.append(NEMESIS, INFO, op.f, {**done, **self._describe()}, node,
                                        f"{type(e).__name__}: {e}")
        else:
            event = self.history.append(NEMESIS, OK, op.f, {**done, **self._describe(), "healthy": c.healthy}, node)
        if self.on_event is not None:
            self.on_event(event)
        return event
