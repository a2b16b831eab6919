"""Trains a small GPT in bf16 with ZeRO-3 on this job's GPUs; rank 0 prints its parameters' hash.

``--mode repeat``: ``deterministic="repeat"``; ``--mode default``: as torch comes.
``--attention flash`` or ``efficient``: attention on that kernel (else torch's choice). Run
by ``test_repeat_cuda.py`` twice per case, each time in fresh processes.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import shardline as sl
from shardline.examples.train import Config, TinyGPT


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["repeat", "default"], required=True)
    p.add_argument("--attention", choices=["default", "flash", "efficient"], default="default")
    args = p.parse_args()
    g = sl.init()
    torch.cuda.set_device(g.rank % torch.cuda.device_count())
    cfg = Config(d_model=256, num_layers=2, num_heads=4, seq_len=512, batch_size=4)
    torch.manual_seed(0)
    model: torch.nn.Module = TinyGPT(cfg).cuda()
    opt: torch.optim.Optimizer | None = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mp = sl.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model, opt = sl.distribute(
        model, opt, strategy="zero3", mixed_precision=mp,
        deterministic="repeat" if args.mode == "repeat" else False,
    )  # fmt: skip
    assert opt is not None
    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}

    def kernel() -> contextlib.AbstractContextManager[None]:
        if args.attention in chosen:
            return sdpa_kernel(chosen[args.attention])
        return contextlib.nullcontext()

    gen = torch.Generator().manual_seed(1)
    b = cfg.batch_size
    for _ in range(3):
        x = torch.randint(0, cfg.vocab, (b * g.world_size, cfg.seq_len + 1), generator=gen)
        x = x[g.rank * b : (g.rank + 1) * b].cuda()
        opt.zero_grad()
        with kernel():  # the forward's choice; its backward runs the same kernel
            loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
    state = model.state_dict()
    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(state[name].detach().float().cpu().numpy().tobytes())
    if g.rank == 0:
        print(f"hash {digest.hexdigest()} ranks {g.world_size}", flush=True)
    sl.shutdown()


if __name__ == "__main__":
    main()
