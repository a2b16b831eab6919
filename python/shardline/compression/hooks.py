"""Communication hooks for DDP: how one gradient bucket is reduced across ranks.

A hook starts the reduction of a flat gradient bucket and returns a function that finishes it.
The bucket arrives already divided by the world size (as in torch's DDP), so summing it across
ranks gives the average; when ``finish()`` returns, the bucket holds the reduced values in place.

```python
def my_hook(group: ProcessGroup, bucket: torch.Tensor) -> Callable[[], None]:
    work = group.all_reduce(bucket, "sum", async_op=True)
    return work.wait
```

Every rank must run the same hook: the hook's collectives are part of the step's collective
sequence, checked by the engine like any other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from shardline.errors import InvalidArgumentError

if TYPE_CHECKING:
    from shardline.comm.group import ProcessGroup

__all__ = [
    "CommHook",
    "allreduce_hook",
    "bf16_compress_hook",
    "fp16_compress_hook",
    "resolve_hook",
]

CommHook = Callable[["ProcessGroup", torch.Tensor], Callable[[], None]]
"""``hook(group, bucket) -> finish``: starts reducing ``bucket`` (summed across ranks);
``finish()`` waits and leaves the result in ``bucket``."""


def allreduce_hook(group: ProcessGroup, bucket: torch.Tensor) -> Callable[[], None]:
    """Sums the bucket across ranks in its own dtype (the default)."""
    work = group.all_reduce(bucket, "sum", async_op=True)
    assert work is not None
    return work.wait


def _compress_hook(dtype: torch.dtype) -> CommHook:
    def hook(group: ProcessGroup, bucket: torch.Tensor) -> Callable[[], None]:
        if bucket.dtype == dtype or not bucket.is_floating_point():
            return allreduce_hook(group, bucket)
        compressed = bucket.to(dtype)
        work = group.all_reduce(compressed, "sum", async_op=True)
        assert work is not None

        def finish() -> None:
            work.wait()
            bucket.copy_(compressed)

        return finish

    hook.__name__ = f"{str(dtype).removeprefix('torch.')}_compress_hook"
    hook.__doc__ = (
        f"Casts the bucket to {dtype} for the wire (half the bytes of float32), sums it "
        "(the native engine accumulates in float32) and casts the result back."
    )
    return hook


fp16_compress_hook: CommHook = _compress_hook(torch.float16)
bf16_compress_hook: CommHook = _compress_hook(torch.bfloat16)

_BY_NAME: dict[str, CommHook] = {
    "none": allreduce_hook,
    "allreduce": allreduce_hook,
    "fp16": fp16_compress_hook,
    "bf16": bf16_compress_hook,
}


def resolve_hook(hook: str | CommHook | None) -> CommHook:
    """Turns ``None``, a built-in hook's name (``"fp16"``, ``"bf16"``) or a callable into a hook.

    Raises:
        InvalidArgumentError: an unknown name or a non-callable.
    """
    if hook is None:
        return allreduce_hook
    if isinstance(hook, str):
        try:
            return _BY_NAME[hook.lower()]
        except KeyError:
            raise InvalidArgumentError(
                f"unknown comm_hook {hook!r}; use one of {', '.join(sorted(_BY_NAME))} or a "
                "callable hook(group, bucket) -> finish"
            ) from None
    if not callable(hook):
        raise InvalidArgumentError(
            f"comm_hook must be a name or a callable hook(group, bucket) -> finish, not {hook!r}"
        )
    return hook
