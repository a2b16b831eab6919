"""``recompute_blocks(model, policy)``: recompute each repeated block's activations in backward.

A transformer's activations, not its parameters, fill most of a GPU at a useful batch: on
the 395M GPT of ``benches/bench_zero.py`` (fp32, 8 x 1024 tokens per rank) they are about 80 %
of the peak, under ZeRO-3 and FSDP2 alike. Two policies trade some of them for compute:

- ``"selective"``: keep what the expensive ops (matrix products, attention, convolutions)
  made, and make the outputs of the cheap ops between them (LayerNorm and RMSNorm modules,
  GELU, SiLU, products such as SwiGLU's) again in backward from what their own backward keeps
  anyway (``selective.py``). On a GPT block this drops the LayerNorm and GELU outputs, about a third
  of the block's activations, for a few elementwise kernels per block; no GEMM runs again.
- ``"full"``: keep only each block's input and run its whole forward again in backward: the
  least memory, for about a third more compute.

Either way backward computes exactly what it would have (the same kernels on the same values,
dropout with the forward's RNG state), so gradients equal those without recomputation bit for
bit. ``"full"`` is ``torch.utils.checkpoint`` (non-reentrant).

``sl.distribute(..., recompute="selective")`` applies it before wrapping, for any strategy.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from shardline.errors import InvalidArgumentError
from shardline.parallel.recompute import selective
from shardline.parallel.recompute.region import checkpoint

__all__ = [
    "RECOMPUTE_POLICIES",
    "check_policy",
    "find_blocks",
    "kept_under_recompute",
    "recompute_blocks",
    "recomputing",
    "recomputing_blocks",
]

RECOMPUTE_POLICIES = ("selective", "full")
_MARK = "_shardline_recompute"

BlockSelector = type[nn.Module] | tuple[type[nn.Module], ...] | Callable[[str, nn.Module], bool]


def check_policy(policy: str | None, who: str = "recompute") -> None:
    """Refuses anything but ``None`` and the names in ``RECOMPUTE_POLICIES``."""
    if policy is not None and policy not in RECOMPUTE_POLICIES:
        raise InvalidArgumentError(
            f"{who}: recompute={policy!r} is not a policy; choose None or one of "
            f"{', '.join(RECOMPUTE_POLICIES)}"
        )


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's repeated blocks, as ``(qualified name, module)``.

    They are the children of the ``nn.ModuleList`` or ``nn.Sequential`` (two children or
    more, all of one class) holding the most parameters; ``[]`` when there is none.
    """
    best: tuple[int, list[tuple[str, nn.Module]]] | None = None
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList | nn.Sequential) or len(mod) < 2:
            continue
        kids = list(mod.named_children())
        if len({type(k) for _, k in kids}) != 1:
            continue
        numel = sum(p.numel() for p in mod.parameters())
        if numel and (best is None or numel > best[0]):
            prefix = f"{name}." if name else ""
            best = (numel, [(prefix + k, m) for k, m in kids])
    return best[1] if best is not None else []


def recomputing_blocks(model: nn.Module, policy: str | None = None) -> list[str]:
    """Qualified names of the blocks of ``model`` that recompute in backward.

    Those ``recompute_blocks`` wrapped, else, with a ``policy``, those ``find_blocks`` finds;
    ``[]`` when neither applies. ZeRO makes each of them one unit (``zero/grouping.py``:
    ``unit_blocks``).
    """
    check_policy(policy)
    marked = [n for n, m in model.named_modules() if getattr(m, _MARK, None) is not None]
    if marked or policy is None:
        return marked
    return [n for n, _ in find_blocks(model)]


def recompute_blocks(
    model: nn.Module, policy: str = "selective", modules: BlockSelector | None = None
) -> list[str]:
    """Makes each block of ``model`` recompute its activations in backward (module docstring).

    Call it on the plain model, before a strategy wraps it (``sl.distribute(...,
    recompute=policy)`` does). Blocks run as before without autograd (``torch.no_grad()``,
    evaluation). A module whose region holds collectives (tensor parallelism) runs them again
    in the recompute. ``"selective"`` reads a norm's parameters when its consumer's gradient
    is computed: a wrapper that frees parameters between forward and backward must gather
    them per block (ours do; with torch's FSDP2, ``fully_shard`` each block whole).

    Args:
        model: The model, changed in place (each block's ``forward`` is wrapped).
        policy: ``"selective"`` or ``"full"``.
        modules: Which modules are the blocks: a class or tuple of classes, or a predicate on
            ``(qualified name, module)``; ``None`` finds them (``find_blocks``).

    Returns:
        The qualified names of the modules wrapped.

    Raises:
        InvalidArgumentError: an unknown policy, no block found, or a block wrapped already.
    """
    if policy is None:
        raise InvalidArgumentError("recompute_blocks: policy must be 'selective' or 'full'")
    check_policy(policy, "recompute_blocks")
    if modules is None:
        blocks = find_blocks(model)
        how = (
            "found no repeated blocks (a ModuleList or Sequential of one module class); "
            "name them with modules=BlockClass"
        )
    else:
        selector = modules

        def chosen(name: str, m: nn.Module) -> bool:
            if isinstance(selector, type | tuple):
                return isinstance(m, selector)
            return selector(name, m)

        blocks = [(n, m) for n, m in model.named_modules() if n and chosen(n, m)]
        how = f"no module of {type(model).__name__} matched modules={modules!r}"
    if not blocks:
        raise InvalidArgumentError(f"recompute={policy!r}: {how}")
    names = [n for n, _ in blocks]
    for n, m in blocks:
        if getattr(m, _MARK, None) is not None:
            raise InvalidArgumentError(
                f"recompute: block {n!r} recomputes already ({getattr(m, _MARK)!r}); apply "
                "recompute once per model"
            )
    nested = [n for n in names if any(n.startswith(f"{o}.") for o in names)]
    if nested:
        raise InvalidArgumentError(
            f"recompute: blocks {nested[:3]} lie inside other blocks; choose modules that do "
            "not nest"
        )
    for _, m in blocks:
        _wrap(m, policy)
    return names


