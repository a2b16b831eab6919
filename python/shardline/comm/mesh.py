"""``DeviceMesh``: ranks laid out on a grid with named axes, a ProcessGroup per axis."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import timedelta
from itertools import product

from shardline.comm.group import ProcessGroup
from shardline.comm.world import default_group
from shardline.errors import InvalidArgumentError

__all__ = ["DeviceMesh"]


class DeviceMesh:
    """Ranks of a group arranged row-major on a grid, e.g. ``DeviceMesh({"dp": 2, "tp": 4})``.

    Along each axis the ranks that differ only in that coordinate form a ProcessGroup:
    ``mesh.group("tp")`` holds this rank and the other tensor-parallel ranks of its row.
    Every rank of ``group`` must build the same mesh (it creates sub-groups collectively).

    Args:
        shape: Sizes per axis, as a tuple (``(2, 4)``) or a mapping ``{"dp": 2, "tp": 4}``.
        axis_names: Names for a tuple shape; default ``("axis0", "axis1", ...)``.
        group: The group to lay out; the default group when ``None``.
        timeout: The per-axis groups' ``timeout`` (seconds or a ``timedelta``); ``group``'s
            when ``None``.

    Raises:
        InvalidArgumentError: the shape does not multiply to the group's size, or names clash.
    """

    def __init__(
        self,
        shape: Sequence[int] | Mapping[str, int],
        axis_names: Sequence[str] | None = None,
        *,
        group: ProcessGroup | None = None,
        timeout: timedelta | float | None = None,
    ) -> None:
        if isinstance(shape, Mapping):
            if axis_names is not None:
                raise InvalidArgumentError("DeviceMesh: pass axis_names or a dict shape, not both")
            axis_names, shape = list(shape.keys()), list(shape.values())
        dims = tuple(int(s) for s in shape)
        names = (
            tuple(axis_names)
            if axis_names is not None
            else tuple(f"axis{i}" for i in range(len(dims)))
        )
        if group is None:
            group = default_group()
        if len(names) != len(dims) or len(set(names)) != len(names):
            raise InvalidArgumentError(
                f"DeviceMesh on rank {group.rank}: need one distinct name per axis, got {names} "
                f"for shape {dims}"
            )
        if not dims or any(d < 1 for d in dims) or math.prod(dims) != group.world_size:
            raise InvalidArgumentError(
                f"DeviceMesh on rank {group.rank}: shape {dims} holds {math.prod(dims)} ranks but "
                f"the group has {group.world_size}; make the axis sizes multiply to world_size"
            )
        self.shape = dims
        self.axis_names = names
        self.parent = group
        self.coordinate = _unravel(group.rank, dims)
        self._groups: dict[str, ProcessGroup] = {}
        for axis, name in enumerate(names):
            others = [range(d) if i != axis else range(1) for i, d in enumerate(dims)]
            for fixed in product(*others):
                ranks = [
                    _ravel((*fixed[:axis], k, *fixed[axis + 1 :]), dims) for k in range(dims[axis])
                ]
                sub = group.new_group(ranks, timeout=timeout)
                if sub is not None:
                    self._groups[name] = sub

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape, strict=True))
        return f"DeviceMesh({axes}; coordinate={self.coordinate})"

    def _axis(self, axis: str | int) -> int:
        if isinstance(axis, int):
            if not 0 <= axis < len(self.shape):
                raise InvalidArgumentError(f"DeviceMesh: no axis {axis} in {self.axis_names}")
            return axis
        if axis not in self.axis_names:
            raise InvalidArgumentError(f"DeviceMesh: no axis {axis!r}; axes are {self.axis_names}")
        return self.axis_names.index(axis)

    def group(self, axis: str | int) -> ProcessGroup:
        """The ProcessGroup of this rank along ``axis`` (a name or an index)."""
        return self._groups[self.axis_names[self._axis(axis)]]

    def size(self, axis: str | int | None = None) -> int:
        """Number of ranks along ``axis``, or in the whole mesh when ``None``."""
        return math.prod(self.shape) if axis is None else self.shape[self._axis(axis)]

    def local_rank(self, axis: str | int) -> int:
        """This rank's coordinate along ``axis``."""
        return self.coordinate[self._axis(axis)]

    def shutdown(self) -> None:
        """Shuts down the per-axis groups."""
        for g in self._groups.values():
            g.shutdown()


def _unravel(rank: int, dims: tuple[int, ...]) -> tuple[int, ...]:
    coord = []
    for d in reversed(dims):
        coord.append(rank % d)
        rank //= d
    return tuple(reversed(coord))


def _ravel(coord: Sequence[int], dims: tuple[int, ...]) -> int:
    rank = 0
    for c, d in zip(coord, dims, strict=True):
        rank = rank * d + c
    return rank
