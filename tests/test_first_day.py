"""What a new user meets first: the version, and where a layout lives when asked by the wrong
name."""

from __future__ import annotations

import pytest
import torch

import shardline as sl
from shardline.cli import main
from shardline.errors import InvalidArgumentError


def test_version_names_shardline_its_engine_and_torch(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"shardline {sl.__version__} (engine ")
    assert f"torch {torch.__version__})" in out


@pytest.mark.parametrize(
    ("name", "where"),
    [("pp", "sl.pipeline(model, group"), ("1f1b", "mesh=sl.DeviceMesh"), ("tp", "tensor_parallel")],
)
def test_a_pipeline_or_tensor_strategy_by_name_points_to_where_it_lives(
    name: str, where: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=f"unknown strategy '{name}'") as err:
        sl.distribute(torch.nn.Linear(2, 2), None, strategy=name)
    assert where in str(err.value) and "'tp': 'auto'" in str(err.value)
