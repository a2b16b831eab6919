"""One sharding unit: its parameters laid out in a flat buffer, and this rank's shard of it.

Layout of a unit of ``numel`` elements on ``N`` ranks: the parameters are concatenated in a
flat buffer padded to ``N * S`` elements, ``S = ceil(numel / N)``. Rank ``r`` owns elements
``[r*S, (r+1)*S)``: its *shard* (in the master dtype, what the optimizer steps). Each original
parameter that overlaps the shard gets a 1-D *local* ``nn.Parameter`` viewing its part of the
shard (possibly empty), named like the original; optimizers step those.

A *whole* unit (``owner`` set: parameters of an optimizer that looks at whole parameters) is
not split: rank ``owner`` holds all of it, unpadded, and its locals have the parameters'
shapes; the other ranks hold nothing (empty 1-D locals that never get a gradient). It is
gathered by a broadcast from the owner and its gradients are reduced to the owner, at every
stage, each backward: only the owner keeps them. (So a ``zero_grad()`` between a ``no_sync``
backward and the next synchronised one is seen by the owner alone; the others still add what
they accumulated.)

With *offload* (``"optimizer"`` or ``"cpu"``) the shard lives in host memory (pinned under
CUDA, in blocks of its exact size: ``shardline._pinned``), so the optimizer and its state run
there; reduced gradient parts are copied to the host as each unit's reduction finishes.
``"optimizer"`` keeps a device copy of the shard in the compute dtype for the all-gathers
(``dev_shard``, refreshed after each optimizer step); ``"cpu"`` keeps none and copies the shard
to the device for each all-gather.

Under CUDA the copies between host and device run on side streams (``copy_stream``): the
gradients' copies to the host as each reduction finishes, and ``"cpu"``'s copies of the shards
to the device with the all-gathers they feed, so the compute stream never waits on the bus.

``full`` (compute dtype) holds the gathered parameters; the module's own parameters are views
into it. For ZeRO-3 its storage is released (``resize_(0)``) between uses and re-allocated
before the next all-gather, so the views (and tensors autograd saved) stay valid objects.

On CPU, where the group has symmetric memory (``shardline.comm.symmetric``), the buffers that
live as long as the unit move to the wrapper's arenas (``rehome``) before the layout's first
collective, so that their collectives read every rank's data where it is: ``full`` at stages 1
and 2 (the all-gather's output), the shard at stage 3 when it is in the compute dtype (the
all-gather's input; under mixed precision the input is a cast made per gather, which stays an
ordinary tensor), and ``grad_home`` (where ``grad_full`` lives) at stage 1 (the all-reduce's
buffer). ZeRO-2 and 3 gradient buffers, made and dropped every backward, come
from a pool in symmetric memory while it has room when the wrapper asks for one (``grad_pool``;
a reduce-scatter reads each rank's input where that rank put it, so the ranks need not agree
on where), else they are ordinary tensors.
"""

from __future__ import annotations

import enum
import math
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from shardline._pinned import pinned_empty
from shardline.comm.symmetric import SymmetricArena, SymmetricPool
from shardline.comm.work import Work
from shardline.compression.codec import Entry

__all__ = ["GradState", "ParamState", "Unit", "copy_stream"]

_COPY_STREAMS: dict[tuple[int | None, str], torch.cuda.Stream] = {}


def copy_stream(device: torch.device, direction: str) -> torch.cuda.Stream:
    """The side stream of this process for offload's copies in ``direction`` on ``device``.

    ``"to_host"`` and ``"to_device"`` are separate streams, so the two directions (separate
    copy engines) overlap each other as well as the compute.
    """
    key = (device.index, direction)
    stream = _COPY_STREAMS.get(key)
    if stream is None:
        stream = _COPY_STREAMS[key] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    return stream


class ParamState(enum.Enum):
    """Where a unit's parameters are (as FSDP2's ``ShardedState``, with the gather in flight)."""

    SHARDED = "sharded"  # only the shards: ``full`` is freed (stage 3) or not yet gathered
    GATHERING = "gathering"  # an all-gather into ``full`` is in flight (``gather_work``)
    GATHERED = "gathered"  # ``full`` holds every parameter


