"""A checkpoint directory: per-rank shard files, ``index.json``, and the commit protocol.

Layout of a committed checkpoint ``path``::

    path/rank00000.safetensors     this rank's pieces (``.safetensors.zst`` when compressed)
    path/index.json                every tensor: dtype, global shape, chunks (file, range)
    path/COMMIT                    written last; readers ignore directories without it

Saving writes into ``path.partial-<nonce>``, a folder of that save's own: every rank writes
and fsyncs its shard file and a small manifest; rank 0 waits for all manifests, writes the
index and ``COMMIT`` (fsynced), puts the folder in ``path``'s place and fsyncs the parent. A
checkpoint already at ``path`` is swapped out in one step (``renameat2``'s exchange, where the
filesystem has it; else renamed to ``path.old-<nonce>`` first) and then deleted. A crash at any
point leaves either the previous checkpoint or the new one, never a torn one. Finding
checkpoints (``latest``, ``keep_last``) passes over these working folders (``is_working``);
only a crash between the fallback's two renames leaves the previous checkpoint under
``path.old-<nonce>`` alone, where ``latest`` does not look.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from shardline import _native, dtypes
from shardline.checkpoint.pieces import Piece, dtype_name, flat_index
from shardline.errors import CheckpointError

__all__ = [
    "COMMIT",
    "INDEX",
    "SCHEMA",
    "Checkpoint",
    "commit",
    "is_committed",
    "mark_failed",
    "raise_if_failed",
    "shard_name",
    "write_rank",
]

INDEX = "index.json"
# Reads at least this large are not pooled: the engine splits each across threads itself.
PARALLEL_READ_BYTES = 64 << 20
READ_THREADS = 8
COMMIT = "COMMIT"
FAILED = "FAILED"  # a rank's failure marker in a partial checkpoint
SCHEMA = 1


# A save's folders that are not checkpoints: ``<name>.partial-<nonce>`` (``.partial``, as
# earlier versions named it) and ``<name>.old-<nonce>``, the checkpoint it replaces.
_WORKING = re.compile(r"\.(partial(-[0-9a-f]+)?|old-\d+)$")


def working_folder(final: Path, nonce: int) -> Path:
    """Where the save with ``nonce`` writes ``final`` before it commits."""
    return final.with_name(f"{final.name}.partial-{nonce:x}")


def is_working(path: Path) -> bool:
    """Whether ``path`` is a save's working folder (see ``_WORKING``), not a checkpoint."""
    return _WORKING.search(path.name) is not None


def remove_stale(final: Path, keep: Path) -> None:
    """Removes ``final``'s working folders left by earlier saves (died or failed), but ``keep``.

    Only once every rank is in the save that writes ``keep``: then none still writes into
    an earlier one, nor waits for the failure another rank left there.
    """
    with contextlib.suppress(OSError):
        for p in final.parent.iterdir():
            rest = p.name[len(final.name) :]
            if p != keep and p.name.startswith(final.name) and _WORKING.fullmatch(rest):
                shutil.rmtree(p, ignore_errors=True)


_RENAME_EXCHANGE = 2  # renameat2's flag (linux/fs.h)
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swaps the names of ``a`` and ``b`` in one step; False where that is not available.

    Linux's ``renameat2(RENAME_EXCHANGE)`` (glibc 2.28 or later; ext4, xfs, btrfs, tmpfs, but
    not every network filesystem): ``b`` is never missing, not even for an instant.
    """
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, f"swapping {a} and {b}: {os.strerror(err)}")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _bytes_view(t: torch.Tensor) -> Any:
    """A zero-copy writable/readable byte view of a contiguous CPU tensor."""
    flat = t.reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else bytearray()


def manifest_name(rank: int) -> str:
    """The per-rank manifest in a partial checkpoint."""
    return f"rank{rank:05d}.json"


def shard_name(rank: int, compressed: bool) -> str:
    """This rank's shard file in a checkpoint directory."""
    return f"rank{rank:05d}.safetensors" + (".zst" if compressed else "")


