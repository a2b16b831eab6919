"""``_native.ShardReader``: one open shard file serving ranges, and the checkpoint reader that
keeps one per shard file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shardline.checkpoint._store import COMMIT, INDEX, SCHEMA, Checkpoint
from shardline.errors import CheckpointError, InvalidArgumentError
from tests.test_shard_files import _n, in_threads, raw

pytestmark = pytest.mark.usefixtures("native")


def write(path: Path, tensors: dict[str, torch.Tensor], compress: int | None = None) -> Any:
    entries = [
        (name, {torch.float32: "F32", torch.int64: "I64"}[t.dtype], list(t.shape), raw(t))
        for name, t in tensors.items()
    ]
    return _n().write_shard(str(path), entries, {"k": "v"}, compress=compress, chunk_bytes=4096)


def sample() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(100, 70, generator=g), "step": torch.arange(10)}


@pytest.mark.parametrize("compress", [None, 3], ids=["plain", "zstd"])
def test_one_open_file_serves_header_and_ranges(tmp_path: Path, compress: int | None) -> None:
    tensors = sample()
    path = tmp_path / "r.shard"
    write(path, tensors, compress)
    with _n().ShardReader(str(path)) as reader:
        assert reader.path == str(path)
        assert not reader.closed
        header = reader.header()
        assert header["metadata"] == {"k": "v"}
        assert {k: (v["dtype"], v["shape"]) for k, v in header["tensors"].items()} == {
            "w": ("F32", [100, 70]),
            "step": ("I64", [10]),
        }
        # The file stays open and mapped: a new file renamed over the path, then removed,
        # changes nothing for the reader.
        write(tmp_path / "new.shard", {"other": torch.zeros(3)})
        (tmp_path / "new.shard").replace(path)
        path.unlink()
        w = raw(tensors["w"])
        for start, length in ((0, w.size), (4000, 200), (4095, 2), (27990, 10)):
            for verify in (True, False):
                out = np.zeros(length, dtype=np.uint8)
                reader.read_range("w", start, out, verify)
                np.testing.assert_array_equal(out, w[start : start + length])
        step = torch.empty(10, dtype=torch.int64)
        reader.read_range("step", 0, step)  # a contiguous CPU tensor as the buffer
        assert torch.equal(step, tensors["step"])
        buf = bytearray(8)
        reader.read_range(key="step", byte_offset=8, out_buffer=memoryview(buf), verify=True)
        assert bytes(buf) == raw(tensors["step"])[8:16].tobytes()
        reader.verify()
    assert reader.closed


def test_reads_from_threads_share_one_reader(tmp_path: Path) -> None:
    t = torch.randn(4 << 20)  # 16 MiB in 4 KiB chunks
    path = tmp_path / "big.shard"
    write(path, {"w": t}, compress=1)
    reader = _n().ShardReader(str(path))

    def body(i: int) -> None:
        for j in range(20):
            part = torch.empty(1000)
            k = (i * 20 + j) * 1000
            reader.read_range("w", k * 4, raw(part))
            assert torch.equal(part, t[k : k + 1000])

    in_threads(8, body)
    reader.close()


def test_closed_reader_refuses_every_call(tmp_path: Path) -> None:
    path = tmp_path / "c.shard"
    write(path, sample())
    reader = _n().ShardReader(str(path))
    reader.close()
    reader.close()  # twice is fine
    assert reader.closed
    assert "closed" in repr(reader)
    out = np.zeros(4, dtype=np.uint8)
    for call in (
        lambda: reader.read_range("w", 0, out),
        reader.header,
        reader.verify,
    ):
        with pytest.raises(InvalidArgumentError, match=r"c\.shard.*closed"):
            call()


@pytest.mark.parametrize("compress", [None, 3], ids=["plain", "zstd"])
def test_corrupt_file_raises_checkpoint_error(tmp_path: Path, compress: int | None) -> None:
    tensors = sample()
    path = tmp_path / "r00007.shard"
    result = write(path, tensors, compress)
    w = result["w"]
    with path.open("r+b") as f:
        f.seek(w["offset"] + w["stored_bytes"] // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x10]))
    with _n().ShardReader(str(path)) as reader:
        out = np.zeros(raw(tensors["w"]).size, dtype=np.uint8)
        with pytest.raises(CheckpointError, match=r"r00007\.shard.*tensor \"w\""):
            reader.read_range("w", 0, out)
        with pytest.raises(CheckpointError, match=r"r00007\.shard.*tensor \"w\""):
            reader.verify()
        step = torch.empty(10, dtype=torch.int64)  # the intact tensor still reads
        reader.read_range("step", 0, step)
        assert torch.equal(step, tensors["step"])


def test_truncated_or_missing_file_fails_on_open(tmp_path: Path) -> None:
    path = tmp_path / "t.shard"
    write(path, sample())
    data = path.read_bytes()
    for keep in (0, 7, 8, 100, len(data) - 1):
        path.write_bytes(data[:keep])
        with pytest.raises(CheckpointError, match=r"t\.shard"):
            _n().ShardReader(str(path))
    with pytest.raises(CheckpointError, match="no-such-file"):
        _n().ShardReader(str(tmp_path / "no-such-file"))


def test_bad_reads_raise_invalid_argument(tmp_path: Path) -> None:
    path = tmp_path / "x.shard"
    write(path, {"w": torch.randn(10)})
    with _n().ShardReader(str(path)) as reader:
        out = np.zeros(8, dtype=np.uint8)
        with pytest.raises(InvalidArgumentError, match="outside"):
            reader.read_range("w", 36, out)
        with pytest.raises(InvalidArgumentError, match="byte_offset must be >= 0"):
            reader.read_range("w", -1, out)
        with pytest.raises(InvalidArgumentError, match="no tensor named"):
            reader.read_range("v", 0, out)
        with pytest.raises(InvalidArgumentError, match="read-only"):
            reader.read_range("w", 0, bytes(8))


def _checkpoint(root: Path, parts: int = 3) -> tuple[Path, torch.Tensor]:
    """A committed checkpoint of one tensor ``w`` split over ``parts`` shard files."""
    t = torch.randn(parts * 1000)
    chunks = []
    files = {}
    for r in range(parts):
        fname = f"rank{r:05d}.safetensors"
        piece = t[r * 1000 : (r + 1) * 1000]
        info = write(root / fname, {f"w@{r * 1000}": piece})
        files[fname] = {"rank": r, "bytes": info["__file__"]["bytes"], "compressed": False}
        chunks.append(
            {"file": fname, "file_key": f"w@{r * 1000}", "start": r * 1000, "end": (r + 1) * 1000}
        )
    index = {
        "schema": SCHEMA,
        "files": files,
        "tensors": {"w": {"dtype": "F32", "shape": [parts * 1000], "chunks": chunks}},
    }
    (root / INDEX).write_text(json.dumps(index))
    (root / COMMIT).write_text("")
    return root, t


def test_checkpoint_keeps_one_reader_per_file_until_closed(tmp_path: Path) -> None:
    root, t = _checkpoint(tmp_path)
    with Checkpoint(root) as ck:
        out = torch.empty(2000)
        ck.read("w", out, 500)  # spans files 0, 1 and 2
        assert torch.equal(out, t[500:2500])
        readers = {f.name: ck.reader(f.name) for f in ck.files()}
        assert all(ck.reader(name) is r for name, r in readers.items())
        # Open files keep serving reads even once their paths are gone.
        for f in ck.files():
            f.unlink()
        jobs = [("w", torch.empty(100), k * 100) for k in range(30)]
        ck.read_many(jobs)  # a thread pool, one reader per file
        for _, part, start in jobs:
            assert torch.equal(part, t[start : start + 100])
        assert all(ck.reader(name) is r for name, r in readers.items())
    assert all(r.closed for r in readers.values())
    with pytest.raises(CheckpointError, match="closed"):
        ck.read("w", torch.empty(10), 0)
    ck.close()  # idempotent


def test_checkpoint_reports_a_corrupt_shard(tmp_path: Path) -> None:
    root, t = _checkpoint(tmp_path, parts=2)
    (root / "rank00001.safetensors").write_bytes(b"\x00" * 3)
    with Checkpoint(root) as ck:
        first = torch.empty(1000)
        ck.read("w", first, 0)
        assert torch.equal(first, t[:1000])
        with pytest.raises(CheckpointError, match=r"rank00001\.safetensors"):
            ck.read("w", torch.empty(1000), 1000)
