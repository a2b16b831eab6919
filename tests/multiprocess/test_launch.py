"""`shardline run` with real processes: env, output, failures, restarts, signals, bad flags.

Workers are small scripts written to ``tmp_path``. Each records its pid (and its children's)
in ``PID_DIR``; the ``pid_dir`` fixture fails a test that leaves any of them running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardline.cli import main
from shardline.errors import InvalidArgumentError
from shardline.launch import LaunchConfig, resolve_secret, worker_env
from tests.multiprocess._launch import PYTHONPATH, free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

LAUNCH_TIMEOUT = 60.0

# Every worker script starts with this: who am I, and where do I record my pids.
HEADER = """\
import json, os, signal, subprocess, sys, time
from pathlib import Path

RANK = int(os.environ["RANK"])
ATTEMPT = int(os.environ["SHARDLINE_RESTART_COUNT"])
PID_DIR = Path(os.environ["PID_DIR"])
OUT_DIR = Path(os.environ["OUT_DIR"])


def record(pid, role):
    (PID_DIR / str(pid)).write_text(f"{role} of rank {RANK}, attempt {ATTEMPT}")


def log_attempt():
    with open(OUT_DIR / "attempts.log", "a") as f:
        f.write(f"{ATTEMPT} {RANK} {os.environ['MASTER_PORT']} "
                f"{os.environ['TORCHELASTIC_RESTART_COUNT']}\\n")


def wait_for(path, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.02)


def spawn_grandchild(ignore_sigterm=False):
    # A child in the worker's process group; it reports when it is ready to be signalled.
    ready = OUT_DIR / f"grandchild-{RANK}-{ATTEMPT}.ready"
    code = (
        "import signal, sys, time; "
        + ("signal.signal(signal.SIGTERM, signal.SIG_IGN); " if ignore_sigterm else "")
        + "open(sys.argv[1], 'w').close(); time.sleep(120)"
    )
    child = subprocess.Popen([sys.executable, "-c", code, str(ready)])
    record(child.pid, "grandchild")
    wait_for(ready)
    return child


record(os.getpid(), "worker")
"""

ENV_DUMP = """
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
        "MASTER_PORT", "SHARDLINE_SECRET", "SHARDLINE_RESTART_COUNT",
        "TORCHELASTIC_RESTART_COUNT", "OMP_NUM_THREADS", "PYTHONUNBUFFERED"]
info = {k: os.environ.get(k) for k in keys}
info["argv"] = sys.argv[1:]
(OUT_DIR / f"env-{RANK}.json").write_text(json.dumps(info))
print(f"hello from rank {RANK}")
print(f"warning from rank {RANK}", file=sys.stderr)
sys.stdout.write(f"partial line of rank {RANK}")
"""

FAIL_ON_RANK_ONE = """
if RANK == 0:
    spawn_grandchild(ignore_sigterm=True)  # only SIGKILL after the grace period stops it
    (OUT_DIR / "rank0.ready").write_text("")
    time.sleep(120)
else:
    wait_for(OUT_DIR / "rank0.ready")
    raise RuntimeError("rank one exploded")
"""

FAIL_UNTIL_THIRD_ATTEMPT = """
log_attempt()
if ATTEMPT < 2:
    if RANK == 1:
        wait_for(OUT_DIR / f"rank0-{ATTEMPT}.logged")  # so every attempt of both is logged
        sys.exit(3)
    (OUT_DIR / f"rank0-{ATTEMPT}.logged").write_text("")
    time.sleep(120)
print(f"rank {RANK} succeeded on attempt {ATTEMPT}")
"""

ALWAYS_FAIL = """
log_attempt()
if RANK == 0:
    time.sleep(0.2)
    sys.exit(7)
time.sleep(120)
"""

SLEEP_WITH_GRANDCHILD = """
log_attempt()
spawn_grandchild()
(OUT_DIR / f"rank{RANK}.ready").write_text("")
time.sleep(120)
"""

ALL_REDUCE = """\
import torch

import shardline as sl

