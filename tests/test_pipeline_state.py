"""A pipeline's state: tied weights across stages, full state dicts, checkpoints that reshard.

References are one process: the same model trained on the same micro-batches, and the same
checkpoint loaded into a plain model. Ranks are threads (``tests/_ranks.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardline as sl
from shardline import checkpoint
from shardline.comm import ProcessGroup
from tests._ranks import run_ranks
from tests.test_pipeline import _RNG, batch, loss_fn, make_model, run_steps

VOCAB, DIM = 11, 8


def tied_model() -> nn.Sequential:
    """Embedding -> 4 blocks -> a head whose weight is the embedding's."""
    with _RNG:
        torch.manual_seed(0)
        emb = nn.Embedding(VOCAB, DIM)
        blocks = [nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(4)]
        head = nn.Linear(DIM, VOCAB, bias=False)
        head.weight = emb.weight
        return nn.Sequential(emb, *blocks, head)


def lm_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, VOCAB), target.reshape(-1))


def tokens(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(50 + step)
    x = torch.randint(0, VOCAB, (8, 5), generator=gen)
    return x, torch.randint(0, VOCAB, (8, 5), generator=gen)


def tied_reference(m: int, steps: int) -> dict[str, torch.Tensor]:
    model = tied_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        x, y = tokens(step)
        opt.zero_grad()
        for xi, yi in zip(x.chunk(m), y.chunk(m), strict=True):
            (lm_loss(model(xi), yi) / m).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(("p", "schedule", "v"), [(2, "1f1b", 1), (4, "zero_bubble", 1),
                                                  (2, "interleaved", 2)])  # fmt: skip
def test_a_tied_embedding_and_head_stay_tied_and_equal_one_process(
    p: int, schedule: str, v: int
) -> None:
    m, steps = 4, 3
    want = tied_reference(m, steps)

    def body(g: ProcessGroup) -> dict[str, torch.Tensor]:
        model = sl.pipeline(tied_model(), g, schedule=schedule, microbatches=m,
                            loss_fn=lm_loss, virtual_stages=v)  # fmt: skip
        run_steps(model, torch.optim.AdamW(model.parameters(), lr=1e-2), tokens, range(steps))
        return model.state_dict()  # the whole model, on every rank

    for full in run_ranks(p, body, timeout=90):
        assert set(full) == set(want)
        for key, value in want.items():
            torch.testing.assert_close(full[key], value, msg=key)
        # The embedding's copy and the head's copy (on different ranks) took equal updates.
        assert torch.equal(full["0.weight"], full[f"{5}.weight"])


def _train_pipeline(g: ProcessGroup, steps: int, path: Path | None = None) -> Any:
    model = sl.pipeline(make_model(), g, schedule="1f1b", microbatches=2, loss_fn=loss_fn)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run_steps(model, opt, batch, range(steps))
    if path is not None:
        checkpoint.save(path, model=model, optimizer=opt, group=g)
    return model.state_dict()


def test_checkpoints_reshard_between_pipeline_depths_and_a_plain_model(tmp_path: Path) -> None:
    """Saved at pp=2; loaded into one process and at pp=4, bit for bit; the next step at pp=4
    equals the next step of the plain model loaded from the same checkpoint."""
    saved = run_ranks(2, lambda g: _train_pipeline(g, 2, tmp_path / "pp2"), timeout=90)[0]

    plain = make_model()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    checkpoint.load(tmp_path / "pp2", model=plain, optimizer=opt)
    for key, value in saved.items():
        assert torch.equal(plain.state_dict()[key], value), key
    x, y = batch(2)
    opt.zero_grad()
    for xi, yi in zip(x.chunk(2), y.chunk(2), strict=True):
        (loss_fn(plain(xi), yi) / 2).backward()
    opt.step()
    want = plain.state_dict()

    def at_pp4(g: ProcessGroup) -> tuple[bool, dict[str, torch.Tensor]]:
        model = sl.pipeline(make_model(), g, schedule="1f1b", microbatches=2, loss_fn=loss_fn)
        opt4 = torch.optim.AdamW(model.parameters(), lr=1e-2)
        checkpoint.load(tmp_path / "pp2", model=model, optimizer=opt4, group=g)
        loaded = model.state_dict()
        same = all(torch.equal(loaded[k], v) for k, v in saved.items())
        opt4.zero_grad()
        model.step(x, target=y)
        opt4.step()
        return same, model.state_dict()

    for same, after in run_ranks(4, at_pp4, timeout=90):
        assert same
        for key, value in want.items():
            torch.testing.assert_close(after[key], value, msg=key)


def test_the_index_describes_the_pipeline(tmp_path: Path) -> None:
    run_ranks(2, lambda g: _train_pipeline(g, 1, tmp_path / "ck"), timeout=60)
    info = checkpoint.info(tmp_path / "ck")
    text = str(info)
    assert "pipeline" in text and "1f1b" in text, text


def test_a_tied_weight_and_its_optimizer_state_reshard(tmp_path: Path) -> None:
    """Saved at pp=2 (each copy of the tied weight, with its AdamW state), loaded at pp=4:
    the next step equals the same step at pp=2, which never went through a checkpoint."""
    m = 2

    def run(g: ProcessGroup, save: bool, load: bool) -> dict[str, torch.Tensor]:
        model = sl.pipeline(tied_model(), g, microbatches=m, loss_fn=lm_loss)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        steps = range(2, 3) if load else range(3 if not save else 2)
        if load:
            checkpoint.load(tmp_path / "tied", model=model, optimizer=opt, group=g)
        run_steps(model, opt, tokens, steps)
        if save:
            checkpoint.save(tmp_path / "tied", model=model, optimizer=opt, group=g)
        return model.state_dict()

    straight = run_ranks(2, lambda g: run(g, False, False), timeout=60)[0]
    run_ranks(2, lambda g: run(g, True, False), timeout=60)
    for resumed in run_ranks(4, lambda g: run(g, False, True), timeout=60):
        for key, value in straight.items():
            torch.testing.assert_close(resumed[key], value, msg=key)


@pytest.mark.parametrize(
    ("norm_type", "dp"),
    [(2.0, None), (float("inf"), None), (2.0, "zero2"), (float("inf"), "zero3")],
)
def test_clip_grad_norm_spans_every_stage_and_counts_a_tied_weight_once(
    norm_type: float, dp: str | None
) -> None:
    """``model.clip_grad_norm_`` between ``step`` and ``opt.step()`` equals torch's
    ``clip_grad_norm_`` on the whole model in one process (the tied weight counted once);
    with ZeRO on two replicas too, each training half of the batch (its parts' norms summed
    over the stages and the replicas)."""
    m, steps, max_norm = 2, 3, 0.05
    model = tied_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    norms = []
    for step in range(steps):
        x, y = tokens(step)
        opt.zero_grad()
        for xi, yi in zip(x.chunk(m), y.chunk(m), strict=True):
            (lm_loss(model(xi), yi) / m).backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)))
        opt.step()
    want = model.state_dict()

    def body(g: ProcessGroup) -> tuple[dict[str, torch.Tensor], list[float]]:
        if dp is None:
            pipe = sl.pipeline(tied_model(), g, microbatches=m, loss_fn=lm_loss)
            popt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
            rows = slice(None)
        else:
            mesh = sl.DeviceMesh({"dp": 2, "pp": 2}, group=g)
            plain = tied_model()
            pipe, popt = sl.distribute(  # type: ignore[assignment]
                plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), mesh=mesh,
                strategy={"dp": dp, "pp": "1f1b"}, microbatches=m // 2, loss_fn=lm_loss,
            )  # fmt: skip
            half = 8 // 2
            rows = slice(half * mesh.local_rank("dp"), half * mesh.local_rank("dp") + half)
        seen = []
        for step in range(steps):
            x, y = tokens(step)
            popt.zero_grad()
            pipe.step(x[rows], target=y[rows])
            seen.append(float(pipe.clip_grad_norm_(max_norm, norm_type)))
            popt.step()
        return pipe.state_dict(), seen

    for full, seen in run_ranks(2 if dp is None else 4, body, timeout=60):
        assert seen == pytest.approx(norms, rel=1e-5)
        for key, value in want.items():
            torch.testing.assert_close(full[key], value, msg=key)
