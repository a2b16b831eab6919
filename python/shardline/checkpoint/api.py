"""``save`` and ``load``: the checkpoint API (``maintenance`` finds, checks and exports).

Any strategy saves and any strategy loads: a checkpoint written by N ranks with ZeRO-3 loads
into M ranks with DDP, into ZeRO-2, or into one process and a plain ``nn.Module``, bit for bit
(model and optimizer; Adam's moments follow their parameters).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import secrets
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from shardline import config
from shardline._pinned import pinned_empty
from shardline._progress import Progress, wanted
from shardline._version import __version__
from shardline.checkpoint._store import (
    INDEX,
    Checkpoint,
    commit,
    is_committed,
    mark_failed,
    raise_if_failed,
    remove_stale,
    shard_name,
    working_folder,
    write_rank,
)
from shardline.checkpoint.maintenance import rotate
from shardline.checkpoint.pieces import Piece, model_pieces, optimizer_pieces
from shardline.checkpoint.reshard import Read, plan_model, plan_optimizer
from shardline.comm.group import ProcessGroup
from shardline.comm.world import default_group, is_initialized
from shardline.errors import CheckpointError
from shardline.parallel import contract

__all__ = ["SaveHandle", "load", "save"]

_pending: SaveHandle | None = None
_pending_lock = threading.Lock()


def _timeout(group: ProcessGroup | None) -> float:
    """How long a save waits for the other ranks: the group's ``timeout``.

    One process (no group) waits for nobody; ``SHARDLINE_TIMEOUT`` (else 300 s) bounds it.
    """
    return group.timeout if group is not None else config.default_timeout()


def _group(group: ProcessGroup | None) -> ProcessGroup | None:
    if group is not None:
        return group
    return default_group() if is_initialized() else None


def _device(group: ProcessGroup) -> torch.device:
    return group.device


class SaveHandle:
    """A save in progress (``async_=True``) or done: ``wait()`` raises its error, if any."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._taken = False  # whether wait() handed the error to the program
        self._thread: threading.Thread | None = None

    def _run(self, job: Any) -> None:
        try:
            job()
        except BaseException as exc:  # surfaced by wait()
            self._error = exc
        finally:
            self._done.set()

    def done(self) -> bool:
        """Whether the save finished (committed or failed)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Path:
        """Blocks until the checkpoint is committed; returns its path or raises its error."""
        if not self._done.wait(timeout):
            raise CheckpointError(f"checkpoint {self.path} still being written after {timeout} s")
        if self._error is not None:
            self._taken = True
            raise self._error
        return self.path

    def _settle(self) -> None:
        """Waits for this save to finish, for the next one; its error stays with this handle.

        An error nobody took with ``wait()`` becomes a warning here: a failed save (a full
        disk, a lost rank) must not go unseen, nor fail every later save of the process.
        """
        self._done.wait()
        if self._error is not None and not self._taken:
            self._taken = True
            warnings.warn(
                f"the asynchronous checkpoint save to {self.path} failed and its error was "
                f"never taken with handle.wait(): {type(self._error).__name__}: {self._error}; "
                "the next save goes ahead",
                RuntimeWarning,
                stacklevel=3,
            )


def _capture_rng() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    np_state: Any = np.random.get_state()
    name, keys, pos, has_gauss, gauss = np_state
    state["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)]
    version, values, gauss_next = random.getstate()
    state["python"] = [version, list(values), gauss_next]
    return state


def _restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(torch.tensor(s, dtype=torch.uint8), i)
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, values, gauss_next = state["python"]
    random.setstate((version, tuple(values), gauss_next))


def _owners(pieces: list[Piece], world_size: int) -> dict[str, int]:
    """Which rank writes each replicated piece: biggest first, to the least loaded rank."""
    load = [0] * world_size
    owner: dict[str, int] = {}
    for p in sorted(pieces, key=lambda p: (-p.numel * p.tensor.element_size(), p.key)):
        r = min(range(world_size), key=lambda i: (load[i], i))
        owner[p.key] = r
        load[r] += p.numel * p.tensor.element_size()
    return owner


def save(
    path: str | os.PathLike[str],
    *,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
    compress: int | None = None,
    async_: bool = False,
    keep_last: int | None = None,
    progress: bool | None = None,
    group: ProcessGroup | None = None,
) -> SaveHandle:
    """Saves a checkpoint directory at ``path`` (collective: every rank calls it).

    Args:
        path: The checkpoint directory (replaced atomically if it exists).
        model: A plain model or any strategy's wrapper (what it holds comes from the strategy
            contract, ``shardline.parallel.contract``).
        optimizer: Its optimizer; state is stored by parameter name.
        extra: JSON-serialisable training state (step, sampler state, your values). RNG
            states of torch, numpy and random are saved per rank as well.
        compress: A zstd level (e.g. 3) for ``.safetensors.zst`` shards; ``None``: plain
            safetensors files that other tools read.
        async_: Snapshot the state into host memory, return at once and write in a
            background thread; ``handle.wait()`` commits or raises its error. A later save
            waits for it first; an error nobody took with ``wait()`` is then a
            ``RuntimeWarning``, and the later save goes ahead.
            The host buffers are kept and reused by the next async save.
        keep_last: Afterwards keep only the newest ``keep_last`` checkpoints next to ``path``.
        progress: A progress line on stderr for this rank's shard. ``None``: on rank 0 for
            synchronous saves that take more than 2 s (``SHARDLINE_PROGRESS=0`` turns it
            off, ``=1`` shows it at once); ``True``/``False``: always/never.
        group: The ranks; the default group (or one process when none was initialised).
            Its ``timeout`` bounds the waits for the other ranks: rank 0's for every rank's
            shard, the others' for rank 0's commit.

    Returns:
        A ``SaveHandle``; for a synchronous save it is already done.

    Raises:
        CheckpointError: a rank failed, or one did not write its shard (rank 0 did not
            commit) within the group's ``timeout``; the previous checkpoint is intact.
    """
    global _pending  # noqa: PLW0603  # one save in flight per process
    with _pending_lock:
        previous, _pending = _pending, None
    if previous is not None:
        previous._settle()
    g = _group(group)
    rank, world = (g.rank, g.world_size) if g is not None else (0, 1)
    final = Path(path)
    user = dict(extra or {})
    try:
        extra_json = json.loads(json.dumps(user))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"save({final}): extra is not JSON-serialisable: {exc}") from exc
    nonce = secrets.randbits(62) if rank == 0 else 0
    if g is not None:  # rank 0's nonce; from here every rank is past its previous save
        t = torch.tensor([nonce], dtype=torch.int64, device=_device(g))
        g.broadcast(t, src=0)
        nonce = int(t.item())
    # This save's own folder. A rank may still be in an earlier save to the same path when
    # rank 0 starts this one (rank 0 failed fast and retried): that save's folder, and the
    # failure rank 0 left there for it, stay until every rank is here.
    partial = working_folder(final, nonce)
    partial.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        remove_stale(final, keep=partial)

    pieces: list[Piece] = []
    aliases: dict[str, str] = {}
    optim_json: dict[str, Any] | None = None
    if model is not None:
        pieces, aliases = model_pieces(model, rank)
    if optimizer is not None:
        if model is None:
            raise CheckpointError("save(optimizer=...) needs model= too (state is keyed by name)")
        more, optim_json = optimizer_pieces(model, optimizer, rank)
        pieces += more
    owner = _owners([p for p in pieces if p.replicated], world)
    mine = [p for p in pieces if (owner.get(p.key) == rank if p.replicated else p.numel > 0)]
    if async_:  # a snapshot in host memory; training may change the originals meanwhile
        on_gpu = any(p.tensor.is_cuda for p in mine)
        mine = [dataclasses.replace(p, tensor=_staged(p)) for p in mine]
        if on_gpu:
            torch.cuda.synchronize()  # the non-blocking copies into pinned buffers
    rng = _capture_rng()
    header = {
        "writer": f"shardline {__version__}",
        "nonce": nonce,
        "world_size": world,
        "created": time.time(),
        "step": user.get("step"),
        "layout": _layout(model),
        "hf_config": _hf_config(model),
        "aliases": aliases,
        "optimizer": optim_json,
        "extra": extra_json,
    }
    handle = SaveHandle(final)
    if progress is None and async_:
        progress = False  # an async save runs while training prints: quiet unless asked
    show, delay = wanted(progress, rank)
    shard = partial / shard_name(rank, compress is not None)
    what = f"checkpoint save {final}" + (f" (rank {rank}'s shard)" if world > 1 else "")
    nbytes = sum(p.tensor.numel() * p.tensor.element_size() for p in mine)
    manifest = {
        "rng": rng,
        # Rank 0 checks that every rank holds the same replicated keys (one rank writes each),
        # and merges every rank's optimizer values (a whole parameter's are on its owner).
        "replicated": sorted(p.key for p in pieces if p.replicated),
        "optimizer_values": optim_json["values"] if optim_json is not None else {},
    }

    timeout = _timeout(g)

    def job() -> None:
        deadline = time.monotonic() + timeout
        # Compressed files end smaller than the state: show bytes written, not a fraction.
        bar = Progress(
            what,
            None if compress is not None else nbytes,
            enabled=show,
            delay=delay,
            poll=lambda: os.stat(shard).st_size,
        )
        try:
            try:
                write_rank(partial, rank, mine, compress, manifest)
                if rank == 0:
                    _commit(partial, final, world, header, deadline, timeout)
            except BaseException as exc:  # the other ranks stop waiting, with the reason
                mark_failed(partial, rank, f"{type(exc).__name__}: {exc}")
                raise
            if rank == 0:
                if keep_last is not None:
                    rotate(final, keep_last)
            else:
                _wait_commit(final, partial, nonce, deadline, timeout)
        except BaseException:
            bar.close(ok=False)
            raise
        bar.close()

    if async_:
        thread = threading.Thread(target=handle._run, args=(job,), name="shardline-ckpt")
        handle._thread = thread
        thread.start()
        with _pending_lock:
            _pending = handle
    else:
        handle._run(job)
        handle.wait()
    return handle


# Host buffers of the last async save, reused by the next one (the previous save is always
# finished before a new one snapshots): no page faults on new memory, only the copy.
_staging: dict[tuple[str, int], torch.Tensor] = {}


def _staged(p: Piece) -> torch.Tensor:
    """A host copy of ``p``'s tensor in a buffer kept from the previous async save."""
    src = p.tensor.detach()
    buf = _staging.get((p.key, p.start))
    if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
        buf = (
            pinned_empty(src.shape, dtype=src.dtype)
            if src.is_cuda
            else torch.empty(src.shape, dtype=src.dtype)
        )
        _staging[(p.key, p.start)] = buf
    buf.copy_(src, non_blocking=src.is_cuda)
    return buf


