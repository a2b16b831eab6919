"""Tensor parallelism composed with data parallelism on one mesh (ranks are threads).

``sl.distribute(mesh={dp, tp}, strategy={"dp": ddp | zero1 | zero2 | zero3, "tp": "auto"})``
on the built-in GPT trains as one process on the whole batch (clipped gradients included:
the norm is summed over both axes, each element once), and its checkpoints load into one
process and into other layouts bit for bit, optimizer state included.
"""

from __future__ import annotations

import copy
import functools
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import shardline as sl
from shardline import checkpoint
from shardline.comm import ProcessGroup
from shardline.examples.train import TinyGPT, as_sequential, lm_loss
from shardline.parallel.tensor import ColumnParallelLinear, VocabParallelEmbedding
from tests._ranks import run_ranks
from tests.test_tensor_parallel import (
    _batches,
    _batches61,
    _gpt,
    _gpt61,
    _pristine_llama,
    check_resumed,
)

TIMEOUT = 120
CLIP = 0.5  # below the norms these steps see, so clipping changes every step


def _adamw(params: object) -> torch.optim.Optimizer:
    # A larger eps than the default: the key bias's gradient is rounding noise (see
    # test_tensor_parallel), which Adam with a tiny eps turns into full-size steps.
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-4)  # type: ignore[arg-type]


def _dense_run(steps: int) -> tuple[TinyGPT, torch.optim.Optimizer, list[float]]:
    """One process on the whole batch, torch's own clipping: the reference."""
    model = _gpt()
    opt = _adamw(model.parameters())
    norms = []
    for x, y in _batches()[:steps]:
        opt.zero_grad()
        model(x, y).backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
    return model, opt, norms


def _mesh_run(
    g: ProcessGroup, dp: str, steps: int, **options: object
) -> tuple[sl.DeviceMesh, nn.Module, torch.optim.Optimizer, list[float]]:
    """dp2 x tp2: each replica takes half of every batch; the optimizer built dense."""
    mesh = sl.DeviceMesh({"dp": 2, "tp": 2}, group=g)
    model = _gpt()
    wrapped, opt = sl.distribute(
        model,
        _adamw(model.parameters()),
        mesh=mesh,
        strategy={"dp": dp, "tp": "auto"},
        **options,
    )
    assert opt is not None
    half = slice(2 * mesh.local_rank("dp"), 2 * mesh.local_rank("dp") + 2)
    norms = []
    for x, y in _batches()[:steps]:
        opt.zero_grad()
        wrapped(x[half], y[half]).backward()
        norms.append(float(wrapped.clip_grad_norm_(CLIP)))  # type: ignore[operator]
        opt.step()
    return mesh, wrapped, opt, norms


@pytest.mark.parametrize("dp", ["ddp", "zero1", "zero2", "zero3"])
def test_dp_by_tp_trains_as_one_process_with_clipping(dp: str) -> None:
    """Three clipped AdamW steps at dp2 x tp2: the norms and the full state dict (gathered
    over both axes) equal one process's on the whole batch."""
    dense, _, want_norms = _dense_run(3)
    want = dense.state_dict()

    def body(g: ProcessGroup) -> tuple[list[float], dict[str, torch.Tensor]]:
        _, wrapped, _, norms = _mesh_run(g, dp, 3)
        return norms, wrapped.state_dict()

    for norms, state in run_ranks(4, body, timeout=TIMEOUT):
        assert norms == pytest.approx(want_norms, rel=1e-5)
        assert set(state) == set(want)
        for key, value in want.items():
            torch.testing.assert_close(state[key], value, msg=key)


