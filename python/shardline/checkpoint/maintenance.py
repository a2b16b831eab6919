"""Finding, describing, checking and exporting checkpoints.

``latest``, ``info``, ``verify``, ``consolidate`` (``shardline ckpt info|verify|consolidate``
on the command line), and the rotation ``save(keep_last=...)`` uses.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardline import _native
from shardline.checkpoint._store import INDEX, Checkpoint, is_committed, is_working
from shardline.checkpoint.pieces import dtype_name, is_local_key
from shardline.errors import CheckpointError

__all__ = ["consolidate", "info", "latest", "rotate", "verify"]


def _committed_under(root: Path) -> list[tuple[tuple[float, float], Path]]:
    """The committed checkpoints in ``root``, each with its age (step, then time).

    Passes over a save's working folders (a save in progress, or one that died) and, with a
    warning, a checkpoint whose index cannot be read: one unreadable folder must not hide
    the others.
    """
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if not p.is_dir() or is_working(p) or not is_committed(p):
            continue
        try:
            found.append((_age_key(p), p))
        except FileNotFoundError:
            continue  # deleted meanwhile (another process's keep_last)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            warnings.warn(
                f"{p / INDEX} is unreadable ({type(exc).__name__}: {exc}); passed over as a "
                "checkpoint (`shardline ckpt verify` checks one)",
                RuntimeWarning,
                stacklevel=3,
            )
    return found


def _age_key(path: Path) -> tuple[float, float]:
    index = json.loads((path / INDEX).read_text())
    step = index.get("step")
    return (float(step) if isinstance(step, int | float) else -1.0, float(index["created"]))


def rotate(final: Path, keep: int) -> None:
    """Keeps only the newest ``keep`` committed checkpoints next to ``final`` (and it)."""
    others = [p for _, p in sorted(_committed_under(final.parent))]
    for old in others[: max(0, len(others) - max(keep, 1))]:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The newest committed checkpoint under ``root`` (by step, then time), or ``None``."""
    found = _committed_under(Path(root))
    return max(found)[1] if found else None


def info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What a checkpoint holds and how it was written (strategy, shards, precision, ...)."""
    with Checkpoint(path) as ck:
        idx = ck.index
        model_keys = [k for k in ck.tensors if k.startswith("model/") and not is_local_key(k)]
        return {
            "path": str(ck.path),
            "writer": idx.get("writer"),
            "world_size": idx["world_size"],
            "step": idx.get("step"),
            "created": idx.get("created"),
            **idx.get("layout", {}),
            "compressed": any(f["compressed"] for f in idx["files"].values()),
            "files": len(idx["files"]),
            "bytes": sum(f["bytes"] for f in idx["files"].values()),
            "model_tensors": len(model_keys),
            "model_parameters": sum(int(np.prod(ck.tensors[k]["shape"])) for k in model_keys),
            "optimizer": idx.get("optimizer") is not None,
            "aliases": idx.get("aliases", {}),
            "extra": idx.get("extra", {}),
        }


def verify(path: str | os.PathLike[str]) -> None:
    """Checks every checksum and that the index covers every tensor completely."""
    with Checkpoint(path) as ck:
        for f in ck.files():
            if not f.is_file():
                raise CheckpointError(f"{ck.path}: shard file {f.name} is missing")
            with _native.ShardReader(str(f)) as reader:
                reader.verify()
        for key, entry in ck.tensors.items():
            total = int(np.prod(entry["shape"])) if entry["shape"] else 1
            covered = 0
            if any("box" in c for c in entry["chunks"]):  # blocks do not overlap: count elements
                covered = sum(
                    int(np.prod(c["box"]["shape"])) if "box" in c else c["end"] - c["start"]
                    for c in entry["chunks"]
                )
            else:  # flat ranges, sorted: the covered prefix
                for c in entry["chunks"]:
                    if c["start"] > covered:
                        break
                    covered = max(covered, c["end"])
            if covered < total:
                raise CheckpointError(f"{ck.path}: {key!r} is covered up to {covered} of {total}")


def consolidate(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    max_shard_bytes: int = 5 << 30,
) -> list[Path]:
    """Writes the model as Hugging Face-style safetensors (full tensors, plain names).

    One ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` files plus
    ``model.safetensors.index.json`` when larger than ``max_shard_bytes``, and the model's
    ``config.json`` when it was a Hugging Face model (``from_pretrained`` then loads the
    folder). Streams: at most one output file's worth of tensors is in memory. Tied tensors
    are stored once.
    """
    with Checkpoint(path) as ck:
        dst = Path(out)
        dst.mkdir(parents=True, exist_ok=True)
        # The model's tensors; not a strategy's per-rank values (``Local``: residuals, ...)
        keys = [k for k in ck.tensors if k.startswith("model/") and not is_local_key(k)]
        groups: list[list[str]] = [[]]
        size = 0
        for k in keys:
            nbytes = int(np.prod(ck.shape(k))) * torch.empty(0, dtype=ck.dtype(k)).element_size()
            if groups[-1] and size + nbytes > max_shard_bytes:
                groups.append([])
                size = 0
            groups[-1].append(k)
            size += nbytes
        written: list[Path] = []
        weight_map: dict[str, str] = {}
        for i, group_keys in enumerate(groups):
            name = (
                "model.safetensors"
                if len(groups) == 1
                else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            )
            tensors = []
            keep = []
            for k in group_keys:
                t = torch.empty(ck.shape(k), dtype=ck.dtype(k))
                ck.read(k, t)
                keep.append(t)
                plain = k[len("model/") :]
                view = t.reshape(-1)
                data = view.view(torch.uint8).numpy() if view.numel() else bytearray()
                tensors.append((plain, dtype_name(t.dtype, k), list(t.shape), data))
                weight_map[plain] = name
            _native.write_shard(str(dst / name), tensors, {"format": "pt"})
            written.append(dst / name)
            del keep, tensors
        config = ck.index.get("hf_config")
        if config is not None:  # the model's Hugging Face config: from_pretrained needs it
            (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
            written.append(dst / "config.json")
        if len(groups) > 1:
            index = {
                "metadata": {"total_size": sum(f.stat().st_size for f in written)},
                "weight_map": weight_map,
            }
            (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
            written.append(dst / "model.safetensors.index.json")
        return written
