"""ZeRO stages 1/2/3 against their oracles: one process on the full batch, and torch's ZeRO.

Ranks run as threads (``run_ranks``); the models, data and loops are ``tests._zero``'s. The
usage patterns a review found broken are in ``test_zero_usage.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import shardline as sl
from shardline.comm import ProcessGroup
from shardline.errors import InvalidArgumentError, ShardlineError
from shardline.parallel import MixedPrecision, ShardedDataParallel
from shardline.parallel.data.zero.grouping import plan_units
from tests._ranks import run_ranks
from tests._zero import (
    _INIT,
    OPTIMIZERS,
    UNIT_MB,
    Wide,
    adamw,
    assert_state_close,
    batch,
    lm_loss,
    make,
    planned_then_trained,
    reference,
    train,
)
from tests.multiprocess._launch import report
from tests.multiprocess._launch import run as run_processes

pytestmark = pytest.mark.usefixtures("native")


# -- parity ------------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stage_matches_single_process(stage: int, n: int, optimizer: str) -> None:
    """10 steps, tied embeddings, two param groups: equal to one process (fp32 tolerance)."""
    make_opt = OPTIMIZERS[optimizer]
    ref_losses, ref_state, _ = reference(n, 10, make_opt)
    outs = run_ranks(n, lambda g: train(g, stage, 10, make_opt)[:2], timeout=120)
    for losses, state in outs:
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        assert_state_close(state, ref_state)


@pytest.mark.parametrize("no_sync", [False, True])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_accumulation_clipping_and_frozen_layer(stage: int, no_sync: bool) -> None:
    """Two micro-batches per step (with or without no_sync), global-norm clipping, a frozen
    block and tied embeddings: equal to one process doing the same."""
    kw = {"frozen": True}
    ref_losses, ref_state, _ = reference(3, 6, adamw, accum=2, clip=0.05, **kw)
    outs = run_ranks(
        3,
        lambda g: train(g, stage, 6, adamw, accum=2, clip=0.05, no_sync=no_sync, **kw)[:2],
        timeout=120,
    )
    for losses, state in outs:
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        assert_state_close(state, ref_state)
        frozen = make(**kw).blocks[0].state_dict()
        for k, v in frozen.items():
            assert torch.equal(state[f"blocks.0.{k}"], v), "a frozen parameter moved"


@pytest.mark.parametrize("stage", [2, 3])
def test_mixed_precision_tracks_fp32(stage: int) -> None:
    """bf16 compute with fp32 master weights stays within bf16 tolerance of fp32 training,
    and the master weights (the state dict) stay fp32."""
    ref_losses, ref_state, _ = reference(2, 8, adamw)
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    outs = run_ranks(2, lambda g: train(g, stage, 8, adamw, mixed_precision=mp)[:2], timeout=120)
    for losses, state in outs:
        assert losses == pytest.approx(ref_losses, rel=2e-2)
        for k, v in ref_state.items():
            assert state[k].dtype == torch.float32
            torch.testing.assert_close(state[k], v, rtol=0.0, atol=5e-2, msg=k)


def test_stages_agree_with_each_other_and_with_ddp() -> None:
    """Same model, data and optimizer: zero1, zero2, zero3 and our DDP give one model."""

    def body(g: ProcessGroup) -> list[dict[str, torch.Tensor]]:
        states = [train(g, s, 5, adamw)[1] for s in (1, 2, 3)]
        plain = make()
        ddp = sl.DistributedDataParallel(plain, group=g)
        opt = adamw(list(plain.named_parameters()))
        for step in range(5):
            opt.zero_grad()
            x, y = batch(step, g.rank)
            lm_loss(ddp(x), y).backward()
            opt.step()
        return [*states, ddp.state_dict()]

    for states in run_ranks(2, body, timeout=120):
        for s in states[1:]:
            assert_state_close(s, states[0])


# -- conditional modules -----------------------------------------------------------------------


class Branchy(nn.Module):
    """Rank-dependent control flow: an expert only some ranks run (MoE-like)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.expert_a = nn.Linear(32, 32)
        self.expert_b = nn.Linear(32, 32)
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = self.expert_b(h) if use_b else self.expert_a(h)
        return self.out(torch.relu(h))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_module_run_on_some_ranks_only_does_not_hang(stage: int) -> None:
    """Rank 0 runs expert_b, the others expert_a: no hang, and the gradients are the average
    of every rank's (zero for the expert a rank skipped), as one process computes them."""
    n, steps = 3, 4

    def new() -> Branchy:
        with _INIT:
            torch.manual_seed(0)
            return Branchy()

    def data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(step * 10 + rank)
        return torch.randn(5, 8, generator=gen), torch.randn(5, 4, generator=gen)

    ref = new()
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        ropt.zero_grad()
        loss = sum(
            nn.functional.mse_loss(ref(*[data(step, r)[0]], use_b=r == 0), data(step, r)[1])
            for r in range(n)
        )
        (loss / n).backward()
        ropt.step()

    def body(g: ProcessGroup) -> dict[str, torch.Tensor]:
        torch.set_num_threads(1)
        plain = new()
        opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
        model, opt = sl.distribute(plain, opt, strategy=f"zero{stage}", group=g, unit_mb=0)
        for step in range(steps):
            opt.zero_grad()
            x, y = data(step, g.rank)
            nn.functional.mse_loss(model(x, use_b=g.rank == 0), y).backward()
            opt.step()
        return model.state_dict()

    for state in run_ranks(n, body, timeout=60):
        assert_state_close(state, ref.state_dict())


