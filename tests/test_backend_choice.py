"""Backend choice (``init(backend=None)``) and the device checks at the edge, without a GPU."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

import shardline as sl
from shardline.comm import ProcessGroup, init_process_group
from shardline.comm.backends import nccl
from shardline.comm.rendezvous.generations import agree_on_backend
from shardline.comm.world import choose_backend
from shardline.errors import InvalidArgumentError, ShardlineError
from tests._ranks import new_store

# -- the rule ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("backend", "env", "local_world_size", "gpus", "want"),
    [
        # 1. the argument wins over everything
        ("gloo", {"SHARDLINE_BACKEND": "native", "SHARDLINE_DEVICE": "cuda"}, 1, 8, "gloo"),
        # 2. then SHARDLINE_BACKEND (case-insensitive)
        (None, {"SHARDLINE_BACKEND": "MPI", "SHARDLINE_DEVICE": "cpu"}, 1, 8, "mpi"),
        (None, {"SHARDLINE_BACKEND": "nccl"}, 1, 0, "nccl"),
        # 3. then SHARDLINE_DEVICE
        (None, {"SHARDLINE_DEVICE": "cpu"}, 1, 8, "native"),
        (None, {"SHARDLINE_DEVICE": "cuda"}, 4, 0, "nccl"),
        (None, {"SHARDLINE_DEVICE": "cuda:3"}, 1, 8, "nccl"),
        # 4. then a GPU for every local rank gives nccl, anything less native
        (None, {}, 1, 0, "native"),
        (None, {}, 1, 1, "nccl"),
        (None, {}, 8, 8, "nccl"),
        (None, {}, 2, 8, "nccl"),
        (None, {}, 16, 8, "native"),
        (None, {"SHARDLINE_BACKEND": "", "SHARDLINE_DEVICE": ""}, 2, 2, "nccl"),
    ],
)
def test_choose_backend_rule(
    backend: str | None, env: dict[str, str], local_world_size: int, gpus: int, want: str
) -> None:
    got = choose_backend(backend, env=env, local_world_size=local_world_size, cuda_devices=gpus)
    assert got == want


def test_without_cuda_the_default_is_native() -> None:
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA; the rule's CUDA branch is covered with cuda_devices=")
    assert choose_backend(None, env={}) == "native"


@pytest.mark.parametrize(
    ("backend", "env", "match"),
    [
        ("nvlink", {}, r"backend='nvlink' is not a backend; use one of native, gloo, nccl, mpi"),
        (None, {"SHARDLINE_BACKEND": "tcp"}, r"SHARDLINE_BACKEND='tcp' is not a backend"),
        (None, {"SHARDLINE_DEVICE": "gpu"}, r"SHARDLINE_DEVICE='gpu' is not a device"),
    ],
)
def test_unknown_choices_are_rejected(backend: str | None, env: dict[str, str], match: str) -> None:
    with pytest.raises(ShardlineError, match=match):
        choose_backend(backend, env=env, cuda_devices=0)


def _single_rank_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    for name in ("MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SHARDLINE_DEVICE"):
        monkeypatch.delenv(name, raising=False)


def test_init_takes_the_backend_from_shardline_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    _single_rank_env(monkeypatch)
    monkeypatch.setenv("SHARDLINE_BACKEND", "gloo")
    group = sl.init()
    try:
        assert group.backend == "gloo"
        assert group.device == torch.device("cpu")
        t = torch.ones(3)
        sl.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
    finally:
        sl.shutdown()


def test_init_on_cpu_device_chooses_native(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.conftest import need_native

    need_native()
    _single_rank_env(monkeypatch)
    monkeypatch.delenv("SHARDLINE_BACKEND", raising=False)
    monkeypatch.setenv("SHARDLINE_DEVICE", "cpu")
    try:
        assert sl.init().backend == "native"
    finally:
        sl.shutdown()


def test_ranks_that_disagree_with_rank_0_fail_with_instructions() -> None:
    store = new_store()
    agree_on_backend(store, 0, "nccl", explicit=False)
    agree_on_backend(store, 2, "nccl", explicit=False)
    with pytest.raises(ShardlineError, match=r"rank 1 chose backend 'native' but rank 0 uses"):
        agree_on_backend(store, 1, "native", explicit=False)
    with pytest.raises(ShardlineError, match="SHARDLINE_BACKEND"):
        agree_on_backend(store, 1, "gloo", explicit=True)


# -- availability ------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a CPU-only host")
def test_nccl_without_cuda_says_what_to_use() -> None:
    with pytest.raises(ShardlineError, match=r"needs CUDA.*use backend='native'"):
        init_process_group(new_store(), 0, 1, backend="nccl")
    with pytest.raises(ShardlineError, match="needs CUDA"):
        nccl.default_device(0)


def test_mpi_without_mpi4py_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # makes `import mpi4py` fail
    with pytest.raises(ShardlineError, match=r"pip install shardline\[mpi\].*MPI"):
        init_process_group(None, 0, 1, backend="mpi")
    monkeypatch.setenv("SHARDLINE_BACKEND", "mpi")
    with pytest.raises(ShardlineError, match=r"pip install shardline\[mpi\]"):
        sl.init()
    assert not sl.is_initialized()


def test_backends_other_than_mpi_need_a_store() -> None:
    with pytest.raises(ShardlineError, match="needs a store"):
        init_process_group(None, 0, 1, backend="gloo")


# -- device checks at the edge, with a fake CUDA backend and fake CUDA tensors -----------------


class _FakeCuda(torch.Tensor):
    """A CPU tensor that reports a CUDA device, to reach the CUDA checks without a GPU."""

    fake_device = torch.device("cuda", 1)

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self.fake_device

    @property
    def is_cpu(self) -> bool:  # type: ignore[override]
        return False


def fake_cuda(index: int) -> torch.Tensor:
    t = torch.Tensor._make_subclass(_FakeCuda, torch.ones(3))
    t.fake_device = torch.device("cuda", index)  # type: ignore[attr-defined]
    return t


class _FakeBackend:
    """Records calls; ``device`` makes the ProcessGroup check tensors like the nccl backend."""

    name = "fake"
    transport = "fake"
    rank = 0
    world_size = 1

    def __init__(self, device: torch.device | None) -> None:
        if device is not None:
            self.device = device
        self.calls: list[str] = []

    def all_reduce(self, t: torch.Tensor, op: str, *, async_op: bool = True) -> Any:
        self.calls.append("all_reduce")
        return _Done()

    def subgroup(self, name: str, ranks: Sequence[int], *, overlap_compute: bool = False) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _Done:
    def wait(self, timeout: float | None = None) -> None:
        pass

    def is_completed(self) -> bool:
        return True


def test_cuda_group_accepts_tensors_on_its_device_only() -> None:
    impl = _FakeBackend(torch.device("cuda", 0))
    group = ProcessGroup(impl)  # type: ignore[arg-type]
    assert group.device == torch.device("cuda", 0)
    group.all_reduce(fake_cuda(0))
    assert impl.calls == ["all_reduce"]
    with pytest.raises(InvalidArgumentError, match=r"on cuda:1 but this rank's NCCL group runs"):
        group.all_reduce(fake_cuda(1))
    with pytest.raises(InvalidArgumentError, match=r"works on CUDA tensors.*\.to\('cuda:0'\)"):
        group.all_reduce(torch.ones(3))
    with pytest.raises(InvalidArgumentError, match=r"numpy array.*torch.from_numpy"):
        group.all_reduce(np.ones(3, dtype=np.float32))
    assert impl.calls == ["all_reduce"]  # nothing bad reached the backend


def test_cpu_group_rejects_cuda_tensors_pointing_to_nccl() -> None:
    impl = _FakeBackend(None)
    group = ProcessGroup(impl)  # type: ignore[arg-type]
    assert group.device == torch.device("cpu")
    with pytest.raises(InvalidArgumentError, match=r"need the NCCL backend.*backend='nccl'"):
        group.all_reduce(fake_cuda(0))
    group.all_reduce(torch.ones(3))
    assert impl.calls == ["all_reduce"]


@pytest.mark.parametrize("backend", ["gloo", "native"])
def test_real_cpu_backends_reject_cuda_tensors(backend: str) -> None:
    from tests._ranks import run_ranks
    from tests.conftest import need_native

    if backend == "native":
        need_native()

    def body(g: ProcessGroup) -> None:
        with pytest.raises(InvalidArgumentError, match="NCCL"):
            g.all_reduce(fake_cuda(0))

    run_ranks(1, body, backend=backend)


@pytest.mark.parametrize("value", ["0", "-2", "eight", "1.5"])
def test_a_bad_nccl_max_ctas_is_refused_before_any_gpu_work(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("SHARDLINE_NCCL_MAX_CTAS", value)
    with pytest.raises(InvalidArgumentError, match=r"SHARDLINE_NCCL_MAX_CTAS=.*positive integer"):
        nccl.NcclBackend(
            new_store(), 0, 1, name="ctas", timeout=5.0, device=torch.device("cuda", 0)
        )


@pytest.mark.parametrize("value", ["-1", "eight", "1.5"])
def test_a_bad_nccl_overlap_ctas_is_refused_before_any_gpu_work(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("SHARDLINE_NCCL_OVERLAP_CTAS", value)
    with pytest.raises(
        InvalidArgumentError, match=r"SHARDLINE_NCCL_OVERLAP_CTAS=.*non-negative integer"
    ):
        nccl.NcclBackend(
            new_store(), 0, 1, name="ctas", timeout=5.0, device=torch.device("cuda", 0)
        )


@pytest.mark.parametrize(
    ("every", "overlap", "plain_group", "overlap_group"),
    [
        (None, None, None, nccl.OVERLAP_CTAS),  # the defaults
        (None, "0", None, None),  # 0: NCCL's choice for overlapping groups too
        (None, "4", None, 4),
        ("16", None, 16, 16),  # SHARDLINE_NCCL_MAX_CTAS caps every group of ours
        ("16", "4", 16, 16),
    ],
)
def test_which_groups_get_fewer_nccl_thread_blocks(
    monkeypatch: pytest.MonkeyPatch,
    every: str | None,
    overlap: str | None,
    plain_group: int | None,
    overlap_group: int | None,
) -> None:
    for var, value in (
        ("SHARDLINE_NCCL_MAX_CTAS", every),
        ("SHARDLINE_NCCL_OVERLAP_CTAS", overlap),
    ):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    assert nccl._max_ctas(overlap_compute=False) == plain_group
    assert nccl._max_ctas(overlap_compute=True) == overlap_group
