"""ZeRO stages 1/2/3 in the ways programs use them, each from a review that found it broken.

Each trains as one process would (the same model on every rank's data, in one process); ranks
run as threads (``run_ranks``).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import shardline as sl
from shardline.comm import ProcessGroup
from shardline.parallel import ShardedDataParallel
from tests._ranks import run_ranks
from tests._zero import _INIT, assert_state_close, batch, lm_loss, make

pytestmark = pytest.mark.usefixtures("native")


class Chain(nn.Module):
    """Four 16-wide layers; ``order`` picks which run and in what order."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(16, 16) for _ in range(4))

    def forward(
        self, x: torch.Tensor, order: str = "abcd", ckpt: bool = False, dangling: str = ""
    ) -> torch.Tensor:
        for name in order:
            layer = getattr(self, name)
            if ckpt:
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
            x = torch.tanh(x)
        for name in dangling:  # run, output unused
            getattr(self, name)(x)
        return x


def chain() -> Chain:
    with _INIT:
        torch.manual_seed(0)
        return Chain()


def chain_data(step: int, rank: int, micro: int = 0) -> torch.Tensor:
    return torch.randn(
        5, 16, generator=torch.Generator().manual_seed(100 * step + 10 * rank + micro)
    )


Pattern = Callable[[nn.Module, torch.optim.Optimizer, int, int], None]


def same_as_one_process(
    stage: int, n: int, ours: Pattern, theirs: Pattern, steps: int = 3, **options: Any
) -> None:
    """``ours(model, opt, rank, step)`` on every rank == ``theirs(model, opt, rank, step)``
    run for every rank in one process (each scaled by 1/n), then stepped."""
    ref = chain()
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        ropt.zero_grad()
        for r in range(n):
            theirs(ref, ropt, r, step)
        ropt.step()

    def body(g: ProcessGroup) -> dict[str, torch.Tensor]:
        torch.set_num_threads(1)
        plain = chain()
        opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
        options.setdefault("unit_mb", 0)
        model, opt = sl.distribute(plain, opt, strategy=f"zero{stage}", group=g, **options)
        assert opt is not None
        for step in range(steps):
            ours(model, opt, g.rank, step)
        return model.state_dict()

    for state in run_ranks(n, body, timeout=60, op_timeout=15):
        assert_state_close(state, ref.state_dict())


