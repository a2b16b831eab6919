"""A choice of ``as_distributed`` built: the model wrapped as a ``Candidate`` says, and fed.

``wrap_choice`` builds the strategy (recomputation first), a tensor-parallel layout on its
``{"dp", "tp"}`` mesh, or a pipeline on its ``{"dp", "pp"}`` mesh (``{"dp", "pp", "tp"}``
with its stages split too); ``described`` records on the result what was chosen and how each
rank must feed it (``sampler_args``, ``batch_scale``; with pipelines, a ``step(inputs,
target)`` on every choice).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardline.comm.group import ProcessGroup
from shardline.comm.mesh import DeviceMesh
from shardline.parallel import strategies
from shardline.parallel.candidate import Candidate
from shardline.parallel.compose import compose
from shardline.parallel.data.ddp import DistributedDataParallel
from shardline.parallel.data.zero import ShardedDataParallel
from shardline.parallel.layout_meta import widened
from shardline.parallel.pipeline_layout import VIRTUAL, WithLoss
from shardline.parallel.precision import MixedPrecision
from shardline.parallel.recompute.blocks import recompute_blocks

__all__ = ["DDP_ONLY", "ZERO_ONLY", "Meshes", "described", "mesh_axes", "wrap_choice"]

# Options only one family takes: as_distributed drops the other family's, errors name the owner.
_DDP_OPTIONS = frozenset(strategies.options_of(DistributedDataParallel))
_ZERO_OPTIONS = frozenset(strategies.options_of(ShardedDataParallel))
ZERO_ONLY = _ZERO_OPTIONS - _DDP_OPTIONS
DDP_ONLY = _DDP_OPTIONS - _ZERO_OPTIONS

# By the model-parallel axes and their sizes (``mesh_axes``).
Meshes = dict[tuple[tuple[str, int], ...], DeviceMesh]


def wrap_choice(
    model: nn.Module,
    choice: Candidate,
    group: ProcessGroup,
    mixed_precision: MixedPrecision | None,
    options: dict[str, Any],
    meshes: Meshes,
    example_input: Any = None,
) -> nn.Module:
    """``model`` wrapped as ``choice`` says, its recomputation applied first.

    Of ``options``, those its wrapper knows and those no wrapper claims. A tensor-parallel
    choice is composed on its ``{"dp", "tp"}`` mesh, a pipeline on its ``{"dp", "pp"}`` or
    ``{"dp", "pp", "tp"}`` mesh (``model`` a ``WithLoss``; its stages balanced on a
    micro-batch of ``example_input``, as they were priced): meshes of ``group`` (``meshes``,
    by ``mesh_axes``), made once, by every rank, where missing.
    """
    if choice.pp > 1:
        return _pipelined(model, choice, group, mixed_precision, meshes, example_input)
    if choice.recompute is not None:
        recompute_blocks(model, choice.recompute)
    row = strategies.strategy(choice.strategy)
    mine_only = frozenset(row.options())
    kept = {k: v for k, v in options.items() if k in mine_only or k not in DDP_ONLY | ZERO_ONLY}
    if row.stage:
        kept["mixed_precision"] = mixed_precision
    if choice.offload is not None:
        kept["offload"] = choice.offload
    if choice.tp == 1:
        return row.wrap(model, group=group, **kept)
    mesh = _mesh(meshes, choice, group)
    wrapped, _ = compose(model, None, choice.distribute_strategy, mesh, kept)
    return wrapped


def _pipelined(
    model: nn.Module,
    choice: Candidate,
    group: ProcessGroup,
    mixed_precision: MixedPrecision | None,
    meshes: Meshes,
    example_input: Any,
) -> nn.Module:
    assert isinstance(model, WithLoss)
    inputs = widened(example_input, choice.batch_scale)[0]
    options: dict[str, Any] = {
        "microbatches": choice.microbatches,
        "loss_fn": model.loss_fn,
        # the micro-batch the stages are balanced on: the one they were priced on
        "example": inputs.chunk(choice.microbatches)[0],
    }
    if choice.recompute is not None:  # each stage recomputes its forward in backward
        options["recompute"] = True
    if choice.schedule == "interleaved":
        options["virtual_stages"] = VIRTUAL
    if mixed_precision is not None and mixed_precision.param_dtype is not None:
        # the stages autocast; their gradients are reduced in the weights' own dtype
        options["mixed_precision"] = MixedPrecision(param_dtype=mixed_precision.param_dtype)
    mesh = _mesh(meshes, choice, group)
    wrapped, _ = compose(model.chain, None, choice.distribute_strategy, mesh, options)
    return wrapped


def mesh_axes(choice: Candidate) -> tuple[tuple[str, int], ...]:
    """The model-parallel axes of ``choice``'s mesh, ``pp`` then ``tp``: those above 1."""
    return tuple((axis, k) for axis, k in (("pp", choice.pp), ("tp", choice.tp)) if k > 1)


def _mesh(meshes: Meshes, choice: Candidate, group: ProcessGroup) -> DeviceMesh:
    """``choice``'s mesh of ``group``, made once.

    Its axes: ``dp`` (where it has replicas, and always beside a lone ``tp``, which composes
    on it), then ``pp``, then ``tp``.
    """
    axes = mesh_axes(choice)
    if axes not in meshes:
        replicas = group.world_size // math.prod(k for _, k in axes)
        dp = {"dp": replicas} if replicas > 1 or choice.pp == 1 else {}
        meshes[axes] = DeviceMesh({**dp, **dict(axes)}, group=group)
    return meshes[axes]


def described(
    wrapped: nn.Module,
    choice: Candidate,
    reason: str,
    plan: Any,
    group: ProcessGroup,
    meshes: Meshes,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
) -> nn.Module:
    """``wrapped`` with what was chosen and how to feed it, as ``as_distributed`` returns it.

    With ``loss_fn`` (pipelines considered), a choice that is not a pipeline gets a
    ``step(inputs, target)`` as a pipeline's. The meshes only trials used are shut down
    (their groups' transports released).
    """
    key = mesh_axes(choice)
    mesh = meshes.get(key)
    for other, unused in meshes.items():
        if other != key:
            unused.shutdown()
    wrapped.strategy = choice.distribute_strategy  # type: ignore[assignment]
    wrapped.strategy_reason = reason  # type: ignore[assignment]
    wrapped.plan = plan
    wrapped.mesh = mesh  # type: ignore[assignment]
    dp = mesh is not None and "dp" in mesh.axis_names
    args = {"num_replicas": group.world_size, "rank": group.rank}
    if mesh is not None:
        args = {"num_replicas": mesh.size("dp"), "rank": mesh.local_rank("dp")} if dp else {
            "num_replicas": 1, "rank": 0,
        }  # fmt: skip
    wrapped.sampler_args = args  # type: ignore[assignment]
    wrapped.batch_scale = choice.batch_scale  # type: ignore[assignment]
    if loss_fn is not None and choice.pp == 1:  # one way to train, whichever is chosen
        wrapped.step = _stepper(wrapped, loss_fn)
    return wrapped


def _stepper(wrapped: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor]) -> Any:
    def step(inputs: Any, target: Any) -> torch.Tensor:
        """Forward, ``loss_fn`` and backward of one batch; returns the loss (as a pipeline's)."""
        loss = loss_fn(wrapped(inputs), target)
        loss.backward()  # type: ignore[no-untyped-call]
        return loss.detach()

    return step
