"""The data parallelism of a pipeline rank's stages: ``parallel.data``'s DDP or ZeRO per chunk.

The model chunk this rank holds (its stage; its ``virtual_stages`` stages: see below) is
wrapped over the data-parallel replicas by ``DistributedDataParallel`` (``"ddp"``) or by
``ShardedDataParallel`` (``"zero1"``, ``"zero2"``, ``"zero3"``), as torchtitan puts FSDP on
each pipeline stage. The wrappers are kept beside the pipeline's module tree (their parameters
are the stages' own, under the model's names). The pipeline runs the chunks itself, micro-batch
by micro-batch, so it drives the wrappers' caller steps (``data.ddp_accumulate``,
``data.zero.held``):

- **DDP**: ``accumulate()`` when a step starts (gradients add up in the buckets), and
  ``reduce_grads()`` as soon as this rank's actions of the step are done: one all-reduce per
  bucket, while earlier stages are still in their cool-down; the tied weights' sum waits for the
  first stage. Both are linear, so their order does not change the result.
- **ZeRO**: ``unshard(accumulate=True)`` when a step starts: ZeRO-3 all-gathers the chunk's
  parameters once for all the step's micro-batches (``reshard_after_forward=False``), and
  every stage accumulates the whole gradients in one buffer per unit, in fp32 under mixed
  precision with bf16 whole parameters. Tied copies are summed into those buffers
  (``whole_grad``), then ``reduce_grads()`` reduces each once (ZeRO-1 all-reduce, ZeRO-2/3
  reduce-scatter) and ZeRO-3 frees the whole parameters until the next step.

A wrapped module is one unit per dtype and one bucket per dtype (sizes above the module's),
and the collectives run on the replicas' group itself (the pipeline's step issues them in one
order): one collective per dtype and step for each of the gather and the reduction. Several
chunks of one rank (``interleaved``) are wrapped together, as one module holding them all
under the model's names, unless ``per_chunk``: their reductions wait for the step's end (the
tied weights' sum) either way, so separate wrappers would only add collectives (two chunks:
two all-gathers and two reductions per step instead of one each). Chunks that share a
parameter are always wrapped together.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from shardline.comm.group import ProcessGroup
from shardline.errors import InvalidArgumentError
from shardline.parallel.contract import Shard
from shardline.parallel.data.ddp import DistributedDataParallel
from shardline.parallel.data.zero import ShardedDataParallel
from shardline.parallel.precision import MixedPrecision

__all__ = ["ZERO_STAGES", "StageReplicas"]

ZERO_STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}
_MIB = 1 << 20

Wrapper = DistributedDataParallel | ShardedDataParallel


class StageReplicas:
    """The data-parallel wrappers of one pipeline rank's chunks (see the module docstring).

    Args:
        chunks: This rank's stage modules, whose parameters are named as the model's.
        owner: The pipeline module holding every tensor of this rank's stages under the
            model's names: when chunks share a parameter, its tensors are wrapped as one.
        dp: The replicas' group.
        strategy: ``"ddp"``, ``"zero1"``, ``"zero2"`` or ``"zero3"``.
        compute: ``mixed_precision.param_dtype``: ZeRO's whole parameters in that dtype.
        per_chunk: One wrapper per chunk even where this rank holds several.
    """

    def __init__(
        self,
        chunks: list[nn.Module],
        owner: nn.Module,
        dp: ProcessGroup,
        strategy: str,
        compute: torch.dtype | None = None,
        per_chunk: bool = False,
    ) -> None:
        self.dp, self.strategy = dp, strategy
        self.stage = ZERO_STAGES.get(strategy, 0)
        seen: set[int] = set()
        shared = False
        for m in chunks:
            ids = {id(p) for p in m.parameters()}
            shared = shared or bool(ids & seen)
            seen |= ids
        held = [m for m in chunks if any(True for _ in m.parameters())]
        modules = held if (per_chunk or len(held) < 2) and not shared else [_union(owner)]
        if self.stage and not held:
            raise InvalidArgumentError(
                f"pipeline: rank {dp.rank}'s stages have no parameters to shard with "
                f"ZeRO-{self.stage}; use dp='ddp' or put parameters in every stage"
            )
        self.wrappers: list[Wrapper] = [self._wrap(m, compute) for m in modules]
        self._zero = [w for w in self.wrappers if isinstance(w, ShardedDataParallel)]
        self._ddp = [w for w in self.wrappers if isinstance(w, DistributedDataParallel)]
        self._of = {id(p): w for w in self._zero for p in w.module.parameters()}

    def _wrap(self, module: nn.Module, compute: torch.dtype | None) -> Wrapper:
        """One bucket (DDP) or unit (ZeRO) per dtype: sizes above the module's."""
        mb = float(sum(p.nbytes for p in module.parameters()) // _MIB + 1)
        if not self.stage:
            return DistributedDataParallel(
                module, group=self.dp, bucket_cap_mb=mb, first_bucket_mb=mb,
                in_place_mb=float("inf"), broadcast_buffers=False, init_sync=False,
            )  # fmt: skip
        return ShardedDataParallel(
            module, stage=self.stage, group=self.dp, unit_mb=mb, units="size",
            mixed_precision=_precision(module, compute), init_sync=False, reorder=False,
            own_groups=False,
        )  # fmt: skip

    @property
    def zero(self) -> bool:
        """Whether the replicas are sharded (ZeRO): the optimizer steps parts."""
        return bool(self.stage)

    # -- a step ---------------------------------------------------------------------------------

    def begin(self) -> None:
        """Before a step's actions: gradients accumulate; ZeRO: whole parameters, once."""
        for w in self._ddp:
            w.accumulate()
        for z in self._zero:
            z.unshard(accumulate=True)

    def reduce(self) -> None:
        """After the step's actions: every chunk's gradients reduced over the replicas."""
        for w in self.wrappers:
            w.reduce_grads()

    def fold(self) -> None:
        """Adds gradients set by hand into ZeRO's buffers.

        The zero-bubble weight pass's, and deterministic mode's sums.
        """
        for z in self._zero:
            z.fold_grads()

    def whole_grad(self, p: torch.Tensor) -> torch.Tensor:
        """ZeRO: the step's whole gradient of ``p`` so far (a view of the buffer reduced)."""
        return self._of[id(p)].whole_grad(p)

    # -- parameters, optimizers, memory --------------------------------------------------------

    def named_locals(self, prefix: str = "") -> Iterator[tuple[str, nn.Parameter]]:
        """ZeRO: this replica's parts, under the parameters' names."""
        for z in self._zero:
            yield from z.named_parameters(prefix)

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        """ZeRO: points an optimizer holding this rank's parameters at their parts."""
        for z in self._zero:
            z.bind_optimizer(optimizer, shared=True)

    def memory_stats(self) -> dict[str, int]:
        """ZeRO's bytes by kind: whole ``params``, separate parts (``master``), ``grads``."""
        out = {"params": 0, "master": 0, "grads": 0}
        for z in self._zero:
            for k, v in z.memory_stats().items():
                if k in out:
                    out[k] += v
        return out

    @contextlib.contextmanager
    def whole(self, writeback: bool = False) -> Iterator[None]:
        """Whole parameters inside, with their master values (``writeback``: then kept)."""
        with contextlib.ExitStack() as stack:
            for z in self._zero:
                stack.enter_context(z.whole_parameters(writeback=writeback))
            yield

    # -- the strategy contract ------------------------------------------------------------------

    def sharded_params(self) -> dict[str, Shard]:
        """ZeRO: each parameter as a ``Shard`` of this replica's part (none where empty)."""
        out: dict[str, Shard] = {}
        for z in self._zero:
            for name, value in z.sharded_state_dict().items():
                if isinstance(value, Shard):
                    out[name] = value if value.numel else Shard(value.global_shape, [])
        return out

    def load_params(self, sd: Mapping[str, Any]) -> None:
        """ZeRO: this replica's parts from ``sd`` (laid out as ``sharded_params`` gives)."""
        for z in self._zero:
            mine = z.sharded_state_dict()
            z.load_sharded_state_dict(
                {
                    k: v
                    for k, v in sd.items()
                    if isinstance(mine.get(k), Shard) and isinstance(v, Shard) and v.pieces
                }
            )

    def sharded_optim_state(self, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
        """ZeRO: each non-empty part's optimizer state by parameter name.

        Elementwise tensors laid out as the part, other tensors (``step``) as whole
        ``Shard``s, other values as they are.
        """
        state: dict[str, dict[str, Any]] = {}
        for z in self._zero:
            sizes = {n: loc.numel() for n, loc in z.named_parameters()}
            for name, entries in z.sharded_optim_state_dict(optimizer)["state"].items():
                if not sizes.get(name):
                    continue
                state[name] = {
                    k: Shard.flat(v.detach(), v.shape, 0) if torch.is_tensor(v) else v
                    for k, v in entries.items()
                }
        return state


def _union(owner: nn.Module) -> nn.Module:
    """A plain module holding ``owner``'s own children, parameters and buffers, by name."""
    union = nn.Module()
    union._modules.update(owner._modules)
    union._parameters.update(owner._parameters)
    union._buffers.update(owner._buffers)
    union._non_persistent_buffers_set |= owner._non_persistent_buffers_set
    return union


def _precision(module: nn.Module, compute: torch.dtype | None) -> MixedPrecision:
    """ZeRO's precision: whole parameters in ``compute`` when lower than the parameters'.

    The parts (the optimizer's), the gradient buffers and the reductions stay in the
    parameters' own dtype.
    """
    kinds = {p.dtype for p in module.parameters()}
    if compute is None or len(kinds) != 1:
        return MixedPrecision(master_weights=False)
    own = kinds.pop()
    if not own.is_floating_point or compute.itemsize >= own.itemsize:
        return MixedPrecision(master_weights=False)
    return MixedPrecision(param_dtype=compute, reduce_dtype=own, master_weights=False)
