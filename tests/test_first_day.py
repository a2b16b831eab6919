"""What a new user meets first: the install, the version, and where a layout lives when asked
by the wrong name."""

from __future__ import annotations

import re
from pathlib import Path

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


ROOT = Path(__file__).resolve().parents[1]


def test_the_install_says_what_it_does_before_each_long_step() -> None:
    # A first install downloads gigabytes and compiles Rust: each such command of .ci/run (the
    # README's two commands) is announced before it starts, never minutes of silence.
    lines = (ROOT / ".ci" / "run").read_text().split("\n")
    long = [
        i
        for i, line in enumerate(lines)
        if re.match(r"\s*(uv_install |cargo test|\"\$PY\" -m pytest|\"\$VENV/bin/mkdocs\")", line)
    ]
    assert len(long) >= 5
    for i in long:
        before = [line.strip() for line in lines[max(0, i - 6) : i]]
        assert any(line.startswith("say ") for line in before), lines[i]


def test_the_readme_says_what_an_install_takes() -> None:
    readme = (ROOT / "README.md").read_text()
    install = readme[readme.index("## Install") :]
    install = install[: install.index("\n## ", 1)]
    for what in ("Rust toolchain", "GB", "minutes", "already has torch"):
        assert what in install, what
    assert len(readme.split("\n")) <= 300


def test_composition_without_a_mesh_shows_the_tensor_parallel_axis_too() -> None:
    with pytest.raises(InvalidArgumentError, match="mesh=") as err:
        sl.distribute(torch.nn.Linear(2, 2), None, strategy={"dp": "ddp", "tp": "auto"})
    assert "'tp': 'auto'" in str(err.value) and "'pp': '1f1b'" in str(err.value)
    doc = sl.distribute.__doc__ or ""
    assert '"tp": "auto"' in doc and '``"tp"``' in doc
