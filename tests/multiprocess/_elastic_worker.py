"""The training script of the elastic tests, run by ``shardline run --nnodes MIN:MAX``.

One script for every process: the first ones, replacements and newcomers. A small MLP trains
with AdamW on a fixed dataset through ``sl.DistributedSampler``, ``WORKER_BATCH`` samples per
rank per step, committing after every step. Rank 0 logs each committed step and the world size
it ran at (``log.jsonl`` in ``WORKER_DIR``; a redone step is logged again), so the test can
train the same steps at the same sizes in one process and compare. At the end rank 0 writes
the full parameters (``final.pt``).

Settings (environment):
    WORKER_DIR: where the log, the final parameters and checkpoints go.
    WORKER_STRATEGY: ``ddp``, ``zero1``, ``zero2`` or ``zero3``.
    WORKER_STEPS: steps to train.
    WORKER_KILL: ``<slot>@<step>``: the first process of that slot kills itself (SIGKILL)
        once that step is committed, as ``kill -9`` would.
    WORKER_SAVE_EVERY: write a checkpoint (``state.save()``) every that many steps.
    WORKER_STEP_SLEEP: seconds to sleep per step (gives a test time to act).
    WORKER_SLOW_BELOW: ``<ranks>:<seconds>``: sleep that long per step instead while the job
        has fewer ranks (a newcomer's start-up then fits in the steps left, however slow the
        machine).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn

import shardline as sl
from shardline.comm import world

N_SAMPLES = 4096
IN, HIDDEN, OUT = 8, 32, 4


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(N_SAMPLES, IN, generator=g)
    w = torch.randn(IN, OUT, generator=g)
    return x, torch.tanh(x @ w)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, OUT))  # fmt: skip


def optimizer(params: object) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)  # type: ignore[arg-type]


def main() -> None:
    out = Path(os.environ["WORKER_DIR"])
    strategy = os.environ.get("WORKER_STRATEGY", "zero2")
    steps = int(os.environ.get("WORKER_STEPS", "30"))
    batch = int(os.environ.get("WORKER_BATCH", "8"))
    kill = os.environ.get("WORKER_KILL", "")
    save_every = int(os.environ.get("WORKER_SAVE_EVERY", "0"))
    pause = float(os.environ.get("WORKER_STEP_SLEEP", "0"))
    below, slow = (os.environ.get("WORKER_SLOW_BELOW") or "0:0").split(":")
    sl.init()
    place = world.elastic_slot()
    assert place is not None, "run me under shardline run --nnodes MIN:MAX"
    slot, first = place[0], place[1] == 0
    x, y = data()
    plain = model()
    net, opt = sl.distribute(plain, optimizer(plain.parameters()), strategy=strategy)
    sampler = sl.DistributedSampler(N_SAMPLES, shuffle=True, seed=0)
    state = sl.elastic.State(model=net, optimizer=opt, sampler=sampler, step=0,
                             checkpoint_dir=out / "ckpt" if save_every else None)  # fmt: skip

    def changed(old: int, new: int) -> None:
        print(f"on_change {old} -> {new} at step {state.step}", flush=True)

    @sl.elastic.run(on_change=changed)
    def train(state: sl.elastic.State) -> None:
        it = iter(sampler)
        while state.step < steps:
            idx = torch.tensor([next(it) for _ in range(batch)])
            loss = nn.functional.mse_loss(net(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            state.step += 1
            if save_every and state.step % save_every == 0:
                state.save()
            # Logged before the commit: a commit that sees a new member raises once it is made
            # (a step whose commit fails is redone, and logged again).
            if sl.get_rank() == 0:
                with open(out / "log.jsonl", "a") as f:
                    f.write(json.dumps({"step": state.step, "world": sl.get_world_size()}) + "\n")
            state.commit()
            if kill and first and kill == f"{slot}@{state.step}":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(float(slow) if sl.get_world_size() < int(below) else pause)

    train(state)
    full = net.state_dict() if strategy != "ddp" else net.module.state_dict()
    if sl.get_rank() == 0:
        torch.save({k: v.detach().clone() for k, v in full.items()}, out / "final.pt")
    sl.shutdown()


if __name__ == "__main__":
    main()
