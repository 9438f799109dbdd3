"""Unchanged torchft trainers survive the permanent loss of their own lighthouse node, given one
host name with an address per node.

torchft's Rust client takes one URL (``TORCHFT_LIGHTHOUSE``), but when it (re)connects it tries
every address the host name resolves to, in order, until one accepts. So a name with one address
per node on a common client port (a Kubernetes headless Service, round-robin DNS, a hosts entry)
is a complete HA path: when the trainers' node dies, the manager's retry (``TORCHFT_QUORUM_RETRIES``)
reconnects to the next address, a live node, which forwards to the (new) leader.

The test runs the three nodes on 127.0.0.2, .3 and .4 with the same client port and gives the
trainers a name, ``NAME``, that resolves to those three addresses. The name lives in a hosts file
that only the trainers see: each trainer runs in a private mount namespace (``unshare --mount
--propagation private``) in which that file is bind-mounted over /etc/hosts; the machine's
/etc/hosts is checked to be unchanged afterwards. The Raft leader's address comes first, so every
trainer connects to the leader (checked from the trainers' open sockets before the kill; when the
resolver sorts another address first, leadership is handed to that node instead); the leader is
then SIGKILLed while Quorum calls wait at it and never restarted. Every trainer must go
on as the same process, reconnect to another address of the name (checked from its sockets again),
commit ``STEPS_AFTER_KILL`` more steps within a bounded time and end with the others at the same
step with bit-identical parameters and optimizer state.

Parametrized over both torchft lines (``tests/support/torchft_lines.py``): torchft 0.2.0 in this
environment and torchft-nightly in its own virtual environment (both install the module
``torchft``). Needs root (a mount namespace and a bind mount) and ``unshare``; skipped otherwise.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

pytest.importorskip("torch", reason="torch is not installed: the torchft training tests need it")
pytest.importorskip("torchft", reason="torchft is not installed: the torchft training tests need it")

from lighthouse_cluster.local.cluster import LocalCluster, free_ports, port_is_free  # noqa: E402
from support.torchft_lines import LINES, python_for, torchft_version  # noqa: E402
from support.trainer_process import TORCHFT_RESTART_ENV, TorchftTrainer  # noqa: E402
from support.training import TrainingRun, median_duration_s, slowest_step_around  # noqa: E402

# The nightly line's first use creates its virtual environment (minutes; bounded by its own pip
# timeout), inside this test's time limit.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

NAME = "lighthouse-ha.test"  # .test: reserved (RFC 2606), never a real name
NODE_HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
HOSTS_FILE = Path("/etc/hosts")
ADMIN_TOKEN = "hosts-ha-test-token"

GROUPS = 3
MIN_REPLICAS = 2  # the cluster's min_replicas and the trainers' min_replica_size: two groups may go on
STEPS = 40
STEP_SLEEP_S = 0.1
KILL_AT_STEP = 8
STEPS_AFTER_KILL = 10
AFTER_KILL_DEADLINE_S = 60.0

# The wrapper every trainer runs in: a new mount namespace whose mounts propagate nowhere
# (private), the test's hosts file bound over /etc/hosts in it only, then exec the trainer (so the
# trainer keeps the pid, and the process group, the harness signals). RESOLV_MULTI=on: glibc
# returns every address of a name in /etc/hosts only with "multi on" (/etc/host.conf; Debian's
# has it, glibc's default is off and returns the first line's address alone).
WRAPPER = 'mount --bind "$0" /etc/hosts && export RESOLV_MULTI=on && exec "$@"'


def namespaced(hosts_file: Path, cmd: list[str]) -> list[str]:
    unshare = shutil.which("unshare") or "unshare"
    return [unshare, "--mount", "--propagation", "private", "sh", "-c", WRAPPER, str(hosts_file), *cmd]


def etc_hosts_state() -> tuple[str, str]:
    """The machine's /etc/hosts as this process sees it: its content's sha256, and the mounts on
    /etc/hosts in this process's mount namespace (none on a normal machine)."""
    digest = hashlib.sha256(HOSTS_FILE.read_bytes()).hexdigest()
    mounts = [line for line in Path("/proc/self/mountinfo").read_text().splitlines()
              if line.split()[4] == str(HOSTS_FILE)]
    return digest, "\n".join(mounts)


