"""A pipeline's state dicts: full ones gathered from every rank, and the strategy contract's.

- **Full state dicts.** ``state_dict()`` gathers every rank's tensors: the whole model's, on
  every rank (a collective over the pipeline's ranks).
- **The strategy contract** (``parallel.contract``). Every rank names every tensor of the model:
  a ``Shard`` holding the whole tensor (one box at zero offsets) where this rank holds it, an
  empty one elsewhere. Copies of one tensor on several ranks (a tied weight's, data-parallel
  replicas') are equal, so each lists the same piece: saved more than once, loaded into
  every copy. The checkpointer then saves and reshards a pipeline like any other layout.
- **The gradient norm** over every stage's parameters (``clip_grad_norm``).
"""

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shardline.comm.group import ProcessGroup
from shardline.comm.objects import all_gather_object
from shardline.errors import InvalidArgumentError
from shardline.parallel._common import clip_to_global_norm_
from shardline.parallel.contract import (
    Shard,
    composed_state_dict,
    groups_by_name,
    named_tensors,
    state_like,
    tensors_of,
)
from shardline.parallel.pipeline.tied import TensorInfo, Tied

__all__ = [
    "clip_grad_norm",
    "full_state_dict",
    "load_sharded_state",
    "sharded_optim_state",
    "sharded_state",
]


def clip_grad_norm(
    module: nn.Module,
    tied: list[Tied],
    groups: list[ProcessGroup],
    max_norm: float,
    norm_type: float = 2.0,
    copies: Mapping[str, int] | None = None,
) -> torch.Tensor:
    """Clips every rank's gradients to the norm of the whole model's gradient; returns it.

    ``groups``: the pipeline's, then (tensor parallelism inside the stages) the model's own,
    whose ``copies[name]`` ranks hold equal copies of a parameter. Each tensor counts once:
    a tied weight on the lowest of its ranks only. DDP replicas hold equal gradients after a
    step, so they are not summed over; ZeRO's parts are (its group among ``groups``).
    """
    skip = {n for t in tied if groups[0].rank != min(t.ranks) for n in t.names}
    named = [
        (n, g) for n, p in module.named_parameters() if (g := p.grad) is not None and g.numel()
    ]
    grads = [g for _, g in named]
    counted = [(n, g) for n, g in named if n not in skip]
    device = grads[0].device if grads else None
    return clip_to_global_norm_(
        [g for _, g in counted], grads, groups, max_norm, norm_type, device,
        copies=None if copies is None else [copies.get(n, 1) for n, _ in counted],
    )  # fmt: skip


def full_state_dict(module: nn.Module, group: ProcessGroup) -> dict[str, torch.Tensor]:
    """The whole model's state dict on this rank's device, from every rank (a collective)."""
    local = nn.Module.state_dict(module)
    device = next(iter(local.values())).device if local else torch.device("cpu")
    # Through the host: a GPU rank's tensors would otherwise arrive on that rank's device.
    mine = {k: v.detach().cpu() for k, v in local.items()}
    merged: dict[str, torch.Tensor] = {}
    for part in all_gather_object(mine, group):
        for k, v in part.items():
            merged.setdefault(k, v.to(device))
    return merged


def sharded_state(
    module: nn.Module, infos: Mapping[str, TensorInfo], params: bool = True
) -> dict[str, Any]:
    """The contract's ``sharded_state_dict``: see the module docstring.

    A tensor-parallel layer inside a stage gives its own ``Shard`` (its slices' boxes). With
    ``params=False`` (ZeRO's parts stand for the parameters, whose whole tensors may be
    freed) the tensors are read as they are, without asking the layers.
    """
    mine = composed_state_dict(module) if params else named_tensors(module)
    out: dict[str, Any] = {}
    for name, info in infos.items():
        value = mine.get(name)
        if isinstance(value, Shard):
            out[name] = value
        elif value is not None:
            out[name] = Shard.box(value, info.shape, (0,) * len(info.shape))
        else:
            out[name] = Shard(info.shape, [])
    return out


def load_sharded_state(module: nn.Module, sd: Mapping[str, Any], params: bool = True) -> None:
    """The contract's ``load_sharded_state_dict``: this rank's tensors from ``sd``.

    ``params=False``: ``sd`` holds no parameter (as for ``sharded_state``).
    """
    mine = composed_state_dict(module) if params else named_tensors(module)
    with torch.no_grad():
        for name, value in sd.items():
            if not (isinstance(value, Shard) and value.pieces and name in mine):
                continue
            for dst, src in zip(tensors_of(mine[name]), tensors_of(value), strict=True):
                if dst.data_ptr() != src.data_ptr():
                    dst.copy_(src)


def sharded_optim_state(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    group: ProcessGroup,
    state: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The contract's ``sharded_optim_state_dict``: each parameter's state, by name.

    Its tensors are ``Shard``s of whole tensors: a box where shaped like the parameter, else a
    flat range (``step``); ``state`` replaces that part when given (ZeRO's parts). Each param
    group lists the parameters of that group on every rank of the pipeline (a collective), so
    that the checkpoint describes the whole optimizer.
    """
    names = {id(p): n for n, p in module.named_parameters()}
    if state is None:
        state = _whole_optim_state(module, optimizer, names)
    groups = groups_by_name(optimizer, names)
    everyone = all_gather_object([g["params"] for g in groups], group)
    if any(len(theirs) != len(groups) for theirs in everyone):
        counts = [len(theirs) for theirs in everyone]
        raise InvalidArgumentError(
            f"pipeline: the ranks' optimizers have {counts} param groups; build every stage's "
            "optimizer with the same groups (empty ones included)"
        )
    for i, g in enumerate(groups):
        merged: list[str] = []
        for theirs in everyone:
            merged += [n for n in theirs[i] if n not in merged]
        g["params"] = merged
    return {"state": state, "param_groups": groups}


def _whole_optim_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, names: dict[int, str]
) -> dict[str, dict[str, Any]]:
    layouts = composed_state_dict(module)  # tensor-parallel slices: their boxes
    state: dict[str, dict[str, Any]] = {}
    for param, entries in optimizer.state.items():
        name = names.get(id(param))
        if name is None:
            continue
        out: dict[str, Any] = {}
        for k, v in entries.items():
            laid = state_like(layouts.get(name), v, param) if torch.is_tensor(v) else None
            if laid is not None:
                out[k] = laid
            elif not torch.is_tensor(v):
                out[k] = v
            elif v.shape == param.shape and v.dim() > 0:
                out[k] = Shard.box(v.detach(), v.shape, (0,) * v.dim())
            else:
                out[k] = Shard.flat(v.detach(), v.shape, 0)
        state[name] = out
    return state
