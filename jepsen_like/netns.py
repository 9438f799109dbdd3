"""Network partitions between local processes with Linux network namespaces (root only).

``NetnsNetwork`` owns everything it creates, all of it named with a per-run prefix
(``jl-<pid>-<tag>``) so parallel runs never clash:

* one namespace per node (``<prefix>-n<i>``), each with ``lo`` and one veth ``eth0`` holding
  ``<subnet>.<10 + i>/24``;
* a hub namespace (``<prefix>-hub``) holding a bridge that every node's veth is attached to.
  The bridge lives in its own namespace, not the root one, so the host's firewall (for example
  Docker's ``FORWARD DROP`` with ``br_netfilter``) never sees node-to-node traffic;
* one veth in the root namespace (``jl<tag>r``) holding ``<subnet>.1/24`` and attached to the
  bridge: the test process reaches every node (client gRPC ports, status) through it;
* a private ``/24`` (``10.213.X.0/24`` by default) picked under a file lock so that no two runs
  and no existing route on the host use the same one. Traffic stays between these namespaces.

Faults are ``DROP`` rules on *node addresses only*, installed atomically inside the node
namespaces (nftables table ``inet jepsen_like``, or an ``iptables-restore`` of the filter
table when ``nft`` is missing): ``isolate(i)`` cuts node ``i`` from every other node both ways,
``partition(...)`` cuts between sides, ``cut(a, b)`` drops ``a -> b`` only, ``heal()`` removes
every rule. The root address is never blocked, so clients keep reaching an isolated node,
exactly as clients on the far side of a real partition would keep reaching the minority.

``teardown()`` is idempotent, also runs after a partial ``setup()``, kills any process still
inside the node namespaces (only this run's processes can be there), deletes the namespaces
(which destroys the bridge and every veth), and raises if anything is left behind.

Debian packages: ``iproute2`` (``ip``) and ``nftables`` (``nft``) or ``iptables``.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterable, Sequence

__all__ = ["NetnsError", "NetnsNetwork", "available", "cleanup_stale"]

NAME_PREFIX = "jl"
NFT_TABLE = "jepsen_like"
DEFAULT_SUBNET_BASE = "10.213"
LOCK_PATH = Path("/run/lock/jepsen_like-netns.lock")
NODE_HOST_OFFSET = 10
_CMD_TIMEOUT_S = 10.0


class NetnsError(RuntimeError):
    """A namespace operation failed; the message names the command and its stderr."""


def _run(cmd: Sequence[str], *, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(list(cmd), input=input, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetnsError(f"{' '.join(cmd)}: {e}") from e
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _firewall_tool() -> str | None:
    if shutil.which("nft"):
        return "nft"
    if shutil.which("iptables-restore"):
        return "iptables"
    return None


def list_namespaces() -> list[str]:
    """Names of every named network namespace (``ip netns list``)."""
    proc = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _root_links() -> list[str]:
    proc = _run(["ip", "-o", "link", "show"], check=False)
    names = []
    for line in proc.stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@", 1)[0])
    return names


_available_cache: tuple[bool, str] | None = None


def available() -> tuple[bool, str]:
    """Whether this process can build namespaces with firewall rules, and if not, why.

    Checks: running as root, ``ip`` and ``nft``/``iptables-restore`` on PATH, and that a probe
    namespace with a veth and a DROP rule can really be created (then removes it).
    """
    global _available_cache
    if _available_cache is not None:
        return _available_cache
    _available_cache = _probe()
    return _available_cache


def _probe() -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "network namespaces need root (run the tests as root)"
    if shutil.which("ip") is None:
        return False, "the `ip` tool is missing (apt-get install -y iproute2)"
    tool = _firewall_tool()
    if tool is None:
        return False, "neither `nft` nor `iptables-restore` is installed (apt-get install -y nftables)"
    net = NetnsNetwork(2)
    try:
        net.setup()
        net.isolate(0)  # a real DROP rule in each namespace: proves the firewall works there
        net.heal()
    except (NetnsError, OSError) as e:
        return False, f"cannot create a network namespace with {tool} rules: {e}"
    finally:
        try:
            net.teardown()
        except NetnsError:
            pass
    return True, f"network namespaces with {tool}"


@dataclass
class NetnsNetwork:
    """``nodes`` network namespaces on one bridge; see the module docstring.

    Nodes are numbered ``0 .. nodes-1`` (the ``LocalCluster`` member index). Use as a context
    manager, or call ``setup()`` and always ``teardown()``.
    """

    name: ClassVar[str] = "netns"
    nodes: int
    subnet_base: str = DEFAULT_SUBNET_BASE
    firewall: str | None = None  # "nft" or "iptables"; default: nft if installed
    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    subnet: ipaddress.IPv4Network | None = field(init=False, default=None)
    _blocked: set[tuple[int, int]] = field(init=False, default_factory=set)
    _installed: dict[int, frozenset[tuple[int, int]]] = field(init=False, default_factory=dict)
    _created: bool = field(init=False, default=False)
    prefix: str = field(init=False, default="")        # every namespace name starts with it
    root_link: str = field(init=False, default="")     # the veth in the root namespace
    hub: str = field(init=False, default="")           # the namespace holding the bridge
    namespaces: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.nodes > 200:
            raise ValueError("nodes must be 1..200")
        if not re.fullmatch(r"[0-9a-f]{1,8}", self.tag):
            raise ValueError("tag must be 1-8 lowercase hex digits")
        self.firewall = self.firewall or _firewall_tool()
        self.prefix = f"{NAME_PREFIX}-{os.getpid()}-{self.tag}"
        self.root_link = f"{NAME_PREFIX}{self.tag}r"  # <= 15 characters (IFNAMSIZ)
        self.hub = f"{self.prefix}-hub"
        self.namespaces = [f"{self.prefix}-n{i}" for i in range(self.nodes)]

    # -- addresses ----------------------------------------------------------------------------

    def address(self, i: int) -> str:
        """Node ``i``'s IPv4 address (valid after ``setup()``)."""
        if self.subnet is None:
            raise NetnsError("setup() has not run")
        return str(self.subnet.network_address + NODE_HOST_OFFSET + i)

    @property
    def addresses(self) -> list[str]:
        return [self.address(i) for i in range(self.nodes)]

    @property
    def root_address(self) -> str:
        """The root namespace's address on the bridge (where client traffic comes from)."""
        if self.subnet is None:
            raise NetnsError("setup() has not run")
        return str(self.subnet.network_address + 1)

    def namespace(self, i: int) -> str:
        return self.namespaces[i]

    def exec_prefix(self, i: int) -> list[str]:
        """Prefix a command with this to run it inside node ``i``'s namespace (same PID: ``ip
        netns exec`` execs the command, so signals reach it directly)."""
        return ["ip", "netns", "exec", self.namespaces[i]]

    def run(self, i: int, cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` inside node ``i``'s namespace and return the completed process."""
        return _run([*self.exec_prefix(i), *cmd], check=check)

    # The two hooks of ``jepsen_like.network.NetworkBackend``.

    def cluster_kwargs(self) -> dict[str, Any]:
        """``LocalCluster`` keyword arguments that put node ``i`` at ``address(i)`` inside its
        namespace (after ``setup()``)."""
        return {"hosts": self.addresses, "launch_prefix": self.exec_prefix}

    def attach(self, cluster: Any) -> None:
        """Nothing to do: the namespaces need no port of the cluster's."""

    # -- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> "NetnsNetwork":
        return self.setup()

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def setup(self) -> "NetnsNetwork":
        """Create the namespaces, bridge and veths. On failure everything made so far is
        removed and ``NetnsError`` is raised."""
        if self._created:
            raise NetnsError("setup() already ran")
        self._created = True
        try:
            _run(["ip", "netns", "add", self.hub])
            _run(["ip", "-n", self.hub, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", self.hub, "link", "set", "br0", "up"])
            for i, ns in enumerate(self.namespaces):
                _run(["ip", "netns", "add", ns])
                _run(["ip", "-n", self.hub, "link", "add", f"n{i}", "type", "veth", "peer", "name", "eth0",
                      "netns", ns])
                _run(["ip", "-n", self.hub, "link", "set", f"n{i}", "master", "br0", "up"])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "link", "add", self.root_link, "type", "veth", "peer", "name", "root", "netns", self.hub])
            _run(["ip", "link", "set", self.root_link, "alias", f"jepsen_like pid={os.getpid()} tag={self.tag}"])
            _run(["ip", "-n", self.hub, "link", "set", "root", "master", "br0", "up"])
            with _subnet_lock():
                self.subnet = _pick_subnet(self.subnet_base)
                _run(["ip", "addr", "add", f"{self.root_address}/24", "dev", self.root_link])
            _run(["ip", "link", "set", self.root_link, "up"])
            for i, ns in enumerate(self.namespaces):
                _run(["ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0"])
                _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            self._apply()
        except BaseException:
            try:
                self.teardown()
            except NetnsError:
                pass
            raise
        return self

    def teardown(self) -> None:
        """Remove everything this network made (idempotent); raise ``NetnsError`` if some of
        it could not be removed."""
        if not self._created:
            return
        existing = set(list_namespaces())
        mine = [ns for ns in [*self.namespaces, self.hub] if ns in existing]
        for ns in mine:
            _kill_namespace_processes(ns)
        for ns in mine:
            _run(["ip", "netns", "delete", ns], check=False)
        if self.root_link in _root_links():
            _run(["ip", "link", "delete", self.root_link], check=False)
        self._blocked.clear()
        self._installed.clear()
        left = self.leftovers()
        deadline = time.monotonic() + 5.0
        while left and time.monotonic() < deadline:  # a veth can outlive its namespace briefly
            time.sleep(0.05)
            for ns in left:
                if ns in self.namespaces or ns == self.hub:
                    _run(["ip", "netns", "delete", ns], check=False)
                elif ns == self.root_link:
                    _run(["ip", "link", "delete", ns], check=False)
            left = self.leftovers()
        if left:
            raise NetnsError(f"could not remove {left}")

    def leftovers(self) -> list[str]:
        """Namespaces and root links of this network that still exist."""
        names = set(list_namespaces())
        left = [ns for ns in [*self.namespaces, self.hub] if ns in names]
        if self.root_link in _root_links():
            left.append(self.root_link)
        return left

    # -- faults -------------------------------------------------------------------------------

    def isolate(self, node: int) -> None:
        """Drop all traffic between ``node`` and every other node, both ways (the root
        namespace, i.e. clients, still reaches it)."""
        self.partition([node], [j for j in range(self.nodes) if j != node])

    def partition(self, *sides: Iterable[int]) -> None:
        """Drop all traffic between nodes on different sides, both ways (adds to existing cuts).
        Nodes listed on no side keep talking to everyone."""
        groups = [list(s) for s in sides]
        for gi, a_side in enumerate(groups):
            for gj, b_side in enumerate(groups):
                if gi != gj:
                    for a in a_side:
                        for b in b_side:
                            self._blocked.add((self._check(a), self._check(b)))
        self._apply()

    def cut(self, src: int, dst: int) -> None:
        """Drop packets from ``src`` to ``dst`` only (TCP between them then stalls both ways,
        but the direction is what a one-way network fault looks like on the wire)."""
        if self._check(src) == self._check(dst):
            raise ValueError("cannot cut a node from itself")
        self._blocked.add((src, dst))
        self._apply()

    def heal(self) -> None:
        """Remove every cut."""
        self._blocked.clear()
        self._apply()

    @property
    def blocked(self) -> frozenset[tuple[int, int]]:
        """The directed (src, dst) node pairs currently dropped."""
        return frozenset(self._blocked)

    def _check(self, i: int) -> int:
        if not 0 <= i < self.nodes:
            raise ValueError(f"no node {i} (have 0..{self.nodes - 1})")
        return i

    def _apply(self) -> None:
        """Install, in every namespace whose rule set changed, its full rule set atomically.
        A directed cut (a, b) is dropped at both ends: output to b in a, input from a in b."""
        for i in range(self.nodes):
            rules = frozenset(p for p in self._blocked if i in p)
            if self._installed.get(i, frozenset()) == rules and i in self._installed:
                continue
            drop_in = sorted({self.address(a) for a, b in rules if b == i})
            drop_out = sorted({self.address(b) for a, b in rules if a == i})
            if self.firewall == "nft":
                _run([*self.exec_prefix(i), "nft", "-f", "-"], input=_nft_script(drop_in, drop_out))
            elif self.firewall == "iptables":
                _run([*self.exec_prefix(i), "iptables-restore", "-w"], input=_iptables_script(drop_in, drop_out))
            else:
                raise NetnsError("no firewall tool: apt-get install -y nftables (or iptables)")
            self._installed[i] = rules


def _nft_script(drop_in: list[str], drop_out: list[str]) -> str:
    lines = [f"table inet {NFT_TABLE}", f"delete table inet {NFT_TABLE}", f"table inet {NFT_TABLE} {{",
             "  chain input {", "    type filter hook input priority -150; policy accept;"]
    if drop_in:
        lines.append(f"    ip saddr {{ {', '.join(drop_in)} }} drop")
    lines += ["  }", "  chain output {", "    type filter hook output priority -150; policy accept;"]
    if drop_out:
        lines.append(f"    ip daddr {{ {', '.join(drop_out)} }} drop")
    lines += ["  }", "}", ""]
    return "\n".join(lines)


def _iptables_script(drop_in: list[str], drop_out: list[str]) -> str:
    lines = ["*filter", ":INPUT ACCEPT [0:0]", ":FORWARD ACCEPT [0:0]", ":OUTPUT ACCEPT [0:0]"]
    lines += [f"-A INPUT -s {a}/32 -j DROP" for a in drop_in]
    lines += [f"-A OUTPUT -d {a}/32 -j DROP" for a in drop_out]
    lines += ["COMMIT", ""]
    return "\n".join(lines)


class _subnet_lock:
    """An exclusive file lock so two runs never pick the same /24 at the same time."""

    def __enter__(self) -> None:
        LOCK_PATH.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(LOCK_PATH, "a")
        fcntl.flock(self._f, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._f, fcntl.LOCK_UN)
        self._f.close()


def _pick_subnet(base: str) -> ipaddress.IPv4Network:
    """A ``<base>.X.0/24`` that no address or route of the root namespace overlaps."""
    used: list[ipaddress.IPv4Network] = []
    for cmd in (["ip", "-o", "-4", "addr", "show"], ["ip", "-4", "route", "show", "table", "all"]):
        for token in _run(cmd, check=False).stdout.split():
            if re.fullmatch(r"\d+\.\d+\.\d+\.\d+(/\d+)?", token):
                try:
                    used.append(ipaddress.ip_network(token, strict=False))
                except ValueError:
                    pass
    start = secrets.randbelow(256)
    for k in range(256):
        candidate = ipaddress.ip_network(f"{base}.{(start + k) % 256}.0/24")
        if not any(candidate.overlaps(u) for u in used if u.prefixlen > 0):
            return candidate
    raise NetnsError(f"no free /24 under {base}.0.0/16")


def _kill_namespace_processes(ns: str) -> None:
    """SIGKILL whatever still runs inside ``ns`` (only this run's own processes can)."""
    for _ in range(3):
        pids = [int(p) for p in _run(["ip", "netns", "pids", ns], check=False).stdout.split() if p.isdigit()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def cleanup_stale() -> list[str]:
    """Remove namespaces (and their processes) and root links left by runs whose process is
    gone (say, a SIGKILLed pytest). Opt-in: it trusts the PID in the names, which is only
    meaningful when every run shares this PID namespace. Returns what it removed."""
    removed = []
    for ns in list_namespaces():
        m = re.fullmatch(rf"{NAME_PREFIX}-(\d+)-([0-9a-f]+)-(hub|n\d+)", ns)
        if m and not _pid_alive(int(m.group(1))):
            _kill_namespace_processes(ns)
            _run(["ip", "netns", "delete", ns], check=False)
            removed.append(ns)
    proc = _run(["ip", "-o", "link", "show"], check=False)
    for line in proc.stdout.splitlines():
        m = re.search(r"^\d+: (\S+?)(@\S+)?: .*alias jepsen_like pid=(\d+)", line)
        if m and not _pid_alive(int(m.group(3))):
            _run(["ip", "link", "delete", m.group(1)], check=False)
            removed.append(m.group(1))
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