class GradState(enum.Enum):
    """Where a unit's gradients are in a backward."""

    IDLE = "idle"  # none yet in this backward
    ACCUMULATING = "accumulating"  # some arrived: held, or added into ``grad_full``
    REDUCING = "reducing"  # its reduction was launched: no more may arrive
    PUBLISHED = "published"  # shown to the optimizer as the locals' ``.grad`` (after backward)


@dataclass
class Unit:
    """A unit's buffers and bookkeeping (see the module docstring)."""

    index: int
    names: list[str]
    params: list[nn.Parameter]
    world_size: int
    rank: int
    cdtype: torch.dtype  # compute: gathered parameters
    wdtype: torch.dtype  # master: shard and optimizer
    rdtype: torch.dtype  # reduce: gradients on the wire
    modules: list[str] = field(default_factory=list)
    owner: int | None = None  # a whole unit's rank (see the module docstring)
    offload: str | None = None  # "optimizer" or "cpu": the shard in host memory
    # layout
    offsets: list[int] = field(default_factory=list)
    numel: int = 0
    shard_numel: int = 0
    # buffers
    full: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    shard: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    locals: list[nn.Parameter] = field(default_factory=list)
    local_ranges: list[tuple[int, int]] = field(default_factory=list)  # in the param's numel
    shard_grad: torch.Tensor | None = None
    dev_shard: torch.Tensor | None = None  # offload="optimizer": the shard on the device
    host_grad: torch.Tensor | None = None  # offload: the pinned buffer shard_grad reuses
    grad_full: torch.Tensor | None = None
    grad_home: torch.Tensor | None = None  # stage 1 in symmetric memory: grad_full's place
    grad_pool: SymmetricPool | None = None  # stages 2, 3: where grad_full comes from, if room
    grad_filled: list[bool] = field(default_factory=list)
    held_grads: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # not yet in grad_full
    # state
    param_state: ParamState = ParamState.GATHERED  # built with the values in ``full``
    grad_state: GradState = GradState.IDLE
    gather_work: Work | None = None
    gather_input: torch.Tensor | None = None
    shard_is_view: bool = False
    trainable: bool = True
    active: int = 0
    uses_left: int = 0
    expected_uses: int = 0
    uses_seen: int = 0
    grads_pending: int = 0
    shown_base: weakref.ref[torch.Tensor] | None = None  # what .grad views (not kept alive)
    grad_version: int = 0
    fwd_uses: int = 0  # module calls since the last backward
    packed: int = 0  # tensors saved for backward by its modules (stage 3)
    unpacked: int = 0  # ... and used by backward so far

    # -- layout ------------------------------------------------------------------------------

    def lay_out(self) -> None:
        """Places the parameters in the flat buffer (offsets, sizes); allocates nothing."""
        off = 0
        self.offsets = []
        for p in self.params:
            self.offsets.append(off)
            off += p.numel()
        self.numel = off
        if self.owner is None:
            self.shard_numel = max(1, math.ceil(off / self.world_size))
        else:
            self.shard_numel = off if self.rank == self.owner else 0

    def symmetric_sizes(self, stage: int) -> tuple[list[tuple[int, torch.dtype]], ...]:
        """``(gather, reduce)``: what ``rehome`` takes from each arena at ``stage``, in order.

        After ``lay_out``. The same on every rank: whole and offloaded units take none.
        """
        if self.owner is not None or self.offload is not None:
            return [], []
        if stage < 3:
            gather = [(self.padded, self.cdtype)]  # full
        elif self.cdtype == self.wdtype:
            gather = [(self.shard_numel, self.wdtype)]  # the shard: the all-gather's input
        else:  # its compute-dtype copy is the input: kept, it would cost memory between steps
            gather = []
        return gather, [(self.padded, self.rdtype)] if stage == 1 else []

    def build(self, device: torch.device, shard_is_view: bool) -> None:
        """Lays the parameters out, copies their values in, and makes the local views.

        The parameters' ``.data`` become views of ``full``; nothing is communicated here.
        """
        self.lay_out()
        lo, hi = self.lo, self.hi
        self.full = torch.zeros(self.padded, dtype=self.cdtype, device=device)
        shard_is_view = shard_is_view and self.offload is None
        self.shard_is_view = shard_is_view
        if not shard_is_view:  # the master copy comes from the original values, not the cast
            if self.offload is not None and device.type == "cuda":
                self.shard = pinned_empty(self.shard_numel, dtype=self.wdtype)
            else:
                self.shard = torch.zeros(
                    self.shard_numel, dtype=self.wdtype, device="cpu" if self.offload else device
                )
        self.dev_shard = None
        with torch.no_grad():
            for p, o in zip(self.params, self.offsets, strict=True):
                flat = p.detach().reshape(-1)
                self.full[o : o + p.numel()].copy_(flat)
                a, b = max(o, lo), min(o + p.numel(), hi)
                if b > a and not shard_is_view:
                    self.shard[a - lo : b - lo].copy_(flat[a - o : b - o])
        self._point_params()
        if shard_is_view:
            self.shard = self.full[lo:hi]
        self.trainable = any(p.requires_grad for p in self.params)
        self._make_locals()

    def _point_params(self) -> None:
        for p, o in zip(self.params, self.offsets, strict=True):
            p.data = self.full[o : o + p.numel()].view(p.shape)

    def _make_locals(self) -> None:
        views = self._local_views()
        self.locals = [
            nn.Parameter(view, requires_grad=p.requires_grad)
            for (view, _), p in zip(views, self.params, strict=True)
        ]
        self.local_ranges = [r for _, r in views]

    def _local_views(self) -> list[tuple[torch.Tensor, tuple[int, int]]]:
        """Each parameter's view of the shard, and its range within the parameter."""
        lo, hi = self.lo, self.hi
        out = []
        for p, o in zip(self.params, self.offsets, strict=True):
            a, b = max(o, lo), min(o + p.numel(), hi)
            if b < a:
                a = b = min(max(o, lo), hi)
            view = self.shard[a - lo : b - lo]
            if self.owner is not None and b > a:  # a whole parameter keeps its shape
                view = view.view(p.shape)
            out.append((view, (a - o, b - o) if b > a else (0, 0)))
        return out

    @torch.no_grad()
    def rehome(self, stage: int, arenas: tuple[SymmetricArena, SymmetricArena]) -> None:
        """Moves what ``symmetric_sizes`` names into the arenas, values and views kept.

        The parameters, the local parameters (an optimizer holds them) and shown gradients
        keep their objects and values; only their memory moves. Runs before the layout's
        first collective, so nothing is in flight.
        """
        gather, reduce = self.symmetric_sizes(stage)
        if gather and stage < 3:
            full = arenas[0].take(self.padded, self.cdtype)
            full.copy_(self.full)
            self.full = full
            self._point_params()
            if self.shard_is_view:
                self.shard = full[self.lo : self.hi]
                self._repoint_locals()
        elif gather:
            shard = arenas[0].take(self.shard_numel, self.wdtype)
            shard.copy_(self.shard)
            self.shard = shard
            self._repoint_locals()
        if not reduce:
            return
        home = arenas[1].take(self.padded, self.rdtype)
        self.grad_home = home
        old = self.grad_full
        if old is None:
            return  # the next backward's window opens there
        home.copy_(old)
        self.grad_full = home
        sg = self.shard_grad
        if sg is not None and sg.untyped_storage().data_ptr() == old.untyped_storage().data_ptr():
            self.shard_grad = home[self.lo : self.hi]
        if self.grad_state is GradState.PUBLISHED and self.locals_have_grads():
            self.publish_grads()

    def _repoint_locals(self) -> None:
        for loc, (view, _) in zip(self.locals, self._local_views(), strict=True):
            loc.data = view

    def entries(self) -> list[Entry]:
        """Each parameter's name, offset and shape in the flat gradient (for compressors)."""
        return [
            Entry(name, off, tuple(p.shape))
            for name, off, p in zip(self.names, self.offsets, self.params, strict=True)
        ]

    @property
    def grad_itemsize(self) -> int:
        """Bytes of one element of the gradient buffer (the reduction dtype)."""
        return torch.empty((), dtype=self.rdtype).element_size()

    @property
    def padded(self) -> int:
        """Elements of the full flat buffer (``world_size * shard_numel``; a whole unit's own)."""
        if self.owner is not None:
            return max(1, self.numel)
        return self.world_size * self.shard_numel

    @property
    def lo(self) -> int:
        """Where this rank's shard starts in the full flat buffer."""
        if self.owner is not None:
            return 0 if self.rank == self.owner else self.numel
        return self.rank * self.shard_numel

    @property
    def hi(self) -> int:
        """One past where this rank's shard ends in the full flat buffer."""
        return self.lo + self.shard_numel

    # -- gathered parameters -----------------------------------------------------------------

    def free(self) -> None:
        """Releases the gathered parameters' memory (views stay valid objects)."""
        if self.param_state is ParamState.GATHERED and self.full.untyped_storage().nbytes() > 0:
            self.full.untyped_storage().resize_(0)
        self.param_state = ParamState.SHARDED
        self.gather_work = None
        self.gather_input = None

    def alloc(self) -> None:
        """Re-allocates the gathered parameters' memory (contents undefined)."""
        need = self.padded * self.full.element_size()
        if self.full.untyped_storage().nbytes() < need:
            self.full.untyped_storage().resize_(need)

    def gather_source(self) -> torch.Tensor:
        """This rank's shard in the compute dtype (the all-gather's input).

        A whole unit is broadcast in place: the owner's values are put into ``full`` (already
        there when the shard is a view of it) and ``full`` itself is returned.
        """
        if self.owner is not None:
            if self.rank == self.owner and not self.shard_is_view:
                self.full[: self.numel].copy_(self.shard)
            return self.full
        if self.shard_is_view:
            return self.shard.clone()  # the input may not alias the output's own slice
        if self.offload is not None:
            if self.dev_shard is None:
                # Asynchronous from pinned memory: the CPU goes on queueing kernels (the
                # optimizer, which writes the shard, runs only after a synchronisation).
                on_device = self.shard.to(
                    device=self.full.device, dtype=self.cdtype, non_blocking=True
                )
                if self.offload == "cpu":
                    return on_device
                self.dev_shard = on_device
            return self.dev_shard
        if self.shard.dtype == self.cdtype:
            return self.shard
        return self.shard.to(self.cdtype)

    def keep_on_host(self, part: torch.Tensor, *, fresh: bool) -> None:
        """Offload: ``part`` (this rank's reduced gradient) into the host-side ``shard_grad``.

        It replaces or adds to what ``shard_grad`` holds. Under CUDA a replacing copy into
        pinned memory runs on the ``"to_host"`` side stream, after what the current stream has
        queued (the reduction); the caller synchronises the device before the optimizer reads.
        """
        held = self.shard_grad
        if fresh or held is None:
            # The pinned buffer outlives zero_grad() (pinning is slow); shard_grad is None
            # between a zero_grad() and the next reduction, as without offload.
            buf = self.host_grad
            if buf is None or buf.numel() != part.numel():
                buf = self.host_grad = (
                    pinned_empty(part.numel(), dtype=self.wdtype)
                    if part.device.type == "cuda"
                    else torch.empty(part.numel(), dtype=self.wdtype)
                )
            if part.is_cuda:
                side = copy_stream(part.device, "to_host")
                side.wait_stream(torch.cuda.current_stream(part.device))
                with torch.cuda.stream(side):
                    buf.copy_(part.reshape(-1), non_blocking=True)
                part.record_stream(side)  # the caller drops it before the copy is done
            else:
                buf.copy_(part.reshape(-1))
            self.shard_grad = buf
        else:
            if part.is_cuda:  # a copy into what is added to may still be in flight
                copy_stream(part.device, "to_host").synchronize()
            held.add_(part.reshape(-1).to(device="cpu", dtype=self.wdtype))

    # -- gradients ---------------------------------------------------------------------------

    def new_grad_window(self) -> None:
        """Makes ``grad_full`` hold every gradient of this backward so far (allocating it)."""
        if self.grad_full is None:
            buf = self.grad_home
            if buf is None and self.grad_pool is not None:
                buf = self.grad_pool.take(self.padded, self.rdtype)  # None when it is full
            if buf is None:
                buf = torch.empty(self.padded, dtype=self.rdtype, device=self.full.device)
            self.grad_full = buf
            self.grad_filled = [False] * len(self.params)
        while self.held_grads:
            i, grad = self.held_grads.pop(0)
            self._accumulate(i, grad)
            del grad  # freed here, one at a time

    def add_grad(self, i: int, grad: torch.Tensor, *, last: bool) -> None:
        """Adds parameter ``i``'s gradient into the unit's flat gradient buffer.

        Until the unit's ``last`` gradient the buffer is not allocated: autograd's gradients
        are held as they are (what a plain backward holds), so the full-size buffer lives only
        from the unit's last gradient to its reduction (as FSDP2's reduce-scatter input).
        """
        if self.grad_full is None and not last:
            self.held_grads.append((i, grad))
            return
        self.new_grad_window()
        self._accumulate(i, grad)

    def _accumulate(self, i: int, grad: torch.Tensor) -> None:
        assert self.grad_full is not None
        o, n = self.offsets[i], self.params[i].numel()
        dst = self.grad_full[o : o + n].view(grad.shape)
        if self.grad_filled[i]:
            dst.add_(grad)
        else:
            dst.copy_(grad)
            self.grad_filled[i] = True

    def fill_missing(self) -> None:
        """Zeros the parts of ``grad_full`` no gradient arrived for (and the padding)."""
        self.new_grad_window()
        assert self.grad_full is not None
        for i, p in enumerate(self.params):
            if not self.grad_filled[i]:
                o = self.offsets[i]
                self.grad_full[o : o + p.numel()].zero_()
                self.grad_filled[i] = True
        self.grad_full[self.numel :].zero_()

    def publish_grads(self) -> None:
        """Points each trainable local parameter's ``.grad`` at its part of ``shard_grad``."""
        if self.shard_grad is not None:
            self._show(self.shard_grad)
        elif self.owner is not None and self.rank != self.owner:
            for loc in self.locals:  # another rank steps them
                loc.grad = None

    def mark_accumulating(self) -> None:
        """After a ``no_sync`` backward: shows the locals this rank's unreduced slice.

        As DDP leaves local gradients in ``.grad``; a ``zero_grad()`` before the next backward
        is then seen, and drops the accumulation.
        """
        if self.held_grads:  # a no_sync backward that left some parameter without a gradient
            self.new_grad_window()
        if self.grad_full is None or not any(self.grad_filled):
            return
        mine = self.grad_full[self.lo : self.hi]
        if self.offload is not None:  # a .grad must be on its parameter's device: a copy
            mine = mine.to(device="cpu", dtype=self.wdtype)
        elif mine.dtype != self.wdtype:  # a .grad must have its parameter's dtype
            mine = mine.to(self.wdtype)
        self._show(mine)

    def _show(self, base: torch.Tensor) -> None:
        lo = self.lo
        for p, loc, (a, b), o in zip(
            self.params, self.locals, self.local_ranges, self.offsets, strict=True
        ):
            if not p.requires_grad:
                continue
            if self.owner is not None and b == a:
                loc.grad = None  # a whole unit on another rank: nothing to step here
                continue
            start = o + a - lo if b > a else 0
            loc.grad = base[start : start + (b - a)].view(loc.shape)
        self.grad_state = GradState.PUBLISHED
        self.shown_base = weakref.ref(base)
        self.grad_version = base._version

    def locals_have_grads(self) -> bool:
        """Whether the optimizer side still holds this unit's gradients (not zeroed to None)."""
        elsewhere = self.owner is not None and self.rank != self.owner  # never has any
        return elsewhere or all(
            loc.grad is not None
            for loc, p in zip(self.locals, self.params, strict=True)
            if p.requires_grad
        )

    def nbytes(self) -> dict[str, int]:
        """Bytes this rank holds for the unit, by kind."""

        def size(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.untyped_storage().nbytes()

        full = size(self.full)
        shard_own = 0 if self.shard_is_view else size(self.shard)
        grad_own = size(self.grad_full if self.grad_full is not None else self.grad_home)
        sg = self.shard_grad
        sg_own = 0
        if sg is not None and not (
            self.grad_full is not None
            and sg.untyped_storage().data_ptr() == self.grad_full.untyped_storage().data_ptr()
        ):
            sg_own = size(sg)
        if self.offload is not None:  # the shard and its gradient are in host memory
            return {"params": full + size(self.dev_shard), "master": 0, "grads": grad_own,
                    "host": shard_own + size(self.host_grad)}  # fmt: skip
        return {"params": full, "master": shard_own, "grads": grad_own + sg_own, "host": 0}
