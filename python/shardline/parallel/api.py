"""``distribute()`` and ``as_distributed()``: wrap a model for a parallel strategy in one call."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardline import config
from shardline.comm import trace
from shardline.comm.group import ProcessGroup
from shardline.comm.mesh import DeviceMesh
from shardline.comm.tree import tree_group
from shardline.comm.world import MICROBATCH, REPEAT, default_group, deterministic_mode
from shardline.errors import InvalidArgumentError
from shardline.parallel import strategies
from shardline.parallel.candidate import Candidate
from shardline.parallel.choice import DDP_ONLY, ZERO_ONLY, Meshes, described, wrap_choice
from shardline.parallel.compose import compose
from shardline.parallel.data.zero import ShardedDataParallel
from shardline.parallel.data.zero.optimizers import check_optimizer
from shardline.parallel.deterministic import blocks_of, make_deterministic
from shardline.parallel.deterministic.collector import keep_wide
from shardline.parallel.deterministic.microbatch import MicrobatchSums, check_power_of_two
from shardline.parallel.deterministic.repeat import fixed_sums, repeatable_kernels
from shardline.parallel.fit import plan_strategy
from shardline.parallel.pipeline_layout import WithLoss, with_loss
from shardline.parallel.precision import MixedPrecision
from shardline.parallel.probes import probe_step
from shardline.parallel.recompute.blocks import recompute_blocks
from shardline.parallel.trials import to_try, trial_steps, tried_steps

__all__ = ["as_distributed", "distribute"]

_log = logging.getLogger("shardline")


def distribute(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strategy: str | dict[str, str] = "ddp",
    group: ProcessGroup | None = None,
    mesh: DeviceMesh | None = None,
    recompute: str | None = None,
    deterministic: bool | str | None = None,
    **options: Any,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Wraps ``model`` (and ``optimizer``) for data-parallel training on ``group``.

    Args:
        model: A plain ``nn.Module``, already on its device.
        optimizer: A plain optimizer over ``model``'s parameters, or ``None``.
        strategy: ``"ddp"``; ``"zero1"``, ``"zero2"``, ``"zero3"`` (``"fsdp"`` is zero3): see
            ``ShardedDataParallel``; ``"local_sgd"`` (``sync_every``, ``outer_optimizer``):
            see ``shardline.parallel.replica.local_sgd``; ``"async"`` (``staleness``,
            ``on_stale``, ``servers``): see ``shardline.parallel.replica.async_sgd`` (the
            optimizer returned is then an ``AsyncOptimizer``, whose ``step`` pushes and
            pulls); ``"hogwild"``: see ``shardline.parallel.replica.hogwild``. With ``mesh``,
            a strategy per axis:
            ``{"dp": "zero3", "pp": "1f1b", "tp": "auto"}``: a pipeline schedule on ``pp``,
            tensor parallelism on ``tp`` (``"auto"`` or a plan, as ``sl.tensor_parallel``
            takes), and DDP or ZeRO-1/2/3 keeping the replicas on ``dp`` (or HSDP's
            ``"dp_replicate": "ddp"`` with ``"dp_shard": "zero3"``); any axis may be left
            out. ``options`` then go to ``sl.pipeline`` (``microbatches``, ``loss_fn``,
            ``split``, ``virtual_stages``) and ``sequence_parallel`` to the ``tp`` axis.
        group: The ranks to train on; the default group when ``None``.
        mesh: A ``DeviceMesh`` whose axes are the strategy's (``"dp"``, ``"pp"``, ``"tp"``,
            ``"dp_replicate"``, ``"dp_shard"``), for composition.
        recompute: ``"selective"`` or ``"full"``: the model's repeated blocks recompute their
            activations in backward (``parallel.recompute.recompute_blocks``), for less
            memory per rank at the same results, bit for bit; ``None`` keeps them all. Under
            ZeRO each block is then one unit (``unit_mb`` sizes the rest).
        deterministic: Train to the same parameters, bit for bit, at every world size that
            gives each rank a power-of-two block of the global batch, and as one process
            when the whole batch is a power of two (DDP, ZeRO-1/2/3, float32 on CPU):
            gradients are computed per sample and summed in one fixed tree
            (``shardline.parallel.deterministic``), on this group's ranks too
            (``shardline.comm.tree.tree_group``). Rank ``r`` must hold samples
            ``[r*b, (r+1)*b)`` of the global batch. On a mesh: a pipeline (``pp``),
            tensor parallelism (``tp``, its split sums cut into the blocks of
            ``make_deterministic(model, blocks=)``: the ``tp`` size when not prepared) or
            both, with replicas on ``dp``. ``"repeat"``: the same bits run after run for
            this layout only, at the cost of torch's deterministic kernels
            (``shardline.parallel.deterministic.repeat``; every strategy but ``async`` and
            ``hogwild``, on a mesh too). ``"microbatch"``: the same bits at every
            power-of-two world size, on the model's own kernels, for micro-batches of one
            size in every layout: each backward one micro-batch
            (``sl.rank_microbatches``), the backwards of a step added in the same fixed
            tree (``shardline.parallel.deterministic.microbatch``; DDP and ZeRO-1/2/3, an
            optimizer given). ``None`` takes ``sl.init(deterministic=)``, else
            ``SHARDLINE_DETERMINISTIC``.
        **options: Passed to the strategy (for DDP: ``bucket_cap_mb``, ``broadcast_buffers``,
            ``comm_hook``, ...; for ZeRO: ``unit_mb``, ``prefetch``, ``mixed_precision``; for
            both: ``compression``, a ``shardline.optim`` compressor or its name).

    Returns:
        ``(wrapped_model, optimizer)``. For DDP the optimizer is returned as is: it already
        holds the parameters that the wrapper keeps in sync. For ZeRO it is the same object,
        its param groups (and their hyperparameters) now holding this rank's shards.

    Raises:
        InvalidArgumentError: an unknown strategy or option, or an optimizer over other
            parameters.
    """
    if mesh is None and not isinstance(strategy, dict):  # (before the model changes)
        _check_options(strategies.strategy(strategy).name, options)
    deterministic = deterministic_mode(deterministic, "distribute()")
    if deterministic == REPEAT:
        group = _repeatable(model, strategy, group, mesh)
    elif deterministic == MICROBATCH:
        group = _microbatch(model, optimizer, strategy, group, mesh, options)
    elif deterministic:
        model, group = _deterministic(model, strategy, group, mesh, recompute, options)
    # Compared across ranks by ``shardline doctor`` when the job is traced.
    trace.note(
        "distribute",
        {"strategy": strategy, "recompute": recompute, "deterministic": deterministic, **options},
    )
    if recompute is not None:
        recompute_blocks(model, recompute)
    if mesh is not None or isinstance(strategy, dict):
        return compose(model, optimizer, strategy, mesh, options, deterministic=deterministic)
    wrapped, optimizer = _wrap(model, optimizer, strategy, group, options)
    if deterministic == MICROBATCH and optimizer is not None:
        MicrobatchSums(wrapped, optimizer)  # kept alive by its hooks on both
    return wrapped, optimizer


