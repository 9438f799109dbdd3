"""The environment variables ftclient reads, and their parsing (pure: pass ``environ`` in tests).

torchft's names and precedence are kept: the timeout variables beat the Manager's arguments,
``TORCHFT_QUORUM_RETRIES`` beats ``quorum_retries``, ``TORCHFT_MANAGER_PORT`` is used only
when no ``port`` is passed, ``TORCHFT_LIGHTHOUSE`` only when no ``lighthouse_addr`` is passed.
``REPLICA_GROUP_ID`` / ``NUM_REPLICA_GROUPS`` are what torchft's launch scripts (torchx) set.
``FTCLIENT_LIVENESS_INTERVAL_MS`` (ftclient's own) beats ``liveness_interval``; 0 turns the liveness
stream off. ``LIGHTHOUSE_JOB`` (ftclient's own, the lighthouse job) is read by
:mod:`ftclient.job_selection`, with its rule against the ``job`` argument and the URL's ``?job=``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
MANAGER_PORT_ENV = "TORCHFT_MANAGER_PORT"
TIMEOUT_SEC_ENV = "TORCHFT_TIMEOUT_SEC"
QUORUM_TIMEOUT_SEC_ENV = "TORCHFT_QUORUM_TIMEOUT_SEC"
CONNECT_TIMEOUT_SEC_ENV = "TORCHFT_CONNECT_TIMEOUT_SEC"
QUORUM_RETRIES_ENV = "TORCHFT_QUORUM_RETRIES"
LIVENESS_INTERVAL_MS_ENV = "FTCLIENT_LIVENESS_INTERVAL_MS"
REPLICA_GROUP_ID_ENV = "REPLICA_GROUP_ID"
NUM_REPLICA_GROUPS_ENV = "NUM_REPLICA_GROUPS"


def _environ(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def env_timeout(name: str, default: timedelta, environ: Mapping[str, str] | None = None) -> timedelta:
    """``timedelta(seconds=$name)`` when the variable is set (it wins, as in torchft), else
    ``default``. Fractional seconds are accepted (torchft takes whole seconds only)."""
    raw = _environ(environ).get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None
    if seconds <= 0:
        raise ValueError(f"{name}={raw!r} must be a positive number of seconds")
    return timedelta(seconds=seconds)


def env_int(name: str, default: int | None, environ: Mapping[str, str] | None = None) -> int | None:
    """``int($name)`` when set, else ``default``; a clear error for a malformed value."""
    raw = _environ(environ).get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def quorum_retries(default: int, environ: Mapping[str, str] | None = None) -> int:
    value = env_int(QUORUM_RETRIES_ENV, default, environ)
    assert value is not None
    if value < 0:
        raise ValueError(f"{QUORUM_RETRIES_ENV} must be >= 0, got {value}")
    return value


def lighthouse_addr(given: str | None, environ: Mapping[str, str] | None = None) -> str:
    """The lighthouse endpoint list: the argument, else ``TORCHFT_LIGHTHOUSE``."""
    value = given or _environ(environ).get(LIGHTHOUSE_ENV, "")
    if not value.strip():
        raise ValueError(f"no lighthouse address: pass lighthouse_addr or set {LIGHTHOUSE_ENV} to one URL "
                         "or a comma-separated list (e.g. http://lh1:29510,http://lh2:29510,http://lh3:29510)")
    return value


def replica_group_id(environ: Mapping[str, str] | None = None) -> int | None:
    """``REPLICA_GROUP_ID`` as set by torchft's launchers, or None."""
    return env_int(REPLICA_GROUP_ID_ENV, None, environ)


def num_replica_groups(environ: Mapping[str, str] | None = None) -> int | None:
    """``NUM_REPLICA_GROUPS`` as set by torchft's launchers, or None."""
    return env_int(NUM_REPLICA_GROUPS_ENV, None, environ)


def liveness_interval(default: timedelta | None, environ: Mapping[str, str] | None = None) -> timedelta | None:
    """The liveness stream's keep-alive period: ``FTCLIENT_LIVENESS_INTERVAL_MS`` when set (0: no
    stream), else ``default``."""
    value = env_int(LIVENESS_INTERVAL_MS_ENV, None, environ)
    if value is None:
        return default
    if value < 0:
        raise ValueError(f"{LIVENESS_INTERVAL_MS_ENV} must be >= 0 (0: no liveness stream), got {value}")
    return None if value == 0 else timedelta(milliseconds=value)
