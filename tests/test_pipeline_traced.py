"""Pipelines of models that are not an ``nn.Sequential``, split by tracing (torch's splitter).

The model is written as users write them: an embedding, a ``ModuleList`` of blocks looped over
in ``forward``, a final norm and a head tied to the embedding, plus a buffer. Split at a named
block, it trains exactly as one process accumulating the same micro-batches, its checkpoints
load into the plain model, several tensors may cross a cut, a model may take several inputs
(a mask every block reads), and cuts the runtime cannot run are refused up front. Ranks are
threads (``tests/_ranks.py``).
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
from tests._ranks import run_ranks
from tests.test_pipeline import _RNG, run_steps
from tests.test_pipeline_state import VOCAB, lm_loss, tokens

DIM, M, STEPS = 8, 2, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(self.norm(x)))


class TinyLM(nn.Module):
    def __init__(self, residual: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block() for _ in range(4)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.full((1,), 0.5))
        self.residual = residual  # keeps the embedding to the end: two tensors cross a cut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = e = self.embed(x) * self.scale
        for block in self.blocks:
            h = block(h) + (e if self.residual else 0)
        return self.head(self.norm(h))


def tiny_lm(residual: bool = False) -> TinyLM:
    with _RNG:
        torch.manual_seed(0)
        return TinyLM(residual)


def one_process(
    model: nn.Module, data: Callable[[int], tuple[Any, torch.Tensor]] = tokens
) -> dict[str, torch.Tensor]:
    """``model`` after STEPS AdamW steps in one process, accumulating M micro-batches each;
    ``data(step)`` gives the inputs (a tensor or a tuple of them) and the target."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        x, y = data(step)
        xs = x if isinstance(x, tuple) else (x,)
        opt.zero_grad()
        for *parts, yi in zip(*(t.chunk(M) for t in xs), y.chunk(M), strict=True):
            (lm_loss(model(*parts), yi) / M).backward()
        opt.step()
    return model.state_dict()


def reference(residual: bool = False) -> dict[str, torch.Tensor]:
    return one_process(tiny_lm(residual))


def train(
    g: ProcessGroup,
    schedule: str,
    path: Path | None = None,
    residual: bool = False,
    split: tuple[str, ...] = ("blocks.2",),
) -> dict[str, torch.Tensor]:
    x0, _ = tokens(0)
    model = sl.pipeline(tiny_lm(residual), g, schedule=schedule, microbatches=M,
                        loss_fn=lm_loss, split=list(split), example=x0.chunk(M)[0])  # fmt: skip
    if len(split) == 1:
        assert {n.split(".")[0] for n, _ in model.named_parameters()} == (
            {"embed", "blocks"} if g.rank == 0 else {"blocks", "norm", "head"}
        )
    run_steps(model, torch.optim.AdamW(model.parameters(), lr=1e-2), tokens)
    if path is not None:
        checkpoint.save(path, model=model, group=g)
    return model.state_dict()


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_a_traced_model_trains_as_one_process(schedule: str) -> None:
    want = reference()
    for full in run_ranks(2, lambda g: train(g, schedule), timeout=120):
        assert set(full) == set(want)
        for key, value in want.items():
            torch.testing.assert_close(full[key], value, msg=key)
        assert torch.equal(full["embed.weight"], full["head.weight"])  # still tied


def test_a_traced_pipelines_checkpoint_loads_into_the_plain_model(tmp_path: Path) -> None:
    saved = run_ranks(2, lambda g: train(g, "1f1b", tmp_path / "ck"), timeout=120)[0]
    plain = TinyLM()
    checkpoint.load(tmp_path / "ck", model=plain)
    for key, value in plain.state_dict().items():
        assert torch.equal(value, saved[key]), key


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_several_tensors_cross_a_cut_and_train_as_one_process(schedule: str) -> None:
    """The residual model keeps the embedding to the end: two tensors cross every cut (the
    hidden state and the embedding), and the middle stage passes the embedding through."""
    want = reference(residual=True)
    split = ("blocks.1", "blocks.3")
    for full in run_ranks(3, lambda g: train(g, schedule, residual=True, split=split),
                          timeout=120):  # fmt: skip
        for key, value in want.items():
            torch.testing.assert_close(full[key], value, msg=key)


