"""Zero-bubble's weight pass put off by the layers themselves (``pipeline/deferred.py``).

The input pass then frees the graph, and the weight pass computes what the layers filed:
checked bit for bit against autograd's one backward of the plain layers, and a zero-bubble
pipeline of transformer blocks against one process.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import shardline as sl
from shardline.examples.train import Block, Config
from shardline.parallel.pipeline.deferred import WeightStore, forwarding, install
from tests._ranks import run_ranks

_RNG = threading.Lock()  # rank threads build their models one at a time
CFG = Config(d_model=32, num_heads=2, seq_len=8)


def blocks(n: int = 2) -> nn.Sequential:
    with _RNG:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 32), *[Block(CFG) for _ in range(n)], nn.Linear(32, 5))


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_an_input_pass_and_the_weight_pass_give_autograds_gradients_bit_for_bit(
    autocast: bool,
) -> None:
    plain, stage = blocks(), blocks()
    norms = install(stage)
    assert norms is not None and len(norms) == 2 * 2 * 2  # two blocks' two norms, w and b
    x0, g0 = torch.randn(4, 8, 32), torch.randn(4, 8, 5)
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    x = x0.clone().requires_grad_(True)
    with amp:
        y = plain(x)
    torch.autograd.backward([y], [g0.to(y.dtype)])

    xd = x0.clone().requires_grad_(True)
    store = WeightStore(norms)
    with forwarding(store), amp:
        yd = stage(xd)
    (got_x,) = store.input_pass([yd], [g0.to(yd.dtype)], [xd])
    assert all(p.grad is None for p in stage.parameters())  # nothing but the input's yet
    with pytest.raises(RuntimeError, match=r"second time|freed"):  # the graph is gone
        torch.autograd.backward([yd], [g0.to(yd.dtype)])
    store.run()
    assert got_x is not None and torch.equal(got_x, x.grad)
    for (name, p), q in zip(stage.named_parameters(), plain.parameters(), strict=True):
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert torch.equal(p.grad, q.grad), name


def test_a_stage_with_other_parameters_is_left_as_it_was() -> None:
    stage = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4))
    assert install(stage) is None
    assert all("forward" not in m.__dict__ for m in stage.modules())
    # Inside forwarding(store) the installed layers note themselves (the two linear layers
    # around the blocks and a block's four); outside it they note nothing and compute what
    # they did.
    stage = blocks(1)
    assert install(stage) is not None
    x, store = torch.randn(2, 8, 32), WeightStore()
    with forwarding(store):
        stage(x)
    assert len(store._noted) == 6
    assert torch.equal(stage(x), blocks(1)(x)) and len(store._noted) == 6


def test_an_input_changed_in_place_before_the_weight_pass_is_an_error() -> None:
    stage = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    assert install(stage) == []
    x, store = torch.randn(3, 4, requires_grad=True), WeightStore()
    with forwarding(store):
        y = stage(x)
    store.input_pass([y], [torch.ones(3, 2)], [x])
    with torch.no_grad():
        x.mul_(2)  # the first layer's input, after its forward
    with pytest.raises(sl.InvalidArgumentError, match="modified in place after its forward"):
        store.run()


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


@pytest.mark.parametrize(
    ("p", "schedule"), [(2, "zero_bubble"), (3, "zero_bubble"), (3, "zero_bubble_h2")]
)
def test_a_zero_bubble_pipeline_of_blocks_trains_as_one_process_bit_for_bit(
    p: int, schedule: str
) -> None:
    m, steps = 4, 3
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 8, 32, generator=gen), torch.randn(8, 8, 5, generator=gen))
            for _ in range(steps)]  # fmt: skip
    ref = blocks(3)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in data:
        opt.zero_grad()
        for xi, yi in zip(x.chunk(m), y.chunk(m), strict=True):
            (_loss(ref(xi), yi) / m).backward()
        opt.step()
    want = ref.state_dict()

    def body(g: sl.ProcessGroup) -> tuple[dict[str, torch.Tensor], set[int]]:
        model = sl.pipeline(blocks(3), g, schedule=schedule, microbatches=m, loss_fn=_loss)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in data:
            opt.zero_grad()
            model.step(x, target=y)
            opt.step()
        return model.state_dict(), set(model._deferred)

    results = run_ranks(p, body, timeout=120)
    # Every stage but the first defers (the first has no input pass).
    assert set().union(*(d for _, d in results)) == set(range(1, p))
    for state, _ in results:
        for key, value in state.items():
            assert torch.equal(value, want[key]), key


class _Reuse(nn.Module):
    """A linear layer whose weight its parent also uses directly, and one never called."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.raw = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + x @ self.lin.weight.t() + x @ self.raw.weight.t()


def test_a_weight_used_outside_its_layer_makes_the_stage_walk_its_graph() -> None:
    """The layers' notes would miss the direct use's part of the gradient: the first input
    pass finds it (``WeightStore.covers``) and the stage splits by the walk instead."""

    def model() -> nn.Sequential:
        with _RNG:
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(32, 32), _Reuse(), nn.Linear(32, 5))

    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 8, 32, generator=gen), torch.randn(8, 8, 5, generator=gen)
    ref = model()
    for xi, yi in zip(x.chunk(4), y.chunk(4), strict=True):
        (_loss(ref(xi), yi) / 4).backward()
    want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}

    def body(g: sl.ProcessGroup) -> tuple[dict[str, torch.Tensor], bool, bool]:
        m = model()
        pipe = sl.pipeline(m, g, schedule="zero_bubble", microbatches=4, loss_fn=_loss,
                           split=["1"])  # fmt: skip
        installed = 1 in pipe._deferred
        pipe.step(x, target=y)
        grads = {n: p.grad for n, p in pipe.named_parameters() if p.grad is not None}
        return grads, installed, 1 in pipe._deferred

    (g0, _, _), (g1, installed, still) = run_ranks(2, body, timeout=60)
    assert installed and not still  # set up for stage 1, then turned off at its first check
    got = {**g0, **g1}
    assert got.keys() == want.keys()
    for name, grad in got.items():
        torch.testing.assert_close(grad, want[name], msg=name)
