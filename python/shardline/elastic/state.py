"""``State``: what training returns to after a failure, committed in host memory.

``state = sl.elastic.State(model=model, optimizer=opt, sampler=sampler, step=0)`` names the
objects; ``state.commit()`` copies their state on this rank into host memory, and
``state.restore()`` puts the last commit back into the same objects, in place (the model's
parameters and the optimizer stay the objects the training loop holds). Extra fields are
attributes (``state.step``), committed and restored with the rest.

What is copied is what the strategy contract says this rank holds (its methods
``sharded_state_dict`` and ``sharded_optim_state_dict``), so a ZeRO rank commits its shards
only, a pipeline rank its stages, and nothing here knows a strategy's name. A tensor held
under two names (tied weights) is copied once. The sampler's position is its
``state_dict()``, so a restore serves again exactly the samples after the commit.

With a ``group``, each rank also holds the commit of the rank before it (``elastic.buddy``):
``restore`` is then collective, and a rank that lost its own commit (a replacement process,
with a fresh ``State``) gets it back from its buddy, with no disk read.

A commit costs one copy of this rank's state into host memory (pinned where the state is on a
GPU, so the copy runs at the link's speed: 3 GiB in 60 ms on an H200), plus, with buddies, one
point-to-point exchange of that share; ``benches/bench_commit.py`` measures the copy.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardline import checkpoint
from shardline.checkpoint.pieces import global_shape
from shardline.comm import world
from shardline.comm.group import ProcessGroup
from shardline.comm.objects import all_gather_object, broadcast_object
from shardline.elastic import buddy, job, reshard
from shardline.errors import InvalidArgumentError, MembershipChanged
from shardline.parallel import contract
from shardline.parallel.contract import Box, FlatRange, Local, Shard

__all__ = ["State"]

_log = logging.getLogger("shardline")
_runs = 0  # how many ``shardline.elastic.run`` functions run now (``run`` counts them)
_ON_DISK: dict[str, Any] = {"on disk": True}  # _recover: only a checkpoint can help (by identity)
_OWN = ("model", "optimizer", "sampler")
_TREES = ("model", "optimizer")  # the parts of a commit that hold tensors
# What a State holds besides its fields: a field cannot take one of these names.
_ATTRIBUTES = frozenset(
    ("group", "checkpoint_dir", "restored_from", "commits", "committed_at", "last_commit_seconds")
)


@dataclass(frozen=True)
class _Held:
    """A committed tensor: its host copy and the device it goes back to."""

    host: torch.Tensor
    device: torch.device


_LEAVES = (torch.Tensor, _Held, buddy.Slot)


def _map(value: Any, fn: Callable[[Any], Any], memo: dict[int, Any]) -> Any:
    """``value`` with ``fn`` applied to every tensor (or ``_Held``) inside it.

    Structures of the contract (``Shard``, ``Local``) and containers are rebuilt; a value met
    twice (tied weights) maps to one result.
    """
    key = id(value)
    if key in memo:
        return memo[key]
    out: Any
    if isinstance(value, _LEAVES):
        out = fn(value)
    elif isinstance(value, Shard):
        out = value.like([_map(p.tensor, fn, memo) for p in value.pieces])
    elif isinstance(value, Local):
        out = Local(_map(value.tensor, fn, memo))
    elif isinstance(value, Box | FlatRange):
        raise AssertionError("pieces are mapped through their Shard")
    elif isinstance(value, dict):
        out = {k: _map(v, fn, memo) for k, v in value.items()}
    elif isinstance(value, list | tuple):
        out = type(value)(_map(v, fn, memo) for v in value)
    else:
        out = copy.deepcopy(value)
    memo[key] = out
    return out


def _to_host(t: Any) -> _Held:
    src = t.detach()
    pin = src.device.type == "cuda"
    host = torch.empty(src.shape, dtype=src.dtype, pin_memory=pin)
    host.copy_(src, non_blocking=pin)
    return _Held(host, src.device)


def _to_device(held: Any) -> torch.Tensor:
    assert isinstance(held, _Held)
    return held.host.to(held.device, copy=True)


class State:
    """Training state that survives a failure: committed in host memory, restored in place.

    Args:
        model: The (possibly distributed) model; its state on this rank is committed.
        optimizer: Its optimizer (needs ``model``).
        sampler: An object with ``state_dict()`` / ``load_state_dict()`` (``DistributedSampler``).
        group: The ranks that commit together (every one calls ``commit`` and ``restore``);
            with more than one, each rank also holds the commit of the rank before it
            (``elastic.buddy``), so a rank that lost its own (a replacement process) gets it
            back in ``restore``. ``None``: this rank alone.
        checkpoint_dir: Where ``save()`` writes checkpoints; ``restore`` falls back to the
            latest one there when memory cannot help (a rank and its buddy both lost).
        **extra: Other fields (``step=0``), read and set as attributes, committed and
            restored as copies.

    Attributes:
        commits: How many commits were made.
        committed_at: ``time.time()`` of the last commit (``None`` before the first).
        last_commit_seconds: How long the last commit took on this rank.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        sampler: Any = None,
        group: ProcessGroup | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        **extra: Any,
    ) -> None:
        if optimizer is not None and model is None:
            raise InvalidArgumentError(
                "elastic.State: an optimizer needs its model (its state is kept by the "
                "model's parameter names); pass model= too"
            )
        clash = sorted(name for name in extra if hasattr(State, name) or name in _ATTRIBUTES)
        if clash:
            raise InvalidArgumentError(
                f"elastic.State: {', '.join(clash)} is a name State uses; rename the field"
            )
        object.__setattr__(self, "_fields", dict(extra))
        self.model, self.optimizer, self.sampler = model, optimizer, sampler
        if group is None and world.elastic_generation() is not None:
            group = world.default_group()  # an elastic job commits over the whole job
        self.group = group if group is not None and group.world_size > 1 else None
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.restored_from: str | None = None  # "memory", "buddy" or a checkpoint's path
        self._held: tuple[Any, list[torch.Tensor]] | None = None  # the previous rank's commit
        self.commits = 0
        self.committed_at: float | None = None
        self.last_commit_seconds = 0.0
        self._saved: dict[str, Any] | None = None
        self._marked = False  # this process told an elastic job that it has trained
        # The commit before: kept until the next one is complete everywhere (a rank lost in
        # the middle of a commit leaves some ranks with the new one and some without).
        self._previous: dict[str, Any] | None = None
        self._held_previous: tuple[Any, list[torch.Tensor]] | None = None

    # Extra fields read and write as attributes.

    def __getattr__(self, name: str) -> Any:
        fields = self.__dict__.get("_fields", {})
        if name in fields:
            return fields[name]
        raise AttributeError(f"elastic.State has no field {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__.get("_fields", {}):
            self._fields[name] = value
        else:
            object.__setattr__(self, name, value)

    def fields(self) -> dict[str, Any]:
        """The extra fields and their current values."""
        return dict(self._fields)

    def commit(self) -> None:
        """Makes the current state the one ``restore`` returns to (this rank's share).

        Waits for the device's pending work on the copied tensors (a CUDA sync), so call it
        between steps, after ``optimizer.step()``. In an elastic job it also learns, with
        the other ranks, whether a node joined: it then raises ``MembershipChanged`` (once the
        commit is made) for ``shardline.elastic.run`` to re-form the group, so make it the
        step's last statement.
        """
        self._snapshot(self.commits + 1)
        g = self.group
        if world.elastic_generation() is not None:
            if not self._marked:
                job.mark("trained")  # a process joining later restores with the others
                self._marked = True
            # Every rank learns of a new member at the same step: rank 0 asks the store (one
            # round trip per commit, not one per rank) and the flag is all-reduced.
            asks = g is None or g.rank == 0
            flag = torch.tensor([int(asks and world.membership_changed())])
            if g is not None:
                world.host_group(g).all_reduce(flag, "max")
            _raise_if_aborted(g)
            if int(flag.item()):
                what = "the elastic job's members changed (a node joined, or a rank left)"
                if _runs > 0:  # elastic.run catches it, and says it re-forms the group
                    raise MembershipChanged(what)
                raise MembershipChanged(
                    f"{what}; run the training function under shardline.elastic.run, which "
                    "re-forms the group and goes on"
                )

    def _snapshot(self, number: int) -> None:
        """Copies the state into host memory as commit ``number`` (and to the buddy)."""
        start = time.perf_counter()
        devices: set[torch.device] = set()

        def to_host(t: Any) -> _Held:
            held = _to_host(t)
            devices.add(held.device)
            return held

        # One memo per tree: ids are unique only while their objects live, and each tree
        # lives for its own mapping.
        saved: dict[str, Any] = {"fields": copy.deepcopy(self._fields)}
        if self.model is not None:
            saved["model"] = _map(contract.sharded_state_dict(self.model), to_host, {})
        if self.optimizer is not None:
            assert self.model is not None
            optim = contract.sharded_optim_state_dict(self.model, self.optimizer)
            saved["optimizer"] = _map(optim, to_host, {})
        if self.sampler is not None:
            saved["sampler"] = copy.deepcopy(self.sampler.state_dict())
        for device in devices - {torch.device("cpu")}:
            torch.cuda.synchronize(device)  # the pinned copies ran asynchronously
        saved["number"] = number
        g = self.group
        saved["rank"], saved["world"] = (g.rank, g.world_size) if g is not None else (0, 1)
        gen = world.elastic_generation()
        saved["gen"] = gen.number if gen is not None else 0  # the layout it was made in
        held = buddy.exchange(world.host_group(g), *_split(saved)) if g is not None else None
        _raise_if_aborted(g)  # an NCCL group aborted meanwhile: its step's values are void
        # Only now, once the exchange worked: a failure in it keeps the commits held before.
        self._previous, self._held_previous = self._saved, self._held
        self._saved, self._held = saved, held
        self.commits = number
        self.committed_at = time.time()
        self.last_commit_seconds = time.perf_counter() - start

    def restore(self) -> None:
        """Puts the last commit back into the same model, optimizer, sampler and fields.

        Raises:
            InvalidArgumentError: nothing was committed yet.
        """
        self.restored_from = "memory"
        saved = self._saved if self.group is None else self._recover()
        if saved is _ON_DISK:
            self._load_latest()
            return
        if saved is None:
            raise InvalidArgumentError(
                "elastic.State.restore: nothing was committed yet; call state.commit() once "
                "the state is worth returning to (after the first step, say)"
            )
        if self.model is not None:
            sd = _map(saved["model"], _to_device, {})
            contract.load_sharded_state_dict(self.model, sd)
        if self.optimizer is not None:
            assert self.model is not None
            self.optimizer.state.clear()  # entries of parameters the commit had no state for
            osd = _map(saved["optimizer"], _to_device, {})
            contract.load_sharded_optim_state_dict(self.model, self.optimizer, osd)
        if self.sampler is not None:
            self.sampler.load_state_dict(saved["sampler"])
        self._fields.update(copy.deepcopy(saved["fields"]))

    def _recover(self) -> dict[str, Any] | None:
        """This rank's commit, fetched from its buddy if this rank lost it. Collective."""
        g = self.group
        assert g is not None
        mine = self._saved["number"] if self._saved is not None else None
        held = self._held[0]["number"] if self._held is not None else None
        # Every rank decides from the same views: what each holds, and whether it sees a
        # checkpoint on disk (all must, to load one together).
        views = all_gather_object((mine, held, self._latest() is not None), g)
        newest = max((m for m, _, _ in views if m is not None), default=None)
        if newest is None:
            return None
        n = g.world_size
        lost = [q for q, (m, _, _) in enumerate(views) if m != newest]
        for q in lost:
            holder = (q + 1) % n
            if views[holder][1] != newest:
                if all(disk for _, _, disk in views):
                    return _ON_DISK
                raise InvalidArgumentError(
                    f"elastic.State.restore: rank {q}'s commit #{newest} is lost, and so is "
                    f"the copy its buddy rank {holder} held (two neighbours lost at once), "
                    "and no checkpoint_dir holds a checkpoint; give State a checkpoint_dir "
                    "and call state.save() now and then, or load one (sl.checkpoint.load)"
                )
        for q in lost:
            if g.rank == (q + 1) % n:
                assert self._held is not None
                buddy.give(g, *self._held, dst=q)
            elif g.rank == q:
                self._saved = _join(*buddy.take(g, (q + 1) % n))
                self.commits = newest
                self.restored_from = "buddy"
        return self._saved

    # -- after a membership change ------------------------------------------------------------

    def _move_to(self, group: ProcessGroup) -> None:
        """Points the state at the re-formed group: the model's strategy and the sampler too.

        No collective; the values come with ``_rejoin``.
        """
        if self.model is not None:
            contract.regroup(self.model, group)
        self.group = group if group.world_size > 1 else None
        if self.sampler is not None and hasattr(self.sampler, "num_replicas"):
            self.sampler.num_replicas, self.sampler.rank = group.world_size, group.rank

    def _commits(self) -> list[tuple[tuple[int, int], int, int, str]]:
        """What this rank holds: ``((number, generation), old rank, old world size, kind)``.

        ``kind`` is ``"own"`` or ``"held"`` (a buddy's). A commit is named by its number and
        the generation it was made in: after a restore the same number is committed again in
        the new layout.
        """
        out = []
        for saved in (self._saved, self._previous):
            if saved is not None:
                out.append(((saved["number"], saved["gen"]), saved["rank"], saved["world"], "own"))
        for held in (self._held, self._held_previous):
            if held is not None:
                sk = held[0]
                out.append(((sk["number"], sk["gen"]), sk["rank"], sk["world"], "held"))
        return out

    def _rejoin(self, group: ProcessGroup) -> None:
        """Restores the newest complete commit of the old group into this group's layout.

        Collective over ``group`` (every rank of the new generation: survivors, replacements
        and newcomers). A commit is complete when every old rank's share of it is held by
        someone: itself, or its buddy. The shares move to their new owners
        (``elastic.reshard``); the fields and the sampler's position come from old rank 0's.
        Falls back to the latest checkpoint in ``checkpoint_dir`` when no commit is complete.
        """
        sig = _signature(self.model)
        host = world.host_group(group)
        views = all_gather_object(
            {"sig": sig, "commits": self._commits(), "disk": self._latest() is not None}, host
        )
        if len({v["sig"] for v in views}) > 1:
            raise InvalidArgumentError(
                "elastic: the ranks of the new generation hold different models (parameter "
                "names or shapes differ); every process must build the same model"
            )
        ident, world_size = _newest_complete(views)
        if ident is None:
            if all(v["disk"] for v in views):
                self.group = group if group.world_size > 1 else None
                self._load_latest()
                top = max((c[0][0] for v in views for c in v["commits"]), default=0)
                self._snapshot(top + 1)  # as below: a commit in this layout at once
                return
            if not any(v["commits"] for v in views):
                raise InvalidArgumentError(
                    "elastic: a rank was lost before the first state.commit(), so there is "
                    "nothing to go back to; commit after the first step, or give State a "
                    "checkpoint_dir and call state.save()"
                )
            raise InvalidArgumentError(
                "elastic: no commit is complete among the survivors (a rank and its buddy "
                "were both lost) and no checkpoint_dir holds a checkpoint; give State a "
                "checkpoint_dir and call state.save() now and then"
            )
        owners = {c[1] for v in views for c in v["commits"] if c[0] == ident and c[3] == "own"}
        mine: list[reshard.Commit] = []
        first: int | None = None  # the rank giving old rank 0's fields and sampler position
        for r, v in enumerate(views):
            for num, q, _, kind in v["commits"]:
                if num == ident and q == 0 and (kind == "own" or 0 not in owners):
                    first = r if first is None else first
        for saved in (self._saved, self._previous):
            if saved is not None and _ident(saved) == ident:
                mine.append(_host_commit(saved))
        for held in (self._held, self._held_previous):
            if held is not None and _ident(held[0]) == ident and held[0]["rank"] not in owners:
                mine.append(_host_commit(_join(*held)))
        reshard.load(host, mine, self.model, self.optimizer)
        _raise_if_aborted(group)
        assert first is not None
        top = self._by_ident(ident, rank=0) if group.rank == first else None
        extra = broadcast_object(
            (top["fields"], top.get("sampler")) if top is not None else None, first, host
        )
        fields, sampler_state = extra
        self._fields.update(copy.deepcopy(fields))
        if self.sampler is not None and sampler_state is not None:
            self.sampler.load_state_dict(sampler_state)
        self.restored_from = "memory" if world_size == group.world_size else "resharded"
        self.group = group if group.world_size > 1 else None
        # The commits held were made in the old layout: the restored state is committed
        # again at once, in this one, so that a failure before the next commit finds it.
        self._snapshot(ident[0])

    def _by_ident(self, ident: tuple[int, int], rank: int) -> dict[str, Any] | None:
        """The commit ``ident`` of old rank ``rank`` this rank holds (own or held)."""
        for saved in (self._saved, self._previous):
            if saved is not None and _ident(saved) == ident and saved["rank"] == rank:
                return saved
        for held in (self._held, self._held_previous):
            if held is not None and _ident(held[0]) == ident and held[0]["rank"] == rank:
                return _join(*held)
        return None

    # -- on disk --------------------------------------------------------------------------------

    def save(self) -> Path:
        """Writes a checkpoint of the current state into ``checkpoint_dir`` (collective).

        The model and optimizer go through ``sl.checkpoint.save`` (any layout loads it); the
        fields and the sampler's position go in its ``extra`` (fields must be JSON values).
        Keeps the newest two. Returns the checkpoint's path.
        """
        if self.checkpoint_dir is None:
            raise InvalidArgumentError(
                "elastic.State.save: no checkpoint_dir; pass State(checkpoint_dir=...)"
            )
        extra = {"elastic_fields": self._fields}
        if self.sampler is not None:
            extra["elastic_sampler"] = self.sampler.state_dict()
        # The job's ranks save together, also when State commits alone (no elastic launcher):
        # the checkpoint holds every rank's shards, under rank 0's stamp.
        group = self.group
        if group is None and world.is_initialized() and world.default_group().world_size > 1:
            group = world.default_group()
        stamp = time.time_ns()  # rank 0's: every rank writes into the same directory
        if group is not None:
            stamp = broadcast_object(stamp, 0, group)
        path = self.checkpoint_dir / f"state-{stamp}"
        checkpoint.save(path, model=self.model, optimizer=self.optimizer, extra=extra,
                        keep_last=2, group=group)  # fmt: skip
        return path

    def _latest(self) -> Path | None:
        if self.checkpoint_dir is None:
            return None
        return checkpoint.latest(self.checkpoint_dir)

    def _load_latest(self) -> None:
        path = self._latest()
        assert path is not None
        if self.optimizer is not None:
            self.optimizer.state.clear()
        extra = checkpoint.load(path, model=self.model, optimizer=self.optimizer, group=self.group)
        self._fields.update(extra.get("elastic_fields", {}))
        if self.sampler is not None and "elastic_sampler" in extra:
            self.sampler.load_state_dict(extra["elastic_sampler"])
        self.restored_from = str(path)
        _log.warning("elastic: two neighbouring ranks lost their commits; restored %s", path)

    def __repr__(self) -> str:
        held = [k for k in _OWN if getattr(self, k) is not None]
        return f"elastic.State({', '.join(held + list(self._fields))}; commits={self.commits})"


def _raise_if_aborted(g: ProcessGroup | None) -> None:
    """Raises the loss a group noted (an aborted NCCL group's ops end without an error)."""
    lost = g._lost_peer() if g is not None else None
    if lost is not None:
        raise lost


def _signature(model: nn.Module | None) -> str:
    """The model's parameter names and global shapes, hashed: the same model on every rank."""
    if model is None:
        return ""
    sd = contract.sharded_state_dict(model)
    text = repr(sorted((n, global_shape(v)) for n, v in sd.items() if not isinstance(v, Local)))
    return hashlib.sha256(text.encode()).hexdigest()


def _ident(saved: dict[str, Any]) -> tuple[int, int]:
    """A commit's name: its number and the generation (layout) it was made in."""
    return saved["number"], saved["gen"]


def _newest_complete(views: list[dict[str, Any]]) -> tuple[tuple[int, int] | None, int]:
    """The newest commit every old rank's share of is held by someone, and its world size.

    Newest: the highest number, and of one number (committed again after a restore) the
    latest generation's.
    """
    held: dict[tuple[int, int], set[int]] = {}
    sizes: dict[tuple[int, int], int] = {}
    for v in views:
        for name, q, size, _ in v["commits"]:
            held.setdefault(tuple(name), set()).add(q)
            sizes[tuple(name)] = size
    for ident in sorted(held, reverse=True):
        if held[ident] >= set(range(sizes[ident])):
            return ident, sizes[ident]
    return None, 0


def _host_commit(saved: dict[str, Any]) -> Any:
    """A commit with host tensors in place of ``_Held``s, for ``reshard``."""

    def host(h: Any) -> torch.Tensor:
        return h.host if isinstance(h, _Held) else h

    return reshard.Commit(
        saved["rank"],
        _map(saved["model"], host, {}) if "model" in saved else None,
        _map(saved["optimizer"], host, {}) if "optimizer" in saved else None,
    )


def _split(saved: dict[str, Any]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """A commit as a skeleton (tensors replaced by ``buddy.Slot``s) and its host tensors.

    The skeleton's ``"devices"`` says where each tensor goes back to.
    """
    tensors: list[torch.Tensor] = []
    devices: dict[int, torch.device] = {}

    def slot(held: _Held) -> buddy.Slot:
        devices[len(tensors)] = held.device
        tensors.append(held.host)
        return buddy.Slot(len(tensors) - 1)

    skeleton = {k: _map(v, slot, {}) if k in _TREES else v for k, v in saved.items()}
    skeleton["devices"] = devices
    return skeleton, tensors


def _join(skeleton: dict[str, Any], tensors: list[torch.Tensor]) -> dict[str, Any]:
    """The commit ``_split`` made a skeleton of, with ``tensors`` back in their slots."""
    devices = skeleton["devices"]

    def held(s: buddy.Slot) -> _Held:
        return _Held(tensors[s.index], devices[s.index])

    return {
        k: _map(v, held, {}) if k in _TREES else v for k, v in skeleton.items() if k != "devices"
    }
