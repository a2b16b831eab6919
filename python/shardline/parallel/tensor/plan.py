"""``tensor_parallel``: a model's layers rewritten in place into tensor-parallel ones.

A plan maps module names to styles:

- ``"colwise"`` (``Colwise(pieces=k)`` for a fused weight of k blocks, q/k/v;
  ``Colwise(replicas=r)`` for a slice r consecutive ranks share): an ``nn.Linear`` (or a
  transformers ``Conv1D``) becomes a ``ColumnParallelLinear``;
- ``"rowwise"``: an ``nn.Linear`` (or ``Conv1D``) becomes a ``RowParallelLinear`` (it takes
  a column layer's output slice);
- ``"vocab"``: an ``nn.Embedding`` becomes a ``VocabParallelEmbedding``, an output
  ``nn.Linear`` a ``ColumnParallelLinear`` whose logits stay split by vocabulary (a head
  tied to the embedding stays tied: both hold the same rows). A model with a ``loss_fn``
  attribute (the built-in GPT) then gets the vocabulary-parallel cross-entropy there, so its
  loss is the dense one and the full logits are never gathered;
- ``"sequence"``: a norm on the sequence-split residual stream becomes a
  ``SequenceParallelNorm``;
- ``"sequence_region"``: any module whose input and output are the residual stream (the
  chain of blocks) takes it split along the sequence and gives it back whole;
  ``"sequence_enter"`` / ``"sequence_exit"`` do each half (on the first and the last of
  blocks a model calls in a loop), and ``"sequence_gather"`` gathers a module's input
  (attention or an MLP whose code wants the whole sequence; ``Colwise(input="shared")``
  inside it);
- ``"shared_input"``: a module whose column layers share one input (q, k and v; gate and
  up) brings it into the region once: one all-reduce of its gradient instead of one per
  layer (``Colwise(input="shared")`` inside it);
- ``"attention"``: an ``nn.MultiheadAttention`` becomes a ``ParallelMultiheadAttention``
  (its heads split).

``plan="auto"`` recognises the models ``tensor.auto`` lists (the built-in GPT; Llama-style
and GPT-2 Hugging Face models); everything else stays replicated, and ``model.plan()`` lists
it.

Before any layer is cut, the group's rank 0 broadcasts the model's tensors, so every layout
starts from the numbers one process would have (the strategy contract).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shardline.comm.coalesced import broadcast_coalesced
from shardline.comm.group import ProcessGroup
from shardline.comm.world import default_group
from shardline.errors import InvalidArgumentError
from shardline.parallel.replaced import mark_replaced
from shardline.parallel.tensor import overlap
from shardline.parallel.tensor.attention import ParallelMultiheadAttention, unsupported
from shardline.parallel.tensor.auto import auto_plan, fix_attention, is_hf_causal_lm, tied_heads
from shardline.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelNorm,
    VocabParallelEmbedding,
    is_conv1d,
)
from shardline.parallel.tensor.loss import causal_lm_loss, vocab_parallel_loss
from shardline.parallel.tensor.regions import copy_to, gather_from, gather_seq, split_to
from shardline.parallel.tensor.styles import Colwise, Rowwise

__all__ = ["Colwise", "Rowwise", "tensor_parallel"]


def _on_input(fn: Any) -> Any:
    """A forward pre-hook applying ``fn`` to the module's first input (or ``hidden_states``)."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if args:
            return (fn(args[0]), *args[1:]), kwargs
        if "hidden_states" not in kwargs:
            raise InvalidArgumentError(
                f"tensor_parallel: {type(module).__name__} was called with neither a positional "
                "input nor hidden_states=, so its plan's hook finds no input to bring into the "
                "region; pass the input positionally"
            )
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}

    return hook


def _on_output(fn: Any) -> Any:
    """A forward hook applying ``fn`` to the module's output (or a tuple's first element)."""

    def hook(_: nn.Module, __: Any, out: Any) -> Any:
        return (fn(out[0]), *out[1:]) if isinstance(out, tuple) else fn(out)

    return hook


