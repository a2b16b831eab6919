"""Distributed checkpointing: sharded, resharding on load, atomic; activation checkpointing.

- ``save``, ``load``: model and optimizer state of any strategy (plain, DDP, ZeRO-1/2/3),
  loadable into any other strategy and world size; ``extra`` training state and RNG states.
- ``latest``, ``info``, ``verify``, ``consolidate``: find, describe, check and export
  checkpoints (``shardline ckpt info|verify|consolidate`` on the command line).
- ``BlockShard``: a one-block ``shardline.parallel.Shard``, what a module's
  ``sharded_state_dict()`` returns for a tensor-parallel block (kept from earlier versions).
- ``activations``: activation checkpointing across ranks.
"""

from __future__ import annotations

from shardline.checkpoint import activations
from shardline.checkpoint.api import SaveHandle, load, save
from shardline.checkpoint.maintenance import consolidate, info, latest, verify
from shardline.parallel.contract import BlockShard

__all__ = [
    "BlockShard",
    "SaveHandle",
    "activations",
    "consolidate",
    "info",
    "latest",
    "load",
    "save",
    "verify",
]
