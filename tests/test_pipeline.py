"""Pipeline parallelism against one process: every schedule, 2 and 4 stages, 1..2p micro-batches.

The reference trains a copy of the same model in one process on the same global batch,
accumulating the same micro-batches (each loss divided by their number), with AdamW; after 3
steps every parameter a rank holds must equal the reference's (``assert_close`` defaults).
Ranks are threads (``tests/_ranks.py``).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import shardline as sl
from shardline.comm import ProcessGroup
from shardline.errors import InvalidArgumentError
from shardline.parallel.pipeline import build
from tests._ranks import run_ranks

STEPS = 3


_RNG = threading.Lock()  # ranks are threads: one at a time through the global generator


def make_model(norm: bool = False) -> nn.Sequential:
    """Ten children, each with parameters (so 8 stages at p=4, v=2 all train something)."""
    with _RNG:
        return _make_model(norm)


def _make_model(norm: bool) -> nn.Sequential:
    torch.manual_seed(0)
    widths = [6, 16, 16, 24, 16, 16, 12, 12, 16, 8, 3]
    children: list[nn.Module] = []
    for k, (a, b) in enumerate(itertools.pairwise(widths)):
        act: nn.Module = nn.BatchNorm1d(b) if norm and k == 4 else nn.Tanh()
        children.append(nn.Sequential(nn.Linear(a, b), act) if k < 9 else nn.Linear(a, b))
    return nn.Sequential(*children)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 6, generator=gen), torch.randn(16, 3, generator=gen)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def reference(
    m: int, norm: bool = False, autocast: torch.dtype | None = None
) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = make_model(norm)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        total = 0.0
        for xi, yi in zip(x.chunk(m), y.chunk(m), strict=True):
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=bool(autocast)):
                loss = loss_fn(model(xi), yi)
            (loss / m).backward()
            total += float(loss.detach())
        opt.step()
        losses.append(total / m)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def run_steps(
    model: Any,
    opt: torch.optim.Optimizer,
    data: Callable[[int], tuple[torch.Tensor, torch.Tensor]] = batch,
    steps: range = range(STEPS),
) -> list[float]:
    """``model.step`` then ``opt.step`` on ``data(step)`` for each step; the losses."""
    losses = []
    for step in steps:
        x, y = data(step)
        opt.zero_grad()
        losses.append(float(model.step(x, target=y)))
        opt.step()
    return losses


def train(
    g: ProcessGroup, schedule: str, m: int, v: int, norm: bool = False, **kw: Any
) -> tuple[dict[str, torch.Tensor], list[float], dict[int, int]]:
    model = sl.pipeline(
        make_model(norm), g, schedule=schedule, microbatches=m, loss_fn=loss_fn,
        virtual_stages=v, **kw,
    )  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = run_steps(model, opt)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state, losses, model.peak_activations


CASES = [
    (schedule, p, m, v)
    for p in (2, 4)
    for m in (1, p, 2 * p)
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1), ("interleaved", 2))
    if not (schedule == "interleaved" and m % p)
] + [("zero_bubble_h2", 4, 8, 1)]


@pytest.mark.parametrize(("schedule", "p", "m", "v"), CASES, ids=str)
def test_every_schedule_equals_one_process(schedule: str, p: int, m: int, v: int) -> None:
    want, want_losses = reference(m)
    results = run_ranks(p, lambda g: train(g, schedule, m, v), timeout=120)
    held: set[str] = set()
    for state, losses, _ in results:
        for key, value in state.items():
            torch.testing.assert_close(value, want[key], msg=key)
        held |= state.keys()
        assert losses == pytest.approx(want_losses, rel=1e-5)
    assert held == set(want), "every parameter lives on exactly one rank"


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_bf16_mixed_precision_equals_one_process_under_autocast(schedule: str) -> None:
    """``mixed_precision=MixedPrecision(param_dtype=bf16)``: each stage's forward and the loss
    under autocast, as one process accumulating the same micro-batches under autocast; fp32
    weights, bf16 activations across the boundary."""
    want, want_losses = reference(4, autocast=torch.bfloat16)
    plain, _ = reference(4)
    mp = sl.MixedPrecision(param_dtype=torch.bfloat16)
    results = run_ranks(2, lambda g: train(g, schedule, 4, 1, mixed_precision=mp), timeout=60)
    for state, losses, _ in results:
        for key, value in state.items():
            assert value.dtype == torch.float32
            torch.testing.assert_close(value, want[key], msg=key)
        assert losses == pytest.approx(want_losses, rel=1e-5)
    # ... and bf16 really ran: the fp32 run ends elsewhere.
    assert any(not torch.equal(plain[k], want[k]) for k in want)
    bad = sl.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="reduce_dtype is not supported"):
        run_ranks(2, lambda g: train(g, "1f1b", 2, 1, mixed_precision=bad), timeout=60)


def test_bf16_weights_are_cast_once_per_step() -> None:
    """Under mixed precision each weight is cast to bf16 once per step: the backward of every
    micro-batch keeps the same low-precision copy (one per weight, not one per micro-batch
    in flight)."""
    mp = sl.MixedPrecision(param_dtype=torch.bfloat16)

    def body(g: ProcessGroup) -> tuple[dict[tuple[int, ...], set[int]], Counter[tuple[int, ...]]]:
        model = sl.pipeline(make_model(), g, microbatches=4, loss_fn=loss_fn, mixed_precision=mp)
        weights: Counter[tuple[int, ...]] = Counter()
        for p in model.parameters():
            if p.dim() == 2:
                weights.update({tuple(p.shape), tuple(p.shape[::-1])})
        saved: dict[tuple[int, ...], set[int]] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.dtype == torch.bfloat16 and tuple(t.shape) in weights:
                saved.setdefault(tuple(t.shape), set()).add(t.untyped_storage().data_ptr())
            return t

        x, y = batch(0)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.step(x, target=y)
        return saved, weights

    for saved, weights in run_ranks(2, body, timeout=60):
        assert saved, "the forwards saved bf16 weights for their backward"
        for shape, copies in saved.items():
            assert len(copies) <= weights[shape], (shape, len(copies), weights[shape])


def test_batchnorm_uneven_named_stages_and_gpipe_memory() -> None:
    """BatchNorm statistics per micro-batch; stages cut at named children, of uneven size."""
    want, _ = reference(4, norm=True)
    results = run_ranks(2, lambda g: train(g, "gpipe", 4, 1, norm=True, split=["5"]), timeout=60)
    for state, _, peak in results:
        for key, value in state.items():
            torch.testing.assert_close(value, want[key], msg=key)
        assert max(peak.values()) == 4  # GPipe holds every micro-batch
    assert set(results[0][0]) | set(results[1][0]) == set(want)


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_recompute_per_stage_equals_one_process_and_reruns_each_forward(schedule: str) -> None:
    """With recompute=True each stage runs its forward again in backward (counted by a hook),
    and training still equals one process."""
    want, _ = reference(4)

    def body(g: ProcessGroup) -> tuple[dict[str, torch.Tensor], int]:
        model = make_model()
        calls = [0]
        model[0].register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        pipe = sl.pipeline(model, g, schedule=schedule, microbatches=4, loss_fn=loss_fn,
                           recompute=True)  # fmt: skip
        run_steps(pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-2))
        return pipe.state_dict(), calls[0]

    results = run_ranks(2, body, timeout=60)
    for state, _ in results:
        for key, value in state.items():
            torch.testing.assert_close(value, want[key], msg=key)
    assert results[0][1] >= 2 * STEPS * 4  # child 0 lives on rank 0: forward + recompute


def test_recompute_keeps_stage_boundaries_in_the_activation_manager() -> None:
    """Inside an ActivationCheckpointManager's activate(), recompute registers each stage's
    input as that stage's boundary while its micro-batch is in flight: the manager's stage
    calls list them (seen from a hook during the step), its peak counts at most p of them on
    the first stage under 1F1B, and the stage is clear again after the step."""
    from shardline.parallel.recompute import ActivationCheckpointManager

    p, m = 2, 4

    def body(g: ProcessGroup) -> tuple[int, int, int, list[str], int]:
        model = make_model()
        manager = ActivationCheckpointManager(g)
        seen: list[str] = []
        last = model[-1]  # on rank 1: while it runs, stage 1's boundaries are registered
        last.register_forward_hook(lambda *_: seen.extend(map(str, manager.stage_checkpoints(1))))
        pipe = sl.pipeline(model, g, schedule="1f1b", microbatches=m, loss_fn=loss_fn,
                           recompute=True)  # fmt: skip
        with manager.activate():
            run_steps(pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-2), steps=range(1))
        left = len(manager.stage_checkpoints(g.rank))
        return manager.peak_bytes, manager.recomputed_bytes, left, seen, manager.clear_stage(9)

    (peak0, recomputed0, left0, _, none), (_, _, left1, seen1, _) = run_ranks(p, body, timeout=60)
    one_input = 16 // m * 6 * 4  # a micro-batch of the model's input: 4 rows x 6 float32
    assert peak0 == p * one_input  # 1F1B: at most p micro-batches in flight on stage 0
    assert recomputed0 > 0 and left0 == left1 == 0 and none == 0
    assert "stage1.mb0.boundary" in seen1 and all(k.startswith("stage1.mb") for k in seen1)


def test_compiled_stages_equal_one_process() -> None:
    """``compile=`` runs each stage through ``torch.compile`` (the aot_eager backend here: no
    C compiler needed, the same graph capture and AOT autograd as inductor); parameters
    keep their names and training equals one process. Zero-bubble cannot split a compiled
    stage's fused backward, and says so before any work."""
    want, _ = reference(2)
    compiled = {"backend": "aot_eager"}
    results = run_ranks(2, lambda g: train(g, "1f1b", 2, 1, compile=compiled), timeout=120)
    for state, _, _ in results:
        for key, value in state.items():
            torch.testing.assert_close(value, want[key], msg=key)
    with pytest.raises(AssertionError, match="compile= with schedule='zero_bubble'"):
        run_ranks(2, lambda g: train(g, "zero_bubble", 2, 1, compile=True), timeout=60)


