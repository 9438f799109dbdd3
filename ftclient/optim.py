"""Fault-tolerant optimizer wrapper (ftclient's counterpart of torchft.optim).

This module owns the optimizer side of the per-step protocol: ``zero_grad()`` starts the
quorum for the step (``manager.start_quorum()``, which overlaps with the forward pass) and
``step()`` applies the update only when the replica groups agree to commit
(``manager.should_commit()``). Everything else is passed through to the wrapped optimizer.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol

import torch
from torch.optim import Optimizer as TorchOptimizer

__all__ = ["Optimizer", "OptimizerWrapper"]


class _QuorumManager(Protocol):
    def start_quorum(self) -> None: ...

    def should_commit(self) -> bool: ...


class OptimizerWrapper(TorchOptimizer):
    """Wraps any torch optimizer so it only steps on committed steps.

    Call ``zero_grad()`` at the start of each step (before the forward pass) and ``step()``
    after the backward pass::

        optimizer = OptimizerWrapper(manager, torch.optim.AdamW(model.parameters()))
        for batch in loader:
            optimizer.zero_grad()          # manager.start_quorum()
            loss_fn(model(batch)).backward()
            optimizer.step()               # steps iff manager.should_commit()

    ``param_groups``, ``state``, ``defaults``, ``state_dict``, ``load_state_dict`` and
    ``add_param_group`` are the wrapped optimizer's, so LR schedulers and checkpointing work
    on the wrapper. Closures are not supported (a closure would re-run forward/backward outside
    the quorum).

    Args:
        manager: the Manager (anything with ``start_quorum()`` and ``should_commit() -> bool``).
        optim: the optimizer to wrap.
    """

    def __init__(self, manager: _QuorumManager, optim: TorchOptimizer) -> None:
        # torch's Optimizer.__init__ is deliberately not called: all state lives in ``optim``.
        self.optim = optim
        self.manager = manager

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start the quorum for this step, then zero the wrapped optimizer's gradients."""
        self.manager.start_quorum()
        self.optim.zero_grad(set_to_none)

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Step the wrapped optimizer iff ``manager.should_commit()`` is True."""
        if closure is not None:
            raise ValueError(
                "OptimizerWrapper.step does not take a closure: run forward/backward between "
                "zero_grad() and step() instead"
            )
        if self.manager.should_commit():
            self.optim.step()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    @property  # type: ignore[override]
    def state(self) -> Mapping[torch.Tensor, Any]:
        return self.optim.state

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.optim.defaults

    def __repr__(self) -> str:
        return f"OptimizerWrapper({self.optim!r})"


Optimizer = OptimizerWrapper
"""Alias of :class:`OptimizerWrapper` (torchft spells it ``torchft.Optimizer``)."""
