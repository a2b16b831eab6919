"""bench_zero.py's report: the table with its goal lines, and the plot.

The implementations' names live here too, as the table groups and compares them.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import _report

IMPLS = ("zero1", "zero2", "zero3", "fsdp2", "ddp")
OURS = ("zero1", "zero2", "zero3")
# Not run by default (``--impls``): zero3 with its shards and AdamW state in host memory
# (``offload="optimizer"``, and ``"cpu"``, stepped by ``sl.optim.CPUAdamW``) against FSDP2 with
# ``CPUOffloadPolicy`` (torch's AdamW on the host).
OFFLOAD_IMPLS = ("zero3-offload", "zero3-offload-cpu", "fsdp2-offload")
# Not run by default: each block recomputing in backward what the selective policy drops
# (``sl.distribute(..., recompute="selective")``), and FSDP2 on the same model transformation
# (our ``recompute_blocks`` before ``fully_shard``), so the gain is shown apart from the policy.
RECOMPUTE_IMPLS = ("zero3-sel", "zero2-sel", "fsdp2-sel")
# Not run by default: zero3 with each unit rule whatever the device's default
# (``grouping.default_units``: "blocks" on CUDA): every repeated block one unit, as FSDP2 shards
# here (``fully_shard`` per block), or layers merged up to ``unit_mb``.
UNIT_IMPLS = ("zero3-blocks", "zero3-size")
# Not run by default: deterministic mode (``sl.distribute(..., deterministic=True)``: gradients
# per sequence, summed in one fixed tree; the same bits at any world size), and repeatable mode
# (``-rep``: ``deterministic="repeat"``, the same bits run after run for one layout), and
# micro-batch mode (``deterministic="microbatch"``: the same bits at any world size on the
# model's own kernels; ``-mb`` runs the rank's batch as one micro-batch, ``-mb2`` as two, and
# ``-acc2`` as two without the mode: plain gradient accumulation), for their cost.
DET_IMPLS = (*(f"zero{s}-{m}" for m in ("det", "rep", "mb", "mb2", "acc2") for s in (1, 2, 3)),)
MIB = 2**20
MEM_KEYS = (
    "persistent_bytes",
    "persistent_generic_bytes",
    "peak_bytes",
    "left_after_del_bytes",
    "host_bytes",
    "host_peak_bytes",
)


def ratio(a: float | None, b: float | None) -> str:
    return _report.ratio(a, b, "5.2f", "    - ")


def table(results: dict[int, dict[str, Any]], device: str) -> str:
    cuda = device == "cuda"
    peer = "torch (NCCL)" if cuda else "torch (Gloo)"
    mem_col = "peak MiB" if cuda else "persist MiB"
    lines = [
        f"{'ranks':>5} {'impl':9} {'batch':>5} {'step ms':>9} {'tokens/s':>11} {'vs fsdp2':>8} "
        f"{mem_col:>11} {'vs fsdp2':>8} "
        + (f"{'persist MiB':>11} " if cuda else "")
        + f"{'loss':>8}  check   (zero*: ours on {'NCCL' if cuda else 'the native engine'}; "
        f"fsdp2, ddp: {peer}; offloads against fsdp2-offload; memory per rank, max over ranks)"
    ]
    goals = []
    for world, res in results.items():
        rows = res["impls"]
        ref_name = "fsdp2" if "loss" in rows.get("fsdp2", {}) else None
        ref_name = ref_name or next((n for n, r in rows.items() if "loss" in r), None)
        ref_loss = rows[ref_name]["loss"] if ref_name else None
        fs = rows.get("fsdp2", {})
        mem_key = "peak_bytes" if cuda else "persistent_bytes"
        # A bf16 loss is read at bf16's precision: one step of it (2**-7 relative at most)
        # apart is the same training.
        tolerance = 2.0**-7 if res["config"].get("dtype") == "bf16" else 1e-3

        def batch_of(r: dict[str, Any], default: int = res["config"]["batch_per_rank"]) -> int:
            return int(r.get("batch_per_rank", default))

        for name, r in rows.items():
            if "error" in r and "step_ms" not in r:
                lines.append(f"{world:5d} {name:9} FAILED: {r['error'].strip().splitlines()[-1]}")
                continue
            mem = r.get(mem_key)
            peer_row = rows.get("fsdp2-offload", {}) if name in OFFLOAD_IMPLS else fs
            check = "ok"
            if ref_name is not None and batch_of(r) != batch_of(rows[ref_name]):
                check = "(other batch)"
            elif ref_loss is not None and "loss" in r:
                rel = abs(r["loss"] - ref_loss) / max(abs(ref_loss), 1e-12)
                if not rel <= tolerance:  # NaN too
                    check = f"WARN {rel:.1e} vs {ref_name}"
            lines.append(
                f"{world:5d} {name:9} {batch_of(r):5d} {r.get('step_ms', math.nan):9.2f} "
                f"{r.get('tokens_per_s', math.nan):11,.0f} "
                f"{ratio(r.get('tokens_per_s'), peer_row.get('tokens_per_s')):>8} "
                f"{(mem or math.nan) / MIB:11.1f} {ratio(mem, peer_row.get(mem_key)):>8} "
                + (f"{(r.get('persistent_bytes') or math.nan) / MIB:11.1f} " if cuda else "")
                + f"{r.get('loss', math.nan):8.4f}  {check}"
            )
        for name, r in rows.items():
            left = r.get("left_after_del_bytes") or 0
            if left > MIB:
                lines.append(
                    f"      note: {name} left {left / MIB:,.1f} MiB allocated after del model, opt"
                )
        for name, r in rows.items():  # ours' own accounting against the storage walk
            own, walk = r.get("persistent_bytes"), r.get("persistent_generic_bytes")
            if r.get("memory_stats") and own and walk and abs(own - walk) > 0.05 * walk:
                lines.append(
                    f"      note: {name} memory_stats() says {own / MIB:.1f} MiB, its reachable "
                    f"storages {walk / MIB:.1f} MiB"
                )
        mem_word = "peak" if cuda else "persistent"
        fo = rows.get("fsdp2-offload", {})
        for name in ("zero3-offload", "zero3-offload-cpu"):
            r = rows.get(name, {})
            if "tokens_per_s" in r and "tokens_per_s" in fo:
                speed = r["tokens_per_s"] / fo["tokens_per_s"]
                goals.append(
                    f"{world} ranks: {name} tokens/s {speed:.2f}x FSDP2 with CPUOffloadPolicy "
                    f"({'met' if speed >= 1.2 else 'NOT met'}: >= 1.2x), {mem_word} memory "
                    f"{(r.get(mem_key) or math.nan) / MIB:.1f} vs "
                    f"{(fo.get(mem_key) or math.nan) / MIB:.1f} MiB, host memory held per rank "
                    f"{(r.get('host_bytes') or math.nan) / MIB:,.0f} vs "
                    f"{(fo.get('host_bytes') or math.nan) / MIB:,.0f} MiB "
                    f"({ratio(r.get('host_bytes'), fo.get('host_bytes')).strip()})"
                )
        for name in ("zero3-offload", "zero3-offload-cpu", "fsdp2-offload"):
            r = rows.get(name, {})
            if r.get("host_peak_bytes") and "tokens_per_s" in r:
                goals.append(
                    f"{world} ranks: {name} trains {res['params'] / 1e9:.2f}B parameters, "
                    f"holding {r['host_bytes'] / 2**30:,.1f} GiB of host memory per rank after "
                    f"its warm-up, {r['host_peak_bytes'] / 2**30:,.1f} GiB at its peak"
                )
        same_batch = "fit" not in fs  # --batch max: each at the most it fits, compared below
        z3 = rows.get("zero3", {})
        if same_batch and "tokens_per_s" in z3 and "tokens_per_s" in fs:
            speed = z3["tokens_per_s"] / fs["tokens_per_s"]
            m3, mf = z3.get(mem_key), fs.get(mem_key)
            mem_ok = m3 is not None and mf is not None and m3 <= mf
            goals.append(
                f"{world} ranks: tokens/s {speed:.2f}x FSDP2 "
                f"({'met' if speed >= 1.0 else 'NOT met'}), {mem_word} memory "
                f"{(m3 or math.nan) / MIB:.1f} vs {(mf or math.nan) / MIB:.1f} MiB "
                f"({'met' if mem_ok else 'NOT met'})"
            )
        if not same_batch and "tokens_per_s" in fs:
            for name in ("zero3", "zero2", "zero3-sel", "zero2-sel"):
                r = rows.get(name, {})
                if "tokens_per_s" in r:
                    speed = r["tokens_per_s"] / fs["tokens_per_s"]
                    goals.append(
                        f"{world} ranks: {name} at its largest batch ({batch_of(r)}) "
                        f"{speed:.2f}x FSDP2's tokens/s at its largest ({batch_of(fs)}) "
                        f"({'met' if speed >= 1.1 else 'NOT met'}: >= 1.10x)"
                    )
        fss = rows.get("fsdp2-sel", {})
        for sel in ("zero3-sel", "zero2-sel") if same_batch else ():
            zs = rows.get(sel, {})
            if not (
                "tokens_per_s" in zs
                and "tokens_per_s" in fs
                and zs.get(mem_key)
                and fs.get(mem_key)
            ):
                continue
            mem = zs[mem_key] / fs[mem_key]
            goals.append(
                f"{world} ranks: {sel} {mem_word} memory {mem:.2f}x FSDP2's "
                f"({'met' if mem <= 0.9 else 'NOT met'}: <= 0.9x) at "
                f"{zs['tokens_per_s'] / fs['tokens_per_s']:.2f}x its tokens/s"
                + (
                    f"; against FSDP2 on the same recompute: "
                    f"{zs['tokens_per_s'] / fss['tokens_per_s']:.2f}x tokens/s, "
                    f"{(zs[mem_key] / fss[mem_key]) if fss.get(mem_key) else math.nan:.2f}x "
                    "memory"
                    if "tokens_per_s" in fss
                    else ""
                )
            )
    lines.append("goals: zero3 >= 1.0x FSDP2 tokens/s, peak memory <= FSDP2")
    lines += [f"  {g}" for g in goals] or ["  (needs zero3 and fsdp2 in the run)"]
    return "\n".join(lines)


def progress(args: argparse.Namespace, world: int, res: dict[str, Any], _seconds: float) -> str:
    return table({world: res}, args.device)


def plot(results: dict[int, dict[str, Any]], path: Path, device: str) -> str:
    mem_key = "peak_bytes" if device == "cuda" else "persistent_bytes"
    mem_word = "peak" if device == "cuda" else "persistent"

    def draw(plt: Any) -> Any:
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
        worlds = list(results)
        names = [n for n in IMPLS if any(n in results[w]["impls"] for w in worlds)]
        width = 0.8 / max(1, len(names))
        for k, name in enumerate(names):
            xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(worlds))]
            rows = [results[w]["impls"].get(name, {}) for w in worlds]
            axes[0].bar(xs, [r.get("tokens_per_s") or 0 for r in rows], width, label=name)
            axes[1].bar(xs, [(r.get(mem_key) or 0) / MIB for r in rows], width, label=name)
        ylabels = ("tokens/s (all ranks)", f"{mem_word} MiB per rank")
        for ax, ylabel in zip(axes, ylabels, strict=True):
            ax.set_xticks(range(len(worlds)), [f"{w} ranks" for w in worlds])
            ax.set_ylabel(ylabel)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"ZeRO / FSDP2 / DDP, TinyGPT ({device})")
        return fig

    return _report.plot(path, draw)
