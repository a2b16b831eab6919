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

from shardline.comm.coalesced import broadcast_coalesced
from shardline.comm.group import ProcessGroup
from shardline.comm.world import default_group
from shardline.compression.codec import Compressor, Entry
from shardline.compression.quantize import OneBit
from shardline.errors import InvalidArgumentError

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
        self._entry = dict(zip(self._params, self._layout, strict=True))
        # The moments, flat (each parameter's state holds views); after the freeze Adam's
        # denominator is constant and kept flat too (one more value per parameter).
        self._m: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._denom: torch.Tensor | None = None
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

    def _bind_state(self) -> None:
        """Puts every parameter's moments in two flat float32 buffers (its state holds views).

        The momentum is then reduced in place, and each pass runs over one buffer.
        """
        device = self._params[0].device
        self._m = torch.zeros(self._numel, dtype=torch.float32, device=device)
        self._v = torch.zeros(self._numel, dtype=torch.float32, device=device)
        for p, e in zip(self._params, self._layout, strict=True):
            state = self.state[p]
            for key, flat in (("exp_avg", self._m), ("exp_avg_sq", self._v)):
                view = flat[e.offset : e.offset + e.numel].view(p.shape)
                if key in state:
                    view.copy_(state[key])
                state[key] = view
            state.setdefault("step", torch.zeros((), dtype=torch.float32))
        self._denom = None

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Adam step (a collective: every rank calls it)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._m is None:
            self._bind_state()
        assert self._m is not None
        n = self.group.world_size
        frozen = self.frozen
        grads = None
        if not frozen:
            grads = self._flat_grads()
            self.group.all_reduce(grads, "sum")
            grads.div_(n)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                e = self._entry[p]
                if grads is not None:
                    g = grads[e.offset : e.offset + e.numel].view_as(p)
                else:  # frozen: this rank's own gradient
                    g = p.grad if p.grad is not None else torch.zeros_like(p)
                if group["weight_decay"]:
                    g = g.add(p, alpha=group["weight_decay"])
                state = self.state[p]
                state["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
                if not frozen:
                    state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
                    state["step"] += 1
        del grads
        if frozen:
            # Each rank's momentum (from its own gradient) averaged through the compressor, in
            # place: every rank then holds the same momentum.
            self._m.div_(n)
            self.compressor.reduce(self.group, self._m, key="momentum", layout=self._layout)()
            self.compressor.advance()
            if self._denom is None:  # constant from now on (one more value per parameter)
                self._denom = self._denominator()
        denom = self._denom if frozen else self._denominator()
        assert denom is not None
        for group in self.param_groups:
            beta1 = group["betas"][0]
            for p in group["params"]:
                e = self._entry[p]
                t = float(self.state[p]["step"])  # frozen: the variance's bias as it froze
                step_size = group["lr"] / (1 - beta1**t)
                d = denom[e.offset : e.offset + e.numel].view(p.shape)
                p.addcdiv_(self.state[p]["exp_avg"].to(p.dtype), d.to(p.dtype), value=-step_size)
        self.steps += 1
        return loss

    def _denominator(self) -> torch.Tensor:
        """Adam's denominator ``sqrt(v / (1 - beta2^t)) + eps`` of every value, flat."""
        assert self._v is not None
        out = torch.empty_like(self._v)
        for group in self.param_groups:
            beta2 = group["betas"][1]
            for p in group["params"]:
                e = self._entry[p]
                t = float(self.state[p]["step"])
                v = self._v[e.offset : e.offset + e.numel]
                part = out[e.offset : e.offset + e.numel]
                torch.sqrt(v, out=part).div_((1 - beta2**t) ** 0.5).add_(group["eps"])
        return out

    def state_dict(self) -> dict[str, Any]:
        """Torch's, plus the step count and this rank's compressor state.

        The step count says whether the variance is frozen; the compressor state holds this
        rank's residuals, so save the result per rank.
        """
        out = super().state_dict()
        out["onebit_adam"] = {
            "steps": self.steps,
            "compressor": {k: v.clone() for k, v in self.compressor.state_tensors().items()},
        }
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's; the loaded moments go back into the flat buffers."""
        state_dict = dict(state_dict)
        extra = state_dict.pop("onebit_adam", None)
        super().load_state_dict(state_dict)
        if extra is not None:
            self.steps = int(extra["steps"])
            self.compressor.load_state_tensors(extra["compressor"])
        if self.state:
            self._bind_state()
        else:
            self._m = self._v = self._denom = None
