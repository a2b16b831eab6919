"""Parallel strategies: wrappers around a plain model and optimizer.

- ``distribute``: one call, strategy by name; ``as_distributed``: the fastest strategy that
  fits, chosen by memory (``fit``), probes and a step model (``timing``) and trial steps
  (``trials``).
- ``clip_grad_norm_``: clipping by the global norm, whatever the layout.
- ``estimate_memory`` (``planner``, counting activations with ``activations``),
  ``plan_strategy`` and ``choose_strategy`` (``fit``): the pre-flight memory planner.
- ``strategies``: the strategy names, one table (name -> wrapper, stage, planner layout).
- ``contract``: the four methods every strategy implements for checkpoints, and the values
  they return (``Shard``, ``Local``, replicated tensors).
- ``data``: ``DistributedDataParallel`` (replicas, bucketed overlapped all-reduce) and
  ``ShardedDataParallel`` (ZeRO stages 1/2/3, FSDP, with automatic units); ``MixedPrecision``;
  ``register_optimizer``: how ZeRO shards an optimizer it does not know.
- ``pipeline``: a model split into stages over ranks, run by a schedule (GPipe, 1F1B,
  interleaved, zero-bubble).
- ``tensor``: tensor parallelism (column/row-parallel linears, vocabulary-parallel embedding
  and loss, sequence parallelism) and ``tensor_parallel``, which rewrites a model's layers.
- ``replica``: local SGD, DiLoCo, asynchronous SGD, Hogwild; ``recompute``: activation
  recomputation in backward and the activation store across ranks.
- ``deterministic``: deterministic mode, ``make_deterministic`` (per-sample gradients summed
  in one fixed tree: the same parameters, bit for bit, at any world size), and
  ``rank_microbatches`` for its micro-batch mode (the model's own kernels).
"""

from __future__ import annotations

from shardline.parallel import contract
from shardline.parallel.api import as_distributed, distribute
from shardline.parallel.clip import clip_grad_norm_
from shardline.parallel.contract import Box, FlatRange, Local, Shard
from shardline.parallel.data import DistributedDataParallel, ShardedDataParallel
from shardline.parallel.data.zero.optimizers import register_optimizer
from shardline.parallel.deterministic import make_deterministic
from shardline.parallel.deterministic.microbatch import rank_microbatches
from shardline.parallel.fit import StrategyPlan, choose_strategy, plan_strategy
from shardline.parallel.pipeline import PipelineModule, pipeline
from shardline.parallel.planner import MemoryEstimate, estimate_memory
from shardline.parallel.precision import MixedPrecision
from shardline.parallel.strategies import STRATEGIES
from shardline.parallel.tensor import tensor_parallel

__all__ = [
    "STRATEGIES",
    "Box",
    "DistributedDataParallel",
    "FlatRange",
    "Local",
    "MemoryEstimate",
    "MixedPrecision",
    "PipelineModule",
    "Shard",
    "ShardedDataParallel",
    "StrategyPlan",
    "as_distributed",
    "choose_strategy",
    "clip_grad_norm_",
    "contract",
    "distribute",
    "estimate_memory",
    "make_deterministic",
    "pipeline",
    "plan_strategy",
    "rank_microbatches",
    "register_optimizer",
    "tensor_parallel",
]
