"""What tracing costs one process's ZeRO-3 steps: the tracer on and off, blocks alternated.

Separate runs of a short GPU job drift by more than the 1 % being measured (a run's step time
moved 25-39 ms on an H200 between runs of the same command). Here one process (world size 1)
trains ``bench_zero.py``'s GPT under ZeRO-3 and starts and stops the tracer between blocks
of ``--steps`` steps, alternating which side goes first, so both sides see the same drift;
it prints each side's median step time and ``on / off - 1``.

    python benches/bench_trace_blocks.py --device cuda              # medium GPT, bf16
    python benches/bench_trace_blocks.py --device cpu --size small --dtype fp32

Writes ``benches/results/trace-blocks-<tag>.{txt,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _report
import torch
from bench_zero import SIZES

import shardline as sl
from shardline.comm.trace import device as device_times
from shardline.comm.trace.recorder import TRACER
from shardline.examples.train import Config, TinyGPT


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--size", default="medium", choices=list(SIZES))
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--blocks", type=int, default=8, help="blocks per side")
    p.add_argument("--steps", type=int, default=20, help="steps per block")
    p.add_argument("--tag", default=None)
    args = p.parse_args(argv)
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"}.items():  # fmt: skip
        os.environ.setdefault(k, v)
    os.environ.pop("SHARDLINE_TRACE", None)  # the blocks say when it traces
    cuda = args.device == "cuda"
    if cuda:
        # What ``sl.init(trace=...)`` does for its NCCL groups, here for the whole run (the
        # tracer comes and goes between blocks): NCCL records a start event per op, so both
        # sides carry that one event record; the "on" blocks add our event and the reading.
        device_times.enable_nccl_timing()
    group = sl.init(backend="nccl" if cuda else "native")
    d_model, layers, heads, seq_len, batch = SIZES[args.size]
    cfg = Config(d_model=d_model, num_layers=layers, num_heads=heads, seq_len=seq_len)
    torch.manual_seed(0)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    model = TinyGPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    precision = {}
    if args.dtype == "bf16":
        precision["mixed_precision"] = sl.MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    model, opt = sl.distribute(model, opt, strategy="zero3", **precision)
    assert opt is not None
    x = torch.randint(0, cfg.vocab, (batch, seq_len), device=device)
    y = torch.randint(0, cfg.vocab, (batch, seq_len), device=device)

    def block(n: int) -> float:
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            model(x, y).backward()
            opt.step()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t) / n * 1e3

    block(5)  # warm-up
    res: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.blocks):
            for side in ("off", "on") if i % 2 == 0 else ("on", "off"):
                if side == "on":
                    TRACER.start(f"{tmp}/t", rank=0, world_size=1, backend=group.backend)
                res[side].append(block(args.steps))
                if side == "on":
                    TRACER.stop()
        with open(f"{tmp}/t/rank0.trace.jsonl") as f:
            written = [json.loads(line) for line in f]
    records = len(written)
    on_gpu = sum(1 for e in written if "d" in e)
    sl.shutdown()
    a, b = statistics.median(res["off"]), statistics.median(res["on"])
    # Each block against the other side's block beside it: drift between pairs cancels.
    paired = statistics.median(on / off - 1 for on, off in zip(res["on"], res["off"], strict=True))
    lines = [
        f"zero3, 1 process, {args.device}, {args.size} GPT {args.dtype}, {args.blocks} blocks of "
        f"{args.steps} steps per side, alternated",
        f"tracing off: {a:.2f} ms/step (median; blocks {[round(v, 2) for v in res['off']]})",
        f"tracing on:  {b:.2f} ms/step (median; blocks {[round(v, 2) for v in res['on']]})",
        f"overhead: {b / a - 1:+.2%} (on / off - 1; bar 1 %); median of the pairs' ratios "
        f"{paired:+.2%}",
        f"{records} timeline lines written in the last block, {on_gpu} ops with GPU times",
    ]
    tag = args.tag or f"{args.device}-{args.size}-{args.dtype}"
    _report.publish(
        _report.RESULTS / f"trace-blocks-{tag}",
        _report.header(Path(__file__).name, _report.machine(args.device)),
        "\n".join(lines),
        {"args": vars(args), **res, "overhead": b / a - 1, "paired_overhead": paired},
        lambda _path: "no plot: two numbers",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
