"""What the planner's benches share: one rank's GPT, its batch, and a choice built to train.

``gpt`` builds ``bench_zero.py``'s GPT of a size (or, for ``"main"``, the main job's, each
rank taking its share of the main job's batch), this rank's batch of random tokens and the
mixed precision of a ``--dtype``; ``trained`` wraps a fresh model as one of
``sl.plan_strategy``'s choices, with AdamW, as ``sl.distribute`` takes it.
"""

from __future__ import annotations

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

    A tensor-parallel choice is composed on a ``{"dp", "tp"}`` mesh, a pipeline on its
    ``{"dp", "pp"}`` mesh (both kept in ``meshes``), as ``sl.as_distributed`` builds them
    (a pipeline's stages balanced on a micro-batch of ``batch``, this rank's).
    """
    import torch  # noqa: PLC0415

    import shardline as sl  # noqa: PLC0415

    if getattr(choice, "pp", 1) > 1:
        from shardline.comm.world import default_group  # noqa: PLC0415
        from shardline.examples.model import as_sequential, lm_loss  # noqa: PLC0415
        from shardline.parallel.choice import wrap_choice  # noqa: PLC0415
        from shardline.parallel.pipeline_layout import with_loss  # noqa: PLC0415

        group = default_group()
        model = wrap_choice(
            with_loss(as_sequential(build()), lm_loss), choice, group, mp, {},
            meshes if meshes is not None else {}, batch,
        )  # fmt: skip
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    kw: dict[str, Any] = {}
    if choice.strategy != "ddp":
        kw["mixed_precision"] = mp
    if choice.offload:
        kw["offload"] = choice.offload
    tp = getattr(choice, "tp", 1)
    if tp > 1:
        meshes = meshes if meshes is not None else {}
        if tp not in meshes:
            meshes[tp] = sl.DeviceMesh({"dp": sl.get_world_size() // tp, "tp": tp})
        kw["mesh"] = meshes[tp]
    model, opt = sl.distribute(
        model, opt, strategy=choice.distribute_strategy, recompute=choice.recompute, **kw
    )
    assert opt is not None
    return model, opt


def widened(batch: Any, k: int) -> Any:
    """``batch`` repeated ``k`` times along its first dimension: ``k`` ranks' batches."""
    from shardline.parallel.layout_meta import widened as repeat  # noqa: PLC0415

    return repeat(batch, k)
