"""Tensor parallelism against the dense layers and one process (ranks are threads).

Each parallel layer, built from a dense one, gives the dense output and, for its slice of the
weights, the dense gradients; the vocabulary-parallel loss equals ``F.cross_entropy`` on the
whole logits; ``state_dict`` holds the full tensors. The built-in GPT under
``tensor_parallel(plan="auto")`` at t = 2 and 4, with and without sequence parallelism, trains
as one process does.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import shardline as sl
from shardline import checkpoint
from shardline.comm import ProcessGroup
from shardline.examples.train import Config, TinyGPT
from shardline.parallel.tensor import (
    ColumnParallelLinear,
    Colwise,
    RowParallelLinear,
    SequenceParallelNorm,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from tests._ranks import built_once, run_ranks

TIMEOUT = 120


def _part(t: torch.Tensor, g: ProcessGroup, dim: int) -> torch.Tensor:
    return t.chunk(g.world_size, dim=dim)[g.rank]


@built_once
def _pristine_mlp() -> tuple[nn.LayerNorm, nn.Linear, nn.Linear]:
    torch.manual_seed(0)
    return nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)


def _mlp() -> tuple[nn.LayerNorm, nn.Linear, nn.Linear]:
    """Fresh copies of one set of layers (ranks are threads: no seeding in them)."""
    return copy.deepcopy(_pristine_mlp())


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_column_then_row_equals_the_dense_mlp(t: int, sp: bool) -> None:
    """norm -> column -> GELU -> row: the output, the input's gradient and each rank's slice
    of the weights' gradients are the dense ones; with sequence parallelism the input and
    output are this rank's part of the sequence and the norm's gradients are summed."""
    x = torch.randn(2, 8, 8)
    ln, up, down = _mlp()
    xd = x.clone().requires_grad_(True)
    want = down(F.gelu(up(ln(xd))))
    (want * torch.arange(8.0)).sum().backward()

    def body(g: ProcessGroup) -> None:
        ln2, up2, down2 = _mlp()
        norm = SequenceParallelNorm(ln2, g) if sp else ln2
        col = ColumnParallelLinear.from_dense(up2, g, sequence_parallel=sp)
        row = RowParallelLinear.from_dense(down2, g, sequence_parallel=sp)
        xs = (_part(x, g, 1) if sp else x).clone().requires_grad_(True)
        out = row(F.gelu(col(norm(xs))))
        torch.testing.assert_close(out, _part(want, g, 1) if sp else want)
        (out * torch.arange(8.0)).sum().backward()
        assert xs.grad is not None and xd.grad is not None
        torch.testing.assert_close(xs.grad, _part(xd.grad, g, 1) if sp else xd.grad)
        torch.testing.assert_close(col.weight.grad, _part(up.weight.grad, g, 0))
        torch.testing.assert_close(col.bias.grad, _part(up.bias.grad, g, 0))
        torch.testing.assert_close(row.weight.grad, _part(down.weight.grad, g, 1))
        torch.testing.assert_close(row.bias.grad, down.bias.grad)
        torch.testing.assert_close(ln2.weight.grad, ln.weight.grad)
        torch.testing.assert_close(ln2.bias.grad, ln.bias.grad)

    run_ranks(t, body, timeout=TIMEOUT)


def test_a_fused_weight_is_split_piece_by_piece() -> None:
    """q, k and v in one matrix (pieces=3): each rank holds its part of each, and its output
    is [its q, its k, its v]; the state dict gives the fused matrix back in dense order."""
    torch.manual_seed(0)
    qkv = nn.Linear(4, 12)
    x = torch.randn(3, 4)
    q, k, v = qkv(x).detach().chunk(3, dim=-1)

    def body(g: ProcessGroup) -> None:
        col = ColumnParallelLinear.from_dense(qkv, g, pieces=3)
        mine = col(x).detach()
        torch.testing.assert_close(mine, torch.cat([_part(z, g, 1) for z in (q, k, v)], dim=-1))
        full = col.state_dict()
        assert torch.equal(full["weight"], qkv.weight) and torch.equal(full["bias"], qkv.bias)

    run_ranks(2, body, timeout=TIMEOUT)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_vocab_parallel_embedding_equals_the_dense_lookup(sp: bool) -> None:
    torch.manual_seed(0)
    emb = nn.Embedding(12, 4)
    ids = torch.randint(0, 12, (2, 6))
    want = emb(ids)
    (want * torch.arange(4.0)).sum().backward()

    def body(g: ProcessGroup) -> None:
        mine = VocabParallelEmbedding.from_dense(emb, g, sequence_parallel=sp)
        out = mine(ids)
        torch.testing.assert_close(out, _part(want, g, 1) if sp else want)
        (out * torch.arange(4.0)).sum().backward()
        torch.testing.assert_close(mine.weight.grad, _part(emb.weight.grad, g, 0))

    run_ranks(3, body, timeout=TIMEOUT)


@pytest.mark.parametrize("t", [2, 4])
def test_vocab_parallel_cross_entropy_equals_the_dense_loss(t: int) -> None:
    """Value and gradient, from vocabulary slices; ignored targets count for nothing."""
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 16) * 4
    target = torch.randint(0, 16, (3, 5))
    target[0, 0] = target[2, 4] = -100
    ld = logits.clone().requires_grad_(True)
    want = F.cross_entropy(ld.flatten(0, 1), target.flatten())
    want.backward()
    assert ld.grad is not None

    def body(g: ProcessGroup) -> None:
        mine = _part(logits, g, -1).clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(mine, target, g)
        torch.testing.assert_close(loss, want)
        loss.backward()
        torch.testing.assert_close(mine.grad, _part(ld.grad, g, -1))
        each = vocab_parallel_cross_entropy(mine.detach(), target, g, reduction="none")
        ref = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none")
        torch.testing.assert_close(each.flatten(), ref)

    run_ranks(t, body, timeout=TIMEOUT)


@built_once
def _pristine_gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(Config(d_model=32, num_heads=4, num_layers=2, seq_len=16))


def _gpt() -> TinyGPT:
    return copy.deepcopy(_pristine_gpt())


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 256, (4, 17), generator=gen) for _ in range(3)]
    return [(r[:, :-1], r[:, 1:]) for r in rows]


def _step(model: nn.Module, opt: torch.optim.Optimizer, batch: tuple[torch.Tensor, ...]) -> float:
    opt.zero_grad()
    loss = model(*batch)
    loss.backward()
    opt.step()
    return float(loss.detach())


def _train(model: nn.Module) -> list[float]:
    # The key bias's gradient is zero in exact arithmetic (softmax does not see a shift shared
    # by all keys), so it is rounding noise, which Adam with a tiny eps turns into full-size
    # steps of either sign. A larger eps keeps that noise at the noise's size.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    return [_step(model, opt, batch) for batch in _batches()]


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_the_builtin_gpt_trains_as_one_process(t: int, sp: bool) -> None:
    """plan='auto': heads and MLP features split; the embedding and the head tied to it split
    by vocabulary, with the vocabulary-parallel loss; norms replicated (or, with sequence
    parallelism, on sequence parts). Three AdamW steps: losses and the full state dict equal
    one process's."""
    dense = _gpt()
    want_losses = _train(dense)
    want = dense.state_dict()

    def body(g: ProcessGroup) -> tuple[list[float], dict[str, torch.Tensor], int, int, str]:
        model = sl.tensor_parallel(_gpt(), g, sequence_parallel=sp)
        held = [model.blocks[0].qkv.weight.numel(), model.tok.weight.numel()]
        assert model.head.weight is model.tok.weight  # still tied: the same rows
        losses = _train(model)
        return losses, model.state_dict(), held, model.plan()

    for losses, state, held, plan in run_ranks(t, body, timeout=TIMEOUT):
        assert losses == pytest.approx(want_losses, rel=1e-5)
        assert set(state) == set(want)
        for key, value in want.items():
            torch.testing.assert_close(state[key], value, msg=key)
        # Each rank holds 1/t of a split weight: q/k/v, and the vocabulary.
        assert [h * t for h in held] == [3 * 32 * 32, 256 * 32]
        assert "blocks.0.qkv: Colwise(pieces=3" in plan and "tok: vocab" in plan
        assert "pos.weight" in plan.split("replicated")[1]