class Scrambled(nn.Module):
    """Registered out -> mid -> inp, run inp -> mid -> out."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(24, 4)
        self.mid = nn.ModuleList(nn.Linear(24, 24) for _ in range(3))
        self.inp = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for layer in self.mid:
            h = torch.tanh(layer(h))
        return self.out(h)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_units_are_re_formed_in_execution_order_after_the_first_backward(stage: int) -> None:
    """Units follow the order modules ran from the second step on; the optimizer built before
    keeps working (same local parameter objects) and training equals one process."""
    n, steps = 2, 5

    def new() -> Scrambled:
        with _INIT:
            torch.manual_seed(0)
            return Scrambled()

    def data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(step * 10 + rank)
        return torch.randn(5, 8, generator=gen), torch.randn(5, 4, generator=gen)

    ref = new()
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(steps):
        ropt.zero_grad()
        loss = sum(
            nn.functional.mse_loss(ref(data(step, r)[0]), data(step, r)[1]) for r in range(n)
        )
        (loss / n).backward()
        ropt.step()

    def body(g: ProcessGroup) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]], Any]:
        torch.set_num_threads(1)
        plain = new()
        opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
        model, opt = sl.distribute(plain, opt, strategy=f"zero{stage}", group=g, unit_mb=0.003)
        assert isinstance(model, ShardedDataParallel) and opt is not None
        before = [u.modules for u in model._plan.units]
        locals_before = [id(p) for p in model.parameters()]
        for step in range(steps):
            opt.zero_grad()
            x, y = data(step, g.rank)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        after = [u.modules for u in model._plan.units]
        assert sorted(locals_before) == sorted(id(p) for p in model.parameters())
        return before, after, model.state_dict()

    for before, after, state in run_ranks(n, body, timeout=60):
        assert before[0][0] == "out" and after[0][0] == "inp", (before, after)
        assert [m for u in after for m in u] == ["inp", "mid.0", "mid.1", "mid.2", "out"]
        assert_state_close(state, ref.state_dict())


# -- state dicts -------------------------------------------------------------------------------


def test_state_dict_is_the_plain_models_and_loads_across_world_sizes() -> None:
    """zero3 at 2 ranks -> plain model -> zero2 at 3 ranks -> zero1 at 2: same tensors, and the
    optimizer state (by name) follows; training continues exactly as without the round trip."""
    _, ref_state, _ = reference(2, 6, adamw)

    def first(g: ProcessGroup) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        _, state, model, opt = train(g, 3, 3, adamw)
        return state, model.optim_state_dict(opt)

    state, osd = run_ranks(2, first, timeout=60)[0]
    plain = make()
    plain.load_state_dict(state)  # loads into the plain model as is
    assert set(osd["state"]) == {k for k, _ in plain.named_parameters()}
    _, _, ref3 = reference(2, 3, adamw)  # Adam moments by name equal one process's
    for name, st in osd["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(st[key], ref3[name][key], rtol=1e-4, atol=1e-7)

    def second(g: ProcessGroup) -> dict[str, Any]:
        torch.set_num_threads(1)
        p = make()
        opt = adamw(list(p.named_parameters()))
        model, opt = sl.distribute(p, opt, strategy="zero2", group=g, unit_mb=UNIT_MB)
        assert isinstance(model, ShardedDataParallel) and opt is not None
        model.load_state_dict(state)
        model.load_optim_state_dict(opt, osd)
        assert_state_close(model.state_dict(), state, atol=0.0)
        return model.optim_state_dict(opt)

    osd3 = run_ranks(3, second, timeout=60)[0]
    for name in osd["state"]:
        assert torch.equal(osd3["state"][name]["exp_avg_sq"], osd["state"][name]["exp_avg_sq"])

    def resume(g: ProcessGroup) -> dict[str, torch.Tensor]:
        torch.set_num_threads(1)
        p = make()
        opt = adamw(list(p.named_parameters()))
        model, opt = sl.distribute(p, opt, strategy="zero1", group=g, unit_mb=UNIT_MB)
        assert isinstance(model, ShardedDataParallel) and opt is not None
        model.load_state_dict(state)
        model.load_optim_state_dict(opt, osd3)
        for step in range(3, 6):
            opt.zero_grad()
            x, y = batch(step, g.rank)
            lm_loss(model(x), y).backward()
            opt.step()
        return model.state_dict()

    for final in run_ranks(2, resume, timeout=60):
        assert_state_close(final, ref_state)


def test_sharded_state_dict_covers_each_parameter_exactly_once() -> None:
    def body(g: ProcessGroup) -> dict[str, Any]:
        _, _, model, _ = train(g, 3, 1, adamw)
        return model.sharded_state_dict()

    n = 3
    shards = run_ranks(n, body, timeout=60)
    full = run_ranks(n, lambda g: train(g, 3, 1, adamw)[1], timeout=60)[0]
    for name, value in full.items():
        if not isinstance(shards[0][name], sl.parallel.Shard):
            assert torch.equal(shards[0][name], value)  # a buffer
            continue
        covered = torch.zeros(value.numel(), dtype=torch.int32)
        rebuilt = torch.zeros(value.numel())
        for rank_shards in shards:
            s = rank_shards[name]
            assert s.global_shape == value.shape
            for piece in s.pieces:
                assert isinstance(piece, sl.parallel.FlatRange)
                covered[piece.start : piece.start + piece.tensor.numel()] += 1
                rebuilt[piece.start : piece.start + piece.tensor.numel()] = piece.tensor
        assert torch.all(covered == 1), name
        assert torch.equal(rebuilt.view(value.shape), value)


# -- memory ------------------------------------------------------------------------------------


def held_bytes(model: ShardedDataParallel, opt: torch.optim.Optimizer) -> int:
    """Bytes of parameters, gradients and optimizer state this rank holds (unique storages)."""
    seen: dict[int, int] = {}

    def add(t: torch.Tensor | None) -> None:
        if t is not None and t.numel():
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()

    for u in model._units:
        add(u.full)
        add(u.shard)
        add(u.shard_grad)
        add(u.grad_full)
    for p in model.module.parameters():
        add(p.grad)
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v) and v.dim() > 0:
                add(v)
    return sum(seen.values())


@pytest.mark.parametrize("n", [2, 4])
def test_bytes_per_parameter_match_the_zero_formulas(n: int) -> None:
    """fp32 AdamW: zero1 8+8/N, zero2 4+12/N, zero3 16/N bytes per parameter (within 5%)."""
    formula = {1: 8 + 8 / n, 2: 4 + 12 / n, 3: 16 / n}

    def body(g: ProcessGroup) -> dict[int, float]:
        torch.set_num_threads(1)
        out = {}
        for stage in (1, 2, 3):
            with _INIT:
                torch.manual_seed(0)
                plain = Wide()
            psi = sum(p.numel() for p in plain.parameters())
            opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
            model, opt = sl.distribute(plain, opt, strategy=f"zero{stage}", group=g)
            assert isinstance(model, ShardedDataParallel) and opt is not None
            for _ in range(2):
                opt.zero_grad()
                model(torch.randn(4, 256)).square().mean().backward()
                opt.step()
            out[stage] = held_bytes(model, opt) / psi
        return out

    for per_param in run_ranks(n, body, timeout=120):
        for stage, want in formula.items():
            assert per_param[stage] == pytest.approx(want, rel=0.05), (stage, per_param)


# -- grouping ----------------------------------------------------------------------------------


def test_small_layers_are_merged_and_large_ones_stand_alone() -> None:
    layers: list[nn.Module] = [nn.Linear(16, 16) for _ in range(300)]  # 1088 B each
    layers.insert(150, nn.Linear(1024, 512))  # 2 MiB: alone
    model = nn.Sequential(*layers)
    plan = plan_units(model, 64 * 1024)
    sizes = [u.nbytes for u in plan.units]
    big = [u for u in plan.units if "150" in u.modules]
    assert len(big) == 1 and big[0].modules[-1] == "150"  # small leftovers before it join it
    assert big[0].nbytes - (1024 * 512 + 512) * 4 < 64 * 1024
    for u in plan.units:
        if u is not big[0] and u is not plan.units[-1]:
            assert 64 * 1024 <= u.nbytes < 64 * 1024 + 1088
    covered = [m for u in plan.units for m in u.modules]
    assert covered == [str(i) for i in range(301)]  # each layer once, in order
    assert (
        plan.summary(3)
        == f"301 layers -> {len(sizes)} units, {2 * len(sizes)} all-gathers per step"
    )


def test_units_never_mix_dtypes() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).double(), nn.Linear(4, 4))
    plan = plan_units(model, 1 << 20)
    assert [u.dtype for u in plan.units] == [torch.float32, torch.float64, torch.float32]


# -- errors ------------------------------------------------------------------------------------


def test_bad_arguments_are_clear() -> None:
    def body(g: ProcessGroup) -> None:
        plain = make()
        with pytest.raises(InvalidArgumentError, match="stage must be 1, 2 or 3"):
            ShardedDataParallel(plain, stage=4, group=g)
        opt = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)
        with pytest.raises(InvalidArgumentError, match="not parameters of the model"):
            sl.distribute(make(), opt, strategy="zero2", group=g)

    run_ranks(2, body, timeout=60)


def test_inner_module_called_directly_is_an_error() -> None:
    def body(g: ProcessGroup) -> None:
        model, _ = sl.distribute(make(), None, strategy="zero3", group=g, unit_mb=UNIT_MB)
        with pytest.raises(ShardlineError, match="outside the wrapper's forward"):
            model.module(batch(0, 0)[0])

    run_ranks(2, body, timeout=60)


def test_zero1_matches_torch_zero_redundancy_optimizer_in_processes() -> None:
    """Real processes: our zero1 and zero3 against torch DDP + ZeroRedundancyOptimizer."""
    ranks = run_processes(2, "zero_vs_torch", timeout=120)
    assert all(r.rc == 0 and "OK" in r.out for r in ranks), report(ranks)


# -- one line ----------------------------------------------------------------------------------


def train_as_one_process_would(model: nn.Module, g: ProcessGroup) -> list[float]:
    """``reference``'s 4 steps of AdamW on this rank's batches; the mean loss of each step."""
    opt = adamw(list(model.named_parameters()))
    losses = []
    for step in range(4):
        opt.zero_grad()
        x, y = batch(step, g.rank)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        total = loss.detach().reshape(1).clone()
        g.all_reduce(total, op="avg")
        losses.append(float(total))
    return losses


def test_as_distributed_picks_by_memory_and_trains_like_one_process() -> None:
    """Plenty of memory: DDP. Little: zero3, and a plain AdamW over model.parameters() (the
    shards) trains exactly like one process. Ranks with different memory agree on the most
    sharded choice."""
    ref_losses, ref_state, _ = reference(2, 4, adamw)

    def body(g: ProcessGroup) -> tuple[str, str, str, list[float], dict[str, torch.Tensor]]:
        torch.set_num_threads(1)
        roomy = sl.as_distributed(make(), group=g, available_bytes=1 << 40, verbose=False)
        # rank 0 believes it has room for DDP, rank 1 only for zero3
        budget = 1 << 40 if g.rank == 0 else 60_000
        model = sl.as_distributed(
            make(), group=g, available_bytes=budget, verbose=False, unit_mb=UNIT_MB
        )
        losses = train_as_one_process_would(model, g)
        return roomy.strategy, model.strategy, model.strategy_reason, losses, model.state_dict()

    for roomy, chosen, reason, losses, state in run_ranks(2, body, timeout=60):
        assert roomy == "ddp"
        assert chosen == "zero3", reason
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        assert_state_close(state, ref_state)


def test_as_distributed_recomputes_when_no_strategy_fits_without_it() -> None:
    """A budget that no strategy fits with every activation kept but zero1 fits with the
    blocks recomputing: untimed, as_distributed recomputes (the first of its choices that
    fits), says so, and trains like one process."""
    ref_losses, ref_state, _ = reference(2, 4, adamw)
    example = (batch(0, 0)[0],)
    priced = sl.plan_strategy(
        make(), world_size=2, available_bytes=1 << 40, example_input=example, unit_mb=UNIT_MB
    ).candidates
    kept_all = min(c.estimate.total for c in priced if c.recompute is None)
    target = next(c for c in priced if c.recompute and c.estimate.total < kept_all)
    budget = target.estimate.total
    assert all(c.estimate.total > budget for c in priced[: priced.index(target)])

    def body(g: ProcessGroup) -> tuple[str, str, list[float], dict[str, torch.Tensor]]:
        torch.set_num_threads(1)
        model = sl.as_distributed(
            make(), group=g, available_bytes=budget, headroom=1.0, example_input=example,
            verbose=False, unit_mb=UNIT_MB, timing=False,
        )  # fmt: skip
        assert model.plan.choice == target and "<- chosen" in model.plan.explain()
        losses = train_as_one_process_would(model, g)
        return model.strategy, model.strategy_reason, losses, model.state_dict()

    for chosen, reason, losses, state in run_ranks(2, body, timeout=60):
        assert chosen == target.strategy
        assert reason.startswith(f"{target.name}: "), reason
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        assert_state_close(state, ref_state)


@pytest.mark.parametrize(
    "mp", [None, MixedPrecision(param_dtype=torch.bfloat16)], ids=["fp32", "bf16"]
)
def test_planner_matches_measured_bytes(mp: MixedPrecision | None) -> None:
    """estimate_memory's persistent bytes (params + grads + master + optimizer) are within
    10% of what the wrapper and AdamW hold after two steps, for every stage."""
    n = 2

    def body(g: ProcessGroup) -> dict[int, tuple[int, int]]:
        torch.set_num_threads(1)
        out = {}
        for stage in (1, 2, 3):
            planned, model, opt = planned_then_trained(g, stage, mixed_precision=mp)
            out[stage] = (planned.persistent, held_bytes(model, opt))
        return out

    for per_stage in run_ranks(n, body, timeout=120):
        for stage, (planned, measured) in per_stage.items():
            assert planned == pytest.approx(measured, rel=0.10), (stage, planned, measured)