@pytest.mark.parametrize("dp", ["ddp", "zero2"])
def test_full_rank_powersgd_on_a_dp_by_tp_mesh_trains_as_one_process(dp: str) -> None:
    """Compression on a composed mesh: PowerSGD at full rank is the dense reduction, so the
    tensor-parallel slices, compressed over ``dp``, still train as one process."""
    dense, _, want_norms = _dense_run(3)
    want = dense.state_dict()

    def body(g: ProcessGroup) -> tuple[list[float], dict[str, torch.Tensor]]:
        full = sl.compression.PowerSGD(rank=4096, min_compression_rate=0, warmup_steps=0)
        _, wrapped, _, norms = _mesh_run(g, dp, 3, compression=full)
        assert wrapped.compression is full and full.steps == 3  # type: ignore[union-attr]
        return norms, wrapped.state_dict()

    for norms, state in run_ranks(4, body, timeout=TIMEOUT):
        assert norms == pytest.approx(want_norms, rel=1e-4)
        for key, value in want.items():
            torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=key)


def test_zero3_by_tp_checkpoints_load_into_one_process_and_into_tp4(tmp_path: Path) -> None:
    """Saved at zero3 dp2 x tp2 after two steps (ZeRO's flat parts of tensor-parallel slices,
    fused q/k/v included): one process and a tp=4 model load the saved parameters bit for
    bit, and their third step gives the loss and parameters the mesh run got (the AdamW
    state came along). The zero3 x tp run also loads a dense checkpoint back."""
    path = tmp_path / "ck"
    batches = _batches()

    def saver(g: ProcessGroup) -> tuple[dict[str, torch.Tensor], float, dict[str, torch.Tensor]]:
        mesh, wrapped, opt, _ = _mesh_run(g, "zero3", 2)
        checkpoint.save(path, model=wrapped, optimizer=opt, group=g)
        saved = {k: v.clone() for k, v in wrapped.state_dict().items()}
        x, y = batches[2]
        half = slice(2 * mesh.local_rank("dp"), 2 * mesh.local_rank("dp") + 2)
        opt.zero_grad()
        loss = wrapped(x[half], y[half])
        loss.backward()
        wrapped.clip_grad_norm_(CLIP)  # type: ignore[operator]
        opt.step()
        total = loss.detach().clone()
        mesh.group("dp").all_reduce(total, op="avg")
        return saved, float(total), wrapped.state_dict()

    saved, want_loss, want_after = run_ranks(4, saver, timeout=TIMEOUT)[0]

    def third(model: nn.Module, opt: torch.optim.Optimizer) -> float:
        x, y = batches[2]
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        clip = getattr(model, "clip_grad_norm_", None)
        if callable(clip):
            clip(CLIP)
        else:
            nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        return float(loss.detach())

    check = functools.partial(check_resumed, saved, want_loss, want_after)

    plain = _gpt()
    opt = _adamw(plain.parameters())
    checkpoint.load(path, model=plain, optimizer=opt)
    state = {k: v.clone() for k, v in plain.state_dict().items()}
    check(state, third(plain, opt), plain.state_dict())

    def tp4(g: ProcessGroup) -> tuple[dict[str, torch.Tensor], float, dict[str, torch.Tensor]]:
        mesh = sl.DeviceMesh({"tp": 4}, group=g)
        model = _gpt()
        wrapped, opt = sl.distribute(
            model, _adamw(model.parameters()), mesh=mesh, strategy={"tp": "auto"}
        )
        assert opt is not None
        checkpoint.load(path, model=wrapped, optimizer=opt, group=g)
        state = {k: v.clone() for k, v in wrapped.state_dict().items()}
        x, y = batches[2]
        opt.zero_grad()
        loss = wrapped(x, y)
        loss.backward()
        sl.clip_grad_norm_(wrapped, CLIP, group=mesh.group("tp"))
        opt.step()
        return state, float(loss.detach()), wrapped.state_dict()

    for result in run_ranks(4, tp4, timeout=TIMEOUT):
        check(*result)

    dense_path = tmp_path / "dense"
    checkpoint.save(dense_path, model=plain)

    def reload(g: ProcessGroup) -> dict[str, torch.Tensor]:
        _, wrapped, _, _ = _mesh_run(g, "zero3", 1)
        checkpoint.load(dense_path, model=wrapped, group=g)
        return wrapped.state_dict()

    for state in run_ranks(4, reload, timeout=TIMEOUT):
        for key, value in plain.state_dict().items():
            assert torch.equal(state[key], value), key


