"""The planner tests' model: a small ``TinyGPT`` built the same on every rank, and its batches."""

from __future__ import annotations

import torch

from shardline.examples.train import Config, TinyGPT
from tests._ranks import seeded

__all__ = ["CFG", "gpt", "tokens"]

CFG = Config(d_model=32, num_layers=2, num_heads=2, seq_len=16)


def gpt() -> TinyGPT:
    """The model, seeded: the same weights on every rank (threads build one at a time)."""
    with seeded(0):
        return TinyGPT(CFG)


def tokens(rank: int, batch: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of ``batch`` sequences: inputs and targets."""
    gen = torch.Generator().manual_seed(rank)
    x = torch.randint(0, CFG.vocab, (batch, CFG.seq_len), generator=gen)
    return x, torch.randint(0, CFG.vocab, (batch, CFG.seq_len), generator=gen)
