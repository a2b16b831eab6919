"""Elastic regroup: a wrapped model moves onto a new group in place and trains on as a fresh one.

Four thread ranks train two steps and save a checkpoint; one rank is then lost (it aborts the
old group and the wrapper's sub-groups, so any collective on them fails) and three ranks form
a new group. Survivors move their wrapper with ``contract.regroup``; in the mixed scenarios a
process joins the running job (a new model wrapped by ``distribute`` while
``parallel.joining.is_joining()`` says so, as in an elastic job: no start-up collectives) and the
survivors' ranks change. Everyone loads the checkpoint and trains two more steps. The oracle
is three ranks that wrap fresh models on a three-rank group, load the same checkpoint and
train the same steps: the same unit (or bucket) layout and the same final parameters.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardline as sl
from shardline import checkpoint
from shardline.comm import ProcessGroup, init_process_group
from shardline.errors import InvalidArgumentError
from shardline.parallel import ShardedDataParallel, contract, joining
from shardline.parallel.data.ddp import DistributedDataParallel
from tests._ranks import SECRET, new_store, run_ranks, seeded

pytestmark = pytest.mark.usefixtures("native")

STRATEGIES = ["ddp", "zero1", "zero2", "zero3"]
_JOINING: set[str] = set()  # rank threads that act as a process joining a running job
UNIT_MB = 0.004  # ~4 KiB units: the MLP below has two, which re-forming changes
TIMEOUT = 90.0


class MLP(nn.Module):
    """Registered in another order than it runs, so ZeRO re-forms its units on a first step."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(64, 8)
        self.hidden = nn.Linear(32, 64)  # 8.4 KiB: a unit of its own size
        self.inp = nn.Linear(8, 32)
        self.norm = nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.norm(self.inp(x)))))


@pytest.fixture(autouse=True)
def _joined_running_job(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``parallel.joining.is_joining()`` is true in the rank threads in ``_JOINING``."""
    monkeypatch.setattr(joining, "_ask", lambda: threading.current_thread().name in _JOINING)
    yield
    _JOINING.clear()


def make(seed: int) -> MLP:
    with torch.random.fork_rng(), seeded(seed):
        return MLP()


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def adafactor(params: Any) -> torch.optim.Optimizer:
    """Needs whole parameters: ZeRO gives each of its units to one rank (by world size)."""
    return torch.optim.Adafactor(params, lr=1e-2)


def wrap(
    plain: nn.Module, strategy: str, g: ProcessGroup, make_opt: Any = adamw, **options: Any
) -> tuple[nn.Module, torch.optim.Optimizer]:
    opt = make_opt(plain.parameters())
    if strategy != "ddp":
        options["unit_mb"] = UNIT_MB
    model, opt_out = sl.distribute(plain, opt, strategy=strategy, group=g, **options)
    assert opt_out is not None
    return model, opt_out


def steps(model: nn.Module, opt: torch.optim.Optimizer, rank: int, first: int, last: int) -> None:
    for step in range(first, last):
        opt.zero_grad()
        x, y = batch(step, rank)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def layout_of(model: nn.Module) -> list[tuple[list[str], int | None]]:
    """ZeRO's units (with a whole unit's rank) or DDP's buckets, by parameter names: what every
    rank's collectives follow."""
    if isinstance(model, ShardedDataParallel):
        return [(list(u.names), u.owner) for u in model._units]
    assert isinstance(model, DistributedDataParallel)
    return [(names, None) for names in model.bucket_layout]


def finish(model: nn.Module) -> tuple[list[list[str]], dict[str, torch.Tensor]]:
    """The layout and the full parameters (``state_dict()`` is a collective for ZeRO)."""
    return layout_of(model), {k: v.detach().clone() for k, v in model.state_dict().items()}


