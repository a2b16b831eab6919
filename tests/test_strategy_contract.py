"""The strategy contract: a strategy the checkpointer has never heard of saves and reshards.

``Interleaved`` is a toy strategy written only against ``shardline.parallel.contract``: each
rank holds every other block of rows of each weight (two ``Box`` pieces per weight on two
ranks, one or more on others), every other range of each bias (``FlatRange`` pieces), and a
per-rank ``Local`` counter. Nothing in ``shardline.checkpoint`` names it, yet its checkpoints
load into a plain model, into DDP and ZeRO, and into itself at another world size, bit for bit;
and checkpoints of the built-in strategies load into it. The oracle is one process training the
whole model with the same gradients.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardline as sl
from shardline import checkpoint
from shardline.comm import ProcessGroup
from shardline.parallel import contract
from shardline.parallel.contract import Box, FlatRange, Local, Shard
from tests._ranks import run_ranks, seeded

pytestmark = pytest.mark.usefixtures("native")

ROWS = 4  # rows per block


def make() -> nn.Module:
    with seeded(0):
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8))


def grads(step: int, model: nn.Module) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def my_blocks(rows: int, rank: int, world: int) -> list[int]:
    """Row blocks this rank holds: rank, rank + world, ..."""
    return list(range(rank, -(-rows // ROWS), world))


class Interleaved(nn.Module):
    """The toy strategy (see the module docstring): local parameters, one per piece."""

    def __init__(self, full: nn.Module, rank: int, world: int) -> None:
        super().__init__()
        self.shapes = {n: tuple(p.shape) for n, p in full.named_parameters()}
        self.rank, self.world = rank, world
        self.pieces = nn.ParameterDict()
        self.where: dict[str, list[tuple[str, int]]] = {}  # name -> (piece key, start row)
        for name, p in full.named_parameters():
            self.where[name] = []
            for b in my_blocks(p.shape[0], rank, world):
                key = f"{name.replace('.', '_')}_{b}"
                lo = b * ROWS
                self.pieces[key] = nn.Parameter(p.detach()[lo : lo + ROWS].clone())
                self.where[name].append((key, lo))
        self.residual = torch.full((3,), float(rank))  # per rank by design

    def step_grads(self, full_grads: dict[str, torch.Tensor]) -> None:
        for name, parts in self.where.items():
            for key, lo in parts:
                self.pieces[key].grad = full_grads[name][lo : lo + ROWS].clone()
        self.residual += 1

    def _shard(self, name: str, tensors: dict[str, torch.Tensor]) -> Shard:
        shape = self.shapes[name]
        pieces: list[Box | FlatRange] = []
        for key, lo in self.where[name]:
            t = tensors[key]
            if len(shape) == 2:
                pieces.append(Box(t, (lo, 0)))
            else:
                pieces.append(FlatRange(t, lo))
        return Shard(shape, pieces)

    def layout(self) -> dict[str, Any]:
        return {"strategy": "interleaved", "mesh": {"dp": self.world}}

    def sharded_state_dict(self) -> dict[str, Any]:
        local = dict(self.pieces.items())
        out: dict[str, Any] = {n: self._shard(n, local) for n in self.where}
        out["residual"] = Local(self.residual)
        return out

    def load_sharded_state_dict(self, sd: dict[str, Any]) -> None:
        with torch.no_grad():
            for name, value in sd.items():
                if isinstance(value, Local):
                    self.residual.copy_(value.tensor)
                    continue
                for (key, _), piece in zip(self.where[name], value.pieces, strict=True):
                    if piece.tensor is not self.pieces[key]:
                        self.pieces[key].copy_(piece.tensor)

    def sharded_optim_state_dict(self, opt: torch.optim.Optimizer) -> dict[str, Any]:
        state: dict[str, dict[str, Any]] = {}
        for name, parts in self.where.items():
            first = opt.state.get(self.pieces[parts[0][0]], {}) if parts else {}
            entries: dict[str, Any] = {}
            for k, v in first.items():
                if torch.is_tensor(v) and v.dim() > 0:
                    tensors = {key: opt.state[self.pieces[key]][k] for key, _ in parts}
                    entries[k] = self._shard(name, tensors)
                else:
                    entries[k] = v
            if entries:
                state[name] = entries
        # the optimizer steps (this rank's pieces of) every parameter of the model
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": list(self.where)}
            for g in opt.param_groups
        ]
        return {"state": state, "param_groups": groups}

    def load_sharded_optim_state_dict(self, opt: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
        for name, entries in sd["state"].items():
            for i, (key, _) in enumerate(self.where[name]):
                # each piece steps its own counter: a shared ``step`` would count twice
                opt.state[self.pieces[key]] = {
                    k: v.pieces[i].tensor if isinstance(v, Shard) else _own(v)
                    for k, v in entries.items()
                }
        contract.apply_param_groups(opt, sd["param_groups"])

    def full(self, g: ProcessGroup) -> dict[str, torch.Tensor]:
        """Every rank's pieces put together (an all-gather of each piece, rank by rank)."""
        out = {}
        for name, shape in self.shapes.items():
            whole = torch.zeros(shape)
            for r in range(self.world):
                for b in my_blocks(shape[0], r, self.world):
                    lo = b * ROWS
                    rows = min(ROWS, shape[0] - lo)
                    part = torch.zeros((rows, *shape[1:]))
                    if r == self.rank:
                        part.copy_(self.pieces[f"{name.replace('.', '_')}_{b}"].detach())
                    g.broadcast(part, src=r)
                    whole[lo : lo + rows] = part
            out[name] = whole
        return out


