"""The reshard core: what a load reads, from files or from memory, in any layout.

``sl.checkpoint.load`` (shard files) and elastic restores (commits held by the ranks) share it.

The targets come from the strategy contract: ``sharded_state_dict()`` says which parts of
which tensors this rank holds, and the reads fill those tensors; the filled dict then goes back
through ``load_sharded_state_dict()``. Optimizer state is read into fresh tensors laid out like
its parameter (elementwise state: same pieces) or whole (``step`` and other tensors), and goes
back through ``load_sharded_optim_state_dict()``. Nothing here knows a strategy.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardline.checkpoint._store import Checkpoint
from shardline.checkpoint.pieces import (
    flat_index,
    global_shape,
    is_local_key,
    local_key,
    targets_of,
)
from shardline.errors import CheckpointError, InvalidArgumentError
from shardline.parallel import contract
from shardline.parallel.contract import Local, Shard

__all__ = ["InMemoryCheckpoint", "Read", "chunks_for", "plan_model", "plan_optimizer"]

# One read: the stored key, the tensor to fill, its first element or block offsets.
Read = tuple[str, torch.Tensor, int | tuple[int, ...]]


def _reads(key: str, value: Any, rank: int) -> list[Read]:
    return [(k, t, where) for k, (t, _, where) in targets_of(key, value, rank)]


def _apply(what: str, fn: Callable[[], None]) -> Callable[[], None]:
    """``fn``, with the strategy's ``InvalidArgumentError`` as a ``CheckpointError``."""

    def run() -> None:
        try:
            fn()
        except InvalidArgumentError as exc:
            raise CheckpointError(f"{what}: {exc}") from exc

    return run


def plan_model(
    ck: Checkpoint, model: nn.Module, strict: bool, rank: int, same_layout: bool
) -> tuple[list[Read], Callable[[], None]]:
    """Checks the model against the checkpoint; the reads that load it, and what ends it.

    ``Local`` values are read only when ``same_layout`` (same world size and layout as when
    saved); otherwise they keep the strategy's own values.
    """
    sd = contract.sharded_state_dict(model)
    stored = {
        k[len("model/") :]
        for k in list(ck.tensors) + list(ck.aliases)
        if k.startswith("model/") and not is_local_key(k)
    }
    locals_ = {n for n, v in sd.items() if isinstance(v, Local)}
    missing = sorted(n for n in sd if n not in locals_ and not ck.has(f"model/{n}"))
    unexpected = sorted(stored - set(sd))
    bad = [
        f"{n}: checkpoint {list(ck.shape(f'model/{n}'))} vs model {list(global_shape(v))}"
        for n, v in sorted(sd.items())
        if n not in locals_ and ck.has(f"model/{n}") and ck.shape(f"model/{n}") != global_shape(v)
    ]
    problems = []
    if bad:
        problems.append(f"shape mismatches: {'; '.join(bad)}")
    if strict and missing:
        problems.append(f"missing keys: {missing}")
    if strict and unexpected:
        problems.append(f"unexpected keys: {unexpected}")
    if problems:
        raise CheckpointError(
            f"load({ck.path}) into {type(model).__name__}: " + " | ".join(problems)
        )
    reads: list[Read] = []
    given: dict[str, Any] = {}
    for name, value in sd.items():
        key = f"model/{name}"
        if isinstance(value, Local):
            if not (same_layout and ck.has(local_key(key, rank))):
                continue
        elif not ck.has(key):
            continue
        reads += _reads(key, value, rank)
        given[name] = value
    what = f"load({ck.path}) into {type(model).__name__}"
    return reads, _apply(what, lambda: contract.load_sharded_state_dict(model, given))


