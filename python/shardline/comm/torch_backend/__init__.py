"""The ``torch.distributed`` backend ``"shardline"``: PyTorch's collectives and DDP on our engine.

After ``import shardline``::

    torch.distributed.init_process_group("shardline")          # env://, or store=, rank=, ...
    model = torch.nn.parallel.DistributedDataParallel(model)    # all-reduces run on the engine

``register()`` hands torch a creator (``torch.distributed.Backend.register_backend``) that torch
calls once per group, for the default group and for every ``new_group(..., backend=
"shardline")``, with a store prefixed by the group's name and the group-local rank and size.
The creator builds a native ``shardline.comm.ProcessGroup`` through that store (under one more
``shardline/`` prefix; host identity from ``host_identity()``, job secret by ``job_secret``'s
rules) and wraps it in ``ShardlineProcessGroup``, a Python subclass of
``torch.distributed.ProcessGroup``: torch's Python code calls its methods directly, and torch's
pybind trampoline routes C++ callers (DDP's reducer, parameter checks, buffer broadcasts) to
them. Only CPU tensors are handled; CUDA tensors belong to NCCL.

The package, one role per file:

- ``__init__`` (this file): registration: ``register()``, ``is_registered()`` and the creator
  torch calls for every group (``_create_group``).
- ``process_group``: ``ShardlineProcessGroup`` and its checks of torch's arguments.
- ``work``: ``ShardlineWork``, the ``torch.distributed.Work`` of an op, and the threads that
  complete its futures (see [Note: completion] there).
- ``monitored``: ``monitored_barrier`` through the group's store.
- ``sparse``: all-reduce of sparse COO tensors.
- ``cpu_backend``: the ``Backend`` a group registers for the ``cpu`` device, where torch
  allows one written in Python.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from shardline import config
from shardline.comm import init_process_group
from shardline.comm.rendezvous.env import host_identity, timeout_seconds
from shardline.comm.torch_backend.process_group import BACKEND_NAME, ShardlineProcessGroup
from shardline.comm.torch_backend.work import ShardlineWork
from shardline.comm.trace.recorder import TRACER
from shardline.errors import ShardlineError
from shardline.heap import keep_freed_memory

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = ["BACKEND_NAME", "ShardlineProcessGroup", "ShardlineWork", "is_registered", "register"]

# torch's default timeout for CPU groups; passing it means "none given", so the engine's own
# default applies (SHARDLINE_TIMEOUT, else 300 s) instead of torch's 30 minutes.
_TORCH_DEFAULT_TIMEOUT = getattr(
    getattr(dist, "constants", None), "default_pg_timeout", timedelta(minutes=30)
)

_registered = False
_register_lock = threading.Lock()


def _missing_api() -> list[str]:
    """The torch APIs this backend needs that this torch build lacks."""
    if not dist.is_available():
        return ["torch.distributed (this torch build has no distributed support)"]
    needed = {
        "torch.distributed.Backend.register_backend": getattr(
            getattr(dist, "Backend", None), "register_backend", None
        ),
        "torch.distributed.ProcessGroup": getattr(dist, "ProcessGroup", None),
        "torch.distributed._Work": getattr(dist, "_Work", None),
        "torch.distributed.PrefixStore": getattr(dist, "PrefixStore", None),
        "torch.futures.Future": getattr(getattr(torch, "futures", None), "Future", None),
    }
    return [name for name, value in needed.items() if value is None]


def is_registered() -> bool:
    """Whether ``register()`` has registered the ``"shardline"`` backend with torch."""
    return _registered


def register(*, strict: bool = False) -> bool:
    """Registers ``"shardline"`` as a ``torch.distributed`` backend for CPU tensors.

    Idempotent; ``import shardline`` calls it. Afterwards ``init_process_group("shardline")``
    and ``new_group(ranks, backend="shardline")`` create groups on the native engine. The
    backend does not claim the ``cpu`` device for torch's default backend choice (gloo keeps it).

    Args:
        strict: Raise instead of returning ``False`` when this torch lacks the needed APIs.

    Returns:
        ``True`` once registered; ``False`` when this torch cannot host the backend (with
        ``strict=False``; if torch can register backends at all, creating a group then raises
        a ``ShardlineError`` that names the missing APIs).

    Raises:
        ShardlineError: ``strict`` is set and torch lacks an API the backend needs.
    """
    global _registered  # noqa: PLW0603  # one registration per process
    with _register_lock:
        if _registered:
            return True
        missing = _missing_api()
        if missing:
            message = (
                f"torch {torch.__version__} lacks {', '.join(missing)}, which the "
                f"{BACKEND_NAME!r} torch.distributed backend needs; use torch 2.11 or newer"
            )
            if strict:
                raise ShardlineError(message)
            register_backend = getattr(getattr(dist, "Backend", None), "register_backend", None)
            if register_backend is not None and BACKEND_NAME.upper() not in _plugins():
                # Fail at group creation with the reason, not at `import shardline`.
                register_backend(BACKEND_NAME, _unavailable(message), devices=["cpu"])
            return False
        if BACKEND_NAME.upper() not in _plugins():
            dist.Backend.register_backend(
                BACKEND_NAME, _create_group, extended_api=True, devices=["cpu"]
            )
        _registered = True
        return True


def _plugins() -> dict[str, Any]:
    plugins = getattr(getattr(dist, "Backend", None), "_plugins", None)
    return plugins if isinstance(plugins, dict) else {}


def _unavailable(message: str) -> Callable[..., Any]:
    def fail(*_args: object) -> Any:
        raise ShardlineError(message)

    return fail


# -- group creation ---------------------------------------------------------------------------


def _engine_timeout(timeout: timedelta | None) -> float:
    """The engine's deadline: torch's ``timeout`` if the user chose one, else ours."""
    if timeout is None or timeout == _TORCH_DEFAULT_TIMEOUT:
        return timeout_seconds(None)
    return timeout_seconds(timeout)


def _master_addr(store: Store) -> str | None:
    """The rendezvous host: the innermost store's ``host``, else ``MASTER_ADDR``."""
    inner: object = store
    while isinstance(inner, dist.PrefixStore):  # type: ignore[attr-defined]
        inner = inner.underlying_store
    host = getattr(inner, "host", None)
    return str(host) if host else config.env_var("MASTER_ADDR") or None


