"""The main job (``shardline.examples.train``) as a pipeline, as ZeRO-3 replicas of one
(``--pp 2`` on 4 processes), as DDP replicas of 2-way tensor parallelism (``--tp 2``), and
as a pipeline of tensor-parallel stages (``--pp 2 --tp 2``), under ``shardline run``.

Its verify step replays the same batches in one process (TinyGPT, whose output layer shares
the token embedding: the first and last stages hold copies of one tied weight) and must find
the same model.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.multiprocess._launch import PYTHONPATH

pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("native")]


@pytest.mark.parametrize(
    ("nproc", "args", "says"),
    [
        # (1f1b runs in the mesh layouts below; a plain pipeline's schedule is only its name
        # passed on, so one schedule here covers that path. Each case costs CI ~17 s.)
        (2, ["--strategy", "pp", "--schedule", "zero_bubble"], "2-stage zero_bubble pipeline"),
        (4, ["--strategy", "zero3", "--pp", "2"], "2 zero3 replicas of a 2-stage 1f1b pipeline"),
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
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "SHARDLINE_TIMEOUT": "60"}
    cmd = [sys.executable, "-m", "shardline", "run", "--nproc-per-node", str(nproc), "-m",
           "shardline.examples.train", *args, "--steps", "10"]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, check=False)
    text = f"rc={done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert done.returncode == 0, text
    assert says in done.stdout, text
    verify = re.search(r"verify: .* \(difference ([0-9.e+-]+)\) -> (.*)", done.stdout)
    assert verify and verify.group(2).strip() == "same model", text
