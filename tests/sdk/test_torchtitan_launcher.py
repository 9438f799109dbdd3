"""``python -m ftclient.as_torchft``: torchft programs, torchtitan's fault tolerance among them,
run on ftclient without editing them.

In this process (unit tests; torchft modules, ``sys.meta_path``, ``argv`` and ``path`` restored
after each): ``install()`` maps ``torchft`` and its covered submodules to ftclient, refuses an
uncovered one with an error naming what ftclient lacks, and refuses to run after a real torchft
was imported; ``-c`` code runs as ``__main__`` with its own ``sys.argv`` and exit status; usage
errors exit 2. In real processes (integration): a script and a ``-m`` module started through
the launcher see ftclient's package as ``torchft`` and as torchtitan's
``importlib.util.find_spec("torchft")`` finds it, get their own ``sys.argv`` and exit status,
and load no module of the installed torchft.

The torchtitan test uses torchtitan 0.3.0's own ``TorchFTManager``
(``torchtitan/experiments/torchft/manager.py``) as its trainer builds it, on CPU with
``process_group="gloo"``: 2 replica groups (one process each, FSDP2 on a one-rank mesh) against
a real 3-node lighthouse cluster, ``maybe_set_all_reduce_hook`` on the FSDP2 modules (gradients
averaged across the groups through the ``dp_replicate`` managed group), the loss summed with
torchtitan's ``dist_sum`` on ``loss_sync_pg`` (functional collectives), ``torchft.Optimizer``,
and the model and optimizer state registered with ``set_state_dict_fns`` as torchtitan's
checkpointer does. The groups start from different weights; the second heals from the first at
step 0 (``init_sync``), every step commits with both groups in one quorum of the cluster, and
they end with identical weights. Then, in the same processes, torchtitan's
``maybe_semi_sync_training`` builds ``torchft.local_sgd.DiLoCo`` (ftclient's, with torchtitan's
keyword arguments) on the FSDP2 model under a new synchronous ``TorchFTManager``: every
synchronisation commits with both groups, the second heals at the first, and the global
weights end identical.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from support.waiting import wait_for

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHFT_", "FTCLIENT_"))}
    env.update(PYTHONPATH=str(ROOT), **extra)
    return env


def launch(*args: str, cwd: Path = ROOT, **env: str) -> subprocess.Popen[str]:
    """``python -m ftclient.as_torchft ARGS`` started (each takes seconds to import torch: the
    test starts them all, then collects them with :func:`result`)."""
    return subprocess.Popen([sys.executable, "-m", "ftclient.as_torchft", *args], cwd=cwd, env=_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(p: subprocess.Popen[str], timeout: float = 90.0) -> subprocess.CompletedProcess[str]:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate(timeout=10)
        raise AssertionError(f"{p.args} still running after {timeout}s:\n{out}\n{err}") from None
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


PROBE = textwrap.dedent('''
    """Reports what torchft is in this process (written by test_torchtitan_launcher)."""
    import importlib.machinery, importlib.util, json, os, sys

    import torchft
    import torchft.process_group
    from torchft import local_sgd
    from torchft.checkpointing import PGTransport
    from torchft.manager import Manager

    import ftclient
    import ftclient.torchft_compat

    installed = importlib.machinery.PathFinder.find_spec("torchft")  # finds, imports nothing
    installed_dir = os.path.dirname(installed.origin) if installed is not None else None
    try:
        import torchft.torchcomms
        missing = "imported"
    except ModuleNotFoundError as e:
        missing = str(e)
    print(json.dumps({
        "name": __name__, "argv": sys.argv,
        "is_compat": torchft is ftclient.torchft_compat,
        "find_spec": importlib.util.find_spec("torchft") is not None,
        "names": [torchft.Manager is ftclient.Manager is Manager, torchft.ProcessGroupGloo is ftclient.ProcessGroupGloo,
                  torchft.process_group.ManagedProcessGroup is ftclient.ManagedProcessGroup,
                  local_sgd.DiLoCo is ftclient.DiLoCo, PGTransport.__module__ == "ftclient.checkpointing.pg_transport",
                  torchft.Optimizer is ftclient.OptimizerWrapper],
        "installed_dir": installed_dir,
        "from_installed": sorted(m for m, mod in list(sys.modules.items())
                                 if installed_dir and (getattr(mod, "__file__", None) or "").startswith(installed_dir)),
        "missing": missing,
    }))
    sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
''')


# -- in this process: install(), -c, usage ------------------------------------------------------------


def _is_torchft(name: str) -> bool:
    return name == "torchft" or name.startswith("torchft.")


@pytest.fixture
def no_torchft(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process without any torchft module (an earlier test may have imported the real
    one), restored afterwards, with sys.meta_path, sys.argv and sys.path."""
    saved = {k: v for k, v in sys.modules.items() if _is_torchft(k)}
    meta_path, path = list(sys.meta_path), list(sys.path)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    for k in saved:
        del sys.modules[k]
    try:
        yield
    finally:
        for k in [k for k in sys.modules if _is_torchft(k)]:
            del sys.modules[k]
        sys.modules.update(saved)
        sys.meta_path[:] = meta_path
        sys.path[:] = path


