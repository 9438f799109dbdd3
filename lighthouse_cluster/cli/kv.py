"""`lighthouse-cluster rendezvous list/show/remove`: the training runs' rendezvous state (the
replicated key-value store, one namespace per job and run id; ``client/kv_client.py``). A bad
local input or a request the node refused exits 2, an unreachable cluster 1."""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable

import click

from lighthouse_cluster.cli.app import main
from lighthouse_cluster.cli.options import ClientOptions, client_options

# Values longer than this are cut in the table (json shows them whole, base64 when not text).
SHOWN_VALUE_CHARS = 60


def _kv_call(fn: Callable[[], Any]) -> Any:
    """Run ``fn()``; a refusal is one line and exit 2, an unreachable cluster one line and exit 1."""
    from lighthouse_cluster.client.kv_client import KVError, KVUnavailable

    try:
        return fn()
    except KVError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1 if isinstance(e, KVUnavailable) else 2)


def _cluster(client: ClientOptions, with_token: bool = False) -> Any:
    from lighthouse_cluster.client.kv_client import KVCluster

    if with_token:
        client.need_token()
    addresses, tls = client.dial()
    return KVCluster(addresses, tls=tls, token=client.admin_token if with_token else None, timeout=client.timeout)


def _age(ms: int) -> str:
    if not ms:
        return "-"
    s = max(0.0, time.time() - ms / 1000)
    return f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f}m ago" if s < 7200 else f"{s / 3600:.1f}h ago"


def _round(n: Any) -> str:
    """A run's rendezvous round as ``rendezvous list`` shows it: "3 complete", "4 waiting",
    "unknown" (a state without a summary), "-" (no torchrun state, or an older node)."""
    if n.rendezvous in ("complete", "waiting", "closed"):
        return f"{n.round} {n.rendezvous}"
    return "unknown" if n.rendezvous == "unknown" else "-"


def _value_json(value: bytes) -> dict[str, str]:
    import base64

    try:
        return {"value": value.decode()}
    except UnicodeDecodeError:
        return {"value_base64": base64.b64encode(value).decode()}


def _value_text(value: bytes) -> str:
    """``value`` as one line of text a terminal shows as it is: bytes that are not UTF-8 and
    characters that are not printable (a pickled state's control bytes, an escape sequence)
    written as backslash escapes."""
    text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in value.decode(errors="backslashreplace"))
    return text if len(text) <= SHOWN_VALUE_CHARS else text[:SHOWN_VALUE_CHARS] + f"... ({len(value)} bytes)"


@main.group()
def rendezvous() -> None:
    """List, show and remove the training runs' rendezvous state.

    Each run (job and run id) has its own namespace of versioned keys in the cluster's replicated
    key-value store, written by its trainers' rendezvous (torchrun). Namespaces no write touched
    for the idle expiry (24 h by default) are dropped by the cluster itself."""


@rendezvous.command("list")
@click.option("--job", default="", help="Only this job's runs.")
@client_options()
def list_(client: ClientOptions, job: str) -> None:
    """Every rendezvous namespace: job, run id, torchrun's round, keys, bytes, last write."""
    from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb

    with _cluster(client) as cluster:
        r = _kv_call(lambda: cluster.call("ListNamespaces", cpb.KVListNamespacesRequest(job=job)))
    if client.output == "json":
        click.echo(json.dumps({"idle_expiry_s": r.idle_expiry_ms / 1000, "namespaces": [
            {"job": n.ns.job, "run_id": n.ns.run_id, "keys": n.keys, "bytes": n.bytes, "created_ms": n.created_ms,
             "touched_ms": n.touched_ms, "rendezvous": n.rendezvous or None,
             **({"round": n.round, "participants": n.participants, "waiting": n.waiting}
                if n.rendezvous in ("complete", "waiting", "closed") else {})} for n in r.namespaces]}, indent=2))
        return
    from lighthouse_cluster.cli.output import print_table

    print_table(f"rendezvous namespaces (idle ones expire after {r.idle_expiry_ms / 1000:g} s)",
                ("job", "run id", "round", "keys", "bytes", "created", "last write"),
                [(n.ns.job, n.ns.run_id, _round(n), n.keys, n.bytes, _age(n.created_ms), _age(n.touched_ms))
                 for n in r.namespaces], wide=("run id",), record="rendezvous")


@rendezvous.command("show")
@click.argument("job")
@click.argument("run_id")
@click.option("--prefix", default="", help="Only keys starting with this.")
@click.option("--limit", type=click.IntRange(min=0), default=0, help="At most this many keys (0: the cluster's limit).")
@client_options()
def show(client: ClientOptions, job: str, run_id: str, prefix: str, limit: int) -> None:
    """One run's keys, with their versions and values."""
    from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb

    with _cluster(client) as cluster:
        r = _kv_call(lambda: cluster.call("List", cpb.KVListRequest(
            ns=cpb.KVNamespace(job=job, run_id=run_id), prefix=prefix, limit=limit, values=True)))
    if client.output == "json":
        click.echo(json.dumps({"job": job, "run_id": run_id, "total": r.total, "keys": [
            {"key": e.key, "version": e.version, **_value_json(e.value)} for e in r.entries]}, indent=2))
        return
    from lighthouse_cluster.cli.output import print_table

    print_table(f"rendezvous {job}/{run_id}: {r.total} keys" + (f" (first {len(r.entries)})"
                                                              if len(r.entries) < r.total else ""),
                ("key", "version", "value"), [(e.key, e.version, _value_text(e.value)) for e in r.entries],
                wide=("key", "value"), record="key")


@rendezvous.command("remove")
@click.argument("job")
@click.argument("run_id")
@client_options(admin=True)
def remove(client: ClientOptions, job: str, run_id: str) -> None:
    """Remove one run's rendezvous namespace and its keys (admin token)."""
    from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb

    with _cluster(client, with_token=True) as cluster:
        r = _kv_call(lambda: cluster.call("DropNamespace", cpb.KVDropRequest(ns=cpb.KVNamespace(job=job,
                                                                                            run_id=run_id))))
    if client.output == "json":
        click.echo(json.dumps({"job": job, "run_id": run_id, "removed": r.dropped, "keys": r.keys}))
    elif r.dropped:
        click.echo(f"rendezvous {job}/{run_id} removed ({r.keys} keys)")
    else:
        click.echo(f"no rendezvous {job}/{run_id}: nothing to remove")
