"""Deterministic mode: one process, DDP and ZeRO-1/2/3 train to the same parameters, bit for bit.

The reference is one process training the main job's model on the whole batch with
``make_deterministic``; every layout must match it exactly after several AdamW steps. The same
layouts without deterministic mode do not (checked, so the comparison can fail).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import shardline as sl
from shardline.comm.tree import tree_group, tree_sum
from shardline.errors import InvalidArgumentError
from shardline.examples.train import Config, TinyGPT, corpus
from shardline.parallel.deterministic import is_deterministic, kernels, make_deterministic
from tests._ranks import built_once, run_ranks, seeded

pytestmark = pytest.mark.timeout(180)

CFG = Config(d_model=64, num_layers=2, num_heads=4, seq_len=16, batch_size=8)
STEPS = 3


@built_once
def pristine() -> TinyGPT:
    with seeded(0):
        return TinyGPT(CFG)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``STEPS`` global batches of ``CFG.batch_size`` windows of the built-in corpus."""
    tokens = corpus(num_chars=20_000)
    n = (tokens.numel() - 1) // CFG.seq_len
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        idx = torch.randint(0, n, (CFG.batch_size,), generator=gen).tolist()
        rows = torch.stack([tokens[i * CFG.seq_len : (i + 1) * CFG.seq_len + 1] for i in idx])
        out.append((rows[:, :-1], rows[:, 1:]))
    return out


def train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int) -> None:
    b = CFG.batch_size // world
    for x, y in batches():
        opt.zero_grad(set_to_none=True)
        model(x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]).backward()
        opt.step()


def adam(params: object) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, foreach=False)  # type: ignore[arg-type]


@built_once
def one_process() -> dict[str, torch.Tensor]:
    model = make_deterministic(copy.deepcopy(pristine()))
    train(model, adam(model.parameters()), 0, 1)
    return {k: v.clone() for k, v in model.state_dict().items()}


def train_bf16(model: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int) -> None:
    """``train`` under CPU autocast: the products in bf16 (autocast is per thread)."""
    with torch.autocast("cpu", torch.bfloat16):
        train(model, opt, rank, world)


def layout(
    strategy: str,
    world: int,
    deterministic: bool,
    trainer: Callable[..., None] = train,
    **options: object,
) -> dict[str, torch.Tensor]:
    def body(g: sl.ProcessGroup) -> dict[str, torch.Tensor]:
        plain = copy.deepcopy(pristine())
        model, opt = sl.distribute(
            plain, adam(plain.parameters()), strategy=strategy, group=g,
            deterministic=deterministic, **options,
        )  # fmt: skip
        assert opt is not None
        trainer(model, opt, g.rank, world)
        return {k: v.clone() for k, v in model.state_dict().items()}

    states = run_ranks(world, body, timeout=150)
    for other in states[1:]:  # every rank holds the same full model
        assert all(torch.equal(other[k], states[0][k]) for k in states[0])
    return states[0]


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_every_layout_trains_to_one_process_bits(strategy: str, world: int) -> None:
    ref = one_process()
    assert differing(layout(strategy, world, deterministic=True), ref) == []


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_under_autocast_every_layout_trains_to_one_process_bits(strategy: str) -> None:
    """bf16 autocast: each sample's products in bf16, widened to float32 before any sum."""
    model = make_deterministic(copy.deepcopy(pristine()))
    train_bf16(model, adam(model.parameters()), 0, 1)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    assert all(v.dtype == torch.float32 for v in ref.values())
    fp32 = one_process()  # autocast was in effect: far more than float32 rounding apart
    assert max((ref[k] - fp32[k]).abs().max().item() for k in ref) > 1e-4
    for world in (2, 4):
        assert differing(layout(strategy, world, True, trainer=train_bf16), ref) == []


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_bf16_parameters_reduced_in_float32_train_to_one_process_bits(strategy: str) -> None:
    """``MixedPrecision(bf16, reduce_dtype=float32)``: each rank's float32 sum is reduced,
    not its rounding to bf16, as one process rounds only its whole sum."""
    mp = sl.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ref = layout(strategy, 1, True, mixed_precision=mp)
    fp32 = one_process()  # bf16 was in effect: far more than float32 rounding apart
    assert max((ref[k] - fp32[k]).abs().max().item() for k in ref) > 1e-4
    for world in (2, 4):
        assert differing(layout(strategy, world, True, mixed_precision=mp), ref) == []


