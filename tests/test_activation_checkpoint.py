"""Activation checkpointing: recompute against a plain backward, the store against hand counts.

``checkpoint`` is checked against the same model run without it (bitwise gradients, fewer
saved bytes). The store's placements, transfers and statistics run on 1-4 ranks as threads
(``run_ranks``); every expected tensor and byte count is rebuilt in the test from a seeded
generator, not read back from the manager.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from torch import nn

from shardline.comm import ProcessGroup
from shardline.errors import InvalidArgumentError, PeerLostError
from shardline.parallel import recompute
from shardline.parallel.recompute import ActivationCheckpointManager
from tests._ranks import run_ranks

pytestmark = pytest.mark.usefixtures("native")


def make_tensor(seed: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The same tensor for the same arguments, on any thread."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


# -- checkpoint(): recompute in backward ------------------------------------------------------


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.drop = nn.Dropout(0.3)
        self.down = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.down(self.drop(torch.relu(self.up(x)))) * scale


def train_step(
    model: nn.Module, x: torch.Tensor, wrap: Any, **kw: Any
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One forward and backward; returns the gradients and every tensor saved outside ``wrap``."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    torch.manual_seed(1234)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = wrap(model, x, **kw) if wrap is not None else model(x, **kw)
    out.square().sum().backward()
    assert x.grad is not None
    grads = [x.grad] + [p.grad for p in model.parameters() if p.grad is not None]
    return grads, saved


def activation_bytes(saved: list[torch.Tensor], model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of distinct storages saved, parameters and the input left out (the reference)."""
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip.add(x.untyped_storage().data_ptr())
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    return sum(n for ptr, n in storages.items() if ptr not in skip)


def test_checkpoint_gradients_bitwise_equal_and_fewer_saved_bytes() -> None:
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(8, 16)
    plain, saved_plain = train_step(model, x, None)
    ckpt, saved_ckpt = train_step(model, x, recompute.checkpoint)
    assert len(plain) == len(ckpt) == 5
    assert all(bitwise_equal(a, b) for a, b in zip(plain, ckpt, strict=True))
    assert sum(map(nbytes, saved_ckpt)) < sum(map(nbytes, saved_plain))
    assert sum(map(nbytes, saved_ckpt)) <= nbytes(x)  # only the region's input stays

    # The RNG state is what makes them equal: without it the recompute drops other units.
    other, _ = train_step(model, x, recompute.checkpoint, preserve_rng_state=False)
    assert not all(torch.equal(a, b) for a, b in zip(plain, other, strict=True))

    # Keyword arguments reach the function.
    scaled, _ = train_step(model, x, recompute.checkpoint, scale=2.0)
    plain_scaled, _ = train_step(model, x, None, scale=2.0)
    assert all(bitwise_equal(a, b) for a, b in zip(plain_scaled, scaled, strict=True))


def test_checkpoint_records_bytes_not_kept_in_the_active_manager() -> None:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = MLP()
    x = torch.randn(8, 16)
    with torch.random.fork_rng():
        _, saved = train_step(model, x, None)
    expected = activation_bytes(saved, model, x)
    assert expected > 0

    def body(g: ProcessGroup) -> tuple[int, int, int]:
        m = ActivationCheckpointManager(g)
        with torch.random.fork_rng():
            train_step(model, x, recompute.checkpoint)  # not active: nothing recorded
            before = m.recomputed_bytes
            with m.activate():
                train_step(model, x, recompute.checkpoint)
                train_step(model, x, recompute.checkpoint)
        return before, m.recomputed_bytes, m.memory_stats().total_recomputed_bytes

    assert run_ranks(1, body) == [(0, 2 * expected, 2 * expected)]


