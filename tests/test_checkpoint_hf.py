"""A real client of consolidated checkpoints: Hugging Face ``transformers``.

A GPT-2 trained one step under zero3 on 2 ranks is saved, consolidated, and loaded with
``GPT2LMHeadModel.from_pretrained``: its weights must equal ours bit for bit (the tied
``lm_head`` included, which the checkpoint stores once), and its loss must equal that of one
process trained on the whole batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import shardline as sl
from shardline import checkpoint
from tests._ranks import run_ranks

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face client test needs transformers (pip install .[test])"
)

pytestmark = pytest.mark.usefixtures("native")


def test_zero3_checkpoint_consolidates_into_a_transformers_model(tmp_path: Path) -> None:
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )  # fmt: skip  (no dropout: the oracle is one process on the whole batch)
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(cfg)
    copies = [transformers.GPT2LMHeadModel(cfg) for _ in range(2)]
    for c in copies:
        c.load_state_dict(ref.state_dict())
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))

    def body(g: Any) -> dict[str, torch.Tensor]:
        opt = torch.optim.AdamW(copies[g.rank].parameters(), lr=1e-2)
        model, opt = sl.distribute(copies[g.rank], opt, strategy="zero3", group=g, unit_mb=0.01)
        mine = x[2 * g.rank : 2 * g.rank + 2]
        model(mine, labels=mine).loss.backward()
        opt.step()
        checkpoint.save(tmp_path / "ck", model=model, optimizer=opt, group=g)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    ours = run_ranks(2, body, timeout=120)[0]
    checkpoint.consolidate(tmp_path / "ck", tmp_path / "hf")
    # consolidate wrote the model's config.json beside the weights: from_pretrained takes it
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    assert hf.config.n_embd == 32 and hf.config.n_layer == 2
    for k, v in hf.state_dict().items():
        assert torch.equal(v, ours[k]), k
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()

    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref(x, labels=x).loss.backward()
    opt.step()
    with torch.no_grad():
        torch.testing.assert_close(hf(x, labels=x).loss, ref(x, labels=x).loss)


def test_a_tensor_parallel_zero3_llama_consolidates_into_from_pretrained(tmp_path: Path) -> None:
    """A Llama with one key/value head, trained one step at zero3 dp2 x tp2 (its key/value
    head replicated on both tp ranks, q/k/v/o and the MLP split, the vocabulary split) and
    saved: the consolidated files load with ``LlamaForCausalLM.from_pretrained`` into weights
    equal to ours bit for bit."""
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=16,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg)
    copies = [transformers.LlamaForCausalLM(cfg) for _ in range(4)]
    for c in copies:
        c.load_state_dict(ref.state_dict())
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))

    def body(g: Any) -> dict[str, torch.Tensor]:
        mesh = sl.DeviceMesh({"dp": 2, "tp": 2}, group=g)
        model = copies[g.rank]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = sl.distribute(model, opt, mesh=mesh, strategy={"dp": "zero3", "tp": "auto"})
        assert opt is not None
        rows = x[2 * mesh.local_rank("dp") : 2 * mesh.local_rank("dp") + 2]
        model(input_ids=rows, labels=rows).loss.backward()
        opt.step()
        checkpoint.save(tmp_path / "ck", model=model, optimizer=opt, group=g)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    ours = run_ranks(4, body, timeout=120)[0]
    checkpoint.consolidate(tmp_path / "ck", tmp_path / "hf")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    assert hf.config.num_key_value_heads == 1
    assert set(hf.state_dict()) == set(ours)
    for k, v in hf.state_dict().items():
        assert torch.equal(v, ours[k]), k
