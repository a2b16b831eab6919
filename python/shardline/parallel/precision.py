"""Mixed precision for the sharded strategies, as one frozen policy object."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MixedPrecision"]


@dataclass(frozen=True)
class MixedPrecision:
    """How parameters are stored, computed with and reduced.

    Attributes:
        param_dtype: dtype of the gathered parameters that forward and backward compute with
            (``torch.bfloat16`` or ``torch.float16``); ``None`` keeps the model's dtype.
        reduce_dtype: dtype gradients are reduced in; ``None`` means ``param_dtype``.
        master_weights: keep an fp32 copy of this rank's shard, which the optimizer steps
            (and whose state is fp32), instead of stepping low-precision values.

    Example:
        ``sl.distribute(model, opt, strategy="zero3",
        mixed_precision=sl.MixedPrecision(param_dtype=torch.bfloat16))``
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    master_weights: bool = True

    def compute_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype forward runs in for a model stored in ``model_dtype``."""
        return self.param_dtype or model_dtype

    def reduction_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype gradients travel and are summed in."""
        return self.reduce_dtype or self.compute_dtype(model_dtype)

    def master_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype of this rank's shard (what the optimizer steps)."""
        if self.master_weights and model_dtype.is_floating_point:
            return torch.float32 if model_dtype.itemsize < 4 else model_dtype
        return model_dtype
