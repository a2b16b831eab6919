"""Our DDP against torch's DDP, in the same processes, on the same model and data.

Each world size starts ``--ranks`` processes. Every rank builds both wrappers around copies of
the same model: ``shardline.DistributedDataParallel`` on our group (native engine on CPU, NCCL
passthrough on CUDA) and ``torch.nn.parallel.DistributedDataParallel`` on torch's group (Gloo on
CPU, NCCL on CUDA). Timed blocks of ``--steps`` training steps alternate between the two, so
both see the same machine state; the median block gives steps/s and samples (or tokens)/s.

Models:
- ``comm``: communication-heavy, a deep wide MLP (25 MB of gradients) on a small batch
  (8 rows per rank on CPU: with Gloo, about half of a step is communication);
- ``comm1``: the same MLP on one row per rank: communication-bound, the step is mostly the
  gradient all-reduce (the case the engine is for);
- ``compute``: compute-heavy, the main job's transformer LM on a large batch.

A third contender, ``no comm``, is our wrapper stepping under ``no_sync()``: the same step with
no gradient communicated and no rank waiting for another, the floor of what hiding
communication can give. The ``floor`` column is our step over it (1.00x: every byte of
communication hidden behind backward and the ranks in step). A fourth, ``in step``, is the
same with one 4-byte all-reduce after backward: the ranks wait for each other every step, as
under DDP, but move no gradient. Between ``no comm`` and it is what keeping the ranks in step
costs (each step is its slowest rank's); between it and ours, what the gradients' bytes cost.

Prints the throughput ratio ours/torch and writes JSON, a text table and (with matplotlib) a
PNG to ``benches/results/``.

    python benches/bench_ddp.py --ranks 2 4                 # CPU, here
    python benches/bench_ddp.py --device cuda --ranks 2     # the 2-GPU host, NCCL vs NCCL
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _harness
import _report

# -- worker --------------------------------------------------------------------------------------


def make_model(kind: str, device: Any, big: bool) -> tuple[Any, Any, int]:
    """(model, batch maker, items per rank and step) for ``kind``."""
    import torch  # noqa: PLC0415
    from torch import nn  # noqa: PLC0415

    from shardline.examples.train import Config, TinyGPT  # noqa: PLC0415

    torch.manual_seed(0)
    if kind in ("comm", "comm1"):
        width, depth, rows = (4096, 8, 64) if big else (1024, 6, 8)
        rows = 1 if kind == "comm1" else rows
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        model = nn.Sequential(*layers).to(device)
        gen = torch.Generator(device="cpu").manual_seed(1)

        def batch_mlp() -> tuple[Any, ...]:
            x = torch.randn(rows, width, generator=gen).to(device)
            return (x,)

        return model, batch_mlp, rows
    cfg = (
        Config(d_model=1024, num_layers=8, num_heads=16, seq_len=512, batch_size=8)
        if big
        else Config(batch_size=32, seq_len=64)
    )
    model = TinyGPT(cfg).to(device)
    gen = torch.Generator(device="cpu").manual_seed(2)

    def batch_lm() -> tuple[Any, ...]:
        rows = torch.randint(0, cfg.vocab, (cfg.batch_size, cfg.seq_len + 1), generator=gen)
        rows = rows.to(device)
        return rows[:, :-1], rows[:, 1:]

    return model, batch_lm, cfg.batch_size * cfg.seq_len


def step_fn(
    model: Any,
    opt: Any,
    batch: tuple[Any, ...],
    sync: bool = True,
    meet: Callable[[], object] | None = None,
) -> None:
    """One step; ``sync=False``: under ``no_sync()``, then ``meet()`` if given."""
    opt.zero_grad(set_to_none=True)
    with contextlib.nullcontext() if sync else model.no_sync():
        out = model(*batch)
        loss = out if out.dim() == 0 else out.float().pow(2).mean()
        loss.backward()
    if meet is not None:
        meet()
    opt.step()


def worker(args: argparse.Namespace) -> int:
    import copy  # noqa: PLC0415

    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415
    from torch.nn.parallel import DistributedDataParallel as TorchDDP  # noqa: PLC0415

    import shardline as sl  # noqa: PLC0415

    rank, world, device, ours_group = _harness.join_job(args.device)
    cuda = device.type == "cuda"
    results: dict[str, Any] = {}
    for kind in args.models:
        base, make_batch, items = make_model(kind, device, big=cuda)
        params = sum(p.numel() for p in base.parameters())
        ours = sl.DistributedDataParallel(copy.deepcopy(base), group=ours_group, **args.ddp_kw)
        theirs = TorchDDP(copy.deepcopy(base), device_ids=[device.index] if cuda else None)
        alone = sl.DistributedDataParallel(copy.deepcopy(base), group=ours_group, **args.ddp_kw)
        contenders = {"shardline": ours, "torch": theirs, "nocomm": alone, "insync": alone}
        meets = {"insync": functools.partial(ours_group.all_reduce, torch.zeros(1, device=device))}
        unsynced = ("nocomm", "insync")  # the contenders under no_sync()
        opts = {k: torch.optim.SGD(m.parameters(), lr=1e-4) for k, m in contenders.items()}
        batches = [make_batch() for _ in range(4)]
        times: dict[str, list[float]] = {k: [] for k in contenders}
        for name, m in contenders.items():  # warm-up, also the bucket rebuild
            for i in range(args.warmup):
                step_fn(m, opts[name], batches[i % 4], name not in unsynced, meets.get(name))
        _harness.sync(device)
        for _ in range(args.repeats):
            for name, m in contenders.items():
                dist.barrier()
                _harness.sync(device)
                t0 = time.perf_counter()
                for i in range(args.steps):
                    step_fn(m, opts[name], batches[i % 4], name not in unsynced, meets.get(name))
                _harness.sync(device)
                times[name].append((time.perf_counter() - t0) / args.steps)
        # Report the slowest rank's median: a step is as slow as its slowest rank.
        med = torch.tensor(
            [statistics.median(times[k]) for k in contenders], dtype=torch.float64, device=device
        )
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
        row = {
            "params": params,
            "grad_mb": params * 4 / 2**20,
            "items_per_step": items * world,
            "unit": "samples" if kind.startswith("comm") else "tokens",
        }
        for (name, _), t in zip(contenders.items(), med.tolist(), strict=True):
            row[f"{name}_step_ms"] = t * 1e3
            row[f"{name}_per_s"] = items * world / t
        row["ratio"] = row["shardline_per_s"] / row["torch_per_s"]
        row["floor"] = row["shardline_step_ms"] / row["nocomm_step_ms"]
        results[kind] = row
        del ours, theirs, alone, contenders, opts
    return _harness.leave_job(rank, results, args.out)


# -- parent --------------------------------------------------------------------------------------


def table(results: dict[int, dict[str, Any]], device: str) -> str:
    peer = "torch DDP (NCCL)" if device == "cuda" else "torch DDP (Gloo)"
    lines = [
        f"{'model':8} {'ranks':>5} {'grads MB':>9} {'shardline/s':>13} {'torch/s':>13} "
        f"{'step ms ours':>12} {'step ms torch':>13} {'ratio':>6} {'no comm':>8} {'floor':>6}"
        f" {'in step':>8}"
        f"   (peer: {peer})"
    ]
    for world, res in results.items():
        for kind, row in res.items():
            lines.append(
                f"{kind:8} {world:5d} {row['grad_mb']:9.1f} {row['shardline_per_s']:13,.0f} "
                f"{row['torch_per_s']:13,.0f} {row['shardline_step_ms']:12.2f} "
                f"{row['torch_step_ms']:13.2f} {row['ratio']:5.2f}x {_floor(row)}"
                f"  ({row['unit']}/s)"
            )
    return "\n".join(lines)


def _floor(row: dict[str, Any]) -> str:
    """The no-communication step and ours over it (files from before it: blank)."""
    if "nocomm_step_ms" not in row:
        return f"{'-':>8} {'-':>6} {'-':>8}"
    insync = f"{row['insync_step_ms']:8.2f}" if "insync_step_ms" in row else f"{'-':>8}"
    return f"{row['nocomm_step_ms']:8.2f} {row['floor']:5.2f}x {insync}"


def progress(args: argparse.Namespace, world: int, res: dict[str, Any], _seconds: float) -> str:
    return table({world: res}, args.device)


def plot(results: dict[int, dict[str, Any]], path: Path) -> str:
    def draw(plt: Any) -> Any:
        labels, ratios = [], []
        for world, res in results.items():
            for kind, row in res.items():
                labels.append(f"{kind}\n{world} ranks")
                ratios.append(row["ratio"])
        fig, ax = plt.subplots(figsize=(1.4 * len(labels) + 2, 3.5))
        ax.bar(labels, ratios, color="tab:blue")
        ax.axhline(1.0, color="grey", lw=1)
        ax.set_ylabel("throughput, shardline / torch DDP")
        ax.set_title("DDP training throughput ratio")
        return fig

    return _report.plot(path, draw)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument(
        "--models", nargs="+", default=["comm", "compute"], choices=["comm", "comm1", "compute"]
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    _harness.add_blocks(p, steps=10, repeats=5, warmup=3, repeats_help="timed blocks per contender")
    _harness.add_launch(p, timeout=900.0)
    ddp_kw = "options for shardline's DDP, e.g. in_place_mb=inf,bucket_cap_mb=50"
    _harness.add_kw(p, "--ddp-kw", ddp_kw)
    args, results = _harness.run_bench(p, argv, __file__, worker, progress)
    cores = os.cpu_count()
    tag = args.tag or f"{args.device}-{cores}c"
    _report.publish(
        _report.RESULTS / f"ddp-{tag}",
        _report.header(Path(__file__).name, _report.machine(args.device)),
        table(results, args.device),
        {"args": vars(args), "cores": cores, "results": results},
        lambda path: plot(results, path),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