def hosts_file_text(addresses: list[str]) -> str:
    """The machine's hosts file plus one line per address of ``NAME``, in order (the trainers
    still resolve this host's own name: torchft's checkpoint server advertises it)."""
    text = HOSTS_FILE.read_text()
    return text + ("" if text.endswith("\n") or not text else "\n") + "".join(f"{a} {NAME}\n" for a in addresses)


def check_namespace_support(tmp: Path) -> None:
    """Skip unless this machine can run a command with a private /etc/hosts: root, ``unshare``,
    a bind mount in a new mount namespace that resolves ``NAME`` there and leaves the machine's
    /etc/hosts alone, with private propagation inside; and 127.0.0.2-4 usable (Linux loopback)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the trainers run in a mount namespace with their own /etc/hosts")
    if shutil.which("unshare") is None or shutil.which("getent") is None:
        pytest.skip("needs unshare and getent (util-linux, libc-bin)")
    for host in NODE_HOSTS:
        try:
            with socket.socket() as s:
                s.bind((host, 0))
        except OSError as e:
            pytest.skip(f"cannot bind {host} (loopback beyond 127.0.0.1 needs Linux): {e}")
    probe_hosts = tmp / "probe-hosts"
    probe_hosts.write_text(hosts_file_text(NODE_HOSTS))
    before = etc_hosts_state()
    script = "awk '$5 == \"/\" {print}' /proc/self/mountinfo"
    try:
        res = subprocess.run(namespaced(probe_hosts, ["sh", "-c", script]), capture_output=True, text=True,
                             timeout=30, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.skip("unshare --mount did not finish within 30 s")
    assert etc_hosts_state() == before, "the probe's bind mount leaked into the machine's /etc/hosts"
    if res.returncode != 0:
        pytest.skip(f"cannot bind-mount a hosts file in a private mount namespace: {res.stderr.strip()[-300:]}")
    # Optional fields of a private mount carry no "shared:N": nothing mounted in the namespace
    # propagates back to the machine's.
    root_mounts = res.stdout.splitlines()
    assert root_mounts and not any(" shared:" in line for line in root_mounts), root_mounts
    resolved = resolve_in_namespace(probe_hosts)
    assert sorted(resolved) == NODE_HOSTS, f"{NAME} resolved to {resolved} inside the namespace"


def resolve_in_namespace(hosts_file: Path) -> list[str]:
    """The addresses ``NAME`` resolves to where ``hosts_file`` is /etc/hosts, in the order the
    trainers' resolver gives them (glibc's getaddrinfo, which sorts them per RFC 6724: here
    127.0.0.2 and .3 share a longer prefix with the source address 127.0.0.1 than .4 does, so
    they come first whatever the file's order; ties keep it)."""
    res = subprocess.run(namespaced(hosts_file, ["getent", "ahosts", NAME]), capture_output=True, text=True,
                         timeout=30, stdin=subprocess.DEVNULL, check=True)
    return [f[0] for f in (line.split() for line in res.stdout.splitlines()) if f[1:2] == ["STREAM"]]


def established_peers(pid: int, port: int) -> set[str]:
    """Remote addresses of the process's ESTABLISHED TCP connections to ``port`` (from its file
    descriptors and /proc/net/tcp{,6}; IPv4-mapped IPv6 addresses as IPv4)."""
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return set()
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    peers = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            f = row.split()
            remote, state, inode = f[2], f[3], f[9]
            if state != "01" or inode not in inodes:  # 01 = ESTABLISHED
                continue
            ip_hex, port_hex = remote.split(":")
            if int(port_hex, 16) != port:
                continue
            raw = bytes.fromhex(ip_hex)
            if len(raw) == 4:
                peers.add(socket.inet_ntoa(raw[::-1]))
            else:  # four host-order 32-bit words
                v6 = ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
                peers.add(str(v6.ipv4_mapped or v6))
    return peers


