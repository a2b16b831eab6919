"""Micro-batch mode (``deterministic="microbatch"``): every layout's bits, on the model's kernels.

The reference is plain PyTorch in this process: each micro-batch's gradient computed alone on
an unwrapped copy of the model, the micro-batches' gradients added with ``tree_sum`` (the
canonical tree), the optimizer stepped on that. One process with 4 backwards a step, 2 ranks
with 2, and 4 ranks with 1, under DDP and every ZeRO stage, must end 3 AdamW steps with
exactly its parameters. The control: the same layouts without the mode do not.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import shardline as sl
from shardline import config
from shardline.comm import world as world_mod
from shardline.comm.tree import tree_sum
from shardline.errors import InvalidArgumentError
from shardline.examples.train import Config, TinyGPT, corpus
from shardline.parallel.deterministic.microbatch import MicrobatchSums
from tests._ranks import built_once, run_ranks, seeded

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("kernels_restored")]

CFG = Config(d_model=64, num_layers=2, num_heads=4, seq_len=16, batch_size=8)
SIZE = 2  # samples per micro-batch: 4 a step
STEPS = 3


@built_once
def pristine() -> TinyGPT:
    with seeded(0):
        return TinyGPT(CFG)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch, the same on every rank."""
    tokens = corpus(num_chars=20_000)
    gen = torch.Generator().manual_seed(7 + step)
    n = (tokens.numel() - 1) // CFG.seq_len
    idx = torch.randint(0, n, (CFG.batch_size,), generator=gen).tolist()
    rows = torch.stack([tokens[i * CFG.seq_len : (i + 1) * CFG.seq_len + 1] for i in idx])
    return rows[:, :-1], rows[:, 1:]


def train(
    world: int,
    strategy: str,
    deterministic: bool | str,
    backend: str = "native",
    set_to_none: bool = True,
) -> dict[str, torch.Tensor]:
    """``STEPS`` AdamW steps on ``world`` ranks, each backward one micro-batch of ``SIZE``."""

    def body(g: sl.ProcessGroup) -> dict[str, torch.Tensor]:
        plain = copy.deepcopy(pristine())
        opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
        model, opt = sl.distribute(
            plain, opt, strategy=strategy, group=g, deterministic=deterministic
        )
        assert opt is not None
        for step in range(STEPS):
            opt.zero_grad(set_to_none=set_to_none)
            parts = sl.rank_microbatches(batch(step), SIZE, group=g)
            for x, y in parts:
                (model(x, y) / len(parts)).backward()
            opt.step()
        return {k: v.clone() for k, v in model.state_dict().items()}

    states = run_ranks(world, body, backend=backend, timeout=200)
    for other in states[1:]:
        assert differing(other, states[0]) == []
    return states[0]


def reference() -> dict[str, torch.Tensor]:
    """Plain PyTorch: each micro-batch's gradient alone, added in the canonical tree."""
    model = copy.deepcopy(pristine())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    n = CFG.batch_size // SIZE
    for step in range(STEPS):
        x, y = batch(step)
        grads = []
        for k in range(n):
            model.zero_grad(set_to_none=True)
            (model(x[k * SIZE : (k + 1) * SIZE], y[k * SIZE : (k + 1) * SIZE]) / n).backward()
            grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        for name, p in model.named_parameters():  # a tied weight once
            p.grad = tree_sum(torch.stack([g[name] for g in grads]))
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_every_layout_ends_with_the_tree_of_the_micro_batches(strategy: str) -> None:
    want = reference()
    for world in (1, 2, 4):
        got = train(world, strategy, "microbatch")
        assert differing(got, want) == [], f"{strategy} on {world} ranks"
    assert torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_gradients_zeroed_in_place_count_for_no_backward(strategy: str) -> None:
    """``zero_grad(set_to_none=False)`` leaves the strategy's (zeroed) gradient tensors: they
    are no backward's, and the step's sum is written into them, as the strategy's own."""
    want = reference()
    for world in (1, 2):
        got = train(world, strategy, "microbatch", set_to_none=False)
        assert differing(got, want) == [], f"{strategy} on {world} ranks"


