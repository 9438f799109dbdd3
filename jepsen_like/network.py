"""Network backends behind one interface, chosen by name, imported lazily.

Every backend has ``setup()``, ``teardown()`` (idempotent), ``isolate(i)``,
``partition(*sides)``, ``cut(src, dst)``, ``heal()`` and ``blocked`` (the directed node pairs
currently dropped), with nodes numbered ``0 .. n-1`` as in ``LocalCluster``:

* ``netns`` (``jepsen_like.netns.NetnsNetwork``): one Linux network namespace per node and
  nftables/iptables DROP rules; root only. The default when ``netns.available()``.
* ``proxy`` (``jepsen_like.proxy``): a userspace TCP proxy per directed link; no root.
* ``none``: no network faults at all (process faults only); every fault raises.

How a backend wires ``LocalCluster`` nodes through itself (``cluster_kwargs``): a backend may
define ``cluster_kwargs() -> dict`` (extra ``LocalCluster`` keyword arguments: ``hosts``,
``launch_prefix``, ports, ``extra_args``...) and ``attach(cluster)`` (called once the cluster
object exists, before any node starts). ``NetnsNetwork`` has neither; its wiring is
``hosts=net.addresses, launch_prefix=net.exec_prefix``.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Iterable, Protocol

BACKENDS = ("netns", "proxy", "none")


class NetworkBackend(Protocol):
    def setup(self) -> Any: ...
    def teardown(self) -> None: ...
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

    def __init__(self, nodes: int) -> None:
        self.nodes = nodes

    def setup(self) -> "NoNetwork":
        return self

    def teardown(self) -> None:
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
        from . import netns
        ok, _why = netns.available()
        if ok:
            return "netns"
    return "proxy"


def make_network(name: str, nodes: int, **options: Any) -> NetworkBackend:
    """A backend object (not yet set up). ``name`` is ``netns``, ``proxy``, ``none`` or ``auto``."""
    if name == "auto":
        name = default_backend()
    if name == "none":
        return NoNetwork(nodes)
    if name == "netns":
        from . import netns
        ok, why = netns.available()
        if not ok:
            raise BackendUnavailable(f"netns backend unavailable: {why}; try --backend proxy")
        return netns.NetnsNetwork(nodes, **options)
    if name == "proxy":
        try:
            proxy = importlib.import_module("jepsen_like.proxy")
        except ImportError as e:
            raise BackendUnavailable(f"proxy backend unavailable ({e}); try --backend netns as root") from e
        cls = getattr(proxy, "ProxyNetwork", None)
        if cls is None:
            raise BackendUnavailable("jepsen_like.proxy has no ProxyNetwork class")
        available = getattr(proxy, "available", None)
        if available is not None:
            ok, why = available()
            if not ok:
                raise BackendUnavailable(f"proxy backend unavailable: {why}")
        return cls(nodes, **options)
    raise BackendUnavailable(f"unknown network backend {name!r}; choose one of {', '.join(BACKENDS)} or auto")


def backend_name(net: Any) -> str:
    if isinstance(net, NoNetwork):
        return "none"
    return "netns" if type(net).__name__ == "NetnsNetwork" else "proxy"


def cluster_kwargs(net: Any) -> dict[str, Any]:
    """``LocalCluster`` keyword arguments that put its nodes behind ``net`` (after ``setup()``)."""
    if hasattr(net, "cluster_kwargs"):
        return dict(net.cluster_kwargs())
    if hasattr(net, "exec_prefix") and hasattr(net, "addresses"):
        return {"hosts": list(net.addresses), "launch_prefix": net.exec_prefix}
    return {}


def attach(net: Any, cluster: Any) -> None:
    """Let a backend that needs the cluster's ports see it before the nodes start."""
    hook = getattr(net, "attach", None)
    if hook is not None:
        hook(cluster)
