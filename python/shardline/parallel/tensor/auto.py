"""``plan="auto"``: tensor-parallel plans for the model shapes we recognise.

- **The built-in GPT's blocks** (``qkv``, ``proj``, an ``mlp`` of linear, activation,
  linear; ``num_heads``): q/k/v (one fused matrix: ``Colwise(pieces=3)``) and the MLP's first
  linear split by output, ``proj`` and the MLP's second by input. With
  ``sequence_parallel=True`` the blocks' norms too, and the ``nn.Sequential`` chaining them
  becomes the sequence-parallel region.
- **Llama-style attention and MLP** (Hugging Face ``q_proj``, ``k_proj``, ``v_proj``,
  ``o_proj``, ``head_dim``; ``gate_proj``, ``up_proj``, ``down_proj``): heads and key/value
  heads split (grouped-query attention keeps its groups; with fewer key/value heads than
  ranks, each rank holds the one its query heads use, shared by t / kv ranks, their
  gradients summed), ``o_proj`` and ``down_proj`` by input. With ``sequence_parallel=True``
  (Llama and GPT-2) the residual stream between the decoder layers is split along the
  sequence (``_sequence_layers``).
- **GPT-2** (Hugging Face, ``Conv1D`` layers, weights stored ``(in, out)``): ``c_attn`` (q, k
  and v fused: ``Colwise(pieces=3)``) and ``c_fc`` split by output, the ``c_proj`` after each
  by input; the attention's ``split_size`` becomes this rank's (``fix_attention``).
- **torch's own layers**: every ``nn.MultiheadAttention`` (heads split:
  ``ParallelMultiheadAttention``), and in ``nn.TransformerEncoderLayer``/``DecoderLayer``-shaped
  modules the MLP (``linear1`` by output, ``linear2`` by input).
- **The vocabulary**: an embedding tied to an output head on a model with ``loss_fn`` (the
  built-in GPT), or a Hugging Face causal LM's input and output embeddings (tied or not),
  split by vocabulary; the model's loss becomes the vocabulary-parallel one.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from shardline.errors import InvalidArgumentError
from shardline.parallel.tensor.layers import ColumnParallelLinear, is_conv1d
from shardline.parallel.tensor.styles import Colwise, Rowwise

__all__ = [
    "auto_plan",
    "chain_heads",
    "fix_attention",
    "is_hf_causal_lm",
    "splits_by_vocabulary",
    "tied_heads",
]

_log = logging.getLogger(__name__)


def splits_by_vocabulary(model: nn.Module, names: list[str] | tuple[str, ...], t: int) -> bool:
    """Whether the embeddings and heads ``names`` can be split by vocabulary over ``t`` ranks.

    A vocabulary that ``t`` does not divide (61 tokens at tp=2; GPT-2's 50,257 at any even
    tp) keeps them whole on every rank, replicated like any layer the plan leaves alone, and
    the loss stays the model's own: it trains as one process does, at the memory of a
    replicated vocabulary, and the log says so and how to split it (pad the vocabulary).
    """
    rows: dict[str, int] = {}
    for name in names:
        m = model.get_submodule(name)
        size = m.num_embeddings if isinstance(m, nn.Embedding) else m.out_features
        rows[name] = int(size)  # type: ignore[arg-type]  # an Embedding's or a Linear's
    odd = {n: v for n, v in rows.items() if v % t}
    if odd:
        _log.warning(
            "tensor_parallel: plan='auto' keeps %s whole on every rank: the vocabulary (%s) "
            "does not divide by tp=%d. To split it, pad it to a multiple of %d (for a "
            "Hugging Face model: model.resize_token_embeddings(n, pad_to_multiple_of=%d))",
            ", ".join(sorted(odd)), ", ".join(str(v) for v in sorted(set(odd.values()))), t,
            t, t,
        )  # fmt: skip
    return not odd


def _gpt_blocks(model: nn.Module, t: int, sequence_parallel: bool) -> dict[str, Any]:
    plan: dict[str, Any] = {}
    parents: set[str] = set()
    for name, m in model.named_modules():
        qkv, proj, mlp = (getattr(m, a, None) for a in ("qkv", "proj", "mlp"))
        if not (isinstance(qkv, nn.Linear) and isinstance(proj, nn.Linear)):
            continue
        if not (isinstance(mlp, nn.Sequential) and len(mlp) == 3):
            continue
        if not (isinstance(mlp[0], nn.Linear) and isinstance(mlp[2], nn.Linear)):
            continue
        heads = getattr(m, "num_heads", None)
        if not isinstance(heads, int) or heads % t:
            raise InvalidArgumentError(
                f"tensor_parallel: {name or type(m).__name__} has num_heads={heads}, not "
                f"divisible by tp={t}; use a tp size that divides the heads"
            )
        p = f"{name}." if name else ""
        plan |= {f"{p}qkv": Colwise(pieces=3), f"{p}proj": Rowwise(),
                 f"{p}mlp.0": Colwise(), f"{p}mlp.2": Rowwise()}  # fmt: skip
        if sequence_parallel:
            plan |= {f"{p}{a}": "sequence" for a in ("ln1", "ln2") if hasattr(m, a)}
            parents.add(name.rpartition(".")[0])
    if sequence_parallel and plan:
        chain = next(iter(parents)) if len(parents) == 1 else None
        if chain is None or not isinstance(model.get_submodule(chain), nn.Sequential):
            raise InvalidArgumentError(
                "tensor_parallel: plan='auto' with sequence_parallel=True needs the blocks in "
                "one nn.Sequential (the residual stream is split along the sequence around "
                "it); give a plan with 'sequence_region' on the module that chains them"
            )
        plan[chain] = "sequence_region"
    return plan


def _llama_layers(model: nn.Module, t: int, sequence_parallel: bool) -> dict[str, Any]:
    plan: dict[str, Any] = {}
    for name, m in model.named_modules():
        p = f"{name}." if name else ""
        projs = [getattr(m, a, None) for a in ("q_proj", "k_proj", "v_proj", "o_proj")]
        if all(isinstance(x, nn.Linear) for x in projs):
            head_dim = getattr(m, "head_dim", None)
            if not isinstance(head_dim, int):
                continue
            heads, kv = projs[0].out_features // head_dim, projs[1].out_features // head_dim  # type: ignore[union-attr]
            # Key/value heads fewer than t: each rank holds the one its query heads use,
            # shared by t / kv consecutive ranks (Megatron's replication).
            replicas = t // kv if kv < t and t % kv == 0 else 1
            if heads % t or (kv * replicas) % t:
                raise InvalidArgumentError(
                    f"tensor_parallel: {name} has {heads} attention heads and {kv} key/value "
                    f"heads; tp={t} must divide the heads, and divide or be a multiple of the "
                    "key/value heads"
                )
            # q, k and v share the attention's input: it enters the region once there (with
            # sequence parallelism, gathered there), its gradient reduced once, not thrice.
            col = Colwise(input="shared")
            kv_style = Colwise(replicas=replicas, input="shared")
            plan |= {f"{p}q_proj": col, f"{p}k_proj": kv_style, f"{p}v_proj": kv_style,
                     f"{p}o_proj": Rowwise(), name: "shared_input"}  # fmt: skip
        mlp = [getattr(m, a, None) for a in ("gate_proj", "up_proj", "down_proj")]
        if all(isinstance(x, nn.Linear) for x in mlp):
            col = Colwise(input="shared")  # gate and up share the MLP's input: as above
            plan |= {f"{p}gate_proj": col, f"{p}up_proj": col,
                     f"{p}down_proj": Rowwise(), name: "shared_input"}  # fmt: skip
    if plan and sequence_parallel:
        plan |= _sequence_layers(
            model, ("input_layernorm", "post_attention_layernorm"), ("self_attn", "mlp")
        )
    return plan


def _sequence_layers(
    model: nn.Module, norms: tuple[str, ...], blocks: tuple[str, ...]
) -> dict[str, Any]:
    """Sequence parallelism for decoder layers a model calls in a loop (Hugging Face's).

    Between the layers the residual stream is split along the sequence: it is split before
    the first layer and gathered after the last (``"sequence_enter"`` / ``"sequence_exit"``);
    each layer's norms run on the parts (``"sequence"``), and its attention and MLP gather
    the whole sequence at their input (``"sequence_gather"``: the reduce-scatter of the
    row-parallel layer at their end splits it again).
    """
    layers = [
        name
        for name, m in model.named_modules()
        if all(isinstance(getattr(m, a, None), nn.Module) for a in (*norms, *blocks))
    ]
    parents = {name.rpartition(".")[0] for name in layers}
    if not layers or len(parents) != 1:
        raise InvalidArgumentError(
            "tensor_parallel: plan='auto' with sequence_parallel=True needs the decoder "
            f"layers (modules with {', '.join((*norms, *blocks))}) in one list; give a plan "
            "with 'sequence_enter' / 'sequence_exit' on the first and last of them"
        )
    plan: dict[str, Any] = {}
    for name in layers:
        plan |= {f"{name}.{a}": "sequence" for a in norms}
        plan |= {f"{name}.{a}": "sequence_gather" for a in blocks}
    if len(layers) == 1:
        plan[layers[0]] = "sequence_region"
    else:
        plan |= {layers[0]: "sequence_enter", layers[-1]: "sequence_exit"}
    return plan


def _gpt2_blocks(model: nn.Module, t: int, sequence_parallel: bool) -> dict[str, Any]:
    plan: dict[str, Any] = {}
    for name, m in model.named_modules():
        p = f"{name}." if name else ""
        c_attn, c_proj, c_fc = (getattr(m, a, None) for a in ("c_attn", "c_proj", "c_fc"))
        if (
            is_conv1d(c_attn)
            and is_conv1d(c_proj)
            and isinstance(getattr(m, "split_size", None), int)
        ):
            heads = getattr(m, "num_heads", 0)
            if getattr(m, "is_cross_attention", False) or heads % t:
                raise InvalidArgumentError(
                    f"tensor_parallel: {name} has {heads} heads (cross-attention: "
                    f"{getattr(m, 'is_cross_attention', False)}); tp={t} must divide the heads "
                    "of a self-attention"
                )
            seq = "shared" if sequence_parallel else None  # the block gathered the sequence
            plan |= {f"{p}c_attn": Colwise(pieces=3, input=seq),
                     f"{p}c_proj": Rowwise()}  # fmt: skip
        elif is_conv1d(c_fc) and is_conv1d(c_proj):
            seq = "shared" if sequence_parallel else None
            plan |= {f"{p}c_fc": Colwise(input=seq), f"{p}c_proj": Rowwise()}
    if plan and sequence_parallel:
        plan |= _sequence_layers(model, ("ln_1", "ln_2"), ("attn", "mlp"))
    return plan


def _torch_layers(model: nn.Module, t: int, sequence_parallel: bool) -> dict[str, Any]:
    """The layers of torch.nn itself: ``nn.MultiheadAttention`` and the encoder/decoder layers' MLP.

    Heads split; ``linear1`` by output and ``linear2`` by input in modules shaped like
    ``nn.TransformerEncoderLayer`` / ``DecoderLayer``.
    """
    plan: dict[str, Any] = {}
    for name, m in model.named_modules():
        p = f"{name}." if name else ""
        if isinstance(m, nn.MultiheadAttention):
            if m.num_heads % t:
                raise InvalidArgumentError(
                    f"tensor_parallel: {name} has {m.num_heads} heads, not divisible by tp={t}; "
                    "use a tp size that divides the heads"
                )
            plan[name] = "attention"
        lin1, lin2 = getattr(m, "linear1", None), getattr(m, "linear2", None)
        attn = getattr(m, "self_attn", None)
        if isinstance(attn, nn.MultiheadAttention) and all(
            isinstance(x, nn.Linear) for x in (lin1, lin2)
        ):
            plan |= {f"{p}linear1": Colwise(), f"{p}linear2": Rowwise()}
    if plan and sequence_parallel:
        raise InvalidArgumentError(
            "tensor_parallel: sequence_parallel=True is not supported yet for "
            "nn.MultiheadAttention models; use sequence_parallel=False"
        )
    return plan


def fix_attention(model: nn.Module, t: int) -> None:
    """After the rewrite, attention modules count this rank's heads.

    A GPT-2 attention splits ``c_attn``'s output by its own share (``split_size``); a
    Llama-style one repeats its key/value heads for its query heads
    (``num_key_value_groups``: several when key/value heads are split too, all of its query
    heads when one is shared by several ranks).
    """
    for m in model.modules():
        c_attn = getattr(m, "c_attn", None)
        if isinstance(c_attn, ColumnParallelLinear) and hasattr(m, "split_size"):
            setattr(m, "split_size", c_attn.out_features // (3 * t))  # noqa: B010
        q, k = getattr(m, "q_proj", None), getattr(m, "k_proj", None)
        split = isinstance(q, ColumnParallelLinear) and isinstance(k, ColumnParallelLinear)
        if split and hasattr(m, "num_key_value_groups"):
            groups = q.weight.shape[0] // k.weight.shape[0]  # type: ignore[union-attr]
            setattr(m, "num_key_value_groups", groups)  # noqa: B010


def tied_heads(model: nn.Module) -> list[tuple[str, str]]:
    """(embedding, output linear) names whose weights are one tensor."""
    embeddings = {id(m.weight): n for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    return [
        (embeddings[id(m.weight)], n)
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and id(m.weight) in embeddings
    ]


def chain_heads(model: nn.Module) -> list[tuple[str, str]]:
    """(embedding, output linear) names of an untied chain's vocabulary, else ``[]``.

    A chain (a Llama as stages) that embeds a vocabulary in its first child and projects onto
    it with the last linear layer of its last child, not tied to the embedding. The embedding
    is the first child's only ``nn.Embedding`` as wide as the head's output (a position
    embedding is not).
    """
    children = list(model.named_children()) if isinstance(model, nn.Sequential) else []
    if len(children) < 2:
        return []
    (first, start), (last, end) = children[0], children[-1]
    heads = [(n, m) for n, m in end.named_modules() if isinstance(m, nn.Linear)]
    if not heads:
        return []
    head, linear = heads[-1]
    embeddings = [
        n
        for n, m in start.named_modules()
        if isinstance(m, nn.Embedding) and m.num_embeddings == linear.out_features
    ]
    if len(embeddings) != 1 or start.get_submodule(embeddings[0]).weight is linear.weight:
        return []
    return [(".".join(filter(None, (first, embeddings[0]))), ".".join(filter(None, (last, head))))]


def is_hf_causal_lm(model: nn.Module) -> bool:
    """A Hugging Face model with embeddings in and out and a settable ``loss_function``."""
    return all(hasattr(model, a) for a in ("get_input_embeddings", "get_output_embeddings")) and (
        isinstance(getattr(type(model), "loss_function", None), property)
    )


def _vocab(model: nn.Module, t: int) -> dict[str, Any]:
    """The embedding and output head split by vocabulary, when ``t`` divides it."""
    plan: dict[str, Any] = {}
    if callable(getattr(model, "loss_fn", None)):
        plan = {n: "vocab" for pair in tied_heads(model) for n in pair}
    elif is_hf_causal_lm(model):
        names = {id(m): n for n, m in model.named_modules()}
        emb, head = model.get_input_embeddings(), model.get_output_embeddings()  # type: ignore[operator]
        if isinstance(emb, nn.Embedding) and isinstance(head, nn.Linear):
            plan = {names[id(emb)]: "vocab", names[id(head)]: "vocab"}
    return plan if splits_by_vocabulary(model, list(plan), t) else {}


def auto_plan(model: nn.Module, t: int, sequence_parallel: bool) -> dict[str, Any]:
    """The plan for ``model`` (see the module docstring).

    Raises:
        InvalidArgumentError: nothing recognised, or sizes ``t`` does not divide.
    """
    plan = (
        _gpt_blocks(model, t, sequence_parallel)
        | _llama_layers(model, t, sequence_parallel)
        | _gpt2_blocks(model, t, sequence_parallel)
        | _torch_layers(model, t, sequence_parallel)
    )
    if plan:
        plan |= _vocab(model, t)
    if not plan:
        raise InvalidArgumentError(
            f"tensor_parallel: plan='auto' recognises no block in {type(model).__name__}; "
            "pass a plan {module name: 'colwise' | 'rowwise' | 'vocab' | 'sequence' | "
            "'sequence_region'}"
        )
    return plan
