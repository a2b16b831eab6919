"""Symmetric memory: CPU tensors that every rank of a host can read and write directly.

``symmetric_empty(shape, dtype=..., group=...)`` returns a tensor in a ``/dev/shm`` segment of
this rank that every other rank of the group has mapped too. A collective whose buffer is in
symmetric memory (the same place on every rank) needs no copy through the engine's
shared-memory slots, since every rank reads its peers' data where they put it:

- ``all_reduce(t)``: rank ``i`` reduces part ``i`` from every rank's segment and writes the
  result into every rank's segment;
- ``reduce_scatter(out, t)`` (the input ``t`` symmetric, on any ranks and at any place):
  rank ``i`` reduces block ``i`` of every rank's input into its ``out``, reading each
  symmetric input where it is and the others through the slots;
- ``all_gather(t, part)`` (equal parts; the input ``part`` or the output ``t`` symmetric):
  every rank's part is copied from that rank's segment.

Each reads every input byte once and writes every output byte once (the memory-traffic bound
``benches/bench_collectives.py`` prints). Any other op, and ops on ordinary tensors, work as
before. DDP's buckets and ZeRO's flat buffers live here by default on CPU (``symmetric=False``
or ``SHARDLINE_SYMMETRIC=0`` turns that off; see ``wants_symmetric``). All-reduce and
all-gather need every rank to pass the same place (``SymmetricArena`` hands out the same
offsets on every rank); a reduce-scatter's inputs may come from a ``SymmetricPool``.

Every rank of the group calls ``symmetric_empty`` (or makes a ``SymmetricArena``) with the
same sizes, in the same order (it is a collective). The memory stays mapped while a tensor on
it (or a view of it) lives; when the last one goes, this rank's engine drops its mappings of
the other ranks' segments too. On a group of one rank, one that spans hosts, or a backend
other than the native engine, it returns an ordinary tensor: there is no shared memory to use.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import math
import os
import queue
import secrets
import threading
import weakref
from collections.abc import Sequence

import torch

from shardline import _native, config
from shardline.comm.group import ProcessGroup
from shardline.comm.objects import all_gather_object
from shardline.comm.world import default_group
from shardline.errors import InvalidArgumentError, ShardlineError

_log = logging.getLogger("shardline")


def symmetric_empty(
    *size: int | Sequence[int],
    dtype: torch.dtype = torch.float32,
    group: ProcessGroup | None = None,
) -> torch.Tensor:
    """An uninitialised CPU tensor in symmetric memory; a collective of ``group``.

    ``size`` and ``dtype`` as ``torch.empty``'s; ``group`` the default group when ``None``.

    Example::

        grads = sl.symmetric_empty(1 << 22)      # 16 MiB of float32 on every rank
        grads.copy_(flat_gradients)
        sl.all_reduce(grads)                     # no copy through the shared-memory slots
    """
    g = group if group is not None else default_group()
    shape = _shape(size)
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if not symmetric_available(g) or nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    memory = _symmetric_memory(g, nbytes)
    assert memory is not None  # required: it raised otherwise
    return torch.frombuffer(memory, dtype=dtype).view(shape)


def symmetric_available(group: ProcessGroup) -> bool:
    """Whether ``group`` has symmetric memory: the native engine, 2+ ranks on one host."""
    return group.transport == "shm" and isinstance(group.engine(), _native.Group)


def wants_symmetric(
    group: ProcessGroup, device: torch.device, choice: bool | None, who: str
) -> bool:
    """Whether ``who``'s flat buffers go to symmetric memory.

    ``choice`` ``None`` means where the group has it (CPU tensors, see ``symmetric_available``)
    unless ``SHARDLINE_SYMMETRIC=0``; ``False`` never; ``True`` always, and an error that says
    why where it cannot be.
    """
    if choice is None:
        return (
            device.type == "cpu"
            and bool(config.get("SHARDLINE_SYMMETRIC"))
            and symmetric_available(group)
        )
    if choice and (device.type != "cpu" or not symmetric_available(group)):
        where = (
            f"its tensors are on {device}"
            if device.type != "cpu"
            else f"its group {group.name!r} has no shared memory (transport "
            f"{group.transport!r}, {group.world_size} rank(s))"
        )
        raise InvalidArgumentError(
            f"{who}: symmetric=True, but {where}; symmetric memory is for CPU tensors of 2+ "
            "ranks of the native engine on one host. Pass symmetric=None (automatic) or False"
        )
    return bool(choice)


class _Allocation:
    """One collective allocation of ``nbytes`` of symmetric memory on ``group``.

    ``symmetric`` False where there is none: a group without shared memory, zero bytes, or
    (not ``required``) a rank without room, after a warning.
    """

    ALIGN = 64

    def __init__(
        self, nbytes: int, group: ProcessGroup | None = None, *, required: bool = True
    ) -> None:
        g = group if group is not None else default_group()
        self.group = g
        self.nbytes = nbytes
        wanted = nbytes > 0 and symmetric_available(g)
        self._memory = _symmetric_memory(g, nbytes, required) if wanted else None
        self.symmetric = self._memory is not None


class SymmetricArena(_Allocation):
    """One symmetric allocation cut into tensors, at the same offsets on every rank.

    Making one is a collective of ``group`` (see ``symmetric_empty``); ``take`` is local and
    hands out the next ``numel`` elements (64-byte aligned), so ranks that take the same
    sizes in the same order get buffers at the same place, which is what the engine's
    symmetric collectives need. The allocation lives while the arena or any tensor taken
    from it does.

    Args:
        nbytes: Bytes to allocate (``SymmetricArena.bytes_for`` sizes a list of tensors).
        group: The ranks that share it; the default group when ``None``.
        required: ``False``: where some rank cannot have it (no room in ``/dev/shm``), hand
            out ordinary tensors (``symmetric`` False), with a warning, instead of raising.
    """

    def __init__(
        self, nbytes: int, group: ProcessGroup | None = None, *, required: bool = True
    ) -> None:
        super().__init__(nbytes, group, required=required)
        self._used = 0

    @classmethod
    def bytes_for(cls, sizes: Sequence[tuple[int, torch.dtype]]) -> int:
        """Bytes an arena needs to hand out tensors of these ``(numel, dtype)``."""
        return sum(_aligned(n * _itemsize(dt), cls.ALIGN) for n, dt in sizes)

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The next ``numel`` elements of ``dtype``, zero-filled.

        Each is a tensor of its own (its own version counter, as autograd and in-place checks
        expect of separate buffers), not a view of one big one. Where the group has no
        symmetric memory, an ordinary tensor.
        """
        size = numel * _itemsize(dtype)
        end = self._used + size
        if end > self.nbytes:
            raise InvalidArgumentError(
                f"SymmetricArena: {size} more bytes asked of {self.nbytes} ({self._used} in "
                "use); size it with SymmetricArena.bytes_for the tensors it will hold"
            )
        offset, self._used = self._used, _aligned(end, self.ALIGN)
        if self._memory is None:
            return torch.zeros(numel, dtype=dtype)
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        out = torch.frombuffer(self._memory, dtype=dtype, count=numel, offset=offset)
        return out.zero_()


