"""Optimizers that strategies step.

- ``CPUAdamW``, ``CPUAdam``, ``CPUSGD``: torch's optimizers, stepped in Rust over float32
  parameters in host memory (``cpu_optim``).
- ``OneBitAdam``: Adam whose momentum travels as signs once its variance is frozen
  (``onebit_adam``).

Gradient compressors live in ``shardline.compression``; the strategies that communicate less
often (local SGD, DiLoCo, asynchronous SGD, Hogwild) in ``shardline.parallel.replica``.
"""

from __future__ import annotations

from shardline.optim.cpu_optim import CPUSGD, CPUAdam, CPUAdamW
from shardline.optim.onebit_adam import OneBitAdam

__all__ = ["CPUSGD", "CPUAdam", "CPUAdamW", "OneBitAdam"]
