"""Data parallelism: every rank trains a replica (or a shard) of the whole model on its batch.

- ``ddp``: ``DistributedDataParallel``, replicas with bucketed, overlapped gradient all-reduce.
- ``zero``: ``ShardedDataParallel``, ZeRO stages 1/2/3 (FSDP) with automatic units.
"""

from __future__ import annotations

from shardline.parallel.data.ddp import DistributedDataParallel
from shardline.parallel.data.zero import ShardedDataParallel

__all__ = ["DistributedDataParallel", "ShardedDataParallel"]