def test_a_llama_with_replicated_kv_heads_under_zero2_by_tp_trains_as_one_process() -> None:
    """A Hugging Face Llama whose one key/value head is replicated on both tp ranks
    (``Colwise(replicas=2)``), at zero2 dp2 x tp2: three clipped AdamW steps give one
    process's losses and parameters (the replicated heads' gradients are counted once in
    the norm)."""

    def run(model: nn.Module, mesh: sl.DeviceMesh | None) -> tuple[list[float], nn.Module]:
        opt: torch.optim.Optimizer | None = _adamw(model.parameters())
        if mesh is not None:
            model, opt = sl.distribute(
                model, opt, mesh=mesh, strategy={"dp": "zero2", "tp": "auto"}
            )
        assert opt is not None
        rows = slice(None) if mesh is None else slice(mesh.local_rank("dp"), None, 2)
        losses = []
        for x, _ in _batches():
            ids = (x % 128)[rows]
            opt.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            if mesh is None:
                nn.utils.clip_grad_norm_(model.parameters(), CLIP)  # the reference: torch's
            else:
                sl.clip_grad_norm_(model, CLIP)
            opt.step()
            total = loss.detach().clone()
            if mesh is not None:
                mesh.group("dp").all_reduce(total, op="avg")
            losses.append(float(total))
        return losses, model

    want_losses, dense = run(copy.deepcopy(_pristine_llama(1)), None)
    want = dense.state_dict()

    def body(g: ProcessGroup) -> tuple[list[float], dict[str, torch.Tensor]]:
        mesh = sl.DeviceMesh({"dp": 2, "tp": 2}, group=g)
        losses, model = run(copy.deepcopy(_pristine_llama(1)), mesh)
        return losses, model.state_dict()

    for losses, state in run_ranks(4, body, timeout=TIMEOUT):
        assert losses == pytest.approx(want_losses, rel=1e-5)
        for key, value in want.items():
            torch.testing.assert_close(state[key], value, msg=key)


# -- pipelines with tensor parallelism inside (3-D) ------------------------------------------------

M = 2  # micro-batches per replica


def _mesh_pipeline(
    g: ProcessGroup,
    axes: dict[str, int],
    strategy: dict[str, str],
    steps: int,
    gpt: Callable[[], TinyGPT] = _gpt,
) -> tuple[sl.DeviceMesh, nn.Module, torch.optim.Optimizer, list[float], list[float]]:
    """The built-in GPT as a chain of children on ``axes``: each dp replica steps its share of
    every batch (M micro-batches) through the pipeline, stages split over tp; clipped."""
    mesh = sl.DeviceMesh(axes, group=g)
    model = gpt()
    stage, opt = sl.distribute(
        as_sequential(model), _adamw(model.parameters()), mesh=mesh, strategy=strategy,
        microbatches=M, loss_fn=lm_loss,
    )  # fmt: skip
    assert opt is not None
    d = axes.get("dp", 1)
    rows = slice(mesh.local_rank("dp"), None, d) if d > 1 else slice(None)
    losses, norms = [], []
    for x, y in _batches()[:steps]:
        opt.zero_grad()
        loss = stage.step(x[rows], target=y[rows])  # type: ignore[operator]
        norms.append(float(stage.clip_grad_norm_(CLIP)))  # type: ignore[operator]
        opt.step()
        if d > 1:
            loss = loss.clone()
            mesh.group("dp").all_reduce(loss, op="avg")
        losses.append(float(loss))
    return mesh, stage, opt, losses, norms


