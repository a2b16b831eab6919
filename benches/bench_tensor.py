"""Our tensor parallelism against DTensor's (``parallelize_module``) on the same Llama model.

Each world size starts ``--ranks`` processes, all one tensor-parallel group. Both sides take
the same Hugging Face ``LlamaForCausalLM`` (built from one seed): ours through
``sl.tensor_parallel(model, group)`` (``plan="auto"``: attention and MLP split, embeddings and
the head split by vocabulary, the vocabulary-parallel loss; native engine on CPU, NCCL on
CUDA), torch's through ``parallelize_module`` with the equivalent plan (``ColwiseParallel`` /
``RowwiseParallel`` on q/k/v/o and gate/up/down, the embedding ``RowwiseParallel``, the head
``ColwiseParallel`` with ``loss_parallel``; Gloo on CPU, NCCL on CUDA). Timed blocks of
``--steps`` steps (forward, backward, AdamW one parameter at a time on both sides) alternate
between the two.

Prints step time, tokens/s and their ratio, peak memory (CUDA) and parameter bytes per rank
against 1/t of the split weights plus the replicated ones. Writes ``.txt`` and ``.json`` to
``benches/results/``.

    python benches/bench_tensor.py --ranks 2                                  # CPU, here
    python benches/bench_tensor.py --device cuda --ranks 2 4 --hidden 2048 --layers 16
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path
from typing import Any

import _harness
import _report


def build(args: argparse.Namespace, device: Any) -> Any:
    """The Llama model, the same on every rank and side (fp32, one seed)."""
    import torch  # noqa: PLC0415
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    cfg = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden,
        intermediate_size=(args.hidden * 8 // 3 + 255) // 256 * 256,  # Llama's rounding
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(device)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The Llama's shape (``build``), its sequence length and the threads per rank."""
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")


def dtensor_plan(model: Any) -> dict[str, Any]:
    """torch's plan equal to ours (``plan="auto"``)."""
    from torch.distributed.tensor import Replicate, Shard  # noqa: PLC0415
    from torch.distributed.tensor.parallel import (  # noqa: PLC0415
        ColwiseParallel,
        RowwiseParallel,
    )

    plan: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}"
        plan |= {f"{p}.self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")}
        plan |= {f"{p}.mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")}
        plan |= {
            f"{p}.self_attn.o_proj": RowwiseParallel(),
            f"{p}.mlp.down_proj": RowwiseParallel(),
        }
    return plan


def worker(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module  # noqa: PLC0415

    import shardline as sl  # noqa: PLC0415

    rank, world, device, group = _harness.join_job(args.device)
    torch.set_num_threads(max(1, args.threads))
    ours = sl.tensor_parallel(build(args, device), group)
    theirs = build(args, device)
    mesh = init_device_mesh(device.type, (world,))
    parallelize_module(theirs, mesh, dtensor_plan(theirs))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)
    # One parameter at a time on both sides: torch's multi-tensor AdamW cannot mix DTensor
    # weights with the plain tensors of the layers its plan leaves whole (the norms).
    opts = {
        "shardline": torch.optim.AdamW(ours.parameters(), lr=1e-5, foreach=False),
        "torch": torch.optim.AdamW(theirs.parameters(), lr=1e-5, foreach=False),
    }

    def ours_step() -> float:
        opts["shardline"].zero_grad()
        loss = ours(input_ids=ids, labels=ids).loss
        loss.backward()
        opts["shardline"].step()
        return float(loss.detach())

    def torch_step() -> float:
        opts["torch"].zero_grad()
        logits = theirs(input_ids=ids).logits
        target = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]
        with loss_parallel():
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
            loss.backward()
        opts["torch"].step()
        return float(loss.full_tensor().detach() if hasattr(loss, "full_tensor") else loss)

    steps = {"shardline": ours_step, "torch": torch_step}
    if args.ab_overlap:  # ours again, with the shared inputs' all-reduce not overlapped
        from shardline.parallel.tensor import overlap  # noqa: PLC0415

        plain = sl.tensor_parallel(build(args, device), group)
        opts["plain"] = torch.optim.AdamW(plain.parameters(), lr=1e-5, foreach=False)

        def plain_step() -> float:
            on, overlap.plain_call = overlap.plain_call, lambda x: False
            try:
                opts["plain"].zero_grad()
                loss = plain(input_ids=ids, labels=ids).loss
                loss.backward()
                opts["plain"].step()
                return float(loss.detach())
            finally:
                overlap.plain_call = on

        steps["no_overlap"] = plain_step
    first = {name: fn() for name, fn in steps.items()}  # the same model: the same first loss
    times, peak = _harness.alternate(steps, args, device)
    med = torch.tensor([statistics.median(times[k]) for k in steps], dtype=torch.float64,
                       device=device)  # fmt: skip
    dist.all_reduce(med, op=dist.ReduceOp.MAX)  # the slowest rank's median
    with torch.device("meta"):  # the dense model's sizes, without its memory
        sizes = {n: p.numel() * p.element_size() for n, p in build(args, "meta").named_parameters()}
    split = sum(
        b for n, b in sizes.items() if any(k in n for k in ("proj", "embed_tokens", "lm_head"))
    )
    dense = sum(sizes.values())
    mine = sum(p.numel() * p.element_size() for p in ours.parameters())
    tokens = args.batch * args.seq
    row: dict[str, Any] = {
        "tokens_per_step": tokens,
        "first_loss": first,
        "param_bytes_per_rank": mine,
        "param_bytes_ideal": split / world + (dense - split),
    }
    for name, t in zip(steps, med.tolist(), strict=True):
        row[f"{name}_step_ms"] = t * 1e3
        row[f"{name}_tokens_per_s"] = tokens / t
        row[f"{name}_peak_bytes"] = peak[name]
    row["ratio"] = row["shardline_tokens_per_s"] / row["torch_tokens_per_s"]
    if "no_overlap" in steps:
        row["overlap_gain"] = row["shardline_tokens_per_s"] / row["no_overlap_tokens_per_s"]
    return _harness.leave_job(rank, row, args.out)


