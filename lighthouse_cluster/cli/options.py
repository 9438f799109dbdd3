"""The options the commands share, each defined once: the client options (where the nodes are,
TLS, output, timeout, admin token) folded into one ``ClientOptions`` by ``client_options``, the
torchft and node flags ``serve`` and ``up`` both take, the ``--config`` file loader, and the
one-line exit for bad input (status 2).
"""

from __future__ import annotations

import functools
import os
import sys
import tomllib
from dataclasses import dataclass, field
from typing import Any, Callable, NoReturn

import click

from lighthouse_cluster.core.defaults import (
    CLIENT_TIMEOUT_S,
    DEFAULT_HEARTBEAT_TIMEOUT_MS,
    DEFAULT_JOIN_TIMEOUT_MS,
    DEFAULT_QUORUM_TICK_MS,
)
from lighthouse_cluster.core.lease import DEFAULT_LEASE_MS
from lighthouse_cluster.server.config import (
    DEFAULT_LIVENESS_TIMEOUT_MS,
    MAX_LEASE_MS,
    MAX_LIVENESS_TIMEOUT_MS,
    MIN_LIVENESS_TIMEOUT_MS,
    ConfigError,
)

ENV = "LIGHTHOUSE_CLUSTER_"
# Where `serve --config` leaves the file's [[jobs]] tables (click's context meta).
DECLARED_JOBS = "lighthouse_cluster.declared_jobs"
# gRPC core logs a failed TLS handshake at INFO on stderr; the commands say what failed in one line.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


