"""The group's backend for the ``cpu`` device, as torch's own groups have one.

``ShardlineProcessGroup`` is a Python subclass of ``torch.distributed.ProcessGroup`` (torch
calls its methods directly, and only such a group can hand torch a ``Work`` of its own, which a
receive from any source needs for ``_source_rank()``). Such a group has no backend registered
for a device, and torch asks for one in places: ``group._device_types`` (which
``dist.monitored_barrier`` and ``dcp.async_save`` check for ``cpu``), and the C++ dispatcher's
``getBackend(cpu)``, which functional collectives (``torch.distributed._functional_collectives``,
DTensor on a CPU mesh) go through.

Where torch lets Python subclass ``torch._C._distributed_c10d.Backend`` (it does not up to
2.11), each group registers a ``CpuBackend`` for ``cpu``: a thin forwarder whose every
collective calls the group's method of the same name, so both ways in run the same code.
Elsewhere the group registers nothing and those torch features stay unavailable, as before.
"""

from __future__ import annotations

import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from shardline.errors import CommunicatorClosedError

if TYPE_CHECKING:
    from shardline.comm.torch_backend.process_group import ShardlineProcessGroup

__all__ = ["attach", "supported"]

# The torch method names a backend serves, as torch's trampoline looks them up, and the
# group's methods they forward to (older names to the methods the group defines).
_FORWARDED = {
    name: name
    for name in (
        "allreduce",
        "allreduce_coalesced",
        "broadcast",
        "reduce",
        "allgather",
        "allgather_coalesced",
        "all_gather_single",
        "all_gather_single_coalesced",
        "reduce_scatter",
        "reduce_scatter_single",
        "reduce_scatter_single_coalesced",
        "gather",
        "scatter",
        "alltoall",
        "all_to_all_single",
        "barrier",
        "send",
        "recv",
        "recv_anysource",
    )
} | {
    "allreduce_sparse": "allreduce",
    "_allgather_base": "all_gather_single",
    "allgather_into_tensor_coalesced": "all_gather_single_coalesced",
    "_reduce_scatter_base": "reduce_scatter_single",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_single_coalesced",
    "alltoall_base": "all_to_all_single",
}

_Backend: Any = getattr(getattr(torch._C, "_distributed_c10d", None), "Backend", None)


def _supported() -> bool:
    """Whether this torch lets Python subclass ``Backend`` (a trampoline class; 2.15 has it)."""
    if _Backend is None:
        return False
    try:
        type("Probe", (_Backend,), {})(0, 1)
    except TypeError:  # "No constructor defined": a plain binding, not a trampoline
        return False
    return True


def _forward(name: str, target: str) -> Any:
    def method(self: Any, *args: Any) -> Any:
        return getattr(self._group(), target)(*args)

    method.__name__ = name
    method.__doc__ = f"The group's ``{target}``."
    return method


def _monitored_barrier(self: Any, opts: Any = None, wait_all_ranks: bool = False) -> None:
    """The group's ``monitored_barrier``; torch passes ``BarrierOptions`` here."""
    timeout = getattr(opts, "timeout", opts)
    if isinstance(timeout, timedelta) and timeout < timedelta(0):  # torch's "unset"
        timeout = None
    self._group().monitored_barrier(timeout, wait_all_ranks)


def _make_class() -> type:
    def __init__(self: Any, group: ShardlineProcessGroup) -> None:
        _Backend.__init__(self, group.rank(), group.size())
        self._ref = weakref.ref(group)

    def _group(self: Any) -> ShardlineProcessGroup:
        group: ShardlineProcessGroup | None = self._ref()
        if group is None:
            raise CommunicatorClosedError(
                "this shardline group was destroyed; create a new one with "
                "torch.distributed.new_group"
            )
        return group

    namespace: dict[str, Any] = {
        "__doc__": "The ``cpu`` backend of a ``ShardlineProcessGroup``: forwards to the group.",
        "__init__": __init__,
        "_group": _group,
        "getBackendName": lambda self: "shardline",
        "monitored_barrier": _monitored_barrier,
        # The group's own shutdown and abort end the engine; the backend holds nothing.
        "shutdown": lambda self: None,
        "abort": lambda self: None,
    }
    namespace |= {name: _forward(name, target) for name, target in _FORWARDED.items()}
    return type("CpuBackend", (_Backend,), namespace)


_CLASS: type | None = _make_class() if _supported() else None


def supported() -> bool:
    """Whether groups get a ``cpu`` backend on this torch (see the module docs)."""
    return _CLASS is not None


def attach(group: ShardlineProcessGroup) -> None:
    """Registers a ``CpuBackend`` forwarding to ``group`` as its backend for ``cpu``."""
    if _CLASS is None:
        return
    kind = dist.ProcessGroup.BackendType.CUSTOM
    group._register_backend(torch.device("cpu"), kind, _CLASS(group))
    group._set_default_backend(kind)
