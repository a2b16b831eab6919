"""Gradient compression with error feedback: the interface every compressor implements.

A compressor reduces one flat gradient buffer (a DDP bucket, a ZeRO unit) across a group with
fewer bytes on the wire than the dense reduction, and keeps what it could not send
(*error feedback*): the part of this step's gradient that compression dropped is added to the
next step's, so nothing is lost, only delayed. Over any number of steps, the sum of the
updates applied equals the sum of the true (averaged) gradients minus the residuals still
held, which stay bounded.

Wrappers call ``reduce(group, flat, key=, layout=, out=)``. ``flat`` holds this rank's
gradient already divided by the world size, so the sum across ranks is the average:

- ``out=None``: all-reduce; ``flat`` holds the (approximate) average when ``finish()``
  returns. DDP buckets and ZeRO-1 use this.
- ``out`` given (``flat.numel() == world_size * out.numel()``): reduce-scatter; ``out`` gets
  this rank's slice of the average. ZeRO-2/3 use this; a compressor sends only what this
  needs, never a dense all-reduce.

Every rank must make the same calls in the same order (they are collectives). The first
``warmup_steps`` steps, and the first steps after the group's size changes, are reduced
uncompressed (so error feedback, PowerSGD's warm start and a frozen variance start from
sensible values); ``advance()`` (called by the wrapper once per synchronised backward) counts
steps.

State (residuals, PowerSGD's ``Q``) is per rank by design: wrappers put it in checkpoints as
``Local`` values under ``_compression/<field>/<parameter name>``, loaded back only into the
same layout; anything else starts from zero after a short uncompressed warm-up.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shardline.errors import InvalidArgumentError

if TYPE_CHECKING:
    from shardline.comm.group import ProcessGroup

__all__ = ["Compressor", "Entry", "plain"]

Finish = Callable[[], None]


@dataclass(frozen=True)
class Entry:
    """One tensor inside a flat buffer: its name, where it starts, its shape."""

    name: str
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Its number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n


Entries = tuple[Entry, ...]
"""The tensors of one bucket, in order: where each lies in the flat buffer."""


@dataclass
class _Buffers:
    """One key's state: its layout and named flat buffers (residuals)."""

    layout: Entries
    numel: int
    flats: dict[str, torch.Tensor]