sl.init()
t = torch.full((4,), float(sl.get_rank() + 1))
sl.all_reduce(t)
assert t.tolist() == [3.0] * 4, t
print(f"SUM {t[0].item()} rank {sl.get_rank()} of {sl.get_world_size()}")
sl.shutdown()
"""


# --- helpers -------------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie left for an init that does not reap counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    return stat[stat.rfind(b")") + 2 :].split()[0] not in (b"Z", b"X")


def _recorded(pid_dir: Path) -> dict[int, str]:
    return {int(p.name): p.read_text() for p in pid_dir.iterdir()}


@pytest.fixture
def pid_dir(tmp_path: Path) -> Iterator[Path]:
    """Where workers record their pids; afterwards, none of them may still be running."""
    path = tmp_path / "pids"
    path.mkdir()
    yield path
    deadline = time.monotonic() + 3.0
    while (left := [p for p in _recorded(path) if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    roles = _recorded(path)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left behind: {[(p, roles[p]) for p in left]}"


def _script(tmp_path: Path, body: str, name: str = "worker.py") -> Path:
    path = tmp_path / name
    path.write_text(HEADER + body)
    return path


def _env(tmp_path: Path, pid_dir: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        **os.environ,
        "PYTHONPATH": PYTHONPATH,
        "PID_DIR": str(pid_dir),
        "OUT_DIR": str(tmp_path),
    }
    for name in ("SHARDLINE_SECRET", "SHARDLINE_INSECURE", "OMP_NUM_THREADS"):
        env.pop(name, None)
    env.update(extra or {})
    return env


def _start(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "shardline", "run", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(
    proc: subprocess.Popen[str], timeout: float = LAUNCH_TIMEOUT
) -> subprocess.CompletedProcess[str]:
    """Waits for the launcher; past ``timeout`` stops it (and so its workers) and fails."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the launcher stops its workers on SIGTERM
        try:
            out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        raise AssertionError(
            f"launcher still running after {timeout} s\nstdout:\n{out}\nstderr:\n{err}"
        ) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _launch(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return _finish(_start(args, env))


def _show(res: subprocess.CompletedProcess[str]) -> str:
    return f"rc={res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}"


def _wait_for_files(paths: list[Path], proc: subprocess.Popen[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.send_signal(signal.SIGTERM)
            res = _finish(proc)
            raise AssertionError(f"workers never became ready\n{_show(res)}")
        time.sleep(0.05)


def _attempts(tmp_path: Path) -> list[tuple[int, ...]]:
    """``(attempt, rank, master port, TORCHELASTIC_RESTART_COUNT)`` of every worker run."""
    lines = (tmp_path / "attempts.log").read_text().splitlines()
    return sorted(tuple(int(x) for x in line.split()) for line in lines)


# --- a job that succeeds -------------------------------------------------------------------


def test_every_rank_gets_its_env_and_prefixed_output(tmp_path: Path, pid_dir: Path) -> None:
    script = _script(tmp_path, ENV_DUMP)
    envs = []
    for job, extra in enumerate(({}, {"OMP_NUM_THREADS": "3"})):
        args = ["--lr", "0.1", "-m", "x", "--nproc-per-node", "9"]
        res = _launch(["--nproc-per-node", "2", str(script), *args], _env(tmp_path, pid_dir, extra))
        assert res.returncode == 0, _show(res)
        for rank in (0, 1):
            assert f"[rank{rank}]: hello from rank {rank}\n" in res.stdout, _show(res)
            assert f"[rank{rank}]: partial line of rank {rank}\n" in res.stdout, _show(res)
            assert f"[rank{rank}]: warning from rank {rank}\n" in res.stderr, _show(res)
        assert all(line.startswith("[rank") for line in res.stdout.splitlines()), _show(res)
        envs.append([json.loads((tmp_path / f"env-{r}.json").read_text()) for r in (0, 1)])
        cores = len(os.sched_getaffinity(0))
        for rank, env in enumerate(envs[job]):
            assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
            assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
            assert env["GROUP_RANK"] == "0" and env["MASTER_ADDR"] == "127.0.0.1"
            assert env["SHARDLINE_RESTART_COUNT"] == env["TORCHELASTIC_RESTART_COUNT"] == "0"
            assert env["PYTHONUNBUFFERED"] == "1"
            assert env["OMP_NUM_THREADS"] == (str(max(1, cores // 2)) if job == 0 else "3")
            assert env["argv"] == args
        a, b = envs[job]
        assert a["MASTER_PORT"] == b["MASTER_PORT"] and 0 < int(a["MASTER_PORT"]) < 65536
        assert a["SHARDLINE_SECRET"] == b["SHARDLINE_SECRET"]
        assert len(a["SHARDLINE_SECRET"]) == 64 and int(a["SHARDLINE_SECRET"], 16) >= 0
    assert envs[0][0]["SHARDLINE_SECRET"] != envs[1][0]["SHARDLINE_SECRET"], "secret reused"


def test_two_launchers_form_one_job_of_two_nodes(tmp_path: Path, pid_dir: Path) -> None:
    script = _script(tmp_path, ENV_DUMP)
    port = str(free_port())
    env = _env(tmp_path, pid_dir, {"SHARDLINE_SECRET": "two-node-secret"})
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--master-port", port]
    procs = [_start([*common, "--node-rank", str(n), str(script)], env) for n in (0, 1)]
    results = [_finish(p) for p in procs]
    assert all(r.returncode == 0 for r in results), "\n".join(map(_show, results))
    assert "[rank3]: hello from rank 3" in results[1].stdout
    for rank in range(4):
        info = json.loads((tmp_path / f"env-{rank}.json").read_text())
        assert info["RANK"] == str(rank) and info["LOCAL_RANK"] == str(rank % 2)
        assert info["GROUP_RANK"] == str(rank // 2)
        assert info["WORLD_SIZE"] == "4" and info["LOCAL_WORLD_SIZE"] == "2"
        assert info["MASTER_PORT"] == port and info["SHARDLINE_SECRET"] == "two-node-secret"


@pytest.mark.usefixtures("native")
def test_real_all_reduce_of_a_module_run_with_dash_m(tmp_path: Path, pid_dir: Path) -> None:
    (tmp_path / "sl_launch_allreduce.py").write_text(ALL_REDUCE)
    env = _env(tmp_path, pid_dir, {"SHARDLINE_TIMEOUT": "30"})
    env["PYTHONPATH"] = os.pathsep.join([PYTHONPATH, str(tmp_path)])
    res = _launch(["--nproc-per-node", "2", "-m", "sl_launch_allreduce"], env)
    assert res.returncode == 0, _show(res)
    for rank in (0, 1):
        assert f"[rank{rank}]: SUM 3.0 rank {rank} of 2" in res.stdout, _show(res)


def test_cli_main_runs_in_process(
    tmp_path: Path,
    pid_dir: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    script = _script(tmp_path, ENV_DUMP)
    for name, value in _env(tmp_path, pid_dir).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SHARDLINE_SECRET", raising=False)
    handler = signal.getsignal(signal.SIGINT)
    assert main(["run", "--nproc_per_node", "2", str(script), "x"]) == 0
    assert signal.getsignal(signal.SIGINT) is handler, "signal handler not restored"
    out, err = capfd.readouterr()
    assert "[rank0]: hello from rank 0" in out and "[rank1]: hello from rank 1" in out, out
    assert "[rank1]: warning from rank 1" in err, err
    assert json.loads((tmp_path / "env-1.json").read_text())["argv"] == ["x"]

    assert main(["run", "--no-prefix", "--nproc-per-node", "1", str(script)]) == 0
    out, err = capfd.readouterr()
    assert out == "hello from rank 0\npartial line of rank 0\n", out
    assert err == "warning from rank 0\n", err


# --- failures and restarts -----------------------------------------------------------------


def test_failing_rank_stops_the_others_and_is_reported(tmp_path: Path, pid_dir: Path) -> None:
    script = _script(tmp_path, FAIL_ON_RANK_ONE)
    begin = time.monotonic()
    res = _launch(["--nproc-per-node", "2", str(script)], _env(tmp_path, pid_dir))
    elapsed = time.monotonic() - begin
    assert res.returncode == 1, _show(res)
    assert elapsed < 30, f"took {elapsed:.1f} s to stop rank 0\n{_show(res)}"
    report = res.stderr[res.stderr.index("=" * 78) :]
    assert "rank 1 failed (attempt 1 of 1" in report, _show(res)
    assert "exited with code 1" in report and "rank 0 stopped by the launcher" in report
    assert "Traceback (most recent call last)" in report, _show(res)
    assert "RuntimeError: rank one exploded" in report, _show(res)
    assert "[rank1]: RuntimeError: rank one exploded" in res.stderr
    roles = sorted(r.split(" of ")[0] for r in _recorded(pid_dir).values())
    assert roles == ["grandchild", "worker", "worker"], roles
    assert not [pid for pid in _recorded(pid_dir) if _alive(pid)], "the pid_dir fixture re-checks"


def test_restarts_until_an_attempt_succeeds(tmp_path: Path, pid_dir: Path) -> None:
    script = _script(tmp_path, FAIL_UNTIL_THIRD_ATTEMPT)
    res = _launch(
        ["--nproc-per-node", "2", "--max-restarts", "2", str(script)], _env(tmp_path, pid_dir)
    )
    assert res.returncode == 0, _show(res)
    runs = _attempts(tmp_path)
    assert [(attempt, rank) for attempt, rank, _, _ in runs] == [
        (a, r) for a in range(3) for r in range(2)
    ], runs
    assert all(attempt == elastic for attempt, _, _, elastic in runs)
    ports = {attempt: port for attempt, _, port, _ in runs}
    assert len(set(ports.values())) > 1, f"the master port was never renewed: {ports}"
    assert res.stderr.count("rank 1 failed") == 2 and res.stderr.count("restarting") == 2
    assert "[rank1]: rank 1 succeeded on attempt 2" in res.stdout, _show(res)


def test_gives_up_after_max_restarts(tmp_path: Path, pid_dir: Path) -> None:
    script = _script(tmp_path, ALWAYS_FAIL)
    res = _launch(
        ["--nproc-per-node", "2", "--max-restarts", "1", str(script)], _env(tmp_path, pid_dir)
    )
    assert res.returncode == 7, _show(res)
    assert sorted({attempt for attempt, *_ in _attempts(tmp_path)}) == [0, 1]
    assert "rank 0 failed (attempt 2 of 2" in res.stderr, _show(res)
    assert "giving up after 2 attempts" in res.stderr, _show(res)


@pytest.mark.parametrize("code", [0, 3])
def test_an_elastic_job_whose_workers_end_before_it_forms_ends_with_their_code(
    tmp_path: Path, pid_dir: Path, code: int
) -> None:
    """Workers that end at once (a wrong module name, ``--help``) before the first generation
    is published: the launcher ends with their code, not waits for a generation forever."""
    script = tmp_path / "ends.py"  # (not _script's header, which reads RANK: elastic sets none)
    script.write_text(f"raise SystemExit({code})\n")
    env = _env(tmp_path, pid_dir, {"SHARDLINE_SECRET": "elastic-test"})
    args = ["--nnodes", "1:2", "--master-port", str(free_port()), "--nproc-per-node", "2"]
    res = _finish(_start([*args, str(script)], env), timeout=60)
    assert res.returncode == code, _show(res)


def test_worker_killed_by_a_signal_is_reported_by_name(tmp_path: Path, pid_dir: Path) -> None:
    script = _script(tmp_path, "os.kill(os.getpid(), signal.SIGKILL)\n")
    res = _launch(["--nproc-per-node", "1", str(script)], _env(tmp_path, pid_dir))
    assert res.returncode == 1, _show(res)
    assert "rank 0 (local rank 0, pid " in res.stderr, _show(res)
    assert "was killed by signal SIGKILL (9)" in res.stderr, _show(res)
    assert "rank 0 wrote nothing to stderr" in res.stderr, _show(res)


# --- signals -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"]
)
def test_stop_signal_stops_every_worker(
    tmp_path: Path, pid_dir: Path, signum: signal.Signals, code: int
) -> None:
    script = _script(tmp_path, SLEEP_WITH_GRANDCHILD)
    proc = _start(
        ["--nproc-per-node", "2", "--max-restarts", "3", str(script)], _env(tmp_path, pid_dir)
    )
    _wait_for_files([tmp_path / "rank0.ready", tmp_path / "rank1.ready"], proc, 45)
    proc.send_signal(signum)
    stopped_at = time.monotonic()
    res = _finish(proc, timeout=30)
    assert res.returncode == code, _show(res)
    assert time.monotonic() - stopped_at < 10, _show(res)
    assert f"stopped by {signum.name}" in res.stderr, _show(res)
    assert {attempt for attempt, *_ in _attempts(tmp_path)} == {0}, "restarted after a stop"
    assert len(_recorded(pid_dir)) == 4  # two workers, two grandchildren
    assert not [pid for pid in _recorded(pid_dir) if _alive(pid)], "the pid_dir fixture re-checks"


# --- bad arguments -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nproc-per-node", "0"], "--nproc-per-node 0: need at least 1 worker"),
        (["--nproc-per-node", "two"], "invalid int value: 'two'"),
        (["--nnodes", "2"], "--nnodes 2 needs --master-port"),
        (["--nnodes", "2", "--master-port", "29500"], "export SHARDLINE_SECRET="),
        (["--nnodes", "1:2", "--master-port", "29500"], "--nnodes 1:2 needs a secret"),
        (["--nnodes", "2", "--node-rank", "2", "--master-port", "1"], "--node-rank 2 is outside"),
        (["--master-port", "70000"], "--master-port 70000 is not a port"),
        (["--max-restarts", "-1"], "--max-restarts -1 must be 0 or more"),
    ],
)
def test_bad_arguments_fail_with_a_clear_error(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    flags: list[str],
    message: str,
) -> None:
    monkeypatch.delenv("SHARDLINE_SECRET", raising=False)
    monkeypatch.delenv("SHARDLINE_INSECURE", raising=False)
    script = _script(tmp_path, "raise SystemExit('must not run')\n")
    assert main(["run", *flags, str(script)]) == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_missing_script_and_missing_target_are_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "--nproc-per-node", "2", str(tmp_path / "nope.py")]) == 2
    assert "nope.py' does not exist" in capsys.readouterr().err
    assert main(["run", "--nproc-per-node", "2"]) == 2
    assert "the following arguments are required" in capsys.readouterr().err


def test_python_dash_m_shardline_reports_bad_arguments(tmp_path: Path, pid_dir: Path) -> None:
    script = _script(tmp_path, "raise SystemExit('must not run')\n")
    res = _launch(["--nnodes", "2", "--master-port", "29500", str(script)], _env(tmp_path, pid_dir))
    assert res.returncode == 2, _show(res)
    assert "shardline run: error:" in res.stderr and "SHARDLINE_INSECURE=1" in res.stderr
    assert not _recorded(pid_dir), "a worker started despite the error"


def test_secret_and_thread_count_come_from_the_environment_when_set() -> None:
    one = LaunchConfig("train.py", nproc_per_node=2)
    two = LaunchConfig("train.py", nproc_per_node=2, nnodes=2, node_rank=1, master_port=29500)
    assert resolve_secret(one, {"SHARDLINE_SECRET": "s"}) == "s"
    assert resolve_secret(two, {"SHARDLINE_SECRET": "s"}) == "s"
    assert resolve_secret(two, {"SHARDLINE_INSECURE": "1"}) is None
    with pytest.raises(InvalidArgumentError, match="SHARDLINE_SECRET"):
        resolve_secret(two, {})
    env = worker_env(
        two, local_rank=1, master_port=29500, secret=None, base={"OMP_NUM_THREADS": "5"}
    )
    assert env["RANK"] == "3" and env["GROUP_RANK"] == "1" and env["WORLD_SIZE"] == "4"
    assert env["OMP_NUM_THREADS"] == "5" and "SHARDLINE_SECRET" not in env
