"""Pre-flight memory planning: bytes per rank for each strategy (``fit`` picks one that fits).

``estimate_memory`` reads only parameter metadata (numel, dtype) and the sharding units of
``grouping.plan_units``; it never allocates parameters. Optionally it runs one forward of the
model on the meta device to count the activations autograd saves for backward.

The per-rank layout matches the sharded wrapper (``_units.Unit``). With Ψ parameters (Ψ_t of
them trainable), N ranks, each unit ``u`` padded to a multiple of N (shard
``S_u = max(1, ceil(numel_u / N))``), model dtype size m, compute size c, master size w,
reduce size r and k optimizer states per parameter (stored in w):

==========  ========  =============================  ===================  =========
strategy    params    grads                          master               optimizer
==========  ========  =============================  ===================  =========
ddp         m·Ψ       m·Ψ_t                          0                    k·m·Ψ_t
zero1       c·ΣN·S_u  r·ΣN·S_u (+ w·ΣS_u if w != r)  w·ΣS_u if w != c     k·w·ΣS_u
zero2       c·ΣN·S_u  w·ΣS_u                         w·ΣS_u if w != c     k·w·ΣS_u
zero3/fsdp  w·ΣS_u    w·ΣS_u                         0 (the shard is it)  k·w·ΣS_u
==========  ========  =============================  ===================  =========

fp32 Adam without mixed precision gives the ZeRO paper's 16, 8 + 8/N, 4 + 12/N and 16/N bytes
per parameter. Transient communication buffers come on top (the largest units, an upper
bound): ZeRO-2 and ZeRO-3 hold full gradient flats in backward (the wrapper's
``_MAX_INFLIGHT`` reductions in flight plus the unit accumulating, each r·N·S), and ZeRO-3
``1 + prefetch`` gathered units in the compute dtype (plus their cast all-gather inputs when
c != w). ZeRO-1 and ZeRO-2 re-gather all units as the forward after a step begins, from
compute-dtype copies of the shards (c·ΣS_u, ``regather``); each copy is freed as its unit's
modules first run, so they peak at the forward's start, before the activations grow.

With ``offload`` the master shard, its gradient and the optimizer states, (2 + k)·w·ΣS_u, are
counted as ``host`` instead; the device keeps the full parameters (stages 1/2) and gradients
(stage 1) between steps, and for ``"optimizer"`` a compute-dtype copy of the shards from the
first all-gather to the step (c·ΣS_u, with the buffers of backward).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardline.errors import InvalidArgumentError
from shardline.parallel import strategies
from shardline.parallel.activations import count_activations, estimate_activations
from shardline.parallel.data.compressed import resolve_compression
from shardline.parallel.data.zero.grouping import (
    check_units,
    default_unit_mb,
    default_units,
    plan_units,
    unit_blocks,
)
from shardline.parallel.data.zero.schedule import _MAX_INFLIGHT
from shardline.parallel.memory_estimate import _COMPONENTS, MemoryEstimate, format_bytes
from shardline.parallel.precision import MixedPrecision
from shardline.parallel.recompute.blocks import check_policy

if TYPE_CHECKING:
    from shardline.compression.codec import Compressor

__all__ = [
    "OPTIMIZERS",
    "PLANNED_STRATEGIES",
    "MemoryEstimate",
    "estimate_activations",
    "estimate_memory",
    "format_bytes",
    "optimizer_states",
    "step_lists",
]

PLANNED_STRATEGIES = strategies.STRATEGIES
"""Strategies ``estimate_memory`` knows (``fsdp`` is laid out as ``zero3``)."""

OPTIMIZERS: dict[str, int] = {
    "adamw": 2,
    "adam": 2,
    "sgd": 0,
    "sgd-momentum": 1,
    "adagrad": 1,
    "rmsprop": 1,
    "none": 0,
}
"""Optimizer names and the states each keeps per parameter."""


def optimizer_states(optimizer: str | torch.optim.Optimizer | None) -> int:
    """States per parameter (k) for an optimizer name or instance.

    Instances are read from their class and hyperparameters (largest over param groups):
    ``SGD`` keeps a momentum buffer when ``momentum > 0``, ``Adam(amsgrad=True)`` three states,
    ``RMSprop`` one plus one for momentum and one when centered.

    Raises:
        InvalidArgumentError: an unknown name or optimizer class.
    """
    if optimizer is None:
        return 0
    if isinstance(optimizer, str):
        key = optimizer.lower()
        if key not in OPTIMIZERS:
            raise InvalidArgumentError(
                f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)} "
                "or pass a torch.optim.Optimizer"
            )
        return OPTIMIZERS[key]
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidArgumentError(
            f"optimizer must be a name ({', '.join(OPTIMIZERS)}) or a torch.optim.Optimizer, "
            f"not {type(optimizer).__name__}"
        )
    groups = optimizer.param_groups or [optimizer.defaults]
    return max(_states_of(optimizer, {**optimizer.defaults, **g}) for g in groups)


def _states_of(optimizer: torch.optim.Optimizer, hp: Mapping[str, Any]) -> int:
    """States per parameter of one param group with hyperparameters ``hp``."""
    optim = torch.optim
    rules: list[tuple[type[torch.optim.Optimizer], Callable[[Mapping[str, Any]], int]]] = [
        (optim.SGD, lambda h: int(h.get("momentum", 0) > 0)),
        (optim.Adam, lambda h: 3 if h.get("amsgrad") else 2),
        (optim.AdamW, lambda h: 3 if h.get("amsgrad") else 2),
        (optim.Adagrad, lambda h: 1),
        (
            optim.RMSprop,
            lambda h: 1 + int(h.get("momentum", 0) > 0) + int(bool(h.get("centered"))),
        ),
        (optim.Adamax, lambda h: 2),
        (optim.NAdam, lambda h: 2),
        (optim.RAdam, lambda h: 2),
        (optim.Adadelta, lambda h: 2),
        (optim.Rprop, lambda h: 2),
        (optim.ASGD, lambda h: 1),
        (optim.SparseAdam, lambda h: 2),
    ]
    for cls, states in rules:
        if isinstance(optimizer, cls):
            return states(hp)
    known = ", ".join(cls.__name__ for cls, _ in rules)
    raise InvalidArgumentError(
        f"cannot infer the optimizer states of {type(optimizer).__name__}; pass a name "
        f"({', '.join(OPTIMIZERS)}) or one of {known}"
    )


# Parameter-sized lists a foreach step makes at once, by optimizer name: torch's Adam and
# AdamW take the square root of the second moments into a new list; SGD steps in place.
STEP_LISTS: dict[str, int] = {
    "adamw": 1,
    "adam": 1,
    "sgd": 0,
    "sgd-momentum": 0,
    "adagrad": 1,
    "rmsprop": 1,
    "none": 0,
}


def step_lists(optimizer: str | torch.optim.Optimizer | None) -> tuple[int, bool | None]:
    """``(lists, foreach)``: the parameter-sized lists the optimizer's step makes at once.

    ``foreach``: ``None`` for torch's default (foreach on CUDA, one parameter at a time on
    CPU), ``False`` one at a time (each list then holds one parameter). A fused step makes
    none. Read from an instance's class and hyperparameters: weight decay that is added to
    the gradients (``SGD``, ``Adam``, ``Adagrad``, ``RMSprop``) makes one list more.
    """
    if optimizer is None:
        return 0, None
    if isinstance(optimizer, str):
        return STEP_LISTS.get(optimizer.lower(), 1), None
    groups = [{**optimizer.defaults, **g} for g in optimizer.param_groups or [{}]]
    if all(hp.get("fused") for hp in groups):
        return 0, None
    decoupled = isinstance(optimizer, torch.optim.AdamW)
    coupled = any(
        hp.get("weight_decay") and not (decoupled or hp.get("decoupled_weight_decay", False))
        for hp in groups
    )
    own = 0 if isinstance(optimizer, torch.optim.SGD) else 1
    return own + int(coupled), groups[0].get("foreach")


@dataclass(frozen=True)
class _Unit:
    """Sizes of one sharding unit: element counts and the dtypes it lives in."""

    numel: int
    trainable: int  # elements of parameters that require grad
    shard: int  # S_u = max(1, ceil(numel / N))
    largest: int  # elements of its largest trainable parameter
    model: torch.dtype
    compute: torch.dtype
    master: torch.dtype
    reduce: torch.dtype


def _coefficients(
    name: str, u: _Unit, k: int, offload: str | None = None
) -> dict[str, tuple[int, int]]:
    """``{component: (bytes per full element, bytes per shard element)}`` for one unit.

    For ``ddp`` the full coefficient multiplies the unpadded numel; for ZeRO it multiplies
    the padded ``N * S_u``; the shard coefficient always multiplies ``S_u``. With
    ``offload`` the master shard, its gradient and the optimizer states are ``host``; between
    steps the device keeps the full parameters (stages 1/2) and the full gradients (stage 1)
    only (the shard's device copy lives from the first all-gather to the step: a transient).
    """
    m, c, w, r = u.model.itemsize, u.compute.itemsize, u.master.itemsize, u.reduce.itemsize
    if offload is not None and name != "ddp":
        return {
            "params": (0 if name == "zero3" else c, 0),
            "grads": (r if name == "zero1" else 0, 0),
            "master": (0, 0),
            "optimizer": (0, 0),
            "host": (0, (2 + k) * w),
        }
    separate = u.master != u.compute  # else the master shard is a view into the full params
    if name == "ddp":
        return {"params": (m, 0), "grads": (m, 0), "master": (0, 0), "optimizer": (k * m, 0)}
    if name == "zero1":
        # The full gradients persist in the reduce dtype; the shard gradient views them
        # unless the master dtype differs.
        return {
            "params": (c, 0),
            "grads": (r, w if u.master != u.reduce else 0),
            "master": (0, w if separate else 0),
            "optimizer": (0, k * w),
        }
    if name == "zero2":
        return {
            "params": (c, 0),
            "grads": (0, w),
            "master": (0, w if separate else 0),
            "optimizer": (0, k * w),
        }
    return {"params": (0, w), "grads": (0, w), "master": (0, 0), "optimizer": (0, k * w)}


def _top(values: list[int], count: int) -> int:
    """Sum of the ``count`` largest ``values`` (the largest units: an upper bound)."""
    return sum(sorted(values, reverse=True)[:count])


def _comm_buffers(
    name: str, units: list[_Unit], n: int, prefetch: int, offload: str | None = None
) -> tuple[int, int]:
    """Peak transient bytes of communication buffers: ``(in backward, as a forward begins)``.

    As ``ShardedDataParallel`` holds them. Stages 1 and 2 re-gather every unit at once as
    the forward after a step begins, each from a copy (or cast) of its shard in the compute
    dtype; each copy is freed when its unit's modules first run, before the activations they
    make, so the copies count at the forward's start and not beside the activations.
    ``offload="optimizer"`` keeps them (its device copies of the shards) from the first
    all-gather to the step: in backward too.
    """
    if name == "ddp":
        return 0, 0  # gradients are views into the buckets, already counted in grads
    gather_inputs = sum(u.compute.itemsize * u.shard for u in units)
    kept = gather_inputs if offload == "optimizer" else 0
    regather = gather_inputs - kept
    if name == "zero1":
        return kept, regather  # the persistent full gradients are all-reduced in place
    # Backward: _MAX_INFLIGHT reductions in flight plus the unit accumulating, each a full
    # gradient flat in the reduce dtype, and a reduce-scatter output when r != w.
    flats = _top([u.reduce.itemsize * n * u.shard for u in units], _MAX_INFLIGHT + 1)
    outs = _top([u.reduce.itemsize * u.shard for u in units if u.reduce != u.master], _MAX_INFLIGHT)
    if name == "zero2":
        return flats + outs + kept, regather
    live = 1 + prefetch  # the unit in use and those gathered ahead
    gathered = _top([u.compute.itemsize * n * u.shard for u in units], live)
    casts = _top([u.compute.itemsize * u.shard for u in units if u.compute != u.master], live)
    # offload="optimizer": the shards' device copies, forward to step.
    return gathered + casts + flats + outs + kept, 0


def _formula(full: int, shard: int, n_symbol: str = "N") -> str:
    """``(8, 8)`` -> ``"8 + 8/N"``; ``(0, 16)`` -> ``"16/N"``; ``(0, 0)`` -> ``"0"``."""
    parts = [str(full)] if full else []
    if shard:
        parts.append(f"{shard}/{n_symbol}")
    return " + ".join(parts) or "0"


def estimate_memory(
    model: nn.Module,
    *,
    world_size: int,
    strategy: str = "zero3",
    optimizer: str | torch.optim.Optimizer | None = "adamw",
    mixed_precision: MixedPrecision | None = None,
    example_input: Any = None,
    unit_mb: float | None = None,
    prefetch: int = 1,
    compression: str | Compressor | None = None,
    offload: str | None = None,
    recompute: str | None = None,
    units: str | None = None,
) -> MemoryEstimate:
    """Bytes per rank to train ``model`` with ``strategy`` on ``world_size`` ranks.

    Only parameter metadata is read; nothing is allocated for parameters. Activations are
    counted only when ``example_input`` is given, by one forward on the meta device.

    Args:
        model: The plain model (on any device, ``meta`` included).
        world_size: Ranks (N), at least 1.
        strategy: ``ddp``, ``zero1``, ``zero2``, ``zero3`` or ``fsdp`` (laid out as zero3).
        optimizer: A name from ``OPTIMIZERS`` or a ``torch.optim.Optimizer`` (its states per
            parameter are inferred from its class and hyperparameters).
        mixed_precision: The sharded strategies' precision policy; ignored (with a note) for
            ``ddp``.
        example_input: One rank's batch: a tensor, a tuple of positional arguments or a dict
            of keyword arguments. Only shapes and dtypes are used.
        unit_mb: Sharding unit threshold in MiB, as given to the sharded wrapper; ``None``:
            its default for the model's device (1 MiB on CPU, 32 MiB on CUDA).
        prefetch: Units ZeRO-3 gathers ahead of the one computing.
        compression: The gradient compressor passed to ``distribute`` (or its name): its
            per-rank state is counted.
        offload: ZeRO's ``offload`` (``"optimizer"`` or ``"cpu"``): the master shards, their
            gradients and the optimizer states move to ``host``.
        recompute: ``distribute``'s ``recompute`` (``"selective"`` or ``"full"``): the
            activations counted are what the blocks keep under it. A model passed through
            ``recompute_blocks`` already is counted that way without it.
        units: ZeRO's ``units`` (``"size"`` or ``"blocks"``); ``None``: its default for the
            model's device (``"blocks"`` on CUDA without offload).

    Returns:
        A ``MemoryEstimate``; ``print`` it for a table.

    Raises:
        InvalidArgumentError: an unknown strategy or optimizer, ``world_size < 1``, a negative
            ``prefetch`` or ``unit_mb``, an unknown ``units``, or a model without parameters.
    """
    name = _check_strategy(strategy)
    _check_world_size(world_size)
    if prefetch < 0 or (unit_mb is not None and unit_mb < 0):
        raise InvalidArgumentError(
            f"prefetch ({prefetch}) and unit_mb ({unit_mb}) must not be negative"
        )
    if offload not in (None, "optimizer", "cpu"):
        raise InvalidArgumentError(
            f"estimate_memory: offload must be None, 'optimizer' or 'cpu', not {offload!r}"
        )
    if offload is not None and strategies.strategy(name).stage == 0:
        raise InvalidArgumentError(
            f"estimate_memory: offload is an option of the ZeRO strategies, not {name}"
        )
    check_units(units, "estimate_memory")
    check_policy(recompute, "estimate_memory")
    k = optimizer_states(optimizer)
    notes: list[str] = []
    mp = _effective_precision(name, mixed_precision, notes)
    (activations, again), measured = _activations_or_note(
        model, example_input, mp, notes, recompute
    )
    estimate = _estimate(
        model,
        name,
        world_size,
        k,
        mp,
        unit_mb,
        prefetch,
        activations,
        measured,
        notes,
        offload,
        recompute,
        units,
        recomputed=again,
        step=step_lists(optimizer),
    )
    compressor = resolve_compression(compression, None)
    if compressor is None:
        return estimate
    sharded = strategies.strategy(name).stage >= 2
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    extra = compressor.memory_bytes(numel, world_size, sharded=sharded)
    note = f"compression {compressor!r}: {format_bytes(extra)} of per-rank state"
    if sharded:
        note += " (its residual covers the whole gradient, not only this rank's shard)"
    return dataclasses.replace(estimate, compression=extra, notes=(*estimate.notes, note))


def _estimate(
    model: nn.Module,
    name: str,
    world_size: int,
    k: int,
    mp: MixedPrecision | None,
    unit_mb: float | None,
    prefetch: int,
    activations: int,
    measured: bool,
    notes: list[str],
    offload: str | None = None,
    recompute: str | None = None,
    unit_rule: str | None = None,
    recomputed: int = 0,
    step: tuple[int, bool | None] = (1, None),
    device: torch.device | None = None,
    pipelined: bool = False,
) -> MemoryEstimate:
    """The estimate once arguments are checked and activations counted.

    ``step``: the optimizer's ``step_lists``; ``device``: where the model will train (its
    units' default size and rule, and whether its step is foreach), by default the model's;
    ``pipelined``: a pipeline stage's, whose later micro-batches run their forwards with the
    gradients of the earlier ones alive.
    """
    layout = strategies.strategy(name).planned_as
    first = next(model.parameters(), None)
    if device is None:
        device = first.device if first is not None else torch.device("cpu")
    if unit_mb is None:
        unit_mb = default_unit_mb(device, sum(p.nbytes for p in model.parameters()))
    threshold = int(unit_mb * 2**20)
    rule = unit_rule or default_units(device, offload)
    blocks = unit_blocks(model, rule, recompute, threshold)
    plan = plan_units(model, threshold, blocks=blocks)
    n = world_size
    named = dict(model.named_parameters())

    def params_of(names: tuple[str, ...]) -> list[nn.Parameter]:
        return [named[name] for name in names]

    units = []
    for spec in plan.units:
        dt = spec.dtype
        compute = mp.compute_dtype(dt) if mp else dt
        master = mp.master_dtype(dt) if mp else dt
        reduce = mp.reduction_dtype(dt) if mp else dt
        sizes = [p.numel() for p in params_of(spec.params) if p.requires_grad]
        shard = max(1, -(-spec.numel // n))
        largest = max(sizes, default=0)
        units.append(_Unit(spec.numel, sum(sizes), shard, largest, dt, compute, master, reduce))

    totals = dict.fromkeys((*_COMPONENTS, "host"), 0)
    coefficients: dict[str, set[tuple[int, int]]] = {c: set() for c in _COMPONENTS}
    host: set[tuple[int, int]] = set()
    for u in units:
        for comp, (full, shard) in _coefficients(layout, u, k, offload).items():
            if layout != "ddp":
                full_elems = n * u.shard
            else:  # DDP reduces and steps only parameters that require grad
                full_elems = u.numel if comp == "params" else u.trainable
            totals[comp] += full * full_elems + shard * u.shard
            coefficients.get(comp, host).add((full, shard))

    formulas: list[tuple[str, str]] = []
    if all(len(c) == 1 for c in coefficients.values()):
        pairs = {comp: next(iter(c)) for comp, c in coefficients.items()}
        formulas = [(comp, _formula(*pairs[comp])) for comp in _COMPONENTS]
        persistent = (sum(p[0] for p in pairs.values()), sum(p[1] for p in pairs.values()))
        formulas.append(("persistent", _formula(*persistent)))
        if len(host) == 1:
            formulas.append(("host", _formula(*next(iter(host)))))

    num_params = sum(u.numel for u in units)
    frozen = num_params - sum(u.trainable for u in units)
    if frozen and layout != "ddp":
        notes.append(
            f"{frozen:,} frozen parameters are counted with gradients and optimizer states "
            "(an upper bound)"
        )
    if not measured and not any(note.startswith("activations") for note in notes):
        notes.append("activations not estimated: pass example_input")
    buffers, regather = _comm_buffers(layout, units, n, prefetch, offload)
    return MemoryEstimate(
        strategy=name,
        world_size=n,
        params=totals["params"],
        grads=totals["grads"],
        master=totals["master"],
        optimizer=totals["optimizer"],
        comm_buffers=buffers,
        regather=regather,
        activations=activations,
        recomputed=recomputed,
        step_scratch=_step_scratch(layout, units, n, offload, step, device),
        grads_in_backward=strategies.strategy(name).stage >= 2 and not pipelined,
        num_params=num_params,
        num_units=len(units),
        optimizer_states=k,
        activations_estimated=measured,
        formulas=tuple(formulas),
        notes=tuple(notes),
        host=totals["host"],
        offload=offload,
    )


def _step_scratch(
    layout: str,
    units: list[_Unit],
    n: int,
    offload: str | None,
    step: tuple[int, bool | None],
    device: torch.device,
) -> int:
    """Bytes the optimizer's step allocates while it runs (``MemoryEstimate.step_scratch``).

    It updates the trainable parameters in the model's dtype (DDP) or this rank's master
    shards (ZeRO); under offload it steps on the host.
    """
    lists, foreach = step
    if not lists or not units or (offload is not None and layout != "ddp"):
        return 0
    if foreach is None:  # torch's default: foreach where every parameter is on CUDA
        foreach = device.type == "cuda"
    if layout == "ddp":
        sizes = [(u.model.itemsize * u.trainable, u.model.itemsize * u.largest) for u in units]
    else:
        sizes = [
            (u.master.itemsize * u.shard, u.master.itemsize * min(u.largest, u.shard))
            for u in units
        ]
    if foreach:
        return lists * sum(whole for whole, _ in sizes)
    return lists * max(one for _, one in sizes)


def _check_strategy(strategy: str) -> str:
    if not isinstance(strategy, str):
        raise InvalidArgumentError(
            f"unknown strategy {strategy!r}; use one of {', '.join(PLANNED_STRATEGIES)}"
        )
    return strategies.strategy(strategy).name


def _check_world_size(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InvalidArgumentError(f"world_size must be an integer >= 1, got {world_size!r}")


def _effective_precision(
    name: str, mixed_precision: MixedPrecision | None, notes: list[str]
) -> MixedPrecision | None:
    """The policy that applies to ``name``.

    DDP trains in the model's dtype; the sharded wrapper defaults to ``MixedPrecision()``
    (fp32 master weights for a low-precision model).
    """
    if name == "ddp":
        if mixed_precision is not None:
            notes.append("ddp ignores mixed_precision: estimated in the model's dtype")
        return None
    return mixed_precision or MixedPrecision()


def _activations_or_note(
    model: nn.Module,
    example_input: Any,
    mp: MixedPrecision | None,
    notes: list[str],
    recompute: str | None = None,
) -> tuple[tuple[int, int], bool]:
    """``((kept, made again), measured)``; a forward that fails on the meta device: a note."""
    if example_input is None:
        return (0, 0), False
    try:
        return count_activations(model, example_input, mp, recompute), True
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
        notes.append(
            f"activations not estimated: the forward failed on the meta device "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        )
        return (0, 0), False
