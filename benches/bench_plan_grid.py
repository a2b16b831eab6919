"""The planner's choice against the grid: every choice that fits, timed, beside what it chose.

Each rank builds a GPT (``--size``: ``main`` is the main job's model, the others
``bench_zero.py``'s) and one rank's batch, and calls ``sl.as_distributed`` with it as
``example_input`` (its probes and prediction timed: the seconds to decide). Then every choice
that fits on every rank (not the offloads) is trained with ``sl.distribute`` and AdamW: built
afresh, ``--warmup`` steps, then ``--steps`` timed steps, the grid ``--rounds`` times over in
turn, the fastest round kept (the slowest rank's median step). Prints each choice's
predicted and measured step, how far its slowest round was above its fastest (``rounds``: the
host's noise), the fastest measured, the planner's choice and its measured step over the
fastest (the bar: within 5 %), the same by the mean of the rounds, and the same for the first
choice that fits (what memory alone picks).

    python benches/bench_plan_grid.py --device cpu --ranks 2 --size main        # here
    python benches/bench_plan_grid.py --device cpu --ranks 8 --size small
    python benches/bench_plan_grid.py --device cuda --ranks 2 --size medium --dtype bf16

The planner's columns: ``predicted`` (the step model, from its probes) and ``trial`` (the few
it tried: the median of 10 steps after 3 to warm up, on a copy of the model; the mean of two
such trials for the fastest and those within 15 % of it).

``--budget-mib`` gives each rank that much memory instead of what it has (so that only the
more sharded or recomputing choices fit). ``--tensor-parallel`` lets the planner price
tensor-parallel layouts too (``as_distributed(tensor_parallel=True)``); the grid then trains
them as well, each replica on ``tp`` ranks' batches (the same global batch); ``--pipeline``
the same for 1F1B and zero-bubble pipelines (``as_distributed(pipeline=True)`` of the GPT
as a chain of children with its loss; a pipeline choice trained by its ``step``); with both,
pipelines whose stages split over ``tp`` ranks too. Writes
``benches/results/plan-grid-<tag>.{txt,json}``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import _harness
import _plan_job

MIB = 2**20


def worker(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415

    import shardline as sl  # noqa: PLC0415

    rank, world, device, group = _harness.join_job(args.device)
    build, (x, y), mp = _plan_job.gpt(args.size, args.dtype, rank, world, device)
    budget = args.budget_mib * MIB if args.budget_mib else None
    extra: dict[str, Any] = {}
    model, extra = _plan_job.planned_model(build(), args)
    _harness.sync(device)
    t0 = time.perf_counter()
    chosen = sl.as_distributed(
        model, group=group, example_input=(x, y), mixed_precision=mp,
        available_bytes=budget, verbose=False, tensor_parallel=args.tensor_parallel, **extra,
    )  # fmt: skip
    _harness.sync(device)
    decide = time.perf_counter() - t0
    plan = chosen.plan
    first_fit = next((c for c in plan.candidates if c.fits), plan.choice)
    del chosen
    grid = [c for c in plan.candidates if c.fits and c.offload is None]
    rounds: dict[str, list[float]] = {c.name: [] for c in grid}
    meshes: dict[Any, Any] = {}
    for _round in range(args.rounds):
        for c in grid:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            model, opt = _plan_job.trained(build, c, mp, meshes, (x, y))
            # A tp or pp replica trains that many ranks' batches (its ranks' tokens differ
            # here, which changes no time).
            bx, by = _plan_job.widened((x, y), c.batch_scale)
            times = []
            for i in range(args.warmup + args.steps):
                _harness.sync(device)
                t = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                if c.pp > 1:
                    model.step(bx, by)
                else:
                    model(bx, by).backward()
                opt.step()
                _harness.sync(device)
                if i >= args.warmup:
                    times.append(time.perf_counter() - t)
            step = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
            group.all_reduce(step, op="max")
            rounds[c.name].append(float(step.item()))
            del model, opt
    rows = [
        {
            "choice": c.name,
            "predicted": c.time.total if c.time is not None else None,
            "trial": c.time.trial if c.time is not None else None,
            "measured": min(rounds[c.name]),
            "rounds": rounds[c.name],
        }
        for c in grid
    ]
    result = {
        "rows": rows,
        "world": world,
        "chosen": plan.choice.name,
        "first_fit": first_fit.name,
        "decide_s": decide,
        "probes_s": plan.probes.seconds if plan.probes is not None else None,
        "explain": plan.explain(),
    }
    return _harness.leave_job(rank, result, args.out)


def table(results: dict[int, dict[str, Any]], args: argparse.Namespace) -> str:
    lines = []
    for world, res in results.items():
        w = max([28] + [len(r["choice"]) + 2 for r in res["rows"]])  # the choice column
        lines.append(
            f"{args.size} GPT {args.dtype}, {world} ranks, {args.device}, AdamW, "
            f"{args.steps} steps per choice, best of {args.rounds} rounds"
            + (f", {args.budget_mib} MiB per rank" if args.budget_mib else "")
        )
        lines.append(
            f"{'choice':<{w}}{'predicted ms':>14}{'trial ms':>10}{'measured ms':>14}"
            f"{'vs fastest':>12}{'rounds':>8}"
        )
        best = min(r["measured"] for r in res["rows"])
        by_name = {r["choice"]: r["measured"] for r in res["rows"]}
        for r in res["rows"]:
            mark = "  <- chosen" if r["choice"] == res["chosen"] else ""
            pred = f"{r['predicted'] * 1e3:>14.2f}" if r["predicted"] is not None else f"{'-':>14}"
            trial = r.get("trial")
            pred += f"{trial * 1e3:>10.2f}" if trial is not None else f"{'-':>10}"
            lines.append(
                f"{r['choice']:<{w}}{pred}{r['measured'] * 1e3:>14.2f}"
                f"{r['measured'] / best:>11.3f}x{_spread(r):>8}{mark}"
            )
        fastest = min(res["rows"], key=lambda r: r["measured"])["choice"]
        ratio = by_name[res["chosen"]] / best
        lines.append(
            f"fastest measured: {fastest}; chosen: {res['chosen']}, {ratio:.3f}x the fastest "
            f"({'within' if ratio <= 1.05 else 'outside'} the 5 % bar); the first that fits "
            f"({res['first_fit']}): {by_name[res['first_fit']] / best:.3f}x; deciding took "
            f"{res['decide_s']:.1f} s (probes {res['probes_s'] or 0:.1f} s; bar 60 s)"
        )
        if all(len(r.get("rounds", [])) > 1 for r in res["rows"]):
            mean = {r["choice"]: statistics.fmean(r["rounds"]) for r in res["rows"]}
            top = min(mean, key=lambda k: mean[k])
            lines.append(
                f"by the mean of the rounds (not the fastest round): fastest {top}; chosen "
                f"{mean[res['chosen']] / mean[top]:.3f}x it"
            )
        lines.append("rank 0's plan:")
        lines.extend("  " + line for line in res["explain"].splitlines())
    return "\n".join(lines)


def _spread(row: dict[str, Any]) -> str:
    """How far the slowest round's step is above the fastest's (older files: none)."""
    rounds = row.get("rounds") or []
    return f"+{max(rounds) / min(rounds) - 1:.0%}" if len(rounds) > 1 else "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _plan_job.add_args(p, "main")
    p.add_argument("--steps", type=int, default=10, help="timed steps per choice and round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3, help="times over the grid, fastest kept")
    p.add_argument("--budget-mib", type=int, default=0, help="memory per rank (0: measured)")
    _harness.add_launch(p, timeout=1200.0)
    args, results = _harness.run_bench(
        p, argv, __file__, worker, lambda a, w, r, _s: table({w: r}, a)
    )
    _plan_job.publish("plan-grid", Path(__file__).name, args, results, table(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
