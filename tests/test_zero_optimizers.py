"""Every ``torch.optim`` optimizer under ZeRO: exact against one process, or refused up front.

Elementwise optimizers step 1-D shards; per-parameter ones (Adafactor, Muon, or registered)
get whole parameters, each on one rank; L-BFGS and SparseAdam are refused by name with what
works instead. The oracle is one process training on the average of every rank's loss
(``tests.test_zero.reference``), and for checkpoints the same optimizer in one process.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardline as sl
from shardline import checkpoint
from shardline.comm import ProcessGroup
from shardline.errors import InvalidArgumentError
from shardline.parallel import ShardedDataParallel
from shardline.parallel.data.zero import optimizers
from tests._ranks import run_ranks
from tests._zero import UNIT_MB, assert_state_close, batch, lm_loss, make, reference

pytestmark = pytest.mark.usefixtures("native")

Make = Callable[[list[tuple[str, nn.Parameter]]], torch.optim.Optimizer]


def _params(named: list[tuple[str, nn.Parameter]]) -> list[nn.Parameter]:
    return [p for _, p in named]


# One optimizer of each torch.optim class ZeRO shards (SparseAdam and LBFGS are refused).
EXACT: dict[str, Make] = {
    "SGD": lambda n: torch.optim.SGD(_params(n), lr=0.1, momentum=0.9, nesterov=True),
    "Adam": lambda n: torch.optim.Adam(_params(n), lr=1e-2, amsgrad=True),
    "AdamW": lambda n: torch.optim.AdamW(_params(n), lr=1e-2),
    "Adamax": lambda n: torch.optim.Adamax(_params(n), lr=1e-2),
    "NAdam": lambda n: torch.optim.NAdam(_params(n), lr=1e-2),
    "RAdam": lambda n: torch.optim.RAdam(_params(n), lr=1e-2),
    "Adagrad": lambda n: torch.optim.Adagrad(_params(n), lr=0.1, initial_accumulator_value=0.1),
    "Adadelta": lambda n: torch.optim.Adadelta(_params(n), lr=1.0),
    "RMSprop": lambda n: torch.optim.RMSprop(
        _params(n), lr=1e-2, momentum=0.5, centered=True, eps=1e-3
    ),
    "Rprop": lambda n: torch.optim.Rprop(_params(n), lr=1e-2),
    "ASGD": lambda n: torch.optim.ASGD(_params(n), lr=1e-2, t0=1),
    "Adafactor": lambda n: torch.optim.Adafactor(_params(n), lr=1e-2),
}


def test_every_torch_optimizer_is_covered() -> None:
    """A new torch.optim class must get a rule here (and a row above) before it is trusted."""
    classes = {
        name
        for name in dir(torch.optim)
        if isinstance(getattr(torch.optim, name), type)
        and issubclass(getattr(torch.optim, name), torch.optim.Optimizer)
        and name != "Optimizer"
    }
    ruled = {c.__name__ for c in optimizers._RULES}
    assert classes <= ruled
    assert classes - {"LBFGS", "SparseAdam", "Muon"} <= set(EXACT)


def train_with(
    g: ProcessGroup, stage: int, steps: int, make_opt: Make, *, after: bool
) -> tuple[dict[str, torch.Tensor], ShardedDataParallel, torch.optim.Optimizer]:
    """``steps`` ZeRO steps; the optimizer passed to distribute(), or built ``after`` it."""
    torch.set_num_threads(1)
    plain = make()
    if after:
        model, _ = sl.distribute(plain, strategy=f"zero{stage}", group=g, unit_mb=UNIT_MB)
        opt = make_opt(list(model.named_parameters()))
    else:
        named = [(k, p) for k, p in plain.named_parameters() if p.requires_grad]
        model, bound = sl.distribute(
            plain, make_opt(named), strategy=f"zero{stage}", group=g, unit_mb=UNIT_MB
        )
        assert bound is not None
        opt = bound
    assert isinstance(model, ShardedDataParallel)
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(step, g.rank)
        lm_loss(model(x), y).backward()
        opt.step()
    return model.state_dict(), model, opt


# Every optimizer passed to distribute(); built after wrapping, one of each kind (elementwise,
# eager state, whole parameters): the path is the same for every elementwise optimizer.
CASES = [(name, False) for name in sorted(EXACT)] + [
    (name, True) for name in ("AdamW", "Adagrad", "Adafactor")
]


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize(("name", "after"), CASES, ids=[f"{n}-{a}" for n, a in CASES])
def test_optimizer_matches_single_process(name: str, after: bool, stage: int) -> None:
    """3 steps on 2 ranks: the same parameters as one process (fp32 tolerance)."""
    make_opt = EXACT[name]
    _, want, _ = reference(2, 3, make_opt)
    for got, model, _ in run_ranks(2, lambda g: train_with(g, stage, 3, make_opt, after=after)):
        assert_state_close(got, want)
        whole = "whole on rank" in model.plan()
        assert whole == (name == "Adafactor"), model.plan()


def test_muon_gets_whole_matrices() -> None:
    """Muon steps 2-D weights only: AdamW takes the rest, Muon's matrices stay whole.

    Two steps (the second uses the momentum the owner kept): Muon orthogonalises in bfloat16,
    so from the third step on, gradients that differ in the last float32 bit (another reduction
    order) can round differently there, by up to 2e-4 on these weights, at every stage alike.
    """

    def make_opt(named: list[tuple[str, nn.Parameter]]) -> Any:
        return [
            torch.optim.Muon([p for _, p in named if p.dim() == 2], lr=1e-2),
            torch.optim.AdamW([p for _, p in named if p.dim() != 2], lr=1e-2),
        ]

    def one_process() -> dict[str, torch.Tensor]:
        model = make()
        opts = make_opt(list(model.named_parameters()))
        for step in range(2):
            for o in opts:
                o.zero_grad()
            sum(lm_loss(model(x), y) for x, y in (batch(step, r) for r in range(2))).div(
                2
            ).backward()
            for o in opts:
                o.step()
        return {k: v.clone() for k, v in model.state_dict().items()}

    def ours(g: ProcessGroup) -> tuple[dict[str, torch.Tensor], str]:
        torch.set_num_threads(1)
        plain = make()
        opts = make_opt(list(plain.named_parameters()))  # Muon checks for 2-D when built
        model, _ = sl.distribute(plain, strategy="zero2", group=g, unit_mb=UNIT_MB)
        assert isinstance(model, ShardedDataParallel)
        for o in opts:
            model.bind_optimizer(o)
        for step in range(2):
            for o in opts:
                o.zero_grad()
            x, y = batch(step, g.rank)
            lm_loss(model(x), y).backward()
            for o in opts:
                o.step()
        return model.state_dict(), model.plan()

    want = one_process()
    for got, plan in run_ranks(2, ours):
        assert_state_close(got, want)
        assert "Muon steps whole parameters" in plan, plan


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_lbfgs_is_refused_for_zero_with_what_works(stage: int) -> None:
    def body(g: ProcessGroup) -> None:
        plain = make()
        opt = torch.optim.LBFGS(plain.parameters())
        sl.distribute(plain, opt, strategy=f"zero{stage}", group=g, unit_mb=UNIT_MB)

    with pytest.raises(AssertionError) as err:
        run_ranks(2, body)
    text = str(err.value)
    assert text.count("InvalidArgumentError: LBFGS cannot be used with ZeRO") == 2, text
    assert "strategy='ddp'" in text


def test_lbfgs_built_after_wrapping_is_refused_before_its_step_does_anything() -> None:
    def body(g: ProcessGroup) -> bool:
        model, _ = sl.distribute(make(), strategy="zero2", group=g, unit_mb=UNIT_MB)
        opt = torch.optim.LBFGS(model.parameters())
        before = [p.detach().clone() for p in model.parameters()]

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = lm_loss(model(batch(0, g.rank)[0]), batch(0, g.rank)[1])
            loss.backward()
            return loss

        with pytest.raises(InvalidArgumentError, match="LBFGS cannot be used with ZeRO"):
            opt.step(closure)
        return all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))

    assert run_ranks(2, body) == [True, True]


def test_lbfgs_under_ddp_matches_single_process() -> None:
    def closure_for(model: nn.Module, opt: Any, xs: list[Any]) -> Callable[[], torch.Tensor]:
        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = sum(lm_loss(model(x), y) for x, y in xs) / len(xs)
            loss.backward()
            return loss

        return closure

    model = make()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    opt.step(closure_for(model, opt, [batch(0, r) for r in range(2)]))
    want = {k: v.clone() for k, v in model.state_dict().items()}

    def body(g: ProcessGroup) -> dict[str, torch.Tensor]:
        torch.set_num_threads(1)
        plain = make()
        opt = torch.optim.LBFGS(plain.parameters(), lr=0.5, max_iter=4)
        ddp, _ = sl.distribute(plain, opt, strategy="ddp", group=g)
        opt.step(closure_for(ddp, opt, [batch(0, g.rank)]))
        return ddp.state_dict()

    for got in run_ranks(2, body):
        assert_state_close(got, want)


def test_sparse_adam_is_refused_with_what_works() -> None:
    def body(g: ProcessGroup) -> None:
        plain = make()
        sl.distribute(plain, torch.optim.SparseAdam(plain.parameters()), strategy="zero1", group=g)

    with pytest.raises(AssertionError, match=r"SparseAdam cannot be used with ZeRO.*Adam"):
        run_ranks(2, body)


class NormalizedSGD(torch.optim.Optimizer):
    """Steps each parameter by ``-lr * grad / ||grad||``: the norm needs the whole parameter."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / (p.grad.norm() + 1e-12), alpha=-group["lr"])


