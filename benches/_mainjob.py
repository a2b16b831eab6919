"""The main job as a benchmark's subject: one run's tokens/s, and runs of two sides alternated.

``shardline run --nproc-per-node N -m shardline.examples.train`` on its built-in model, with
``--no-verify``; a run's tokens/s is the job's own summary line.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(r"summary: \d+ steps, ([\d,]+) tokens/s")


def tokens_per_s(
    nproc: int,
    steps: int,
    strategy: str,
    device: str,
    *,
    env: Mapping[str, str] | None = None,
    flags: Sequence[str] = (),
) -> float:
    """Tokens/s of one main-job run, with ``env`` added to this environment and ``flags``."""
    full = {**os.environ, "PYTHONPATH": str(ROOT / "python"), **(env or {})}
    cmd = [sys.executable, "-m", "shardline", "run", "--nproc-per-node", str(nproc),
           "-m", "shardline.examples.train", "--no-verify", "--steps", str(steps),
           "--strategy", strategy, "--device", device, *flags]  # fmt: skip
    out = subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=900, check=False)
    m = SUMMARY.search(out.stdout)
    if out.returncode != 0 or m is None:
        raise SystemExit(f"the main job failed (rc {out.returncode}):\n{out.stdout}\n{out.stderr}")
    return float(m.group(1).replace(",", ""))


def alternate(pairs: int, sides: Mapping[str, Callable[[int], float]]) -> dict[str, list[float]]:
    """``pairs`` runs of each side (called with the pair's index), the order flipped each pair.

    Each run's result is also printed as it comes (to stderr), so that a bench stopped by a
    time limit still shows the runs it finished.
    """
    names = list(sides)
    got: dict[str, list[float]] = {n: [] for n in names}
    for i in range(pairs):
        for name in names if i % 2 == 0 else names[::-1]:
            got[name].append(sides[name](i))
            print(f"pair {i + 1}/{pairs}: {name} {got[name][-1]:,.1f}", file=sys.stderr, flush=True)
    return got