class MaskedLM(TinyLM):
    """Two inputs: token ids and a boolean mask that every block reads (as attention masks
    are), so the mask crosses every cut."""

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        h = self.embed(x) * self.scale
        for block in self.blocks:
            h = torch.where(keep, block(h), h)
        return self.head(self.norm(h))


def masked(step: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    x, y = tokens(step)
    keep = (torch.arange(x.shape[1]) % 3 != step % 3).expand(x.shape).unsqueeze(-1)
    return (x, keep.contiguous()), y


@pytest.mark.parametrize("schedule", ["gpipe", "zero_bubble"])
def test_a_model_of_two_inputs_trains_as_one_process(schedule: str) -> None:
    def fresh() -> MaskedLM:
        with _RNG:
            torch.manual_seed(0)
            return MaskedLM()

    want = one_process(fresh(), masked)

    def body(g: ProcessGroup) -> dict[str, torch.Tensor]:
        (x, keep), _ = masked(0)
        pipe = sl.pipeline(fresh(), g, schedule=schedule, microbatches=M, loss_fn=lm_loss,
                           split=["blocks.1", "blocks.3"], example=(x[:2], keep[:2]))  # fmt: skip
        run_steps(pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-2), masked)
        return pipe.state_dict()

    for full in run_ranks(3, body, timeout=120):
        for key, value in want.items():
            torch.testing.assert_close(full[key], value, msg=key)


def test_a_model_traced_on_keyword_inputs_takes_them_by_name() -> None:
    """example= a dict ({"x": ..., "keep": ...}, as a Hugging Face model takes input_ids and
    attention_mask): the model is traced on keyword inputs, step() takes a dict with those
    keys, and training equals one process; inputs under other keys are refused by name."""

    def fresh() -> MaskedLM:
        with _RNG:
            torch.manual_seed(0)
            return MaskedLM()

    want = one_process(fresh(), masked)

    def by_name(step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        (x, keep), y = masked(step)
        return {"keep": keep, "x": x}, y  # not the example's order: matched by name

    def body(g: ProcessGroup) -> dict[str, torch.Tensor]:
        (x, keep), _ = masked(0)
        pipe = sl.pipeline(fresh(), g, schedule="1f1b", microbatches=M, loss_fn=lm_loss,
                           split=["blocks.2"], example={"x": x[:2], "keep": keep[:2]})  # fmt: skip
        run_steps(pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-2), by_name)
        with pytest.raises(sl.InvalidArgumentError, match=r"keys \['mask', 'x'\]"):
            pipe.step({"x": x, "mask": keep}, target=masked(0)[1])
        return pipe.state_dict()

    for full in run_ranks(2, body, timeout=120):
        for key, value in want.items():
            torch.testing.assert_close(full[key], value, msg=key)


