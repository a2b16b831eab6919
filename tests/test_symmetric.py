"""Symmetric memory (``sl.symmetric_empty``, ``SymmetricArena``): all-reduce, reduce-scatter
and all-gather without a copy through the slots.

The result must be the rank-order reduction, bit for bit, as through the slots (the values
round when added, so another order of additions would show); ranks that disagree about where
their tensor is must fail, all of them, with a message that says so; nothing may be left in
``/dev/shm``, and no mapping once the tensors are gone.
"""

from __future__ import annotations

import functools
import gc
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

import shardline as sl
from shardline import _native
from shardline.comm import ProcessGroup, symmetric
from shardline.comm.symmetric import SymmetricArena, wait_for_releases, wants_symmetric
from tests._ranks import THREAD_PREFIX, run_ranks
from tests._symmetric_maps import symmetric_ranges

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


@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize(
    ("dtype", "op"), [(torch.float32, "sum"), (torch.bfloat16, "avg"), (torch.int32, "max")]
)
def test_reduce_scatter_of_a_symmetric_input_equals_the_one_through_the_slots(
    world: int, dtype: torch.dtype, op: str
) -> None:
    before = shm_files()

    def body(g: ProcessGroup) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for n in SIZES:
            inp = sl.symmetric_empty(world * n + 5, dtype=dtype, group=g)[5:]
            inp.copy_(values(g.rank, world * n, dtype))
            got, plain = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
            g.reduce_scatter(got, inp, op=op)
            g.reduce_scatter(plain, values(g.rank, world * n, dtype), op=op)
            out.append((got, plain))
        return out

    results = run_ranks(world, body)
    for k, n in enumerate(SIZES):
        wide = torch.float32 if dtype == torch.bfloat16 else dtype
        inputs = [values(r, world * n, dtype).to(wide) for r in range(world)]
        reduce = {"sum": torch.add, "max": torch.maximum}.get(op)  # avg: compared with slots
        total = None if reduce is None else functools.reduce(reduce, inputs).to(dtype)
        for rank, per_size in enumerate(results):
            got, plain = per_size[k]
            assert torch.equal(got, plain), (world, n, rank, int((got != plain).sum()))
            if total is not None:
                assert torch.equal(got, total[rank * n : (rank + 1) * n]), (world, n, rank)
    assert shm_files() <= before, f"left in /dev/shm: {shm_files() - before}"


@pytest.mark.parametrize("where", ["output", "input"])
@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_all_gather_with_symmetric_memory_equals_the_concatenation(
    world: int, dtype: torch.dtype, where: str
) -> None:
    def body(g: ProcessGroup) -> list[torch.Tensor]:
        out = []
        for n in SIZES:
            if where == "output":
                t = sl.symmetric_empty(world * n + 3, dtype=dtype, group=g)[3:]
                part = values(g.rank, n, dtype)
            else:
                t = torch.empty(world * n, dtype=dtype)
                part = sl.symmetric_empty(n + 3, dtype=dtype, group=g)[3:]
                part.copy_(values(g.rank, n, dtype))
            t.fill_(-1)
            g.all_gather(t, part)
            out.append(t.clone())
        return out

    results = run_ranks(world, body)
    for k, n in enumerate(SIZES):
        want = torch.cat([values(r, n, dtype) for r in range(world)])
        for rank, per_size in enumerate(results):
            assert torch.equal(per_size[k], want), (world, n, rank)


