"""The torch.distributed backend "shardline": registration, torch's collectives, torch's DDP.

In-process tests drive ``ShardlineProcessGroup`` directly on ranks as threads (no torch global
state); everything that goes through ``torch.distributed.init_process_group`` runs in real
processes (``tests/multiprocess/_worker.py``'s ``torch_*`` scenarios), two ranks each.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardline.comm import torch_backend as tb
from shardline.comm.torch_backend.process_group import _reduce_op
from shardline.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    InvalidArgumentError,
    ShardlineError,
)
from tests._ranks import run_ranks
from tests.multiprocess._launch import Rank, report, run

pytestmark = pytest.mark.usefixtures("native")


# -- registration and argument checks ------------------------------------------------------------


def test_register_is_idempotent_and_leaves_the_cpu_default_to_gloo() -> None:
    assert tb.is_registered()
    assert tb.register() is True
    assert tb.register(strict=True) is True
    assert "shardline" in dist.Backend.backend_list
    assert dist.Backend("shardline") == "shardline"
    assert dist.Backend.default_device_backend_map.get("cpu") == "gloo"


def test_a_torch_without_the_needed_apis_gets_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert tb._missing_api() == []
    monkeypatch.delattr(dist, "_Work")
    assert tb._missing_api() == ["torch.distributed._Work"]
    monkeypatch.setattr(tb, "_registered", False)
    with pytest.raises(ShardlineError, match=r"lacks torch\.distributed\._Work"):
        tb.register(strict=True)
    assert tb.register() is False  # at import time: no exception, nothing re-registered
    assert dist.Backend._plugins["SHARDLINE"].creator_fn is tb._create_group


def test_torch_default_timeout_means_the_engine_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDLINE_TIMEOUT", "42")
    assert tb._engine_timeout(timedelta(minutes=30)) == 42.0  # torch's default: not a choice
    assert tb._engine_timeout(None) == 42.0
    assert tb._engine_timeout(timedelta(seconds=7)) == 7.0


@pytest.mark.parametrize(
    ("op", "name"),
    [
        (dist.ReduceOp.SUM, "sum"),
        (dist.ReduceOp.AVG, "avg"),
        (dist.ReduceOp.MAX, "max"),
        (dist.ReduceOp.MIN, "min"),
        (dist.ReduceOp.PRODUCT, "prod"),
        (dist.ReduceOp(dist.ReduceOp.MAX), "max"),
        (None, "sum"),
    ],
)
def test_torch_reduce_ops_map_to_engine_ops(op: object, name: str) -> None:
    opts = dist.AllreduceOptions()
    if op is not None:
        opts.reduceOp = op  # type: ignore[assignment]
    assert _reduce_op(opts, "allreduce") == name
    assert _reduce_op(op, "allreduce") == name


@pytest.mark.parametrize("op", ["BAND", "BOR", "BXOR", "PREMUL_SUM"])
def test_unsupported_reduce_ops_raise_naming_the_supported_ones(op: str) -> None:
    with pytest.raises(InvalidArgumentError, match=rf"does not support ReduceOp\.{op}.*PRODUCT"):
        _reduce_op(getattr(dist.ReduceOp, op), "allreduce")


class _FakeCuda(torch.Tensor):
    """A CPU tensor that reports a CUDA device (this machine may have no GPU)."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)


def _torch_pgs(
    n: int, body: Callable[[tb.ShardlineProcessGroup], object], op_timeout: float = 20.0
) -> list[Any]:
    """``run_ranks`` with every rank's group wrapped as a torch ProcessGroup."""
    return run_ranks(n, lambda g: body(tb.ShardlineProcessGroup(g)), op_timeout=op_timeout)


def test_cuda_and_other_devices_get_a_clear_error_before_anything_is_sent() -> None:
    def body(pg: tb.ShardlineProcessGroup) -> None:
        cuda = torch.ones(2).as_subclass(_FakeCuda)
        with pytest.raises(InvalidArgumentError, match=r"CPU tensors.*nccl"):
            pg.allreduce([cuda])
        with pytest.raises(InvalidArgumentError, match="nccl"):
            pg.all_gather_single(torch.empty(4), cuda)
        with pytest.raises(InvalidArgumentError, match=r"meta.*\.cpu\(\)"):
            pg.broadcast([torch.empty(2, device="meta")])
        t = torch.ones(2)
        pg.allreduce([t]).wait()  # nothing was sent above: the group is in step
        assert torch.equal(t, torch.full((2,), 2.0))

    _torch_pgs(2, body)


