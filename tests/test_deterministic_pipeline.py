"""Deterministic mode in pipelines: every schedule, with or without replicas, trains to one
process's parameters, bit for bit.

The reference is one process training the main job's model on the whole batch with
``make_deterministic`` (``tests/test_deterministic.py``'s). The pipelines split the same model
(``as_sequential``: its token embedding is tied to the output head, in the first and the last
stage), so the tied weight's uses cross ranks too. Without deterministic mode the same
pipelines differ in the last bits (checked, so the comparison can fail).
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import shardline as sl
from shardline.comm.tree import tree_sum
from shardline.errors import InvalidArgumentError, ShardlineError
from shardline.examples.model import as_sequential, lm_loss
from shardline.parallel.deterministic import make_deterministic
from shardline.parallel.pipeline.deterministic import MicroTree
from tests._ranks import run_ranks, seeded
from tests.test_deterministic import (
    CFG,
    STEPS,
    adam,
    batches,
    differing,
    one_process,
    pristine,
)

pytestmark = pytest.mark.timeout(180)

# The pipeline's names for the whole model's tensors (the head's weight is the embedding's).
_RENAMED = {"embed.tok.weight": "tok.weight", "embed.pos.weight": "pos.weight",
            "head.ln.weight": "ln.weight", "head.ln.bias": "ln.bias",
            "head.head.weight": "head.weight"}  # fmt: skip


def _as_one_process(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in state.items():
        ours = _RENAMED.get(name, name)
        if name.startswith("block"):
            i, rest = name.removeprefix("block").split(".", 1)
            ours = f"blocks.{i}.{rest}"
        out[ours] = value
    return out


def pipelined(
    world: int, schedule: str, microbatches: int, stages: int, dp: str | None,
    deterministic: bool = True,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """The whole model after ``STEPS`` steps of a pipeline (``stages``), replicas on the rest."""

    def body(g: sl.ProcessGroup) -> dict[str, torch.Tensor]:
        seq = as_sequential(copy.deepcopy(pristine()))
        replicas = world // stages
        virtual = 2 if schedule == "interleaved" else 1
        if dp is None:
            if deterministic:
                make_deterministic(seq)
            model = sl.pipeline(seq, g, schedule=schedule, microbatches=microbatches,
                                loss_fn=lm_loss, virtual_stages=virtual)  # fmt: skip
            opt = adam(model.parameters())
        else:
            mesh = sl.DeviceMesh({"dp": replicas, "pp": stages}, group=g)
            model, maybe = sl.distribute(
                seq, adam(seq.parameters()), mesh=mesh, strategy={"dp": dp, "pp": schedule},
                microbatches=microbatches, loss_fn=lm_loss, virtual_stages=virtual,
                deterministic=deterministic,
            )  # fmt: skip
            assert maybe is not None
            opt = maybe
        return stepped(model, opt, g.rank // stages, replicas)  # the mesh is row-major

    return whole_model(run_ranks(world, body, timeout=150))


def stepped(
    model: nn.Module, opt: torch.optim.Optimizer, replica: int, replicas: int
) -> dict[str, torch.Tensor]:
    """``STEPS`` pipeline steps on replica ``replica``'s part of each batch; the whole model."""
    b = CFG.batch_size // replicas
    for x, y in batches():
        opt.zero_grad(set_to_none=True)
        model.step(x[replica * b : (replica + 1) * b], target=y[replica * b : (replica + 1) * b])  # type: ignore[operator]
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def whole_model(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The ranks' ``stepped`` models, checked equal, by the one process's names."""
    for other in states[1:]:  # state_dict() gives every rank the whole model
        assert differing(other, states[0]) == []
    return _as_one_process(states[0])


@pytest.mark.parametrize(
    ("world", "schedule", "microbatches", "stages", "dp"),
    [
        (2, "1f1b", 4, 2, None),
        (2, "gpipe", 4, 2, None),
        (2, "zero_bubble", 4, 2, None),
        (2, "interleaved", 2, 2, None),  # 4 stages on 2 ranks: the tied copies on one rank each
        (4, "1f1b", 4, 4, None),
        (4, "zero_bubble", 4, 4, None),
        (4, "zero_bubble_h2", 8, 4, None),
        (4, "1f1b", 2, 2, "ddp"),
        (4, "interleaved", 2, 2, "zero3"),  # 2 chunks per rank, wrapped together
        (4, "zero_bubble", 2, 2, "zero3"),
        (4, "gpipe", 2, 2, "zero1"),
    ],
)
def test_every_schedule_trains_to_one_process_bits(
    world: int, schedule: str, microbatches: int, stages: int, dp: str | None
) -> None:
    got = pipelined(world, schedule, microbatches, stages, dp)
    assert differing(got, one_process()) == []


def test_without_it_the_pipeline_differs_in_the_last_bits() -> None:
    """The control: the same 4-micro-batch pipeline, plain, does not match one process."""
    ref = one_process()
    got = pipelined(2, "1f1b", 4, 2, None, deterministic=False)
    assert differing(got, ref), "a plain pipeline matched one process bit for bit: blind test"
    assert max((got[k] - ref[k]).abs().max().item() for k in ref) < 1e-4


@settings(max_examples=40, deadline=None)
@given(k=st.integers(0, 4), order_seed=st.integers(0, 2**31 - 1))
def test_micro_batches_add_in_the_canonical_tree_in_any_order(k: int, order_seed: int) -> None:
    """``MicroTree`` gives ``tree_sum`` over the micro-batches whatever order they come in."""
    m = (1 << k) + (order_seed % 3 if k > 1 else 0)  # powers of two and a few others
    gen = torch.Generator().manual_seed(order_seed)
    grads = torch.randn(m, 33, generator=gen, dtype=torch.float64)
    grads *= torch.exp2(torch.randint(-20, 20, (m, 33), generator=gen).double())
    tree = MicroTree()
    for i in torch.randperm(m, generator=gen).tolist():
        tree.add(i, grads[i].clone())
    assert torch.equal(tree.total(), tree_sum(grads))


def test_what_it_does_not_cover_in_a_pipeline_is_refused() -> None:
    seq = make_deterministic(as_sequential(copy.deepcopy(pristine())))

    def body(g: sl.ProcessGroup) -> list[str]:
        errors = []
        for kwargs in ({"microbatches": 3}, {"microbatches": 2, "recompute": True}):
            with pytest.raises(InvalidArgumentError) as info:
                sl.pipeline(copy.deepcopy(seq), g, loss_fn=lm_loss, **kwargs)  # type: ignore[arg-type]
            errors.append(str(info.value))
        mesh = sl.DeviceMesh({"pp": 1, "tp": 2}, group=g)
        with pytest.raises(InvalidArgumentError) as info:
            sl.distribute(copy.deepcopy(pristine()), mesh=mesh,
                          strategy={"pp": "1f1b", "tp": "auto"}, deterministic=True)  # fmt: skip
        errors.append(str(info.value))
        return errors

    errors = run_ranks(2, body)[0]
    assert "power-of-two number of micro-batches (got 3)" in errors[0]
    assert "with recompute is not supported" in errors[1]
    assert "with TinyGPT split by tracing is not supported" in errors[2]


class _EveryOther(nn.Module):
    """A linear layer that only every other forward uses (a model whose use varies)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(CFG.d_model, CFG.d_model)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x) if self.calls % 2 else x


