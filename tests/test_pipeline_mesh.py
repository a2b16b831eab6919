"""Pipelines composed with data parallelism on a mesh: ``sl.distribute(..., mesh=...)``.

``dp=2 x pp=2``: each replica trains its half of the global batch through a 2-stage pipeline,
gradients averaged over the replicas once per step (DDP). The reference is one process on the
whole batch, accumulating the same micro-batches. Ranks are threads (``tests/_ranks.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import shardline as sl
from shardline import checkpoint
from shardline.comm import ProcessGroup
from shardline.errors import InvalidArgumentError
from tests._ranks import run_ranks
from tests.test_pipeline import STEPS, batch, loss_fn, make_model, reference

M = 2  # micro-batches per replica


def train_on_mesh(
    g: ProcessGroup, schedule: str, path: Path | None = None
) -> dict[str, torch.Tensor]:
    mesh = sl.DeviceMesh({"dp": 2, "pp": 2}, group=g)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = sl.distribute(
        model, opt, mesh=mesh, strategy={"dp": "ddp", "pp": schedule}, microbatches=M,
        loss_fn=loss_fn,
    )  # fmt: skip
    assert opt is not None
    replica = mesh.local_rank("dp")
    for step in range(STEPS):
        x, y = batch(step)
        rows = slice(8 * replica, 8 * replica + 8)
        opt.zero_grad()
        model.step(x[rows], target=y[rows])  # type: ignore[operator]
        opt.step()
    if path is not None:
        checkpoint.save(path, model=model, optimizer=opt, group=g)
    return model.state_dict()


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_ddp_over_pipeline_stages_equals_one_process(schedule: str) -> None:
    want, _ = reference(2 * M)  # the whole batch, in the replicas' micro-batches, in order
    for full in run_ranks(4, lambda g: train_on_mesh(g, schedule), timeout=90):
        assert set(full) == set(want)
        for key, value in want.items():
            torch.testing.assert_close(full[key], value, msg=key)


def test_a_dp_x_pp_checkpoint_loads_into_one_process_and_at_pp4(tmp_path: Path) -> None:
    saved = run_ranks(4, lambda g: train_on_mesh(g, "1f1b", tmp_path / "ck"), timeout=90)[0]
    plain = make_model()
    checkpoint.load(tmp_path / "ck", model=plain)
    for key, value in saved.items():
        assert torch.equal(plain.state_dict()[key], value), key

    def at_pp4(g: ProcessGroup) -> bool:
        model = sl.pipeline(make_model(), g, microbatches=2, loss_fn=loss_fn)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        checkpoint.load(tmp_path / "ck", model=model, optimizer=opt, group=g)
        loaded = model.state_dict()
        return all(torch.equal(loaded[k], v) for k, v in saved.items())

    assert all(run_ranks(4, at_pp4, timeout=90))
    info = str(checkpoint.info(tmp_path / "ck"))
    assert "ddp x pipeline" in info, info


def test_compositions_not_built_yet_say_so() -> None:
    def body(g: ProcessGroup) -> None:
        mesh = sl.DeviceMesh({"dp": 2, "pp": 1}, group=g)
        with pytest.raises(InvalidArgumentError, match=r"over pipeline stages is not built yet"):
            sl.distribute(make_model(), mesh=mesh, strategy={"dp": "zero2", "pp": "1f1b"})
        with pytest.raises(InvalidArgumentError, match="tensor parallelism"):
            sl.distribute(make_model(), mesh=mesh, strategy={"tp": "auto", "pp": "1f1b"})

    run_ranks(2, body, timeout=60)