def _wrap(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    strategy: str,
    group: ProcessGroup | None,
    options: dict[str, Any],
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """``distribute``'s wrapping of ``model`` by one strategy (no mesh)."""
    row = strategies.strategy(strategy)
    if row.stage and optimizer is not None:
        check_optimizer(optimizer, row.stage)  # before any collective of the wrapper's
    if row.stage:
        sharded = row.wrap(model, group=group, **options)
        assert isinstance(sharded, ShardedDataParallel)
        if optimizer is not None:
            sharded.bind_optimizer(optimizer)
        return sharded, optimizer
    if optimizer is not None:
        owned = {id(p) for p in model.parameters()}
        foreign = [p for grp in optimizer.param_groups for p in grp["params"] if id(p) not in owned]
        if foreign:
            raise InvalidArgumentError(
                f"distribute(): the optimizer holds {len(foreign)} tensors that are not "
                "parameters of the model; build the optimizer from model.parameters()"
            )
    wrapped = row.wrap(model, group=group, **options)
    bind = getattr(wrapped, "bind_optimizer", None)
    if optimizer is not None and callable(bind):  # async: the loop's optimizer pushes and pulls
        return wrapped, bind(optimizer)
    return wrapped, optimizer


def _repeatable(
    model: nn.Module,
    strategy: str | dict[str, str],
    group: ProcessGroup | None,
    mesh: DeviceMesh | None,
) -> ProcessGroup | None:
    """Repeatable kernels for this process, and the group with its sums in a fixed order.

    On a mesh the group is left as it is: ``compose`` fixes its axes' sums.
    """
    if not isinstance(strategy, dict) and strategies.strategy(strategy).name in _TIMED:
        raise InvalidArgumentError(
            f"distribute(deterministic='repeat'): {strategy!r} applies each update when it "
            "arrives, so its result depends on the ranks' timing; use 'ddp', a ZeRO stage or "
            "'local_sgd'"
        )
    repeatable_kernels(model)
    if mesh is not None or isinstance(strategy, dict):
        return group
    return fixed_sums(group if group is not None else default_group())


_TIMED = frozenset({"async", "hogwild"})


def _microbatch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    strategy: str | dict[str, str],
    group: ProcessGroup | None,
    mesh: DeviceMesh | None,
    options: dict[str, Any],
) -> ProcessGroup:
    """Repeatable kernels, and the group that sums the ranks in the canonical tree.

    ``recompute`` is allowed: it runs the same kernels on the same micro-batch again.
    """
    where = "distribute(deterministic='microbatch')"
    if mesh is not None or isinstance(strategy, dict):
        raise InvalidArgumentError(
            f"{where} covers DDP and ZeRO-1/2/3 without a mesh; tensor parallelism and "
            "pipelines split sums inside a micro-batch: use deterministic=True there"
        )
    name = strategies.strategy(strategy).name
    if name not in _DETERMINISTIC:
        raise InvalidArgumentError(
            f"{where} covers {', '.join(sorted(_DETERMINISTIC))}, not {strategy!r}"
        )
    if optimizer is None:
        raise InvalidArgumentError(
            f"{where}: give the optimizer too; its step adds the step's micro-batches"
        )
    changed = sorted(k for k in ("compression", "comm_hook") if options.get(k) is not None)
    if changed:
        raise InvalidArgumentError(
            f"{where}: {', '.join(changed)} changes what is summed; leave it out"
        )
    g = group if group is not None else default_group()
    check_power_of_two(g.world_size)
    repeatable_kernels(model)
    return tree_group(g)


