"""Fixtures: backends and transports to parametrise over, and a guard against leaked ranks."""

from __future__ import annotations

import gc
import importlib.util
import os
import threading
import time
from collections.abc import Iterator

import pytest

# MKL's strict reproducible mode, before anything multiplies: deterministic mode needs it and
# sets it itself in a process where MKL has not run yet, which this one is not by then.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

import torch

from tests._ranks import THREAD_PREFIX

HAVE_NATIVE = importlib.util.find_spec("shardline._native") is not None
# .ci/run sets this so a missing engine fails the run instead of skipping its tests.
REQUIRE_NATIVE = os.environ.get("SHARDLINE_REQUIRE_NATIVE") == "1"


def need_native() -> None:
    """Skips the calling test when the engine is not built (fails under .ci/run)."""
    if HAVE_NATIVE:
        return
    if REQUIRE_NATIVE:
        pytest.fail("shardline._native is not importable but SHARDLINE_REQUIRE_NATIVE=1")
    pytest.skip("shardline._native is not built (maturin develop --release)")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Moves what exists after collection (torch, every test module) out of the collector's
    sight: ``run_ranks``' ``gc.collect()`` after each run then walks only what tests made
    since, in milliseconds instead of 0.2 s (and so do the collector's own full passes)."""
    gc.collect()
    gc.freeze()


@pytest.fixture(params=["native", "gloo"])
def backend(request: pytest.FixtureRequest) -> str:
    """Every backend; native tests skip until the engine is built."""
    if request.param == "native":
        need_native()
    return str(request.param)


@pytest.fixture
def native() -> None:
    """Requires the native engine."""
    need_native()


@pytest.fixture(params=["shm", "tcp", "hier"])
def transport(request: pytest.FixtureRequest) -> str:
    """Every transport of the native engine, forced through host identities."""
    return str(request.param)


@pytest.fixture(autouse=True)
def _torch_threads_restored() -> Iterator[None]:
    """Puts torch's intra-op thread count back after each test. Rank bodies set it for the
    whole process (``torch.set_num_threads(1)``); left so, rank threads of later tests ran
    with one thread beside a main thread with two, and a reduction's order (BatchNorm's
    statistics) then differed between a test's reference and its ranks."""
    before = torch.get_num_threads()
    yield
    # Always: a count set in another thread changes what new threads start with, not what
    # this one reads.
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _no_leaked_ranks() -> Iterator[None]:
    before = {t.ident for t in threading.enumerate()}
    yield
    deadline = time.monotonic() + 5.0
    while True:
        leaked = [
            t.name
            for t in threading.enumerate()
            if t.ident not in before and t.name.startswith(THREAD_PREFIX) and t.is_alive()
        ]
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not leaked, f"rank threads still running after the test: {leaked}"


@pytest.fixture
def kernels_restored() -> Iterator[None]:
    """torch's kernel choices as they were: deterministic and repeatable modes turn torch's
    deterministic algorithms on (and their filling of new tensors off) for the process."""
    had, bench = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark
    fill = torch.utils.deterministic.fill_uninitialized_memory  # type: ignore[attr-defined]
    yield
    torch.use_deterministic_algorithms(had)
    torch.backends.cudnn.benchmark = bench
    torch.utils.deterministic.fill_uninitialized_memory = fill  # type: ignore[attr-defined]