def _sequence_hooks(module: nn.Module, group: ProcessGroup, kind: str) -> nn.Module:
    """Hooks at the edges of the sequence-split stream (the ``"sequence_*"`` styles).

    Hooks, not a wrapper, so the module keeps its place and its parameters their names.
    """
    split = _on_input(lambda x: split_to(x, group, dim=1))
    gather = _on_output(lambda x: gather_from(x, group, dim=1))
    if kind in ("sequence_region", "sequence_enter"):
        module.register_forward_pre_hook(split, with_kwargs=True)
    if kind in ("sequence_region", "sequence_exit"):
        module.register_forward_hook(gather)
    if kind == "sequence_gather":  # the whole sequence in; backward reduce-scatters
        module.register_forward_pre_hook(_on_input(lambda x: gather_seq(x, group, dim=1)),
                                         with_kwargs=True)  # fmt: skip
    if kind == "shared_input":  # whole in; backward all-reduces once for every layer inside
        module.register_forward_pre_hook(_on_input(_shared_input(module, group)),
                                         with_kwargs=True)  # fmt: skip
    return module


def _shared_input(module: nn.Module, group: ProcessGroup) -> Any:
    """The shared input's entry: ``copy_to``, its all-reduce overlapping weight gradients.

    The column layers inside defer their weight gradients to its backward (``overlap``).
    """
    layers: list[ColumnParallelLinear] | None = None

    def enter(x: torch.Tensor) -> torch.Tensor:
        nonlocal layers
        if layers is None:  # found at the first call: the plan is applied by then
            layers = [m for m in module.modules()
                      if isinstance(m, ColumnParallelLinear) and m.can_defer()]  # fmt: skip
        if not layers or not overlap.plain_call(x):
            return copy_to(x, group)
        deferred = overlap.SharedInputCall([t for m in layers for t in (m.weight, m.bias)])
        for i, m in enumerate(layers):
            m.deferred = (deferred, i)
        return overlap.shared_copy(x, group, deferred)

    return enter


_STYLES: dict[str, Any] = {
    "colwise": Colwise(),
    "rowwise": Rowwise(),
    "vocab": "vocab",
    "sequence": "sequence",
    "sequence_region": "sequence_region",
    "sequence_enter": "sequence_enter",
    "sequence_exit": "sequence_exit",
    "sequence_gather": "sequence_gather",
    "shared_input": "shared_input",
    "attention": "attention",
}


def _style(name: str, style: Any) -> Any:
    if isinstance(style, Colwise | Rowwise):
        return style
    if isinstance(style, str) and style in _STYLES:
        return _STYLES[style]
    raise InvalidArgumentError(
        f"tensor_parallel: plan[{name!r}] = {style!r} is not a style; use one of "
        f"{', '.join(map(repr, _STYLES))}, or Colwise(pieces=...) / Rowwise(...)"
    )


def _retie(model: nn.Module, ties: list[tuple[str, str]]) -> None:
    """Makes a tied head hold its embedding's rows again (both were split the same way)."""
    for emb, head in ties:
        e, h = model.get_submodule(emb), model.get_submodule(head)
        if isinstance(e, VocabParallelEmbedding) and isinstance(h, ColumnParallelLinear):
            h.weight = e.weight


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    old = model.get_submodule(name)
    kept = {id(p) for p in new.parameters()}
    gone = [(f"{name}.{n}", p) for n, p in old.named_parameters() if id(p) not in kept]
    mark_replaced(gone, "sl.tensor_parallel")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


_NEEDS: dict[str, type | tuple[type, ...]] = {
    "colwise": nn.Linear,
    "rowwise": nn.Linear,
    "vocab": (nn.Embedding, nn.Linear),
    "sequence": nn.Module,  # a norm: any leaf module (SequenceParallelNorm checks)
    "sequence_region": nn.Module,
    "sequence_enter": nn.Module,
    "sequence_exit": nn.Module,
    "sequence_gather": nn.Module,
    "shared_input": nn.Module,
    "attention": nn.MultiheadAttention,
}


