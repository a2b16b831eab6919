"""What an in-memory commit (``sl.elastic.State.commit``) costs, next to a training step.

One process, a stack of ``--layers`` linear blocks of width ``--width`` with AdamW (so a
commit copies parameters plus two moments: 12 bytes per parameter in fp32), on ``--device``.
Times ``--repeats`` commits and training steps, alternating, and prints their medians, the
copy rate and the commit as a share of a step. A commit at every step costs that share; at
every k-th step, 1/k of it.

    python benches/bench_commit.py                                   # CPU, here
    python benches/bench_commit.py --device cuda --width 4096 --layers 16

Writes ``benches/results/commit-<device>.{txt,json}``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=8192, help="rows per step")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tag", default=None)
    args = p.parse_args(argv)

    import torch  # noqa: PLC0415
    from torch import nn  # noqa: PLC0415

    import shardline as sl  # noqa: PLC0415

    device = torch.device(args.device)
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(args.width, args.width), nn.GELU()) for _ in range(args.layers)]
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.width, device=device)
    state = sl.elastic.State(model=model, optimizer=opt, step=0)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step() -> float:
        sync()
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        sync()
        return time.perf_counter() - t0

    def commit() -> float:
        sync()
        t0 = time.perf_counter()
        state.commit()
        return time.perf_counter() - t0

    step(), commit()  # warm-up: optimizer state exists, host buffers touched
    steps, commits = [], []
    for _ in range(args.repeats):
        steps.append(step())
        commits.append(commit())
    t_step, t_commit = statistics.median(steps), statistics.median(commits)
    params = sum(q.numel() for q in model.parameters())
    nbytes = sum(q.numel() * q.element_size() for q in model.parameters()) * 3  # + 2 moments
    lines = [
        _report.header("bench_commit.py", _report.machine(args.device)),
        f"parameters {params / 1e6:.1f} M; a commit copies {nbytes / 2**30:.2f} GiB "
        "(weights and AdamW's two moments)",
        f"training step  {t_step * 1e3:9.1f} ms (median of {args.repeats})",
        f"commit         {t_commit * 1e3:9.1f} ms  ({nbytes / t_commit / 1e9:.1f} GB/s), "
        f"{t_commit / t_step:.1%} of a step",
    ]
    text = "\n".join(lines)
    print(text)
    out = Path(__file__).resolve().parent / "results" / f"commit-{args.tag or args.device}"
    out.with_suffix(".txt").write_text(text + "\n")
    _report.write_json(
        out.with_suffix(".json"),
        {
            "args": vars(args),
            "machine": _report.machine_info(),
            "step_s": steps,
            "commit_s": commits,
            "bytes": nbytes,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
