"""Ranks of multiprocess tests forked from a server that has imported torch and shardline.

A fresh ``python _worker.py`` spends about 2.5 s of CPU importing torch before it does
anything; the tests of processes start some hundred ranks, which on CI's 2 cores was most of
their time. Here one server process (``multiprocessing``'s forkserver) imports torch,
shardline and the worker modules once, and every rank is a fork of it: a separate process
with its own pid, environment, exit status and output, that runs the worker script as
``__main__`` exactly as ``python worker.py scenario`` would. What a rank does after start-up
is unchanged; what is not covered here is a fresh interpreter's import of shardline, which
the launcher's tests (``shardline run`` starts its workers with ``subprocess``) still do.

``ForkedProcess`` offers the part of ``subprocess.Popen`` the tests use: ``pid``,
``poll``, ``wait``, ``communicate``, ``send_signal``, ``kill``, ``returncode`` and a
line-readable ``stdout``. Output goes to files rather than pipes (a fork server cannot hand
pipe ends over), read back when the rank ends. ``ExecProcess`` is the same surface over a
fresh interpreter: ranks under ``TEST_FRESH_RANKS=1``, the benches' ranks (which measure a
process of their own), and command lines that cannot be forked (``-m``, ``-c``, a stdin).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import IO

# Imported by the server before it forks anything (its children skip these imports).
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch._dynamo",  # a rank's first optimizer imports it: seconds, in every rank
    "shardline",
    "tests.multiprocess._worker",
    "tests.multiprocess._liveness_worker",
    "tests.multiprocess._doctor_worker",
]

# Ranks as fresh interpreters (``python worker.py``) instead, for comparison or debugging.
FRESH_INTERPRETERS = os.environ.get("TEST_FRESH_RANKS") == "1"
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1


@functools.cache
def _context() -> multiprocessing.context.ForkServerContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _enter_netns(name: str) -> None:
    """Moves this (single-threaded, just forked) process into network namespace ``name``, as
    ``ip netns exec`` does (``os.setns`` is Python 3.12's; libc's is called here)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def die_with_parent() -> None:
    """Asks Linux to SIGKILL this process when its parent (the fork server) exits.

    The server exits when the test session does, also when pytest is killed, so a rank
    that would otherwise run on (one that all-reduces forever, waiting for a kill) goes
    with it instead of loading the machine as an orphan. A parent already gone before the
    call (this process was re-parented) kills it at once.
    """
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if parent == 1 or os.getppid() != parent:  # orphaned already (init adopted it)
        os.kill(os.getpid(), signal.SIGKILL)


def _run_script(
    script: str,
    argv: list[str],
    env: dict[str, str],
    out: str,
    err: str,
    new_session: bool,
    netns: str | None,
) -> None:
    """The rank's body, in the forked child: the environment, output, session, network
    namespace and ``__main__`` of ``python script *argv``, and its exit status (atexit
    handlers included, which a multiprocessing child would otherwise skip)."""
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [script, *argv]
    code = 0
    try:
        # After the redirection, so that a failure here lands in the rank's own stderr.
        die_with_parent()
        if new_session:
            os.setsid()
        if netns is not None:
            _enter_netns(netns)
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class RankProcess:
    """A child process whose stdout and stderr go to files, with the ``subprocess.Popen``
    surface the tests use; ``ForkedProcess`` and ``ExecProcess`` start it."""

    def __init__(self, output: tuple[Path | None, Path | None] | None, new_session: bool) -> None:
        """``output``: the stdout and stderr files (kept; ``None`` for one: this process's own
        stream), or ``None`` for files of its own (deleted by ``communicate``)."""
        self._dir: str | None = None
        if output is None:
            self._dir = tempfile.mkdtemp(prefix="shardline-rank-")
            output = (Path(self._dir, "stdout"), Path(self._dir, "stderr"))
        self._out = None if output[0] is None else str(output[0])
        self._err = None if output[1] is None else str(output[1])
        for path in (self._out, self._err):
            if path is not None:
                Path(path).touch()  # a rank killed before it opened them still has both
        self.new_session = new_session
        self.pid: int = 0
        self.returncode: int | None = None
        self._output: tuple[str, str] | None = None
        self._stdout: IO[str] | None = None

    @property
    def stdout(self) -> IO[str]:
        """The rank's stdout, readable while it runs (closed by ``communicate``)."""
        if self._stdout is None:
            if self._out is None:
                raise ValueError("this process writes to this process's stdout")
            self._stdout = open(self._out)  # noqa: SIM115
        return self._stdout

    def poll(self) -> int | None:
        """The exit status (negative: killed by that signal), or ``None`` while it runs."""
        raise NotImplementedError

    def wait(self, timeout: float | None = None) -> int:
        """Waits for the rank to end; ``subprocess.TimeoutExpired`` past ``timeout``."""
        raise NotImplementedError

    def read(self) -> tuple[str, str]:
        """What the rank wrote to stdout and stderr so far (all of it once it was collected)."""
        if self._output is not None:
            return self._output
        return tuple(  # type: ignore[return-value]
            "" if p is None else Path(p).read_text(errors="replace") for p in (self._out, self._err)
        )

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Waits, then returns everything the rank wrote to stdout and stderr."""
        self.wait(timeout)
        if self._output is None:
            if self._stdout is not None:
                self._stdout.close()
            self._output = self.read()
            if self._dir is not None:
                for path in (self._out, self._err):
                    if path is not None:
                        Path(path).unlink()
                os.rmdir(self._dir)
        return self._output

    def send_signal(self, signum: int) -> None:
        """Sends ``signum`` to the rank (to its whole session when it leads one), if it still
        runs."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                if self.new_session:
                    os.killpg(self.pid, signum)
                else:
                    os.kill(self.pid, signum)

    def kill(self) -> None:
        """SIGKILL."""
        self.send_signal(signal.SIGKILL)