class ReusingLM(TinyLM):
    """Block 0 runs twice, in stages 0 and 2, and the buffer ``scale`` is read in both: with
    two stages per rank both copies land on rank 0 and must be one tensor there."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks[0](self.embed(x) * self.scale)
        h = self.blocks[1](h)
        h = self.blocks[0](self.blocks[2](h)) * self.scale
        return self.head(self.norm(self.blocks[3](h)))


@pytest.mark.parametrize("kind", [TinyLM, ReusingLM])
def test_a_traced_model_runs_interleaved_virtual_stages(kind: type[TinyLM]) -> None:
    def fresh() -> TinyLM:
        with _RNG:
            torch.manual_seed(0)
            return kind()

    want = one_process(fresh())

    def body(g: ProcessGroup) -> tuple[dict[str, torch.Tensor], list[str]]:
        pipe = sl.pipeline(fresh(), g, schedule="interleaved", virtual_stages=2,
                           microbatches=M, loss_fn=lm_loss, example=tokens(0)[0][:2],
                           split=["blocks.1", "blocks.2", "blocks.3"])  # fmt: skip
        names = [n for n, _ in pipe.named_parameters()]
        run_steps(pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-2), tokens)
        return pipe.state_dict(), names

    results = run_ranks(2, body, timeout=120)
    for full, _ in results:
        for key, value in want.items():
            torch.testing.assert_close(full[key], value, msg=key)
    # Rank 0 runs stages 0 and 2 (the embedding, blocks 0 and 2), rank 1 stages 1 and 3; a
    # tensor two stages of one rank read is held once.
    mine = sorted({n.split(".")[0] + "." + n.split(".")[1] for n in results[0][1]})
    assert mine == ["blocks.0", "blocks.2", "embed.weight"]
    assert len(results[0][1]) == len(set(results[0][1]))


def test_cuts_the_runtime_cannot_run_are_refused_before_any_work() -> None:
    x0 = tokens(0)[0][:4]

    def cut(residual: bool, split: list[str], example: object) -> None:
        run_ranks(2, lambda g: sl.pipeline(tiny_lm(residual), g, split=split, example=example))

    with pytest.raises(AssertionError, match=r"'blocks\.9' is not a submodule of TinyLM"):
        cut(False, ["blocks.9"], x0)
    with pytest.raises(AssertionError, match=r"pass split=\[the submodules"):
        cut(False, ["blocks.2"], None)


@pytest.mark.parametrize("v", [1, 2])
def test_a_traced_meta_model_materialises_its_stage_and_loads_a_checkpoint(
    tmp_path: Path, v: int
) -> None:
    """Traced on the meta device (model and example): no rank ever holds real weights of
    another stage; loaded from a checkpoint, it trains as the model that was saved."""
    checkpoint.save(tmp_path / "ck", model=tiny_lm())
    want = reference()

    def body(g: ProcessGroup) -> dict[str, torch.Tensor]:
        with torch.device("meta"):
            model = TinyLM()
            example = torch.zeros(4, 5, dtype=torch.long)
        split = ["blocks.2"] if v == 1 else ["blocks.1", "blocks.2", "blocks.3"]
        pipe = sl.pipeline(model, g, microbatches=M, loss_fn=lm_loss, split=split,
                           example=example, virtual_stages=v,
                           schedule="1f1b" if v == 1 else "interleaved")  # fmt: skip
        assert not any(p.is_meta for p in pipe.parameters())
        checkpoint.load(tmp_path / "ck", model=pipe, group=g)
        run_steps(pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-2), tokens)
        return pipe.state_dict()

    for full in run_ranks(2, body, timeout=120):
        for key, value in want.items():
            torch.testing.assert_close(full[key], value, msg=key)


def test_a_hugging_face_model_with_its_cache_on_is_traced_with_it_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """GPT-2 as Hugging Face builds it (``use_cache=True``): the pipeline traces it with the
    cache off, says so, and its loss equals one process's on the same batch."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB,
                                     n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)  # fmt: skip
    ids = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(0))

    def loss_fn(out: Any, y: torch.Tensor) -> torch.Tensor:
        logits = out.logits if hasattr(out, "logits") else out
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

    def build() -> nn.Module:
        with _RNG:  # ranks are threads: one at a time through the global generator
            torch.manual_seed(0)
            return transformers.GPT2LMHeadModel(config)

    plain = build()
    with torch.no_grad():
        want = float(sum(loss_fn(plain(ids[i : i + 2]), ids[i : i + 2]) for i in (0, 2)) / 2)

    def body(g: ProcessGroup) -> float:
        model = sl.pipeline(build(), g, schedule="1f1b", microbatches=2, loss_fn=loss_fn,
                            split=["transformer.h.1"], example=ids[:2])  # fmt: skip
        return float(model.step(ids, target=ids))

    with caplog.at_level("WARNING", logger="shardline"):
        losses = run_ranks(2, body)
    assert losses == [pytest.approx(want, rel=1e-5)] * 2
    assert "tracing GPT2LMHeadModel with config.use_cache=False" in caplog.text
