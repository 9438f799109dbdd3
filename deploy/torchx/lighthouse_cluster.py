"""A torchx component that runs lighthouse-cluster: one role, one replica per lighthouse node.

    # on this host (nodes on 127.0.0.1, clients on 29510-29512, dashboards on 29710-29712;
    # the secret from your shell):
    export LIGHTHOUSE_CLUSTER_SECRET=$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))')
    torchx run -s local_cwd deploy/torchx/lighthouse_cluster.py:lighthouse --min_replicas 1

    # Kubernetes (torchx's scheduler needs Volcano) or Slurm:
    torchx run -s kubernetes -cfg queue=default deploy/torchx/lighthouse_cluster.py:lighthouse \\
        --image REGISTRY/lighthouse-cluster:0.1.0 --env LIGHTHOUSE_CLUSTER_SECRET=...
    torchx run -s slurm deploy/torchx/lighthouse_cluster.py:lighthouse --secret_file ~/.lighthouse-cluster/secret

Each replica runs ``python3 -c LAUNCHER --index ${replica_id} ...``: the launcher (plain Python,
no dependency but the lighthouse_cluster package in the image) finds every node's host at run
time, from the scheduler's own variables, and execs ``lighthouse-cluster serve`` with this
node's id (``lh<replica_id>``), the full peer list and its HTTP port (``--http_port``, default
29710: /readyz, /livez, /metrics and the dashboard; 0 turns it off):

* Kubernetes/Volcano: ``VC_LIGHTHOUSE_<i>_HOSTS`` (torchx makes one Volcano task per replica and
  Volcano's svc plugin publishes every task's DNS name to every pod);
* Slurm: the first host of ``SLURM_JOB_NODELIST_HET_GROUP_<i>`` (torchx runs one heterogeneous
  job group per replica);
* anything else (local_cwd, local_docker is not supported): every node on 127.0.0.1, ports
  +1 per node, as ``lighthouse-cluster up`` does;
* or ``--hosts a,b,c`` names them explicitly.

This file imports without torchx installed (the launcher and ``serve_argv`` need only the
standard library); ``lighthouse()`` itself needs torchx.
"""

from typing import Dict, List, Optional

try:
    from torchx import specs
    from torchx.specs import AppDef
except ImportError:  # pragma: no cover - exercised by the tests when torchx is absent
    specs = None  # type: ignore[assignment]
    AppDef = None  # type: ignore[assignment,misc]

ROLE = "lighthouse"
DEFAULT_IMAGE = "lighthouse-cluster:0.1.0"
DRY_RUN_ENV = "LIGHTHOUSE_CLUSTER_LAUNCHER_DRY_RUN"