def test_a_state_dict_loads_back_into_the_slices() -> None:
    """load_state_dict takes full tensors (a dense model's) and keeps this rank's slices."""
    other = _gpt()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    want = other.state_dict()

    def body(g: ProcessGroup) -> dict[str, torch.Tensor]:
        model = sl.tensor_parallel(_gpt(), g)
        model.load_state_dict(want)
        return model.state_dict()

    for state in run_ranks(2, body, timeout=TIMEOUT):
        for key, value in want.items():
            assert torch.equal(state[key], value), key


def test_plans_that_cannot_work_are_refused_before_any_change() -> None:
    def attempt(plan: Any, t: int = 2, heads: int = 4) -> None:
        torch.manual_seed(0)
        pristine = TinyGPT(Config(d_model=24, num_heads=heads, num_layers=1, seq_len=8))

        def body(g: ProcessGroup) -> None:
            model = copy.deepcopy(pristine)
            before = [p.clone() for p in model.parameters()]
            try:
                sl.tensor_parallel(model, g, plan)
            finally:
                assert all(
                    torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
                )

        run_ranks(t, body, timeout=TIMEOUT)

    with pytest.raises(AssertionError, match=r"num_heads=3, not divisible by tp=2"):
        attempt("auto", heads=3)
    with pytest.raises(AssertionError, match=r"names \['blocks\.9\.qkv'\], which TinyGPT"):
        attempt({"blocks.9.qkv": "colwise"})
    with pytest.raises(AssertionError, match=r"needs an nn\.Linear; blocks\.0\.ln1 is a LayerNorm"):
        attempt({"blocks.0.ln1": "colwise"})
    with pytest.raises(AssertionError, match=r"'diagonal' is not a style"):
        attempt({"blocks.0.qkv": "diagonal"})
    with pytest.raises(AssertionError, match=r"blocks\.0\.mlp\.0 has 96 output features, which"):
        attempt({"blocks.0.mlp.0": "colwise"}, t=5)
    with pytest.raises(AssertionError, match=r"72 output features \(3 pieces of them\)"):
        attempt({"blocks.0.qkv": Colwise(pieces=3)}, t=5)


