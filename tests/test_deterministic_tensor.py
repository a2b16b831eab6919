"""Deterministic mode with tensor parallelism: every tp size, alone or with replicas, trains to
one process's parameters, bit for bit.

The reference is one process training the main job's model on the whole batch, prepared with
``make_deterministic(model, blocks=4)``: the sums tensor parallelism splits (the row layers'
outputs, the column layers' input gradients, the vocabulary's softmax) are cut into 4 blocks
there too. tp = 2 and 4, with DDP or ZeRO replicas, and DDP alone on the same blocks must all
give its bits. Without deterministic mode tensor parallelism does not (checked, so the
comparison can fail).
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardline as sl
from shardline.comm.tree import tree_sum
from shardline.errors import InvalidArgumentError
from shardline.examples.model import TinyGPT, as_sequential, lm_loss
from shardline.parallel.deterministic import blocks_of, make_deterministic
from shardline.parallel.deterministic.split import column_input_grad, row_output
from shardline.parallel.tensor.loss import vocab_parallel_cross_entropy
from tests._ranks import built_once, run_ranks
from tests.test_deterministic import CFG, adam, batches, differing, pristine
from tests.test_deterministic_pipeline import stepped, whole_model

pytestmark = pytest.mark.timeout(180)

BLOCKS = 4


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, replica: int, replicas: int) -> None:
    b = CFG.batch_size // replicas
    for x, y in batches():
        opt.zero_grad(set_to_none=True)
        model(x[replica * b : (replica + 1) * b], y[replica * b : (replica + 1) * b]).backward()
        opt.step()


def trained(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full model's tensors, and on a held-out batch (no grad: evaluation) its loss and
    its last layer norm's output (whole on every tensor-parallel rank)."""
    gpt = next(m for m in model.modules() if isinstance(m, TinyGPT))
    seen: list[torch.Tensor] = []
    hook = gpt.ln.register_forward_hook(lambda _, __, out: seen.append(out))
    x, y = batches()[-1]
    with torch.no_grad():
        held = model(x[:2], y[:2])
    hook.remove()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return {"held-out loss": held, "held-out features": seen[0], **state}


@built_once
def one_process() -> dict[str, torch.Tensor]:
    model = make_deterministic(copy.deepcopy(pristine()), blocks=BLOCKS)
    train(model, adam(model.parameters()), 0, 1)
    return trained(model)


def tensor_parallel(
    dp: int, tp: int, strategy: str | None, deterministic: bool = True
) -> dict[str, torch.Tensor]:
    """``trained`` after training on a dp x tp mesh (every rank's checked equal)."""

    def body(g: sl.ProcessGroup) -> dict[str, torch.Tensor]:
        plain = copy.deepcopy(pristine())
        if deterministic:
            make_deterministic(plain, blocks=BLOCKS)
        axes = {"tp": tp} if strategy is None else {"dp": dp, "tp": tp}
        mesh = sl.DeviceMesh(axes, group=g)
        plan = {"tp": "auto"} if strategy is None else {"dp": strategy, "tp": "auto"}
        model, opt = sl.distribute(
            plain, adam(plain.parameters()), mesh=mesh, strategy=plan,
            deterministic=deterministic,
        )  # fmt: skip
        assert opt is not None
        train(model, opt, mesh.local_rank("dp") if strategy else 0, dp)
        return trained(model)

    states = run_ranks(dp * tp, body, timeout=150)
    for other in states[1:]:  # every rank saves the same full model
        assert differing(other, states[0]) == []
    return states[0]


@pytest.mark.parametrize(
    ("dp", "tp", "strategy"),
    [(1, 2, None), (1, 4, None), (2, 2, "ddp"), (2, 2, "zero3"), (2, 2, "zero1")],
)
def test_every_tensor_parallel_layout_trains_to_one_process_bits(
    dp: int, tp: int, strategy: str | None
) -> None:
    assert differing(tensor_parallel(dp, tp, strategy), one_process()) == []


