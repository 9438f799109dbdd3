"""``lighthouse_cluster.local.node_forks``: nodes forked from a fork server that has imported
their code, and when LocalCluster forks instead of exec'ing.

A forked ``lighthouse-cluster`` command gets its arguments, its environment, its own session and
its log file, and reports its exit code (or minus the signal that ended it) as ``subprocess.Popen``
does; what acts only at exec (a launch prefix, ``LD_PRELOAD``), a node that must die with its
parent, and a main module the child would run again all keep the exec."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest

from lighthouse_cluster import __version__
from lighthouse_cluster.local.cluster import LocalCluster
from lighthouse_cluster.local.node_forks import ForkedProcess, _main_module_rerun, can_fork
from support.waiting import wait_for

COMMAND = [sys.executable, "-m", "lighthouse_cluster"]


def module(name: str | None = None, file: str | None = None) -> types.ModuleType:
    main = types.ModuleType("__main__")
    main.__spec__ = types.SimpleNamespace(name=name) if name else None  # type: ignore[assignment]
    if file:
        main.__file__ = file
    return main


def test_what_keeps_the_exec() -> None:
    env = dict(os.environ)
    assert can_fork([*COMMAND, "serve"], env) in (None, _main_module_rerun())
    assert "launch prefix" in (can_fork(["ip", "netns", "exec", "ns1", *COMMAND, "serve"], env) or "")
    assert "LD_PRELOAD" in (can_fork([*COMMAND, "serve"], {**env, "LD_PRELOAD": "/usr/lib/faketime.so"}) or "")


def test_a_main_module_the_child_would_run_again_keeps_the_exec() -> None:
    assert _main_module_rerun(module()) is None  # python -c, an xdist worker
    assert _main_module_rerun(module(name="pytest.__main__", file="/x/pytest/__main__.py")) is None  # python -m pytest
    assert "main script /x/run.py" in (_main_module_rerun(module(file="/x/run.py")) or "")
    assert "main module myjob" in (_main_module_rerun(module(name="myjob", file="/x/myjob.py")) or "")


@pytest.mark.integration
def test_a_forked_command_gets_its_arguments_environment_session_and_log(tmp_path: Path) -> None:
    log = tmp_path / "version.log"
    proc = ForkedProcess([*COMMAND, "--version"], dict(os.environ), log)
    assert proc.wait(timeout=30) == 0
    assert f"lighthouse-cluster, version {__version__}" in log.read_text()

    # The environment it was given (and not this process's): the endpoint named only there.
    log = tmp_path / "status.log"
    env = {**os.environ, "LIGHTHOUSE_CLUSTER_ENDPOINTS": "http://127.0.0.1:9"}
    proc = ForkedProcess([*COMMAND, "status", "--timeout", "0.5"], env, log)
    assert proc.wait(timeout=30) != 0
    assert "127.0.0.1:9" in log.read_text()

    # A usage error: the same exit code and the same line as the exec'd command's.
    log = tmp_path / "bad.log"
    proc = ForkedProcess([*COMMAND, "serve", "--no-such-option"], dict(os.environ), log)
    execd = subprocess.run([*COMMAND, "serve", "--no-such-option"], capture_output=True, text=True, timeout=60)
    assert proc.wait(timeout=30) == execd.returncode == 2
    assert log.read_text() == execd.stderr and "No such option '--no-such-option'" in execd.stderr


@pytest.mark.integration
def test_a_forked_node_is_signalled_waited_for_and_leads_its_own_session(make_cluster) -> None:
    cluster = make_cluster(nodes=1)
    assert cluster.wait_for_leader(timeout=20) == 0
    proc = cluster.members[0].process
    assert isinstance(proc, ForkedProcess)
    assert os.getsid(proc.pid) == proc.pid and proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.1)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=10) == -signal.SIGKILL and proc.returncode == -signal.SIGKILL
    proc.kill()  # ended already: nothing to signal
    cluster.start_node(0)
    assert cluster.wait_for_leader(timeout=20) == 0
    assert cluster.stop(0) == 0  # SIGTERM: the graceful stop's exit code
    assert "serving torchft.LighthouseService" in cluster.members[0].log_path.read_text()


@pytest.mark.integration
def test_the_cluster_execs_what_a_fork_would_change(make_cluster) -> None:
    prefixed = make_cluster(nodes=1, launch_prefix=lambda i: ["env", "LIGHTHOUSE_TEST_PREFIX=1"])
    assert isinstance(prefixed.members[0].process, subprocess.Popen)
    parented = make_cluster(nodes=1, die_with_parent=True)
    assert isinstance(parented.members[0].process, subprocess.Popen)
    plain = make_cluster(nodes=1, fork_nodes=False)
    assert isinstance(plain.members[0].process, subprocess.Popen)
    for cluster in (prefixed, parented, plain):
        assert cluster.wait_for_leader(timeout=20) == 0
    wait_for("the exec'd nodes' command lines", lambda: all(
        b"lighthouse_cluster\0serve" in Path(f"/proc/{c.members[0].process.pid}/cmdline").read_bytes()
        for c in (prefixed, parented, plain)), 10)


LEAVER = r"""
import sys, tempfile
from pathlib import Path
from lighthouse_cluster.local.cluster import LocalCluster
cluster = LocalCluster(root=Path(tempfile.mkdtemp()), nodes=1, fork_nodes=True).start()
cluster.wait_for_leader(timeout=20)
cluster.pause(0)  # SIGSTOP: a SIGTERM alone would not end it
print(cluster.members[0].process.pid, type(cluster.members[0].process).__name__, flush=True)
if sys.argv[1] == "drop":  # no reference left to the node but multiprocessing's own
    import gc
    del cluster
    gc.collect()
