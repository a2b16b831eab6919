"""``checkpoint(fn, *args)``: recompute a region in backward instead of keeping its activations."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.utils.checkpoint as torch_checkpoint

from shardline.parallel.recompute.store import ACTIVE

__all__ = ["checkpoint"]

T = TypeVar("T")


def checkpoint(
    fn: Callable[..., T],
    *args: Any,
    use_reentrant: bool = False,
    preserve_rng_state: bool = True,
    **kwargs: Any,
) -> T:
    """Runs ``fn(*args, **kwargs)`` without keeping its activations; backward recomputes them.

    This is ``torch.utils.checkpoint.checkpoint`` with shardline's defaults: non-reentrant
    (works with ``torch.autograd.grad``, keyword arguments, nested checkpoints and inputs that
    do not require grad), and the CPU and device RNG states of the forward restored for the
    recompute, so dropout draws the same masks and gradients equal those without checkpointing
    bit for bit. Keyword arguments go to ``fn``, except torch's own options
    (``context_fn``, ``determinism_check``, ``debug``, ``early_stop``), which go to torch.

    Inside ``ActivationCheckpointManager.activate()`` the bytes the region's autograd nodes
    would have saved (distinct storages, parameters and the region's inputs excluded: those
    stay alive anyway) are added to that manager's ``recomputed_bytes``, once per forward
    (not again when backward recomputes a nested checkpoint). Not with
    ``use_reentrant=True`` or a caller's ``context_fn``.

    Args:
        fn: The region to checkpoint, a function or module.
        *args: Its positional inputs; these are kept for the recompute.
        use_reentrant: Use torch's older reentrant implementation (no keyword arguments).
        preserve_rng_state: Restore the forward's RNG states for the recompute.
        **kwargs: Keyword arguments of ``fn``.

    Returns:
        What ``fn`` returns.
    """
    manager = ACTIVE.get()
    # A nested checkpoint that runs again while backward recomputes its outer region was
    # counted in forward already: count only outside backward.
    in_backward = torch._C._current_graph_task_id() != -1
    if manager is None or in_backward or use_reentrant or "context_fn" in kwargs:
        return torch_checkpoint.checkpoint(
            fn,
            *args,
            use_reentrant=use_reentrant,
            preserve_rng_state=preserve_rng_state,
            **kwargs,
        )
    counter = _SavedBytes(args)
    out = torch_checkpoint.checkpoint(
        fn,
        *args,
        use_reentrant=False,
        preserve_rng_state=preserve_rng_state,
        context_fn=counter.contexts,
        **kwargs,
    )
    manager._note_recomputed(counter.nbytes)
    return out


class _SavedBytes:
    """Counts the bytes torch's checkpoint declines to save during a forward."""

    def __init__(self, inputs: tuple[Any, ...]) -> None:
        self.nbytes = 0
        self._inputs = {
            _storage_ptr(a) for a in inputs if isinstance(a, torch.Tensor) and _has_storage(a)
        }
        # [Note: weak dedupe] One storage saved by several nodes counts once. Keys are storage
        # addresses, each with a weak reference to a tensor on it: a dead reference means the
        # storage may be gone and its address reused, so the next tensor there counts anew.
        # Nothing here keeps a tensor alive.
        self._seen: dict[int, weakref.ref[torch.Tensor]] = {}

    def contexts(
        self,
    ) -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
        """``context_fn`` for torch's checkpoint: count in forward, nothing in recompute."""
        return self._count(), contextlib.nullcontext()

    def add(self, x: torch.Tensor) -> None:
        if not _has_storage(x):
            return
        root = x._base if x._base is not None else x
        if root.is_leaf and root.requires_grad:  # a parameter (or a view of one)
            return
        ptr = _storage_ptr(x)
        if ptr in self._inputs:
            return
        seen = self._seen.get(ptr)
        if seen is not None and seen() is not None:
            return
        self._seen[ptr] = weakref.ref(x)
        self.nbytes += x.untyped_storage().nbytes()

    @contextlib.contextmanager
    def _count(self) -> Iterator[None]:
        # torch enters this inside its own saved-tensor hooks, whose pack is now the top of
        # the stack: wrap it, count, delegate. Without that hook (no grad) count nothing.
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        hooks = top(False) if top is not None else None
        if hooks is None:
            yield
            return
        pack, unpack = hooks

        def counting_pack(x: torch.Tensor) -> Any:
            self.add(x)
            return pack(x)

        # [Note: transparent wrapper] torch marks its internal hooks so nested checkpoints see
        # through them to the user's hooks; mark ours the same way, pointing where torch's did.
        counting_pack._checkpoint_internal = getattr(pack, "_checkpoint_internal", False)  # type: ignore[attr-defined]
        counting_pack._user_hooks = getattr(pack, "_user_hooks", None)  # type: ignore[attr-defined]
        with torch.autograd.graph.saved_tensors_hooks(counting_pack, unpack):
            yield


def _has_storage(t: torch.Tensor) -> bool:
    return t.device.type != "meta" and not t.is_sparse and not t.is_nested


def _storage_ptr(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())