def connect(master: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", master.port, None, False, timedelta(seconds=30))


def new_group(store: dist.TCPStore, rank: int) -> ProcessGroup:
    """This rank of the three-rank group formed after the loss (its own name on a new store)."""
    return init_process_group(
        store, rank, 3, name="regrouped", host_id="host-a", timeout=20.0, secret=SECRET,
        master_addr="127.0.0.1",
    )  # fmt: skip


def reference(path: Path, strategy: str, optimizer_state: bool, make_opt: Any = adamw) -> Any:
    """Three ranks wrap fresh models on three ranks, load the checkpoint, train steps 2 and 3."""

    def body(g: ProcessGroup) -> Any:
        torch.set_num_threads(1)
        model, opt = wrap(make(seed=99), strategy, g, make_opt)
        checkpoint.load(path, model=model, optimizer=opt if optimizer_state else None, group=g)
        steps(model, opt, g.rank, 2, 4)
        return finish(model)

    return run_ranks(3, body, timeout=TIMEOUT)[0]


# Old rank -> what it does after the loss: its rank in the new group, and whether it is the
# survivor of its old self ("regroup") or a process that joins afresh ("fresh"); None: lost.
SCENARIOS: dict[str, dict[int, tuple[int, str] | None]] = {
    "survivors": {0: (0, "regroup"), 1: (1, "regroup"), 2: (2, "regroup"), 3: None},
    "joiner": {0: (0, "regroup"), 1: None, 2: (1, "regroup"), 3: (2, "fresh")},
}


def elastic_run(
    path: Path, strategy: str, scenario: str, optimizer_state: bool, make_opt: Any = adamw
) -> list[Any]:
    """Train at four ranks, lose one, go on at three (see the module docstring)."""
    master = new_store(30.0)
    roles = SCENARIOS[scenario]

    def body(g4: ProcessGroup) -> Any:
        torch.set_num_threads(1)
        store = connect(master)
        model, opt = wrap(make(seed=0), strategy, g4, make_opt)
        steps(model, opt, g4.rank, 0, 2)
        checkpoint.save(path, model=model, optimizer=opt, group=g4)
        role = roles[g4.rank]
        if role is None:  # the lost rank: once every other saved, it kills the old groups
            store.wait([f"saved{r}" for r in roles if r != g4.rank])
            old = [g4]
            if isinstance(model, ShardedDataParallel):
                old += [model._gather_group, model._reduce_group]
            for g in old:
                g.abort("rank lost (test)")
            store.set("dead", "1")
            return None
        store.set(f"saved{g4.rank}", "1")
        store.wait(["dead"])
        rank, how = role
        g3 = new_group(store, rank)
        try:
            me = threading.current_thread().name
            if how == "fresh":  # a process joining the running job: as world.init sets it
                _JOINING.add(me)
                model, opt = wrap(make(seed=7), strategy, g3, make_opt)
            else:
                params = dict(model.named_parameters())
                groups = [list(pg["params"]) for pg in opt.param_groups]
                contract.regroup(model, g3)
                # The same local parameter objects (in unit order: it may change), still the
                # optimizer's.
                after = dict(model.named_parameters())
                assert after.keys() == params.keys()
                assert all(after[n] is p for n, p in params.items())
                assert [list(pg["params"]) for pg in opt.param_groups] == groups
                assert all(
                    a is b
                    for before, pg in zip(groups, opt.param_groups, strict=True)
                    for a, b in zip(before, pg["params"], strict=True)
                )
                if strategy != "ddp":
                    assert not opt.state, "the shards' optimizer state was not cleared"
                opt.state.clear()  # the caller's part (DDP's state would still fit)
                assert getattr(model, "group", None) is g3
            checkpoint.load(path, model=model, optimizer=opt if optimizer_state else None, group=g3)
            _JOINING.discard(me)  # restored: as elastic.job.settled()
            steps(model, opt, rank, 2, 4)
            return rank, finish(model)
        finally:
            g3.shutdown()

    results = [r for r in run_ranks(4, body, timeout=TIMEOUT) if r is not None]
    assert sorted(rank for rank, _ in results) == [0, 1, 2]
    return [out for _, out in sorted(results, key=lambda r: r[0])]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(
    ("scenario", "optimizer_state"),
    [("survivors", True), ("joiner", True), ("joiner", False)],
    ids=["survivors", "joiner", "joiner-no-optimizer-state"],
)
def test_regroup_resumes_like_fresh_wrappers(
    tmp_path: Path, strategy: str, scenario: str, optimizer_state: bool
) -> None:
    """After regroup and a load, training goes on exactly as fresh wrappers on the new group.

    Without optimizer state loaded, ZeRO re-forms its units after the first backward on every
    rank (survivors and the joiner alike); with it, none does.
    """
    path = tmp_path / "ck"
    outs = elastic_run(path, strategy, scenario, optimizer_state)
    want_layout, want = reference(path, strategy, optimizer_state)
    for layout, state in outs:
        assert layout == want_layout
        assert state.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(state[k], want[k], rtol=0, atol=0, msg=k)
    if strategy != "ddp":
        registration = ["out.weight", "out.bias", "hidden.weight", "hidden.bias"]
        reformed = want_layout[0][0] != registration
        assert reformed == (not optimizer_state), want_layout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_regroup_after_a_step_that_failed_midway(tmp_path: Path, strategy: str) -> None:
    """The rank is lost between forward and backward: backward raises on the survivors, with
    reductions (and stage 3's gathers) left in flight on the dead groups; regroup drops them."""
    path = tmp_path / "ck"
    master = new_store(30.0)

    def body(g4: ProcessGroup) -> Any:
        torch.set_num_threads(1)
        store = connect(master)
        model, opt = wrap(make(seed=0), strategy, g4)
        steps(model, opt, g4.rank, 0, 2)
        checkpoint.save(path, model=model, optimizer=opt, group=g4)
        opt.zero_grad()
        x, y = batch(2, g4.rank)
        loss = nn.functional.mse_loss(model(x), y)  # every rank's forward completes
        if g4.rank == 3:
            store.wait(["forward0", "forward1", "forward2"])
            for g in [g4, *(getattr(model, k, None) for k in ("_gather_group", "_reduce_group"))]:
                if g is not None:
                    g.abort("rank lost (test)")
            store.set("dead", "1")
            return None
        store.set(f"forward{g4.rank}", "1")
        store.wait(["dead"])
        with pytest.raises(Exception, match="aborted"):
            loss.backward()
        del loss
        g3 = new_group(store, g4.rank)
        try:
            contract.regroup(model, g3)
            opt.state.clear()
            checkpoint.load(path, model=model, optimizer=opt, group=g3)
            steps(model, opt, g3.rank, 2, 4)
            return finish(model)
        finally:
            g3.shutdown()

    outs = [r for r in run_ranks(4, body, timeout=TIMEOUT) if r is not None]
    want_layout, want = reference(path, strategy, optimizer_state=True)
    assert len(outs) == 3
    for layout, state in outs:
        assert layout == want_layout
        for k in want:
            torch.testing.assert_close(state[k], want[k], rtol=0, atol=0, msg=k)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
@pytest.mark.parametrize("optimizer_state", [True, False], ids=["optimizer-state", "no-state"])
def test_regroup_with_an_optimizer_of_whole_parameters(
    tmp_path: Path, strategy: str, optimizer_state: bool
) -> None:
    """Whole units go to ranks by the new world size, through the same collective re-layout
    on survivors (``regroup``) and on the joiner (``bind_optimizer``)."""
    path = tmp_path / "ck"
    outs = elastic_run(path, strategy, "joiner", optimizer_state, adafactor)
    want_layout, want = reference(path, strategy, optimizer_state, adafactor)
    assert sorted(owner for _, owner in want_layout) == [0, 1]  # given out over three ranks
    for layout, state in outs:
        assert layout == want_layout
        for k in want:
            torch.testing.assert_close(state[k], want[k], rtol=0, atol=0, msg=k)


# -- refusals --------------------------------------------------------------------------------------


class StageLike(nn.Module):
    """A strategy of the contract without ``regroup`` (as a pipeline stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def sharded_state_dict(self) -> dict[str, Any]:
        return dict(self.state_dict(keep_vars=True))

    def layout(self) -> dict[str, Any]:
        return {"strategy": "stage-like", "mesh": {}}


class Movable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.moved_to: list[Any] = []

    def sharded_state_dict(self) -> dict[str, Any]:
        return dict(self.state_dict(keep_vars=True))

    def regroup(self, group: Any) -> None:
        self.moved_to.append(group)


def test_contract_regroup_refuses_strategies_without_it() -> None:
    """A strategy without ``regroup`` is refused by name; a plain module needs nothing."""
    group = cast(ProcessGroup, object())  # never used: nothing here communicates
    with pytest.raises(InvalidArgumentError, match=r"elastic: StageLike cannot move to a new"):
        contract.regroup(StageLike(), group)
    inside = nn.Sequential(nn.Linear(2, 2), Movable(), StageLike())
    with pytest.raises(InvalidArgumentError, match=r"StageLike \(at '2'\).*DDP and ZeRO-1/2/3"):
        contract.regroup(inside, group)
    assert inside[1].moved_to == []  # checked before anything moved
    plain = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    before = [p.detach().clone() for p in plain.parameters()]
    contract.regroup(plain, group)
    assert all(torch.equal(a, b) for a, b in zip(before, plain.parameters(), strict=True))
    nested = nn.Sequential(nn.Linear(2, 2), Movable())
    contract.regroup(nested, group)
    assert nested[1].moved_to == [group]


@pytest.mark.timeout(120)
def test_wrappers_refuse_what_regroup_does_not_support() -> None:
    """HSDP and tensor parallelism inside ZeRO, DDP inside join() or a running backward."""

    def body(g: ProcessGroup) -> None:
        torch.set_num_threads(1)
        alone = [g.new_group([r]) for r in range(g.world_size)][g.rank]
        hsdp = ShardedDataParallel(make(0), group=alone, replicate_group=g, unit_mb=UNIT_MB)
        with pytest.raises(InvalidArgumentError, match=r"hybrid sharding.*not supported"):
            hsdp.regroup(g)
        zero = ShardedDataParallel(make(0), group=g, unit_mb=UNIT_MB)
        zero.set_model_parallel(g, {})
        with pytest.raises(InvalidArgumentError, match="tensor parallelism inside ZeRO"):
            zero.regroup(g)
        ddp = DistributedDataParallel(make(0), group=g)
        with ddp.join(), pytest.raises(InvalidArgumentError, match="inside join"):
            ddp.regroup(g)
        x, y = batch(0, g.rank)
        out = ddp(x)
        refused: list[Exception] = []

        def hook(grad: torch.Tensor) -> None:
            try:
                ddp.regroup(g)
            except InvalidArgumentError as e:
                refused.append(e)

        out.register_hook(hook)
        nn.functional.mse_loss(out, y).backward()
        assert refused and "while a backward is running" in str(refused[0])
        ddp.regroup(g)  # between steps it works (on the same ranks, here)
        nn.functional.mse_loss(ddp(x), y).backward()

    run_ranks(2, body, timeout=60)
