"""Strategies composed on one ``DeviceMesh`` (data x pipeline x tensor), for ``distribute(mesh=)``.

- ``{"dp": ..., "pp": schedule}``: the pipeline splits the model on ``pp``; its replicas on
  ``dp`` are kept by DDP or sharded by ZeRO, per chunk (``pipeline/replicas.py``).
- ``{"dp": "ddp" | "zero1" | "zero2" | "zero3", "tp": plan}``: tensor parallelism on ``tp``
  (``sl.tensor_parallel``), then DDP or ZeRO over the replicas on ``dp``: each tp slice is
  averaged with (ZeRO: sharded over) the same slice of the others. ``clip_grad_norm_`` of
  the result sums over both axes, each element once; checkpoints place ZeRO's flat parts of
  a slice in the dense tensor (``parallel.placement``).
- HSDP: ``{"dp_replicate": "ddp", "dp_shard": "zero3"}`` (``tp`` may join them): ZeRO over
  ``dp_shard``, its shards' gradients averaged over the replicas on ``dp_replicate``.
- ``{"dp": ..., "pp": schedule, "tp": plan}`` (3-D, any axis may be left out): the pipeline
  splits first, tensor parallelism rewrites each stage (``pipeline(tp_group=)``), then the
  replicas on ``dp`` are kept by DDP or sharded by ZeRO.

The optimizer passed in is rebound to what this rank now holds, under the same names, so it
may be built from the dense model before the call.

``deterministic``: the ``tp`` and ``dp`` groups add in the canonical tree (``tree_group``), and
the model (prepared by ``make_deterministic``) has its tensor-parallel layers prepared too.
``"repeat"``: every axis that sums (``tp``, ``dp``, HSDP's two) adds in a fixed order
(``repeat.fixed_sums``); the model is not prepared.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardline.comm.group import ProcessGroup
from shardline.comm.mesh import DeviceMesh
from shardline.comm.tree import tree_group
from shardline.comm.world import REPEAT
from shardline.errors import InvalidArgumentError
from shardline.parallel import strategies
from shardline.parallel._common import ModelParallel, copies_over
from shardline.parallel.data.zero.optimizers import check_optimizer
from shardline.parallel.deterministic import make_deterministic
from shardline.parallel.deterministic.repeat import fixed_sums
from shardline.parallel.pipeline import pipeline
from shardline.parallel.tensor import tensor_parallel

__all__ = ["compose"]

_AXES = {"dp", "pp", "tp", "dp_replicate", "dp_shard"}
_DP = (None, "ddp", "zero1", "zero2", "zero3")


def compose(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    strategy: str | dict[str, str],
    mesh: DeviceMesh | None,
    options: dict[str, Any],
    *,
    deterministic: bool | str = False,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """``distribute()`` on a mesh: a strategy per axis (see the module docstring)."""
    if mesh is None or not isinstance(strategy, dict):
        raise InvalidArgumentError(
            "distribute(): composing strategies takes both mesh= and a strategy per axis, "
            "e.g. mesh=sl.DeviceMesh({'dp': 2, 'pp': 2, 'tp': 2}) with strategy={'dp': "
            "'zero3', 'pp': '1f1b', 'tp': 'auto'} (any axis may be left out; HSDP: "
            "'dp_replicate' and 'dp_shard')"
        )
    unknown = sorted(set(strategy) - _AXES)
    if unknown or not {"pp", "tp", "dp_shard"} & set(strategy):
        raise InvalidArgumentError(
            f"distribute(strategy={strategy}): compose 'pp' (a pipeline schedule), 'tp' (a "
            "tensor-parallel plan, 'auto') and data parallelism: 'dp' ('ddp', 'zero1', "
            "'zero2', 'zero3'), or HSDP's 'dp_shard' (ZeRO) with 'dp_replicate' ('ddp')"
        )
    hsdp = {"dp_shard", "dp_replicate"} & set(strategy)
    if hsdp and ("dp" in strategy or "pp" in strategy or "dp_shard" not in hsdp):
        raise InvalidArgumentError(
            f"distribute(strategy={strategy}): HSDP names 'dp_shard' (ZeRO over it) and "
            "optionally 'dp_replicate' (replicas across it), instead of 'dp'; with a "
            "pipeline it is not built yet"
        )
    if strategy.get("dp_replicate", "ddp") not in ("ddp", "replicate"):
        raise InvalidArgumentError(
            f"distribute(strategy={strategy}): 'dp_replicate' keeps replicas: use 'ddp'"
        )
    axis = "dp_shard" if hsdp else "dp"
    dp = strategy.get(axis)
    dp = "zero3" if dp == "fsdp" else dp
    if dp not in _DP or (hsdp and dp in (None, "ddp")):
        raise InvalidArgumentError(
            f"distribute(strategy={strategy}): on the {axis} axis use "
            + ("'zero1', 'zero2' or 'zero3' ('fsdp')" if hsdp else
               "'ddp', 'zero1', 'zero2' or 'zero3' ('fsdp')")
        )  # fmt: skip
    if options.get("sequence_parallel") and "tp" not in strategy:
        raise InvalidArgumentError("distribute(): sequence_parallel needs a 'tp' axis")
    if "tp" in strategy and "pp" in strategy and options.get("sequence_parallel"):
        raise InvalidArgumentError(
            f"distribute(strategy={strategy}): sequence parallelism inside pipeline stages is "
            "not supported yet; leave sequence_parallel off"
        )
    axes = set(mesh.axis_names)
    if axes != set(strategy):
        raise InvalidArgumentError(
            f"distribute(): the mesh's axes {sorted(axes)} and the strategy's "
            f"{sorted(strategy)} must be the same"
        )
    if "pp" in strategy:
        return _pipeline(model, optimizer, strategy, mesh, dp, options, deterministic)
    return _layers(model, optimizer, strategy, mesh, dp, options, deterministic)


def _pipeline(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    strategy: dict[str, str],
    mesh: DeviceMesh,
    dp: str | None,
    options: dict[str, Any],
    deterministic: bool | str,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    options.pop("sequence_parallel", None)  # off here: refused above when on
    tp = "tp" in strategy
    before = _names_of(model, optimizer) if tp else {}
    # ``pipeline`` fixes its groups' sums itself: in the tree for a prepared model
    # (deterministic mode), in a fixed order in repeatable mode.
    stage = pipeline(
        model,
        mesh.group("pp"),
        schedule=strategy["pp"],
        dp_group=mesh.group("dp") if dp is not None else None,
        dp_strategy=dp or "ddp",
        tp_group=mesh.group("tp") if tp else None,
        tp_plan=strategy.get("tp", "auto"),
        deterministic=REPEAT if deterministic == REPEAT else False,
        **options,
    )
    if optimizer is not None:
        if tp:  # the same names, now this rank's slices (and nothing of other stages)
            now = dict(nn.Module.named_parameters(stage, remove_duplicate=False))
            for group in optimizer.param_groups:
                held = [next((n for n in before[id(p)] if n in now), None) for p in group["params"]]
                group["params"] = [now[n] for n in held if n is not None]
        stage.bind_optimizer(optimizer)  # this rank's parameters (ZeRO: their parts)
    return stage, optimizer


def _names_of(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[int, list[str]]:
    """The names of each of the model's parameters (a tied one has several), by id.

    Checks that a given optimizer holds only them and has no state yet. Tensor parallelism
    replaces the parameters; the optimizer is rebound by these names.
    """
    if optimizer is not None and optimizer.state:
        raise InvalidArgumentError(
            "distribute(): the optimizer already has state; with tensor parallelism build it "
            "(or wrap the model) before the first optimizer step"
        )
    before: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        before.setdefault(id(p), []).append(n)
    groups = optimizer.param_groups if optimizer is not None else []
    if any(id(p) not in before for g in groups for p in g["params"]):
        raise InvalidArgumentError(
            "distribute(): the optimizer holds a tensor that is not a parameter of the model; "
            "build it from model.parameters()"
        )
    return before


def _layers(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    strategy: dict[str, str],
    mesh: DeviceMesh,
    dp: str | None,
    options: dict[str, Any],
    deterministic: bool | str,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Tensor parallelism on ``tp`` (if named), then DDP or ZeRO on ``dp``.

    HSDP: ZeRO on ``dp_shard``, its gradient parts averaged over ``dp_replicate``.
    """
    before = _names_of(model, optimizer) if "tp" in strategy else {}
    groups = optimizer.param_groups if optimizer is not None else []
    sp = bool(options.pop("sequence_parallel", False))  # checked against the axes above
    if dp is None and options:
        raise InvalidArgumentError(
            f"distribute(): {sorted(options)} are data parallelism's options; with no 'dp' "
            "axis only sequence_parallel applies"
        )
    row = strategies.strategy(dp) if dp is not None else None
    if row is not None:
        unknown = sorted(set(options) - set(row.options()))
        if unknown:
            raise InvalidArgumentError(
                f"distribute(strategy={strategy}): {dp} does not take {unknown}; it takes "
                f"{row.options()}"
            )
        if row.stage and optimizer is not None:
            check_optimizer(optimizer, row.stage)  # before any collective

    def axis(name: str) -> ProcessGroup:
        g = mesh.group(name)
        if deterministic == REPEAT:
            return fixed_sums(g)
        return tree_group(g) if deterministic else g

    tp = axis("tp") if "tp" in strategy else None
    if tp is not None:
        model = tensor_parallel(model, tp, strategy["tp"], sequence_parallel=sp)
        if deterministic is True:  # its new layers: their split sums in the model's blocks
            make_deterministic(model)
        now = dict(model.named_parameters(remove_duplicate=False))
        for group in groups:  # the same names, now this rank's slices
            group["params"] = [now[before[id(p)][0]] for p in group["params"]]
    if row is None:
        return model, optimizer
    # Before ZeRO takes the parameters' memory over.
    copies = copies_over(tp, model) if tp is not None else None
    if "dp_replicate" in strategy:
        options = {**options, "replicate_group": axis("dp_replicate")}
    wrapped = row.wrap(model, group=axis("dp_shard" if "dp_shard" in strategy else "dp"),
                       **options)  # fmt: skip
    if tp is not None and copies is not None:
        assert isinstance(wrapped, ModelParallel)
        wrapped.set_model_parallel(tp, copies)
    bind = getattr(wrapped, "bind_optimizer", None)
    if optimizer is not None and row.stage and callable(bind):
        bind(optimizer)  # ZeRO: this rank's parts of the slices, in their groups
    return wrapped, optimizer
