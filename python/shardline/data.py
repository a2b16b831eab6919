"""``DistributedSampler``: torch's sampler, index for index, plus mid-epoch resume.

[Note: epoch order] An epoch has one *global order*: ``randperm(dataset_len)`` drawn from
``torch.Generator().manual_seed(seed + epoch)`` (or ``range(dataset_len)`` without shuffle).
A *pass* hands out a suffix of it, ``order[start:]`` (``start`` is 0 unless the sampler was
resumed): the suffix is padded by repeating its own first entries up to a multiple of
``num_replicas`` (or cut down to one, with ``drop_last``), and rank ``r`` takes positions
``r, r + W, r + 2W, ...``. So once every rank has consumed ``k`` samples of a pass, the first
``k * W`` positions of the suffix are consumed, and ``start + min(k * W, len(suffix))`` real
samples of the epoch are done. That number is what ``state_dict`` records; a resume with any
world size hands out what is left of the same global order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from shardline.comm import collectives
from shardline.comm import world as comm_world
from shardline.errors import InvalidArgumentError, ShardlineError

__all__ = ["DistributedSampler"]

STATE_VERSION = 1
_STATE_KEYS = ("version", "epoch", "seed", "shuffle", "dataset_len", "num_consumed")


class DistributedSampler(Sampler[int]):
    """Gives each rank its share of a dataset's indices; resumable in the middle of an epoch.

    Without a resume it yields exactly what ``torch.utils.data.DistributedSampler`` yields for
    the same arguments: the epoch's order (``torch.randperm`` seeded with ``seed + epoch``, or
    ``0..n-1`` without shuffle) padded to a multiple of ``num_replicas`` by repeating its first
    indices (or, with ``drop_last``, cut down to one), of which rank ``r`` takes every
    ``num_replicas``-th index starting at ``r``. Call ``set_epoch(epoch)`` before each epoch.

    Resume: ``state_dict()`` records how many samples of the current epoch's order all ranks
    together have consumed; ``load_state_dict()`` on a sampler of *any* world size makes the
    next pass hand out the rest of that epoch's order, split the same way (padded or cut down
    for the rest only), so no sample is repeated or skipped. Later epochs are normal. The only
    repeats in an epoch are the padding of the pass that finishes it: fewer than
    ``num_replicas`` of the first indices of that pass's rest.

    Consumption: by default the sampler counts the indices it yielded in the current pass.
    A ``DataLoader`` with workers fetches ahead of training, so that count runs ahead of what
    was trained on; then report the truth with ``advance(n)`` after each step, or pass
    ``consumed=`` to ``state_dict``.

    [Note: global state] the state is global, not per rank: it is this rank's count times
    ``num_replicas``. It is the same on every rank because ranks consume equally (one batch
    each per step, as DDP does), so any rank's state can be saved.

    Args:
        dataset_or_len: A dataset (anything with ``len()``) or its length.
        num_replicas: Number of ranks; the default group's world size when ``None``
            (``shardline.init()``, else an initialised ``torch.distributed``).
        rank: This rank, in ``[0, num_replicas)``; the default group's rank when ``None``.
        shuffle: Shuffle every epoch (the same permutation on every rank).
        seed: Seed of the shuffle; the same on every rank.
        drop_last: Drop the tail that does not split evenly instead of padding.

    Raises:
        InvalidArgumentError: bad length, ``num_replicas`` or ``rank``.
        ShardlineError: ``num_replicas`` or ``rank`` is missing and no group is initialised.

    Example::

        sampler = sl.DistributedSampler(dataset, seed=1)
        sampler.load_state_dict(ckpt["sampler"])          # optional, any world size
        loader = DataLoader(dataset, batch_size=32, sampler=sampler)
        for epoch in range(ckpt["epoch"], num_epochs):
            sampler.set_epoch(epoch)                       # keeps a loaded mid-epoch position
            for x, y in loader:
                step(x, y)
                sampler.advance(len(x))                    # samples, not len((x, y))
                if time_to_save():
                    save({"sampler": sampler.state_dict(), "epoch": epoch, ...})
    """

    def __init__(
        self,
        dataset_or_len: Sized | int,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        self.dataset = dataset_or_len
        self.dataset_len = _length(dataset_or_len)
        self.num_replicas, self.rank = _replicas(num_replicas, rank)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        # The current pass: it starts at global position `_start` of the epoch's order.
        # `_fresh`: no __iter__ since the pass was set up (by __init__, set_epoch or a load),
        # so the next __iter__ runs it even if it is empty.
        self._start = 0
        self._fresh = True
        self._yielded = 0
        self._consumed: int | None = None  # set by advance(); wins over _yielded

    def __repr__(self) -> str:
        return (
            f"DistributedSampler(dataset_len={self.dataset_len}, num_replicas={self.num_replicas}"
            f", rank={self.rank}, shuffle={self.shuffle}, seed={self.seed}, "
            f"drop_last={self.drop_last}, epoch={self.epoch})"
        )

    # -- torch's interface -------------------------------------------------------------------

    @property
    def num_samples(self) -> int:
        """Indices this rank gets from the next pass (the current one while it runs)."""
        return self._pass_len(self._next_start())

    @property
    def total_size(self) -> int:
        """``num_samples * num_replicas``: the pass's length after padding or dropping."""
        return self.num_samples * self.num_replicas

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        """Starts a pass and yields this rank's indices.

        The first pass after ``load_state_dict`` hands out the rest of the loaded epoch; an
        iteration that starts after a pass ran to its end replays the whole epoch (as torch
        does when ``set_epoch`` is not called); one that starts after an unfinished pass
        replays that pass.
        """
        self._start = self._next_start()
        self._fresh = False
        self._yielded = 0
        self._consumed = None
        return self._count(self._indices(self._start))

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch, which seeds the shuffle (``seed + epoch``).

        Setting a different epoch starts it from its beginning; setting the current one keeps
        the position, so a loop may call ``set_epoch(e)`` right after loading a state of
        epoch ``e``.
        """
        epoch = int(epoch)
        if epoch != self.epoch:
            self._reset(0)
        self.epoch = epoch

    # -- consumption and resume ---------------------------------------------------------------

    def advance(self, n: int) -> None:
        """Reports that this rank consumed ``n`` more samples of the current pass.

        Once called in a pass, ``state_dict`` uses this count instead of the number of
        indices yielded, so prefetching does not count as consumption.

        Raises:
            InvalidArgumentError: ``n`` is negative or the count passes the pass's length.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidArgumentError(f"advance(n): n={n!r} must be a non-negative integer")
        total = (self._consumed or 0) + n
        self._check_count(total, "advance")
        self._consumed = total

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The resumable state of the current epoch, the same on every rank.

        Args:
            consumed: Samples this rank consumed in the current pass (since the last
                ``__iter__``, which a load or ``set_epoch`` re-arms). ``None`` takes the count
                from ``advance``, or else the number of indices yielded.

        Returns:
            ``{"version", "epoch", "seed", "shuffle", "dataset_len", "num_consumed"}``, where
            ``num_consumed`` counts the real (not padding) samples of the epoch's global order
            consumed by all ranks: ``start + min(consumed * num_replicas, dataset_len -
            start)``, ``start`` being where the pass began in that order (0, or the loaded
            ``num_consumed``). A rank that consumed its whole pass finished the epoch: then
            ``num_consumed == dataset_len``, also where ``drop_last`` dropped a tail (so a
            resume never serves a tail the epoch dropped).

        Raises:
            InvalidArgumentError: ``consumed`` is negative or more than the pass holds.
        """
        if consumed is None:
            consumed = self._consumed if self._consumed is not None else self._yielded
        elif isinstance(consumed, bool) or not isinstance(consumed, int) or consumed < 0:
            raise InvalidArgumentError(
                f"state_dict(consumed={consumed!r}): consumed must be a non-negative integer"
            )
        self._check_count(consumed, "state_dict")
        length = self._pass_len(self._start)
        if consumed == length > 0:
            done = self.dataset_len
        else:
            done = self._start + min(consumed * self.num_replicas, self.dataset_len - self._start)
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "dataset_len": self.dataset_len,
            "num_consumed": done,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resumes from ``state_dict()``'s result, saved by a run of any world size.

        Takes the state's epoch, seed and shuffle (they define the epoch's order); keeps this
        sampler's ``num_replicas``, ``rank`` and ``drop_last``. The next pass hands out the
        rest of that epoch's order; ``set_epoch`` with another epoch discards the position.

        Raises:
            InvalidArgumentError: the state is malformed, of another version, or of a dataset
                of a different length.
        """
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise InvalidArgumentError(
                f"load_state_dict: the state lacks {', '.join(missing)}; pass what "
                "DistributedSampler.state_dict() returned"
            )
        if state["version"] != STATE_VERSION:
            raise InvalidArgumentError(
                f"load_state_dict: state version {state['version']!r} is not supported "
                f"(this shardline reads version {STATE_VERSION})"
            )
        n = state["dataset_len"]
        if n != self.dataset_len:
            raise InvalidArgumentError(
                f"load_state_dict: the state is of a dataset of {n} samples but this sampler's "
                f"has {self.dataset_len}; resume with the same dataset (or start a new epoch "
                "without loading the sampler state)"
            )
        done = state["num_consumed"]
        if isinstance(done, bool) or not isinstance(done, int) or not 0 <= done <= n:
            raise InvalidArgumentError(
                f"load_state_dict: num_consumed={done!r} must be an integer in [0, {n}]"
            )
        self.epoch = int(state["epoch"])
        self.seed = int(state["seed"])
        self.shuffle = bool(state["shuffle"])
        self._reset(done)

    # -- internals ----------------------------------------------------------------------------

    def _reset(self, start: int) -> None:
        self._start = start
        self._fresh = True
        self._yielded = 0
        self._consumed = None

    def _pass_len(self, start: int) -> int:
        """Indices per rank in a pass over ``order[start:]`` (torch's ``num_samples``)."""
        rest = self.dataset_len - start
        if self.drop_last:
            return rest // self.num_replicas
        return math.ceil(rest / self.num_replicas)

    def _exhausted(self) -> bool:
        length = self._pass_len(self._start)
        return self._yielded >= length or (self._consumed is not None and self._consumed >= length)

    def _next_start(self) -> int:
        return 0 if not self._fresh and self._exhausted() else self._start

    def _check_count(self, count: int, what: str) -> None:
        length = self._pass_len(self._start)
        if count > length:
            raise InvalidArgumentError(
                f"{what}: rank {self.rank} cannot have consumed {count} samples of a pass of "
                f"{length}; count only this pass's samples (it restarts at every iteration)"
            )

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.dataset_len)
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_len, generator=g)

    def _indices(self, start: int) -> list[int]:
        rest = self._order()[start:]
        total = self._pass_len(start) * self.num_replicas
        if total > rest.numel():  # pad by repeating the rest's first entries, as torch does
            pad = total - rest.numel()
            rest = torch.cat([rest, rest.repeat(math.ceil(pad / rest.numel()))[:pad]])
        picked: list[int] = rest[self.rank : total : self.num_replicas].tolist()
        return picked

    def _count(self, indices: list[int]) -> Iterator[int]:
        for i in indices:
            self._yielded += 1
            yield i