def _own(value: Any) -> Any:
    return value.clone() if torch.is_tensor(value) else value


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def reference(steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = make()
    opt = adam(model.parameters())
    for s in range(steps):
        for n, p in model.named_parameters():
            p.grad = grads(s, model)[n].clone()
        opt.step()
    return model, opt


def train_toy(path: Path, world: int, steps: int) -> None:
    init = make()

    def body(g: ProcessGroup) -> None:
        toy = Interleaved(init, g.rank, g.world_size)
        opt = adam(toy.parameters())
        for s in range(steps):
            toy.step_grads(grads(s, init))
            opt.step()
        checkpoint.save(path, model=toy, optimizer=opt, group=g)

    run_ranks(world, body, timeout=60)


def test_a_new_strategy_loads_into_a_plain_model_bit_for_bit(tmp_path: Path) -> None:
    train_toy(tmp_path / "ck", 2, 2)
    info = checkpoint.info(tmp_path / "ck")
    assert info["strategy"] == "interleaved" and info["mesh"] == {"dp": 2}
    checkpoint.verify(tmp_path / "ck")
    want, want_opt = reference(2)
    plain = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8))
    opt = adam(plain.parameters())
    checkpoint.load(tmp_path / "ck", model=plain, optimizer=opt)
    for (n, p), q in zip(plain.named_parameters(), want.parameters(), strict=True):
        assert torch.equal(p, q), n
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][k], want_opt.state[q][k]), (n, k)
        assert float(opt.state[p]["step"]) == 2.0


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_a_new_strategy_and_the_built_in_ones_load_each_other(
    tmp_path: Path, strategy: str
) -> None:
    """toy at 2 -> DDP/ZeRO at 3 -> toy at 3 -> continue: equals the reference."""
    train_toy(tmp_path / "toy2", 2, 2)
    init = make()

    def builtin(g: ProcessGroup) -> dict[str, torch.Tensor]:
        torch.manual_seed(g.rank + 7)  # different values: the load must overwrite them
        plain = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8))
        model, opt = sl.distribute(plain, adam(plain.parameters()), strategy=strategy, group=g)
        checkpoint.load(tmp_path / "toy2", model=model, optimizer=opt, group=g)
        checkpoint.save(tmp_path / "builtin3", model=model, optimizer=opt, group=g)
        return {k: v.clone() for k, v in model.state_dict().items()}

    want, _ = reference(2)
    for got in run_ranks(3, builtin, timeout=90):
        for n, q in want.state_dict().items():
            assert torch.equal(got[n], q), n

    def toy3(g: ProcessGroup) -> dict[str, torch.Tensor]:
        toy = Interleaved(make(), g.rank, g.world_size)
        opt = adam(toy.parameters())
        checkpoint.load(tmp_path / "builtin3", model=toy, optimizer=opt, group=g)
        toy.step_grads(grads(2, init))
        opt.step()
        return toy.full(g)

    want3, _ = reference(3)
    for got in run_ranks(3, toy3, timeout=90):
        for n, q in want3.named_parameters():
            torch.testing.assert_close(got[n], q.detach(), rtol=0, atol=1e-6, msg=n)


def test_local_values_come_back_only_into_the_same_layout(tmp_path: Path) -> None:
    train_toy(tmp_path / "ck", 2, 3)  # residual: rank + 3 on each rank

    def load(g: ProcessGroup) -> list[float]:
        toy = Interleaved(make(), g.rank, g.world_size)
        checkpoint.load(tmp_path / "ck", model=toy, group=g)
        return toy.residual.tolist()

    assert run_ranks(2, load, timeout=60) == [[3.0] * 3, [4.0] * 3]
    # three ranks: another layout, so each keeps its own value (its rank)
    assert run_ranks(3, load, timeout=60) == [[0.0] * 3, [1.0] * 3, [2.0] * 3]


def test_the_checkpointer_names_no_strategy() -> None:
    """``checkpoint/`` reaches state only through the contract: no wrapper class, no name."""
    root = Path(sl.checkpoint.__file__).parent
    banned = re.compile(
        r"DistributedDataParallel|ShardedDataParallel|parallel\.data|zero\d|\"ddp\"|\"fsdp\"|"
        r"isinstance\(model"
    )
    for path in sorted(root.rglob("*.py")):
        if "activations" in path.parts or path.name.startswith("_activation"):
            continue  # activation checkpointing holds no model state
        hits = [
            f"{path.name}:{i}: {line.strip()}"
            for i, line in enumerate(path.read_text().splitlines(), 1)
            if banned.search(line)
        ]
        assert not hits, hits


def test_replicated_values_missing_on_a_rank_fail_every_rank_at_once(tmp_path: Path) -> None:
    """A replicated value must be on every rank (one rank writes it): a strategy that breaks
    that is named at commit, and no rank waits out the deadline for the commit."""

    class Uneven(nn.Module):
        def __init__(self, rank: int) -> None:
            super().__init__()
            self.rank = rank
            self.w = nn.Parameter(torch.ones(4))

        def sharded_state_dict(self) -> dict[str, Any]:
            extra = {"only_on_rank_1": torch.zeros(2)} if self.rank == 1 else {}
            return {"w": self.w, **extra}

    def body(g: ProcessGroup) -> str:
        with pytest.raises(sl.CheckpointError) as err:
            checkpoint.save(tmp_path / "ck", model=Uneven(g.rank), group=g)
        return str(err.value)

    # run_ranks fails ranks still running at 60 s; the commit deadline is 300 s
    messages = run_ranks(2, body, timeout=60)
    assert all("different replicated state" in m and "only_on_rank_1" in m for m in messages), (
        messages
    )
    assert not (tmp_path / "ck").exists()
