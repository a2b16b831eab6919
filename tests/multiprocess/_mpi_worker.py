"""One MPI rank: ``mpirun -n N python _mpi_worker.py SCENARIO``; prints ``OK`` or ``ERROR ...``.

Expected values are computed with plain torch on every rank's known inputs.
"""

from __future__ import annotations

import sys

import torch

import shardline as sl


def inputs(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input: small integers, exact in every dtype (bf16 included)."""
    return ((torch.arange(n) % 7) + rank + 1).to(dtype)


def collectives() -> None:
    group = sl.init(backend="mpi")
    r, w = sl.get_rank(), sl.get_world_size()
    assert group.backend == "mpi" and group.transport == "mpi", group
    everyone = [inputs(q, 1000, torch.float64) for q in range(w)]
    stacked = torch.stack(everyone)
    references = {
        "sum": stacked.sum(0),
        "avg": stacked.mean(0),
        "max": stacked.max(0).values,
        "min": stacked.min(0).values,
        "prod": stacked.prod(0),
    }
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64):
        for op, want in references.items():
            if op == "avg" and not dtype.is_floating_point:
                continue
            t = inputs(r, 1000, dtype)
            sl.all_reduce(t, op=op)
            assert torch.equal(t.double(), want.to(dtype).double()), (dtype, op, t[:5])

    flags = torch.tensor([r == 0, True, False])
    sl.all_reduce(flags, op="sum")  # "or"
    assert flags.tolist() == [True, True, False]
    flags = torch.tensor([r == 0, True, False])
    sl.all_reduce(flags, op="prod")  # "and"
    assert flags.tolist() == [w == 1, True, False]

    out = torch.empty(3 * w, dtype=torch.bfloat16)
    sl.all_gather(out, inputs(r, 3, torch.bfloat16))
    assert torch.equal(out, torch.cat([inputs(q, 3, torch.bfloat16) for q in range(w)]))
    parts = [torch.empty(q + 1, dtype=torch.int32) for q in range(w)]  # unequal sizes
    sl.all_gather(parts, torch.full((r + 1,), r, dtype=torch.int32))
    assert [p.tolist() for p in parts] == [[q] * (q + 1) for q in range(w)]

    big = inputs(r, 4 * w, torch.float32)
    mine = torch.empty(4)
    sl.reduce_scatter(mine, big)
    total = sum(inputs(q, 4 * w, torch.float32) for q in range(w))
    assert torch.equal(mine, total[4 * r : 4 * r + 4]), mine

    t = inputs(r, 10, torch.float16)
    sl.broadcast(t, src=w - 1)
    assert torch.equal(t, inputs(w - 1, 10, torch.float16))

    t = inputs(r, 10, torch.float32)
    sl.reduce(t, dst=0, op="max")
    if r == 0:
        assert torch.equal(t, inputs(w - 1, 10, torch.float32))

    gathered = torch.empty(5 * w) if r == 0 else None
    sl.gather(inputs(r, 5, torch.float32), gathered, dst=0)
    if gathered is not None:
        assert torch.equal(gathered, torch.cat([inputs(q, 5, torch.float32) for q in range(w)]))

    piece = torch.empty(2, dtype=torch.int64)
    source = [torch.full((2,), q * 10, dtype=torch.int64) for q in range(w)] if r == 0 else None
    sl.scatter(piece, source, src=0)
    assert piece.tolist() == [r * 10, r * 10]

    out = torch.empty(w, dtype=torch.int64)
    sl.all_to_all(out, torch.arange(w) + 100 * r)
    assert out.tolist() == [r + 100 * q for q in range(w)]

    if w >= 2:
        if r == 0:
            sl.send(torch.arange(6.0), dst=1)
        elif r == 1:
            got = torch.empty(6)
            sl.recv(got, src=0)
            assert torch.equal(got, torch.arange(6.0))

    work = sl.all_reduce(torch.ones(1 << 20), async_op=True)
    assert work is not None
    work.wait()
    sub = sl.new_group([w - 1])
    if r == w - 1:
        assert sub is not None and sub.world_size == 1
        t = torch.ones(3)
        sub.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
    sl.barrier()
    print("OK", flush=True)
    sl.shutdown()


def mismatch() -> None:
    """RANK/WORLD_SIZE are set to values MPI disagrees with; every rank must fail."""
    try:
        sl.init(backend="mpi")
        print("OK no error", flush=True)
        sl.shutdown()
    except sl.ShardlineError as exc:
        print(f"ERROR {type(exc).__name__} {exc}", flush=True)


SCENARIOS = {"collectives": collectives, "mismatch": mismatch}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]]()
