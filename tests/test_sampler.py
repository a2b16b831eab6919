"""DistributedSampler: torch's index stream bit for bit, and mid-epoch resume across world sizes.

The oracle for an epoch's global order is torch's own DistributedSampler with one replica.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import pytest
import torch
import torch.utils.data as tud
from hypothesis import given, settings
from hypothesis import strategies as st

from shardline.comm import collectives
from shardline.comm import world as comm_world
from shardline.data import DistributedSampler
from shardline.errors import InvalidArgumentError, ShardlineError

SETTINGS = settings(max_examples=150, deadline=None)


def torch_stream(
    n: int, world: int, rank: int, *, shuffle: bool, seed: int, drop_last: bool, epoch: int
) -> list[int]:
    s = tud.DistributedSampler(
        range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    s.set_epoch(epoch)
    return list(s)


def global_order(n: int, *, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """The epoch's global order, from torch's sampler with a single replica."""
    return torch_stream(n, 1, 0, shuffle=shuffle, seed=seed, drop_last=False, epoch=epoch)


def samplers(n: int, world: int, **kwargs: Any) -> list[DistributedSampler]:
    return [DistributedSampler(n, world, r, **kwargs) for r in range(world)]


def padding(rest: list[int], total: int) -> list[int]:
    """What a pass over ``rest`` padded to ``total`` entries repeats: its first entries, cyclic."""
    pad = total - len(rest)
    return list(itertools.islice(itertools.cycle(rest), pad)) if pad > 0 else []


# -- torch equality ------------------------------------------------------------------------------


@SETTINGS
@given(
    n=st.integers(0, 300),
    world=st.integers(1, 8),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**31),
    epochs=st.lists(st.integers(0, 1000), min_size=1, max_size=3),
)
def test_stream_equals_torchs_sampler(
    n: int, world: int, shuffle: bool, drop_last: bool, seed: int, epochs: list[int]
) -> None:
    for rank in range(world):
        ours = DistributedSampler(
            n, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        for epoch in epochs:
            ours.set_epoch(epoch)
            want = torch_stream(
                n, world, rank, shuffle=shuffle, seed=seed, drop_last=drop_last, epoch=epoch
            )
            assert list(ours) == want
            assert len(ours) == len(want)
            assert list(ours) == want  # iterating again replays the epoch, as torch does


def test_accepts_a_dataset_and_matches_torch_attributes() -> None:
    data = list(range(10))
    ours = DistributedSampler(data, num_replicas=4, rank=1)
    theirs = tud.DistributedSampler(data, num_replicas=4, rank=1)
    assert isinstance(ours, tud.Sampler)
    assert (ours.num_samples, ours.total_size, ours.dataset) == (3, 12, data)
    assert (theirs.num_samples, theirs.total_size) == (3, 12)
    assert list(ours) == list(theirs)


# -- one epoch across ranks ----------------------------------------------------------------------


@pytest.mark.parametrize(("n", "world"), [(12, 4), (12, 3), (1, 1), (0, 3)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_each_sample_exactly_once_when_the_length_divides(
    n: int, world: int, shuffle: bool
) -> None:
    streams = [list(s) for s in samplers(n, world, shuffle=shuffle, seed=5)]
    assert sorted(itertools.chain(*streams)) == list(range(n))
    assert {len(s) for s in streams} == {n // world}


@SETTINGS
@given(n=st.integers(1, 200), world=st.integers(1, 9), seed=st.integers(0, 100))
def test_padding_repeats_only_the_first_indices_of_the_order(n: int, world: int, seed: int) -> None:
    streams = [list(s) for s in samplers(n, world, seed=seed)]
    order = global_order(n, shuffle=True, seed=seed, epoch=0)
    everything = Counter(itertools.chain(*streams))
    total = -(-n // world) * world
    assert everything - Counter(range(n)) == Counter(padding(order, total))
    assert set(everything) == set(range(n))
    assert total - n < world


@SETTINGS
@given(n=st.integers(0, 200), world=st.integers(1, 9), seed=st.integers(0, 100))
def test_drop_last_drops_the_tail_of_the_order(n: int, world: int, seed: int) -> None:
    streams = [list(s) for s in samplers(n, world, seed=seed, drop_last=True)]
    order = global_order(n, shuffle=True, seed=seed, epoch=0)
    kept = n - n % world
    assert sorted(itertools.chain(*streams)) == sorted(order[:kept])


def test_set_epoch_changes_the_order_deterministically() -> None:
    a, b = DistributedSampler(1000, 2, 0, seed=3), DistributedSampler(1000, 2, 0, seed=3)
    first = list(a)
    a.set_epoch(1)
    b.set_epoch(1)
    second = list(a)
    assert second == list(b)
    assert second != first
    a.set_epoch(0)
    assert list(a) == first
    assert list(DistributedSampler(1000, 2, 0, seed=4)) != first
    assert list(DistributedSampler(10, 2, 0, shuffle=False)) == [0, 2, 4, 6, 8]


# -- resume --------------------------------------------------------------------------------------


def consume(group: list[DistributedSampler], k: int, how: str) -> tuple[list[int], dict[str, Any]]:
    """Every rank consumes ``k`` samples of a new pass; returns them and the (common) state."""
    taken: list[int] = []
    states = []
    for s in group:
        it = iter(s)
        if how == "yielded":
            taken += itertools.islice(it, k)
            states.append(s.state_dict())
        elif how == "advance":  # a prefetching loader: everything is fetched, k consumed
            fetched = list(it)
            taken += fetched[:k]
            s.advance(k)
            states.append(s.state_dict())
        else:
            taken += itertools.islice(it, k)
            states.append(s.state_dict(consumed=k))
    assert all(st == states[0] for st in states), states
    return taken, states[0]


@SETTINGS
@given(
    n=st.integers(0, 120),
    worlds=st.lists(st.integers(1, 6), min_size=2, max_size=4),
    fractions=st.lists(st.floats(0, 1), min_size=4, max_size=4),
    how=st.sampled_from(["yielded", "advance", "explicit"]),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    seed=st.integers(0, 1000),
    epoch=st.integers(0, 5),
)
def test_resume_chain_consumes_every_sample_once(
    n: int,
    worlds: list[int],
    fractions: list[float],
    how: str,
    shuffle: bool,
    drop_last: bool,
    seed: int,
    epoch: int,
) -> None:
    order = global_order(n, shuffle=shuffle, seed=seed, epoch=epoch)
    everything: list[int] = []
    state: dict[str, Any] | None = None
    finished: tuple[int, int, int] | None = None  # (start, world, per-rank length) of that pass
    for i, world in enumerate(worlds):
        # Later runs construct their samplers with other seed/shuffle: the state's win.
        first = state is None
        group = samplers(
            n,
            world,
            shuffle=shuffle if first else not shuffle,
            seed=seed if first else seed + 1,
            drop_last=drop_last,
        )
        for s in group:
            if state is None:
                s.set_epoch(epoch)
            else:
                s.load_state_dict(state)
                s.set_epoch(epoch)  # the same epoch: keeps the position
        start = 0 if state is None else state["num_consumed"]
        if start < n and finished is None:
            # A state of s < n samples means exactly the first s of the order, each once.
            assert Counter(everything) == Counter(order[:start])
        length = len(group[0])
        assert all(len(s) == length for s in group)
        k = length if i == len(worlds) - 1 else int(fractions[i] * length)
        taken, state = consume(group, k, how)
        assert state["epoch"] == epoch and state["seed"] == seed and state["shuffle"] == shuffle
        if finished is not None:
            assert taken == []
        elif k == length > 0:
            finished = (start, world, length)
            assert state["num_consumed"] == n
        else:
            assert state["num_consumed"] == start + min(k * world, n - start)
        everything += taken

    have, want = Counter(everything), Counter(order)
    if finished is None:  # the last pass was empty: drop_last with fewer samples left than ranks
        assert drop_last or state["num_consumed"] == n
        assert have == Counter(order[: state["num_consumed"]])
        return
    start, world, length = finished
    repeats = [] if drop_last else padding(order[start:], length * world)
    assert have - want == Counter(repeats)
    assert len(repeats) < world
    dropped = order[start + length * world :] if drop_last else []
    assert want - have == Counter(dropped)
    assert len(dropped) < world


@pytest.mark.parametrize(("before", "after"), [(2, 3), (4, 2), (3, 1), (4, 4)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_resume_with_another_world_size(before: int, after: int, drop_last: bool) -> None:
    n, steps = 103, 7
    order = global_order(n, shuffle=True, seed=11, epoch=2)
    old = samplers(n, before, seed=11, drop_last=drop_last)
    for s in old:
        s.set_epoch(2)
    taken, state = consume(old, steps, "yielded")
    assert state["num_consumed"] == steps * before
    assert sorted(taken) == sorted(order[: steps * before])

    new = samplers(n, after, seed=11, drop_last=drop_last)
    for s in new:
        s.load_state_dict(state)
    rest = order[steps * before :]
    streams = [list(s) for s in new]
    # The rest of the same order, dealt out round-robin over the new ranks.
    if drop_last:
        cut = len(rest) - len(rest) % after
        assert streams == [rest[r:cut:after] for r in range(after)]
    else:
        padded = rest + padding(rest, -(-len(rest) // after) * after)
        assert streams == [padded[r::after] for r in range(after)]
    assert {s.state_dict()["num_consumed"] for s in new} == {n}

    # The next epoch is an ordinary one for the new world size.
    for r, s in enumerate(new):
        s.set_epoch(3)
        assert list(s) == torch_stream(
            n, after, r, shuffle=True, seed=11, drop_last=drop_last, epoch=3
        )


def test_loaded_state_overrides_seed_and_shuffle_and_keeps_drop_last() -> None:
    state = DistributedSampler(50, 2, 0, seed=9, shuffle=False).state_dict(consumed=5)
    s = DistributedSampler(50, 3, 2, seed=1, shuffle=True, drop_last=True)
    s.load_state_dict(state)
    assert (s.seed, s.shuffle, s.drop_last, s.epoch) == (9, False, True, 0)
    assert list(s) == list(range(10, 50))[2:39:3]


def test_a_pass_only_restarts_at_the_resume_point_until_it_finishes() -> None:
    s = DistributedSampler(20, 2, 0, seed=1)
    s.load_state_dict({**s.state_dict(), "num_consumed": 10})
    order = global_order(20, shuffle=True, seed=1, epoch=0)
    assert len(s) == 5
    it = iter(s)
    assert next(it) == order[10]
    assert list(s) == order[10::2]  # the unfinished pass is replayed from the resume point
    assert len(s) == 10  # it finished: the next iteration is a whole epoch again
    assert list(s) == order[0::2]


def test_finished_epoch_state_resumes_to_an_empty_pass() -> None:
    s = DistributedSampler(10, 4, 0, drop_last=True)
    assert len(list(s)) == 2
    state = s.state_dict()
    assert state["num_consumed"] == 10  # the dropped tail counts as done
    t = DistributedSampler(10, 1, 0, drop_last=True)
    t.load_state_dict(state)
    assert list(t) == []
    t.set_epoch(1)
    assert len(list(t)) == 10


def test_set_epoch_to_another_epoch_discards_a_loaded_position() -> None:
    s = DistributedSampler(30, 3, 1, seed=2)
    s.load_state_dict({**s.state_dict(), "num_consumed": 21, "epoch": 4})
    assert len(s) == 3
    s.set_epoch(5)
    assert list(s) == torch_stream(30, 3, 1, shuffle=True, seed=2, drop_last=False, epoch=5)


def test_dataloader_without_workers_counts_exactly() -> None:
    n, world, bs = 64, 2, 4
    s = DistributedSampler(n, world, 0, seed=3)
    loader = tud.DataLoader(torch.arange(n), batch_size=bs, sampler=s)
    seen = []
    for step, batch in enumerate(loader):
        seen += batch.tolist()
        if step == 2:
            break
    assert s.state_dict()["num_consumed"] == 3 * bs * world
    assert seen == list(s)[: 3 * bs]


def test_advance_corrects_for_prefetch() -> None:
    s = DistributedSampler(40, 2, 1)
    it = iter(s)
    list(itertools.islice(it, 12))  # a loader fetched 12 ...
    s.advance(3)
    s.advance(2)  # ... but training consumed 5
    assert s.state_dict()["num_consumed"] == 10
    assert s.state_dict(consumed=7)["num_consumed"] == 14


# -- errors and defaults -------------------------------------------------------------------------


def test_state_of_another_dataset_length_is_rejected() -> None:
    state = DistributedSampler(100, 2, 0).state_dict()
    with pytest.raises(InvalidArgumentError, match=r"dataset of 100 samples.*has 99"):
        DistributedSampler(99, 2, 0).load_state_dict(state)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"num_consumed": 101}, "num_consumed=101"),
        ({"num_consumed": -1}, "num_consumed=-1"),
        ({"version": 2}, "version 2"),
    ],
)
def test_malformed_states_are_rejected(change: dict[str, int], match: str) -> None:
    s = DistributedSampler(100, 2, 0)
    with pytest.raises(InvalidArgumentError, match=match):
        s.load_state_dict({**s.state_dict(), **change})
    state = s.state_dict()
    del state["seed"]
    with pytest.raises(InvalidArgumentError, match="lacks seed"):
        s.load_state_dict(state)


def test_counts_beyond_the_pass_are_rejected() -> None:
    s = DistributedSampler(10, 2, 0)
    with pytest.raises(InvalidArgumentError, match="consumed 6 samples of a pass of 5"):
        s.state_dict(consumed=6)
    with pytest.raises(InvalidArgumentError, match="non-negative"):
        s.advance(-1)
    s.advance(5)
    with pytest.raises(InvalidArgumentError, match="pass of 5"):
        s.advance(1)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((10, 0, 0), "num_replicas=0"),
        ((10, 2, 2), r"rank=2 is outside \[0, num_replicas=2\)"),
        ((10, 2, -1), "rank=-1"),
        ((-1, 2, 0), "length -1"),
        ((object(), 2, 0), "has no len"),
    ],
)
def test_bad_arguments_are_rejected(args: tuple[Any, int, int], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        DistributedSampler(*args)


def test_rank_and_world_size_come_from_the_default_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(comm_world, "is_initialized", lambda: True)
    monkeypatch.setattr(collectives, "get_rank", lambda group=None: 2)
    monkeypatch.setattr(collectives, "get_world_size", lambda group=None: 3)
    s = DistributedSampler(10)
    assert (s.num_replicas, s.rank) == (3, 2)
    assert DistributedSampler(10, rank=0).rank == 0


def test_without_a_group_rank_and_world_size_are_required() -> None:
    assert not comm_world.is_initialized()
    with pytest.raises(ShardlineError, match=r"call shardline.init\(\) first or pass both"):
        DistributedSampler(10)
