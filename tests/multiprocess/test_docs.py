"""Every code block of the README and of the docs site (``docs/``) runs, as a user would run it.

A block is run as its page says, by an HTML comment on the line before its fence:

- a ``python`` block with no comment runs as ``python block.py`` (one process: world size 1);
- ``<!-- test: ranks=N -->`` runs it under ``shardline run --nproc-per-node N``;
- ``loss-falls`` (with it) also checks that the losses it prints fall (the first against the
  last ``loss <number>``);
- ``<!-- test: run -->`` runs a ``bash`` block with ``bash -e`` in a fresh folder;
- ``<!-- test: skip: <reason> -->`` skips it, and the reason must say where that behaviour is
  tested or why it cannot run here (a reason of at least a few words is required).

A page may hold hidden set-up code, ``<!-- test-setup`` ... ``-->``, that runs before each of
its later ``python`` blocks: the objects a fragment names (a model, an optimizer, a batch).
``text`` blocks are output and are not run; a ``bash`` block without a comment fails this test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.multiprocess._launch import PYTHONPATH

pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("native")]

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
_TEST = re.compile(r"^\s*<!-- test: (.*?) -->\s*$")


@dataclass
class Block:
    """One fenced code block of a page and how the page says to run it."""

    page: Path
    line: int
    lang: str
    code: str
    setup: str
    how: str

    @property
    def name(self) -> str:
        """``page:line``, the test's id."""
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The code blocks of ``page``, each with the set-up code above it and its test comment."""
    lines = page.read_text().split("\n")
    found: list[Block] = []
    setup, i = "", 0
    while i < len(lines):
        if lines[i].strip() == "<!-- test-setup":
            end = lines.index("-->", i)
            setup = "\n".join(lines[i + 1 : end])
            i = end + 1
            continue
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, lang = fence.group(1), fence.group(2)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        code = "\n".join(line.removeprefix(indent) for line in lines[i + 1 : end])
        comment = _TEST.match(lines[i - 1]) if i else None
        found.append(Block(page, i + 1, lang, code, setup, comment.group(1) if comment else ""))
        i = end + 1
    return found


ALL = [b for page in PAGES for b in blocks(page) if b.lang != "text"]
# A block that repeats an earlier one (the README's quick start is also the getting-started
# page's) runs once: same code, same set-up, run the same way.
FIRST: dict[tuple[str, str, str, str], Block] = {}
for _b in ALL:
    FIRST.setdefault((_b.lang, _b.code, _b.setup, _b.how), _b)


def test_the_pages_hold_code_blocks() -> None:
    # A parser that finds nothing would make every other test of this file vanish.
    assert len(ALL) >= 20, [b.name for b in ALL]
    assert {b.page.name for b in ALL} >= {"README.md", "getting-started.md", "zero.md"}


def _run(block: Block, tmp: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "SHARDLINE_TIMEOUT": "60"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    if block.lang == "bash":
        cmd = ["bash", "-e", "-c", block.code]
    else:
        script = tmp / "block.py"
        script.write_text(f"{block.setup}\n{block.code}\n" if block.setup else block.code)
        ranks = re.search(r"ranks=(\d+)", block.how)
        cmd = [sys.executable, str(script)]
        if ranks:
            cmd = [sys.executable, "-m", "shardline", "run", "--nproc-per-node", ranks.group(1),
                   str(script)]  # fmt: skip
    return subprocess.run(
        cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=150, check=False
    )


@pytest.mark.parametrize("block", ALL, ids=lambda b: b.name)
@pytest.mark.timeout(200)  # above the run's own 150 s, so a hang reports its output
def test_the_code_block_runs(block: Block, tmp_path: Path) -> None:
    if block.how.startswith("skip:"):
        reason = block.how.removeprefix("skip:").strip()
        assert len(reason.split()) >= 4, f"{block.name}: say why it is skipped"
        pytest.skip(reason)
    first = FIRST[(block.lang, block.code, block.setup, block.how)]
    if first is not block:
        pytest.skip(f"the same block as {first.name}, which runs")
    if block.lang == "bash":
        assert block.how == "run", f"{block.name}: a bash block needs <!-- test: run --> or skip"
    else:
        assert block.lang == "python", f"{block.name}: unknown language {block.lang!r}"
    done = _run(block, tmp_path)
    text = f"{block.name}: rc={done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert done.returncode == 0, text
    if "loss-falls" in block.how:
        losses = [float(x) for x in re.findall(r"loss[ :=]+([0-9.]+)", done.stdout)]
        assert len(losses) >= 2, text
        assert losses[-1] < losses[0], text