def test_over_gloo_too() -> None:
    assert differing(train(4, "zero3", "microbatch", backend="gloo"), reference()) == []


def test_without_it_the_layouts_differ() -> None:
    """The control: one process accumulates its 4 micro-batches in order, ((0+1)+2)+3; two
    ranks (native, rank order) add (0+1) + (2+3)."""
    want = reference()
    one, two = train(1, "ddp", False), train(2, "ddp", False)
    assert differing(one, want), "the test is blind to the order"
    assert differing(one, two)
    assert max((one[k] - want[k]).abs().max().item() for k in want) < 1e-4


class _ConvNet(nn.Module):
    """Layers per-sample mode refuses (a convolution, a batch-wide norm's kin: GroupNorm)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.head = nn.Linear(8 * 16, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.conv(x)))
        return nn.functional.cross_entropy(self.head(h.flatten(1)), y)


def test_any_layers_on_their_own_kernels() -> None:
    with seeded(3):
        base = _ConvNet()
        xs, ys = torch.randn(8, 4, 16), torch.randint(0, 3, (8,))

    def run(world: int) -> dict[str, torch.Tensor]:
        def body(g: sl.ProcessGroup) -> dict[str, torch.Tensor]:
            net = copy.deepcopy(base)
            opt = torch.optim.SGD(net.parameters(), lr=0.5)
            model, opt = sl.distribute(net, opt, group=g, deterministic="microbatch")
            assert opt is not None
            for _ in range(2):
                opt.zero_grad()
                parts = sl.rank_microbatches((xs, ys), 2, group=g)
                for x, y in parts:
                    (model(x, y) / len(parts)).backward()
                opt.step()
            return {k: v.clone() for k, v in model.state_dict().items()}

        return run_ranks(world, body)[0]

    assert differing(run(1), run(2)) == []
    assert differing(run(2), run(4)) == []


def test_rank_microbatches_deals_them_round_the_ranks() -> None:
    xs = torch.arange(12)

    def body(g: sl.ProcessGroup) -> list[list[int]]:
        return [p.tolist() for p in sl.rank_microbatches(xs, 2, group=g)]

    assert run_ranks(2, body) == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [10, 11]]]

    def uneven(g: sl.ProcessGroup) -> None:
        sl.rank_microbatches((xs, xs[:10]), 2, group=g)

    with pytest.raises(AssertionError, match=r"\[12, 10\] samples does not cut"):
        run_ranks(1, uneven)


def test_a_step_after_three_backwards_is_refused() -> None:
    def body(g: sl.ProcessGroup) -> str:
        net = nn.Linear(4, 2)
        before = net.weight.detach().clone()
        opt = torch.optim.SGD(net.parameters(), lr=1.0)
        model, opt = sl.distribute(net, opt, group=g, deterministic="microbatch")
        assert opt is not None
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
        with pytest.raises(InvalidArgumentError, match=r"3 backwards before this step") as e:
            opt.step()
        assert torch.equal(net.weight.detach(), before)  # nothing stepped
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()  # the kept ones dropped: one backward
        opt.step()
        assert not torch.equal(net.weight.detach(), before)
        return str(e.value)

    run_ranks(1, body)


def test_what_the_mode_refuses() -> None:
    def body(g: sl.ProcessGroup) -> None:
        net = nn.Linear(4, 2)
        opt = torch.optim.SGD(net.parameters(), lr=1.0)
        for kwargs, match in (
            ({"strategy": "local_sgd"}, r"covers ddp, fsdp, zero1, zero2, zero3, not 'local_sgd'"),
            ({"compression": "int8"}, r"compression changes what is summed"),
            ({"mesh": sl.DeviceMesh({"dp": 1}, group=g)}, r"without a mesh"),
        ):
            with pytest.raises(InvalidArgumentError, match=match):
                sl.distribute(net, opt, group=g, deterministic="microbatch", **kwargs)
        with pytest.raises(InvalidArgumentError, match=r"give the optimizer too"):
            sl.distribute(net, group=g, deterministic="microbatch")

    run_ranks(1, body)

    def three(g: sl.ProcessGroup) -> None:
        net = nn.Linear(4, 2)
        opt = torch.optim.SGD(net.parameters(), lr=1.0)
        sl.distribute(net, opt, group=g, deterministic="microbatch")

    with pytest.raises(AssertionError, match=r"3 ranks; the ranks' micro-batches.*use 2 or 4"):
        run_ranks(3, three)


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_no_sync_is_refused(strategy: str) -> None:
    """Its backwards would be this rank's alone, and the step's sum silently wrong."""

    def body(g: sl.ProcessGroup) -> None:
        net = nn.Linear(4, 2)
        opt = torch.optim.SGD(net.parameters(), lr=1.0)
        model, _ = sl.distribute(net, opt, strategy=strategy, group=g, deterministic="microbatch")
        with pytest.raises(InvalidArgumentError, match=r"no_sync\(\) would keep a backward's"):
            model.no_sync()

    run_ranks(2, body)


def test_a_pipeline_is_refused() -> None:
    def body(g: sl.ProcessGroup) -> None:
        chain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        with pytest.raises(InvalidArgumentError, match=r"pipeline\(deterministic='microbatch'\)"):
            sl.pipeline(chain, group=g, microbatches=2, deterministic="microbatch")

    run_ranks(2, body)


def test_the_mode_and_the_setting_take_microbatch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert world_mod.deterministic_mode(" MicroBatch ") == "microbatch"
    monkeypatch.setenv("SHARDLINE_DETERMINISTIC", "microbatch")
    assert config.get("SHARDLINE_DETERMINISTIC") == "microbatch"
    assert world_mod.deterministic_mode() == "microbatch"


def test_the_counter_adds_in_the_canonical_tree() -> None:
    """``MicrobatchSums``' counter against ``tree_sum``, for 1 to 9 backwards."""
    torch.manual_seed(0)
    net = nn.Linear(64, 64, bias=False)
    sums = MicrobatchSums(net, torch.optim.SGD(net.parameters(), lr=0.0))
    for n in range(1, 10):
        leaves = torch.randn(n, 64, 64) * torch.logspace(-3, 3, n).view(n, 1, 1)
        for k in range(n):
            sums._push([leaves[k].clone()])
        assert sums.backwards == n
        (got,) = sums._fold()
        assert got is not None and torch.equal(got, tree_sum(leaves)), n
        if n > 3:  # the test can fail: in order, 4 leaves or more add to other bits
            in_order = leaves[0].clone()
            for leaf in leaves[1:]:
                in_order += leaf
            assert not torch.equal(in_order, got), n


