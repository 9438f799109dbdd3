"""Network backends behind one interface (``NetworkBackend``), chosen by name.

Every backend has ``setup()``, ``teardown()`` (idempotent), ``isolate(i)``,
``partition(*sides)``, ``cut(src, dst)``, ``heal()`` and ``blocked`` (the directed node pairs
currently dropped), with nodes numbered ``0 .. n-1`` as in ``LocalCluster``, and wires the
cluster's nodes through itself in two steps: ``cluster_kwargs()`` (extra ``LocalCluster``
keyword arguments: ``hosts``, ``launch_prefix``...) and ``attach(cluster)`` (called once the
cluster object exists, before any node starts).

* ``netns`` (``jepsen_like.netns.NetnsNetwork``): one Linux network namespace per node and
  nftables/iptables DROP rules; root only. The default when ``netns.available()``.
* ``proxy`` (``jepsen_like.proxy.ProxyNetwork``): a userspace TCP proxy per directed link; no root.
* ``none`` (``NoNetwork``): no network faults at all (process faults only); every fault raises.

Both backend modules import with the standard library alone; whether a backend can run here
(root, ``ip``, ``nft``) is asked of its ``available()`` when it is chosen, and a backend that
cannot run raises ``BackendUnavailable`` saying why. A backend module that is broken fails at
import, loudly.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar, Iterable, Protocol

from . import netns, proxy

BACKENDS = ("netns", "proxy", "none")


class NetworkBackend(Protocol):
    name: ClassVar[str]

    def setup(self) -> Any: ...
    def teardown(self) -> None: ...
    def cluster_kwargs(self) -> dict[str, Any]: ...
    def attach(self, cluster: Any) -> None: ...
    def isolate(self, node: int) -> None: ...
    def partition(self, *sides: Iterable[int]) -> None: ...
    def cut(self, src: int, dst: int) -> None: ...
    def heal(self) -> None: ...
    @property
    def blocked(self) -> frozenset[tuple[int, int]]: ...


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here; the message says why and what to do."""


class NoNetwork:
    """The ``none`` backend: nodes on loopback, no network faults."""

    name: ClassVar[str] = "none"

    def __init__(self, nodes: int) -> None:
        self.nodes = nodes

    def setup(self) -> "NoNetwork":
        return self

    def teardown(self) -> None:
        pass

    def cluster_kwargs(self) -> dict[str, Any]:
        return {}

    def attach(self, cluster: Any) -> None:
        pass

    def _refuse(self, *args: object) -> None:
        raise BackendUnavailable("the 'none' network backend injects no network faults (use --backend netns or proxy)")

    isolate = partition = cut = _refuse

    def heal(self) -> None:
        pass

    @property
    def blocked(self) -> frozenset[tuple[int, int]]:
        return frozenset()


def default_backend() -> str:
    """``netns`` when running as root and namespaces work here, else ``proxy``."""
    if os.geteuid() == 0:
        ok, _why = netns.available()
        if ok:
            return "netns"
    return "proxy"


def make_network(name: str, nodes: int, **options: Any) -> NetworkBackend:
    """A backend object (not yet set up). ``name`` is ``netns``, ``proxy``, ``none`` or ``auto``;
    raises ``BackendUnavailable`` (with the reason) when it cannot run here."""
    if name == "auto":
        name = default_backend()
    if name == "none":
        return NoNetwork(nodes)
    if name == "netns":
        ok, why = netns.available()
        if not ok:
            raise BackendUnavailable(f"netns backend unavailable: {why}; try --backend proxy")
        return netns.NetnsNetwork(nodes, **options)
    if name == "proxy":
        ok, why = proxy.available()
        if not ok:
            raise BackendUnavailable(f"proxy backend unavailable: {why}")
        return proxy.ProxyNetwork(nodes, **options)
    raise BackendUnavailable(f"unknown network backend {name!r}; choose one of {', '.join(BACKENDS)} or auto")