def _kind(style: Any) -> str:
    if isinstance(style, Colwise):
        return "colwise"
    if isinstance(style, Rowwise):
        return "rowwise"
    return str(style)


def _check(module: nn.Module, style: Any, name: str, t: int) -> None:
    """Refuses a style that does not fit the module, or sizes ``t`` does not split."""
    kind = _kind(style)
    need = _NEEDS[kind]
    linear = isinstance(module, nn.Linear) or is_conv1d(module)
    fits = linear if kind in ("colwise", "rowwise") else isinstance(module, need)
    if kind == "vocab":
        fits = isinstance(module, nn.Embedding) or linear
    if not fits:
        kinds = " or ".join(
            f"nn.{k.__name__}" for k in (need if isinstance(need, tuple) else (need,))
        )
        raise InvalidArgumentError(
            f"tensor_parallel: plan[{name!r}] = {style!r} needs an {kinds}; {name} is a "
            f"{type(module).__name__}"
        )
    if kind == "attention":
        assert isinstance(module, nn.MultiheadAttention)
        why, heads = unsupported(module), module.num_heads
        if why is not None or heads % t:
            raise InvalidArgumentError(
                f"tensor_parallel: {name}: "
                + (f"{why} is not supported" if why else f"{heads} heads do not split over "
                   f"tp={t}; use a tp size that divides them")
            )  # fmt: skip
        return
    size, what, by = 0, "", t
    out_f = in_f = 0
    if linear:
        w: torch.Tensor = module.weight  # type: ignore[assignment]
        out_f, in_f = (w.shape[1], w.shape[0]) if is_conv1d(module) else (w.shape[0], w.shape[1])
    if linear and kind in ("colwise", "vocab"):
        pieces = style.pieces if isinstance(style, Colwise) else 1
        replicas = style.replicas if isinstance(style, Colwise) else 1
        if t % replicas:
            raise InvalidArgumentError(
                f"tensor_parallel: {name}: Colwise(replicas={replicas}) must divide tp={t}"
            )
        size, by = out_f, pieces * t // replicas
        what = "output features" + (f" ({pieces} pieces of them)" if pieces > 1 else "")
    elif linear and kind == "rowwise":
        size, what = in_f, "input features"
    elif isinstance(module, nn.Embedding):
        size, what = module.num_embeddings, "rows (the vocabulary)"
    if size % by:
        raise InvalidArgumentError(
            f"tensor_parallel: {name} has {size} {what}, which do not split evenly over "
            f"tp={t} ranks; use a tp size that divides them (or pad the layer), or leave "
            f"{name} out of the plan"
        )


def _rewrite(
    module: Any, style: Any, group: ProcessGroup, sp: bool, shares: dict[int, ProcessGroup]
) -> nn.Module:
    kind = _kind(style)
    if kind == "colwise":
        shared = style.input == "shared"
        return ColumnParallelLinear.from_dense(module, group, pieces=style.pieces,
                                               gather_output=style.gather_output,
                                               sequence_parallel=sp and not shared,
                                               input_shared=shared, replicas=style.replicas,
                                               share=shares.get(style.replicas))  # fmt: skip
    if kind == "rowwise":
        return RowParallelLinear.from_dense(module, group, sequence_parallel=sp,
                                            input_is_parallel=style.input_is_parallel)  # fmt: skip
    if kind == "vocab" and isinstance(module, nn.Embedding):
        return VocabParallelEmbedding.from_dense(module, group)
    if kind == "vocab":  # an output head: logits split by vocabulary
        return ColumnParallelLinear.from_dense(module, group)
    if kind in ("sequence", "attention"):
        wrap = SequenceParallelNorm if kind == "sequence" else ParallelMultiheadAttention.from_dense
        return wrap(module, group)
    return _sequence_hooks(module, group, kind)


