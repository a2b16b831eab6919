"""The torch.distributed backend "shardline" against Gloo, the oracle: same calls, same results.

Each test runs real processes (``tests/multiprocess/_conformance_worker.py``) on 3 ranks whose
default group is Gloo; every check runs once on a Gloo group and once on a "shardline" group of
the same ranks, with the same inputs, and the outputs must be equal. One test per behaviour
PyTorch's own distributed suite found missing or wrong: the layout of list-shaped collectives
(``all_gather_coalesced`` returned a transposed result), tagged messages, receives from any
source, ``monitored_barrier``, the words of a barrier's timeout, sparse all-reduce.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiprocess._launch import report, run

pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("native")]

WORKER = Path(__file__).parent / "multiprocess" / "_conformance_worker.py"
RANKS = 3


def _check(case: str, timeout: float = 120) -> None:
    ranks = run(RANKS, case, timeout=timeout, worker=WORKER, env={"SHARDLINE_TIMEOUT": "60"})
    assert all("OK" in r.out for r in ranks), report(ranks)


def test_list_shaped_collectives_lay_out_their_outputs_as_gloo_does() -> None:
    """all_gather_coalesced fills one list per rank (it was one list per input), and every
    other list-shaped or flat entry point matches Gloo too."""
    _check("shapes")


def test_tagged_messages_are_received_by_tag_as_with_gloo() -> None:
    _check("tags")


def test_a_receive_from_any_source_names_its_sender_as_with_gloo() -> None:
    _check("any_source")


def test_monitored_barrier_names_the_ranks_that_did_not_arrive_as_gloo_does() -> None:
    _check("monitored")


def test_a_barrier_timeout_says_so_in_the_words_torch_looks_for() -> None:
    ranks = run(RANKS, "barrier_timeout", timeout=120, worker=WORKER)
    lines = [line for line in ranks[0].out.splitlines() if line.startswith("TIMEOUT")]
    assert [line.split()[1] for line in lines] == ["gloo", "shardline"], report(ranks)
    assert all("OK" in r.out for r in ranks), report(ranks)


def test_sparse_all_reduce_sums_as_gloo_does() -> None:
    _check("sparse")
