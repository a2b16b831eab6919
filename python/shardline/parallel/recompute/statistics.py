"""Activation memory over the ranks of a group: ``ActivationMemoryStats`` and byte formatting."""

from __future__ import annotations

from dataclasses import dataclass

from shardline.parallel.memory_estimate import format_bytes as _format_bytes

__all__ = ["ActivationMemoryStats", "format_bytes"]


@dataclass(frozen=True)
class ActivationMemoryStats:
    """Activation memory on every rank of a group, from ``memory_stats()``.

    Attributes:
        per_rank_bytes: Bytes of activations each rank holds now.
        per_rank_peak_bytes: The most each rank has held at once.
        per_rank_counts: How many tensors (whole or partition parts) each rank holds.
        per_rank_recomputed_bytes: Bytes ``checkpoint`` did not keep on each rank (recomputed
            in backward instead), while this manager was active.
    """

    per_rank_bytes: tuple[int, ...]
    per_rank_peak_bytes: tuple[int, ...]
    per_rank_counts: tuple[int, ...]
    per_rank_recomputed_bytes: tuple[int, ...]

    @property
    def world_size(self) -> int:
        """Number of ranks the statistics cover."""
        return len(self.per_rank_bytes)

    @property
    def total_bytes(self) -> int:
        """Bytes held now, summed over ranks."""
        return sum(self.per_rank_bytes)

    @property
    def total_peak_bytes(self) -> int:
        """Every rank's peak, summed (an upper bound of the group's simultaneous peak)."""
        return sum(self.per_rank_peak_bytes)

    @property
    def min_bytes(self) -> int:
        """Bytes held by the rank that holds the least."""
        return min(self.per_rank_bytes)

    @property
    def max_bytes(self) -> int:
        """Bytes held by the rank that holds the most."""
        return max(self.per_rank_bytes)

    @property
    def average_bytes(self) -> float:
        """Mean bytes held per rank."""
        return self.total_bytes / self.world_size

    @property
    def total_count(self) -> int:
        """Tensors held, summed over ranks (a partitioned entry counts once per rank)."""
        return sum(self.per_rank_counts)

    @property
    def total_recomputed_bytes(self) -> int:
        """Bytes recomputed instead of kept, summed over ranks."""
        return sum(self.per_rank_recomputed_bytes)

    def summary(self) -> str:
        """A readable multi-line report (exact byte counts in parentheses)."""

        def b(n: float) -> str:
            return f"{format_bytes(n)} ({round(n)} B)"

        per_rank = ", ".join(format_bytes(n) for n in self.per_rank_bytes)
        return "\n".join(
            [
                f"Activation memory over {self.world_size} rank(s):",
                f"  total held:        {b(self.total_bytes)} in {self.total_count} tensor(s)",
                f"  total peak:        {b(self.total_peak_bytes)}",
                f"  per rank:          min {format_bytes(self.min_bytes)}, "
                f"max {format_bytes(self.max_bytes)}, "
                f"average {format_bytes(self.average_bytes)}",
                f"  held by rank:      [{per_rank}]",
                f"  tensors by rank:   {list(self.per_rank_counts)}",
                f"  recomputed:        {b(self.total_recomputed_bytes)} not kept by checkpoint",
            ]
        )


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units: ``"512 B"``, ``"1.50 KiB"``, ``"2.00 MiB"``."""
    return _format_bytes(n, digits=2)
