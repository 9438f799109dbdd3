"""The `lighthouse-cluster` command: serve a node, run a local cluster, show cluster status.

A thin shell: options are parsed here (flags > environment variables > ``--config`` TOML file >
defaults) and handed to ``config``, ``node``, ``local_cluster`` and ``cluster_view``. Every
failure a user can cause ends with exit status 2 (bad input) or 1 (cluster problem) and a
one-line reason.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

import click

from . import __version__
from .config import ConfigError, build_node_config, parse_host_port, split_endpoints

ENV = "LIGHTHOUSE_CLUSTER_"


def _load_config_file(ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    if not value:
        return value
    try:
        with open(value, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise click.BadParameter(f"cannot read {value}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise click.BadParameter(f"{value} is not valid TOML: {e}") from None
    defaults: dict[str, Any] = {}
    for key, v in data.items():
        name = key.replace("-", "_")
        if name == "peer":
            name = "peers"
        defaults[name] = v
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


def torchft_flags(f: Any) -> Any:
    """torchft_lighthouse's own flags, same names, meaning and defaults."""
    f = click.option("--heartbeat_timeout_ms", "--heartbeat-timeout-ms", "heartbeat_timeout_ms", type=int,
                     default=5000, show_default=True, envvar=ENV + "HEARTBEAT_TIMEOUT_MS",
                     help="A replica whose last heartbeat is older is unhealthy.")(f)
    f = click.option("--quorum_tick_ms", "--quorum-tick-ms", "quorum_tick_ms", type=int, default=100,
                     show_default=True, envvar=ENV + "QUORUM_TICK_MS",
                     help="How often the leader re-evaluates the pending quorum.")(f)
    f = click.option("--join_timeout_ms", "--join-timeout-ms", "join_timeout_ms", type=int, default=60000,
                     show_default=True, envvar=ENV + "JOIN_TIMEOUT_MS",
                     help="How long to wait for heartbeating replicas that have not asked for the quorum.")(f)
    f = click.option("--min_replicas", "--min-replicas", "min_replicas", type=int, required=True,
                     envvar=ENV + "MIN_REPLICAS", help="Fewest replica groups a new quorum may have.")(f)
    return f


def _exit_config_error(e: ConfigError) -> None:
    click.echo(f"error: {e}", err=True)
    sys.exit(2)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="lighthouse-cluster")
def main() -> None:
    """Highly-available lighthouse for torchft: Raft-replicated quorums on 3 or 5 nodes."""


# -- serve -----------------------------------------------------------------------------------------


@main.command()
@click.option("--config", type=click.Path(dir_okay=False), is_eager=True, expose_value=False,
              callback=_load_config_file, envvar=ENV + "CONFIG",
              help="TOML file whose keys are these options' names (peers = [...] for --peer).")
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
              help="Serve /metrics, /livez, /readyz and the dashboard (/) over HTTP here. Default: off.")
@click.option("--admin-token", envvar=ENV + "ADMIN_TOKEN",
              help="Bearer token enabling the dashboard's kill button (prefer the env var). Default: kill disabled.")
@torchft_flags
@click.option("--election-timeout-ms", type=int, envvar=ENV + "ELECTION_TIMEOUT_MS",
              help="Raft election timeout lower bound (default 150; upper bound is three times it).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              envvar=ENV + "LOG_LEVEL", show_default=True)
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text", envvar=ENV + "LOG_FORMAT",
              show_default=True)
