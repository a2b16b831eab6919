"""Progress lines of long checkpoint saves and loads (``shardline._progress``)."""

from __future__ import annotations

import io
import time
from pathlib import Path

import pytest
import torch

from shardline import checkpoint
from shardline._progress import Progress, wanted
from shardline.errors import CheckpointError
from tests._zero import adamw, make

pytestmark = pytest.mark.usefixtures("native")


class Tty(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_a_log_gets_the_first_line_each_quarter_and_the_end() -> None:
    out = io.StringIO()
    bar = Progress("job", 100, delay=0.0, stream=out)
    for n in (30, 10, 20, 30, 5):  # 30 40 60 90 95
        bar.add(n)
    bar.close()
    lines = out.getvalue().splitlines()
    assert [line.split("]")[1].split()[0] for line in lines] == ["30%", "60%", "90%", "100%"]
    assert lines[-1].startswith("job [########################] 100% 0.00 GB of 0.00 GB")
    assert " in " in lines[-1] and "left" not in lines[-1]


def test_nothing_is_shown_before_the_delay_or_when_disabled() -> None:
    out = io.StringIO()
    bar = Progress("job", 100, delay=60.0, stream=out)
    bar.add(100)
    bar.close()
    off = Progress("job", 100, enabled=False, delay=0.0, stream=out)
    off.add(50)
    off.close()
    assert out.getvalue() == ""


def test_a_terminal_is_redrawn_in_place_and_a_failure_says_so() -> None:
    out = Tty()
    bar = Progress("job", 1000, delay=0.0, stream=out)
    bar.add(250)
    bar.close(ok=False)
    text = out.getvalue()
    assert text.startswith("\rjob [######..................]  25%")
    assert text.endswith("-- failed\n") and text.count("\r") == 2


def test_polled_progress_without_a_total_shows_bytes() -> None:
    out = io.StringIO()
    sizes = iter(range(1, 10**6))
    bar = Progress(
        "save", None, delay=0.0, stream=out, poll=lambda: next(sizes) * 10**9, interval=0.01
    )
    deadline = time.monotonic() + 10
    while "GB" not in out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)
    bar.close()
    first, last = out.getvalue().splitlines()[0], out.getvalue().splitlines()[-1]
    assert first.startswith("save: ") and "GB/s" in first and "[" not in first
    assert last.endswith(" s"), last


def test_who_shows_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHARDLINE_PROGRESS", raising=False)
    assert wanted(None, 0) == (True, 2.0) and wanted(None, 1) == (False, 2.0)
    assert wanted(True, 3) == (True, 0.0) and wanted(False, 0) == (False, 0.0)
    monkeypatch.setenv("SHARDLINE_PROGRESS", "0")
    assert wanted(None, 0)[0] is False and wanted(True, 0)[0] is True
    monkeypatch.setenv("SHARDLINE_PROGRESS", "1")
    assert wanted(None, 5) == (True, 0.0)


def test_save_and_load_report_their_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make()
    opt = adamw(list(model.named_parameters()))
    checkpoint.save(tmp_path / "ck", model=model, optimizer=opt, progress=True)
    save_err = capsys.readouterr().err
    assert save_err.startswith(f"checkpoint save {tmp_path / 'ck'} [")
    assert "100%" in save_err.splitlines()[-1]
    model2 = make()
    nbytes = sum(v.numel() * v.element_size() for v in model2.state_dict().values())
    checkpoint.load(tmp_path / "ck", model=model2, progress=True)
    last = capsys.readouterr().err.splitlines()[-1]
    assert f"100% {nbytes / 1e9:.2f} GB of {nbytes / 1e9:.2f} GB" in last, last
    checkpoint.save(tmp_path / "quiet", model=model)  # short: under the delay, nothing
    checkpoint.load(tmp_path / "quiet", model=model2)
    assert capsys.readouterr().err == ""


def test_a_failed_load_ends_its_line_as_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint.save(tmp_path / "ck", model=make())
    shard = next((tmp_path / "ck").glob("rank*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=shard.name):
        checkpoint.load(tmp_path / "ck", model=make(), progress=True)
    assert capsys.readouterr().err.rstrip().endswith("-- failed")


def test_a_mismatched_optimizer_is_refused_before_the_model_is_touched(tmp_path: Path) -> None:
    model = make()
    opt = adamw(list(model.named_parameters()))
    checkpoint.save(tmp_path / "ck", model=model, optimizer=opt)
    model2 = make(seed=1)
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    one_group = torch.optim.AdamW(model2.parameters())
    one_group.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})
    with pytest.raises(CheckpointError, match="param group"):
        checkpoint.load(tmp_path / "ck", model=model2, optimizer=one_group)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed by a refused load"


def test_a_failure_after_the_last_quarter_is_still_reported() -> None:
    out = io.StringIO()
    bar = Progress("job", 100, delay=0.0, stream=out)
    bar.add(100)
    bar.close(ok=False)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[-1].endswith("-- failed"), lines


def test_a_shorter_line_blanks_the_rest_of_the_longer_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = Tty()
    bar = Progress("job", 100, delay=0.0, stream=out)
    texts = iter(["x" * 50, "y" * 10])
    monkeypatch.setattr(bar, "line", lambda failed=False: next(texts))
    bar.add(10)
    bar.close()
    assert out.getvalue() == "\r" + "x" * 50 + "\r" + "y" * 10 + " " * 40 + "\n"
