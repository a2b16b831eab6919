"""The strategy contract: how every strategy says what state this rank holds, and restores it.

Every strategy (DDP, ZeRO, a pipeline stage, a tensor-parallel module, and any composition)
implements four methods, and the checkpointer uses nothing else:

- ``sharded_state_dict()``: the model's state on this rank, by the plain model's names;
- ``load_sharded_state_dict(sd)``: takes such a dict back (its tensors filled with new values);
- ``sharded_optim_state_dict(opt)``: ``{"state": {param name: {key: value}}, "param_groups":
  [group with "params" as names]}``;
- ``load_sharded_optim_state_dict(opt, sd)``: takes such a dict back.

A value is one of:

- a ``torch.Tensor``: replicated, the whole tensor on every rank that holds it;
- a ``Shard``: one or more pieces of a global tensor held here, each a ``Box`` (a block at
  offsets, shaped like its tensor) or a ``FlatRange`` (elements ``start ..`` of the tensor
  flattened in row-major order); a ``Shard`` may hold no piece (this rank holds none of it);
- a ``Local``: a tensor that differs per rank by design (an error-feedback residual, a local-SGD
  replica), saved per rank and dropped when the layout changes;
- in optimizer state only, any JSON value (hyperparameters, flags).

The same value object under two names means one tensor under two names (tied weights): it is
stored once. A strategy may also define ``layout()``, a JSON-able description of how it lays
state out (strategy name, mesh), which checkpoints record for people to read; nothing is
decided by it.

``sharded_state_dict(model)`` and the other functions here call the model's own method when it
has one, else the default for a plain module (``composed_state_dict``): every tensor
replicated, but a submodule's own values where it has the method; optimizer state that has
its parameter's local shape laid out like the parameter (``state_like``). A module that defines only
``sharded_state_dict()`` (tensor-parallel blocks, say) gets the defaults for the other three.

A strategy may also define ``regroup(group)`` (elastic training, ``regroup(model, group)``
here): it moves onto a new process group in place, the same wrapper and local parameter
objects, without a collective (the old group is dead), leaving the layout a fresh wrapper on
``group`` would have; the values are then restored through the four methods above
(``sl.checkpoint.load``). A plain module holds no communication state and needs nothing; a
strategy without ``regroup`` is refused.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardline.errors import InvalidArgumentError

if TYPE_CHECKING:
    from shardline.comm.group import ProcessGroup

__all__ = [
    "Box",
    "FlatRange",
    "Local",
    "Shard",
    "composed_state_dict",
    "groups_by_name",
    "layout",
    "load_optim_by_name",
    "load_sharded_optim_state_dict",
    "load_sharded_state_dict",
    "named_tensors",
    "param_layouts",
    "regroup",
    "sharded_optim_state_dict",
    "sharded_state_dict",
    "state_like",
    "strategies_inside",
]


@dataclass(frozen=True)
class Box:
    """A rectangular block of a global tensor: ``tensor`` placed at ``offsets``."""

    tensor: torch.Tensor
    offsets: tuple[int, ...]


@dataclass(frozen=True)
class FlatRange:
    """Elements ``start .. start + tensor.numel()`` of the global tensor, flattened row-major."""

    tensor: torch.Tensor
    start: int


class Shard:
    """This rank's pieces of one global tensor (see the module docstring).

    Args:
        global_shape: The whole tensor's shape.
        pieces: ``Box`` and ``FlatRange`` pieces; none when this rank holds nothing of it.
    """

    __slots__ = ("global_shape", "pieces")

    def __init__(self, global_shape: Sequence[int], pieces: Sequence[Box | FlatRange]) -> None:
        self.global_shape = tuple(int(d) for d in global_shape)
        self.pieces: tuple[Box | FlatRange, ...] = tuple(pieces)

    def check(self, name: str) -> None:
        """``InvalidArgumentError`` naming ``name`` unless every piece lies inside the tensor."""
        for piece in self.pieces:
            problem = _piece_problem(self.global_shape, piece)
            if problem is not None:
                raise InvalidArgumentError(f"{name!r}: {problem}")

    @classmethod
    def box(
        cls, tensor: torch.Tensor, global_shape: Sequence[int], offsets: Sequence[int]
    ) -> Shard:
        """One block at ``offsets``."""
        return cls(global_shape, [Box(tensor, tuple(int(o) for o in offsets))])

    @classmethod
    def flat(cls, tensor: torch.Tensor, global_shape: Sequence[int], start: int) -> Shard:
        """One flat range starting at element ``start``."""
        return cls(global_shape, [FlatRange(tensor, int(start))])

    def like(self, tensors: Sequence[torch.Tensor]) -> Shard:
        """The same layout holding ``tensors`` (one per piece, each shaped like it)."""
        if len(tensors) != len(self.pieces):
            raise InvalidArgumentError(
                f"Shard.like: {len(tensors)} tensors for {len(self.pieces)} pieces"
            )
        pieces: list[Box | FlatRange] = [
            Box(t, p.offsets) if isinstance(p, Box) else FlatRange(t, p.start)
            for t, p in zip(tensors, self.pieces, strict=True)
        ]
        return Shard(self.global_shape, pieces)

    @property
    def numel(self) -> int:
        """Elements held here, over all pieces."""
        return sum(p.tensor.numel() for p in self.pieces)

    def __repr__(self) -> str:
        parts = ", ".join(
            f"box{list(p.offsets)}+{list(p.tensor.shape)}"
            if isinstance(p, Box)
            else f"flat[{p.start}:{p.start + p.tensor.numel()}]"
            for p in self.pieces
        )
        return f"Shard(shape={list(self.global_shape)}, pieces=[{parts}])"


@dataclass(frozen=True)
class Local:
    """A tensor that differs per rank by design; saved per rank, dropped on a layout change."""

    tensor: torch.Tensor


def _piece_problem(shape: tuple[int, ...], piece: Box | FlatRange) -> str | None:
    t = piece.tensor
    if isinstance(piece, FlatRange):
        total = math.prod(shape)
        if piece.start < 0 or piece.start + t.numel() > total:
            return (
                f"a flat range of {t.numel()} elements at {piece.start} does not lie inside a "
                f"tensor of shape {list(shape)} ({total} elements)"
            )
        return None
    offs, sizes = piece.offsets, tuple(t.shape)
    if not (len(shape) == len(offs) == len(sizes)) or any(
        o < 0 or o + n > d for o, n, d in zip(offs, sizes, shape, strict=True)
    ):
        return (
            f"a block of shape {list(sizes)} at offsets {list(offs)} does not lie inside a "
            f"tensor of shape {list(shape)}"
        )
    return None


def groups_by_name(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[dict[str, Any]]:
    """The optimizer's param groups with parameter names (``names[id(p)]``) for parameters."""
    groups = []
    for g in optimizer.param_groups:
        entry = {k: v for k, v in g.items() if k != "params"}
        entry["params"] = [names[id(p)] for p in g["params"] if id(p) in names]
        groups.append(entry)
    return groups


