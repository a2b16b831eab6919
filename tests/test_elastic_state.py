"""``sl.elastic.State``: a commit in host memory, restored in place, equals the committed step.

The oracle is the run itself: training goes on from a commit for two more steps, the state is
restored, and everything (parameters, optimizer state, sampler position, extra fields) must
equal what it was at the commit, bit for bit, in the same objects; training on from the
restore must repeat those two steps exactly. For one process, for DDP and ZeRO-1/2/3 on two
ranks (threads), for a 2-stage pipeline, and for tied weights.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardline as sl
from shardline.comm import ProcessGroup
from shardline.errors import InvalidArgumentError
from tests._ranks import built_once, run_ranks


@built_once
def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    )


def model() -> nn.Sequential:
    return copy.deepcopy(_model())


def batch(step: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)


def train(m: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int = 0) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(step, rank)
        opt.zero_grad()
        loss = nn.functional.mse_loss(m(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def snapshot(m: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Everything of this rank, copied: the full model (a collective for ZeRO) and the
    optimizer's state as the strategy lays it out."""
    from shardline.parallel import contract

    optim = contract.sharded_optim_state_dict(m, opt)
    flat = {
        f"{name}.{k}": t.clone()
        for name, entries in optim["state"].items()
        for k, v in entries.items()
        if isinstance(v, torch.Tensor | contract.Shard | contract.Local)
        for t in contract.tensors_of(v)
    }  # fmt: skip
    return {"model": {k: v.clone() for k, v in m.state_dict().items()}, "optim": flat}


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for part in ("model", "optim"):
        assert a[part].keys() == b[part].keys(), part
        for k in a[part]:
            assert torch.equal(a[part][k], b[part][k]), f"{part}: {k}"


def commit_train_restore(m: nn.Module, opt: torch.optim.Optimizer, rank: int = 0) -> None:
    """Commit after 3 steps, train 2, restore: the state of the commit, and the same 2 steps."""
    train(m, opt, range(3), rank)
    sampler = sl.DistributedSampler(list(range(40)), num_replicas=1, rank=0, seed=1)
    it = iter(sampler)
    taken = [next(it) for _ in range(5)]
    sampler.advance(5)
    state = sl.elastic.State(model=m, optimizer=opt, sampler=sampler, step=3, note={"lr": 1})
    state.commit()
    params = [id(p) for p in m.parameters()]
    at_commit = snapshot(m, opt)
    losses = train(m, opt, range(3, 5), rank)
    state.step, state.note["lr"] = 5, 2
    sampler.advance(7)
    state.restore()
    assert [id(p) for p in m.parameters()] == params, "restore replaced the parameters"
    assert_same(snapshot(m, opt), at_commit)
    assert state.step == 3 and state.note == {"lr": 1}
    assert list(sampler)[:3] == list(sl.DistributedSampler(list(range(40)), num_replicas=1,
                                                         rank=0, seed=1))[5:8]  # fmt: skip
    assert taken == list(sl.DistributedSampler(list(range(40)), 1, 0, seed=1))[:5]
    assert train(m, opt, range(3, 5), rank) == losses, "the steps after the restore differ"


def test_one_process_returns_to_the_commit_bitwise() -> None:
    m = model()
    commit_train_restore(m, torch.optim.AdamW(m.parameters(), lr=1e-2))


def test_a_restore_in_a_fresh_optimizer_brings_its_state_back() -> None:
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    train(m, opt, range(2))
    state = sl.elastic.State(model=m, optimizer=opt)
    state.commit()
    want = snapshot(m, opt)
    opt.state.clear()  # as if the optimizer had been rebuilt
    state.restore()
    assert_same(snapshot(m, opt), want)


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_a_distributed_model_returns_to_the_commit_on_every_rank(strategy: str) -> None:
    def body(g: ProcessGroup) -> None:
        m = model()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        options = {} if strategy == "ddp" else {"unit_mb": 0.001}  # several units
        dm, dopt = sl.distribute(m, opt, strategy=strategy, group=g, **options)
        commit_train_restore(dm, dopt, g.rank)

    run_ranks(2, body, timeout=120)


def test_a_pipeline_stage_returns_to_the_commit() -> None:
    def body(g: ProcessGroup) -> None:
        pipe = sl.pipeline(model(), g, microbatches=2, loss_fn=nn.functional.mse_loss)
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)

        def steps(r: range) -> list[float]:
            out = []
            for step in r:
                opt.zero_grad()
                x, y = batch(step)
                out.append(float(pipe.step(x, target=y)))
                opt.step()
            return out

        steps(range(2))
        state = sl.elastic.State(model=pipe, optimizer=opt)
        state.commit()
        want = {k: v.clone() for k, v in pipe.state_dict().items()}
        losses = steps(range(2, 4))
        state.restore()
        for k, v in pipe.state_dict().items():
            assert torch.equal(v, want[k]), k
        assert steps(range(2, 4)) == losses

    run_ranks(2, body, timeout=120)


