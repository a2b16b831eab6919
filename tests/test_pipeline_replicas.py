"""The data-parallel wrappers under a pipeline: steps a caller drives, and their collectives.

A pipeline stage runs its micro-batches on the inner module itself, so the wrappers of
``parallel.data`` give it caller steps: ZeRO's ``unshard(accumulate=True)`` (gathered once
per step, whole gradients accumulated) then ``reduce_grads()`` (one reduction per unit), and
DDP's ``accumulate()`` then ``reduce_grads()`` (one all-reduce per bucket). Each is checked
directly on a small model, counting the group's collectives (``group.traffic()``), and then
composed into a ``dp=2 x pp=2`` pipeline (``pipeline.replicas``): the collectives per step do
not depend on the number of micro-batches, and training equals one process. Ranks are
threads (``tests/_ranks.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import shardline as sl
from shardline.comm import ProcessGroup
from shardline.parallel.data.ddp import DistributedDataParallel
from shardline.parallel.data.zero import ShardedDataParallel
from shardline.parallel.pipeline.replicas import StageReplicas
from tests._ranks import run_ranks
from tests.test_pipeline import STEPS, batch, loss_fn, make_model, reference
from tests.test_pipeline_mesh import train_replica


def _calls(group: ProcessGroup) -> dict[str, int]:
    return {op: row["calls"] for op, row in group.traffic().items()}


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {op: n - before.get(op, 0) for op, n in after.items() if n - before.get(op, 0)}


def _micro_batches(module: nn.Module, rank: int, m: int) -> None:
    """This rank's half of batch 0, in ``m`` micro-batches, each loss divided by ``m``."""
    x, y = batch(0)
    rows = slice(8 * rank, 8 * rank + 8)
    for xi, yi in zip(x[rows].chunk(m), y[rows].chunk(m), strict=True):
        (loss_fn(module(xi), yi) / m).backward()


