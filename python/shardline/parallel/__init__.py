"""Parallel strategies: wrappers around a plain model and optimizer.

- ``distribute``: one call, strategy by name.
- ``DistributedDataParallel``: replicas with bucketed, overlapped gradient all-reduce.
- ``comm_hooks``: how a gradient bucket is reduced (``fp16``/``bf16`` compression, your own).
"""

from __future__ import annotations

from shardline.parallel import comm_hooks
from shardline.parallel.api import STRATEGIES, distribute
from shardline.parallel.ddp import DistributedDataParallel

__all__ = ["STRATEGIES", "DistributedDataParallel", "comm_hooks", "distribute"]
