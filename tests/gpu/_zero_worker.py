"""One rank of the CUDA ZeRO-3 check (run by test_zero_cuda.py through ``shardline run``).

Trains the same transformer with our zero3 on the nccl backend and with torch's FSDP2
(``fully_shard`` on every block, then the root) on NCCL: same seed, data and AdamW. Prints the
largest parameter difference and each one's peak ``torch.cuda.max_memory_allocated``; exits
non-zero if the models differ. Then zero3 with ``recompute="selective"``: the same parameters
(to flash attention's nondeterministic backward); forward must leave less for backward by what
the planner says it drops, and the peak must be lower.
"""

from __future__ import annotations

import copy
import gc
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import shardline as sl
from shardline.examples.train import Config, TinyGPT
from tests.gpu._common import init_both


def gathered(model: torch.nn.Module) -> int:
    """Bytes of parameters ZeRO holds gathered now (0 for FSDP2, not measured here)."""
    stats = getattr(model, "memory_stats", None)
    return stats()["params"] if stats is not None else 0


def main() -> int:
    group, rank, _, device = init_both()
    torch.manual_seed(0)
    cfg = Config(d_model=512, num_layers=6, num_heads=8, seq_len=256)
    base = TinyGPT(cfg)
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, cfg.vocab, (8, cfg.seq_len + 1), generator=gen) for _ in range(6)]

    def train(name: str) -> tuple[dict[str, torch.Tensor], int, list[float], int]:
        model = copy.deepcopy(base).to(device)
        if name == "fsdp2":
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            kw = {"recompute": "selective"} if name == "zero3-sel" else {}
            model, opt = sl.distribute(model, opt, strategy="zero3", group=group, **kw)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        losses = []
        for cpu_batch in batches:
            b = cpu_batch.to(device)
            opt.zero_grad()
            before, held = torch.cuda.memory_allocated(), gathered(model)
            loss = model(b[:, :-1], b[:, 1:])
            # What forward left for backward, less the parameters ZeRO still holds gathered
            # then (the last units: their number depends on the units' sizes, which differ
            # once the recomputed blocks are units of their own).
            kept = torch.cuda.memory_allocated() - before - (gathered(model) - held)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        peak = torch.cuda.max_memory_allocated()
        state = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().cpu()
            for k, v in model.state_dict().items()
        }
        del model, opt
        gc.collect()
        torch.cuda.empty_cache()
        return state, peak, losses, kept

    ours, ours_peak, ours_losses, ours_kept = train("zero3")
    theirs, theirs_peak, theirs_losses, _ = train("fsdp2")
    worst = max(float((ours[k] - theirs[k]).abs().max()) for k in theirs)
    print(
        f"rank {rank}: max |ours - fsdp2| = {worst:.3g}; peak MiB ours {ours_peak / 2**20:.1f} "
        f"fsdp2 {theirs_peak / 2**20:.1f} ({ours_peak / theirs_peak:.3f}x); "
        f"losses ours {ours_losses[-1]:.5f} fsdp2 {theirs_losses[-1]:.5f}",
        flush=True,
    )
    sel, sel_peak, _, sel_kept = train("zero3-sel")
    sel_worst = max(float((ours[k] - sel[k]).abs().max()) for k in ours)
    # What the planner says "selective" drops (the LayerNorm and GELU outputs) must be what
    # forward leaves for backward less (to 2 %: allocator rounding), and the peak lower.
    example = (batches[0][:, :-1], batches[0][:, 1:])
    kept = {
        p: sl.estimate_memory(
            base, world_size=2, strategy="zero3", example_input=example, recompute=p
        ).activations
        for p in (None, "selective")
    }
    dropped = kept[None] - kept["selective"]
    print(
        f"rank {rank}: max |selective - zero3| = {sel_worst:.3g}; peak MiB selective "
        f"{sel_peak / 2**20:.1f} ({sel_peak / ours_peak:.3f}x zero3's), "
        f"{(ours_peak - sel_peak) / 2**20:.1f} MiB less; after forward "
        f"{(ours_kept - sel_kept) / 2**20:.1f} MiB less, of {dropped / 2**20:.1f} MiB dropped",
        flush=True,
    )
    dist.destroy_process_group()
    sl.shutdown()
    ok = worst <= 1e-4 and ours_peak <= 1.05 * theirs_peak
    ok = ok and sel_worst <= 1e-4 and sel_peak < ours_peak
    ok = ok and abs((ours_kept - sel_kept) - dropped) <= 0.02 * dropped
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
