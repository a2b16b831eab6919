"""Symmetric memory (``sl.symmetric_empty``): all-reduces without a copy through the slots.

The result must be the rank-order reduction, bit for bit, as through the slots (the values
round when added, so another order of additions would show); ranks that disagree about where
their tensor is must fail, all of them, with a message that says so; and nothing may be left
in ``/dev/shm``.
"""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

import pytest
import torch

import shardline as sl
from shardline import _native
from shardline.comm import ProcessGroup
from tests._ranks import run_ranks

pytestmark = pytest.mark.usefixtures("native")
# Ragged sizes: one element, less than a block, and several blocks per rank's part.
SIZES = [1, 1000, (1 << 20) + 7]


def values(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    i = torch.arange(n, dtype=torch.float64)
    v = ((i * 2_654_435_761 + rank * 40_503) % 1_000_003) / 7.0
    return v.to(dtype) if dtype.is_floating_point else (v % 1000).to(dtype)


def shm_files() -> set[str]:
    """This process's files in /dev/shm (the ranks are its threads; other test processes
    may run beside it)."""
    return {f for f in os.listdir("/dev/shm") if f.startswith(f"shardline-{os.getpid()}-")}


@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize(
    ("dtype", "op"),
    [(torch.float32, "sum"), (torch.bfloat16, "sum"), (torch.float32, "avg"), (torch.int32, "max")],
)
def test_all_reduce_in_symmetric_memory_equals_the_one_through_the_slots(
    world: int, dtype: torch.dtype, op: str
) -> None:
    before = shm_files()

    def body(g: ProcessGroup) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for n in SIZES:
            # A view that starts inside the allocation, not at its base.
            t = sl.symmetric_empty(n + 13, dtype=dtype, group=g)[13:]
            t.copy_(values(g.rank, n, dtype))
            plain = values(g.rank, n, dtype)
            g.all_reduce(t, op=op)
            g.all_reduce(plain, op=op)
            out.append((t.clone(), plain))
        return out

    results = run_ranks(world, body)
    for k, n in enumerate(SIZES):
        # Half-precision sums accumulate in float32 and round once, as the engine documents.
        wide = torch.float32 if dtype == torch.bfloat16 else dtype
        inputs = [values(r, n, dtype).to(wide) for r in range(world)]
        want = {
            "sum": functools.reduce(torch.add, inputs).to(dtype),
            "max": functools.reduce(torch.maximum, inputs).to(dtype),
            "avg": None,  # the engine's mean: the path through the slots is the reference
        }[op]
        for rank, per_size in enumerate(results):
            got, plain = per_size[k]
            assert torch.equal(got, plain), (
                f"{world} ranks, {n} x {dtype} {op}: rank {rank} differs from the all-reduce "
                f"through the slots at {int((got != plain).sum())} elements"
            )
            if want is not None:
                assert torch.equal(got, want), (rank, n, int((got != want).sum()))
    assert shm_files() <= before, f"left in /dev/shm: {shm_files() - before}"


def test_avg_is_the_mean() -> None:
    def body(g: ProcessGroup) -> torch.Tensor:
        t = sl.symmetric_empty(4096, group=g)
        t.copy_(values(g.rank, 4096, torch.float32))
        g.all_reduce(t, op="avg")
        return t.clone()

    results = run_ranks(3, body)
    want = sum(values(r, 4096, torch.float64) for r in range(3)) / 3
    for got in results:
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("odd_one", ["ordinary tensor", "other offset"])
def test_ranks_that_disagree_about_the_place_all_fail_naming_it(odd_one: str) -> None:
    def body(g: ProcessGroup) -> str:
        memory = sl.symmetric_empty(1 << 16, group=g)
        t = memory[: 1 << 15]
        if g.rank == 1:
            t = torch.zeros(1 << 15) if odd_one == "ordinary tensor" else memory[1 << 15 :]
        with pytest.raises(sl.ShardlineError) as caught:
            g.all_reduce(t)
        return f"{type(caught.value).__name__}: {caught.value}"

    for message in run_ranks(3, body):
        # Each rank names rank 1 (or learns of it from the abort of the rank that saw it).
        assert "symmetric memory" in message and "rank 1 passed" in message, message


def test_unequal_sizes_fail_on_every_rank() -> None:
    def body(g: ProcessGroup) -> str:
        with pytest.raises(sl.ShardlineError) as caught:
            sl.symmetric_empty(100 + g.rank, group=g)
        return str(caught.value)

    for message in run_ranks(2, body):
        assert "same size" in message, message


def test_across_hosts_it_is_an_ordinary_tensor_and_all_reduce_works() -> None:
    def body(g: ProcessGroup) -> torch.Tensor:
        t = sl.symmetric_empty(2, 3, group=g)
        assert t.shape == (2, 3) and t.dtype == torch.float32
        t.fill_(g.rank + 1)
        g.all_reduce(t)
        return t

    for got in run_ranks(2, body, transport="tcp"):
        assert torch.equal(got, torch.full((2, 3), 3.0))


def test_too_little_room_in_dev_shm_is_an_error_not_a_crash(tmp_path: Path) -> None:
    """A segment larger than its tmpfs fails when it is made (every page is allocated then),
    naming the remedy, instead of a SIGBUS at the first collective that touches the page."""
    small = tmp_path / "shm"
    small.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    try:
        with pytest.raises(sl.ShardlineError, match="shm-size"):
            _native.symmetric_create(str(small / "segment"), 4 << 20)
        assert not list(small.iterdir()), "the failed segment's file was left behind"
    finally:
        subprocess.run(["umount", str(small)], check=False)