def check_resumed(
    saved: dict[str, torch.Tensor],
    want_loss: float,
    want_after: dict[str, torch.Tensor],
    state: dict[str, torch.Tensor],
    loss: float,
    after: dict[str, torch.Tensor],
) -> None:
    """A layout that loaded a checkpoint holds the saved tensors bit for bit, and its next
    step gives the saving run's loss and parameters."""
    for key, value in saved.items():
        assert torch.equal(state[key], value), key
    assert loss == pytest.approx(want_loss, rel=1e-5)
    for key, value in want_after.items():
        torch.testing.assert_close(after[key], value, msg=key)


def test_checkpoints_reshard_between_tp_layouts_and_one_process(tmp_path: Path) -> None:
    """Saved at tp=2 (model and AdamW state) after two steps: loaded into one process and at
    tp=4, the model is the saved one bit for bit, and the third step gives the loss and
    parameters the tp=2 run got (the optimizer state came along, fused q/k/v pieces too)."""
    batches = _batches()
    path = tmp_path / "ck"

    def saver(g: ProcessGroup) -> tuple[dict[str, torch.Tensor], float, dict[str, torch.Tensor]]:
        model = sl.tensor_parallel(_gpt(), g)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
        for batch in batches[:2]:
            _step(model, opt, batch)
        checkpoint.save(path, model=model, optimizer=opt, group=g)
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        loss = _step(model, opt, batches[2])
        return saved, loss, model.state_dict()

    saved, want_loss, want_after = run_ranks(2, saver, timeout=TIMEOUT)[0]

    check = functools.partial(check_resumed, saved, want_loss, want_after)

    plain = _gpt()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, eps=1e-4)
    checkpoint.load(path, model=plain, optimizer=opt)
    state = {k: v.clone() for k, v in plain.state_dict().items()}
    check(state, _step(plain, opt, batches[2]), plain.state_dict())

    def loader(g: ProcessGroup) -> tuple[dict[str, torch.Tensor], float, dict[str, torch.Tensor]]:
        model = sl.tensor_parallel(_gpt(), g)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
        checkpoint.load(path, model=model, optimizer=opt, group=g)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        return state, _step(model, opt, batches[2]), model.state_dict()

    for result in run_ranks(4, loader, timeout=TIMEOUT):
        check(*result)


