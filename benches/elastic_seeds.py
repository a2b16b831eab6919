"""The elastic kill test over many seeds: does every run finish with the right parameters?

Runs ``tests/multiprocess/test_elastic.py``'s kill -9 scenario (4 simulated nodes of one
ZeRO-2 worker each under ``shardline run --nnodes 1:4 --max-restarts 3``; a random rank kills
itself at a random step; the final parameters must equal a one-process run at the sizes the
job had, on the same data order) for seeds ``0 .. --seeds - 1``, and reports each seed's
outcome, time and ``/dev/shm`` leftovers. The test suite runs seed 1 (``ELASTIC_SEEDS=0,1,2``
runs others).

    python benches/elastic_seeds.py --seeds 20

Writes ``benches/results/elastic-seeds-<tag>.txt``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE.parent))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--tag", default="cpu")
    args = p.parse_args(argv)

    import _report  # noqa: PLC0415
    from tests.multiprocess import test_elastic as t  # noqa: PLC0415

    rows, failed = [], 0
    for seed in range(args.seeds):
        before = set(os.listdir("/dev/shm"))
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f"shardline-seed{seed}-") as tmp:
            try:
                t.test_a_killed_rank_is_replaced_and_training_ends_as_at_the_sizes_it_ran(
                    seed, Path(tmp), None
                )
                outcome = "ok"
            except Exception as exc:  # reported, then the next seed
                outcome = f"FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                traceback.print_exc()
                failed += 1
        left = [n for n in set(os.listdir("/dev/shm")) - before if "shardline" in n]
        row = f"seed {seed:2d}: {outcome} ({time.monotonic() - start:.1f} s" + (
            f", left in /dev/shm: {left})" if left else ")"
        )
        print(row, flush=True)
        rows.append(row)
    rows.append(f"{args.seeds - failed} of {args.seeds} seeds passed")
    head = _report.header("elastic_seeds.py", _report.machine())
    text = "\n".join(rows)
    out = HERE.parent / "results" / f"elastic-seeds-{args.tag}.txt"
    out.write_text(head + "\n" + text + "\n")
    print(text.splitlines()[-1])
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
