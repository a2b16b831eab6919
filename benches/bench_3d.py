"""Layouts on one mesh, ours against the same layouts built from torch's own pieces.

Every rank builds the same Hugging Face ``LlamaForCausalLM`` (one seed, fp32 master weights,
bf16 compute) and trains it on the same global batch of ``--batch`` sequences of ``--seq``
tokens; each data-parallel replica takes every ``dp``-th sequence. Per layout (``--layouts``,
e.g. ``dp4,dp2xtp2,pp2xtp2``; an axis left out is 1):

- ``dpN`` (ZeRO-3): ours ``sl.distribute(strategy="zero3")``; torch's ``fully_shard`` on
  every decoder layer, then the root (``MixedPrecisionPolicy``, gradients reduced in fp32).
- ``dpDxtpT``: ours ``sl.distribute(mesh=DeviceMesh({"dp": D, "tp": T}), strategy={"dp":
  "zero3", "tp": "auto"})``; torch's ``parallelize_module`` on the mesh's ``tp`` axis (the
  plan equal to ours: ``bench_tensor.dtensor_plan``, the vocabulary-parallel loss), then
  ``fully_shard`` on its ``dp`` axis.
- With a ``pp`` axis (``pp2xtp2``, ``dp2xpp2``, ``dp2xpp2xtp2``): the Llama as a chain of
  stages (``_llama_stages.llama_chain``), cut at the same children on both sides, 1F1B over
  ``--microbatches`` micro-batches per replica. Ours ``sl.distribute(mesh=..., strategy={"pp":
  "1f1b", "tp": "auto", "dp": --pp-dp})``, autocast to bf16; torch's
  ``torch.distributed.pipelining`` (``PipelineStage``, ``Schedule1F1B``) on stages split by
  ``parallelize_module`` and, with a ``dp`` axis, ``fully_shard`` (``MixedPrecisionPolicy``,
  ``reshard_after_forward=False``, as torchtitan runs FSDP under a pipeline), else autocast.
  In a pipeline both sides gather the logits on the last stage for the loss.

Both sides use ``torch.optim.AdamW``. Each implementation is built, warmed up and timed alone
(``--repeats`` blocks of ``--steps`` steps), then freed, so its peak memory is its own. Prints
tokens/s, MFU (model FLOPs: ``6 N + 12 L d S`` per token with ``N`` the parameters outside
the input embedding, over ``GPUs x --peak-tflops``), peak memory per GPU (max over ranks) and
the step-1 loss of each layout. ``--dtype float32`` runs everything in fp32 (the step-1
losses then agree to fp32 rounding). Writes ``benches/results/3d-<tag>.{txt,json,png}``.

    python benches/bench_3d.py --ranks 4 --layouts dp4,dp2xtp2,pp2xtp2                # CPU, here
    python benches/bench_3d.py --device cuda --ranks 4 --layouts dp4,dp2xtp2,pp2xtp2,dp2xpp2 \\
        --hidden 3072 --layers 26 --heads 24 --kv-heads 8 --vocab 32000 --seq 2048 --batch 16
    # the 8-GPU run (results/3d-8gpu.*); again with --dtype float32 for the losses
    python benches/bench_3d.py --device cuda --ranks 8 \\
        --layouts dp2xpp2xtp2,dp4xtp2,pp2xtp4,dp8 --hidden 3072 --layers 26 --heads 24 \\
        --kv-heads 8 --vocab 32000 --seq 2048 --batch 16 --tag 8gpu
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import _harness
import _report
from _llama_stages import cuts, llama_chain, next_token_loss, param_groups, torch_pipeline
from bench_tensor import add_model_args, build, dtensor_plan

MIB = 2**20
AXES = ("dp", "pp", "tp")


def parse_layout(text: str) -> dict[str, int]:
    """``"dp2xpp2xtp2"`` -> ``{"dp": 2, "pp": 2, "tp": 2}`` (``dp`` is 1 when left out)."""
    axes: dict[str, int] = {}
    for part in text.split("x"):
        name = part.rstrip("0123456789")
        if name not in AXES or not part[len(name) :].isdigit() or name in axes:
            raise argparse.ArgumentTypeError(
                f"{text!r}: a layout names dp, pp and tp sizes joined by x, e.g. dp4, dp2xtp2, "
                "pp2xtp2, dp2xpp2xtp2"
            )
        axes[name] = int(part[len(name) :])
    return {n: axes.get(n, 1) for n in AXES if n in axes or n == "dp"}


def flops_per_token(model: Any, seq: int) -> float:
    """``6 N + 12 L d S``: ``N`` without the input embedding (a lookup), attention's scores and
    their product with the values at full (not causal) cost, as PaLM's MFU counts them."""
    cfg = model.config
    n = sum(p.numel() for n_, p in model.named_parameters() if "embed_tokens" not in n_)
    return 6 * n + 12 * cfg.num_hidden_layers * cfg.hidden_size * seq


