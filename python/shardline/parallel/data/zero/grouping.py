"""Automatic grouping of a model's parameters into sharding units.

A *unit* is the set of parameters that ZeRO-3 all-gathers together (and that every ZeRO stage
reduces and shards as one flat buffer). Units are formed from the module tree and parameter
sizes, without user wrapping:

- the modules that own parameters are taken in execution order (the order recorded on the first
  step) or, before anything ran, in registration order;
- consecutive small modules are merged until a unit reaches ``threshold`` bytes (default
  1 MiB); a module at or above the threshold is never merged with another large one (small
  modules that ran just before it, fewer than ``threshold`` bytes, join its unit rather than
  forming a tiny unit of their own: one collective fewer for each LayerNorm);
- *blocks* (the modules that recompute their activations in backward,
  ``parallel.recompute.recompute_blocks``) are each one unit, whatever their size: their
  backward recomputes a norm's or an activation's output, which needs that module's
  parameters, right before the consumer's gradient; in a unit of their own those would be
  gathered (and waited for) one unit early, and on a 1B GPT in fp32 on 4 H200s the waits cost
  18 ms a step where one unit per block cost 9
  (``benches/results/zero-cuda-4xh200-xl-fp32-sel2.txt``, ``-sel3.txt``);
- a unit never mixes dtypes (a flat buffer has one dtype);
- a unit never mixes *whole* modules (whose parameters an optimizer needs whole: see
  ``optimizers``) with others; each whole unit is given to one rank, largest first to the
  least loaded rank.

A parameter shared by several modules (tied embeddings) belongs to the unit of the first module
that owns it; the other modules *use* that unit too, and the sharded wrapper gathers it for
them. The result is deterministic for a given model and order, so every rank computes the same
units without talking.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from shardline.errors import InvalidArgumentError
from shardline.parallel.recompute.blocks import find_blocks, recomputing_blocks

__all__ = [
    "CUDA_UNIT_MB",
    "DEFAULT_UNIT_MB",
    "UnitPlan",
    "UnitSpec",
    "default_unit_mb",
    "plan_units",
]

DEFAULT_UNIT_MB = 1.0
# On GPUs every unit costs a fixed few tens of microseconds (collective launch, hooks, stream
# waits) against hundreds of GB/s, so small units waste the links: 1 MiB units ran a few percent
# behind FSDP2 where 32 MiB units kept pace, at the same peak memory.
CUDA_UNIT_MB = 32.0


# A small model on a GPU still gets this many units at least: with 32 MiB units a 76 MiB model
# was three units, and holding two of them gathered peaked 7.6 % above FSDP2's per-block
# wrapping (tests/gpu/test_zero_cuda.py).
MIN_CUDA_UNITS = 8


def default_unit_mb(device: torch.device, model_bytes: int | None = None) -> float:
    """The unit threshold used when none is given.

    1 MiB on CPU; on CUDA 32 MiB, or less for a model under 256 MiB, so that it still has
    about ``MIN_CUDA_UNITS`` units (and never less than 1 MiB).
    """
    if device.type != "cuda":
        return DEFAULT_UNIT_MB
    if model_bytes is None:
        return CUDA_UNIT_MB
    return max(DEFAULT_UNIT_MB, min(CUDA_UNIT_MB, model_bytes / MIN_CUDA_UNITS / 2**20))


def default_units(device: torch.device, offload: str | None = None) -> str:
    """The unit rule when none is given: ``"blocks"`` on CUDA without offload, else ``"size"``.

    On CUDA one unit per repeated block (when blocks hold at least the unit threshold) ran
    faster than 32 MiB units where the step is short: 1.10-1.18x on a 395M GPT in bf16 on 2
    H200s, 1.03x on a 1B one, level in fp32, at the same peak to 0.7 %
    (``benches/results/zero-cuda-2xh200-*-blocks``): fewer, larger gathers and reductions,
    and fewer hooks. With offload, memory is the point and smaller units peak lower: on a 3B
    GPT 10.9 GB with 32 MiB units against 11.9 GB with blocks (FSDP2: 11.3 GB). On CPU small
    units let the engine's reductions overlap backward sooner.
    """
    return "blocks" if device.type == "cuda" and offload is None else "size"


UNIT_RULES = ("size", "blocks")


def check_units(units: str | None, who: str) -> None:
    """Raises InvalidArgumentError, naming ``who``, unless ``units`` is None or a unit rule."""
    if units is not None and units not in UNIT_RULES:
        raise InvalidArgumentError(f"{who}: units must be 'size' or 'blocks', not {units!r}")


def unit_blocks(
    model: nn.Module, units: str = "size", policy: str | None = None, min_bytes: int = 0
) -> list[str]:
    """Qualified names of the blocks that are one unit each under the unit rule ``units``.

    The recomputing ones (``recomputing_blocks``, with ``policy``); with ``units="blocks"``
    and none of those, the model's repeated blocks (``find_blocks``) when each holds at least
    ``min_bytes`` of parameters (smaller ones are merged by size, as other modules are).
    """
    blocks = recomputing_blocks(model, policy)
    if units == "blocks" and not blocks:
        found = find_blocks(model)
        if found and all(sum(p.nbytes for p in m.parameters()) >= min_bytes for _, m in found):
            blocks = [n for n, _ in found]
    return blocks


@dataclass(frozen=True)
class UnitSpec:
    """One unit: its modules, its parameters (fully qualified names) and its size."""

    index: int
    modules: tuple[str, ...]
    params: tuple[str, ...]
    numel: int
    dtype: torch.dtype
    owner: int | None = None  # the rank holding a whole unit; None: split across all

    @property
    def nbytes(self) -> int:
        """Bytes of the unit's parameters (unpadded)."""
        return self.numel * torch.empty(0, dtype=self.dtype).element_size()