def _create_group(opts: Any, backend_options: object | None = None) -> ShardlineProcessGroup:
    """Creates one group; torch calls it with ``extended_api`` arguments.

    Args:
        opts: torch's ``_DistributedBackendOptions``: the group's prefixed store, group-local
            rank and size, timeout and id.
        backend_options: ``init_process_group(pg_options=...)``; unused.
    """
    del backend_options  # no options of our own yet
    store: Store = opts.store
    group_id = str(getattr(opts, "group_id", "") or "0")
    timeout = _engine_timeout(getattr(opts, "timeout", None))
    group = init_process_group(
        dist.PrefixStore(f"{BACKEND_NAME}/", store),  # type: ignore[attr-defined]
        int(opts.group_rank),
        int(opts.group_size),
        backend="native",
        host_id=host_identity(),
        name=f"torch.{group_id}",
        timeout=timeout,
        master_addr=_master_addr(store),
    )
    if config.get("SHARDLINE_KEEP_FREED_MEMORY"):  # as ``shardline.init`` does on CPU
        keep_freed_memory()
    where = config.get("SHARDLINE_TRACE")
    if where and not TRACER.active and not dist.is_initialized():  # the default group
        TRACER.start(where, rank=group.rank, world_size=group.world_size, backend=BACKEND_NAME)
    return ShardlineProcessGroup(group, store=store, timeout=timeout)


# Importing this package registers the backend; `import shardline` imports it.
register()
