"""The memory planner against measured peaks: every choice ``sl.plan_strategy`` prices, trained.

Each rank builds ``bench_zero.py``'s GPT (``--size``), has ``sl.plan_strategy`` price every
choice of ``sl.as_distributed`` for it (the strategies, each again with the blocks
recomputing their activations, and on GPUs zero3 with offload) given one rank's batch, then
trains each choice for ``--steps`` steps with ``sl.distribute`` and AdamW and measures the
peak GPU memory of those steps (``torch.cuda.max_memory_allocated``, reset once the wrapper
is built, less what was allocated before the model was). Prints each choice's predicted and
measured bytes per rank (the most over the ranks) and their ratio; the planner's bar is
within 10 %. On CPU nothing is measured: it prints the prices only. ``--tensor-parallel``
adds the tensor-parallel layouts (``plan_strategy(tensor_parallel=True)``), each trained on
its replica's batch (``tp`` ranks' batches: the same global batch).

    python benches/bench_plan_memory.py --device cuda --ranks 2 --size medium --dtype bf16
    python benches/bench_plan_memory.py --device cpu --ranks 2 --size small      # prices only

Writes ``benches/results/plan-memory-<tag>.{txt,json}``.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path
from typing import Any

import _harness
import _plan_job

MIB = 2**20


def worker(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415

    import shardline as sl  # noqa: PLC0415

    rank, world, device, _group = _harness.join_job(args.device)
    cuda = device.type == "cuda"
    build, (x, y), mp = _plan_job.gpt(args.size, args.dtype, rank, world, device)
    shape_only = build(meta=True)
    plan = sl.plan_strategy(
        shape_only, world_size=world, available_bytes=1 << 50, example_input=(x, y),
        mixed_precision=mp, device=device, tensor_parallel=args.tensor_parallel,
    )  # fmt: skip
    rows = []
    meshes: dict[Any, Any] = {}
    for c in plan.candidates:
        measured = 0
        if cuda:
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            model, opt = _plan_job.trained(build, c, mp, meshes)
            bx, by = _plan_job.widened((x, y), c.tp)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            for _ in range(args.steps):
                opt.zero_grad(set_to_none=True)
                model(bx, by).backward()
                opt.step()
            torch.cuda.synchronize()
            peak = torch.tensor([torch.cuda.max_memory_allocated() - base], device=device)
            torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
            measured = int(peak.item())
            del model, opt
        row = {"choice": c.name, "predicted": c.estimate.total, "measured": measured}
        rows.append(row | {"activations": c.estimate.activations})
    return _harness.leave_job(rank, {"rows": rows, "world": world}, args.out)


def table(results: dict[int, dict[str, Any]], args: argparse.Namespace) -> str:
    lines = []
    for world, res in results.items():
        lines.append(
            f"{args.size} GPT {args.dtype}, {world} ranks, {args.device}, AdamW, "
            f"{args.steps} steps per choice"
        )
        lines.append(
            f"{'choice':<28}{'predicted MiB':>14}{'measured MiB':>14}{'ratio':>8}"
            f"{'activations MiB':>17}"
        )
        ratios = []
        for r in res["rows"]:
            measured = r["measured"]
            ratio = r["predicted"] / measured if measured else None
            if ratio is not None:
                ratios.append(ratio)
            lines.append(
                f"{r['choice']:<28}{r['predicted'] / MIB:>14.1f}"
                + (f"{measured / MIB:>14.1f}{ratio:>8.3f}" if ratio else f"{'-':>14}{'-':>8}")
                + f"{r['activations'] / MIB:>17.1f}"
            )
        if ratios:
            within = sum(abs(q - 1) <= 0.10 for q in ratios)
            lines.append(
                f"predicted / measured: {min(ratios):.3f} to {max(ratios):.3f}; "
                f"{within} of {len(ratios)} within 10 % (the bar)"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _plan_job.add_args(p, "small")
    p.add_argument("--steps", type=int, default=3, help="steps per choice")
    _harness.add_launch(p, timeout=600.0)
    args, results = _harness.run_bench(
        p, argv, __file__, worker, lambda a, w, r, _s: table({w: r}, a)
    )
    _plan_job.publish("plan-memory", Path(__file__).name, args, results, table(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
