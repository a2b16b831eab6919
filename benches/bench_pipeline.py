"""Our pipeline against ``torch.distributed.pipelining``: same model, stages, micro-batches.

Each world size starts ``--ranks`` processes, one stage per rank. The model is a chain of
``--layers`` transformer blocks (the main job's ``Block``) between an embedding and a head,
split the same way for both: ``sl.pipeline`` on our group (native engine on CPU, NCCL on
CUDA) and torch's ``PipelineStage`` with ``ScheduleGPipe`` / ``Schedule1F1B`` on torch's group
(Gloo on CPU, NCCL on CUDA). Timed blocks of ``--steps`` steps alternate between the two.

Prints step time, tokens/s and their ratio, and our measured bubble (the share of a step a
rank spends waiting for messages, from the runtime's own timeline, mean over ranks; on GPUs
the timeline is CUDA events, the device's time) next to two theories: the schedule simulated
with unit costs (forward 1, backward 2: (p - 1) / (m + p - 1) for GPipe and 1F1B), and the
same schedule simulated with the costs its actions measured in the timed steps (each
stage's mean forward, backward, input and weight pass): what the schedule itself leaves idle
on this machine, so the measured bubble beyond it is the runtime's, and the actions' times
varying from step to step. The ratio is also given round by round (alternated blocks), and
each side's page faults per step (the most of any rank): memory the C library handed back
and took again, which the kernel maps and zeroes anew (``SHARDLINE_KEEP_FREED_MEMORY``).
Zero-bubble (ZB-H1, and ZB-H2 with up to 2p - 1 micro-batches held) has no torch peer with
one stage per rank: it alternates with our own 1F1B instead, and its row says how it
compares. Writes ``.txt``,
``.json`` and a plot of one step's timeline per rank to ``benches/results/``.

    python benches/bench_pipeline.py --ranks 2                       # CPU, here
    python benches/bench_pipeline.py --ranks 4 8 --microbatches 16   # the many-core host
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import _harness
import _report

# Our schedule -> torch's class of the same name; zero-bubble (one stage per rank) has
# none in torch (its zero-bubble schedules run two stages per rank), so it runs alone.
SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "zero_bubble": None,
    "zero_bubble_h2": None,
}


def build(args: argparse.Namespace, device: Any) -> Any:
    """The model as an ``nn.Sequential`` (embedding, blocks, head), the same on every rank."""
    import torch  # noqa: PLC0415
    from torch import nn  # noqa: PLC0415

    from shardline.examples.train import Block, Config  # noqa: PLC0415

    cfg = Config(d_model=args.width, num_heads=max(1, args.width // 64), seq_len=args.seq)
    torch.manual_seed(0)
    children: list[tuple[str, nn.Module]] = [("embed", nn.Embedding(cfg.vocab, cfg.d_model))]
    children += [(f"block{i}", Block(cfg)) for i in range(args.layers)]
    children += [("head", nn.Linear(cfg.d_model, cfg.vocab))]
    return nn.Sequential(OrderedDict(children)).to(device), cfg


def parts(names: list[str], p: int) -> list[list[str]]:
    """Embedding with the first blocks, head with the last: blocks shared out evenly."""
    blocks = names[1:-1]
    per, extra = divmod(len(blocks), p)
    out, k = [], 0
    for s in range(p):
        n = per + (1 if s < extra else 0)
        out.append(blocks[k : k + n])
        k += n
    out[0].insert(0, names[0])
    out[-1].append(names[-1])
    return out


def worker(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415

    rank, world, device, ours_group = _harness.join_job(args.device)
    torch.set_num_threads(max(1, args.threads))
    results = {s: one_schedule(args, s, rank, world, device, ours_group) for s in args.schedules}
    return _harness.leave_job(rank, results, args.out)


def one_schedule(
    args: argparse.Namespace, schedule: str, rank: int, world: int, device: Any, group: Any
) -> dict[str, Any]:
    """Both pipelines, built afresh, timed in alternating blocks; rank 0's row of the table."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415
    from torch import nn  # noqa: PLC0415
    from torch.distributed import pipelining  # noqa: PLC0415

    import shardline as sl  # noqa: PLC0415
    from shardline.parallel.pipeline.schedules import build as build_schedule  # noqa: PLC0415
    from shardline.parallel.pipeline.simulate import simulate  # noqa: PLC0415

    m = args.microbatches

    def loss_fn(out: Any, target: Any) -> Any:
        return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())

    model, cfg = build(args, device)
    cut = parts([n for n, _ in model.named_children()], world)
    ours = sl.pipeline(model, group, schedule=schedule, microbatches=m,
                       split=[p[0] for p in cut[1:]], loss_fn=loss_fn)  # fmt: skip
    theirs_model, _ = build(args, device)
    sub = nn.Sequential(OrderedDict((n, getattr(theirs_model, n)) for n in cut[rank]))
    peer = SCHEDULES[schedule]
    stage = pipelining.PipelineStage(sub, rank, world, device)
    sched = getattr(pipelining, peer)(stage, m, loss_fn=loss_fn) if peer else None
    opts = {
        "shardline": torch.optim.SGD(ours.parameters(), lr=1e-4),
        "torch": torch.optim.SGD(sub.parameters(), lr=1e-4),
    }
    gen = torch.Generator().manual_seed(1)
    rows = torch.randint(0, cfg.vocab, (args.batch, cfg.seq_len + 1), generator=gen)
    x, y = rows[:, :-1].contiguous().to(device), rows[:, 1:].contiguous().to(device)

    def ours_step() -> None:
        opts["shardline"].zero_grad()
        ours.step(x, target=y)
        opts["shardline"].step()

    def torch_step() -> None:
        assert sched is not None
        opts["torch"].zero_grad()
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            sched.step(target=y)
        else:
            sched.step()
        opts["torch"].step()

    steps = {"shardline": ours_step, "torch": torch_step} if peer else {"shardline": ours_step}
    if not peer:  # zero-bubble: torch has none; our 1F1B, timed alternately, is its baseline
        base_model, _ = build(args, device)
        base = sl.pipeline(base_model, group, schedule="1f1b", microbatches=m,
                           split=[p[0] for p in cut[1:]], loss_fn=loss_fn)  # fmt: skip
        opts["shardline_1f1b"] = torch.optim.SGD(base.parameters(), lr=1e-4)

        def base_step() -> None:
            opts["shardline_1f1b"].zero_grad()
            base.step(x, target=y)
            opts["shardline_1f1b"].step()

        steps["shardline_1f1b"] = base_step
    faults: dict[str, list[int]] = {k: [] for k in steps}  # this rank's page faults, per step
    steps = {k: counted(fn, faults[k]) for k, fn in steps.items()}
    busy: list[float] = []
    took: dict[str, list[float]] = {}  # this rank's actions' seconds, by kind, every timed step

    def after(name: str) -> None:
        if name == "shardline":
            busy.append(ours.last_step["busy"] / ours.last_step["seconds"])
            for kind, t0, t1 in ours.last_step["timeline"]:
                took.setdefault(kind, []).append(t1 - t0)

    times, peak = _harness.alternate(steps, args, device, after)
    # The slowest rank's median step; the bubble is the mean over ranks of the waiting share.
    # On the rank's device: torch's group is NCCL on CUDA.
    med = torch.tensor(
        [statistics.median(times[k]) for k in steps], dtype=torch.float64, device=device
    )
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    # Each round's blocks, the slowest rank's: the ratio of the two sides round by round.
    blocks = torch.tensor([times[k] for k in steps], dtype=torch.float64, device=device)
    dist.all_reduce(blocks, op=dist.ReduceOp.MAX)
    base = list(steps).index("torch" if peer else "shardline_1f1b")
    rounds = (blocks[base] / blocks[0]).tolist()
    bubble = torch.tensor([1.0 - statistics.median(busy)], dtype=torch.float64, device=device)
    dist.all_reduce(bubble)
    timeline: list[Any] = [None] * world
    dist.all_gather_object(timeline, ours.last_step["timeline"])
    costs: list[Any] = [None] * world
    dist.all_gather_object(costs, {kind: statistics.fmean(v) for kind, v in took.items()})
    peaks: list[Any] = [None] * world
    dist.all_gather_object(peaks, peak)
    # The most a rank faulted pages in per step (median of its steps), by side.
    most = torch.tensor(
        [statistics.median(faults[k]) for k in steps], dtype=torch.float64, device=device
    )
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    tokens = args.batch * cfg.seq_len
    actions = build_schedule(schedule, world, m)
    row: dict[str, Any] = {
        "tokens_per_step": tokens,
        "bubble_measured": float(bubble) / world,
        "bubble_theory": simulate(actions, world).bubble,
        "bubble_at_measured_costs": simulate(actions, world, cost=measured(costs)).bubble,
        "action_ms": [{k: v * 1e3 for k, v in c.items()} for c in costs],
        "timeline": timeline,
    }
    for name, t in zip(steps, med.tolist(), strict=True):
        row[f"{name}_step_ms"] = t * 1e3
        row[f"{name}_tokens_per_s"] = tokens / t
        row[f"{name}_peak_bytes_per_stage"] = [pk[name] for pk in peaks]
    for name, n in zip(steps, most.tolist(), strict=True):
        row[f"{name}_page_faults_per_step"] = n
    if peer:
        row["ratio"] = row["shardline_tokens_per_s"] / row["torch_tokens_per_s"]
    else:
        row["ratio_vs_1f1b"] = row["shardline_tokens_per_s"] / row["shardline_1f1b_tokens_per_s"]
    row["ratio_rounds"] = rounds  # tokens/s against the other side's, in each round
    return row


