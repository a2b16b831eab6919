"""One settings table: every ``SHARDLINE_*`` variable declared once, checked by name.

The oracle for the docs' settings page is the table itself; for the code, a scan of every
source file for the variable names it mentions, and a walk of the package's syntax trees for
reads of ``os.environ`` (only ``shardline.config`` reads the environment).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from shardline import config
from shardline.errors import InvalidArgumentError

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "python" / "shardline"
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
        ("SHARDLINE_TIMEOUT", "1e9", 1e9),
        ("SHARDLINE_KEEPALIVE", "0", 0.0),
        ("SHARDLINE_SPIN_US", str(2**31 - 1), 2**31 - 1),
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
        # Past these the clocks and integers below overflowed, far from the setting's name
        ("SHARDLINE_TIMEOUT", "inf", "must be a number of seconds from 0.001 to 1e+09"),
        ("SHARDLINE_TIMEOUT", "1e10", "must be a number of seconds from 0.001 to 1e+09"),
        ("SHARDLINE_TIMEOUT", "1e-7", "must be a number of seconds from 0.001 to 1e+09"),
        ("SHARDLINE_TRACE_INTERVAL", "inf", "must be a number of seconds from 0.001 to 1e+09"),
        (
            "SHARDLINE_KEEPALIVE",
            "1e308",
            "must be a number of seconds from 0.001 to 1e+09, 0 for off",
        ),
        (
            "SHARDLINE_KEEPALIVE",
            "nan",
            "must be a number of seconds from 0.001 to 1e+09, 0 for off",
        ),
        (
            "SHARDLINE_SPIN_US",
            str(10**23),
            "must be an integer of at least 0 (microseconds), at most 2147483647",
        ),
        (
            "SHARDLINE_ONESHOT_BYTES",
            str(2**63),
            f"must be an integer of at least 0 (bytes), at most {2**48}",
        ),
    ],
)
def test_a_bad_value_is_refused_by_name(name: str, text: str, rule: str) -> None:
    with pytest.raises(InvalidArgumentError, match=re.escape(f"{name}={text!r} {rule}")):
        config.get(name, {name: text})


def test_an_undeclared_name_is_a_programming_error() -> None:
    with pytest.raises(KeyError, match=r"not declared in shardline\.config\.SETTINGS"):
        config.get("SHARDLINE_" + "NOPE", {})


# -- who reads the environment -------------------------------------------------------------------

# os.environ's methods that only write.
_WRITES = {"update", "pop", "popitem", "clear", "__setitem__", "__delitem__"}
# (file under python/shardline, function): why it may use ``os.environ`` whole. Only code that
# builds a child process's environment from the launcher's belongs here; what it reads of that
# mapping goes through shardline.config's accessors (which take the mapping).
ENVIRON_WHOLE = {
    ("launch/config.py", "worker_env"): "copies the launcher's environment into a worker's "
    "(subprocess.Popen(env=...)): every variable is passed on, none is read here",
    ("launch/launcher.py", "launch"): "the launcher's environment, which its workers inherit: "
    "handed whole to worker_env, and to config.raw/get(name, env) for the secret",
}


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _function(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> str:
    """The name of the function ``node`` sits in (``<module>`` at the top level)."""
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return node.name
    return "<module>"


def _environ_reads(path: Path) -> list[tuple[int, str, str]]:
    """``(line, function, code)`` of each read of the environment in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    parents = _parents(tree)
    os_names = {"os"} | {
        a.asname or a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.Import)
        for a in n.names
        if a.name == "os"
    }
    found: list[ast.Attribute | ast.ImportFrom] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            # `from os import environ` would hide the reads from this walk
            found += [node] if {a.name for a in node.names} & {"environ", "getenv"} else []
            continue
        if not (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in os_names
            and node.attr in ("environ", "environb", "getenv", "getenvb")
        ):
            continue
        up = parents.get(node)
        if node.attr.startswith("environ"):
            if isinstance(up, ast.Subscript) and isinstance(up.ctx, ast.Store | ast.Del):
                continue  # os.environ[k] = v, del os.environ[k]
            if (
                isinstance(up, ast.Attribute)
                and up.attr in _WRITES
                and isinstance(parents.get(up), ast.Call)
                and parents[up].func is up  # type: ignore[attr-defined]
            ):
                continue  # os.environ.update({...}), os.environ.pop(k)
        found.append(node)
    return [(n.lineno, _function(n, parents), ast.unparse(parents.get(n, n))) for n in found]


