"""Engine settings arrive as arguments: ``_native.Group`` takes and checks them, the native
backend passes what ``shardline.config`` read, and no Rust source reads the environment."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shardline.comm import ProcessGroup
from shardline.comm.backends import native as native_backend
from shardline.errors import InvalidArgumentError
from tests._ranks import run_ranks
from tests.conftest import need_native
from tests.test_native_setup import FakeEngine

RUST_SRC = Path(__file__).resolve().parents[1] / "rust" / "src"


def _n() -> Any:
    """The engine module, imported late so that a missing build skips instead of erroring."""
    need_native()
    import shardline._native as n

    return n


def _group(**settings: Any) -> Any:
    """A one-rank group with ``settings``."""
    return _n().Group(
        0,
        1,
        name="settings",
        secret=b"s",
        host_ids=["h"],
        addrs=[""],
        listener=None,
        arena_path=None,
        timeout=5.0,
        **settings,
    )


def test_group_takes_every_setting_and_none_keeps_the_default() -> None:
    for settings in (
        {},
        {"spin_us": None, "stream_stores": None, "oneshot_bytes": None},
        {"spin_us": 0, "stream_stores": "0", "oneshot_bytes": 0},
        {"spin_us": 7, "stream_stores": "1", "oneshot_bytes": 4096},
        {"spin_us": 50, "stream_stores": "2", "oneshot_bytes": 256 << 10},
    ):
        g = _group(**settings)
        t = np.arange(8, dtype=np.float32)
        g.all_reduce(t.view(np.uint8), "float32")
        assert np.array_equal(t, np.arange(8, dtype=np.float32)), settings
        g.close()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"spin_us": -1}, r"spin_us must be a number of microseconds >= 0, got -1"),
        ({"oneshot_bytes": -4096}, r"oneshot_bytes must be a number of bytes >= 0, got -4096"),
        ({"stream_stores": "3"}, r"stream_stores must be \"0\".*\"1\".*\"2\".*got \"3\""),
        ({"stream_stores": ""}, r"stream_stores must be"),
        ({"stream_stores": "on"}, r"stream_stores must be"),
    ],
)
def test_group_refuses_bad_settings_clearly(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        _group(**settings)


def test_group_refuses_settings_of_the_wrong_type() -> None:
    with pytest.raises(TypeError, match="stream_stores"):
        _group(stream_stores=2)
    with pytest.raises(TypeError, match="spin_us"):
        _group(spin_us="50")


def test_a_refused_setting_leaves_the_listener_usable() -> None:
    n = _n()
    listener = n.Listener()
    kw: dict[str, Any] = {
        "name": "settings",
        "secret": b"s",
        "host_ids": ["h"],
        "addrs": [listener.address],
        "listener": listener,
        "arena_path": None,
        "timeout": 5.0,
    }
    with pytest.raises(InvalidArgumentError):
        _n().Group(0, 1, **kw, spin_us=-1)
    g = n.Group(0, 1, **kw)
    g.close()


@pytest.mark.parametrize("stream_stores", ["0", "1", "2"])
def test_every_streaming_mode_reduces_correctly_on_shared_memory(stream_stores: str) -> None:
    """Two ranks (threads) on one arena; 1 MiB all_reduces are chunked, large enough to stream."""
    n = _n()
    path = f"/dev/shm/shardline-{os.getpid()}-settings-{stream_stores}"
    n.arena_create(path, 2, 1 << 20)
    out: list[Any] = [None, None]

    def rank(r: int) -> None:
        try:
            g = n.Group(
                r,
                2,
                name="streams",
                secret=b"s",
                host_ids=["h", "h"],
                addrs=["", ""],
                listener=None,
                arena_path=path,
                timeout=10.0,
                stream_stores=stream_stores,
                oneshot_bytes=0,
                spin_us=0,
            )
            t = torch.arange(1 << 18, dtype=torch.float32) + r
            g.all_reduce(t.view(torch.uint8).numpy(), "float32")
            g.close()
            out[r] = t
        except BaseException as exc:  # reported below
            out[r] = exc

    try:
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
    finally:
        n.arena_unlink(path)
    want = 2 * torch.arange(1 << 18, dtype=torch.float32) + 1
    for r, got in enumerate(out):
        assert isinstance(got, torch.Tensor), f"rank {r}: {got!r}"
        assert torch.equal(got, want), f"rank {r}"


def _group_kwargs(g: ProcessGroup) -> dict[str, Any]:
    return dict(g._impl._g.kw)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("env", "want"),
    [
        # No oneshot_bytes: the engine measures it (see the test below).
        ({}, {"spin_us": 50, "stream_stores": "2", "oneshot_bytes": None}),
        (
            {
                "SHARDLINE_SPIN_US": "7",
                "SHARDLINE_STREAM_STORES": "0",
                "SHARDLINE_ONESHOT_BYTES": "4096",
            },
            {"spin_us": 7, "stream_stores": "0", "oneshot_bytes": 4096},
        ),
    ],
)
def test_the_native_backend_passes_the_settings_it_read(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], want: dict[str, Any]
) -> None:
    engine = FakeEngine()  # records each Group's keyword arguments
    monkeypatch.setattr(native_backend, "_native_module", lambda: engine)
    monkeypatch.setenv("SHARDLINE_SHM_SLOT_BYTES", "65536")
    for name in ("SHARDLINE_SPIN_US", "SHARDLINE_STREAM_STORES", "SHARDLINE_ONESHOT_BYTES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for kw in run_ranks(2, _group_kwargs):
        assert {k: kw[k] for k in want} == want


def test_the_native_backend_refuses_a_bad_setting_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = FakeEngine()
    monkeypatch.setattr(native_backend, "_native_module", lambda: engine)
    monkeypatch.setenv("SHARDLINE_STREAM_STORES", "3")
    with pytest.raises(AssertionError, match=r"SHARDLINE_STREAM_STORES='3'"):
        run_ranks(1, _group_kwargs)


def test_settings_from_the_environment_reach_the_real_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    need_native()
    monkeypatch.setenv("SHARDLINE_SPIN_US", "0")
    monkeypatch.setenv("SHARDLINE_STREAM_STORES", "1")
    monkeypatch.setenv("SHARDLINE_ONESHOT_BYTES", "0")

    def body(g: ProcessGroup) -> torch.Tensor:
        assert g._impl._g.oneshot_bytes == 0  # type: ignore[attr-defined]
        t = torch.full((1 << 18,), float(g.rank))
        g.all_reduce(t)
        return t

    for t in run_ranks(2, body):
        assert torch.equal(t, torch.full((1 << 18,), 1.0))


def test_the_one_shot_limit_is_measured_when_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank of a group takes the same measured limit (rust/tests/shm_collectives.rs
    checks that either algorithm gives the same bits)."""
    need_native()
    monkeypatch.delenv("SHARDLINE_ONESHOT_BYTES", raising=False)

    def body(g: ProcessGroup) -> int:
        g.all_reduce(torch.ones(4))  # the first all-reduce measures
        return g._impl._g.oneshot_bytes  # type: ignore[attr-defined,no-any-return]

    limits = run_ranks(2, body)
    assert limits[0] == limits[1]
    assert 0 <= limits[0] <= 256 << 10


def test_no_rust_source_reads_the_environment() -> None:
    """One settings table: settings are read in ``shardline.config`` and passed down."""
    reads = re.compile(r"\benv::var|\benv::vars\b|\bgetenv\b|\bvar_os\b")
    found = [
        f"{path.relative_to(RUST_SRC)}:{i}: {line.strip()}"
        for path in sorted(RUST_SRC.rglob("*.rs"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if reads.search(line)
    ]
    assert RUST_SRC.is_dir()
    assert not found, "Rust reads the environment:\n" + "\n".join(found)