# Runs inside each replica as `python3 -c LAUNCHER ARGS...`. Kept free of "$": torchx applies
# its ${macro} substitution to every argument and Kubernetes expands $(VAR) in container args.
LAUNCHER = r'''
import argparse, json, os, subprocess, sys

def fail(message):
    sys.stderr.write("lighthouse-cluster launcher: " + message + "\n")
    sys.exit(2)

def find_hosts(mode, n, role):
    if mode == "auto":
        if os.environ.get("VC_%s_0_HOSTS" % role.upper().replace("-", "_")):
            mode = "volcano"
        elif os.environ.get("SLURM_JOB_NODELIST_HET_GROUP_0"):
            mode = "slurm"
        else:
            mode = "local"
    if mode == "volcano":
        hosts = []
        for i in range(n):
            name = "VC_%s_%d_HOSTS" % (role.upper().replace("-", "_"), i)
            if not os.environ.get(name):
                fail("%s is not set: is this a Volcano job with the svc plugin?" % name)
            hosts.append(os.environ[name].split(",")[0])
        return mode, hosts
    if mode == "slurm":
        hosts = []
        for i in range(n):
            name = "SLURM_JOB_NODELIST_HET_GROUP_%d" % i
            if not os.environ.get(name):
                fail("%s is not set: is this a heterogeneous Slurm job with one group per node?" % name)
            out = subprocess.run(["scontrol", "show", "hostnames", os.environ[name]], check=True,
                                 capture_output=True, text=True).stdout.split()
            hosts.append(out[0])
        return mode, hosts
    if mode == "local":
        return mode, ["127.0.0.1"] * n
    hosts = [h.strip() for h in mode.split(",") if h.strip()]
    if len(hosts) != n:
        fail("--hosts names %d hosts for %d nodes" % (len(hosts), n))
    if len(set(hosts)) != n:
        fail("--hosts names a host twice: %s" % mode)
    return "list", hosts

def main(argv):
    serve_extra = []
    if "--" in argv:
        at = argv.index("--")
        argv, serve_extra = argv[:at], argv[at + 1:]
    p = argparse.ArgumentParser(prog="lighthouse-cluster-launcher")
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--hosts", default="auto")
    p.add_argument("--role", default="lighthouse")
    p.add_argument("--client-port", type=int, default=29510)
    p.add_argument("--raft-port", type=int, default=29610)
    p.add_argument("--http-port", type=int, default=29710)
    p.add_argument("--data-dir", default="")
    a = p.parse_args(argv)
    if not 0 <= a.index < a.nodes:
        fail("replica index %d is not below --nodes %d" % (a.index, a.nodes))
    mode, hosts = find_hosts(a.hosts, a.nodes, a.role)
    local = mode == "local"
    raft = [a.raft_port + (i if local else 0) for i in range(a.nodes)]
    client = [a.client_port + (i if local else 0) for i in range(a.nodes)]
    http = [a.http_port + (i if local else 0) for i in range(a.nodes)] if a.http_port > 0 else []
    ids = ["lh%d" % i for i in range(a.nodes)]
    i = a.index
    args = ["serve", "--node-id", ids[i],
            "--raft-bind", "%s:%d" % ("127.0.0.1" if local else "0.0.0.0", raft[i]),
            "--client-bind", "%s:%d" % ("127.0.0.1" if local else "[::]", client[i])]
    if http:
        args += ["--http-bind", "%s:%d" % ("127.0.0.1" if local else "0.0.0.0", http[i])]
    if a.data_dir:
        args += ["--data-dir", os.path.join(a.data_dir, ids[i])]
    for k in range(a.nodes):
        args += ["--peer", "%s=%s:%d,%s:%d" % (ids[k], hosts[k], raft[k], hosts[k], client[k])]
    args += serve_extra
    endpoints = ",".join("http://%s:%d" % (hosts[k], client[k]) for k in range(a.nodes))
    sys.stderr.write("lighthouse-cluster launcher: node %s (%s hosts); LIGHTHOUSE_CLUSTER_ENDPOINTS=%s\n"
                     % (ids[i], mode, endpoints))
    if http:
        sys.stderr.write("lighthouse-cluster launcher: dashboard of node %s: http://%s:%d/ (/metrics for Prometheus)\n"
                         % (ids[i], hosts[i], http[i]))
    argv = [sys.executable, "-m", "lighthouse_cluster"] + args
    if os.environ.get("LIGHTHOUSE_CLUSTER_LAUNCHER_DRY_RUN"):
        print(json.dumps(argv))
        return
    sys.stderr.flush()
    os.execv(sys.executable, argv)

main(sys.argv[1:])
'''


def launcher_args(
    index: str,
    nodes: int,
    hosts: str = "auto",
    client_port: int = 29510,
    raft_port: int = 29610,
    data_dir: str = "",
    secret_file: str = "",
    serve_args: Optional[List[str]] = None,
    http_port: int = 29710,
) -> List[str]:
    """The arguments of ``python3`` for one replica (``index`` may be torchx's ``${replica_id}``)."""
    args = ["-c", LAUNCHER, "--index", index, "--nodes", str(nodes), "--hosts", hosts, "--role", ROLE,
            "--client-port", str(client_port), "--raft-port", str(raft_port), "--http-port", str(http_port)]
    if data_dir:
        args += ["--data-dir", data_dir]
    extra = list(serve_args or [])
    if secret_file:
        extra = ["--secret-file", secret_file] + extra
    return args + ["--"] + extra


