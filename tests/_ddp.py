"""What the DDP tests share: a small MLP, its batches and the kinds of bucket.

Also torch's Gloo group for a thread rank, and our DDP run beside torch's in every rank.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from shardline.comm import ProcessGroup
from tests._ranks import run_ranks, shared_store

IN, HIDDEN, OUT = 12, 24, 5
INF = float("inf")
# How gradients reach the collective: large ones reduced where autograd left them, all copied
# into ordinary buckets, or into buckets in symmetric memory (the default on one host).
BUCKETS = [{"in_place_mb": 0.0, "symmetric": False}, {"in_place_mb": INF, "symmetric": False}, {}]
BUCKET_IDS = ["in-place", "packed", "symmetric"]
# Rank threads share torch's global generator: models are built under this lock.
INIT_LOCK = threading.Lock()


def mlp(seed: int = 0, *, batchnorm: bool = False) -> nn.Module:
    with INIT_LOCK:
        torch.manual_seed(seed)
        return _mlp(batchnorm)


def _mlp(batchnorm: bool) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(IN, HIDDEN)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(HIDDEN))
    layers += [nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT)]
    return nn.Sequential(*layers)


def batch(step: int, rank: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(rows, IN, generator=g), torch.randn(rows, OUT, generator=g)


def torch_gloo(shared: dist.Store, rank: int, world_size: int) -> dist.ProcessGroup:
    """A torch ProcessGroup on Gloo for one thread-rank (torch's DDP needs the c10d wrapper),
    rendezvousing in ``shared``, the ranks' in-memory store (``run_ranks`` says why)."""
    store = dist.PrefixStore("torch-ddp", shared)
    gloo = dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=30))
    pg = dist.ProcessGroup(store, rank, world_size)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    return pg


def train(
    model: nn.Module,
    rank: int,
    steps: int,
    *,
    lr: float = 0.05,
    rows: int = 8,
    record: list[list[torch.Tensor]] | None = None,
) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for step in range(steps):
        x, y = batch(step, rank, rows)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if record is not None:
            record.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        opt.step()


def params(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()]


def side_by_side(
    n: int,
    ours: Callable[[ProcessGroup], nn.Module],
    theirs: Callable[[dist.ProcessGroup], nn.Module],
    run: Callable[[nn.Module, int], object],
    backend: str = "native",
) -> list[tuple[object, object]]:
    """Runs ``run`` on our DDP and on torch's DDP in every rank; returns both results."""
    shared = shared_store()

    def body(g: ProcessGroup) -> tuple[object, object]:
        torch.set_num_threads(1)
        a = run(ours(g), g.rank)
        b = run(theirs(torch_gloo(shared, g.rank, n)), g.rank)
        return a, b

    return run_ranks(n, body, backend=backend, timeout=90.0)


def assert_equal_lists(a: list[torch.Tensor], b: list[torch.Tensor], exact: bool) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if exact:
            assert torch.equal(x, y), (x - y).abs().max()
        else:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
