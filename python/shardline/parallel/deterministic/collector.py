"""One forward's per-unit gradients, by parameter, summed in the canonical tree once complete.

Each use of a parameter in a forward (a tied embedding has two) gives, in backward, its
per-unit gradients as a ``_Use`` that makes them a block of rows at a time. When the last use
has given, the collector adds the uses' blocks unit by unit (in the order backward gave them)
and sums the units of each block in the canonical tree (``shardline.comm.tree.tree_sum``).
A block's size depends on the parameter's shape only, never on the number of units: every
layout runs the same kernels on the same shapes, so a unit's gradient has the same bits in
all of them, and the units' blocks stay in cache for the tree.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from shardline import _native
from shardline.comm.tree import built_kernels, tree_sum
from shardline.errors import InvalidArgumentError
from shardline.parallel.deterministic import kernels

__all__ = [
    "Collector",
    "Dense",
    "Lookups",
    "Products",
    "Rows",
    "Use",
    "keep_wide",
    "sum_uses",
    "use_of",
    "wide_grad",
]

# Elements per unit in one block of rows, by device: on CPU 16 units of 65536 fp32 are 4 MiB,
# on a GPU whole layers' products fit and fewer blocks mean fewer kernel launches.
BLOCK_ELEMENTS = {"cpu": 1 << 16, "cuda": 1 << 22}
# Multiply-adds of the units' products from which the engine runs them on torch's threads.
_THREADED_PRODUCTS = 1 << 22
# Low-precision gradients are summed in float32 and rounded once, as one GEMM's output is.
_WIDER = {torch.bfloat16: torch.float32, torch.float16: torch.float32}


class Use:
    """One use's per-unit gradients of a parameter, ``[units, *shape]``, made by rows."""

    dtype: torch.dtype  # of the rows it makes

    def rows(self, start: int, stop: int, into: torch.Tensor | None) -> torch.Tensor:
        """Rows ``[start, stop)`` of every unit's gradient, added into ``into`` if given."""
        raise NotImplementedError

    def tensors(self) -> list[torch.Tensor]:
        """What makes it, to move it to another rank: ``use_of(tensors)`` makes it again.

        The first is an int64 tensor of its kind and sizes.
        """
        raise NotImplementedError


class Dense(Use):
    """Per-unit gradients already made (biases, norms: small)."""

    def __init__(self, per_unit: torch.Tensor) -> None:
        self.per_unit, self.dtype = per_unit, per_unit.dtype

    def rows(self, start: int, stop: int, into: torch.Tensor | None) -> torch.Tensor:
        """See ``Use.rows``."""
        block = self.per_unit[:, start:stop]
        return block if into is None else into.add_(block)

    def tensors(self) -> list[torch.Tensor]:
        """See ``Use.tensors``."""
        return [torch.tensor([_DENSE]), self.per_unit]


# A parameter's gradient in float32 and, where asked for, rounded to a lower precision.
Summed = tuple[torch.Tensor, torch.Tensor | None]


class Rows(Use):
    """Per-unit sums over rows made on a GPU on demand (a bias's, a norm's: ``gpu_rows``).

    ``make(False, None)`` gives every unit's sums, ``[units, *shape]``; ``make(True, low)``
    their canonical tree (where ``tree_fits``) in the same launch, and with ``low`` a dtype
    that tree rounded to it too: the parameter's gradient where this is its only use
    (``summed``).
    """

    dtype = torch.float32

    def __init__(self, make: Callable[[bool, torch.dtype | None], Summed], tree_fits: bool) -> None:
        self._make, self.tree_fits = make, tree_fits
        self._per_unit: torch.Tensor | None = None

    def per_unit(self) -> torch.Tensor:
        """Every unit's sums, made once."""
        if self._per_unit is None:
            self._per_unit = self._make(False, None)[0]
        return self._per_unit

    def rows(self, start: int, stop: int, into: torch.Tensor | None) -> torch.Tensor:
        """See ``Use.rows``."""
        block = self.per_unit()[:, start:stop]
        return block if into is None else into.add_(block)

    def summed(self, low: torch.dtype | None = None) -> Summed:
        """The units' sums added in the canonical tree (``tree_fits``): ``tree_sum``'s bits.

        And with ``low``, that sum rounded to it (``Tensor.to``'s bits), from the same launch.
        """
        return self._make(True, low)

    def tensors(self) -> list[torch.Tensor]:
        """See ``Use.tensors`` (as ``Dense``)."""
        return Dense(self.per_unit()).tensors()