def _commit(
    partial: Path, final: Path, world: int, header: dict[str, Any], deadline: float, timeout: float
) -> None:
    """Rank 0's ``commit``: past ``deadline``, its error names ``timeout`` (the group's)."""
    try:
        commit(partial, final, world, header, deadline)
    except CheckpointError as exc:
        if time.monotonic() <= deadline:
            raise
        raise CheckpointError(f"{exc} (waited {timeout:g} s, the group's timeout)") from None


def _wait_commit(final: Path, partial: Path, nonce: int, deadline: float, timeout: float) -> None:
    """A rank other than 0: waits until rank 0 committed, at most until ``deadline``."""
    while True:
        if is_committed(final):
            try:
                if json.loads((final / INDEX).read_text()).get("nonce") == nonce:
                    return
            except (OSError, ValueError):
                pass
        raise_if_failed(partial, final)
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"checkpoint {final}: rank 0 did not commit within {timeout:g} s (the group's "
                "timeout; is it alive?); the previous checkpoint there, if any, is intact"
            )
        time.sleep(0.01)


# -- load ----------------------------------------------------------------------------------------


def load(
    path: str | os.PathLike[str] | None,
    *,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    strict: bool = True,
    restore_rng: bool = True,
    progress: bool | None = None,
    group: ProcessGroup | None = None,
) -> dict[str, Any]:
    """Loads a checkpoint into ``model`` / ``optimizer`` of any strategy and world size.

    Each rank reads only the byte ranges of the shards it needs. Missing keys, unexpected
    keys and shape mismatches are reported together in one ``CheckpointError`` (with
    ``strict=False`` only shape mismatches are), before anything is read. With
    ``restore_rng`` this rank's RNG states are restored when the checkpoint has them for this
    rank. ``progress``: a progress line on stderr (``None``: on rank 0, for loads that take
    more than 2 s; ``SHARDLINE_PROGRESS=0`` turns it off).

    ``path=None`` loads nothing and returns ``{}``, so that resuming reads the same on a first
    run, when ``latest(root)`` finds no checkpoint::

        extra = sl.checkpoint.load(sl.checkpoint.latest("ckpt"), model=model, optimizer=opt)
        step = extra.get("step", 0)

    Returns:
        The ``extra`` saved with it (``{}`` for ``path=None``).
    """
    if path is None:
        return {}
    with Checkpoint(path) as ck:
        g = _group(group)
        rank, world = (g.rank, g.world_size) if g is not None else (0, 1)
        if optimizer is not None and model is None:
            raise CheckpointError("load(optimizer=...) needs model= too (state is keyed by name)")
        same_layout = ck.index.get("world_size") == world and ck.index.get("layout") == _layout(
            model
        )
        # Check everything first, then read model and optimizer in one go.
        reads: list[Read] = []
        finish: list[Callable[[], None]] = []
        if model is not None:
            more, apply = plan_model(ck, model, strict, rank, same_layout)
            reads += more
            finish.append(apply)
        if optimizer is not None:
            assert model is not None
            more, apply = plan_optimizer(ck, model, optimizer, strict, rank)
            reads += more
            finish.append(apply)
        show, delay = wanted(progress, rank)
        bar = Progress(
            f"checkpoint load {ck.path}",
            sum(t.numel() * t.element_size() for _, t, _ in reads),
            enabled=show,
            delay=delay,
        )
        try:
            with torch.no_grad():
                ck.read_many(reads, progress=bar.add)
        except BaseException:
            bar.close(ok=False)
            raise
        bar.close()
        for f in finish:
            f()
        rng = ck.index.get("rng", {}).get(str(rank))
        if restore_rng and rng:
            _restore_rng(rng)
        return dict(ck.index.get("extra") or {})


def _hf_config(model: nn.Module | None) -> dict[str, Any] | None:
    """A Hugging Face model's ``config`` as a dict (under a strategy's ``module``), if any.

    ``consolidate`` writes it as ``config.json``, so that ``from_pretrained`` takes the files.
    """
    for _ in range(4):  # a strategy wraps the model in `module`, a composition twice
        config = getattr(model, "config", None)
        if callable(getattr(config, "to_json_string", None)):
            return dict(json.loads(config.to_json_string()))  # type: ignore[union-attr]
        model = getattr(model, "module", None)
    return None


def _layout(model: nn.Module | None) -> dict[str, Any]:
    """The strategy's description of its layout, as JSON gives it back."""
    return dict(json.loads(json.dumps(contract.layout(model))))
