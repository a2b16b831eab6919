"""Pipelines composed with data parallelism on a mesh: ``sl.distribute(..., mesh=...)``.

``dp=2 x pp=2``: each replica trains its half of the global batch through a 2-stage pipeline,
gradients averaged over the replicas once per step (DDP, or ZeRO-1/2/3 sharding the optimizer
state, the gradients and the parameters between steps over the replicas). The reference is
one process on the whole batch, accumulating the same micro-batches. Ranks are threads
(``tests/_ranks.py``).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

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
    g: ProcessGroup, schedule: str, path: Path | None = None, dp: str = "ddp"
) -> dict[str, torch.Tensor]:
    mesh = sl.DeviceMesh({"dp": 2, "pp": 2}, group=g)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = sl.distribute(
        model, opt, mesh=mesh, strategy={"dp": dp, "pp": schedule}, microbatches=M,
        loss_fn=loss_fn,
    )  # fmt: skip
    assert opt is not None
    whole = sum(p.numel() for p in model.state_dict().values()) if dp != "ddp" else 0
    after = (lambda: check_sharded(model, opt, dp, whole)) if dp != "ddp" else None
    train_replica(model, opt, mesh.local_rank("dp"), after)
    if path is not None:
        checkpoint.save(path, model=model, optimizer=opt, group=g)
    return model.state_dict()


def train_replica(model: Any, opt: torch.optim.Optimizer, replica: int, after: Any = None) -> None:
    """STEPS steps of replica ``replica`` (of 2) on its half of each batch; ``after()`` after
    each optimizer step."""
    for step in range(STEPS):
        x, y = batch(step)
        rows = slice(8 * replica, 8 * replica + 8)
        opt.zero_grad()
        model.step(x[rows], target=y[rows])
        opt.step()
        if after is not None:
            after()


def check_sharded(model: Any, opt: torch.optim.Optimizer, dp: str, whole: int) -> None:
    """ZeRO on the replicas: the optimizer steps 1-D parts, about half of this rank's stage
    (two replicas); gradients are parts only after ZeRO-2/3's step, and ZeRO-3 holds no whole
    parameters between steps. ZeRO-1/2's parts view the whole parameters (no copy of their
    own: ``master`` 0), ZeRO-3's are the only copy (padding included)."""
    parts = list(model.parameters())
    assert all(p.dim() == 1 for p in parts)
    stats = model.memory_stats()
    held = sum(p.numel() for p in parts)
    assert 0 < held < whole // 2, (held, whole)
    if dp == "zero3":
        assert held <= stats["master"] // 4 <= held + 1, (held, stats)
    else:
        assert stats["master"] == 0, stats
    moments = sum(v.numel() for st in opt.state.values() for k, v in st.items() if k != "step")
    assert moments == 2 * held  # AdamW's two moments, for the parts only
    if dp != "zero1":
        assert held <= stats["grads"] // 4 <= held + 1, stats
    assert (stats["params"] == 0) == (dp == "zero3"), stats


@pytest.mark.parametrize(
    ("dp", "schedule"),
    [("ddp", "1f1b"), ("ddp", "zero_bubble"), ("zero1", "1f1b"), ("zero2", "gpipe"),
     ("zero3", "1f1b"), ("zero3", "zero_bubble")],
)  # fmt: skip
def test_data_parallel_over_pipeline_stages_equals_one_process(dp: str, schedule: str) -> None:
    want, _ = reference(2 * M)  # the whole batch, in the replicas' micro-batches, in order
    for full in run_ranks(4, lambda g: train_on_mesh(g, schedule, dp=dp), timeout=90):
        assert set(full) == set(want)
        for key, value in want.items():
            torch.testing.assert_close(full[key], value, msg=key)