def test_a_parameter_some_micro_batches_skip_is_named() -> None:
    def body(g: sl.ProcessGroup) -> str:
        seq = as_sequential(copy.deepcopy(pristine()))
        chain = nn.Sequential(*seq[:-1], _EveryOther(), seq[-1])
        model = sl.pipeline(make_deterministic(chain), g, microbatches=4, loss_fn=lm_loss)
        x, y = batches()[0]
        with pytest.raises(ShardlineError) as info:
            model.step(x, target=y)
        return str(info.value)

    errors = run_ranks(2, body, timeout=60)
    assert f"shape [{CFG.d_model}, {CFG.d_model}] got gradients from 2 of the step's 4" in errors[1]
    assert "pipeline stage(s) [1] on rank 1 failed" in errors[0]  # at once, with the reason


class _Embeds(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Embedding(64, 16), nn.Embedding(64, 16)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.a(idx) * 2 + self.b(idx.flip(-1))  # backward reaches b first


class _Heads(nn.Module):
    def __init__(self, tied: _Embeds) -> None:
        super().__init__()
        self.a = nn.Linear(16, 64, bias=False)
        self.b = nn.Linear(16, 64, bias=False)
        self.a.weight, self.b.weight = tied.a.weight, tied.b.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(x) + self.a(torch.tanh(x))


def _two_tied() -> nn.Sequential:
    with seeded(0):
        embeds = _Embeds()
        return make_deterministic(
            nn.Sequential(embeds, nn.Linear(16, 16), nn.LayerNorm(16), _Heads(embeds))
        )


def test_two_weights_tied_across_the_same_stages_train_to_one_process_bits() -> None:
    """Both weights' uses travel between the same two ranks in the same micro-batches."""
    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 64, (8, 9), generator=gen) for _ in range(STEPS)]
    one = _two_tied()
    opt = adam(one.parameters())
    for d in data:
        opt.zero_grad(set_to_none=True)
        lm_loss(one(d[:, :-1]), d[:, 1:]).backward()
        opt.step()

    def body(g: sl.ProcessGroup) -> dict[str, torch.Tensor]:
        model = sl.pipeline(_two_tied(), g, microbatches=4, loss_fn=lm_loss, split=["2"])
        opt = adam(model.parameters())
        for d in data:
            opt.zero_grad(set_to_none=True)
            model.step(d[:, :-1], target=d[:, 1:])
            opt.step()
        return {k: v.clone() for k, v in model.state_dict().items()}

    assert differing(run_ranks(2, body)[0], one.state_dict()) == []