def pipelined(
    world: int, stages: int, tp: int, schedule: str, microbatches: int, dp: str | None
) -> dict[str, torch.Tensor]:
    """The whole model after a pipeline of ``tp``-way tensor-parallel stages (``dp``: its
    replicas on the rest), by the one process's names."""

    def body(g: sl.ProcessGroup) -> dict[str, torch.Tensor]:
        gpt = make_deterministic(copy.deepcopy(pristine()), blocks=BLOCKS)
        chain = as_sequential(gpt)  # type: ignore[arg-type]
        replicas = world // (stages * tp)
        axes = {"pp": stages, "tp": tp} if dp is None else {"dp": replicas, "pp": stages, "tp": tp}
        mesh = sl.DeviceMesh(axes, group=g)
        plan = {"pp": schedule, "tp": "auto"} | ({} if dp is None else {"dp": dp})
        model, opt = sl.distribute(
            chain, adam(chain.parameters()), mesh=mesh, strategy=plan,
            microbatches=microbatches, loss_fn=gpt.loss_fn, deterministic=True,
            virtual_stages=2 if schedule == "interleaved" else 1,
        )  # fmt: skip
        assert opt is not None
        return stepped(model, opt, mesh.local_rank("dp") if dp is not None else 0, replicas)

    return whole_model(run_ranks(world, body, timeout=150))


@pytest.mark.parametrize(
    ("world", "stages", "tp", "schedule", "microbatches", "dp"),
    [
        (4, 2, 2, "1f1b", 4, None),
        (4, 2, 2, "zero_bubble", 2, None),
        (4, 2, 2, "interleaved", 2, None),
        (8, 2, 2, "1f1b", 2, "zero3"),
    ],
)
def test_pipelines_of_tensor_parallel_stages_train_to_one_process_bits(
    world: int, stages: int, tp: int, schedule: str, microbatches: int, dp: str | None
) -> None:
    ref = {k: v for k, v in one_process().items() if not k.startswith("held-out")}
    assert differing(pipelined(world, stages, tp, schedule, microbatches, dp), ref) == []


def test_data_parallelism_on_the_same_blocks_gives_the_same_bits() -> None:
    def body(g: sl.ProcessGroup) -> dict[str, torch.Tensor]:
        plain = make_deterministic(copy.deepcopy(pristine()), blocks=BLOCKS)
        model, opt = sl.distribute(plain, adam(plain.parameters()), group=g, deterministic=True)
        assert opt is not None
        train(model, opt, g.rank, g.world_size)
        return trained(model)

    assert differing(run_ranks(2, body, timeout=150)[0], one_process()) == []


def test_without_it_tensor_parallelism_differs_in_the_last_bits() -> None:
    """The control: plain tp=2 does not give one process's bits (its sums are split)."""
    ref = one_process()
    got = tensor_parallel(1, 2, None, deterministic=False)
    assert differing(got, ref), "plain tensor parallelism matched bit for bit: the test is blind"
    assert max((got[k] - ref[k]).abs().max().item() for k in ref) < 1e-4


