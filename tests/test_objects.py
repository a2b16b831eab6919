"""Object collectives: every rank gets every rank's object (or the source's), on every backend."""

from __future__ import annotations

import threading
from collections import OrderedDict
from fractions import Fraction
from typing import Any

import pytest
import torch

import shardline as sl
from shardline.comm import ProcessGroup
from shardline.comm.objects import all_gather_object, broadcast_object
from shardline.errors import InvalidArgumentError
from tests._ranks import run_ranks


def rank_object(rank: int) -> Any:
    """Rank ``rank``'s object: pickled sizes differ from rank to rank, types vary."""
    return {
        "rank": rank,
        "name": "r" * (rank * 1000),  # from a few bytes to a few KiB
        "tuple": (rank, Fraction(rank, 7), None),
        "ordered": OrderedDict((f"k{i}", i) for i in range(rank)),
        "tensor": torch.arange(rank, dtype=torch.float64),
        "bytes": bytes(range(rank % 256)),
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_all_gather_object_gives_every_rank_every_object(backend: str, world: int) -> None:
    got = run_ranks(world, lambda g: all_gather_object(rank_object(g.rank), g), backend=backend)
    reference = [rank_object(r) for r in range(world)]
    for r, objects in enumerate(got):
        assert len(objects) == world, r
        assert all(same(o, want) for o, want in zip(objects, reference, strict=True)), r


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_broadcast_object_gives_every_rank_the_source_object(backend: str, world: int) -> None:
    def body(g: ProcessGroup) -> list[Any]:
        return [
            broadcast_object(rank_object(g.rank) if g.rank == src else None, src, g)
            for src in range(g.world_size)
        ]

    for r, objects in enumerate(run_ranks(world, body, backend=backend)):
        assert all(same(o, rank_object(src)) for src, o in enumerate(objects)), r


@pytest.mark.parametrize("empty", [None, "", b"", [], {}, (), set()])
def test_empty_objects_travel(backend: str, empty: object) -> None:
    def body(g: ProcessGroup) -> tuple[list[Any], Any, Any]:
        mixed = all_gather_object(empty if g.rank % 2 else rank_object(g.rank), g)
        return all_gather_object(empty, g), broadcast_object(empty, 1, g), mixed

    for gathered, broadcast, mixed in run_ranks(3, body, backend=backend):
        assert gathered == [empty] * 3 and type(gathered[0]) is type(empty)
        assert broadcast == empty and type(broadcast) is type(empty)
        assert (
            same(mixed[0], rank_object(0)) and mixed[1] == empty and same(mixed[2], rank_object(2))
        )


def test_objects_are_copies_and_groups_are_respected(backend: str) -> None:
    def body(g: ProcessGroup) -> tuple[bool, list[Any]]:
        mine = [g.rank]
        back = all_gather_object(mine, g)[g.rank]
        sub = g.new_group([1, 3])
        inner = all_gather_object(("sub", g.rank), sub) if sub is not None else []
        return back is not mine and back == mine, inner

    got = run_ranks(4, body, backend=backend)
    assert all(copied for copied, _ in got)
    assert [inner for _, inner in got] == [
        [],
        [("sub", 1), ("sub", 3)],
        [],
        [("sub", 1), ("sub", 3)],
    ]


def test_broadcast_object_rejects_a_source_outside_the_group(backend: str) -> None:
    def body(g: ProcessGroup) -> None:
        with pytest.raises(InvalidArgumentError, match="src"):
            broadcast_object("x", 2, g)

    run_ranks(2, body, backend=backend)


def test_default_group_and_top_level_names(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert sl.all_gather_object is all_gather_object
    assert sl.broadcast_object is broadcast_object
    sl.init(backend="gloo", timeout=10)
    try:
        assert sl.all_gather_object({"a": 1}) == [{"a": 1}]
        assert sl.broadcast_object([1, 2]) == [1, 2]
    finally:
        sl.shutdown()


@pytest.mark.parametrize("world", [2, 3])
def test_an_object_that_does_not_pickle_fails_every_rank_at_once(backend: str, world: int) -> None:
    """Rank 1's object holds a lock: rank 1 raises with pickle's error, every other rank
    raises naming rank 1, and none waits for bytes that will not come."""

    def body(g: ProcessGroup) -> list[str]:
        errors = []
        for call in (
            lambda: all_gather_object(threading.Lock() if g.rank == 1 else g.rank, g),
            lambda: broadcast_object(threading.Lock() if g.rank == 1 else None, 1, g),
        ):
            with pytest.raises(InvalidArgumentError) as info:
                call()
            errors.append(str(info.value))
        # The group still works: the next call of every rank is answered.
        assert all_gather_object(g.rank, g) == list(range(g.world_size))
        return errors

    for r, (gathered, broadcast) in enumerate(run_ranks(world, body, backend=backend)):
        for text in (gathered, broadcast):
            if r == 1:
                assert "its object cannot be pickled" in text and "lock" in text, text
            else:
                assert "the object of rank 1 cannot be pickled" in text, text