"""


@pytest.mark.integration
@pytest.mark.parametrize("reference", ["kept", "drop"])
def test_a_process_that_leaves_a_paused_forked_node_running_still_exits_and_takes_the_node(reference: str) -> None:
    res = subprocess.run([sys.executable, "-c", LEAVER, reference], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-3000:]
    pid, kind = res.stdout.split()
    assert kind == "ForkedProcess"
    wait_for(f"forked node {pid} gone", lambda: not Path(f"/proc/{pid}").exists(), 10)


@pytest.mark.integration
def test_a_forked_nodes_cpu_counts_in_the_tests_cpu(make_cluster) -> None:
    """suite_time's per-test CPU includes the forked nodes' (their fork server reaps them, not
    this process): after a node ends, cpu_mark grew by its CPU beyond this process's own."""
    from support.suite_time import cpu_mark, forked_cpu

    cluster = make_cluster(nodes=1)
    cluster.wait_for_leader(timeout=20)
    proc = cluster.members[0].process
    assert isinstance(proc, ForkedProcess)
    fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    node_cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    assert node_cpu > 0
    before = forked_cpu()
    mark = cpu_mark()
    cluster.kill(0)
    assert cpu_mark() - mark >= node_cpu * 0.99
    assert forked_cpu() - before >= node_cpu * 0.99


@pytest.mark.integration
def test_a_forked_node_gets_the_starting_processs_resource_limits_and_umask(make_cluster, tmp_path: Path) -> None:
    """As an exec'd child inherits them (the fork server has those of when it started)."""
    import resource

    ForkedProcess([*COMMAND, "--version"], dict(os.environ), tmp_path / "warm.log").wait(timeout=30)  # fork server up
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(soft, 1000) - 1
    old_umask = os.umask(0o027)
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        cluster = make_cluster(nodes=1)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        os.umask(old_umask)
    proc = cluster.members[0].process
    assert isinstance(proc, ForkedProcess)
    cluster.wait_for_leader(timeout=20)
    # The node raises its soft open-file limit itself: from the caller's, its log says.
    assert f"open-file limit raised from {low} to" in cluster.members[0].log_path.read_text()
    umask = next(ln for ln in Path(f"/proc/{proc.pid}/status").read_text().splitlines() if ln.startswith("Umask:"))
    assert umask.split()[1] == "0027"
