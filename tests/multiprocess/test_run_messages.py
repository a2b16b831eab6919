"""What `shardline run` and its workers say: a rank that left normally, an elastic job's labels.

Each test runs real launchers on loopback with a small script written to ``tmp_path`` and
checks the words users read: the error of a rank whose peer exited normally, and in an
elastic job the rank labels, the incarnation a replacement sees, the advice on a node join and
the ``--nnodes`` the launcher names. Every launcher has a hard deadline and is killed, with
its workers, at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.multiprocess._launch import PYTHONPATH, free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("native")]

DEADLINE_S = 90.0

# Rank 1 leaves (HOW) while rank 0 waits for it in a 16-float all-reduce (or a receive);
# rank 0 prints its error on one line. TCP=1 puts each rank on a host of its own.
LEAVER = """\
import os, sys, torch
if os.environ.get("TCP"):
    os.environ["SHARDLINE_HOST_ID"] = "host-" + os.environ["RANK"]
import shardline as sl

sl.init()
how = os.environ["HOW"]
if sl.get_rank() == 1:
    if how == "shutdown":
        sl.shutdown()
    elif how == "raise":
        raise RuntimeError("rank 1 broke")
else:
    t = torch.ones(16)
    try:
        sl.recv(t, 1) if how == "recv" else sl.all_reduce(t)
    except sl.PeerLostError as exc:
        print("ERROR " + " ".join(str(exc).split()), flush=True)
"""

# One elastic worker: trains under elastic.run, committing every step. Its first line says
# where it runs and what its environment says; the first process of slot 1.0 dies (exit code
# 7) three steps after it joined.
ELASTIC = """\
import json, os, time, torch
from pathlib import Path
import shardline as sl
from shardline.comm import world

sl.init()
slot, process = world.elastic_slot()
names = ["SHARDLINE_ELASTIC_SLOT", "SHARDLINE_ELASTIC_INCARNATION", "SHARDLINE_RESTART_COUNT",
         "TORCHELASTIC_RESTART_COUNT", "LOCAL_RANK"]
env = {n: os.environ.get(n) for n in names}
print(f"START slot {slot} process {process} env {json.dumps(env, sort_keys=True)}", flush=True)
out = Path(os.environ["OUT_DIR"])
state = sl.elastic.State(model=torch.nn.Linear(2, 2), step=0)
done = 0

@sl.elastic.run
def train(state):
    global done
    while state.step < 80:
        sl.all_reduce(torch.ones(4))
        state.step += 1
        state.commit()
        done += 1
        (out / f"step-{slot}").write_text(str(state.step))
        if slot == "1.0" and process == 0 and done == 3:
            os._exit(7)
        time.sleep(0.1)

train(state)
print(f"DONE slot {slot} at step {state.step}", flush=True)
"""


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "OUT_DIR": str(tmp_path),
           "SHARDLINE_SECRET": "run-messages", "SHARDLINE_TIMEOUT": "60",
           "OMP_NUM_THREADS": "1", **extra}  # fmt: skip
    env.pop("SHARDLINE_INSECURE", None)
    return env


def _start(args: list[str], env: dict[str, str], out: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "shardline", "run", *args]
    with open(out, "wb") as f:
        return subprocess.Popen(
            cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )


def _finish(procs: list[subprocess.Popen[bytes]], outs: list[Path]) -> list[str]:
    """Waits for every launcher (killing all past the deadline); each one's output."""
    deadline = time.monotonic() + DEADLINE_S
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the launchers did not end\n{_show(outs)}") from None
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return [o.read_text() for o in outs]


def _show(outs: list[Path]) -> str:
    return "\n".join(f"--- {o.name}\n{o.read_text()[-6000:]}" for o in outs)


