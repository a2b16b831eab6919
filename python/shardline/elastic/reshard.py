"""Committed state of one layout, loaded into another: the in-memory side of a reshard.

After a membership change the ranks of the new group hold, between them, the commit of every
rank of the old one (their own, or the copy they hold for their buddy). ``load`` puts it into
the new layout through the same checks and reads as ``sl.checkpoint.load``: the commits are
described as an in-memory checkpoint (``checkpoint.reshard.InMemoryCheckpoint``: chunks
instead of shard files),
each rank plans its reads from the strategy contract (``checkpoint.reshard``), asks for
the chunks its reads overlap (its own first, so a rank whose shard did not move receives
nothing), and the holders send them point to point, one at a time in one global order (no
rank waits on another that waits on it). Nothing here knows a strategy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardline import dtypes
from shardline.checkpoint.pieces import Piece, jsonable_groups, pieces_of
from shardline.checkpoint.reshard import (
    InMemoryCheckpoint,
    Read,
    chunks_for,
    plan_model,
    plan_optimizer,
)
from shardline.comm.group import ProcessGroup
from shardline.comm.objects import all_gather_object
from shardline.parallel.contract import Local

__all__ = ["Commit", "describe", "load"]


@dataclass
class Commit:
    """One old rank's commit, with host tensors: ``model``/``optimizer`` as the contract gives."""

    old_rank: int
    model: dict[str, Any] | None
    optimizer: dict[str, Any] | None


def _pieces(commit: Commit) -> tuple[list[Piece], dict[str, str], dict[str, Any]]:
    """Its pieces, aliases (tied tensors) and the optimizer's JSON part."""
    pieces: list[Piece] = []
    aliases: dict[str, str] = {}
    first: dict[int, str] = {}
    for name, value in (commit.model or {}).items():
        key = f"model/{name}"
        if isinstance(value, Local):
            continue  # a Local is dropped when the layout changes
        if id(value) in first:
            aliases[key] = first[id(value)]
            continue
        first[id(value)] = key
        pieces += pieces_of(key, value, commit.old_rank) or []
    optim: dict[str, Any] = {}
    if commit.optimizer is not None:
        values: dict[str, dict[str, Any]] = {}
        for name, entries in sorted(commit.optimizer["state"].items()):
            for k, v in entries.items():
                if isinstance(v, Local):
                    continue
                more = pieces_of(f"optim/{name}/{k}", v, commit.old_rank)
                if more is None:
                    values.setdefault(name, {})[k] = v
                else:
                    pieces += more
        optim = {"param_groups": jsonable_groups(commit.optimizer["param_groups"]),
                 "values": values}  # fmt: skip
    return pieces, aliases, optim


def describe(commits: Iterable[Commit]) -> tuple[list[dict[str, Any]], Any]:
    """What this rank can give: one entry per piece (no data), and the pieces themselves."""
    entries: list[dict[str, Any]] = []
    data: list[torch.Tensor] = []
    extra: dict[str, Any] = {"aliases": {}, "optimizer": None}
    for commit in commits:
        pieces, aliases, optim = _pieces(commit)
        extra["aliases"].update(aliases)
        extra["optimizer"] = _merge(extra["optimizer"], optim)
        for p in pieces:
            entries.append({
                "key": p.key, "shape": list(p.shape), "dtype": dtypes.FILE_DTYPES[p.tensor.dtype],
                "start": p.start, "end": p.end, "box": list(p.box) if p.box is not None else None,
                "bshape": list(p.tensor.shape), "index": len(data),
            })  # fmt: skip
            data.append(p.tensor.contiguous())
    return [{"entries": entries, **extra}], data


def _merge(into: dict[str, Any] | None, more: dict[str, Any] | None) -> dict[str, Any] | None:
    """Optimizer JSON parts of several ranks as one: param groups, and every rank's values.

    Non-tensor per-parameter values (a ZeRO rank's, for the parameters it owns) are only in
    their owner's commit, as ``checkpoint.save`` merges them from every rank.
    """
    if not more:
        return into
    if not into:
        return {"param_groups": more["param_groups"], "values": dict(more["values"])}
    for name, entries in more["values"].items():
        into["values"].setdefault(name, {}).update(entries)
    return into