@pytest.mark.parametrize("dp", ["ddp", "zero3"])
def test_a_dp_x_pp_checkpoint_loads_into_one_process_at_pp4_and_at_dp4_zero3(
    tmp_path: Path, dp: str
) -> None:
    saved = run_ranks(4, lambda g: train_on_mesh(g, "1f1b", tmp_path / "ck", dp=dp), timeout=90)[0]
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

    def at_dp4_zero3(g: ProcessGroup) -> bool:
        model = make_model()
        wrapped, opt = sl.distribute(
            model, torch.optim.AdamW(model.parameters(), lr=1e-2), strategy="zero3", group=g
        )
        checkpoint.load(tmp_path / "ck", model=wrapped, optimizer=opt, group=g)
        loaded = wrapped.state_dict()
        return all(torch.equal(loaded[k], v) for k, v in saved.items())

    assert all(run_ranks(4, at_pp4, timeout=90))
    assert all(run_ranks(4, at_dp4_zero3, timeout=90))
    info = str(checkpoint.info(tmp_path / "ck"))
    assert f"{dp} x pipeline" in info, info


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_zero_accumulates_whole_gradients_in_its_reduction_buffer(schedule: str) -> None:
    """ZeRO-3 over pipeline stages: each micro-batch's backward (the weight pass of the
    zero-bubble schedule too) adds into views of the one buffer the step then reduce-scatters,
    so no whole-size copy of the gradients is made; the training still equals one process."""
    want, _ = reference(2 * M)

    def body(g: ProcessGroup) -> tuple[list[bool], dict[str, torch.Tensor]]:
        mesh = sl.DeviceMesh({"dp": 2, "pp": 2}, group=g)
        model = make_model()
        model, opt = sl.distribute(
            model, torch.optim.AdamW(model.parameters(), lr=1e-2), mesh=mesh,
            strategy={"dp": "zero3", "pp": schedule}, microbatches=M, loss_fn=loss_fn,
        )  # fmt: skip
        zero = model._replicas.wrappers[0]  # the ShardedDataParallel of this rank's stage
        reduce, in_place = zero.reduce_grads, []

        def spy() -> None:  # at the end of the step's backward, before the reduction
            whole = [p for p in zero.module.parameters() if p.requires_grad]
            bases = {zero.whole_grad(p).untyped_storage().data_ptr() for p in whole}
            in_place.append(len(bases) == 1 and all(
                p.grad is not None and p.grad.untyped_storage().data_ptr() in bases for p in whole
            ))  # fmt: skip
            reduce()

        zero.reduce_grads = spy
        assert opt is not None
        train_replica(model, opt, mesh.local_rank("dp"))
        return in_place, model.state_dict()

    for in_place, full in run_ranks(4, body, timeout=90):
        assert in_place and all(in_place), in_place
        for key, value in want.items():
            torch.testing.assert_close(full[key], value, msg=key)


