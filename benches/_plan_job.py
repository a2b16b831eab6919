"""What the planner's benches share: one rank's GPT, its batch, and a choice built to train.

``gpt`` builds ``bench_zero.py``'s GPT of a size (or, for ``"main"``, the main job's, each
rank taking its share of the main job's batch), this rank's batch of random tokens and the
mixed precision of a ``--dtype``; ``trained`` wraps a fresh model as one of
``sl.plan_strategy``'s choices, with AdamW, as ``sl.distribute`` takes it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any


def gpt(
    size: str, dtype: str, rank: int, world: int, device: Any
) -> tuple[Callable[..., Any], tuple[Any, Any], Any]:
    """``(build, (x, y), mixed_precision)``.

    ``build()`` makes the model (seeded) on ``device``, ``build(meta=True)`` its shapes only;
    ``(x, y)`` is this rank's batch; the policy is ``dtype``'s (``"bf16"``: bf16 compute,
    fp32 reductions; ``"fp32"``: none).
    """
    import torch  # noqa: PLC0415
    from bench_zero import SIZES  # noqa: PLC0415

    import shardline as sl  # noqa: PLC0415
    from shardline.examples.train import Config, TinyGPT  # noqa: PLC0415

    if size == "main":
        cfg, batch = Config(), Config().batch_size // world
    else:
        d_model, layers, heads, seq_len, batch = SIZES[size]
        cfg = Config(d_model=d_model, num_layers=layers, num_heads=heads, seq_len=seq_len)
    mp = (
        sl.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if dtype == "bf16"
        else None
    )
    gen = torch.Generator().manual_seed(rank)
    x = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=gen).to(device)
    y = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=gen).to(device)

    def build(meta: bool = False) -> Any:
        if meta:  # shapes only, nothing allocated
            with torch.device("meta"):
                return TinyGPT(cfg)
        torch.manual_seed(0)
        return TinyGPT(cfg).to(device)

    return build, (x, y), mp


def trained(
    build: Callable[..., Any],
    choice: Any,
    mp: Any,
    meshes: dict[Any, Any] | None = None,
    batch: Any = None,
) -> tuple[Any, Any]:
    """``(model, optimizer)``: a fresh model wrapped as ``choice`` (a ``Candidate``), AdamW.

    A tensor-parallel or pipeline choice is built as ``sl.as_distributed`` builds it, on its
    ``{"dp", "tp"}`` or ``{"dp", "pp"}`` mesh (kept in ``meshes``; a pipeline's stages
    balanced on a micro-batch of ``batch``, this rank's).
    """
    import torch  # noqa: PLC0415

    import shardline as sl  # noqa: PLC0415

    if choice.batch_scale > 1:
        from shardline.comm.world import default_group  # noqa: PLC0415
        from shardline.examples.model import as_sequential, lm_loss  # noqa: PLC0415
        from shardline.parallel.choice import wrap_choice  # noqa: PLC0415
        from shardline.parallel.pipeline_layout import with_loss  # noqa: PLC0415

        plain = build()
        model = wrap_choice(
            with_loss(as_sequential(plain), lm_loss) if choice.pp > 1 else plain, choice,
            default_group(), mp, {}, meshes if meshes is not None else {}, batch,
        )  # fmt: skip
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    kw: dict[str, Any] = {}
    if choice.strategy != "ddp":
        kw["mixed_precision"] = mp
    if choice.offload:
        kw["offload"] = choice.offload
    model, opt = sl.distribute(
        model, opt, strategy=choice.strategy, recompute=choice.recompute, **kw
    )
    assert opt is not None
    return model, opt


def add_args(p: argparse.ArgumentParser, size: str) -> None:
    """The arguments both planner benches take (``size``: the default model size)."""
    p.add_argument("--ranks", type=int, nargs="+", default=[2])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--size", default=size, help="main, or bench_zero.py's model sizes")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--tensor-parallel", action="store_true", help="price tp layouts too")
    p.add_argument("--pipeline", action="store_true", help="price pipelines of the GPT too")


def planned_model(model: Any, args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The model to plan (the GPT, or as a chain with ``--pipeline``) and what
    ``as_distributed`` / ``plan_strategy`` then take besides."""
    if not args.pipeline:
        return model, {}
    from shardline.examples.model import as_sequential, lm_loss  # noqa: PLC0415

    return as_sequential(model), {"pipeline": True, "loss_fn": lm_loss}


def publish(prefix: str, bench: str, args: argparse.Namespace, results: Any, text: str) -> None:
    """Writes ``benches/results/<prefix>-<tag>.{txt,json}`` (the tag from the arguments)."""
    import _report  # noqa: PLC0415

    tag = args.tag or (
        f"{args.device}-{args.size}-{args.dtype}-{os.cpu_count()}c"
        + ("-tp" if args.tensor_parallel else "")
        + ("-pp" if getattr(args, "pipeline", False) else "")
    )
    _report.publish(
        _report.RESULTS / f"{prefix}-{tag}",
        _report.header(bench, _report.machine(args.device)),
        text,
        {"args": vars(args), "results": results},
        lambda _path: "no plot: a table",
    )


def widened(batch: Any, k: int) -> Any:
    """``batch`` repeated ``k`` times along its first dimension: ``k`` ranks' batches."""
    from shardline.parallel.layout_meta import widened as repeat  # noqa: PLC0415

    return repeat(batch, k)
