"""The rendezvous store outlives every rank that still needs it, and its loss is explained.

Rank 0 shutting down while the others still create groups through the store must not break
them: without a launcher, ``shutdown()`` is collective and rank 0 leaves last; under
``shardline run`` the launcher hosts the store and rank 0 leaves at once. A store that does
vanish gives a ``ShardlineError`` naming the rank, the step and what to do.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

import shardline as sl
from shardline.comm import init_process_group
from tests._ranks import SECRET
from tests.multiprocess._launch import PYTHONPATH, finish, free_port, report, start

pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("native")]

WORKER = Path(__file__).with_name("_store_worker.py")
LAG_S = 3.0
BROKEN = re.compile(r"Broken pipe|DistNetworkError|DistStoreError|Connection reset")


def _shutdown_seconds(out: str, rank: int) -> float:
    found = re.search(rf"OK rank {rank} shutdown ([0-9.]+)", out)
    assert found, f"rank {rank} did not finish:\n{out}"
    return float(found.group(1))


def test_rank_0_leaves_last_when_it_hosts_the_store() -> None:
    """Plain env:// (rank 0 hosts the store): rank 0 waits in shutdown() for the laggards."""
    env = {"WORKER_LAG": str(LAG_S), "SHARDLINE_TIMEOUT": "30"}
    ranks = finish(start(3, "early_exit", env=env, worker=WORKER), timeout=90)
    text = report(ranks)
    assert not BROKEN.search(text), text
    assert all(r.rc == 0 for r in ranks), text
    # Rank 0 stayed until the others had checked out, about LAG_S after it was done.
    assert _shutdown_seconds(ranks[0].out, 0) > LAG_S / 2, text
    for r in ranks[1:]:
        assert _shutdown_seconds(r.out, r.rank) < LAG_S / 2, text


def _shardline_run(args: list[str], timeout: float = 90) -> tuple[int, str, str]:
    """``shardline run ARGS`` (the launcher hosts the store); its exit code and output."""
    env = {
        **{k: v for k, v in os.environ.items() if k != "SHARDLINE_SECRET"},
        "PYTHONPATH": PYTHONPATH,
        "WORKER_LAG": str(LAG_S),
        "SHARDLINE_TIMEOUT": "30",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardline", "run", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the launcher stops its workers
        out, err = proc.communicate(timeout=30)
        raise AssertionError(f"launcher still running after {timeout} s\n{out}\n{err}") from None
    return proc.returncode, out, err


def test_rank_0_leaves_at_once_under_shardline_run() -> None:
    """Under ``shardline run`` the launcher hosts the store: nobody waits for anybody."""
    rc, out, err = _shardline_run(["--nproc-per-node", "3", str(WORKER), "early_exit"])
    text = f"rc={rc}\nstdout:\n{out}\nstderr:\n{err}"
    assert not BROKEN.search(text), text
    assert rc == 0, text
    assert _shutdown_seconds(out, 0) < LAG_S / 2, text
    for rank in (1, 2):
        _shutdown_seconds(out, rank)


def test_a_restart_on_a_fixed_port_gets_a_fresh_store() -> None:
    """Attempt 1 reuses --master-port; keys of attempt 0 (dead listeners) must be gone."""
    port = str(free_port())
    args = ["--nproc-per-node", "2", "--master-port", port, "--max-restarts", "1"]
    rc, out, err = _shardline_run([*args, str(WORKER), "restart_on_one_port"])
    text = f"rc={rc}\nstdout:\n{out}\nstderr:\n{err}"
    assert rc == 0 and "rank 1 failed (attempt 1 of 2" in err, text
    for rank in (0, 1):
        _shutdown_seconds(out, rank)


def test_a_rank_that_skips_shutdown_checks_out_at_exit() -> None:
    env = {"WORKER_LAG": "1", "SHARDLINE_TIMEOUT": "30"}
    ranks = finish(start(3, "skip_shutdown", env=env, worker=WORKER), timeout=90)
    text = report(ranks)
    assert all(r.rc == 0 for r in ranks) and "LEAVING rank 2" in ranks[2].out, text
    assert _shutdown_seconds(ranks[0].out, 0) < 15, text  # not the 30 s timeout


def test_rank_0_stops_waiting_for_a_dead_rank_and_names_it() -> None:
    env = {"SHARDLINE_TIMEOUT": "4"}
    ranks = finish(start(3, "dead_rank", env=env, worker=WORKER), timeout=90)
    text = report(ranks)
    assert all(r.rc == 0 for r in ranks), text
    waited = _shutdown_seconds(ranks[0].out, 0)
    assert 3 < waited < 15, text
    assert re.search(r"LOG .*rank 0.*rank\(s\) \[2\] did not check out", ranks[0].out), text
    assert _shutdown_seconds(ranks[1].out, 1) < 3, text


def test_a_store_that_vanishes_mid_rendezvous_names_the_rank_and_the_step() -> None:
    host = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import datetime, time, torch.distributed as d\n"
            "s = d.TCPStore('127.0.0.1', 0, None, True, datetime.timedelta(seconds=60),"
            " wait_for_workers=False)\n"
            "print(s.port, flush=True)\n"
            "time.sleep(120)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert host.stdout is not None
        port = int(host.stdout.readline())
        client = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30))
        # Rank 0 of 2 publishes its identity, then waits for rank 1's, which never comes.
        killer = threading.Timer(1.0, host.kill)
        killer.start()
        with pytest.raises(sl.ShardlineError) as info:
            init_process_group(
                client, 0, 2, host_id="h", timeout=30, secret=SECRET, master_addr="127.0.0.1"
            )
        killer.join()
    finally:
        host.kill()
        host.wait()
        if host.stdout is not None:
            host.stdout.close()
    text = str(info.value)
    assert isinstance(info.value, sl.PeerLostError), repr(info.value)
    assert "rank 0" in text and "creating group 'world'" in text, text
    assert "host identit" in text, text
    assert f"127.0.0.1:{port} is gone" in text and "shardline run" in text, text