class Products(Use):
    """A linear layer's weight: unit ``u``'s gradient is ``dys[u].T @ xs[u]``.

    Float32 on CPU, the engine computes each unit's product (``_native.unit_products``: one
    small GEMM each, whose bits do not depend on the rows asked for) and, for ``summed``,
    adds them in the canonical tree as they come, without holding every unit's product:
    faster than ``torch.bmm`` and then ``tree_sum``. In bf16 or fp16 on a GPU (autocast),
    one Triton kernel does the same (``gpu_products``: float32 products, never rounded to
    the low precision; ``gpu``). Elsewhere ``torch.bmm``. Every layout takes the same path
    for the same parameter, so the bits agree across layouts.
    """

    def __init__(self, dys: torch.Tensor, xs: torch.Tensor) -> None:
        self.native = (
            dys.device.type == "cpu" and dys.dtype == xs.dtype == torch.float32 and dys.dim() == 3
        )
        if self.native:
            dys, xs = dys.contiguous(), xs.contiguous()
        self.gpu = (
            dys.is_cuda
            and dys.dtype == xs.dtype
            and dys.dtype in _WIDER
            and dys.dim() == 3
            and max(dys.numel(), xs.numel(), dys.shape[0] * dys.shape[2] * xs.shape[2]) < 1 << 31
            and _gpu_products(dys.device) is not None
        )
        self.dys, self.xs = dys, xs
        self.dtype = torch.float32 if self.gpu else dys.dtype
        # ``gpu``: whether ``summed`` makes the tree in the same launch (few enough units)
        self.tree_fits = self.gpu and dys.shape[0] <= _gpu_products(dys.device).MAX_UNITS
        # ``bias_fits``: whether that launch can make the layer's bias's tree too, from the
        # same ``dys`` (a power of two of units); ``with_bias`` (set by the layer): it does.
        units = dys.shape[0]
        self.bias_fits = self.tree_fits and units & (units - 1) == 0
        self.with_bias = False
        self._made: dict[torch.dtype | None, tuple[Summed, Summed]] = {}

    def rows(self, start: int, stop: int, into: torch.Tensor | None) -> torch.Tensor:
        """See ``Use.rows``."""
        if self.native:
            block = self._engine(start, stop, tree=False)
        elif self.gpu:
            block = _gpu_products(self.dys.device).products(self.dys, self.xs, start, stop,
                                                            tree=False)  # fmt: skip
        else:
            block = torch.bmm(self.dys[:, :, start:stop].transpose(1, 2), self.xs)
        return block if into is None else into.add_(block)

    def summed(
        self, lookups: list[Lookups] | None = None, low: torch.dtype | None = None
    ) -> Summed:
        """The units' gradients summed in the canonical tree (``native``, or ``tree_fits``).

        The bits of ``tree_sum(self.rows(0, outs, None))``, without every unit's at once.
        ``lookups`` (``native``, given after this use): an embedding tied to the weight, whose
        rows each unit adds onto its product before the tree, in their order: the bits of
        ``_total`` then ``tree_sum``. ``low`` (``gpu``): that sum rounded to it too
        (``Tensor.to``'s bits), from the same launch; else the second item is ``None``.
        """
        outs = self.dys.shape[2]
        if self.gpu and self.with_bias:
            return self._both(low)[0]
        if self.gpu:  # (``tree_fits``)
            kernel = _gpu_products(self.dys.device)
            shape, device = (outs, self.xs.shape[2]), self.dys.device
            rounded = None if low is None else torch.empty(shape, dtype=low, device=device)
            summed = kernel.products(self.dys, self.xs, 0, outs, tree=True, rounded=rounded)
            return summed, rounded
        return self._engine(0, outs, tree=True, lookups=lookups), None

    def bias_summed(self, low: torch.dtype | None) -> Summed:
        """``with_bias``: the bias's tree, ``row_sums(tree=True)``'s bits.

        From the launch that makes the weight's, once for both.
        """
        return self._both(low)[1]

    def _both(self, low: torch.dtype | None) -> tuple[Summed, Summed]:
        made = self._made.get(low)
        if made is None:
            outs, ins, device = self.dys.shape[2], self.xs.shape[2], self.dys.device
            w_low = b_low = None
            if low is not None:
                w_low = torch.empty((outs, ins), dtype=low, device=device)
                b_low = torch.empty(outs, dtype=low, device=device)
            b = torch.empty(outs, dtype=torch.float32, device=device)
            kernel = _gpu_products(device)
            w = kernel.products(self.dys, self.xs, 0, outs, tree=True, rounded=w_low, bias=b,
                                bias_rounded=b_low)  # fmt: skip
            made = self._made[low] = (w, w_low), (b, b_low)
        return made

    def _engine(
        self, start: int, stop: int, *, tree: bool, lookups: list[Lookups] | None = None
    ) -> torch.Tensor:
        units, rows, outs = self.dys.shape
        ins = self.xs.shape[2]
        shape = (stop - start, ins) if tree else (units, stop - start, ins)
        out = torch.empty(shape, dtype=torch.float32)
        # Multiply-adds; with no product (an embedding's lookups alone), the units' rows to
        # fill and add: a large vocabulary's are worth the threads too.
        work = units * max(rows, 1) * (stop - start) * ins
        threads = torch.get_num_threads() if work >= _THREADED_PRODUCTS else 1
        _native.unit_products(
            self.dys, self.xs, out, units, rows, outs, ins, start, stop, tree, threads,
            lookups=_by_unit(units, lookups) if lookups else None,
        )  # fmt: skip
        return out

    @staticmethod
    def none_for(use: Lookups) -> Products:
        """No product (zero rows a unit), shaped as ``use``'s weight, which only embeddings use.

        ``summed(lookups)`` then sums the lookups alone.
        """
        return Products(use.dy.new_empty(use.units, 0, use.total),
                        use.dy.new_empty(use.units, 0, use.dy.shape[-1]))  # fmt: skip

    def tensors(self) -> list[torch.Tensor]:
        """See ``Use.tensors``."""
        return [torch.tensor([_PRODUCTS]), self.dys, self.xs]