def test_a_step_takes_the_kept_backwards_through_the_hooks() -> None:
    torch.manual_seed(0)
    net = nn.Linear(64, 64, bias=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    MicrobatchSums(net, opt)
    leaves = torch.randn(4, 64, 64) * torch.logspace(-3, 3, 4).view(4, 1, 1)
    for k in range(4):
        net(torch.zeros(1, 64))  # a forward keeps the last backward's gradients
        net.weight.grad = leaves[k].clone()
    opt.step()
    assert torch.equal(net.weight.grad, tree_sum(leaves))


def test_two_models_in_one_job() -> None:
    """Each wrapper makes sub-groups of the tree group: one tree group per group, so the
    second wrapper's sub-groups are new ones (a second tree group made the same names, and
    its ranks met the wrong peers)."""

    def body(g: sl.ProcessGroup) -> list[float]:
        out = []
        for _ in range(2):
            net = copy.deepcopy(pristine())
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            model, opt = sl.distribute(
                net, opt, strategy="zero3", group=g, deterministic="microbatch"
            )
            x, y = sl.rank_microbatches(batch(0), 2, group=g)[0]
            out.append(model(x, y).item())
        return out

    losses = run_ranks(4, body, timeout=150)  # (more than 2 ranks: the tree group)
    assert losses[0][0] == losses[0][1]