def test_install_maps_torchft_to_ftclient_and_refuses_the_rest(no_torchft: None) -> None:
    import importlib

    import ftclient
    import ftclient.torchft_compat
    from ftclient.as_torchft import install, installed

    assert not installed()
    assert install() is ftclient.torchft_compat and install() is ftclient.torchft_compat and installed()
    torchft = importlib.import_module("torchft")
    assert torchft is ftclient.torchft_compat and importlib.util.find_spec("torchft") is not None
    assert importlib.import_module("torchft.process_group").ManagedProcessGroup is ftclient.ManagedProcessGroup
    assert importlib.import_module("torchft.checkpointing.pg_transport").PGTransport.__name__ == "PGTransport"
    assert torchft.local_sgd.DiLoCo is ftclient.DiLoCo and torchft.Optimizer is ftclient.OptimizerWrapper
    with pytest.raises(ModuleNotFoundError, match="ftclient has no torchcomms process group") as e:
        importlib.import_module("torchft.torchcomms")
    assert "It covers torchft, torchft.process_group" in str(e.value)
    with pytest.raises(ModuleNotFoundError, match="it has no counterpart in ftclient"):
        importlib.import_module("torchft.no_such_thing")
    with pytest.raises(AttributeError, match="ftclient has no XCCL"):
        torchft.ProcessGroupXCCL  # noqa: B018


def test_install_refuses_once_a_real_torchft_is_imported(no_torchft: None) -> None:
    import types

    from ftclient.as_torchft import install

    sys.modules["torchft"] = types.ModuleType("torchft")
    with pytest.raises(RuntimeError, match="torchft is already imported in this process"):
        install()


def test_code_runs_as_main_with_its_argv_and_usage_errors_exit_2(
        no_torchft: None, capsys: pytest.CaptureFixture[str]) -> None:
    from ftclient.as_torchft import main

    main(["-c", "import sys, torchft, ftclient.torchft_compat as c\n"
                "assert __name__ == '__main__' and torchft is c, (__name__, torchft)\n"
                "print('argv', sys.argv)", "y"])
    assert capsys.readouterr().out == "argv ['-c', 'y']\n"
    with pytest.raises(SystemExit) as code:
        main(["-c", "raise SystemExit(3)"])
    assert code.value.code == 3
    for argv, message in (([], "usage: python -m ftclient.as_torchft SCRIPT"), (["-m"], "needs a value"),
                          (["no/such/script.py"], "can't open file")):
        with pytest.raises(SystemExit) as code:
            main(argv)
        assert code.value.code == 2 and message in capsys.readouterr().err, argv


# -- real processes -----------------------------------------------------------------------------------------


@pytest.mark.integration
def test_the_launcher_answers_import_torchft_with_ftclient_for_a_script_and_a_module(tmp_path: Path) -> None:
    (tmp_path / "probe.py").write_text(PROBE)
    started = [launch(str(tmp_path / "probe.py"), "--lr", "0.1", PROBE_EXIT="3"), launch("-m", "probe", "x", cwd=tmp_path)]
    as_script, as_module = (result(p) for p in started)
    assert as_script.returncode == 3, as_script.stderr  # the program's exit status
    assert as_module.returncode == 0, as_module.stderr
    reports = [json.loads(r.stdout) for r in (as_script, as_module)]
    assert [r["argv"] for r in reports] == [[str(tmp_path / "probe.py"), "--lr", "0.1"], [str(tmp_path / "probe.py"), "x"]]
    for r in reports:
        assert r["name"] == "__main__" and r["is_compat"] and r["find_spec"] and all(r["names"]), r
        assert r["installed_dir"] is not None, "the tests expect the real torchft installed (interop extra)"
        assert r["from_installed"] == []  # nothing of the installed torchft was imported
        assert "No module named 'torchft.torchcomms' under ftclient's torchft compatibility layer" in r["missing"]