def write_rank(
    directory: Path,
    rank: int,
    pieces: Iterable[Piece],
    compress: int | None,
    extra_manifest: dict[str, Any],
) -> None:
    """Writes this rank's shard file and manifest into ``directory`` (both fsynced)."""
    fname = shard_name(rank, compress is not None)
    tensors = []
    chunks = []
    keep = []
    for p in pieces:
        t = p.tensor.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        t = t.contiguous()
        keep.append(t)
        file_key = f"{p.key}@{p.start}"
        shape = list(t.shape) if p.replicated or p.box is not None else [t.numel()]
        dtype = dtype_name(t.dtype, p.key)
        tensors.append((file_key, dtype, shape, _bytes_view(t)))
        chunk = {
            "key": p.key,
            "file": fname,
            "file_key": file_key,
            "start": p.start,
            "end": p.end,
            "dtype": dtype,
            "shape": list(p.shape),
        }
        if p.box is not None:
            chunk["box"] = {"offsets": list(p.box), "shape": list(t.shape)}
        chunks.append(chunk)
    info = _native.write_shard(
        str(directory / fname),
        tensors,
        {"format": "pt", "shardline.rank": str(rank)},
        compress=compress,
    )
    manifest = {
        "rank": rank,
        "file": fname,
        "bytes": info["__file__"]["bytes"],
        "compressed": compress is not None,
        "chunks": chunks,
        **extra_manifest,
    }
    tmp = directory / (manifest_name(rank) + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(directory / manifest_name(rank))


def mark_failed(partial: Path, rank: int, reason: str) -> None:
    """Leaves this rank's failure in a partial checkpoint, so no other rank waits for it."""
    # (when the directory is gone the others time out, as they would have)
    # Written whole, then renamed: a rank polling for it could read it still empty, and say
    # the failure without its reason.
    marker = partial / f"{FAILED}.rank{rank:05d}"
    tmp = marker.with_name(f".{marker.name}.tmp")  # not matched by raise_if_failed's glob
    with contextlib.suppress(OSError):
        tmp.write_text(reason)
        tmp.rename(marker)


def raise_if_failed(partial: Path, final: Path) -> None:
    """``CheckpointError`` with the first failure a rank left in ``partial``, if any.

    ``partial`` may be gone: rank 0 renames it to ``final`` when it commits, between a
    waiting rank's look at ``final`` and this one.
    """
    try:
        markers = sorted(partial.glob(f"{FAILED}.rank*"))
    except FileNotFoundError:
        return  # committed meanwhile (the caller looks at final again)
    for marker in markers:
        try:
            reason = marker.read_text()
        except OSError:
            reason = "(unreadable)"
        rank = int(marker.name.rsplit("rank", 1)[1])
        raise CheckpointError(
            f"checkpoint {final} was not saved: rank {rank} failed: {reason}; the previous "
            "checkpoint there, if any, is intact"
        )


def commit(
    partial: Path,
    final: Path,
    world_size: int,
    header: dict[str, Any],
    deadline: float,
) -> None:
    """Rank 0: waits for every rank's manifest, writes the index and COMMIT, renames."""
    names = [partial / manifest_name(r) for r in range(world_size)]
    while True:
        missing = [n for n in names if not n.exists()]
        if not missing:
            break
        raise_if_failed(partial, final)
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"checkpoint {final}: ranks {[int(n.name[4:9]) for n in missing]} did not "
                f"finish writing their shards in time; {final} was not changed (the previous "
                "checkpoint there, if any, is intact)"
            )
        time.sleep(0.01)
    tensors: dict[str, dict[str, Any]] = {}
    files: dict[str, Any] = {}
    rng: dict[str, Any] = {}
    values: dict[str, dict[str, Any]] = {}  # optimizer values, from every rank that has some
    replicated: list[str] | None = None
    for n in names:
        m = json.loads(n.read_text())
        files[m["file"]] = {"rank": m["rank"], "bytes": m["bytes"], "compressed": m["compressed"]}
        rng[str(m["rank"])] = m.get("rng")
        for name, entries in m.get("optimizer_values", {}).items():
            for k, v in entries.items():
                values.setdefault(name, {}).setdefault(k, v)
        if replicated is None:
            replicated = m.get("replicated", [])
        elif m.get("replicated", []) != replicated:
            theirs = set(m.get("replicated", []))
            odd = sorted(theirs ^ set(replicated))[:5]
            raise CheckpointError(
                f"checkpoint {final}: rank {m['rank']} and rank 0 hold different replicated "
                f"state (e.g. {odd}); a strategy must give a replicated value on every rank, "
                f"or a Shard where only some ranks hold it. {final} was not changed"
            )
        for c in m["chunks"]:
            entry = tensors.setdefault(c["key"], {"dtype": c["dtype"], "shape": c["shape"]})
            if entry["dtype"] != c["dtype"] or entry["shape"] != c["shape"]:
                raise CheckpointError(
                    f"checkpoint {final}: ranks disagree on {c['key']!r} "
                    f"({entry['dtype']} {entry['shape']} vs {c['dtype']} {c['shape']})"
                )
            entry.setdefault("chunks", []).append(
                {k: c[k] for k in ("file", "file_key", "start", "end", "box") if k in c}
            )
        n.unlink()
    for entry in tensors.values():
        entry["chunks"].sort(key=lambda c: c["start"])
    if header.get("optimizer") is not None:
        header = {**header, "optimizer": {**header["optimizer"], "values": values}}
    index = {**header, "schema": SCHEMA, "files": files, "tensors": tensors, "rng": rng}
    with open(partial / INDEX, "w") as f:
        json.dump(index, f)
        f.flush()
        os.fsync(f.fileno())
    with open(partial / COMMIT, "w") as f:
        f.write(str(header.get("nonce", "")))
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(partial)
    old = None
    if not final.exists():
        partial.rename(final)
    elif _exchange(partial, final):
        old = partial  # the previous checkpoint, now under the working folder's name
    else:  # two renames: between them only path.old-<nonce> holds a checkpoint
        old = final.with_name(f"{final.name}.old-{header.get('nonce', 0)}")
        final.rename(old)
        partial.rename(final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def is_committed(path: Path) -> bool:
    """Whether ``path`` is a complete checkpoint."""
    return (path / COMMIT).is_file() and (path / INDEX).is_file()


class Checkpoint:
    """A committed checkpoint opened for reading: the index and byte-range reads.

    Each shard file is opened once, on its first read, as a ``_native.ShardReader`` (mapped,
    header validated once) and kept open for the object's life; reads from several threads
    share it. ``close()`` (or ``with Checkpoint(path) as ck:``) releases the files; a
    Checkpoint that is garbage collected releases them too.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"no checkpoint at {self.path}: not a directory")
        if not is_committed(self.path):
            raise CheckpointError(
                f"{self.path} is not a committed checkpoint (no {COMMIT} marker or {INDEX}): "
                "a save did not finish; load an earlier one (checkpoint.latest(root))"
            )
        try:
            self.index: dict[str, Any] = json.loads((self.path / INDEX).read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{self.path / INDEX} is unreadable: {exc}") from exc
        if self.index.get("schema") != SCHEMA:
            raise CheckpointError(
                f"{self.path}: index schema {self.index.get('schema')!r}, this shardline reads "
                f"schema {SCHEMA}"
            )
        self.tensors: dict[str, dict[str, Any]] = self.index["tensors"]
        self.aliases: dict[str, str] = self.index.get("aliases", {})
        # [Note: open shard files] One reader per shard file, opened on first use under the
        # lock (read_many reads from a thread pool); reads run outside it.
        self._readers: dict[str, _native.ShardReader] = {}
        self._readers_lock = threading.Lock()
        self._closed = False

    def reader(self, file: str) -> _native.ShardReader:
        """The open reader of shard file ``file`` (a name in the index), opened on first use."""
        with self._readers_lock:
            if self._closed:
                raise CheckpointError(f"checkpoint {self.path} was closed; open it again to read")
            reader = self._readers.get(file)
            if reader is None:
                reader = _native.ShardReader(str(self.path / file))
                self._readers[file] = reader
            return reader

    def close(self) -> None:
        """Closes every shard file opened for reading; later reads raise. Idempotent."""
        with self._readers_lock:
            readers = list(self._readers.values())
            self._readers.clear()
            self._closed = True
        for reader in readers:
            reader.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def resolve(self, key: str) -> str:
        """The stored key for ``key`` (tied tensors are stored once)."""
        return self.aliases.get(key, key)

    def has(self, key: str) -> bool:
        """Whether the checkpoint holds ``key`` (directly or as an alias)."""
        return self.resolve(key) in self.tensors

    def shape(self, key: str) -> tuple[int, ...]:
        """The global shape of ``key``."""
        return tuple(self.tensors[self.resolve(key)]["shape"])

    def dtype(self, key: str) -> torch.dtype:
        """The stored dtype of ``key``."""
        return dtypes.from_file_name(self.tensors[self.resolve(key)]["dtype"])

    def read(
        self,
        key: str,
        out: torch.Tensor,
        start: int | tuple[int, ...] = 0,
        verify: bool = True,
    ) -> None:
        """Copies elements ``start .. start + out.numel()`` of ``key`` into ``out``.

        With ``start`` a tuple of offsets, ``out`` receives the block of its own shape at
        those offsets instead. Reads only the byte ranges needed; converts the dtype if
        ``out``'s differs from the stored one.
        """
        stored = self.resolve(key)
        entry = self.tensors[stored]
        if isinstance(start, tuple) or any("box" in c for c in entry["chunks"]):
            self._read_through_whole(key, entry, out, start, verify)
            return
        dtype = dtypes.from_file_name(entry["dtype"])
        n = out.numel()
        direct = out.device.type == "cpu" and out.is_contiguous() and out.dtype == dtype
        buf = out if direct else torch.empty(n, dtype=dtype)
        flat = buf.reshape(-1)
        itemsize = flat.element_size()
        lo, hi = start, start + n
        covered = lo
        for c in entry["chunks"]:
            a, b = max(lo, c["start"]), min(hi, c["end"])
            if b <= a:
                continue
            if a > covered:
                break
            dst = flat[a - lo : b - lo]
            self.reader(c["file"]).read_range(
                c["file_key"], (a - c["start"]) * itemsize, _bytes_view(dst), verify
            )
            covered = max(covered, b)
        if covered < hi:
            raise CheckpointError(
                f"{self.path}: {key!r} elements {covered}..{hi} are in no shard file; the index "
                "is incomplete (run checkpoint.verify)"
            )
        if not direct:
            with torch.no_grad():
                out.copy_(buf.view(out.shape) if out.dim() else buf.reshape(()))

    def _read_through_whole(
        self,
        key: str,
        entry: dict[str, Any],
        out: torch.Tensor,
        start: int | tuple[int, ...],
        verify: bool,
    ) -> None:
        """``read`` where blocks are involved.

        The chunks that overlap the request are placed into the whole tensor (in host
        memory), and the request is cut out of it.
        """
        dtype = dtypes.from_file_name(entry["dtype"])
        shape = tuple(entry["shape"])
        whole = torch.empty(shape, dtype=dtype)
        flat = whole.reshape(-1)
        seen = torch.zeros(flat.numel(), dtype=torch.bool)
        if out.numel() == 0:
            return
        if isinstance(start, tuple):
            if len(start) != len(shape) or out.dim() != len(shape):
                raise CheckpointError(
                    f"{self.path}: a block at {list(start)} of shape {list(out.shape)} does not "
                    f"fit {key!r} of shape {list(shape)}"
                )
            region = tuple(slice(o, o + n) for o, n in zip(start, out.shape, strict=True))
            lo = flat_index(shape, start)
            last = tuple(o + n - 1 for o, n in zip(start, out.shape, strict=True))
            hi = flat_index(shape, last) + 1
        else:
            lo, hi = start, start + out.numel()
        for c in entry["chunks"]:
            if c["end"] <= lo or c["start"] >= hi or c["end"] <= c["start"]:
                continue
            reader = self.reader(c["file"])
            if "box" in c:
                box = c["box"]
                block = torch.empty(box["shape"], dtype=dtype)
                reader.read_range(c["file_key"], 0, _bytes_view(block), verify)
                where = tuple(
                    slice(o, o + n) for o, n in zip(box["offsets"], box["shape"], strict=True)
                )
                whole[where] = block
                seen.view(shape)[where] = True
            else:
                dst = flat[c["start"] : c["end"]]
                reader.read_range(c["file_key"], 0, _bytes_view(dst), verify)
                seen[c["start"] : c["end"]] = True
        if isinstance(start, tuple):
            values, got = whole[region], seen.view(shape)[region]
        else:
            values, got = flat[lo:hi], seen[lo:hi]
        if not bool(got.all()):
            raise CheckpointError(
                f"{self.path}: parts of {key!r} are in no shard file; the index is incomplete "
                "(run checkpoint.verify)"
            )
        with torch.no_grad():
            out.copy_(values.reshape(out.shape))

    def read_many(
        self,
        jobs: Iterable[tuple[str, torch.Tensor, int | tuple[int, ...]]],
        verify: bool = True,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """``read(key, out, start)`` for every job, several at a time.

        Reads of 64 MiB or more run one after another (each is split across threads in the
        engine); the smaller ones, most of a model's tensors, run on a pool of threads (the
        engine releases the GIL), which also keeps a cold disk's request queue full.
        ``progress`` is called with the bytes of each read once it is done.
        """

        def one(job: tuple[str, torch.Tensor, int | tuple[int, ...]]) -> None:
            key, out, start = job
            self.read(key, out, start, verify)
            if progress is not None:
                progress(out.numel() * out.element_size())

        jobs = list(jobs)
        big = [j for j in jobs if j[1].numel() * j[1].element_size() >= PARALLEL_READ_BYTES]
        small = [j for j in jobs if j[1].numel() * j[1].element_size() < PARALLEL_READ_BYTES]
        for job in big:
            one(job)
        workers = min(READ_THREADS, os.cpu_count() or 1, len(small))
        if workers <= 1:
            for job in small:
                one(job)
            return
        with ThreadPoolExecutor(workers, thread_name_prefix="shardline-load") as pool:
            # list(): wait for all, and raise the first error in job order.
            list(pool.map(one, small))

    def files(self) -> list[Path]:
        """The shard files."""
        return [self.path / name for name in self.index["files"]]