def test_several_tensors_bad_split_sizes_and_bad_tags_are_refused() -> None:
    def body(pg: tb.ShardlineProcessGroup) -> None:
        with pytest.raises(InvalidArgumentError, match=r"tag=-3 must be an integer from 0"):
            pg.send([torch.ones(1)], 1 - pg.rank(), -3)
        with pytest.raises(InvalidArgumentError, match="one tensor per process"):
            pg.allreduce([torch.ones(1), torch.ones(1)])
        with pytest.raises(InvalidArgumentError, match="split sizes"):
            pg.all_to_all_single(torch.empty(3), torch.empty(3), [1, 1], [1, 1])

    _torch_pgs(2, body)


# -- Work and future completion ---------------------------------------------------------------


def test_future_completes_without_wait_even_when_a_callback_blocks_on_a_later_op() -> None:
    """[Note: completion]: A's callback waits for B's future; B must still complete."""

    go = threading.Event()  # rank 1 joins once rank 0 has set up futures for pending ops

    def body(pg: tb.ShardlineProcessGroup) -> list[float]:
        if pg.rank() == 1:
            assert go.wait(20)
        a, b = torch.full((4,), 1.0 + pg.rank()), torch.full((4,), 10.0 * (pg.rank() + 1))
        work_a, work_b = pg.allreduce([a]), pg.allreduce([b])
        fut_a, fut_b = work_a.get_future(), work_b.get_future()
        seen: list[float] = []
        done = threading.Event()

        def after_a(_f: object) -> None:
            seen.append(float(fut_b.wait()[0][0]))  # blocks this completer thread on B
            done.set()

        fut_a.then(after_a)
        if pg.rank() == 0:
            assert not work_a.is_completed() and not fut_b.done()
            go.set()
        assert done.wait(20), "future B never completed while A's callback waited on it"
        assert fut_a.value()[0] is a and torch.equal(a, torch.full((4,), 3.0))
        assert work_a.is_completed() and work_b.is_completed()
        assert work_a.wait() and work_b.wait()
        return seen

    assert _torch_pgs(2, body) == [[30.0], [30.0]]


def test_get_future_after_the_op_finished_is_already_complete() -> None:
    def body(pg: tb.ShardlineProcessGroup) -> None:
        outs = [torch.empty(2) for _ in range(2)]
        work = pg.allgather([outs], [torch.full((2,), float(pg.rank()))])
        work.wait()
        fut = work.get_future()
        assert fut.done() and fut is work.get_future()
        assert [o.tolist() for o in fut.value()] == [[0.0, 0.0], [1.0, 1.0]]
        assert work.result() == outs and work.is_success() and work.exception() is None

    _torch_pgs(2, body)


@pytest.mark.parametrize("future_first", [False, True])
def test_wait_with_a_timeout_gives_up_while_the_op_keeps_running(future_first: bool) -> None:
    go = threading.Event()  # rank 1 joins once rank 0's wait has timed out

    def body(pg: tb.ShardlineProcessGroup) -> None:
        if pg.rank() == 1:
            assert go.wait(20)
        t = torch.full((3,), 1.0 + pg.rank())
        work = pg.allreduce([t])
        if future_first:
            work.get_future()  # a completer thread now waits for the op too
        if pg.rank() == 0:
            with pytest.raises(CollectiveTimeoutError):
                work.wait(timedelta(milliseconds=100))
            assert not work.is_completed()
            go.set()
        assert work.wait(timedelta(0)) is True  # torch's "no timeout"
        assert torch.equal(t, torch.full((3,), 3.0))

    _torch_pgs(2, body)


def test_a_failed_op_raises_through_wait_and_through_its_future() -> None:
    def body(pg: tb.ShardlineProcessGroup) -> str:
        work = pg.allreduce([torch.ones(4 if pg.rank() == 0 else 8)])
        fut = work.get_future()
        done = threading.Event()
        fut.then(lambda _f: done.set())
        assert done.wait(20)
        with pytest.raises(CollectiveMismatchError, match="all_reduce"):
            work.wait()
        with pytest.raises(Exception, match="all_reduce") as info:
            fut.wait()
        assert work.is_completed() and not work.is_success()
        assert isinstance(work.exception(), CollectiveMismatchError)
        return type(info.value).__name__

    names = _torch_pgs(2, body, op_timeout=10.0)
    assert names == ["CollectiveMismatchError"] * 2


