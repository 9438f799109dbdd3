"""torchtitan's trainer on CPU: ``python examples/torchtitan/cpu_shim.py ARGS`` is
``python -m torchtitan.train ARGS`` with the few things patched that a CPU (and torch 2.13)
lack, and one torchtitan 0.3.0 bug that makes a healed replica group diverge (patch 6). Nothing
here touches torchft, ftclient or the lighthouse cluster: the trainer's fault tolerance runs
exactly as it would on a GPU, with ``--fault_tolerance.process_group gloo``.

Run it where ``make_assets.py`` wrote ``tests/assets/`` (the trainer reads its tokenizer and data
set relative to the working directory)::

    torchrun --standalone --nproc_per_node=1 examples/torchtitan/cpu_shim.py \\
        --module torchft.llama3 --config llama3_torchft_debugmodel ...
    # the same trainer on ftclient, unedited:
    torchrun --standalone --nproc_per_node=1 -m ftclient.as_torchft examples/torchtitan/cpu_shim.py ...

Each patch, and why (torchtitan 0.3.0, torch 2.13.0 CPU build):

1. **Device.** ``torchtitan.tools.utils`` picks ``_get_available_device_type() or "cuda"``: with
   no accelerator that is ``"cuda"``. The shim sets ``device_type = "cpu"`` and a device module
   that is ``torch.cpu`` plus what torchtitan's memory monitor and trainer call and ``torch.cpu``
   lacks (``get_device_name``, ``get_device_properties``, ``memory_stats``,
   ``reset_peak_memory_stats``, ``empty_cache``, an integer ``current_device``).
2. **triton.** ``torchtitan.distributed.minimal_async_ep.kernels`` imports ``triton`` on every
   path (through the MoE token dispatcher); the CPU build of torch ships no triton. The shim
   gives that one module stand-ins that raise if a kernel is ever called (the Llama3 debug model
   has no MoE, so none is).
3. **FlexAttention.** torch refuses FlexAttention's backward on CPU (``_validate_device``), and
   torchtitan runs it through ``torch.compile`` (inductor, made for GPU kernels). The shim lets
   ``requires_grad`` inputs through on CPU and runs ``flex_attention`` and ``create_block_mask``
   eagerly (torch's reference implementation, differentiable).
4. **Timeouts.** torchtitan calls ``torch.distributed.set_timeout``, which torch 2.13 has only as
   ``distributed_c10d._set_pg_timeout``; the shim adds the public name. (Any device.)
5. **Gloo and FSDP2.** Gloo has no ``PREMUL_SUM``, which FSDP2 uses to scale gradients in its
   reduce-scatter; where torchtitan sets each FSDP module's gradient divide factor to 1 (it
   divides by the token count itself), the shim also makes the module reduce with a plain sum
   (``set_force_sum_reduction_for_comms(True)``),
   so ``--parallelism.data_parallel_shard_degree 2`` runs on Gloo (with
   ``--parallelism.spmd_backend partial_dtensor``).
6. **A healed group's stale learning rate** (torchtitan 0.3.0, any device, any SDK).
   ``TorchFTOptimizersContainer.state_dict()`` returns a cache made once at set-up, and what a
   peer heals from is that cache: its tensors are live, but its ``param_groups`` (the learning
   rate among them) are those of step 0. A group healed mid-warm-up or mid-decay runs its next
   step with step 0's learning rate, and its weights then differ from its peers' for good (by
   ~1e-4 after one step in ``tests/torchtitan``). The shim refreshes the cache each time the
   state is asked for, which is what the cache stands for.
"""

from __future__ import annotations

import runpy
import sys
import types
from datetime import timedelta
from typing import Any

import torch