def worker(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: PLC0415
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module  # noqa: PLC0415

    import shardline as sl  # noqa: PLC0415

    rank, world, device, group = _harness.join_job(args.device)
    cuda = device.type == "cuda"
    torch.set_num_threads(max(1, args.threads))
    low = getattr(torch, args.dtype) if args.dtype != "float32" else None  # the compute dtype
    gen = torch.Generator().manual_seed(1)
    batches = [
        torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)
        for _ in range(2)
    ]
    with torch.device("meta"):
        per_token = flops_per_token(build(args, "meta"), args.seq)

    def ours(axes: dict[str, int]) -> tuple[Any, Any, int]:
        model = build(args, device)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        if "pp" in axes:  # autocast in the stages; ZeRO on dp holds the whole weights in bf16
            mesh = sl.DeviceMesh({n: k for n, k in axes.items() if k > 1 or n == "pp"},
                                 group=group)  # fmt: skip
            strategy = {"pp": "1f1b", "tp": "auto", "dp": args.pp_dp}
            model, opt = sl.distribute(
                llama_chain(model), opt, mesh=mesh,
                strategy={n: strategy[n] for n in mesh.axis_names},
                microbatches=args.microbatches, loss_fn=next_token_loss,
                split=cuts(args.layers, axes["pp"]),
                mixed_precision=sl.MixedPrecision(param_dtype=low) if low else None,
            )  # fmt: skip
            return model, opt, mesh.local_rank("dp") if axes["dp"] > 1 else 0
        mp = sl.MixedPrecision(param_dtype=low, reduce_dtype=torch.float32) if low else None
        if "tp" not in axes:
            model, opt = sl.distribute(model, opt, strategy="zero3", group=group,
                                       mixed_precision=mp)  # fmt: skip
            return model, opt, group.rank
        mesh = sl.DeviceMesh(axes, group=group)
        model, opt = sl.distribute(model, opt, mesh=mesh, mixed_precision=mp,
                                   strategy={"dp": "zero3", "tp": "auto"})  # fmt: skip
        return model, opt, mesh.local_rank("dp")

    def theirs(axes: dict[str, int]) -> tuple[Any, Any, int]:
        model = build(args, device)
        if "pp" in axes:
            pipe = torch_pipeline(llama_chain(model), axes, device,
                                  microbatches=args.microbatches, dtype=low)  # fmt: skip
            dp_rank = pipe.mesh["dp"].get_local_rank()
            return pipe, torch.optim.AdamW(param_groups(pipe.module), lr=args.lr), dp_rank
        mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
        if "tp" in axes:
            mesh = init_device_mesh(device.type, (axes["dp"], axes["tp"]),
                                    mesh_dim_names=("dp", "tp"))  # fmt: skip
            parallelize_module(model, mesh["tp"], dtensor_plan(model))
            dp_mesh = mesh["dp"]
        else:
            dp_mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
        for layer in model.model.layers:
            fully_shard(layer, mesh=dp_mesh, mp_policy=mp)
        fully_shard(model, mesh=dp_mesh, mp_policy=mp)
        return model, torch.optim.AdamW(model.parameters(), lr=args.lr), dp_mesh.get_local_rank()

    def step(side: str, axes: dict[str, int], model: Any, opt: Any, row: int, i: int) -> Any:
        """One training step; the loss where this rank knows it, else ``None``."""
        ids = batches[i % len(batches)][row :: axes["dp"]]
        opt.zero_grad(set_to_none=True)
        loss: Any = None
        if "pp" in axes and side == "torch":  # the loss on the last stage only
            losses: list[Any] = []
            given = {"target": ids, "losses": losses} if model.last else {}
            model.schedule.step(*([ids] if model.first else []), **given)
            loss = torch.stack(losses).mean() if model.last else None
        elif "pp" in axes:
            loss = model.step(ids, target=ids)  # every rank of the pipeline gets it
        elif side == "torch" and "tp" in axes:  # logits split by vocabulary: torch's parallel loss
            logits = model(input_ids=ids).logits
            with loss_parallel():
                loss = next_token_loss(logits, ids)
                loss.backward()
            loss = loss.full_tensor()
        else:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        opt.step()
        return None if loss is None else loss.detach()

    rows: dict[str, dict[str, Any]] = {}
    for text in args.layouts:
        axes = parse_layout(text)
        if math.prod(axes.values()) != world:
            raise SystemExit(f"{text}: {axes} is not {world} ranks")
        for side, make in (("shardline", ours), ("torch", theirs)):
            key = f"{text}/{side}"
            _harness.sync(device)
            base = torch.cuda.memory_allocated(device) if cuda else 0
            model, opt, row = make(axes)
            loss = step(side, axes, model, opt, row, 0)
            first = torch.zeros(2, dtype=torch.float64, device=device)
            if loss is not None:
                first += torch.stack([loss.to(first.dtype), torch.ones_like(first[0])])
            dist.all_reduce(first)  # the mean over the ranks that know their replica's loss
            for i in range(1, args.warmup):
                step(side, axes, model, opt, row, i)
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            times = []
            for _ in range(args.repeats):
                dist.barrier()
                _harness.sync(device)
                t0 = time.perf_counter()
                for i in range(args.steps):
                    step(side, axes, model, opt, row, i)
                _harness.sync(device)
                times.append((time.perf_counter() - t0) / args.steps)
            peak = torch.cuda.max_memory_allocated(device) - base if cuda else 0
            stats = torch.tensor([statistics.median(times), float(peak)], device=device,
                                 dtype=torch.float64)  # fmt: skip
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # the slowest rank, the fullest GPU
            t = float(stats[0])
            tokens = args.batch * args.seq
            rows[key] = {
                "layout": text, "side": side, "axes": axes, "step_ms": t * 1e3,
                "tokens_per_s": tokens / t, "peak_bytes": float(stats[1]),
                "first_loss": float(first[0] / first[1]),
                "mfu": tokens / t * per_token / (world * args.peak_tflops * 1e12),
            }  # fmt: skip
            if rank == 0:
                print(f"{key}: {rows[key]['step_ms']:.1f} ms, loss {rows[key]['first_loss']:.5f}",
                      flush=True)  # fmt: skip
            del model, opt
            if cuda:
                torch.cuda.empty_cache()
    result = {"rows": rows, "flops_per_token": per_token, "dtype": args.dtype}
    return _harness.leave_job(rank, result, args.out)


