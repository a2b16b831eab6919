"""Launching a built Triton kernel again for a few microseconds of host time, not forty.

Deterministic mode's steps on a GPU are bound by the host, and each Triton launch cost about
45 us of it on an H200's host (torch's own kernels: 7-17): the JIT binds the arguments,
specializes them, hashes a key, looks the kernel up and packs the launch, in Python, every
call. ``launch`` keeps each built kernel under a key of its own, made from what Triton
specializes a kernel on (each tensor's dtype, device and whether its address is 16-byte aligned;
each integer's divisibility by 16, whether it is 1 and whether it needs 64 bits; the
constexprs), at least as fine as Triton's, and calls the built kernel's launcher directly.
The first call of each key goes through the JIT, which builds the kernel (or finds it in
its cache) and launches it; so does every call where the Triton installed does not expose
a built kernel's launcher as expected.

Importing this module needs Triton (installed with torch's CUDA builds).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton

try:
    from triton import knobs as _knobs
except ImportError:  # an older Triton: the JIT launches every call
    _knobs = None

__all__ = ["launch"]

# Per kernel: key -> its built kernel (``None``: this Triton's JIT launches each call).
_BUILT: dict[Any, dict[tuple[Any, ...], Any]] = {}
_LONG = 1 << 31


def _key(args: Sequence[Any], tail: tuple[Any, ...]) -> tuple[Any, ...]:
    """What Triton specializes a kernel on, for these arguments (finer is harmless)."""
    key: list[Any] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.dtype, a.device, a.data_ptr() % 16 == 0))
        elif isinstance(a, bool) or a is None:
            key.append(a)
        elif isinstance(a, int):
            key.append((a % 16 == 0, a == 1, -_LONG <= a < _LONG))
        else:
            key.append(type(a))
    return (*key, *tail)


def launch(
    kernel: Any,
    grid: tuple[int, ...],
    args: Sequence[Any],
    constexprs: dict[str, Any],
    **options: Any,
) -> None:
    """``kernel[grid](*args, **constexprs, **options)``, on the current device and stream.

    ``args``: the kernel's first parameters, in order; ``constexprs``: every one after them,
    by name; ``options``: ``num_warps``, ``num_stages`` (in the same order at every call).
    """
    built = _BUILT.get(kernel)
    if built is None:
        built = _BUILT[kernel] = {}
    # The constexprs in the kernel's order, as the launcher takes every parameter.
    tail = tuple(constexprs[name] for name in kernel.arg_names[len(args) :])
    key = (*_key(args, tail), *options.values())
    compiled = built.get(key, False)
    if compiled is False:
        got = kernel[grid](*args, **constexprs, **options)
        usable = _knobs is not None and all(
            hasattr(got, a) for a in ("run", "function", "packed_metadata", "launch_metadata")
        )
        built[key] = got if usable else None
        return
    if compiled is None:
        kernel[grid](*args, **constexprs, **options)
        return
    device = triton.runtime.driver.active.get_current_device()
    stream = triton.runtime.driver.active.get_current_stream(device)
    values = (*args, *tail)
    runtime = _knobs.runtime
    enter = runtime.launch_enter_hook
    meta = None if enter is None else compiled.launch_metadata(grid, stream, *values)
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata, meta,
                 enter, runtime.launch_exit_hook, *values)  # fmt: skip
