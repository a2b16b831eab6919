"""DeviceMesh: coordinates, sizes and a working group per named axis."""

from __future__ import annotations

import pytest
import torch

from shardline import DeviceMesh, InvalidArgumentError
from shardline.comm import ProcessGroup
from tests._ranks import run_ranks


def test_mesh_groups_reduce_along_each_axis(backend: str) -> None:
    def body(g: ProcessGroup) -> tuple[tuple[int, ...], float, float, int]:
        mesh = DeviceMesh({"dp": 2, "tp": 3}, group=g)
        tp = torch.tensor([float(g.rank)])
        mesh.group("tp").all_reduce(tp)
        dp = torch.tensor([float(g.rank)])
        mesh.group("dp").all_reduce(dp)
        return mesh.coordinate, tp.item(), dp.item(), mesh.size("tp")

    results = run_ranks(6, body, backend=backend)
    for rank, (coord, tp, dp, tp_size) in enumerate(results):
        row, col = divmod(rank, 3)
        assert coord == (row, col)
        assert tp == sum(range(3 * row, 3 * row + 3))
        assert dp == col + (col + 3)
        assert tp_size == 3


def test_mesh_rejects_wrong_shape() -> None:
    def body(g: ProcessGroup) -> str:
        with pytest.raises(InvalidArgumentError, match="multiply to world_size") as info:
            DeviceMesh((3, 3), axis_names=("a", "b"), group=g)
        return str(info.value)

    assert "rank 0" in run_ranks(1, body, backend="gloo")[0]
