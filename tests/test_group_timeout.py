"""A group carries its timeout, and the waits of work on the group honour it.

Oracles: the timeout given at creation (``init``, ``init_process_group``, ``new_group``,
``DeviceMesh``), and the wall clock: with ``SHARDLINE_TIMEOUT=300`` in the environment, a rank
that never arrives ends a checkpoint's commit or an async SGD round after the group's few
seconds, with an error that names them, not after 300.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardline as sl
from shardline import checkpoint
from shardline.checkpoint import api as checkpoint_api
from shardline.comm import ProcessGroup
from shardline.comm.mesh import DeviceMesh
from shardline.errors import CheckpointError, CollectiveTimeoutError, InvalidArgumentError
from tests._ranks import run_ranks, seeded

GROUP_S = 2.0  # the group's timeout in the tests that wait for a rank that never arrives
LATE_S = 8.0  # the most such a wait may take beyond it (a loaded 2-core machine)
HELD_S = 25.0  # how long a held-back rank waits to be released (the test fails before)
HARD_S = 45.0  # every multi-rank test's hard timeout


@pytest.fixture
def env_timeout_300(monkeypatch: pytest.MonkeyPatch) -> None:
    """``SHARDLINE_TIMEOUT=300``: a wait that reads it instead of the group's takes 300 s."""
    monkeypatch.setenv("SHARDLINE_TIMEOUT", "300")


# -- the group's timeout -----------------------------------------------------------------------


def test_a_group_carries_its_timeout_and_sub_groups_inherit_it() -> None:
    def body(g: ProcessGroup) -> None:
        assert g.timeout == 7.5
        sub = g.new_group([0, 1])
        assert sub is not None and sub.timeout == 7.5
        given = g.new_group([0, 1], timeout=3)
        assert given is not None and given.timeout == 3.0
        nested = given.new_group([1, 0])
        assert nested is not None and nested.timeout == 3.0
        as_delta = g.new_group([0, 1], timeout=timedelta(seconds=4))
        assert as_delta is not None and as_delta.timeout == 4.0
        mesh = DeviceMesh({"dp": 1, "tp": 2}, group=g)
        assert mesh.group("tp").timeout == 7.5 and mesh.group("dp").timeout == 7.5
        short = DeviceMesh((2,), group=g, timeout=1.5)
        assert short.group(0).timeout == 1.5
        with pytest.raises(InvalidArgumentError, match="timeout must be positive"):
            g.new_group([0, 1], timeout=0)

    run_ranks(2, body, backend="gloo", op_timeout=7.5, timeout=HARD_S)


def test_init_gives_the_default_group_its_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("SHARDLINE_TIMEOUT", "90")
    # Long enough for the rendezvous too (rank 0 connects to the store it hosts within the
    # timeout, which took over 4 s once on a loaded CI machine); distinct, so each is seen.
    for given, want in ((25.5, 25.5), (timedelta(seconds=40), 40.0), (None, 90.0)):
        group = sl.init(backend="gloo", timeout=given)
        try:
            assert group.timeout == want
            assert sl.new_group([0]).timeout == want  # type: ignore[union-attr]
            assert DeviceMesh({"x": 1}).group("x").timeout == want
        finally:
            sl.shutdown()


@pytest.mark.usefixtures("native")
def test_a_sub_group_given_a_timeout_times_out_by_it() -> None:
    """The backend's sub-group runs with the timeout ``new_group`` was given, not the parent's."""
    released = threading.Event()

    def body(g: ProcessGroup) -> float | None:
        sub = g.new_group([0, 1], timeout=GROUP_S)
        assert sub is not None and sub.timeout == GROUP_S
        if g.rank == 1:  # never enters the barrier
            released.wait(HELD_S)
            return None
        start = time.monotonic()
        try:
            with pytest.raises(CollectiveTimeoutError):
                sub.barrier()
        finally:
            released.set()
        return time.monotonic() - start

    waited = run_ranks(2, body, op_timeout=60.0, timeout=HARD_S)[0]
    assert GROUP_S - 0.5 <= waited < GROUP_S + LATE_S


