"""The cluster commands: `status`, `health`, `members list/add/remove`, `transfer-leader`."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from lighthouse_cluster.cli.app import main
from lighthouse_cluster.cli.options import ClientOptions, admin_call, client_options, exit_config_error
from lighthouse_cluster.core.defaults import STATUS_TIMEOUT_S, TRANSFER_TIMEOUT_S
from lighthouse_cluster.server.config import ConfigError


# -- status ----------------------------------------------------------------------------------------


@main.command()
@client_options(timeout=STATUS_TIMEOUT_S)
def status(client: ClientOptions) -> None:
    """Show nodes, leader, current quorum, heartbeats and jobs; exit 1 when no leader is known."""
    from lighthouse_cluster.cli.status_tables import render
    from lighthouse_cluster.client.cluster_view import build_view, collect, collect_jobs, to_json

    addresses, tls = client.dial()
    reasons: dict[str, str] = {}
    answers = collect(addresses, client.timeout, tls, reasons)
    if all(st is None for _, st in answers):
        message = "no node answered: " + "; ".join(reasons.get(a, a) for a in addresses)
        if client.output == "json":
            click.echo(json.dumps({"leader": None, "nodes": [], "quorum": None, "error": message}))
        click.echo(f"error: {message}", err=True)
        sys.exit(1)
    view = build_view(answers)
    if not view.jobs:  # the leader's Status does not list them (an older node): ask for them
        asked = [endpoint for endpoint, st in answers
                 if st is not None and (view.leader is None or st.node.id == view.leader)]
        view.jobs = next((jobs for jobs in (collect_jobs(a, client.timeout, tls) for a in asked) if jobs is not None), [])
    if client.output == "json":
        click.echo(json.dumps(to_json(view), indent=2))
    else:
        from lighthouse_cluster.cli.output import console

        render(view, console())
    if view.leader is None:
        click.echo("error: no leader is known (election in progress or no majority reachable)", err=True)
        sys.exit(1)


# -- health ----------------------------------------------------------------------------------------


@main.command()
@client_options(timeout=STATUS_TIMEOUT_S)
@click.option("--max-lag", type=int, default=100, show_default=True,
              help="Most log entries a node may be behind the leader's commit index and count as healthy.")
def health(client: ClientOptions, max_lag: int) -> None:
    """Per-node liveness, readiness, leader and lag; exit 0 only when the whole cluster is healthy."""
    from lighthouse_cluster.cli.status_tables import render_health
    from lighthouse_cluster.client.cluster_view import build_health, collect, health_to_json

    addresses, tls = client.dial()
    reasons: dict[str, str] = {}
    answers = collect(addresses, client.timeout, tls, reasons)
    if all(st is None for _, st in answers) and client.output != "json":
        click.echo("error: no node answered: " + "; ".join(reasons.get(a, a) for a in addresses), err=True)
        sys.exit(1)
    h = build_health(answers, max_lag)
    if client.output == "json":
        click.echo(json.dumps(health_to_json(h), indent=2))
    else:
        from lighthouse_cluster.cli.output import console

        render_health(h, console())
    if not h.healthy:
        click.echo(f"error: cluster unhealthy: {h.problems[0]}", err=True)
        sys.exit(1)


# -- members ---------------------------------------------------------------------------------------


def _print_members(r: Any, output: str, title: str = "members") -> None:
    data = {"leader": r.leader_id or None, "term": r.term, "version": r.version,
            "members": [{"id": m.id, "raft_address": m.raft_address, "client_address": m.client_address,
                         "leader": m.id == r.leader_id, "connected": m.id == r.leader_id or m.id in r.connected}
                        for m in r.members]}
    if output == "json":
        click.echo(json.dumps(data, indent=2))
        return
    from lighthouse_cluster.cli.output import Cell, print_table

    print_table(f"{title} (table version {r.version}{', from --peer' if not r.version else ''})",
                ("id", "raft address", "client address", "role", "connected"),
                [(m["id"], m["raft_address"], m["client_address"],
                  Cell("leader", "bold green") if m["leader"] else "follower",
                  "yes" if m["connected"] else Cell("no", "red")) for m in data["members"]], record="member")


@main.group()
def members() -> None:
    """List, add and remove cluster members (runtime membership change)."""


@members.command("list")
@client_options()
def members_list(client: ClientOptions) -> None:
    """The members as the leader sees them (any node answers when no leader is known)."""
    from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb

    admin = client.admin_client()

    def ask() -> Any:
        from lighthouse_cluster.client.admin_client import AdminCallError

        try:
            return admin.call("ListMembers", cpb.MembersRequest(), at=admin.leader()[0])
        except AdminCallError:  # no leader known (or it just went away): any node's view
            return admin.any_node("ListMembers", cpb.MembersRequest())

    _print_members(admin_call(ask), client.output)


@members.command("add")
@click.argument("node_id")
@click.argument("raft_addr")
@click.argument("client_addr")
@client_options(admin=True)
def members_add(node_id: str, raft_addr: str, client_addr: str, client: ClientOptions) -> None:
    """Add NODE_ID (already started with `serve --join`) at RAFT_ADDR / CLIENT_ADDR."""
    from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
    from lighthouse_cluster.server.config import check_node_id, normalize_address

    try:
        check_node_id(node_id)
        raft = normalize_address(raft_addr, "RAFT_ADDR")
        client_address = normalize_address(client_addr, "CLIENT_ADDR")
    except ConfigError as e:
        exit_config_error(e)
    admin = client.admin_client(with_token=True)
    r = admin_call(lambda: admin.call("AddMember", cpb.AddMemberRequest(
        node=cpb.NodeInfo(id=node_id, raft_address=raft, client_address=client_address))))
    _print_members(r, client.output, f"{node_id} added; members")


@members.command("remove")
@click.argument("node_id")
@client_options(admin=True)
def members_remove(node_id: str, client: ClientOptions) -> None:
    """Remove NODE_ID from the cluster (then stop its process)."""
    from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb

    admin = client.admin_client(with_token=True)
    r = admin_call(lambda: admin.call("RemoveMember", cpb.RemoveMemberRequest(node_id=node_id)))
    _print_members(r, client.output, f"{node_id} removed; members")


# -- transfer-leader -------------------------------------------------------------------------------


@main.command("transfer-leader")
@click.option("--to", "to", metavar="NODE_ID", help="The new leader (default: the most caught-up follower).")
@client_options(timeout=TRANSFER_TIMEOUT_S, admin=True)
def transfer_leader(to: str | None, client: ClientOptions) -> None:
    """Hand leadership over to another node (e.g. before maintenance on the leader's host)."""
    from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb

    admin = client.admin_client(with_token=True)
    r = admin_call(lambda: admin.call("TransferLeader", cpb.TransferLeaderRequest(to_node_id=to or "")))
    for _ in range(2):  # a split vote can elect a third node: ask the new leader to hand over again
        if not to or r.leader_id == to:
            break
        r = admin_call(lambda: admin.call("TransferLeader", cpb.TransferLeaderRequest(to_node_id=to)))
    data = {"previous_leader": r.previous_leader_id, "leader": r.leader_id, "term": r.term}
    if client.output == "json":
        click.echo(json.dumps(data, indent=2))
    else:
        from lighthouse_cluster.cli.output import Cell, print_table

        print_table("leadership transferred", ("previous leader", "leader", "term"),
                    [(r.previous_leader_id, Cell(r.leader_id, "bold green"), str(r.term))])
    if to and r.leader_id != to:
        click.echo(f"error: {r.leader_id} was elected, not {to}", err=True)
        sys.exit(1)
