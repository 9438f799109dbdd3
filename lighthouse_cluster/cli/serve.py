"""`lighthouse-cluster serve`: one node in the foreground.

The options are declared here, once each, as click options (flag, environment variable, default,
help); click resolves them (flags > environment variables > ``--config`` TOML file > defaults)
and hands them to ``serve`` by name. ``serve`` keeps the few that are its own (``--secret-file``,
``--event-loop``, ``--log-level``, ``--log-format``) and passes every other one, by the same name,
as one ``server.config.ServeOptions``, which ``build_node_config`` validates into the node's
``NodeConfig``. A new node option is therefore a click option here and a ``ServeOptions`` field of
the same name (with the same default: tests/cli/test_serve_options.py checks both), plus a
``NodeConfig`` field when the node reads it; nothing else spells it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from lighthouse_cluster.cli.app import main
from lighthouse_cluster.cli.options import (
    DECLARED_JOBS,
    ENV,
    exit_config_error,
    lease_flag,
    liveness_flag,
    load_config_file,
    manager_watch_flag,
    torchft_flags,
)
from lighthouse_cluster.core.codec import SCHEMA_VERSION
from lighthouse_cluster.core.kv_store import DEFAULT_IDLE_EXPIRY_S
from lighthouse_cluster.server.config import (
    DEFAULT_JOB_PORT_PROCESS_NICE,
    DEFAULT_QUIESCE_AFTER_MS,
    MAX_JOB_PORT_PROCESS_NICE,
    ConfigError,
    ServeOptions,
    build_node_config,
)
from lighthouse_cluster.server.event_loop import DEFAULT_LOOP, LOOPS
from lighthouse_cluster.server.event_loop import run as run_event_loop
from lighthouse_cluster.server.gc_thresholds import use_serving_thresholds


@main.command()
@click.option("--config", type=click.Path(dir_okay=False), is_eager=True, expose_value=False,
              callback=load_config_file, envvar=ENV + "CONFIG",
              help="TOML file whose keys are these options' names (peers = [...] for --peer), and "
                   "[[jobs]] tables declaring jobs (name, port or ports, settings, [jobs.config]) that the "
                   "leader creates when the cluster does not have them yet.")
@click.option("--node-id", required=True, envvar=ENV + "NODE_ID", help="This node's id; must be one of the peers.")
@click.option("--peer", "peers", multiple=True, envvar=ENV + "PEERS", metavar="ID=RAFT_HOST:PORT,CLIENT_HOST:PORT",
              help="Every node of the cluster, this one included (repeat; env: space-separated).")
@click.option("--client-bind", envvar=ENV + "CLIENT_BIND", metavar="HOST:PORT",
              help="Where to serve gRPC (torchft.LighthouseService + cluster service). "
                   "Default: [::] and this node's client port.")
@click.option("--raft-bind", envvar=ENV + "RAFT_BIND", metavar="HOST:PORT",
              help="Where to listen for Raft peers. Default: every interface (0.0.0.0, or :: for an IPv6 "
                   "Raft address) on this node's Raft port.")
@click.option("--raft-dial", "raft_dial", multiple=True, envvar=ENV + "RAFT_DIAL", metavar="ID=HOST:PORT",
              help="Reach peer ID's Raft port at HOST:PORT instead of its Raft address (NAT, port forwarding, "
                   "a proxy); its identity stays its Raft address (repeat; env: space-separated).")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), envvar=ENV + "DATA_DIR",
              help="Raft journal and snapshots; without it the node keeps no state across restarts.")
@click.option("--secret", envvar=ENV + "SECRET", help="Cluster secret encrypting the Raft port (prefer the env var).")
@click.option("--secret-file", type=click.Path(dir_okay=False, path_type=Path), envvar=ENV + "SECRET_FILE",
              help="Read the cluster secret from this file.")
@click.option("--insecure", is_flag=True, envvar=ENV + "INSECURE",
              help="Run the Raft port without a secret (trusted networks only).")
@click.option("--http-bind", envvar=ENV + "HTTP_BIND", metavar="HOST:PORT",
              help="Serve /metrics, /livez, /readyz and the dashboard (/) over HTTP here (HTTPS with --tls-cert). Default: off.")
@click.option("--admin-token", envvar=ENV + "ADMIN_TOKEN",
              help="Bearer token required by the admin commands (jobs add/set/remove, members add/remove, "
                   "transfer-leader, snapshot) "
                   "and the dashboard's kill button (prefer the env var). Default: all of those refused.")
@click.option("--tls-cert", envvar=ENV + "TLS_CERT", type=click.Path(dir_okay=False), metavar="PEM",
              help="Serve the client (gRPC) port with TLS: this node's certificate chain. Needs --tls-key.")
@click.option("--tls-key", envvar=ENV + "TLS_KEY", type=click.Path(dir_okay=False), metavar="PEM",
              help="The private key of --tls-cert.")
@click.option("--tls-client-ca", envvar=ENV + "TLS_CLIENT_CA", type=click.Path(dir_okay=False), metavar="PEM",
              help="Require client certificates signed by this CA (mutual TLS); peers are dialed with --tls-cert.")
@click.option("--tls-ca", envvar=ENV + "TLS_CA", type=click.Path(dir_okay=False), metavar="PEM",
              help="CA that signs the peers' certificates, for node-to-node calls "
                   "(default: --tls-client-ca, else the system's roots).")
@click.option("--join", is_flag=True, envvar=ENV + "JOIN",
              help="This node joins a running cluster: --peer lists the current members and this node, which an "
                   "admin then adds with `lighthouse-cluster members add` (allows an even number of peers).")
@torchft_flags
@click.option("--election-timeout-ms", type=int, envvar=ENV + "ELECTION_TIMEOUT_MS",
              help="Raft election timeout lower bound (default 150; upper bound is three times it).")
@click.option("--quiesce-after-ms", type=int, default=DEFAULT_QUIESCE_AFTER_MS, show_default=True,
              envvar=ENV + "QUIESCE_AFTER_MS",
              help="With no client call for this long, the Raft leader heartbeats every 200 ms instead of 37.5 ms "
                   "(an idle node's CPU; the first client call wakes it). 0: never.")
@click.option("--rendezvous-idle-expiry-s", type=float, default=DEFAULT_IDLE_EXPIRY_S, show_default=True,
              envvar=ENV + "RENDEZVOUS_IDLE_EXPIRY_S",
              help="A rendezvous namespace (torchrun's --rdzv-backend=lighthouse: one per job and run id) that no "
                   "write touched for this many seconds is dropped by the leader. Seconds, not ms: hours is typical.")
@lease_flag
@liveness_flag
@manager_watch_flag
@click.option("--auto-create-jobs/--no-auto-create-jobs", "auto_create_jobs", default=False, show_default=True,
              envvar=ENV + "AUTO_CREATE_JOBS",
              help="The leader creates a job nobody added on its first use (a Quorum call, heartbeat or Watch "
                   "naming it) with the settings `jobs add` would give it. Off: such calls fail NOT_FOUND.")
@click.option("--job-port-processes/--no-job-port-processes", "job_port_processes", default=False,
              show_default=True, envvar=ENV + "JOB_PORT_PROCESSES",
              help="Serve each job's own client port from a process of its own, which forwards the job's calls to "
                   "the leader as a follower does: a job's load then stays off this node's event loop, which "
                   "other jobs' rounds share (one Python process more per job port).")
@click.option("--job-port-process-nice", "job_port_process_nice", type=int, default=DEFAULT_JOB_PORT_PROCESS_NICE,
              show_default=True, envvar=ENV + "JOB_PORT_PROCESS_NICE",
              help=f"With --job-port-processes: the port processes run this many steps of CPU priority (nice) "
                   f"below the node, so where they share cores the node's Raft and rounds go first. "
                   f"0-{MAX_JOB_PORT_PROCESS_NICE}; 0: the node's priority.")
@click.option("--event-loop", type=click.Choice(LOOPS), default=DEFAULT_LOOP, show_default=True,
              envvar=ENV + "EVENT_LOOP", help="asyncio event loop of the node (uvloop: faster; asyncio: the standard one).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              envvar=ENV + "LOG_LEVEL", show_default=True)
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text", envvar=ENV + "LOG_FORMAT",
              show_default=True)
@click.option("--unsafe-no-fsync", "unsafe_no_fsync", is_flag=True, envvar=ENV + "UNSAFE_NO_FSYNC",
              help="UNSAFE, for tests and benchmarks only: never fsync the Raft journal, term, vote and snapshots. "
                   "A process crash still loses nothing; a power loss or machine crash can lose quorums this node "
                   "acknowledged (with two of three nodes: committed ones). The node logs a warning and "
                   "`lighthouse-cluster status` shows it.")
@click.option("--schema-version", type=int, default=SCHEMA_VERSION, hidden=True,
              help="Write and report at most this replicated schema version: act as an older version "
                   "(rolling-upgrade tests).")
@click.pass_context
def serve(ctx: click.Context, secret_file: Path | None, event_loop: str, log_level: str, log_format: str,
          **node_options: Any) -> None:
    """Run one lighthouse node in the foreground (SIGTERM hands leadership over, then exits)."""
    from lighthouse_cluster.local.supervise import die_with_parent_from_env
    from lighthouse_cluster.server.logs import configure_logging
    from lighthouse_cluster.server.open_files import raise_open_file_limit

    die_with_parent_from_env()  # a node of `up`: dies with it (no-op unless `up` asked for it)

    if secret_file is not None:
        try:
            node_options["secret"] = secret_file.read_text().strip()
        except OSError as e:
            exit_config_error(ConfigError(f"cannot read --secret-file {secret_file}: {e.strerror}"))
    for repeated in ("peers", "raft_dial"):  # from a config file or env as one string
        value = node_options[repeated]
        node_options[repeated] = list(value.split() if isinstance(value, str) else value)
    try:
        config = build_node_config(ServeOptions(**node_options), jobs=ctx.meta.get(DECLARED_JOBS))
    except ConfigError as e:
        exit_config_error(e)
    configure_logging(log_level, log_format, config.node_id)
    raise_open_file_limit()  # before any socket: trainers' connections, Raft, the journal
    use_serving_thresholds()
    try:
        run_event_loop(_serve(config), event_loop)
    except OSError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)


async def _serve(config: Any) -> None:
    from lighthouse_cluster.server.node import LighthouseNode

    node = LighthouseNode(config)
    await node.start()
    node.install_signal_handlers()
    await node.wait_closed()
