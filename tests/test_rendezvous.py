"""Rendezvous: env:// and SLURM variables, the store, host identity, secret, init()."""

from __future__ import annotations

import hashlib
import socket
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import shardline as sl
from shardline.comm.rendezvous.env import (
    INSECURE_SECRET,
    RendezvousInfo,
    create_store,
    first_slurm_host,
    host_identity,
    job_secret,
    machine_identity,
    read_env,
    timeout_seconds,
)
from shardline.errors import ShardlineError
from tests._ranks import new_store

TORCHRUN = {
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
}


def test_torchrun_variables() -> None:
    assert read_env(TORCHRUN) == RendezvousInfo("10.0.0.1", 29500, 5, 8, 1, 4, "env")


def test_slurm_variables_with_nodelist_master() -> None:
    env = {
        "SLURM_PROCID": "6",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "2",
        "SLURM_TASKS_PER_NODE": "4(x2)",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "gpu[007-008]",
        "MASTER_PORT": "29400",
    }
    assert read_env(env) == RendezvousInfo("gpu007", 29400, 6, 8, 2, 4, "slurm")


def test_slurm_launch_node_address_wins_over_nodelist() -> None:
    env = {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": "0",
        "SLURM_LAUNCH_NODE_IPADDR": "10.1.2.3",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "MASTER_PORT": "1234",
    }
    assert read_env(env).master_addr == "10.1.2.3"


def test_master_addr_wins_over_slurm() -> None:
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "MASTER_ADDR": "h0", "MASTER_PORT": "1"}
    assert read_env(env).master_addr == "h0"


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("node01", "node01"),
        ("gpu[007-010,012],cpu01", "gpu007"),
        ("a,b", "a"),
        ("rack1-[3,5]", "rack1-3"),
    ],
)
def test_first_slurm_host(nodelist: str, first: str) -> None:
    assert first_slurm_host(nodelist) == first


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"RANK": "8"}, r"RANK=8 is outside \[0, WORLD_SIZE=8\)"),
        ({"RANK": "x"}, "not an integer"),
        ({"WORLD_SIZE": "0"}, "at least 1"),
        ({"LOCAL_RANK": "4"}, "LOCAL_RANK=4"),
        ({"LOCAL_WORLD_SIZE": "9"}, "LOCAL_WORLD_SIZE=9"),
        ({"MASTER_ADDR": ""}, "MASTER_ADDR is not set on rank 5"),
        ({"MASTER_PORT": ""}, "MASTER_PORT is not set"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000"),
        ({"RANK": "", "WORLD_SIZE": ""}, "set RANK and WORLD_SIZE"),
    ],
)
def test_inconsistent_variables_fail_fast(change: dict[str, str], message: str) -> None:
    with pytest.raises(ShardlineError, match=message):
        read_env({**TORCHRUN, **change})


def test_a_script_run_without_a_launcher_is_one_process() -> None:
    assert read_env({"PATH": "/usr/bin"}) == RendezvousInfo("127.0.0.1", 0, 0, 1, 0, 1, "env")


def test_single_process_needs_no_master() -> None:
    info = read_env({"RANK": "0", "WORLD_SIZE": "1"})
    assert (info.master_addr, info.master_port, info.local_world_size) == ("127.0.0.1", 0, 1)


def test_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHARDLINE_TIMEOUT", raising=False)
    assert timeout_seconds() == 300.0
    monkeypatch.setenv("SHARDLINE_TIMEOUT", "2.5")
    assert timeout_seconds() == 2.5
    assert timeout_seconds(7) == 7.0
    monkeypatch.setenv("SHARDLINE_TIMEOUT", "soon")
    with pytest.raises(ShardlineError, match="SHARDLINE_TIMEOUT"):
        timeout_seconds()
    with pytest.raises(ShardlineError, match="positive"):
        timeout_seconds(0)


def test_host_identity() -> None:
    assert host_identity({"SHARDLINE_HOST_ID": "box-7"}) == "box-7"
    ident = host_identity({})
    assert ident.startswith(socket.gethostname() + "/")
    assert len(ident) > len(socket.gethostname()) + 1


def test_machine_identity_ignores_the_host_id_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks forced apart with SHARDLINE_HOST_ID still share this machine's cores."""
    real = host_identity({})
    monkeypatch.setenv("SHARDLINE_HOST_ID", "pretend-host")
    assert host_identity() == "pretend-host"
    assert machine_identity() == real


def test_secret_from_env_is_hashed() -> None:
    store = new_store()
    got = job_secret(store, 0, ["a", "b"], key="k", env={"SHARDLINE_SECRET": "hunter2"})
    assert got == hashlib.sha256(b"hunter2").digest()


def test_multi_host_without_secret_fails_with_instructions() -> None:
    with pytest.raises(ShardlineError, match=r"SHARDLINE_SECRET.*SHARDLINE_INSECURE=1"):
        job_secret(new_store(), 1, ["a", "b"], key="k", env={})
    assert (
        job_secret(new_store(), 1, ["a", "b"], key="k", env={"SHARDLINE_INSECURE": "1"})
        == INSECURE_SECRET
    )


def test_single_host_secret_is_generated_and_shared() -> None:
    store = new_store()
    got: dict[int, bytes] = {}

    def rank(r: int) -> None:
        # One client per rank: a TCPStore client blocks in get() for its caller only.
        client = dist.TCPStore("127.0.0.1", store.port, None, False, timedelta(seconds=10))
        got[r] = job_secret(client, r, ["h", "h", "h"], key="secret", env={})

    threads = [threading.Thread(target=rank, args=(r,)) for r in (2, 1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(got[0]) == 32
    assert got[0] == got[1] == got[2]


def test_store_port_in_use_names_address() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        info = RendezvousInfo("127.0.0.1", port, 0, 2, 0, 2, "env")
        with pytest.raises(ShardlineError, match=f"127.0.0.1:{port}"):
            create_store(info, timeout=2)


def test_init_from_env_single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not sl.is_initialized()
    sl.init(backend="gloo", timeout=10)
    try:
        assert sl.is_initialized()
        assert sl.get_rank() == 0
        assert sl.get_world_size() == 1
        with pytest.raises(ShardlineError, match="already initialised"):
            sl.init(backend="gloo")
        t = torch.arange(4.0)
        sl.all_reduce(t, op="max")
        out = torch.empty(4)
        sl.all_gather(out, t)
        work = sl.broadcast(t, src=0, async_op=True)
        assert work is not None
        work.wait()
        sl.barrier()
        sub = sl.new_group([0])
        assert sub is not None
        assert sub.world_size == 1
        mesh = sl.DeviceMesh((1, 1), axis_names=("dp", "tp"))
        assert mesh.coordinate == (0, 0)
        assert mesh.size() == 1
        assert torch.equal(out, torch.arange(4.0))
    finally:
        sl.shutdown()
    assert not sl.is_initialized()
    with pytest.raises(ShardlineError, match=r"call shardline.init\(\)"):
        sl.get_rank()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA, so nccl would work")
def test_init_nccl_without_cuda_says_what_to_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ShardlineError, match=r"needs CUDA.*backend='native'"):
        sl.init(backend="nccl")
    assert not sl.is_initialized()
