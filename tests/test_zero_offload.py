"""ZeRO with offload: shards, gradients and optimizer state in host memory.

On CPU the device and the host are the same memory, so an offloaded run must equal the
run without offload bit for bit: the same reductions, the same optimizer on the same values,
only through the host-side buffers (the gradient copies, the shards' device copies and their
refresh after each step). The GPU run of the same tests is ``tests/gpu/``'s.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardline as sl
from shardline.comm import ProcessGroup
from shardline.errors import InvalidArgumentError
from shardline.optim import CPUAdamW
from shardline.parallel import MixedPrecision, ShardedDataParallel
from tests._ranks import run_ranks
from tests._zero import Wide, adamw, make, planned_then_trained, train

pytestmark = pytest.mark.usefixtures("native")


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k, v in b.items():
        assert torch.equal(a[k], v), k


@pytest.mark.parametrize("offload", ["optimizer", "cpu"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offloaded_training_equals_training_without(stage: int, offload: str) -> None:
    """Two micro-batches per step, global-norm clipping, a frozen block, tied embeddings."""
    kw = {"frozen": True, "accum": 2, "clip": 0.05}
    plain = run_ranks(2, lambda g: train(g, stage, 5, adamw, **kw)[:2], timeout=120)
    off = run_ranks(2, lambda g: train(g, stage, 5, adamw, offload=offload, **kw)[:2], timeout=120)
    for (losses, state), (ref_losses, ref_state) in zip(off, plain, strict=True):
        assert losses == ref_losses
        _equal(state, ref_state)


@pytest.mark.parametrize("stage", [2, 3])
def test_no_sync_accumulation_with_offload_equals_it_without(stage: int) -> None:
    kw = {"accum": 2, "no_sync": True}
    plain = run_ranks(2, lambda g: train(g, stage, 4, adamw, **kw)[:2], timeout=120)
    off = run_ranks(2, lambda g: train(g, stage, 4, adamw, offload="cpu", **kw)[:2], timeout=120)
    for (losses, state), (ref_losses, ref_state) in zip(off, plain, strict=True):
        assert losses == ref_losses
        _equal(state, ref_state)


def test_mixed_precision_with_offload_equals_it_without() -> None:
    mp = MixedPrecision(param_dtype=torch.bfloat16)
    plain = run_ranks(2, lambda g: train(g, 3, 4, adamw, mixed_precision=mp)[:2], timeout=120)
    off = run_ranks(
        2, lambda g: train(g, 3, 4, adamw, mixed_precision=mp, offload="optimizer")[:2], timeout=120
    )
    for (losses, state), (ref_losses, ref_state) in zip(off, plain, strict=True):
        assert losses == ref_losses
        _equal(state, ref_state)


def test_the_rust_cpu_adamw_steps_the_offloaded_shards() -> None:
    def ours(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
        return CPUAdamW([p for _, p in named], lr=1e-2, weight_decay=0.0)

    def torchs(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for _, p in named], lr=1e-2, weight_decay=0.0, foreach=False)

    got = run_ranks(2, lambda g: train(g, 3, 5, ours, offload="optimizer")[:2], timeout=120)
    want = run_ranks(2, lambda g: train(g, 3, 5, torchs)[:2], timeout=120)
    for (losses, state), (ref_losses, ref_state) in zip(got, want, strict=True):
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, rtol=1e-4, atol=1e-5, msg=k)


def test_memory_is_counted_on_the_host_and_state_dicts_round_trip() -> None:
    def body(g: ProcessGroup) -> tuple[dict[str, int], bool]:
        _, _, model, opt = train(g, 3, 2, adamw, offload="cpu")
        stats = model.memory_stats()
        saved = (model.state_dict(), model.optim_state_dict(opt))
        _, _, again, opt2 = train(g, 3, 0, adamw, offload="cpu")
        again.load_state_dict(saved[0])
        again.load_optim_state_dict(opt2, saved[1])
        same = all(torch.equal(a, b) for a, b in zip(
            again.state_dict().values(), saved[0].values(), strict=True))  # fmt: skip
        on_host = all(loc.device.type == "cpu" for u in model._units for loc in u.locals)
        return stats, same and on_host

    for stats, ok in run_ranks(2, body, timeout=120):
        assert ok
        numel = sum(p.numel() for p in make().parameters())
        assert stats["master"] == 0
        # fp32 shards of every parameter (tied once) plus their gradients, split over 2 ranks
        assert stats["host"] >= 2 * 4 * numel // 2


def test_a_bad_offload_is_refused() -> None:
    def body(g: ProcessGroup) -> None:
        with pytest.raises(InvalidArgumentError, match="offload must be"):
            ShardedDataParallel(make(), group=g, offload="disk")

    run_ranks(1, body)


@pytest.mark.parametrize("offload", ["optimizer", "cpu"])
def test_the_planner_counts_device_and_host_bytes(offload: str) -> None:
    """estimate_memory(offload=) against what the wrapper and AdamW hold after two steps."""

    def body(g: ProcessGroup) -> dict[int, tuple[int, int, int, int]]:
        out = {}
        for stage in (1, 2, 3):
            planned, model, opt = planned_then_trained(g, stage, offload=offload)
            stats = model.memory_stats()
            states = sum(t.nbytes for s in opt.state.values() for t in s.values() if t.dim() > 0)
            device = stats["params"] + stats["master"] + stats["grads"]
            out[stage] = (planned.persistent, device, planned.host, stats["host"] + states)
        return out

    for per_stage in run_ranks(2, body, timeout=120):
        for stage, (planned, device, planned_host, host) in per_stage.items():
            assert planned == pytest.approx(device, rel=0.10, abs=4096), (stage, planned, device)
            assert planned_host == pytest.approx(host, rel=0.10), (stage, planned_host, host)
            assert planned_host > 0


def test_choose_strategy_offloads_on_gpus_when_nothing_else_fits() -> None:
    model = Wide()
    zero3 = sl.estimate_memory(model, world_size=2, strategy="zero3").total
    opt = sl.estimate_memory(model, world_size=2, strategy="zero3", offload="optimizer").total
    cpu = sl.estimate_memory(model, world_size=2, strategy="zero3", offload="cpu").total
    assert cpu < opt < zero3
    for budget, want in (((opt + zero3) // 2, "optimizer"), ((cpu + opt) // 2, "cpu")):
        name, reason, est = sl.parallel.choose_strategy(
            model, world_size=2, available_bytes=budget, headroom=1.0, device="cuda"
        )
        assert (name, est.offload) == ("zero3", want), reason
        assert f"offload={want}" in reason and "zero3 (" in reason
        assert est.host > 0
    # On CPU the host is the device: no offload, zero3 said to be short.
    name, reason, est = sl.parallel.choose_strategy(
        model, world_size=2, available_bytes=cpu // 2, headroom=1.0, device="cpu"
    )
    assert (name, est.offload) == ("zero3", None) and "short by" in reason
