"""``Deferred``, the one handle of the backends over other libraries (gloo, NCCL, MPI)."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest

from shardline.comm.backends._deferred import DONE, Deferred
from shardline.comm.backends.mpi import MpiBackend
from shardline.errors import CollectiveTimeoutError, CommunicatorClosedError, ShardlineError


class FakeWork:
    """A torch ``Work``: records how it was waited for; fails if told to."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.waits: list[timedelta | None] = []
        self.fail = fail
        self.done = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.waits.append(timeout)
        if self.fail is not None:
            raise self.fail
        self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


def test_waits_every_work_then_runs_after_once_and_lets_go() -> None:
    works = [FakeWork(), FakeWork()]
    ran: list[int] = []
    buffer = object()
    handle = Deferred(works, after=lambda: ran.append(1), keep=(buffer,))
    assert not handle.is_completed()
    handle.wait(2.5)
    assert [w.waits for w in works] == [[timedelta(seconds=2.5)]] * 2
    handle.wait()
    assert ran == [1] and handle.is_completed()
    assert handle._works is None and handle._keep is None  # torch's Works and buffers freed
    assert works[0].waits == [timedelta(seconds=2.5)]  # not waited again


def test_a_failed_wait_is_translated_and_runs_nothing() -> None:
    ran: list[int] = []

    def translate(exc: RuntimeError) -> ShardlineError:
        return CommunicatorClosedError(f"translated: {exc}")

    handle = Deferred(
        [FakeWork(RuntimeError("NCCL error"))], after=lambda: ran.append(1), translate=translate
    )
    with pytest.raises(CommunicatorClosedError, match="translated: NCCL error") as info:
        handle.wait()
    assert isinstance(info.value.__cause__, RuntimeError) and ran == []
    # Without translate the library's error passes through; ours always do.
    with pytest.raises(RuntimeError, match="gloo"):
        Deferred([FakeWork(RuntimeError("gloo"))]).wait()
    ours = CollectiveTimeoutError("ours")
    with pytest.raises(CollectiveTimeoutError) as raised:
        Deferred([FakeWork(ours)], translate=translate).wait()
    assert raised.value is ours


def test_an_op_with_nothing_to_wait_for_is_complete() -> None:
    ran: list[int] = []
    handle = Deferred(after=lambda: ran.append(1))
    assert handle.is_completed()
    handle.wait()
    handle.wait()
    assert ran == [1]
    DONE.wait(1.0)
    assert DONE.is_completed()


# -- MPI: polled requests, with a fake MPI (mpi4py may be absent) -----------------------------


class FakeRequest:
    def __init__(self) -> None:
        self.done = False


class FakeMPI:
    class Exception(Exception):  # mpi4py's name
        pass

    class Request:
        tests = 0

        @staticmethod
        def Testall(requests: list[FakeRequest]) -> bool:  # mpi4py's name
            FakeMPI.Request.tests += 1
            return all(r.done for r in requests)


class FakeComm:
    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1


def _mpi(timeout: float) -> MpiBackend:
    return MpiBackend(FakeMPI, FakeComm(), name="world", timeout=timeout)


def test_mpi_requests_are_polled_until_done_then_after_runs() -> None:
    backend = _mpi(timeout=10)
    request = FakeRequest()
    ran: list[int] = []
    handle: Any = backend._start("all_reduce", lambda: [request], lambda: ran.append(1))
    assert not handle.is_completed()
    timer = threading.Timer(0.05, lambda: setattr(request, "done", True))
    timer.start()
    handle.wait()
    timer.join()
    assert ran == [1] and handle.is_completed()


def test_mpi_wait_times_out_and_names_the_op() -> None:
    handle: Any = _mpi(timeout=0.05)._start("broadcast", lambda: [FakeRequest()])
    with pytest.raises(CollectiveTimeoutError, match=r"broadcast on rank 0 \(mpi\) did not finish"):
        handle.wait()
    with pytest.raises(CollectiveTimeoutError, match=r"within 0\.0 s"):
        handle.wait(0.01)


def test_mpi_abort_fails_a_pending_wait_and_later_ops() -> None:
    backend = _mpi(timeout=10)
    handle: Any = backend._start("barrier", lambda: [FakeRequest()])
    threading.Timer(0.05, backend.abort, args=("test abort",)).start()
    with pytest.raises(CommunicatorClosedError, match=r"aborted \(test abort\)"):
        handle.wait()
    with pytest.raises(CommunicatorClosedError, match="aborted"):
        backend._start("barrier", lambda: [FakeRequest()])