def tensor_parallel(
    model: nn.Module,
    group: ProcessGroup | None = None,
    plan: str | Mapping[str, Any] = "auto",
    *,
    sequence_parallel: bool = False,
) -> nn.Module:
    """Rewrites ``model``'s layers into tensor-parallel ones over ``group``; returns it.

    Build the optimizer after it, from ``model.parameters()`` (this rank's slices). Every
    rank of ``group`` calls it with the same plan.

    Args:
        model: The dense model, built normally on every rank (rank 0's weights are used).
        group: The tensor-parallel group (``None``: the default group).
        plan: ``"auto"`` or ``{module name: style}`` (see the module docstring).
        sequence_parallel: Split the residual stream along the sequence between the
            column/row pairs (norms included): the all-reduces become reduce-scatters and
            all-gathers, and activations there take 1/t of the memory.

    Raises:
        InvalidArgumentError: a name the model lacks, a style that does not fit the module,
            or sizes (heads, features, vocabulary) not divisible by the group's size; before
            anything changes.
    """
    g = group if group is not None else default_group()
    t = g.world_size
    chosen = auto_plan(model, t, sequence_parallel) if plan == "auto" else dict(plan)  # type: ignore[arg-type]
    modules = dict(model.named_modules())
    missing = [n for n in chosen if n not in modules]
    if missing:
        some = sorted((n for n in modules if n), key=len)[:12]
        raise InvalidArgumentError(
            f"tensor_parallel: the plan names {missing}, which {type(model).__name__} does not "
            f"have; some of its modules: {some}"
        )
    styles = {n: _style(n, s) for n, s in chosen.items()}
    for name, style in styles.items():
        _check(model.get_submodule(name), style, name, t)
    ties = tied_heads(model)
    tensors = [*model.parameters(), *(b for b in model.buffers() if b.numel())]
    broadcast_coalesced(g, [x.data for x in tensors], 0, 25 << 20)
    # Ranks that hold the same slice (key/value heads fewer than t): one group each, made by
    # every rank in the same order.
    shares: dict[int, ProcessGroup] = {}
    for r in sorted({s.replicas for s in styles.values() if isinstance(s, Colwise)} - {1}):
        for k in range(t // r):
            sub = g.new_group(list(range(k * r, (k + 1) * r)))
            if sub is not None:
                shares[r] = sub
    for name, style in styles.items():
        new = _rewrite(model.get_submodule(name), style, g, sequence_parallel, shares)
        if new is not model.get_submodule(name):
            _replace(model, name, new)
    _retie(model, ties)
    fix_attention(model, t)
    heads = [n for n, s in styles.items() if s == "vocab" and isinstance(modules[n], nn.Linear)]
    if heads and callable(getattr(model, "loss_fn", None)):
        setattr(model, "loss_fn", functools.partial(vocab_parallel_loss, group=g))  # noqa: B010
    elif heads and is_hf_causal_lm(model):  # transformers: its .loss, from split logits
        setattr(model, "loss_function", functools.partial(causal_lm_loss, group=g))  # noqa: B010
    report = _report(model, styles, t)
    object.__setattr__(model, "plan", lambda: report)
    return model


def _report(model: nn.Module, styles: Mapping[str, Any], t: int) -> str:
    lines = [f"tensor parallel over {t} ranks:"]
    lines += [f"  {name or '(the model)'}: {styles[name]}" for name in sorted(styles)]
    split = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
             ParallelMultiheadAttention)  # fmt: skip
    whole = [
        f"{name}.{p}" if name else p
        for name, m in model.named_modules()
        for p, _ in m.named_parameters(recurse=False)
        if not isinstance(m, split) or (isinstance(m, RowParallelLinear) and p == "bias")
    ]
    lines.append(f"  replicated on every rank: {', '.join(whole) or 'nothing'}")
    return "\n".join(lines)
