"""Selective recomputation read off the autograd graph: no second forward, no dispatch mode.

Inside a block, every tensor autograd saves for backward passes a pack hook. A tensor made by
a cheap op whose own backward node keeps what made it (a LayerNorm's output, whose node keeps
the input, weight, bias, mean and rstd; a GELU's or SiLU's output, whose node keeps the input;
a product whose node keeps both factors) is not kept: the hook keeps a reference to that node
instead. In backward, when a consumer (the next matrix product) unpacks it, the op runs once
more on the node's own saved tensors, so the same kernel sees the same values and the result
is the same bit for bit. Views of such tensors are taken again from the recomputed one.

This is what torch's selective checkpointing does for these ops, without its cost: that runs
the block under a Python dispatch mode that sees every aten op twice (forward and recompute).
On the 395M GPT in bf16 on 2 H200s that took the step from 86 to 181 ms
(``benches/results/zero-cuda-2xh200-large-bf16-sac.txt``); these hooks take it to 98 ms
(``...-bf16-sel2.txt``): one Python call per saved tensor in forward, one per unpack.

Composes with saved-tensor hooks already active outside the block (ZeRO-3 tags saved tensors
to gather parameters in backward): what is kept goes through them, and a tensor read early by a
recomputation is handed to its own node's unpack rather than unpacked twice.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = [
    "NORM_MODULES",
    "droppable",
    "enter_block",
    "leave_block",
    "note_norm_eps",
    "selective_hooks",
]

Node = Any  # torch.autograd.graph.Node (grad_fn objects)


class _State(threading.local):
    def __init__(self) -> None:
        self.blocks: list[_Block] = []  # blocks running forward in this thread, innermost last
        self.recomputing = 0  # > 0 while a dropped tensor is recomputed


_state = _State()


def _layer_norm(fn: Node, eps: float | None) -> torch.Tensor:
    assert eps is not None
    out: torch.Tensor = torch.native_layer_norm(
        fn._saved_input, fn._saved_normalized_shape, fn._saved_weight, fn._saved_bias, eps
    )[0]
    return out


def _rms_norm(fn: Node, eps: float | None) -> torch.Tensor:
    # eps None is the op's own default (the dtype's epsilon), as in the forward
    out: torch.Tensor = torch.ops.aten._fused_rms_norm(
        fn._saved_input, fn._saved_normalized_shape, fn._saved_weight, eps
    )[0]
    return out


def _gelu(fn: Node, _eps: float | None) -> torch.Tensor:
    # (the functional binding: the same aten op as the forward's, without the op packet's cost)
    return torch.nn.functional.gelu(fn._saved_self, approximate=fn._saved_approximate)


def _silu(fn: Node, _eps: float | None) -> torch.Tensor:
    return torch.nn.functional.silu(fn._saved_self)


def _mul(fn: Node, _eps: float | None) -> torch.Tensor:
    return torch.mul(fn._saved_self, fn._saved_other)


# Backward node class name -> how its output 0 is made again from what the node saved.
_RECIPES: dict[str, Callable[[Node, float | None], torch.Tensor]] = {
    "NativeLayerNormBackward0": _layer_norm,
    "FusedRmsNormBackward0": _rms_norm,  # CUDA's RMSNorm kernel (elsewhere it is products)
    "GeluBackward0": _gelu,
    "SiluBackward0": _silu,
    "MulBackward0": _mul,
}

# The norms' nodes, with the saved values their recipe reads (checked: they differ by version).
_NORMS = {
    "NativeLayerNormBackward0": ("input", "weight", "bias"),
    "FusedRmsNormBackward0": ("input", "weight"),
}
NORM_MODULES: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.RMSNorm)


_KNOWN: dict[type, bool] = {}  # node class -> whether it has a recipe (by name, cached)


def _recipe(t: torch.Tensor, eps: dict[int, float | None]) -> tuple[Node, float | None] | None:
    """``(node, eps)`` when ``t`` (not a view) can be made again from its node's saved tensors.

    Runs for every tensor a block saves: the common answer (no) is reached in a few lookups.
    """
    fn = t.grad_fn
    if fn is None:
        return None
    kind = type(fn)
    known = _KNOWN.get(kind)
    if known is None:
        known = _KNOWN[kind] = kind.__name__ in _RECIPES
    if not known or t.output_nr != 0:
        return None
    name = kind.__name__
    if name in _NORMS:
        # eps is not among the node's saved values: known only for norm modules' outputs
        if id(fn) not in eps or not all(hasattr(fn, f"_raw_saved_{n}") for n in _NORMS[name]):
            return None
        return fn, eps[id(fn)]
    if name == "MulBackward0" and any(f is None for f, _ in fn.next_functions):
        return None  # a factor that needs no gradient: its node keeps only the other one
    return fn, None


def droppable(t: torch.Tensor, eps: dict[int, float | None]) -> bool:
    """Whether ``"selective"`` drops the saved tensor ``t`` (also for the memory estimate)."""
    base = t._base
    return _recipe(t if base is None else base, eps) is not None


class _Recompute:
    """A dropped tensor: its producing node, run again on first unpack.

    One record serves every save of the tensor (and of its views) in the block.
    """

    __slots__ = ("eps", "node", "value")

    def __init__(self, node: Node, eps: float | None) -> None:
        self.node, self.eps = node, eps
        self.value: torch.Tensor | None = None

    def get(self) -> torch.Tensor:
        if self.value is None:
            _state.recomputing += 1
            try:
                # No graph: autograd gives the unpacked value the saved tensor's own history
                # (create_graph=True differentiates through it as without recomputation).
                with torch.no_grad():
                    self.value = _RECIPES[type(self.node).__name__](self.node, self.eps)
            finally:
                _state.recomputing -= 1
        return self.value


class _View:
    __slots__ = ("geometry", "source")

    def __init__(self, source: _Recompute, geometry: tuple[Any, Any, Any]) -> None:
        self.source, self.geometry = source, geometry

    def get(self) -> torch.Tensor:
        size, stride, offset = self.geometry
        return self.source.get().as_strided(size, stride, offset)


class _Kept:
    """A kept tensor, packed by the hooks outside the block.

    A recomputation that reads it (through its node's saved values) unpacks it early; the
    node's own unpack then takes that value, so the outer hooks see exactly one unpack, as
    without recomputation.
    """

    __slots__ = ("early", "packed")

    def __init__(self, packed: Any) -> None:
        self.packed = packed
        self.early: torch.Tensor | None = None


class _Block:
    """The pack and unpack hooks of one block's forward."""

    def __init__(self, outer: tuple[Callable[..., Any], Callable[..., Any]] | None) -> None:
        self.outer = outer
        self.eps: dict[int, float | None] = {}  # id(norm node) -> eps, for this forward
        self.nodes: list[Node] = []  # those nodes, alive while ids are looked up
        self.dropped: dict[int, _Recompute] = {}  # id(node) -> its record, per forward
        self.context: Any = None  # the saved-tensor hooks, while they are active

    def pack(self, t: torch.Tensor) -> Any:
        base = t._base
        found = _recipe(t if base is None else base, self.eps)
        if found is None:
            return t if self.outer is None else _Kept(self.outer[0](t))
        node, eps = found
        record = self.dropped.get(id(node))
        if record is None:
            record = self.dropped[id(node)] = _Recompute(node, eps)
        if base is None:
            return record
        offset = t.storage_offset() - base.storage_offset()
        return _View(record, (t.size(), t.stride(), offset))

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, _Recompute | _View):
            return packed.get()
        assert self.outer is not None
        kept: _Kept = packed
        if kept.early is not None:
            early, kept.early = kept.early, None
            return early
        value: torch.Tensor = self.outer[1](kept.packed)
        if _state.recomputing:
            kept.early = value
        return value


