"""Micro-batch mode on this job's GPUs: prints one hash of the parameters per case.

A small GPT trains 3 AdamW steps on a global batch of 8 sequences cut into micro-batches of
2: one GPU runs 4 backwards a step, two GPUs 2 each. Cases (``--cases``):

- ``oracle``: plain PyTorch on one GPU, with the mode's kernels (torch's deterministic
  algorithms, cuBLAS's fixed workspace): each micro-batch's gradient alone, the four added
  with ``tree_sum``, then the step (one process only);
- ``ddp``, ``zero1``, ``zero3``: ``sl.distribute(..., deterministic="microbatch")``;
- ``zero3-bf16``: ZeRO-3 with bf16 parameters and float32 reductions (no oracle: its
  gathered bf16 copies are ZeRO's own; compared across GPU counts).

``--autocast``: every case under bf16 autocast. Run by ``test_microbatch_cuda.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib

import torch

import shardline as sl
from shardline.comm.tree import tree_sum
from shardline.examples.train import Config, TinyGPT
from shardline.parallel.deterministic.repeat import repeatable_kernels

CFG = Config(d_model=256, num_layers=2, num_heads=4, seq_len=256, batch_size=8)
SIZE, STEPS = 2, 3


def batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [
        torch.randint(0, CFG.vocab, (CFG.batch_size, CFG.seq_len + 1), generator=gen).cuda()
        for _ in range(STEPS)
    ]


def digest(model: torch.nn.Module) -> str:
    state = model.state_dict()
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(state[name].detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def oracle(base: torch.nn.Module, cast: contextlib.AbstractContextManager[None]) -> str:
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    n = CFG.batch_size // SIZE
    for x in batches():
        grads = []
        for k in range(n):
            model.zero_grad(set_to_none=True)
            part = x[k * SIZE : (k + 1) * SIZE]
            with cast:
                loss = model(part[:, :-1], part[:, 1:]) / n
            loss.backward()
            grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        for name, p in model.named_parameters():
            p.grad = tree_sum(torch.stack([g[name] for g in grads]))
        opt.step()
    return digest(model)


def mode(base: torch.nn.Module, case: str, cast: contextlib.AbstractContextManager[None]) -> str:
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    kw = {}
    if case == "zero3-bf16":
        kw["mixed_precision"] = sl.MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    strategy = case.removesuffix("-bf16")
    wrapped, opt2 = sl.distribute(model, opt, strategy=strategy, deterministic="microbatch", **kw)
    assert opt2 is not None
    for x in batches():
        opt2.zero_grad(set_to_none=True)
        parts = sl.rank_microbatches(x, SIZE)
        for part in parts:
            with cast:
                loss = wrapped(part[:, :-1], part[:, 1:]) / len(parts)
            loss.backward()
        opt2.step()
    return digest(wrapped)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="oracle,ddp,zero1,zero3,zero3-bf16")
    p.add_argument("--autocast", action="store_true")
    args = p.parse_args()
    g = sl.init()
    torch.cuda.set_device(g.rank % torch.cuda.device_count())
    torch.manual_seed(0)
    base = TinyGPT(CFG).cuda()
    repeatable_kernels(base)  # the oracle's kernels too, before the first product
    for case in args.cases.split(","):
        if case == "oracle" and g.world_size > 1:
            continue
        cast = (
            torch.autocast("cuda", dtype=torch.bfloat16)
            if args.autocast
            else contextlib.nullcontext()
        )
        got = oracle(base, cast) if case == "oracle" else mode(base, case, cast)
        if g.rank == 0:
            print(f"case {case} hash {got} ranks {g.world_size}", flush=True)
    sl.shutdown()


if __name__ == "__main__":
    main()
