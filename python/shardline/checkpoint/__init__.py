"""Distributed checkpointing: sharded, resharding on load, atomic; activation checkpointing.

- ``save``, ``load``: model and optimizer state of any strategy (plain, DDP, ZeRO-1/2/3),
  loadable into any other strategy and world size; ``extra`` training state and RNG states.
- ``latest``, ``info``, ``verify``, ``consolidate``: find, describe, check and export
  checkpoints (``shardline ckpt info|verify|consolidate`` on the command line).
"""

from __future__ import annotations

from shardline.checkpoint.api import SaveHandle, load, save
from shardline.checkpoint.maintenance import consolidate, info, latest, verify

__all__ = [
    "SaveHandle",
    "consolidate",
    "info",
    "latest",
    "load",
    "save",
    "verify",
]
