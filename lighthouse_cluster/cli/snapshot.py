"""`lighthouse-cluster snapshot save/restore`: the replicated state to a file and back."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from lighthouse_cluster.cli.app import main
from lighthouse_cluster.cli.options import ClientOptions, admin_call, client_options, exit_config_error
from lighthouse_cluster.durable_files import write_durably
from lighthouse_cluster.server.config import ConfigError


# -- snapshot --------------------------------------------------------------------------------------

SNAPSHOT_FORMAT = "lighthouse-cluster-snapshot"


@main.group()
def snapshot() -> None:
    """Save the replicated state to a file, or restore a saved quorum into a running cluster."""


def _snapshot_table(title: str, rows: dict[str, Any], output: str) -> None:
    if output == "json":
        click.echo(json.dumps(rows, indent=2))
        return
    from lighthouse_cluster.cli.output import print_record

    flat = {k: str(v) for k, v in rows.items() if k != "jobs"}
    for name, j in rows.get("jobs", {}).items():
        flat[f"job {name}"] = (("created, " if j["created"] else "") + f"quorum id {j['previous_quorum_id']} -> "
                               f"{j['quorum_id']}" + (f" ({j['not_restored']})" if j.get("not_restored") else ""))
    print_record(title, flat)


@snapshot.command("save")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@client_options(admin=True)
def snapshot_save(file: Path, client: ClientOptions) -> None:
    """Write a consistent snapshot of the replicated state, taken on the leader, to FILE."""
    import base64

    from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb

    admin = client.admin_client(with_token=True)
    snap = admin_call(lambda: admin.call("SaveSnapshot", cpb.SnapshotRequest()))
    meta = {"format": SNAPSHOT_FORMAT, "format_version": 1, "leader_id": snap.leader_id, "term": snap.term,
            "last_applied": snap.last_applied, "quorum_id": snap.quorum_id, "taken_ms": snap.taken_ms,
            "schema_version": snap.schema_version}
    try:  # a backup: on disk (temp file, fsync, rename, directory fsync) before "saved" is printed
        write_durably(file, json.dumps({**meta, "state": base64.b64encode(snap.state).decode()}, indent=1).encode(),
                      mode=0o600)
    except OSError as e:
        click.echo(f"error: cannot write {file}: {e.strerror}", err=True)
        sys.exit(1)
    _snapshot_table(f"snapshot saved to {file}", {**meta, "file": str(file), "bytes": len(snap.state)},
                    client.output)


@snapshot.command("restore")
@click.argument("file", type=click.Path(dir_okay=False, exists=True, path_type=Path))
@client_options(admin=True)
def snapshot_restore(file: Path, client: ClientOptions) -> None:
    """Commit FILE's quorum in a running cluster whose quorum id is below it (e.g. a cluster
    rebuilt from empty data directories), so quorum ids continue after it."""
    import base64
    import binascii

    from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb

    try:
        data = json.loads(file.read_text())
        if data.get("format") != SNAPSHOT_FORMAT:
            raise ValueError("not a lighthouse-cluster snapshot file")
        state = base64.b64decode(data["state"], validate=True)
    except (OSError, ValueError, KeyError, TypeError, binascii.Error) as e:
        exit_config_error(ConfigError(f"cannot read snapshot {file}: {e}"))
    admin = client.admin_client(with_token=True)
    r = admin_call(lambda: admin.call("RestoreSnapshot", cpb.Snapshot(
        state=state, term=data.get("term", 0), last_applied=data.get("last_applied", 0),
        quorum_id=data.get("quorum_id", 0), leader_id=data.get("leader_id", ""))))
    shown: dict[str, Any] = {"applied": r.applied, "quorum_id": r.quorum_id, "previous_quorum_id": r.previous_quorum_id}
    if r.jobs:  # the snapshot's other jobs: name -> what happened to it
        shown["jobs"] = {j.name: {"created": j.created, "quorum_id": j.quorum_id,
                                  "previous_quorum_id": j.previous_quorum_id,
                                  **({"not_restored": j.not_restored} if j.not_restored else {})} for j in r.jobs}
    _snapshot_table(f"snapshot {file} restored", shown, client.output)
