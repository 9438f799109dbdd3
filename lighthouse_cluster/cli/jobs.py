"""`lighthouse-cluster jobs add/list/show/set/remove`: the cluster's jobs. A bad local input or a
request the node refused exits 2, an unreachable cluster 1."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from lighthouse_cluster.cli.app import main
from lighthouse_cluster.cli.options import ClientOptions, client_options, exit_config_error
from lighthouse_cluster.server.config import ConfigError


# -- jobs ------------------------------------------------------------------------------------------


def job_settings_options(f: Any) -> Any:
    """The job settings as flags (``job_requests.SETTING_FLAGS``: serve's spellings). No
    environment variables: a node's LIGHTHOUSE_CLUSTER_MIN_REPLICAS must not change a job."""
    from lighthouse_cluster.cli.job_requests import SETTING_FLAGS

    for name, flags, help_text in reversed(SETTING_FLAGS):
        f = click.option(*flags, name, type=int, default=None, metavar="N", help=help_text)(f)
    return f


def _job_input(build: Any) -> Any:
    """``build()``'s request; a ``JobError`` (bad local input) is one line and exit 2, before any call."""
    from lighthouse_cluster.core.jobs import JobError

    try:
        return build()
    except JobError as e:
        exit_config_error(ConfigError(str(e)))


def _job_call(fn: Any) -> Any:
    """Run ``fn()``; a failed call is one line on stderr: exit 2 when the node refused the
    request (a bad token, unknown job, duplicate, bad value, live replicas), 1 when the cluster
    could not be reached or did not answer."""
    import grpc

    from lighthouse_cluster.client.admin_client import AdminCallError

    try:
        return fn()
    except AdminCallError as e:
        hint = " (check LIGHTHOUSE_CLUSTER_ADMIN_TOKEN or --admin-token)" \
            if e.code == grpc.StatusCode.UNAUTHENTICATED else ""
        click.echo(f"error: {e}{hint}", err=True)
        sys.exit(2 if e.refused else 1)


def _print_job(job: Any, output: str, title: str = "", answered_by: str = "") -> None:
    from lighthouse_cluster.client.job_view import job_json

    data = job_json(job)
    if output == "json":
        click.echo(json.dumps({**data, "answered_by": answered_by} if answered_by else data, indent=2))
        return
    from lighthouse_cluster.cli.job_tables import render_job
    from lighthouse_cluster.cli.output import console

    render_job(data, console(), answered_by=answered_by, title=title)


@main.group()
def jobs() -> None:
    """Add, list, show, change and remove jobs: named quorum namespaces sharing the cluster.

    A torchft trainer selects a job by calling the job's own port (--port); an ftclient trainer
    on any port by name (LIGHTHOUSE_JOB=NAME). Calls that name no job belong to the `default` job,
    whose settings are the nodes' serve flags."""


@jobs.command("add")
@click.argument("name")
@job_settings_options
@click.option("--port", "ports", multiple=True, metavar="PORT|NODE=PORT",
              help="A client port every node serves for this job only (torchft trainers select the job by it); "
                   "NODE=PORT for one node's port (repeat). Default: none (reached by name).")
@click.option("--config", "config", multiple=True, metavar="KEY=VALUE",
              help="A configuration entry the job's trainers read (ftclient: manager.job_config()) (repeat).")
@client_options(admin=True)
def jobs_add(name: str, ports: tuple[str, ...], config: tuple[str, ...], client: ClientOptions,
             **settings: int | None) -> None:
    """Create job NAME; settings not given are the leader's own (its serve flags)."""
    from lighthouse_cluster.cli.job_requests import add_request, settings_given

    request = _job_input(lambda: add_request(name, settings_given(settings), ports, config))
    admin = client.admin_client(with_token=True)
    _print_job(_job_call(lambda: admin.call("AddJob", request)), client.output, f"job {name} added")


@jobs.command("list")
@client_options()
def jobs_list(client: ClientOptions) -> None:
    """Every job, the default one first: ports, min_replicas, last quorum, members, heartbeating
    replicas and config keys (as the leader sees them; another node's view when no leader answers)."""
    from lighthouse_cluster.client.job_view import jobs_view
    from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb

    admin = client.admin_client()
    r, address = _job_call(lambda: admin.read("ListJobs", cpb.ListJobsRequest()))
    data = jobs_view(r)
    data["answered_by"] = f"{r.answered_by} ({address})" if r.answered_by else address
    if client.output == "json":
        click.echo(json.dumps(data, indent=2))
        return
    from lighthouse_cluster.cli.job_tables import render_jobs
    from lighthouse_cluster.cli.output import console

    render_jobs(data, console())


@jobs.command("show")
@click.argument("name")
@client_options()
def jobs_show(name: str, client: ClientOptions) -> None:
    """Every field of job NAME: settings, ports (and whether the answering node listens on its
    own), config, the members of its last quorum, heartbeats and pending requesters (leader's view)."""
    from lighthouse_cluster.core.jobs import check_job_name
    from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb

    _job_input(lambda: check_job_name(name))
    admin = client.admin_client()
    job, address = _job_call(lambda: admin.read("GetJob", cpb.JobRequest(name=name)))
    _print_job(job, client.output, answered_by=address)


@jobs.command("set")
@click.argument("name")
@job_settings_options
@click.option("--port", "ports", multiple=True, metavar="PORT|NODE=PORT",
              help="Replace the job's ports with these (repeat; as in `jobs add`).")
@click.option("--no-ports", is_flag=True, help="Remove the job's own ports (it stays reachable by name).")
@click.option("--config", "config", multiple=True, metavar="KEY=VALUE", help="Set a config entry (repeat).")
@click.option("--unset-config", "unset_config", multiple=True, metavar="KEY", help="Remove a config entry (repeat).")
@client_options(admin=True)
def jobs_set(name: str, ports: tuple[str, ...], no_ports: bool, config: tuple[str, ...],
             unset_config: tuple[str, ...], client: ClientOptions, **settings: int | None) -> None:
    """Change job NAME: only what is given changes (the default job: only its config)."""
    from lighthouse_cluster.cli.job_requests import set_request, settings_given

    request = _job_input(lambda: set_request(name, settings_given(settings), ports, no_ports, config,
                                             unset_config))
    admin = client.admin_client(with_token=True)
    _print_job(_job_call(lambda: admin.call("SetJob", request)), client.output, f"job {name} changed")


@jobs.command("remove")
@click.argument("name")
@click.option("--force", is_flag=True, help="Remove it even while its replicas heartbeat (their next calls fail "
                                            "with NOT_FOUND).")
@client_options(admin=True)
def jobs_remove(name: str, force: bool, client: ClientOptions) -> None:
    """Remove job NAME (refused while its replicas heartbeat, unless --force)."""
    from lighthouse_cluster.cli.job_requests import remove_request

    request = _job_input(lambda: remove_request(name, force))
    admin = client.admin_client(with_token=True)
    r = _job_call(lambda: admin.call("RemoveJob", request))
    data = {"name": r.name, "last_quorum_id": r.last_quorum_id}
    if client.output == "json":
        click.echo(json.dumps(data, indent=2))
        return
    from lighthouse_cluster.cli.output import print_record

    print_record(f"job {r.name} removed", {"last quorum id": str(r.last_quorum_id)})