@pytest.mark.parametrize("mode", ["2", "0"])
@pytest.mark.parametrize("where", ["output", "input"])
def test_an_all_gather_that_streams_into_its_output_equals_the_concatenation(
    where: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outputs of 64 MiB and more of 4 ranks or more are written with streaming stores
    (``SHARDLINE_STREAM_STORES`` 2, the default), here at an odd offset and a length that is
    no multiple of 64 bytes; ``0`` copies them plainly. Both must give every byte."""
    monkeypatch.setenv("SHARDLINE_STREAM_STORES", mode)
    world, n = 4, (4 << 20) + 5  # 4 x 16 MiB + 80 bytes of float32
    gen = torch.Generator().manual_seed(5)
    parts = [torch.randn(n, generator=gen) for _ in range(world)]

    def body(g: ProcessGroup) -> torch.Tensor:
        if where == "output":
            t = sl.symmetric_empty(world * n + 3, group=g)[3:]
            part = parts[g.rank]
        else:
            t = torch.empty(world * n)
            part = sl.symmetric_empty(n + 1, group=g)[1:]
            part.copy_(parts[g.rank])
        t.fill_(-1)
        g.all_gather(t, part)
        return t.clone()

    want = torch.cat(parts)
    assert want.nbytes >= 64 << 20
    for got in run_ranks(world, body):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    "symmetric_ranks", [{0}, {1, 2}, {0, 1, 2}], ids=["one", "all-but-one", "all"]
)
def test_reduce_scatter_takes_each_input_where_its_rank_put_it(symmetric_ranks: set[int]) -> None:
    """Inputs in symmetric memory on some ranks (each at an offset of its own: a pool's), the
    others ordinary: every rank's block is the rank-order reduction, as through the slots,
    in one chunk and in many (larger than the slots)."""
    world = 3

    def body(g: ProcessGroup) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for n in SIZES:
            pool = sl.symmetric_empty(world * n + 64 * world, group=g)  # the same everywhere
            at = 64 * (g.rank + 1)  # ... but a different offset on every rank
            symmetric = g.rank in symmetric_ranks
            inp = pool[at : at + world * n] if symmetric else torch.empty(world * n)
            inp.copy_(values(g.rank, world * n, torch.float32))
            got, plain = torch.empty(n), torch.empty(n)
            g.reduce_scatter(got, inp, op="sum")
            inp.fill_(-1)  # the op is over: this rank may reuse its input at once
            g.reduce_scatter(plain, values(g.rank, world * n, torch.float32), op="sum")
            out.append((got, plain))
        return out

    results = run_ranks(world, body)
    for k, n in enumerate(SIZES):
        total = functools.reduce(
            torch.add, [values(r, world * n, torch.float32) for r in range(world)]
        )
        for rank, per_size in enumerate(results):
            got, plain = per_size[k]
            assert torch.equal(got, plain), (n, rank, int((got != plain).sum()))
            assert torch.equal(got, total[rank * n : (rank + 1) * n]), (n, rank)


@pytest.mark.parametrize("op", ["all_gather output", "all_gather input"])
def test_a_rank_outside_symmetric_memory_fails_every_rank_naming_it(op: str) -> None:
    def body(g: ProcessGroup) -> str:
        big, small = torch.zeros(3 * 1024), torch.zeros(1024)
        if g.rank != 1:  # rank 1 passes ordinary tensors
            if op == "all_gather input":
                small = sl.symmetric_empty(1024, group=g)
            else:
                big = sl.symmetric_empty(3 * 1024, group=g)
        else:  # the allocation is a collective: rank 1 makes it too, and does not use it
            sl.symmetric_empty(1024 if op == "all_gather input" else 3 * 1024, group=g)
        call = (
            (lambda: g.reduce_scatter(small, big))
            if op == "reduce_scatter"
            else (lambda: g.all_gather(big, small))
        )
        with pytest.raises(sl.ShardlineError) as caught:
            call()
        return f"{type(caught.value).__name__}: {caught.value}"

    for message in run_ranks(3, body):
        assert "symmetric memory" in message and "rank 1 passed" in message, message


def mappings() -> int:
    """Mappings of this process's (unlinked) symmetric segments."""
    return len(symmetric_ranges())


def test_the_mappings_go_when_the_last_tensor_does() -> None:
    """The last tensor on an allocation going queues its release; ``wait_for_releases``
    returns once it is done (every rank queued its own before the barrier)."""
    before = mappings()

    def body(g: ProcessGroup) -> tuple[int, int]:
        t = sl.symmetric_empty(1 << 16, group=g)
        view = t[100:200]
        g.all_reduce(t)
        held = mappings()  # every rank (thread) maps every rank's segment
        del t
        gc.collect()
        g.all_reduce(view)  # the view keeps the allocation
        g.barrier()
        del view
        gc.collect()
        g.barrier()
        assert wait_for_releases()
        return held, mappings()

    counts = run_ranks(3, body)
    assert max(held for held, _ in counts) - before >= 3  # every rank's three, at least
    assert [after for _, after in counts] == [before] * 3, "a release was not done"
    assert mappings() == before, "the engine kept the segments after their tensors went"


def test_the_release_thread_ends_at_exit_and_starts_again_for_new_memory() -> None:
    """At exit (atexit) the release thread ends, so that nothing the interpreter's teardown
    frees is released from it while Python finalizes. Memory allocated afterwards starts it
    again, and its releases are done."""
    symmetric._start_releaser()  # as the first allocation does
    assert symmetric.wait_for_releases()
    symmetric._stop_releaser()
    assert symmetric._releaser is not None and not symmetric._releaser.is_alive()
    assert symmetric.wait_for_releases(timeout=1.0)  # nothing to wait for: no thread
    before = mappings()

    def body(g: ProcessGroup) -> int:
        t = sl.symmetric_empty(1 << 12, group=g)
        g.all_reduce(t)
        del t
        g.barrier()
        assert symmetric.wait_for_releases()
        return mappings()

    assert run_ranks(2, body) == [before, before]
    assert symmetric._releaser.is_alive()


def test_collecting_another_ranks_symmetric_memory_does_not_wait_for_its_collective() -> None:
    """Rank threads share the garbage collector. Rank 0's collection frees rank 1's symmetric
    memory while rank 1 waits in an all-reduce for rank 0; the release (which waits for the
    op that group has in progress) goes to the release thread, so rank 0 goes on into that
    all-reduce. Run on rank 0's thread, it waited for rank 1's op to time out."""
    inside = threading.Event()

    def body(g: ProcessGroup) -> bool:
        t = sl.symmetric_empty(1 << 10, group=g)
        if g.rank == 1:
            cycle: list[object] = [t]
            cycle.append(cycle)  # only the collector frees it
            del t, cycle
            inside.set()
            g.all_reduce(torch.ones(4))  # waits for rank 0, holding its group's engine
            return True
        assert inside.wait(30)
        time.sleep(0.3)  # rank 1 is in the all-reduce by now
        gc.collect()
        g.all_reduce(torch.ones(4))
        return t.numel() == 1 << 10

    gc.disable()  # no collection but rank 0's
    try:
        assert all(run_ranks(2, body, op_timeout=10.0))
    finally:
        gc.enable()


def test_an_arena_hands_out_aligned_buffers_at_the_same_places() -> None:
    sizes = [(5, torch.float32), (1000, torch.bfloat16), (3, torch.float64)]

    def body(g: ProcessGroup) -> list[torch.Tensor]:
        arena = SymmetricArena(SymmetricArena.bytes_for(sizes), group=g)
        taken = [arena.take(n, dt) for n, dt in sizes]
        base = taken[0].data_ptr()
        assert [t.data_ptr() - base for t in taken] == [0, 64, 64 + 2048]
        for t in taken:
            assert not t.any()  # zero-filled
            t.copy_(values(g.rank, t.numel(), t.dtype))
            g.all_reduce(t)
        with pytest.raises(sl.InvalidArgumentError, match="bytes_for"):
            arena.take(1, torch.float32)
        return taken

    results = run_ranks(2, body)
    for k, (n, dt) in enumerate(sizes):
        wide = torch.float32 if dt == torch.bfloat16 else dt
        want = (values(0, n, dt).to(wide) + values(1, n, dt).to(wide)).to(dt)
        assert all(torch.equal(r[k], want) for r in results)


def test_wants_symmetric_is_automatic_explicit_and_says_why_not() -> None:
    def body(g: ProcessGroup) -> tuple[bool, bool, bool, str]:
        cpu = torch.device("cpu")
        auto = wants_symmetric(g, cpu, None, "DDP")
        off = wants_symmetric(g, cpu, False, "DDP")
        on = wants_symmetric(g, cpu, True, "DDP") if g.transport == "shm" else False
        message = ""
        if g.transport != "shm":
            with pytest.raises(sl.InvalidArgumentError) as caught:
                wants_symmetric(g, cpu, True, "DDP")
            message = str(caught.value)
        return auto, off, on, message

    assert run_ranks(2, body) == [(True, False, True, "")] * 2
    for auto, off, _, message in run_ranks(2, body, transport="tcp"):
        assert not auto and not off
        assert "DDP: symmetric=True" in message and "no shared memory" in message, message


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


def test_no_room_on_one_rank_gives_every_rank_ordinary_tensors_or_one_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A rank that cannot make its segment (``/dev/shm`` full) does not leave the others
    waiting: all of them learn it, and fall back together (DDP's automatic choice, with a
    warning) or fail together (``symmetric=True``), naming the rank."""
    create = _native.symmetric_create

    def full_on_rank_1(path: str, nbytes: int) -> None:
        if threading.current_thread().name == f"{THREAD_PREFIX}1":
            raise sl.ShardlineError(f"no room for {nbytes} bytes in /dev/shm (test)")
        create(path, nbytes)

    monkeypatch.setattr(_native, "symmetric_create", full_on_rank_1)

    def body(g: ProcessGroup) -> tuple[bool, bool, str]:
        auto = sl.DistributedDataParallel(torch.nn.Linear(8, 8), group=g)
        x = torch.full((4, 8), float(g.rank))
        auto(x).sum().backward()  # trains on ordinary buckets
        with pytest.raises(sl.ShardlineError) as caught:
            sl.DistributedDataParallel(torch.nn.Linear(8, 8), group=g, symmetric=True)
        arena = SymmetricArena(4096, group=g, required=False)
        return auto.symmetric, arena.symmetric, str(caught.value)

    with caplog.at_level("WARNING", logger="shardline"):
        results = run_ranks(3, body)
    for auto, arena, message in results:
        assert not auto and not arena
        assert "rank(s) 1" in message and "no room" in message, message
    assert "could not be had on rank(s) [1]" in caplog.text
