"""ZeRO's state dicts: full tensors (collective) and this rank's shards (the strategy contract).

``state_dict()`` / ``load_state_dict()`` keep PyTorch's meaning: full tensors of the whole plain
model, under its names (gathering them is a collective). ``optim_state_dict()`` /
``load_optim_state_dict()`` do the same for the optimizer. The four methods of the strategy
contract (``shardline.parallel.contract``) describe and restore this rank's shards without
communication: a parameter is a one-range ``Shard`` of its flattened tensor, and its
elementwise optimizer state has the same range.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from shardline.comm.objects import broadcast_object
from shardline.errors import InvalidArgumentError
from shardline.parallel.contract import (
    Box,
    Shard,
    apply_param_groups,
    groups_by_name,
    named_tensors,
)
from shardline.parallel.data.compressed import split_state, state_entries
from shardline.parallel.data.zero.base import ZeroBase
from shardline.parallel.data.zero.layout import UnitLayout
from shardline.parallel.data.zero.units import ParamState, Unit
from shardline.parallel.placement import Placement, place

__all__ = ["StateDicts"]


class StateDicts:
    """Full and sharded state dicts of a wrapper's units (see the module docstring).

    A part of ``ShardedDataParallel``, which delegates to it: it reads the wrapper's units
    (the fields of ``base.ZeroBase``) through a weak reference, so the wrapper is freed as
    before, and gathers master values through their ``UnitLayout``.
    """

    def __init__(self, wrapper: ZeroBase, layout: UnitLayout) -> None:
        self._wrapper = weakref.ref(wrapper)
        self._layout = layout  # the wrapper's: master values gathered

    @property
    def _w(self) -> ZeroBase:
        """The wrapper whose units these state dicts describe."""
        w = self._wrapper()
        assert w is not None, "the ShardedDataParallel of these state dicts was freed"
        return w

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """Full tensors under the plain model's names (collective: call it on every rank)."""
        w = self._w
        full: dict[nn.Parameter, torch.Tensor] = {}
        for u in w._units:
            values = self._layout._gather_master(u)
            for p, name, o in zip(u.params, u.names, u.offsets, strict=True):
                full[p] = values[o : o + p.numel()].view(p.shape).to(w._dtypes[name])
        # The module's own state_dict() over the gathered values: a tensor-parallel layer in it
        # then gathers its slices into the global tensors, as it does unwrapped.
        shown = {p: p.data for p in full}
        try:
            for p, value in full.items():
                p.data = value
            out = w.module.state_dict(*args, **kwargs)
            # keep_vars=True would hand out the parameters, whose data is put back below.
            return type(out)(
                (k, v.detach() if isinstance(v, nn.Parameter) else v) for k, v in out.items()
            )
        finally:
            for p, data in shown.items():
                p.data = data

    @torch.no_grad()
    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Loads full tensors (as from the plain model's ``state_dict``) into the shards."""
        w = self._w
        expected = named_tensors(w.module)
        names = {id(p): n for u in w._units for p, n in zip(u.params, u.names, strict=True)}
        shapes = {
            k: self._global_shape(names[id(v)], v) if id(v) in names else tuple(v.shape)
            for k, v in expected.items()
        }
        missing = [k for k in expected if k not in state_dict]
        unexpected = [k for k in state_dict if k not in expected]
        bad = [
            f"{k}: checkpoint {tuple(state_dict[k].shape)} vs model {shapes[k]}"
            for k in expected
            if k in state_dict and tuple(state_dict[k].shape) != shapes[k]
        ]
        if bad or (strict and (missing or unexpected)):
            raise InvalidArgumentError(
                "load_state_dict: "
                + "; ".join(
                    part
                    for part in (
                        f"missing keys {missing}" if missing else "",
                        f"unexpected keys {unexpected}" if unexpected else "",
                        f"shape mismatches {bad}" if bad else "",
                    )
                    if part
                )
            )
        for key, value in expected.items():
            if key not in state_dict:
                continue
            src = state_dict[key]
            u = w._unit_of.get(id(value))
            if u is None:
                value.copy_(src)
                continue
            i = next(j for j, p in enumerate(u.params) if p is value)
            name, (a, _b) = u.names[i], u.local_ranges[i]
            _fill(self._placed(name, u.locals[i].data, a, value), src.detach().to(u.wdtype))
            if u.param_state is ParamState.GATHERED and w.stage < 3:
                o = u.offsets[i]
                mine = self._placed(name, u.full[o : o + value.numel()], 0, value)
                _fill(mine, src.detach().to(u.cdtype))
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    # -- the strategy contract -------------------------------------------------------------------

    def layout(self) -> dict[str, Any]:
        """How this wrapper lays state out (recorded in checkpoints, for people to read)."""
        w = self._w
        mp = w.mixed_precision
        sharded = ["optimizer_state", "gradients", "parameters"][: w.stage]
        return {
            "strategy": f"zero{w.stage}",
            "mesh": {"dp": w.group.world_size},
            "sharded": sharded,
            "whole_parameters": len(w._whole),
            "precision": {
                "param_dtype": str(mp.param_dtype) if mp.param_dtype else None,
                "reduce_dtype": str(mp.reduce_dtype) if mp.reduce_dtype else None,
                "master_weights": mp.master_weights,
            },
        }

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shards (one-range ``Shard``s) and buffers, under the plain model's names.

        A parameter of a whole unit is one range covering all of it on its owner and a
        ``Shard`` without pieces elsewhere. A parameter tied to another (one tensor under two
        names) gives the same object for both.
        """
        w = self._w
        out: dict[str, Any] = {}
        shards: dict[int, Shard] = {}
        for u in w._units:
            for p, name, loc, (a, _b) in zip(
                u.params, u.names, u.locals, u.local_ranges, strict=True
            ):
                if u.owner is not None and u.owner != u.rank:
                    shards[id(p)] = Shard(self._global_shape(name, p), [])
                else:
                    shards[id(p)] = self._placed(name, loc.detach(), a, p)
        for key, value in named_tensors(w.module).items():
            out[key] = shards.get(id(value), value)
        buffers = [
            (u.index, u.entries(), u.padded) for u in w._units if u.owner is None and u.trainable
        ]
        out.update(state_entries(w._compression, buffers, w._device))
        return out

    def _global_shape(self, name: str, p: torch.Tensor) -> tuple[int, ...]:
        w = self._w
        placement: Placement | None = w._placements.get(name)
        return placement.global_shape if placement is not None else tuple(p.shape)

    def _placed(self, name: str, local: torch.Tensor, start: int, p: torch.Tensor) -> Shard:
        """Elements ``start ..`` of parameter ``p`` (``local``) as a ``Shard`` of its tensor.

        Of the plain model's tensor; where ``p`` is itself a slice (a tensor-parallel weight),
        of the global one, through its placement (``parallel.placement``).
        """
        w = self._w
        return place(w._placements.get(name), local, start, p.shape)

    @torch.no_grad()
    def load_sharded_state_dict(self, sd: dict[str, Any]) -> None:
        """Takes ``sharded_state_dict()``'s shape back; parameters are re-gathered before use.

        Values that are this wrapper's own tensors (a checkpoint filled them in place) are not
        copied.
        """
        w = self._w
        sd = split_state(sd, w._compression)
        mine = self.sharded_state_dict()
        unknown = sorted(set(sd) - set(mine))
        if unknown:
            raise InvalidArgumentError(f"load_sharded_state_dict: the model has no {unknown}")
        for name, value in sd.items():
            dst, src = mine[name], value
            if isinstance(dst, Shard):
                if not isinstance(src, Shard) or len(src.pieces) != len(dst.pieces):
                    raise InvalidArgumentError(
                        f"load_sharded_state_dict: {name!r} must be laid out as "
                        "sharded_state_dict() gives it"
                    )
                pairs = [(d.tensor, s.tensor) for d, s in zip(dst.pieces, src.pieces, strict=True)]
            else:
                pairs = [(dst, src)]
            for d, s in pairs:
                if d.data_ptr() != s.data_ptr() or d.shape != s.shape:
                    d.copy_(s)
        self.refresh()

    def sharded_optim_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's optimizer state by parameter name, without communication.

        Elementwise state (Adam's moments) comes as a ``Shard`` laid out as the parameter's
        shard; other values (``step``) as they are. State of a whole unit's
        parameters is only on its owner, so its other tensors (Adafactor's row and column
        moments, ``step``) are ``Shard``s held by that rank alone. ``param_groups`` list
        parameter names instead of indices.
        """
        w = self._w
        state: dict[str, dict[str, Any]] = {}
        names: dict[int, str] = {}
        for u in w._units:
            for p, name, loc, (a, _b) in zip(
                u.params, u.names, u.locals, u.local_ranges, strict=True
            ):
                names[id(loc)] = name
                entries = optimizer.state.get(loc)
                if not entries:
                    continue
                whole = u.owner is not None
                out: dict[str, Any] = {}
                for k, v in entries.items():
                    if not torch.is_tensor(v):
                        out[k] = v
                    elif v.shape == loc.shape and v.dim() == (p.dim() if whole else 1):
                        out[k] = self._placed(name, v.detach(), a, p)
                    elif whole:
                        out[k] = Shard.flat(v.detach(), v.shape, 0)
                    else:
                        out[k] = v
                state[name] = out
        return {"state": state, "param_groups": groups_by_name(optimizer, names)}

    def load_sharded_optim_state_dict(
        self, optimizer: torch.optim.Optimizer, sd: dict[str, Any]
    ) -> None:
        """Takes ``sharded_optim_state_dict()``'s shape back into ``optimizer`` (this rank's).

        The unit layout is fixed from here on (no re-forming after the first backward).
        """
        w = self._w
        w._trace = None
        local = {name: loc for u in w._units for name, loc in zip(u.names, u.locals, strict=True)}
        unknown = sorted(set(sd["state"]) - set(local))
        if unknown:
            raise InvalidArgumentError(
                f"load_sharded_optim_state_dict: state for parameters the model lacks: {unknown}"
            )
        for name, entries in sd["state"].items():
            loc = local[name]
            optimizer.state[loc] = {
                k: self._unplaced(name, v, loc) if isinstance(v, Shard) else v
                for k, v in entries.items()
            }
        apply_param_groups(optimizer, sd.get("param_groups", []))

    def _unplaced(self, name: str, value: Shard, loc: torch.Tensor) -> torch.Tensor:
        """A state tensor shaped like ``loc`` from ``_placed``'s pieces."""
        if len(value.pieces) == 1:
            return value.pieces[0].tensor.view(loc.shape)
        u, i = self._where(name)
        out = torch.empty(loc.numel(), dtype=value.pieces[0].tensor.dtype, device=loc.device)
        mine = self._placed(name, out, u.local_ranges[i][0], u.params[i])
        for dst, src in zip(mine.pieces, value.pieces, strict=True):
            dst.tensor.copy_(src.tensor)
        return out.view(loc.shape)

    def _where(self, name: str) -> tuple[Unit, int]:
        w = self._w
        return next((u, i) for u in w._units for i, n in enumerate(u.names) if n == name)

    def refresh(self) -> None:
        """Re-gathers parameters from the shards before the next forward.

        Call it after writing into the local shards directly (a checkpoint loader does);
        ``load_state_dict`` and optimizer steps do it for you. Stage 3 always gathers.
        """
        w = self._w
        for u in w._units:
            u.dev_shard = None  # offload: the device copy is stale
        if w.stage < 3:
            w._needs_gather = True

    def optim_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state with full tensors, keyed by parameter name (collective)."""
        w = self._w
        local_name = {
            id(loc): name for u in w._units for name, loc in zip(u.names, u.locals, strict=True)
        }
        state: dict[str, dict[str, Any]] = {}
        for u in w._units:
            if u.owner is not None:
                state.update(self._owner_state(u, optimizer))
                continue
            keys = sorted(
                {
                    k
                    for loc in u.locals
                    for k, v in optimizer.state.get(loc, {}).items()
                    if torch.is_tensor(v) and v.shape == loc.shape and v.dim() == 1
                }
            )
            for k in keys:
                values = self._gather_state(u, optimizer, k)
                for p, name, o, loc in zip(u.params, u.names, u.offsets, u.locals, strict=True):
                    if loc in optimizer.state:
                        state.setdefault(name, {})[k] = values[o : o + p.numel()].view(p.shape)
            for name, loc in zip(u.names, u.locals, strict=True):
                for k, v in optimizer.state.get(loc, {}).items():
                    if k not in keys:
                        state.setdefault(name, {})[k] = v.clone() if torch.is_tensor(v) else v
        return {"state": state, "param_groups": groups_by_name(optimizer, local_name)}

    @torch.no_grad()
    def load_optim_state_dict(
        self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
    ) -> None:
        """Loads ``optim_state_dict()`` output (full tensors by name) into this rank's shards.

        The unit layout is fixed from here on (no re-forming after the first backward).
        """
        w = self._w
        w._trace = None
        by_name = {name: (u, i) for u in w._units for i, name in enumerate(u.names)}
        unknown = [n for n in state_dict["state"] if n not in by_name]
        if unknown:
            raise InvalidArgumentError(
                f"load_optim_state_dict: state for parameters the model does not have: {unknown}"
            )
        for name, entries in state_dict["state"].items():
            u, i = by_name[name]
            loc, (a, b) = u.locals[i], u.local_ranges[i]
            new: dict[str, Any] = {}
            if u.owner is not None and u.owner != u.rank:
                continue  # the owner steps it
            for k, v in entries.items():
                if torch.is_tensor(v) and v.shape == u.params[i].shape and v.dim() > 0:
                    part = v.reshape(-1)[a:b].to(device=loc.device, dtype=loc.dtype)
                    new[k] = part.clone().view(loc.shape)
                else:
                    new[k] = v.clone() if torch.is_tensor(v) else v
            optimizer.state[loc] = new
        for g, saved in zip(optimizer.param_groups, state_dict["param_groups"], strict=False):
            for k, v in saved.items():
                if k != "params":
                    g[k] = v

    def _owner_state(self, u: Unit, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
        """A whole unit's optimizer state, as its owner holds it, on every rank (collective)."""
        w = self._w
        assert u.owner is not None
        mine: dict[str, dict[str, Any]] | None = None
        if u.rank == u.owner:
            mine = {
                name: {
                    k: v.detach().cpu() if torch.is_tensor(v) else v
                    for k, v in optimizer.state.get(loc, {}).items()
                }
                for name, loc in zip(u.names, u.locals, strict=True)
                if optimizer.state.get(loc)
            }
        got: dict[str, dict[str, Any]] = broadcast_object(mine, src=u.owner, group=w.group)
        return {
            name: {
                k: v.to(w._device) if torch.is_tensor(v) and v.dim() else v
                for k, v in entries.items()
            }
            for name, entries in got.items()
        }

    def _gather_state(self, u: Unit, optimizer: torch.optim.Optimizer, key: str) -> torch.Tensor:
        w = self._w
        lo = u.lo
        flat: torch.Tensor | None = None
        for loc, o, (a, b) in zip(u.locals, u.offsets, u.local_ranges, strict=True):
            v = optimizer.state.get(loc, {}).get(key)
            if v is None or b <= a:
                continue
            if flat is None:
                flat = torch.zeros(u.shard_numel, dtype=v.dtype, device=w._device)
            flat[o + a - lo : o + b - lo].copy_(v)
        if flat is None:
            flat = torch.zeros(u.shard_numel, dtype=u.wdtype, device=w._device)
        out = torch.empty(u.padded, dtype=flat.dtype, device=w._device)
        w.group.all_gather(out, flat)
        return out


def _fill(dst: Shard, src: torch.Tensor) -> None:
    """Copies into ``dst``'s pieces their parts of the global tensor ``src``."""
    for piece in dst.pieces:
        if isinstance(piece, Box):
            region = tuple(
                slice(o, o + n) for o, n in zip(piece.offsets, piece.tensor.shape, strict=True)
            )
            piece.tensor.copy_(src[region])
        else:
            n = piece.tensor.numel()
            piece.tensor.view(-1).copy_(src.reshape(-1)[piece.start : piece.start + n])