class Compressor:
    """Base class: warm-up, world-size changes, residual storage, checkpoint state.

    Subclasses implement ``_reduce`` (and may override ``memory_bytes``).

    Args:
        warmup_steps: Steps reduced uncompressed first (and again after the group's size
            changes).
        error_feedback: Keep what compression dropped and add it to the next step's gradient.
    """

    name = "compressor"

    def __init__(self, *, warmup_steps: int = 2, error_feedback: bool = True) -> None:
        if warmup_steps < 0:
            raise InvalidArgumentError(
                f"{self.name}: warmup_steps must be >= 0, not {warmup_steps}"
            )
        self.warmup_steps = int(warmup_steps)
        self.error_feedback = bool(error_feedback)
        self.steps = 0
        self._world: int | None = None
        self._keys: dict[Hashable, _Buffers] = {}
        # Where each parameter's slice of the buffers lives now: name -> (buffers, entry).
        self._where: dict[str, tuple[_Buffers, Entry]] = {}
        # Loaded values waiting for their parameter's first use: field -> name -> tensor.
        self._pending: dict[str, dict[str, torch.Tensor]] = {}
        self._per_name: dict[str, dict[str, torch.Tensor]] = {}  # e.g. PowerSGD's Q

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # -- what wrappers call --------------------------------------------------------------------

    def reduce(
        self,
        group: ProcessGroup,
        flat: torch.Tensor,
        *,
        key: Hashable,
        layout: Sequence[Entry],
        out: torch.Tensor | None = None,
    ) -> Finish:
        """Starts reducing ``flat`` (see the module docstring); returns ``finish``.

        Args:
            group: The ranks to reduce over.
            flat: This rank's gradient, divided by the world size; 1-D, contiguous.
            key: Names the buffer across steps (residuals are kept per key).
            layout: The tensors packed in ``flat`` (names, offsets, shapes); parts of ``flat``
                outside every entry (padding) are reduced too.
            out: ``None`` for an all-reduce into ``flat``; this rank's slice for a
                reduce-scatter.
        """
        if out is not None and flat.numel() != group.world_size * out.numel():
            raise InvalidArgumentError(
                f"{self.name}.reduce on rank {group.rank}: a reduce-scatter needs world_size "
                f"{group.world_size} x out's {out.numel()} elements, got {flat.numel()}"
            )
        if self._world != group.world_size:
            if self._world is not None:
                self.reset()  # residuals of another layout mean nothing here
            self._world = group.world_size
        if self.steps < self.warmup_steps or flat.numel() == 0:
            return plain(group, flat, out)
        return self._reduce(group, flat, key, tuple(layout), out)

    def advance(self) -> None:
        """One synchronised backward is done (counts warm-up steps)."""
        self.steps += 1

    def reset(self) -> None:
        """Drops every residual and starts the warm-up again (the layout changed)."""
        self.steps = 0
        self._keys.clear()
        self._where.clear()
        self._pending.clear()
        self._per_name.clear()

    def memory_bytes(self, numel: int, world_size: int, *, sharded: bool) -> int:
        """Extra bytes per rank this compressor keeps for ``numel`` gradient elements.

        ``sharded``: the gradient is reduce-scattered (ZeRO-2/3): a residual still covers
        the whole unpadded gradient this rank computed, not only its shard.
        """
        del world_size, sharded
        return 4 * numel if self.error_feedback else 0

    def held(self, key: Hashable, numel: int) -> torch.Tensor:
        """What this rank holds back of buffer ``key`` (``numel`` values), in its layout.

        Summed over ranks and added to the updates applied so far, it gives the sum of the
        true averaged gradients: the error-feedback invariant (tests check it).
        """
        state = self._keys.get(key)
        if state is not None and "residual" in state.flats:
            return state.flats["residual"].clone()
        return torch.zeros(numel, dtype=torch.float32)

    def prepare(
        self, key: Hashable, layout: Sequence[Entry], numel: int, device: torch.device
    ) -> None:
        """Allocates ``key``'s state now (before a checkpoint is loaded into it)."""
        if self.error_feedback:
            self._buffer(key, "residual", numel, tuple(layout), device)

    # -- what subclasses implement -------------------------------------------------------------

    def _reduce(
        self,
        group: ProcessGroup,
        flat: torch.Tensor,
        key: Hashable,
        layout: Entries,
        out: torch.Tensor | None,
    ) -> Finish:
        raise NotImplementedError

    # -- residual storage ----------------------------------------------------------------------

    def _plus_residual(
        self, flat: torch.Tensor, key: Hashable, layout: Entries
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A float32 copy of ``flat`` with ``key``'s residual added, and the residual."""
        p = flat.float() if flat.dtype != torch.float32 else flat.clone()
        if not self.error_feedback:
            return p, None
        res = self._buffer(key, "residual", flat.numel(), layout, flat.device)
        return p.add_(res), res

    def _buffer(
        self, key: Hashable, field: str, numel: int, layout: Entries, device: torch.device
    ) -> torch.Tensor:
        """The float32 buffer ``field`` of ``key``, zero at first.

        A key whose layout changed (DDP rebuilds its buckets after the first step) gets a new
        buffer, filled parameter by parameter from wherever each one's values were, or from
        a loaded checkpoint.
        """
        state = self._keys.get(key)
        if state is None or state.layout != layout or state.numel != numel:
            state = _Buffers(layout, numel, {})
            self._keys[key] = state  # the old one stays reachable through ``_where``
        buf = state.flats.get(field)
        if buf is not None:
            return buf
        buf = torch.zeros(numel, dtype=torch.float32, device=device)
        for e in layout:
            view = buf[e.offset : e.offset + e.numel]
            loaded = self._pending.get(field, {}).pop(e.name, None)
            if loaded is not None and loaded.numel() == e.numel:
                view.copy_(loaded.reshape(-1))
                continue
            old = self._where.get(e.name)
            if old is not None and old[0] is not state and field in old[0].flats:
                o = old[1]
                view.copy_(old[0].flats[field][o.offset : o.offset + o.numel])
        state.flats[field] = buf
        for e in layout:
            self._where[e.name] = (state, e)
        live = {id(st) for st, _ in self._where.values()}
        for k in [k for k, st in self._keys.items() if id(st) not in live]:
            del self._keys[k]  # a layout no parameter is in any more
        return buf

    # -- checkpoint state ----------------------------------------------------------------------

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's state as ``{"<field>/<parameter name>": tensor}`` (views, in place).

        Loading writes into these views; ``load_state_tensors`` takes values for parameters
        whose buffers do not exist yet.
        """
        out: dict[str, torch.Tensor] = {}
        for name, (state, e) in sorted(self._where.items(), key=lambda kv: kv[0]):
            for field, buf in state.flats.items():
                out[f"{field}/{name}"] = buf[e.offset : e.offset + e.numel].view(e.shape)
        for field, tensors in self._per_name.items():
            for name, t in tensors.items():
                out[f"{field}/{name}"] = t
        out["steps"] = torch.tensor([self.steps], dtype=torch.int64)
        return out

    def load_state_tensors(self, values: dict[str, torch.Tensor]) -> None:
        """Takes ``state_tensors()``'s values back (same layout; the checkpointer checks)."""
        mine = self.state_tensors()
        for k, v in values.items():
            if k == "steps":
                self.steps = int(v.reshape(-1)[0])
                continue
            field, _, name = k.partition("/")
            dst = mine.get(k)
            if dst is not None:
                if dst.data_ptr() != v.data_ptr():
                    dst.copy_(v.reshape(dst.shape))
            else:
                self._pending.setdefault(field, {})[name] = v.detach().clone()


def plain(group: ProcessGroup, flat: torch.Tensor, out: torch.Tensor | None) -> Finish:
    """The dense reduction: all-reduce into ``flat``, or reduce-scatter into ``out``."""
    if out is None:
        work = group.all_reduce(flat, "sum", async_op=True)
    elif out.dtype == flat.dtype:
        work = group.reduce_scatter(out, flat, "sum", async_op=True)
    else:
        tmp = torch.empty(out.numel(), dtype=flat.dtype, device=flat.device)
        w = group.reduce_scatter(tmp, flat, "sum", async_op=True)
        assert w is not None

        def finish() -> None:
            w.wait()
            out.copy_(tmp)

        return finish
    assert work is not None
    return work.wait
