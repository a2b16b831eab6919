"""The commit protocol under failures and readers: a checkpoint is there whole or not at all.

Oracles: what a reader finds at each step of a save (a spy on the commit's directory fsyncs,
where rank 0 has written ``COMMIT`` and renames), each rank's error text and how soon it
came, and the state loaded back against the model's.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardline as sl
from shardline import checkpoint
from shardline.checkpoint import _store, api
from shardline.comm import ProcessGroup
from shardline.errors import CheckpointError
from tests._ranks import run_ranks
from tests._zero import make
from tests.test_checkpoint import full_state

pytestmark = pytest.mark.usefixtures("native")


def same(model: nn.Module, path: Path) -> bool:
    """Whether the checkpoint at ``path`` loads back ``model``'s state, bit for bit."""
    loaded = make(seed=9)
    checkpoint.load(path, model=loaded)
    return all(torch.equal(v, loaded.state_dict()[k]) for k, v in full_state(model).items())


def test_a_failed_async_save_fails_once_and_the_next_save_goes_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save that failed in the background (here a full disk) raises through its handle;
    the process's later saves are not failed by it. An error nobody took with ``wait()``
    is a warning at the next save, which still saves."""
    real = api.write_rank
    full = [True]

    def write_rank(*args: Any, **kwargs: Any) -> Any:
        if full[0]:
            full[0] = False
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "write_rank", write_rank)
    model = make()
    handle = checkpoint.save(tmp_path / "a", model=model, async_=True)
    with pytest.raises(OSError, match="No space left"):
        handle.wait()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # taken: nothing to say
        assert checkpoint.save(tmp_path / "b", model=model).wait() == tmp_path / "b"
    full[0] = True
    checkpoint.save(tmp_path / "c", model=model, async_=True)  # fails; nobody waits for it
    with pytest.warns(RuntimeWarning, match=r"save to \S+/c failed .*No space left"):
        checkpoint.save(tmp_path / "d", model=model)
    for name in ("b", "d"):
        loaded = make(seed=9)
        checkpoint.load(tmp_path / name, model=loaded)
        assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in full_state(model).items())
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()


def test_a_failure_marker_is_read_whole_or_not_at_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank polling for another's failure must never read its marker half written: it
    would say that rank failed without saying why."""
    partial, final = tmp_path / "ck.partial", tmp_path / "ck"
    partial.mkdir()
    seen: list[str | None] = []
    real = Path.write_text

    def write_text(self: Path, data: str, *args: Any, **kwargs: Any) -> int:
        self.touch()  # the file exists, its text not yet written: a poller may look now
        try:
            _store.raise_if_failed(partial, final)
            seen.append(None)
        except CheckpointError as exc:
            seen.append(str(exc))
        return real(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    _store.mark_failed(partial, 1, "OSError: [Errno 28] No space left on device")
    monkeypatch.undo()
    assert seen == [None]
    with pytest.raises(CheckpointError, match=r"rank 1 failed: OSError: \[Errno 28\] No space"):
        _store.raise_if_failed(partial, final)


def test_a_rank_0_that_failed_fast_and_saves_again_strands_no_other_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0's disk is full at once, rank 1 still writes its shard; rank 0 saves again.

    Rank 1 learns of rank 0's failure as soon as its shard is written (not at the group's
    deadline, for the failure rank 0 left was not cleared away by its next save), and the
    second save commits on both ranks."""
    real = api.write_rank
    calls = {0: 0, 1: 0}

    def write_rank(directory: Path, rank: int, *args: Any, **kwargs: Any) -> Any:
        calls[rank] += 1
        if calls[rank] == 1 and rank == 0:
            raise OSError(28, "No space left on device")
        if calls[rank] == 1:
            time.sleep(1.0)  # rank 1's shard takes longer
        return real(directory, rank, *args, **kwargs)

    monkeypatch.setattr(api, "write_rank", write_rank)
    torch.manual_seed(0)
    model = nn.Linear(8, 8)

    def body(g: ProcessGroup) -> list[str]:
        said = []
        for _ in range(2):
            t0 = time.monotonic()
            try:
                checkpoint.save(tmp_path / "last", model=model, group=g)
                said.append("saved")
                break
            except (OSError, CheckpointError) as exc:
                said.append(f"{time.monotonic() - t0:.1f} s: {exc}")
        return said

    first, second = run_ranks(2, body, timeout=60, op_timeout=10)
    assert "No space left" in first[0] and first[1] == "saved", first
    took, text = second[0].split(" s: ", 1)
    assert "rank 0 failed: OSError: [Errno 28] No space left" in text, second
    assert float(took) < 5.0, second  # within its shard's 1 s, not the 10 s deadline
    assert second[1] == "saved", second
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last"]


def test_latest_never_returns_a_save_in_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At every directory fsync of a commit (``COMMIT`` written, renames before or after),
    ``latest`` names a committed checkpoint by its own name, which loads."""
    first, second = make(seed=1), make(seed=2)
    checkpoint.save(tmp_path / "step1", model=first, extra={"step": 1})
    seen: list[Path | None] = []
    real = _store._fsync_dir

    def spy(path: Path) -> None:
        seen.append(checkpoint.latest(tmp_path))
        real(path)

    monkeypatch.setattr(_store, "_fsync_dir", spy)
    checkpoint.save(tmp_path / "step2", model=second, extra={"step": 2})  # a new name
    checkpoint.save(tmp_path / "step2", model=second, extra={"step": 3})  # saved over
    monkeypatch.undo()
    assert len(seen) >= 4 and all(p is not None for p in seen), seen
    assert {p.name for p in seen if p is not None} <= {"step1", "step2"}, seen
    assert seen[0] == tmp_path / "step1" and seen[-1] == tmp_path / "step2"
    for p in {p for p in seen if p is not None}:
        assert same(first if p.name == "step1" else second, p)


