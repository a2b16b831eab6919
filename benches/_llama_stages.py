"""A Hugging Face Llama as a chain of pipeline stages, and torch's own pipeline of it.

``llama_chain(model)`` is the same model (the same parameter objects) as an ``nn.Sequential``
of ``embed``, ``layer0`` ... ``layer{L-1}`` and ``head`` (final norm and output layer), each
decoder layer computing its own rotary embedding: what a pipeline splits. ``cuts`` says where
the stages start (the same for both sides of a bench), ``next_token_loss`` is the model's own
loss on one micro-batch of logits, and ``torch_pipeline`` builds this rank's stage from
torch's pieces: DTensor tensor parallelism (``parallelize_module``) on the ``tp`` axis,
``fully_shard`` on ``dp``, ``torch.distributed.pipelining``'s 1F1B on ``pp``.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


class Embed(nn.Module):
    """The token embedding: the first child of the chain."""

    def __init__(self, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.embed_tokens(ids)
        return out


class Layer(nn.Module):
    """One decoder layer with its own copy of the model's rotary embedding (no parameters)."""

    def __init__(self, layer: nn.Module, rotary: nn.Module) -> None:
        super().__init__()
        self.layer, self.rotary = layer, rotary

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        # No mask: SDPA's causal kernel, as the whole model runs without padding.
        out = self.layer(h, position_ids=pos, position_embeddings=self.rotary(h, pos))
        return out[0] if isinstance(out, tuple) else out  # transformers < 4.54 returns a tuple


class Head(nn.Module):
    """The final norm and the output layer: the last child of the chain."""

    def __init__(self, norm: nn.Module, lm_head: nn.Linear) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lm_head(self.norm(h))
        return out


def llama_chain(model: Any) -> nn.Sequential:
    """``LlamaForCausalLM`` as ``embed, layer0, ..., head``: the same parameters."""
    inner = model.model
    layers = [
        (f"layer{i}", Layer(layer, copy.deepcopy(inner.rotary_emb)))
        for i, layer in enumerate(inner.layers)
    ]
    return nn.Sequential(
        OrderedDict(
            [
                ("embed", Embed(inner.embed_tokens)),
                *layers,
                ("head", Head(inner.norm, model.lm_head)),
            ]
        )
    )


def cuts(layers: int, stages: int) -> list[str]:
    """The children that start stages 1, 2, ...: the layers spread evenly, the head counted
    as one more layer (its matrix is about one layer's; the embedding is a lookup)."""
    return [f"layer{round((layers + 1) * k / stages)}" for k in range(1, stages)]


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of each position's logits against the next token (the last
    position has none): ``LlamaForCausalLM(input_ids=ids, labels=ids).loss``."""
    target = nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


class Autocast(nn.Module):
    """Runs ``inner`` under ``torch.autocast`` (torchtitan's mixed precision without FSDP)."""

    def __init__(self, inner: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.inner, self.dtype = inner, dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = "cuda" if x.is_cuda else "cpu"
        with torch.autocast(device, dtype=self.dtype):
            out: torch.Tensor = self.inner(x)
        return out


def _tp_plan(stage: nn.Sequential) -> dict[str, Any]:
    """DTensor's plan for this stage's children, equal to ours (``tp="auto"`` in a pipeline):
    attention and MLP split, the embedding and the head by vocabulary, the logits gathered."""
    from torch.distributed.tensor import Replicate  # noqa: PLC0415
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel  # noqa: PLC0415

    plan: dict[str, Any] = {}
    for name, _ in stage.named_children():
        if name == "embed":
            plan["embed.embed_tokens"] = RowwiseParallel(input_layouts=Replicate())
        elif name == "head":
            plan["head.lm_head"] = ColwiseParallel(output_layouts=Replicate())
        else:
            p = f"{name}.layer"
            plan |= {
                f"{p}.self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")
            }
            plan |= {f"{p}.mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")}
            plan |= {
                f"{p}.self_attn.o_proj": RowwiseParallel(),
                f"{p}.mlp.down_proj": RowwiseParallel(),
            }
    return plan


def param_groups(module: nn.Module) -> list[dict[str, Any]]:
    """``module``'s parameters as two groups, DTensor slices and plain tensors: torch's
    multi-tensor AdamW takes a list of one kind only (a stage split by tensor parallelism
    without FSDP has both: its norms stay whole)."""
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    params = list(module.parameters())
    groups = [[p for p in params if isinstance(p, DTensor)]]
    groups.append([p for p in params if not isinstance(p, DTensor)])
    return [{"params": g} for g in groups if g]


@dataclass
class TorchPipeline:
    """This rank's part of torch's pipeline."""

    schedule: Any  # torch.distributed.pipelining.Schedule1F1B
    module: nn.Module  # the stage: its parameters are the optimizer's
    mesh: Any  # the (dp, pp, tp) DeviceMesh
    first: bool  # holds the first stage: step() takes the inputs
    last: bool  # holds the last stage: step() takes the targets and gives the losses


def torch_pipeline(
    chain: nn.Sequential,
    axes: dict[str, int],
    device: torch.device,
    *,
    microbatches: int,
    dtype: torch.dtype | None,
) -> TorchPipeline:
    """This rank's stage of ``chain`` built from torch's pieces on a ``(dp, pp, tp)`` mesh.

    Mixed precision (``dtype``; ``None``: all fp32) is FSDP's policy with a ``dp`` axis
    (parameters gathered in ``dtype``, gradients reduced in fp32, ``reshard_after_forward=
    False`` under a pipeline, as torchtitan does), autocast without one.
    """
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: PLC0415
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B  # noqa: PLC0415
    from torch.distributed.tensor.parallel import parallelize_module  # noqa: PLC0415

    names = ("dp", "pp", "tp")
    mesh = init_device_mesh(device.type, tuple(axes.get(n, 1) for n in names), mesh_dim_names=names)
    p, s = axes["pp"], mesh["pp"].get_local_rank()
    children = [n for n, _ in chain.named_children()]
    starts = [0, *(children.index(c) for c in cuts(len(children) - 2, p)), len(children)]
    stage = nn.Sequential(
        OrderedDict((n, chain.get_submodule(n)) for n in children[starts[s] : starts[s + 1]])
    )
    if axes.get("tp", 1) > 1:
        parallelize_module(stage, mesh["tp"], _tp_plan(stage))
    module: nn.Module = stage
    if axes.get("dp", 1) > 1:
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
        for child in stage.children():
            fully_shard(child, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)
        fully_shard(stage, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)
    elif dtype is not None:
        module = Autocast(stage, dtype)
    piece = PipelineStage(module, s, p, device, group=mesh["pp"].get_group())
    schedule = Schedule1F1B(piece, n_microbatches=microbatches, loss_fn=next_token_loss)
    return TorchPipeline(schedule, stage, mesh, s == 0, s == p - 1)
