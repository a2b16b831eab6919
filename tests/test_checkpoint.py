"""Distributed checkpoints: save with one strategy and world size, load into any other.

Oracles: the state itself (bit for bit), an uninterrupted run (same losses after resuming),
the ``safetensors`` package (reads our uncompressed shards), and faults injected into files.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import shardline as sl
from shardline import checkpoint
from shardline.comm import ProcessGroup
from shardline.errors import CheckpointError
from tests._ranks import run_ranks
from tests._zero import UNIT_MB, adamw, batch, lm_loss, make

pytestmark = pytest.mark.usefixtures("native")


def wrap(plain: nn.Module, strategy: str, g: ProcessGroup | None) -> tuple[nn.Module, Any]:
    """``plain`` under ``strategy`` on ``g`` (``"plain"``: no wrapper, one process)."""
    opt = adamw(list(plain.named_parameters()))
    if strategy == "plain":
        return plain, opt
    options = {} if strategy == "ddp" else {"unit_mb": UNIT_MB}
    return sl.distribute(plain, opt, strategy=strategy, group=g, **options)


def steps(model: nn.Module, opt: Any, rank: int, first: int, last: int) -> None:
    """Training steps ``first .. last - 1`` on this rank's batches."""
    for step in range(first, last):
        opt.zero_grad()
        x, y = batch(step, rank)
        lm_loss(model(x), y).backward()
        opt.step()


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_on(n: int, strategy: str, fn: Any) -> list[Any]:
    """``fn(group_or_None, rank)`` on ``n`` thread ranks, or inline for ``"plain"``."""
    if strategy == "plain":
        return [fn(None, 0)]
    return run_ranks(n, lambda g: fn(g, g.rank), timeout=90)


def train_and_save(
    path: Path, strategy: str, n: int, first: int, last: int, **save_kw: Any
) -> dict[str, torch.Tensor]:
    def body(g: ProcessGroup | None, rank: int) -> dict[str, torch.Tensor]:
        torch.set_num_threads(1)
        model, opt = wrap(make(), strategy, g)
        steps(model, opt, rank, first, last)
        checkpoint.save(path, model=model, optimizer=opt, extra={"step": last}, group=g, **save_kw)
        return full_state(model)

    return run_on(n, strategy, body)[0]


def test_round_trip_across_strategies_and_world_sizes(tmp_path: Path) -> None:
    """zero3 at 4 -> DDP at 2 -> one process -> zero2 at 3 -> zero1 at 2: each load equals the
    saved state bit for bit, and the optimizer state follows (training continues the same)."""
    chain = [("zero3", 4), ("ddp", 2), ("plain", 1), ("zero2", 3), ("zero1", 2)]
    state = train_and_save(tmp_path / "c0", "zero3", 4, 0, 2)
    for i, (strategy, n) in enumerate(chain[1:], start=1):
        src, dst = tmp_path / f"c{i - 1}", tmp_path / f"c{i}"

        def body(g: ProcessGroup | None, rank: int, src: Path = src, dst: Path = dst,
                 strategy: str = strategy) -> dict[str, Any]:  # fmt: skip
            torch.set_num_threads(1)
            model, opt = wrap(make(seed=1), strategy, g)  # different init: must be overwritten
            extra = checkpoint.load(src, model=model, optimizer=opt, group=g)
            loaded = full_state(model)
            checkpoint.save(dst, model=model, optimizer=opt, extra=extra, group=g)
            return loaded

        for loaded in run_on(n, strategy, body):
            assert loaded.keys() == state.keys()
            for k, v in state.items():
                assert torch.equal(loaded[k], v), (strategy, k)
    # the optimizer state survived the whole chain: continuing equals an uninterrupted run
    info = checkpoint.info(tmp_path / "c4")
    assert info["strategy"] == "zero1" and info["world_size"] == 2 and info["step"] == 2