class ForkedProcess(RankProcess):
    """A rank forked from the server: ``python script *argv`` without the interpreter's start."""

    def __init__(
        self,
        script: Path | str,
        argv: list[str],
        env: dict[str, str],
        *,
        output: tuple[Path, Path] | None = None,
        new_session: bool = False,
        netns: str | None = None,
    ) -> None:
        """Forks ``python script *argv`` with environment ``env``; its stdout and stderr go to
        ``output`` (kept) or to files of its own (deleted by ``communicate``); with
        ``new_session`` it leads a session of its own (``start_new_session``), with ``netns``
        it runs in that network namespace (``ip netns exec``)."""
        super().__init__(output, new_session)
        assert self._out is not None and self._err is not None
        self._proc: BaseProcess = _context().Process(
            target=_run_script,
            args=(str(script), argv, env, self._out, self._err, new_session, netns),
            daemon=False,
        )
        self._proc.start()
        assert self._proc.pid is not None
        self.pid = self._proc.pid

    def poll(self) -> int | None:
        """The exit status (negative: killed by that signal), or ``None`` while it runs."""
        if self.returncode is None and not self._proc.is_alive():
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Waits for the rank to end; ``subprocess.TimeoutExpired`` past ``timeout``."""
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(str(self._proc), timeout or 0.0)
        assert self.returncode is not None
        return self.returncode


class ExecProcess(RankProcess):
    """A fresh interpreter (or any command line), its output in files like a forked rank's."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        *,
        output: tuple[Path | None, Path | None] | None = None,
        new_session: bool = False,
        netns: str | None = None,
        stdin: bool = False,
    ) -> None:
        """Starts ``argv`` with environment ``env``, output as ``RankProcess`` says; with
        ``netns`` under ``ip netns exec``; with ``stdin`` its standard input is a pipe
        (``self.stdin``), else empty."""
        super().__init__(output, new_session)
        if netns is not None:
            argv = ["ip", "netns", "exec", netns, *argv]
        with contextlib.ExitStack() as files:
            out, err = (
                None if p is None else files.enter_context(open(p, "wb"))
                for p in (self._out, self._err)
            )
            self._popen = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=new_session,
            )
        self.pid = self._popen.pid
        self.stdin: IO[bytes] | None = self._popen.stdin

    def poll(self) -> int | None:
        """The exit status (negative: killed by that signal), or ``None`` while it runs."""
        self.returncode = self._popen.poll()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Waits for the process to end; ``subprocess.TimeoutExpired`` past ``timeout``."""
        self.returncode = self._popen.wait(timeout)
        return self.returncode
