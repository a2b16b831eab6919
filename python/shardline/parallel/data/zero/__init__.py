"""ZeRO stages 1, 2 and 3 (FSDP): ``ShardedDataParallel`` and the parts it is built from.

- ``wrapper``: ``ShardedDataParallel``, construction and the public API (the design is in
  its docstring);
- ``state_dicts``: full and sharded state dicts (the strategy contract);
- ``schedule``: forward and backward hooks, all-gathers and reductions, in fixed orders;
- ``held``: steps a caller drives (a pipeline stage): whole parameters held over its
  micro-batches, their gradients reduced once;
- ``layout``: units built from a plan and re-formed in execution order;
- ``base``: the fields the parts share, and the ``TrainingState`` enum;
- ``units``: one unit's flat buffers and shard; ``grouping``: which parameters form a unit.
"""

from __future__ import annotations

from shardline.parallel.data.zero.wrapper import ShardedDataParallel

__all__ = ["ShardedDataParallel"]
