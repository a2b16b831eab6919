"""Where the peak of a training step goes: our zero3 against torch FSDP2, per step, on CUDA.

A diagnostic beside ``bench_zero.py`` (same model, batches and wrapping). For each
implementation, one at a time, it records the CUDA caching allocator's history
(``torch.cuda.memory._record_memory_history``) over ``--steps`` steps, prints the peak of each
step, then replays the allocation trace to find the moment of the highest live total and prints
what was alive then, grouped by the first frames of the allocating stack that belong to the
model, the wrapper or torch's FSDP (the persistent tensors allocated before recording began are
one line, "before recording").

    TORCH_PORT=29611 python -m shardline run --nproc-per-node 2 benches/probe_zero_peak.py \
        --size large --impls zero3,fsdp2 [--zero-kw unit_mb=128]
"""

from __future__ import annotations

import argparse
import collections
import gc
import sys
from pathlib import Path
from typing import Any

import _harness
import bench_zero

MIB = 2**20
KEEP = ("shardline", "fsdp", "examples/train", "torch/nn/modules", "torch/optim")


def frame_key(frames: list[dict[str, Any]], depth: int) -> str:
    """The first ``depth`` frames of an allocation's stack in files we care about."""
    picked = []
    for f in frames:
        name = str(f.get("filename", ""))
        if any(k in name for k in KEEP):
            picked.append(f"{Path(name).name}:{f.get('line')}:{f.get('name')}")
            if len(picked) == depth:
                break
    return " < ".join(picked) or "(no model/wrapper frame)"


def live_at_peak(
    trace: list[dict[str, Any]], depth: int
) -> tuple[int, str, dict[str, collections.Counter[int]]]:
    """Replays ``alloc``/``free_completed`` events: (peak delta, the stack of the allocation
    that reached it, {frame key: Counter of the sizes alive then})."""
    live: dict[int, tuple[int, str]] = {}
    total = best = 0
    best_live: dict[int, tuple[int, str]] = {}
    at = ""
    for ev in trace:
        action = ev.get("action")
        if action == "alloc":
            live[ev["addr"]] = (ev["size"], frame_key(ev.get("frames", []), depth))
            total += ev["size"]
            if total > best:
                best, best_live = total, dict(live)
                at = frame_key(ev.get("frames", []), 6)
        elif action == "free_completed" and ev["addr"] in live:
            total -= live.pop(ev["addr"])[0]
    groups: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for size, key in best_live.values():
        groups[key][size] += 1
    return best, at, dict(groups)


def sizes(counter: collections.Counter[int]) -> str:
    """``"120.0x20 160.0x20"``: MiB per allocation times count, largest first."""
    return " ".join(f"{s / MIB:.1f}x{c}" for s, c in sorted(counter.items(), reverse=True)[:6])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="large", choices=list(bench_zero.SIZES))
    p.add_argument("--impls", default="zero3,fsdp2")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--depth", type=int, default=2, help="frames per group key")
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--zero-kw", type=_harness.float_options, default={})
    args = p.parse_args()

    import torch  # noqa: PLC0415

    from shardline.examples.train import Config, TinyGPT  # noqa: PLC0415

    rank, _world, device, _ = _harness.join_job("cuda")
    d_model, layers, heads, seq_len, batch = bench_zero.SIZES[args.size]
    cfg = Config(
        d_model=d_model, num_layers=layers, num_heads=heads, seq_len=seq_len, batch_size=batch
    )
    torch.manual_seed(0)
    base = TinyGPT(cfg)
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randint(0, cfg.vocab, (batch, seq_len), generator=gen).to(device)
    y = torch.randint(0, cfg.vocab, (batch, seq_len), generator=gen).to(device)

    gc.collect()
    idle = torch.cuda.memory_allocated()
    for name in [s for s in args.impls.split(",") if s]:
        gc.collect()
        torch.cuda.empty_cache()
        if rank == 0:
            left = (torch.cuda.memory_allocated() - idle) / MIB
            print(f"-- before building {name}: {left:,.1f} MiB left by what ran before", flush=True)
        model, opt = bench_zero.build_impl(name, base, device, 1e-3, args.zero_kw)
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        peaks = []
        for _ in range(args.steps):
            torch.cuda.reset_peak_memory_stats()
            opt.zero_grad(set_to_none=True)
            model(x, y).backward()
            opt.step()
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() / MIB)
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = snap["device_traces"][torch.cuda.current_device()]
        best, at, groups = live_at_peak(trace, args.depth)
        if rank == 0:
            kw = args.zero_kw if name != "fsdp2" else ""
            print(f"== {name} {kw}: allocated before the steps {start / MIB:,.1f} MiB")
            print("   peak per step (MiB): " + ", ".join(f"{v:,.1f}" for v in peaks))
            print(f"   replayed peak {(start + best) / MIB:,.1f} MiB; alive then, by stack:")
            print(
                f"   (reached by an allocation in {at}; before recording: {start / MIB:,.1f} MiB)"
            )
            total = {k: sum(s * c for s, c in v.items()) for k, v in groups.items()}
            for key in sorted(total, key=lambda k: -total[k])[: args.top]:
                n = sum(groups[key].values())
                print(f"   {total[key] / MIB:10,.1f} MiB {n:5d}x  {key}  [{sizes(groups[key])}]")
            sys.stdout.flush()
        del model, opt, snap, trace
    return _harness.leave_job(rank)


if __name__ == "__main__":
    sys.exit(main())
