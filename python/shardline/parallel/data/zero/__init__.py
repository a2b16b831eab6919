"""ZeRO stages 1, 2 and 3 (FSDP): ``ShardedDataParallel`` and the parts it is built from.

- ``wrapper``: ``ShardedDataParallel``, construction and the public API (the design is in
  its docstring); it owns one object per role below and delegates to them (the object graph
  is in ``base``'s docstring):
- ``layout``: units built from a plan and re-formed in execution order, a ``UnitLayout``;
- ``schedule``: forward and backward hooks, all-gathers and reductions, in fixed orders, a
  ``GatherReduceSchedule``;
- ``held``: steps a caller drives (a pipeline stage): whole parameters held over its
  micro-batches, their gradients reduced once, a ``HeldSteps``;
- ``state_dicts``: full and sharded state dicts (the strategy contract), a ``StateDicts``;
- ``binding``: optimizers pointed at the shards, an ``OptimizerBinding``;
- ``base``: the fields the parts share, and the ``TrainingState`` enum;
- ``units``: one unit's flat buffers and shard; ``grouping``: which parameters form a unit.
"""

from __future__ import annotations

from shardline.parallel.data.zero.wrapper import ShardedDataParallel

__all__ = ["ShardedDataParallel"]
