"""DDP's mechanics: bucket order and launch, symmetric buckets, start-up checks and errors."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import shardline as sl
from shardline.comm import ProcessGroup
from shardline.comm.symmetric import wait_for_releases
from shardline.errors import CommunicatorClosedError, InvalidArgumentError, ShardlineError
from shardline.parallel import DistributedDataParallel
from tests._ddp import (
    HIDDEN,
    IN,
    INIT_LOCK,
    OUT,
    assert_equal_lists,
    batch,
    mlp,
    params,
    train,
)
from tests._ranks import run_ranks
from tests._symmetric_maps import in_symmetric_memory, symmetric_ranges

pytestmark = pytest.mark.usefixtures("native")


class Shuffled(nn.Module):
    """Registered b, a, c but run a -> b -> c: backward readies c, b, a."""

    def __init__(self) -> None:
        super().__init__()
        with INIT_LOCK:
            torch.manual_seed(0)
            self.b = nn.Linear(HIDDEN, HIDDEN)
            self.a = nn.Linear(IN, HIDDEN)
            self.c = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def test_buckets_follow_ready_order_and_start_during_backward() -> None:
    launched: list[tuple[int, int]] = []

    def body(g: ProcessGroup) -> list[list[list[str]]]:
        torch.set_num_threads(1)
        model: DistributedDataParallel

        def hook(group: ProcessGroup, bucket: torch.Tensor) -> Callable[[], None]:
            step = model._step
            assert step is not None
            if g.rank == 0:
                launched.append((bucket.numel(), step.ready.count(False)))
            work = group.all_reduce(bucket, "sum", async_op=True)
            assert work is not None
            return work.wait

        # One parameter per bucket (cap below the smallest parameter's bytes).
        model = DistributedDataParallel(
            Shuffled(), group=g, bucket_cap_mb=1e-6, first_bucket_mb=1e-6, comm_hook=hook
        )
        before = model.bucket_layout
        for step in range(2):
            x, y = batch(step, g.rank)
            nn.functional.mse_loss(model(x), y).backward()
        return [before, model.bucket_layout]

    layouts = run_ranks(2, body)
    assert layouts[0] == layouts[1]
    # Before the first step: reverse registration order (b, a, c registered).
    assert [name for names in layouts[0][0] for name in names] == [
        "c.bias",
        "c.weight",
        "a.bias",
        "a.weight",
        "b.bias",
        "b.weight",
    ]
    # After it: the order backward produced the gradients.
    assert [name for names in layouts[0][1] for name in names] == [
        "c.bias",
        "c.weight",
        "b.bias",
        "b.weight",
        "a.bias",
        "a.weight",
    ]
    # The first bucket of each step started while other gradients were still being computed.
    first_of_each_step = [launched[0], launched[6]]
    assert all(pending > 0 for _, pending in first_of_each_step), launched


def test_in_place_gradients_keep_the_ready_order() -> None:
    """Small gradients packed between in-place ones do not hold the later ones back."""

    def body(g: ProcessGroup) -> list[list[str]]:
        # in place from 1 KiB (ordinary buckets: symmetric ones hold every gradient)
        model = DistributedDataParallel(Shuffled(), group=g, in_place_mb=1e-3, symmetric=False)
        for step in range(2):
            x, y = batch(step, g.rank)
            nn.functional.mse_loss(model(x), y).backward()
        return model.bucket_layout

    layout = run_ranks(2, body)[0]
    # Ready order: c.bias, c.weight, b.bias, b.weight, a.bias, a.weight. b.weight and a.weight
    # (>= 1 KiB) are reduced in place; the small ones share a bucket that fills at a.bias.
    assert layout == [["b.weight"], ["c.bias", "c.weight", "b.bias", "a.bias"], ["a.weight"]]


def test_the_last_bucket_and_the_mask_are_reduced_waiting_on_cpu() -> None:
    """The last bucket fills as backward ends: the final callback reduces it, and the mask of
    used parameters, on the rank's own thread; the others start during backward."""

    def body(g: ProcessGroup) -> tuple[list[tuple[torch.dtype, int, bool]], list[int]]:
        calls: list[tuple[torch.dtype, int, bool]] = []
        inner = g.all_reduce

        def recording(tensor: torch.Tensor, op: object = "sum", async_op: bool = False) -> Any:
            calls.append((tensor.dtype, tensor.numel(), async_op))
            return inner(tensor, op, async_op)

        model = DistributedDataParallel(
            Shuffled(), group=g, bucket_cap_mb=1e-6, first_bucket_mb=1e-6
        )
        for step in range(2):  # the second step runs on the rebuilt buckets
            if step == 1:
                g.all_reduce = recording  # type: ignore[method-assign]
            x, y = batch(step, g.rank)
            nn.functional.mse_loss(model(x), y).backward()
        return calls, [b.flat.numel() for b in model._buckets]

    calls, sizes = run_ranks(2, body)[0]
    assert len(sizes) == 6
    assert calls == [(torch.float32, n, True) for n in sizes[:-1]] + [
        (torch.float32, sizes[-1], False),
        (torch.uint8, 6, False),
    ]


def test_different_models_are_named() -> None:
    def body(g: ProcessGroup) -> str:
        width = HIDDEN if g.rank == 0 else HIDDEN + 1
        with pytest.raises(InvalidArgumentError) as info:
            DistributedDataParallel(nn.Linear(IN, width), group=g)
        return str(info.value)

    messages = run_ranks(2, body)
    assert all("rank 1 has 2 trainable parameters" in m for m in messages), messages


