"""Simulated hosts for benchmarks: ``n`` network namespaces on one switch, links shaped by tc.

Host ``r`` is namespace ``<tag>h<r>`` with address ``10.78.0.<r+1>`` on interface
``<tag>e<r>``, a veth whose other end sits on a bridge in the switch namespace ``<tag>sw``.
``shape("1gbit")`` puts a token-bucket filter (Linux traffic control) on both ends of every
link, so each host sends and receives at most that rate; the code under test has no knob for
it. ``close()`` removes the namespaces (links and filters go with them).

Built through netlink with ``pyroute2`` (pure Python, ``pip install pyroute2``), so it runs
where the ``ip`` and ``tc`` tools are not installed. Needs root; traffic stays inside these
namespaces.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

__all__ = ["Star", "usable"]


def usable() -> str | None:
    """Why simulated hosts cannot be built here (``None`` when they can)."""
    try:
        import pyroute2  # noqa: F401, PLC0415
    except ImportError:
        return "pyroute2 is not installed (pip install pyroute2)"
    import os  # noqa: PLC0415

    if os.geteuid() != 0:
        return "network namespaces need root"
    return None


class Star:
    """``n`` hosts on one switch (see the module docstring)."""

    def __init__(self, n: int, tag: str = "slb") -> None:
        self.n = n
        self.tag = tag

    def ns(self, r: int) -> str:
        """Host ``r``'s namespace."""
        return f"{self.tag}h{r}"

    def ifname(self, r: int) -> str:
        """Host ``r``'s interface (inside its namespace)."""
        return f"{self.tag}e{r}"

    def port(self, r: int) -> str:
        """The switch's end of host ``r``'s link."""
        return f"{self.tag}p{r}"

    def addr(self, r: int) -> str:
        """Host ``r``'s address."""
        return f"10.78.0.{r + 1}"

    @property
    def switch(self) -> str:
        """The switch's namespace."""
        return f"{self.tag}sw"

    def open(self) -> Star:
        """Builds the namespaces, the bridge and the links."""
        from pyroute2 import IPRoute, NetNS, netns  # noqa: PLC0415

        self.close()  # leftovers of an interrupted run
        netns.create(self.switch)
        for r in range(self.n):
            netns.create(self.ns(r))
        with NetNS(self.switch) as sw:
            sw.link("add", ifname="br0", kind="bridge")
            br = sw.link_lookup(ifname="br0")[0]
            sw.link("set", index=br, state="up")
            with IPRoute() as ipr:
                for r in range(self.n):
                    ipr.link("add", ifname=self.ifname(r), kind="veth", peer=self.port(r))
                    e = ipr.link_lookup(ifname=self.ifname(r))[0]
                    p = ipr.link_lookup(ifname=self.port(r))[0]
                    ipr.link("set", index=e, net_ns_fd=self.ns(r))
                    ipr.link("set", index=p, net_ns_fd=self.switch)
            for r in range(self.n):
                with NetNS(self.ns(r)) as h:
                    h.link("set", index=h.link_lookup(ifname="lo")[0], state="up")
                    e = h.link_lookup(ifname=self.ifname(r))[0]
                    h.addr("add", index=e, address=self.addr(r), prefixlen=24)
                    h.link("set", index=e, state="up")
                p = sw.link_lookup(ifname=self.port(r))[0]
                sw.link("set", index=p, master=br)
                sw.link("set", index=p, state="up")
        return self

    def shape(self, rate: str | None) -> None:
        """Limits every link to ``rate`` each way (``"1gbit"``, ``"10gbit"``; ``None``: none)."""
        from pyroute2 import NetNS  # noqa: PLC0415

        gbit = float(rate.removesuffix("gbit")) if rate and rate.endswith("gbit") else 1.0
        burst = int(max(2.0, 2 * gbit) * (1 << 20))  # >= rate / HZ at HZ 250, with margin
        for r in range(self.n):
            for name, dev in ((self.ns(r), self.ifname(r)), (self.switch, self.port(r))):
                with NetNS(name) as ns:
                    idx = ns.link_lookup(ifname=dev)[0]
                    with contextlib.suppress(Exception):  # nothing there yet
                        ns.tc("del", index=idx, handle=0x10000)
                    if rate is not None:
                        ns.tc("add", "tbf", index=idx, handle=0x10000, rate=rate, burst=burst,
                              latency="200ms")  # fmt: skip

    def tx_rx(self, r: int) -> tuple[int, int]:
        """Bytes host ``r``'s interface has sent and received so far."""
        from pyroute2 import NetNS  # noqa: PLC0415

        with NetNS(self.ns(r)) as ns:
            idx = ns.link_lookup(ifname=self.ifname(r))[0]
            stats = ns.get_links(idx)[0].get_attr("IFLA_STATS64")
        return int(stats["tx_bytes"]), int(stats["rx_bytes"])

    def enter(self, r: int) -> Callable[[], None]:
        """A ``preexec_fn`` that moves a child process into host ``r``."""
        name = self.ns(r)

        def move() -> None:
            from pyroute2 import netns  # noqa: PLC0415

            netns.setns(name, flags=0)

        return move

    def close(self) -> None:
        """Deletes every namespace of this tag."""
        from pyroute2 import netns  # noqa: PLC0415

        for name in netns.listnetns():
            if name == self.switch or (
                name.startswith(f"{self.tag}h") and name[len(self.tag) + 1 :].isdigit()
            ):
                with contextlib.suppress(Exception):
                    netns.remove(name)