def load(
    group: ProcessGroup,
    mine: list[Commit],
    model: nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
) -> None:
    """Loads the old group's commits, spread over ``group``'s ranks, into the new layout.

    Collective over ``group``. ``mine``: the commits this rank holds (its own, its buddy's).
    """
    described, data = describe(mine)
    views = all_gather_object(described[0], group)
    tensors: dict[str, dict[str, Any]] = {}
    aliases: dict[str, str] = {}
    optim = None
    for holder, view in enumerate(views):
        aliases.update(view["aliases"])
        optim = _merge(optim, view["optimizer"])
        for e in view["entries"]:
            entry = tensors.setdefault(e["key"], {"shape": e["shape"], "dtype": e["dtype"],
                                                  "chunks": []})  # fmt: skip
            chunk = {"start": e["start"], "end": e["end"], "holder": holder, "file": "memory",
                     "file_key": f"{holder}/{e['index']}"}  # fmt: skip
            if e["box"] is not None:
                chunk["box"] = {"offsets": e["box"], "shape": e["bshape"]}
            entry["chunks"].append(chunk)
    index = {"tensors": tensors, "aliases": aliases, "optimizer": optim}
    ck = InMemoryCheckpoint(index, f"the commits of the previous generation (rank {group.rank})")
    reads: list[Read] = []
    finish = []
    if model is not None:
        more, apply = plan_model(ck, model, True, group.rank, False)
        reads += more
        finish.append(apply)
    if optimizer is not None and model is not None:
        optimizer.state.clear()
        more, apply = plan_optimizer(ck, model, optimizer, True, group.rank)
        reads += more
        finish.append(apply)
    wanted: dict[str, dict[str, Any]] = {}  # file_key -> chunk
    chosen: dict[str, list[dict[str, Any]]] = {}
    for key, out, where in reads:
        stored = ck.resolve(key)
        entry = tensors[stored]
        for c in chunks_for(entry, out, where, group.rank):
            wanted[c["file_key"]] = c
            chosen.setdefault(stored, []).append(c)
    for stored, picked in chosen.items():
        unique = {c["file_key"]: c for c in picked}
        tensors[stored]["chunks"] = sorted(unique.values(), key=lambda c: (c["start"], c["end"]))
    for stored, entry in tensors.items():
        if stored not in chosen:
            entry["chunks"] = []
    _transfer(group, views, data, sorted(wanted), ck.have)
    with torch.no_grad():
        ck.read_many(reads, verify=False)
    for f in finish:
        f()
    ck.close()


def _transfer(
    group: ProcessGroup,
    views: list[dict[str, Any]],
    data: list[torch.Tensor],
    wanted: list[str],
    have: dict[str, torch.Tensor],
) -> None:
    """Every rank gets the chunks it asked for; holders send them in one global order."""
    asks = all_gather_object(wanted, group)
    me = group.rank
    order = sorted({k for ask in asks for k in ask}, key=lambda k: tuple(map(int, k.split("/"))))
    for file_key in order:
        holder, i = map(int, file_key.split("/"))
        askers = [r for r, ask in enumerate(asks) if file_key in ask and r != holder]
        if holder == me:
            t = data[i]
            if file_key in asks[me]:
                have[file_key] = t
            on = t.to(group.device) if t.device != group.device else t
            for r in askers:
                if on.numel():
                    group.send(on.reshape(-1), r)
        elif me in askers:
            e = next(e for e in views[holder]["entries"] if e["index"] == i)
            shape = tuple(e["bshape"])
            buf = torch.empty(math.prod(shape), dtype=dtypes.from_file_name(e["dtype"]),
                              device=group.device)  # fmt: skip
            if buf.numel():
                group.recv(buf, holder)
            have[file_key] = buf.cpu().reshape(shape)
