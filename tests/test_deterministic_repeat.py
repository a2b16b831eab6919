"""Repeatable mode (``deterministic="repeat"``): the same bits run after run, for one layout.

The reference for the group's sums is each rank's gradient computed alone, in this process,
then added across ranks in a known order: over Gloo (not ours) in the canonical tree
(``tree_sum``), over the native engine in rank order. DDP and ZeRO-3 must end one SGD step
with exactly the parameters that sum gives. The control: plain DDP over Gloo (its own ring's
order) does not.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

import shardline as sl
from shardline import config
from shardline.comm import world as world_mod
from shardline.comm.tree import tree_sum
from shardline.errors import InvalidArgumentError
from shardline.examples.train import Config, TinyGPT, corpus
from shardline.parallel.deterministic import is_deterministic
from shardline.parallel.deterministic.repeat import repeatable_kernels
from tests._ranks import built_once, run_ranks, seeded

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("kernels_restored")]

CFG = Config(d_model=64, num_layers=2, num_heads=4, seq_len=16, batch_size=8)
WORLD = 4


@built_once
def pristine() -> TinyGPT:
    with seeded(0):
        return TinyGPT(CFG)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = corpus(num_chars=20_000)
    gen = torch.Generator().manual_seed(7)
    n = (tokens.numel() - 1) // CFG.seq_len
    idx = torch.randint(0, n, (CFG.batch_size,), generator=gen).tolist()
    rows = torch.stack([tokens[i * CFG.seq_len : (i + 1) * CFG.seq_len + 1] for i in idx])
    return rows[:, :-1], rows[:, 1:]


def rank_slice(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch()
    b = CFG.batch_size // WORLD
    return x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]


def one_step(strategy: str, backend: str, deterministic: bool | str) -> dict[str, torch.Tensor]:
    """One SGD step (lr 1) of ``WORLD`` ranks; every rank's parameters, checked equal."""

    def body(g: sl.ProcessGroup) -> dict[str, torch.Tensor]:
        plain = copy.deepcopy(pristine())
        opt = torch.optim.SGD(plain.parameters(), lr=1.0)
        model, opt = sl.distribute(
            plain, opt, strategy=strategy, group=g, deterministic=deterministic
        )
        assert opt is not None
        opt.zero_grad(set_to_none=True)
        model(*rank_slice(g.rank)).backward()
        opt.step()
        return {k: v.clone() for k, v in model.state_dict().items()}

    states = run_ranks(WORLD, body, backend=backend, timeout=150)
    for other in states[1:]:
        assert all(torch.equal(other[k], states[0][k]) for k in states[0])
    return states[0]


def reference(add: str) -> dict[str, torch.Tensor]:
    """The step with the ranks' gradients (each computed alone) added by ``add``, averaged."""
    grads: list[dict[str, torch.Tensor]] = []
    for rank in range(WORLD):
        model = copy.deepcopy(pristine())
        model(*rank_slice(rank)).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    stepped = copy.deepcopy(pristine())
    with torch.no_grad():
        for name, p in stepped.named_parameters():  # a tied weight once
            parts = torch.stack([g[name] for g in grads])
            if add == "tree":
                total = tree_sum(parts)
            else:  # rank order
                total = parts[0].clone()
                for part in parts[1:]:
                    total += part
            p.sub_(total / WORLD)
    return {k: v.clone() for k, v in stepped.state_dict().items()}


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_over_gloo_the_ranks_are_added_in_the_tree(strategy: str) -> None:
    got = one_step(strategy, "gloo", "repeat")
    assert differing(got, reference("tree")) == []
    assert torch.are_deterministic_algorithms_enabled()


def test_over_gloo_without_it_the_sums_differ() -> None:
    """The control: Gloo's own ring adds in another order than the tree."""
    got, want = one_step("ddp", "gloo", False), reference("tree")
    assert differing(got, want), "plain DDP over Gloo matched the tree: the test is blind"
    assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-5


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_the_native_engine_adds_the_ranks_in_rank_order(strategy: str) -> None:
    got = one_step(strategy, "native", "repeat")
    assert differing(got, reference("rank order")) == []
    assert differing(reference("tree"), reference("rank order")), "the orders give one result"


def test_the_model_keeps_its_own_kernels() -> None:
    """No per-sample gradients: the model is not prepared as ``deterministic=True`` does."""

    def body(g: sl.ProcessGroup) -> bool:
        model, _ = sl.distribute(copy.deepcopy(pristine()), group=g, deterministic="repeat")
        return is_deterministic(model.module)

    assert run_ranks(2, body) == [False, False]


