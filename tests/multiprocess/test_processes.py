"""Real processes: shared memory across processes, TCP between simulated hosts, faults."""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.multiprocess._launch import finish, free_port, kill_all, report, run, start

pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("native")]
TWO_HOSTS = {
    0: {"SHARDLINE_HOST_ID": "sim-a"},
    1: {"SHARDLINE_HOST_ID": "sim-a"},
    2: {"SHARDLINE_HOST_ID": "sim-b"},
    3: {"SHARDLINE_HOST_ID": "sim-b"},
}
SECRET = {"SHARDLINE_SECRET": "multiprocess-test"}


def arenas_of(pids: list[int]) -> list[str]:
    return [p for pid in pids for p in glob.glob(f"/dev/shm/shardline-{pid}-*")]


def test_shm_all_reduce_between_four_processes() -> None:
    ranks = run(4, "allreduce", env={"SHARDLINE_HOST_ID": "one-box"})
    assert all("OK" in r.out for r in ranks)
    assert not arenas_of([r.proc.pid for r in ranks])


def test_tcp_between_two_simulated_hosts() -> None:
    per_rank = {0: {"SHARDLINE_HOST_ID": "sim-a"}, 1: {"SHARDLINE_HOST_ID": "sim-b"}}
    ranks = run(2, "allreduce", env=SECRET, per_rank=per_rank)
    assert all("OK" in r.out for r in ranks)


def test_hierarchical_two_hosts_of_two() -> None:
    ranks = run(4, "allreduce", env=SECRET, per_rank=TWO_HOSTS)
    assert all("OK" in r.out for r in ranks)
    assert not arenas_of([r.proc.pid for r in ranks])


def test_multi_host_without_secret_fails_at_init_with_instructions() -> None:
    env = {"SHARDLINE_SECRET": "", "SHARDLINE_INSECURE": "", "SHARDLINE_TIMEOUT": "5"}
    per_rank = {0: {"SHARDLINE_HOST_ID": "sim-a"}, 1: {"SHARDLINE_HOST_ID": "sim-b"}}
    ranks = run(2, "expect_failure", env=env, per_rank=per_rank, timeout=60)
    assert all("SHARDLINE_SECRET" in r.out for r in ranks), report(ranks)


def test_insecure_opt_out_runs_across_hosts_without_a_secret() -> None:
    env = {"SHARDLINE_SECRET": "", "SHARDLINE_INSECURE": "1"}
    per_rank = {0: {"SHARDLINE_HOST_ID": "sim-a"}, 1: {"SHARDLINE_HOST_ID": "sim-b"}}
    ranks = run(2, "allreduce", env=env, per_rank=per_rank)
    assert all("OK" in r.out for r in ranks), report(ranks)


@pytest.mark.parametrize("hosts", ["one-host", "two-hosts"])
def test_kill_minus_nine_raises_peer_lost_on_every_survivor(hosts: str) -> None:
    per_rank = TWO_HOSTS if hosts == "two-hosts" else {}
    env = {**SECRET, **({"SHARDLINE_HOST_ID": "one-box"} if hosts == "one-host" else {})}
    ranks = start(4, "kill_loop", env=env, per_rank=per_rank)
    try:
        _wait_for_output(ranks, "LOOPING", 60)
        time.sleep(0.5)
        ranks[1].proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        finish(ranks, 30)
    finally:
        kill_all(ranks)
    survivors = [r for r in ranks if r.rank != 1]
    for r in survivors:
        assert r.rc == 0 and "ERROR PeerLostError" in r.out, report(ranks)
        elapsed = float(r.out.split("ERROR PeerLostError ")[1].split()[0])
        assert elapsed < 10, f"rank {r.rank} noticed the dead peer after {elapsed} s"
    assert time.monotonic() - killed_at < 30
    assert not arenas_of([r.proc.pid for r in ranks]), "arena left in /dev/shm"


@pytest.mark.parametrize("hosts", ["one-host", "two-hosts"])
def test_mismatched_collectives_fail_on_all_ranks(hosts: str) -> None:
    per_rank = {1: {"SHARDLINE_HOST_ID": "sim-b"}} if hosts == "two-hosts" else {}
    ranks = run(2, "mismatch", env={**SECRET, "SHARDLINE_HOST_ID": "sim-a"}, per_rank=per_rank)
    for r in ranks:
        assert "ERROR CollectiveMismatchError" in r.out, report(ranks)
        assert "all_reduce" in r.out and "all_gather" in r.out, report(ranks)