def test_only_config_reads_the_environment() -> None:
    """An AST walk: no ``os.environ[...]``, ``.get``, ``in``, ``getenv`` outside config.py.

    Writes (``os.environ.update``, ``os.environ[k] = v``) are fine; passing ``os.environ``
    whole is allowed only where ``ENVIRON_WHOLE`` says why.
    """
    offenders, used = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if where == "config.py":
            continue
        for line, function, code in _environ_reads(path):
            if (where, function) in ENVIRON_WHOLE and "os.environ if " in code:
                used.add((where, function))
                continue
            offenders.append(f"{where}:{line} in {function}(): {code}")
    assert not offenders, (
        "read the environment through shardline.config (get/raw for SHARDLINE_*, env_var for "
        "a launcher's variables):\n" + "\n".join(offenders)
    )
    assert used == set(ENVIRON_WHOLE), f"stale ENVIRON_WHOLE entries: {set(ENVIRON_WHOLE) - used}"


def test_the_walk_catches_every_kind_of_read(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "import os\n"
        "import os as system\n"
        "def f(env=None):\n"
        "    a = os.environ['RANK']\n"
        "    b = os.environ.get('RANK', '0')\n"
        "    c = 'RANK' in os.environ\n"
        "    d = os.getenv('RANK')\n"
        "    e = system.environ.get('RANK')\n"
        "    g = os.environ if env is None else env\n"
        "    os.environ['RANK'] = '1'\n"
        "    os.environ.update({'RANK': '1'})\n"
        "    os.environ.pop('RANK', None)\n"
        "    del os.environ['RANK']\n"
    )
    lines = sorted(line for line, _, _ in _environ_reads(source))
    assert lines == [4, 5, 6, 7, 8, 9]


def test_launcher_variables_are_read_by_declared_name() -> None:
    env = {"LOCAL_RANK": "3", "MASTER_ADDR": ""}
    assert config.env_var("LOCAL_RANK", env) == "3"
    assert config.env_var("MASTER_ADDR", env) == ""  # as set: the caller decides what "" means
    assert config.env_var("RANK", env) is None
    assert config.env_var("RANK", env, default="0") == "0"
    assert config.env_required("LOCAL_RANK", env) == "3"
    with pytest.raises(KeyError, match="MASTER_PORT"):
        config.env_required("MASTER_PORT", env)
    with pytest.raises(KeyError, match="not a launcher variable"):
        config.env_var("HOME", env)
    with pytest.raises(KeyError, match="get/raw"):
        config.env_var("SHARDLINE_TIMEOUT", env)


def test_every_launcher_variable_the_code_reads_is_declared() -> None:
    read: dict[str, str] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("env_var", "env_required")
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                read.setdefault(str(node.args[0].value), str(path.relative_to(ROOT)))
    assert read, "no launcher variable read through config.env_var: is the scan broken?"
    undeclared = {n: where for n, where in read.items() if n not in config.LAUNCHER_VARIABLES}
    assert not undeclared, f"declare these in config.LAUNCHER_VARIABLES: {undeclared}"


def test_the_default_timeout_is_shardline_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHARDLINE_TIMEOUT", raising=False)
    assert config.default_timeout() == 300.0
    monkeypatch.setenv("SHARDLINE_TIMEOUT", "7.5")
    assert config.default_timeout() == 7.5