@pytest.mark.parametrize("strategy", ["async", "hogwild"])
def test_a_strategy_whose_result_follows_the_timing_is_refused(strategy: str) -> None:
    model = nn.Linear(4, 4)
    with pytest.raises(InvalidArgumentError, match=rf"'{strategy}' applies each update"):
        sl.distribute(model, strategy=strategy, deterministic="repeat")


def test_the_mode_is_true_false_or_repeat() -> None:
    mode_of = world_mod.deterministic_mode
    assert mode_of(True) is True and mode_of(False) is False
    assert mode_of("Repeat") == "repeat"
    with pytest.raises(InvalidArgumentError, match=r"deterministic='often': use True"):
        mode_of("often")
    with pytest.raises(InvalidArgumentError, match=r"^distribute\(\): deterministic=1: use True"):
        mode_of(1, "distribute()")


def test_the_setting_takes_repeat(monkeypatch: pytest.MonkeyPatch) -> None:
    for text, want in (("repeat", "repeat"), ("1", True), ("0", False), ("", False)):
        monkeypatch.setenv("SHARDLINE_DETERMINISTIC", text)
        assert config.get("SHARDLINE_DETERMINISTIC") == want
        assert world_mod.deterministic_mode() == want
    monkeypatch.setenv("SHARDLINE_DETERMINISTIC", "yes")
    with pytest.raises(InvalidArgumentError, match=r"SHARDLINE_DETERMINISTIC='yes' must be 1"):
        config.get("SHARDLINE_DETERMINISTIC")


def test_init_refuses_another_mode() -> None:
    with pytest.raises(InvalidArgumentError, match=r"init\(\): deterministic='always'"):
        sl.init(deterministic="always")


def test_on_a_mesh_the_sharded_axis_adds_in_the_tree() -> None:
    """``compose``'s path: ZeRO-3 on a mesh's ``dp_shard`` axis (4 ranks over Gloo) ends the
    step with the tree's parameters; the same mesh without the mode does not (the control)."""

    def on_mesh(deterministic: bool | str) -> list[dict[str, torch.Tensor]]:
        def body(g: sl.ProcessGroup) -> dict[str, torch.Tensor]:
            plain = copy.deepcopy(pristine())
            opt = torch.optim.SGD(plain.parameters(), lr=1.0)
            mesh = sl.DeviceMesh({"dp_shard": WORLD}, group=g)
            model, opt = sl.distribute(
                plain, opt, mesh=mesh, strategy={"dp_shard": "zero3"},
                deterministic=deterministic,
            )  # fmt: skip
            assert opt is not None
            opt.zero_grad(set_to_none=True)
            model(*rank_slice(g.rank)).backward()
            opt.step()
            return {k: v.clone() for k, v in model.state_dict().items()}

        states: list[dict[str, torch.Tensor]] = run_ranks(WORLD, body, backend="gloo", timeout=150)
        return states

    want = reference("tree")
    assert all(differing(state, want) == [] for state in on_mesh("repeat"))
    assert differing(on_mesh(False)[0], want), "ZeRO-3 over Gloo matched the tree: blind"


@pytest.mark.parametrize(("asked", "on"), [(None, True), (False, False)])
def test_a_pipeline_takes_the_jobs_repeatable_mode(
    monkeypatch: pytest.MonkeyPatch, asked: bool | None, on: bool
) -> None:
    """``sl.pipeline(deterministic=None)`` follows ``init``'s mode, here the setting's;
    ``False`` keeps it off."""
    monkeypatch.setenv("SHARDLINE_DETERMINISTIC", "repeat")
    torch.use_deterministic_algorithms(False)

    def body(g: sl.ProcessGroup) -> bool:
        with seeded(0):
            chain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        sl.pipeline(
            chain, g, microbatches=2, loss_fn=lambda out, target: out.sum(), deterministic=asked
        )
        return torch.are_deterministic_algorithms_enabled()

    assert run_ranks(2, body) == [on, on]


def test_on_a_gpu_a_cublas_workspace_set_otherwise_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unset, ``CUBLAS_WORKSPACE_CONFIG`` is set to cuBLAS's fixed workspace; a value that is
    not one is refused by name (the GPU branch, taken here by saying there is one)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    repeatable_kernels(nn.Linear(2, 2))
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    with pytest.raises(InvalidArgumentError, match=r"CUBLAS_WORKSPACE_CONFIG is ':0:0'"):
        repeatable_kernels(nn.Linear(2, 2))