def _deterministic(
    model: nn.Module,
    strategy: str | dict[str, str],
    group: ProcessGroup | None,
    mesh: DeviceMesh | None,
    recompute: str | None,
    options: dict[str, Any],
) -> tuple[nn.Module, ProcessGroup | None]:
    """The model with per-sample gradients and the group that sums ranks in the same tree.

    On a mesh (a pipeline ``pp``, tensor parallelism ``tp``, their replicas ``dp``) the group
    is left as it is: ``sl.pipeline`` and ``compose`` sum on the mesh's axes in the tree. A
    model not prepared yet gets blocks for the ``tp`` size.
    """
    blocks = None
    if isinstance(strategy, dict):
        dp = strategy.get("dp", "ddp")
        axes = set(strategy)
        tensor = "tp" in axes
        if not (axes <= {"pp", "tp", "dp"} and axes & {"pp", "tp"}) or dp not in _DETERMINISTIC:
            raise InvalidArgumentError(
                f"distribute(deterministic=True) on a mesh covers a pipeline ('pp'), tensor "
                f"parallelism ('tp') or both, with replicas ('dp': "
                f"{', '.join(sorted(_DETERMINISTIC))}), not {strategy!r}"
            )
        if tensor and options.get("sequence_parallel"):
            raise InvalidArgumentError(
                "distribute(deterministic=True): sequence parallelism splits the norms' "
                "per-sample sums along the sequence; leave sequence_parallel off"
            )
        if tensor and blocks_of(model) is None and mesh is not None:
            blocks = mesh.size("tp")  # the fewest blocks that serve this tp size
    else:
        name = None if mesh is not None else strategies.strategy(strategy)
        if name is None or name.name not in _DETERMINISTIC:
            raise InvalidArgumentError(
                f"distribute(deterministic=True) covers {', '.join(sorted(_DETERMINISTIC))}, "
                f"and pipelines and tensor parallelism on a mesh, not {strategy!r}"
            )
    changed = sorted(k for k in ("compression", "comm_hook") if options.get(k) is not None)
    if changed or recompute is not None:
        what = ", ".join([*changed, *(["recompute"] if recompute is not None else [])])
        raise InvalidArgumentError(
            f"distribute(deterministic=True): {what} changes what is summed or recomputes it "
            "outside the per-sample gradients; leave it out in deterministic mode"
        )
    precision = options.get("mixed_precision")
    low = (torch.float16, torch.bfloat16)
    if precision is not None and getattr(precision, "param_dtype", None) in low:
        wide = precision.reduce_dtype == torch.float32 and mesh is None
        if wide:  # ZeRO reduces each rank's float32 sum, before its rounding
            keep_wide(model.parameters())
        else:
            _log.warning(
                "distribute(deterministic=True) with %s compute and %s reductions: each "
                "rank's gradient sum is rounded to it before the ranks' sum, so the bits "
                "depend on the world size (the order of every sum is still fixed); reduce "
                "in float32 (MixedPrecision(reduce_dtype=torch.float32), without a mesh) for "
                "the same bits",
                precision.param_dtype,
                precision.reduce_dtype or precision.param_dtype,
            )
    if mesh is not None:  # the pipeline, or compose, sums on the mesh's axes in the tree
        return make_deterministic(model, blocks=blocks), group
    return make_deterministic(model), tree_group(group if group is not None else default_group())