def counted(step: Any, faults: list[int]) -> Any:
    """``step``, noting the minor page faults each call took (pages the kernel had to map
    and zero: memory malloc gave back and took again)."""

    def run() -> None:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

    return run


def measured(costs: list[dict[str, float]]) -> Any:
    """Each action's cost as its stage measured it (``costs[rank][kind]``, timed steps' mean)."""
    return lambda a: costs[a.stage][a.kind]


# -- parent --------------------------------------------------------------------------------------


def table(results: dict[int, dict[str, Any]], m: int) -> str:
    lines = [
        f"{'schedule':14} {'stages':>6} {'m':>3} {'ours tok/s':>11} {'torch tok/s':>12} "
        f"{'ratio':>6} {'ours ms':>8} {'torch ms':>9} {'bubble':>7} {'theory':>7} {'at costs':>8}"
    ]
    for world, res in results.items():
        for schedule, row in res.items():
            theirs = row.get("torch_tokens_per_s")
            ours_peak, torch_peak = (
                max(row.get(f"{k}_peak_bytes_per_stage") or [0]) for k in ("shardline", "torch")
            )
            memory = (
                f"  peak GiB/stage {ours_peak / 2**30:.2f} vs {torch_peak / 2**30:.2f}"
                if ours_peak
                else ""
            )
            lines.append(
                f"{schedule:14} {world:6d} {m:3d} {row['shardline_tokens_per_s']:11,.0f} "
                + (f"{theirs:12,.0f} {row['ratio']:5.2f}x " if theirs else f"{'-':>12} {'-':>6} ")
                + f"{row['shardline_step_ms']:8.1f} "
                + (f"{row['torch_step_ms']:9.1f} " if theirs else f"{'-':>9} ")
                + f"{row['bubble_measured']:7.1%} {row['bubble_theory']:7.1%} "
                + f"{row['bubble_at_measured_costs']:8.1%}"
                + memory
                + (
                    f"  {row['ratio_vs_1f1b']:.2f}x our 1f1b "
                    f"({row['shardline_1f1b_tokens_per_s']:,.0f} tok/s, same blocks)"
                    if "ratio_vs_1f1b" in row
                    else ""
                )
                + rounds(row.get("ratio_rounds"))
                + page_faults(row)
            )
    return "\n".join(lines)


