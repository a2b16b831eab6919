"""Elastic training: ranks leave and join, state is restored from memory, training goes on.

``State`` commits a rank's share of the training state in host memory, with a copy at its
buddy rank, and restores it into the same objects. ``run`` re-enters the training function
after a membership change of an elastic job (``shardline run --nnodes MIN:MAX``, launched by
``shardline.launch.agent``), with the group re-formed and the state resharded to the new size.
"""

from shardline.elastic import job  # noqa: F401  (tells parallel.joining how to know)
from shardline.elastic.run import run
from shardline.elastic.state import State

__all__ = ["State", "run"]