@dataclass(frozen=True)
class UnitPlan:
    """All units of a model, with the numbers ``model.plan()`` prints."""

    units: tuple[UnitSpec, ...]
    layers: int
    threshold: int
    blocks: tuple[str, ...] = ()  # modules that are one unit each (``plan_units``)

    def all_gathers_per_step(self, stage: int) -> int:
        """Parameter all-gathers per training step: stage 3 gathers for forward and backward."""
        return 2 * len(self.units) if stage == 3 else len(self.units)

    def summary(self, stage: int = 3) -> str:
        """One line, e.g. ``312 layers -> 24 units, 48 all-gathers per step``."""
        return (
            f"{self.layers} layers -> {len(self.units)} units, "
            f"{self.all_gathers_per_step(stage)} all-gathers per step"
        )

    def table(self, stage: int = 3) -> str:
        """The summary line followed by one row per unit."""
        rows = [self.summary(stage)]
        for u in self.units:
            first, last = u.modules[0] or "<root>", u.modules[-1] or "<root>"
            span = first if len(u.modules) == 1 else f"{first} .. {last} ({len(u.modules)})"
            whole = "" if u.owner is None else f"  whole on rank {u.owner}"
            rows.append(
                f"  unit {u.index:>3}: {u.nbytes / 2**20:8.2f} MiB  "
                f"{len(u.params):>3} params  {span}{whole}"
            )
        return "\n".join(rows)