@pytest.mark.usefixtures("native")
def test_a_rank_left_out_of_a_sub_group_that_runs_its_parents_op_is_told_why() -> None:
    """``new_group`` gives a rank outside the sub-group ``None``, and ``group=None`` is the
    whole world: a rank that passes it on runs the parent's op, which the others never join.
    Its timeout says so, naming the sub-group it is not in."""
    released = threading.Event()

    def body(g: ProcessGroup) -> str | None:
        parent = g.new_group([0, 1, 2], timeout=GROUP_S)  # the world, with a short deadline
        assert parent is not None
        sub = parent.new_group([0, 1])
        if sub is not None:  # the members run the sub-group's op, as meant
            sub.all_reduce(torch.ones(4))
            released.wait(HELD_S)
            return None
        try:
            with pytest.raises(CollectiveTimeoutError) as caught:
                parent.all_reduce(torch.ones(4))  # as sl.all_reduce(t, group=None) would
        finally:
            released.set()
        return str(caught.value)

    said = run_ranks(3, body, op_timeout=60.0, timeout=HARD_S)[2]
    assert said is not None
    assert "rank 2 is not in sub-group" in said and "(ranks [0, 1] of" in said, said
    assert "group=None means the whole world" in said, said


# -- checkpoint commits ------------------------------------------------------------------------


@pytest.mark.usefixtures("env_timeout_300")
@pytest.mark.parametrize("held", ["shard", "commit"])
def test_a_checkpoint_commit_waits_the_group_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held: str
) -> None:
    """``shard``: rank 1 never writes its shard, rank 0 gives up committing. ``commit``: rank 0
    never commits, rank 1 gives up waiting for it. Both after the group's timeout."""
    released = threading.Event()
    write_rank = checkpoint_api.write_rank  # type: ignore[attr-defined]
    commit = checkpoint_api.commit  # type: ignore[attr-defined]

    def late_write(partial: Path, rank: int, *args: Any) -> None:
        if held == "shard" and rank == 1:
            released.wait(HELD_S)
        write_rank(partial, rank, *args)

    def late_commit(*args: Any) -> None:
        if held == "commit":
            released.wait(HELD_S)
        commit(*args)

    monkeypatch.setattr(checkpoint_api, "write_rank", late_write)
    monkeypatch.setattr(checkpoint_api, "commit", late_commit)
    gives_up = 0 if held == "shard" else 1
    path = tmp_path / "ckpt"

    def body(g: ProcessGroup) -> tuple[float, str | None]:
        model = nn.Linear(4, 3)
        start = time.monotonic()
        error: CheckpointError | None = None
        try:
            checkpoint.save(path, model=model, group=g, progress=False)
        except CheckpointError as exc:
            error = exc
        finally:
            if g.rank == gives_up:
                released.set()
        return time.monotonic() - start, None if error is None else str(error)

    results = run_ranks(2, body, backend="gloo", op_timeout=GROUP_S, timeout=HARD_S)
    waited, message = results[gives_up]
    assert message is not None, "the save should have timed out"
    assert GROUP_S - 0.5 <= waited < GROUP_S + LATE_S, message
    assert f"{GROUP_S:g} s" in message and "the group's timeout" in message
    held_back = results[1 - gives_up][1]
    if held == "commit":
        assert "rank 0 did not commit within 2 s" in message
        assert held_back is None  # rank 0, released, commits
    else:
        assert "ranks [1] did not finish writing their shards" in message
        assert held_back is not None and "rank 0 failed" in held_back


# -- async SGD ---------------------------------------------------------------------------------


@pytest.mark.usefixtures("env_timeout_300", "native")
def test_an_async_sgd_round_waits_the_group_timeout() -> None:
    """Rank 1 never pushes: the server on rank 0 gives up on round 0 after the group's time."""
    released = threading.Event()

    def body(g: ProcessGroup) -> tuple[float, str] | None:
        with seeded(0):
            model = nn.Linear(4, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        wrapped, stepper = sl.distribute(
            model, opt, strategy="async", group=g, staleness=0, on_stale="wait"
        )
        assert stepper is not None
        if g.rank == 1:  # never pushes a gradient
            released.wait(HELD_S)
            return None
        wrapped(torch.ones(2, 4)).sum().backward()
        start = time.monotonic()
        try:
            with pytest.raises(TimeoutError) as caught:
                stepper.step()
        finally:
            released.set()
        return time.monotonic() - start, str(caught.value)

    outcome = run_ranks(2, body, op_timeout=GROUP_S, timeout=HARD_S)[0]
    assert outcome is not None
    waited, message = outcome
    assert GROUP_S - 0.5 <= waited < GROUP_S + LATE_S, message
    assert f"waited {GROUP_S:g} s for round 0" in message