def serve(node_id: str, peers: tuple[str, ...], client_bind: str | None, raft_bind: str | None,
          raft_dial: tuple[str, ...], data_dir: Path | None, secret: str | None, secret_file: Path | None,
          insecure: bool, http_bind: str | None, admin_token: str | None, min_replicas: int, join_timeout_ms: int, quorum_tick_ms: int, heartbeat_timeout_ms: int,
          election_timeout_ms: int | None, log_level: str, log_format: str) -> None:
    """Run one lighthouse node in the foreground (SIGTERM hands leadership over, then exits)."""
    from .logs import configure_logging

    if secret_file is not None:
        try:
            secret = secret_file.read_text().strip()
        except OSError as e:
            _exit_config_error(ConfigError(f"cannot read --secret-file {secret_file}: {e.strerror}"))
    if isinstance(peers, str):  # from a config file or env as one string
        peers = tuple(peers.split())
    if isinstance(raft_dial, str):
        raft_dial = tuple(raft_dial.split())
    try:
        config = build_node_config(
            node_id=node_id, peers=list(peers), client_bind=client_bind, raft_bind=raft_bind, data_dir=data_dir,
            secret=secret, insecure=insecure, min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
            quorum_tick_ms=quorum_tick_ms, heartbeat_timeout_ms=heartbeat_timeout_ms,
            election_timeout_ms=election_timeout_ms, raft_dial=list(raft_dial), http_bind=http_bind,
            admin_token=admin_token)
    except ConfigError as e:
        _exit_config_error(e)
    configure_logging(log_level, log_format, node_id)
    try:
        asyncio.run(_serve(config))
    except OSError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)


async def _serve(config: Any) -> None:
    from .node import LighthouseNode

    node = LighthouseNode(config)
    await node.start()
    node.install_signal_handlers()
    await node.wait_closed()


# -- up --------------------------------------------------------------------------------------------


@main.command()
@click.option("--nodes", type=click.IntRange(1, 9), default=3, show_default=True, help="How many nodes (odd).")
@click.option("--bind", default="[::]:29510", show_default=True, metavar="HOST:PORT",
              help="The first node's client address; the others take the following ports (as torchft_lighthouse).")