def note_norm_eps(module: nn.Module, _args: Any, output: Any) -> None:
    """Forward hook of a block's norm module (``NORM_MODULES``): notes its eps.

    The norm's backward node does not keep eps, and recomputing its output needs it.
    """
    fn = output.grad_fn if isinstance(output, torch.Tensor) else None
    if _state.blocks and fn is not None:
        # One read of ``grad_fn``, kept: torch 2.11 makes a new Python object for a node at
        # each read while none is alive, so a second read's id was not the key (its norms'
        # outputs were then kept, or not, as memory addresses happened to be reused).
        block = _state.blocks[-1]
        block.eps[id(fn)] = module.eps  # type: ignore[assignment]
        block.nodes.append(fn)


def enter_block(hooks: bool) -> _Block:
    """Starts a ``"selective"`` block's forward in this thread.

    From now on its norms' eps are noted; with ``hooks``, what autograd saves goes through the
    block's hooks.

    Returns the block, for ``leave_block`` (and ``droppable``'s ``eps``).
    """
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:  # pragma: no cover - every torch this package supports has it
        raise RuntimeError("recompute='selective' needs torch >= 2.1 (saved-tensor hook stack)")
    block = _Block(top(False) if hooks else None)
    _state.blocks.append(block)
    if hooks:
        block.context = torch.autograd.graph.saved_tensors_hooks(block.pack, block.unpack)
        block.context.__enter__()
    return block


def leave_block(block: _Block) -> None:
    """Ends what ``enter_block`` started (the records already packed stay with autograd)."""
    if block.context is not None:
        block.context.__exit__(None, None, None)
    _state.blocks.remove(block)
    block.eps.clear()
    block.nodes.clear()
    block.dropped.clear()


@contextmanager
def selective_hooks() -> Iterator[None]:
    """Runs a block's forward with ``"selective"``'s saved-tensor hooks (module docstring)."""
    block = enter_block(hooks=True)
    try:
        yield
    finally:
        leave_block(block)