def _dense_losses(steps: int) -> tuple[TinyGPT, list[float], list[float]]:
    model, _, norms = _dense_run(steps)
    fresh = _gpt()
    losses = []
    opt = _adamw(fresh.parameters())
    for x, y in _batches()[:steps]:
        opt.zero_grad()
        loss = fresh(x, y)
        loss.backward()
        nn.utils.clip_grad_norm_(fresh.parameters(), CLIP)
        opt.step()
        losses.append(float(loss.detach()))
    return model, losses, norms


def _like_one_process(
    results: list[tuple[list[float], list[float], dict[str, torch.Tensor]]],
    want_losses: list[float],
    want_norms: list[float],
    want: dict[str, torch.Tensor],
    names: dict[str, str],
) -> None:
    """Every rank's losses, clipped norms and stage state equal one process's (``names``: the
    chain's state-dict names to the model's)."""
    for losses, norms, state in results:
        assert losses == pytest.approx(want_losses, rel=1e-5)
        assert norms == pytest.approx(want_norms, rel=1e-5)
        for key, value in state.items():
            torch.testing.assert_close(value, want[names[key]], msg=key)


LAYOUTS = {
    "pp2xtp2": ({"pp": 2, "tp": 2}, {"pp": "1f1b", "tp": "auto"}),
    "dp2xpp2xtp2-ddp": ({"dp": 2, "pp": 2, "tp": 2}, {"dp": "ddp", "pp": "1f1b", "tp": "auto"}),
    "dp2xpp2xtp2-zero1": (
        {"dp": 2, "pp": 2, "tp": 2}, {"dp": "zero1", "pp": "gpipe", "tp": "auto"}
    ),
    "dp2xpp2xtp2-zero3": (
        {"dp": 2, "pp": 2, "tp": 2}, {"dp": "zero3", "pp": "1f1b", "tp": "auto"}
    ),
}  # fmt: skip


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipelines_with_tensor_parallel_stages_train_as_one_process(layout: str) -> None:
    """pp x tp and dp x pp x tp (DDP, ZeRO-1, ZeRO-3 on dp): the pipeline splits the model,
    tensor parallelism splits each stage's blocks, and the embedding and the head tied to it
    (on the first and last stages) by vocabulary. Three clipped AdamW steps: losses, norms
    (summed over every axis, each element once) and the full state dict equal one process's
    on the whole batch."""
    axes, strategy = LAYOUTS[layout]
    dense, want_losses, want_norms = _dense_losses(3)
    want = dense.state_dict()
    names = dict(zip(as_sequential(_gpt()).state_dict(), _gpt().state_dict(), strict=True))

    def body(g: ProcessGroup) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
        mesh, stage, _, losses, norms = _mesh_pipeline(g, axes, strategy, 3)
        if "tp" in axes:  # the tied embedding and head split by vocabulary, stage by stage
            kinds = {type(m) for m in stage.modules()}
            first = mesh.local_rank("pp") == 0
            assert (VocabParallelEmbedding in kinds) == first
            assert ColumnParallelLinear in kinds
        return losses, norms, stage.state_dict()

    world = 1
    for n in axes.values():
        world *= n
    _like_one_process(run_ranks(world, body, timeout=TIMEOUT), want_losses, want_norms, want, names)


def _untied_gpt() -> TinyGPT:
    """The GPT with an output head of its own, not the embedding: a chain like a Llama's."""
    model = _gpt()
    model.head.weight = nn.Parameter(model.tok.weight.detach().flip(0).clone())
    return model