@pytest.mark.parametrize("exchange", [True, False], ids=["swapped", "two-renames"])
def test_saving_over_a_checkpoint_always_leaves_one_under_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    """Saved over, ``path`` is swapped for the new checkpoint in one step (or, where the
    filesystem cannot, renamed aside first); afterwards only ``path`` is left."""
    real_exchange = _store._exchange
    swapped: list[bool] = []

    def exchange_or_not(a: Path, b: Path) -> bool:
        swapped.append(real_exchange(a, b) if exchange else False)
        return swapped[-1]

    monkeypatch.setattr(_store, "_exchange", exchange_or_not)
    old, new = make(seed=1), make(seed=2)
    checkpoint.save(tmp_path / "ck", model=old)
    names: list[list[str]] = []
    real = _store._fsync_dir

    def spy(path: Path) -> None:
        names.append(sorted(p.name for p in tmp_path.iterdir() if _store.is_committed(p)))
        real(path)

    monkeypatch.setattr(_store, "_fsync_dir", spy)
    checkpoint.save(tmp_path / "ck", model=new)
    monkeypatch.setattr(_store, "_fsync_dir", real)
    # Before the swap ck (old) and the working folder, after it ck (new) and the old one
    # under the working folder's name (or path.old-<nonce>), then that one deleted.
    if exchange and swapped != [True]:
        pytest.skip(f"{tmp_path}'s filesystem cannot swap two names in one step")
    assert swapped == [exchange]
    assert all("ck" in n for n in names), names
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert same(new, tmp_path / "ck")


def test_an_unreadable_index_is_passed_over_with_a_warning(tmp_path: Path) -> None:
    """A folder whose ``index.json`` was cut short (a full disk) hides no other checkpoint
    from ``latest`` and fails no ``keep_last`` rotation after a save has committed."""
    model = make()
    checkpoint.save(tmp_path / "s1", model=model, extra={"step": 1})
    checkpoint.save(tmp_path / "s2", model=model, extra={"step": 2})
    (tmp_path / "s2" / "index.json").write_text('{"step": 2, "crea')
    with pytest.warns(RuntimeWarning, match=r"s2/index.json is unreadable \(JSONDecodeError"):
        assert checkpoint.latest(tmp_path) == tmp_path / "s1"
    with pytest.warns(RuntimeWarning, match="s2/index.json is unreadable"):
        checkpoint.save(tmp_path / "s3", model=model, extra={"step": 3}, keep_last=1)
    # s1 rotated out; s2, whose age cannot be read, is left as it is
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s2", "s3"]
    assert same(model, tmp_path / "s3")


def test_consolidate_and_info_hold_the_model_not_a_ranks_own_values(tmp_path: Path) -> None:
    """DDP with compression keeps each rank's residuals (``Local`` values) in the checkpoint;
    the exported model is the plain model's state dict, which loads strictly."""

    def mlp() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

    def body(g: ProcessGroup) -> None:
        net = mlp()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        model, opt = sl.distribute(net, opt, strategy="ddp", group=g, compression="int8")
        opt.zero_grad()
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        checkpoint.save(tmp_path / "ck", model=model, optimizer=opt, group=g)

    run_ranks(2, body, timeout=60)
    with _store.Checkpoint(tmp_path / "ck") as ck:
        assert any("#rank1" in k for k in ck.tensors)  # the residuals are there
    checkpoint.consolidate(tmp_path / "ck", tmp_path / "hf")
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    plain = mlp()
    assert sorted(exported) == sorted(plain.state_dict())
    plain.load_state_dict(exported)  # strict
    assert checkpoint.info(tmp_path / "ck")["model_tensors"] == 4
