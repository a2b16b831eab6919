"""Simulated hosts, for the tests and the benches: network namespaces on one switch.

Host ``h`` (the i-th of ``names``) is namespace ``<tag><h>`` with address ``<subnet>.<i+1>``
on interface ``<tag>e<h>``, a veth whose other end is a port of a bridge in the switch
namespace ``<tag>sw``. ``shape("1gbit")`` puts a token-bucket filter (Linux traffic control)
on both ends of every link, so each host sends and receives at most that rate; ``cut(h)``
takes ``h``'s link down. Processes started with ``Hosts.popen(host, ...)`` run inside a
namespace with their output in files that can be read while they run; ranks of a job go
into them with ``_launch.start(..., netns=lambda r: hosts.ns(...))``. ``close()`` kills every
process started here, deletes the namespaces (their links and filters go with them) and says
which ``/dev/shm`` entries of ours appeared and were not removed.

Built with the ``ip`` and ``tc`` tools (iproute2); needs root. Traffic stays inside these
namespaces.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.multiprocess._launch import Rank, kill_all, orphaned_shm, report, spawn

__all__ = ["Hosts", "namespaces_allowed"]


def _run(tool: str, *args: str, check: bool = True) -> str:
    done = subprocess.run([tool, *args], check=check, capture_output=True, text=True, timeout=20)
    return done.stdout


class Hosts:
    """Hosts ``names`` on one switch, and the processes run in them (module docstring)."""

    def __init__(
        self, names: Sequence[str] = ("a", "b"), *, tag: str | None = None, subnet: str = "10.77.0"
    ) -> None:
        self.names = list(names)
        self.tag = tag or f"sl{os.getpid() % 100000}"
        self.subnet = subnet
        self.procs: list[Rank] = []
        self._tmp = tempfile.TemporaryDirectory(prefix="shardline-hosts-")
        self._made: list[str] = []
        self._shm_before: set[str] = set()

    def ns(self, host: str) -> str:
        """The namespace of ``host``."""
        return f"{self.tag}{host}"

    @property
    def switch(self) -> str:
        """The switch's namespace."""
        return f"{self.tag}sw"

    def ifname(self, host: str) -> str:
        """``host``'s interface (inside its namespace)."""
        return f"{self.tag}e{host}"

    def _port(self, host: str) -> str:
        return f"{self.tag}p{host}"

    def addr(self, host: str) -> str:
        """``host``'s address."""
        return f"{self.subnet}.{self.names.index(host) + 1}"

    def open(self) -> Hosts:
        """Builds the switch, the hosts and their links (removing leftovers of an interrupted
        run of the same tag first)."""
        self._shm_before = orphaned_shm()
        self._delete([self.switch, *map(self.ns, self.names)])
        sw = self.switch
        _run("ip", "netns", "add", sw)
        self._made.append(sw)
        _run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", sw, "link", "set", "br0", "up")
        for host in self.names:
            ns, dev, port = self.ns(host), self.ifname(host), self._port(host)
            _run("ip", "netns", "add", ns)
            self._made.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port,
                 "netns", sw)  # fmt: skip
            _run("ip", "-n", ns, "addr", "add", f"{self.addr(host)}/24", "dev", dev)
            _run("ip", "-n", ns, "link", "set", dev, "up")
            _run("ip", "-n", sw, "link", "set", port, "master", "br0")
            _run("ip", "-n", sw, "link", "set", port, "up")
        return self

    def shape(self, rate: str | None) -> None:
        """Limits every link to ``rate`` each way (``"1gbit"``, ``"10gbit"``; ``None``: none)."""
        gbit = float(rate.removesuffix("gbit")) if rate and rate.endswith("gbit") else 1.0
        burst = int(max(2.0, 2 * gbit) * (1 << 20))  # >= rate / HZ at HZ 250, with margin
        for host in self.names:
            for ns, dev in ((self.ns(host), self.ifname(host)), (self.switch, self._port(host))):
                if rate is None:
                    _run("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
                else:
                    _run("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "handle", "1:",
                         "tbf", "rate", rate, "burst", str(burst), "latency", "200ms")  # fmt: skip

    def cut(self, host: str = "b") -> None:
        """Takes ``host``'s link down: from now on nothing passes between it and the others."""
        _run("ip", "-n", self.ns(host), "link", "set", self.ifname(host), "down")

    def tx_rx(self, host: str) -> tuple[int, int]:
        """Bytes ``host``'s interface has sent and received so far."""
        return nic_bytes(self._proc_net(host, "dev"), self.ifname(host))

    def popen(
        self, host: str, name: str, args: list[str], env: Mapping[str, str], stdin: bool = False
    ) -> Rank:
        """Starts ``python *args`` in ``host`` (``_launch.spawn``: forked when it can be), in a
        session of its own; with ``stdin``, its standard input is a pipe (``proc.stdin``)."""
        out = Path(self._tmp.name) / f"{name}.out"
        err = Path(self._tmp.name) / f"{name}.err"
        proc = spawn(
            args, env, output=(out, err), new_session=True, netns=self.ns(host), stdin=stdin
        )
        rank = Rank(-1, proc, name=name, host=host)
        self.procs.append(rank)
        return rank

    def _proc_net(self, host: str, table: str) -> str:
        """``/proc/net/<table>`` as ``host`` sees it, read through a live process of ours there
        when there is one (fast), else ``ip netns exec``."""
        inside = [p for p in self.procs if p.host == host and p.rc is None]
        with contextlib.suppress(OSError):
            if inside:
                return Path(f"/proc/{inside[0].proc.pid}/net/{table}").read_text()
        return _run("ip", "netns", "exec", self.ns(host), "cat", f"/proc/net/{table}", check=False)

    def listening_ports(self, host: str) -> list[int]:
        """TCP ports listening in ``host`` (state 0A in its ``/proc/net/tcp``)."""
        ports = []
        for table in ("tcp", "tcp6"):
            for line in self._proc_net(host, table).splitlines()[1:]:
                cols = line.split()
                if len(cols) > 3 and cols[3] == "0A":
                    ports.append(int(cols[1].rsplit(":", 1)[1], 16))
        return sorted(set(ports))

    def wait(self, procs: list[Rank], timeout: float) -> list[str]:
        """Waits for ``procs``; kills every process here past ``timeout``; the names of those
        that were still running then."""
        deadline = time.monotonic() + timeout
        hung = []
        for p in procs:
            try:
                p.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung.append(p.name)
        if hung:
            self.kill()
        return hung

    def kill(self) -> None:
        """SIGKILLs every process started here (whole sessions: launchers and workers)."""
        kill_all(self.procs)

    def report(self, procs: list[Rank] | None = None) -> str:
        """Every process's exit status and output."""
        return report(procs if procs is not None else self.procs, err_limit=4000)

    def close(self) -> list[str]:
        """Kills what runs, deletes the namespaces; the ``/dev/shm`` entries left behind."""
        self.kill()
        self._delete(self._made)
        self._made.clear()
        self._tmp.cleanup()
        return sorted(orphaned_shm() - self._shm_before)

    @staticmethod
    def _delete(names: list[str]) -> None:
        listed = set(_run("ip", "netns", "list", check=False).split())
        for ns in names:
            if ns in listed:
                _run("ip", "netns", "del", ns, check=False)


def nic_bytes(proc_net_dev: str, ifname: str) -> tuple[int, int]:
    """Bytes sent and received by ``ifname``, from the text of a ``/proc/net/dev``."""
    for line in proc_net_dev.splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == ifname:
            cols = counters.split()
            return int(cols[8]), int(cols[0])
    raise KeyError(f"no interface {ifname!r} in /proc/net/dev")


def namespaces_allowed() -> str | None:
    """``None`` when this process may create network namespaces, else why not."""
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"slprobe{os.getpid() % 100000}"
    try:
        _run("ip", "netns", "add", probe)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        return f"`ip netns add` is refused here: {str(detail).strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None