def test_an_untied_head_splits_by_vocabulary_in_a_pipeline() -> None:
    """pp2 x tp2 on a chain whose head is not its embedding (a Llama as stages): the first
    stage's embedding and the last stage's head are split by vocabulary (``chain_heads``),
    and three clipped AdamW steps give one process's losses, norms and parameters."""
    dense = _untied_gpt()
    opt = _adamw(dense.parameters())
    want_losses, want_norms = [], []
    for x, y in _batches():
        opt.zero_grad()
        loss = dense(x, y)
        loss.backward()
        want_norms.append(float(nn.utils.clip_grad_norm_(dense.parameters(), CLIP)))
        opt.step()
        want_losses.append(float(loss.detach()))
    want = dense.state_dict()
    names = dict(zip(as_sequential(_gpt()).state_dict(), _gpt().state_dict(), strict=True))

    def body(g: ProcessGroup) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
        mesh, stage, _, losses, norms = _mesh_pipeline(
            g, {"pp": 2, "tp": 2}, {"pp": "1f1b", "tp": "auto"}, 3, gpt=_untied_gpt
        )
        split = {n for n, m in stage.named_modules()
                 if isinstance(m, VocabParallelEmbedding | ColumnParallelLinear)}  # fmt: skip
        head = "head.head" if mesh.local_rank("pp") == 1 else "embed.tok"
        assert any(n.endswith(head) for n in split), split
        return losses, norms, stage.state_dict()

    _like_one_process(run_ranks(4, body, timeout=TIMEOUT), want_losses, want_norms, want, names)


def test_a_3d_checkpoint_loads_into_one_process_zero3_and_tp4(tmp_path: Path) -> None:
    """Saved at zero3 dp2 x pp2 x tp2 after two steps (model and AdamW state: ZeRO parts of
    tp slices of pipeline stages): one process loads it bit for bit and its third step gives
    the mesh run's loss and parameters; zero3 on 8 ranks and tp=4 load the same values."""
    path = tmp_path / "ck"
    axes, strategy = LAYOUTS["dp2xpp2xtp2-zero3"]

    def saver(g: ProcessGroup) -> tuple[dict[str, torch.Tensor], float, dict[str, torch.Tensor]]:
        mesh, stage, opt, _, _ = _mesh_pipeline(g, axes, strategy, 2)
        assert any(isinstance(m, ColumnParallelLinear) for m in stage.modules())
        checkpoint.save(path, model=stage, optimizer=opt, group=g)
        saved = {k: v.clone() for k, v in stage.state_dict().items()}
        x, y = _batches()[2]
        rows = slice(mesh.local_rank("dp"), None, 2)
        opt.zero_grad()
        loss = stage.step(x[rows], target=y[rows]).clone()  # type: ignore[operator]
        stage.clip_grad_norm_(CLIP)  # type: ignore[operator]
        opt.step()
        mesh.group("dp").all_reduce(loss, op="avg")
        return saved, float(loss), stage.state_dict()

    saved, want_loss, want_after = run_ranks(8, saver, timeout=TIMEOUT)[0]

    dense = _gpt()
    chain = as_sequential(dense)
    opt = _adamw(dense.parameters())
    checkpoint.load(path, model=chain, optimizer=opt)
    for key, value in saved.items():
        assert torch.equal(chain.state_dict()[key], value), key
    x, y = _batches()[2]
    opt.zero_grad()
    loss = dense(x, y)
    loss.backward()
    nn.utils.clip_grad_norm_(dense.parameters(), CLIP)
    opt.step()
    assert float(loss.detach()) == pytest.approx(want_loss, rel=1e-5)
    for key, value in want_after.items():
        torch.testing.assert_close(chain.state_dict()[key], value, msg=key)

    def zero3(g: ProcessGroup) -> dict[str, torch.Tensor]:
        model = sl.ShardedDataParallel(as_sequential(_gpt()), stage=3, group=g)
        checkpoint.load(path, model=model, group=g)
        return model.state_dict()

    def tp4(g: ProcessGroup) -> dict[str, torch.Tensor]:
        model = sl.tensor_parallel(_gpt(), g)
        checkpoint.load(path, model=as_sequential(model), group=g)
        return as_sequential(model).state_dict()

    for loaded in [*run_ranks(8, zero3, timeout=TIMEOUT), *run_ranks(4, tp4, timeout=TIMEOUT)]:
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), key