WORKER = textwrap.dedent('''
    """One torchtitan fault-tolerant replica group (1 rank, FSDP2) on ftclient, through torchtitan
    0.3.0's TorchFTManager (written by test_torchtitan_launcher; run under ftclient.as_torchft)."""
    import hashlib, importlib.machinery, json, os, sys

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import torchtitan.experiments.torchft.manager as titan_ft
    from torchtitan.distributed.utils import dist_sum
    from torchtitan.experiments.torchft import TorchFTManager

    import ftclient.torchft_compat
    import torchft

    out_path, group, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    installed = importlib.machinery.PathFinder.find_spec("torchft")
    installed_dir = os.path.dirname(installed.origin) if installed is not None else "<none>"
    report = {
        "torchft_is_compat": torchft is ftclient.torchft_compat,
        "torchtitan_sees_compat": titan_ft.has_torchft and titan_ft.torchft is ftclient.torchft_compat,
    }

    # The replica group: its TCPStore (the Manager's MASTER_ADDR/PORT) and a one-rank world for FSDP2.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", store=dist.PrefixStore("fsdp", store), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))

    ft = TorchFTManager(TorchFTManager.Config(enable=True, process_group="gloo", process_group_timeout_ms=20000,
                                              replica_id=group, group_size=2, min_replica_size=1))
    report["pg"] = type(ft.manager._pg).__module__ + "." + type(ft.manager._pg).__name__
    report["replicate_pg"] = type(ft.replicate_pg).__module__ + "." + type(ft.replicate_pg).__name__
    report["dp_info"] = ft.get_dp_info(1, 0)

    def make_model(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    model = make_model(100 + group)  # the groups start apart; init_sync heals the second
    ft.maybe_set_all_reduce_hook([model])
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    ft.manager.set_state_dict_fns(
        lambda sd: (model.load_state_dict(sd["model"]), opt.load_state_dict(sd["optim"])),
        lambda: {"model": model.state_dict(), "optim": opt.state_dict()})
    ft_opt = torchft.Optimizer(ft.manager, opt)

    records = []
    for step in range(steps):
        ft_opt.zero_grad()  # starts the quorum (async)
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1000 * group + step))
        loss = model(x).pow(2).mean()
        loss.backward()  # FSDP2, then the all-reduce hook on dp_replicate
        global_loss = dist_sum(loss.detach(), None, ft.loss_sync_pg)  # torchtitan's loss sync
        before = ft.manager.current_step()
        ft_opt.step()  # should_commit, then the optimizer step
        q = ft.manager.last_quorum_result
        records.append({"step": before, "committed": ft.manager.current_step() == before + 1,
                        "quorum_id": q.quorum_id, "heal": q.heal, "participants": ft.manager.num_participants(),
                        "loss": loss.item(), "global_loss": global_loss})
    def digest(model):
        h = hashlib.sha256()
        for name, p in sorted(model.state_dict().items()):
            h.update(name.encode() + p.full_tensor().detach().numpy().tobytes())
        return h.hexdigest()

    report.update(records=records, digest=digest(model), replica_id=ft.manager.replica_id)
    ft.manager.shutdown(wait=True)  # its liveness stream closes: the cluster drops it at once

    # Semi-synchronous: torchtitan's maybe_semi_sync_training builds torchft.local_sgd.DiLoCo
    # (its own keyword arguments) on the FSDP2 (DTensor) model, with a synchronous quorum.
    from torchtitan.experiments.torchft.config import FaultTolerance
    from torchtitan.experiments.torchft import maybe_semi_sync_training

    semi = FaultTolerance(enable=True, process_group="gloo", process_group_timeout_ms=20000, replica_id=group,
                          group_size=2, min_replica_size=1, semi_sync_method="diloco", sync_steps=2)
    ft = TorchFTManager(semi)
    report["semi_sync_loss_pg"] = ft.loss_sync_pg is None and not ft.use_async_quorum
    model = make_model(200 + group)  # apart again: the first synchronisation heals the second group
    ft.maybe_set_all_reduce_hook([model])  # semi-synchronous: sets no hook
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    syncs = []
    with maybe_semi_sync_training(semi, ft, model, 2, opt) as diloco:
        report["semi_sync"] = type(diloco).__module__ + "." + type(diloco).__name__
        for step in range(2 * steps):
            opt.zero_grad()
            x = torch.randn(8, 6, generator=torch.Generator().manual_seed(2000 * group + step))
            model(x).pow(2).mean().backward()
            opt.step()  # DiLoCo synchronises every sync_steps inner steps
            if diloco.last_sync is not None and diloco.syncs > len(syncs):
                s = diloco.last_sync
                syncs.append({"committed": s.committed, "participants": s.participants, "healed": s.healed,
                              "quorum_id": s.quorum_id})
    report.update(syncs=syncs, semi_sync_digest=digest(model), semi_sync_step=ft.manager.current_step(),
                  from_installed=sorted(m for m, mod in list(sys.modules.items())
                                        if (getattr(mod, "__file__", None) or "").startswith(installed_dir)))
    ft.manager.shutdown(wait=True)
    with open(out_path, "w") as f:
        json.dump(report, f)
''')


