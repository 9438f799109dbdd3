"""The member table a node persists in its data directory (``members.json``), for restarts.

Once an admin changed the cluster's members (``admin.NodeAdmin``), the table (id, Raft address,
client address per node) is replicated through the state machine; each node writes the version
it adopted here, so that it restarts with the current members instead of its original --peer
list. A table that no longer names the node (it was removed) is ignored.
"""

from __future__ import annotations

import json
import logging

from lighthouse_cluster.durable_files import write_durably
from lighthouse_cluster.server.config import NodeConfig, PeerSpec

log = logging.getLogger(__name__)

MEMBERS_FILE = "members.json"


def load_members(config: NodeConfig) -> tuple[PeerSpec, ...] | None:
    """The member table this node last saw committed (in its data directory), if it has one
    that still names this node; a restart then needs no updated --peer list."""
    if config.data_dir is None:
        return None
    path = config.data_dir / MEMBERS_FILE
    try:
        data = json.loads(path.read_text())
        members = tuple(PeerSpec(*m) for m in data["members"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring %s (%s); using the --peer list", path, e)
        return None
    if config.node_id not in {m.node_id for m in members}:
        log.warning("%s does not name this node (it was removed); using the --peer list", path)
        return None
    log.info("members from %s (version %s): %s", path, data.get("version"), ", ".join(str(m) for m in members))
    return members


def save_members(config: NodeConfig, version: int, members: tuple[PeerSpec, ...]) -> None:
    """Write ``members`` (replicated table ``version``) atomically and durably; a failure is logged,
    not raised."""
    if config.data_dir is None:
        return
    path = config.data_dir / MEMBERS_FILE
    try:
        # Durably (durable_files): a restart after a power loss must not find the file half written.
        write_durably(path, json.dumps({"version": version, "members": [
            [m.node_id, m.raft_address, m.client_address] for m in members]}, indent=1).encode(),
            sync=not config.unsafe_no_fsync)
    except OSError as e:
        log.warning("cannot save the member table to %s: %s", path, e)