def lighthouse(
    min_replicas: int = 1,
    nodes: int = 3,
    image: str = DEFAULT_IMAGE,
    hosts: str = "auto",
    client_port: int = 29510,
    raft_port: int = 29610,
    http_port: int = 29710,
    data_dir: str = "",
    secret_file: str = "",
    join_timeout_ms: int = 60000,
    heartbeat_timeout_ms: int = 5000,
    quorum_tick_ms: int = 100,
    cpu: int = 1,
    memMB: int = 1024,
    max_retries: int = 10,
    env: Optional[Dict[str, str]] = None,
) -> "AppDef":
    """A highly-available torchft lighthouse: ``nodes`` lighthouse-cluster nodes (3 or 5).

    Trainers set TORCHFT_LIGHTHOUSE to any node's client address (each replica logs the full
    list at start); see deploy/README.md.

    Args:
        min_replicas: torchft's --min_replicas: fewest replica groups a new quorum may have.
        nodes: lighthouse nodes, an odd number (3 or 5); node i is lh<i>.
        image: container image with lighthouse-cluster installed (deploy/docker/Dockerfile).
        hosts: "auto" (from the scheduler), "local" (127.0.0.1, ports +1 per node) or
            a comma-separated host per node.
        client_port: gRPC port for trainers (local: of the first node).
        raft_port: Raft port (local: of the first node).
        http_port: HTTP port: /readyz, /livez, /metrics (Prometheus) and the dashboard; no
            authentication, keep it on a private network (local: of the first node; 0: none).
        data_dir: directory for the Raft journals (node i uses DATA_DIR/lh<i>); without one a
            restart of every node sends quorum ids back to 0.
        secret_file: file holding the cluster secret, as seen by the node; without one the
            nodes take LIGHTHOUSE_CLUSTER_SECRET from their environment (see env).
        join_timeout_ms: torchft's --join_timeout_ms.
        heartbeat_timeout_ms: torchft's --heartbeat_timeout_ms.
        quorum_tick_ms: torchft's --quorum_tick_ms.
        cpu: CPUs per node.
        memMB: memory per node in MB.
        max_retries: restarts of a failed node before the job fails.
        env: extra environment variables for the nodes (e.g. LIGHTHOUSE_CLUSTER_SECRET=...,
            LIGHTHOUSE_CLUSTER_LOG_FORMAT=json).
    """
    if specs is None:
        raise ImportError("torchx is not installed: pip install torchx")
    if nodes < 1 or nodes % 2 == 0:
        raise ValueError(f"nodes={nodes}: use an odd number (3 or 5) so a majority survives a split")
    serve_args = ["--min_replicas", str(min_replicas), "--join_timeout_ms", str(join_timeout_ms),
                  "--heartbeat_timeout_ms", str(heartbeat_timeout_ms), "--quorum_tick_ms", str(quorum_tick_ms)]
    role = specs.Role(
        name=ROLE,
        image=image,
        entrypoint="python3",
        args=launcher_args(specs.macros.replica_id, nodes, hosts=hosts, client_port=client_port,
                           raft_port=raft_port, data_dir=data_dir, secret_file=secret_file,
                           serve_args=serve_args, http_port=http_port),
        env={"PYTHONUNBUFFERED": "1", **(env or {})},
        num_replicas=nodes,
        max_retries=max_retries,
        # Restart only the failed node; the others keep the quorum going.
        retry_policy=specs.RetryPolicy.REPLICA,
        resource=specs.Resource(cpu=cpu, gpu=0, memMB=memMB),
        port_map={"client": client_port, "raft": raft_port, **({"http": http_port} if http_port > 0 else {})},
    )
    return specs.AppDef(name="lighthouse-cluster", roles=[role])
