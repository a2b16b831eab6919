"""One settings table: every ``SHARDLINE_*`` variable declared once, checked by name.

The oracle for the docs' settings page is the table itself; for the code, a scan of every
source file for the variable names it mentions.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shardline import config
from shardline.errors import InvalidArgumentError

ROOT = Path(__file__).resolve().parents[1]
# Names that look like settings but are not environment variables.
NOT_SETTINGS = {"SHARDLINE_ZSTD"}  # the dtype tag of compressed tensors in shard files


def test_the_settings_page_is_the_declared_table() -> None:
    readme = (ROOT / "docs" / "settings.md").read_text()
    match = re.search(
        r"<!-- settings table: .*? -->\n(.*?)\n<!-- end of settings table -->", readme, re.S
    )
    assert match, "docs/settings.md lost its settings table markers"
    assert match.group(1).strip() == config.markdown_table()


def test_every_variable_the_code_names_is_declared() -> None:
    sources = [
        *(ROOT / "python").rglob("*.py"),
        *(ROOT / "rust" / "src").rglob("*.rs"),
        *(ROOT / "tests").rglob("*.py"),
        ROOT / ".ci" / "run",
    ]
    named: dict[str, str] = {}
    for path in sources:
        for name in re.findall(r"SHARDLINE_[A-Z0-9_]+[A-Z0-9]", path.read_text()):
            named.setdefault(name, str(path.relative_to(ROOT)))
    declared = {s.name for s in config.SETTINGS}
    undeclared = {n: where for n, where in named.items() if n not in declared | NOT_SETTINGS}
    assert not undeclared, f"declare these in shardline/config.py: {undeclared}"


def test_python_reads_settings_only_through_config() -> None:
    """No ``os.environ`` / ``getenv`` read of a ``SHARDLINE_*`` name outside config.py."""
    reads = re.compile(r"(environ(\.get)?\(|environ\[|getenv\()\s*[\"']SHARDLINE_")
    offenders = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "python").rglob("*.py")
        if path.name != "config.py" and reads.search(path.read_text())
    ]
    assert not offenders


@pytest.mark.parametrize(
    ("name", "text", "value"),
    [
        ("SHARDLINE_TIMEOUT", "2.5", 2.5),
        ("SHARDLINE_TIMEOUT", None, 300.0),
        ("SHARDLINE_COMM_THREADS", " 3 ", 3),
        ("SHARDLINE_COMM_THREADS", "", None),
        ("SHARDLINE_BACKEND", "GLOO", "gloo"),
        ("SHARDLINE_DEVICE", "cuda:1", "cuda:1"),
        ("SHARDLINE_INSECURE", "1", True),
        ("SHARDLINE_INSECURE", None, False),
        ("SHARDLINE_STREAM_STORES", "0", "0"),
        ("SHARDLINE_SECRET", " keep blanks ", " keep blanks "),
    ],
)
def test_values_parse_with_their_defaults(name: str, text: str | None, value: object) -> None:
    env = {} if text is None else {name: text}
    assert config.get(name, env) == value


@pytest.mark.parametrize(
    ("name", "text", "rule"),
    [
        ("SHARDLINE_TIMEOUT", "soon", "is not a number of seconds"),
        ("SHARDLINE_TIMEOUT", "-1", "must be a positive number of seconds"),
        ("SHARDLINE_COMM_THREADS", "0", "must be an integer of at least 1"),
        ("SHARDLINE_SHM_SLOT_BYTES", "1k", "must be an integer of at least 4096"),
        ("SHARDLINE_BACKEND", "tcp", "is not a backend; use one of native, gloo, nccl, mpi"),
        ("SHARDLINE_DEVICE", "gpu", "is not a device"),
        ("SHARDLINE_INSECURE", "yes", "must be 1 (on) or 0 (off)"),
        ("SHARDLINE_STREAM_STORES", "3", "is not a streaming-store mode"),
    ],
)
def test_a_bad_value_is_refused_by_name(name: str, text: str, rule: str) -> None:
    with pytest.raises(InvalidArgumentError, match=re.escape(f"{name}={text!r} {rule}")):
        config.get(name, {name: text})


def test_an_undeclared_name_is_a_programming_error() -> None:
    with pytest.raises(KeyError, match=r"not declared in shardline\.config\.SETTINGS"):
        config.get("SHARDLINE_" + "NOPE", {})