@contextlib.contextmanager
def recomputing(model: nn.Module, policy: str | None) -> Iterator[None]:
    """Within this context the blocks of ``model`` recompute under ``policy``; after, as before.

    For the planner's timing probe: ``None`` changes nothing; a model whose blocks recompute
    already keeps its own policy.
    """
    check_policy(policy)
    if policy is None or recomputing_blocks(model):
        yield
        return
    blocks = [m for _, m in find_blocks(model)]
    own = [m.__dict__.get("forward") for m in blocks]  # a forward set on the instance
    handles = [h for m in blocks for h in _wrap(m, policy)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for m, forward in zip(blocks, own, strict=True):
            del m.forward  # the recomputing one
            if forward is not None:
                m.forward = forward
            delattr(m, _MARK)


def _wrap(module: nn.Module, policy: str) -> list[torch.utils.hooks.RemovableHandle]:
    # A method bound to the module (not a closure over it), so a deepcopy of the model gets
    # blocks that run their own forward; the policy travels as an attribute.
    setattr(module, _MARK, policy)
    module.forward = types.MethodType(_recomputing_forward, module)
    if policy != "selective":
        return []
    return [
        m.register_forward_hook(selective.note_norm_eps)
        for m in module.modules()
        if isinstance(m, selective.NORM_MODULES)
    ]


def _recomputing_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    forward = functools.partial(type(self).forward, self)
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    if getattr(self, _MARK) == "full":
        return checkpoint(forward, *args, **kwargs)
    with selective.selective_hooks():
        return forward(*args, **kwargs)


@contextlib.contextmanager
def kept_under_recompute(
    model: nn.Module, policy: str | None, keep: Callable[[torch.Tensor], None]
) -> Iterator[tuple[Callable[[torch.Tensor], bool], Callable[[], int | None]]]:
    """For memory estimates: what recomputation would keep in a forward of ``model``.

    Within this context the blocks run plainly, and ``keep`` receives each block input a
    ``"full"`` block keeps. Yields ``(counted, running)``: ``counted(t)`` says whether a
    tensor autograd saves now is kept for backward (not inside a ``"full"`` block, not
    dropped by a ``"selective"`` one); ``running()`` numbers the call of the outermost block
    running now (each call is recomputed on its own in backward), ``None`` outside blocks.

    The blocks are those ``recompute_blocks`` wrapped (each with its policy), else, with a
    ``policy``, those ``find_blocks`` finds; with neither, nothing changes.
    """
    check_policy(policy)
    marked = [m for m in model.modules() if getattr(m, _MARK, None) is not None]
    blocks = (
        [(m, str(getattr(m, _MARK))) for m in marked]
        if marked
        else [(m, policy) for _, m in find_blocks(model)]
        if policy is not None
        else []
    )
    running: list[tuple[str, selective._Block | None]] = []
    calls = [0]  # outermost block calls so far

    def enter(policy: str) -> Callable[..., None]:
        def hook(_m: nn.Module, args: Any, kwargs: Any) -> None:
            if not running:
                calls[0] += 1
            if not running and policy == "full":
                for t in (*args, *kwargs.values()):
                    if isinstance(t, torch.Tensor):
                        keep(t)
            block = selective.enter_block(hooks=False) if policy == "selective" else None
            running.append((policy, block))

        return hook

    def leave(_m: nn.Module, _args: Any, _kwargs: Any, _out: Any) -> None:
        _, block = running.pop()
        if block is not None:
            selective.leave_block(block)

    def counted(t: torch.Tensor) -> bool:
        if not running:
            return True
        policy, block = running[0]
        return policy == "selective" and block is not None and not selective.droppable(t, block.eps)

    handles = []
    plain = []  # wrapped blocks run their own forward here, not the recomputing one
    for m, pol in blocks:
        handles.append(m.register_forward_pre_hook(enter(pol), with_kwargs=True))
        handles.append(m.register_forward_hook(leave, with_kwargs=True))
        if "forward" in m.__dict__:
            plain.append((m, m.__dict__.pop("forward")))
        if pol == "selective" and getattr(m, _MARK, None) is None:
            handles.extend(
                n.register_forward_hook(selective.note_norm_eps)
                for n in m.modules()
                if isinstance(n, selective.NORM_MODULES)
            )
    try:
        yield counted, lambda: calls[0] if running else None
    finally:
        for h in handles:
            h.remove()
        for m, fwd in plain:
            m.forward = fwd
