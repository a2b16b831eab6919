"""Where this process has mapped symmetric memory (the ranks of a test are its threads)."""

from __future__ import annotations

import os

import torch

__all__ = ["in_symmetric_memory", "symmetric_ranges"]


def symmetric_ranges() -> list[tuple[int, int]]:
    """Address ranges of this process's symmetric segments, one per mapping."""
    with open("/proc/self/maps") as maps:
        lines = [line for line in maps if f"/shardline-{os.getpid()}-symm-" in line]
    return [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in lines]  # type: ignore[misc]


def in_symmetric_memory(t: torch.Tensor) -> bool:
    """Whether all of ``t``'s bytes lie in one symmetric segment."""
    start = t.data_ptr()
    return any(lo <= start and start + t.nbytes <= hi for lo, hi in symmetric_ranges())
