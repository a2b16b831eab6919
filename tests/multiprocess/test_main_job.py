"""The main job (``shardline.examples.train``) as a pipeline, as ZeRO-3 replicas of one
(``--pp 2`` on 4 processes), as DDP replicas of 2-way tensor parallelism (``--tp 2``), and
as a pipeline of tensor-parallel stages (``--pp 2 --tp 2``), and in deterministic mode (DDP,
ZeRO-3, a pipeline, tensor parallelism, both), under ``shardline run``.

Its verify step replays the same batches in one process (TinyGPT, whose output layer shares
the token embedding: the first and last stages hold copies of one tied weight) and must find
the same model: for a pipeline, bit for bit (the replay sums as the stages do), through the loss
spike of a 16-sequence run. With lossy gradient compression it must find that the run trained
(top-k stays on the byte-frequency plateau for 150 steps, and passes), and a codec that
delivers nothing must fail.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from shardline.examples.train import compressed_verdict
from tests.multiprocess._launch import PYTHONPATH

pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("native")]
VERIFY = re.compile(r"verify: .* \(difference ([0-9.e+-]+)\) -> (.*)")


def _main_job(nproc: int, args: list[str], script: str | None = None) -> tuple[int, str]:
    """Runs the main job (or ``script``) under ``shardline run``; its exit code and output."""
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "SHARDLINE_TIMEOUT": "60"}
    target = [script] if script else ["-m", "shardline.examples.train"]
    cmd = [sys.executable, "-m", "shardline", "run", "--nproc-per-node", str(nproc), *target,
           *args]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, check=False)
    return done.returncode, f"rc={done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"


@pytest.mark.parametrize(
    ("nproc", "args", "says"),
    [
        # (1f1b runs in the mesh layouts below, and 1f1b and interleaved (two chunks per
        # rank) in the bit-for-bit test; other schedules are only a name passed on. Each case
        # costs CI ~17 s.)
        (2, ["--strategy", "pp", "--schedule", "zero_bubble"], "2-stage zero_bubble pipeline"),
        (  # in repeatable mode (on the mesh's axes; its bits are this layout's: "same model")
            4,
            ["--strategy", "zero3", "--pp", "2", "--deterministic", "repeat"],
            "2 zero3 replicas of a 2-stage 1f1b pipeline",
        ),
        (4, ["--tp", "2"], "2 ddp replica(s) of 2-way tensor parallelism"),
        (
            4,
            ["--strategy", "pp", "--pp", "2", "--tp", "2"],
            "a 2-stage 1f1b pipeline of 2-way tensor-parallel stages",
        ),
    ],
)
@pytest.mark.timeout(300)  # above the run's own 240 s, so a hang reports its output
def test_the_main_job_trains_as_a_pipeline_and_matches_one_process(
    nproc: int, args: list[str], says: str
) -> None:
    rc, text = _main_job(nproc, [*args, "--steps", "10"])
    assert rc == 0, text
    assert says in text, text
    verify = VERIFY.search(text)
    assert verify and verify.group(2).strip() == "same model", text


@pytest.mark.parametrize(
    ("nproc", "layout"),
    [
        (2, ["--strategy", "ddp"]),
        (2, ["--strategy", "zero3"]),
        (2, ["--strategy", "pp"]),
        (2, ["--tp", "2"]),
        (4, ["--pp", "2", "--tp", "2"]),
    ],
    ids=["ddp", "zero3", "pp", "tp2", "pp2-tp2"],
)
@pytest.mark.timeout(300)
def test_deterministic_mode_ends_with_one_process_bits(nproc: int, layout: list[str]) -> None:
    """``--deterministic``: the replay in one process sums in the same tree; exactly equal.

    A pipeline too: one process trains on the whole batch at once (not as the stages do);
    and tensor parallelism, alone or in a pipeline's stages, whose split sums one process
    cuts into the same 2 blocks.
    """
    rc, text = _main_job(nproc, [*layout, "--deterministic", "--steps", "20"])
    assert rc == 0, text
    verify = VERIFY.search(text)
    assert verify and verify.group(2).strip() == "the same bits", text
    assert float(verify.group(1)) == 0.0, text


@pytest.mark.timeout(300)
def test_microbatch_mode_ends_with_its_replays_bits() -> None:
    """``--deterministic microbatch``: each process's batch one micro-batch, on the model's
    own kernels; the replay runs them one after another in one process, added in the tree."""
    rc, text = _main_job(2, ["--strategy", "zero3", "--deterministic", "microbatch",
                             "--steps", "20"])  # fmt: skip
    assert rc == 0, text
    verify = VERIFY.search(text)
    assert verify and verify.group(2).strip() == "the same bits", text
    assert float(verify.group(1)) == 0.0, text


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
@pytest.mark.timeout(300)  # above the run's own 240 s, so a hang reports its output
def test_a_pipeline_matches_its_replay_bit_for_bit_through_a_loss_spike(schedule: str) -> None:
    # 2 x 8 = 16 sequences a step: this run spikes at step 44 (gradient norm ~9, ~0.5 around
    # it), where any difference in rounding grows a thousandfold; a replay that took the batch
    # whole, or summed the tied weight's gradients in one tensor, was 4e-3 to 1e-2 off by step
    # 50 and bit-different from the first steps. (Interleaved needs two chunks per rank.)
    rc, text = _main_job(2, ["--strategy", "pp", "--schedule", schedule, "--batch-size", "8",
                             "--steps", "60"])  # fmt: skip
    assert rc == 0, text
    assert f"2-stage {schedule} pipeline" in text, text
    assert "1 x 16 x 64 tokens" in text, text
    verify = VERIFY.search(text)
    assert verify and verify.group(2).strip() == "same model", text
    assert float(verify.group(1)) == 0.0, text


@pytest.mark.timeout(300)
def test_a_lossy_codec_that_stalls_on_the_plateau_still_trained() -> None:
    # Top-k (1%) never leaves the byte-frequency plateau in 150 steps (+34% vs one process);
    # its verdict says so and passes: the gap after 150 steps is when a run leaves the
    # plateau, which compression moves either way (see compressed_verdict).
    rc, text = _main_job(2, ["--compression", "topk"])
    assert rc == 0, text
    verify = VERIFY.search(text)
    assert verify, text
    assert verify.group(2).startswith("trained with topk compression to the byte-frequency "
                                      "plateau only"), text  # fmt: skip
    assert "replicas equal" in verify.group(2), text


@pytest.mark.timeout(300)
def test_a_codec_that_delivers_nothing_fails_its_verify() -> None:
    script = os.path.join(os.path.dirname(__file__), "_silent_codec_job.py")
    rc, text = _main_job(2, ["--steps", "40"], script=script)
    assert rc == 1, text
    verify = VERIFY.search(text)
    assert verify and verify.group(2).startswith("DID NOT TRAIN with silent compression"), text


@pytest.mark.parametrize(
    ("final", "same", "ok", "says"),
    [
        (2.10, True, True, "past the byte-frequency plateau"),
        (2.85, True, True, "to the byte-frequency plateau only"),
        (3.20, True, False, "DID NOT TRAIN"),
        (float("nan"), True, False, "DID NOT TRAIN"),
        (2.10, False, False, "REPLICAS DIFFER"),
    ],
)
def test_the_compressed_verdict(final: float, same: bool, ok: bool, says: str) -> None:
    got, words = compressed_verdict("int8 compression", final, 2.0957, 2.8147, same)
    assert got is ok
    assert says in words
