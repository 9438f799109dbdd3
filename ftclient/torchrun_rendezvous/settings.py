"""``--rdzv-endpoint`` and ``--rdzv-conf`` of ``torchrun --rdzv-backend=lighthouse``, read and
checked before anything is dialled. Pure: no torch, no network; a bad value is a
``RendezvousSettingsError`` whose message is one line naming the setting and what to write.

* ``--rdzv-endpoint``: the cluster's nodes as every client takes them
  (``lighthouse_cluster.client.discovery.parse_endpoints``): ``http://a:29510,http://b:29510``,
  ``https://`` for TLS, or one DNS name that has an address per node. A ``?job=NAME`` query
  names the job, as for ftclient.
* ``--rdzv-id``: the run id, the namespace's second half (``core.kv_store.check_namespace``).
* ``--rdzv-conf`` keys of this backend (``CONF_KEYS``):

  - ``job``: the job the namespace belongs to. Else ``LIGHTHOUSE_JOB``, else ``?job=`` on the
    endpoint, else ``default`` (``ftclient.job_selection``). A job other than ``default`` must
    exist on the cluster (``lighthouse-cluster jobs create``).
  - ``tls_ca``, ``tls_cert``, ``tls_key``: files, as the CLI's ``--tls-ca``,
    ``--tls-client-cert``, ``--tls-client-key`` (and the same ``LIGHTHOUSE_CLUSTER_TLS_*``
    environment variables when not given).
  - ``token_file``: a file holding the bearer token sent with every call (the admin token's
    file); ``LIGHTHOUSE_CLUSTER_ADMIN_TOKEN`` is not read: a rendezvous does not need it.
  - ``read_timeout``: seconds a store read waits for its key (default 60, as c10d's).
  - ``kv_timeout``: seconds one store operation is retried across leader changes before the
    rendezvous gives up (default 30).

  torch's own keys pass through to its handler (``TORCH_CONF_KEYS``: ``join_timeout``,
  ``last_call_timeout``, ``close_timeout``, ``heartbeat_timeout``, ``keep_alive_interval``,
  ``keep_alive_max_attempt``, and ``timeout``, which torchrun adds); any other key is refused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ftclient.job_selection import select_job
from lighthouse_cluster.client.discovery import EXAMPLE, parse_endpoints
from lighthouse_cluster.core.jobs import DEFAULT_JOB
from lighthouse_cluster.core.kv_store import KVError, check_namespace
from lighthouse_cluster.tls import ClientTLS, TLSConfigError, client_tls_for

BACKEND_NAME = "lighthouse"
DEFAULT_READ_TIMEOUT_S = 60.0
DEFAULT_KV_TIMEOUT_S = 30.0
CONF_KEYS = ("job", "tls_ca", "tls_cert", "tls_key", "token_file", "read_timeout", "kv_timeout")
TORCH_CONF_KEYS = ("timeout", "join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout",
                   "keep_alive_interval", "keep_alive_max_attempt")


class RendezvousSettingsError(ValueError):
    """A ``--rdzv-endpoint``, ``--rdzv-id`` or ``--rdzv-conf`` value that cannot work (one line)."""


@dataclass(frozen=True)
class RendezvousSettings:
    """Where the rendezvous lives: the nodes, the namespace ``(job, run_id)``, how to dial."""

    addresses: tuple[str, ...]
    job: str
    run_id: str
    tls: ClientTLS | None = None
    token: str | None = field(default=None, repr=False)
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    kv_timeout_s: float = DEFAULT_KV_TIMEOUT_S

    @property
    def namespace(self) -> str:
        return f"{self.job}/{self.run_id}"


def _seconds(config: Mapping[str, Any], key: str, default: float) -> float:
    raw = config.get(key)
    if raw is None or str(raw).strip() == "":
        return default
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise RendezvousSettingsError(f"--rdzv-conf {key}={raw!r}: not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise RendezvousSettingsError(f"--rdzv-conf {key}={raw!r}: must be a positive number of seconds")
    return value


def _token(path: str | None) -> str | None:
    if not path:
        return None
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise RendezvousSettingsError(f"--rdzv-conf token_file={path}: cannot read it ({e.strerror})") from None
    if not token or "\n" in token:
        raise RendezvousSettingsError(f"--rdzv-conf token_file={path}: must hold one token on one line")
    return token


def read_settings(endpoint: str, run_id: str, config: Mapping[str, Any],
                  environ: Mapping[str, str] | None = None) -> RendezvousSettings:
    """The settings of torchrun's ``--rdzv-endpoint``, ``--rdzv-id`` and ``--rdzv-conf`` (torch's
    ``RendezvousParameters.endpoint``, ``.run_id``, ``.config``); ``environ``: the environment
    (default ``os.environ``) for ``LIGHTHOUSE_JOB`` and the TLS variables."""
    env = os.environ if environ is None else environ
    unknown = sorted(k for k in config if k not in CONF_KEYS and k not in TORCH_CONF_KEYS)
    if unknown:
        raise RendezvousSettingsError(f"--rdzv-conf {unknown[0]}: not a setting of the {BACKEND_NAME} backend "
                                      f"(its keys: {', '.join(CONF_KEYS)}; torch's: {', '.join(TORCH_CONF_KEYS[1:])})")
    if not endpoint or not endpoint.strip():
        raise RendezvousSettingsError(f"--rdzv-endpoint is empty: give the cluster's nodes, e.g. {EXAMPLE}")
    try:
        parsed = parse_endpoints(endpoint)
    except ValueError as e:
        raise RendezvousSettingsError(f"--rdzv-endpoint {endpoint!r}: {e}") from None
    try:
        job = select_job(str(config.get("job") or "") or None, endpoint, env).name
    except ValueError as e:
        raise RendezvousSettingsError(f"the rendezvous job: {e}") from None
    try:
        check_namespace(job, run_id or "")
    except KVError as e:
        raise RendezvousSettingsError(f"--rdzv-id {run_id!r}: {e}") from None
    try:
        tls = client_tls_for(endpoint, config.get("tls_ca") or None, config.get("tls_cert") or None,
                             config.get("tls_key") or None, env=env)
    except TLSConfigError as e:
        raise RendezvousSettingsError(f"--rdzv-conf tls_ca/tls_cert/tls_key: {e}") from None
    return RendezvousSettings(
        addresses=parsed.addresses, job=job, run_id=run_id, tls=tls, token=_token(config.get("token_file")),
        read_timeout_s=_seconds(config, "read_timeout", DEFAULT_READ_TIMEOUT_S),
        kv_timeout_s=_seconds(config, "kv_timeout", DEFAULT_KV_TIMEOUT_S))


def is_default_job(settings: RendezvousSettings) -> bool:
    return settings.job == DEFAULT_JOB
