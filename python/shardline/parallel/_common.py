"""Pieces every data-parallel wrapper needs.

The same-model check, the global gradient norm, and hooks that do not
keep the wrapper alive.
"""

from __future__ import annotations

import hashlib
import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from shardline.comm.group import ProcessGroup
from shardline.errors import InvalidArgumentError
from shardline.parallel.contract import Shard, param_layouts

__all__ = [
    "ModelParallel",
    "check_same_model",
    "clip_to_global_norm_",
    "copies_over",
    "remove_hooks_when_collected",
    "weak_method",
]


def clip_to_global_norm_(
    counted: Sequence[torch.Tensor],
    scaled: Sequence[torch.Tensor],
    group: ProcessGroup | Sequence[ProcessGroup],
    max_norm: float,
    norm_type: float,
    device: torch.device | None,
    copies: Sequence[int] | None = None,
) -> torch.Tensor:
    """Scales ``scaled`` in place so that the global gradient norm is at most ``max_norm``.

    The global norm is that of ``counted`` (this rank's share, each element once in the whole
    group) over every rank of ``group`` (or of several groups that together span the ranks
    holding the model: a pipeline's stages, then their replicas), as
    ``torch.nn.utils.clip_grad_norm_`` computes it on one process
    (``coef = max_norm / (norm + 1e-6)``, at most 1). Where ``copies[i]`` ranks hold equal
    copies of ``counted[i]`` (a weight tensor parallelism keeps whole), each counts
    ``1 / copies[i]``. Returns the norm.
    """
    norm_type = float(norm_type)
    groups = [group] if isinstance(group, ProcessGroup) else list(group)
    if norm_type == float("inf"):
        maxima = [g.detach().abs().max().float().to(device) for g in counted]
        total = torch.stack(maxima).max().reshape(1) if maxima else torch.zeros(1, device=device)
        for grp in groups:
            grp.all_reduce(total, op="max")
    else:
        # On the group's device: gradients may be in host memory (ZeRO offload).
        parts = [
            torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32).to(device)
            for g in counted
        ]
        if copies is not None:
            parts = [x * (1.0 / c) ** (1.0 / norm_type) for x, c in zip(parts, copies, strict=True)]
        total = (
            torch.stack(parts).pow(norm_type).sum().reshape(1)
            if parts
            else torch.zeros(1, device=device)
        )
        for grp in groups:
            grp.all_reduce(total, op="sum")
        total = total.pow(1.0 / norm_type)
    norm = total[0]
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    with torch.no_grad():
        for g in scaled:
            g.mul_(coef.to(device=g.device, dtype=g.dtype))
    return norm


def check_same_model(
    group: ProcessGroup,
    names: Sequence[str],
    params: Sequence[torch.Tensor],
    who: str,
    device: torch.device | None = None,
) -> None:
    """All ranks must hold the same parameter list; otherwise name the rank that differs.

    ``device``: where the check's tensors go (the group's device); default the parameters'.

    Raises:
        InvalidArgumentError: counts, names, shapes or dtypes differ from rank 0's, or the
            parameters live on several devices.
    """
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise InvalidArgumentError(
            f"{who}: parameters live on several devices {sorted(map(str, devices))}; "
            "move the model to one device first"
        )
    if device is None:
        device = params[0].device if params else torch.device("cpu")
    layout = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in zip(names, params, strict=True))
    digest = int.from_bytes(hashlib.sha256(layout.encode()).digest()[:7], "little")
    mine = torch.tensor([len(params), sum(p.numel() for p in params), digest], device=device)
    everyone = torch.empty(group.world_size * 3, dtype=torch.int64, device=device)
    group.all_gather(everyone, mine)
    rows = everyone.view(group.world_size, 3)
    for r in range(group.world_size):
        if not torch.equal(rows[r], rows[0]):
            a, b = rows[0].tolist(), rows[r].tolist()
            raise InvalidArgumentError(
                f"{who} on rank {group.rank}: rank {r} has {b[0]} trainable "
                f"parameters with {b[1]} elements while rank 0 has {a[0]} with {a[1]}"
                + (" (same counts, different names/shapes/dtypes)" if a[:2] == b[:2] else "")
                + "; build the same model on every rank before wrapping it"
            )


def weak_method(obj: object, name: str, *bound: Any) -> Callable[..., Any]:
    """A hook calling ``obj.<name>(*bound, *args)`` while ``obj`` lives (a no-op after).

    Hooks live on the user's modules and parameters. A bound method there would keep the
    wrapper, and with it every buffer and optimizer shard it owns, alive for as long as the
    plain model is: ``del model`` would free nothing.
    """
    ref = weakref.ref(obj)

    def call(*args: Any, **kwargs: Any) -> Any:
        target = ref()
        if target is None:
            return None
        return getattr(target, name)(*bound, *args, **kwargs)

    return call


def _remove(handles: list[Any]) -> None:
    for h in handles:
        h.remove()


def remove_hooks_when_collected(obj: object, handles: list[Any]) -> None:
    """Removes ``handles`` (hook handles) once ``obj`` is garbage-collected.

    The plain model that ``obj`` wrapped then carries no dead hooks.
    """
    weakref.finalize(obj, _remove, handles).atexit = False


def copies_over(group: ProcessGroup, module: nn.Module) -> dict[str, int]:
    """How many ranks of ``group`` hold each element of each of ``module``'s parameters.

    ``module`` is split over ``group`` (tensor parallelism): a split weight's elements are
    each on one rank (1; ``Colwise(replicas=r)``: r), a weight every rank keeps whole is on
    all of them. Read from the strategy contract (``contract.param_layouts``); a collective.
    """
    layouts = param_layouts(module)
    names = sorted(n for n, _ in module.named_parameters())
    held, whole = [], []
    for n in names:
        value = layouts[n]
        if isinstance(value, Shard):
            held.append(float(value.numel))
            whole.append(math.prod(value.global_shape))
        else:
            held.append(float(value.numel()))
            whole.append(value.numel())
    total = torch.tensor(held, dtype=torch.float64, device=next(module.parameters()).device)
    group.all_reduce(total, op="sum")
    return {
        n: max(1, round(got / max(1, w)))
        for n, got, w in zip(names, total.tolist(), whole, strict=True)
    }


class ModelParallel:
    """For a data-parallel wrapper whose module is itself split (tensor parallelism inside).

    ``set_model_parallel(group, copies)`` names the group the module is split over and how
    many of its ranks hold each parameter's elements (``copies_over``, measured before
    wrapping); the wrapper's ``clip_grad_norm_`` then sums over that group too, each element
    once, as ``torch.nn.utils.clip_grad_norm_`` does on the dense model.
    """

    _model_group: ProcessGroup | None = None
    _copies: dict[str, int] | None = None

    def set_model_parallel(self, group: ProcessGroup, copies: dict[str, int]) -> None:
        """The group the wrapped module is split over, and each parameter's copies on it."""
        self._model_group = group
        self._copies = dict(copies)

    def _norm_groups(self, own: ProcessGroup | None) -> list[ProcessGroup]:
        """The groups a gradient norm is summed over: ``own`` (if any), then the model's."""
        return [g for g in (own, self._model_group) if g is not None]

    def _copies_of(self, names: Sequence[str]) -> list[int] | None:
        if self._copies is None:
            return None
        return [self._copies.get(n, 1) for n in names]
