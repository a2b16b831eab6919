"""What the wrappers of ``optim`` share: a full replica of the model on every rank.

Local SGD, async SGD and Hogwild each wrap a plain module whose parameters every rank holds
in full. ``Replica`` gives them the module's forward, parameters and state dicts, the strategy
contract's defaults (the module's own state, replicated), and ``comm_stats()`` from the bytes
the wrapper charged to ``self._traffic``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from shardline.comm import traffic
from shardline.comm.group import ProcessGroup
from shardline.parallel import contract
from shardline.parallel.data.compressed import comm_stats

__all__ = ["Replica", "split_like"]


def split_like(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of consecutive parts of ``flat``, shaped like ``tensors`` (the inverse of a cat)."""
    parts = torch.split(flat[: sum(t.numel() for t in tensors)], [t.numel() for t in tensors])
    return [part.view_as(t) for part, t in zip(parts, tensors, strict=True)]


class Replica(nn.Module):
    """Base of the wrappers that keep a full replica per rank (see the module docstring).

    Subclasses set ``module``, ``group`` and ``strategy`` (the name in checkpoints' layout),
    and count their steps in ``_report_steps()``.
    """

    module: nn.Module
    group: ProcessGroup
    strategy = "replica"

    def __init__(self) -> None:
        super().__init__()
        self._traffic = traffic.Traffic()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The replica's forward."""
        return self.module(*args, **kwargs)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The replica's parameters (what the optimizer steps)."""
        return self.module.parameters(recurse)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's ``state_dict`` (this rank's replica)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Loads into the replica."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    # -- reports -------------------------------------------------------------------------------

    def _report_steps(self) -> int:
        return 0

    def _report_extra(self) -> dict[str, Any]:
        return {}

    def comm_stats(self) -> dict[str, Any]:
        """Bytes this rank sent and received for the model so far.

        In total, per op kind and per optimizer step (``shardline.comm.traffic`` says how they
        are counted).
        """
        stats = comm_stats([self._traffic.snapshot()], None, self._report_steps())
        return {**stats, **self._report_extra()}

    # -- the strategy contract -----------------------------------------------------------------

    def layout(self) -> dict[str, Any]:
        """How this wrapper lays state out (recorded in checkpoints)."""
        inner = contract.layout(self.module)
        return {**inner, "strategy": self.strategy, "mesh": {"dp": self.group.world_size}}

    def sharded_state_dict(self) -> dict[str, Any]:
        """The replica's state (replicated)."""
        return contract.sharded_state_dict(self.module)

    def load_sharded_state_dict(self, sd: dict[str, Any]) -> None:
        """Takes ``sharded_state_dict()``'s shape back into the replica."""
        contract.load_sharded_state_dict(self.module, sd)

    def sharded_optim_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state by the module's parameter names."""
        return contract.sharded_optim_state_dict(self.module, optimizer)

    def load_sharded_optim_state_dict(
        self, optimizer: torch.optim.Optimizer, sd: dict[str, Any]
    ) -> None:
        """Takes ``sharded_optim_state_dict()``'s shape back into ``optimizer``."""
        contract.load_sharded_optim_state_dict(self.module, optimizer, sd)
