"""ZeRO's flat buffers in symmetric memory (the default on CPU on one host).

What lives as long as the wrapper goes there: ``full`` at stages 1 and 2 (the all-gather's
output), the shard at stage 3 when it is the all-gather's input (no mixed precision), the
gradient buffer at stage 1 (the all-reduce's). The collectives add in the same rank order as
through the slots, so training gives the same bits with ``symmetric=False``; with micro-batch
accumulation, a frozen block, tied weights and clipping, and under bf16 compute.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import shardline as sl
from shardline.comm import ProcessGroup
from shardline.errors import InvalidArgumentError
from shardline.parallel import MixedPrecision, ShardedDataParallel
from tests._ranks import run_ranks
from tests._symmetric_maps import in_symmetric_memory
from tests._zero import UNIT_MB, adamw, batch, lm_loss, make
from tests.test_pipeline import loss_fn
from tests.test_pipeline import make_model as make_pipeline_model
from tests.test_pipeline_mesh import train_replica

pytestmark = pytest.mark.usefixtures("native")


def train(g: ProcessGroup, stage: int, symmetric: bool | None, **kw: Any) -> tuple[
    dict[str, torch.Tensor], ShardedDataParallel
]:  # fmt: skip
    torch.set_num_threads(1)
    plain = make(frozen=True)
    opt = adamw([(k, p) for k, p in plain.named_parameters() if p.requires_grad])
    model, opt = sl.distribute(
        plain, opt, strategy=f"zero{stage}", group=g, unit_mb=UNIT_MB, symmetric=symmetric, **kw
    )
    assert isinstance(model, ShardedDataParallel) and opt is not None
    for step in range(4):
        opt.zero_grad()
        for m in range(2):  # two synchronised micro-batches: stage 1 adds into its buffer
            x, y = batch(step, g.rank, m)
            (lm_loss(model(x), y) / 2).backward()
        model.clip_grad_norm_(0.05)
        opt.step()
    return model.state_dict(), model


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_symmetric_buffers_give_the_same_bits_as_ordinary_ones(stage: int, bf16: bool) -> None:
    kw = {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16)} if bf16 else {}

    def body(g: ProcessGroup) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        ours, model = train(g, stage, None, **kw)
        assert model.symmetric != (stage == 3 and bf16)  # there nothing stays to be moved
        for u in model._units:
            if u.owner is not None:
                continue
            if stage < 3:
                assert in_symmetric_memory(u.full), u.index
            else:
                # fp32: the shard is the all-gather's input; bf16: a cast made per gather is
                assert in_symmetric_memory(u.shard) != bf16 and not in_symmetric_memory(u.full)
            assert (u.grad_home is not None) == (stage == 1)
            if u.grad_home is not None:
                assert in_symmetric_memory(u.grad_home)
            assert u.grad_pool is None  # only with symmetric=True
        plain, model = train(g, stage, False, **kw)
        assert not model.symmetric
        assert not any(in_symmetric_memory(u.full) for u in model._units)
        return ours, plain

    for ours, plain in run_ranks(3, body, timeout=120):
        assert ours.keys() == plain.keys()
        for k, v in plain.items():
            assert torch.equal(ours[k], v), k


def test_symmetric_true_on_a_group_without_it_says_why() -> None:
    def body(g: ProcessGroup) -> str:
        with pytest.raises(InvalidArgumentError) as caught:
            ShardedDataParallel(make(), group=g, symmetric=True)
        return str(caught.value)

    for message in run_ranks(2, body, transport="tcp"):
        assert "ShardedDataParallel: symmetric=True" in message, message


@pytest.mark.parametrize("stage", [1, 3])
def test_a_pipeline_of_zero_stages_gives_the_same_bits_with_symmetric_memory(
    stage: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dp2 x pp2 with ZeRO per stage (held steps: ``unshard`` / ``reduce_grads``; the buffers
    move to symmetric memory at the first hold); then again with ``SHARDLINE_SYMMETRIC=0``."""

    def body(g: ProcessGroup) -> tuple[bool, list[torch.Tensor]]:
        mesh = sl.DeviceMesh({"dp": 2, "pp": 2}, group=g)
        pipe = sl.pipeline(make_pipeline_model(), mesh.group("pp"), schedule="1f1b", microbatches=4,
                           loss_fn=loss_fn, dp_group=mesh.group("dp"),
                           dp_strategy=f"zero{stage}")  # fmt: skip
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        pipe.bind_optimizer(opt)
        train_replica(pipe, opt, mesh.local_rank("dp"))
        zero = pipe._replicas._zero
        ranges = [
            (u.full if stage < 3 else u.shard) for z in zero for u in z._units if u.owner is None
        ]
        symmetric = all(z.symmetric for z in zero) and all(map(in_symmetric_memory, ranges))
        return symmetric, [p.detach().clone() for p in pipe.parameters()]

    ours = run_ranks(4, body, timeout=120)
    monkeypatch.setenv("SHARDLINE_SYMMETRIC", "0")
    plain = run_ranks(4, body, timeout=120)
    for (symmetric, a), (ordinary, b) in zip(ours, plain, strict=True):
        assert symmetric and not ordinary
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("stage", [2, 3])
def test_zero2_and_3_gradients_come_from_the_pool_while_it_has_room(stage: int) -> None:
    """``symmetric=True``: a ``no_sync`` backward leaves each unit's whole gradient in its
    buffer: some in the pool (symmetric memory), the rest, once it is full, ordinary; the
    synchronised backward then reduce-scatters both kinds, every buffer goes back, the pool is
    counted in ``memory_stats()``, and the model has the bits of one trained with
    ``symmetric=False``."""

    def run(g: ProcessGroup, symmetric: bool | None) -> tuple[list[bool], int, dict[str, Any]]:
        torch.set_num_threads(1)
        plain = make()
        opt = adamw(list(plain.named_parameters()))
        model, opt = sl.distribute(plain, opt, strategy=f"zero{stage}", group=g,
                                   unit_mb=UNIT_MB, symmetric=symmetric)  # fmt: skip
        assert isinstance(model, ShardedDataParallel) and opt is not None
        x, y = batch(0, g.rank, 0)  # a first step: the move to symmetric memory comes with
        lm_loss(model(x), y).backward()  # the layout's first collective (ZeRO-2: a reduction)
        opt.step()
        opt.zero_grad()
        with model.no_sync():
            lm_loss(model(x), y).backward()
        held = [
            in_symmetric_memory(u.grad_full)
            for u in model._units
            if u.grad_full is not None and u.owner is None
        ]
        x, y = batch(0, g.rank, 1)
        lm_loss(model(x), y).backward()
        opt.step()
        pools = {id(u.grad_pool): u.grad_pool for u in model._units if u.grad_pool is not None}
        assert len(pools) == (symmetric is True)
        if pools:
            idle = sum(p.idle() for p in pools.values())
            assert idle > 0 and model.memory_stats()["grads"] >= idle
        return held, sum(p.in_use() for p in pools.values()), model.state_dict()

    def body(g: ProcessGroup) -> tuple[list[bool], int, bool]:
        held, in_use, ours = run(g, True)
        _, _, plain = run(g, False)
        return held, in_use, all(torch.equal(v, plain[k]) for k, v in ours.items())

    for held, in_use, same in run_ranks(2, body, timeout=120):
        assert any(held) and not all(held), held  # some from the pool, then ordinary ones
        assert in_use == 0
        assert same
