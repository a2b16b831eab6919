"""The planner's tensor-parallel layouts: what they hold and send, priced on the meta device
against ``sl.tensor_parallel`` itself, and ``as_distributed(tensor_parallel=True)``."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import shardline as sl
from shardline.comm import ProcessGroup
from shardline.examples.train import TinyGPT
from shardline.parallel import MixedPrecision
from shardline.parallel.choice import wrap_choice
from shardline.parallel.layout_meta import split_sizes, widened
from shardline.parallel.tensor_layout import counted_traffic, tensor_layout
from shardline.parallel.timing import Collective, Compute, Link, ModelShape, Probes, predict
from tests._ranks import run_ranks
from tests._tiny_gpt import CFG, gpt, tokens


def test_tp_sizes_divide_the_world_and_a_host() -> None:
    assert split_sizes(8, 8) == [2, 4, 8]
    assert split_sizes(8, 4) == [2, 4]
    assert split_sizes(6, 6) == [2]
    assert split_sizes(4, 1) == []
    assert split_sizes(1, 1) == []


def test_widened_repeats_each_tensor_along_its_first_dimension() -> None:
    x, y = tokens(0)
    wx, wy = widened((x, y), 3)
    assert torch.equal(wx, torch.cat([x, x, x])) and torch.equal(wy, torch.cat([y, y, y]))
    assert widened({"x": x}, 2)["x"].shape == (8, CFG.seq_len)
    assert widened(x, 1) is x


def test_a_model_tensor_parallel_cannot_split_says_why() -> None:
    why = tensor_layout(nn.Sequential(nn.Conv1d(3, 4, 3)), 2)
    assert isinstance(why, str) and why.startswith("tp=2:") and "Sequential" in why
    plan = sl.plan_strategy(
        nn.Sequential(nn.Conv1d(3, 4, 3)), world_size=2, available_bytes=1 << 30,
        tensor_parallel=True, device="cpu",
    )  # fmt: skip
    assert all(c.tp == 1 for c in plan.candidates)
    assert any("not priced: tp=2" in n for n in plan.notes) and "not priced" in plan.explain()


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_a_layout_holds_and_sends_what_tensor_parallel_does(bf16: bool) -> None:
    """Per rank: the parameters (slices and what stays whole) and, in one forward and
    backward of the widened batch, the tp group's calls and bytes per op kind, against
    ``sl.tensor_parallel`` on two ranks (its group's own traffic counters)."""
    layout = tensor_layout(gpt(), 2)
    assert not isinstance(layout, str)
    batch = widened(tokens(0), 2)
    counted = counted_traffic(layout, batch, None)
    assert counted.traffic and 0.9 < counted.split <= 1.0
    held = {n: tuple(p.shape) for n, p in layout.model.named_parameters()}

    def body(g: ProcessGroup) -> tuple[dict[str, tuple[int, ...]], dict[str, dict[str, int]]]:
        torch.set_num_threads(1)
        model = sl.tensor_parallel(gpt(), g, "auto")
        if bf16:
            model = model.to(torch.bfloat16)
        before = g.traffic(subgroups=True)
        model(*batch).backward()
        after = g.traffic(subgroups=True)
        seen = {
            op: {k: v - before.get(op, {}).get(k, 0) for k, v in row.items()}
            for op, row in after.items()
            if row != before.get(op)
        }
        return {n: tuple(p.shape) for n, p in model.named_parameters()}, seen

    ratio = 0.5 if bf16 else 1.0  # counted in the model's dtype, scaled as the planner does
    for shapes, seen in run_ranks(2, body, timeout=60):
        assert shapes == held
        priced: dict[str, list[int]] = {}
        for _phase, op, calls, nbytes in counted.traffic:
            entry = priced.setdefault(op, [0, 0])
            entry[0] += calls
            entry[1] += int(nbytes * ratio)
        assert set(seen) == set(priced), (seen, priced)
        for op, (calls, nbytes) in priced.items():
            share = (2 if op == "all_reduce" else 1) * (2 - 1) / 2
            assert seen[op]["calls"] == calls, (op, seen[op], calls)
            assert seen[op]["sent"] == pytest.approx(share * nbytes, rel=0.01), (op, seen[op])


def test_predict_scales_compute_to_the_replica_batch_and_waits_for_tp() -> None:
    """tp ranks' batches on the split share of the weights; the layers' collectives wait."""
    compute = Compute(forward=0.010, backward=0.020, host=0.001)
    link = Link(latency=1e-4, bandwidth=1e9, issue=0.0)
    probes = Probes({(None, None): compute}, 0.0, link, 0.5, 0.0)
    shape = ModelShape(1000, torch.float32, 4)
    blocking = [Collective("forward", "all_reduce", 3, 3_000_000)]
    plain = predict("ddp", None, 1, shape, 1, None, probes)
    tp = predict(
        "ddp", None, 1, shape, 1, None, probes, scale=2 * 0.25 + 0.75, blocking=blocking,
        blocking_world=2,
    )  # fmt: skip
    assert plain is not None and tp is not None
    assert tp.compute == pytest.approx(0.030 * (2 * 0.25 + 0.75))
    waits = 3 * 1e-4 + 2 * (2 - 1) / 2 * 3_000_000 / 1e9
    assert tp.comm == pytest.approx(waits) and tp.exposed == pytest.approx(waits)
    assert tp.total == pytest.approx(tp.compute + waits)


def test_as_distributed_prices_times_and_agrees_on_tensor_parallel_layouts() -> None:
    """With ``tensor_parallel=True`` the tp=2 layout is priced, timed and, when tried, tried
    on the widened batch; both ranks take the same choice, and how to feed it matches it."""

    def body(g: ProcessGroup) -> tuple[Any, ...]:
        torch.set_num_threads(1)
        model = sl.as_distributed(
            gpt(), group=g, example_input=tokens(g.rank), verbose=False, tensor_parallel=True,
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
        )  # fmt: skip
        plan = model.plan
        tp = [c for c in plan.candidates if c.tp == 2]
        names = ["ddp tp=2", "zero1 tp=2", "zero2 tp=2", "zero3 tp=2"]
        assert [c.name for c in tp] == names, plan.explain()
        assert all(c.fits and c.time is not None and c.estimate.world_size == 1 for c in tp)
        assert all(n in plan.explain() for n in names)
        choice = plan.choice
        scale, args = model.batch_scale, model.sampler_args
        if choice.tp == 2:
            assert model.mesh is not None
            assert model.strategy == {"dp": choice.strategy, "tp": "auto"}
            assert scale == 2 and args == {"num_replicas": 1, "rank": 0}
        else:
            assert model.mesh is None and model.strategy == choice.strategy
            assert scale == 1 and args == {"num_replicas": 2, "rank": g.rank}
        seen = [(c.time.total, c.time.trial) if c.time else None for c in plan.candidates]
        return choice.name, seen

    (c0, t0), (c1, t1) = run_ranks(2, body, timeout=180)
    assert c0 == c1 and t0 == t1


def test_the_tensor_parallel_choice_trains_as_one_process_on_the_replica_batch() -> None:
    """A tp choice as ``as_distributed`` builds it (on its ``{"dp", "tp"}`` mesh), fed as
    ``sampler_args`` and ``batch_scale`` say, trains to one process's losses on that batch."""
    plan = sl.plan_strategy(
        gpt(), world_size=2, available_bytes=1 << 30, tensor_parallel=True, device="cpu",
        example_input=tokens(0),
    )  # fmt: skip
    choice = next(c for c in plan.candidates if c.tp == 2)
    batch = widened(tokens(0), 2)  # the replica's batch: both tp ranks take it

    def train(model: nn.Module) -> list[float]:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            loss = model(*batch)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        return losses

    alone = train(copy.deepcopy(gpt()))

    def body(g: ProcessGroup) -> list[float]:
        torch.set_num_threads(1)
        return train(wrap_choice(gpt(), choice, g, None, {}, {}))

    for losses in run_ranks(2, body, timeout=60):
        assert losses == pytest.approx(alone, rel=1e-5, abs=1e-6)


class _Peeking(TinyGPT):
    """Reads a value of its input in forward, which the meta device cannot give."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        if int(idx.max()) >= CFG.vocab:
            raise ValueError("a token beyond the vocabulary")
        return super().forward(idx, targets)


def test_collectives_are_counted_once_per_call_and_an_uncountable_forward_says_so() -> None:
    layout = tensor_layout(gpt(), 2)
    assert not isinstance(layout, str)
    batch = widened(tokens(0), 2)
    assert (
        counted_traffic(layout, batch, None).traffic == counted_traffic(layout, batch, None).traffic
    )  # nothing carried over from an earlier count
    torch.manual_seed(0)
    plan = sl.plan_strategy(
        _Peeking(CFG), world_size=2, available_bytes=1 << 30, tensor_parallel=True,
        device="cpu", example_input=tokens(0),
    )  # fmt: skip
    assert next(c.name for c in plan.candidates if c.tp == 2) == "ddp tp=2"  # memory priced
    assert any(n.startswith("tp=2: its collectives not counted") for n in plan.notes), plan.notes