def test_a_cublas_workspace_set_otherwise_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU deterministic mode needs cuBLASLt without a workspace (no split-K sums)."""
    for name in kernels.CUBLAS_ENV:  # recorded, so that the test leaves them as they were
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    kernels.cublas_env()
    assert all(os.environ[k] == v for k, v in kernels.CUBLAS_ENV.items())
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "1024")
    with pytest.raises(InvalidArgumentError, match=r"CUBLASLT_WORKSPACE_SIZE=0.*'1024'"):
        kernels.cublas_env()


def test_without_it_the_layouts_differ_in_the_last_bits() -> None:
    """The control: the same comparison fails for plain DDP (sums in other orders)."""
    ref = one_process()
    got = layout("ddp", 2, deterministic=False)
    assert differing(got, ref), "plain DDP matched one process bit for bit: the test is blind"
    # ... while staying within rounding of it.
    assert max((got[k] - ref[k]).abs().max().item() for k in ref) < 1e-4


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(0, 4),
    world=st.integers(1, 7),
    width=st.integers(1, 9),
    seed=st.integers(0, 2**31 - 1),
)
def test_blocks_of_a_power_of_two_are_subtrees(k: int, world: int, width: int, seed: int) -> None:
    """Summing each rank's block, then the blocks, is the tree over all rows, bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    b = 1 << k
    rows = torch.randn(b * world, width, generator=gen) * torch.exp2(
        torch.randint(-20, 20, (b * world, width), generator=gen).float()
    )
    blocks = torch.stack([tree_sum(rows[r * b : (r + 1) * b]) for r in range(world)])
    assert torch.equal(tree_sum(blocks), tree_sum(rows))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_tree_groups_sums_are_the_tree_over_ranks(world: int) -> None:
    n = 37  # not a multiple of the world size: the parts are padded
    gen = torch.Generator().manual_seed(3)
    inputs = [torch.randn(world * n, generator=gen) * 1e3**r for r in range(world)]
    want = tree_sum(torch.stack(inputs))

    def body(g: sl.ProcessGroup) -> tuple[torch.Tensor, ...]:
        tg = tree_group(g)
        summed = inputs[g.rank].clone()
        tg.all_reduce(summed, "sum")
        avg = inputs[g.rank].clone()
        work = tg.all_reduce(avg, "avg", async_op=True)
        assert work is not None
        work.wait()
        part = torch.empty(n)
        tg.reduce_scatter(part, inputs[g.rank].clone(), "sum")
        rooted = inputs[g.rank].clone()
        tg.reduce(rooted, dst=world - 1, op="sum")
        biggest = inputs[g.rank][:5].clone()
        tg.all_reduce(biggest, "max")  # not a sum: the group's own
        return summed, avg, part, rooted, biggest

    for r, (summed, avg, part, rooted, biggest) in enumerate(run_ranks(world, body)):
        assert torch.equal(summed, want)
        assert torch.equal(avg, want / world)
        assert torch.equal(part, want[r * n : (r + 1) * n])
        if r == world - 1:
            assert torch.equal(rooted, want)
        assert torch.equal(biggest, torch.stack(inputs)[:, :5].max(0).values)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_a_group_of_two_ranks_or_one_is_its_own_tree_group(world: int) -> None:
    # Two ranks' sum is one addition whatever the algorithm; more ranks get one tree group
    # per group (a second would name its sub-groups as the first's), which is its own.
    def body(g: sl.ProcessGroup) -> tuple[bool, bool, bool]:
        tg = tree_group(g)
        return tg is g, tree_group(g) is tg, tree_group(tg) is tg

    want = (world <= 2, True, True)
    assert run_ranks(world, body) == [want] * world


def test_a_batch_that_is_not_a_power_of_two_of_units_is_refused() -> None:
    model = make_deterministic(copy.deepcopy(pristine()))
    x, y = batches()[0]
    with pytest.raises(InvalidArgumentError, match="power-of-two number of units"):
        model(x[:6], y[:6])


def test_a_layer_it_cannot_split_by_sample_is_named() -> None:
    with seeded(0):
        model = nn.Sequential(nn.Linear(4, 4), nn.Conv1d(4, 4, 1))
    with pytest.raises(InvalidArgumentError, match=r"Conv1d '1' holds trainable parameters"):
        make_deterministic(model)


def test_a_gradient_summed_over_the_batch_by_autograd_is_refused() -> None:
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pos = nn.Embedding(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x + self.pos(torch.arange(x.shape[1]))).sum()  # broadcast over samples

    model = make_deterministic(Shared())
    with pytest.raises(InvalidArgumentError, match=r"nn.Embedding 'pos' .* one row per sample"):
        model(torch.randn(2, 8, 4))


def test_what_it_does_not_cover_is_refused_before_any_work() -> None:
    model = copy.deepcopy(pristine())
    with pytest.raises(InvalidArgumentError, match="covers ddp, fsdp, zero1, zero2, zero3"):
        sl.distribute(model, strategy="local_sgd", deterministic=True)
    with pytest.raises(InvalidArgumentError, match="compression"):
        sl.distribute(model, strategy="ddp", deterministic=True, compression="int8")


def test_a_copy_of_a_prepared_model_is_prepared_and_its_own() -> None:
    model = make_deterministic(copy.deepcopy(pristine()))
    twin = copy.deepcopy(model)
    x, y = batches()[0]
    twin(x, y).backward()
    assert all(p.grad is None for p in model.parameters())  # the copy ran itself
    model(x, y).backward()
    pairs = zip(model.parameters(), twin.parameters(), strict=True)
    assert all(torch.equal(a.grad, b.grad) for a, b in pairs)
    with pytest.raises(InvalidArgumentError, match="prepared with unit=1, not 2"):
        make_deterministic(model, unit=2)


