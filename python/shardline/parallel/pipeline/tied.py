"""Tied weights across pipeline stages: found before the cut, their copies kept equal.

A parameter used by children in different stages (an embedding tied to the output head) is
found before the model is cut. Every rank that holds one of those stages keeps its own copy;
after each step their gradients are summed over the owning ranks, as Megatron does, so the
copies take the same update and stay equal.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from shardline.comm.coalesced import broadcast_coalesced
from shardline.comm.group import ProcessGroup

__all__ = ["TensorInfo", "Tied", "find_tied", "sum_tied_grads", "sync_copies", "tensor_infos"]


@dataclass(frozen=True)
class TensorInfo:
    """A tensor of the whole model: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class Tied:
    """One parameter shared by several stages: names, stages, ranks, and their group."""

    names: list[str]
    stages: list[int]
    ranks: list[int]
    group: ProcessGroup | None = None


def _stage_of(parts: list[list[str]]) -> dict[str, int]:
    return {child: s for s, names in enumerate(parts) for child in names}


def tensor_infos(model: nn.Module) -> dict[str, TensorInfo]:
    """Every state tensor of the whole (uncut) model: its shape and dtype."""
    return {
        name: TensorInfo(tuple(t.shape), t.dtype)
        for name, t in model.state_dict(keep_vars=True).items()
    }


def find_tied(model: nn.Module, parts: list[list[str]], p: int) -> list[Tied]:
    """Parameters of the uncut model used by children of different stages, in model order."""
    stage = _stage_of(parts)
    seen: dict[int, Tied] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        s = stage[name.split(".", 1)[0]]
        tied = seen.setdefault(id(param), Tied([], [], []))
        tied.names.append(name)
        if s not in tied.stages:
            tied.stages.append(s)
    out = []
    for tied in seen.values():
        if len(tied.stages) > 1:
            tied.ranks = sorted({s % p for s in tied.stages})
            out.append(tied)
    return out


def sum_tied_grads(
    module: nn.Module,
    tied: list[Tied],
    rank: int,
    grad_of: Callable[[nn.Parameter], torch.Tensor] | None = None,
) -> None:
    """Sums each tied parameter's gradient over the ranks that hold it (after a step).

    ``grad_of(param)`` gives the gradient to sum in place (ZeRO's whole gradient, which under
    mixed precision is not ``param.grad``); by default ``param.grad``.
    """
    # The stages' own parameters (a pipeline with ZeRO lists its parts as its parameters).
    params = dict(nn.Module.named_parameters(module, remove_duplicate=False))
    for t in tied:
        if t.group is None or rank not in t.ranks:
            continue
        param = next(params[n] for n in t.names if n in params)
        if grad_of is not None:
            t.group.all_reduce(grad_of(param))
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        t.group.all_reduce(param.grad)


def sync_copies(module: nn.Module, tied: list[Tied], rank: int, dp: ProcessGroup | None) -> None:
    """Makes copies equal after each rank initialised its own stages.

    A weight tied across stages takes the value of its lowest rank; data-parallel replicas
    take replica 0's parameters and buffers.
    """
    params = dict(nn.Module.named_parameters(module, remove_duplicate=False))
    with torch.no_grad():
        for t in tied:
            if t.group is not None and rank in t.ranks:
                param = next(params[n] for n in t.names if n in params)
                t.group.broadcast(param.data, src=0)  # the group's rank 0: the lowest rank
        if dp is not None:
            tensors = [p.data for p in nn.Module.parameters(module)]
            tensors += [b for b in module.buffers() if b.numel() > 0]
            broadcast_coalesced(dp, tensors, 0, 25 << 20)
