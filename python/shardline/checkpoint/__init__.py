"""Distributed checkpointing: sharded, resharding on load, atomic; activation checkpointing.

- ``save``, ``load``: model and optimizer state of any strategy (plain, DDP, ZeRO-1/2/3),
  loadable into any other strategy and world size; ``extra`` training state and RNG states.
- ``latest``, ``info``, ``verify``, ``consolidate``: find, describe, check and export
  checkpoints (``shardline ckpt info|verify|consolidate`` on the command line).
- ``activations``: activation checkpointing across ranks.
"""

from __future__ import annotations

from shardline.checkpoint import activations
from shardline.checkpoint.api import (
    SaveHandle,
    consolidate,
    info,
    latest,
    load,
    save,
    verify,
)

__all__ = [
    "SaveHandle",
    "activations",
    "consolidate",
    "info",
    "latest",
    "load",
    "save",
    "verify",
]