def _one_process_grads() -> dict[str, torch.Tensor]:
    """The mean gradient over the whole batch 0 (both ranks' halves)."""
    model = make_model()
    x, y = batch(0)
    loss_fn(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("m", [1, 4])
def test_a_zero3_caller_step_gathers_once_and_reduces_once_over_its_micro_batches(
    m: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ZeRO-3 held by ``unshard(accumulate=True)``: one all-gather per unit when the step
    starts, none per micro-batch; the whole gradients add up in one buffer per unit, which
    ``reduce_grads()`` reduce-scatters once; then the whole parameters are freed again and
    the parts' gradients are the mean of both ranks' batches (one process's)."""
    # Counts the wrapper's own collectives: ordinary buffers, since moving them to symmetric
    # memory adds its one-time allocation handshake (all-gathers) to the first step.
    monkeypatch.setenv("SHARDLINE_SYMMETRIC", "0")
    want = _one_process_grads()

    def body(g: ProcessGroup) -> tuple[dict[str, int], dict[str, int], int, dict[str, Any]]:
        zero = ShardedDataParallel(make_model(), stage=3, group=g, unit_mb=1.0, units="size",
                                   own_groups=False)  # fmt: skip
        units = len(zero._plan.units)
        assert zero.memory_stats()["params"] == 0  # sharded between steps
        before = _calls(g)
        zero.unshard(accumulate=True)
        gathered = _calls(g)
        _micro_batches(zero.module, g.rank, m)
        assert _calls(g) == gathered  # the micro-batches communicate nothing
        zero.reduce_grads()
        stats = zero.memory_stats()
        parts = {n: (p.detach().clone(), p.grad.clone()) for n, p in zero.named_parameters()}
        return _delta(gathered, before), _delta(_calls(g), gathered), units, {
            "params": stats["params"], "parts": parts, "ranges": _ranges(zero),
        }  # fmt: skip

    for gathers, reductions, units, seen in run_ranks(2, body, timeout=60):
        assert gathers == {"all_gather": units}, gathers
        assert reductions == {"reduce_scatter": units}, reductions
        assert seen["params"] == 0
        for name, (_, grad) in seen["parts"].items():
            a, b = seen["ranges"][name]
            torch.testing.assert_close(grad, want[name].reshape(-1)[a:b], msg=name)


def _ranges(zero: ShardedDataParallel) -> dict[str, tuple[int, int]]:
    return {n: r for u in zero._units for n, r in zip(u.names, u.local_ranges, strict=True)}


@pytest.mark.parametrize("stage", [1, 2])
def test_zero1_and_zero2_caller_steps_reduce_once_and_gather_only_after_an_optimizer_step(
    stage: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ZeRO-1/2: the whole parameters stay; a hold gathers nothing until an optimizer stepped
    the parts, then one all-gather per unit. One all-reduce (ZeRO-1) or reduce-scatter
    (ZeRO-2) per unit and step, and the parts' gradients are one process's."""
    # Counts the wrapper's own collectives: ordinary buffers, since moving them to symmetric
    # memory adds its one-time allocation handshake (all-gathers) to the first step.
    monkeypatch.setenv("SHARDLINE_SYMMETRIC", "0")
    want = _one_process_grads()
    reduce = "all_reduce" if stage == 1 else "reduce_scatter"

    def body(g: ProcessGroup) -> list[dict[str, int]]:
        zero = ShardedDataParallel(make_model(), stage=stage, group=g, unit_mb=1.0,
                                   units="size", own_groups=False)  # fmt: skip
        opt = torch.optim.SGD(zero.parameters(), lr=0.1)
        seen = []
        for _ in range(2):
            before = _calls(g)
            zero.unshard(accumulate=True)
            _micro_batches(zero.module, g.rank, 2)
            zero.reduce_grads()
            seen.append(_delta(_calls(g), before))
            for n, p in zero.named_parameters():
                a, b = _ranges(zero)[n]
                torch.testing.assert_close(p.grad, want[n].reshape(-1)[a:b], msg=n)
            opt.zero_grad()
        opt.step()  # with no gradients: nothing changes, but the parts are stale now
        before = _calls(g)
        zero.unshard(accumulate=True)
        seen.append(_delta(_calls(g), before))
        return seen

    for first, second, after_step in run_ranks(2, body, timeout=60):
        assert first == second == {reduce: 1}, (first, second)
        assert after_step == {"all_gather": 1}, after_step


@pytest.mark.parametrize("m", [1, 4])
def test_a_ddp_caller_step_accumulates_in_its_buckets_and_all_reduces_each_once(m: int) -> None:
    """DDP's ``accumulate()``: the gradients become views of the buckets and the micro-batches
    add up there; ``reduce_grads()`` all-reduces each bucket once (no copy of the gradients
    around it), giving one process's mean gradient."""
    want = _one_process_grads()

    def body(g: ProcessGroup) -> tuple[dict[str, int], int, bool, dict[str, torch.Tensor]]:
        ddp = DistributedDataParallel(make_model(), group=g, bucket_cap_mb=1, first_bucket_mb=1,
                                      in_place_mb=float("inf"))  # fmt: skip
        ddp.accumulate()
        flats = {b.flat.untyped_storage().data_ptr() for b in ddp._buckets}
        in_buckets = all(p.grad.untyped_storage().data_ptr() in flats for p in ddp._params)
        before = _calls(g)
        _micro_batches(ddp.module, g.rank, m)
        ddp.reduce_grads()
        grads = {n: p.grad.clone() for n, p in ddp.module.named_parameters()}
        return _delta(_calls(g), before), len(ddp._buckets), in_buckets, grads

    for calls, buckets, in_buckets, grads in run_ranks(2, body, timeout=60):
        assert calls == {"all_reduce": buckets} and buckets == 1, calls
        assert in_buckets
        for name, value in want.items():
            torch.testing.assert_close(grads[name], value, msg=name)


# The data-parallel group's collectives in one steady step of a dp=2 x pp=2 pipeline, per
# rank: one chunk of one dtype, so one bucket or unit. Before this composition (the pipeline's
# own DDP and ZeRO) the counts were the same.
PER_STEP = {
    "ddp": {"all_reduce": 1},
    "zero1": {"all_reduce": 1, "all_gather": 1},
    "zero2": {"reduce_scatter": 1, "all_gather": 1},
    "zero3": {"reduce_scatter": 1, "all_gather": 1},
}


def _train_counting(
    model: Any, opt: torch.optim.Optimizer, mesh: sl.DeviceMesh
) -> list[dict[str, int]]:
    """Trains this replica (``train_replica``); the collectives each step issued on ``dp``."""
    group, counts = mesh.group("dp"), []
    last = _calls(group)

    def after() -> None:
        nonlocal last
        now = _calls(group)
        counts.append(_delta(now, last))
        last = now

    train_replica(model, opt, mesh.local_rank("dp"), after)
    return counts


@pytest.mark.parametrize("dp", ["ddp", "zero1", "zero2", "zero3"])
@pytest.mark.parametrize("m", [1, 4])
def test_dp_x_pp_issues_the_same_collectives_per_step_for_any_number_of_micro_batches(
    dp: str, m: int
) -> None:
    """The replicas' collectives per step do not depend on the micro-batches: one reduction
    per chunk (DDP's all-reduce, ZeRO-1's all-reduce, ZeRO-2/3's reduce-scatter) and, with
    ZeRO, one all-gather per chunk (the parts the optimizer stepped; ZeRO-3's freed whole
    parameters) when the step starts. And the training equals one process."""
    want, _ = reference(2 * m)

    def body(g: ProcessGroup) -> tuple[list[dict[str, int]], dict[str, torch.Tensor]]:
        mesh = sl.DeviceMesh({"dp": 2, "pp": 2}, group=g)
        model = make_model()
        model, opt = sl.distribute(
            model, torch.optim.AdamW(model.parameters(), lr=1e-2), mesh=mesh,
            strategy={"dp": dp, "pp": "1f1b"}, microbatches=m, loss_fn=loss_fn,
        )  # fmt: skip
        assert opt is not None
        counts = _train_counting(model, opt, mesh)
        return counts, model.state_dict()

    for counts, full in run_ranks(4, body, timeout=90):
        assert len(counts) == STEPS
        assert all(c == PER_STEP[dp] for c in counts[1:]), counts
        for key, value in want.items():
            torch.testing.assert_close(full[key], value, msg=key)


@pytest.mark.parametrize("dp", ["ddp", "zero1", "zero2", "zero3"])
def test_interleaved_chunks_of_a_rank_are_reduced_together(dp: str) -> None:
    """``interleaved`` (two chunks per rank): the chunks are wrapped together, so the step
    issues the collectives of one chunk (as before the composition), and training equals one
    process."""
    want, _ = reference(2 * 4)

    def body(g: ProcessGroup) -> tuple[int, list[dict[str, int]], dict[str, torch.Tensor]]:
        mesh = sl.DeviceMesh({"dp": 2, "pp": 2}, group=g)
        model = make_model()
        model, opt = sl.distribute(
            model, torch.optim.AdamW(model.parameters(), lr=1e-2), mesh=mesh,
            strategy={"dp": dp, "pp": "interleaved"}, microbatches=4, loss_fn=loss_fn,
            virtual_stages=2,
        )  # fmt: skip
        assert opt is not None
        counts = _train_counting(model, opt, mesh)
        return len(model._replicas.wrappers), counts, model.state_dict()

    for wrappers, counts, full in run_ranks(4, body, timeout=90):
        assert wrappers == 1
        assert all(c == PER_STEP[dp] for c in counts[1:]), counts
        for key, value in want.items():
            torch.testing.assert_close(full[key], value, msg=key)


def test_one_wrapper_per_chunk_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """``StageReplicas(per_chunk=True)``: each of a rank's chunks wrapped on its own (as
    torchtitan's FSDP per stage), each reduced once per step."""
    # Counts the wrapper's own collectives: ordinary buffers, since moving them to symmetric
    # memory adds its one-time allocation handshake (all-gathers) to the first step.
    monkeypatch.setenv("SHARDLINE_SYMMETRIC", "0")

    def body(g: ProcessGroup) -> tuple[int, dict[str, int]]:
        mesh = sl.DeviceMesh({"dp": 2, "pp": 2}, group=g)
        pipe = sl.pipeline(make_model(), mesh.group("pp"), schedule="interleaved",
                           microbatches=4, loss_fn=loss_fn, virtual_stages=2)  # fmt: skip
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)  # the whole ones, bound below
        chunks = [pipe._stage_modules[s] for s in pipe.stages]
        pipe._replicas = StageReplicas(chunks, pipe, mesh.group("dp"), "zero3", per_chunk=True)
        pipe.bind_optimizer(opt)
        assert all(p.dim() == 1 for g in opt.param_groups for p in g["params"])
        before = _calls(mesh.group("dp"))
        train_replica(pipe, opt, mesh.local_rank("dp"))
        return len(pipe._replicas.wrappers), _delta(_calls(mesh.group("dp")), before)

    for wrappers, calls in run_ranks(4, body, timeout=90):
        assert wrappers == 2
        assert calls == {"all_gather": 2 * STEPS, "reduce_scatter": 2 * STEPS}, calls
