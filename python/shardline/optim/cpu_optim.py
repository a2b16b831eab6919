"""Optimizers whose step runs in Rust over float32 parameters in host memory.

For optimizer state kept on the CPU (ZeRO offload, CPU training): ``CPUAdamW``, ``CPUAdam`` and
``CPUSGD`` are drop-in ``torch.optim`` optimizers with torch's formulas and state (a state dict
loads into ``torch.optim.AdamW``/``Adam``/``SGD`` and back). Each parameter's step is one pass
over its values (AdamW reads 16 bytes and writes 12 per value), split over torch's intra-op
threads, so it runs at the memory's speed; ``benches/bench_cpu_optim.py`` measures it against
torch's fastest CPU AdamW (``fused=True``) and the memory's copy bandwidth.

Parameters and gradients must be contiguous float32 CPU tensors (ZeRO's flat shards are).
Results equal torch's to float rounding, not bit for bit: the per-element arithmetic is
torch's, in its order, but torch's own kernels differ in where they fuse multiply-adds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from shardline import _native
from shardline.errors import InvalidArgumentError

__all__ = ["CPUSGD", "CPUAdam", "CPUAdamW"]


def _checked(opt: str, i: int, p: torch.Tensor) -> torch.Tensor:
    """``p``'s gradient, contiguous, after checking both can be stepped here."""
    assert p.grad is not None
    if p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous():
        raise InvalidArgumentError(
            f"{opt}: parameter {i} is {p.dtype} on {p.device}"
            f"{'' if p.is_contiguous() else ', not contiguous'}; it steps contiguous float32 "
            "CPU tensors (keep fp32 master weights on the CPU, or use torch.optim on the GPU)"
        )
    g = p.grad
    if g.is_sparse or g.device.type != "cpu":
        raise InvalidArgumentError(
            f"{opt}: parameter {i}'s gradient is {'sparse' if g.is_sparse else g.device}; "
            "it needs a dense CPU gradient"
        )
    return g.to(torch.float32).contiguous()


class CPUAdam(torch.optim.Optimizer):
    """Adam (L2 weight decay) stepped in Rust on CPU float32 parameters.

    Args:
        params: Parameters or param groups (contiguous float32 CPU tensors).
        lr, betas, eps, weight_decay: As ``torch.optim.Adam``.
        decoupled: AdamW's decoupled weight decay (what ``CPUAdamW`` sets).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        decoupled: bool = False,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise InvalidArgumentError(
                f"{type(self).__name__}: lr={lr}, eps={eps}, weight_decay={weight_decay} must be "
                f">= 0 and betas={betas} in [0, 1)"
            )
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        # Not a group setting: a state dict from torch's Adam or AdamW loads either way.
        self.decoupled = bool(decoupled)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        name, threads = type(self).__name__, torch.get_num_threads()
        i = 0
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                i += 1
                if p.grad is None or p.numel() == 0:
                    continue
                g = _checked(name, i - 1, p)
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["step"] += 1
                _native.adam_step(
                    p, g, state["exp_avg"], state["exp_avg_sq"], lr=float(group["lr"]),
                    beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]),
                    decoupled=self.decoupled, step=int(state["step"]),
                    threads=threads,
                )  # fmt: skip
        return loss


class CPUAdamW(CPUAdam):
    """AdamW (decoupled weight decay) stepped in Rust on CPU float32 parameters.

    Args as ``torch.optim.AdamW``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, decoupled=True)


class CPUSGD(torch.optim.Optimizer):
    """SGD stepped in Rust on CPU float32 parameters.

    Momentum, dampening, Nesterov and L2 weight decay; args as ``torch.optim.SGD``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise InvalidArgumentError(
                f"CPUSGD: lr={lr}, momentum={momentum}, weight_decay={weight_decay} must be >= 0"
            )
        if nesterov and (momentum <= 0 or dampening != 0):
            raise InvalidArgumentError("CPUSGD: nesterov needs momentum > 0 and no dampening")
        defaults = {"lr": lr, "momentum": momentum, "dampening": dampening,
                    "weight_decay": weight_decay, "nesterov": nesterov}  # fmt: skip
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        threads = torch.get_num_threads()
        i = 0
        for group in self.param_groups:
            momentum = float(group["momentum"])
            for p in group["params"]:
                i += 1
                if p.grad is None or p.numel() == 0:
                    continue
                g = _checked("CPUSGD", i - 1, p)
                state = self.state[p]
                buf = state.get("momentum_buffer")
                first = buf is None
                if momentum and buf is None:
                    buf = state["momentum_buffer"] = torch.empty_like(
                        p, memory_format=torch.contiguous_format
                    )
                _native.sgd_step(
                    p, g, buf if momentum else None, lr=float(group["lr"]), momentum=momentum,
                    dampening=float(group["dampening"]),
                    weight_decay=float(group["weight_decay"]), nesterov=bool(group["nesterov"]),
                    first=first, threads=threads,
                )  # fmt: skip
        return loss