_DETERMINISTIC = frozenset({"ddp", "zero1", "zero2", "zero3", "fsdp"})


def _local_ranks(group: ProcessGroup) -> int:
    """Ranks of ``group`` per host, which a tensor-parallel group stays within."""
    raw = config.env_var("LOCAL_WORLD_SIZE", default=str(group.world_size))
    try:
        return max(1, min(int(raw), group.world_size))
    except ValueError:
        raise InvalidArgumentError(f"LOCAL_WORLD_SIZE={raw!r} is not an integer") from None


def _check_options(strategy: str, options: dict[str, Any]) -> None:
    """Refuses an option the strategy's wrapper does not take, before any work.

    The error names who takes it instead (a ``TypeError`` from deep inside otherwise).
    """
    cls = strategies.strategy(strategy).wrapper
    valid = strategies.options_of(cls)
    unknown = sorted(set(options) - set(valid))
    if not unknown:
        return
    elsewhere = [
        f"{n} is an option of {'DDP' if n in DDP_ONLY else 'the ZeRO strategies'}"
        for n in unknown
        if n in DDP_ONLY | ZERO_ONLY
    ]
    raise InvalidArgumentError(
        f"distribute(strategy={strategy!r}): unknown option(s) {', '.join(unknown)}"
        + (f" ({'; '.join(elsewhere)})" if elsewhere else "")
        + f"; {cls.__name__} takes {', '.join(valid)}"
    )


