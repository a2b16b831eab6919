"""Scaling run: our DDP and zero3 against torch DDP and FSDP2 at 1, 2, 4 (, 8) GPUs, and our
NCCL passthrough collectives against raw torch NCCL.

Per GPU count ``W`` (``--gpus``), ``W`` processes start (``_harness.py``'s launcher: our group
on MASTER_PORT, torch's NCCL group on its own TCPStore). Every rank builds, from the same
CPU-initialised ``TinyGPT`` (seed 0; ``--size 1b`` has 1.01B parameters) and AdamW, one
implementation at a time:

- ``sl-ddp``: ``sl.distribute(model, opt, strategy="ddp")`` on our group (NCCL passthrough);
- ``sl-zero3``: ``sl.distribute(model, opt, strategy="zero3")`` on our group;
- ``torch-ddp``: ``torch.nn.parallel.DistributedDataParallel`` on torch's group;
- ``fsdp2``: torch's ``fully_shard`` on every transformer block, then on the root.

Per implementation, three phases on the same model:

1. loss: ``--loss-steps`` AdamW steps in strict fp32 (TF32 off) on a fixed global batch of
   ``--loss-batch`` sequences split evenly over the ranks, the same at every GPU count: the
   global-mean loss of the last step must agree across implementations and GPU counts (flagged
   above ``--loss-rtol``);
2. throughput: TF32 matmuls on (``torch.set_float32_matmul_precision("high")``, what fp32
   users run), ``--batch`` sequences per GPU (weak scaling), ``--warmup`` steps, then
   ``--repeats`` timed blocks of ``--steps`` steps; a cell is the slowest rank's median step;
3. memory: peak allocated bytes per GPU over phases 1-2 (counted from after the wrapper is
   built, so the full model FSDP2 and zero3 shard on construction is not in it), max over
   ranks.

Scaling efficiency at ``W`` GPUs = tokens/s(W) / (W / W0 x tokens/s(W0)), ``W0`` the first
count (1 by default), per implementation.

Then, at every ``W >= 2``, our group's all_reduce / all_gather / reduce_scatter against torch's
``all_reduce`` / ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` on its NCCL group,
float32, ``--coll-sizes`` (1 KiB to 1 GiB): each cell checked once against a closed form, then
``--coll-repeats`` timed batches (median), nccl-tests' busbw.

Writes ``benches/results/scaling-<tag>.{txt,json,png}``.

    python benches/bench_scaling.py --gpus 1 2 4                    # 4-GPU host, 1B model
    python benches/bench_scaling.py --device cpu --size small --gpus 1 2 --coll-sizes 1K,1M
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _harness
import _report
import bench_zero

IMPLS = ("sl-ddp", "torch-ddp", "sl-zero3", "fsdp2")
PEER = {"sl-ddp": "torch-ddp", "sl-zero3": "fsdp2"}
GIB = 2**30
# (d_model, num_layers, num_heads, seq_len)
SIZES = {
    "small": (128, 2, 4, 64),  # 0.4M parameters: checks the script on 2 CPU cores
    "1b": (2048, 20, 16, 1024),  # 1.01B parameters
}
# op -> (our group's method, torch.distributed's function)
COLL_OPS = {
    "all_reduce": ("all_reduce", "all_reduce"),
    "all_gather": ("all_gather", "all_gather_into_tensor"),
    "reduce_scatter": ("reduce_scatter", "reduce_scatter_tensor"),
}
BUSBW = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n}
BUSBW["reduce_scatter"] = BUSBW["all_gather"]


# -- worker --------------------------------------------------------------------------------------


def train_worker(args: argparse.Namespace, rank: int, world: int, device: Any) -> dict[str, Any]:
    import gc  # noqa: PLC0415

    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    from shardline.examples.train import Config, TinyGPT, corpus  # noqa: PLC0415

    cuda = device.type == "cuda"

    d_model, layers, heads, seq_len = SIZES[args.size]
    cfg = Config(d_model=d_model, num_layers=layers, num_heads=heads, seq_len=seq_len)
    torch.manual_seed(0)
    base = TinyGPT(cfg)  # on the CPU: the same initial weights at every GPU count
    n_params = sum(p.numel() for p in base.parameters())
    tokens = corpus(num_chars=max(200_000, 4 * (seq_len + 1) * max(args.batch, args.loss_batch)))
    n_windows = (tokens.numel() - 1) // seq_len

    def windows(idx: list[int]) -> tuple[Any, Any]:
        win = torch.stack([tokens[i * seq_len : i * seq_len + seq_len + 1] for i in idx])
        return win[:, :-1].to(device), win[:, 1:].to(device)

    # Phase 1's global batches: the same windows at every GPU count, rank r its slice.
    if args.loss_batch % world:
        raise SystemExit(f"--loss-batch {args.loss_batch} is not divisible by {world} GPUs")
    per = args.loss_batch // world
    gen = torch.Generator().manual_seed(7)
    loss_batches = []
    for _ in range(args.loss_steps):
        idx = torch.randint(0, n_windows, (args.loss_batch,), generator=gen).tolist()
        loss_batches.append(windows(idx[rank * per : (rank + 1) * per]))
    # Phase 2's batches: each rank its own windows.
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [
        windows(torch.randint(0, n_windows, (args.batch,), generator=gen).tolist())
        for _ in range(4)
    ]

    def build(name: str) -> tuple[Any, Any]:
        kw = args.zero_kw if name == "sl-zero3" else {}
        return bench_zero.build_impl(name, base, device, args.lr, kw)

    def step(model: Any, opt: Any, batch: tuple[Any, Any]) -> Any:
        opt.zero_grad(set_to_none=True)
        loss = model(*batch)
        loss.backward()
        opt.step()
        return loss.detach()

    def set_tf32(on: bool) -> None:
        torch.set_float32_matmul_precision("high" if on else "highest")
        torch.backends.cudnn.allow_tf32 = on

    rows: dict[str, dict[str, Any]] = {}
    for name in (i for i in IMPLS if i in args.impls):
        row: dict[str, Any] = {}
        rows[name] = row
        model = opt = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        base_alloc = torch.cuda.memory_allocated() if cuda else 0
        try:
            model, opt = build(name)
            _harness.sync(device)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            set_tf32(False)
            losses = [step(model, opt, b) for b in loss_batches]
            set_tf32(True)
            for i in range(args.warmup):
                step(model, opt, batches[i % len(batches)])
            times, k = [], 0
            for _ in range(args.repeats):
                dist.barrier()
                _harness.sync(device)
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    step(model, opt, batches[k % len(batches)])
                    k += 1
                _harness.sync(device)
                times.append((time.perf_counter() - t0) / args.steps)
            row["step_s_rank"] = statistics.median(times)
            row["spread"] = _report.spread(times)
            row["losses"] = [float(v) for v in torch.stack(losses).cpu()]
            row["persistent_bytes"] = bench_zero.persistent_bytes(model, opt)
            if cuda:
                row["peak_bytes"] = torch.cuda.max_memory_allocated() - base_alloc
        except Exception:  # report, go on with the others
            row["error"] = traceback.format_exc()
            print(f"[{world} GPUs, rank {rank}] {name} failed:\n{row['error']}", flush=True)
        del model, opt
        set_tf32(False)

    # Slowest rank's step, max over ranks of memory and spread, mean over ranks of the losses.
    ok = [n for n, r in rows.items() if "error" not in r]
    flags = torch.tensor([0.0 if n in ok else 1.0 for n in rows], dtype=torch.float64)
    flags_dev = flags.to(device)
    dist.all_reduce(flags_dev, op=dist.ReduceOp.MAX)  # an impl that failed anywhere failed
    ok = [n for n, f in zip(rows, flags_dev.cpu().tolist(), strict=True) if f == 0.0]
    for n, r in rows.items():
        if n not in ok and "error" not in r:
            r["error"] = "failed on another rank (see its output)"
    if ok:
        mx = torch.tensor(
            [
                v
                for n in ok
                for v in (
                    rows[n]["step_s_rank"],
                    rows[n]["spread"],
                    rows[n]["persistent_bytes"],
                    rows[n].get("peak_bytes", math.nan),
                )
            ],
            dtype=torch.float64,
        ).to(device)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        ls = torch.tensor([v for n in ok for v in rows[n]["losses"]], dtype=torch.float64)
        ls = ls.to(device)
        dist.all_reduce(ls, op=dist.ReduceOp.SUM)
        mx_l, ls_l = mx.cpu().tolist(), (ls / world).cpu().tolist()
        items = args.batch * seq_len * world
        for i, n in enumerate(ok):
            step_s, spread, persist, peak = mx_l[4 * i : 4 * i + 4]
            rows[n].update(
                step_ms=step_s * 1e3,
                tokens_per_s=items / step_s,
                spread=spread,
                persistent_bytes=persist,
                peak_bytes=None if math.isnan(peak) else peak,
                losses=ls_l[args.loss_steps * i : args.loss_steps * (i + 1)],
            )
            del rows[n]["step_s_rank"]
    return {
        "params": n_params,
        "tokens_per_step": args.batch * seq_len * world,
        "config": {"d_model": d_model, "layers": layers, "heads": heads, "seq_len": seq_len},
        "impls": rows,
    }


def _collective(impl: str, op: str, ours: Any, big: Any, small: Any) -> Callable[[], Any]:
    """One ``op`` through our group (``impl == "ours"``) or raw torch.distributed, as a call
    without arguments: all_reduce on ``big``, all_gather ``small`` into ``big``, reduce_scatter
    ``big`` into ``small``."""
    import torch.distributed as dist  # noqa: PLC0415

    ours_name, torch_name = COLL_OPS[op]
    fn = getattr(ours, ours_name) if impl == "ours" else getattr(dist, torch_name)
    buffers = {"all_reduce": (big,), "all_gather": (big, small), "reduce_scatter": (small, big)}
    return functools.partial(fn, *buffers[op])


def coll_worker(args: argparse.Namespace, rank: int, world: int, device: Any, ours: Any) -> Any:
    """{op: {size: {"ours": seconds, "torch": seconds, "check": str}}}: per-op median time."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    out: dict[str, dict[str, dict[str, Any]]] = {op: {} for op in COLL_OPS}
    for size in sorted(_harness.parse_size(s) for s in args.coll_sizes.split(",")):
        n = max(world, size // 4 // world * world)  # float32 elements, a multiple of world
        big = torch.empty(n, device=device)
        small = torch.empty(n // world, device=device)
        for op in COLL_OPS:
            cell: dict[str, Any] = {"bytes": n * 4, "check": "ok"}
            runs = {impl: _collective(impl, op, ours, big, small) for impl in ("ours", "torch")}
            for impl, run in runs.items():
                # Check: rank-dependent inputs against the closed form.
                big.fill_(rank + 1)
                small.fill_(rank + 1)
                run()
                _harness.sync(device)
                if op == "all_reduce":
                    good = bool((big == world * (world + 1) / 2).all())
                elif op == "all_gather":
                    want = torch.arange(1, world + 1, device=device, dtype=big.dtype)
                    good = bool((big.view(world, -1) == want[:, None]).all())
                else:
                    good = bool((small == world * (world + 1) / 2).all())
                if not good:
                    bad = cell["check"].removeprefix("ok").removeprefix("WRONG RESULT:")
                    cell["check"] = f"WRONG RESULT:{bad} {impl}"
            iters = 50 if n * 4 <= 16 << 20 else 20 if n * 4 <= 256 << 20 else 8
            times: dict[str, list[float]] = {"ours": [], "torch": []}
            for _ in range(args.coll_repeats):  # ours and torch interleaved, repeat by repeat
                for impl, run in runs.items():
                    dist.barrier()
                    _harness.sync(device)
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        run()
                    _harness.sync(device)
                    times[impl].append((time.perf_counter() - t0) / iters)
            for impl, ts in times.items():
                cell[impl] = statistics.median(ts)
            out[op][str(n * 4)] = cell
        del big, small
    # The slowest rank's time per cell.
    keys = [(op, s, impl) for op in COLL_OPS for s in out[op] for impl in ("ours", "torch")]
    t = torch.tensor([out[op][s][impl] for op, s, impl in keys], dtype=torch.float64).to(device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    for (op, s, impl), v in zip(keys, t.cpu().tolist(), strict=True):
        out[op][s][impl] = v
    return out


def worker(args: argparse.Namespace) -> int:
    rank, world, device, ours = _harness.join_job(args.device)
    result = train_worker(args, rank, world, device) if args.impls else {"impls": {}}
    if world >= 2 and args.coll_sizes:
        result["collectives"] = coll_worker(args, rank, world, device, ours)
    return _harness.leave_job(rank, result, args.out)


# -- parent --------------------------------------------------------------------------------------


def tables(results: dict[int, dict[str, Any]], args: argparse.Namespace) -> str:
    cuda = args.device == "cuda"
    worlds = sorted(results)
    lines = [
        f"{'GPUs' if cuda else 'ranks':>5} {'impl':10} {'step ms':>8} {'tokens/s':>10} "
        f"{'vs torch':>8} {'scaling':>7} {'peak GiB':>8} {'vs torch':>8} "
        f"{'persist GiB':>11} {'spread':>6} {'loss@' + str(args.loss_steps):>9}  check"
    ]
    goals: list[str] = []
    ref_loss = None
    ref_name = ""
    for w in worlds:
        rows = results[w]["impls"]
        for name, r in rows.items():
            if ref_loss is None and r.get("losses"):
                ref_loss, ref_name = r["losses"][-1], f"{name} at {w}"
    speed_ok = mem_ok = True
    for w in worlds:
        rows = results[w]["impls"]
        for name, r in rows.items():
            if "tokens_per_s" not in r:
                lines.append(f"{w:5d} {name:10} FAILED: {r['error'].strip().splitlines()[-1]}")
                continue
            peer = rows.get(PEER.get(name, ""), {})
            one = results[worlds[0]]["impls"].get(name, {})
            eff = (
                r["tokens_per_s"] / (w / worlds[0] * one["tokens_per_s"])
                if one.get("tokens_per_s")
                else math.nan
            )
            r["scaling"] = eff
            vs = r["tokens_per_s"] / peer["tokens_per_s"] if peer.get("tokens_per_s") else None
            peak, ppeak = r.get("peak_bytes"), peer.get("peak_bytes")
            mvs = peak / ppeak if peak and ppeak else None
            vs_text = _report.ratio(r["tokens_per_s"], peer.get("tokens_per_s"), ".3f")
            loss = r["losses"][-1]
            rel = abs(loss - ref_loss) / max(abs(ref_loss), 1e-12) if ref_loss else math.nan
            check = "ok" if rel <= args.loss_rtol else f"WARN {rel:.1e} vs {ref_name}"
            lines.append(
                f"{w:5d} {name:10} {r['step_ms']:8.1f} {r['tokens_per_s']:10,.0f} "
                f"{vs_text:>8} {eff:7.1%} "
                f"{(peak or math.nan) / GIB:8.2f} {_report.ratio(peak, ppeak, '.3f'):>8} "
                f"{r['persistent_bytes'] / GIB:11.2f} {r['spread']:6.1%} {loss:9.5f}  {check}"
            )
            if vs is not None:
                speed_ok &= vs >= 0.98
                goals.append(f"  {w} GPUs: {name} {vs:.3f}x {PEER[name]} tokens/s")
            if name == "sl-zero3" and mvs is not None:
                mem_ok &= mvs <= 1.0
                goals.append(f"  {w} GPUs: sl-zero3 peak {mvs:.3f}x FSDP2's")
    last = worlds[-1]
    effs = [
        f"{n} {r['scaling']:.1%}"
        for n, r in results[last]["impls"].items()
        if not math.isnan(r.get("scaling", math.nan))
    ]
    lines += [
        "goals: ours >= 0.98x torch tokens/s at every count "
        f"({'met' if speed_ok else 'NOT met'}), zero3 peak <= FSDP2 "
        f"({'met' if mem_ok else 'NOT met'}), scaling >= 90% from {worlds[0]} to {last}: "
        + ", ".join(effs),
        *goals,
    ]
    coll = {w: results[w]["collectives"] for w in worlds if "collectives" in results[w]}
    if coll:
        lines += [
            "",
            f"collectives, float32: ours ({'NCCL passthrough' if cuda else 'native'}) vs raw torch "
            f"({'NCCL' if cuda else 'Gloo'}); busbw GB/s, slowest rank, median",
            f"{'ranks':>5} {'op':14} {'size':>6} {'ours us':>10} {'torch us':>10} "
            f"{'ours busbw':>10} {'torch busbw':>11} {'ratio':>6}  check",
        ]
        for w, ops in coll.items():
            for op, cells in ops.items():
                for s, c in cells.items():
                    bw = BUSBW[op](w) * int(s) / 1e9
                    lines.append(
                        f"{w:5d} {op:14} {_report.fmt_size(int(s), compact=True):>6} "
                        f"{c['ours'] * 1e6:10.1f} "
                        f"{c['torch'] * 1e6:10.1f} {bw / c['ours']:10.2f} "
                        f"{bw / c['torch']:11.2f} {_report.ratio(c['torch'], c['ours'], '5.2f')}  "
                        f"{c['check']}"
                    )
    return "\n".join(lines)


def progress(args: argparse.Namespace, world: int, res: dict[str, Any], seconds: float) -> str:
    return f"[{world} GPUs: {seconds:.0f} s]\n" + tables({world: res}, args)


def plot(results: dict[int, dict[str, Any]], path: Path) -> str:
    worlds = sorted(results)
    coll = {w: results[w]["collectives"] for w in worlds if "collectives" in results[w]}

    def draw(plt: Any) -> Any:
        fig, axes = plt.subplots(1, 3 if coll else 2, figsize=(15 if coll else 10, 3.8))
        for name in IMPLS:
            pts = [(w, results[w]["impls"].get(name, {})) for w in worlds]
            pts = [(w, r) for w, r in pts if r.get("tokens_per_s")]
            if not pts:
                continue
            xs = [w for w, _ in pts]
            axes[0].plot(xs, [r["tokens_per_s"] for _, r in pts], "o-", label=name)
            axes[1].plot(xs, [(r.get("peak_bytes") or 0) / GIB for _, r in pts], "o-", label=name)
        axes[0].set(xlabel="GPUs", ylabel="tokens/s", xticks=worlds, title="throughput")
        axes[1].set(xlabel="GPUs", ylabel="peak GiB per GPU", xticks=worlds, title="memory")
        if axes[0].get_legend_handles_labels()[0]:
            axes[0].legend(fontsize=8)
        if coll:
            ax = axes[2]
            for w, ops in coll.items():
                for impl, style in (("ours", "-"), ("torch", "--")):
                    cells = ops["all_reduce"]
                    xs = [int(s) for s in cells]
                    bw = BUSBW["all_reduce"](w)
                    ys = [bw * int(s) / 1e9 / c[impl] for s, c in cells.items()]
                    ax.plot(xs, ys, style, marker="o", ms=3, label=f"{impl} {w} GPUs")
            ax.set(xscale="log", xlabel="bytes", ylabel="busbw GB/s", title="all_reduce")
            ax.legend(fontsize=8)
        return fig

    return _report.plot(path, draw)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", "--ranks", dest="ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--size", default="1b", choices=list(SIZES))
    impls_help = f"comma-separated subset of {','.join(IMPLS)} (empty: collectives only)"
    _harness.add_subset(p, "--impls", IMPLS, impls_help)
    p.add_argument("--batch", type=int, default=8, help="sequences per GPU in timed steps")
    p.add_argument("--loss-batch", type=int, default=8, help="global sequences, loss phase")
    p.add_argument("--loss-steps", type=int, default=3)
    p.add_argument("--loss-rtol", type=float, default=1e-3)
    _harness.add_blocks(p, steps=5, repeats=3, warmup=2)
    p.add_argument("--lr", type=float, default=1e-4)
    _harness.add_kw(p, "--zero-kw", "options for our zero3, e.g. unit_mb=128")
    p.add_argument("--coll-sizes", default="1K,4K,16K,64K,256K,1M,4M,16M,64M,256M,1G")
    p.add_argument("--coll-repeats", type=int, default=7)
    _harness.add_launch(p, timeout=900.0, timeout_help="seconds per GPU count")
    args, results = _harness.run_bench(p, argv, __file__, worker, progress)
    first = next(iter(results.values()))
    tag = args.tag or f"{args.device}-{args.size}"
    model = (
        f"; TinyGPT {first.get('params', 0) / 1e9:.2f}B params {first.get('config')}, AdamW, "
        f"fp32 (TF32 matmuls in timed steps), {args.batch} seqs per GPU"
    )
    _report.publish(
        _report.RESULTS / f"scaling-{tag}",
        _report.header(Path(__file__).name, _report.machine(args.device, gpu_count=True) + model),
        tables(results, args),
        {"args": vars(args), "results": results},
        lambda path: plot(results, path),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