def _length(dataset_or_len: Sized | int) -> int:
    if isinstance(dataset_or_len, bool):
        raise InvalidArgumentError("dataset_or_len must be a dataset or a length, got a bool")
    if isinstance(dataset_or_len, int):
        n = dataset_or_len
    else:
        try:
            n = len(dataset_or_len)
        except TypeError:
            raise InvalidArgumentError(
                f"dataset_or_len: {type(dataset_or_len).__name__} has no len(); pass a map-style "
                "dataset or its length"
            ) from None
    if n < 0:
        raise InvalidArgumentError(f"dataset_or_len: length {n} must be non-negative")
    return n


def _replicas(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    if num_replicas is None or rank is None:
        if comm_world.is_initialized():
            world, me = collectives.get_world_size(), collectives.get_rank()
        elif dist.is_available() and dist.is_initialized():
            world, me = dist.get_world_size(), dist.get_rank()
        else:
            raise ShardlineError(
                "DistributedSampler: num_replicas and rank are not given and no process group "
                "is initialised; call shardline.init() first or pass both"
            )
        num_replicas = world if num_replicas is None else num_replicas
        rank = me if rank is None else rank
    for name, value in (("num_replicas", num_replicas), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgumentError(f"{name}={value!r} must be an integer")
    if num_replicas < 1:
        raise InvalidArgumentError(f"num_replicas={num_replicas} must be at least 1")
    if not 0 <= rank < num_replicas:
        raise InvalidArgumentError(
            f"rank={rank} is outside [0, num_replicas={num_replicas}); pass a rank below "
            "num_replicas"
        )
    return num_replicas, rank