@built_once
def _pristine_llama(kv: int = 4) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=kv, max_position_embeddings=32,
        attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _train_hf(model: nn.Module) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    losses = []
    for x, _ in _batches():
        ids = x % 128
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize(("t", "kv"), [(2, 4), (4, 4), (4, 2), (2, 1)])
def test_a_llama_from_transformers_trains_as_one_process(t: int, kv: int, tmp_path: Path) -> None:
    """A Hugging Face Llama with grouped-query attention (8 heads, ``kv`` key/value heads)
    under plan='auto': q/k/v/o and gate/up/down split, embeddings and the output head split
    by vocabulary with the vocabulary-parallel loss inside, so ``.loss`` is the dense one.
    With fewer key/value heads than ranks, each is held by the t / kv ranks whose query heads
    use it. Three AdamW steps equal one process; the checkpoint loads into the dense model."""
    dense = copy.deepcopy(_pristine_llama(kv))
    want_losses = _train_hf(dense)
    want = dense.state_dict()

    def body(g: ProcessGroup) -> tuple[list[float], dict[str, torch.Tensor], str, int]:
        model = sl.tensor_parallel(copy.deepcopy(_pristine_llama(kv)), g)
        logits = model(input_ids=_batches()[0][0][:, :4] % 128).logits
        losses = _train_hf(model)
        checkpoint.save(tmp_path / "ck", model=model, group=g)
        return losses, model.state_dict(), model.plan(), logits.shape[-1]

    results = run_ranks(t, body, timeout=TIMEOUT)
    for losses, state, plan, vocab in results:
        assert losses == pytest.approx(want_losses, rel=1e-5)
        for key, value in want.items():
            torch.testing.assert_close(state[key], value, msg=key)
        assert vocab == 128 // t  # .logits: this rank's vocabulary slice
        k_proj = "model.layers.0.self_attn.k_proj: Colwise(pieces=1, gather_output=False"
        assert f"{k_proj}, replicas={max(1, t // kv)}," in plan
        assert "model.embed_tokens: vocab" in plan and "lm_head: vocab" in plan
    plain = copy.deepcopy(_pristine_llama(kv))
    checkpoint.load(tmp_path / "ck", model=plain)
    for key, value in results[0][1].items():
        assert torch.equal(plain.state_dict()[key], value), key


def test_dp_by_tp_on_one_mesh_trains_as_one_process_and_checkpoints(tmp_path: Path) -> None:
    """sl.distribute(mesh={dp: 2, tp: 2}, strategy={dp: ddp, tp: auto}) on 4 ranks: each
    replica takes half of the global batch, the optimizer built from the dense model is
    rebound to the slices, and three AdamW steps equal one process on the whole batch. A
    checkpoint saved there loads into one process bit for bit."""
    dense = _gpt()
    _train(dense)  # the whole batch each step
    want = dense.state_dict()
    path = tmp_path / "ck"

    def body(g: ProcessGroup) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        mesh = sl.DeviceMesh({"dp": 2, "tp": 2}, group=g)
        model = _gpt()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
        wrapped, opt = sl.distribute(model, opt, mesh=mesh, strategy={"dp": "ddp", "tp": "auto"})
        assert opt is not None
        half = slice(2 * mesh.local_rank("dp"), 2 * mesh.local_rank("dp") + 2)
        for x, y in _batches():
            opt.zero_grad()
            wrapped(x[half], y[half]).backward()
            opt.step()
        checkpoint.save(path, model=wrapped, optimizer=opt, group=g)
        return wrapped.state_dict(), model.state_dict()

    results = run_ranks(4, body, timeout=TIMEOUT)
    for state, _ in results:
        for key, value in want.items():
            torch.testing.assert_close(state[key], value, msg=key)
    plain = _gpt()
    checkpoint.load(path, model=plain)
    for key, value in results[0][1].items():
        assert torch.equal(plain.state_dict()[key], value), key

    def refused(g: ProcessGroup) -> None:
        mesh = sl.DeviceMesh({"dp": 2, "tp": 2}, group=g)
        with pytest.raises(sl.InvalidArgumentError, match=r"zero2 does not take"):
            sl.distribute(_gpt(), mesh=mesh, strategy={"dp": "zero2", "tp": "auto"},
                          bucket_cap_mb=1)  # fmt: skip
        only_tp = sl.DeviceMesh({"tp": 4}, group=g)
        with pytest.raises(sl.InvalidArgumentError, match=r"\['bucket_cap_mb'\] are data par"):
            sl.distribute(_gpt(), mesh=only_tp, strategy={"tp": "auto"}, bucket_cap_mb=1)

    run_ranks(4, refused, timeout=TIMEOUT)


