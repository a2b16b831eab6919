"""Both shared-memory all-reduce algorithms give the rank-order sum, bit for bit, at 2-16 ranks.

Which one runs is chosen per communicator from measured costs (``SHARDLINE_ONESHOT_BYTES``
unset: ``rust/src/collectives/tuning.rs``), so every size must be right under either. Here
each is forced at every size: ``0`` makes every all-reduce two-phase (reduce-scatter, then
all-gather), a limit above every size makes each one-shot (every rank reads every input).
The values round when added, so a different order of additions would show in the bits.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardline.comm import ProcessGroup
from tests._ranks import run_ranks

pytestmark = pytest.mark.usefixtures("native")
ALGORITHMS = {"two-phase": "0", "one-shot": str(1 << 30)}
# Ragged sizes across the probe sizes (1 KiB - 256 KiB of f32) and beyond.
SIZES = st.lists(st.integers(0, 100_000), min_size=1, max_size=3)


def values(rank: int, n: int) -> torch.Tensor:
    i = torch.arange(n, dtype=torch.float64)
    return (((i * 2_654_435_761 + rank * 40_503) % 1_000_003) / 7.0).to(torch.float32)


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
@pytest.mark.parametrize("world", [2, 3, 8, 16])
@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(sizes=SIZES)
def test_either_algorithm_gives_the_rank_order_sum(
    monkeypatch: pytest.MonkeyPatch, algorithm: str, world: int, sizes: list[int]
) -> None:
    monkeypatch.setenv("SHARDLINE_ONESHOT_BYTES", ALGORITHMS[algorithm])
    # One-shot runs up to a slot's size: slots above the largest size, on every machine.
    monkeypatch.setenv("SHARDLINE_SHM_SLOT_BYTES", str(1 << 20))

    def body(g: ProcessGroup) -> list[torch.Tensor]:
        assert g._impl._g.oneshot_bytes == int(ALGORITHMS[algorithm])  # type: ignore[attr-defined]
        out = []
        for n in sizes:
            t = values(g.rank, n)
            g.all_reduce(t)
            out.append(t)
        return out

    results = run_ranks(world, body, timeout=120)
    for k, n in enumerate(sizes):
        want = functools.reduce(torch.add, (values(r, n) for r in range(world)))
        for rank, got in enumerate(results):
            assert torch.equal(got[k], want), (
                f"{algorithm}, {world} ranks, {n} floats: rank {rank} differs from the "
                f"rank-order sum at {int((got[k] != want).sum())} elements"
            )