def test_1f1b_first_stage_holds_at_most_p_microbatches() -> None:
    results = run_ranks(4, lambda g: train(g, "1f1b", 8, 1), timeout=60)
    peaks = [peak for _, _, peak in results]
    assert peaks[0] == {0: 4} and peaks[3] == {3: 1}, peaks


def test_zero_bubble_h2_holds_up_to_2p_minus_1_microbatches() -> None:
    """ZB-H2 uses its room: 2p - 1 micro-batches held at once on a stage (1F1B's first: p)."""
    results = run_ranks(4, lambda g: train(g, "zero_bubble_h2", 8, 1), timeout=60)
    peaks = [peak for _, _, peak in results]
    assert peaks[0] == {0: 7} and all(max(p.values()) <= 7 for p in peaks), peaks


class _Slow(nn.Module):
    """Sleeps in forward: a stage the next one must wait for."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.1)
        return x


def test_last_step_times_every_action_and_counts_waits_as_bubble() -> None:
    def run(g: ProcessGroup) -> dict[str, Any]:
        model = nn.Sequential(_Slow(), *make_model())
        pipe = sl.pipeline(model, g, schedule="gpipe", microbatches=2, loss_fn=loss_fn)
        x, y = batch(0)
        pipe.step(x, target=y)
        return pipe.last_step

    steps = run_ranks(2, run, timeout=60)
    for rank, got in enumerate(steps):
        want = [a.kind for a in build("gpipe", 2, 2)[rank]]
        assert [kind for kind, _, _ in got["timeline"]] == want
        starts = [start for _, start, _ in got["timeline"]]
        assert starts == sorted(starts)
        assert all(0 <= a <= b <= got["seconds"] for _, a, b in got["timeline"])
        assert 0 < got["busy"] <= got["seconds"]
    # The second stage waited for each of the first's two slow forwards: not busy then.
    assert steps[1]["seconds"] - steps[1]["busy"] >= 0.15
    assert steps[1]["timeline"][0][1] >= 0.05


def test_inference_through_the_pipeline() -> None:
    x, _ = batch(0)
    want = make_model()(x)
    outs = run_ranks(2, lambda g: sl.pipeline(make_model(), g, microbatches=4)(x))
    assert outs[0] is None
    torch.testing.assert_close(outs[1], want)


def test_bad_input_fails_on_every_rank_with_what_to_do() -> None:
    """Errors found by one rank (a batch its stage cannot split) reach the others at once
    (the pipeline's communicators are aborted), and bad arguments fail before any work."""
    with pytest.raises(AssertionError, match="4 of 4 ranks failed") as info:
        run_ranks(4, lambda g: train(g, "1f1b", 3, 1), timeout=60)
    text = str(info.value)
    assert "not divisible into microbatches=3" in text, text
    # The middle stages never see the batch: they stop with the reason of the first or the
    # last stage, whichever aborted the shared-memory links first (both find the batch bad).
    reasons = [f"pipeline stage(s) [{s}] on rank {s} failed" for s in (0, 3)]
    for r in (1, 2):
        block = text.split(f"--- rank {r} ---")[1].split("--- rank", maxsplit=1)[0]
        assert any(why in block for why in reasons), block
    with pytest.raises(AssertionError, match="'nope' is not a child"):
        run_ranks(2, lambda g: sl.pipeline(make_model(), g, split=["nope"]))
    with pytest.raises(AssertionError, match="10 children to split but the pipeline has 12"):
        run_ranks(2, lambda g: sl.pipeline(make_model(), g, virtual_stages=6,
                                           schedule="gpipe"))  # fmt: skip
    with pytest.raises(InvalidArgumentError, match="multiple of the pipeline's 2 ranks"):
        build("interleaved", 2, 3, 2)
    with pytest.raises(AssertionError, match=r"by tracing: pass split="):
        run_ranks(1, lambda g: sl.pipeline(nn.Linear(2, 2), g))


class _Pair(nn.Module):
    """Returns its input and a scaled copy: a tuple crosses the boundary after it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), 2 * x


class _Join(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, skip = pair
        return self.lin(torch.tanh(h) + skip)


def test_a_tuple_crosses_a_boundary_of_an_nn_sequential() -> None:
    """A child that returns a tuple at the end of a stage: the next stage's first child gets
    the tuple, as in one process (both tensors move in one message, gradients back)."""

    def build() -> nn.Sequential:
        with _RNG:
            torch.manual_seed(0)
            return nn.Sequential(_Pair(), _Join())

    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        for xi, yi in zip(x.chunk(2), y.chunk(2), strict=True):
            (loss_fn(model(xi), yi) / 2).backward()
        opt.step()
    want = model.state_dict()

    def body(g: ProcessGroup) -> dict[str, torch.Tensor]:
        pipe = sl.pipeline(build(), g, microbatches=2, loss_fn=loss_fn)
        run_steps(pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-2))
        return pipe.state_dict()

    for full in run_ranks(2, body, timeout=60):
        for key, value in want.items():
            torch.testing.assert_close(full[key], value, msg=key)