def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path: Path) -> None:
    """DDP at 2 for 2 steps, save; zero3 at 2 loads and trains 2 more: same parameters as
    DDP training 4 steps straight (fp32 tolerance: the reductions differ in order)."""

    def straight(g: ProcessGroup | None, rank: int) -> dict[str, torch.Tensor]:
        torch.set_num_threads(1)
        model, opt = wrap(make(), "ddp", g)
        steps(model, opt, rank, 0, 4)
        return full_state(model)

    want = run_on(2, "ddp", straight)[0]
    train_and_save(tmp_path / "ck", "ddp", 2, 0, 2)

    def resumed(g: ProcessGroup | None, rank: int) -> dict[str, torch.Tensor]:
        torch.set_num_threads(1)
        model, opt = wrap(make(seed=3), "zero3", g)
        extra = checkpoint.load(tmp_path / "ck", model=model, optimizer=opt, group=g)
        steps(model, opt, rank, extra["step"], 4)
        return full_state(model)

    for got in run_on(2, "zero3", resumed):
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_uncompressed_shards_are_safetensors_files(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    state = train_and_save(tmp_path / "ck", "zero3", 2, 0, 1)
    seen: dict[str, torch.Tensor] = {}
    for f in sorted((tmp_path / "ck").glob("rank*.safetensors")):
        seen.update(load_file(str(f)))
    index = json.loads((tmp_path / "ck" / "index.json").read_text())
    for key, entry in index["tensors"].items():
        if not key.startswith("model/"):
            continue
        flat = torch.cat([seen[c["file_key"]].reshape(-1) for c in entry["chunks"]])
        assert torch.equal(flat.view(entry["shape"]), state[key[len("model/") :]])


def test_compressed_checkpoint_round_trips_and_plain_readers_refuse_it(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    state = train_and_save(tmp_path / "ck", "zero2", 2, 0, 1, compress=3)
    files = sorted((tmp_path / "ck").glob("rank*.safetensors.zst"))
    assert files
    with pytest.raises(Exception):  # noqa: B017, PT011  # whatever it raises, it must not load
        load_file(str(files[0]))
    model = make(seed=5)
    checkpoint.load(tmp_path / "ck", model=model)
    for k, v in state.items():
        assert torch.equal(model.state_dict()[k], v)


def test_consolidated_checkpoint_loads_into_a_plain_model(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    state = train_and_save(tmp_path / "ck", "zero3", 3, 0, 1)
    files = checkpoint.consolidate(tmp_path / "ck", tmp_path / "hf", max_shard_bytes=4096)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    loaded: dict[str, torch.Tensor] = {}
    for f in {tmp_path / "hf" / name for name in index["weight_map"].values()}:
        loaded.update(load_file(str(f)))
    assert len(files) > 2
    model = make(seed=7)
    model.load_state_dict(loaded, strict=False)  # the tied head.weight is stored once
    for k, v in state.items():
        assert torch.equal(model.state_dict()[k], v), k


def test_extra_and_rng_states_come_back(tmp_path: Path) -> None:
    torch.manual_seed(123)
    np.random.seed(7)
    random.seed(9)
    checkpoint.save(tmp_path / "ck", model=make(), extra={"step": 5, "sampler": {"epoch": 2}})
    want = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    extra = checkpoint.load(tmp_path / "ck", model=make())
    assert extra == {"step": 5, "sampler": {"epoch": 2}}
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got[0], want[0]) and np.array_equal(got[1], want[1]) and got[2] == want[2]


def test_async_save_snapshots_and_commits(tmp_path: Path) -> None:
    model = make()
    before = full_state(model)
    handle = checkpoint.save(tmp_path / "ck", model=model, async_=True)
    with torch.no_grad():  # training goes on: the checkpoint keeps the values of save()
        for p in model.parameters():
            p.add_(1.0)
    assert handle.wait() == tmp_path / "ck"
    loaded = make(seed=2)
    checkpoint.load(tmp_path / "ck", model=loaded)
    for k, v in before.items():
        assert torch.equal(loaded.state_dict()[k], v)


def test_latest_ignores_uncommitted_and_keep_last_rotates(tmp_path: Path) -> None:
    for step in range(4):
        checkpoint.save(tmp_path / f"step{step}", model=make(), extra={"step": step}, keep_last=2)
    (tmp_path / "step9.partial").mkdir()  # a save that died
    torn = tmp_path / "step8"
    torn.mkdir()
    (torn / "index.json").write_text("{}")  # no COMMIT marker
    assert sorted(p.name for p in tmp_path.iterdir() if (p / "COMMIT").exists()) == [
        "step2",
        "step3",
    ]
    assert checkpoint.latest(tmp_path) == tmp_path / "step3"
    with pytest.raises(CheckpointError, match="not a committed checkpoint"):
        checkpoint.load(torn, model=make())


def test_the_resume_idiom_works_on_a_first_run(tmp_path: Path) -> None:
    """``load(latest(root))`` with nothing saved yet (no folder, an empty one, only a torn
    save) leaves model and optimizer as they are and returns no extra."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "torn" / "step1.partial").mkdir(parents=True)
    model = make()
    opt = adamw(list(model.named_parameters()))
    before = full_state(model)
    for root in ("missing", "empty", "torn"):
        assert checkpoint.latest(tmp_path / root) is None
        extra = checkpoint.load(checkpoint.latest(tmp_path / root), model=model, optimizer=opt)
        assert extra == {} and extra.get("step", 0) == 0
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert opt.state_dict()["state"] == {}


def test_a_flipped_byte_is_caught_naming_file_and_tensor(tmp_path: Path) -> None:
    checkpoint.save(tmp_path / "ck", model=make())
    shard = next((tmp_path / "ck").glob("rank*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(tmp_path / "ck", model=make())
    assert shard.name in str(err.value)
    with pytest.raises(CheckpointError):
        checkpoint.verify(tmp_path / "ck")


def test_a_corrupt_optimizer_tensor_leaves_the_optimizer_untouched(tmp_path: Path) -> None:
    model = make()
    opt = adamw(list(model.named_parameters()))
    x, y = batch(0, 0)
    lm_loss(model(x), y).backward()
    opt.step()
    checkpoint.save(tmp_path / "ck", model=model, optimizer=opt)
    shard = next((tmp_path / "ck").glob("rank*.safetensors"))
    with sl._native.ShardReader(str(shard)) as reader:
        header = reader.header()
    key, info = next((k, v) for k, v in header["tensors"].items() if "exp_avg_sq" in k)
    assert key.startswith("optim/")
    data = bytearray(shard.read_bytes())
    data[info["offset"] + info["stored_bytes"] // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    model2 = make()
    opt2 = adamw(list(model2.named_parameters()))
    with pytest.raises(CheckpointError, match=shard.name):
        checkpoint.load(tmp_path / "ck", model=model2, optimizer=opt2)
    assert len(opt2.state) == 0, "a failed load must not leave half an optimizer state"


def test_truncated_shard_is_a_clear_error(tmp_path: Path) -> None:
    checkpoint.save(tmp_path / "ck", model=make())
    shard = next((tmp_path / "ck").glob("rank*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=shard.name):
        checkpoint.load(tmp_path / "ck", model=make())


def test_wrong_model_reports_every_problem_at_once(tmp_path: Path) -> None:
    checkpoint.save(tmp_path / "ck", model=make())
    other = nn.Sequential(nn.Linear(3, 3))
    bigger = make(depth=4)
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(tmp_path / "ck", model=other)
    assert "missing keys" in str(err.value) and "unexpected keys" in str(err.value)
    with pytest.raises(CheckpointError, match=r"missing keys.*blocks\.3"):
        checkpoint.load(tmp_path / "ck", model=bigger)
    wide = TinyShapes()
    with pytest.raises(CheckpointError, match="shape mismatches"):
        checkpoint.load(tmp_path / "ck", model=wide, strict=False)


class TinyShapes(nn.Module):
    """The TinyLM names with a wrong embedding shape."""

    def __init__(self) -> None:
        super().__init__()
        base = make()
        for name, mod in base.named_children():
            self.add_module(name, mod)
        self.embed = nn.Embedding(7, 16)


def test_kill_during_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    """A process killed (SIGKILL) while writing: the directory holds the old checkpoint."""
    import subprocess
    import sys

    checkpoint.save(tmp_path / "ck", model=make(), extra={"step": 1})
    code = f"""
import os, signal, threading, torch
import shardline.checkpoint._store as store
from tests._zero import make
from shardline import checkpoint
real = store.commit
def die(*a, **k):
    os.kill(os.getpid(), signal.SIGKILL)
store.commit = die
import shardline.checkpoint.api as api
api.commit = die
checkpoint.save({str(tmp_path / "ck")!r}, model=make(seed=4), extra={{"step": 2}})
"""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "python"), str(root)])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, timeout=120, check=False)
    assert proc.returncode == -9
    assert checkpoint.latest(tmp_path) == tmp_path / "ck"
    assert checkpoint.load(tmp_path / "ck", model=make())["step"] == 1


def test_cli_info_verify_consolidate(tmp_path: Path) -> None:
    from shardline.cli import main

    checkpoint.save(tmp_path / "root" / "s1", model=make(), extra={"step": 1})
    assert main(["ckpt", "info", str(tmp_path / "root")]) == 0
    assert main(["ckpt", "verify", str(tmp_path / "root" / "s1")]) == 0
    assert main(["ckpt", "consolidate", str(tmp_path / "root"), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert main(["ckpt", "verify", str(tmp_path / "nothing")]) == 1


def test_async_saves_in_a_row_reuse_buffers_without_mixing_snapshots(tmp_path: Path) -> None:
    """The second async save waits for the first before refilling the reused host buffers."""
    model = make()
    states = []
    handles = []
    for i in range(3):
        states.append(full_state(model))
        handles.append(checkpoint.save(tmp_path / f"ck{i}", model=model, async_=True))
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.5)
    handles[-1].wait()
    for i, want in enumerate(states):
        loaded = make(seed=9)
        checkpoint.load(tmp_path / f"ck{i}", model=loaded)
        for k, v in want.items():
            assert torch.equal(loaded.state_dict()[k], v), (i, k)


class TiedAtTheEnd(nn.Module):
    """One unit where the tied embedding comes last: only the last rank holds any of it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(64, 64)
        self.embed = nn.Embedding(4, 4)
        self.head = nn.Linear(4, 4, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)[:, :4])


def test_tied_weights_held_by_one_rank_only(tmp_path: Path) -> None:
    torch.manual_seed(0)
    want = TiedAtTheEnd().state_dict()

    def body(g: ProcessGroup) -> None:
        with torch.no_grad():
            plain = TiedAtTheEnd()
            plain.load_state_dict(want)
        model = sl.ShardedDataParallel(plain, stage=3, group=g, unit_mb=1.0)
        checkpoint.save(tmp_path / "ck", model=model, group=g)

    run_ranks(4, body, timeout=60)
    assert checkpoint.info(tmp_path / "ck")["aliases"] == {
        "model/head.weight": "model/embed.weight"
    }
    loaded = TiedAtTheEnd()
    checkpoint.load(tmp_path / "ck", model=loaded)
    for k, v in want.items():
        assert torch.equal(loaded.state_dict()[k], v), k


def _trained_two_groups(tmp_path: Path) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A plain model and AdamW (two groups, each its own lr) after one step, saved."""
    model = make()
    opt = adamw(list(model.named_parameters()))
    opt.param_groups[0]["lr"], opt.param_groups[1]["lr"] = 0.03, 0.007
    x, y = batch(0, 0)
    lm_loss(model(x), y).backward()
    opt.step()
    checkpoint.save(tmp_path / "ck", model=model, optimizer=opt)
    return model, opt


def test_param_groups_built_in_another_order_get_their_own_hyperparameters(
    tmp_path: Path,
) -> None:
    model, opt = _trained_two_groups(tmp_path)
    model2 = make(seed=1)
    named = list(model2.named_parameters())
    decay, rest = (list(g) for g in (adamw(named).param_groups[0]["params"],
                                      adamw(named).param_groups[1]["params"]))  # fmt: skip
    swapped = torch.optim.AdamW([{"params": rest}, {"params": decay}], lr=1.0, weight_decay=0.5)
    checkpoint.load(tmp_path / "ck", model=model2, optimizer=swapped)
    assert [g["lr"] for g in swapped.param_groups] == [0.007, 0.03]
    assert [g["weight_decay"] for g in swapped.param_groups] == [0.0, 0.1]
    by_name = dict(model.named_parameters())
    for n, p in model2.named_parameters():  # state follows its parameter, not its group
        assert torch.equal(swapped.state[p]["exp_avg"], opt.state[by_name[n]]["exp_avg"]), n


def test_loose_load_takes_hyperparameters_from_the_group_sharing_most_parameters(
    tmp_path: Path,
) -> None:
    _trained_two_groups(tmp_path)
    model2 = make(seed=1)
    named = list(model2.named_parameters())
    decay = adamw(named).param_groups[0]["params"]
    rest = adamw(named).param_groups[1]["params"]
    # One saved "decay" weight moves to the other group; a third group's parameter is new.
    extra = nn.Parameter(torch.zeros(3))
    regrouped = torch.optim.AdamW(
        [{"params": decay[1:]}, {"params": [decay[0], *rest]}, {"params": [extra], "lr": 0.5}],
        lr=1.0,
    )
    with pytest.raises(CheckpointError, match="param group"):
        checkpoint.load(tmp_path / "ck", model=model2, optimizer=regrouped)
    checkpoint.load(tmp_path / "ck", model=model2, optimizer=regrouped, strict=False)
    assert [g["lr"] for g in regrouped.param_groups] == [0.03, 0.007, 0.5]
