"""The runtime runs without the heavy packages (issue 14, item 2).

``pip install .`` gives the lighthouse only: no torch, torchft, numpy, matplotlib or py-spy, no
trainer SDK (ftclient) and no benchmarks. Each test here runs Python subprocesses in which those
cannot be imported (``import_blocker``) and checks that the CLI, every module of the
``lighthouse_cluster`` package and a local cluster work there -- and that none of them even tried
to import one (an attempt that was caught and ignored is recorded too). ``lighthouse-cluster
bench`` then says in one line what to install and exits 2.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support.import_blocker import HEAVY, ROOT, blocked_attempts, blocking_env
from support.waiting import wait_for


def _run(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.integration
def test_the_blocker_blocks(tmp_path: Path):
    """The environment really hides the packages (else every test below proves nothing)."""
    env = blocking_env(tmp_path)
    code = ("import importlib, sys\n"
            f"for name in {HEAVY!r}:\n"
            "    try:\n"
            "        importlib.import_module(name)\n"
            "    except ModuleNotFoundError as e:\n"
            "        assert e.name == name, (e.name, name)\n"
            "    else:\n"
            "        sys.exit(f'{name} imported')\n")
    res = _run(env, "-c", code)
    assert res.returncode == 0, res.stderr
    assert blocked_attempts(env) == list(HEAVY)


@pytest.mark.integration
def test_cli_help_runs_without_heavy_packages(tmp_path: Path):
    env = blocking_env(tmp_path)
    res = _run(env, "-m", "lighthouse_cluster", "--help")
    assert res.returncode == 0, res.stderr
    for command in ("serve", "up", "status", "bench"):
        assert re.search(rf"^\s+{command}\s", res.stdout, re.M), res.stdout
    for command in ("serve", "up", "status"):
        res = _run(env, "-m", "lighthouse_cluster", command, "--help")
        assert res.returncode == 0, (command, res.stderr)
    assert blocked_attempts(env) == []


@pytest.mark.integration
def test_every_runtime_module_imports_without_heavy_packages(tmp_path: Path):
    env = blocking_env(tmp_path)
    code = ("import importlib, json, pkgutil, sys\n"
            "import lighthouse_cluster\n"
            "names = ['lighthouse_cluster']\n"
            "for info in pkgutil.walk_packages(lighthouse_cluster.__path__, 'lighthouse_cluster.'):\n"
            "    importlib.import_module(info.name)\n"
            "    names.append(info.name)\n"
            f"loaded = sorted(m for m in sys.modules if m.partition('.')[0] in {HEAVY!r})\n"
            "print(json.dumps({'modules': names, 'loaded': loaded}))\n")
    res = _run(env, "-c", code)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    modules = set(out["modules"])
    # The walk reached every layer (a walk that stopped early would prove little).
    for name in ("lighthouse_cluster.core.quorum", "lighthouse_cluster.raft.replication",
                 "lighthouse_cluster.server.node", "lighthouse_cluster.client.admin_client",
                 "lighthouse_cluster.local.cluster", "lighthouse_cluster.cli.commands"):
        assert name in modules, sorted(modules)
    assert not [m for m in modules if ".bench" in m], "the benchmarks are not part of the runtime package"
    assert out["loaded"] == []
    assert blocked_attempts(env) == []


@pytest.mark.integration
def test_bench_command_says_what_to_install_without_the_benchmarks(tmp_path: Path):
    env = blocking_env(tmp_path)
    for args in (("bench",), ("bench", "--help"), ("bench", "run", "--quick")):
        res = _run(env, "-m", "lighthouse_cluster", *args)
        assert res.returncode == 2, (args, res.stdout, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1, res.stderr
        assert "pip install -e '.[bench]'" in lines[0] and "python -m benchmarks run" in lines[0], lines[0]
        assert res.stdout == ""
    # It looked for the benchmarks when the command ran, and for nothing else.
    assert blocked_attempts(env) == ["benchmarks"]


@pytest.mark.integration
def test_bench_command_names_a_missing_extra(tmp_path: Path):
    """The benchmarks package is there (a source checkout) but the bench extra is not complete."""
    env = blocking_env(tmp_path, ("torchft", "matplotlib"))
    res = _run(env, "-m", "lighthouse_cluster", "bench", "run", "--quick")
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "torchft, matplotlib not installed" in lines[0], res.stderr
    # python -m benchmarks itself refuses to start a run without them, in one line too.
    res = _run(env, "-m", "benchmarks", "run", "--quick")
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "torchft, matplotlib" in lines[0] and ".[bench]" in lines[0], res.stderr


@pytest.mark.integration
def test_bench_command_hands_over_to_the_benchmarks(tmp_path: Path):
    import benchmarks

    missing = benchmarks.missing_modules()
    if missing:
        pytest.skip(f"the bench extra is not installed here ({', '.join(missing)})")
    # From another directory too: the command finds the checkout its package comes from.
    res = subprocess.run([sys.executable, "-m", "lighthouse_cluster", "bench", "--help"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("Usage: lighthouse-cluster bench [OPTIONS] COMMAND")
    assert re.search(r"^\s+run\s", res.stdout, re.M) and re.search(r"^\s+report\s", res.stdout, re.M)


def test_docker_image_gets_only_the_runtime():
    """deploy/docker's build context allows the package sources and nothing else."""
    docker = ROOT / "deploy" / "docker"
    allowed = [line[1:].strip() for line in (docker / "Dockerfile.dockerignore").read_text().splitlines()
               if line.startswith("!")]
    assert allowed == ["pyproject.toml", "README.md", "lighthouse_cluster/"]
    copies = [line.split()[1:-1] for line in (docker / "Dockerfile").read_text().splitlines()
              if line.startswith("COPY")]
    assert copies == [["pyproject.toml", "README.md"], ["lighthouse_cluster"]]
    assert not (ROOT / "lighthouse_cluster" / "bench").exists()


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_up_and_status_run_without_heavy_packages(tmp_path: Path):
    """A 3-node ``up`` and ``status`` against it, every process without the heavy packages."""
    env = blocking_env(tmp_path)
    out = tmp_path / "up.out"
    with open(out, "w") as f:
        up = subprocess.Popen(
            [sys.executable, "-m", "lighthouse_cluster", "up", "--nodes", "3", "--bind", "127.0.0.1:0",
             "--min_replicas", "1", "--data-dir", str(tmp_path / "data"), "--no-restart"],
            cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
    try:
        def banner() -> bool:
            if "Ctrl-C stops every node." in (text := out.read_text()):
                return True
            assert up.poll() is None, text
            return False

        wait_for("up to print its endpoints", banner, 60, context=out.read_text, interval=0.1)
        endpoints = re.findall(r"export TORCHFT_LIGHTHOUSE=(\S+,\S+)", out.read_text())
        assert endpoints, out.read_text()
        def formed() -> dict | None:
            res = _run(env, "-m", "lighthouse_cluster", "status", "--endpoints", endpoints[0], "--output", "json")
            view = json.loads(res.stdout) if res.returncode == 0 else {}
            return view if view.get("leader") and all(n.get("reachable") for n in view["nodes"]) else None

        view = wait_for("`status` to show a leader and every node reachable", formed, 30, interval=0.5)
        assert sorted(n["id"] for n in view["nodes"]) == ["n1", "n2", "n3"]
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
            try:
                up.wait(timeout=30)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait(timeout=10)
    assert up.returncode == 0, out.read_text()
    assert blocked_attempts(env) == []
