"""Which GPU kernels give a sample bits that depend on the batch around it (deterministic mode).

For each op of the main job's transformer at the shapes of ``bench_zero.py``'s 101M GPT (width
1024, 512 positions, 16 heads), in fp32 (TF32 off) and bf16, runs the op on a batch of 16
samples and on its first 8, 4, 2 and 1, and prints whether those samples' output bits are
the same (``=``) or not (``x``), and whether a second run of the whole batch repeats them.
Two rows run ``kernels.product`` on shorter samples (16 tokens, 1 token). Deterministic mode
needs ``=`` everywhere for the ops it runs; ``shardline.parallel.
deterministic.kernels`` says how it gets them.

    python benches/gpu_batch_invariance.py                  # cuBLAS as configured
    python benches/gpu_batch_invariance.py --no-workspace   # deterministic mode's cuBLASLt

Writes ``benches/results/batch-invariance-<tag>.txt``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _report

SUBS = (8, 4, 2, 1)


def _marks(dtype: Any) -> list[str]:
    """One row per op for ``dtype``: its marks for the sub-batches and the repeat."""
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

    from shardline.parallel.deterministic import kernels  # noqa: PLC0415

    dev, b, t, d, h = "cuda", 16, 512, 1024, 16
    rows = []

    def same(a: torch.Tensor, c: torch.Tensor) -> bool:
        return bool(torch.equal(a.float().reshape(-1).view(torch.int32),
                                c.float().reshape(-1).view(torch.int32)))  # fmt: skip

    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape: int, scale: float = 1.0, g: torch.Generator = g) -> torch.Tensor:
        return (torch.randn(*shape, device=dev, generator=g) * scale).to(dtype)

    x, dy, long = rand(b, t, d), rand(b, t, 4 * d), rand(b, 2 * t, 4 * d)
    w, head = rand(4 * d, d, scale=0.02), rand(256, d, scale=0.02)
    q, k, v = (rand(b, h, t, d // h) for _ in range(3))
    idx = torch.randint(0, 256, (b, t), device=dev, generator=g)
    short, w_short = rand(b, 16, 256), rand(32, 256, scale=0.02)  # 16 tokens a sample
    single, w_single = rand(b, 1, d), rand(d, d, scale=0.02)  # 1 token a sample

    def attention_grads(n: int, backend: Any = None, fixed: bool = False) -> torch.Tensor:
        qq, kk, vv = (z[:n].clone().requires_grad_(True) for z in (q, k, v))
        with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
        with kernels.algorithms() if fixed else contextlib.nullcontext():
            o.backward(torch.ones_like(o))
        return torch.cat([qq.grad, kk.grad, vv.grad], dim=1)  # type: ignore[list-item]

    def lookups(n: int, deterministic: bool = False) -> torch.Tensor:
        out = torch.zeros(n * 256, d, device=dev, dtype=dtype)
        unit = torch.arange(n, device=dev).repeat_interleave(t)
        with kernels.algorithms() if deterministic else contextlib.nullcontext():
            out.index_add_(0, unit * 256 + idx[:n].flatten(), x[:n].reshape(-1, d))
        return out.view(n, 256, d)

    ops: dict[str, Callable[[int], torch.Tensor]] = {
        "linear forward (1024 -> 4096)": lambda n: F.linear(x[:n], w),
        "output layer forward (vocab 256)": lambda n: F.linear(x[:n], head),
        "input gradient (4096 -> 1024)": lambda n: dy[:n].reshape(-1, 4 * d).mm(w).view(n, t, d),
        "output layer forward, kernels.product": lambda n: kernels.product(x[:n], head, None),
        "input gradient, kernels.product": lambda n: kernels.product(dy[:n], w.t(), None),
        "  16 tokens a sample (256 -> 32)": lambda n: kernels.product(short[:n], w_short, None),
        "  1 token a sample (1024 -> 1024)": lambda n: kernels.product(single[:n], w_single, None),
        "per-sample weight gradients (bmm)": lambda n: torch.bmm(dy[:n].transpose(1, 2), x[:n]),
        "attention forward": lambda n: F.scaled_dot_product_attention(
            q[:n], k[:n], v[:n], is_causal=True
        ),
        "attention backward": attention_grads,
        "attention backward, math backend": lambda n: attention_grads(n, SDPBackend.MATH),
        "  memory-efficient kernel": lambda n: attention_grads(n, SDPBackend.EFFICIENT_ATTENTION),
        "  efficient, deterministic algorithms": lambda n: attention_grads(
            n, SDPBackend.EFFICIENT_ATTENTION, fixed=True
        ),
        "per-sample sum over rows (sum(1))": lambda n: x[:n].float().sum(1),
        "  the same, 1024 rows of 4096": lambda n: long[:n].float().sum(1),
        "embedding gradients (index_add_)": lookups,
        "  the same, deterministic algorithms": lambda n: lookups(n, deterministic=True),
        "layer norm forward": lambda n: F.layer_norm(x[:n], [d]),
    }
    name = "fp32" if dtype == torch.float32 else "bf16"
    for op, f in ops.items():
        whole = f(b)
        assert whole.shape[0] == b, f"{op}: the output's first dimension is not the batch"
        marks = ["=" if same(whole[:n], f(n)) else "x" for n in SUBS]
        marks.append("=" if same(whole, f(b)) else "x")
        rows.append(f"{name:5} {op:38} " + "  ".join(f"{m:>5}" for m in marks))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--no-workspace",
        action="store_true",
        help="deterministic mode's settings: cuBLASLt without a workspace",
    )
    p.add_argument("--tag", default=None)
    args = p.parse_args(argv)
    import torch  # noqa: PLC0415

    from shardline.parallel.deterministic import kernels  # noqa: PLC0415

    if args.no_workspace:
        kernels.cublas_env()  # before the first product, where cuBLAS reads it
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows = [*_marks(torch.float32), *_marks(torch.bfloat16)]
    lines = [
        f"{'dtype':5} {'op':38} " + "  ".join(f"{'b=' + str(n):>5}" for n in SUBS) + "  again",
        *rows,
        "(= : the first b samples' bits equal theirs in the batch of 16; again: a second run "
        "of the batch of 16 repeats its bits)",
    ]
    setting = (
        "cuBLASLt without a workspace (kernels.cublas_env)"
        if args.no_workspace
        else "cuBLAS as configured"
    )
    tag = args.tag or ("gpu-no-workspace" if args.no_workspace else "gpu")
    _report.publish(
        _report.RESULTS / f"batch-invariance-{tag}",
        _report.header(Path(__file__).name, _report.machine("cuda")) + f"\n# {setting}",
        "\n".join(lines),
        {"args": vars(args), "rows": rows},
        lambda _path: "no plot: a table of marks",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