@click.option("--raft-port", type=int, help="The first node's Raft port (default: client port + 100).")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Keep node data here (default: a temporary directory removed on exit).")
@torchft_flags
@click.option("--demo", is_flag=True, help="Also run simulated replica groups and print their quorums.")
@click.option("--demo-replicas", type=int, default=3, show_default=True)
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
def up(nodes: int, bind: str, raft_port: int | None, data_dir: Path | None, min_replicas: int,
       join_timeout_ms: int, quorum_tick_ms: int, heartbeat_timeout_ms: int, demo: bool, demo_replicas: int,
       log_level: str) -> None:
    """Run a local N-node cluster on this host in the foreground; Ctrl-C stops every node."""
    from rich.console import Console

    from .local_cluster import LocalCluster, port_is_free

    console = Console(stderr=False)
    if nodes % 2 == 0:
        _exit_config_error(ConfigError(f"--nodes {nodes}: use an odd number so a majority survives a split"))
    try:
        host, port = parse_host_port(bind, "--bind")
    except ConfigError as e:
        _exit_config_error(e)
    wildcard = host in ("[::]", "0.0.0.0", "::")
    advertise = "127.0.0.1" if wildcard or host in ("localhost",) else host.strip("[]")
    client_ports = [port + i for i in range(nodes)]
    raft_base = raft_port or port + 100
    raft_ports = [raft_base + i for i in range(nodes)]
    http_ports = [port + 200 + i for i in range(nodes)]
    busy = [p for p in client_ports + raft_ports + http_ports if not port_is_free(p, advertise)]
    if busy:
        _exit_config_error(ConfigError(f"ports already in use on {advertise}: {busy} (pick another --bind)"))
    root = data_dir or Path(tempfile.mkdtemp(prefix="lighthouse-cluster-"))
    cluster = LocalCluster(root=root, nodes=nodes, host=advertise, client_ports=client_ports, raft_ports=raft_ports,
                           min_replicas=min_replicas, join_timeout_ms=join_timeout_ms, quorum_tick_ms=quorum_tick_ms,
                           heartbeat_timeout_ms=heartbeat_timeout_ms, log_level=log_level,
                           client_bind_host=host if wildcard else None, http_ports=http_ports)
    stopping = False

    def on_signal(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        cluster.start()
        with console.status(f"starting {nodes} nodes, waiting for a leader ..."):
            leader = cluster.wait_for_leader(timeout=30)
        with console.status("waiting for every node to follow the leader ..."):
            if not cluster.wait_for_followers(leader, timeout=10):
                console.print("[yellow]warning:[/] not every node follows the leader yet; "
                              "`lighthouse-cluster status` shows which")
        _print_endpoints(console, cluster, leader, root)
        if demo:
            from .demo import run_demo

            run_demo(cluster, replicas=demo_replicas, console=console)
        else:
            while True:
                for i, m in enumerate(cluster.members):
                    if m.process is not None and m.process.poll() is not None:
                        console.print(f"[red]{m.peer.node_id} exited with {m.process.returncode}[/]; "
                                      f"log: {m.log_path}")
                        m.process = None
                time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    except (TimeoutError, RuntimeError) as e:
        click.echo(f"error: {e}", err=True)
        cluster.stop_all()
        sys.exit(1)
    finally:
        console.print("stopping nodes ...")
        cluster.stop_all(graceful=True)
        if data_dir is None:
            shutil.rmtree(root, ignore_errors=True)


def _print_endpoints(console: Any, cluster: Any, leader: int, root: Path) -> None:
    from rich.table import Table

    table = Table(title="lighthouse-cluster is up", title_justify="left")
    # Addresses are meant to be copied: never wrap or truncate them; the log path folds instead.
    for col in ("node", "client (gRPC)", "raft", "http (dashboard)"):
        table.add_column(col, no_wrap=True)
    table.add_column("log", overflow="fold")
    for i, m in enumerate(cluster.members):
        name = m.peer.node_id + (" (leader)" if i == leader else "")
        http = cluster.http_address(i)
        table.add_row(name, m.peer.client_address, m.peer.raft_address, f"http://{http}" if http else "-",
                      str(m.log_path))
    console.print(table)
    # Plain echo: these lines are meant to be copied, so they must not be wrapped.
    click.echo(f"data: {root}")
    click.echo("torchft trainers (any node works):")
    click.echo(f"  export TORCHFT_LIGHTHOUSE=http://{cluster.client_addresses[0]}")
    click.echo("ftclient trainers and status (all nodes):")
    click.echo(f"  export TORCHFT_LIGHTHOUSE={cluster.endpoints}")
    click.echo(f"  lighthouse-cluster status --endpoints {cluster.endpoints}")
    click.echo("Ctrl-C stops every node.", nl=True)


# -- status ----------------------------------------------------------------------------------------


@main.command()
@click.option("--endpoints", envvar=[ENV + "ENDPOINTS", "TORCHFT_LIGHTHOUSE"], metavar="URL[,URL...]",
              help="Client addresses of the nodes (env: LIGHTHOUSE_CLUSTER_ENDPOINTS or TORCHFT_LIGHTHOUSE).")
@click.option("--output", "-o", type=click.Choice(["table", "json"]), default="table", show_default=True)
@click.option("--timeout", type=float, default=2.0, show_default=True, help="Seconds to wait for each node.")
def status(endpoints: str | None, output: str, timeout: float) -> None:
    """Show nodes, leader, current quorum and heartbeats; exit 1 when no leader is known."""
    from .cluster_view import build_view, collect, render, to_json

    if not endpoints:
        _exit_config_error(ConfigError("no endpoints: pass --endpoints URL[,URL...] or set LIGHTHOUSE_CLUSTER_ENDPOINTS"))
    try:
        addresses = split_endpoints(endpoints)
    except ConfigError as e:
        _exit_config_error(e)
    answers = collect(addresses, timeout)
    if all(st is None for _, st in answers):
        if output == "json":
            click.echo(json.dumps({"leader": None, "nodes": [], "quorum": None,
                                   "error": f"no node answered at {', '.join(addresses)}"}))
        click.echo(f"error: no node answered at {', '.join(addresses)} within {timeout:g}s", err=True)
        sys.exit(1)
    view = build_view(answers)
    if output == "json":
        click.echo(json.dumps(to_json(view), indent=2))
    else:
        from rich.console import Console

        render(view, Console())
    if view.leader is None:
        click.echo("error: no leader is known (election in progress or no majority reachable)", err=True)
        sys.exit(1)


def _add_bench() -> None:
    from .bench.cli import bench

    main.add_command(bench)


_add_bench()


if __name__ == "__main__":
    main()