def test_nested_checkpoints_count_once_per_forward() -> None:
    torch.manual_seed(0)
    l1, l2, l3 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def inner(h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(l2(h))

    def outer(x: torch.Tensor) -> torch.Tensor:
        # l3 saves inner's output, so backward reruns the inner checkpoint to rebuild it.
        return l3(recompute.checkpoint(inner, torch.relu(l1(x))))

    x = torch.randn(4, 8, requires_grad=True)
    params = [x, l1.weight, l2.weight, l3.weight]
    ref = torch.autograd.grad(outer(x).sum(), params)

    def body(g: ProcessGroup) -> tuple[int, int, bool]:
        m = ActivationCheckpointManager(g)
        with m.activate():
            y = recompute.checkpoint(outer, x)
            after_forward = m.recomputed_bytes
            got = torch.autograd.grad(y.sum(), params)
        same = all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
        return after_forward, m.recomputed_bytes, same

    ((after_forward, after_backward, same),) = run_ranks(1, body)
    assert same and after_forward > 0 and after_backward == after_forward


# -- the store: placements --------------------------------------------------------------------

SPECS: list[tuple[tuple[int, ...], torch.dtype]] = [
    ((4, 5), torch.float32),
    ((7,), torch.int64),
    ((3, 3), torch.bool),
    ((2, 3, 2), torch.bfloat16),
    ((), torch.float64),
]


def local_tensor(rank: int, i: int) -> torch.Tensor:
    shape, dtype = SPECS[(rank + i) % len(SPECS)]
    return make_tensor(100 * rank + i, shape, dtype)


@pytest.mark.parametrize("n", [2, 4])
def test_local_policy_round_trips_and_fetches_from_owners(n: int) -> None:
    def body(g: ProcessGroup) -> None:
        m = ActivationCheckpointManager(g, policy="local")
        for i in range(3):
            m.register(f"r{g.rank}.l{i}", local_tensor(g.rank, i))
        m.register(g.rank, local_tensor(g.rank, 9))  # int ids too
        for i in range(3):
            assert bitwise_equal(m.get(f"r{g.rank}.l{i}"), local_tensor(g.rank, i))
        assert bitwise_equal(m.get(g.rank), local_tensor(g.rank, 9))

        keys = m.sync_keys()
        expected = {r: (r,) for r in range(n)}
        expected |= {f"r{r}.l{i}": (r,) for r in range(n) for i in range(3)}
        assert keys == expected
        assert list(keys) == sorted(range(n)) + sorted(k for k in expected if isinstance(k, str))

        if n > 1:
            peer = (g.rank + 1) % n
            with pytest.raises(InvalidArgumentError, match=rf"held by rank\(s\) \[{peer}\]"):
                m.get(f"r{peer}.l0")
        # Every rank asks for every other rank's entries at once (plus one of its own).
        wanted = [f"r{r}.l{i}" for r in range(n) for i in range(3)] + [g.rank]
        got = m.fetch(wanted)
        assert list(got) == wanted
        for r in range(n):
            for i in range(3):
                assert bitwise_equal(got[f"r{r}.l{i}"], local_tensor(r, i))
        assert m.fetch([]) == {}  # a rank may need nothing
        assert m.stored_bytes == sum(nbytes(local_tensor(g.rank, i)) for i in (0, 1, 2, 9))

    run_ranks(n, body, timeout=30)


def test_fetch_of_large_tensors_in_every_direction_does_not_deadlock() -> None:
    n, numel = 4, 1 << 20  # 4 MiB each: more than a socket buffer holds

    def body(g: ProcessGroup) -> None:
        m = ActivationCheckpointManager(g)
        m.register(f"big{g.rank}", torch.full((numel,), float(g.rank)))
        # Ranks ask in different orders; the transfer order is the same everywhere.
        wanted = [f"big{r}" for r in reversed(range(n)) if r != g.rank]
        got = m.fetch(wanted)
        for r in range(n):
            if r != g.rank:
                assert torch.equal(got[f"big{r}"], torch.full((numel,), float(r)))

    run_ranks(n, body, timeout=30)


@pytest.mark.parametrize("n", [3])
def test_first_rank_policy_keeps_data_on_rank0_only(n: int) -> None:
    shape, dtype = (5, 3), torch.float32
    full = make_tensor(7, shape, dtype)

    def body(g: ProcessGroup) -> None:
        m = ActivationCheckpointManager(g, policy="first_rank")
        m.register("attn", make_tensor(7, shape, dtype))  # replicated: every rank computes it
        assert m.holds("attn") == (g.rank == 0)
        assert m.stored_bytes == (nbytes(full) if g.rank == 0 else 0)
        assert m.sync_keys() == {"attn": (0,)}
        assert bitwise_equal(m.get("attn"), full)  # collective: a broadcast from rank 0
        assert m.stored_bytes == (nbytes(full) if g.rank == 0 else 0)  # get keeps nothing
        got = m.fetch(["attn"] if g.rank == n - 1 else [])
        if g.rank == n - 1:
            assert bitwise_equal(got["attn"], full)

    run_ranks(n, body, timeout=30)


@pytest.mark.parametrize("n", [3, 4])
def test_partition_policy_splits_and_gathers(n: int) -> None:
    cases = {
        "odd": ((2, 5), torch.float64),  # 10 elements: uneven parts
        "tiny": ((3,), torch.int32),  # fewer elements than ranks at n=4
        "empty": ((0, 4), torch.float32),
        "scalar": ((), torch.bfloat16),
    }
    fulls = {k: make_tensor(i, *spec) for i, (k, spec) in enumerate(cases.items())}

    def body(g: ProcessGroup) -> dict[str, int]:
        m = ActivationCheckpointManager(g, policy="partition")
        for k, (shape, dtype) in cases.items():
            m.register(k, make_tensor(list(cases).index(k), shape, dtype))
        sizes = {}
        for k in cases:
            before = m.stored_bytes
            m.remove(k)
            sizes[k] = before - m.stored_bytes
            m.register(k, fulls[k])
        for k in cases:
            assert bitwise_equal(m.get(k), fulls[k]), k  # collective: an all-gather
        assert m.sync_keys() == {k: tuple(range(n)) for k in sorted(cases)}
        want = ["odd"] if g.rank == 0 else []
        got = m.fetch(want)
        assert list(got) == want and all(bitwise_equal(got[k], fulls[k]) for k in got)
        return sizes

    per_rank = run_ranks(n, body, timeout=30)
    for k, full in fulls.items():
        parts = torch.tensor_split(full.reshape(-1), n)  # the reference split
        assert [s[k] for s in per_rank] == [nbytes(p) for p in parts], k
        assert sum(s[k] for s in per_rank) == nbytes(full)


@pytest.mark.parametrize("n", [3])
def test_register_and_broadcast_gives_every_rank_a_copy(n: int) -> None:
    src = n - 1
    full = make_tensor(3, (6, 2), torch.float16)

    def body(g: ProcessGroup) -> None:
        m = ActivationCheckpointManager(g, policy="partition")  # ignored: a full copy each
        mine = make_tensor(3, (6, 2), torch.float16) if g.rank == src else None
        out = m.register_and_broadcast(7, mine, src=src)
        assert bitwise_equal(out, full) and bitwise_equal(m.get(7), full)
        assert m.holds(7) and m.stored_bytes == nbytes(full)
        assert m.sync_keys() == {7: tuple(range(n))}

    run_ranks(n, body, timeout=30)


def test_pipeline_boundaries_stay_local_and_fetch_across_stages() -> None:
    def body(g: ProcessGroup) -> None:
        m = ActivationCheckpointManager(g, policy="partition")  # keep_boundary is local anyway
        for mb in range(3):
            m.keep_boundary(g.rank, make_tensor(10 * g.rank + mb, (4, 8), torch.float32), mb)
        for mb in range(3):
            assert bitwise_equal(
                m.boundary(g.rank, mb), make_tensor(10 * g.rank + mb, (4, 8), torch.float32)
            )
        assert m.sync_keys()[m.boundary_id(g.rank, 0)] == (g.rank,)
        # The next stage asks for the previous stage's boundaries; stage 0 needs nothing.
        want = [m.boundary_id(g.rank - 1, mb) for mb in range(3)] if g.rank else []
        got = m.fetch(want)
        for mb in range(3 if g.rank else 0):
            prev = make_tensor(10 * (g.rank - 1) + mb, (4, 8), torch.float32)
            assert bitwise_equal(got[m.boundary_id(g.rank - 1, mb)], prev)

    run_ranks(3, body, timeout=30)


def test_stage_calls_list_a_stage_the_next_stages_boundaries_and_clear_a_stage() -> None:
    """The seed's stage calls: a stage's checkpoints, the next stage's boundaries (known from
    sync_keys, held by another rank), and clearing a stage frees its bytes only."""

    def body(g: ProcessGroup) -> None:
        m = ActivationCheckpointManager(g)
        for mb in range(2):
            m.keep_boundary(g.rank, make_tensor(mb, (4, 8), torch.float32), mb)
        m.register(f"stage{g.rank}.attn", make_tensor(9, (2, 2), torch.float32))
        m.register("unstaged", make_tensor(9, (2, 2), torch.float32))
        assert m.stage_checkpoints(g.rank) == [
            f"stage{g.rank}.attn",
            m.boundary_id(g.rank, 0),
            m.boundary_id(g.rank, 1),
        ]
        m.sync_keys()  # now this rank knows what the others hold
        nxt = m.next_stage_boundaries(g.rank)
        assert nxt == ([m.boundary_id(1, 0), m.boundary_id(1, 1)] if g.rank == 0 else [])
        before = m.stored_bytes
        assert m.clear_stage(g.rank) == 3
        assert m.stored_bytes == before - 2 * 4 * 8 * 4 - 2 * 2 * 4
        assert m.stage_checkpoints(g.rank) == [] and "unstaged" in m
        with pytest.raises(InvalidArgumentError, match=r"stage_id=-1 must be an int >= 0"):
            m.clear_stage(-1)

    run_ranks(2, body, timeout=30)


# -- statistics and clearing ------------------------------------------------------------------


@pytest.mark.parametrize("n", [4])
def test_memory_stats_add_up_across_ranks(n: int) -> None:
    part_full = make_tensor(5, (9, 3), torch.float32)
    first_full = make_tensor(6, (4, 4), torch.int64)

    def expected_local(rank: int) -> list[torch.Tensor]:
        return [
            make_tensor(50 + 10 * rank + i, (rank + 1, 3), torch.float32) for i in range(rank + 1)
        ]

    def body(g: ProcessGroup) -> recompute.ActivationMemoryStats:
        m = ActivationCheckpointManager(g)
        for i, t in enumerate(expected_local(g.rank)):
            m.register(f"l{g.rank}.{i}", t)
        m.register("p", part_full.clone(), policy="partition")
        m.register("f", first_full.clone(), policy="first_rank")
        m.register("scratch", torch.zeros(1000))  # raises the peak, then goes
        m.remove("scratch")
        return m.memory_stats()

    stats = run_ranks(n, body, timeout=30)
    parts = torch.tensor_split(part_full.reshape(-1), n)
    per_rank = [
        sum(map(nbytes, expected_local(r)))
        + nbytes(parts[r])
        + (nbytes(first_full) if r == 0 else 0)
        for r in range(n)
    ]
    counts = [r + 1 + 1 + (1 if r == 0 else 0) for r in range(n)]
    for s in stats:
        assert s == stats[0]  # every rank sees the same numbers
        assert list(s.per_rank_bytes) == per_rank
        assert list(s.per_rank_peak_bytes) == [b + 4000 for b in per_rank]
        assert list(s.per_rank_counts) == counts
        assert s.total_bytes == sum(per_rank) and s.total_count == sum(counts)
        assert s.total_peak_bytes == sum(per_rank) + 4000 * n
        assert (s.min_bytes, s.max_bytes) == (min(per_rank), max(per_rank))
        assert s.average_bytes == pytest.approx(sum(per_rank) / n)
        assert s.total_recomputed_bytes == 0
    text = stats[0].summary()
    assert f"over {n} rank(s)" in text
    assert f"({sum(per_rank)} B) in {sum(counts)} tensor(s)" in text
    assert f"({sum(per_rank) + 4000 * n} B)" in text


def test_format_bytes() -> None:
    fmt = recompute.format_bytes
    assert [fmt(0), fmt(1023), fmt(1536), fmt(3 << 20), fmt(5 << 30)] == [
        "0 B",
        "1023 B",
        "1.50 KiB",
        "3.00 MiB",
        "5.00 GiB",
    ]


@pytest.mark.parametrize("n", [3])
def test_clear_leaves_nothing_anywhere(n: int) -> None:
    def body(g: ProcessGroup) -> None:
        m = ActivationCheckpointManager(g)
        m.register(f"a{g.rank}", torch.ones(10))
        m.register("p", torch.ones(12), policy="partition")
        m.register_and_broadcast("b", torch.ones(3) if g.rank == 0 else None)
        assert m.sync_keys()
        m.clear()
        assert len(m) == 0 and m.stored_bytes == 0
        assert m.sync_keys() == {}
        s = m.memory_stats()
        assert s.total_bytes == 0 and s.total_count == 0 and s.total_peak_bytes > 0
        with pytest.raises(InvalidArgumentError, match="'p'"):
            m.get("p")
        m.register("p", torch.ones(2))  # usable again

    run_ranks(n, body, timeout=30)


def test_world_size_one_runs_every_call_without_peers() -> None:
    full = make_tensor(1, (5, 2), torch.float32)

    def body(g: ProcessGroup) -> None:
        m = ActivationCheckpointManager(g)
        for policy in recompute.POLICIES:
            m.register(policy, full.clone(), policy=policy)  # type: ignore[arg-type]
        m.register_and_broadcast("b", full.clone())
        m.keep_boundary(0, full.clone())
        for k in [*recompute.POLICIES, "b", m.boundary_id(0)]:
            assert m.holds(k) == (k != "partition")
            assert bitwise_equal(m.get(k), full), k
        keys = m.sync_keys()
        assert keys == dict.fromkeys(keys, (0,)) and len(keys) == 5
        got = m.fetch(list(keys))
        assert all(bitwise_equal(t, full) for t in got.values())
        s = m.memory_stats()
        assert s.per_rank_bytes == (5 * nbytes(full),) and s.total_count == 5
        assert s.min_bytes == s.max_bytes == s.average_bytes == s.total_bytes
        assert "in 5 tensor(s)" in s.summary()
        m.clear()
        assert m.sync_keys() == {} and m.memory_stats().total_bytes == 0

    run_ranks(1, body)


# -- errors -----------------------------------------------------------------------------------


def test_invalid_ids_and_arguments_raise_naming_them() -> None:
    def body(g: ProcessGroup) -> None:
        m = ActivationCheckpointManager(g)
        for bad in (True, "", 1.5, None, ("a",)):
            with pytest.raises(InvalidArgumentError, match=r"layer id .* is invalid"):
                m.register(bad, torch.ones(1))  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match="'missing'"):
            m.get("missing")
        with pytest.raises(InvalidArgumentError, match="42"):
            m.remove(42)
        m.register("x", torch.ones(2))
        with pytest.raises(InvalidArgumentError, match="'x' is already registered"):
            m.register("x", torch.ones(2))
        with pytest.raises(InvalidArgumentError, match=r"expected a torch\.Tensor"):
            m.register("y", [1.0])  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match="'everywhere'"):
            m.register("y", torch.ones(1), policy="everywhere")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match="src=2 is not a rank"):
            m.register_and_broadcast("z", torch.ones(1), src=2)
        with pytest.raises(InvalidArgumentError, match="stage_id=-1"):
            m.keep_boundary(-1, torch.ones(1))
        # A rank asking for what nobody holds fails on every rank, naming it; none waits.
        with pytest.raises(InvalidArgumentError, match=r"rank 1 asked for 'nope'"):
            m.fetch(["nope"] if g.rank == 1 else ["x"])
        with pytest.raises(InvalidArgumentError, match=r"layer id 2\.5 is invalid"):
            m.fetch([2.5] if g.rank == 0 else [])  # type: ignore[list-item]
        # src without a tensor: every rank learns it from the broadcast.
        with pytest.raises(InvalidArgumentError, match="src rank 0 passed NoneType"):
            m.register_and_broadcast("w", None, src=0)
        assert m.sync_keys() == {"x": (0, 1)}  # still in step after all of that

    with pytest.raises(InvalidArgumentError, match="'nowhere'"):
        ActivationCheckpointManager(_FakeGroup(), policy="nowhere")  # type: ignore[arg-type]
    run_ranks(2, body, timeout=30)


class _FakeGroup:
    rank, world_size, device = 0, 1, torch.device("cpu")


def test_a_lost_peer_raises_instead_of_hanging() -> None:
    gone = threading.Event()

    def body(g: ProcessGroup) -> Any:
        m = ActivationCheckpointManager(g)
        m.register(f"a{g.rank}", torch.ones(4))
        if g.rank == 1:
            g.shutdown()  # the peer dies
            gone.set()
            return None
        gone.wait(10)
        start = time.monotonic()
        with pytest.raises(PeerLostError, match="rank 1"):
            m.fetch(["a1"])
        return time.monotonic() - start

    elapsed = run_ranks(2, body, op_timeout=10, timeout=30)[0]
    assert elapsed < 5  # the error, not the 10 s deadline
