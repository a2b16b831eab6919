"""Communication-efficient training: gradient compression with error feedback.

Pass a compressor to ``sl.distribute(..., compression=...)`` (DDP, ZeRO-1 on its all-reduce,
ZeRO-2/3 on the reduce-scatter):

- ``Int8()``, ``FP8()``: 8-bit values with a scale per block (4x fewer bytes);
- ``OneBit()``: signs with a scale per block (about 28x fewer), any optimizer;
- ``TopK(ratio=0.01)``: the largest values and their indices, all-gathered;
- ``PowerSGD(rank=4)``: a low-rank product per gradient matrix, warm-started;
- ``Cast(torch.bfloat16)``: half the bytes (what ``comm_hook="bf16"`` does).

Each keeps what it could not send (error feedback) and starts with a few uncompressed steps.
See ``shardline.optim.compression`` for the interface, to write your own.

``OneBitAdam``: Adam whose momentum travels as signs once its variance is frozen. Strategies
that communicate less often: ``distribute(strategy="local_sgd")`` (local SGD, DiLoCo;
``local_sgd``), ``distribute(strategy="async")`` (a sharded parameter server; ``async_sgd``)
and ``distribute(strategy="hogwild")`` (one host's ranks share the parameters; ``hogwild``).

``CPUAdamW``, ``CPUAdam``, ``CPUSGD``: torch's optimizers, stepped in Rust over float32
parameters in host memory (``cpu_optim``).
"""

from __future__ import annotations

from shardline.optim.compression import Compressor, Entry, resolve
from shardline.optim.cpu_optim import CPUSGD, CPUAdam, CPUAdamW
from shardline.optim.onebit_adam import OneBitAdam
from shardline.optim.powersgd import PowerSGD
from shardline.optim.quantize import FP8, Cast, Int8, OneBit, Quantizer
from shardline.optim.topk import TopK

__all__ = [
    "CPUSGD",
    "FP8",
    "CPUAdam",
    "CPUAdamW",
    "Cast",
    "Compressor",
    "Entry",
    "Int8",
    "OneBit",
    "OneBitAdam",
    "PowerSGD",
    "Quantizer",
    "TopK",
    "resolve",
]