@pytest.mark.integration
def test_torchtitan_torchft_manager_trains_on_ftclient_through_the_cluster(
        tmp_path: Path, make_cluster: Callable[..., Any]) -> None:
    pytest.importorskip("torchtitan.experiments.torchft", reason="torchtitan 0.3.0 (the interop extra)")
    cluster = make_cluster(min_replicas=2)
    leader = cluster.wait_for_leader()
    script = tmp_path / "titan_ft_worker.py"
    script.write_text(WORKER)
    env = _env(TORCHFT_LIGHTHOUSE=cluster.endpoints, TORCHFT_TIMEOUT_SEC="20", TORCHFT_QUORUM_TIMEOUT_SEC="40",
               TORCHFT_CONNECT_TIMEOUT_SEC="20")
    procs, outs = [], []
    for group in range(2):
        out = tmp_path / f"group{group}.json"
        log = open(tmp_path / f"group{group}.log", "w")
        outs.append(out)
        procs.append(subprocess.Popen([sys.executable, "-m", "ftclient.as_torchft", str(script), str(out), str(group),
                                       str(STEPS)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    logs = lambda: "\n".join(f"--- group {g}:\n{(tmp_path / f'group{g}.log').read_text()[-3000:]}"  # noqa: E731
                             for g in range(2))
    try:
        def finished() -> bool:
            for p in procs:
                assert p.poll() in (None, 0), f"a worker exited with {p.poll()}\n{logs()}"
            return all(p.poll() == 0 for p in procs)

        wait_for("both torchtitan replica groups to finish", finished, timeout=90, context=logs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    a, b = (json.loads(o.read_text()) for o in outs)
    for r in (a, b):
        assert r["torchft_is_compat"] and r["torchtitan_sees_compat"], r
        assert r["from_installed"] == []  # the installed torchft was never imported
        assert r["pg"] == "ftclient.process_group.ProcessGroupGloo"
        assert r["replicate_pg"] == "ftclient.process_group.ManagedProcessGroup"
        assert [s["committed"] for s in r["records"]] == [True] * STEPS, r["records"]
    assert a["dp_info"] == [2, 0] and b["dp_info"] == [2, 1]
    # Step 0: the second group healed from the first (init_sync); then both train in one quorum.
    assert [s["heal"] for s in b["records"]] == [True] + [False] * (STEPS - 1)
    assert not any(s["heal"] for s in a["records"])
    assert [s["quorum_id"] for s in a["records"]] == [s["quorum_id"] for s in b["records"]]
    assert [s["participants"] for s in a["records"]][1:] == [2] * (STEPS - 1)
    for sa, sb in zip(a["records"][1:], b["records"][1:]):  # torchtitan's loss sync: both losses summed
        assert abs(sa["global_loss"] - (sa["loss"] + sb["loss"])) < 1e-5
        assert abs(sa["global_loss"] - sb["global_loss"]) < 1e-6
    assert a["digest"] == b["digest"]  # averaged gradients through the all-reduce hook: identical weights

    # The semi-synchronous phase: torchtitan's DiLoCo on ftclient, every synchronisation
    # committed by both groups in one quorum, the second group healed at the first.
    for r in (a, b):
        assert r["semi_sync"] == "ftclient.local_sgd.DiLoCo" and r["semi_sync_loss_pg"], r
        assert [s["committed"] for s in r["syncs"]] == [True] * STEPS and r["semi_sync_step"] == STEPS, r["syncs"]
        assert [s["participants"] for s in r["syncs"]] == [2] * STEPS, r["syncs"]
    assert [s["healed"] for s in b["syncs"]] == [True] + [False] * (STEPS - 1)
    assert [s["quorum_id"] for s in a["syncs"]] == [s["quorum_id"] for s in b["syncs"]]
    assert a["syncs"][0]["quorum_id"] > a["records"][-1]["quorum_id"]  # a new quorum of the new managers
    assert a["semi_sync_digest"] == b["semi_sync_digest"]

    status = cluster.status(leader)  # the cluster's last quorum: the two DiLoCo managers
    assert status is not None and status.has_quorum
    members = [p.replica_id for p in status.quorum.participants]
    assert len(members) == 2 and all(m.startswith("torchtitan_ft_") for m in members), members
    assert a["replica_id"] not in members  # the first managers are gone from it
