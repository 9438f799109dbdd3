"""DiLoCo heals an FSDP2 model whose inner optimizer is a container with a flattened state dict,
as torchtitan's ``OptimizersContainer`` is (its ``state_dict()`` is DCP's
``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``: ``"state.<fqn>.exp_avg"``
keys holding DTensors).

DiLoCo's registered state carries the inner optimizer's tensors as local shards (they travel
through ``torch.save``); loading them back must make DTensors of them again. Before the fix the
flattened layout was loaded as plain tensors, and the healed group's next fused AdamW step failed
with "aten._fused_adamw_.default got mixed torch.Tensor and DTensor" (torchtitan's trainer on
ftclient in DiLoCo, at the first step after a heal). One process: a 1-rank Gloo group, the model
sharded with ``fully_shard``, the state round-tripped through ``torch.save`` as a checkpoint
transfer does, then an inner step on the healed copy; the healed optimizer state equals the
source's.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed")

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    import io, os, sys
    import torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from ftclient.local_sgd import DiLoCo

    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    FLAT = StateDictOptions(flatten_optimizer_state_dict=True)

    class Container(torch.optim.Optimizer):
        """torchtitan's OptimizersContainer in small: one AdamW, DCP's flattened state dict."""
        def __init__(self, model):
            self.model, self.inner = model, torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
            super().__init__(model.parameters(), {"lr": 0.1})
            self.param_groups = self.inner.param_groups
        def step(self, closure=None):
            self.inner.step()
        def zero_grad(self, set_to_none=True):
            self.inner.zero_grad(set_to_none)
        def state_dict(self):
            return get_optimizer_state_dict(self.model, self.inner, options=FLAT)
        def load_state_dict(self, sd):
            set_optimizer_state_dict(self.model, self.inner, optim_state_dict=sd, options=FLAT)

    class Manager:  # what DiLoCo asks of a manager before any round: registration only
        def __init__(self): self.fns = {}
        def register_state_dict_fn(self, key, load, save): self.fns[key] = (load, save)

    def make(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        fully_shard(model)
        opt = Container(model)
        model(torch.ones(3, 4)).sum().backward()
        opt.step(); opt.zero_grad()  # optimizer state exists, as torchtitan's cached one does
        manager = Manager()
        diloco = DiLoCo(manager, [model], opt, torch.optim.SGD(model.parameters(), lr=0.7), sync_every=2)
        return model, opt, manager, diloco

    src_model, src_opt, src_mgr, _ = make(0)
    dst_model, dst_opt, dst_mgr, _ = make(1)
    sent = {k: save() for k, (load, save) in src_mgr.fns.items()}
    buf = io.BytesIO(); torch.save(sent, buf); buf.seek(0)
    received = torch.load(buf, weights_only=False)
    for k, (load, save) in dst_mgr.fns.items():
        load(received[k])
    plain = [k for k, v in dst_opt.state_dict().items() if isinstance(v, torch.Tensor) and not isinstance(v, DTensor)
             and v.dim() > 0]
    assert not plain, f"plain tensors in the healed optimizer state: {plain[:3]}"
    for k, v in src_opt.state_dict().items():
        w = dst_opt.state_dict()[k]
        if isinstance(v, torch.Tensor):
            assert torch.equal(v.full_tensor() if isinstance(v, DTensor) else v,
                               w.full_tensor() if isinstance(w, DTensor) else w), k
    dst_model(torch.ones(3, 4)).sum().backward()
    dst_opt.step()  # raised "got mixed torch.Tensor and DTensor" before the fix
    print("OK")
''')


@pytest.mark.integration
def test_diloco_heals_a_flattened_container_optimizer_as_dtensors(tmp_path: Path) -> None:
    script = tmp_path / "heal.py"
    script.write_text(SCRIPT)
    res = subprocess.run([sys.executable, str(script), str(tmp_path / "store")], cwd=ROOT, capture_output=True,
                         text=True, timeout=180, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stdout[-3000:] + res.stderr[-3000:]
