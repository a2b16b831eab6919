"""Shared by the ZeRO tests: a tiny LM and its data, the one-process reference of a ZeRO run,
our ZeRO stages' training loop, and a wide model planned and then trained.

Ranks run as threads (``run_ranks``). The single-process reference trains the same model on
the average of every rank's loss, which is what data parallelism computes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import shardline as sl
from shardline.comm import ProcessGroup
from shardline.parallel import MixedPrecision, ShardedDataParallel

VOCAB, DIM, SEQ, ROWS = 32, 16, 6, 4
_INIT = threading.Lock()  # rank threads share torch's global generator
UNIT_MB = 0.004  # ~4 KiB units: several units even in these tiny models


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.nn.functional.gelu(self.up(self.norm(h))))


class TinyLM(nn.Module):
    """Embedding tied to the output head, a few blocks, optionally a frozen first block."""

    def __init__(self, depth: int = 3, *, tied: bool = True, frozen: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(depth))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        if frozen:
            self.blocks[0].requires_grad_(False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))


def make(seed: int = 0, **kw: Any) -> TinyLM:
    with _INIT:
        torch.manual_seed(seed)
        return TinyLM(**kw)


def batch(step: int, rank: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=g), torch.randint(
        0, VOCAB, (ROWS, SEQ), generator=g
    )


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


def adamw(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    """AdamW with two param groups: no weight decay on biases, norms and the embedding."""
    decay = [p for n, p in named if n.endswith("weight") and "norm" not in n and "embed" not in n]
    rest = [p for n, p in named if not any(p is q for q in decay)]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-2
    )


def sgd_momentum(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for _, p in named], lr=0.1, momentum=0.9)


OPTIMIZERS = {"adamw": adamw, "sgd_momentum": sgd_momentum}


def reference(
    n: int,
    steps: int,
    make_opt: Callable[..., torch.optim.Optimizer],
    *,
    accum: int = 1,
    clip: float | None = None,
    **model_kw: Any,
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """One process, the average of every rank's loss (and micro-batch) per step.

    Returns the losses, the final state dict and the optimizer state by parameter name.
    """
    model = make(**model_kw)
    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    opt = make_opt(named)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for m in range(accum):
            loss = sum(lm_loss(model(x), y) for x, y in (batch(step, r, m) for r in range(n)))
            (loss / (n * accum)).backward()
            total += float(loss.detach()) / n
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(total)
    by_name = {k: opt.state[p] for k, p in named if p in opt.state}
    return losses, {k: v.clone() for k, v in model.state_dict().items()}, by_name


def train(
    g: ProcessGroup,
    stage: int,
    steps: int,
    make_opt: Callable[..., torch.optim.Optimizer],
    *,
    accum: int = 1,
    clip: float | None = None,
    no_sync: bool = False,
    mixed_precision: MixedPrecision | None = None,
    offload: str | None = None,
    **model_kw: Any,
) -> tuple[list[float], dict[str, torch.Tensor], ShardedDataParallel, torch.optim.Optimizer]:
    """Our ZeRO stage on this rank; returns its (rank-averaged) losses and final state."""
    torch.set_num_threads(1)
    plain = make(**model_kw)
    opt = make_opt([(k, p) for k, p in plain.named_parameters() if p.requires_grad])
    model, opt = sl.distribute(
        plain,
        opt,
        strategy=f"zero{stage}",
        group=g,
        unit_mb=UNIT_MB,
        mixed_precision=mixed_precision,
        offload=offload,
    )
    assert isinstance(model, ShardedDataParallel) and opt is not None
    losses = []
    for step in range(steps):
        opt.zero_grad()
        total = torch.zeros(1)
        for m in range(accum):
            x, y = batch(step, g.rank, m)
            sync = not no_sync or m == accum - 1
            ctx = model.no_sync() if not sync else _null()
            with ctx:
                loss = lm_loss(model(x), y)
                (loss / accum).backward()
            total += loss.detach().float()
        if clip is not None:
            model.clip_grad_norm_(clip)
        opt.step()
        g.all_reduce(total, op="avg")
        losses.append(float(total))
    return losses, model.state_dict(), model, opt


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


def assert_state_close(
    ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], atol: float = 1e-5
) -> None:
    assert ours.keys() == ref.keys()
    for k, want in ref.items():
        torch.testing.assert_close(ours[k], want, rtol=1e-4, atol=atol, msg=k)


class Wide(nn.Module):
    """Large units, so padding is negligible against the bytes-per-parameter formulas."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def planned_then_trained(
    g: ProcessGroup, stage: int, **options: Any
) -> tuple[sl.MemoryEstimate, ShardedDataParallel, torch.optim.Optimizer]:
    """A ``Wide`` model's ``estimate_memory`` at ``stage`` (with ``options``), then the model
    distributed the same way and trained two AdamW steps (the memory tests' measured side)."""
    with _INIT:
        torch.manual_seed(0)
        plain = Wide()
    strategy = f"zero{stage}"
    planned = sl.estimate_memory(plain, world_size=g.world_size, strategy=strategy, **options)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    model, opt = sl.distribute(plain, opt, strategy=strategy, group=g, **options)
    assert isinstance(model, ShardedDataParallel) and opt is not None
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 256)).float().square().mean().backward()
        opt.step()
    return planned, model, opt
