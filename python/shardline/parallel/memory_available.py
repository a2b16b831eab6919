"""How much memory one rank may use: free GPU memory, or the host's shared by its ranks.

``fit.plan_strategy`` budgets every choice against it.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from shardline import config
from shardline.errors import InvalidArgumentError

__all__ = ["available_memory", "default_device"]

_MEMINFO = "/proc/meminfo"


def available_memory(device: torch.device | str | int = "cpu") -> int:
    """Free bytes one rank can use on ``device``.

    CUDA: the free memory ``torch.cuda.mem_get_info`` reports. CPU: ``MemAvailable`` from
    ``/proc/meminfo`` (or ``os.sysconf`` where ``/proc`` is missing) divided by the ranks on
    this host (``LOCAL_WORLD_SIZE``, default 1).

    Raises:
        InvalidArgumentError: a device that is neither CPU nor an available CUDA device, or a
            malformed ``LOCAL_WORLD_SIZE``.
    """
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidArgumentError(f"available_memory({device!r}): CUDA is not available")
        return int(torch.cuda.mem_get_info(dev)[0])
    if dev.type != "cpu":
        raise InvalidArgumentError(
            f"available_memory() knows cpu and cuda devices, not {dev.type!r}"
        )
    raw = config.env_var("LOCAL_WORLD_SIZE", default="1")
    try:
        local = int(raw)
    except ValueError:
        raise InvalidArgumentError(f"LOCAL_WORLD_SIZE={raw!r} is not an integer") from None
    return _host_available() // max(local, 1)


def _host_available() -> int:
    """``MemAvailable`` of this host in bytes."""
    try:
        with open(_MEMINFO, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    value, *unit = line.split()[1:]
                    return int(value) * (1024 if unit and unit[0].lower() == "kb" else 1)
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_device(model: nn.Module) -> torch.device:
    """The device a model trains on: its own if CUDA, else CUDA when present, else CPU."""
    first = next(model.parameters(), None)
    if first is not None and first.device.type == "cuda":
        return first.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