def as_distributed(
    model: nn.Module,
    *,
    group: ProcessGroup | None = None,
    optimizer: str | torch.optim.Optimizer | None = "adamw",
    mixed_precision: MixedPrecision | None = None,
    example_input: Any = None,
    available_bytes: int | None = None,
    headroom: float = 0.7,
    timing: bool = True,
    trials: bool = True,
    tensor_parallel: bool = False,
    pipeline: bool = False,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    verbose: bool = True,
    **options: Any,
) -> nn.Module:
    """Wraps ``model`` with the fastest strategy whose memory fits, and says why.

    Prices the memory per rank of DDP and ZeRO-1/2/3 (``estimate_memory`` for each, with the
    optimizer state of ``optimizer``: the name of the one you will build, or an instance); with
    ``example_input``, the same with the model's blocks recomputing their activations
    (selective, then full); on GPUs, zero3 with its shards and optimizer state offloaded to host
    memory (``plan_strategy``). With ``example_input`` and ``timing``, short probes
    (``probe_step``: the model's forward and backward on that batch, an optimizer step, an
    all-reduce of the group) predict each fitting choice's step; with ``trials`` too, the
    fastest few predicted (2 to 4, within 1.6x of the best, with the fastest of up to 3 more
    layouts; each with room for a copy of the model beside it) are each trained for 13 steps
    on a copy of the model, the fastest and those within 15 % of it twice
    (``trials.tried_steps``), and the fastest of those is chosen (within 2 % of it, the least
    sharded). With ``tensor_parallel``, layouts that split each replica's
    layers over ``tp`` ranks of a host are priced, timed and tried too (``plan_strategy``); with
    ``pipeline``, 1F1B and zero-bubble pipelines of an ``nn.Sequential`` over ``pp`` ranks and
    their micro-batches; with both, pipelines whose stages split over ``tp`` ranks too (a
    ``{"dp", "pp", "tp"}`` mesh). On a small model all of it takes a few seconds; the probes'
    and trials' collectives count in the group's ``traffic()``. Without ``example_input`` (or
    ``timing``) the first that fits in that order is chosen. The offloads are chosen only when
    nothing else fits. Every rank takes the same choice, from the slowest rank's times and what
    fits on every rank. Build the optimizer afterwards from the returned model's
    ``parameters()`` (for ZeRO those are this rank's shards, named like the originals).

    Args:
        model: The plain model, on its device.
        group: The ranks to train on; the default group when ``None``.
        optimizer: What the optimizer state will be (``"adamw"``, ``"sgd-momentum"``, ...).
        mixed_precision: For the ZeRO stages (DDP keeps the model's dtype).
        example_input: One rank's batch: activations are counted on it (meta device), and
            the timing probe runs it (leaving the model's gradients, buffers and the RNG
            state as they were).
        available_bytes: Memory per rank; measured (free GPU memory, or available host memory
            shared by the local ranks) when ``None``.
        headroom: Fraction of the available memory a strategy may plan to use.
        timing: Time the fitting choices (needs ``example_input``); ``False`` takes the first
            that fits.
        trials: Train the closest few for a few steps each, on a copy of the model, and
            choose by their measured steps; ``False`` chooses by the prediction alone.
        tensor_parallel: Consider tensor parallelism (``sl.tensor_parallel``'s ``"auto"``
            plan) over 2, 4, ... ranks of a host, with DDP or ZeRO over the replicas. Chosen,
            it changes what each rank is fed: the ``tp`` ranks of a replica take the same
            batch, ``tp`` times one rank's (the same global batch, as it was timed): build
            the sampler as ``sl.DistributedSampler(data, **model.sampler_args)`` and scale
            the batch by ``model.batch_scale``.
        pipeline: Consider pipelines too (``model`` an ``nn.Sequential``, ``loss_fn`` given,
            ``example_input`` one rank's ``(inputs, target)``): 1F1B or zero-bubble over 2,
            4, ... stages with ``pp``, ``2 pp`` or ``4 pp`` micro-batches, DDP or ZeRO over
            the replicas.
            Every choice then trains by ``loss = model.step(inputs, target)`` (forward,
            ``loss_fn`` and backward; a pipeline's ``step``), then ``opt.step()``; a pipeline
            is fed as a tp choice is (``sampler_args``, ``batch_scale``), the same batch on
            each of its ranks.
        loss_fn: ``loss_fn(output, target)``, a mean over the samples (with ``pipeline``).
        verbose: Print the choice and the reason on rank 0 (always logged to ``shardline``).
        **options: Passed to the chosen wrapper; those only the other one knows (``unit_mb``,
            ``comm_hook``, ...) are dropped, so one call works whatever memory a machine has.

    Returns:
        A ``DistributedDataParallel`` or ``ShardedDataParallel`` (over a tensor-parallel
        model for a tp choice), or a pipeline's ``PipelineModule``; ``model.strategy`` (what
        ``sl.distribute`` takes: a name, or a strategy per axis of ``model.mesh``) and
        ``model.strategy_reason`` record the choice, ``model.plan`` (a ``StrategyPlan``) what
        the ranks priced: ``print(model.plan.explain())`` shows every strategy's bytes per
        rank by component, whether it fits and its predicted step. ``model.mesh`` is the
        ``{"dp", "tp"}`` or ``{"dp", "pp"}`` mesh of a tp or pipeline choice (else ``None``);
        ``model.sampler_args`` (``num_replicas``, ``rank``) and ``model.batch_scale`` say
        how to feed it.
    """
    g = group if group is not None else default_group()
    device = next(model.parameters()).device
    meshes: Meshes = {}  # by axis and size: made once, for the trials and the choice
    if pipeline:  # every choice is priced, timed and trained with its loss
        model = with_loss(model, loss_fn)
    plan = plan_strategy(
        model,
        world_size=g.world_size,
        available_bytes=available_bytes,
        optimizer=optimizer,
        mixed_precision=mixed_precision,
        example_input=example_input,
        headroom=headroom,
        unit_mb=options.get("unit_mb"),
        device=device,
        tensor_parallel=tensor_parallel,
        local_ranks=_local_ranks(g),
        pipeline=pipeline,
        loss_fn=loss_fn,
        rank=g.rank,
    )
    if timing and example_input is not None:
        # The smallest micro-batch a fitting pipeline runs, in ranks' batches.
        micro = [c.batch_scale / c.microbatches for c in plan.candidates if c.fits and c.pp > 1]
        probes = probe_step(
            model, example_input, group=g, optimizer=optimizer, computes=plan.to_time(),
            elements=plan.shape.elements if plan.shape is not None else None,
            narrow=min(micro, default=None),
        )  # fmt: skip
        plan = plan.timed(probes)
    # Every rank takes the same choice: from the slowest rank's step times and what fits on all.
    n = len(plan.candidates)
    verdicts = torch.tensor(
        [c.time.total if c.time is not None else math.inf for c in plan.candidates]
        + [0.0 if c.fits else 1.0 for c in plan.candidates],
        dtype=torch.float64,
        device=device,
    )
    g.all_reduce(verdicts, op="max")
    seen = verdicts.tolist()
    mine, plan = plan, plan.agreed(seen[:n], [v == 0.0 for v in seen[n:]])
    if timing and example_input is not None and trials:
        tried = to_try(plan)
        if tried:

            def slowest(seconds: list[float]) -> list[float]:
                agreed = torch.tensor(seconds, dtype=torch.float64, device=device)
                g.all_reduce(agreed, op="max")
                return agreed.tolist()

            def wrap(copy: nn.Module, c: Candidate) -> nn.Module:
                return wrap_choice(copy, c, g, mixed_precision, options, meshes, example_input)

            seconds = tried_steps(
                tried,
                lambda some: trial_steps(model, example_input, some, wrap, optimizer),
                slowest,
            )
            plan = plan.tried(tried, seconds)
    reason = plan.reason
    if not next(c for c in plan.candidates if c.order == mine.choice.order).fits:
        reason += f" ({mine.choice.name}, this rank's choice, does not fit on another rank)"
    choice = plan.choice
    if isinstance(model, WithLoss) and choice.pp == 1:
        model = model.chain  # wrapped under its own names; its step adds the loss
    wrapped = wrap_choice(model, choice, g, mixed_precision, options, meshes, example_input)
    described(wrapped, choice, reason, plan, g, meshes, loss_fn if pipeline else None)
    message = f"shardline.as_distributed chose {reason}"
    _log.info(message)
    if verbose and g.rank == 0:
        print(message, flush=True)
    return wrapped