def table(results: dict[int, dict[str, Any]]) -> str:
    lines = [
        f"{'tp':>3} {'ours tok/s':>11} {'torch tok/s':>12} {'ratio':>6} {'ours ms':>8} "
        f"{'torch ms':>9} {'first loss ours / torch':>24} {'params/rank vs ideal':>21} peak GiB"
    ]
    for world, row in results.items():
        first = row["first_loss"]
        peak = (
            f"{row['shardline_peak_bytes'] / 2**30:.2f} vs {row['torch_peak_bytes'] / 2**30:.2f}"
            if row["shardline_peak_bytes"]
            else "-"
        )
        lines.append(
            f"{world:3d} {row['shardline_tokens_per_s']:11,.0f} {row['torch_tokens_per_s']:12,.0f} "
            f"{row['ratio']:5.2f}x {row['shardline_step_ms']:8.1f} {row['torch_step_ms']:9.1f} "
            f"{first['shardline']:11.5f} / {first['torch']:10.5f} "
            f"{row['param_bytes_per_rank'] / row['param_bytes_ideal']:20.3f}x {peak}"
            + (
                f"  overlap: {row['overlap_gain']:.3f}x ours without it "
                f"({row['no_overlap_step_ms']:.1f} ms)"
                if "overlap_gain" in row
                else ""
            )
        )
    return "\n".join(lines)


def plot(results: dict[int, dict[str, Any]], path: Path) -> str:
    def draw(plt: Any) -> Any:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        worlds = sorted(results)
        xs = range(len(worlds))
        for k, (side, label) in enumerate((("shardline", "ours"), ("torch", "DTensor"))):
            ys = [results[w][f"{side}_tokens_per_s"] for w in worlds]
            ax.bar([x + 0.4 * k for x in xs], ys, width=0.4, label=label)
        ax.set_xticks([x + 0.2 for x in xs], [f"tp={w}" for w in worlds])
        ax.set_ylabel("tokens/s")
        ax.set_title("Llama, tensor parallel: ours against DTensor")
        ax.legend()
        fig.tight_layout()
        return fig

    return _report.plot(path, draw)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    add_model_args(p)
    p.add_argument(
        "--ab-overlap",
        action="store_true",
        help="also time ours with the shared inputs' all-reduce not overlapped",
    )
    _harness.add_blocks(p, steps=3, repeats=3, warmup=1, repeats_help="timed blocks per side")
    _harness.add_launch(p, timeout=900.0)
    args, results = _harness.run_bench(p, argv, __file__, worker, lambda a, w, r, _s: table({w: r}))
    cores = os.cpu_count()
    tag = args.tag or f"{args.device}-{cores}c"
    _report.publish(
        _report.RESULTS / f"tensor-{tag}",
        _report.header(Path(__file__).name, _report.machine(args.device)),
        table(results),
        {"args": vars(args), "cores": cores, "results": results},
        lambda path: plot(results, path),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
