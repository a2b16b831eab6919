"""Simulated hosts for tests: network namespaces joined by veth pairs, built and removed here.

``Hosts`` makes namespace ``a`` (10.77.0.1) and ``b`` (10.77.0.2) on one veth pair, and
optionally a third, ``c`` (10.77.1.2), linked to ``a`` only and routed to 10.77.0.0/24 through
it: a stranger on the network. Processes started with ``Hosts.popen(host, ...)`` run inside a
namespace (``ip netns exec``) with their output in files that can be read while they run.
``close()`` kills every process started here, deletes the namespaces (their links go with
them) and says which ``/dev/shm`` entries of ours appeared and were not removed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.multiprocess._forkserver import FRESH_INTERPRETERS, ForkedProcess

ADDRS = {"a": "10.77.0.1", "b": "10.77.0.2", "c": "10.77.1.2"}


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


def _shm_entries() -> set[str]:
    """Our ``/dev/shm`` entries whose creator (``shardline-<pid>-...``) is gone: what a test
    may have left behind (a live creator, another test's, still owns its entry)."""
    left = set()
    for path in Path("/dev/shm").glob("shardline-*"):
        pid = path.name.split("-")[1]
        if not (pid.isdigit() and Path(f"/proc/{pid}").exists()):
            left.add(path.name)
    return left


@dataclass
class Proc:
    """A process inside a namespace; its output goes to files read by ``out``/``err``."""

    name: str
    host: str
    popen: subprocess.Popen[bytes] | ForkedProcess
    out_path: Path
    err_path: Path

    @property
    def out(self) -> str:
        return self.out_path.read_text(errors="replace")

    @property
    def err(self) -> str:
        return self.err_path.read_text(errors="replace")

    @property
    def rc(self) -> int | None:
        return self.popen.poll()


@dataclass
class Hosts:
    """Namespaces ``a``, ``b`` (and ``c`` when ``stranger``) and the processes run in them."""

    stranger: bool = False
    tag: str = field(default_factory=lambda: f"sl{os.getpid() % 100000}")
    procs: list[Proc] = field(default_factory=list)
    _tmp: tempfile.TemporaryDirectory[str] = field(
        default_factory=lambda: tempfile.TemporaryDirectory(prefix="shardline-hosts-")
    )
    _made: list[str] = field(default_factory=list)
    _shm_before: set[str] = field(default_factory=set)

    def ns(self, host: str) -> str:
        """The namespace name of ``host``."""
        return f"{self.tag}{host}"

    def link(self, host: str) -> str:
        """The name of ``host``'s interface towards ``a`` (``b`` and ``c``) or ``b`` (``a``)."""
        return f"{self.tag}v{host}"

    def open(self) -> Hosts:
        """Builds the namespaces and links (``ip`` must be allowed: root)."""
        self._shm_before = _shm_entries()
        names = ["a", "b", "c"] if self.stranger else ["a", "b"]
        for host in names:
            _ip("netns", "add", self.ns(host))
            self._made.append(self.ns(host))
            _ip("-n", self.ns(host), "link", "set", "lo", "up")
        a, b = self.ns("a"), self.ns("b")
        _ip("link", "add", self.link("a"), "netns", a, "type", "veth", "peer", "name",
            self.link("b"), "netns", b)  # fmt: skip
        _ip("-n", a, "addr", "add", f"{ADDRS['a']}/24", "dev", self.link("a"))
        _ip("-n", b, "addr", "add", f"{ADDRS['b']}/24", "dev", self.link("b"))
        for host in ("a", "b"):
            _ip("-n", self.ns(host), "link", "set", self.link(host), "up")
        if self.stranger:
            c, ca = self.ns("c"), f"{self.tag}vca"
            _ip("link", "add", self.link("c"), "netns", c, "type", "veth", "peer", "name", ca,
                "netns", a)  # fmt: skip
            _ip("-n", a, "addr", "add", "10.77.1.1/24", "dev", ca)
            _ip("-n", c, "addr", "add", f"{ADDRS['c']}/24", "dev", self.link("c"))
            _ip("-n", a, "link", "set", ca, "up")
            _ip("-n", c, "link", "set", self.link("c"), "up")
            _ip("-n", c, "route", "add", "10.77.0.0/24", "via", "10.77.1.1")
        return self

    def cut(self) -> None:
        """Takes ``b``'s end of the a-b link down: from now on nothing passes between them."""
        _ip("-n", self.ns("b"), "link", "set", self.link("b"), "down")

    def popen(
        self, host: str, name: str, args: list[str], env: dict[str, str], stdin: bool = False
    ) -> Proc:
        """Starts ``args`` (a Python command line when it starts with ``-``) in ``host``; with
        ``stdin``, its standard input is a pipe (``proc.popen.stdin``)."""
        argv = [sys.executable, *args] if args[0].startswith("-") else args
        out = Path(self._tmp.name) / f"{name}.out"
        err = Path(self._tmp.name) / f"{name}.err"
        popen: subprocess.Popen[bytes] | ForkedProcess
        if args[0] == "-u" and args[1].endswith(".py") and not stdin and not FRESH_INTERPRETERS:
            # ``python -u script.py ...``: forked from the test fork server instead, its
            # output line-buffered into the same files.
            popen = ForkedProcess(args[1], args[2:], env, output=(out, err), new_session=True,
                                  netns=self.ns(host))  # fmt: skip
        else:
            with out.open("wb") as o, err.open("wb") as e:
                popen = subprocess.Popen(
                    ["ip", "netns", "exec", self.ns(host), *argv],
                    env=env,
                    stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                    stdout=o,
                    stderr=e,
                    start_new_session=True,
                )
        proc = Proc(name, host, popen, out, err)
        self.procs.append(proc)
        return proc

    def listening_ports(self, host: str) -> list[int]:
        """TCP ports listening in ``host`` (state 0A in its ``/proc/net/tcp``), read through a
        live process of ours there when there is one (fast), else ``ip netns exec``."""
        inside = [p for p in self.procs if p.host == host and p.rc is None]
        texts = []
        for path in ("tcp", "tcp6"):
            try:
                if not inside:
                    raise OSError("no process of ours in the namespace")
                texts.append(Path(f"/proc/{inside[0].popen.pid}/net/{path}").read_text())
            except OSError:
                cmd = ["ip", "netns", "exec", self.ns(host), "cat", f"/proc/net/{path}"]
                done = subprocess.run(cmd, capture_output=True, text=True, check=False)
                texts.append(done.stdout)
        ports = []
        for text in texts:
            for line in text.splitlines()[1:]:
                cols = line.split()
                if len(cols) > 3 and cols[3] == "0A":
                    ports.append(int(cols[1].rsplit(":", 1)[1], 16))
        return sorted(set(ports))

    def wait(self, procs: list[Proc], timeout: float) -> list[str]:
        """Waits for ``procs``; kills every process here past ``timeout``; the names of those
        that were still running then."""
        deadline = time.monotonic() + timeout
        hung = []
        for p in procs:
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung.append(p.name)
        if hung:
            self.kill()
        return hung

    def kill(self) -> None:
        """SIGKILLs every process started here (whole sessions: launchers and workers)."""
        for p in self.procs:
            if p.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.popen.pid, signal.SIGKILL)
                p.popen.wait()

    def report(self, procs: list[Proc] | None = None) -> str:
        """Every process's exit status and output."""
        return "\n".join(
            f"--- {p.name} (rc={p.rc}) ---\nstdout:\n{p.out}\nstderr:\n{p.err[-4000:]}"
            for p in (procs if procs is not None else self.procs)
        )

    def close(self) -> list[str]:
        """Kills what runs, deletes the namespaces; the ``/dev/shm`` entries left behind."""
        self.kill()
        for ns in self._made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        self._made.clear()
        self._tmp.cleanup()
        return sorted(_shm_entries() - self._shm_before)


def namespaces_allowed() -> str | None:
    """``None`` when this process may create network namespaces, else why not."""
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"slprobe{os.getpid() % 100000}"
    try:
        _ip("netns", "add", probe)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        return f"`ip netns add` is refused here: {str(detail).strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None
