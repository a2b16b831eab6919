"""Tensor-parallel (rectangular) shards in checkpoints: ``Shard.box`` from a module's
``sharded_state_dict()``, loaded into the whole tensor, into blocks again and into ZeRO shards.

Oracle: one process training the whole model with the same gradients. AdamW is elementwise, so
each rank's block after a step equals the same block of the whole model after the step, bit for
bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardline as sl
from shardline import checkpoint
from shardline.errors import CheckpointError
from shardline.parallel import Shard
from tests._ranks import run_ranks

pytestmark = pytest.mark.usefixtures("native")

D, H = 6, 8  # model width, hidden width (split across ranks)


class Full(nn.Module):
    """norm -> up (H x D) -> relu -> down (D x H), as one process holds it."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, H, bias=False)
        self.down = nn.Linear(H, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.norm(x))))


class ColumnRow(nn.Module):
    """Megatron-style split on ``n`` ranks: ``up`` by output rows, ``down`` by input columns."""

    def __init__(self, full: Full, rank: int, n: int) -> None:
        super().__init__()
        h = H // n
        self.rows = (rank * h, (rank + 1) * h)
        self.norm = nn.LayerNorm(D)
        self.norm.load_state_dict(full.norm.state_dict())
        self.up = nn.Linear(D, h, bias=False)
        self.down = nn.Linear(h, D, bias=False)
        with torch.no_grad():
            self.up.weight.copy_(full.up.weight[self.rows[0] : self.rows[1]])
            self.down.weight.copy_(full.down.weight[:, self.rows[0] : self.rows[1]])

    def sharded_state_dict(self) -> dict[str, Any]:
        lo = self.rows[0]
        return {
            "norm.weight": self.norm.weight,
            "norm.bias": self.norm.bias,
            "up.weight": Shard.box(self.up.weight, (H, D), (lo, 0)),
            "down.weight": Shard.box(self.down.weight, (D, H), (0, lo)),
        }


SHAPES = {"norm.weight": (D,), "norm.bias": (D,), "up.weight": (H, D), "down.weight": (D, H)}


def grads(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g) for n, shape in SHAPES.items()}


def block_of(name: str, full: torch.Tensor, rows: tuple[int, int]) -> torch.Tensor:
    if name == "up.weight":
        return full[rows[0] : rows[1]]
    if name == "down.weight":
        return full[:, rows[0] : rows[1]]
    return full


def step(model: nn.Module, opt: torch.optim.Optimizer, g: dict[str, torch.Tensor]) -> None:
    rows = getattr(model, "rows", (0, H))
    for name, p in model.named_parameters():
        p.grad = block_of(name, g[name], rows).clone()
    opt.step()


@pytest.fixture
def reference() -> tuple[Full, torch.optim.Optimizer]:
    """The whole model after two AdamW steps."""
    full = Full(0)
    opt = torch.optim.AdamW(full.parameters(), lr=0.1, weight_decay=0.1)
    for s in (1, 2):
        step(full, opt, grads(s))
    return full, opt


def save_column_row(path: Path, n: int) -> None:
    """Trains the split model on ``n`` thread ranks like the reference, then saves it."""
    init = Full(0)  # built here: thread ranks share torch's global generator

    def body(g: Any) -> None:
        tp = ColumnRow(init, g.rank, n)
        opt = torch.optim.AdamW(tp.parameters(), lr=0.1, weight_decay=0.1)
        for s in (1, 2):
            step(tp, opt, grads(s))
        checkpoint.save(path, model=tp, optimizer=opt, group=g)

    run_ranks(n, body, timeout=60)


def test_blocks_load_into_the_whole_model_bit_for_bit(tmp_path: Path, reference: Any) -> None:
    full, full_opt = reference
    save_column_row(tmp_path / "ck", 2)
    assert checkpoint.info(tmp_path / "ck")["files"] == 2
    checkpoint.verify(tmp_path / "ck")
    model = Full(seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    checkpoint.load(tmp_path / "ck", model=model, optimizer=opt)
    for (name, p), q in zip(model.named_parameters(), full.parameters(), strict=True):
        assert torch.equal(p, q), name
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][k], full_opt.state[q][k]), f"{name} {k}"
    out = checkpoint.consolidate(tmp_path / "ck", tmp_path / "hf")
    from safetensors.torch import load_file

    exported = load_file(str(out[0]))
    for name, q in full.state_dict().items():
        assert torch.equal(exported[name], q), name


@pytest.mark.parametrize("n_load", [1, 2, 4])
def test_blocks_load_into_other_splits(tmp_path: Path, reference: Any, n_load: int) -> None:
    full, full_opt = reference
    save_column_row(tmp_path / "ck", 2)
    want = {n: full_opt.state[p] for n, p in full.named_parameters()}
    other = Full(7)

    def body(g: Any) -> None:
        tp = ColumnRow(other, g.rank, n_load)
        opt = torch.optim.AdamW(tp.parameters(), lr=0.1, weight_decay=0.1)
        checkpoint.load(tmp_path / "ck", model=tp, optimizer=opt, group=g)
        for name, p in tp.named_parameters():
            whole = dict(full.named_parameters())[name]
            assert torch.equal(p, block_of(name, whole, tp.rows)), name
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(opt.state[p][k], block_of(name, want[name][k], tp.rows))

    run_ranks(n_load, body, timeout=60)


def test_blocks_load_into_zero3_shards(tmp_path: Path, reference: Any) -> None:
    full, _ = reference
    save_column_row(tmp_path / "ck", 2)

    plains = [Full(seed=9) for _ in range(3)]

    def body(g: Any) -> dict[str, torch.Tensor]:
        plain = plains[g.rank]
        opt = torch.optim.AdamW(plain.parameters(), lr=0.1)
        model, opt = sl.distribute(plain, opt, strategy="zero3", group=g, unit_mb=0.0001)
        checkpoint.load(tmp_path / "ck", model=model, group=g)
        return {k: v.clone() for k, v in model.state_dict().items()}

    for got in run_ranks(3, body, timeout=60):
        for name, q in full.state_dict().items():
            assert torch.equal(got[name], q), name


def test_a_block_outside_its_tensor_is_refused(tmp_path: Path) -> None:
    class Bad(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3, 4))

        def sharded_state_dict(self) -> dict[str, Any]:
            return {"w": Shard.box(self.w, (4, 4), (2, 0))}

    with pytest.raises(CheckpointError, match=r"'model/w'.*\[3, 4\] at offsets \[2, 0\]"):
        checkpoint.save(tmp_path / "ck", model=Bad())


def test_a_missing_block_is_reported(tmp_path: Path) -> None:
    """Only rank 0's half saved (as if rank 1 held nothing): loading the whole tensor fails."""

    class Half(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(2, 4))

        def sharded_state_dict(self) -> dict[str, Any]:
            return {"w": Shard.box(self.w, (4, 4), (0, 0))}

    checkpoint.save(tmp_path / "ck", model=Half())
    with pytest.raises(CheckpointError, match="covered"):
        checkpoint.verify(tmp_path / "ck")
    whole = nn.Module()
    whole.w = nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(CheckpointError, match="in no shard file"):
        checkpoint.load(tmp_path / "ck", model=whole)