# torch.compile's resume after a graph break (our collectives run eagerly) reads .grad of the
# non-leaf tensors it hands over, which makes torch warn; nothing is wrong.
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_bf16_autocast_and_torch_compile_of_a_tp_model() -> None:
    """Under bf16 autocast the tp=2 GPT's loss and gradients stay within bf16's rounding of
    one process under autocast (fp32 weights; bf16 activations cross the region edges), and
    torch.compile (aot_eager) of the tp model gives its eager loss and gradients."""
    x, y = _batches()[0]
    dense = _gpt()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = dense(x, y)
    want.backward()

    def body(g: ProcessGroup) -> None:
        model = sl.tensor_parallel(_gpt(), g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, y)
        torch.testing.assert_close(loss, want, rtol=2e-2, atol=2e-2)
        loss.backward()
        full = _part(dense.blocks[0].mlp[0].weight.grad, g, 0)
        got = model.blocks[0].mlp[0].weight.grad
        assert torch.nn.functional.cosine_similarity(got.flatten(), full.flatten(), dim=0) > 0.99
        model.zero_grad()
        eager = model(x, y)
        eager.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        compiled = torch.compile(model, backend="aot_eager")
        again = compiled(x, y)
        again.backward()
        torch.testing.assert_close(again, eager)
        for p, want_grad in zip(model.parameters(), grads, strict=True):
            torch.testing.assert_close(p.grad, want_grad)

    run_ranks(2, body, timeout=TIMEOUT)


@built_once
def _pristine_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg)


@pytest.mark.parametrize("t", [2, 4])
def test_gpt2_with_conv1d_layers_trains_as_one_process(t: int, tmp_path: Path) -> None:
    """GPT-2 (transformers' Conv1D layers, weights stored (in, out); q/k/v fused in c_attn;
    its head tied to the token embedding) under plan='auto': three AdamW steps equal one
    process, the state dict keeps the Conv1D layout, and a checkpoint loads into the dense
    model bit for bit."""
    dense = copy.deepcopy(_pristine_gpt2())
    want_losses = _train_hf(dense)
    want = dense.state_dict()

    def body(g: ProcessGroup) -> tuple[list[float], dict[str, torch.Tensor], str]:
        model = sl.tensor_parallel(copy.deepcopy(_pristine_gpt2()), g)
        assert model.lm_head.weight is model.transformer.wte.weight
        losses = _train_hf(model)
        checkpoint.save(tmp_path / "ck", model=model, group=g)
        return losses, model.state_dict(), model.plan()

    results = run_ranks(t, body, timeout=TIMEOUT)
    for losses, state, plan in results:
        assert losses == pytest.approx(want_losses, rel=1e-5)
        for key, value in want.items():
            assert state[key].shape == value.shape, key
            torch.testing.assert_close(state[key], value, msg=key)
        assert "transformer.h.0.attn.c_attn: Colwise(pieces=3" in plan
    plain = copy.deepcopy(_pristine_gpt2())
    checkpoint.load(tmp_path / "ck", model=plain)
    for key, value in results[0][1].items():
        assert torch.equal(plain.state_dict()[key], value), key


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_hf_models_with_sequence_parallelism_train_as_one_process(t: int, arch: str) -> None:
    """sequence_parallel=True on a transformers Llama (grouped-query attention) and GPT-2:
    the residual stream between decoder layers split along the sequence (norms on the parts,
    attention and MLP gathering the sequence at their input and reduce-scattering it at
    their end). Three AdamW steps give one process's losses and parameters."""
    make = (lambda: _pristine_llama(2)) if arch == "llama" else _pristine_gpt2
    dense = copy.deepcopy(make())
    want_losses = _train_hf(dense)
    want = dense.state_dict()

    def body(g: ProcessGroup) -> tuple[list[float], dict[str, torch.Tensor], str]:
        model = sl.tensor_parallel(copy.deepcopy(make()), g, sequence_parallel=True)
        return _train_hf(model), model.state_dict(), model.plan()

    for losses, state, plan in run_ranks(t, body, timeout=TIMEOUT):
        assert losses == pytest.approx(want_losses, rel=1e-5)
        for key, value in want.items():
            torch.testing.assert_close(state[key], value, msg=key)
        assert "sequence_enter" in plan and "sequence_gather" in plan


