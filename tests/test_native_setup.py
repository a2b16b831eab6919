"""The native backend's setup through the store, checked against a fake engine.

The fake stands in for ``shardline._native`` and records what the real one would be given:
host ids, listeners and addresses, arena creation/unlink order, secret.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from shardline.comm import ProcessGroup
from shardline.comm.backends import native as native_backend
from shardline.errors import ShardlineError
from tests._ranks import SECRET, host_ids, run_ranks


class FakeEngine:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.live: set[str] = set()
        self.created: list[tuple[str, int, int]] = []
        self.unlinked: list[str] = []
        self.sweeps = 0
        self.ports = 40000
        engine = self

        class Listener:
            def __init__(self, host: str = "127.0.0.1") -> None:
                with engine.lock:
                    engine.ports += 1
                    self.address = f"{host}:{engine.ports}"

        class Group:
            def __init__(self, rank: int, world_size: int, **kw: Any) -> None:
                path = kw["arena_path"]
                with engine.lock:
                    assert path is None or path in engine.live, "arena unlinked before mapping"
                self.rank, self.world_size, self.kw = rank, world_size, kw
                self.transport = "fake"
                self.closed = False

            def close(self) -> None:
                self.closed = True

            def abort(self, reason: str) -> None:
                pass

        self.Listener, self.Group = Listener, Group

    def arena_sweep(self, directory: str = "/dev/shm") -> int:
        with self.lock:
            self.sweeps += 1
        return 0

    def arena_create(self, path: str, num_ranks: int, slot_bytes: int) -> None:
        with self.lock:
            self.live.add(path)
            self.created.append((path, num_ranks, slot_bytes))

    def arena_unlink(self, path: str) -> None:
        with self.lock:
            self.live.remove(path)
            self.unlinked.append(path)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeEngine:
    engine = FakeEngine()
    monkeypatch.setattr(native_backend, "_native_module", lambda: engine)
    monkeypatch.delenv("SHARDLINE_BIND_ADDR", raising=False)
    monkeypatch.setenv("SHARDLINE_SHM_SLOT_BYTES", "65536")
    return engine


def _kwargs(g: ProcessGroup) -> SimpleNamespace:
    return SimpleNamespace(**g._impl._g.kw)  # type: ignore[attr-defined]


@pytest.mark.parametrize("transport", ["shm", "tcp", "hier"])
@pytest.mark.parametrize("world", [1, 2, 5])
def test_setup_publishes_hosts_addresses_and_arenas(
    fake: FakeEngine, transport: str, world: int
) -> None:
    got = run_ranks(world, _kwargs, transport=transport)
    ids = host_ids(world, transport)
    hosts = sorted(set(ids))
    for r, kw in enumerate(got):
        assert kw.host_ids == ids
        assert kw.secret == SECRET
        assert kw.name == "world"
        assert kw.timeout == 20.0
        # Every group of two or more ranks gets TCP links (send/recv, and collectives across
        # hosts); a single-host job binds loopback.
        assert (kw.listener is not None) == (world > 1)
        if world > 1:
            assert kw.addrs == got[0].addrs
            assert len(set(kw.addrs)) == world
            assert kw.addrs[r].startswith("127.0.0.1:")
        local = [k for k in range(world) if ids[k] == ids[r]]
        if len(local) >= 2:
            assert kw.arena_path == got[local[0]].arena_path
            assert kw.arena_path.startswith("/dev/shm/shardline-")
        else:
            assert kw.arena_path is None
    # One arena per host with two or more ranks, sized for them, all unlinked after setup.
    expected = [ids.count(h) for h in hosts if ids.count(h) >= 2]
    assert sorted(n for _, n, _ in fake.created) == sorted(expected)
    assert all(slot == 65536 for _, _, slot in fake.created)
    assert fake.sweeps == len(expected)
    assert not fake.live
    assert sorted(fake.unlinked) == sorted(p for p, _, _ in fake.created)


def test_subgroups_get_their_own_arena_and_name(fake: FakeEngine) -> None:
    def body(g: ProcessGroup) -> tuple[str, str | None] | None:
        sub = g.new_group([1, 2, 3])
        return None if sub is None else (_kwargs(sub).name, _kwargs(sub).arena_path)

    got = run_ranks(4, body)
    assert got[0] is None
    assert {x[0] for x in got[1:] if x} == {"world.0"}
    assert len({x[1] for x in got[1:] if x}) == 1
    assert len(fake.created) == 2
    assert not fake.live


def test_generated_secret_is_shared_on_one_host(fake: FakeEngine) -> None:
    def body(g: ProcessGroup) -> bytes:
        return bytes(_kwargs(g).secret)

    got = run_ranks(3, body, secrets=[None, None, None])  # None: resolve from the env
    assert len(got[0]) == 32
    assert got[0] == got[1] == got[2]


def test_bind_address_prefers_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDLINE_BIND_ADDR", "10.9.8.7")
    assert native_backend.bind_address("127.0.0.1") == "10.9.8.7"
    monkeypatch.delenv("SHARDLINE_BIND_ADDR")
    assert native_backend.bind_address("127.0.0.1") == "127.0.0.1"


def test_missing_engine_says_how_to_build(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_native(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "shardline" and args and args[2] and "_native" in args[2]:
            raise ImportError("no engine")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_native)
    with pytest.raises(Exception, match="maturin develop"):
        native_backend._native_module()


@pytest.mark.parametrize(
    ("cores", "machine_ranks", "threads", "min_bytes", "slot"),
    [
        (16, 2, 4, native_backend.THREADS_MIN_BYTES, native_backend.THREADS_SLOT_BYTES),
        (16, 4, 4, native_backend.THREADS_MIN_BYTES, native_backend.THREADS_SLOT_BYTES),
        (64, 2, 4, native_backend.THREADS_MIN_BYTES, native_backend.THREADS_SLOT_BYTES),
        (16, 8, 1, native_backend.FEW_THREADS_MIN_BYTES, native_backend.DEFAULT_SLOT_BYTES),
        (12, 4, 1, native_backend.FEW_THREADS_MIN_BYTES, native_backend.DEFAULT_SLOT_BYTES),
        (16, 16, 1, native_backend.FEW_THREADS_MIN_BYTES, native_backend.DEFAULT_SLOT_BYTES),
        (2, 2, 1, native_backend.FEW_THREADS_MIN_BYTES, native_backend.FEW_CORES_SLOT_BYTES),
    ],
)
def test_helper_threads_take_the_cores_the_ranks_leave(
    monkeypatch: pytest.MonkeyPatch,
    cores: int,
    machine_ranks: int,
    threads: int,
    min_bytes: int,
    slot: int,
) -> None:
    monkeypatch.setattr(native_backend.os, "sched_getaffinity", lambda _pid: set(range(cores)))
    for var in ("SHARDLINE_COMM_THREADS", "SHARDLINE_COMM_THREADS_MIN_BYTES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("SHARDLINE_SHM_SLOT_BYTES", raising=False)
    assert native_backend.comm_threads(machine_ranks) == threads
    assert native_backend.comm_threads_min_bytes(threads) == min_bytes
    assert native_backend._slot_bytes(machine_ranks, threads) == slot
    monkeypatch.setenv("SHARDLINE_COMM_THREADS", "2")
    monkeypatch.setenv("SHARDLINE_COMM_THREADS_MIN_BYTES", "0")
    assert native_backend.comm_threads(machine_ranks) == 2
    assert native_backend.comm_threads_min_bytes(2) == 0


def test_helper_threads_count_the_jobs_ranks_on_the_node(
    fake: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group of 2 ranks gets 4 helper threads each on 16 cores, unless the job has more
    ranks on the node (LOCAL_WORLD_SIZE): a sub-group's ranks share the cores with them."""
    monkeypatch.setattr(native_backend.os, "sched_getaffinity", lambda _pid: set(range(16)))
    monkeypatch.delenv("SHARDLINE_COMM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert [kw.comm_threads for kw in run_ranks(2, _kwargs)] == [4, 4]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert [kw.comm_threads for kw in run_ranks(2, _kwargs)] == [1, 1]


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("SHARDLINE_COMM_THREADS", "0"),
        ("SHARDLINE_COMM_THREADS", "four"),
        ("SHARDLINE_COMM_THREADS_MIN_BYTES", "-1"),
        ("SHARDLINE_SHM_SLOT_BYTES", "1000"),
    ],
)
def test_bad_engine_settings_are_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str
) -> None:
    monkeypatch.setenv(var, value)
    read = {
        "SHARDLINE_COMM_THREADS": lambda: native_backend.comm_threads(2),
        "SHARDLINE_COMM_THREADS_MIN_BYTES": lambda: native_backend.comm_threads_min_bytes(2),
        "SHARDLINE_SHM_SLOT_BYTES": lambda: native_backend._slot_bytes(2, 1),
    }[var]
    with pytest.raises(ShardlineError, match=f"{var}='{value}' must be an integer of at least"):
        read()


@pytest.mark.parametrize(
    ("cores", "local_ranks", "expected"),
    [
        (16, 8, native_backend.DEFAULT_SLOT_BYTES),
        (16, 16, native_backend.DEFAULT_SLOT_BYTES),
        (16, 32, native_backend.FEW_CORES_SLOT_BYTES),
        (2, 2, native_backend.FEW_CORES_SLOT_BYTES),
    ],
)
def test_slot_size_follows_the_machine_unless_set(
    monkeypatch: pytest.MonkeyPatch, cores: int, local_ranks: int, expected: int
) -> None:
    monkeypatch.setattr(native_backend.os, "sched_getaffinity", lambda _pid: set(range(cores)))
    monkeypatch.delenv("SHARDLINE_SHM_SLOT_BYTES", raising=False)
    assert native_backend._slot_bytes(local_ranks) == expected
    monkeypatch.setenv("SHARDLINE_SHM_SLOT_BYTES", "65536")
    assert native_backend._slot_bytes(local_ranks) == 65536