def tensors_of(value: torch.Tensor | Shard | Local) -> Iterator[torch.Tensor]:
    """The tensors a state value holds on this rank."""
    if isinstance(value, Shard):
        yield from (p.tensor for p in value.pieces)
    elif isinstance(value, Local):
        yield value.tensor
    else:
        yield value


# -- the four methods, with the defaults of a plain module -----------------------------------------


def sharded_state_dict(model: nn.Module) -> dict[str, Any]:
    """``model.sharded_state_dict()``, or a plain module's state (``_composed``)."""
    own: Any = getattr(model, "sharded_state_dict", None)
    if callable(own):
        return dict(own())
    return composed_state_dict(model)


def composed_state_dict(model: nn.Module) -> dict[str, Any]:
    """A plain module's state: its tensors replicated, or a submodule's own values.

    Where a submodule has its own ``sharded_state_dict()`` (a tensor-parallel layer), its
    values stand under its name. Read from the modules' tensors directly: ``state_dict()`` of
    such a submodule may be a collective (full tensors gathered), which this must not start.
    """
    contracted: dict[str, nn.Module] = {}  # the outermost submodules with their own
    for name, m in model.named_modules(remove_duplicate=False):
        inside = any(name.startswith(f"{p}.") for p in contracted)
        if name and not inside and callable(getattr(m, "sharded_state_dict", None)):
            contracted[name] = m
    if not contracted:
        return dict(model.state_dict(keep_vars=True))
    out: dict[str, Any] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        pre = f"{name}." if name else ""
        if name in contracted:
            out.update({pre + k: v for k, v in m.sharded_state_dict().items()})
            continue
        if any(name.startswith(f"{p}.") for p in contracted):
            continue
        out.update(_own_tensors(m, pre))
    return out


def _own_tensors(m: nn.Module, pre: str) -> dict[str, torch.Tensor]:
    """``m``'s own parameters and persistent buffers, under ``pre``."""
    out: dict[str, torch.Tensor] = {pre + k: p for k, p in m._parameters.items() if p is not None}
    out.update({
        pre + k: b for k, b in m._buffers.items()
        if b is not None and k not in m._non_persistent_buffers_set
    })  # fmt: skip
    return out


