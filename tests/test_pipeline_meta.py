"""Pipelines of models built on the meta device: each rank materialises only its stages.

The checks: no rank ever holds more than its stages; a tied weight's copies and data-parallel
replicas start equal although every rank initialised its own part; a meta model loaded from a
checkpoint trains exactly as the model that was saved. Ranks are threads (``tests/_ranks.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import shardline as sl
from shardline import checkpoint
from shardline.comm import ProcessGroup
from tests._ranks import run_ranks
from tests.test_pipeline import loss_fn, make_model, reference, run_steps
from tests.test_pipeline_state import lm_loss, tied_model


def on_meta(build: object) -> nn.Module:
    with torch.device("meta"):
        return build()  # type: ignore[operator]


def test_each_rank_materialises_only_its_stage_and_tied_copies_start_equal() -> None:
    total = sum(p.numel() for p in tied_model().parameters())

    def body(g: ProcessGroup) -> tuple[int, dict[str, torch.Tensor]]:
        model = sl.pipeline(on_meta(tied_model), g, microbatches=2, loss_fn=lm_loss)
        params = list(model.parameters())
        assert params and not any(p.is_meta for p in params)
        return sum(p.numel() for p in params), model.state_dict()

    results = run_ranks(2, body, timeout=60)
    held = [n for n, _ in results]
    emb = tied_model().get_parameter("0.weight").numel()  # the tied weight: on both ranks
    assert sum(held) == total + emb and max(held) < total, (held, total)
    full = results[0][1]
    # Rank 0 initialised the embedding, rank 1 the head (a Linear: another init): one value.
    assert torch.equal(full["0.weight"], full["5.weight"])
    assert all(torch.isfinite(v).all() for v in full.values())


def test_a_meta_model_loaded_from_a_checkpoint_trains_as_the_saved_one(tmp_path: Path) -> None:
    plain = make_model()
    checkpoint.save(tmp_path / "ck", model=plain)

    def body(g: ProcessGroup) -> dict[str, torch.Tensor]:
        model = sl.pipeline(on_meta(make_model), g, microbatches=2, loss_fn=loss_fn)
        checkpoint.load(tmp_path / "ck", model=model, group=g)
        run_steps(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        return model.state_dict()

    want, _ = reference(2)  # one process, the same micro-batches
    for got in run_ranks(2, body, timeout=60):
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, msg=key)


def test_replicas_of_a_meta_model_start_equal_under_zero() -> None:
    def body(g: ProcessGroup) -> dict[str, torch.Tensor]:
        mesh = sl.DeviceMesh({"dp": 2, "pp": 2}, group=g)
        torch.manual_seed(g.rank)  # every rank draws different initial values
        model, _ = sl.distribute(on_meta(make_model), None, mesh=mesh,
                                 strategy={"dp": "zero2", "pp": "1f1b"}, microbatches=2,
                                 loss_fn=loss_fn)  # fmt: skip
        return model.state_dict()

    first, *others = run_ranks(4, body, timeout=60)
    for other in others:
        for key, value in first.items():
            assert torch.equal(other[key], value), key


def test_an_init_fn_that_leaves_meta_tensors_is_refused() -> None:
    def body(g: ProcessGroup) -> None:
        sl.pipeline(on_meta(make_model), g, init_fn=lambda m: m.to("meta"), loss_fn=loss_fn)

    with pytest.raises(AssertionError, match="still on the meta device; init_fn must give"):
        run_ranks(2, body, timeout=60)
