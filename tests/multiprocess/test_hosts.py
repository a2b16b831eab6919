"""Two real hosts' worth of networking: jobs across network namespaces on one switch.

Host ``a`` is 10.77.0.1 (the master), host ``b`` 10.77.0.2, each with its own
``SHARDLINE_HOST_ID``, so ranks of one host share memory and the hosts talk TCP. The tests
build the namespaces and remove them (with their links, processes and ``/dev/shm`` entries)
afterwards; where ``ip netns`` is refused, they skip and say why.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.multiprocess._launch import PYTHONPATH, Rank, free_port
from tests.multiprocess._netns import Hosts, namespaces_allowed

_REFUSED = namespaces_allowed()
pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.usefixtures("native"),
    pytest.mark.skipif(_REFUSED is not None, reason=str(_REFUSED)),
]

WORKER = str(Path(__file__).with_name("_liveness_worker.py"))
FAILED = re.compile(r"FAILED ([0-9.]+) (\w+): (.*)$", re.MULTILINE)
SECRET = "two-hosts-test-secret"
KEEPALIVE_S = 3.0


def _env(host: str, **extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SHARDLINE_")}
    return {
        **base,
        "PYTHONPATH": PYTHONPATH,
        "SHARDLINE_HOST_ID": f"host-{host}",
        "SHARDLINE_SECRET": SECRET,
        "SHARDLINE_TIMEOUT": "120",
        "OMP_NUM_THREADS": "1",
        **extra,
    }


@pytest.fixture
def hosts(request: pytest.FixtureRequest) -> Iterator[Hosts]:
    """Hosts ``a`` and ``b``; also ``c`` (a stranger on the same switch) when the test is
    parametrised indirectly with ``"abc"``."""
    h = Hosts(getattr(request, "param", "ab")).open()
    try:
        yield h
    finally:
        left = h.close()
        assert not left, f"left in /dev/shm: {left}"


def _ranks(
    hosts: Hosts,
    scenario: str,
    port: int,
    per_host: int = 2,
    per_rank: dict[int, dict[str, str]] | None = None,
    **extra: str,
) -> list[Rank]:
    """``2 * per_host`` ranks of ``scenario`` started without a launcher (rank 0 hosts the
    store on 10.77.0.1), the first ``per_host`` on host a; ``per_rank`` adds variables."""
    world = 2 * per_host
    procs = []
    for rank in range(world):
        host = "a" if rank < per_host else "b"
        env = _env(
            host,
            MASTER_ADDR=hosts.addr("a"),
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank % per_host),
            LOCAL_WORLD_SIZE=str(per_host),
            **extra,
            **(per_rank or {}).get(rank, {}),
        )
        procs.append(hosts.popen(host, f"rank{rank}", ["-u", WORKER, scenario], env))
    return procs


def _launchers(hosts: Hosts, args: list[str], port: int, secret_b: str = SECRET) -> list[Rank]:
    """``shardline run --nnodes 2`` on each host (2 ranks each), master on host a."""
    procs = []
    for node, host in enumerate("ab"):
        cmd = ["-m", "shardline", "run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "2", "--master-addr", hosts.addr("a"), "--master-port",
               str(port), *args]  # fmt: skip
        env = _env(host, **({"SHARDLINE_SECRET": secret_b} if host == "b" else {}))
        procs.append(hosts.popen(host, f"node{node}", cmd, env))
    return procs


def _failures(procs: list[Rank]) -> dict[str, list[tuple[float, str, str]]]:
    return {
        p.name: [(float(t), kind, msg) for t, kind, msg in FAILED.findall(p.out)] for p in procs
    }


# Above the test's own wait for its processes, so that a hang ends in its report of every rank,
# not in pytest's global limit (120 s), which stops the whole run without one.
@pytest.mark.timeout(460)
def test_main_job_across_two_hosts_matches_one_process(hosts: Hosts) -> None:
    """The README's main job under ``shardline run`` on two hosts x 2 ranks: its verify step
    replays the same global batches in one process and must find the same model."""
    procs = _launchers(hosts, ["-m", "shardline.examples.train", "--steps", "30"], free_port())
    hung = hosts.wait(procs, timeout=400)
    text = hosts.report(procs)
    assert not hung and all(p.rc == 0 for p in procs), text
    verify = re.search(r"verify: .* held-out loss ([0-9.]+) \(difference ([0-9.e+-]+)\) -> (.*)",
                       procs[0].out)  # fmt: skip
    assert verify and verify.group(3).strip() == "same model", text


@pytest.mark.timeout(300)  # above its wait (see the test above)
def test_ddp_and_zero3_across_two_hosts_match_one_process(hosts: Hosts) -> None:
    procs = _ranks(hosts, "strategies_vs_single", free_port())
    hung = hosts.wait(procs, timeout=240)
    text = hosts.report(procs)
    assert not hung and all(p.rc == 0 for p in procs), text
    for p in procs:
        assert "MATCH ddp" in p.out and "MATCH zero3" in p.out, text


def test_wrong_secret_on_one_host_fails_both_within_5_s(hosts: Hosts) -> None:
    """Host b's launcher hands its ranks another secret: both launchers stop within 5 s of
    each other, each reporting its rank's AuthenticationError and what to check."""
    procs = _launchers(hosts, ["-m", "shardline.examples.train"], free_port(), secret_b="wrong")
    ended: dict[str, float] = {}
    deadline = time.monotonic() + 120
    while len(ended) < len(procs) and time.monotonic() < deadline:
        for p in procs:
            if p.name not in ended and p.rc is not None:
                ended[p.name] = time.time()
        time.sleep(0.05)
    hung = hosts.wait(procs, timeout=1)
    text = hosts.report(procs)
    assert not hung and all(p.rc not in (0, None) for p in procs), text
    for p in procs:
        said = p.out + p.err
        assert "AuthenticationError" in said and "SHARDLINE_SECRET" in said, text
    print(f"launchers ended {abs(ended['node0'] - ended['node1']):.2f} s apart")
    assert abs(ended["node0"] - ended["node1"]) < 5.0, (ended, text)


