"""Deterministic mode: the same parameters, bit for bit, whatever the number of ranks.

A gradient is a sum over the batch's samples, and a floating-point sum depends on the order
of its additions. One process sums all samples inside each weight-gradient kernel; a rank of
DDP sums its samples there and the group then sums the ranks, in an order of the algorithm's
choosing. Deterministic mode fixes the order instead:

1. Each parameter's gradient is computed per *unit* (``unit`` consecutive samples, one by
   default) by the layers below, then the units' gradients are added in one canonical tree
   (``shardline.comm.tree.tree_sum``). A parameter used by several layers (a tied embedding)
   gets each unit's contributions added first, in the order backward reaches them.
2. The strategy's group is ``tree_group(group)``, whose sums add the ranks' results in the
   same tree. When every rank holds a power-of-two number of units, its block of units is a
   subtree of the tree over the whole batch, so the group finishes exactly the sum one
   process makes.
3. The mean over samples needs nothing: a mean loss over ``b`` samples scales each sample's
   gradient by ``1/b``, and the group's ``avg`` divides by the world size; both are powers of
   two, and scaling by a power of two commutes with rounding.
4. Tensor parallelism splits sums inside layers (a row layer's output, a column layer's
   input gradient, the vocabulary's softmax). With ``blocks`` every layout cuts each of them
   into that many fixed blocks added in the tree (``split``); a rank holds a subtree of them
   and its group (a ``tree_group``) adds the ranks'.

What it takes: the model's parameters belong to ``nn.Linear``, ``nn.LayerNorm`` and
``nn.Embedding`` layers (others raise, naming them), every such layer sees the samples along
the first dimension of its input, the loss is a mean over the samples (equal terms per
sample), rank ``r`` of ``W`` holds samples ``[r*b, (r+1)*b)`` of the global batch, and ``b``
(per rank) and ``W`` are powers of two. Other layers (attention, activations, the loss) work
row by row and give the same bits for a sample whatever the batch around it on CPU.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from shardline.comm.group import ProcessGroup
from shardline.errors import InvalidArgumentError
from shardline.parallel.deterministic import kernels
from shardline.parallel.deterministic.attention import DeterministicAttention
from shardline.parallel.deterministic.collector import Collector
from shardline.parallel.deterministic.layers import ACTIVE, LAYERS, check_layer
from shardline.parallel.deterministic.split import Split
from shardline.parallel.tensor.auto import auto_plan, chain_heads, tied_heads
from shardline.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from shardline.parallel.tensor.loss import vocab_parallel_loss
from shardline.parallel.tensor.styles import Colwise, Rowwise

__all__ = [
    "blocks_of",
    "collecting",
    "is_deterministic",
    "make_deterministic",
    "unit_of",
]

# The fewest features a block of a split sum may have: MKL multiplies outputs of 8 columns or
# fewer with other kernels than wider ones (measured on an AVX-512 CPU), so a tensor-parallel
# slice that narrow would not round as the whole layer's product does.
MIN_BLOCK = 16

_ATTR = "_shardline_deterministic"
_BLOCKS = "_shardline_deterministic_blocks"
_ROLES = "_shardline_deterministic_roles"


def is_deterministic(model: nn.Module) -> bool:
    """Whether ``make_deterministic`` has prepared ``model``."""
    return hasattr(model, _ATTR)


def unit_of(model: nn.Module) -> int | None:
    """The samples per unit ``make_deterministic`` prepared ``model`` with; ``None``: not."""
    unit: int | None = getattr(model, _ATTR, None)
    return unit


def blocks_of(model: nn.Module) -> int | None:
    """The blocks ``make_deterministic`` prepared ``model`` with; ``None``: not prepared.

    A model not prepared itself whose split layers were, as part of another (a chain of
    the same layers, ``as_sequential``), has theirs.
    """
    if is_deterministic(model):
        blocks: int = getattr(model, _BLOCKS)
        return blocks
    had = {s.blocks for s in _dense_splits(model).values()}
    if len(had) > 1:
        raise InvalidArgumentError(
            f"deterministic mode: the layers of {type(model).__name__} were prepared with "
            f"different blocks ({sorted(had)}), as parts of different models"
        )
    return had.pop() if had else None


def _dense_splits(model: nn.Module) -> dict[str, Split]:
    """The ``Split`` of each dense layer already prepared (one process's: no group)."""
    out = {}
    for name, m in model.named_modules():
        split: Split | None = getattr(m, "_sl_split", None)
        if split is not None and split.group is None:
            out[name] = split
    return out


def make_deterministic(
    model: nn.Module, *, unit: int | None = None, blocks: int | None = None
) -> nn.Module:
    """Prepares ``model`` (in place) for gradients that do not depend on the layout.

    Every ``nn.Linear``, ``nn.LayerNorm`` and ``nn.Embedding`` computes its parameters'
    gradients per unit of ``unit`` samples and adds the units in the canonical tree; the
    model's ``forward`` reads the batch size from its first tensor argument's first dimension.
    Train it as before, alone or under ``sl.distribute(..., deterministic=True)``, which calls
    this and reduces over ranks in the same tree. Larger units cost less (fewer per-unit
    gradients) and allow fewer layouts: every rank needs a power-of-two number of units.
    The prepared model can be copied (``copy.deepcopy``): the copy is prepared too.

    ``blocks`` (a power of two) makes tensor parallelism of up to that many ranks give the
    same bits as well: the sums it splits (a row-parallel layer's output, a column-parallel
    layer's input gradient, the vocabulary's softmax) are cut into ``blocks`` fixed blocks in
    every layout, one process included (``split``), for the layers ``plan="auto"`` splits;
    a model with a ``loss_fn`` gets the vocabulary-parallel cross-entropy in blocks. Layouts
    agree when they use the same ``unit`` and ``blocks``. Called again on a prepared model
    (``distribute`` does, after tensor parallelism rewrote its layers), it prepares the
    layers that are new.

    Args:
        model: The model; its parameters belong to the layers above.
        unit: Samples per unit (``None``: as prepared before, else 1).
        blocks: Blocks of every split sum (``None``: as prepared before, or as the model's
            layers were as part of another model (``blocks_of``), else 1: nothing is cut,
            and tensor parallelism is refused).

    Returns:
        ``model`` itself.

    Raises:
        InvalidArgumentError: a trainable parameter that belongs to another kind of layer
            (named), an unsupported embedding option, ``unit < 1``, ``blocks`` not a power
            of two or not dividing a split layer's features, a tensor-parallel layer whose
            size does not divide ``blocks`` or that ``plan="auto"`` would not split so, or
            a model prepared before with another unit or blocks, or (on a GPU) cuBLAS's
            workspace set otherwise by the environment (``kernels.cublas_env``).
    """
    if any(p.is_cuda for p in model.parameters()):
        kernels.cublas_env()  # before the first product on the GPU, where cuBLAS reads it
    if not all(p.is_cuda for p in model.parameters()):
        kernels.mkl_strict()  # before MKL's first product on CPU, where it reads its mode
    if is_deterministic(model):
        for what, value, had in (
            ("unit", unit, unit_of(model)),
            ("blocks", blocks, blocks_of(model)),
        ):
            if value is not None and value != had:
                raise InvalidArgumentError(
                    f"make_deterministic: the model was prepared with {what}={had}, not "
                    f"{value}; build a fresh model to change it"
                )
        _prepare_layers(model, getattr(model, _ROLES), blocks_of(model) or 1)
        return model
    unit = 1 if unit is None else unit
    blocks = (blocks_of(model) or 1) if blocks is None else blocks
    if unit < 1:
        raise InvalidArgumentError(f"make_deterministic: unit must be >= 1, got {unit}")
    if blocks < 1 or blocks & (blocks - 1):
        raise InvalidArgumentError(
            f"make_deterministic: blocks must be a power of two (the tensor-parallel sizes "
            f"it serves divide it), got {blocks}"
        )
    roles, vocabulary = _split_roles(model, blocks) if blocks > 1 else ({}, False)
    earlier = _dense_splits(model)
    for name, m in model.named_modules():  # in the model's order: the first one named
        prepared = name in earlier or (name in roles and hasattr(m, "_sl_name"))
        if prepared and roles.get(name) != earlier.get(name):
            before = earlier[name].blocks if name in earlier else 1
            raise InvalidArgumentError(
                f"make_deterministic(blocks={blocks}): {name!r} was prepared as part of "
                f"another model, with blocks={before}; prepare this one with the same "
                "blocks (or build it from fresh layers)"
            )
    _prepare_layers(model, roles, blocks)
    if vocabulary and callable(getattr(model, "loss_fn", None)):
        loss = functools.partial(vocab_parallel_loss, group=None, blocks=blocks)
        setattr(model, "loss_fn", loss)  # noqa: B010
    setattr(model, _ATTR, unit)
    setattr(model, _BLOCKS, blocks)
    setattr(model, _ROLES, roles)
    # A bound method, not a closure: a deep copy of the model rebinds it to the copy.
    model.forward = types.MethodType(_forward, model)
    return model


def _prepare_layers(model: nn.Module, roles: dict[str, Split], blocks: int) -> None:
    """Patches each layer with parameters not patched yet; a split layer gets its ``Split``."""
    for name, m in model.named_modules():
        own = [n for n, p in m.named_parameters(recurse=False) if p.requires_grad]
        if not own or getattr(m, "_sl_name", None) is not None:
            continue
        kind = next((k for k in LAYERS if type(m) is k), None)
        if kind is None:
            raise InvalidArgumentError(
                f"deterministic mode: {type(m).__name__} {name or '<root>'!r} holds trainable "
                f"parameters ({', '.join(own)}); only nn.Linear, nn.LayerNorm and "
                "nn.Embedding layers (and their tensor-parallel slices) compute per-unit "
                "gradients. Build the model from those, or freeze these parameters "
                "(requires_grad_(False))"
            )
        check_layer(name, m)
        split = roles.get(name)
        if isinstance(m, ColumnParallelLinear | RowParallelLinear | VocabParallelEmbedding):
            split = _tensor_split(name, m, split, blocks)
        if split is not None:
            m._sl_split = split
        m._sl_name = name
        if m is not model:  # the root's forward is the batch's, below (it calls its layer's)
            m.forward = types.MethodType(LAYERS[kind], m)
    if isinstance(getattr(model, "loss_fn", None), functools.partial):
        _split_loss(model, blocks)


def _split_roles(model: nn.Module, blocks: int) -> tuple[dict[str, Split], bool]:
    """The ``Split`` of each linear layer ``plan="auto"`` splits over ``blocks`` ranks.

    And whether that plan splits an output head by vocabulary. An embedding split by
    vocabulary needs none (a lookup sums nothing); an output head split by it is a column
    layer.
    """
    try:
        plan = auto_plan(model, blocks, False)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(
            f"make_deterministic(blocks={blocks}) cuts the sums that tensor parallelism "
            f"splits, as plan='auto' splits them over {blocks} ranks: {exc}"
        ) from None
    # A chain's output head (tied to its embedding or not) is split by vocabulary inside a
    # pipeline's stages (``pipeline.whole_plan``): cut its sums too, whatever splits it.
    for emb, head in tied_heads(model) + chain_heads(model):
        rows = model.get_submodule(head).out_features
        if head not in plan and isinstance(rows, int) and rows % blocks == 0:
            plan |= {emb: "vocab", head: "vocab"}
    roles: dict[str, Split] = {}
    vocabulary = False
    for name, style in plan.items():
        m = model.get_submodule(name)
        if not isinstance(m, nn.Linear):
            continue  # a vocabulary embedding, or a style deterministic mode refuses later
        if isinstance(style, Colwise) and style.replicas == 1:
            role, pieces, size = "column", style.pieces, m.out_features
        elif isinstance(style, Rowwise):
            role, pieces, size = "row", 1, m.in_features
        elif style == "vocab":
            role, pieces, size, vocabulary = "column", 1, m.out_features, True
        else:
            raise InvalidArgumentError(
                f"make_deterministic(blocks={blocks}): plan='auto' splits {name!r} as "
                f"{style!r}, which deterministic mode does not cut into blocks"
            )
        kind = "output" if role == "column" else "input"
        if size % (pieces * blocks):
            raise InvalidArgumentError(
                f"make_deterministic(blocks={blocks}): {name!r} has {size} {kind} features, "
                f"not {pieces * blocks} equal blocks; use fewer blocks"
            )
        if size // (pieces * blocks) < MIN_BLOCK:
            raise InvalidArgumentError(
                f"make_deterministic(blocks={blocks}): {name!r} would be cut into blocks of "
                f"{size // (pieces * blocks)} {kind} features, under {MIN_BLOCK}: a product "
                "that narrow runs other CPU kernels (MKL on AVX-512 CPUs), so a rank's slice "
                "would not round as the whole layer does; use fewer blocks"
            )
        roles[name] = Split(role, pieces, blocks, None)
    return roles, vocabulary


def _tensor_split(name: str, m: nn.Module, dense: Split | None, blocks: int) -> Split | None:
    """A tensor-parallel layer's ``Split``: the dense layer's blocks, this rank's share."""
    group: ProcessGroup = m.group  # type: ignore[assignment]
    t = group.world_size
    if blocks % t:
        raise InvalidArgumentError(
            f"deterministic mode: {name!r} is split over {t} ranks, which do not divide the "
            f"model's blocks={blocks}; prepare it with sl.make_deterministic(model, "
            f"blocks=B) for a power of two B that is a multiple of every tp size it meets"
        )
    if isinstance(m, VocabParallelEmbedding):
        return None
    want = "column" if isinstance(m, ColumnParallelLinear) else "row"
    pieces = getattr(m, "pieces", 1)
    if dense is None or (dense.role, dense.pieces) != (want, pieces):
        had = "not split" if dense is None else f"{dense.role} ({dense.pieces} pieces)"
        raise InvalidArgumentError(
            f"deterministic mode: tensor parallelism splits {name!r} as a {want} layer "
            f"({pieces} pieces), but with blocks={blocks} plan='auto' makes it {had}, and one "
            "process cuts its sums that way; use plan='auto'"
        )
    return Split(want, pieces, blocks // t, group)


def _split_loss(model: nn.Module, blocks: int) -> None:
    """The vocabulary-parallel loss tensor parallelism set: its sums in this rank's blocks."""
    loss = model.loss_fn
    if not isinstance(loss, functools.partial) or loss.func is not vocab_parallel_loss:
        return
    group = loss.keywords.get("group")
    t = 1 if group is None else group.world_size
    split = functools.partial(vocab_parallel_loss, group=group, blocks=blocks // t)
    setattr(model, "loss_fn", split)  # noqa: B010


def _forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The prepared model's forward: a collector for this batch, then the model's own."""
    first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    if first is None or first.dim() == 0:
        raise InvalidArgumentError(
            "deterministic mode: the model's forward needs a tensor argument whose first "
            "dimension is the batch"
        )
    own = LAYERS.get(type(self))  # the model is itself one layer
    with collecting(first.shape[0], getattr(self, _ATTR), device=first.device):
        if own is not None:
            return own(self, *args, **kwargs)
        return type(self).forward(self, *args, **kwargs)


@contextlib.contextmanager
def collecting(
    batch: int, unit: int, *, held: bool = False, device: torch.device | None = None
) -> Iterator[Collector]:
    """A forward of ``batch`` samples: the prepared layers inside give to the collector yielded.

    It takes their per-unit gradients (``unit`` samples a unit); ``held``: see ``Collector``.
    On a GPU (``device``) the forward runs under ``kernels``' settings, which give a sample
    the same bits whatever the batch.

    Raises:
        InvalidArgumentError: ``batch`` is not a power-of-two number of units.
    """
    units, rest = divmod(batch, unit)
    if rest or units < 1 or units & (units - 1):
        raise InvalidArgumentError(
            f"deterministic mode: a batch of {batch} samples is not a power-of-two number "
            f"of units of {unit}; each rank (and each micro-batch) needs 2**k units so that "
            "its sum is a subtree of the whole batch's"
        )
    gpu = device is not None and device.type == "cuda"
    if gpu:
        kernels.cublas_env()
    previous = getattr(ACTIVE, "collector", None)
    collector = ACTIVE.collector = Collector(units, batch, held=held)
    try:
        with contextlib.ExitStack() as gpu_settings:
            if gpu:  # attention's kernels: see ``kernels`` and ``attention``
                gpu_settings.enter_context(kernels.attention())
                gpu_settings.enter_context(DeterministicAttention())
            yield collector
    finally:
        ACTIVE.collector = previous
