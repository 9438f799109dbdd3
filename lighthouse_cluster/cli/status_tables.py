"""What `lighthouse-cluster status` and `health` print: a ``ClusterView`` or ``Health`` (built by
``client.cluster_view``) as tables on a terminal and plain ``RECORD:`` lines elsewhere."""

from __future__ import annotations

from typing import Any

from lighthouse_cluster.cli.job_tables import render_status_jobs
from lighthouse_cluster.cli.output import Cell, print_table
from lighthouse_cluster.client.cluster_view import ClusterView, Health, unsafe_storage_note, upgrade_note


def render(view: ClusterView, console: Any) -> None:
    """Print the view: tables on a terminal, plain lines elsewhere (``output.print_table``)."""
    print_table("nodes", ("id", "client address", "role", "term", "commit index", "reachable"), [
        (r.id, r.address, Cell(r.role, "bold green" if r.role == "leader" else ""),
         str(r.term) if r.reachable else "-", str(r.commit_index) if r.reachable else "-",
         Cell("yes") if r.reachable else Cell("no", "red"))
        for r in view.nodes], out=console, record="node")
    console.print(f"leader: {view.leader or 'none known'}   term: {view.term}",
                  style="" if view.leader else "red", markup=False)
    upgrading = upgrade_note(view)
    if upgrading:
        console.print(upgrading, markup=False)
    unsafe = unsafe_storage_note(view)
    if unsafe:
        console.print(unsafe, style="bold red", markup=False, soft_wrap=True)
    if view.quorum is None:
        console.print("quorum: none issued yet")
    else:
        max_step = max((p["step"] for p in view.quorum["participants"]), default=0)
        print_table(f"quorum {view.quorum['quorum_id']}", ("replica id", "step", "address", "world size"), [
            (p["replica_id"], str(p["step"]) + (" (recovering)" if p["step"] < max_step else ""), p["address"],
             str(p["world_size"])) for p in view.quorum["participants"]], out=console, wide=("address",),
            record="participant")
    if view.quorum_reason:
        console.print(f"next quorum: {view.quorum_reason}", markup=False)
    if view.rounds:
        lease_ms = view.settings.get("quorum_lease_ms", 0)
        console.print(f"rounds issued by {view.leader}: {view.rounds['lease']} on the leader lease, "
                      f"{view.rounds['commit']} committed each"
                      + (f" (lease {lease_ms} ms)" if lease_ms else " (lease off)"), markup=False)
    if view.heartbeats:
        timeout = view.settings.get("heartbeat_timeout_ms", 0)
        print_table("heartbeats", ("replica id", "age (ms)"), [
            (h["replica_id"], Cell(str(h["age_ms"]), "red" if timeout and h["age_ms"] >= timeout else ""))
            for h in view.heartbeats], out=console, record="heartbeat")
    render_status_jobs(view.jobs, console)


def render_health(h: Health, console: Any) -> None:
    print_table("health", ("id", "client address", "live", "ready", "role", "term", "leader", "commit index", "lag"), [
        (r.id, r.address, Cell("yes") if r.live else Cell("no", "red"), Cell("yes") if r.ready else Cell("no", "red"),
         r.role, str(r.term) if r.live else "-", r.leader_id or "-", str(r.commit_index) if r.live else "-",
         "-" if r.lag is None else str(r.lag)) for r in h.nodes], out=console, record="node")
    if h.healthy:
        console.print(f"healthy: leader {h.leader} in term {h.term}", style="bold green", markup=False)
    else:
        for p in h.problems:
            console.print(f"unhealthy: {p}", style="red", markup=False)