def test_link_cut_mid_training_is_peer_lost_within_the_keepalive_bound(hosts: Hosts) -> None:
    """Host b's link goes down while 2 + 2 ranks all-reduce (deadline 120 s, keep-alive 3 s):
    every rank raises PeerLostError within the keep-alive bound, naming a rank of the other
    host, and a host's own ranks stop with it."""
    procs = _ranks(hosts, "all_reduce_loop", free_port(), SHARDLINE_KEEPALIVE=str(KEEPALIVE_S))
    deadline = time.monotonic() + 120
    while not all("STEP 20" in p.out for p in procs):
        assert time.monotonic() < deadline and all(p.rc is None for p in procs), hosts.report()
        time.sleep(0.2)
    cut_at = time.time()
    hosts.cut()
    hung = hosts.wait(procs, timeout=60)
    text = hosts.report(procs)
    assert not hung, text
    failed = _failures(procs)
    for rank, p in enumerate(procs):
        assert failed[p.name], text
        when, kind, message = failed[p.name][0]
        assert kind == "PeerLostError", text
        others = "[23]" if rank < 2 else "[01]"
        assert re.search(rf"rank {others} \(10\.77\.0\.\d+:\d+\) stopped answering", message), text
        print(f"rank {rank}: {kind} {when - cut_at:.2f} s after the cut: {message}")
        # The bound plus the probe interval, and a second for a busy machine.
        assert when - cut_at < KEEPALIVE_S + KEEPALIVE_S / 6 + 1.0, (rank, when - cut_at, text)


@pytest.mark.parametrize("hosts", ["abc"], indirect=True, ids=["stranger"])
def test_garbage_and_port_scan_from_a_third_host_leave_the_job_unharmed(hosts: Hosts) -> None:
    """Host c attacks every port that opens on host a, the moment it opens, while the job
    starts and while it trains (making a new group every 25 steps): connections that close at
    once, send garbage, claim a huge frame, or stay open and silent. Rank listeners (open
    while ranks link) and the store are hit; every attack is refused and the job finishes
    with every result checked."""
    procs = _ranks(
        hosts, "all_reduce_loop", free_port(), WORKER_STEPS="200", WORKER_NEW_GROUP_EVERY="25"
    )
    scanner = hosts.popen("c", "scanner", ["-u", "-c", _SCANNER, hosts.addr("a")], _env("c"), True)
    stdin = getattr(scanner.proc, "stdin", None)
    assert stdin is not None
    seen: set[int] = set()
    deadline = time.monotonic() + 120
    while any(p.rc is None for p in procs) and time.monotonic() < deadline:
        fresh = [port for port in hosts.listening_ports("a") if port not in seen]
        if fresh:
            seen.update(fresh)
            stdin.write("".join(f"{port}\n" for port in fresh).encode())
            stdin.flush()
        time.sleep(0.005)
    stdin.close()
    hung = hosts.wait([*procs, scanner], timeout=60)
    text = hosts.report()
    assert not hung and scanner.rc == 0, text
    hit = {int(port) for port in re.findall(r"HIT (\d+)", scanner.out)}
    assert len(hit) >= 2, f"the store and at least one rank listener must be hit: {hit}\n{text}"
    assert all(p.rc == 0 and "OK" in p.out for p in procs), text


_SCANNER = """
import os, socket, sys, time
host, silent = sys.argv[1], []
for line in sys.stdin:
    port = int(line)
    try:
        for kind in ("silent", "garbage", "header", "close"):
            s = socket.create_connection((host, port), timeout=5)
            if kind == "garbage":
                s.sendall(os.urandom(4096))
            elif kind == "header":  # a frame header claiming an enormous payload
                s.sendall(b"SHLN" + b"\\xff" * 60)
            if kind == "silent":
                silent.append(s)
            else:
                s.close()
        print("HIT", port, flush=True)
    except OSError as exc:  # the listener closed before the attack: linking was done
        print("MISSED", port, exc, flush=True)
for s in silent:
    s.close()
"""


def test_namespaces_are_cleaned_up() -> None:
    """After a ``Hosts`` closes, its namespaces are gone (links go with them)."""
    h = Hosts("abc").open()
    names = [h.switch, *(h.ns(x) for x in "abc")]
    h.popen("a", "sleeper", ["-c", "import time; time.sleep(60)"], _env("a"))
    assert not h.close()
    listed = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, check=True
    ).stdout
    assert not any(n in listed.split() for n in names), listed
    assert all(p.rc is not None for p in h.procs)
