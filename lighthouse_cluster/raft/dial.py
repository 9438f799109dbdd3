"""Peers dialed somewhere other than their Raft address (``--raft-dial``: NAT, port forwarding, a
fault-injection proxy): ``DialNode`` and ``peer_nodes``, the pysyncobj node objects with the
overrides applied."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lighthouse_cluster.raft.pysyncobj_internals import TCPNode, resolve_host


class DialNode(TCPNode):
    """A peer whose identity is its Raft address but which is dialed at ``dial_address``.

    pysyncobj identifies a peer by ``address`` everywhere (equality and hashing go through the
    id, which is the address; the greater address dials; the dialer announces its own address
    as the first message, and the acceptor looks that string up), and dials ``(ip, port)``
    only (``TCPTransport._connectIfNecessarySingle``). Overriding ``ip``/``port`` therefore
    changes where this node connects to and nothing else. The override is local: it pickles as
    a plain ``TCPNode`` (pysyncobj puts the cluster's nodes into every snapshot, and snapshots
    go to other nodes), so journals and snapshots are the same as without it.
    """

    def __init__(self, address: str, dial_address: str) -> None:
        super().__init__(address)
        host, port = dial_address.rsplit(":", 1)
        self.dial_address = dial_address
        self._dial_host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        self._dial_port = int(port)

    @property
    def ip(self) -> str | None:  # type: ignore[override]
        return resolve_host(self._dial_host)

    @property
    def port(self) -> int:  # type: ignore[override]
        return self._dial_port

    def __reduce__(self) -> tuple[Any, ...]:
        return (TCPNode, (self.address,))

    def __copy__(self) -> DialNode:  # copies stay local: keep the override
        return DialNode(self.address, self.dial_address)

    def __deepcopy__(self, memo: dict[int, Any]) -> DialNode:
        return self.__copy__()


def peer_nodes(peer_addresses: list[str],
               dial: Mapping[str, str]) -> tuple[list[TCPNode], Callable[[str], TCPNode]]:
    """pysyncobj node objects for ``peer_addresses`` with the ``dial`` overrides (Raft address
    -> host:port) applied, and a ``nodeClass`` factory that applies them to any node pysyncobj
    builds later. Raises ValueError for an override naming no peer."""
    unknown = sorted(set(dial) - set(peer_addresses))
    if unknown:
        raise ValueError(f"dial overrides for addresses that are not peers: {unknown}")

    def make(address: str) -> TCPNode:
        return DialNode(address, dial[address]) if address in dial else TCPNode(address)

    return [make(a) for a in peer_addresses], make