class _CpuDeviceModule(types.ModuleType):
    """``torch.cpu`` with what torchtitan calls on its device module and ``torch.cpu`` lacks."""

    def __init__(self) -> None:
        super().__init__("torchtitan_cpu_device")
        self._base = torch.cpu

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)

    def current_device(self) -> int:
        return 0

    def set_device(self, device: Any) -> None:
        pass  # one CPU device

    def get_device_name(self, device: Any = None) -> str:
        return "cpu"

    def get_device_properties(self, device: Any = None) -> Any:
        import os
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return types.SimpleNamespace(name="cpu", total_memory=total)

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        # The keys torchtitan's DeviceMemoryMonitor reads, all zero: CPU memory is not tracked.
        return {"active_bytes.all.peak": 0, "active_bytes.all.current": 0, "reserved_bytes.all.peak": 0,
                "reserved_bytes.all.current": 0, "num_alloc_retries": 0, "num_ooms": 0}

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def synchronize(self, device: Any = None) -> None:
        pass


def _patch_device() -> None:
    if torch._utils._get_available_device_type() is not None:
        return  # an accelerator: torchtitan picks it itself
    import torchtitan.tools.utils as utils  # before any module imports device_type from it

    utils.device_type, utils.device_module = "cpu", _CpuDeviceModule()
    utils.get_device_info = lambda: (utils.device_type, utils.device_module)


def _patch_triton_kernels() -> None:
    try:
        import triton  # noqa: F401
        return
    except ImportError:
        pass
    name = "torchtitan.distributed.minimal_async_ep.kernels"

    class _NoTriton(types.ModuleType):
        def __getattr__(self, attr: str) -> Any:
            if attr.startswith("__"):
                raise AttributeError(attr)

            def kernel(*args: Any, **kwargs: Any) -> None:
                raise RuntimeError(f"{name}.{attr} needs triton, which this CPU build lacks (cpu_shim.py)")
            return kernel

    sys.modules[name] = _NoTriton(name)


def _patch_flex_attention() -> None:
    import torch.nn.attention.flex_attention as fa

    original = fa._validate_device

    def validate_device(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if query.device.type == "cpu":
            return  # the reference implementation's backward is plain autograd
        original(query, key, value)

    fa._validate_device = validate_device
    import torchtitan.models.common.attention as attention

    attention.FlexAttention._compiled_flex_attn = staticmethod(fa.flex_attention)
    attention._compiled_create_block_mask = fa.create_block_mask


def _patch_set_timeout() -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not hasattr(dist, "set_timeout"):
        def set_timeout(timeout: timedelta, group: Any = None) -> None:
            distributed_c10d._set_pg_timeout(timeout, group)
        dist.set_timeout = set_timeout


def _patch_fsdp_sum_reduction() -> None:
    if torch._utils._get_available_device_type() is not None:
        return
    from torch.distributed.fsdp import FSDPModule

    original = FSDPModule.set_gradient_divide_factor
    if getattr(original, "_cpu_shim", False):
        return

    def set_gradient_divide_factor(self: FSDPModule, factor: float) -> None:
        # torchtitan calls this on every FSDP module (disable_fsdp_gradient_division)
        original(self, factor)
        self.set_force_sum_reduction_for_comms(True)

    set_gradient_divide_factor._cpu_shim = True  # type: ignore[attr-defined]
    FSDPModule.set_gradient_divide_factor = set_gradient_divide_factor  # type: ignore[method-assign]


def _patch_stale_optimizer_cache() -> None:
    from torchtitan.experiments.torchft.optimizer import TorchFTOptimizersContainer

    if getattr(TorchFTOptimizersContainer.state_dict, "_cpu_shim", False):
        return

    def state_dict(self: TorchFTOptimizersContainer) -> dict[str, Any]:
        self.init_cache_state_dict()  # the current param_groups (learning rate), not step 0's
        return self.cache_state_dict

    state_dict._cpu_shim = True  # type: ignore[attr-defined]
    TorchFTOptimizersContainer.state_dict = state_dict  # type: ignore[method-assign]


def install() -> None:
    """Apply every patch (idempotent); call before torchtitan's trainer is imported."""
    _patch_device()
    _patch_triton_kernels()
    _patch_set_timeout()
    _patch_fsdp_sum_reduction()
    _patch_flex_attention()
    _patch_stale_optimizer_cache()


def main() -> None:
    install()
    sys.argv[0] = "torchtitan.train"
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