def test_layers_sharing_an_input_reduce_its_gradient_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a Llama layer q, k and v share the attention's input, gate and up the MLP's: each
    input's gradient is all-reduced once (two per layer, and one for the embedding), not
    once per column-parallel layer (five per layer), as DTensor's per-module plans do."""
    _pristine_llama(4)  # built once, before the ranks (threads) copy it
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    counts: dict[int, int] = {}
    original = ProcessGroup.all_reduce

    def counting(self: ProcessGroup, *args: Any, **kwargs: Any) -> Any:
        counts[self.rank] = counts.get(self.rank, 0) + 1
        return original(self, *args, **kwargs)

    def body(g: ProcessGroup) -> int:
        model = sl.tensor_parallel(copy.deepcopy(_pristine_llama(4)), g)
        loss = model(input_ids=ids, labels=ids).loss
        g.barrier()
        before = counts.get(g.rank, 0)
        loss.backward()
        return counts[g.rank] - before

    monkeypatch.setattr(ProcessGroup, "all_reduce", counting)
    assert run_ranks(2, body, timeout=TIMEOUT) == [2 * 2 + 1] * 2


def test_shared_inputs_overlap_their_all_reduce_with_the_weight_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The shared input's all-reduce starts before the weight gradients of q, k, v, gate and
    up are computed (asynchronously, waited for after them), and the gradients equal those
    of the same model with the overlap off."""
    from shardline.parallel.tensor import overlap

    _pristine_llama(4)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    started: dict[int, int] = {}
    original = ProcessGroup.all_reduce

    def counting(self: ProcessGroup, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("async_op"):
            started[self.rank] = started.get(self.rank, 0) + 1
        return original(self, *args, **kwargs)

    def grads(g: ProcessGroup) -> dict[str, torch.Tensor]:
        model = sl.tensor_parallel(copy.deepcopy(_pristine_llama(4)), g)
        model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    monkeypatch.setattr(ProcessGroup, "all_reduce", counting)
    overlapped = run_ranks(2, grads, timeout=TIMEOUT)
    assert started == {0: 4, 1: 4}  # 2 layers x (attention, MLP)
    monkeypatch.setattr(overlap, "plain_call", lambda x: False)
    plain = run_ranks(2, grads, timeout=TIMEOUT)
    for got, want in zip(overlapped, plain, strict=True):
        assert got.keys() == want.keys()
        for name in got:
            torch.testing.assert_close(got[name], want[name], msg=name)


@built_once
def _pristine_gpt61() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(Config(d_model=32, num_heads=4, num_layers=2, seq_len=16, vocab=61))


def _gpt61() -> TinyGPT:
    """The GPT with a vocabulary of 61 tokens: no tp size above 1 divides it. (Built once and
    copied: ranks are threads, and seeding the shared generator in each would race.)"""
    return copy.deepcopy(_pristine_gpt61())


def _batches61() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 61, (4, 17), generator=gen) for _ in range(3)]
    return [(r[:, :-1], r[:, 1:]) for r in rows]


def test_auto_keeps_a_vocabulary_tp_does_not_divide_whole_and_trains_as_one_process(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """plan='auto' never refuses a model for its vocabulary: 61 tokens at tp=2 keep the tied
    embedding and head whole on each rank (heads and MLP still split), the log says why and
    how to split it, and three AdamW steps equal one process's."""
    dense = _gpt61()
    opt = torch.optim.AdamW(dense.parameters(), lr=1e-2, eps=1e-4)
    want_losses = [_step(dense, opt, batch) for batch in _batches61()]
    want = dense.state_dict()

    def body(g: ProcessGroup) -> tuple[list[float], dict[str, torch.Tensor], str]:
        model = sl.tensor_parallel(_gpt61(), g)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
        losses = [_step(model, opt, batch) for batch in _batches61()]
        return losses, model.state_dict(), model.plan()

    with caplog.at_level("WARNING", logger="shardline.parallel.tensor.auto"):
        results = run_ranks(2, body, timeout=TIMEOUT)
    for losses, state, plan in results:
        assert losses == pytest.approx(want_losses, rel=1e-5)
        for key, value in want.items():
            torch.testing.assert_close(state[key], value, msg=key)
        assert "blocks.0.qkv: Colwise(pieces=3" in plan and "tok: vocab" not in plan
    assert "the vocabulary (61) does not divide by tp=2" in caplog.text
    assert "pad it to a multiple of 2" in caplog.text
