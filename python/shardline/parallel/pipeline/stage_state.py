"""A pipeline rank's parameters and state, for optimizers, state dicts and the contract.

``PipelineState`` is the half of ``PipelineModule`` that is not running schedules
(``runtime``): its parameters (with ZeRO on the replicas, the 1-D parts the optimizer steps),
gradient clipping across stages and replicas, whole-model state dicts, and the four contract
methods with ``layout()`` (the strategy contract). The functions it calls are in ``state`` (tied
weights, whole-tensor ``Shard``s) and ``replicas`` (the data-parallel wrappers: ZeRO's parts).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from shardline.comm.group import ProcessGroup
from shardline.parallel._common import ModelParallel
from shardline.parallel.contract import Shard, load_optim_by_name
from shardline.parallel.pipeline.replicas import StageReplicas
from shardline.parallel.pipeline.state_dicts import (
    clip_grad_norm,
    full_state_dict,
    load_sharded_state,
    sharded_optim_state,
    sharded_state,
)
from shardline.parallel.pipeline.tied import TensorInfo, Tied

__all__ = ["PipelineState"]


class PipelineState(ModelParallel, nn.Module):
    """Parameters, clipping, state dicts and the strategy contract of a pipeline rank.

    ``PipelineModule`` sets the attributes below when it is built.
    """

    _group: ProcessGroup
    _p: int
    _dp: ProcessGroup | None
    _replicas: StageReplicas | None
    _tied: list[Tied]
    _infos: dict[str, TensorInfo]
    dp_strategy: str | None
    schedule: str
    stages: list[int]
    microbatches: int
    input_names: list[str] | None = None  # a model traced on keyword inputs: their names

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the gradients to the whole model's gradient norm; returns that norm.

        A collective over the pipeline's stages (DDP replicas agree already; with ZeRO, also
        over the replicas, each holding its parts; with tensor parallelism inside the stages,
        also over its group, each element once). Call it between ``step`` and
        ``opt.step()``, as ``torch.nn.utils.clip_grad_norm_``.
        """
        groups = self._norm_groups(self._group)  # with tensor parallelism, its group too
        if self._zero is not None:  # each replica holds parts: summed over them too
            groups = [*groups, self._zero.dp]
        return clip_grad_norm(self, self._tied, groups, max_norm, norm_type, self._copies)

    @property
    def _zero(self) -> StageReplicas | None:
        """The replicas when ZeRO shards them (the optimizer steps parts), else ``None``."""
        replicas = self._replicas
        return replicas if replicas is not None and replicas.zero else None

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the model's names.

        With ZeRO on the replicas: the 1-D parts this rank's optimizer steps
        (``pipeline.replicas``).
        """
        if self._zero is None:
            yield from super().named_parameters(prefix, recurse, remove_duplicate)
        else:
            yield from self._zero.named_locals(prefix)

    def memory_stats(self) -> dict[str, int]:
        """Bytes this rank holds now, by kind.

        Whole parameters (``params``), optimizer-side copies (``master``: ZeRO's parts, else 0)
        and gradients (``grads``).
        """
        if self._zero is not None:
            return self._zero.memory_stats()
        params = list(super().parameters())
        return {
            "params": sum(p.numel() * p.element_size() for p in params),
            "master": 0,
            "grads": sum(g.numel() * g.element_size() for p in params if (g := p.grad) is not None),
        }

    def bind_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Keeps this rank's parameters of an optimizer built over the whole model.

        With ZeRO, their parts; groups and hyperparameters stay. Returns the same optimizer.
        """
        kept = {id(p) for _, p in nn.Module.named_parameters(self)}  # the whole ones
        for g in optimizer.param_groups:
            g["params"] = [p for p in g["params"] if id(p) in kept]
        for p in [p for p in optimizer.state if id(p) not in kept]:
            del optimizer.state[p]
        if self._zero is not None:
            self._zero.bind(optimizer)
        return optimizer

    # -- state -------------------------------------------------------------------------------

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The whole model's state dict, on every rank (a collective over the pipeline).

        With torch's arguments (``destination``, ``prefix``, ...): this rank's tensors only.
        """
        if args or kwargs:
            return super().state_dict(*args, **kwargs)
        with self._whole():
            return full_state_dict(self, self._group)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Takes a whole model's state dict, as ``state_dict()`` gives.

        Each rank loads the tensors of its stages.
        """
        with self._whole(writeback=True):  # ZeRO: the parts are taken from the loaded values
            mine = super().state_dict()
            return super().load_state_dict(
                {k: v for k, v in state_dict.items() if k in mine}, strict=strict, assign=assign
            )

    def _whole(self, writeback: bool = False) -> contextlib.AbstractContextManager[None]:
        """ZeRO: whole parameters with their master values inside; else nothing to do."""
        zero = self._zero
        return zero.whole(writeback) if zero is not None else contextlib.nullcontext()

    def sharded_state_dict(self) -> dict[str, Any]:
        """The strategy contract: every tensor of the model, as a ``Shard``.

        A whole-tensor one where this rank holds it, an empty one elsewhere (see
        ``pipeline.state_dicts``).
        """
        out = sharded_state(self, self._infos, params=self._zero is None)
        if self._zero is not None:
            out.update(self._zero.sharded_params())
        for t in self._tied:  # a tied weight held here: one value under all of its names
            held = next(
                (out[n] for n in t.names if isinstance(out[n], Shard) and out[n].pieces), None
            )
            if held is not None:
                out.update(dict.fromkeys(t.names, held))
        return out

    def _canonical(self) -> dict[str, str]:
        """This rank's names of tied weights -> the first of their names (the model's own).

        Optimizer state is saved and loaded under that one name, so a checkpoint's groups
        and state read as the unsplit model's, whichever stage holds a copy.
        """
        return {n: t.names[0] for t in self._tied for n in t.names[1:]}

    def load_sharded_state_dict(self, sd: dict[str, Any]) -> None:
        """The strategy contract: takes this rank's tensors back."""
        if self._zero is None:
            load_sharded_state(self, sd)
            return
        parts = {n for n, _ in self._zero.named_locals()}
        load_sharded_state(self, {k: v for k, v in sd.items() if k not in parts}, params=False)
        self._zero.load_params({k: v for k, v in sd.items() if k in parts})

    def sharded_optim_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The strategy contract: this rank's optimizer state by parameter name.

        Every tensor is a ``Shard`` of the whole tensor (see ``pipeline.state_dicts``).
        """
        state = None
        if self._zero is not None:
            state = self._zero.sharded_optim_state(optimizer)
        out = sharded_optim_state(self, optimizer, self._group, state)
        canon = self._canonical()
        out["state"] = {canon.get(n, n): v for n, v in out["state"].items()}
        for g in out["param_groups"]:
            g["params"] = list(dict.fromkeys(canon.get(n, n) for n in g["params"]))
        return out

    def load_sharded_optim_state_dict(
        self, optimizer: torch.optim.Optimizer, sd: dict[str, Any]
    ) -> None:
        """The strategy contract: takes this rank's optimizer state back, by name.

        A tied weight's state comes under its first name (``sharded_optim_state_dict``).
        """
        mine = {n for n, _ in self.named_parameters()}
        local = {first: n for n, first in self._canonical().items() if n in mine}
        state = {n if n in mine else local.get(n, n): v for n, v in sd["state"].items()}
        load_optim_by_name(self, optimizer, {**sd, "state": state})

    def layout(self) -> dict[str, Any]:
        """How this pipeline lays state out, for people reading a checkpoint's index."""
        mesh = {"pp": self._p}
        if self._dp is not None:
            mesh = {"dp": self._dp.world_size, **mesh}
        return {
            "strategy": "pipeline" if self._dp is None else f"{self.dp_strategy} x pipeline",
            "schedule": self.schedule,
            "mesh": mesh,
            "virtual_stages": len(self.stages),
            "microbatches": self.microbatches,
        }