@pytest.mark.timeout(DEADLINE_S + 30)
@pytest.mark.parametrize(
    ("how", "tcp"),
    [("return", ""), ("return", "1"), ("shutdown", ""), ("recv", ""), ("raise", "")],
)
def test_a_peer_that_left_normally_is_said_to_have_done_so(
    tmp_path: Path, how: str, tcp: str
) -> None:
    script = tmp_path / "leaver.py"
    script.write_text(LEAVER)
    out = tmp_path / "launcher.out"
    env = _env(tmp_path, HOW=how, TCP=tcp)
    [text] = _finish([_start(["--nproc-per-node", "2", str(script)], env, out)], [out])
    found = re.search(r"\[rank0\]: ERROR (.*)", text)
    assert found, text
    error = found.group(1)
    if how == "raise":  # a rank that failed: its log has the root cause
        assert "log" in error and "normally" not in error, error
        return
    if how == "recv":
        assert "point-to-point transfer: rank 1 exited normally" in error, error
        assert "before it took part in this transfer" in error, error
    else:
        # The op as called: 16 floats (not the first all-reduce's timing probes).
        assert "during all_reduce(float32, 16, op=sum) #0" in error, error
        left = ("left the job normally (it called shardline.shutdown()" if how == "shutdown"
                else "exited normally (its script ended with no uncaught exception)")  # fmt: skip
        assert f"rank 1 {left}" in error, error
        assert "before it called this collective; check that every rank calls" in error, error
    assert "root cause" not in error and "check its log" not in error, error


@pytest.mark.timeout(DEADLINE_S + 30)
def test_an_elastic_job_labels_its_ranks_and_processes_as_the_launcher_does(
    tmp_path: Path,
) -> None:
    script = tmp_path / "elastic.py"
    script.write_text(ELASTIC)
    port = str(free_port())
    env = _env(tmp_path)
    outs = [tmp_path / "node0.out", tmp_path / "node1.out"]
    common = ["--nnodes", "1:2", "--master-port", port]
    procs = [_start([*common, str(script)], env, outs[0])]
    try:
        # Node 0 trains alone, then node 1 joins: a generation with a node more.
        deadline = time.monotonic() + DEADLINE_S / 2
        while not (tmp_path / "step-0.0").exists():
            assert time.monotonic() < deadline and procs[0].poll() is None, _show(outs[:1])
            time.sleep(0.1)
        procs.append(_start([*common, "--max-restarts", "1", str(script)], env, outs[1]))
    finally:
        texts = _finish(procs, outs[: len(procs)])
    assert [p.returncode for p in procs] == [0, 0], _show(outs)
    node0, node1 = texts
    found = re.finditer(r"\]: START slot 1\.0 process \d env (.*)", node1)
    names = ["SHARDLINE_ELASTIC_SLOT", "SHARDLINE_ELASTIC_INCARNATION", "SHARDLINE_RESTART_COUNT",
             "TORCHELASTIC_RESTART_COUNT", "LOCAL_RANK"]  # fmt: skip
    processes = [tuple(json.loads(m.group(1))[n] for n in names) for m in found]
    worker_lines = [line for line in node1.splitlines() if line.startswith("[")]
    checks = {
        # --nnodes as given, not its MAX.
        "the --nnodes named": "warning: --nnodes 1:2 with --master-addr 127.0.0.1" in node0,
        # Node 0's worker re-formed its group under elastic.run: no advice to use it.
        "a node join is said": "the elastic job's members changed" in node0,
        "no elastic.run advice": "run the training function under shardline.elastic" not in node0,
        # Node 1's workers, the replacement too, print as rank 1 (its slot 0), not rank 0.
        "node 1 joined": "elastic node 1 joined (--nnodes 1:2)" in node1,
        "node 1's labels": bool(worker_lines)
        and all(line.startswith("[rank1]: ") for line in worker_lines),
        "node 1's report": "node 1: local rank 0 (pid " in node1 and "exited with code 7" in node1,
        "a replacement": "replacing slot 1.0 (process 1, a warm standby" in node1,
        "no spare said": "waits as a spare" not in node1,  # its node is in the job already
        "the launcher's #1": "1.0#1" in node0,
        # What each process of slot 1.0 reads in its environment: process 0, then 1.
        "slot 1.0's processes": processes
        == [("1.0", "0", "0", "0", "0"), ("1.0", "1", "1", "1", "0")],
        "the replacement finished": "[rank1]: DONE slot 1.0 at step 80" in node1,
    }
    failed = [name for name, ok in checks.items() if not ok]
    assert not failed, f"{failed}\n{_show(outs)}"