def named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors ``state_dict(keep_vars=True)`` holds, by name, read without calling it.

    (A tensor-parallel layer's ``state_dict()`` gathers full tensors: a collective.) A tensor
    under two names (tied weights) is listed under both.
    """
    out: dict[str, torch.Tensor] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        out.update(_own_tensors(m, f"{name}." if name else ""))
    return out


def _view_like(
    value: torch.Tensor, piece: torch.Tensor, param: torch.Tensor
) -> torch.Tensor | None:
    """The view of ``value`` (shaped like ``param``) where ``piece`` lies in ``param``."""
    if piece is param:
        return value
    if value.shape != param.shape or value.stride() != param.stride():
        return None
    if piece.untyped_storage().data_ptr() != param.untyped_storage().data_ptr():
        return None
    at = value.storage_offset() + piece.storage_offset() - param.storage_offset()
    return value.as_strided(piece.shape, piece.stride(), at)


def load_sharded_state_dict(model: nn.Module, sd: Mapping[str, Any]) -> None:
    """``model.load_sharded_state_dict(sd)``, or copies ``sd``'s values into the model's own.

    The default takes a dict shaped like ``sharded_state_dict(model)``; values that are the
    model's own tensors (filled in place) are left as they are.
    """
    own: Any = getattr(model, "load_sharded_state_dict", None)
    if callable(own):
        own(sd)
        return
    mine = sharded_state_dict(model)
    with torch.no_grad():
        for name, value in sd.items():
            if name not in mine:
                raise InvalidArgumentError(f"load_sharded_state_dict: the model has no {name!r}")
            for dst, src in zip(tensors_of(mine[name]), tensors_of(value), strict=True):
                if dst is not src:
                    dst.copy_(src)


def param_layouts(model: nn.Module) -> dict[str, Any]:
    """Parameter name -> its value in ``sharded_state_dict(model)`` (tensor or ``Shard``)."""
    sd = sharded_state_dict(model)
    return {n: sd[n] for n, _ in model.named_parameters() if n in sd}


def sharded_optim_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``model.sharded_optim_state_dict(opt)``, or a plain module's optimizer state by name.

    The default lays out each state tensor that has its parameter's local shape like the
    parameter (a block-sharded weight's Adam moments are the same block); other tensors
    (``step``) are replicated; other values are kept as they are.
    """
    own: Any = getattr(model, "sharded_optim_state_dict", None)
    if callable(own):
        return dict(own(optimizer))
    params = dict(model.named_parameters())
    names = {id(p): n for n, p in params.items()}
    layouts = param_layouts(model)
    state: dict[str, dict[str, Any]] = {}
    for p, entries in optimizer.state.items():
        if id(p) not in names:
            raise InvalidArgumentError(
                "the optimizer holds state for a tensor that is not a parameter of the model"
            )
        name = names[id(p)]
        where = layouts.get(name)
        out: dict[str, Any] = {}
        for k, v in entries.items():
            laid = state_like(where, v, params[name]) if torch.is_tensor(v) else None
            out[k] = v if laid is None else laid
        state[name] = out
    return {"state": state, "param_groups": groups_by_name(optimizer, names)}


def state_like(where: Any, value: torch.Tensor, param: torch.Tensor) -> Shard | None:
    """An optimizer state tensor laid out as its parameter's ``Shard`` ``where``, if it can be.

    ``None`` when ``where`` is not a ``Shard`` or ``value`` is not shaped like the parameter
    (``step``). Several pieces, each a view of the parameter (a fused weight's blocks): the
    same views of ``value``.
    """
    if not (isinstance(where, Shard) and value.dim() > 0):
        return None
    if len(where.pieces) == 1 and value.shape == where.pieces[0].tensor.shape:
        return where.like([value])
    views = [_view_like(value, piece.tensor, param) for piece in where.pieces]
    if where.pieces and all(x is not None for x in views):
        return where.like(views)  # type: ignore[arg-type]
    return None


def load_sharded_optim_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, sd: Mapping[str, Any]
) -> None:
    """``model.load_sharded_optim_state_dict(opt, sd)``, or a plain module's default.

    The default puts each parameter's state (``Shard`` values as their one piece) into
    ``optimizer.state`` and the hyperparameters of ``sd["param_groups"]`` into the optimizer's
    groups, in order.
    """
    own: Any = getattr(model, "load_sharded_optim_state_dict", None)
    if callable(own):
        own(optimizer, sd)
        return
    load_optim_by_name(model, optimizer, sd)