def test_initial_parameters_come_from_rank_0() -> None:
    def body(g: ProcessGroup) -> list[torch.Tensor]:
        model = DistributedDataParallel(mlp(seed=g.rank), group=g)
        return params(model)

    results = run_ranks(3, body)
    for ours in results:
        assert_equal_lists(ours, params(mlp(seed=0)), exact=True)


def test_exception_inside_join_reaches_the_other_rank() -> None:
    def body(g: ProcessGroup) -> str:
        model = DistributedDataParallel(mlp(), group=g)
        try:
            with model.join():
                for step in range(3):
                    x, y = batch(step, g.rank)
                    if g.rank == 1 and step == 1:
                        raise RuntimeError("data loader broke")
                    nn.functional.mse_loss(model(x), y).backward()
        except ShardlineError as e:
            return f"peer: {type(e).__name__}: {e}"
        except RuntimeError as e:
            return f"raised: {e}"
        return "finished"

    results = run_ranks(2, body, timeout=30.0)
    assert results[1] == "raised: data loader broke"
    assert results[0].startswith("peer:"), results[0]
    assert "DistributedDataParallel.join()" in results[0] or "abort" in results[0].lower()


def test_distribute_returns_the_wrapped_model_and_the_same_optimizer() -> None:
    def body(g: ProcessGroup) -> None:
        model = mlp()
        opt = torch.optim.Adam(model.parameters())
        wrapped, opt2 = sl.distribute(model, opt, strategy="ddp", group=g)
        assert isinstance(wrapped, DistributedDataParallel) and opt2 is opt
        assert set(wrapped.state_dict()) == set(model.state_dict())
        with pytest.raises(InvalidArgumentError, match="unknown strategy"):
            sl.distribute(model, opt, strategy="zero9", group=g)
        # An option of another strategy: named, with who takes it, before any collective.
        with pytest.raises(InvalidArgumentError, match=r"unit_mb \(.*the ZeRO strategies\)"):
            sl.distribute(model, opt, strategy="ddp", group=g, unit_mb=4)
        with pytest.raises(InvalidArgumentError, match=r"bucket_cap_mb \(.*DDP\).*takes unit_mb"):
            sl.distribute(model, opt, strategy="zero3", group=g, bucket_cap_mb=4)
        with pytest.raises(InvalidArgumentError, match="not parameters of the model"):
            sl.distribute(model, torch.optim.SGD(mlp(1).parameters(), lr=1), group=g)

    run_ranks(2, body)


def test_bad_arguments() -> None:
    def body(g: ProcessGroup) -> None:
        with pytest.raises(InvalidArgumentError, match="bucket_cap_mb"):
            DistributedDataParallel(mlp(), group=g, bucket_cap_mb=0)
        with pytest.raises(InvalidArgumentError, match="unknown comm_hook"):
            DistributedDataParallel(mlp(), group=g, comm_hook="int3")

    run_ranks(1, body)


def test_shut_down_group_is_reported() -> None:
    def body(g: ProcessGroup) -> None:
        model = DistributedDataParallel(copy.deepcopy(mlp()), group=g)
        g.shutdown()
        x, y = batch(0, 0)
        with pytest.raises(CommunicatorClosedError):
            nn.functional.mse_loss(model(x), y).backward()

    run_ranks(1, body)


def test_buckets_live_in_symmetric_memory_and_the_rebuild_frees_the_first_ones() -> None:
    """On one host the default puts every bucket in symmetric memory (no in-place
    gradients); the gradients that view the buckets after the first step's rebuild keep their
    values, and the first buckets' mappings go with them."""
    before = len(symmetric_ranges())

    def body(g: ProcessGroup) -> tuple[bool, int, int, list[torch.Tensor]]:
        model = DistributedDataParallel(mlp(), group=g, bucket_cap_mb=0.001, in_place_mb=0.0)
        assert not any(b.in_place for b in model._buckets)
        assert all(in_symmetric_memory(b.flat) for b in model._buckets)
        first = [b.flat.data_ptr() for b in model._buckets]
        train(model, g.rank, steps=1)
        g.barrier()  # every rank has rebuilt and dropped its first buckets
        # Their releases were queued (comm/symmetric.py's release thread does them); none of
        # this group's ranks is in a collective until every rank has seen them done.
        assert wait_for_releases()
        after_rebuild = len(symmetric_ranges())
        g.barrier()
        grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        # Every gradient views a new bucket in symmetric memory, with the step's values.
        for p in model.parameters():
            assert p.grad is not None and in_symmetric_memory(p.grad)
            assert p.grad.data_ptr() not in first
        return model.symmetric, after_rebuild, len(model._buckets), grads

    results = run_ranks(3, body)
    assert all(r[0] for r in results) and results[0][2] > 1
    # 3 ranks each map the 3 segments of the one arena left: the first is gone on every rank
    assert [r[1] - before for r in results] == [9, 9, 9]
    assert wait_for_releases() and len(symmetric_ranges()) == before
    # and the values are the reduced gradients (every rank holds the same)
    for r in results[1:]:
        assert_equal_lists(r[3], results[0][3], exact=True)


def test_symmetric_true_where_there_is_none_says_why() -> None:
    def body(g: ProcessGroup) -> str:
        with pytest.raises(InvalidArgumentError) as caught:
            DistributedDataParallel(mlp(), group=g, symmetric=True)
        return str(caught.value)

    for message in run_ranks(2, body, transport="tcp"):
        assert "symmetric=True" in message and "no shared memory" in message, message