def test_a_registered_per_parameter_optimizer_is_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(optimizers, "_RULES", dict(optimizers._RULES))
    sl.parallel.register_optimizer(NormalizedSGD, per_parameter=True)

    def make_opt(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
        return NormalizedSGD(_params(named), lr=0.05)

    _, want, _ = reference(2, 3, make_opt)
    for stage in (2, 3):
        for got, _, _ in run_ranks(2, lambda g, s=stage: train_with(g, s, 3, make_opt, after=True)):
            assert_state_close(got, want)


def test_register_optimizer_refuses_bad_input() -> None:
    with pytest.raises(InvalidArgumentError, match=r"not a torch\.optim\.Optimizer"):
        sl.parallel.register_optimizer(dict)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="not both"):
        sl.parallel.register_optimizer(NormalizedSGD, per_parameter=True, refuse="no")


def test_adagrad_built_before_wrapping_is_accepted_and_stepped_state_refused() -> None:
    """Adagrad makes its state when built: fresh state is cut to the shards."""

    def body(g: ProcessGroup) -> str:
        plain = make()
        opt = torch.optim.Adagrad(plain.parameters(), lr=0.1, initial_accumulator_value=0.5)
        assert any(opt.state.values())  # made eagerly, before any step
        sl.distribute(plain, opt, strategy="zero2", group=g, unit_mb=UNIT_MB)
        shapes = {tuple(s["sum"].shape) == tuple(p.shape) for p, s in opt.state.items()}
        assert shapes == {True} and all(bool((s["sum"] == 0.5).all()) for s in opt.state.values())
        plain2 = make()
        stepped = torch.optim.Adam(plain2.parameters())
        for p in plain2.parameters():
            p.grad = torch.zeros_like(p)
        stepped.step()
        with pytest.raises(InvalidArgumentError, match="already has state") as err:
            sl.distribute(plain2, stepped, strategy="zero2", group=g, unit_mb=UNIT_MB)
        return str(err.value)

    assert all("before the first optimizer step" in m for m in run_ranks(2, body))