def test_a_shared_weight_whose_uses_backward_does_not_all_reach_is_refused() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(8, 4)
            self.out = nn.Linear(4, 8, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            h = self.emb(idx)
            self.out(h)  # a use whose output the loss ignores
            return h.sum()

    model = make_deterministic(Tied())
    with pytest.raises(InvalidArgumentError, match="reached only some uses of 1 parameter"):
        model(torch.randint(0, 8, (2, 3))).backward()


def test_shutting_a_tree_group_down_leaves_its_group_working() -> None:
    def body(g: sl.ProcessGroup) -> float:
        tree_group(g).shutdown()
        t = torch.ones(3)
        g.all_reduce(t)
        return float(t[0])

    assert run_ranks(3, body) == [3.0, 3.0, 3.0]


def test_the_setting_makes_it_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDLINE_DETERMINISTIC", "1")

    def body(g: sl.ProcessGroup) -> tuple[bool, bool]:
        on, _ = sl.distribute(copy.deepcopy(pristine()), strategy="ddp", group=g)
        off, _ = sl.distribute(
            copy.deepcopy(pristine()), strategy="ddp", group=g, deterministic=False
        )
        return is_deterministic(on.module), is_deterministic(off.module)

    assert run_ranks(2, body) == [(True, False), (True, False)]


def _by_definition(rows: list[torch.Tensor]) -> torch.Tensor:
    """The canonical tree, node by node: left the largest power of two below n, then the rest."""
    if len(rows) == 1:
        return rows[0]
    left = 1 << ((len(rows) - 1).bit_length() - 1)
    return _by_definition(rows[:left]) + _by_definition(rows[left:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 12, 16])
def test_tree_sum_adds_in_the_canonical_tree(dtype: torch.dtype, n: int) -> None:
    """Both paths (the engine's kernel for CPU float32, torch ops for the rest) against the
    definition, on values whose sum depends on the order of the additions."""
    gen = torch.Generator().manual_seed(n)
    rows = torch.randn(n, 300, generator=gen, dtype=torch.float64)
    rows *= torch.exp2(torch.randint(-12, 12, (n, 300), generator=gen).double())
    rows = rows.to(dtype)
    assert torch.equal(tree_sum(rows), _by_definition(list(rows)))
    # Over another dim: for every index of the others, the tree over that dim's rows.
    both = torch.stack([rows, rows.flip(0)])
    summed = tree_sum(both, dim=1)
    assert torch.equal(summed[0], _by_definition(list(rows)))
    assert torch.equal(summed[1], _by_definition(list(rows.flip(0))))


_MKL_CHILD = """
import os, sys, torch
from shardline.errors import InvalidArgumentError
from shardline.parallel.deterministic import kernels, make_deterministic
if sys.argv[1] == "late":
    torch.mm(torch.randn(8, 8), torch.randn(8, 8))  # MKL runs, in its default mode
try:
    make_deterministic(torch.nn.Linear(8, 8))
except InvalidArgumentError as exc:
    print("refused:", exc)
else:
    get, _ = kernels._mkl_cbwr()
    print("strict:", bool(get(-1) & 0x10000), os.environ["MKL_CBWR"])
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("when", ["first", "late", "user-mode"])
def test_mkl_strict_mode_is_set_before_mkl_runs_and_refused_after(when: str) -> None:
    """On CPU, MKL's strict reproducible mode: set before its first product, else named; a
    mode of the user's that is not reproducible is named, not overridden."""
    if kernels._mkl_cbwr() is None:
        pytest.skip("this torch has no MKL (another BLAS): nothing to set")
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}  # MKL's default mode
    if when == "user-mode":
        env["MKL_CBWR"] = "AVX2"
    done = subprocess.run(
        [sys.executable, "-c", _MKL_CHILD, when], env=env, capture_output=True, text=True,
        timeout=120, check=True,
    )  # fmt: skip
    if when == "first":
        assert done.stdout.strip() == "strict: True AUTO,STRICT", done.stdout + done.stderr
    elif when == "late":
        assert "refused:" in done.stdout and "MKL_CBWR=AUTO,STRICT" in done.stdout, done.stdout
    else:
        assert "refused:" in done.stdout and "MKL_CBWR is 'AVX2'" in done.stdout, done.stdout


def test_blocks_narrower_than_the_cpu_kernels_allow_are_refused() -> None:
    """A split sum cut into blocks under ``MIN_BLOCK`` features is refused, naming the layer."""
    narrow = TinyGPT(Config(d_model=32, num_layers=1, num_heads=4, seq_len=16, batch_size=8))
    with pytest.raises(InvalidArgumentError, match=r"'blocks.0.qkv' would be cut into blocks of 8"):
        make_deterministic(narrow, blocks=4)
    make_deterministic(narrow, blocks=2)  # 96 / (3 x 2) = 16 features a block: allowed