class Lookups(Use):
    """An embedding's weight: each unit's output gradients added onto the rows it read.

    ``unit`` is nondecreasing (each unit's lookups in its tokens' order).
    """

    def __init__(
        self, units: int, unit: torch.Tensor, idx: torch.Tensor, dy: torch.Tensor, rows: int
    ) -> None:
        self.units, self.unit, self.idx, self.dy, self.total = units, unit, idx, dy, rows
        self.dtype = dy.dtype
        self._sorted = False
        # Float32 on CPU, the engine adds them inside its tree (``Products.summed``).
        self.native = dy.device.type == "cpu" and dy.dtype == torch.float32 and dy.dim() == 2

    @property
    def in_order(self) -> bool:
        """For the engine: ``native``, and its lookups still by unit (``rows`` sorts them)."""
        return self.native and not self._sorted

    def rows(self, start: int, stop: int, into: torch.Tensor | None) -> torch.Tensor:
        """See ``Use.rows``."""
        width = self.dy.shape[-1]
        if into is None:
            into = self.dy.new_zeros(self.units, stop - start, width)
        unit, idx, dy = self.unit, self.idx, self.dy
        if (start, stop) != (0, self.total):
            if not self._sorted:  # blocks of rows: sorted once, stably, to slice by row
                self.idx, order = torch.sort(idx, stable=True)
                self.unit, self.dy, self._sorted = unit[order], dy[order], True
            bounds = torch.tensor([start, stop], device=idx.device)
            lo, hi = torch.searchsorted(self.idx, bounds).tolist()
            unit, idx, dy = self.unit[lo:hi], self.idx[lo:hi], self.dy[lo:hi]
        # index_add_ adds the gradients of one row in their order (the unit's tokens'),
        # onto what the parameter's earlier uses gave (on a GPU: with torch's deterministic
        # algorithms, not atomics).
        with kernels.algorithms() if dy.is_cuda else contextlib.nullcontext():
            into.view(-1, width).index_add_(0, unit * (stop - start) + (idx - start), dy)
        return into

    def tensors(self) -> list[torch.Tensor]:
        """See ``Use.tensors``."""
        return [torch.tensor([_LOOKUPS, self.units, self.total]), self.unit, self.idx, self.dy]


_DENSE, _PRODUCTS, _LOOKUPS = range(3)


