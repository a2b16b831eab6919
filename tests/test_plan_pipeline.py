"""The planner's pipelines: this rank's stage priced on the meta device against what
``sl.pipeline`` holds and keeps, its step model, and ``as_distributed(pipeline=True)``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import shardline as sl
from shardline.comm import ProcessGroup
from shardline.errors import InvalidArgumentError
from shardline.examples.model import TinyGPT, lm_loss
from shardline.parallel.choice import wrap_choice
from shardline.parallel.layout_meta import widened
from shardline.parallel.pipeline import schedules
from shardline.parallel.pipeline_layout import (
    WithLoss,
    microbatch_counts,
    pipeline_layouts,
    step_ratio,
    with_loss,
)
from shardline.parallel.timing import Compute, Link, Probes
from shardline.parallel.trials import to_try, trial_steps
from tests._chain import alone_losses, chain, check_interleaved, sgd_losses, stepped
from tests._ranks import run_ranks
from tests._tiny_gpt import CFG, tokens


def planned(rank: int = 0) -> sl.StrategyPlan:
    """Rank ``rank``'s plan of the chain over 2 ranks, pipelines priced, on rank 0's batch."""
    return sl.plan_strategy(
        chain(),
        world_size=2,
        available_bytes=1 << 30,
        example_input=tokens(0),
        device="cpu",
        pipeline=True,
        loss_fn=lm_loss,
        rank=rank,
    )


def test_pipelines_need_a_chain_and_its_loss() -> None:
    with pytest.raises(InvalidArgumentError, match=r"nn\.Sequential"):
        with_loss(TinyGPT(CFG), lm_loss)
    with pytest.raises(InvalidArgumentError, match="loss_fn"):
        with_loss(chain(), None)
    model = with_loss(chain(), lm_loss)
    assert with_loss(model, lm_loss) is model
    x, y = tokens(0)
    assert torch.equal(model(x, y), lm_loss(model.chain(x), y))
    assert microbatch_counts(2, 8) == [2, 4, 8] and microbatch_counts(4, 8) == [4, 8]
    assert pipeline_layouts(model, 2, 0, None, None)[1]  # no example: says why


def _live_peak(schedule: str, pp: int, m: int, stage: int) -> int:
    """The most micro-batches ``stage`` keeps at once by the pipeline's own count: a forward
    adds one, a backward or a weight pass frees it."""
    live = peak = 0
    for a in schedules.build(schedule, pp, m)[stage]:
        live += {"F": 1, "B": -1, "I": 0, "W": -1}[a.kind]
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_a_stage_holds_and_keeps_what_sl_pipeline_does(schedule: str) -> None:
    """Per stage and micro-batch count: the cut, the parameters held, and the micro-batches
    the schedule keeps at once (the pipeline's own count after a step), against
    ``sl.pipeline``. Under zero-bubble the first stage's price counts a micro-batch between
    its input and weight passes twice (the graph and the gradients the weight pass keeps);
    the second stage's layers defer their weight gradients (``pipeline.deferred``), and
    there such a micro-batch keeps only each linear layer's input and output gradient."""
    example = tokens(0)
    priced = {  # one stage per rank (interleaved's are checked on their own)
        rank: [
            layout
            for layout in pipeline_layouts(with_loss(chain(), lm_loss), 2, rank, example, None)[0]
            if layout.virtual == 1
        ]
        for rank in (0, 1)
    }

    def body(g: ProcessGroup) -> list[tuple[Any, ...]]:
        torch.set_num_threads(1)
        seen = []
        for layout in priced[g.rank]:
            x, y = widened(example, 2)
            m = layout.microbatches
            stage = sl.pipeline(
                chain(), g, schedule=schedule, microbatches=m, loss_fn=lm_loss,
                example=x.chunk(m)[0],
            )  # fmt: skip
            stage.step(x, y)
            held = sorted(tuple(p.shape) for p in stage.parameters())
            seen.append((held, stage.peak_activations[g.rank], m))
        return seen

    for rank, seen in enumerate(run_ranks(2, body, timeout=60)):
        assert len(seen) == 3
        for layout, (held, peak, m) in zip(priced[rank], seen, strict=True):
            assert sorted(tuple(p.shape) for p in layout.model.parameters()) == held
            assert peak == _live_peak(schedule, 2, m, rank)
            priced_count = layout.activations(schedule) / layout.kept
            if schedule == "1f1b":  # what the activations are multiplied by
                assert peak == min(m, 2 - rank) == priced_count
            elif rank == 0:
                assert layout.deferred == 0 and peak <= priced_count <= 2 * peak
            else:  # block1 and the head: linear inputs ln1, attention, ln2, GELU, final ln
                # a pp=2 pipeline trains both ranks' batches: 8 sequences over m micro-batches
                d, tokens_per_mb = CFG.d_model, 8 // m * CFG.seq_len
                inputs, grads = 4 * d + 4 * d, 3 * d + d + 4 * d + d + CFG.vocab
                assert layout.deferred == (inputs + grads) * tokens_per_mb * 4
                assert layout.deferred < layout.kept and 1 <= priced_count <= peak
            assert layout.split == (("embed", "block0"), ("block1", "head"))
            assert (layout.boundary > 0) == (rank == 0)


def test_the_step_model_prices_1f1b_slots_of_the_slowest_stage() -> None:
    plan = planned()
    compute = Compute(forward=0.010, backward=0.020, host=0.001)
    probes = Probes({(None, None): compute}, 0.0, Link(1e-4, 1e9), 0.5, 0.0)
    timed = plan.timed(probes)
    pipes = [c for c in timed.candidates if c.pp == 2 and c.schedule == "1f1b" and not c.recompute]
    assert [c.name for c in pipes] == ["ddp pp=2 m=2", "ddp pp=2 m=4", "ddp pp=2 m=8"]
    for c in pipes:
        layout = next(p for p in plan.pipelines if p.microbatches == c.microbatches)
        m = c.microbatches
        assert c.time is not None
        assert c.time.compute == pytest.approx(0.030 * 2 * layout.share * (m + 1) / m)
        sends = 2 * (m * 1e-4 + m * layout.boundary / 1e9)  # stage 0 sends and takes back
        assert c.time.comm == pytest.approx(sends)
        assert c.estimate.world_size == 1 and c.distribute_strategy == {"pp": "1f1b"}
    # Zero-bubble: the same layouts in a shorter simulated step, at a price for memory.
    by_name = {c.name: c for c in timed.candidates}
    for c in pipes:
        zb = by_name[f"{c.name} schedule=zero_bubble"]
        m = c.microbatches
        assert zb.distribute_strategy == {"pp": "zero_bubble"} and zb.order > c.order
        # By hand, on 2 stages (forward 1 unit, backward 2): the last stage waits one
        # forward for its first input, then runs its 3m units of work without a gap; ZB-H1
        # reaches that bound, 3m + 1, where 1F1B takes 3(m + 1).
        assert step_ratio("zero_bubble", 2, m, 0.010, 0.020) == pytest.approx((3 * m + 1) / (3 * m))
        assert step_ratio("1f1b", 2, m, 0.010, 0.020) == pytest.approx((m + 1) / m)
        assert zb.time is not None and c.time is not None
        assert zb.time.compute == pytest.approx(c.time.compute * (3 * m + 1) / (3 * m + 3))
        # Stage 0 keeps 2 micro-batches under both (it has no input pass to count twice).
        layout = next(p for p in plan.pipelines if p.microbatches == m)
        assert zb.estimate.activations == c.estimate.activations == 2 * layout.kept


def test_interleaved_stages_hold_keep_and_train_as_sl_pipeline_does() -> None:
    """Interleaved 1F1B over 2 ranks, 2 stages each (the chain cut into 4): per micro-batch
    count, each rank's stages and parameters, and the micro-batches each of its stages keeps
    at once (the pipeline's own count) against the walk of the schedule the price takes;
    the bytes at once are that walk with each stage's own activations. The m=4 choice,
    trained on the replica's batch, follows one process's losses."""
    x, y = tokens(0)
    plans = {rank: planned(rank) for rank in (0, 1)}
    batch = widened((x, y), 2)
    expected = alone_losses(batch)

    def body(g: ProcessGroup) -> tuple[list[tuple[Any, ...]], list[float]]:
        torch.set_num_threads(1)
        picked = [c for c in plans[g.rank].candidates if c.schedule == "interleaved"]
        seen = stepped(picked, g, (x, y), batch, {})
        chosen = next(
            c for c in plans[g.rank].candidates if c.name == "ddp pp=2 m=4 schedule=interleaved"
        )
        stage = wrap_choice(with_loss(chain(), lm_loss), chosen, g, None, {}, {}, (x, y))
        return seen, sgd_losses(stage.step, stage.parameters(), batch)

    for rank, (seen, losses) in enumerate(run_ranks(2, body, timeout=120)):
        assert len(seen) == 3
        for m, held, peak in seen:
            layout = next(p for p in plans[rank].pipelines if (p.microbatches, p.virtual) == (m, 2))
            check_interleaved(layout, rank, held, peak)
        assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_the_step_model_prices_interleaved_stages_in_a_shorter_bubble_with_more_sends() -> None:
    """Interleaved 1F1B: the simulated step of 4 stages over 2 ranks (each of them a half of a
    rank's forward and backward) is shorter than 1F1B's; each of the rank's stages sends
    every micro-batch on and takes its gradient back."""
    plan = planned()
    compute = Compute(forward=0.010, backward=0.020, host=0.001)
    timed = plan.timed(Probes({(None, None): compute}, 0.0, Link(1e-4, 1e9), 0.5, 0.0))
    by_name = {c.name: c for c in timed.candidates}
    for m in (2, 4, 8):
        c = by_name[f"ddp pp=2 m={m} schedule=interleaved"]
        layout = next(p for p in plan.pipelines if (p.microbatches, p.virtual) == (m, 2))
        assert c.distribute_strategy == {"pp": "interleaved"}
        ratio = step_ratio("interleaved", 2, m, 0.010, 0.020, 2)
        assert ratio < step_ratio("1f1b", 2, m, 0.010, 0.020) == pytest.approx((m + 1) / m)
        assert c.time is not None
        assert c.time.compute == pytest.approx(0.030 * 2 * layout.share * ratio)
        # rank 0 holds stages 0 and 2: both send on (stage 1's and 3's inputs)
        assert c.time.comm == pytest.approx(2 * (2 * m * 1e-4 + m * layout.boundary / 1e9))
    # rank 1 holds stages 1 and 3: only stage 1 sends on
    last = planned(1)
    for c in last.timed(Probes({(None, None): compute}, 0.0, Link(1e-4, 1e9), 0.5, 0.0)).candidates:
        if c.schedule == "interleaved":
            m = c.microbatches
            layout = next(p for p in last.pipelines if (p.microbatches, p.virtual) == (m, 2))
            assert c.time is not None and layout.boundary > 0
            assert c.time.comm == pytest.approx(2 * (m * 1e-4 + m * layout.boundary / 1e9))


def test_a_recomputing_pipeline_keeps_each_stages_input_and_output_and_runs_forward_twice() -> None:
    """1F1B with each stage recomputing its forward (``sl.pipeline(recompute=True)``): a
    micro-batch in flight keeps the stage's input and output, by hand from the model's widths
    (the first stage's input is a slice of the batch), the one whose backward runs makes its
    activations again; its backward costs a forward more."""
    compute = Compute(forward=0.010, backward=0.020, host=0.001)
    probes = Probes({(None, None): compute}, 0.0, Link(1e-4, 1e9), 0.5, 0.0)
    for rank in (0, 1):
        plan = sl.plan_strategy(
            chain(), world_size=2, available_bytes=1 << 30, example_input=tokens(0),
            device="cpu", pipeline=True, loss_fn=lm_loss, rank=rank,
        )  # fmt: skip
        assert (None, None) in plan.to_time() and all(r is None for r, _ in plan.to_time())
        by_name = {c.name: c for c in plan.timed(probes).candidates}
        for m in (2, 4, 8):
            again = by_name[f"ddp recompute=full pp=2 m={m}"]
            plain = by_name[f"ddp pp=2 m={m}"]
            layout = next(p for p in plan.pipelines if p.microbatches == m)
            # a pp=2 pipeline trains both ranks' batches: 8 sequences over m micro-batches
            stream = 8 // m * CFG.seq_len * CFG.d_model * 4  # the residual stream, fp32
            assert layout.held == stream  # stage 0's output; stage 1's input
            in_flight = 2 - rank  # 1F1B: min(m, pp - stage)
            assert again.estimate.activations == in_flight * stream
            assert again.estimate.recomputed == layout.kept
            assert plain.estimate.activations == in_flight * layout.kept
            if rank == 0:  # two micro-batches' inputs and outputs instead of their activations
                assert again.estimate.total < plain.estimate.total
            assert again.distribute_strategy == {"pp": "1f1b"} and again.order > plain.order
            # Its backward is a forward and a backward: 1F1B's (m + 1) / m slots of 0.040.
            assert step_ratio("1f1b", 2, m, 0.010, 0.030) == pytest.approx((m + 1) / m)
            assert again.time is not None and plain.time is not None
            assert again.time.compute == pytest.approx(plain.time.compute * 4 / 3)


def test_a_zero_bubble_pipeline_is_tried_beside_its_1f1b_twin() -> None:
    """Its split backward is not in the step model: where it is predicted among the fastest,
    its 1F1B twin (same stages, micro-batches and replicas) is tried too."""
    compute = Compute(forward=0.010, backward=0.020, host=0.001)
    timed = planned().timed(Probes({(None, None): compute}, 0.0, Link(1e-4, 1e9), 0.5, 0.0))
    predicted = {"ddp pp=2 m=8 schedule=zero_bubble": 0.009, "ddp pp=2 m=8": 0.0105}
    predicted |= dict.fromkeys(("ddp", "zero1", "zero2", "zero3"), 0.010)
    agreed = timed.agreed(
        [predicted.get(c.name, 0.020) for c in timed.candidates],
        [c.fits for c in timed.candidates],
    )
    tried = [c.name for c in to_try(agreed)]
    assert tried == [
        "ddp pp=2 m=8 schedule=zero_bubble", "ddp", "zero1", "zero2", "ddp pp=2 m=8",
    ]  # fmt: skip
    predicted["ddp pp=2 m=8 schedule=zero_bubble"] = 0.017  # beyond 1.6x the fastest: not tried
    agreed = timed.agreed(
        [predicted.get(c.name, 0.020) for c in timed.candidates],
        [c.fits for c in timed.candidates],
    )
    # The 4 fastest, then the fastest of a layout they leave out (the 1F1B pipeline).
    assert [c.name for c in to_try(agreed)] == ["ddp", "zero1", "zero2", "zero3", "ddp pp=2 m=8"]


def test_the_fastest_predicted_of_each_layout_the_fastest_few_leave_out_is_tried() -> None:
    """The step model errs by layout more than by choice within one: beyond the 4 fastest,
    the fastest predicted of up to 3 more layouts within 1.6x (tensor-parallel and pipeline
    degrees and schedules) is tried, a zero-bubble one with its 1F1B twin."""
    compute = Compute(forward=0.010, backward=0.020, host=0.001)
    timed = planned().timed(Probes({(None, None): compute}, 0.0, Link(1e-4, 1e9), 0.5, 0.0))
    predicted = dict.fromkeys(("ddp", "zero1", "zero2", "zero3"), 0.010)
    predicted |= {
        "ddp pp=2 m=4 schedule=zero_bubble": 0.013,  # its layout's fastest
        "ddp pp=2 m=8 schedule=zero_bubble": 0.014,
        "ddp pp=2 m=2 schedule=interleaved": 0.015,
        "ddp pp=2 m=2": 0.0155,
        "ddp pp=2 m=8": 0.017,  # beyond 1.6x
    }
    agreed = timed.agreed(
        [predicted.get(c.name, 0.020) for c in timed.candidates],
        [c.fits for c in timed.candidates],
    )
    assert [c.name for c in to_try(agreed)] == [
        "ddp", "zero1", "zero2", "zero3",
        "ddp pp=2 m=4 schedule=zero_bubble", "ddp pp=2 m=2 schedule=interleaved",
        "ddp pp=2 m=2",  # 1F1B's fastest, and the interleaved one's twin
        "ddp pp=2 m=4",  # the zero-bubble one's twin
    ]  # fmt: skip


def test_at_most_three_layouts_beyond_the_fastest_few_are_tried() -> None:
    """On 4 ranks the chain has 5 pipeline layouts besides the plain one: of those within
    1.6x, the 3 predicted fastest are tried, each by its fastest choice, in that order."""
    plan = sl.plan_strategy(
        chain(), world_size=4, available_bytes=1 << 30, example_input=tokens(0), device="cpu",
        pipeline=True, loss_fn=lm_loss, rank=0,
    )  # fmt: skip
    compute = Compute(forward=0.010, backward=0.020, host=0.001)
    timed = plan.timed(Probes({(None, None): compute}, 0.0, Link(1e-4, 1e9), 0.5, 0.0))
    predicted = dict.fromkeys(("ddp", "zero1", "zero2", "zero3"), 0.010)
    predicted |= {
        "ddp pp=4 m=4 schedule=zero_bubble": 0.011,
        "zero1 pp=2 m=8": 0.012,
        "zero2 pp=2 m=8": 0.0125,  # the same layout: not again
        "ddp pp=4 m=8": 0.013,
        "zero2 pp=2 m=2 schedule=interleaved": 0.014,  # a fourth layout: not tried
        "zero3 pp=2 m=4 schedule=zero_bubble": 0.015,  # a fifth
    }
    agreed = timed.agreed(
        [predicted.get(c.name, 0.020) for c in timed.candidates],
        [c.fits for c in timed.candidates],
    )
    assert [c.name for c in to_try(agreed)] == [
        "ddp", "zero1", "zero2", "zero3",
        "ddp pp=4 m=4 schedule=zero_bubble", "zero1 pp=2 m=8", "ddp pp=4 m=8",
        "ddp pp=4 m=4",  # the zero-bubble one's twin
    ]  # fmt: skip


@pytest.mark.parametrize("recompute", [None, "full"])
def test_the_pipeline_choice_trains_as_one_process_on_the_replica_batch(
    recompute: str | None,
) -> None:
    """A pipeline choice as ``as_distributed`` builds it (its stages recomputing or not),
    stepped with the replica's batch on both ranks, trains to one process's losses on that
    batch."""
    x, y = tokens(0)
    plan = planned()
    choice = next(
        c
        for c in plan.candidates
        if c.pp == 2 and c.microbatches == 4 and c.schedule == "1f1b" and c.recompute == recompute
    )
    batch = widened((x, y), 2)
    expected = alone_losses(batch)

    def body(g: ProcessGroup) -> list[float]:
        torch.set_num_threads(1)
        stage = wrap_choice(with_loss(chain(), lm_loss), choice, g, None, {}, {}, (x, y))
        return sgd_losses(stage.step, stage.parameters(), batch)

    for losses in run_ranks(2, body, timeout=60):
        assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_as_distributed_prices_times_and_agrees_on_pipelines_and_every_choice_steps() -> None:
    def body(g: ProcessGroup) -> tuple[Any, ...]:
        torch.set_num_threads(1)
        x, y = tokens(g.rank)
        model = sl.as_distributed(
            chain(), group=g, example_input=(x, y), verbose=False, pipeline=True,
            loss_fn=lm_loss,
        )  # fmt: skip
        plan = model.plan
        pipes = [c for c in plan.candidates if c.pp == 2]
        # 2, 4 and 8 micro-batches by 1F1B, zero-bubble, 1F1B recomputing and interleaved
        assert len(pipes) == 12 and all(c.fits and c.time is not None for c in pipes)
        choice = plan.choice
        assert model.batch_scale == choice.batch_scale
        if choice.pp == 2:
            assert model.sampler_args == {"num_replicas": 1, "rank": 0}
            x, y = widened(tokens(0), 2)  # a replica's batch, the same on both ranks
        else:
            assert model.sampler_args == {"num_replicas": 2, "rank": g.rank}
        # the chain's own names, whichever is chosen (a pipeline's state_dict is whole)
        assert set(model.state_dict()) == set(chain().state_dict())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(4):
            opt.zero_grad(set_to_none=True)
            losses.append(float(model.step(x, y)))
            opt.step()
        seen = [(c.time.total, c.time.trial) if c.time else None for c in plan.candidates]
        return choice.name, seen, losses[-1] - losses[0]

    (c0, t0, d0), (c1, t1, d1) = run_ranks(2, body, timeout=180)
    assert c0 == c1 and t0 == t1
    assert d0 < 0 and d1 < 0  # the loss falls


def test_a_tried_pipeline_is_stepped() -> None:
    """Trials step a pipeline choice (forward and backward of its micro-batches)."""
    plan = planned()
    tried = [c for c in plan.candidates if c.pp == 2][:2]

    def body(g: ProcessGroup) -> list[float]:
        torch.set_num_threads(1)
        model = with_loss(chain(), lm_loss)
        meshes: dict[Any, Any] = {}
        return trial_steps(
            model, tokens(g.rank), tried,
            lambda twin, c: wrap_choice(twin, c, g, None, {}, meshes, tokens(g.rank)), "sgd",
        )  # fmt: skip

    for seconds in run_ranks(2, body, timeout=120):
        assert len(seconds) == 2 and all(s > 0 for s in seconds)


def test_where_the_host_runs_ahead_a_pipeline_launches_its_stage_once_per_microbatch() -> None:
    """On CUDA the host's time goes with the kernels launched: ``m`` micro-batches of a stage
    holding ``share`` of the chain issue ``m * share`` times the probe's; on CPU it goes with
    the work, as the compute does. A recomputing stage launches its forward again."""
    plan = planned()
    host_bound = {(None, None): Compute(forward=0.001, backward=0.002, host=0.010)}
    for ahead in (True, False):
        probes = Probes(host_bound, 0.0, Link(1e-9, 1e15), 1.0, 0.0, ahead=ahead)
        for c in plan.timed(probes).candidates:
            if c.pp != 2:
                continue
            m, virtual = c.microbatches, 2 if c.schedule == "interleaved" else 1
            layout = next(p for p in plan.pipelines if (p.microbatches, p.virtual) == (m, virtual))
            again = 0.001 if c.recompute else 0.0  # a recomputing backward runs forward again
            grow = (0.003 + again) / 0.003
            ratio = step_ratio(c.schedule, 2, m, 0.001, 0.002 + again, virtual)
            scale = 2 * layout.share * ratio * grow
            host = 0.010 * (m * layout.share * grow if ahead else scale)
            assert c.time is not None
            assert c.time.compute + c.time.exposed == pytest.approx(host, rel=1e-3)


def test_on_cpu_each_microbatch_pays_the_fixed_part_of_a_pass() -> None:
    """A pass costs the probe's ``fixed`` part whatever its rows: ``m`` micro-batches of the
    replica's 2 ranks' batches take 2 probes' work and ``m - 2`` fixed parts more, so more
    micro-batches cost more on CPU. Where the host runs ahead (CUDA), its launches per
    micro-batch are priced instead and ``fixed`` is not used."""
    plan = planned()
    fixed = Compute(forward=0.010, backward=0.020, host=0.001, fixed=0.006)
    none = Compute(forward=0.010, backward=0.020, host=0.001)
    for ahead in (False, True):
        timed = {
            c.name: c
            for c in plan.timed(
                Probes({(None, None): fixed}, 0.0, Link(1e-4, 1e9), 0.5, 0.0, ahead=ahead)
            ).candidates
        }
        base = {
            c.name: c
            for c in plan.timed(
                Probes({(None, None): none}, 0.0, Link(1e-4, 1e9), 0.5, 0.0, ahead=ahead)
            ).candidates
        }
        for name, c in timed.items():
            b = base[name]
            assert c.time is not None and b.time is not None
            grow = 1 + (c.microbatches - 2) * 0.006 / (2 * 0.030) if c.pp == 2 and not ahead else 1
            assert c.time.compute == pytest.approx(b.time.compute * grow), name
    # With the fixed part, m = 8 costs more than m = 2 (without it, less: a shorter bubble).
    on_cpu = {
        c.name: c.time
        for c in plan.timed(
            Probes({(None, None): fixed}, 0.0, Link(1e-4, 1e9), 0.5, 0.0)
        ).candidates
    }
    assert on_cpu["ddp pp=2 m=8"].compute > on_cpu["ddp pp=2 m=2"].compute  # type: ignore[union-attr]


def test_a_pipeline_computes_in_the_mixed_precision_dtype_under_any_strategy() -> None:
    """The stages autocast, so even with DDP replicas a pipeline is priced from the probe of
    the compute dtype, where plain DDP keeps the model's."""
    plan = sl.plan_strategy(
        chain(), world_size=2, available_bytes=1 << 30, example_input=tokens(0), device="cpu",
        pipeline=True, loss_fn=lm_loss,
        mixed_precision=sl.MixedPrecision(param_dtype=torch.bfloat16),
    )  # fmt: skip
    assert (None, torch.bfloat16) in plan.to_time()
    only_bf16 = {(None, torch.bfloat16): Compute(forward=0.01, backward=0.02, host=0.001)}
    timed = plan.timed(Probes(only_bf16, 0.0, Link(1e-4, 1e9), 0.5, 0.0))
    by_name = {c.name: c for c in timed.candidates}
    assert by_name["ddp pp=2 m=2"].time is not None  # from the bf16 probe
    assert by_name["ddp"].time is None  # plain DDP computes in fp32: not probed here
    assert by_name["zero1"].time is not None
    # The stages' autocast keeps each linear weight's bf16 cast over the step: priced for
    # DDP replicas, whose weights are fp32 (ZeRO's are gathered in bf16: nothing to cast).
    layout = next(p for p in plan.pipelines if p.microbatches == 2)
    stage = layout.model.chain if isinstance(layout.model, WithLoss) else layout.model
    linear = sum(
        p.numel() for m in stage.modules() if isinstance(m, nn.Linear) for p in m.parameters()
    )
    assert layout.cast == 2 * linear > 0
    assert by_name["ddp pp=2 m=2"].estimate.activations == layout.activations("1f1b") + layout.cast


def test_a_pipelines_zero_replicas_count_their_gradients_beside_the_activations() -> None:
    plan = sl.plan_strategy(
        chain(), world_size=4, available_bytes=1 << 30, example_input=tokens(0), device="cpu",
        pipeline=True, loss_fn=lm_loss,
    )  # fmt: skip
    zero = [c for c in plan.candidates if c.strategy in ("zero2", "zero3")]
    piped = [c.estimate for c in zero if c.pp > 1]
    plain = [c.estimate for c in zero if c.pp == 1 and c.tp == 1]
    assert piped and plain
    # a later micro-batch's forward runs with the earlier ones' gradients alive
    for e in piped:
        assert not e.grads_in_backward
        assert e.backward_peak == e.persistent + e.comm_buffers + e.activations + e.recomputed
    assert all(e.grads_in_backward for e in plain)
