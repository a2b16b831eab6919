"""One action of a pipeline schedule, and which rank holds a stage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Action", "Kind", "stage_rank"]

Kind = Literal["F", "B", "I", "W"]


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule: ``kind`` on micro-batch ``mb`` through ``stage``."""

    kind: Kind
    stage: int
    mb: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.stage}.{self.mb}"


def stage_rank(stage: int, p: int) -> int:
    """The rank that holds ``stage`` in a pipeline of ``p`` ranks."""
    return stage % p
