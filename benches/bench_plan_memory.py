"""The memory planner against measured peaks: every choice ``sl.plan_strategy`` prices, trained.

Each rank builds ``bench_zero.py``'s GPT (``--size``), has ``sl.plan_strategy`` price every
choice of ``sl.as_distributed`` for it (the strategies, each again with the blocks
recomputing their activations, and on GPUs zero3 with offload) given one rank's batch, then
trains each choice for ``--steps`` steps with ``sl.distribute`` and AdamW and measures the
peak GPU memory of those steps (``torch.cuda.max_memory_allocated``, reset once the wrapper
is built, less what was allocated before the model was). Prints each choice's predicted and
measured bytes per rank (each the most over the ranks) and their ratio; the planner's bar is
within 10 %. On CPU nothing is measured: it prints the prices only. ``--tensor-parallel``
adds the tensor-parallel layouts (``plan_strategy(tensor_parallel=True)``), each trained on
its replica's batch (``tp`` ranks' batches: the same global batch); ``--pipeline`` the
pipelines of the GPT as a chain (``plan_strategy(pipeline=True)``), each stepped by its
``step`` on its replica's batch.

    python benches/bench_plan_memory.py --device cuda --ranks 2 --size medium --dtype bf16
    python benches/bench_plan_memory.py --device cpu --ranks 2 --size small      # prices only

``--reprice RESULTS.json`` trains nothing: it prices the choices of an earlier run again
(its model, dtype, ranks and options, in this process on the meta device) and sets the
planner's predictions now beside the peaks measured then.

Writes ``benches/results/plan-memory-<tag>.{txt,json}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

import _harness
import _plan_job

MIB = 2**20


def worker(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415

    import shardline as sl  # noqa: PLC0415

    rank, world, device, group = _harness.join_job(args.device)
    cuda = device.type == "cuda"
    build, (x, y), mp = _plan_job.gpt(args.size, args.dtype, rank, world, device)
    shape_only, extra = _plan_job.planned_model(build(meta=True), args)
    plan = sl.plan_strategy(
        shape_only, world_size=world, available_bytes=1 << 50, example_input=(x, y),
        mixed_precision=mp, device=device, tensor_parallel=args.tensor_parallel, rank=rank,
        **extra,
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
            model, opt = _plan_job.trained(build, c, mp, meshes, (x, y))
            bx, by = _plan_job.widened((x, y), c.batch_scale)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            for _ in range(args.steps):
                opt.zero_grad(set_to_none=True)
                if c.pp > 1:
                    model.step(bx, by)
                else:
                    model(bx, by).backward()
                opt.step()
            torch.cuda.synchronize()
            peak = torch.tensor([torch.cuda.max_memory_allocated() - base], device=device)
            torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
            measured = int(peak.item())
            del model, opt
        # The most over the ranks, as measured: a pipeline's stages differ from rank to rank.
        mine = torch.tensor(
            [c.estimate.total, c.estimate.activations], dtype=torch.float64, device=device
        )
        group.all_reduce(mine, op="max")
        predicted, activations = (int(v) for v in mine.tolist())
        rows.append(
            {"choice": c.name, "predicted": predicted, "measured": measured,
             "activations": activations}
        )  # fmt: skip
    return _harness.leave_job(rank, {"rows": rows, "world": world}, args.out)


def table(results: dict[int, dict[str, Any]], args: argparse.Namespace) -> str:
    lines = []
    for world, res in results.items():
        w = max([28] + [len(r["choice"]) + 2 for r in res["rows"]])  # the choice column
        lines.append(
            f"{args.size} GPT {args.dtype}, {world} ranks, {args.device}, AdamW, "
            f"{args.steps} steps per choice"
        )
        lines.append(
            f"{'choice':<{w}}{'predicted MiB':>14}{'measured MiB':>14}{'ratio':>8}"
            f"{'activations MiB':>17}"
        )
        ratios = []
        for r in res["rows"]:
            measured = r["measured"]
            ratio = r["predicted"] / measured if measured else None
            if ratio is not None:
                ratios.append(ratio)
            lines.append(
                f"{r['choice']:<{w}}{r['predicted'] / MIB:>14.1f}"
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


def repriced(args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    """``args.reprice``'s results with this planner's predictions in place of its own."""
    import torch  # noqa: PLC0415

    import shardline as sl  # noqa: PLC0415

    earlier = json.loads(Path(args.reprice).read_text())
    for key in ("size", "dtype", "tensor_parallel", "pipeline", "steps", "ranks", "device"):
        setattr(args, key, earlier["args"].get(key, False))
    out = {}
    for world, res in earlier["results"].items():
        # Each rank's prices, the most over the ranks (a pipeline's stages differ), as the
        # workers report them.
        now: dict[str, tuple[int, int]] = {}
        for rank in range(int(world)):
            build, batch, mp = _plan_job.gpt(args.size, args.dtype, rank, int(world), "cpu")
            shape_only, extra = _plan_job.planned_model(build(meta=True), args)
            plan = sl.plan_strategy(
                shape_only, world_size=int(world), available_bytes=1 << 50,
                example_input=batch, mixed_precision=mp, device=torch.device(args.device),
                tensor_parallel=args.tensor_parallel, rank=rank, **extra,
            )  # fmt: skip
            for c in plan.candidates:
                total, acts = now.get(c.name, (0, 0))
                now[c.name] = (max(total, c.estimate.total), max(acts, c.estimate.activations))
        rows = [
            {**r, "predicted": now[r["choice"]][0], "activations": now[r["choice"]][1]}
            for r in res["rows"]
            if r["choice"] in now
        ]
        out[int(world)] = {"rows": rows, "world": int(world)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _plan_job.add_args(p, "small")
    p.add_argument("--steps", type=int, default=3, help="steps per choice")
    p.add_argument("--reprice", default=None, help="an earlier run's .json: price it again")
    _harness.add_launch(p, timeout=600.0)
    if "--reprice" in (argv if argv is not None else sys.argv[1:]):
        args = p.parse_args(argv)
        results = repriced(args)
        _plan_job.publish("plan-memory", Path(__file__).name, args, results, table(results, args))
        return 0
    args, results = _harness.run_bench(
        p, argv, __file__, worker, lambda a, w, r, _s: table({w: r}, a)
    )
    _plan_job.publish("plan-memory", Path(__file__).name, args, results, table(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
