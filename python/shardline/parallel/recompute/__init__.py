"""Activation checkpointing across ranks: recompute in backward, and a distributed store.

- ``checkpoint(fn, *args)``: PyTorch's non-reentrant activation checkpointing
  (``torch.utils.checkpoint.checkpoint``): ``fn``'s intermediate activations are not kept for
  backward but recomputed from its inputs, with the RNG state of the forward (dropout matches).
  Inside ``ActivationCheckpointManager.activate()`` it also records the bytes it did not keep.
- ``recompute_blocks(model, "selective" | "full")``: every repeated block of a model
  recomputes in backward: its norms', activations' and products' outputs, from what their
  backward nodes keep (``"selective"``, ``selective.py``), or its whole forward from its input
  (``"full"``); ``sl.distribute(..., recompute=...)`` applies it for any strategy.
- ``ActivationCheckpointManager``: activations kept by layer id under a placement policy
  (``"local"``, ``"first_rank"``, ``"partition"``), fetched from their owners on demand, with
  memory statistics gathered over the group.

Which calls are collective (every rank of the group calls them, in the same order):
``register_and_broadcast``, ``sync_keys``, ``fetch``, ``clear``, ``memory_stats``, and ``get``
of a ``"first_rank"`` or ``"partition"`` entry. Everything else is local. A collective that
loses a peer raises the group's error (``PeerLostError``, ``CollectiveTimeoutError`` after the
group's deadline) on every survivor; none of them waits forever.
"""

from __future__ import annotations

from shardline.parallel.recompute.blocks import (
    RECOMPUTE_POLICIES,
    find_blocks,
    recompute_blocks,
)
from shardline.parallel.recompute.policies import POLICIES, LayerId, Policy
from shardline.parallel.recompute.region import checkpoint
from shardline.parallel.recompute.statistics import ActivationMemoryStats, format_bytes
from shardline.parallel.recompute.store import ActivationCheckpointManager

__all__ = [
    "POLICIES",
    "RECOMPUTE_POLICIES",
    "ActivationCheckpointManager",
    "ActivationMemoryStats",
    "LayerId",
    "Policy",
    "checkpoint",
    "find_blocks",
    "format_bytes",
    "recompute_blocks",
]