def test_wrong_secret_is_rejected_and_nobody_hangs() -> None:
    per_rank = {r: {"SHARDLINE_HOST_ID": f"sim-{r}"} for r in range(3)}
    per_rank[2]["SHARDLINE_SECRET"] = "not-the-job-secret"
    env = {**SECRET, "SHARDLINE_TIMEOUT": "10"}
    ranks = run(3, "expect_failure", env=env, per_rank=per_rank, timeout=60)
    outs = [r.out for r in ranks]
    assert any("ERROR AuthenticationError" in o for o in outs), report(ranks)
    assert all("ERROR" in o for o in outs), report(ranks)


def test_nodes_that_count_different_world_sizes_fail_within_seconds_naming_both() -> None:
    """Two nodes launched with different --nproc-per-node: node 0 (2 per node, 4 in all) and a
    node that counts 3 per node (6 in all, its first rank 3): everybody fails at once."""
    node0 = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "SHARDLINE_HOST_ID": "node0"}
    per_rank = {
        0: node0,
        1: node0,
        2: {"RANK": "3", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "3", "LOCAL_RANK": "0",
            "SHARDLINE_HOST_ID": "node1"},
    }  # fmt: skip
    env = {**SECRET, "SHARDLINE_TIMEOUT": "120"}
    ranks = run(3, "expect_failure", env=env, per_rank=per_rank, timeout=60)
    for r in ranks:
        assert "ERROR " in r.out, report(ranks)
        elapsed = float(r.out.split("ERROR ")[1].split()[1])
        assert elapsed < 10, report(ranks)
        assert "WORLD_SIZE=4" in r.out and "WORLD_SIZE=6" in r.out, report(ranks)
    assert "launch every node with the same --nproc-per-node" in ranks[2].out, report(ranks)


def test_garbage_on_listener_port_is_rejected_and_job_completes(tmp_path: Path) -> None:
    port, go = free_port(), tmp_path / "go"
    per_rank = {0: {"SHARDLINE_HOST_ID": "sim-a"}, 1: {"SHARDLINE_HOST_ID": "sim-b"}}
    # Rank 0 dials rank 1 only once the garbage was written to rank 1's listener, which is
    # then accepting (for up to 180 s) and must drop it and still link rank 0.
    env = {**SECRET, "WORKER_GO": str(go), "SHARDLINE_TIMEOUT": "180"}
    ranks = start(2, "slow_start", env=env, per_rank=per_rank, port=port)
    try:
        store = _connect_store(port, 120)
        host, _, listen_port = bytes(store.get("shardline/world/addr/1")).decode().rpartition(":")
        for payload in (
            b"\x00" * 64,
            b"GET / HTTP/1.1\r\n\r\n",
            os.urandom(4096),
            b"\xff\xff\xff\xff" * 8,
        ):
            with (
                contextlib.suppress(OSError),
                socket.create_connection((host, int(listen_port)), timeout=5) as s,
            ):
                s.sendall(payload)
                s.settimeout(2)
                with contextlib.suppress(OSError):
                    s.recv(64)
        go.touch()
        finish(ranks, 90)
    except Exception as e:
        kill_all(ranks)
        e.add_note(report(ranks))
        raise
    finally:
        kill_all(ranks)
    assert all(r.rc == 0 and "OK" in r.out for r in ranks), report(ranks)


def _connect_store(port: int, timeout: float) -> dist.TCPStore:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=timeout))
        except (RuntimeError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _wait_for_output(ranks: list, marker: str, timeout: float) -> None:  # type: ignore[type-arg]
    # The workers print `marker` once; read it without blocking the pipes for good.
    deadline = time.monotonic() + timeout
    seen: set[int] = set()
    while len(seen) < len(ranks):
        for r in ranks:
            if r.rank in seen:
                continue
            if r.proc.poll() is not None:
                raise AssertionError(f"rank {r.rank} exited early\n{report(ranks)}")
            line = r.proc.stdout.readline()
            if marker in line:
                seen.add(r.rank)
            elif not line:
                time.sleep(0.05)  # a forked rank's stdout is a file: nothing new yet
        if time.monotonic() > deadline:
            kill_all(ranks)
            raise AssertionError(f"ranks did not reach {marker!r} in {timeout} s")
