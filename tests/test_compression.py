"""Gradient compressors against dense reductions: error bounds, the error-feedback invariant,
PowerSGD at full rank, DDP against ZeRO, checkpoints, and the bytes they save.

Ranks run as threads (``run_ranks``); every reference is computed here with plain torch.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import shardline as sl
from shardline import _native, checkpoint
from shardline.comm import ProcessGroup
from shardline.compression import FP8, Cast, Compressor, Entry, Int8, OneBit, PowerSGD, TopK
from shardline.compression.quantize import Quantizer
from shardline.errors import InvalidArgumentError
from tests._ranks import run_ranks

pytestmark = pytest.mark.usefixtures("native")

_INIT = threading.Lock()


def _grad(step: int, rank: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * step + rank)
    # A persistent direction plus noise: what compression must not lose over time.
    base = torch.linspace(-1.0, 1.0, numel) * 0.3
    return base + torch.randn(numel, generator=g)


# -- codecs --------------------------------------------------------------------------------------


def test_int8_rounds_each_value_within_half_a_step_of_its_block() -> None:
    x = torch.randn(3000) * torch.logspace(-3, 2, 3000)
    c = Int8(block=256)
    y = c.roundtrip(x)
    for b in range(0, 3000, 256):
        block = x[b : b + 256]
        step = block.abs().max() / 127
        assert (y[b : b + 256] - block).abs().max() <= step / 2 * (1 + 1e-5)
    assert c.encode(torch.zeros(2, 512)).shape == (2, 512 + 2 * 4)  # a byte each, a scale per block


def test_fp8_keeps_a_relative_error_of_one_sixteenth() -> None:
    x = torch.randn(4096)
    y = FP8(block=128).roundtrip(x)
    for b in range(0, 4096, 128):
        block, out = x[b : b + 128], y[b : b + 128]
        scale = block.abs().max() / 448
        bound = block.abs() / 16 + scale * 2.0**-10  # 3 mantissa bits; subnormals below 2^-6
        assert bool(((out - block).abs() <= bound * (1 + 1e-5)).all())


def test_onebit_keeps_signs_and_each_blocks_mean_magnitude() -> None:
    x = torch.randn(2048)
    y = OneBit(block=512).roundtrip(x)
    assert bool((torch.sign(y) == torch.where(x >= 0, 1.0, -1.0)).all())
    for b in range(0, 2048, 512):
        assert y[b : b + 512].abs().mean() == pytest.approx(float(x[b : b + 512].abs().mean()))
    assert (x - y).norm() < x.norm()  # a contraction: error feedback converges


def test_onebit_native_codec_writes_the_torch_codecs_bytes() -> None:
    """The Rust codec (CPU) and the torch ops (any device) agree, so ranks can mix them."""
    c, torch_path = OneBit(block=64), Quantizer
    x = torch.randn(3, 64 * 40)
    length, signs = x.shape[1], x.shape[1] // 8
    native, ref = c.encode(x), torch_path.encode(c, x)
    assert torch.equal(native[:, :signs], ref[:, :signs])
    scales = native[:, signs:].contiguous().view(torch.float32)
    torch.testing.assert_close(scales, ref[:, signs:].contiguous().view(torch.float32))
    torch.testing.assert_close(c.decode(native, length), torch_path.decode(c, native, length))
    torch.testing.assert_close(
        c.decode_sum(native, length), torch_path.decode(c, native, length).sum(0)
    )
    residual = x.clone()
    assert torch.equal(c.encode_feedback(residual), native)
    torch.testing.assert_close(residual, x - torch_path.decode(c, native, length))
    with pytest.raises(InvalidArgumentError, match="share memory"):
        _native.onebit_decode(native, native, length, 64, False)
    # Chunks of a ragged buffer, padded without a copy, with and without a residual, against
    # the torch codec on rows padded by hand.
    flat, res = torch.randn(1000), torch.randn(1000)
    for residual in (res, None):
        mine = None if residual is None else residual.clone()
        got = c.encode_chunks(flat, mine, 3, 334, 384)
        rows = torch.zeros(3, 384)
        values = flat if residual is None else flat + residual
        for r in range(3):
            part = values[r * 334 : (r + 1) * 334]
            rows[r, : part.numel()] = part
        want = torch_path.encode(c, rows)
        assert torch.equal(got[:, :48], want[:, :48])  # signs
        torch.testing.assert_close(
            got[:, 48:].contiguous().view(torch.float32),
            want[:, 48:].contiguous().view(torch.float32),
        )
        if mine is not None:
            dropped = rows - torch_path.decode(c, want, 384)
            torch.testing.assert_close(
                mine, torch.cat([dropped[r, : min(334, 1000 - r * 334)] for r in range(3)])
            )


def test_bad_arguments_are_refused_with_the_reason() -> None:
    with pytest.raises(InvalidArgumentError, match="ratio"):
        TopK(ratio=0.0)
    with pytest.raises(InvalidArgumentError, match="rank"):
        PowerSGD(rank=0)
    with pytest.raises(InvalidArgumentError, match="multiple of 8"):
        Int8(block=100)
    with pytest.raises(InvalidArgumentError, match="unknown compression 'zip'"):
        sl.compression.resolve("zip")
    with pytest.raises(InvalidArgumentError, match=r"float16 or torch\.bfloat16"):
        Cast(torch.float32)


# -- the reduction, rank by rank -----------------------------------------------------------------

LAYOUT = (Entry("w", 0, (17, 59)),)  # 1003 values: ragged for 3 ranks and for every block
NUMEL = 1003


def _run_steps(
    make: Callable[[], Compressor], n: int, steps: int, sharded: bool
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each rank: (sum of updates it applied, what it holds back, the true sum), over ``steps``."""

    def body(g: ProcessGroup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = make()
        numel = NUMEL if not sharded else -(-NUMEL // n) * n
        applied = torch.zeros(numel if not sharded else numel // n)
        true = torch.zeros(numel)
        for step in range(steps):
            flat = torch.zeros(numel)
            flat[:NUMEL] = _grad(step, g.rank, NUMEL) / n
            for r in range(n):
                true[:NUMEL] += _grad(step, r, NUMEL) / n
            out = torch.empty(numel // n) if sharded else None
            c.reduce(g, flat, key="b", layout=LAYOUT, out=out)()
            applied += out if out is not None else flat
            c.advance()
        return applied, c.held("b", numel), true

    return run_ranks(n, body)


COMPRESSORS: dict[str, Callable[[], Compressor]] = {
    "int8": lambda: Int8(block=64, warmup_steps=0),
    "fp8": lambda: FP8(block=64, warmup_steps=0),
    "onebit": lambda: OneBit(block=64, warmup_steps=0),
    "topk": lambda: TopK(0.05, warmup_steps=0),
    "powersgd": lambda: PowerSGD(2, warmup_steps=0),
    "bf16-ef": lambda: Cast(torch.bfloat16, error_feedback=True),
}


@pytest.mark.parametrize("sharded", [False, True], ids=["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_error_feedback_sums_to_the_true_gradients(name: str, sharded: bool) -> None:
    """Updates applied + what every rank holds back == the sum of the true averaged gradients."""
    n, steps = 3, 100
    results = _run_steps(COMPRESSORS[name], n, steps, sharded)
    true = results[0][2]
    held = sum(r[1] for r in results)
    assert isinstance(held, torch.Tensor)
    if sharded:
        applied = torch.cat([r[0] for r in results])
    else:
        applied = results[0][0]
        for r in results[1:]:  # replicas stay identical
            torch.testing.assert_close(r[0], applied, rtol=0, atol=0)
    torch.testing.assert_close(applied + held, true, rtol=1e-4, atol=1e-3)
    # and what is held back stays bounded: far below what 100 steps of gradients add up to
    assert held.norm() < 0.25 * true.norm()


@pytest.mark.parametrize("name", ["onebit", "topk"])
def test_without_error_feedback_the_lost_part_accumulates(name: str) -> None:
    def make(ef: bool) -> Callable[[], Compressor]:
        if name == "onebit":
            return lambda: OneBit(block=64, warmup_steps=0, error_feedback=ef)
        return lambda: TopK(0.05, warmup_steps=0, error_feedback=ef)

    gaps = []
    for ef in (True, False):
        results = _run_steps(make(ef), 2, 60, sharded=False)
        gaps.append(float((results[0][0] - results[0][2]).norm()))
    assert gaps[0] * 3 < gaps[1], gaps


def test_powersgd_at_full_rank_equals_the_dense_all_reduce() -> None:
    layout = (Entry("a", 0, (8, 5)), Entry("b", 40, (5, 8)), Entry("bias", 80, (7,)))
    numel = 87

    def body(g: ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
        c = PowerSGD(rank=8, min_compression_rate=0.0, warmup_steps=0)
        outs, dense = [], []
        for step in range(3):
            flat = _grad(step, g.rank, numel)
            ref = flat.clone()
            g.all_reduce(ref)
            c.reduce(g, flat, key=0, layout=layout)()
            outs.append(flat)
            dense.append(ref)
            c.advance()
        return torch.stack(outs), torch.stack(dense)

    for got, want in run_ranks(2, body):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_warmup_steps_are_the_dense_reduction_exactly() -> None:
    def body(g: ProcessGroup) -> list[bool]:
        c = OneBit(warmup_steps=2)
        same = []
        for step in range(3):
            flat = _grad(step, g.rank, NUMEL)
            ref = flat.clone()
            g.all_reduce(ref)
            c.reduce(g, flat, key=0, layout=LAYOUT)()
            same.append(torch.equal(flat, ref))
            c.advance()
        return same

    assert run_ranks(2, body) == [[True, True, False]] * 2


def test_a_changed_world_size_resets_the_state_and_warms_up_again() -> None:
    c = Int8(warmup_steps=1)
    c._world, c.steps = 4, 50  # as if it had run on 4 ranks
    c.prepare("b", LAYOUT, NUMEL, torch.device("cpu"))

    def body(g: ProcessGroup) -> None:
        if g.rank == 0:
            flat = _grad(0, 0, NUMEL)
            c.reduce(g, flat, key="b", layout=LAYOUT)()  # on 1 rank now

    run_ranks(1, body)
    assert c.steps == 0 and c.state_tensors().keys() == {"steps"}


# -- in the strategies ---------------------------------------------------------------------------

IN, HIDDEN, OUT = 16, 32, 8


def mlp() -> nn.Module:
    with _INIT:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


TEACHER = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(5)) / IN**0.5


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(16, IN, generator=g)
    return x, torch.tanh(x @ TEACHER)


def train(
    g: ProcessGroup, strategy: str, compression: object, steps: int, model: nn.Module | None = None
) -> tuple[nn.Module, torch.optim.Optimizer, list[float]]:
    model = model if model is not None else mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    options = {"compression": compression}
    if strategy != "ddp":
        options["unit_mb"] = 0
    wrapped, _ = sl.distribute(model, opt, strategy=strategy, group=g, **options)
    losses = []
    for step in range(steps):
        x, y = batch(step, g.rank)
        opt.zero_grad()
        loss = nn.functional.mse_loss(wrapped(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return wrapped, opt, losses


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_zero_with_powersgd_matches_ddp_with_powersgd(stage: str) -> None:
    def body(g: ProcessGroup) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        ddp, _, _ = train(g, "ddp", PowerSGD(rank=2, warmup_steps=1, min_compression_rate=1), 6)
        zero, _, _ = train(g, stage, PowerSGD(rank=2, warmup_steps=1, min_compression_rate=1), 6)
        return full_params(ddp), full_params(zero)

    for ddp, zero in run_ranks(2, body):
        for k in ddp:
            torch.testing.assert_close(zero[k], ddp[k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.parametrize("name", ["int8", "fp8", "onebit", "topk", "powersgd", "bf16"])
@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_each_compressor_trains_to_about_the_uncompressed_loss(name: str, strategy: str) -> None:
    steps = 60

    def body(g: ProcessGroup) -> tuple[float, float, float]:
        _, _, dense = train(g, strategy, None, steps)
        comp = sl.compression.resolve(name)
        assert comp is not None
        if isinstance(comp, TopK):
            comp.ratio = 0.1  # this model's buckets are tiny
        _, _, squeezed = train(g, strategy, comp, steps)
        return sum(dense[:5]) / 5, sum(dense[-10:]) / 10, sum(squeezed[-10:]) / 10

    # Signs alone (1 bit) learn more slowly over 60 steps of a model this small.
    bound = 1.5 if name == "onebit" else 1.3
    for start, dense, squeezed in run_ranks(2, body):
        assert squeezed < 0.5 * start  # it learns
        assert squeezed < bound * dense, (squeezed, dense)


def test_compressor_state_is_checkpointed_per_rank_and_resumes_exactly(tmp_path: Path) -> None:
    def body(g: ProcessGroup) -> None:
        # the uninterrupted run: 5 steps
        whole, _, _ = train(g, "ddp", PowerSGD(rank=2, warmup_steps=1, min_compression_rate=1), 5)
        # 3 steps, save, a fresh wrapper loads, 2 more steps on the same batches
        first, opt, _ = train(g, "ddp", PowerSGD(rank=2, warmup_steps=1, min_compression_rate=1), 3)
        checkpoint.save(tmp_path / "ck", model=first, optimizer=opt, group=g)
        saved = {k: v.clone() for k, v in first.compression.state_tensors().items()}
        fresh = mlp()
        fopt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
        comp = PowerSGD(rank=2, warmup_steps=1, min_compression_rate=1)
        wrapped, _ = sl.distribute(fresh, fopt, strategy="ddp", group=g, compression=comp)
        checkpoint.load(tmp_path / "ck", model=wrapped, optimizer=fopt, group=g)
        loaded = comp.state_tensors()
        assert saved.keys() == loaded.keys() and any(k.startswith("residual/") for k in saved)
        for k, value in saved.items():
            torch.testing.assert_close(loaded[k], value, rtol=0, atol=0, msg=k)
        for step in range(3, 5):
            x, y = batch(step, g.rank)
            fopt.zero_grad()
            nn.functional.mse_loss(wrapped(x), y).backward()
            fopt.step()
        want, got = full_params(whole), full_params(wrapped)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)

    run_ranks(2, body)

    def other_size(g: ProcessGroup) -> float:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        comp = PowerSGD(rank=2, warmup_steps=1, min_compression_rate=1)
        wrapped, _ = sl.distribute(model, opt, strategy="zero2", group=g, compression=comp)
        checkpoint.load(tmp_path / "ck", model=wrapped, optimizer=opt, group=g)
        assert comp.steps == 0  # another layout: the per-rank state starts over, warmed up
        losses = []
        for step in range(5, 9):
            x, y = batch(step, g.rank)
            opt.zero_grad()
            loss = nn.functional.mse_loss(wrapped(x), y)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        return losses[-1]

    assert all(loss < 1.0 for loss in run_ranks(3, other_size))


def test_compression_and_a_comm_hook_together_are_refused() -> None:
    def body(g: ProcessGroup) -> None:
        with pytest.raises(InvalidArgumentError, match="either compression= or comm_hook="):
            sl.distribute(mlp(), strategy="ddp", group=g, compression="int8", comm_hook="fp16")

    run_ranks(1, body)


# -- traffic -------------------------------------------------------------------------------------


def test_groups_count_the_bytes_each_op_moves() -> None:
    def body(g: ProcessGroup) -> dict[str, dict[str, int]]:
        t = torch.ones(1000)
        g.all_reduce(t)
        g.all_gather(torch.empty(4000), t)
        g.reduce_scatter(torch.empty(250), t)
        if g.rank == 0:
            g.send(t, 1)
        elif g.rank == 1:
            g.recv(t, 0)
        return g.traffic()

    got = run_ranks(4, body)
    for r, stats in enumerate(got):
        assert stats["all_reduce"] == {"calls": 1, "sent": 6000, "received": 6000}
        assert stats["all_gather"] == {"calls": 1, "sent": 12000, "received": 12000}
        assert stats["reduce_scatter"] == {"calls": 1, "sent": 3000, "received": 3000}
        assert ("send" in stats) == (r == 0) and ("recv" in stats) == (r == 1)
    assert got[0]["send"]["sent"] == 4000 and got[1]["recv"]["received"] == 4000


@pytest.mark.parametrize(
    ("name", "low", "high"), [("int8", 0.24, 0.30), ("onebit", 0.02, 0.06), ("bf16", 0.49, 0.51)]
)
def test_comm_stats_show_the_bytes_compression_saves(name: str, low: float, high: float) -> None:
    def body(g: ProcessGroup) -> float:
        big = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
        dense = sl.distribute(copy.deepcopy(big), strategy="ddp", group=g)[0]
        comp = sl.compression.resolve(name)
        assert comp is not None
        comp.warmup_steps = 0
        squeezed = sl.distribute(big, strategy="ddp", group=g, compression=comp)[0]
        per_step = []
        for model in (dense, squeezed):
            for _ in range(3):
                model(torch.randn(4, 256)).sum().backward()
            stats = model.comm_stats()
            grads = stats["by_op"].get("all_reduce", {}).get("sent", 0)
            grads += stats["by_op"].get("all_to_all", {}).get("sent", 0)
            grads += stats["by_op"].get("all_gather", {}).get("sent", 0)
            assert stats["steps"] == 3
            per_step.append(grads)
        return per_step[1] / per_step[0]

    for ratio in run_ranks(2, body):
        assert low <= ratio <= high


def test_estimate_memory_counts_the_residual_over_the_whole_gradient() -> None:
    model = nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 10))
    numel = sum(p.numel() for p in model.parameters())
    plain = sl.estimate_memory(model, world_size=4, strategy="zero2")
    squeezed = sl.estimate_memory(model, world_size=4, strategy="zero2", compression="int8")
    assert squeezed.compression == 4 * numel  # the worker residual: whole, not a quarter
    assert squeezed.persistent == plain.persistent + 4 * numel
    assert any("whole gradient" in note for note in squeezed.notes)
    ddp = sl.estimate_memory(model, world_size=4, strategy="ddp", compression=Int8())
    assert ddp.compression == 4 * numel + 4 * -(-numel // 4)  # plus its chunk's server residual


def test_topk_selection_on_large_buffers_is_exact() -> None:
    from shardline.compression.topk import largest

    g = torch.Generator().manual_seed(0)
    a = torch.randn(3_000_000, generator=g).abs()
    a[::1000] = 5.0  # ties at the top
    for k in (1, 3000, 30_000):
        got = largest(a, k)
        want = torch.topk(a, k).values
        assert got.numel() == k and got.unique().numel() == k
        torch.testing.assert_close(torch.sort(a[got], descending=True).values, want)


def test_residuals_follow_their_parameters_when_buckets_are_rebuilt() -> None:
    """DDP rebuilds its buckets after the first step: same keys, other parameters in them."""
    c = Int8(warmup_steps=0)
    cpu = torch.device("cpu")
    before = {0: (Entry("a", 0, (3,)), Entry("b", 3, (2,))), 1: (Entry("c", 0, (4,)),)}
    for key, layout in before.items():
        c.prepare(key, layout, sum(e.numel for e in layout), cpu)
    values = {"a": [1.0, 2.0, 3.0], "b": [4.0, 5.0], "c": [6.0, 7.0, 8.0, 9.0]}
    for name, v in values.items():
        c.state_tensors()[f"residual/{name}"].copy_(torch.tensor(v))
    after = {0: (Entry("c", 0, (4,)), Entry("b", 4, (2,))), 1: (Entry("a", 0, (3,)),)}
    for key, layout in after.items():
        c.prepare(key, layout, sum(e.numel for e in layout), cpu)
    state = c.state_tensors()
    for name, v in values.items():
        assert state[f"residual/{name}"].tolist() == v
    assert c.held(0, 6).tolist() == [6.0, 7.0, 8.0, 9.0, 4.0, 5.0]
    assert set(c._keys) == {0, 1}
