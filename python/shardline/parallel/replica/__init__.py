"""Strategies where every rank keeps a whole replica and replicas meet less often than DDP's.

- ``local_sgd``: ``LocalSGD`` (each rank steps alone, replicas averaged every ``sync_every``
  steps) and DiLoCo (an outer optimizer over the averaged change).
- ``async_sgd``: workers push gradients to a sharded parameter server (``param_server``), with
  no barrier.
- ``hogwild``: one host's ranks step one shared copy of the parameters.
- ``base``: what they share (``Replica``).

Reach them through ``sl.distribute(..., strategy="local_sgd" | "async" | "hogwild")``.
"""