def load_optim_by_name(
    model: nn.Module, optimizer: torch.optim.Optimizer, sd: Mapping[str, Any]
) -> None:
    """The default ``load_sharded_optim_state_dict``: state by ``model.named_parameters()``.

    Each state ``Shard`` is laid out as its parameter's in ``sharded_state_dict(model)``.
    """
    params = dict(model.named_parameters())
    layouts = param_layouts(model)
    for name, entries in sd["state"].items():
        if name not in params:
            raise InvalidArgumentError(
                f"load_sharded_optim_state_dict: the model has no parameter {name!r}"
            )
        optimizer.state[params[name]] = {
            k: _assembled(v, layouts.get(name), params[name]) for k, v in entries.items()
        }
    apply_param_groups(optimizer, sd.get("param_groups", []))


def _assembled(value: Any, where: Any, param: torch.Tensor) -> Any:
    """Optimizer state as the optimizer keeps it.

    A one-piece ``Shard``'s tensor, or a tensor shaped like ``param`` filled from several
    pieces laid out as ``where``'s.
    """
    if not isinstance(value, Shard):
        return value
    if len(value.pieces) == 1:
        return value.pieces[0].tensor
    out = torch.empty_like(param, dtype=value.pieces[0].tensor.dtype)
    assert isinstance(where, Shard) and len(where.pieces) == len(value.pieces)
    for mine, got in zip(where.pieces, value.pieces, strict=True):
        view = _view_like(out, mine.tensor, param)
        assert view is not None, "a piece that is not a view of its parameter"
        view.copy_(got.tensor)
    return out


def apply_param_groups(
    optimizer: torch.optim.Optimizer, groups: Sequence[Mapping[str, Any]]
) -> None:
    """Sets each group's hyperparameters (all but ``params``) from ``groups``, in order."""
    for g, saved in zip(optimizer.param_groups, groups, strict=False):
        for k, v in saved.items():
            if k != "params":
                g[k] = tuple(v) if isinstance(g.get(k), tuple) else v


def layout(model: nn.Module | None) -> dict[str, Any]:
    """``model.layout()``: how the strategy lays its state out, for people to read."""
    own: Any = getattr(model, "layout", None)
    if callable(own):
        return dict(own())
    return {"strategy": "none" if model is None else "plain", "mesh": {}}


# -- elastic training: moving onto a new group -----------------------------------------------------


def strategies_inside(model: nn.Module) -> dict[str, nn.Module]:
    """The outermost modules of ``model`` (``""``: itself) that lay their own state out.

    Those that define ``sharded_state_dict`` (every strategy and tensor-parallel layer: they
    hold process groups), by name; a module inside another is not listed.
    """
    found: dict[str, nn.Module] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        inside = any(name.startswith(f"{p}.") or p == "" for p in found)
        if not inside and callable(getattr(m, "sharded_state_dict", None)):
            found[name] = m
    return found


def regroup(model: nn.Module, group: ProcessGroup) -> None:
    """Moves ``model`` onto ``group`` in place: ``model.regroup(group)``, or a plain module's.

    For elastic training, after ranks were lost or added: the old group is dead and nothing
    is communicated on it, nor on ``group``. The strategy keeps its wrapper and its local
    parameter objects (an optimizer over ``model.parameters()`` stays valid; ZeRO clears the
    state it holds for its shards, shaped for the old ones) and takes the layout a fresh
    wrapper on ``group`` has in a process that joins the running job; parameter values are
    then undefined until the caller restores model and optimizer state
    (``sl.checkpoint.load(..., group=group)``). DDP and ZeRO-1/2/3 can (see their
    ``regroup``); a plain module (replicated, no communication state) needs nothing, and one
    holding strategies that can, inside, has each of them moved.

    Raises:
        InvalidArgumentError: ``model`` is, or holds, a strategy that cannot move to a new
            group yet (a pipeline stage, a tensor-parallel layer), named in the message.
    """
    own: Any = getattr(model, "regroup", None)
    if callable(own):
        own(group)
        return
    inside = strategies_inside(model)
    # Check every one before moving any, so a refusal leaves the model as it was.
    for name, m in inside.items():
        if not callable(getattr(m, "regroup", None)):
            where = f" (at {name!r})" if name else ""
            raise InvalidArgumentError(
                f"elastic: {type(m).__name__}{where} cannot move to a new group yet; DDP and "
                "ZeRO-1/2/3 can"
            )
    moved: set[int] = set()
    for m in inside.values():
        if id(m) not in moved:  # a module under two names moves once
            moved.add(id(m))
            m.regroup(group)  # type: ignore[operator]