# -- HSDP: ZeRO within a replica, replicas across --------------------------------------------------


@pytest.mark.parametrize(
    ("axes", "dp"),
    [
        ({"dp_replicate": 2, "dp_shard": 2}, "zero3"),
        ({"dp_replicate": 2, "dp_shard": 2}, "zero2"),
        ({"dp_replicate": 2, "dp_shard": 2, "tp": 2}, "zero3"),
    ],
    ids=["hsdp-zero3", "hsdp-zero2", "hsdp-zero3-tp2"],
)
def test_hsdp_trains_as_one_process_and_checkpoints(
    axes: dict[str, int], dp: str, tmp_path: Path
) -> None:
    """HSDP: ZeRO over dp_shard, its gradient parts averaged over the replicas on
    dp_replicate (tensor parallelism inside, too). Each data-parallel rank takes its rows of
    every batch; three clipped AdamW steps give one process's norms and parameters, and the
    checkpoint loads into one process bit for bit."""
    _, _, want_norms = _dense_run(3)
    dense = _dense_run(3)[0]
    want = dense.state_dict()
    path = tmp_path / "ck"
    strategy = {"dp_replicate": "ddp", "dp_shard": dp} | ({"tp": "auto"} if "tp" in axes else {})

    def body(g: ProcessGroup) -> tuple[list[float], dict[str, torch.Tensor]]:
        mesh = sl.DeviceMesh(axes, group=g)
        model = _gpt()
        wrapped, opt = sl.distribute(model, _adamw(model.parameters()), mesh=mesh,
                                     strategy=strategy)  # fmt: skip
        assert opt is not None
        who = 2 * mesh.local_rank("dp_replicate") + mesh.local_rank("dp_shard")
        norms = []
        for x, y in _batches():
            opt.zero_grad()
            wrapped(x[who : who + 1], y[who : who + 1]).backward()
            norms.append(float(wrapped.clip_grad_norm_(CLIP)))  # type: ignore[operator]
            opt.step()
        checkpoint.save(path, model=wrapped, optimizer=opt, group=g)
        return norms, wrapped.state_dict()

    world = 1
    for n in axes.values():
        world *= n
    for norms, state in run_ranks(world, body, timeout=TIMEOUT):
        assert norms == pytest.approx(want_norms, rel=1e-5)
        for key, value in want.items():
            torch.testing.assert_close(state[key], value, msg=key)
    plain = _gpt()
    checkpoint.load(path, model=plain, optimizer=_adamw(plain.parameters()))
    for key, value in state.items():
        assert torch.equal(plain.state_dict()[key], value), key


def test_a_vocabulary_tp_does_not_divide_trains_in_dp2_pp2_tp2_as_one_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """tp='auto' with 61 tokens on dp2 x pp2 x tp2 (ZeRO-3): the embedding and head stay whole
    on their stages instead of a refusal; losses, norms and the state equal one process's."""
    here = sys.modules[__name__]  # the helpers above build their model and batches here
    monkeypatch.setattr(here, "_gpt", _gpt61)
    monkeypatch.setattr(here, "_batches", _batches61)
    axes, strategy = LAYOUTS["dp2xpp2xtp2-zero3"]
    dense, want_losses, want_norms = _dense_losses(3)
    want = dense.state_dict()
    names = dict(zip(as_sequential(_gpt61()).state_dict(), _gpt61().state_dict(), strict=True))

    def body(g: ProcessGroup) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
        _, stage, _, losses, norms = _mesh_pipeline(g, axes, strategy, 3, gpt=_gpt61)
        assert VocabParallelEmbedding not in {type(m) for m in stage.modules()}
        return losses, norms, stage.state_dict()

    _like_one_process(run_ranks(8, body, timeout=TIMEOUT), want_losses, want_norms, want, names)