def rounds(ratios: list[float] | None) -> str:
    """The ratio round by round (alternated blocks): its range and median."""
    if not ratios:
        return ""
    return f"  rounds {min(ratios):.2f}-{max(ratios):.2f}x, median {statistics.median(ratios):.2f}x"


def page_faults(row: dict[str, Any]) -> str:
    """The page faults a step took (the most of any rank, median over its steps), both sides."""
    ours = row.get("shardline_page_faults_per_step")
    if ours is None:  # results written before the bench counted them
        return ""
    other, name = row.get("torch_page_faults_per_step"), "torch"
    if other is None:
        other, name = row.get("shardline_1f1b_page_faults_per_step"), "our 1f1b"
    return f"  page faults/step {ours:,.0f} ({name} {other:,.0f})"


def plot(results: dict[int, dict[str, Any]], path: Path) -> str:
    colors = {"F": "tab:blue", "B": "tab:orange", "I": "tab:orange", "W": "tab:green"}

    def draw(plt: Any) -> Any:
        world = max(results)
        res = results[world]
        fig, axes = plt.subplots(len(res), 1, figsize=(10, 1.2 + 0.5 * world * len(res)))
        axes = axes if len(res) > 1 else [axes]
        for ax, (schedule, row) in zip(axes, res.items(), strict=True):
            for r, events in enumerate(row["timeline"]):
                for kind, t0, t1 in events:
                    ax.barh(r, (t1 - t0) * 1e3, left=t0 * 1e3, color=colors[kind], height=0.8)
            ax.set_yticks(range(world), [f"rank {r}" for r in range(world)])
            ax.invert_yaxis()
            ax.set_title(f"{schedule}: one step (blue forward, orange backward; gaps: waiting)")
            ax.set_xlabel("ms")
        fig.tight_layout()
        return fig

    return _report.plot(path, draw)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2])
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    _harness.add_blocks(p, steps=5, repeats=3, warmup=2, repeats_help="timed blocks per side")
    _harness.add_launch(p, timeout=900.0)
    args, results = _harness.run_bench(
        p, argv, __file__, worker, lambda a, w, r, _s: table({w: r}, a.microbatches)
    )
    cores = os.cpu_count()
    tag = args.tag or f"{args.device}-{cores}c"
    _report.publish(
        _report.RESULTS / f"pipeline-{tag}",
        _report.header(Path(__file__).name, _report.machine(args.device)),
        table(results, args.microbatches),
        {"args": vars(args), "cores": cores, "results": results},
        lambda path: plot(results, path),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