def owned_parameters(module: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """``{module name: [(parameter name, parameter)]}`` for parameters each module owns.

    A parameter is owned by the first module (in ``named_modules`` order) that holds it; the
    names are fully qualified (``blocks.0.attn.weight``).
    """
    seen: set[int] = set()
    owned: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for mname, mod in module.named_modules(remove_duplicate=True):
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            owned.setdefault(mname, []).append((f"{mname}.{pname}" if mname else pname, p))
    return owned


def plan_units(
    module: nn.Module,
    threshold_bytes: int | None = None,
    order: Sequence[str] | None = None,
    dtypes: Mapping[str, torch.dtype] | None = None,
    whole: Collection[str] = (),
    world_size: int = 1,
    blocks: Sequence[str] = (),
) -> UnitPlan:
    """Groups ``module``'s parameters into units (see the module docstring).

    Args:
        module: The plain model.
        threshold_bytes: Merge small modules until a unit holds this many bytes;
            ``DEFAULT_UNIT_MB`` MiB when ``None``. ``0`` puts every module in its own unit.
        order: Names of modules in the order they ran; modules missing from it follow in
            registration order.
        dtypes: The dtype of each parameter (by name) when it differs from the tensor's now
            (a sharded model whose parameters are views in a compute dtype).
        whole: Names of parameters to keep whole; their modules form whole units.
        world_size: Ranks to give whole units to.
        blocks: Names of modules each of which (with everything under it) is one unit.

    Raises:
        InvalidArgumentError: a module owns parameters of two dtypes, or the model has no
            parameters.
    """
    threshold = int(DEFAULT_UNIT_MB * 2**20) if threshold_bytes is None else threshold_bytes
    block_of = {
        f"{b}.{sub}" if sub else b: b
        for b in blocks
        for sub, _ in module.get_submodule(b).named_modules(remove_duplicate=False)
    }
    owned = owned_parameters(module)
    if not owned:
        raise InvalidArgumentError("the model has no parameters to shard")
    names = list(owned)
    if order is not None:
        ran = [m for m in dict.fromkeys(order) if m in owned]
        names = ran + [m for m in names if m not in set(ran)]
    units: list[UnitSpec] = []
    cur_mods: list[str] = []
    cur_params: list[str] = []
    cur_numel = 0
    cur_dtype: torch.dtype | None = None
    cur_whole = False
    cur_block: str | None = None
    kept_whole = frozenset(whole)
    whole_units: list[int] = []

    def close() -> None:
        nonlocal cur_mods, cur_params, cur_numel, cur_dtype
        if cur_mods and cur_dtype is not None:
            if cur_whole:
                whole_units.append(len(units))
            units.append(
                UnitSpec(len(units), tuple(cur_mods), tuple(cur_params), cur_numel, cur_dtype)
            )
        cur_mods, cur_params, cur_numel, cur_dtype = [], [], 0, None

    for mname in names:
        params = owned[mname]

        def dtype_of(name: str, p: nn.Parameter) -> torch.dtype:
            return dtypes[name] if dtypes is not None and name in dtypes else p.dtype

        kinds = {dtype_of(n, p) for n, p in params}
        if len(kinds) > 1:
            listed = ", ".join(f"{n} ({dtype_of(n, p)})" for n, p in params)
            raise InvalidArgumentError(
                f"module {mname or '<root>'!r} owns parameters of several dtypes ({listed}); "
                "cast the model to one dtype and set compute precision with MixedPrecision"
            )
        dtype = kinds.pop()
        numel = sum(p.numel() for _, p in params)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        nbytes = numel * itemsize
        is_whole = any(n in kept_whole for n, _ in params)
        block = block_of.get(mname)
        if cur_dtype is not None and (
            dtype != cur_dtype or is_whole != cur_whole or block != cur_block
        ):
            close()
        cur_whole, cur_block = is_whole, block
        if block is not None:  # a block: one unit, closed where the next module is not in it
            cur_mods.append(mname)
            cur_params += [n for n, _ in params]
            cur_numel += numel
            cur_dtype = dtype
            continue
        if nbytes >= threshold:  # large: its own unit, with the small modules just before it
            cur_mods.append(mname)
            cur_params += [n for n, _ in params]
            cur_numel += numel
            cur_dtype = dtype
            close()
            continue
        cur_mods.append(mname)
        cur_params += [n for n, _ in params]
        cur_numel += numel
        cur_dtype = dtype
        if cur_numel * itemsize >= threshold:
            close()
    close()
    load = [0] * max(1, world_size)
    for i in sorted(whole_units, key=lambda i: (-units[i].nbytes, i)):
        owner = min(range(len(load)), key=lambda r: (load[r], r))
        load[owner] += units[i].nbytes
        spec = units[i]
        units[i] = UnitSpec(spec.index, spec.modules, spec.params, spec.numel, spec.dtype, owner)
    return UnitPlan(tuple(units), layers=len(names), threshold=threshold, blocks=tuple(blocks))
