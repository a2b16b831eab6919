"""A rank that is alive but stuck is named by every other rank at the op deadline.

Rank 2 of 4 stops itself (``SIGSTOP``) before an all-reduce, as a process stopped by a
debugger or a scheduler would be: its connections and its host stay up, so nothing looks
dead; only the op deadline (``SHARDLINE_TIMEOUT``, 3 s here) can end the wait. Every other
rank must then raise ``CollectiveTimeoutError`` saying that rank 2 never entered that
all-reduce while they wait in it, and write its flight record, from which ``shardline why``
prints the same sentence. Over shared memory (one host) and over TCP (ranks given other host
ids). The stopped rank is killed at the end.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.multiprocess._launch import PYTHONPATH, kill_all, report, start

pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("native")]

WORKER = Path(__file__).with_name("_liveness_worker.py")
STOPPED = 2
SENTENCE = re.compile(
    r"rank 2 never entered all_reduce #(\d+) \(no answer from it: stopped, or busy outside "
    r"shardline\); ranks 0, 1, 3 wait in it since (\d+) s"
)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_stopped_rank_is_named_by_every_other_rank_and_by_shardline_why(
    transport: str, tmp_path: Path
) -> None:
    hosts = {r: {"SHARDLINE_HOST_ID": f"host-{r}"} for r in range(4)} if transport == "tcp" else {}
    per_rank = {r: dict(hosts.get(r, {})) for r in range(4)}
    per_rank[STOPPED]["WORKER_SIGSTOP_AT"] = "15"
    env = {
        "SHARDLINE_TIMEOUT": "3",
        "SHARDLINE_FLIGHT_DIR": str(tmp_path),
        "SHARDLINE_SECRET": "s",
        "WORKER_STEPS": "1000",
    }
    ranks = start(4, "all_reduce_loop", env=env, per_rank=per_rank, worker=WORKER)
    try:
        for r in ranks:
            if r.rank != STOPPED:
                r.proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        kill_all(ranks)
        raise AssertionError(f"a rank still waits after 60 s\n{report(ranks)}") from None
    finally:
        kill_all(ranks)  # and reaps the stopped rank (SIGKILL ends a stopped process too)
    stopped = ranks[STOPPED]
    text = report(ranks)
    assert "STOPPING 15" in stopped.out, text
    numbers = set()
    for r in ranks:
        if r.rank == STOPPED:
            continue
        assert r.rc == 1 and "FAILED" in r.out and "CollectiveTimeoutError" in r.out, text
        found = SENTENCE.search(r.out)
        assert found, f"rank {r.rank} does not name the stopped rank\n{text}"
        numbers.add(found.group(1))
        assert (tmp_path / f"rank{r.rank}.json").exists(), text
    assert len(numbers) == 1, f"the ranks name different ops: {numbers}\n{text}"
    assert not (tmp_path / f"rank{STOPPED}.json").exists()
    why = subprocess.run(
        [sys.executable, "-m", "shardline", "why", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=False,
        env={"PYTHONPATH": PYTHONPATH, "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert why.returncode == 0, why.stderr
    found = SENTENCE.search(why.stdout)
    assert found and found.group(1) in numbers, why.stdout


def test_sigusr1_to_the_launcher_makes_every_rank_write_its_flight_record(tmp_path: Path) -> None:
    """``kill -USR1`` of ``shardline run`` reaches every worker that handles it (once it ran
    ``shardline.init``): each writes ``rank<r>.json``, and the job goes on."""
    env = {
        **os.environ,
        "PYTHONPATH": PYTHONPATH,
        "SHARDLINE_FLIGHT_DIR": str(tmp_path),
        "WORKER_STEPS": "0",  # all-reduces until stopped
    }
    launcher = subprocess.Popen(
        [sys.executable, "-m", "shardline", "run", "--nproc-per-node", "2", str(WORKER),
         "all_reduce_loop"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert launcher.stdout is not None
        deadline = time.monotonic() + 60
        seen: set[str] = set()
        while len(seen) < 2 and time.monotonic() < deadline:  # both ranks are training
            line = launcher.stdout.readline()
            if "STEP 10" in line:
                seen.add(line.split("]")[0])
        assert len(seen) == 2, "the workers did not start"
        launcher.send_signal(signal.SIGUSR1)
        files = [tmp_path / f"rank{r}.json" for r in range(2)]
        while not all(f.exists() for f in files) and time.monotonic() < deadline:
            time.sleep(0.05)
        dumps = [json.loads(f.read_text()) for f in files]
        assert launcher.poll() is None, "SIGUSR1 stopped the job"
    finally:
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=30)
    assert [d["reason"] for d in dumps] == ["SIGUSR1", "SIGUSR1"], err
    assert all(any(op[2] == "all_reduce" for op in d["ops"]) for d in dumps)
    assert "SIGUSR1 forwarded to rank(s) [0, 1]" in err
