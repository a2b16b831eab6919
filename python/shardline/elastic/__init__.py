"""Elastic training: state committed in memory and restored in place after a failure.

``State`` commits a rank's share of the training state in host memory, with a copy at its
buddy rank, and restores it into the same objects. Re-forming the group in place after a lost
rank, and resharding to a new size, are not built yet (see the README's "Status and limits").
"""

from shardline.elastic.state import State

__all__ = ["State"]
