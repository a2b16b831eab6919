"""Checkpoint shard files: torch tensors round-trip through the engine's writer and reader,
plain files are real safetensors files, and corrupt or hostile files raise CheckpointError."""

from __future__ import annotations

import contextlib
import functools
import json
import struct
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardline import dtypes
from shardline.errors import CheckpointError, InvalidArgumentError
from tests.conftest import need_native

# The names are safetensors' own (its package is the oracle: files must load with it).
SAFETENSORS_DTYPES = dtypes.FILE_DTYPES


@pytest.fixture(autouse=True)
def _engine() -> None:
    need_native()


def _n() -> Any:
    """The engine module, imported late so that a missing build skips instead of erroring."""
    import shardline._native as n

    return n


def in_threads(n: int, body: Callable[[int], None]) -> None:
    """``body(i)`` on ``n`` threads at once; fails with every thread's error."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            body(i)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors


def raw(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a uint8 numpy view (zero copy, works for bf16 and fp8)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality with dtype and shape."""
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(raw(a), raw(b))


def entry(name: str, t: torch.Tensor) -> tuple[str, str, list[int], np.ndarray]:
    return (name, SAFETENSORS_DTYPES[t.dtype], list(t.shape), raw(t))


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "layers.0.weight": torch.randn(300, 70, generator=g),  # 84,000 bytes: many chunks
        "layers.0.bias": torch.randn(70, generator=g).to(torch.bfloat16),
        "smooth.bf16": torch.linspace(-3, 3, 5000).sin().to(torch.bfloat16),
        "half": torch.randn(33, generator=g).to(torch.float16),
        "double": torch.randn(2, 3, generator=g).to(torch.float64),
        "step": torch.tensor(12345, dtype=torch.int64),
        "ids": torch.randint(-(2**31), 2**31 - 1, (17,), generator=g, dtype=torch.int32),
        "short": torch.randint(-100, 100, (5,), generator=g, dtype=torch.int16),
        "bytes": torch.randint(0, 256, (1001,), generator=g, dtype=torch.uint8),
        "signed": torch.randint(-128, 127, (9,), generator=g, dtype=torch.int8),
        "mask": torch.rand(13, generator=g) > 0.5,
        "fp8": torch.randn(40, generator=g).to(torch.float8_e4m3fn),
        "fp8b": torch.randn(40, generator=g).to(torch.float8_e5m2),
        "empty": torch.empty(0, 5),
    }


def write(
    path: Path, tensors: dict[str, torch.Tensor], compress: int | None = None, **kw: int
) -> dict[str, Any]:
    return _n().write_shard(  # type: ignore[no-any-return]
        str(path),
        [entry(k, v) for k, v in tensors.items()],
        {"step": "7", "format": "pt"},
        compress=compress,
        **kw,
    )


def read_header(path: Path) -> dict[str, Any]:
    """The file's validated header, from a ``ShardReader`` opened for it."""
    with _n().ShardReader(str(path)) as reader:
        return reader.header()  # type: ignore[no-any-return]


def read_range(path: Path, name: str, start: int, out: Any, verify: bool = True) -> None:
    """One ``read_range`` from a ``ShardReader`` opened for it."""
    with _n().ShardReader(str(path)) as reader:
        reader.read_range(name, start, out, verify)


def verify_file(path: Path) -> None:
    """``ShardReader.verify`` of a reader opened for it."""
    with _n().ShardReader(str(path)) as reader:
        reader.verify()


def read(path: Path, name: str, like: torch.Tensor, verify: bool = True) -> torch.Tensor:
    out = torch.empty_like(like).contiguous()
    read_range(path, name, 0, raw(out), verify)
    return out