def table(result: dict[str, Any]) -> str:
    rows = result["rows"]
    lines = [
        f"{'layout':10} {'side':9} {'step ms':>9} {'tokens/s':>10} {'vs torch':>8} {'MFU':>6} "
        f"{'peak MiB':>10} {'vs torch':>8} {'step-1 loss':>11}"
    ]
    goals = []
    losses = [r["first_loss"] for r in rows.values()]
    for r in rows.values():
        peer = rows.get(f"{r['layout']}/torch", {})
        lines.append(
            f"{r['layout']:10} {r['side']:9} {r['step_ms']:9.1f} {r['tokens_per_s']:10,.0f} "
            f"{_report.ratio(r['tokens_per_s'], peer.get('tokens_per_s'), '7.2f', '      -')} "
            f"{100 * r['mfu']:5.1f}% {r['peak_bytes'] / MIB:10,.0f} "
            f"{_report.ratio(r['peak_bytes'], peer.get('peak_bytes'), '7.2f', '      -')} "
            f"{r['first_loss']:11.5f}"
        )
        if r["side"] == "shardline" and peer:
            speed = r["tokens_per_s"] / peer["tokens_per_s"]
            line = (
                f"  {r['layout']}: tokens/s {speed:.2f}x torch "
                f"({'met' if speed >= 1.0 else 'NOT met'}: >= 1.0x)"
            )
            if peer["peak_bytes"] > 0:  # measured on CUDA only
                mem = r["peak_bytes"] / peer["peak_bytes"]
                line += f", peak memory {mem:.2f}x ({'met' if mem <= 1.0 else 'NOT met'}: <= 1.0x)"
            goals.append(line)
    spread = (max(losses) - min(losses)) / min(losses) if losses else float("nan")
    fp32 = result.get("dtype") == "float32"
    bar = 1e-4 if fp32 else 0.01  # fp32: the rounding of other reduction orders
    goals.append(
        f"  step-1 losses within {100 * spread:.4f} % of each other "
        f"({'met' if spread <= bar else 'NOT met'}: within {100 * bar:g} % in "
        f"{'fp32' if fp32 else 'bf16'})"
    )
    return "\n".join([*lines, "goals:", *goals])


