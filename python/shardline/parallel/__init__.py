"""Parallel strategies: wrappers around a plain model and optimizer.

- ``distribute``: one call, strategy by name; ``as_distributed``: strategy chosen by memory.
- ``estimate_memory``, ``choose_strategy``: the pre-flight memory planner.
- ``DistributedDataParallel``: replicas with bucketed, overlapped gradient all-reduce.
- ``ShardedDataParallel``: ZeRO stages 1/2/3 (FSDP) with automatic units; ``MixedPrecision``.
- ``comm_hooks``: how a gradient bucket is reduced (``fp16``/``bf16`` compression, your own).
"""

from __future__ import annotations

from shardline.parallel import comm_hooks
from shardline.parallel.api import STRATEGIES, as_distributed, distribute
from shardline.parallel.ddp import DistributedDataParallel
from shardline.parallel.planner import MemoryEstimate, choose_strategy, estimate_memory
from shardline.parallel.precision import MixedPrecision
from shardline.parallel.zero import ShardedDataParallel, ShardedTensor

__all__ = [
    "STRATEGIES",
    "DistributedDataParallel",
    "MemoryEstimate",
    "MixedPrecision",
    "ShardedDataParallel",
    "ShardedTensor",
    "as_distributed",
    "choose_strategy",
    "comm_hooks",
    "distribute",
    "estimate_memory",
]