def transfer_leadership(cluster: LocalCluster, to: int) -> None:
    """``lighthouse-cluster transfer-leader --to NODE`` (the admin command, as a process)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTHOUSE_CLUSTER_")}
    env.update(LIGHTHOUSE_CLUSTER_ENDPOINTS=cluster.endpoints, LIGHTHOUSE_CLUSTER_ADMIN_TOKEN=ADMIN_TOKEN)
    res = subprocess.run([sys.executable, "-m", "lighthouse_cluster", "transfer-leader", "--to",
                          cluster.members[to].peer.node_id], env=env, capture_output=True, text=True, timeout=30,
                         stdin=subprocess.DEVNULL)
    assert res.returncode == 0, f"transfer-leader failed: {res.stdout}{res.stderr}\n{cluster.tail_logs()}"


@dataclass(kw_only=True)
class NamedTrainer(TorchftTrainer):
    """A replica group whose TORCHFT_LIGHTHOUSE is ``http://NAME:PORT``, run by ``python`` (the
    torchft line's interpreter) in a mount namespace where ``hosts_file`` is /etc/hosts."""

    hosts_file: Path

    def command(self) -> list[str]:
        return namespaced(self.hosts_file, super().command())


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[TrainingRun]:
    with TrainingRun(tmp_path) as run:
        yield run


@pytest.fixture
def machine_etc_hosts() -> Iterator[None]:
    """The machine's /etc/hosts is the same after the test, whatever happened in it."""
    before = etc_hosts_state()
    yield
    assert etc_hosts_state() == before, "the machine's /etc/hosts changed during the test"