@pytest.mark.parametrize("compress", [None, 3], ids=["plain", "zstd"])
def test_torch_tensors_round_trip(tmp_path: Path, compress: int | None) -> None:
    tensors = sample_tensors()
    path = tmp_path / "r00000.shard"
    result = write(path, tensors, compress, chunk_bytes=4096)
    assert result["__file__"]["bytes"] == path.stat().st_size
    assert result["__file__"]["header_bytes"] % 4096 == 0
    header = read_header(path)
    assert header["metadata"] == {"step": "7", "format": "pt"}
    assert list(header["tensors"]) == list(tensors)  # file order = the caller's order
    for name, t in tensors.items():
        info = header["tensors"][name]
        assert info["dtype"] == SAFETENSORS_DTYPES[t.dtype]
        assert info["shape"] == list(t.shape)
        assert info["raw_bytes"] == t.nbytes == result[name]["raw_bytes"]
        assert info["offset"] == result[name]["offset"]
        assert info["stored_bytes"] == result[name]["stored_bytes"]
        assert info["compressed"] is (compress is not None)
        assert len(result[name]["crc32c"]) == -(-t.nbytes // 4096)
        back = read(path, name, t)
        assert same(back, t), name
    verify_file(path)


@pytest.mark.parametrize("compress", [None, 1], ids=["plain", "zstd"])
@pytest.mark.parametrize(("start", "length"), [(0, 1), (4000, 200), (4095, 2), (83990, 10)])
def test_partial_ranges(tmp_path: Path, compress: int | None, start: int, length: int) -> None:
    t = torch.randn(300, 70)
    path = tmp_path / "w.shard"
    write(path, {"w": t}, compress, chunk_bytes=4096)
    expected = raw(t)[start : start + length]
    for verify in (True, False):
        out = np.zeros(length, dtype=np.uint8)
        read_range(path, "w", start, out, verify)
        np.testing.assert_array_equal(out, expected)
    # A memoryview and a bytearray work as well as a numpy array.
    buf = bytearray(length)
    read_range(path, "w", start, memoryview(buf))
    assert bytes(buf) == expected.tobytes()


def test_reads_into_a_tensor_and_from_threads(tmp_path: Path) -> None:
    t = torch.randn(4 << 20)  # 16 MiB: a parallel read of 256 frames of 64 KiB
    path = tmp_path / "w.shard"
    write(path, {"w": t}, 1, chunk_bytes=1 << 16)
    out = torch.empty_like(t)
    read_range(path, "w", 0, out)  # a contiguous CPU tensor as the buffer
    assert torch.equal(out, t)

    def body(i: int) -> None:
        part = torch.empty(1000)
        read_range(path, "w", i * 4000, raw(part))
        assert torch.equal(part, t[i * 1000 : (i + 1) * 1000])

    in_threads(8, body)


def test_large_plain_reads_check_every_chunk(tmp_path: Path) -> None:
    """Plain pieces of 256 KiB and more are read with pread (the 4 MiB default chunks): whole
    and partial ranges return the stored bytes, and a flipped byte fails its chunk only."""
    t = torch.randn(5 << 20)  # 20 MiB: five 4 MiB chunks
    path = tmp_path / "big.shard"
    result = write(path, {"w": t})
    expected = raw(t)
    for start, length in ((0, t.nbytes), (1 << 20, 6 << 20), ((4 << 20) - 5, 300 << 10)):
        out = np.zeros(length, dtype=np.uint8)
        read_range(path, "w", start, out)
        np.testing.assert_array_equal(out, expected[start : start + length])
    flip = result["w"]["offset"] + (9 << 20) + 123  # inside chunk 2: bytes [8, 12) MiB
    with path.open("r+b") as f:
        f.seek(flip)
        byte = f.read(1)
        f.seek(flip)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(CheckpointError, match=r"big\.shard.*tensor \"w\".*chunk 2"):
        read(path, "w", t)
    with pytest.raises(CheckpointError, match="chunk 2"):  # a partial range in that chunk
        read_range(path, "w", 8 << 20, np.zeros(512 << 10, dtype=np.uint8))
    out = np.zeros(4 << 20, dtype=np.uint8)  # chunk 3 is intact
    read_range(path, "w", 12 << 20, out)
    np.testing.assert_array_equal(out, expected[12 << 20 : 16 << 20])
    back = read(path, "w", t, verify=False)  # unverified: the stored bytes, flip included
    np.testing.assert_array_equal(raw(back)[: 9 << 20], expected[: 9 << 20])
    assert raw(back)[(9 << 20) + 123] == expected[(9 << 20) + 123] ^ 0x01


def test_plain_files_are_safetensors(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    tensors = sample_tensors()
    path = tmp_path / "r00000-of-00002.safetensors"
    write(path, tensors)
    loaded = load_file(str(path))
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert same(loaded[name], t), name
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    assert meta["step"] == "7"
    ours = json.loads(meta["shardline"])
    assert ours["version"] == 1
    assert len(ours["tensors"]["layers.0.weight"]["crc32c"]) == 1  # 84,000 B < 4 MiB


def test_compressed_files_make_safetensors_fail_loudly(tmp_path: Path) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors = {"smooth": torch.linspace(0, 1, 100_000)}
    path = tmp_path / "r00000.zst.xt"
    result = write(path, tensors, compress=3)
    assert result["smooth"]["stored_bytes"] < result["smooth"]["raw_bytes"] // 2
    with pytest.raises(SafetensorError):
        load_file(str(path))


@pytest.mark.parametrize("compress", [None, 1], ids=["plain", "zstd"])
def test_flipped_byte_raises_checkpoint_error(tmp_path: Path, compress: int | None) -> None:
    tensors = {"a": torch.randn(1000), "b": torch.randn(3000)}
    path = tmp_path / "r00003.shard"
    result = write(path, tensors, compress, chunk_bytes=4096)
    b = result["b"]
    with path.open("r+b") as f:
        f.seek(b["offset"] + b["stored_bytes"] // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CheckpointError, match=r"r00003\.shard.*tensor \"b\""):
        read(path, "b", tensors["b"])
    with pytest.raises(CheckpointError, match=r"r00003\.shard.*tensor \"b\""):
        verify_file(path)
    assert torch.equal(read(path, "a", tensors["a"]), tensors["a"])
    if compress is None:
        # Unverified reads return what is stored; a range in an intact chunk verifies.
        read(path, "b", tensors["b"], verify=False)
        out = np.zeros(16, dtype=np.uint8)
        read_range(path, "b", 0, out)


def test_truncated_file_raises_checkpoint_error(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    t = torch.randn(5000)
    write(path, {"w": t})
    data = path.read_bytes()
    for keep in (0, 7, 8, 100, len(data) - 1):
        path.write_bytes(data[:keep])
        with pytest.raises(CheckpointError, match=r"t\.safetensors"):
            read_header(path)
        with pytest.raises(CheckpointError):
            read(path, "w", t)
    with pytest.raises(CheckpointError, match="no-such-file"):
        read_header(tmp_path / "no-such-file")


def test_bad_arguments_raise_invalid_argument(tmp_path: Path) -> None:
    path = tmp_path / "x.shard"
    t = torch.randn(10)
    n = _n()
    with pytest.raises(InvalidArgumentError, match=r"tensor \"w\".* needs 44 bytes"):
        n.write_shard(str(path), [("w", "F32", [11], raw(t))], {})
    with pytest.raises(InvalidArgumentError, match="unsupported dtype"):
        n.write_shard(str(path), [("w", "float32", [10], raw(t))], {})
    with pytest.raises(InvalidArgumentError, match="reserved"):
        n.write_shard(str(path), [("w", "F32", [10], raw(t))], {"shardline": "x"})
    with pytest.raises(InvalidArgumentError, match="tensors\\[0\\]"):
        n.write_shard(str(path), [("w", "F32", [10])], {})
    with pytest.raises(InvalidArgumentError, match=">= 0"):
        n.write_shard(str(path), [("w", "F32", [-10], raw(t))], {})
    with pytest.raises(InvalidArgumentError, match="zstd level"):
        n.write_shard(str(path), [], {}, compress=99)
    n.write_shard(str(path), [("w", "F32", [10], raw(t))], {})
    out = np.zeros(8, dtype=np.uint8)
    with pytest.raises(InvalidArgumentError, match="outside"):
        read_range(path, "w", 36, out)
    with pytest.raises(InvalidArgumentError, match=">= 0"):
        read_range(path, "w", -1, out)
    with pytest.raises(InvalidArgumentError, match="no tensor named"):
        read_range(path, "v", 0, out)
    with pytest.raises(InvalidArgumentError, match="read-only"):
        read_range(path, "w", 0, bytes(8))


# Hostile headers: whatever the bytes, opening a ShardReader raises CheckpointError or the
# header validates.


@pytest.fixture(scope="module")
def scratch_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hostile")


def _check_hostile(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    try:
        header = read_header(path)
    except CheckpointError:
        return
    # A header that validates must be readable without crashing.
    for name, info in header["tensors"].items():
        out = np.zeros(min(info["raw_bytes"], 1 << 16), dtype=np.uint8)
        for verify in (True, False):
            with contextlib.suppress(CheckpointError):
                read_range(path, name, 0, out, verify)


@functools.cache
def valid_files() -> tuple[bytes, bytes]:
    """A small valid shard, plain and compressed."""
    tensors = {"a": torch.randn(100), "b": torch.arange(50), "c": torch.ones(3, 3)}
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "v.shard"
        write(path, tensors, chunk_bytes=128)
        plain = path.read_bytes()
        write(path, tensors, compress=1, chunk_bytes=128)
        return plain, path.read_bytes()


# Bytes that keep JSON text plausible (names, dtypes, numbers, structure).
SUBSTITUTES = b'abcFIU8_ 0123456789[]{},:"'

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
dtypes = st.sampled_from(["F32", "U8", "BF16", "SHARDLINE_ZSTD", "C64", "", 3])
tensor_entries = st.fixed_dictionaries(
    {
        "dtype": dtypes,
        "shape": st.lists(st.integers(-2, 2**40), max_size=3),
        "data_offsets": st.lists(st.integers(-1, 2**20), max_size=3),
    }
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.binary(max_size=300))
def test_random_bytes_raise_only_checkpoint_error(scratch_dir: Path, data: bytes) -> None:
    _check_hostile(scratch_dir / "random.bin", data)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    header=st.dictionaries(st.text(max_size=6), tensor_entries | json_values, max_size=4),
    metadata=st.none() | json_values | st.dictionaries(st.text(max_size=4), st.text(max_size=40)),
    data_len=st.integers(0, 64),
    length_delta=st.sampled_from([0, 0, 0, -1, 1, 2**40]),
)
def test_random_headers_raise_only_checkpoint_error(
    scratch_dir: Path, header: dict[str, object], metadata: object, data_len: int, length_delta: int
) -> None:
    if metadata is not None:
        header = {**header, "__metadata__": metadata}
    text = json.dumps(header).encode()
    length = max(0, len(text) + length_delta)
    _check_hostile(scratch_dir / "json.bin", struct.pack("<Q", length) + text + bytes(data_len))


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    compressed=st.booleans(),
    edits=st.lists(st.tuples(st.integers(0, 2**32), st.integers(0, 255)), min_size=1, max_size=3),
    keep=st.sampled_from([None, None, None, None, None, 0.0, 0.3, 0.9, 0.999]),
)
def test_corrupted_headers_raise_only_checkpoint_error(
    scratch_dir: Path,
    compressed: bool,
    edits: list[tuple[int, int]],
    keep: float | None,
) -> None:
    data = bytearray(valid_files()[compressed])
    (n,) = struct.unpack("<Q", data[:8])
    json_end = data.rindex(b"}", 0, 8 + n) + 1
    for where, value in edits:
        # Mostly the JSON, where the structure lives; else anywhere (data: checksums).
        i = where % len(data) if value % 3 == 0 else 8 + where % (json_end - 8)
        if chr(data[i]).isdigit() and value % 5:
            data[i] = ord("0") + value % 10  # numbers stay numbers: many mutants still parse
        elif value % 4:
            data[i] = SUBSTITUTES[value % len(SUBSTITUTES)]
        else:
            data[i] = value
    if keep is not None:
        del data[int(keep * len(data)) :]
    _check_hostile(scratch_dir / "corrupt.bin", bytes(data))
