"""1-bit Adam (Tang et al., 2021): Adam whose momentum travels as signs after a freeze.

For ``freeze_step`` steps it is Adam on the averaged gradient (one dense all-reduce per step;
torch's ``Adam`` formulas, so it matches ``DDP + torch.optim.Adam`` exactly). Then the second
moment ``v`` stops changing, which makes the rest of Adam linear in the gradient: each rank
updates its momentum with its *own* gradient, and the momenta are averaged through a
compressor (``OneBit`` by default: one bit per value and a scale per block, with worker and
server error feedback), about 28x fewer bytes than the dense all-reduce. Every rank applies
the same averaged momentum, so replicas stay identical.

Use it on a plain model (not wrapped by DDP): it does its own communication on ``group``, and
broadcasts rank 0's parameters when built::

    opt = sl.optim.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=200)
    loss.backward(); opt.step()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from shardline.comm.group import ProcessGroup
from shardline.errors import InvalidArgumentError
from shardline.optim._replica import split_like
from shardline.optim.compression import Compressor, Entry
from shardline.optim.quantize import OneBit
from shardline.parallel._common import broadcast_coalesced, default_group

__all__ = ["OneBitAdam"]


class OneBitAdam(torch.optim.Optimizer):
    """Adam with a frozen variance and compressed momentum after ``freeze_step`` steps.

    Args:
        params: The model's parameters (one floating dtype).
        lr, betas, eps, weight_decay: As torch's ``Adam`` (L2 weight decay).
        freeze_step: Uncompressed Adam steps before the variance freezes.
        group: The ranks; the default group when ``None``.
        compressor: How momenta are averaged after the freeze (``OneBit()`` by default).
        init_sync: Broadcast rank 0's parameters now.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        freeze_step: int = 100,
        group: ProcessGroup | None = None,
        compressor: Compressor | None = None,
        init_sync: bool = True,
    ) -> None:
        if freeze_step < 1:
            raise InvalidArgumentError(f"OneBitAdam: freeze_step must be >= 1, not {freeze_step}")
        super().__init__(
            params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        )
        self.freeze_step = int(freeze_step)
        self.group = group if group is not None else default_group()
        self.compressor = compressor if compressor is not None else OneBit(warmup_steps=0)
        self.compressor.warmup_steps = 0  # the uncompressed phase is this optimizer's own
        self._params = [p for g in self.param_groups for p in g["params"]]
        dtypes = {p.dtype for p in self._params}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise InvalidArgumentError(
                "OneBitAdam: parameters must share one floating dtype, got "
                f"{sorted(map(str, dtypes))}"
            )
        self.steps = 0
        self._layout = []
        offset = 0
        for i, p in enumerate(self._params):
            self._layout.append(Entry(f"param{i}", offset, tuple(p.shape)))
            offset += p.numel()
        self._numel = offset
        if init_sync:
            broadcast_coalesced(self.group, [p.data for p in self._params], 0, 25 << 20)

    @property
    def frozen(self) -> bool:
        """Whether the variance is frozen (the momentum travels compressed)."""
        return self.steps >= self.freeze_step

    def _flat_grads(self) -> torch.Tensor:
        return torch.cat(
            [
                (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                for p in self._params
            ]
        ).float()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Adam step (a collective: every rank calls it)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        n = self.group.world_size
        grads = self._flat_grads()
        frozen = self.frozen
        if not frozen:
            self.group.all_reduce(grads, "sum")
            grads.div_(n)
        start = 0
        moments = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                g = grads[start : start + p.numel()].view_as(p)
                start += p.numel()
                if group["weight_decay"]:
                    g = g.add(p.float(), alpha=group["weight_decay"])
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
                if not frozen:
                    state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
                    state["step"] += 1
                moments.append(state["exp_avg"])
        if frozen:
            # Each rank's momentum (from its own gradient) averaged through the compressor.
            flat = torch.cat([m.reshape(-1) for m in moments]).div_(n)
            self.compressor.reduce(self.group, flat, key="momentum", layout=self._layout)()
            self.compressor.advance()
            for m, value in zip(moments, split_like(flat, moments), strict=True):
                m.copy_(value)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                t = float(state["step"])  # frozen: the variance's bias as it froze
                step_size = group["lr"] / (1 - beta1**t)
                denom = (state["exp_avg_sq"].sqrt() / (1 - beta2**t) ** 0.5).add_(group["eps"])
                p.addcdiv_(state["exp_avg"].to(p.dtype), denom.to(p.dtype), value=-step_size)
        self.steps += 1
        return loss