def test_variable_all_to_all_and_list_outputs_on_threads() -> None:
    def body(pg: tb.ShardlineProcessGroup) -> None:
        r = pg.rank()
        # rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends 3 to rank 0, 0 to itself
        sends = [[1, 2], [3, 0]][r]
        recvs = [[1, 3], [2, 0]][r]
        src = torch.arange(sum(sends) * 2, dtype=torch.float32).view(-1, 2) + 100 * r
        dst = torch.empty(sum(recvs), 2)
        pg.all_to_all_single(dst, src, recvs, sends).wait()
        want = [
            [[0.0, 1.0], [100.0, 101.0], [102.0, 103.0], [104.0, 105.0]],
            [[2.0, 3.0], [4.0, 5.0]],
        ][r]
        assert dst.tolist() == want
        bad = [[1, 3], [2, 1]][r]  # rank 1 now expects a row from itself that it does not send
        with pytest.raises(InvalidArgumentError, match="rank 1 sends 0 elements to rank 1, which"):
            pg.all_to_all_single(torch.empty(sum(bad), 2), src, bad, sends)
        outs = [torch.empty(2) for _ in range(2)]
        ins = [torch.full((2,), float(r))] * 2
        pg.reduce_scatter([outs[0]], [ins], None).wait()
        assert outs[0].tolist() == [1.0, 1.0]
        # torch's layout: one list per rank, holding that rank's inputs in order.
        lists = [[torch.empty(1), torch.empty(3)] for _ in range(2)]
        work = pg.allgather_coalesced(
            lists, [torch.full((1,), r + 1.0), torch.full((3,), -1.0 * r)]
        )
        work.wait()
        assert [[t.tolist() for t in out] for out in lists] == [
            [[1.0], [0.0] * 3],
            [[2.0], [-1.0] * 3],
        ]
        with pytest.raises(InvalidArgumentError, match=r"2 lists \(one per rank\) of 2 tensors"):
            pg.allgather_coalesced([[torch.empty(1)] * 2], [torch.ones(1), torch.ones(3)])
        assert pg._get_backend(torch.device("cpu")) is pg
        with pytest.raises(RuntimeError, match="cuda"):
            pg._get_backend("cuda")

    _torch_pgs(2, body)


# -- real processes through torch.distributed -------------------------------------------------


def _ok(ranks: list[Rank]) -> None:
    assert all("OK" in r.out for r in ranks), report(ranks)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("init", "transport"), [("env", "shm"), ("store", "tcp")], ids=["env-shm", "store-tcp"]
)
def test_torch_distributed_collectives_on_shardline(init: str, transport: str) -> None:
    env = {"WORKER_INIT": init}
    per_rank = None
    if transport == "tcp":  # two simulated hosts: TCP, with a job secret
        env["SHARDLINE_SECRET"] = "torch-backend-test"
        per_rank = {0: {"SHARDLINE_HOST_ID": "sim-a"}, 1: {"SHARDLINE_HOST_ID": "sim-b"}}
    else:
        env["SHARDLINE_HOST_ID"] = "one-box"
    _ok(run(2, "torch_collectives", timeout=90, env=env, per_rank=per_rank))


@pytest.mark.multiprocess
def test_torch_distributed_errors_are_clear_and_do_not_hang() -> None:
    ranks = run(2, "torch_errors", timeout=90)
    _ok(ranks)
    assert all("ERROR CollectiveMismatchError" in r.out for r in ranks), report(ranks)
    if torch.cuda.is_available():  # real CUDA tensors were refused (on a GPU host)
        assert all("CUDA-CHECKED" in r.out for r in ranks), report(ranks)


@pytest.mark.multiprocess
def test_torch_ddp_on_shardline_matches_gloo_bitwise() -> None:
    ranks = run(2, "torch_ddp", timeout=100)
    _ok(ranks)
    for r in ranks:
        lines = [line for line in r.out.splitlines() if line.startswith("BUCKETS")]
        assert int(lines[0].split()[1]) >= 3, report(ranks)  # several buckets after rebuild