def plot(result: dict[str, Any], path: Path) -> str:
    def draw(plt: Any) -> Any:
        rows = result["rows"]
        layouts = list(dict.fromkeys(r["layout"] for r in rows.values()))
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        for k, (side, label) in enumerate((("shardline", "ours"), ("torch", "torch"))):
            xs = [i + 0.4 * k for i in range(len(layouts))]
            got = [rows.get(f"{name}/{side}", {}) for name in layouts]
            axes[0].bar(xs, [r.get("tokens_per_s", 0) for r in got], width=0.4, label=label)
            axes[1].bar(xs, [r.get("peak_bytes", 0) / 2**30 for r in got], width=0.4, label=label)
        for ax, what in zip(axes, ("tokens/s", "peak GiB per GPU"), strict=True):
            ax.set_xticks([i + 0.2 for i in range(len(layouts))], layouts)
            ax.set_ylabel(what)
            ax.legend()
        how = "fp32" if result.get("dtype") == "float32" else "bf16 compute on fp32 master weights"
        fig.suptitle(f"Llama, {how}: ours against torch's pieces")
        fig.tight_layout()
        return fig

    return _report.plot(path, draw)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[4])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--layouts", type=_harness.comma_list, default=["dp4", "dp2xtp2"])
    p.add_argument("--batch", type=int, default=8, help="sequences per step, all ranks")
    add_model_args(p)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="compute dtype (master weights are fp32 either way)")  # fmt: skip
    p.add_argument("--microbatches", type=int, default=8, help="per replica, in a pipeline")
    p.add_argument("--pp-dp", default="zero3", choices=["ddp", "zero1", "zero2", "zero3"],
                   help="ours on a pipeline's dp axis (torch's: fully_shard)")  # fmt: skip
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="per GPU, bf16 dense (H100 and H200 SXM: 989)")  # fmt: skip
    _harness.add_blocks(p, steps=3, repeats=3, warmup=2, repeats_help="timed blocks per side")
    _harness.add_launch(p, timeout=900.0)
    args, results = _harness.run_bench(p, argv, __file__, worker, lambda a, w, r, _s: table(r))
    cores = os.cpu_count()
    tag = args.tag or f"{args.device}-{cores}c"
    _report.publish(
        _report.RESULTS / f"3d-{tag}",
        _report.header(Path(__file__).name, _report.machine(args.device)),
        "\n".join(table(r) for r in results.values()),
        {"args": vars(args), "cores": cores, "results": results},
        lambda path: plot(next(iter(results.values())), path),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