def plan_optimizer(
    ck: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer, strict: bool, rank: int
) -> tuple[list[Read], Callable[[], None]]:
    """Checks the optimizer against the checkpoint.

    Returns the reads of its state into fresh tensors, and a function that hands them to the
    strategy once all are read.
    """
    saved = ck.index.get("optimizer")
    if saved is None:
        raise CheckpointError(f"{ck.path} holds no optimizer state")
    current = contract.sharded_optim_state_dict(model, optimizer)
    mine = [list(g["params"]) for g in current["param_groups"]]
    layouts = contract.sharded_state_dict(model)
    groups = saved.get("param_groups", [])
    if strict and len(groups) != len(mine):
        raise CheckpointError(
            f"load({ck.path}): the checkpoint has {len(groups)} optimizer param groups, "
            f"the optimizer {len(mine)}"
        )
    groups = _matched_groups(ck, current["param_groups"], groups, strict)
    by_param: dict[str, list[str]] = {}
    for key in ck.tensors:
        if key.startswith("optim/") and not is_local_key(key):
            name, _, k = key[len("optim/") :].rpartition("/")
            by_param.setdefault(name, []).append(k)
    values = saved.get("values", {})
    params = {n for names in mine for n in names}
    unknown = sorted(set(by_param) - params)
    if strict and unknown:
        raise CheckpointError(
            f"load({ck.path}): optimizer state for parameters the model lacks: {unknown}"
        )
    reads: list[Read] = []
    state: dict[str, dict[str, Any]] = {}
    for name in sorted(params):
        if name not in by_param and name not in values:
            continue
        where = layouts[name]
        if isinstance(where, Shard) and not where.pieces:
            continue  # this rank holds none of the parameter, so none of its state
        entries: dict[str, Any] = {}
        for k in by_param.get(name, []):
            key = f"optim/{name}/{k}"
            value = _fresh_like(ck, key, where)
            reads += _reads(key, value, rank)
            entries[k] = value
        entries.update(values.get(name, {}))
        state[name] = entries
    sd = {"state": state, "param_groups": groups}
    what = f"load({ck.path}) into the optimizer of {type(model).__name__}"
    return reads, _apply(what, lambda: contract.load_sharded_optim_state_dict(model, optimizer, sd))


def _matched_groups(
    ck: Checkpoint,
    current: list[dict[str, Any]],
    saved: list[dict[str, Any]],
    strict: bool,
) -> list[dict[str, Any]]:
    """The saved param group for each of the optimizer's groups, matched by their parameters.

    Groups are matched by the names they hold, not by position: an optimizer that builds the
    same groups in another order gets each group's own hyperparameters back. ``strict``: each
    group must hold exactly the parameters of a saved group. Otherwise a group takes the
    saved group sharing most of its parameters, and keeps its own hyperparameters where it
    shares none.
    """
    sets = [set(sg.get("params", [])) for sg in saved]
    out = []
    for i, group in enumerate(current):
        names = set(group["params"])
        overlap = [len(names & s) for s in sets]
        best = max(range(len(saved)), key=overlap.__getitem__, default=None)
        if strict and (best is None or sets[best] != names):
            extra = sorted(names - sets[best]) if best is not None else sorted(names)
            missing = sorted(sets[best] - names) if best is not None else []
            raise CheckpointError(
                f"load({ck.path}): optimizer param group {i} holds different parameters than "
                f"any param group saved (not saved with it: {extra[:3]}, saved with it but "
                f"not in it: {missing[:3]}); build the optimizer's groups the same way, or "
                "pass strict=False to take each group's hyperparameters from the saved group "
                "sharing most of its parameters"
            )
        out.append(saved[best] if best is not None and overlap[best] else group)
    return out


def _fresh_like(ck: Checkpoint, key: str, where: Any) -> torch.Tensor | Shard:
    """A new value for optimizer state ``key`` of a parameter laid out as ``where``.

    Elementwise state (the parameter's shape) is laid out like the parameter; other tensors
    are read whole. Both live on the parameter's device, but scalars (``step``), which torch
    keeps on the CPU.
    """
    shape, dtype = ck.shape(key), ck.dtype(key)
    if len(shape) > 0 and shape == global_shape(where):
        if isinstance(where, Shard):
            fresh = [torch.empty_like(p.tensor, dtype=dtype) for p in where.pieces]
            return where.like(fresh)
        return torch.empty(where.shape, dtype=dtype, device=where.device)
    if len(shape) == 0:
        return torch.empty(shape, dtype=dtype)
    device = where.pieces[0].tensor.device if isinstance(where, Shard) else where.device
    return torch.empty(shape, dtype=dtype, device=device)