def test_whole_parameters_checkpoint_and_reshard(tmp_path: Path) -> None:
    """zero2 + Adafactor at 2 ranks -> one process (same Adafactor state) -> zero3 at 3."""
    make_opt = EXACT["Adafactor"]

    def save(g: ProcessGroup) -> None:
        _, model, opt = train_with(g, 2, 2, make_opt, after=False)
        checkpoint.save(tmp_path / "ck", model=model, optimizer=opt, group=g)

    run_ranks(2, save)
    checkpoint.verify(tmp_path / "ck")
    ref_model = make()
    named = [(k, p) for k, p in ref_model.named_parameters() if p.requires_grad]
    ref_opt = make_opt(named)
    for step in range(2):
        ref_opt.zero_grad()
        sum(lm_loss(ref_model(x), y) for x, y in (batch(step, r) for r in range(2))).div(
            2
        ).backward()
        ref_opt.step()

    plain = make(seed=3)
    opt = make_opt([(k, p) for k, p in plain.named_parameters() if p.requires_grad])
    checkpoint.load(tmp_path / "ck", model=plain, optimizer=opt)
    assert_state_close(plain.state_dict(), ref_model.state_dict())
    for (n, p), (_, q) in zip(plain.named_parameters(), named, strict=True):
        assert opt.state[p].keys() == ref_opt.state[q].keys(), n
        for k, v in ref_opt.state[q].items():
            torch.testing.assert_close(opt.state[p][k], v, rtol=1e-4, atol=1e-6, msg=f"{n}/{k}")

    _, want, _ = reference(2, 3, make_opt)

    def resume(g: ProcessGroup) -> dict[str, torch.Tensor]:
        torch.set_num_threads(1)
        plain = make(seed=4)
        named = [(k, p) for k, p in plain.named_parameters() if p.requires_grad]
        model, o = sl.distribute(plain, make_opt(named), strategy="zero3", group=g, unit_mb=UNIT_MB)
        assert o is not None
        checkpoint.load(tmp_path / "ck", model=model, optimizer=o, group=g)
        # step 2 of the 2-rank run, on 3 ranks: rank 2 sees no data (its loss weighs 0)
        o.zero_grad()
        x, y = batch(2, min(g.rank, 1))
        scale = 1.5 if g.rank < 2 else 0.0  # 3 ranks average: (l0 + l1) / 2 = 1.5 * mean
        (lm_loss(model(x), y) * scale).backward()
        o.step()
        return model.state_dict()

    for got in run_ranks(3, resume, timeout=90):
        assert_state_close(got, want)
