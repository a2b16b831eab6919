"""One rank of a GPU test: ``python _nccl_worker.py SCENARIO``, one process per GPU.

Configured by torchrun-style variables (``LOCAL_RANK`` picks the GPU). Prints ``OK`` when every
check passed; an assertion ends the process with a non-zero status and a traceback.
Expected values come from plain torch on every rank's known inputs.
"""

from __future__ import annotations

import re
import sys

import pytest
import torch

import shardline as sl
from shardline.comm.world import default_group


def inputs(rank: int, n: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Rank ``rank``'s input: small integers, exact in every dtype (bf16 included)."""
    return ((torch.arange(n, device=device) % 7) + rank + 1).to(dtype)


def collectives() -> None:
    group = sl.init()  # no backend: CUDA with a GPU per local rank chooses nccl
    r, w = sl.get_rank(), sl.get_world_size()
    dev = torch.device("cuda", r)  # LOCAL_RANK == RANK on one host
    assert group.backend == "nccl" and group.device == dev, group
    assert torch.cuda.current_device() == r

    n = 1000
    stacked = torch.stack([inputs(q, n, torch.float64, "cpu") for q in range(w)])
    references = {
        "sum": stacked.sum(0),
        "avg": stacked.mean(0),
        "max": stacked.max(0).values,
        "min": stacked.min(0).values,
        "prod": stacked.prod(0),
    }
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64):
        for op, want in references.items():
            if op == "avg" and not dtype.is_floating_point:
                continue
            t = inputs(r, n, dtype, dev)
            sl.all_reduce(t, op=op)
            assert t.device == dev
            assert torch.equal(t.cpu(), want.to(dtype)), (dtype, op, t[:5])
    flags = torch.tensor([r == 0, True, False], device=dev)
    sl.all_reduce(flags, op="sum")  # "or"
    assert flags.tolist() == [True, True, False]
    flags = torch.tensor([r == 0, True, False], device=dev)
    sl.all_reduce(flags, op="min")  # "and"
    assert flags.tolist() == [w == 1, True, False]
    big = torch.full((64 << 20,), float(r + 1), device=dev)  # 256 MiB
    sl.all_reduce(big)
    assert bool((big == w * (w + 1) / 2).all())

    # all_gather: flat, a list, and unequal sizes.
    out = torch.empty(3 * w, dtype=torch.bfloat16, device=dev)
    sl.all_gather(out, inputs(r, 3, torch.bfloat16, dev))
    want_cat = torch.cat([inputs(q, 3, torch.bfloat16, "cpu") for q in range(w)])
    assert torch.equal(out.cpu(), want_cat)
    outs = [torch.empty(3, dtype=torch.bfloat16, device=dev) for _ in range(w)]
    sl.all_gather(outs, inputs(r, 3, torch.bfloat16, dev))
    assert torch.equal(torch.cat(outs).cpu(), want_cat)
    parts = [torch.empty(q + 1, dtype=torch.int32, device=dev) for q in range(w)]
    sl.all_gather(parts, torch.full((r + 1,), r, dtype=torch.int32, device=dev))
    assert [p.tolist() for p in parts] == [[q] * (q + 1) for q in range(w)]

    # reduce_scatter: flat and list input, sum and avg.
    total = sum(inputs(q, 4 * w, torch.float32, "cpu") for q in range(w))
    assert isinstance(total, torch.Tensor)
    mine = torch.empty(4, device=dev)
    sl.reduce_scatter(mine, inputs(r, 4 * w, torch.float32, dev))
    assert torch.equal(mine.cpu(), total[4 * r : 4 * r + 4]), mine
    sl.reduce_scatter(mine, list(inputs(r, 4 * w, torch.float32, dev).chunk(w)), op="avg")
    assert torch.equal(mine.cpu(), total[4 * r : 4 * r + 4] / w), mine

    t = inputs(r, 10, torch.float16, dev)
    sl.broadcast(t, src=w - 1)
    assert torch.equal(t.cpu(), inputs(w - 1, 10, torch.float16, "cpu"))

    t = inputs(r, 10, torch.float32, dev)
    sl.reduce(t, dst=0, op="max")
    if r == 0:
        assert torch.equal(t.cpu(), inputs(w - 1, 10, torch.float32, "cpu"))

    gathered = [torch.empty(5, device=dev) for _ in range(w)] if r == 0 else None
    sl.gather(inputs(r, 5, torch.float32, dev), gathered, dst=0)
    if gathered is not None:
        for q, g in enumerate(gathered):
            assert torch.equal(g.cpu(), inputs(q, 5, torch.float32, "cpu"))

    piece = torch.empty(2, dtype=torch.int64, device=dev)
    source = (
        [torch.full((2,), q * 10, dtype=torch.int64, device=dev) for q in range(w)]
        if r == 0
        else None
    )
    sl.scatter(piece, source, src=0)
    assert piece.tolist() == [r * 10, r * 10]

    out = torch.empty(w, dtype=torch.int64, device=dev)
    sl.all_to_all(out, torch.arange(w, device=dev) + 100 * r)
    assert out.tolist() == [r + 100 * q for q in range(w)]

    if r == 0:
        sl.send(torch.arange(6.0, device=dev), dst=1)
    elif r == 1:
        got = torch.empty(6, device=dev)
        sl.recv(got, src=0)
        assert torch.equal(got.cpu(), torch.arange(6.0))

    work = sl.all_reduce(torch.ones(1 << 20, device=dev), async_op=True)
    assert work is not None
    work.wait()
    sub = sl.new_group([w - 1])
    if r == w - 1:
        assert sub is not None and sub.world_size == 1 and sub.device == dev
        t = torch.ones(3, device=dev)
        sub.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
    sl.barrier()
    torch.cuda.synchronize()
    print("OK", flush=True)
    sl.shutdown()


def edge_checks() -> None:
    sl.init(backend="nccl")
    r = sl.get_rank()
    dev = torch.device("cuda", r)
    for bad, words in [
        (torch.ones(3), "works on CUDA tensors"),
        (torch.ones(3, device=f"cuda:{1 - r}"), f"runs on cuda:{r}"),
        (torch.ones(3).numpy(), "numpy array"),
    ]:
        with pytest.raises(sl.InvalidArgumentError, match=re.escape(words)):
            sl.all_reduce(bad)
    t = torch.ones(3, device=dev)
    sl.all_reduce(t)  # the group still works: nothing was sent for the bad calls
    assert t.tolist() == [2.0, 2.0, 2.0]
    print("OK", flush=True)
    sl.shutdown()


def cpu_on_a_gpu_host() -> None:
    """SHARDLINE_DEVICE=cpu on a GPU host chooses the native engine; CUDA tensors point to nccl."""
    sl.init()
    assert default_group().backend == "native", default_group()
    t = torch.ones(4)
    sl.all_reduce(t)
    assert t.tolist() == [2.0] * 4
    with pytest.raises(sl.InvalidArgumentError, match=re.escape("backend='nccl'")):
        sl.all_reduce(torch.ones(3, device="cuda:0"))
    print("OK", flush=True)
    sl.shutdown()


SCENARIOS = {
    "collectives": collectives,
    "edge_checks": edge_checks,
    "cpu_on_a_gpu_host": cpu_on_a_gpu_host,
}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]]()