@pytest.mark.parametrize("line", LINES)
def test_trainers_survive_the_permanent_loss_of_their_node(machine_etc_hosts: None, harness: TrainingRun,
                                                          tmp_path: Path, line: str) -> None:
    check_namespace_support(tmp_path)
    python = python_for(line)
    version = torchft_version(python)
    started = time.monotonic()

    # One client port on every node's address (a port the trainers' name can carry); Raft ports
    # differ, since the Raft transport listens on every interface.
    for _ in range(20):
        client, *raft = free_ports(4)
        if all(port_is_free(p, h) for h in NODE_HOSTS for p in (client, *raft)):
            break
    else:
        pytest.fail("no client port free on all of 127.0.0.2-4")
    cluster = harness.start_cluster(MIN_REPLICAS, hosts=list(NODE_HOSTS), client_ports=[client] * 3,
                                    raft_ports=raft, admin_token=ADMIN_TOKEN)
    leader = cluster.wait_for_agreed_leader(timeout=30)

    # The name: the leader's address first. The trainers connect to the first address their
    # resolver gives (the file's order, or not: see resolve_in_namespace); that node is the
    # victim, and leads (leadership is handed to it when the resolver put another first).
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text(hosts_file_text([NODE_HOSTS[leader]] + [h for i, h in enumerate(NODE_HOSTS) if i != leader]))
    order = resolve_in_namespace(hosts_file)
    victim = NODE_HOSTS.index(order[0])
    victim_host = NODE_HOSTS[victim]
    others = [i for i in range(cluster.nodes) if i != victim]
    transferred = victim != leader
    if transferred:
        transfer_leadership(cluster, victim)
        leader = cluster.wait_for_agreed_leader(timeout=30)
        harness.check(leader == victim, f"leadership went to n{leader + 1}, not n{victim + 1}")
    old_term = cluster.status(leader).term
    harness.note(f"{version}: nodes on {NODE_HOSTS} port {client}; leader n{victim + 1}; {NAME} -> {order}")

    # Group 2 is slow: the others' Quorum calls wait at the leader for it every step, so the kill
    # hits calls in flight. Every trainer sets up, then they start together (the start barrier).
    trainers = harness.start((NamedTrainer(group=group, lighthouse=f"http://{NAME}:{client}", workdir=tmp_path,
                                           env=TORCHFT_RESTART_ENV, steps=STEPS, step_sleep=STEP_SLEEP_S,
                                           min_final_participants=GROUPS, min_replica_size=MIN_REPLICAS,
                                           slow=group == 2, python=python, hosts_file=hosts_file)
                              for group in range(GROUPS)), barrier_timeout=120)
    harness.wait_all_steps(KILL_AT_STEP)

    # Every trainer talks to the victim, and only to it.
    peers = {t.name: established_peers(t.process.pid, client) for t in trainers}
    harness.check(all(p == {victim_host} for p in peers.values()),
                  f"trainers' connections to port {client} before the kill: {peers}, expected only {victim_host}")

    kill = harness.kill_while_calls_wait(victim)
    killed_at, waiting = kill.at, kill.waiting
    harness.check(kill.leader == victim, f"n{kill.leader + 1}, not n{victim + 1}, led when n{victim + 1} was killed")
    steps_at_kill = [t.step() for t in trainers]
    harness.note(f"n{victim + 1} ({victim_host}, leader in term {old_term}) stays down; steps at the kill: "
                 f"{steps_at_kill}")
    _, failover_s = harness.wait_new_leader(kill, among=others)

    def committed_after_kill(t: TorchftTrainer) -> int:
        return sum(r["committed"] and r["t_start"] > killed_at for r in t.records())

    harness.wait_until(f"every trainer to commit {STEPS_AFTER_KILL} steps after the kill",
                       lambda: all(committed_after_kill(t) >= STEPS_AFTER_KILL for t in trainers),
                       AFTER_KILL_DEADLINE_S)
    resumed_s = time.time() - killed_at
    harness.note(f"{STEPS_AFTER_KILL} steps committed by every trainer {resumed_s:.2f}s after the kill")

    # The trainers are now on the name's other addresses, never the dead one.
    peers = {t.name: established_peers(t.process.pid, client) for t in trainers}
    harness.check(all(p and victim_host not in p and p <= set(order[1:]) for p in peers.values()),
                  f"trainers' connections to port {client} after the kill: {peers}")

    results = harness.wait_finished()
    harness.assert_identical(results, STEPS)
    slowest = []
    for t in trainers:
        harness.assert_one_process(t)  # no crash, no restart
        s = slowest_step_around(t.records(), killed_at)
        slowest.append(s["duration_s"] if s else 0.0)
    retried = sum(t.output().count("lighthouse quorum failed") for t in trainers)
    harness.check(retried > 0, "no lighthouse call failed: the kill did not hit the trainers")
    harness.check(not cluster.members[victim].running, "the killed node was restarted")
    # And the loss is invisible to training: every step committed, nobody left out of a quorum
    # and healed, one quorum id throughout (the new leader re-issues the same quorum).
    found = sorted(d for t in trainers for d in t.disruptions())
    harness.check(not found, "the node loss was not seamless:\n" + "\n".join(what for _, what in found[:20]))
    for t in trainers:
        harness.assert_seamless(t)

    normal = median_duration_s(r for t in trainers for r in t.records())
    print(f"\nhosts HA ({version}): {NAME} -> {order}; leader n{victim + 1}"
          f"{' (leadership handed to it)' if transferred else ''} SIGKILLed for good with {waiting} calls "
          f"waiting at steps {steps_at_kill}; new leader after {failover_s:.2f}s; {STEPS_AFTER_KILL} steps committed "
          f"by every trainer {resumed_s:.2f}s after the kill; slowest step around it {max(slowest):.2f}s (median "
          f"{normal:.3f}s); every step committed, one quorum id; {retried} lighthouse attempts retried; trainers now "
          f"on {peers}; test {time.monotonic() - started:.1f}s")