class _Reader:
    """Stands for a shard file: byte ranges out of chunks held in memory."""

    def __init__(self, chunks: dict[str, torch.Tensor]) -> None:
        self.chunks = chunks

    def read_range(self, file_key: str, offset: int, dst: Any, verify: bool) -> None:
        if not len(dst):
            return
        src = self.chunks[file_key].reshape(-1).view(torch.uint8).numpy()
        dst[:] = src[offset : offset + len(dst)]


class InMemoryCheckpoint(Checkpoint):
    """A checkpoint whose chunks are tensors in memory instead of shard files.

    ``index`` has a file index's ``tensors`` (each chunk's ``file_key`` names a tensor in
    ``have``), ``aliases`` and ``optimizer``; fill ``have`` with the chunks the planned reads
    need (``chunks_for``), then ``read_many`` as from files. ``label`` names it in errors.
    """

    def __init__(self, index: dict[str, Any], label: str) -> None:  # no super(): no files
        self.path = Path(label)
        self.index = index
        self.tensors = index["tensors"]
        self.aliases = index.get("aliases", {})
        self.have: dict[str, torch.Tensor] = {}
        self._closed = False

    def reader(self, file: str) -> Any:
        """Reads byte ranges of the chunks in ``have`` (every chunk is one "file")."""
        return _Reader(self.have)

    def close(self) -> None:
        """Drops the chunks."""
        self.have.clear()


def _span(
    where: int | tuple[int, ...], out: torch.Tensor, shape: tuple[int, ...]
) -> tuple[int, int]:
    """The flat range ``[lo, hi)`` a read covers (a block's: from its first to its last)."""
    if isinstance(where, tuple):
        if out.numel() == 0:
            return 0, 0
        last = tuple(o + n - 1 for o, n in zip(where, out.shape, strict=True))
        return flat_index(shape, where), flat_index(shape, last) + 1
    return where, where + out.numel()


def _covers(covered: list[tuple[int, int]], a: int, b: int) -> bool:
    """Whether the union of ``covered`` holds ``[a, b)``."""
    at = a
    for x, y in sorted(covered):
        if x > at:
            break
        at = max(at, y)
    return at >= b


def _choose(chunks: list[dict[str, Any]], lo: int, hi: int, me: int) -> list[dict[str, Any]]:
    """The chunks that give ``[lo, hi)``: this rank's first, one copy of each range.

    A block's chunks are all taken (their flat spans overlap without covering each other).
    """
    near = sorted((c for c in chunks if c["end"] > lo and c["start"] < hi),
                  key=lambda c: (c["holder"] != me, c["holder"]))  # fmt: skip
    picked: list[dict[str, Any]] = []
    seen: set[tuple[Any, ...]] = set()
    covered: list[tuple[int, int]] = []
    for c in near:
        box = c.get("box")
        sig = (c["start"], c["end"], tuple(box["offsets"]) if box else ())
        if sig in seen:
            continue
        if box is None:
            a, b = max(lo, c["start"]), min(hi, c["end"])
            if _covers(covered, a, b):
                continue
            covered.append((a, b))
        seen.add(sig)
        picked.append(c)
    return picked


def chunks_for(
    entry: dict[str, Any], out: torch.Tensor, where: int | tuple[int, ...], me: int
) -> list[dict[str, Any]]:
    """The chunks of index ``entry`` that one read (``out`` at ``where``) needs.

    This rank's own chunks first (``holder == me``), one copy of each range.
    """
    lo, hi = _span(where, out, tuple(entry["shape"]))
    return _choose(entry["chunks"], lo, hi, me)
