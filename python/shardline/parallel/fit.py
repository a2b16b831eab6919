"""Which strategy fits: the memory a rank can use, and the least sharded strategy within it.

``choose_strategy`` tries the strategies from least to most sharded (``strategies.BY_MEMORY``)
with the estimates of ``planner`` and returns the first whose total fits ``headroom`` of what
``available_memory`` measures; ``as_distributed`` uses it.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from shardline import config
from shardline.errors import InvalidArgumentError
from shardline.parallel import strategies
from shardline.parallel.data.zero.grouping import default_units
from shardline.parallel.planner import (
    MemoryEstimate,
    _activations_or_note,
    _check_world_size,
    _effective_precision,
    _estimate,
    format_bytes,
    optimizer_states,
)
from shardline.parallel.precision import MixedPrecision

__all__ = ["available_memory", "choose_strategy"]

_MEMINFO = "/proc/meminfo"


def available_memory(device: torch.device | str | int = "cpu") -> int:
    """Free bytes one rank can use on ``device``.

    CUDA: the free memory ``torch.cuda.mem_get_info`` reports. CPU: ``MemAvailable`` from
    ``/proc/meminfo`` (or ``os.sysconf`` where ``/proc`` is missing) divided by the ranks on
    this host (``LOCAL_WORLD_SIZE``, default 1).

    Raises:
        InvalidArgumentError: a device that is neither CPU nor an available CUDA device, or a
            malformed ``LOCAL_WORLD_SIZE``.
    """
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidArgumentError(f"available_memory({device!r}): CUDA is not available")
        return int(torch.cuda.mem_get_info(dev)[0])
    if dev.type != "cpu":
        raise InvalidArgumentError(
            f"available_memory() knows cpu and cuda devices, not {dev.type!r}"
        )
    raw = config.env_var("LOCAL_WORLD_SIZE", default="1")
    try:
        local = int(raw)
    except ValueError:
        raise InvalidArgumentError(f"LOCAL_WORLD_SIZE={raw!r} is not an integer") from None
    return _host_available() // max(local, 1)


def _host_available() -> int:
    """``MemAvailable`` of this host in bytes."""
    try:
        with open(_MEMINFO, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    value, *unit = line.split()[1:]
                    return int(value) * (1024 if unit and unit[0].lower() == "kb" else 1)
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _default_device(model: nn.Module) -> torch.device:
    """The device a model trains on: its own if CUDA, else CUDA when present, else CPU."""
    first = next(model.parameters(), None)
    if first is not None and first.device.type == "cuda":
        return first.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def choose_strategy(
    model: nn.Module,
    *,
    world_size: int,
    available_bytes: int | None = None,
    optimizer: str | torch.optim.Optimizer | None = "adamw",
    mixed_precision: MixedPrecision | None = None,
    example_input: Any = None,
    headroom: float = 0.7,
    unit_mb: float | None = None,
    prefetch: int = 1,
    device: torch.device | str | int | None = None,
) -> tuple[str, str, MemoryEstimate]:
    """The least sharded strategy whose estimate fits ``headroom`` of the available memory.

    Tries ``ddp``, then ``zero1``, ``zero2`` and ``zero3``; on CUDA then zero3 with
    ``offload="optimizer"`` and ``"cpu"`` (the estimate's ``offload`` says which), whose host
    part must fit ``headroom`` of the host memory too; when none fits, returns ``zero3`` with
    a reason that says by how much it is short.

    Args:
        model: The plain model.
        world_size: Ranks (N).
        available_bytes: Bytes one rank may use; ``available_memory(device)`` when ``None``.
        optimizer: As for ``estimate_memory``.
        mixed_precision: As for ``estimate_memory`` (ddp is estimated without it).
        example_input: As for ``estimate_memory``; activations count towards the total.
        headroom: Fraction of ``available_bytes`` a strategy may use, in (0, 1].
        unit_mb: As for ``estimate_memory``.
        prefetch: As for ``estimate_memory``.
        device: Where ``available_memory`` looks; the model's CUDA device, else the current
            CUDA device, else the CPU.

    Returns:
        ``(strategy, reason, estimate)``, the reason reading like
        ``"ddp: 1.2 GiB per rank of 12.0 GiB available (70% headroom)"``.

    Raises:
        InvalidArgumentError: as ``estimate_memory``, or ``headroom`` outside (0, 1] or a
            negative ``available_bytes``.
    """
    _check_world_size(world_size)
    if not 0 < headroom <= 1:
        raise InvalidArgumentError(f"headroom must be in (0, 1], got {headroom}")
    if available_bytes is None:
        available_bytes = available_memory(device if device is not None else _default_device(model))
    if available_bytes < 0:
        raise InvalidArgumentError(f"available_bytes must not be negative, got {available_bytes}")
    if prefetch < 0 or (unit_mb is not None and unit_mb < 0):
        raise InvalidArgumentError(
            f"prefetch ({prefetch}) and unit_mb ({unit_mb}) must not be negative"
        )
    k = optimizer_states(optimizer)
    budget = headroom * available_bytes
    on = torch.device(device) if device is not None else _default_device(model)
    # The units ZeRO will make there (the model may not be there yet).
    rule, offload_rule = default_units(on), default_units(on, "optimizer")
    cache: dict[torch.dtype | None, tuple[int, bool, list[str]]] = {}
    rejected: list[str] = []
    estimate: MemoryEstimate | None = None
    for name in strategies.BY_MEMORY:
        notes: list[str] = []
        mp = _effective_precision(name, mixed_precision, notes)
        key = mp.param_dtype if mp is not None else None
        if key not in cache:  # one meta forward per compute dtype
            act_notes: list[str] = []
            act, measured = _activations_or_note(model, example_input, mp, act_notes)
            cache[key] = (act, measured, act_notes)
        act, measured, act_notes = cache[key]
        estimate = _estimate(
            model, name, world_size, k, mp, unit_mb, prefetch, act, measured, notes + act_notes,
            unit_rule=rule,
        )  # fmt: skip
        if estimate.total <= budget:
            reason = (
                f"{name}: {format_bytes(estimate.total)} per rank of "
                f"{format_bytes(available_bytes)} available ({headroom:.0%} headroom)"
            )
            if rejected:
                reason += "; " + ", ".join(rejected) + " would not fit"
            return name, reason, estimate
        rejected.append(f"{name} ({format_bytes(estimate.total)})")
    assert estimate is not None
    if on.type == "cuda":  # the host can hold what the device cannot: offload
        host_budget = headroom * available_memory("cpu")
        for offload in ("optimizer", "cpu"):
            notes = []
            mp = _effective_precision("zero3", mixed_precision, notes)
            act, measured, act_notes = cache[mp.param_dtype if mp is not None else None]
            offloaded = _estimate(
                model, "zero3", world_size, k, mp, unit_mb, prefetch, act, measured,
                notes + act_notes, offload, unit_rule=offload_rule,
            )  # fmt: skip
            if offloaded.total <= budget and offloaded.host <= host_budget:
                reason = (
                    f"zero3 with offload={offload}: {format_bytes(offloaded.total)} per rank "
                    f"of {format_bytes(available_bytes)} available, "
                    f"{format_bytes(offloaded.host)} of host memory; "
                    + ", ".join(rejected) + " would not fit"
                )  # fmt: skip
                return "zero3", reason, offloaded
    short = estimate.total - budget
    reason = (
        f"zero3 may not fit: {format_bytes(estimate.total)} per rank of "
        f"{format_bytes(available_bytes)} available ({headroom:.0%} headroom allows "
        f"{format_bytes(budget)}), short by {format_bytes(short)}; add ranks, use mixed "
        "precision, a smaller batch or activation checkpointing"
    )
    return "zero3", reason, estimate
