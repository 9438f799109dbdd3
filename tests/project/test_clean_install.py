"""`pip install .` alone, in a fresh virtual environment, runs `up`, `serve` (under `up`) and
`status`: the runtime needs none of the extras (no torch, torchft, numpy, matplotlib, py-spy).

tests/project/test_runtime_imports.py checks the same with the heavy packages hidden from this
environment; here nothing but the runtime's own dependencies is installed at all (~20 s for the
install, from the package registry or pip's cache).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import venv
from pathlib import Path

import pytest

from support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
NOT_IN_THE_RUNTIME = {"torch", "torchft", "numpy", "matplotlib", "py-spy", "scikit-learn"}

pytestmark = pytest.mark.integration


def test_pip_install_dot_alone_runs_up_serve_and_status(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    bin_dir = env_dir / "bin"
    install = subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                              str(ROOT)], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    listed = subprocess.run([str(bin_dir / "python"), "-m", "pip", "list", "--format", "json"],
                            capture_output=True, text=True, timeout=120, check=True)
    installed = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert "lighthouse-cluster" in installed
    assert installed & NOT_IN_THE_RUNTIME == set()

    # torchrun's backend comes with the package: the entry point torch's registry loads (its
    # module imports no torch at the top, so it loads here, where torch is not installed).
    probe = ("from importlib.metadata import entry_points\n"
             "(ep,) = [e for e in entry_points(group='torchrun.handlers') if e.name == 'lighthouse']\n"
             "print(ep.value, callable(ep.load()()))\n")
    handler = subprocess.run([str(bin_dir / "python"), "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                             timeout=60)
    assert handler.returncode == 0, handler.stderr[-3000:]
    assert handler.stdout.split() == ["ftclient.torchrun_rendezvous.entry_point:torchrun_handler_creator", "True"]

    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    out = tmp_path / "up.out"
    with open(out, "w") as f:
        # cwd outside the checkout: nothing from the source tree can be imported by accident.
        up = subprocess.Popen([str(bin_dir / "lighthouse-cluster"), "up", "--nodes", "3", "--bind", "127.0.0.1:0",
                               "--min_replicas", "1", "--data-dir", str(tmp_path / "data"), "--no-restart"],
                              cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
    try:
        def banner() -> bool:
            assert up.poll() is None, f"up exited with {up.returncode}:\n{out.read_text()}"
            return "Ctrl-C stops every node." in out.read_text()

        wait_for("up's banner", banner, 60, context=out.read_text)
        endpoints = re.findall(r"export TORCHFT_LIGHTHOUSE=(\S+,\S+)", out.read_text())
        assert endpoints, out.read_text()

        def status() -> dict | None:
            res = subprocess.run([str(bin_dir / "lighthouse-cluster"), "status", "--endpoints", endpoints[0],
                                  "--output", "json"], cwd=tmp_path, env=env, capture_output=True, text=True,
                                 timeout=30)
            view = json.loads(res.stdout) if res.returncode == 0 else {}
            return view if view.get("leader") and all(n.get("reachable") for n in view["nodes"]) else None

        view = wait_for("status to show a leader and three reachable nodes", status, 30,
                        context=out.read_text, interval=0.5)
        assert sorted(n["id"] for n in view["nodes"]) == ["n1", "n2", "n3"]
        assert "Traceback" not in out.read_text(), out.read_text()
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
            try:
                up.wait(timeout=30)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait(timeout=10)
    assert up.returncode == 0, out.read_text()
