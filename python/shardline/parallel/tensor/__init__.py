"""Tensor parallelism: layers too wide for one device split across ranks (Megatron-style).

- ``regions``: the communication at a region's edges as autograd functions (``copy_to``,
  ``reduce_from``, ``gather_from``, ``split_to``; sequence parallel ``gather_seq``,
  ``scatter_seq``), over our ``ProcessGroup``: native engine on CPU, NCCL on GPUs.
- ``layers``: ``ColumnParallelLinear``, ``RowParallelLinear``, ``VocabParallelEmbedding``,
  ``SequenceParallelNorm``, each built from the dense layer.
- ``attention``: ``ParallelMultiheadAttention``, ``nn.MultiheadAttention`` with its heads split.
- ``loss``: ``vocab_parallel_cross_entropy``, from vocabulary-split logits, never gathered.
- ``plan``: ``tensor_parallel(model, group, plan)`` rewrites a model's layers in place.
"""

from __future__ import annotations

from shardline.parallel.tensor.attention import ParallelMultiheadAttention
from shardline.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelNorm,
    VocabParallelEmbedding,
)
from shardline.parallel.tensor.loss import vocab_parallel_cross_entropy
from shardline.parallel.tensor.plan import Colwise, Rowwise, tensor_parallel

__all__ = [
    "ColumnParallelLinear",
    "Colwise",
    "ParallelMultiheadAttention",
    "RowParallelLinear",
    "Rowwise",
    "SequenceParallelNorm",
    "VocabParallelEmbedding",
    "tensor_parallel",
    "vocab_parallel_cross_entropy",
]