def _bf16_reference(m: int) -> dict[str, torch.Tensor]:
    """One process as FSDP's mixed precision: each step's forwards and backwards on a bf16
    copy of the fp32 master weights (under autocast), the micro-batches' gradients summed in
    fp32, AdamW on the master."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        x, y = batch(step)
        low = copy.deepcopy(model).to(torch.bfloat16)
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for xi, yi in zip(x.chunk(m), y.chunk(m), strict=True):
            low.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(low(xi), yi)
            (loss / m).backward()
            for g, q in zip(grads, low.parameters(), strict=True):
                g.add_(q.grad.float())  # type: ignore[union-attr]
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g
        opt.step()
    return model.state_dict()


@pytest.mark.parametrize(
    ("dp", "schedule"), [("zero1", "1f1b"), ("zero3", "1f1b"), ("zero3", "zero_bubble")]
)
def test_zero_under_bf16_holds_whole_parameters_in_bf16(
    tmp_path: Path, dp: str, schedule: str
) -> None:
    """``mixed_precision=bf16`` with ZeRO over pipeline stages, as FSDP's policy: the whole
    parameters the stages compute with are bf16 (half the bytes; ZeRO-3 gathers them from
    the parts in bf16), the parts fp32 masters, and the micro-batches' gradients accumulate in
    fp32. Three AdamW steps equal one process doing that; the state dict and a checkpoint
    hold the fp32 masters, which load into one process bit for bit."""
    want = _bf16_reference(2 * M)
    mp = sl.MixedPrecision(param_dtype=torch.bfloat16)

    def body(g: ProcessGroup) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        mesh = sl.DeviceMesh({"dp": 2, "pp": 2}, group=g)
        model = make_model()
        model, opt = sl.distribute(
            model, torch.optim.AdamW(model.parameters(), lr=1e-2), mesh=mesh,
            strategy={"dp": dp, "pp": schedule}, microbatches=M, loss_fn=loss_fn,
            mixed_precision=mp,
        )  # fmt: skip
        assert opt is not None
        whole = [p for child in model.children() for p in child.parameters()]
        zero = model._replicas.wrappers[0]
        reduce, buffers = zero.reduce_grads, []

        def spy() -> None:  # the step's gradients, before the reduction: all in the buffer
            buffers.extend((zero.whole_grad(p).dtype, p.grad is None)
                           for p in zero.module.parameters())  # fmt: skip
            reduce()

        zero.reduce_grads = spy
        train_replica(model, opt, mesh.local_rank("dp"))
        seen = {
            "buffers": set(buffers),
            "whole": {p.dtype for p in whole},
            "parts": {p.dtype for p in model.parameters()},
            "stats": model.memory_stats(),
        }
        checkpoint.save(tmp_path / "ck", model=model, optimizer=opt, group=g)
        return seen, model.state_dict()

    results = run_ranks(4, body, timeout=90)
    for seen, full in results:
        assert seen["whole"] == {torch.bfloat16} and seen["parts"] == {torch.float32}, seen
        assert seen["buffers"] == {(torch.float32, True)}, seen
        held = seen["stats"]["params"]
        assert held == (0 if dp == "zero3" else seen["stats"]["master"]), seen["stats"]
        for key, value in want.items():
            assert full[key].dtype == torch.float32, key
            torch.testing.assert_close(full[key], value, rtol=1e-4, atol=1e-5, msg=key)
    plain = make_model()
    checkpoint.load(tmp_path / "ck", model=plain)
    for key, value in results[0][1].items():
        assert torch.equal(plain.state_dict()[key], value), key


def test_compositions_that_cannot_work_say_so() -> None:
    def body(g: ProcessGroup) -> None:
        mesh = sl.DeviceMesh({"dp": 2, "pp": 1}, group=g)
        with pytest.raises(InvalidArgumentError, match=r"on the dp axis use"):
            sl.distribute(make_model(), mesh=mesh, strategy={"dp": "zero4", "pp": "1f1b"})
        with pytest.raises(InvalidArgumentError, match=r"axes \['dp', 'pp'\] .* must be"):
            sl.distribute(make_model(), mesh=mesh, strategy={"tp": "auto", "pp": "1f1b"})
        with pytest.raises(InvalidArgumentError, match="sequence_parallel needs a 'tp' axis"):
            sl.distribute(make_model(), mesh=mesh, strategy={"dp": "ddp", "pp": "1f1b"},
                          sequence_parallel=True)  # fmt: skip
        cube = sl.DeviceMesh({"pp": 1, "tp": 2}, group=g)
        with pytest.raises(InvalidArgumentError, match="sequence parallelism inside pipeline"):
            sl.distribute(make_model(), mesh=cube, strategy={"tp": "auto", "pp": "1f1b"},
                          sequence_parallel=True)  # fmt: skip

    run_ranks(2, body, timeout=60)


def test_zero_cuts_the_state_an_optimizer_already_holds_to_its_parts() -> None:
    """Adagrad builds its state at construction: bound by ``distribute``, each rank keeps the
    parts of it for its own parameters, and training equals one process with Adagrad."""
    model = make_model()
    ref = torch.optim.Adagrad(model.parameters(), lr=1e-2, initial_accumulator_value=0.1)
    for step in range(STEPS):
        x, y = batch(step)
        ref.zero_grad()
        for xi, yi in zip(x.chunk(2 * M), y.chunk(2 * M), strict=True):
            (loss_fn(model(xi), yi) / (2 * M)).backward()
        ref.step()
    want = model.state_dict()

    def body(g: ProcessGroup) -> dict[str, torch.Tensor]:
        mesh = sl.DeviceMesh({"dp": 2, "pp": 2}, group=g)
        plain = make_model()
        opt = torch.optim.Adagrad(plain.parameters(), lr=1e-2, initial_accumulator_value=0.1)
        pipe, opt = sl.distribute(plain, opt, mesh=mesh, strategy={"dp": "zero2", "pp": "1f1b"},
                                  microbatches=M, loss_fn=loss_fn)  # fmt: skip
        assert opt is not None
        for part, st in opt.state.items():
            assert st["sum"].shape == part.shape  # the accumulator, cut to the part
        train_replica(pipe, opt, mesh.local_rank("dp"))
        return pipe.state_dict()

    for full in run_ranks(4, body, timeout=90):
        for key, value in want.items():
            torch.testing.assert_close(full[key], value, msg=key)
