"""One GPU, one process: a deterministic GPT's gradients for a batch against its parts'.

Run by ``test_deterministic_cuda.py`` in a fresh process, so that cuBLAS first multiplies after
``make_deterministic`` has set its workspace (``--without-kernel-settings``: the control, with
``kernels``' settings off). Prints one line per check:
``<dtype> parts=<n>: differ [names]`` and ``<dtype> repeat: differ [names]``.
"""

from __future__ import annotations

import contextlib
import sys

import torch

import shardline as sl
from shardline.comm.tree import tree_sum
from shardline.examples.model import Config, TinyGPT
from shardline.parallel.deterministic import kernels

# 512 positions, as in bench_zero.py's GPT (whose flash attention backward changed from run to
# run on an H200).
CFG = Config(d_model=256, num_layers=2, num_heads=4, seq_len=512, batch_size=8)


def grads(model: torch.nn.Module, rows: torch.Tensor, bf16: bool) -> dict[str, torch.Tensor]:
    for p in model.parameters():
        p.grad = None
    with torch.autocast("cuda", torch.bfloat16, enabled=bf16):
        loss = model(rows[:, :-1], rows[:, 1:])
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def main() -> None:
    if "--without-kernel-settings" in sys.argv:  # the control: GPU kernels as they come
        kernels.cublas_env = lambda: None
        kernels.attention = contextlib.nullcontext
        kernels.algorithms = contextlib.nullcontext
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    model = sl.make_deterministic(TinyGPT(CFG).cuda())
    gen = torch.Generator(device="cuda").manual_seed(1)
    rows = torch.randint(0, CFG.vocab, (CFG.batch_size, CFG.seq_len + 1), device="cuda",
                         generator=gen)  # fmt: skip
    for bf16 in (False, True):
        name = "bf16-autocast" if bf16 else "fp32"
        whole = grads(model, rows, bf16)
        again = grads(model, rows, bf16)
        print(f"{name} repeat: differ {[n for n in whole if not torch.equal(whole[n], again[n])]}")
        for parts in (2, 4):
            size = CFG.batch_size // parts
            each = [grads(model, rows[i * size : (i + 1) * size], bf16) for i in range(parts)]
            # the ranks' tree, then the average over ranks (a power of two: exact)
            joined = {n: tree_sum(torch.stack([e[n] for e in each])) / parts for n in whole}
            differ = [n for n in whole if not torch.equal(whole[n], joined[n])]
            print(f"{name} parts={parts}: differ {differ}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
