"""The main job's model and data: TinyGPT, its built-in corpus and each replica's batches.

``TinyGPT`` is a GPT-style byte-level language model whose output layer shares the token
embedding; ``as_sequential`` gives the same model as a chain of children for a pipeline. The
corpus is built in: English-like sentences from a small probabilistic grammar (deterministic
for a seed), tokenised as bytes. ``rank_batches`` says which windows each replica trains on,
step by step. ``shardline.examples.train`` trains it.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from shardline.data import DistributedSampler

__all__ = [
    "Block",
    "Config",
    "Embeddings",
    "Head",
    "TinyGPT",
    "as_sequential",
    "build_model",
    "corpus",
    "get_batch",
    "lm_loss",
    "positions",
    "rank_batches",
    "windows",
]

_SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the robot", "a small bird", "we"]
_VERBS = ["sees", "likes", "follows", "paints", "finds", "remembers", "builds"]
_OBJECTS = ["the river", "a red ball", "the quiet house", "an apple", "the stars", "a song"]
_ENDINGS = ["in the morning", "after dinner", "with care", "every day", "at night", "again"]


def corpus(num_chars: int = 200_000, seed: int = 0) -> torch.Tensor:
    """Bytes of generated sentences ("the robot paints a song at night. ..."), as int64."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < num_chars:
        sentence = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        if rng.random() < 0.5:
            sentence += f" {rng.choice(_ENDINGS)}"
        sentence += ". "
        parts.append(sentence)
        size += len(sentence)
    data = "".join(parts)[:num_chars].encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


@dataclass(frozen=True)
class Config:
    """Model and run settings (the defaults finish in well under a minute on 2 cores)."""

    steps: int = 150
    batch_size: int = 16  # sequences per process and step (a replica of W processes: W x it)
    seq_len: int = 64
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    lr: float = 3e-3
    seed: int = 0
    vocab: int = 256


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
        )
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.d_model // cfg.num_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` plus attention, then plus the MLP (each after its layer norm)."""
        # Heads and sequence length come from q, not from x: under tensor parallelism a rank
        # computes its heads only, and with sequence parallelism x is its part of the sequence.
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        b, n = q.shape[:2]
        q, k, v = (z.view(b, n, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, n, -1))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


def positions(idx: torch.Tensor) -> torch.Tensor:
    """Each sample's positions, ``[batch, n]``.

    One row per sample, so that the position embedding's gradient is summed per sample (what
    deterministic mode needs) rather than over the batch by autograd.
    """
    return torch.arange(idx.shape[1], device=idx.device).expand(idx.shape[0], -1)


class TinyGPT(nn.Module):
    """A GPT-style byte-level language model; the output layer shares the embedding."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.Sequential(*(Block(cfg) for _ in range(cfg.num_layers)))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight
        # The loss of the logits: tensor parallelism swaps in the vocabulary-parallel one.
        self.loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss
        for m in self.modules():
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross-entropy of ``idx`` against ``targets``."""
        x = self.blocks(self.tok(idx) + self.pos(positions(idx)))
        return self.loss_fn(self.head(self.ln(x)), targets)


class Embeddings(nn.Module):
    """TinyGPT's token and position embeddings: the first stage of its pipeline."""

    def __init__(self, tok: nn.Embedding, pos: nn.Embedding) -> None:
        super().__init__()
        self.tok, self.pos = tok, pos

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token plus position embeddings of ``idx``."""
        out: torch.Tensor = self.tok(idx) + self.pos(positions(idx))
        return out


class Head(nn.Module):
    """TinyGPT's final norm and output layer (its weight is the token embedding's)."""

    def __init__(self, ln: nn.LayerNorm, head: nn.Linear) -> None:
        super().__init__()
        self.ln, self.head = ln, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The logits of ``x``."""
        out: torch.Tensor = self.head(self.ln(x))
        return out


def as_sequential(model: TinyGPT) -> nn.Sequential:
    """The same model (the same parameter objects) as a chain of children, for a pipeline."""
    blocks = [(f"block{i}", b) for i, b in enumerate(model.blocks)]
    return nn.Sequential(
        OrderedDict(
            [
                ("embed", Embeddings(model.tok, model.pos)),
                *blocks,
                ("head", Head(model.ln, model.head)),
            ]
        )
    )


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy of ``logits`` against ``targets``."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build_model(cfg: Config) -> TinyGPT:
    """The model, initialised from ``cfg.seed`` (identical on every rank)."""
    torch.manual_seed(cfg.seed)
    return TinyGPT(cfg)


def windows(tokens: torch.Tensor, cfg: Config) -> int:
    """Number of non-overlapping training windows of ``seq_len + 1`` bytes."""
    return (tokens.numel() - 1) // cfg.seq_len


def get_batch(
    tokens: torch.Tensor, indices: list[int], cfg: Config
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets for windows ``indices``."""
    rows = torch.stack(
        [tokens[i * cfg.seq_len : i * cfg.seq_len + cfg.seq_len + 1] for i in indices]
    )
    return rows[:, :-1], rows[:, 1:]


def rank_batches(
    n: int, rank: int, world_size: int, cfg: Config, size: int | None = None
) -> list[list[int]]:
    """The window indices replica ``rank`` of ``world_size`` trains on, step by step.

    ``size`` windows a step (``cfg.batch_size`` when ``None``); epochs are chained.
    """
    size = cfg.batch_size if size is None else size
    sampler = DistributedSampler(n, num_replicas=world_size, rank=rank, seed=cfg.seed)
    batches: list[list[int]] = []
    epoch = 0
    while len(batches) < cfg.steps:
        sampler.set_epoch(epoch)
        order = list(sampler)
        for start in range(0, len(order) - size + 1, size):
            batches.append(order[start : start + size])
        epoch += 1
    return batches[: cfg.steps]
