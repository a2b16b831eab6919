"""Pipeline parallelism: a model split into stages, one (or ``virtual_stages``) per rank.

``pipeline(model, group, schedule=..., microbatches=m, split=..., loss_fn=...)`` returns the
``PipelineModule`` this rank runs; ``model.step(inputs, target=...)`` then runs forward and
backward of every micro-batch under the schedule (``schedules``: GPipe, 1F1B, interleaved
1F1B, zero-bubble ZB-H1 and ZB-H2, each a list of actions per rank), and ``model(x)`` runs
inference.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from shardline.comm.group import ProcessGroup
from shardline.comm.tree import tree_group
from shardline.comm.world import MICROBATCH, REPEAT, default_group, deterministic_mode
from shardline.errors import InvalidArgumentError
from shardline.parallel._common import copies_over
from shardline.parallel.deterministic import blocks_of, make_deterministic, unit_of
from shardline.parallel.deterministic.repeat import fixed_sums, repeatable_kernels
from shardline.parallel.pipeline.materialize import is_meta, materialize
from shardline.parallel.pipeline.replicas import ZERO_STAGES
from shardline.parallel.pipeline.runtime import PipelineModule
from shardline.parallel.pipeline.schedules import SCHEDULES, Action, build
from shardline.parallel.pipeline.split import (
    balanced_parts,
    chain_children,
    child_costs,
    keep_only,
    named_parts,
)
from shardline.parallel.pipeline.tied import find_tied, tensor_infos
from shardline.parallel.pipeline.trace import rank_stages, strip, trace_split
from shardline.parallel.precision import MixedPrecision
from shardline.parallel.tensor.auto import (
    auto_plan,
    chain_heads,
    splits_by_vocabulary,
    tied_heads,
)
from shardline.parallel.tensor.plan import tensor_parallel
from shardline.parallel.tensor.styles import Colwise

__all__ = ["SCHEDULES", "Action", "PipelineModule", "build", "pipeline", "whole_plan"]


def pipeline(
    model: nn.Module,
    group: ProcessGroup | None = None,
    *,
    schedule: str = "1f1b",
    microbatches: int = 1,
    split: str | Sequence[str] = "auto",
    loss_fn: Callable[[torch.Tensor, Any], torch.Tensor] | None = None,
    virtual_stages: int = 1,
    dp_group: ProcessGroup | None = None,
    dp_strategy: str = "ddp",
    recompute: bool = False,
    init_fn: Callable[[nn.Module], None] | None = None,
    device: torch.device | str | None = None,
    example: Any = None,
    mixed_precision: MixedPrecision | None = None,
    compile: bool | dict[str, Any] = False,
    tp_group: ProcessGroup | None = None,
    tp_plan: str | Mapping[str, Any] = "auto",
    deterministic: bool | str | None = None,
) -> PipelineModule:
    """Splits ``model`` into ``group.world_size * virtual_stages`` stages; returns this rank's.

    Build the optimizer afterwards from the returned module's ``parameters()`` (this rank's,
    under the model's names). The children of ``model`` that other ranks hold are removed from
    it, so their memory is freed once nothing else refers to them. A parameter used by
    several stages (an embedding tied to the head) stays tied: the gradients of its copies are
    summed over their ranks after each step.

    Args:
        model: An ``nn.Sequential`` (its forward chains its children), or any other model
            with ``split`` naming submodules and ``example`` (split by tracing); built the
            same way on every rank, possibly on the meta device.
        group: The pipeline's ranks, in stage order; ``None``: the default group.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` (``virtual_stages >= 2``),
            ``"zero_bubble"`` (ZB-H1: backward split into input and weight passes, with
            1F1B's memory) or ``"zero_bubble_h2"`` (the same with up to ``2p - 1``
            micro-batches held per rank: a shorter step where an input pass costs more than
            a forward, as on CPUs).
        microbatches: Micro-batches per ``step``; the batch must divide evenly.
        split: ``"auto"`` (contiguous stages balanced by compute: each child's FLOPs on
            ``example`` when given, else its parameter count) or the names of the children
            that start stages 1, 2, ... (one fewer than the stages).
        loss_fn: ``loss_fn(output, target)`` for each micro-batch, a mean over its samples;
            needed by ``step``.
        virtual_stages: Stages per rank (model chunks for ``"interleaved"``).
        dp_group: The ranks holding replicas of this rank's stages (the data-parallel axis of
            a mesh; ``sl.distribute(..., mesh=...)`` passes it): after each step their
            gradients are averaged over it.
        dp_strategy: What the replicas share: ``"ddp"`` (everything replicated), or
            ``"zero1"``, ``"zero2"``, ``"zero3"``: the optimizer state, also the gradients,
            also the parameters between steps, sharded over ``dp_group``: each of this
            rank's chunks wrapped by ``parallel.data``'s ``DistributedDataParallel`` or
            ``ShardedDataParallel`` (``pipeline.replicas``).
        recompute: Activation checkpointing per stage: between a micro-batch's forward and
            backward a stage keeps only its input (the boundary activation); backward
            recomputes the rest (``shardline.parallel.recompute.checkpoint``: the same
            RNG, so dropout matches).
        init_fn: For a model built on the meta device (``pipeline.materialize``): called on
            each of this rank's children once it has storage; ``None`` calls
            ``reset_parameters()`` on every module that has one. Only this rank's stages are
            ever materialised; tied copies and replicas are then made equal.
        device: Where a meta model's stages are materialised: ``None`` is this rank's GPU on
            the nccl backend, else the CPU.
        example: One micro-batch of the model's input. For an ``nn.Sequential`` it is
            optional: ``split="auto"`` then balances the stages by FLOPs on it. Any other
            model needs it (a tensor, a tuple of the positional inputs, such as ids and a
            mask, or a dict of keyword inputs, such as ``{"input_ids": ..., "attention_mask":
            ...}``, after which ``step`` takes such a dict) to be traced (``pipeline.trace``,
            torch's splitter); ``split`` then names
            the submodules that start stages 1, 2, ...; several tensors may cross a cut, and
            inputs that later stages read are carried to them.
        mixed_precision: ``sl.MixedPrecision(param_dtype=torch.bfloat16)`` runs every stage's
            forward (and ``loss_fn``) under ``torch.autocast`` in that dtype: weights,
            gradients and optimizer state stay in the model's dtype (fp32), matrix products
            run in bf16, and activations cross stage boundaries in the dtype autocast gives
            them (bf16 out of a linear layer: half the bytes). Each weight is cast once per
            step. With ZeRO on ``dp_group`` the whole parameters themselves are bf16 during
            the step (gathered from the fp32 parts in bf16) and the micro-batches'
            gradients add up in fp32, as FSDP's ``MixedPrecisionPolicy`` does; the parts,
            the optimizer and checkpoints stay fp32. ``reduce_dtype`` is not supported here
            (gradients are reduced in fp32, the parameters' own dtype).
        compile: ``True`` (or ``torch.compile``'s keyword arguments, e.g.
            ``{"backend": "inductor", "mode": "max-autotune"}``) compiles each of this rank's
            stages with ``torch.compile``; parameters and their names are unchanged.
        tp_group: Tensor parallelism inside the stages (the ``tp`` axis of a mesh;
            ``sl.distribute(..., mesh=...)`` passes it): after the split, this rank's stages
            are rewritten by ``sl.tensor_parallel`` over it. ``nn.Sequential`` models only.
        tp_plan: ``"auto"``, or ``{module name: style}`` by the whole model's names: the
            plan is made for the whole model and kept where it names this rank's modules.
        deterministic: ``"repeat"``: repeatable mode (``deterministic.repeat``): the same
            bits run after run for this layout (repeatable kernels, and the sums of
            ``dp_group`` and ``tp_group`` in a fixed order). ``None`` takes
            ``sl.init(deterministic=)``, else ``SHARDLINE_DETERMINISTIC``, where it says
            ``"repeat"``. Deterministic mode across layouts comes from the model instead
            (``sl.make_deterministic``, below), whatever this says.

    A model prepared by ``sl.make_deterministic`` trains in deterministic mode: to the
    parameters one process gets from the same samples, bit for bit
    (``pipeline.deterministic``), for any schedule, with a power-of-two number of
    micro-batches of a power-of-two number of units each, and ``dp_group``'s reductions in
    the same tree; with ``tp_group``, its split sums cut into the model's ``blocks`` (a
    multiple of the tp size) and the tp group's sums in the tree too. Not with
    ``recompute`` or ``compile``, nor a model split by tracing.

    Raises:
        InvalidArgumentError: a model that is not an ``nn.Sequential``, more stages than
            children, an unknown split point or schedule, or sizes a schedule does not support;
            raised on every rank before any communication.
    """
    g = group if group is not None else default_group()
    unit = unit_of(model)
    if unit is not None:
        _check_deterministic(model, microbatches, tp_group, recompute, compile)
        dp_group = tree_group(dp_group) if dp_group is not None else None
        tp_group = tree_group(tp_group) if tp_group is not None else None
    elif (mode := deterministic_mode(deterministic, "pipeline()")) == MICROBATCH:
        raise InvalidArgumentError(
            "pipeline(deterministic='microbatch'): the mode covers DDP and ZeRO; a pipeline "
            "sums its micro-batches in the fixed tree with deterministic=True "
            "(sl.make_deterministic(model) first)"
        )
    elif mode == REPEAT:
        repeatable_kernels(model)
        dp_group = fixed_sums(dp_group) if dp_group is not None else None
        tp_group = fixed_sums(tp_group) if tp_group is not None else None
    if dp_strategy not in ("ddp", *ZERO_STAGES):
        raise InvalidArgumentError(
            f"pipeline: dp_strategy={dp_strategy!r}; use 'ddp', 'zero1', 'zero2' or 'zero3'"
        )
    stages = g.world_size * virtual_stages
    # Checked before the model is cut (and before any communication), on every rank.
    actions = build(schedule, g.world_size, microbatches, virtual_stages)
    tp = tp_group if tp_group is not None and tp_group.world_size > 1 else None
    if tp is not None and not isinstance(model, nn.Sequential):
        raise InvalidArgumentError(
            f"pipeline: tensor parallelism inside the stages takes an nn.Sequential (a chain "
            f"of children); {type(model).__name__} would be split by tracing, whose stages "
            "cannot be rewritten into tensor-parallel layers"
        )
    if not isinstance(model, nn.Sequential):
        return _traced(model, g, split, example, virtual_stages, stages, init_fn, device,
                       schedule=schedule, actions=actions, microbatches=microbatches,
                       loss_fn=loss_fn, dp_group=dp_group, dp_strategy=dp_strategy,
                       recompute=recompute, mixed_precision=mixed_precision,
                       compile=compile)  # fmt: skip
    children = chain_children(model)
    if isinstance(split, str):
        if split != "auto":
            raise InvalidArgumentError(
                f"split={split!r}: use 'auto' or a list of the children that start each stage"
            )
        parts = balanced_parts(children, stages, child_costs(children, example))
    else:
        parts = named_parts(children, list(split), stages)
    mine = {name for c in range(virtual_stages) for name in parts[c * g.world_size + g.rank]}
    by_name = dict(children)
    infos = tensor_infos(model)
    tied = find_tied(model, parts, g.world_size)
    plan = whole_plan(model, tp, tp_plan) if tp is not None else None
    keep_only(model, mine)
    meta = is_meta(model)
    if meta:
        where = torch.device(device) if device is not None else _default_device(g)
        materialize(((n, by_name[n]) for n in sorted(mine)), where, init_fn)
    copies = None
    if tp is not None and plan is not None:
        tensor_parallel(model, tp, {n: v for n, v in plan.items() if n.split(".")[0] in mine})
        if unit is not None:  # the new layers: their split sums in the model's blocks
            make_deterministic(model)
        by_name = {n: model.get_submodule(n) for n in mine}  # a child may be rewritten itself
        copies = copies_over(tp, model)
    stage = PipelineModule(
        parts,
        {name: by_name[name] for name in mine},
        g,
        schedule=schedule,
        actions=actions,
        microbatches=microbatches,
        virtual_stages=virtual_stages,
        loss_fn=loss_fn,
        infos=infos,
        tied=tied,
        dp_group=dp_group,
        dp_strategy=dp_strategy,
        recompute=recompute,
        synchronize=meta,
        mixed_precision=mixed_precision,
        compile=compile,
        deterministic=unit,
    )
    if tp is not None and copies is not None:
        stage.set_model_parallel(tp, copies)
    return stage


def _check_deterministic(
    model: nn.Module,
    microbatches: int,
    tp_group: ProcessGroup | None,
    recompute: bool,
    compile: bool | dict[str, Any],
) -> None:
    """Refuses what deterministic mode does not cover in a pipeline, before any work."""
    other = [
        what
        for what, on in (
            ("recompute", recompute),
            ("compile", bool(compile)),
            (f"{type(model).__name__} split by tracing", not isinstance(model, nn.Sequential)),
        )
        if on
    ]
    if other:
        raise InvalidArgumentError(
            f"pipeline: a model in deterministic mode (make_deterministic) with {other[0]} is "
            "not supported: its sums would have orders of their own. Use an nn.Sequential "
            "without it, or leave deterministic mode"
        )
    t = tp_group.world_size if tp_group is not None else 1
    blocks = blocks_of(model) or 1
    if blocks % t:
        raise InvalidArgumentError(
            f"pipeline: tensor parallelism over {t} ranks inside the stages of a model "
            f"prepared with blocks={blocks}: the tp size must divide the blocks; prepare it "
            f"with sl.make_deterministic(model, blocks={max(t, blocks)})"
        )
    if microbatches < 1 or microbatches & (microbatches - 1):
        raise InvalidArgumentError(
            f"pipeline: deterministic mode needs a power-of-two number of micro-batches "
            f"(got {microbatches}): the micro-batches' sums are subtrees of the batch's, and "
            "the loss's 1/microbatches is then exact"
        )


def whole_plan(model: nn.Module, tp: ProcessGroup, plan: str | Mapping[str, Any]) -> dict[str, Any]:
    """The tensor-parallel plan of the whole (uncut) model, by its names.

    ``"auto"`` also splits the vocabulary's embedding and output head by vocabulary, tied
    (the built-in GPT) or not (a chain whose first child embeds and whose last child ends in
    the head: ``chain_heads``); the head's logits are gathered, so the pipeline's ``loss_fn``
    sees them whole.
    """
    if plan == "auto":
        chosen = auto_plan(model, tp.world_size, sequence_parallel=False)
        for emb, head in tied_heads(model) + chain_heads(model):
            if splits_by_vocabulary(model, (emb, head), tp.world_size):
                chosen |= {emb: "vocab", head: Colwise(gather_output=True)}
        return chosen
    if isinstance(plan, str):
        raise InvalidArgumentError(f"pipeline: tp_plan={plan!r}; use 'auto' or a dict")
    return dict(plan)


def _traced(
    model: nn.Module,
    g: ProcessGroup,
    split: str | Sequence[str],
    example: Any,
    virtual_stages: int,
    stages: int,
    init_fn: Callable[[nn.Module], None] | None,
    device: torch.device | str | None,
    **options: Any,
) -> PipelineModule:
    """A model that is not a chain of children, split by tracing (``pipeline.trace``)."""
    if isinstance(split, str) or example is None:
        raise InvalidArgumentError(
            f"sl.pipeline splits {type(model).__name__} (not an nn.Sequential) by tracing: pass "
            "split=[the submodules that start stages 1, 2, ...] (e.g. ['layers.4']) and "
            "example= one micro-batch of input"
        )
    infos = tensor_infos(model)
    traced = trace_split(model, list(split), example, stages, g.world_size)
    strip(model)
    mine, children = rank_stages(traced, g.rank, g.world_size)
    meta = any(is_meta(stage) for stage in mine.values())
    if meta:
        where = torch.device(device) if device is not None else _default_device(g)
        materialize([(f"stage {s}", st.graph_module) for s, st in mine.items()], where, init_fn)
        for stage in mine.values():
            stage.adopt()  # the graph module's tensors, materialised
    module = PipelineModule(
        traced.parts,
        children,
        g,
        virtual_stages=virtual_stages,
        infos=infos,
        tied=traced.tied,
        synchronize=meta,
        stage_modules=dict(mine),
        **options,
    )
    if isinstance(example, dict):  # keyword inputs: step() takes a dict with these keys
        module.input_names = list(example)
    return module


def _default_device(group: ProcessGroup) -> torch.device:
    if group.backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