class SymmetricPool(_Allocation):
    """Symmetric memory handed out and taken back, at offsets of each rank's own.

    For buffers of ops that read each rank's buffer where that rank says it is (a
    reduce-scatter's input: ranks need not agree on the offset, nor on whether it is in
    symmetric memory at all). Making one is a collective of ``group``; ``take`` is local: the
    first free range that fits, or ``None`` when none does (the caller then uses an ordinary
    tensor). A range is free again once the last tensor on it, views included, is gone.

    Args:
        nbytes: Bytes to allocate.
        group: The ranks that share it; the default group when ``None``.
        required: ``False``: where some rank cannot have it, ``take`` always answers ``None``
            (with a warning) instead of raising here.
    """

    def __init__(
        self, nbytes: int, group: ProcessGroup | None = None, *, required: bool = True
    ) -> None:
        super().__init__(nbytes, group, required=required)
        self._held: list[tuple[int, int, weakref.ref[ctypes.Array[ctypes.c_char]]]] = []

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """``numel`` elements of ``dtype`` (uninitialised), or ``None`` when nothing fits."""
        size = numel * _itemsize(dtype)
        if self._memory is None or size == 0:
            return None
        self._held = [h for h in self._held if h[2]() is not None]
        at = 0
        for lo, hi, _ in sorted(self._held, key=lambda h: h[0]):
            if lo - at >= size:
                break
            at = max(at, _aligned(hi, self.ALIGN))
        if at + size > self.nbytes:
            return None
        piece = (ctypes.c_char * size).from_address(ctypes.addressof(self._memory) + at)
        piece.memory = self._memory  # type: ignore[attr-defined]  # the allocation lives on
        self._held.append((at, at + size, weakref.ref(piece)))
        return torch.frombuffer(piece, dtype=dtype)

    def in_use(self) -> int:
        """Bytes handed out and not yet free again."""
        return sum(hi - lo for lo, hi, ref in self._held if ref() is not None)

    def idle(self) -> int:
        """Bytes held and not handed out (0 where the pool got no memory)."""
        return 0 if self._memory is None else self.nbytes - self.in_use()


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _aligned(n: int, to: int) -> int:
    return -(-n // to) * to


def _symmetric_memory(
    g: ProcessGroup, nbytes: int, required: bool = True
) -> ctypes.Array[ctypes.c_char] | None:
    """``nbytes`` of symmetric memory on ``g`` (a collective); tensors on it hold it alive.

    Every rank learns whether every rank made and mapped its segment, so all of them fail (or,
    not ``required``, all return ``None``) together: none waits for a rank that gave up.
    """
    native = g.engine()
    path = f"/dev/shm/shardline-{os.getpid()}-symm-{secrets.token_hex(6)}"
    made: str | None = None
    try:
        _native.symmetric_create(path, nbytes)
    except ShardlineError as exc:  # no room in /dev/shm, most often
        made = f"{type(exc).__name__}: {exc}"
    segment = None
    try:
        entries = all_gather_object((path, made), group=g)
        failed = [(r, e) for r, (_, e) in enumerate(entries) if e is not None]
        if not failed:
            error = None
            try:
                segment = _native.symmetric_register(native, [p for p, _ in entries], nbytes)
            except ShardlineError as exc:
                error = f"{type(exc).__name__}: {exc}"
            # Every rank has mapped every segment (or failed) before any name goes.
            errors = all_gather_object(error, group=g)
            failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    finally:
        if made is None:
            _native.symmetric_unlink(path)
    if failed:
        if segment is not None:  # mapped here, not everywhere: this rank lets go of it
            _native.symmetric_release(native, segment.index)
        if not required:
            _log.warning(
                "symmetric memory: %d bytes could not be had on rank(s) %s (%s); using "
                "ordinary tensors, whose collectives copy through the engine's slots. Give "
                "/dev/shm more room (docker --shm-size) or pass symmetric=False",
                nbytes, [r for r, _ in failed], failed[0][1],
            )  # fmt: skip
            return None
        raise ShardlineError(
            "symmetric_empty failed on rank(s) "
            + "; ".join(f"{r}: {e}" for r, e in failed)
            + f" (rank {g.rank} of group {g.name!r}); every rank must allocate the same size"
        )
    assert segment is not None
    memory = (ctypes.c_char * nbytes).from_address(segment.address)
    memory.segment = segment  # type: ignore[attr-defined]  # the mapping lives with the tensor
    # When the last tensor on it goes, so do this rank's mappings of the peers' segments
    # (on the release thread: see _RELEASES).
    _start_releaser()
    weakref.finalize(memory, _RELEASES.put, (weakref.ref(native), segment.index))
    return memory


# Finalizers only queue releases; one daemon thread per process does them. A finalizer runs
# on whatever thread the garbage collector happens to run on, and symmetric_release waits for
# the group's op in progress (the engine holds its lock for a whole op). With ranks as threads
# of one process (tests/_ranks.py), rank 0's gc.collect() (trials.py runs one after each
# trial) ran rank 1's finalizer, so rank 0 waited for rank 1's collective while rank 1 waited
# in it for rank 0: a hang until the op timed out. SimpleQueue.put is safe in finalizers.
# An event in the queue is set once every release queued before it is done; None ends the
# thread (at exit: _stop_releaser).
_RELEASES: queue.SimpleQueue[tuple[weakref.ref[_native.Group], int] | threading.Event | None]
_RELEASES = queue.SimpleQueue()
_releaser: threading.Thread | None = None
_releaser_lock = threading.Lock()


def _start_releaser() -> None:
    global _releaser  # noqa: PLW0603
    with _releaser_lock:
        if _releaser is None or not _releaser.is_alive():  # not yet, or forked since
            _releaser = threading.Thread(
                target=_release_queued, name="shardline-symmetric-release", daemon=True
            )
            _releaser.start()


def wait_for_releases(timeout: float = 30.0) -> bool:
    """Waits until this process has released every symmetric allocation dropped so far.

    The last tensor on an allocation going only queues its release (its mappings of the
    peers' segments); a thread of this process does it as soon as the group is between
    collectives. Call this where no rank of the group is inside a collective, or it waits
    for those to end. Returns whether it finished within ``timeout`` seconds.
    """
    with _releaser_lock:
        if _releaser is None or not _releaser.is_alive():
            return True  # nothing was ever queued in this process (or since a fork)
    done = threading.Event()
    _RELEASES.put(done)
    return done.wait(timeout)


def _stop_releaser() -> None:
    """Ends the release thread before the interpreter tears down (registered with atexit).

    The teardown frees what modules still hold, symmetric memory too. A release it queued
    would run native code on a daemon thread while Python finalizes, and such a thread that
    takes the GIL back then is ended where it stands, inside native frames (a hazard of the
    kind that aborts a process after its work is done). The process's mappings go with it
    anyway, so nothing is left unreleased.
    """
    with _releaser_lock:
        thread = _releaser
    if thread is not None and thread.is_alive():
        _RELEASES.put(None)
        thread.join(timeout=5.0)


atexit.register(_stop_releaser)


def _release_queued() -> None:
    while True:
        item = _RELEASES.get()
        if item is None:
            return
        if isinstance(item, threading.Event):
            item.set()
            continue
        native, index = item
        try:
            _release(native, index)
        except Exception:  # keep releasing the others
            _log.exception("symmetric memory: releasing allocation #%d failed", index)


def _release(native: weakref.ref[_native.Group], index: int) -> None:
    group = native()
    if group is None:
        return  # the group went first, with every mapping
    with contextlib.suppress(ShardlineError):  # destroyed or aborted: the mappings went too
        _native.symmetric_release(group, index)


def _shape(size: tuple[int | Sequence[int], ...]) -> tuple[int, ...]:
    if len(size) == 1 and not isinstance(size[0], int):
        size = tuple(size[0])
    if not all(isinstance(s, int) and s >= 0 for s in size):
        raise InvalidArgumentError(
            f"symmetric_empty: size must be non-negative ints (or one sequence of them), "
            f"got {size!r}"
        )
    return tuple(int(s) for s in size)  # type: ignore[arg-type]
