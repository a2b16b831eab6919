"""The planner's pipelines whose stages split over tensor-parallel ranks (a mesh ``{"dp",
"pp", "tp"}``): this rank's stage priced on the meta device against what ``sl.pipeline``
holds and keeps on 4 ranks, its step model, and the choice trained against one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import shardline as sl
from shardline.comm import ProcessGroup
from shardline.examples.model import lm_loss
from shardline.parallel.choice import described, wrap_choice
from shardline.parallel.layout_meta import widened
from shardline.parallel.pipeline_layout import step_ratio, with_loss
from shardline.parallel.timing import Compute, Link, Probes
from tests._chain import alone_losses, chain, check_interleaved, sgd_losses, stepped
from tests._ranks import run_ranks
from tests._tiny_gpt import tokens


def planned(rank: int = 0) -> sl.StrategyPlan:
    """Rank ``rank``'s plan of the chain over 4 ranks, pipelines and tp layouts priced."""
    return sl.plan_strategy(
        chain(), world_size=4, available_bytes=1 << 30, example_input=tokens(0), device="cpu",
        pipeline=True, loss_fn=lm_loss, tensor_parallel=True, rank=rank,
    )  # fmt: skip


def four_ranks() -> tuple[dict[int, sl.StrategyPlan], tuple[Any, Any], Any, list[float]]:
    """Every rank's plan, rank 0's batch, a replica's batch (4 ranks') and one process's
    losses on it: what the tp x pp pipelines are built from and must follow."""
    example = tokens(0)
    batch = widened(example, 4)
    return {rank: planned(rank) for rank in range(4)}, example, batch, alone_losses(batch)


def test_pipelines_of_tensor_parallel_stages_are_priced_beside_the_others() -> None:
    plan = planned()
    names = [c.name for c in plan.candidates]
    both = [c for c in plan.candidates if c.pp > 1 and c.tp > 1]
    assert [c.name for c in both if c.schedule == "1f1b" and not c.recompute] == [
        "ddp tp=2 pp=2 m=2", "ddp tp=2 pp=2 m=4", "ddp tp=2 pp=2 m=8",
    ]  # fmt: skip
    assert "ddp tp=2" in names and "ddp pp=2 m=4" in names and "ddp pp=4 m=4" in names
    for c in both:
        # one replica of 4 ranks: no data-parallel axis, and the batch of 4 ranks
        assert c.estimate.world_size == 1 and c.batch_scale == 4
        assert c.distribute_strategy == {"pp": c.schedule, "tp": "auto"}
    # tp=4 does not divide the 2 heads: neither tp=4 nor tp=4 pipelines, and the note says so
    assert not any(c.tp == 4 for c in plan.candidates)
    assert any("tp=4" in n for n in plan.notes)
    # Each rank of a tp pair holds half of each split layer of its stage.
    alone = {p.microbatches: p for p in plan.pipelines if p.size == 2 and p.tp == 1}
    split = {p.microbatches: p for p in plan.pipelines if p.size == 2 and p.tp == 2}
    for m, layout in split.items():
        whole = alone[m]
        mine = sum(p.numel() for p in layout.model.parameters())
        assert mine < sum(p.numel() for p in whole.model.parameters())
        assert 0.9 < layout.tp_split <= 1.0
        ops = {(phase, op) for phase, op, _, _ in layout.traffic}
        assert ("forward", "all_reduce") in ops and ("backward", "all_reduce") in ops