@settings(max_examples=40, deadline=None)
@given(
    blocks_log=st.integers(0, 3),
    t_log=st.integers(0, 3),
    pieces=st.sampled_from([1, 3]),
    rows=st.integers(1, 9),
    seed=st.integers(0, 2**31 - 1),
)
def test_a_ranks_blocks_then_the_ranks_make_the_one_process_sum(
    blocks_log: int, t_log: int, pieces: int, rows: int, seed: int
) -> None:
    """``row_output``/``column_input_grad`` over each rank's slice, then ``tree_sum`` over the
    ranks, equal the one-process result bit for bit."""
    blocks, t = 1 << blocks_log, 1 << min(t_log, blocks_log)
    gen = torch.Generator().manual_seed(seed)
    s = 2 + seed % 5  # features per block
    x = torch.randn(rows, 3, blocks * s, generator=gen)
    w = torch.randn(7, blocks * s, generator=gen)
    cols = blocks * s // t
    parts = [row_output(x[..., r * cols : (r + 1) * cols], w[:, r * cols : (r + 1) * cols],
                        blocks // t) for r in range(t)]  # fmt: skip
    assert torch.equal(tree_sum(torch.stack(parts)), row_output(x, w, blocks))
    assert (row_output(x, w, blocks) - x @ w.T).abs().max() < 1e-4  # the product it cuts

    dy = torch.randn(rows, 3, pieces * blocks * s, generator=gen)
    wc = torch.randn(pieces * blocks * s, 5, generator=gen)
    per, mine = blocks * s, blocks * s // t  # rows of a piece; of it on one rank

    def held(r: int) -> torch.Tensor:
        return torch.cat([torch.arange(q * per + r * mine, q * per + (r + 1) * mine)
                          for q in range(pieces)])  # fmt: skip

    parts = [
        column_input_grad(dy[..., held(r)], wc[held(r)], pieces, blocks // t) for r in range(t)
    ]
    assert torch.equal(tree_sum(torch.stack(parts)), column_input_grad(dy, wc, pieces, blocks))
    assert (column_input_grad(dy, wc, pieces, blocks) - dy @ wc).abs().max() < 1e-4


def test_the_blocked_loss_equals_cross_entropy() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 6, 64, generator=gen, requires_grad=True)
    target = torch.randint(0, 64, (4, 6), generator=gen)
    ours = vocab_parallel_cross_entropy(logits, target, None, blocks=8)
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
    torch.testing.assert_close(ours, ref)
    (g_ours,) = torch.autograd.grad(ours, logits)
    (g_ref,) = torch.autograd.grad(ref, logits)
    torch.testing.assert_close(g_ours, g_ref)


def test_what_it_does_not_cover_is_refused_before_any_work() -> None:
    with pytest.raises(InvalidArgumentError, match="power of two"):
        make_deterministic(copy.deepcopy(pristine()), blocks=3)
    with pytest.raises(InvalidArgumentError, match=r"blocks=64\).*num_heads=4"):
        make_deterministic(copy.deepcopy(pristine()), blocks=64)

    def body(g: sl.ProcessGroup) -> None:
        # A tp size that does not divide the model's blocks.
        model = make_deterministic(copy.deepcopy(pristine()), blocks=1)
        mesh = sl.DeviceMesh({"tp": 2}, group=g)
        with pytest.raises(InvalidArgumentError, match=r"split over 2 ranks, which do not divide"):
            sl.distribute(model, mesh=mesh, strategy={"tp": "auto"}, deterministic=True)
        model = copy.deepcopy(pristine())
        with pytest.raises(InvalidArgumentError, match="sequence_parallel off"):
            sl.distribute(model, mesh=mesh, strategy={"tp": "auto"}, deterministic=True,
                          sequence_parallel=True)  # fmt: skip
        chain = make_deterministic(as_sequential(copy.deepcopy(pristine())), blocks=1)
        staged = sl.DeviceMesh({"pp": 1, "tp": 2}, group=g)
        with pytest.raises(InvalidArgumentError, match=r"the tp size must divide the blocks"):
            sl.distribute(chain, mesh=staged, strategy={"pp": "1f1b", "tp": "auto"},
                          deterministic=True, microbatches=2, loss_fn=lm_loss)  # fmt: skip
        # Not prepared: distribute takes the tp size as its blocks.
        model = copy.deepcopy(pristine())
        sl.distribute(model, mesh=mesh, strategy={"tp": "auto"}, deterministic=True)
        assert blocks_of(model) == 2

    run_ranks(2, body, timeout=60)


def test_layers_prepared_with_other_blocks_as_part_of_another_model_are_named() -> None:
    gpt = make_deterministic(copy.deepcopy(pristine()), blocks=2)
    assert blocks_of(as_sequential(gpt)) == 2  # its chain of the same layers: theirs
    with pytest.raises(InvalidArgumentError, match=r"'block0.qkv' was prepared .* blocks=2"):
        make_deterministic(as_sequential(gpt), blocks=4)
    plain = make_deterministic(copy.deepcopy(pristine()))  # blocks=1: no layer is cut
    with pytest.raises(InvalidArgumentError, match=r"was prepared .* with blocks=1"):
        make_deterministic(as_sequential(plain), blocks=2)


def test_an_explicit_plan_that_splits_otherwise_is_named() -> None:
    def body(g: sl.ProcessGroup) -> None:
        model = make_deterministic(copy.deepcopy(pristine()), blocks=2)
        mesh = sl.DeviceMesh({"tp": 2}, group=g)
        plan = {"blocks.0.mlp.0": "rowwise"}
        with pytest.raises(InvalidArgumentError, match=r"'blocks.0.mlp.0' as a row layer"):
            sl.distribute(model, mesh=mesh, strategy={"tp": plan}, deterministic=True)

    run_ranks(2, body, timeout=60)


def test_the_prepared_model_still_evaluates_as_before() -> None:
    """Outside a training forward the layers run as torch's (and ``blocks`` changes nothing)."""
    model = make_deterministic(copy.deepcopy(pristine()), blocks=BLOCKS)
    x, y = batches()[0]
    with torch.no_grad():
        assert isinstance(model, TinyGPT)
        torch.testing.assert_close(model(x, y), pristine()(x, y))