def load_config_file(ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    if not value:
        return value
    try:
        with open(value, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise click.BadParameter(f"cannot read {value}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise click.BadParameter(f"{value} is not valid TOML: {e}") from None
    # [[jobs]] tables are no option: serve reads them from here (``DECLARED_JOBS``).
    ctx.meta[DECLARED_JOBS] = data.pop("jobs", None)
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
    f = click.option("--heartbeat_timeout_ms", "--heartbeat-timeout-ms", "heartbeat_timeout_ms", type=click.IntRange(min=1),
                     default=DEFAULT_HEARTBEAT_TIMEOUT_MS, show_default=True, envvar=ENV + "HEARTBEAT_TIMEOUT_MS",
                     help="A replica whose last heartbeat is older is unhealthy.")(f)
    f = click.option("--quorum_tick_ms", "--quorum-tick-ms", "quorum_tick_ms", type=click.IntRange(min=1),
                     default=DEFAULT_QUORUM_TICK_MS, show_default=True, envvar=ENV + "QUORUM_TICK_MS",
                     help="How often the leader re-evaluates the pending quorum.")(f)
    f = click.option("--join_timeout_ms", "--join-timeout-ms", "join_timeout_ms", type=click.IntRange(min=1),
                     default=DEFAULT_JOIN_TIMEOUT_MS, show_default=True, envvar=ENV + "JOIN_TIMEOUT_MS",
                     help="How long to wait for heartbeating replicas that have not asked for the quorum.")(f)
    f = click.option("--min_replicas", "--min-replicas", "min_replicas", type=click.IntRange(min=1), required=True,
                     envvar=ENV + "MIN_REPLICAS", help="Fewest replica groups a new quorum may have.")(f)
    return f


def lease_flag(f: Any) -> Any:
    return click.option(
        "--quorum-lease-ms", "quorum_lease_ms", type=click.IntRange(0, MAX_LEASE_MS), default=None,
        show_default=f"{DEFAULT_LEASE_MS}, at most the election timeout",
        envvar=ENV + "QUORUM_LEASE_MS",
        help="Leader lease for fast quorums: issued without a Raft commit while a majority confirmed "
             "the leader within it; a new leader waits out what of it exceeds the election timeout "
             "before serving. Assumes node clock rates differ by less than 2x. 0 commits every round.")(f)


def liveness_flag(f: Any) -> Any:
    return click.option(
        "--liveness-timeout-ms", "liveness_timeout_ms",
        type=click.IntRange(MIN_LIVENESS_TIMEOUT_MS, MAX_LIVENESS_TIMEOUT_MS), default=DEFAULT_LIVENESS_TIMEOUT_MS,
        show_default=True, envvar=ENV + "LIVENESS_TIMEOUT_MS",
        help="A replica group whose liveness stream (ftclient's Watch) sent no keep-alive for this long is "
             "declared dead and left out of the next quorum at once (a closed stream is a death at once). "
             "A false death costs one quorum change. torchft trainers are unaffected (heartbeat timeout).")(f)


def manager_watch_flag(f: Any) -> Any:
    return click.option(
        "--watch-manager-connections/--no-watch-manager-connections", "watch_manager_connections", default=True,
        show_default=True, envvar=ENV + "WATCH_MANAGER_CONNECTIONS",
        help="The leader keeps an idle connection to each running quorum member's manager server; when it "
             "closes and a new one is refused (the trainer process died), the member is declared dead at "
             "once instead of after its heartbeat timeout. Nothing changes for the trainers.")(f)


def exit_config_error(e: ConfigError) -> NoReturn:
    """Bad input: one line on stderr, exit status 2."""
    click.echo(f"error: {e}", err=True)
    sys.exit(2)



# -- client options (status and the admin commands) -------------------------------------------------

CLIENT_KEYS = ("endpoints", "tls_ca", "tls_client_cert", "tls_client_key", "output", "timeout")


@dataclass(frozen=True)
class ClientOptions:
    """Where the nodes are and how to dial them, as the client options gave them."""

    endpoints: str | None
    tls_ca: str | None
    tls_client_cert: str | None
    tls_client_key: str | None
    output: str
    timeout: float
    admin_token: str | None = field(default=None, repr=False)

    def dial(self) -> tuple[list[str], Any]:
        """(the nodes' addresses, client TLS or None); bad input exits 2 with one line."""
        from lighthouse_cluster.client.discovery import parse_endpoints
        from lighthouse_cluster.tls import TLSConfigError, client_tls_for

        if not self.endpoints:
            exit_config_error(ConfigError("no endpoints: pass --endpoints URL[,URL...], or set "
                                          "LIGHTHOUSE_CLUSTER_ENDPOINTS (or TORCHFT_LIGHTHOUSE)"))
        try:
            addresses = list(parse_endpoints(self.endpoints).addresses)
            tls = client_tls_for(self.endpoints, self.tls_ca, self.tls_client_cert, self.tls_client_key, env={})
        except (ValueError, TLSConfigError) as e:
            exit_config_error(ConfigError(str(e)))
        return addresses, tls

    def need_token(self) -> None:
        if not self.admin_token:
            exit_config_error(ConfigError("no admin token: set LIGHTHOUSE_CLUSTER_ADMIN_TOKEN or pass --admin-token"))

    def admin_client(self, with_token: bool = False) -> Any:
        """An ``AdminClient`` for these nodes (with the admin token: after ``need_token``)."""
        from lighthouse_cluster.client.admin_client import AdminClient

        if with_token:
            self.need_token()
        addresses, tls = self.dial()
        return AdminClient(addresses, tls=tls, token=self.admin_token if with_token else None, timeout=self.timeout)


def client_options(timeout: float = CLIENT_TIMEOUT_S, admin: bool = False) -> Callable[[Any], Any]:
    """The client options of a command (``--admin-token`` too with ``admin``), handed to it as
    one ``client: ClientOptions`` argument."""

    def decorate(f: Any) -> Any:
        @functools.wraps(f)
        def command(**kwargs: Any) -> Any:
            given = {k: kwargs.pop(k) for k in CLIENT_KEYS}
            token = kwargs.pop("admin_token") if admin else None
            return f(client=ClientOptions(**given, admin_token=token), **kwargs)

        if admin:
            command = click.option("--admin-token", envvar=ENV + "ADMIN_TOKEN", metavar="TOKEN",
                                   help="The cluster's admin token (prefer the env var "
                                        "LIGHTHOUSE_CLUSTER_ADMIN_TOKEN).")(command)
        command = click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=timeout,
                               show_default=True, help="Seconds to wait for each call.")(command)
        command = click.option("--output", "-o", type=click.Choice(["table", "json"]), default="table",
                               show_default=True)(command)
        command = click.option("--tls-client-key", envvar=ENV + "TLS_CLIENT_KEY", type=click.Path(dir_okay=False),
                               metavar="PEM", help="Key of --tls-client-cert.")(command)
        command = click.option("--tls-client-cert", envvar=ENV + "TLS_CLIENT_CERT", type=click.Path(dir_okay=False),
                               metavar="PEM", help="Client certificate, for nodes that require one (mutual TLS).")(command)
        command = click.option("--tls-ca", envvar=ENV + "TLS_CA", type=click.Path(dir_okay=False), metavar="PEM",
                               help="Dial the nodes with TLS, trusting this CA (https:// or grpcs:// endpoints alone "
                                    "use the system's roots).")(command)
        command = click.option("--endpoints", envvar=[ENV + "ENDPOINTS", "TORCHFT_LIGHTHOUSE"], metavar="URL[,URL...]",
                               help="Client addresses of the nodes; any one is enough "
                                    "(env: LIGHTHOUSE_CLUSTER_ENDPOINTS or TORCHFT_LIGHTHOUSE).")(command)
        return command

    return decorate


def admin_call(fn: Callable[[], Any]) -> Any:
    """Run ``fn()``; an AdminCallError becomes one line on stderr and exit status 1."""
    from lighthouse_cluster.client.admin_client import AdminCallError

    try:
        return fn()
    except AdminCallError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