def use_of(tensors: list[torch.Tensor]) -> Use:
    """The use that ``Use.tensors`` gave these tensors of (received from another rank)."""
    head = [int(v) for v in tensors[0].tolist()]
    if head[0] == _DENSE:
        return Dense(tensors[1])
    if head[0] == _PRODUCTS:
        return Products(tensors[1], tensors[2])
    return Lookups(head[1], tensors[1], tensors[2], tensors[3], head[2])


class Collector:
    """One forward's per-unit gradients, by parameter, until backward has all of them.

    ``held``: a parameter's uses are kept once all have given, not summed, until ``finish()``
    hands them out (a pipeline's micro-batch: its stage sums them when it chooses).
    """

    def __init__(self, units: int, batch: int, *, held: bool = False) -> None:
        self.units = units
        self.batch = batch
        self.held = held
        self._uses: dict[int, int] = {}
        self._given: dict[int, list[Use]] = {}
        self._params: dict[int, torch.Tensor] = {}
        self._done: list[tuple[torch.Tensor, list[Use]]] = []

    def use(self, param: torch.Tensor) -> int:
        """Notes one use of ``param`` in this forward; its key for ``give``."""
        key = id(param)
        self._uses[key] = self._uses.get(key, 0) + 1
        self._params[key] = param  # the id stays this tensor's until its last use has given
        return key

    def give(self, key: int, use: Use) -> torch.Tensor | None:
        """Adds one use; once the last has come, the tree sum over units of their total.

        ``held``: ``None`` always; the complete uses wait for ``finish()``.
        """
        left = self._uses[key] - 1
        if left:
            self._uses[key] = left
            if not self._given:  # the first held parameter of this backward
                torch.autograd.Variable._execution_engine.queue_callback(self._check_complete)
            self._given.setdefault(key, []).append(use)
            return None
        given = self._given.pop(key, None)
        given = [use] if given is None else [*given, use]
        param = self._params.pop(key)
        del self._uses[key]
        if self.held:
            self._done.append((param, given))
            return None
        return sum_uses(param, given)

    def finish(self) -> list[tuple[torch.Tensor, list[Use]]]:
        """``held``: each parameter whose uses have all given, with them, in that order."""
        done, self._done = self._done, []
        return done

    def _check_complete(self) -> None:
        """At the end of backward: no parameter may be left with some of its uses given."""
        held = [self._params[k] for k in self._given]
        if held:
            shapes = ", ".join(str(list(p.shape)) for p in held[:4])
            raise InvalidArgumentError(
                f"deterministic mode: backward reached only some uses of {len(held)} "
                f"parameter(s) used several times in the forward (shapes {shapes}); their "
                "gradient is the sum over all uses, so it was not made. Let the loss depend "
                "on every use, or detach the uses it does not need"
            )


