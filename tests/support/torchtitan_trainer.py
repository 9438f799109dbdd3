"""One replica group of torchtitan 0.3.0's own fault-tolerant trainer, for ``support.training``.

The process the harness starts is ``torchrun --standalone --nproc_per_node=N`` (its own session:
a SIGKILL of the group takes torchrun and its ranks), which runs ``python -m torchtitan.train
--module torchft.llama3 --config llama3_torchft_debugmodel --fault_tolerance.enable ...`` through
``examples/torchtitan/cpu_shim.py`` (what a CPU and torch 2.13 lack; nothing of torchft, ftclient
or the cluster). The SDK line decides what ``import torchft`` gives the trainer:

* ``"0.2.0"``: torchft 0.2.0, installed in the environment running the tests;
* ``"nightly"``: torchft-nightly, in its own virtual environment (``support.torchft_lines``);
* ``"ftclient"``: ftclient, through ``torchrun ... -m ftclient.as_torchft cpu_shim.py ...``
  (the trainer unedited).

torchft takes exactly one lighthouse URL (``TORCHFT_LIGHTHOUSE``: give it a node that the test
does not kill); ftclient takes the list of every node.

What the harness reads is what torchtitan and the SDK log and save, nothing of its own:

* torchtitan's metric line per step (``step: N  loss: L``) and the manager's ``should_commit=``
  line per commit, per rank (torchrun's ``--tee 3`` prefixes each rank's lines with
  ``[default<rank>]:``), and heal lines (torchft: ``healing required``; ftclient: ``healing from``);
* the final DCP checkpoint of each group (``--checkpoint.enable``, saved at the last step, every
  group its own: ``--checkpoint.no-enable-ft-dataloader-checkpoints``), loaded in the test process
  (``final_state``) and compared tensor by tensor across groups (``compare_states``).

The working directory of every group is the run's directory, where ``make_assets.py`` wrote the
tokenizer and the ``c4_test`` corpus that torchtitan's debug config reads relative to it.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

# What torchrun and the SDKs log, read the same way by the benchmark: torchrun's per-rank prefix,
# the managers' should_commit and heal lines, torchft's donor crash (the state dict taken under
# FSDP2's forward). The process tree under torchrun, from /proc.
from benchmarks.procs import descendants
from benchmarks.torchtitan import COMMIT_LINE, DONOR_CRASH, HEAL_LINE, RANK_PREFIX
from support.trainer_process import ROOT, TrainerProcess

SHIM = ROOT / "examples" / "torchtitan" / "cpu_shim.py"
MAKE_ASSETS = ROOT / "examples" / "torchtitan" / "make_assets.py"

LINES = ("ftclient", "0.2.0", "nightly")

# Small enough for 2 cores (~0.5 s a step, one core a group), large enough to be torchtitan's
# real path: the Llama3 debug model (6 layers, dim 256), FlexAttention, AdamW, LR warm-up and
# decay, the c4_test loader, FSDP2 on each group's mesh.
BASE_ARGS = [
    "--module", "torchft.llama3", "--config", "llama3_torchft_debugmodel",
    "--fault_tolerance.enable",
    "--fault_tolerance.process_group", "gloo",
    "--training.seq_len", "128", "--training.local_batch_size", "2",
    "--profiler.no-enable-profiling", "--validator.no-enable",
    "--metrics.log_freq", "1", "--metrics.disable_color_printing",
    "--checkpoint.enable", "--checkpoint.interval", "100000",
    "--checkpoint.no-enable-ft-dataloader-checkpoints",
    # The timeout order docs/torchtitan.md gives: the group's own process group (15 s in this
    # config) above the SDK's quorum and transfer timeouts (kind_env): a rank whose peer in its
    # group still waits for a quorum or a heal must not time out first.
    "--comm.train_timeout_seconds", "180",
]

STEP_LINE = re.compile(r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>\S+)")


def python_for(line: str) -> str:
    if line == "ftclient":
        return sys.executable
    from support.torchft_lines import python_for as torchft_python

    return torchft_python(line)


def make_assets(directory: Path) -> None:
    """torchtitan's tokenizer and c4_test corpus under ``directory/tests/assets`` (made here by
    ``examples/torchtitan/make_assets.py``, nothing downloaded)."""
    sys.path.insert(0, str(MAKE_ASSETS.parent))
    try:
        import make_assets as assets  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(MAKE_ASSETS.parent))
    assets.make_assets(directory)


@dataclass(kw_only=True)
class TorchtitanTrainer(TrainerProcess):
    """One replica group: ``torchrun`` of torchtitan's FT trainer with ``nproc`` ranks."""

    line: str                   # "ftclient", "0.2.0" or "nightly"
    groups: int                 # --fault_tolerance.group_size: how many replica groups
    steps: int                  # --training.steps
    nproc: int = 1              # ranks in the group (FSDP over them)
    min_replica_size: int = 1
    args: list[str] = field(default_factory=list)  # more torchtitan options (semi-sync, parallelism)

    DIGESTS: ClassVar[tuple[str, ...]] = ("model_sha256", "optim_sha256")

    @property
    def dump_folder(self) -> Path:
        # One per replica group, kept across its incarnations (torchtitan's --dump_folder).
        return self.workdir / f"dump-g{self.group}"

    def command(self) -> list[str]:
        launcher = [python_for(self.line), "-m", "torch.distributed.run", "--standalone",
                    f"--nproc_per_node={self.nproc}", "--tee", "3"]
        program = (["-m", "ftclient.as_torchft", str(SHIM)] if self.line == "ftclient" else [str(SHIM)])
        return [*launcher, *program, *BASE_ARGS,
                f"--fault_tolerance.replica_id={self.group}", f"--fault_tolerance.group_size={self.groups}",
                "--fault_tolerance.min_replica_size", str(self.min_replica_size),
                "--training.steps", str(self.steps), "--dump_folder", str(self.dump_folder), *self.args]

    def kind_env(self) -> dict[str, str]:
        # One thread per rank: the groups share 2 cores. The quorum timeout outlasts a killed
        # group's restart on a loaded 2-core host (torchrun, imports, model: 30 s and more was
        # seen), which a survivor with min_replica_size 2 waits for in its Quorum call. The
        # assets are local: Hugging Face's datasets library is told not to look for the hub.
        return {"OMP_NUM_THREADS": "1", "TORCHFT_TIMEOUT_SEC": "30", "TORCHFT_QUORUM_TIMEOUT_SEC": "120",
                "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}

    def kill(self) -> None:
        """SIGKILL torchrun and every process under it, then reap torchrun. torchrun starts each
        rank in a session of its own (torch.distributed.elastic's subprocess handler), so a
        SIGKILL of torchrun's process group would leave the ranks training on, orphaned: torchrun
        is stopped first (it can start no rank after its descendants were listed), then all die."""
        p = self.process
        if p is None:
            return
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
            for pid in descendants(p.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        super().kill()

    # -- what the group logged --------------------------------------------------------------------

    def rank_lines(self, rank: int = 0) -> list[str]:
        """This incarnation's output lines of one rank (torchrun's ``[default<rank>]:`` prefix)."""
        out = []
        for line in self.output().splitlines():
            m = RANK_PREFIX.match(line)
            if m and int(m["rank"]) == rank:
                out.append(line[m.end():])
        return out

    def steps_logged(self, rank: int = 0) -> list[tuple[int, float]]:
        """torchtitan's (step, loss) metric lines of one rank, in order."""
        found = []
        for line in self.rank_lines(rank):
            m = STEP_LINE.search(line)
            if m:
                found.append((int(m["step"]), float(m["loss"])))
        return found

    def commits(self, rank: int = 0) -> list[tuple[int, bool]]:
        """The manager's should_commit decisions of one rank: (manager step, committed)."""
        found = []
        for line in self.rank_lines(rank):
            m = COMMIT_LINE.search(line)
            if m:
                found.append((int(m["step"]), m["ok"] == "True"))
        return found

    def heals(self, rank: int = 0) -> int:
        return sum(1 for line in self.rank_lines(rank) if HEAL_LINE.search(line))

    def donor_crashed(self) -> bool:
        return bool(DONOR_CRASH.search(self.output()))

    def step(self) -> int:
        logged = self.steps_logged()
        return logged[-1][0] if logged else -1

    # -- what the group saved ---------------------------------------------------------------------

    def checkpoint_dir(self, step: int | None = None) -> Path:
        return self.dump_folder / "checkpoint" / f"step-{self.steps if step is None else step}"

    def results(self) -> list[dict[str, Any] | None]:
        ckpt = self.checkpoint_dir()
        if not (ckpt / ".metadata").exists():
            return [None]
        state = final_state(ckpt)
        model = {k: v for k, v in state.items() if not k.startswith(("optimizer.", "lr_scheduler.", "train_state."))}
        optim = {k: v for k, v in state.items() if k.startswith("optimizer.")}
        return [{"group": self.group, "final_step": int(state.get("train_state.step", -1)),
                 "model_sha256": digest(model), "optim_sha256": digest(optim), "tensors": len(state)}]

    def process_problems(self, result: dict[str, Any] | None = None) -> list[str]:
        return [] if self.incarnation == 0 else [f"{self.name} was restarted"]

    def seamless_problems(self, result: dict[str, Any] | None = None) -> list[str]:
        problems = []
        for rank in range(self.nproc):
            failed = [s for s, ok in self.commits(rank) if not ok]
            if failed:
                problems.append(f"{self.name} rank {rank}: should_commit=False at manager steps {failed}")
        logged = [s for s, _ in self.steps_logged()]
        if not logged or logged != list(range(logged[0], logged[0] + len(logged))):
            problems.append(f"{self.name}: torchtitan's steps are not consecutive: {logged}")
        return problems

    def tail(self, lines: int = 40) -> str:
        return super().tail(lines)


def final_state(checkpoint: Path) -> dict[str, Any]:
    """A DCP checkpoint of torchtitan as one flat dict of full (unsharded) tensors and values,
    the per-group data loader's state left out (each group reads its own shard of the data)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "state.pt"
        dcp_to_torch_save(str(checkpoint), str(out))
        loaded = torch.load(out, map_location="cpu", weights_only=False)
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, (list, tuple)) and any(isinstance(v, (dict, torch.Tensor)) for v in value):
            for i, v in enumerate(value):
                walk(f"{prefix}.{i}", v)
        else:
            flat[prefix] = value

    walk("", loaded)
    return {k: v for k, v in flat.items() if not k.startswith("dataloader")}


def digest(state: dict[str, Any]) -> str:
    import torch

    h = hashlib.sha256()
    for key in sorted(state):
        value = state[key]
        h.update(key.encode())
        if isinstance(value, torch.Tensor):
            h.update(str(value.dtype).encode())
            h.update(value.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(value).encode())
    return h.hexdigest()


def compare_states(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Where two final states differ, key by key (empty: the same keys, every tensor equal bit
    for bit, every other value equal)."""
    import torch

    problems = []
    if set(a) != set(b):
        problems.append(f"keys differ: only in the first {sorted(set(a) - set(b))[:5]}, "
                        f"only in the second {sorted(set(b) - set(a))[:5]}")
    for key in sorted(set(a) & set(b)):
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x, y):
                diff = (x.float() - y.float()).abs().max().item() if x.shape == y.shape else "shape"
                problems.append(f"{key}: tensors differ (max |a-b| {diff})")
        elif x != y:
            problems.append(f"{key}: {x!r} != {y!r}")
    return problems