def test_tied_weights_stay_one_tensor() -> None:
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    m = nn.Sequential(emb, head)
    state = sl.elastic.State(model=m)
    state.commit()
    with torch.no_grad():
        emb.weight.add_(1.0)
    state.restore()
    assert head.weight is emb.weight
    saved = state._saved
    assert saved is not None and len({id(v) for v in saved["model"].values()}) == 1


def test_misuse_is_refused_with_what_to_do() -> None:
    m = model()
    with pytest.raises(InvalidArgumentError, match="nothing was committed yet"):
        sl.elastic.State(model=m).restore()
    with pytest.raises(InvalidArgumentError, match="needs its model"):
        sl.elastic.State(optimizer=torch.optim.SGD(m.parameters(), lr=0.1))
    for name in ("commit", "fields", "commits", "last_commit_seconds"):
        with pytest.raises(InvalidArgumentError, match=f"{name} is a name State uses"):
            sl.elastic.State(**{name: 1})
    with pytest.raises(AttributeError, match="no field 'steps'"):
        _ = sl.elastic.State(step=1).steps


def _scramble(m: nn.Module, opt: torch.optim.Optimizer) -> None:
    """What a replacement process holds: other weights, no optimizer state."""
    with torch.no_grad():
        for p in m.parameters():
            p.uniform_(-9, 9)
    opt.state.clear()


@pytest.mark.parametrize(("strategy", "n"), [("zero2", 2), ("zero2", 3), ("zero3", 3)])
def test_a_rank_that_lost_its_commit_gets_it_from_its_buddy(strategy: str, n: int) -> None:
    def body(g: ProcessGroup) -> None:
        m = model()
        dm, dopt = sl.distribute(m, torch.optim.AdamW(m.parameters(), lr=1e-2), strategy=strategy,
                                 group=g, unit_mb=0.001)  # fmt: skip
        train(dm, dopt, range(3), g.rank)
        state = sl.elastic.State(model=dm, optimizer=dopt, group=g, step=3)
        state.commit()
        at_commit = snapshot(dm, dopt)
        losses = train(dm, dopt, range(3, 5), g.rank)
        if g.rank == 1:  # rank 1 was replaced: a fresh process, a fresh State
            _scramble(dm, dopt)
            state = sl.elastic.State(model=dm, optimizer=dopt, group=g, step=0)
        state.restore()
        assert_same(snapshot(dm, dopt), at_commit)
        assert state.step == 3 and state.commits == 1
        assert train(dm, dopt, range(3, 5), g.rank) == losses

    run_ranks(n, body, timeout=120)


def test_two_neighbours_lost_at_once_is_an_error_on_every_rank() -> None:
    def body(g: ProcessGroup) -> str:
        m = model()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        dm, dopt = sl.distribute(m, opt, strategy="zero2", group=g)
        train(dm, dopt, range(1), g.rank)
        state = sl.elastic.State(model=dm, optimizer=dopt, group=g)
        state.commit()
        if g.rank in (1, 2):
            state = sl.elastic.State(model=dm, optimizer=dopt, group=g)
        with pytest.raises(InvalidArgumentError) as err:
            state.restore()
        return str(err.value)

    for message in run_ranks(3, body, timeout=120):
        assert "rank 1's commit #1 is lost, and so is the copy its buddy rank 2 held" in message
        assert "give State a checkpoint_dir and call state.save() now and then" in message


def test_two_neighbours_lost_fall_back_to_the_latest_checkpoint(tmp_path: Path) -> None:
    def body(g: ProcessGroup) -> None:
        m = model()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        dm, dopt = sl.distribute(m, opt, strategy="zero2", group=g)
        sampler = sl.DistributedSampler(list(range(30)), num_replicas=3, rank=g.rank, seed=2)
        sampler.advance(4)
        state = sl.elastic.State(model=dm, optimizer=dopt, sampler=sampler, group=g,
                                 checkpoint_dir=tmp_path, step=2)  # fmt: skip
        train(dm, dopt, range(2), g.rank)
        state.save()  # on disk at step 2
        at_save = snapshot(dm, dopt)
        losses = train(dm, dopt, range(2, 4), g.rank)
        state.step = 4
        state.commit()  # in memory at step 4: lost below on ranks 1 and 2
        train(dm, dopt, range(4, 5), g.rank)
        if g.rank in (1, 2):
            _scramble(dm, dopt)
            sampler = sl.DistributedSampler(list(range(30)), num_replicas=3, rank=g.rank, seed=2)
            state = sl.elastic.State(model=dm, optimizer=dopt, sampler=sampler, group=g,
                                     checkpoint_dir=tmp_path, step=0)  # fmt: skip
        state.restore()
        assert state.restored_from is not None and "state-" in state.restored_from
        assert state.step == 2
        assert_same(snapshot(dm, dopt), at_save)
        assert sampler.state_dict()["num_consumed"] == 12  # 4 per rank, 3 ranks
        assert train(dm, dopt, range(2, 4), g.rank) == losses

    run_ranks(3, body, timeout=120)