def sum_uses(param: torch.Tensor, given: list[Use]) -> torch.Tensor:
    """``param``'s gradient: its uses added unit by unit, then the units in the tree.

    Low-precision uses (bf16 parameters, or products under autocast) are widened to float32
    before anything is added, and the gradient is rounded to ``param``'s dtype once (for a
    parameter given to ``keep_wide``, the float32 sum is kept for ``wide_grad``).
    """
    if param.dim() == 0:
        raise InvalidArgumentError("deterministic mode: a 0-d parameter has no rows to sum")
    n = param.shape[0]
    per_unit = BLOCK_ELEMENTS.get(param.device.type, BLOCK_ELEMENTS["cuda"])
    step = max(1, per_unit * n // max(1, param.numel()))
    # The engine's products (and lookups), summed as they come; on a GPU rounded to the
    # parameter's dtype in the same launch.
    grad, rounded = _engine_sum(given, param.dtype if param.dtype in _WIDER else None)
    if grad is None and step >= n:
        grad = tree_sum(_total(given, 0, n), fresh=True)
    elif grad is None:
        wide = _WIDER.get(param.dtype, param.dtype)
        grad = torch.empty(param.shape, dtype=wide, device=param.device)
        for start in range(0, n, step):
            stop = min(n, start + step)
            grad[start:stop] = tree_sum(_total(given, start, stop), fresh=True)
    if grad.dtype == param.dtype:
        return grad
    if param in _WANTED:
        _WIDE[param] = grad
    return grad.to(param.dtype) if rounded is None else rounded


def _engine_sum(given: list[Use], low: torch.dtype | None) -> Summed | tuple[None, None]:
    """The engine's tree over units of a weight's uses (``(None, None)``: not for it).

    For a linear layer's float32 products on CPU, and the embeddings' lookups that follow
    them (a tied weight) or make them all: the bits of ``_total`` then ``tree_sum``. On a GPU,
    for its low-precision products or a bias's or norm's sums, used once: the tree made in
    the same launch (``gpu_products``, ``gpu_rows``), the same bits, and rounded to ``low``
    there too.
    """
    first, rest = given[0], given[1:]
    if (isinstance(first, Products) and first.gpu) or isinstance(first, Rows):
        return first.summed(low=low) if first.tree_fits and not rest else (None, None)
    lookups = [u for u in rest if isinstance(u, Lookups) and u.in_order]
    if len(lookups) < len(rest):
        return None, None
    if isinstance(first, Products) and first.native:
        return first.summed(lookups)
    if isinstance(first, Lookups) and first.in_order:
        return Products.none_for(first).summed([first, *lookups])
    return None, None


_GPU_PRODUCTS: list[Any] = []  # ``gpu_products`` once looked for ([None]: no Triton here)


def _gpu_products(device: torch.device) -> Any:
    """``shardline.parallel.deterministic.gpu_products``, or ``None`` (see ``built_kernels``)."""
    if _GPU_PRODUCTS:  # looked for already: every linear layer's backward asks
        return _GPU_PRODUCTS[0]

    def load() -> Any:
        from shardline.parallel.deterministic import gpu_products  # noqa: PLC0415  (Triton)

        return gpu_products

    def trial(module: Any) -> None:
        z = torch.zeros(2, 1, 1, dtype=torch.bfloat16, device=device)
        module.products(z, z, 0, 1, tree=True)
        module.products(z, z, 0, 1, tree=False)

    instead = "torch.bmm, whose bf16 products round before the tree: other bits than Triton's"
    return built_kernels(_GPU_PRODUCTS, load, trial, "per-unit product kernel", instead)


def _by_unit(units: int, lookups: list[Lookups]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The lookups as the engine takes them: ``(offsets, idx, dy)`` by unit, in their order."""
    if len(lookups) == 1:
        unit, idx, dy = lookups[0].unit, lookups[0].idx, lookups[0].dy
    else:  # each unit's: the first use's in order, then the next use's
        unit, idx, dy = (torch.cat([getattr(u, a) for u in lookups]) for a in ("unit", "idx", "dy"))
        order = torch.sort(unit, stable=True).indices
        unit, idx, dy = unit[order], idx[order], dy[order]
    offsets = torch.zeros(units + 1, dtype=torch.int64)
    torch.cumsum(torch.bincount(unit, minlength=units), 0, out=offsets[1:])
    return offsets, idx.to(torch.int64).contiguous(), dy.contiguous()


# Low-precision parameters whose float32 gradient a strategy reduces in float32 (ZeRO with
# ``MixedPrecision``): each rank's part of the sum then stays unrounded, as one process's
# whole sum does, and the bits do not depend on the world size.
_WANTED: WeakIdKeyDictionary = WeakIdKeyDictionary()
_WIDE: WeakIdKeyDictionary = WeakIdKeyDictionary()


def keep_wide(params: Iterable[torch.Tensor]) -> None:
    """Keeps these parameters' float32 gradients, before rounding, for ``wide_grad``."""
    for p in params:
        _WANTED[p] = True


def wide_grad(param: torch.Tensor) -> torch.Tensor | None:
    """``param``'s float32 gradient of its last sum, whose rounding is its ``.grad``, once.

    ``None`` if there is none (not kept, not low precision, or already taken).
    """
    if not _WIDE or param not in _WIDE:  # ZeRO's hook asks for every parameter: fast when none
        return None
    grad: torch.Tensor = _WIDE[param]
    del _WIDE[param]
    return grad


def _total(given: list[Use], start: int, stop: int) -> torch.Tensor:
    block: torch.Tensor | None = None
    for use in given:
        if block is not None and use.dtype == block.dtype:
            block = use.rows(start, stop, block)  # added in place
            continue
        part = use.rows(start, stop, None)
        if part.dtype in _WIDER:
            part = part.to(_WIDER[part.dtype])
        block = part if block is None else block.add_(part)
    assert block is not None
    return block