def test_a_tensor_parallel_stage_holds_keeps_and_trains_as_sl_pipeline_does() -> None:
    """On 4 ranks (pp=2 x tp=2), per micro-batch count: the parameters each rank holds and
    the micro-batches its stage keeps at once, priced against the composed pipeline
    ``as_distributed`` would build; and the m=4 choice, trained on the replica's batch,
    follows one process's losses."""
    plans, (x, y), batch, expected = four_ranks()

    def body(g: ProcessGroup) -> tuple[list[tuple[Any, ...]], list[float]]:
        torch.set_num_threads(1)
        plan, meshes = plans[g.rank], {}
        picked = [
            c
            for c in plan.candidates
            if c.tp == 2 and c.pp == 2 and c.schedule == "1f1b" and not c.recompute
        ]
        seen: list[tuple[Any, ...]] = list(stepped(picked, g, (x, y), batch, meshes))
        # recomputing too: it builds, and its first step gives one process's first loss
        again = next(c for c in plan.candidates if c.name == "ddp recompute=full tp=2 pp=2 m=4")
        stage = wrap_choice(with_loss(chain(), lm_loss), again, g, None, {}, meshes, (x, y))
        seen.append(("recompute", float(stage.step(*batch)), stage.recompute))
        chosen = next(c for c in plan.candidates if c.name == "ddp tp=2 pp=2 m=4")
        stage = wrap_choice(with_loss(chain(), lm_loss), chosen, g, None, {}, meshes, (x, y))
        losses = sgd_losses(stage.step, stage.parameters(), batch)
        # as as_distributed returns it: one replica of 4 ranks, fed the same batch on each
        described(stage, chosen, "", plan, g, meshes, lm_loss)
        assert stage.mesh.axis_names == ("pp", "tp") and stage.batch_scale == 4
        assert stage.sampler_args == {"num_replicas": 1, "rank": 0}
        return seen, losses

    for rank, (seen, losses) in enumerate(run_ranks(4, body, timeout=120)):
        plan, stage = plans[rank], rank // 2  # the tp axis varies fastest
        assert len(seen) == 4
        (_, loss, recomputing) = seen.pop()
        assert recomputing and loss == pytest.approx(expected[0], rel=1e-5)
        for m, held, peak in seen:
            layout = next(p for p in plan.pipelines if (p.size, p.tp, p.microbatches) == (2, 2, m))
            assert layout.stage == stage
            assert sorted(tuple(p.shape) for p in layout.model.parameters()) == held
            assert peak == {stage: min(m, 2 - stage)}
            assert layout.activations("1f1b") == layout.kept * min(m, 2 - stage)
        assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_interleaved_tensor_parallel_stages_hold_keep_and_train_as_sl_pipeline_does() -> None:
    """Interleaved 1F1B over pp=2 x tp=2 (the chain cut into 4 stages, 2 per rank, each split
    over its tp pair): per micro-batch count, the slices each rank holds and the
    micro-batches each of its stages keeps at once against the composed pipeline; the price
    is within the schedule's walk; the m=4 choice follows one process's losses."""
    plans, (x, y), batch, expected = four_ranks()

    def body(g: ProcessGroup) -> tuple[list[tuple[Any, ...]], list[float]]:
        torch.set_num_threads(1)
        plan, meshes = plans[g.rank], {}
        picked = [c for c in plan.candidates if (c.tp, c.pp, c.schedule) == (2, 2, "interleaved")]
        seen = stepped(picked, g, (x, y), batch, meshes)
        chosen = next(
            c for c in plan.candidates if c.name == "ddp tp=2 pp=2 m=4 schedule=interleaved"
        )
        stage = wrap_choice(with_loss(chain(), lm_loss), chosen, g, None, {}, meshes, (x, y))
        return seen, sgd_losses(stage.step, stage.parameters(), batch)

    for rank, (seen, losses) in enumerate(run_ranks(4, body, timeout=120)):
        plan, stage = plans[rank], rank // 2  # the tp axis varies fastest
        assert [m for m, _, _ in seen] == [2, 4, 8]
        for m, held, peak in seen:
            layout = next(
                p for p in plan.pipelines if (p.tp, p.virtual, p.microbatches) == (2, 2, m)
            )
            check_interleaved(layout, stage, held, peak)
            # the split blocks' collectives, per micro-batch, on both of this rank's stages
            assert 0.9 < layout.tp_split <= 1.0
            ops = {(phase, op) for phase, op, _, _ in layout.traffic}
            assert ("forward", "all_reduce") in ops and ("backward", "all_reduce") in ops
        assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_the_step_model_splits_a_stage_over_its_tp_ranks_and_waits_for_their_collectives() -> None:
    """The split layers' share of the stage's compute runs on ``1 / tp`` of it, the rest on
    all of it; each micro-batch waits for the stage's tensor-parallel collectives in full.
    Interleaved: both of the rank's stages', and each of them sends every micro-batch on
    (rank 0 holds stages 0 and 2 of 4)."""
    plan = planned()
    compute = Compute(forward=0.010, backward=0.020, host=0.001)
    latency, bandwidth = 1e-4, 1e9
    timed = plan.timed(Probes({(None, None): compute}, 0.0, Link(latency, bandwidth), 0.5, 0.0))
    seen = set()
    for c in timed.candidates:
        if not (c.tp == 2 and c.pp == 2 and c.schedule in ("1f1b", "interleaved")) or c.recompute:
            continue
        virtual = 2 if c.schedule == "interleaved" else 1
        layout = next(
            p
            for p in plan.pipelines
            if (p.size, p.tp, p.microbatches, p.virtual) == (2, 2, c.microbatches, virtual)
        )
        m, split = c.microbatches, layout.tp_split
        ratio = step_ratio(c.schedule, 2, m, 0.010, 0.020, virtual)
        assert c.time is not None
        assert c.time.compute == pytest.approx(0.030 * 2 * layout.share * ratio * (2 - split))
        sends = 2 * (m * virtual * latency + m * layout.boundary / bandwidth)
        waits = sum(
            m * calls * latency
            + (1.0 if op == "all_reduce" else 0.5) * m * nbytes / bandwidth  # 2 ranks
            for _, op, calls, nbytes in layout.traffic
        )
        assert c.time.comm == pytest.approx(sends + waits)
        seen.add((c.schedule, m))
    assert seen == {(s, m) for s in ("1f1b", "interleaved") for m in (2, 4, 8)}
