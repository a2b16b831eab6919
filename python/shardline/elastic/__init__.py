"""Elastic training: state committed in memory and restored in place after a failure.

``State`` is the first part of issue 19: commits in host memory, restored into the same
objects. Re-forming the group in place after a lost rank, and resharding to a new size, come
next (see the README's "Status and limits").
"""

from shardline.elastic.state import State

__all__ = ["State"]
