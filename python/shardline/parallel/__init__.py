"""Parallel strategies: wrappers around a plain model and optimizer.

- ``distribute``: one call, strategy by name.
- ``DistributedDataParallel``: replicas with bucketed, overlapped gradient all-reduce.
- ``ShardedDataParallel``: ZeRO stages 1/2/3 (FSDP) with automatic units; ``MixedPrecision``.
- ``comm_hooks``: how a gradient bucket is reduced (``fp16``/``bf16`` compression, your own).
"""

from __future__ import annotations

from shardline.parallel import comm_hooks
from shardline.parallel.api import STRATEGIES, distribute
from shardline.parallel.ddp import DistributedDataParallel
from shardline.parallel.precision import MixedPrecision
from shardline.parallel.zero import ShardedDataParallel, ShardedTensor

__all__ = [
    "STRATEGIES",
    "DistributedDataParallel",
    "MixedPrecision",
    "ShardedDataParallel",
    "ShardedTensor",
    "comm_hooks",
    "distribute",
]
