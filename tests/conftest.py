"""Fixtures: backends and transports to parametrise over, and a guard against leaked ranks."""

from __future__ import annotations

import fcntl
import gc
import importlib.util
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

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


# In-process tests with wall-clock bounds (an error within 5 s, a 3 s deadline that covers
# the group's set-up, a pace): they count as tests of processes here, so that they never
# run beside a test whose processes are starting.
_TIMED_FILES = {"test_errors.py", "test_async_sgd.py", "test_activation_checkpoint.py"}


def _of_processes(item: pytest.Item) -> bool:
    return item.get_closest_marker("multiprocess") is not None or item.path.name in _TIMED_FILES


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``pytest -n 2`` the tests in ``tests/multiprocess/`` and
    the timed files go to one worker as one unit, one after another as without xdist; every
    other test is a unit of its own. (``--dist loadgroup`` would do this from marks, but
    pytest 9 ignores the node ids xdist 3.8 rewrites for it.)"""
    from xdist.scheduler import LoadScopeScheduling

    class Scheduler(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if path.startswith("tests/multiprocess/") or path.rpartition("/")[2] in _TIMED_FILES:
                return "processes"
            return nodeid

    return Scheduler(config, log)


@pytest.fixture(autouse=True)
def _one_test_of_processes_at_a_time(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """The few tests of processes outside that unit (marked ``multiprocess`` in other files)
    wait for the machine here: a lock shared by the session's xdist workers."""
    if not _of_processes(request.node):
        yield
        return
    with open(tmp_path_factory.getbasetemp().parent / "shardline-processes.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


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
