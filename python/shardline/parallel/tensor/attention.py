"""``nn.MultiheadAttention`` with its heads split across a tensor-parallel group.

``ParallelMultiheadAttention.from_dense(mha, group)`` keeps this rank's ``num_heads / t``
heads: the fused input projection (``in_proj_weight``, q, k and v in one matrix) is split
piece by piece, as a ``ColumnParallelLinear`` with three pieces does, and ``out_proj`` becomes
a ``RowParallelLinear``. The call is ``nn.MultiheadAttention``'s: ``(query, key, value,
key_padding_mask=None, need_weights=True, attn_mask=None, average_attn_weights=True,
is_causal=False)`` -> ``(output, weights)``, batch-first or not, and the module's state dict
has the dense names and shapes (``in_proj_weight``, ``out_proj.weight``, ...), so
``nn.TransformerEncoderLayer`` and friends run it unchanged and checkpoints load into the
dense model. Attention weights, when asked for, are the dense ones (averaged over all heads,
or all heads gathered).

Supported: the same embedding size for query, key and value, no ``bias_k``/``bias_v``, no
``add_zero_attn`` (the tensor-parallel plan refuses the others by name). Dropout applies to
this rank's heads, as in the dense module it applies to each head independently.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from shardline.comm.group import ProcessGroup
from shardline.errors import InvalidArgumentError
from shardline.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from shardline.parallel.tensor.regions import copy_to, gather_from, reduce_from

__all__ = ["ParallelMultiheadAttention", "unsupported"]


def unsupported(mha: nn.MultiheadAttention) -> str | None:
    """Why ``mha`` cannot be split here, or ``None``."""
    if not mha._qkv_same_embed_dim:
        return "key/value embedding sizes differ from the query's (kdim/vdim)"
    if mha.bias_k is not None or mha.add_zero_attn:
        return "add_bias_kv / add_zero_attn"
    return None


class ParallelMultiheadAttention(nn.Module):
    """This rank's heads of an ``nn.MultiheadAttention`` (see the module docstring).

    Attributes:
        embed_dim, num_heads, head_dim, dropout, batch_first: The dense module's.
        group: The tensor-parallel group.
    """

    # Attributes ``nn.TransformerEncoderLayer`` reads to choose its fused fast path; the
    # fused kernels would use the sliced weights as if whole, so the fast path stays off.
    _qkv_same_embed_dim = False

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        group: ProcessGroup,
        *,
        bias: bool = True,
        dropout: float = 0.0,
        batch_first: bool = False,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        t = group.world_size
        if num_heads % t or embed_dim % num_heads:
            raise InvalidArgumentError(
                f"ParallelMultiheadAttention: num_heads={num_heads} must divide by tp={t} and "
                f"divide embed_dim={embed_dim}; use a tp size that divides the heads"
            )
        self.embed_dim, self.num_heads, self.group = embed_dim, num_heads, group
        self.head_dim, self.dropout, self.batch_first = embed_dim // num_heads, dropout, batch_first
        # The q/k/v projection as a three-piece column-parallel layer, kept off the module
        # tree: its tensors are this module's, under the dense names.
        inner = ColumnParallelLinear(embed_dim, 3 * embed_dim, group, bias=bias, pieces=3,
                                     device=device, dtype=dtype)  # fmt: skip
        self.__dict__["_in"] = inner
        self.in_proj_weight = inner.weight
        self.in_proj_bias = inner.bias
        self.out_proj = RowParallelLinear(embed_dim, embed_dim, group, bias=bias,
                                          device=device, dtype=dtype)  # fmt: skip

    @classmethod
    def from_dense(
        cls, mha: nn.MultiheadAttention, group: ProcessGroup
    ) -> ParallelMultiheadAttention:
        """This rank's heads of ``mha``'s weights."""
        why = unsupported(mha)
        if why is not None:
            raise InvalidArgumentError(f"ParallelMultiheadAttention: {why} is not supported")
        w = mha.in_proj_weight
        out = cls(mha.embed_dim, mha.num_heads, group, bias=mha.in_proj_bias is not None,
                  dropout=mha.dropout, batch_first=mha.batch_first, device=w.device,
                  dtype=w.dtype)  # fmt: skip
        inner = out._inner
        with torch.no_grad():
            inner.weight.copy_(inner._mine("weight", w))
            if inner.bias is not None and mha.in_proj_bias is not None:
                inner.bias.copy_(inner._mine("bias", mha.in_proj_bias))
        out.out_proj = RowParallelLinear.from_dense(mha.out_proj, group)
        return out

    @property
    def _inner(self) -> ColumnParallelLinear:
        """The q/k/v projection (its parameters are this module's own)."""
        inner: ColumnParallelLinear = self.__dict__["_in"]
        return inner

    # -- state: the dense names ----------------------------------------------------------------

    _NAMES: ClassVar[dict[str, str]] = {"in_proj_weight": "weight", "in_proj_bias": "bias"}

    def sharded_state_dict(self) -> dict[str, Any]:
        """The strategy contract: q/k/v blocks of the dense tensors, and ``out_proj``'s."""
        inner = self._inner.sharded_state_dict()
        out = {ours: inner[theirs] for ours, theirs in self._NAMES.items() if theirs in inner}
        out.update({f"out_proj.{k}": v for k, v in self.out_proj.sharded_state_dict().items()})
        return out

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        full: dict[str, torch.Tensor] = {}
        self._inner._save_to_state_dict(full, "", keep_vars)
        for ours, theirs in self._NAMES.items():
            if theirs in full:
                destination[prefix + ours] = full[theirs]

    def _load_from_state_dict(
        self,
        state_dict: Any,
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        mine = {theirs: state_dict[prefix + ours] for ours, theirs in self._NAMES.items()
                if prefix + ours in state_dict}  # fmt: skip
        missing: list[str] = []
        self._inner._load_from_state_dict(mine, "", local_metadata, strict, missing, [], error_msgs)
        inv = {theirs: ours for ours, theirs in self._NAMES.items()}
        missing_keys += [prefix + inv[k] for k in missing]

    # -- forward --------------------------------------------------------------------------------

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``nn.MultiheadAttention.forward`` over this rank's heads; the output is whole."""
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = (z.unsqueeze(0 if self.batch_first else 1)
                                 for z in (query, key, value))  # fmt: skip
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        if not self.batch_first:
            query, key, value = (z.transpose(0, 1) for z in (query, key, value))
        q, k, v = self._project(query, key, value)
        b, n, s = q.shape[0], q.shape[2], k.shape[2]
        mask = self._mask(attn_mask, key_padding_mask, b, n, s, q.dtype)
        if is_causal and mask is None:
            mask = torch.full((n, s), -torch.inf, dtype=q.dtype, device=q.device).triu(1)
        p = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            scores = q @ k.transpose(-2, -1) / self.head_dim**0.5
            probs = torch.softmax(scores if mask is None else scores + mask, dim=-1)
            probs = F.dropout(probs, p) if p else probs
            y = probs @ v
            if average_attn_weights:  # the mean over every head: a sum over the ranks
                weights = reduce_from(probs.sum(dim=1), self.group) / self.num_heads
            else:
                weights = gather_from(probs, self.group, dim=1)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        y = self.out_proj(y.transpose(1, 2).reshape(b, n, -1))
        if not self.batch_first:
            y = y.transpose(0, 1)
        if unbatched:
            y = y.squeeze(0 if self.batch_first else 1)
            weights = weights.squeeze(0) if weights is not None else None
        return y, weights

    def _project(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's heads of q, k and v, each ``(batch, heads here, length, head_dim)``."""
        w, bias = self.in_proj_weight, self.in_proj_bias
        if query is key and key is value:  # self-attention: one product
            q, k, v = F.linear(copy_to(query, self.group), w, bias).chunk(3, dim=-1)
        else:
            ws = w.chunk(3, dim=0)
            bs = bias.chunk(3) if bias is not None else (None, None, None)
            kv_in = copy_to(key, self.group)
            v_in = kv_in if value is key else copy_to(value, self.group)
            q = F.linear(copy_to(query, self.group), ws[0], bs[0])
            k, v = F.linear(kv_in, ws[1], bs[1]), F.linear(v_in, ws[2], bs[2])
        heads = self.num_heads // self.group.world_size
        return tuple(  # type: ignore[return-value]
            z.reshape(z.shape[0], z.shape[1], heads, self.head_dim).transpose(1, 2)
            for z in (q, k, v)
        )

    def _mask(
        self,
        attn_mask: torch.Tensor | None,
        key_padding_mask: torch.Tensor | None,
        b: int,
        n: int,
        s: int,
        dtype: torch.dtype,
    ) -> torch.Tensor | None:
        """One additive mask ``(b or 1, heads here or 1, n, s)`` from torch's two.

        Each marks where attention is not allowed: True, or ``-inf``.
        """
        out: torch.Tensor | None = None
        for m, shape in ((attn_mask, None), (key_padding_mask, (b, 1, 1, s))):
            if m is None:
                continue
            add = (torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(m, -torch.inf)
                   if m.dtype == torch.bool else m.to(dtype))  # fmt: skip
            if shape is not None:
                add = add.reshape(shape)
            elif add.dim() == 3:  # (b * num_heads, n, s): this rank's heads of each
                heads, r = self.num_heads // self.group.world_size, self.group.rank
                add = add.reshape(b, self.num_heads, n, s)[:, r * heads : (r + 1) * heads]
            out = add if out is None else out + add
        return out

    def extra_repr(self) -> str:  # noqa: D102
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads} (this rank: "
            f"{self.num_heads // self.group.world_size}), tp={self.group.world_size}, "
            f"batch_first={self.batch_first}"
        )
