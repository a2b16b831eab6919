"""No rank waits out its deadline for a peer that already failed; a slow peer is not lost.

Ranks are started without our launcher (plain env://, rank 0 hosts the store, as under
srun or a scheduler), with a deadline (``SHARDLINE_TIMEOUT=120``) far beyond what the tests
allow: a rank that fails while joining, or a secret refused by the handshake, must stop every
other rank within 5 s, each saying why. Ranks with different ``SHARDLINE_HOST_ID`` talk over
TCP on loopback. The two-host versions, across network namespaces, are in ``test_hosts.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.multiprocess._launch import Rank, finish, report, start

pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("native")]

WORKER = Path(__file__).with_name("_liveness_worker.py")
FAILED = re.compile(r"^FAILED ([0-9.]+) (\w+): (.*)$", re.MULTILINE)
BOUND_S = 5.0  # the bar: every rank stops within 5 s of the first failure
SLOW_DEADLINE = {"SHARDLINE_TIMEOUT": "120"}


def failures(ranks: list[Rank]) -> dict[int, tuple[float, str, str]]:
    """Each failed rank's (unix time, error class, message), from its ``FAILED`` line."""
    found = {}
    for r in ranks:
        m = FAILED.search(r.out)
        if m:
            found[r.rank] = (float(m.group(1)), m.group(2), m.group(3))
    return found


def test_a_rank_failing_to_join_stops_the_others_within_5_s() -> None:
    """Ranks 2 and 3 fail in init (they were given another backend than rank 0 uses), after
    the store is open; ranks 0 and 1 are already linking and waiting for them."""
    wrong = {"SHARDLINE_BACKEND": "gloo"}
    ranks = finish(
        start(4, "join", env=SLOW_DEADLINE, per_rank={2: wrong, 3: wrong}, worker=WORKER),
        timeout=90,
    )
    text = report(ranks)
    got = failures(ranks)
    assert sorted(got) == [0, 1, 2, 3] and all(r.rc == 1 for r in ranks), text
    for r in (2, 3):
        assert got[r][1] == "ShardlineError" and "backend 'gloo'" in got[r][2], text
    first = min(got[2][0], got[3][0])
    for r in (0, 1):
        when, kind, message = got[r]
        assert kind == "PeerLostError", text
        assert re.search(r"rank [23] failed while joining the job", message), text
        assert "backend 'gloo' but rank 0 uses 'native'" in message, text
        print(f"rank {r}: {kind} {when - first:.2f} s after the first failure")
        assert when - first < BOUND_S, f"rank {r} stopped {when - first:.1f} s late\n{text}"


def test_a_wrong_secret_fails_both_sides_within_5_s() -> None:
    """Rank 1 holds another secret: rank 0's handshake refuses it, and rank 1, which only
    saw its connection dropped, learns why from the store."""
    ranks = finish(
        start(
            2,
            "join",
            env={**SLOW_DEADLINE, "SHARDLINE_SECRET": "right"},
            per_rank={
                0: {"SHARDLINE_HOST_ID": "host-a"},
                1: {"SHARDLINE_HOST_ID": "host-b", "SHARDLINE_SECRET": "wrong"},
            },
            worker=WORKER,
        ),
        timeout=90,
    )
    text = report(ranks)
    got = failures(ranks)
    assert sorted(got) == [0, 1], text
    for r in (0, 1):
        assert got[r][1] == "AuthenticationError", text
        assert "SHARDLINE_SECRET" in got[r][2], text
    assert "rank 0 failed while joining the job" in got[1][2], text
    print(f"both sides failed {abs(got[1][0] - got[0][0]):.3f} s apart")
    assert abs(got[1][0] - got[0][0]) < BOUND_S, text


def test_a_slow_peer_is_not_lost() -> None:
    """The last rank computes for 3.5x the keep-alive bound while the others wait for it in
    an all-reduce over TCP: its host answers the keep-alive, so nobody loses it."""
    ranks = finish(
        start(
            2,
            "slow_peer",
            env={
                **SLOW_DEADLINE,
                "SHARDLINE_SECRET": "s",
                "SHARDLINE_KEEPALIVE": "1",
                "WORKER_SLOW_S": "3.5",
            },
            per_rank={r: {"SHARDLINE_HOST_ID": f"host-{r}"} for r in range(2)},
            worker=WORKER,
        ),
        timeout=90,
    )
    text = report(ranks)
    assert all(r.rc == 0 and "OK" in r.out for r in ranks), text


def test_a_killed_pipeline_stage_is_peer_lost_on_the_others() -> None:
    """The last stage of a 2-stage pipeline is SIGKILLed mid-training: the first stage raises
    PeerLostError naming it, long before the deadline."""
    ranks = finish(start(2, "pipeline_kill", env=SLOW_DEADLINE, worker=WORKER), timeout=90)
    text = report(ranks)
    got = failures(ranks)
    assert ranks[1].rc == -9 and 0 in got, text
    _, kind, message = got[0]
    assert kind == "PeerLostError" and "rank 1" in message, text
    last = max(int(s) for s in re.findall(r"STEP (\d+)", ranks[0].out))
    assert last >= 3, text
