"""Sums in one fixed tree: the same bits whatever the number of ranks (deterministic mode).

A floating-point sum depends on the order of its additions. ``tree_sum`` adds the rows of a
tensor in one canonical binary tree: the left subtree holds the largest power of two of rows
below ``n`` (``n / 2`` when ``n`` is one), the right one the rest, recursively. Split any
sequence of ``n`` leaves into blocks of ``2**k`` consecutive leaves and every block is a
subtree, and the tree over the blocks is the canonical tree over that many leaves. So when
each rank holds a block of ``2**k`` consecutive samples and sums them with ``tree_sum``, the
group can finish the sum over the ranks' results, again with ``tree_sum``, and gets the bits
one process gets from ``tree_sum`` over all samples.

``tree_group(group)`` is ``group`` with that reduction: its ``all_reduce``,
``reduce_scatter`` and ``reduce`` of floating-point tensors with ``sum`` or ``avg`` move every
rank's part to the rank that owns it (``all_to_all``), add the ranks' parts in rank order
with ``tree_sum`` (``avg`` then divides once by the world size), and give the result back
(``all_gather``, or ``gather`` to the root). That is the bandwidth of a reduce-scatter and an
all-gather, like the ring's, and the result does not depend on the algorithm or transport.
Every other op is ``group``'s own, and so are the sums of two ranks: any algorithm adds two
values once, and ``a + b == b + a``. The strategies take such a group unchanged.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from shardline import _native
from shardline.comm.group import ProcessGroup

if TYPE_CHECKING:
    from collections.abc import Sequence

    from shardline.comm.work import Backend, Handle

__all__ = ["built_kernels", "tree_group", "tree_sum"]

_SUMS = ("sum", "avg")
_THREADED = 1 << 16  # elements per row from which the engine's kernel sums on torch's threads


def tree_sum(parts: torch.Tensor, *, fresh: bool = False, dim: int = 0) -> torch.Tensor:
    """The sum over dim 0 of ``parts``, added in the canonical tree (see the module's text).

    Returns a new tensor of ``parts.shape[1:]`` (with ``fresh``, whose caller owns ``parts``
    and lets it go: ``parts[0]`` itself when there is one row); ``parts`` is not changed.
    ``dim``: the sum over that dim instead, for every index of the others (each a tree of
    elementwise adds of views: no copy, the same bits as each slice summed alone).
    """
    if dim % parts.dim():
        return _torch_tree(parts.movedim(dim, 0))
    n = parts.shape[0]
    if n == 1:
        return parts[0] if fresh else parts[0].clone()
    if n == 0:
        return parts.new_zeros(parts.shape[1:])
    if parts.dtype == torch.float32 and parts.device.type == "cpu":
        # The engine's kernel adds in the same tree, in one pass with the rows in cache.
        out = torch.empty(parts.shape[1:], dtype=torch.float32)
        rows = parts if parts.is_contiguous() else parts.contiguous()
        threads = torch.get_num_threads() if out.numel() >= _THREADED else 1
        _native.tree_sum(rows, out, n, threads)
        return out
    if fresh and parts.is_cuda and parts.dtype == torch.float32 and parts.is_contiguous():
        kernel = _cuda_kernel(parts.device)
        if kernel is not None and n & (n - 1) == 0 and n <= kernel.MAX_ROWS:
            summed: torch.Tensor = kernel.tree_sum_into(parts)  # one launch, the same adds
            return summed
    return _torch_tree(parts)


_CUDA: list[Any] = []  # the Triton kernel's module once looked for ([None]: no Triton here)


def _cuda_kernel(device: torch.device) -> Any:
    """``shardline.comm.tree_cuda``, or ``None`` (see ``built_kernels``)."""
    if _CUDA:  # looked for already: every parameter's sum asks
        return _CUDA[0]

    def load() -> Any:
        from shardline.comm import tree_cuda  # noqa: PLC0415  (needs Triton)

        return tree_cuda

    def trial(module: Any) -> None:
        module.tree_sum_into(torch.zeros(2, 1, device=device))

    return built_kernels(_CUDA, load, trial, "tree kernel")


def built_kernels(
    cache: list[Any],
    load: Callable[[], Any],
    trial: Callable[[Any], None],
    what: str,
    instead: str = "torch's elementwise adds (more launches)",
) -> Any:
    """A module of Triton kernels, looked for once (kept in ``cache``), or ``None``.

    ``None`` where ``load`` finds no Triton (CPU builds of torch), or where ``trial``, its
    first launch, fails: Triton compiles then, and needs a C compiler. That failure is a
    warning naming ``what`` and what the caller does ``instead``.
    """
    if not cache:
        try:
            module = load()
        except ImportError:
            module = None
        if module is not None:
            try:
                trial(module)
            except Exception as exc:  # any failure to build: fall back
                warnings.warn(
                    f"shardline: Triton's {what} failed to build ({exc!r:.200}); deterministic "
                    f"sums on the GPU use {instead} instead",
                    stacklevel=4,
                )
                module = None
        cache.append(module)
    return cache[0]


def _torch_tree(parts: torch.Tensor) -> torch.Tensor:
    n = parts.shape[0]
    if n == 1:
        return parts[0].clone()
    left = 1 << ((n - 1).bit_length() - 1)  # the largest power of two below n
    if left * 2 == n:  # a perfect tree: one level at a time, every pair at once
        x = parts[0::2] + parts[1::2]
        while x.shape[0] > 1:
            x = x[0::2] + x[1::2]
        return x[0]
    return _torch_tree(parts[:left]) + _torch_tree(parts[left:])


class _Then:
    """A handle that finishes an op in steps: the first handle, then ``then()`` when waited."""

    def __init__(self, first: Handle, then: Callable[[], None]) -> None:
        self._first = first
        self._then: Callable[[], None] | None = then
        self._error: BaseException | None = None

    def wait(self, timeout: float | None = None) -> None:
        if self._error is not None:
            raise self._error
        if self._then is None:
            return
        try:
            self._first.wait(timeout)
            then, self._then = self._then, None
            then()
        except BaseException as exc:
            self._error, self._then = exc, None
            raise

    def is_completed(self) -> bool:
        return self._then is None

    @property
    def source(self) -> int | None:
        return None


class TreeBackend:
    """A backend whose float sums run in the canonical tree over ranks (see the module)."""

    completes_blocking_ops = False  # every handle here is waited on

    def __init__(self, inner: Backend, *, owns: bool = False) -> None:
        self._inner = inner
        self._owns = owns  # a sub-group's transport is its own; a tree group's is its parent's
        self.group_name = f"{getattr(inner, 'group_name', 'world')}+tree"

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _parts(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``flat`` padded to ``world_size`` equal parts, its all_to_all output, a part's size."""
        w = self._inner.world_size
        part = -(-flat.numel() // w)
        send = flat
        if part * w != flat.numel():
            send = torch.cat([flat, flat.new_zeros(part * w - flat.numel())])
        return send, torch.empty_like(send), part

    def _reduced(self, received: torch.Tensor, part: int, op: str) -> torch.Tensor:
        w = self._inner.world_size
        mine = tree_sum(received.view(w, part))
        if op == "avg":
            mine.div_(w)
        return mine

    def _own(self, op: str, t: torch.Tensor) -> bool:
        """Whether the inner backend's op gives the tree's bits.

        Any op but a float sum does, and so does a float sum of two ranks: one addition per
        element, and ``a + b == b + a``.
        """
        return op not in _SUMS or not t.is_floating_point() or self._inner.world_size <= 2

    def all_reduce(self, t: torch.Tensor, op: str, *, async_op: bool = True) -> Handle:
        if self._own(op, t):
            return self._inner.all_reduce(t, op, async_op=async_op)
        flat = t.view(-1)
        send, received, part = self._parts(flat)
        first = self._inner.all_to_all(received, send, async_op=True)

        def then() -> None:
            mine = self._reduced(received, part, op)
            out = flat if send is flat else torch.empty_like(send)
            self._inner.all_gather(out, mine, None, async_op=True).wait()
            if out is not flat:
                flat.copy_(out[: flat.numel()])

        return self._finish(first, then, async_op)

    def reduce_scatter(
        self, out: torch.Tensor, inp: torch.Tensor, op: str, *, async_op: bool = True
    ) -> Handle:
        if self._own(op, out):
            return self._inner.reduce_scatter(out, inp, op, async_op=async_op)
        received = torch.empty_like(inp)
        first = self._inner.all_to_all(received, inp, async_op=True)

        def then() -> None:
            out.view(-1).copy_(self._reduced(received, out.numel(), op))

        return self._finish(first, then, async_op)

    def reduce(self, t: torch.Tensor, op: str, root: int, *, async_op: bool = True) -> Handle:
        if self._own(op, t):
            return self._inner.reduce(t, op, root, async_op=async_op)
        flat = t.view(-1)
        send, received, part = self._parts(flat)
        first = self._inner.all_to_all(received, send, async_op=True)
        root_here = self._inner.rank == root

        def then() -> None:
            mine = self._reduced(received, part, op)
            out = torch.empty_like(send) if root_here else None
            self._inner.gather(out, mine, root, async_op=True).wait()
            if out is not None:
                flat.copy_(out[: flat.numel()])

        return self._finish(first, then, async_op)

    @staticmethod
    def _finish(first: Handle, then: Callable[[], None], async_op: bool) -> Handle:
        handle = _Then(first, then)
        if not async_op:
            handle.wait()
        return handle

    def subgroup(
        self,
        name: str,
        ranks: Sequence[int],
        *,
        overlap_compute: bool = False,
        timeout: float | None = None,
    ) -> Backend:
        kw: dict[str, Any] = {"overlap_compute": overlap_compute}
        if timeout is not None:
            kw["timeout"] = timeout
        return TreeBackend(self._inner.subgroup(name, ranks, **kw), owns=True)

    def close(self) -> None:
        """Closes the transport if it is this group's own (not the group it was made from)."""
        if self._owns:
            self._inner.close()


def tree_group(group: ProcessGroup) -> ProcessGroup:
    """``group``'s ranks and transport, its float sums in the canonical tree over ranks.

    The result is a ``ProcessGroup`` (named ``<group>+tree``) that shares ``group``'s
    connections: call its collectives in the same order on every rank, as with any group.
    A strategy built on it (``distribute(..., deterministic=True)`` does this) reduces its
    gradients to the same bits whatever the world size, when each rank's gradient is the
    ``tree_sum`` of a power-of-two block of the batch (``shardline.parallel.deterministic``).

    A group of one or two ranks is its own tree group: two ranks' sum is one addition per
    element whatever the algorithm (``a + b == b + a``), and a layer of Python in front of the
    group's collectives would only cost time.
    """
    if isinstance(group._impl, TreeBackend) or group.world_size <= 2:
        return group
    # One per group: the sub-groups a strategy makes of it are named after it and numbered
    # in order, so a second tree group would make sub-groups of the same names as the
    # first's, and their ranks would meet the wrong peers.
    made: ProcessGroup | None = getattr(group, "_tree_group", None)
    if made is None:
        made = ProcessGroup(
            TreeBackend(group._impl),
            ranks=group.ranks,
            global_ranks=group.global_ranks,
            timeout=group.timeout,
        )
        group._tree_group = made  # type: ignore[attr-defined]
    return made