def _loss(model: nn.Module, rank: int, step: int, micro: int = 0, **kw: Any) -> torch.Tensor:
    return model(chain_data(step, rank, micro), **kw).square().mean()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_forward_between_backward_and_step(stage: int) -> None:
    """A no-grad forward (logging) after backward, before the step: later forwards still see
    the stepped parameters."""

    def ours(m: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
        opt.zero_grad()
        _loss(m, rank, step).backward()
        with torch.no_grad():
            m(chain_data(step, rank, 1))
        opt.step()

    def theirs(m: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
        (_loss(m, rank, step) / 2).backward()

    same_as_one_process(stage, 2, ours, theirs)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_activation_checkpointing(stage: int) -> None:
    """torch.utils.checkpoint (non-reentrant) inside the model: modules run again in backward."""

    def ours(m: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
        opt.zero_grad()
        _loss(m, rank, step, ckpt=True).backward()
        opt.step()

    def theirs(m: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
        (_loss(m, rank, step) / 2).backward()

    same_as_one_process(stage, 2, ours, theirs)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_backwards_per_step_and_a_retained_graph(stage: int) -> None:
    """Two forwards then two backwards, and backward(retain_graph=True) twice."""

    def ours(m: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
        opt.zero_grad()
        first, second = _loss(m, rank, step, 0), _loss(m, rank, step, 1)
        first.backward()
        second.backward(retain_graph=True)
        second.backward()
        opt.step()

    def theirs(m: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
        ((_loss(m, rank, step, 0) + 2 * _loss(m, rank, step, 1)) / 2).backward()

    same_as_one_process(stage, 2, ours, theirs)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_ranks_running_modules_in_different_orders(stage: int) -> None:
    """Rank 0 runs a, b, c, d and rank 1 b, c, d, a: no deadlock, same model as one process."""
    orders = {0: "abcd", 1: "bcda"}

    def ours(m: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
        opt.zero_grad()
        _loss(m, rank, step, order=orders[rank]).backward()
        opt.step()

    def theirs(m: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
        (_loss(m, rank, step, order=orders[rank]) / 2).backward()

    same_as_one_process(stage, 2, ours, theirs)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_grad_after_no_sync_drops_the_accumulated_gradients(stage: int) -> None:
    """A micro-batch under no_sync, then optimizer.zero_grad() (say, it was NaN): as in torch,
    its gradients are gone."""

    def ours(m: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
        opt.zero_grad()
        with m.no_sync():  # type: ignore[operator]
            _loss(m, rank, step, 0).backward()
        opt.zero_grad()
        _loss(m, rank, step, 1).backward()
        opt.step()

    def theirs(m: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
        (_loss(m, rank, step, 1) / 2).backward()

    same_as_one_process(stage, 2, ours, theirs)


def test_a_unit_whose_last_module_does_not_reach_the_loss() -> None:
    """Units {a, b} and {c, d}; b runs after a but its output is unused: the unit is still
    gathered for a's backward (no prefetch to hide it)."""

    def ours(m: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
        opt.zero_grad()
        _loss(m, rank, step, order="a", dangling="b").backward()
        opt.step()

    def theirs(m: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
        (_loss(m, rank, step, order="a") / 2).backward()

    same_as_one_process(3, 2, ours, theirs, prefetch=0, unit_mb=0.002)


def test_optimizer_with_eager_state_built_after_wrapping() -> None:
    """Adagrad creates its state at construction: units must not change shape afterwards."""

    def body(g: ProcessGroup) -> None:
        torch.set_num_threads(1)
        model = ShardedDataParallel(chain(), stage=3, group=g, unit_mb=0)
        opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
        for step in range(2):
            opt.zero_grad()
            _loss(model, g.rank, step, order="dcba").backward()
            opt.step()

    run_ranks(2, body, timeout=60)


@pytest.mark.parametrize("frozen", ["none", "base", "experts"])
def test_backward_holds_few_units_gathered(frozen: str) -> None:
    """Stage 3 frees each unit in backward once its gradients are in and its saved tensors
    were used, also when it has frozen parameters or this rank did not run it."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(8))

        def forward(self, x: torch.Tensor, skip: int) -> torch.Tensor:
            for i, layer in enumerate(self.layers):
                if frozen != "experts" or i % 2 == 0 or i // 2 % 2 == skip:
                    x = x + torch.tanh(layer(x))
            return x

    def body(g: ProcessGroup) -> int:
        torch.set_num_threads(1)
        with _INIT:
            torch.manual_seed(0)
            net = Net()
        if frozen == "base":
            for layer in net.layers[::2]:
                layer.requires_grad_(False)
        model = ShardedDataParallel(net, stage=3, group=g, unit_mb=0)
        peak = 0
        pre_backward = model._schedule._pre_backward

        def probe(units: list[Any]) -> None:  # called for every saved tensor backward uses
            nonlocal peak
            pre_backward(units)
            peak = max(peak, sum(u.full.untyped_storage().nbytes() > 0 for u in model._units))

        model._schedule._pre_backward = probe  # type: ignore[method-assign]
        x = torch.randn(4, 64, requires_grad=True)
        for _ in range(2):
            model(x, skip=g.rank).square().mean().backward()
        return peak

    # At most the unit in use, the one prefetched and the one just finished (freed at the
    # next event), of 8.
    for peak in run_ranks(2, body, timeout=60):
        assert 0 < peak <= 3, peak


@pytest.mark.parametrize("stage", [2, 3])
def test_a_units_gradient_buffer_exists_only_from_its_last_gradient(stage: int) -> None:
    """Until a unit's last gradient arrives its gradients stay autograd's tensors: the
    full-size flat buffer is allocated only then, and the values are still exact."""

    def body(g: ProcessGroup) -> list[tuple[int, bool]]:
        torch.set_num_threads(1)
        with _INIT:
            torch.manual_seed(0)
            net = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
        model = ShardedDataParallel(net, stage=stage, group=g, unit_mb=1)  # one unit
        (unit,) = model._units
        seen: list[tuple[int, bool]] = []
        for p in net.parameters():  # registered after the wrapper's hooks: they run after them
            p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                lambda _: seen.append((len(unit.held_grads), unit.grad_full is None))
            )
        x = torch.randn(3, 16, generator=torch.Generator().manual_seed(g.rank))
        model(x).square().mean().backward()
        return seen

    for seen in run_ranks(2, body, timeout=60):
        # Four parameters: three held without a buffer, the last one flushes them all.
        assert seen[:3] == [(1, True), (2, True), (3, True)], seen
        assert seen[3][0] == 0, seen


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero3"])
def test_deleting_the_wrapped_model_frees_it(strategy: str) -> None:
    """After ``del model, opt`` the wrapper and its buffers are garbage, and the plain model
    the caller kept carries none of its hooks: hooks on the user's modules and parameters
    must not keep the wrapper (and its memory) alive."""

    def body(g: ProcessGroup) -> tuple[bool, int, int]:
        torch.set_num_threads(1)
        plain = make()
        hooks_before = _hook_count(plain)
        opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
        kw = {} if strategy == "ddp" else {"unit_mb": 0}
        model, opt = sl.distribute(plain, opt, strategy=strategy, group=g, **kw)
        hooks_wrapped = _hook_count(plain)
        x, y = batch(0, g.rank)
        lm_loss(model(x), y).backward()
        opt.step()
        wrapper = weakref.ref(model)
        del model, opt
        gc.collect()
        return wrapper() is None, hooks_wrapped - hooks_before, _hook_count(plain) - hooks_before

    for wrapper_gone, added, left in run_ranks(2, body, timeout=60):
        assert added > 0, "the wrapper registered no hooks: this test checks nothing"
        assert wrapper_gone, "the wrapper is still alive after del model, opt"
        assert left == 0, f"the plain model still carries {left} of the wrapper's hooks"


def _hook_count(module: nn.Module) -> int:
    """Forward (pre-)hooks on ``module``'s modules plus post-accumulate-grad hooks on its
    parameters."""
    on_modules = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in module.modules())
    on_params = sum(len(p._post_accumulate_grad_hooks or {}) for p in module.parameters())
    return on_modules + on_params
