"""Every collective x dtype x world size x ragged size, checked against plain torch."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardline.comm import ProcessGroup
from tests._ranks import run_ranks
from tests.conftest import need_native
from tests.reference import ALL_DTYPES, FLOATS, assert_close, make, ops_for, reduce_ref

Results = dict[tuple[Any, ...], torch.Tensor]
SIZES = st.lists(st.integers(0, 67), min_size=1, max_size=3)
# Three examples per case: each runs every op on every rank count and dtype (CI time).
HYPO = settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))


def run_every_op(g: ProcessGroup, sizes: list[int], dtype: torch.dtype) -> Results:
    """Runs each collective once per size on rank ``g.rank``; returns the outputs."""
    r, w = g.rank, g.world_size
    out: Results = {}
    for n in sizes:
        for op in ops_for(dtype):
            t = make(r, n, dtype)
            g.all_reduce(t, op=op)
            out["all_reduce", op, n] = t
        for op in ("sum", "max") if dtype != torch.bool else ("sum",):
            o = torch.full((n,), 1, dtype=dtype)
            g.reduce_scatter(o, make(r, n * w, dtype), op=op)
            out["reduce_scatter", op, n] = o
        flat = torch.empty(n * w, dtype=dtype)
        g.all_gather(flat, make(r, n, dtype))
        out["all_gather", n] = flat
        ragged = [torch.empty(n + k, dtype=dtype) for k in range(w)]
        g.all_gather(ragged, make(r, n + r, dtype))
        out["all_gather_ragged", n] = torch.cat(ragged)
        b = make(r, n, dtype, salt=r)
        g.broadcast(b, src=w - 1)
        out["broadcast", n] = b
        red = make(r, n, dtype)
        g.reduce(red, dst=w - 1, op="sum")
        if r == w - 1:
            out["reduce", n] = red
        gl = [torch.empty(n, dtype=dtype) for _ in range(w)] if r == 0 else None
        g.gather(make(r, n, dtype), gl, dst=0)
        if gl is not None:
            out["gather", n] = torch.cat(gl)
        sc = torch.empty(n, dtype=dtype)
        src_list = [make(k, n, dtype, salt=1) for k in range(w)] if r == 0 else None
        g.scatter(sc, src_list, src=0)
        out["scatter", n] = sc
        a2a = torch.empty(n * w, dtype=dtype)
        g.all_to_all(a2a, make(r, n * w, dtype, salt=2))
        out["all_to_all", n] = a2a
        if w > 1:
            got = torch.empty(n, dtype=dtype)
            send = g.send(make(r, n, dtype, salt=3), (r + 1) % w, async_op=True)
            g.recv(got, (r - 1) % w)
            assert send is not None
            send.wait()
            out["sendrecv", n] = got
    g.barrier()
    return out


def check_every_op(results: list[Results], sizes: list[int], dtype: torch.dtype) -> None:
    w = len(results)
    for n in sizes:
        ins = [make(k, n, dtype) for k in range(w)]
        for r, res in enumerate(results):
            at = f"rank {r}/{w}, {dtype}, n={n}"
            for op in ops_for(dtype):
                assert_close(res["all_reduce", op, n], reduce_ref(ins, op), f"all_reduce {op} {at}")
            for op in ("sum", "max") if dtype != torch.bool else ("sum",):
                full = reduce_ref([make(k, n * w, dtype) for k in range(w)], op)
                assert_close(
                    res["reduce_scatter", op, n],
                    full[r * n : (r + 1) * n],
                    f"reduce_scatter {op} {at}",
                )
            assert_close(res["all_gather", n], torch.cat(ins), f"all_gather {at}")
            assert_close(
                res["all_gather_ragged", n],
                torch.cat([make(k, n + k, dtype) for k in range(w)]),
                f"all_gather unequal {at}",
            )
            assert_close(res["broadcast", n], make(w - 1, n, dtype, salt=w - 1), f"broadcast {at}")
            if r == w - 1:
                assert_close(res["reduce", n], reduce_ref(ins, "sum"), f"reduce {at}")
            if r == 0:
                assert_close(res["gather", n], torch.cat(ins), f"gather {at}")
            assert_close(res["scatter", n], make(r, n, dtype, salt=1), f"scatter {at}")
            expected = torch.cat(
                [make(k, n * w, dtype, salt=2)[r * n : (r + 1) * n] for k in range(w)]
            )
            assert_close(res["all_to_all", n], expected, f"all_to_all {at}")
            if w > 1:
                assert_close(
                    res["sendrecv", n], make((r - 1) % w, n, dtype, salt=3), f"send/recv {at}"
                )


@pytest.mark.usefixtures("native")
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@HYPO
@given(sizes=SIZES)
def test_every_op_matches_torch_native(world: int, dtype: torch.dtype, sizes: list[int]) -> None:
    results = run_ranks(world, lambda g: run_every_op(g, sizes, dtype))
    check_every_op(results, sizes, dtype)


@pytest.mark.usefixtures("native")
@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool], ids=str)
def test_every_op_on_every_transport(transport: str, world: int, dtype: torch.dtype) -> None:
    sizes = [0, 1, 37, 4099]
    results = run_ranks(world, lambda g: run_every_op(g, sizes, dtype), transport=transport)
    check_every_op(results, sizes, dtype)


@pytest.mark.usefixtures("native")
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_op_with_helper_threads(
    monkeypatch: pytest.MonkeyPatch, world: int, dtype: torch.dtype
) -> None:
    """Blocking shared-memory ops split over 3 helper threads per rank (forced on at every
    size, on small slots so the large sizes cross many chunks) give the same results."""
    monkeypatch.setenv("SHARDLINE_COMM_THREADS", "3")
    monkeypatch.setenv("SHARDLINE_COMM_THREADS_MIN_BYTES", "0")
    monkeypatch.setenv("SHARDLINE_SHM_SLOT_BYTES", str(256 << 10))
    sizes = [0, 37, 300_001]
    results = run_ranks(world, lambda g: run_every_op(g, sizes, dtype))
    check_every_op(results, sizes, dtype)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.uint8], ids=str)
def test_every_op_matches_torch_gloo(world: int, dtype: torch.dtype) -> None:
    """The gloo reference backend passes the same checks (cross-check of the tests)."""
    sizes = [0, 1, 13]
    results = run_ranks(world, lambda g: run_every_op(g, sizes, dtype), backend="gloo")
    check_every_op(results, sizes, dtype)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("n", [(1 << 20) + 3, 3 * (1 << 18) + 1])
def test_large_all_reduce_and_ring_ops(backend: str, world: int, n: int) -> None:
    """Sizes past the chunk/slot size exercise the pipelined paths."""

    def body(g: ProcessGroup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = make(g.rank, n, torch.float32)
        g.all_reduce(t)
        rs = torch.empty(n // world + 1)
        g.reduce_scatter(rs, make(g.rank, (n // world + 1) * world, torch.float32))
        ag = torch.empty((n // world) * world)
        g.all_gather(ag, make(g.rank, n // world, torch.float32))
        return t, rs, ag

    results = run_ranks(world, body, backend=backend)
    m = n // world + 1
    full = reduce_ref([make(k, m * world, torch.float32) for k in range(world)], "sum")
    for r, (t, rs, ag) in enumerate(results):
        assert_close(t, reduce_ref([make(k, n, torch.float32) for k in range(world)], "sum"), "ar")
        assert_close(rs, full[r * m : (r + 1) * m], "reduce_scatter")
        assert_close(
            ag, torch.cat([make(k, n // world, torch.float32) for k in range(world)]), "ag"
        )


@pytest.mark.parametrize("dtype", [*FLOATS, torch.int64, torch.bool], ids=str)
def test_zero_dim_tensors(backend: str, dtype: torch.dtype) -> None:
    def body(g: ProcessGroup) -> torch.Tensor:
        t = make(g.rank, 1, dtype).reshape(())
        g.all_reduce(t, op="max")
        return t

    for t in run_ranks(3, body, backend=backend):
        assert t.shape == ()
        assert_close(t, reduce_ref([make(k, 1, dtype).reshape(()) for k in range(3)], "max"), "0-d")


def test_numpy_arrays_zero_copy(backend: str) -> None:
    def body(g: ProcessGroup) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        a = np.full((4, 3), g.rank + 1, dtype=np.float32)
        g.all_reduce(a)
        flags = np.array([g.rank == 1, False, True])
        g.all_reduce(flags)
        gathered = np.empty(3 * g.world_size, dtype=np.int64)
        g.all_gather(gathered, np.arange(3, dtype=np.int64) + 10 * g.rank)
        return a, flags, gathered

    for a, flags, gathered in run_ranks(3, body, backend=backend):
        np.testing.assert_array_equal(a, np.full((4, 3), 6, dtype=np.float32))
        np.testing.assert_array_equal(flags, [True, False, True])
        np.testing.assert_array_equal(gathered, [0, 1, 2, 10, 11, 12, 20, 21, 22])


def test_tensor_requiring_grad_is_updated_in_place(backend: str) -> None:
    def body(g: ProcessGroup) -> torch.Tensor:
        p = torch.nn.Parameter(torch.full((5,), float(g.rank)))
        g.broadcast(p, src=1)
        return p.detach().clone()

    for p in run_ranks(2, body, backend=backend):
        assert torch.equal(p, torch.full((5,), 1.0))


def test_async_ops_waited_out_of_order(backend: str) -> None:
    def body(g: ProcessGroup) -> list[torch.Tensor]:
        tensors = [torch.full((1000 * (i + 1),), float(g.rank + i)) for i in range(4)]
        works = [g.all_reduce(t, async_op=True) for t in tensors]
        gathered = [torch.empty(2, dtype=torch.int64) for _ in range(g.world_size)]
        works.append(g.all_gather(gathered, torch.tensor([g.rank, -g.rank]), async_op=True))
        bcast = torch.full((7,), float(g.rank))
        works.append(g.broadcast(bcast, src=2, async_op=True))
        for work in reversed(works):
            assert work is not None
            work.wait(timeout=30)
            assert work.is_completed()
        return [*tensors, torch.cat(gathered), bcast]

    results = run_ranks(3, body, backend=backend)
    for res in results:
        for i in range(4):
            assert torch.equal(res[i], torch.full((1000 * (i + 1),), float(3 * i + 3)))
        assert res[4].tolist() == [0, 0, 1, -1, 2, -2]
        assert torch.equal(res[5], torch.full((7,), 2.0))


def test_async_work_keeps_tensors_alive(backend: str) -> None:
    """Dropping every reference but the Work must not free memory under the engine."""

    def body(g: ProcessGroup) -> float:
        work = g.all_reduce(torch.ones(1 << 18), async_op=True)
        assert work is not None
        work.wait()
        return 1.0

    assert run_ranks(2, body, backend=backend) == [1.0, 1.0]


def test_subgroups_and_nested_subgroups(backend: str) -> None:
    def body(g: ProcessGroup) -> tuple[float | None, float | None, float | None]:
        odd = g.new_group([1, 3, 4])
        even = g.new_group([0, 2])
        a = b = c = None
        if odd is not None:
            t = torch.tensor([float(g.rank)])
            odd.all_reduce(t)
            a = t.item()
            inner = odd.new_group([0, 2])  # parent ranks 1 and 4
            if inner is not None:
                u = torch.tensor([float(g.rank)])
                inner.all_reduce(u, op="max")
                c = u.item()
        else:
            assert even is not None
            t = torch.tensor([float(g.rank + 10)])
            even.all_reduce(t)
            b = t.item()
        g.barrier()
        return a, b, c

    results = run_ranks(5, body, backend=backend)
    assert results == [
        (None, 22.0, None),
        (8.0, None, 4.0),
        (None, 22.0, None),
        (8.0, None, None),
        (8.0, None, 4.0),
    ]


def test_subgroup_ranks_and_names(backend: str) -> None:
    def body(g: ProcessGroup) -> tuple[int, int, str] | None:
        sub = g.new_group([2, 0])
        return None if sub is None else (sub.rank, sub.world_size, sub.name)

    assert run_ranks(3, body, backend=backend) == [(0, 2, "world.0"), None, (1, 2, "world.0")]


@pytest.mark.parametrize("transport", ["shm", "tcp", "hier"])
def test_a_float16_mean_that_fits_is_finite_on_every_path(transport: str) -> None:
    """Every rank's 60,000 in float16: the mean fits, the sum (120,000) does not. Over TCP's
    ring and tree and across hosts the partial sums stayed float16 and the mean read inf; each
    input is now divided by n first (NCCL's ncclAvg), as shared memory's float32 sums never
    needed. Small and large tensors take different paths; reduce leaves non-roots' input."""
    need_native()
    n = 3 if transport == "hier" else 2

    def body(g: ProcessGroup) -> list[float]:
        seen = []
        for numel in (4, 1 << 20):
            t = torch.full((numel,), 60000.0, dtype=torch.float16)
            g.all_reduce(t, "avg")
            r = torch.full((numel,), 60000.0, dtype=torch.float16)
            g.reduce(r, 0, "avg")
            out = torch.empty(numel, dtype=torch.float16)
            g.reduce_scatter(out, torch.full((n * numel,), 60000.0, dtype=torch.float16), "avg")
            seen += [t.float().unique().item(), r.float().unique().item()]
            seen.append(out.float().unique().item())
        return seen

    for rank, seen in enumerate(run_ranks(n, body, transport=transport)):
        assert seen == [60000.0] * 6, (rank, seen)


@pytest.mark.parametrize(
    ("backend", "transport"),
    [("native", "shm"), ("native", "tcp"), ("native", "hier"), ("gloo", "shm")],
)
def test_messages_are_matched_by_tag_and_taken_from_any_source(
    backend: str, transport: str
) -> None:
    """A recv takes the first message with its tag from its source (messages with other tags
    wait for their own recv); a recv from any source says which rank sent what it took."""
    if backend == "native":
        need_native()
    w = 4

    def body(g: ProcessGroup) -> list[Any]:
        r = g.rank
        got: list[Any] = []
        sends = []  # async: Gloo completes a send only once the receiver takes it
        if r == 0:
            for n, value, tag in ((3, 1.0, 1), (5, 2.0, 2), (3, 3.0, 1)):
                sends.append(g.send(torch.full((n,), value), w - 1, async_op=True, tag=tag))
            for k in range(2 * (w - 1)):
                out = torch.empty(3)
                work = g.recv(out, None, async_op=bool(k % 2), tag=7)
                if not isinstance(work, int):
                    work.wait()
                source = work if isinstance(work, int) else work.source
                got.append((source, out.tolist()))
        else:
            if r == w - 1:
                two, one, three = torch.empty(5), torch.empty(3), torch.empty(3)
                assert g.recv(two, 0, tag=2) == 0
                g.recv(one, 0, tag=1)
                g.recv(three, 0, tag=1)
                got = [two.tolist(), one.tolist(), three.tolist()]
            for k in range(2):
                msg = torch.tensor([float(k), float(r), float(r)])
                sends.append(g.send(msg, 0, async_op=True, tag=7))
        for work in sends:
            assert work is not None
            work.wait()
        g.barrier()
        return got

    results = run_ranks(w, body, backend=backend, transport=transport)
    assert results[w - 1] == [[2.0] * 5, [1.0] * 3, [3.0] * 3]
    for s in range(1, w):  # every message once, from the sender named, in its order
        from_s = [msg for source, msg in results[0] if source == s]
        assert from_s == [[0.0, s, s], [1.0, s, s]], results[0]
    assert len(results[0]) == 2 * (w - 1)


@pytest.mark.usefixtures("native")
@pytest.mark.parametrize("world", [2, 3])
def test_sends_before_receives_complete_past_the_sockets_buffers(
    transport: str, world: int
) -> None:
    """Every rank sends 64 MiB to the next rank, then receives from the one before, as a
    pipeline's exchange does: over TCP a send that waits for room must read what reaches its
    rank meanwhile (before, every rank waited for the next until the deadline)."""
    n = 16 << 20

    def body(g: ProcessGroup) -> bool:
        r, w = g.rank, g.world_size
        got = torch.empty(n)
        sent = g.send(torch.full((n,), float(r + 1)), (r + 1) % w, async_op=True)
        g.recv(got, (r - 1) % w)
        assert sent is not None
        sent.wait()
        return bool(torch.equal(got, torch.full((n,), float((r - 1) % w + 1))))

    assert run_ranks(world, body, transport=transport, op_timeout=20.0) == [True] * world


@pytest.mark.usefixtures("native")
@pytest.mark.parametrize(
    ("transport", "world"), [("shm", 3), ("tcp", 2), ("tcp", 3), ("hier", 3), ("hier", 4)]
)
@pytest.mark.parametrize("n", [1000, 4 << 20], ids=["4KB", "16MB"])
def test_messages_sent_before_a_collective_are_kept_for_receives_after_it(
    transport: str, world: int, n: int
) -> None:
    """Rank 0 sends the last rank two messages and enters an all_reduce and a barrier; the
    last rank enters them before it receives, the second message first, as Gloo allows. Over
    TCP a message ahead of the collective's on its link failed as a mismatch, and one that
    outgrew the sockets' buffers held its sender's collective back until the deadline; across
    two hosts of two ranks (``hier``, 4) the last rank is not its host's first and waits on
    its host's shared memory, which then reads its TCP links."""
    last = world - 1

    def body(g: ProcessGroup) -> list[float]:
        r = g.rank
        x = torch.full((1024,), float(r + 1))
        sends = []
        if r == 0:
            sends = [g.send(torch.full((n,), 7.0), last, tag=1, async_op=True),
                     g.send(torch.arange(3.0), last, tag=2, async_op=True)]  # fmt: skip
        g.all_reduce(x)
        g.barrier()
        got = [x[0].item()]
        if r == last:
            small, big = torch.empty(3), torch.empty(n)
            g.recv(small, 0, tag=2)
            g.recv(big, 0, tag=1)
            got += [*small.tolist(), float(big.min()), float(big.max())]
        for s in sends:
            assert s is not None
            s.wait()
        return got

    total = float(sum(range(1, world + 1)))
    expected = [[total]] * last + [[total, 0.0, 1.0, 2.0, 7.0, 7.0]]
    assert run_ranks(world, body, transport=transport, op_timeout=20.0) == expected
